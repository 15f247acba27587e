"""``rl doctor``'s checks without a subprocess: a part with no comparable version, boolean flags turned off,
and one CUDA query and one needs() per run."""

from __future__ import annotations

import pytest

from rl_cli import doctor

TRANSFORMERS = doctor._BY_MODULE["transformers"]


@pytest.mark.parametrize("version", ["installed", "local-build+abc", ""])
def test_a_part_without_a_comparable_version_is_reported_as_unknown(monkeypatch, version):
    real = doctor.md.version
    monkeypatch.setattr(doctor.md, "version", lambda dist: version if dist == "transformers" else real(dist))
    monkeypatch.setattr(doctor, "_locked", lambda: {"transformers": "5.0.0"})  # a lock to compare with
    (check,) = doctor.check_parts([TRANSFORMERS], cuda=False)
    assert check.version == f"unknown version ({version})"
    assert check.problem is None and check.fix is None
    assert check.lines()[0].split(None, 1)[1] == f"unknown version ({version})"


def test_a_lock_entry_without_a_comparable_version_is_not_compared(monkeypatch):
    monkeypatch.setattr(doctor, "_locked", lambda: {"transformers": "not a version"})
    (check,) = doctor.check_parts([TRANSFORMERS], cuda=False)
    assert check.problem is None or "uv.lock" not in check.problem


def test_a_lock_pin_unlike_the_installed_version_is_named(monkeypatch):
    monkeypatch.setattr(doctor.md, "version", lambda dist: "5.0.0")
    monkeypatch.setattr(doctor, "_declared", dict)
    monkeypatch.setattr(doctor, "_locked", lambda: {"transformers": "5.1.0"})
    (check,) = doctor.check_parts([TRANSFORMERS], cuda=False)
    assert check.problem == "uv.lock pins 5.1.0"


def _modules(argv):
    return [p.module for p in doctor.needs("sft", argv)]


@pytest.mark.parametrize(
    ("flag", "module"),
    [
        ("use_liger_kernel", "liger_kernel"),
        ("use_mlflow", "mlflow"),
        ("flash_attn", "flash_attn"),
        ("use_wandb", "wandb"),
        ("load_in_4bit", "bitsandbytes"),
        ("ds.load_in_4bit", "bitsandbytes"),
    ],
)
def test_needs_reads_boolean_flags_as_the_parser_does(flag, module):
    for on in (
        [f"--{flag}"],
        [f"--{flag}", "true"],
        [f"--{flag}=1"],
        [f"--{flag}", "--bf16"],
        ["--x", "--" + flag, "yes"],
        [f"--{flag}", "false", f"--{flag}"],
    ):
        assert module in _modules(on), on
    for off in (
        [],
        [f"--{flag}", "false"],
        [f"--{flag}=0"],
        [f"--{flag}", "off", "--bf16"],
        [f"--{flag}", f"--{flag}=no"],
    ):
        assert module not in _modules(off), off


def test_needs_takes_openrlhf_wandb_key_as_on():
    assert "wandb" in _modules(["--use_wandb", "abc123key"])
    assert "wandb" in _modules(["--use_wandb=abc123key"])


def test_check_parts_given_cuda_does_not_ask_torch(monkeypatch):
    monkeypatch.setattr(doctor, "_cuda", lambda: pytest.fail("_cuda called though cuda was given"))
    (check,) = doctor.check_parts([doctor._BY_MODULE["wandb"]], cuda=True)
    assert check.part.module == "wandb"


def test_main_asks_cuda_and_needs_once(monkeypatch, capsys):
    calls = {"cuda": 0, "needs": 0}
    real_needs = doctor.needs

    def cuda():
        calls["cuda"] += 1
        return False

    def needs(command, argv):
        calls["needs"] += 1
        return real_needs(command, argv)

    monkeypatch.setattr(doctor, "_cuda", cuda)
    monkeypatch.setattr(doctor, "needs", needs)
    monkeypatch.setattr(doctor, "check_parts", lambda cuda: [] if cuda is False else pytest.fail(f"cuda={cuda}"))
    assert doctor.main(["sft", "--use_liger_kernel", "false"]) == 0
    assert calls == {"cuda": 1, "needs": 1}
    assert "every part it needs is here (torch, transformers, deepspeed)" in capsys.readouterr().out
