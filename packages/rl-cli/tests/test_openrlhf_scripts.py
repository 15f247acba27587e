"""OpenRLHF's own example scripts, flag for flag, through our parsers with ``--print_config``, and their runs.

rl_cli.openrlhf_examples holds OpenRLHF v0.11.0's examples/scripts/ as data (SCRIPTS) and the overrides that
scale each to this CPU machine (OVERRIDES). For each script the tests assert that every flag is known to our
parser (mapped or refused, never unrecognized), and that ``--print_config`` exits 0, or exits 2 with exactly
the one-line refusal of each blocker in turn, and 0 once the blockers are dropped. scripts/openrlhf_examples.py
runs every script to the end and records the outcome in docs/openrlhf-examples.json; the last tests check that
record is current (the flags and overrides it ran with are today's) and the README table (packages/rl-cli/
README.md, "OpenRLHF's example scripts") against both. The cheapest scripts (sft, rm, dpo) also run to the
end here (marked slow).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rl_cli import openrlhf, serve_rm
from rl_cli.config import build_parser
from rl_cli.main import main
from rl_cli.openrlhf_examples import (
    FEATURES,
    NOT_COMMANDS,
    OVERRIDES,
    SCRIPTS,
    drop,
    record,
    run_argv,
    write_fixtures,
)

README = Path(__file__).resolve().parents[1] / "README.md"
RESULTS = Path(__file__).resolve().parents[3] / "docs" / "openrlhf-examples.json"
RERUN = "rerun: OMP_NUM_THREADS=1 python scripts/openrlhf_examples.py"


@pytest.fixture(scope="module")
def fixtures(tmp_path_factory) -> dict[str, str]:
    return write_fixtures(tmp_path_factory.mktemp("openrlhf_scripts"))


def _parser(command: str):
    if command == "serve-rm":
        return build_parser("rl serve-rm", "", serve_rm._groups())[0]
    return openrlhf.parser_of(command)


def _dry_run(command: str, argv: list[str], capsys) -> tuple[int, str, str]:
    try:
        code = main([command, *argv, "--print_config"])
    except SystemExit as e:
        code = e.code
    out, err = capsys.readouterr()
    return code, out, (err.strip().splitlines() or [""])[-1]


@pytest.mark.parametrize("name", SCRIPTS)
def test_every_flag_of_the_script_is_known(name, fixtures):
    s = SCRIPTS[name]
    known = _parser(s.command)._option_string_actions
    unknown = [a.split("=")[0] for a in s.args(fixtures) if a.startswith("--") and a.split("=")[0] not in known]
    assert not unknown, f"{name}: flags neither mapped nor refused (rl_cli/openrlhf_tables.py): {unknown}"


@pytest.mark.parametrize("name", SCRIPTS)
def test_the_script_prints_its_config_or_is_refused_in_one_line(name, fixtures, capsys, monkeypatch):
    s = SCRIPTS[name]
    monkeypatch.delenv("RL_REWARD_TOKEN", raising=False)
    argv = s.args(fixtures)
    for flag, feature in s.blockers:
        code, _, line = _dry_run(s.command, argv, capsys)
        assert (code, line) == (2, f"rl {s.command}: error: " + FEATURES[feature].format(flag=flag))
        if flag is None:  # not a flag: the server's token, from the environment
            monkeypatch.setenv("RL_REWARD_TOKEN", "secret")
        else:
            argv = drop(argv, flag)
    code, out, line = _dry_run(s.command, argv, capsys)
    assert code == 0, f"{name} (blockers dropped): {line}"
    assert "nothing loaded" in out or s.command == "serve-rm"


def test_openrlhf_checkpoint_flags_bring_its_default_folder(fixtures, capsys):
    """train_sft.sh resumes with --ckpt.load_enable and no --ckpt.path: OpenRLHF's ./ckpt/checkpoints_sft."""
    argv = SCRIPTS["train_sft.sh"].args(fixtures)
    code, out, _ = _dry_run("sft", argv, capsys)
    assert code == 0 and "ckpt_path: ./ckpt/checkpoints_sft" in out and "load_checkpoint: true" in out
    code, out, _ = _dry_run("sft", ["--ckpt.path", "/mine", *argv], capsys)  # given before or after: it wins
    assert code == 0 and "ckpt_path: /mine" in out
    code, out, _ = _dry_run(
        "ppo-ray", [*SCRIPTS["train_ppo_ray_slurm.sh"].args(fixtures), "--ckpt.save_steps", "5"], capsys
    )
    assert code == 0 and "ckpt_path: ./ckpt/checkpoints_ppo_ray" in out and "save_steps: 5" in out
    code, out, _ = _dry_run(
        "ppo-ray", [*SCRIPTS["train_ppo_ray_slurm.sh"].args(fixtures), "--ckpt.save_steps", "-1"], capsys
    )
    assert code == 0 and "ckpt_path: null" in out  # no checkpoints: no folder


def test_save_hf_without_save_steps_saves_the_final_model_only_as_openrlhf_does(fixtures, capsys):
    """train_ppo_ray_hybrid_engine.sh gives --ckpt.save_hf and no --ckpt.save_steps: OpenRLHF then writes no
    checkpoint (so no HF export into one) and saves the final model to --ckpt.output_dir. Ours too, saying so."""
    code, out, _ = _dry_run("ppo-ray", SCRIPTS["train_ppo_ray_hybrid_engine.sh"].args(fixtures), capsys)
    assert code == 0 and "save_hf_ckpt: true" in out and "save_steps: -1" in out
    assert (
        "[rl ppo-ray] --ckpt.save_hf: no checkpoints are written without --ckpt.save_steps; the final model goes "
        f"to --save_path ({fixtures['out']}/final)"
    ) in out
    code, out, _ = _dry_run("ppo-ray", SCRIPTS["train_dapo_ray_hybrid_engine.sh"].args(fixtures), capsys)
    assert code == 0 and "save_hf_ckpt: true" in out and "no checkpoints are written" not in out  # save_steps 20


def test_deepspeed_sleep_is_taken_under_zero_and_refused_without_a_zero_optimizer(fixtures, capsys):
    """--ds.enable_sleep (train_dapo_ray_hybrid_engine.sh, ZeRO-3) sets rl-core's DeepSpeed sleep; ZeRO-0 and
    --adam_offload are refused in one line before anything loads."""
    argv = SCRIPTS["train_dapo_ray_hybrid_engine.sh"].args(fixtures)
    code, out, _ = _dry_run("ppo-ray", argv, capsys)
    assert code == 0 and "deepspeed_enable_sleep: true" in out
    code, _, line = _dry_run("ppo-ray", [*argv, "--ds.zero_stage", "0"], capsys)
    assert (code, line) == (
        2,
        "rl ppo-ray: error: --deepspeed_enable_sleep needs --zero_stage 1, 2 or 3 (DeepSpeed "
        "offloads the states of a ZeRO optimizer), got --zero_stage 0",
    )
    code, _, line = _dry_run("ppo-ray", [*argv, "--ds.adam_offload"], capsys)
    assert code == 2 and line.endswith("--adam_offload keeps them there already: drop one of them")


def test_openrlhf_checkpoint_folder_stays_below_yaml(fixtures, capsys, tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("train:\n  ckpt_path: /from/yaml\n")
    code, out, _ = _dry_run("sft", [*SCRIPTS["train_sft.sh"].args(fixtures), "--config", str(cfg)], capsys)
    assert code == 0 and "ckpt_path: /from/yaml" in out


def _results() -> dict:
    return json.loads(RESULTS.read_text())["scripts"]


@pytest.mark.parametrize("name", SCRIPTS)
def test_the_recorded_run_used_todays_flags_and_overrides(name):
    """docs/openrlhf-examples.json: a script's record is stale once its flags or overrides change."""
    got = _results().get(name)
    assert got is not None, f"{name}: no recorded run; {RERUN} {name}"
    assert {k: got.get(k) for k in record(name)} == record(name), f"{name}: stale record; {RERUN} {name}"
    if got["ran_to_end"]:  # its exit code 0 and a last metrics line (serve-rm: its reply)
        assert got["exit_code"] == 0 and json.loads(got["last"][-1]), got


def test_every_override_is_a_known_flag(fixtures):
    for name in SCRIPTS:
        known = _parser(SCRIPTS[name].command)._option_string_actions
        flags = [a for o in OVERRIDES[name] for a in o.flags.split() if a.startswith("--")]
        assert flags and all(f in known for f in flags), (name, [f for f in flags if f not in known])
        assert (
            run_argv(name, fixtures)[-len(" ".join(o.flags for o in OVERRIDES[name]).split()) :]
            == " ".join(o.flags for o in OVERRIDES[name]).format(**fixtures).split()
        )  # appended last: the overrides win


def test_readme_lists_each_script_with_its_status_and_recorded_run():
    text = README.read_text()
    results = _results()
    for name, s in SCRIPTS.items():
        status = "runs as is" if not s.blockers else "refused: " + ", ".join(dict.fromkeys(f for _, f in s.blockers))
        r = results[name]
        ran = f"yes, {r['seconds']:.0f} s |" if r["ran_to_end"] else "no: "
        assert f"| `{name}` | `rl {s.command}` | {status} | {ran}" in text, (name, ran)
    for name in NOT_COMMANDS:
        assert f"| `{name}` |" in text, name


@pytest.mark.slow
@pytest.mark.parametrize("name", ["train_sft.sh", "train_rm.sh", "train_dpo_llama.sh"])
def test_the_cheapest_scripts_run_to_the_end(name, fixtures, tmp_path):
    """The script's own flags and its overrides, in this process: the run ends with its steps logged and the
    final model written to the script's --ckpt.output_dir."""
    fx = {**fixtures, "out": str(tmp_path / "out")}
    assert main(run_argv(name, fx)) == 0
    rows = [json.loads(x) for x in (tmp_path / "out" / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "train/loss" in r] == [1, 2, 3, 4], rows  # 16 rows, 4 a step
    assert (tmp_path / "out" / "final" / "config.json").is_file()
