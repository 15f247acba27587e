"""``rl sft | rm | dpo | kto``: flags from the config dataclasses, YAML, OpenRLHF aliases, and real runs
(one process, and two ranks under torchrun with gloo + ZeRO-3 giving the same losses)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from rl_cli.config import build_parser
from rl_cli.loading import resolve
from rl_cli.train import COMMANDS, _groups, _wandb_key, run

pytestmark = [pytest.mark.timeout(900), pytest.mark.slow]
WORDS = ["abc", "hello", "xyz", "rl", "ppo", "grpo", "data", "kto"]


def parse(name, argv):
    groups = _groups(COMMANDS[name])
    parser, flags = build_parser(f"rl {name}", "", groups)
    return resolve(groups, parser.parse_args(argv), flags)


def test_dotted_flags_aliases_and_yaml_with_command_line_winning(tmp_path):
    y = tmp_path / "run.yaml"
    y.write_text("strategy:\n  zero_stage: 3\n  learning_rate: 1e-5\nmax_len: 512\ndata.input_key: question\n"
                 "beta: 0.5\npretrain: /m\n")
    c = parse("dpo", ["--config", str(y), "--zero_stage", "1", "--strategy.micro_train_batch_size", "2",
                      "--l2", "0.01", "--adam_betas", "0.9", "0.99", "--ipo", "--bf16", "false", "--dataset", "d.jsonl"])
    s, d, t, m = c["strategy"], c["data"], c["train"], c["model"]
    assert (s.zero_stage, s.learning_rate, s.micro_train_batch_size, s.weight_decay) == (1, 1e-5, 2, 0.01)
    assert s.adam_betas == (0.9, 0.99) and s.bf16 is False
    assert (d.max_len, d.input_key, d.dataset) == (512, "question", "d.jsonl")
    assert (t.beta, t.ipo) == (0.5, True) and m.pretrain == "/m"


def test_eval_flags_parse_under_openrlhf_names():
    c = parse("sft", ["--dataset", "t.jsonl", "--eval_dataset", "e.jsonl", "--eval_steps", "50", "--eval_split", "test",
                      "--max_eval_samples", "100"])
    d, t = c["data"], c["train"]
    assert (d.eval_dataset, d.eval_split, d.max_eval_samples, t.eval_steps) == ("e.jsonl", "test", 100, 50)
    c = parse("dpo", ["--data.eval_dataset", "e.jsonl", "--train.eval_steps", "-1"])
    assert (c["data"].eval_dataset, c["train"].eval_steps) == ("e.jsonl", -1)
    assert (parse("kto", [])["data"].eval_dataset, parse("kto", [])["train"].eval_steps) == (None, -1)
    with pytest.raises(ValueError, match=r"eval_steps \(--eval_steps\) must be >= 1, or -1"):
        parse("rm", ["--eval_steps", "0"])


def test_bad_settings_fail_with_the_fix(tmp_path, capsys):
    y = tmp_path / "bad.yaml"
    y.write_text("strategy:\n  zero_stgae: 3\n")
    with pytest.raises(ValueError, match=r"unknown setting 'strategy.zero_stgae'; did you mean strategy.zero_stage"):
        parse("sft", ["--config", str(y)])
    with pytest.raises(SystemExit):
        parse("sft", ["--micro_train_batchsize", "2"])
    assert "did you mean --micro_train_batch_size" in capsys.readouterr().err
    with pytest.raises(ValueError, match=r"zero_stage must be 0, 1, 2 or 3 \(or unset: auto\), got 5"):
        parse("sft", ["--zero_stage", "5"])
    with pytest.raises(SystemExit):
        parse("sft", ["--bf16", "maybe"])
    assert "expected true or false, got 'maybe'" in capsys.readouterr().err


def test_openrlhf_use_wandb_key_goes_to_the_environment(monkeypatch):
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    assert _wandb_key(["--use_wandb", "abc123", "--bf16"]) == ["--use_wandb", "true", "--bf16"]
    assert os.environ["WANDB_API_KEY"] == "abc123"
    assert _wandb_key(["--use_wandb", "--bf16"]) == ["--use_wandb", "--bf16"]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    from rl_rollout.testing import make_tiny_model

    root = tmp_path_factory.mktemp("cli")
    make_tiny_model(root / "tiny")
    (root / "sft.jsonl").write_text("".join(json.dumps({"q": f"reverse {w}", "a": w[::-1]}) + "\n" for w in WORDS))
    (root / "pairs.jsonl").write_text("".join(
        json.dumps({"prompt": f"reverse {w}", "chosen": w[::-1], "rejected": w}) + "\n" for w in WORDS))
    (root / "kto.jsonl").write_text("".join(
        json.dumps({"input": f"reverse {w}", "output": o, "label": good}) + "\n"
        for w in WORDS for o, good in ((w[::-1], True), (w, False))))
    return root


COMMON = ["--micro_train_batch_size", "2", "--train_batch_size", "4", "--learning_rate", "3e-3", "--bf16", "false",
          "--lr_warmup_ratio", "0"]


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def losses_of(run_dir):
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["train/loss"] for r in rows if "train/loss" in r]


@pytest.mark.parametrize("name,extra", [
    ("rm", ["--dataset", "pairs.jsonl", "--prompt_key", "prompt", "--max_epochs", "2"]),
    ("dpo", ["--dataset", "pairs.jsonl", "--prompt_key", "prompt", "--beta", "0.1", "--max_epochs", "2"]),
    ("kto", ["--dataset", "kto.jsonl", "--output_key", "output", "--max_epochs", "1"]),  # 16 rows
])
def test_preference_commands_train_and_export(files, name, extra, capsys, monkeypatch):
    monkeypatch.chdir(files)
    out = files / f"out-{name}"
    assert run(name, ["--pretrain", "tiny", *extra, *COMMON, "--save_path", str(out), "--run_dir", f"run-{name}"]) == 0
    printed = capsys.readouterr().out
    assert f"[rl {name}] global batch 4 = micro batch 2 x accumulation 2 x data parallel 1" in printed
    losses = losses_of(files / f"run-{name}")
    assert len(losses) == 4 and all(0 < x < 100 for x in losses), losses  # learning itself: rl-core's tests
    assert (out / "config.json").is_file() and ((out / "rl_head.json").is_file() == (name == "rm"))


@pytest.mark.parametrize("name,flag,extra", [  # each of the packing flag's names: ours and OpenRLHF's two
    ("rm", "--packing_samples", ["--dataset", "pairs.jsonl", "--prompt_key", "prompt"]),
    ("dpo", "--ds.packing_samples", ["--dataset", "pairs.jsonl", "--prompt_key", "prompt", "--beta", "0.1"]),
    ("kto", "--packing", ["--dataset", "kto.jsonl", "--output_key", "output", "--max_steps", "2"]),
])
def test_preference_commands_train_on_packed_pairs(files, name, flag, extra, capsys, monkeypatch):
    """The flag reaches the trainer (packed equals padded: rl-core's test_core_preference_trainers.py)."""
    monkeypatch.chdir(files)
    argv = ["--pretrain", "tiny", *extra, *COMMON, flag]
    assert run(name, [*argv, "--print_config"]) == 0
    assert 'packing: true' in capsys.readouterr().out
    out = files / f"out-packed-{name}"
    assert run(name, [*argv, "--save_path", str(out), "--run_dir", f"run-packed-{name}"]) == 0
    losses = losses_of(files / f"run-packed-{name}")
    assert len(losses) == 2 and all(0 < x < 100 for x in losses), losses
    assert (out / "config.json").is_file()


def test_sft_with_a_fused_lm_head_trains_with_the_losses_of_the_full_logits(files, monkeypatch):
    """rl sft --fused_lm_head: the NLL's gradients made in forward from the hidden states, chunk by chunk (the
    Actor-level equality of log-probs and gradients, the DPO/KTO reference's path included: rl-core's tests)."""
    name, extra = "sft", ["--dataset", "sft.jsonl", "--input_key", "q", "--output_key", "a", "--max_steps", "3"]
    monkeypatch.chdir(files)
    argv = ["--pretrain", "tiny", *extra, *COMMON]
    assert run(name, [*argv, "--run_dir", f"run-full-{name}"]) == 0
    assert run(name, [*argv, "--fused_lm_head", "--run_dir", f"run-fused-{name}"]) == 0
    full, fused = losses_of(files / f"run-full-{name}"), losses_of(files / f"run-fused-{name}")
    assert len(full) >= 2 and fused == pytest.approx(full, abs=1e-5), (full, fused)


def test_sft_with_an_eval_set_logs_eval_metrics_and_names_a_bad_eval_file(files, capsys, monkeypatch):
    from rl_core.data import DataError

    monkeypatch.chdir(files)
    (files / "sft_eval.jsonl").write_text("".join(json.dumps({"q": f"reverse {w}", "a": w[::-1]}) + "\n"
                                                  for w in ("cat", "sun", "map")))
    base = ["--pretrain", "tiny", "--dataset", "sft.jsonl", "--input_key", "q", "--output_key", "a",
            "--apply_chat_template", "--max_epochs", "2", *COMMON]
    assert run("sft", [*base, "--eval_dataset", "sft_eval.jsonl", "--eval_steps", "2", "--run_dir", "run-eval"]) == 0
    printed = capsys.readouterr().out
    assert "[rl sft] eval set: SFTDataset: kept 3/3 rows" in printed and ", eval loss " in printed
    rows = [json.loads(x) for x in (files / "run-eval" / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["eval/tokens"]) for r in rows if "eval/loss" in r] == [(2, 12.0), (4, 12.0)]  # 3 x (3 + eos)

    (files / "no_answers.jsonl").write_text(json.dumps({"q": "reverse cat"}) + "\n")
    with pytest.raises(SystemExit) as exit_:  # bad data is the user's to fix: one line, exit code 2
        run("sft", [*base, "--eval_dataset", "no_answers.jsonl", "--skip_bad_rows"])
    assert exit_.value.code == 2
    assert re.search(r"^rl sft: eval set \(--eval_dataset no_answers.jsonl\): .*kept 0/1 rows.* in "
                     r"\S*no_answers.jsonl: no usable rows", capsys.readouterr().err, re.M)
    (files / "empty.jsonl").write_text("")
    with pytest.raises(DataError, match=r"eval set \(--eval_dataset empty.jsonl\): no rows in 'empty.jsonl'"):
        run("sft", [*base, "--eval_dataset", "empty.jsonl", "--debug"])  # --debug: the error itself, traceback
    with pytest.raises(SystemExit):
        run("sft", [*base, "--eval_steps", "2"])
    assert "--eval_steps 2 needs --eval_dataset PATH" in capsys.readouterr().err


@pytest.mark.multiprocess
@pytest.mark.parametrize("name,zero,extra", [
    ("sft", "3", ["--dataset", "sft.jsonl", "--input_key", "q", "--output_key", "a", "--apply_chat_template"]),
    ("dpo", "2", ["--dataset", "pairs.jsonl", "--prompt_key", "prompt", "--beta", "0.1"]),
])
def test_two_ranks_under_torchrun_match_one_process(files, tmp_path, name, zero, extra):
    """2 gloo ranks (micro 2 x 1 x dp 2) give one process's losses (micro 2 x accumulation 2)."""
    extra = [str(files / a) if a.endswith(".jsonl") else a for a in extra]
    args = ["--pretrain", str(files / "tiny"), *extra, "--zero_stage", zero, "--max_epochs", "2", *COMMON]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for var in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):  # set by earlier in-process runs
        env.pop(var, None)
    one = subprocess.run([sys.executable, "-m", f"rl_cli.train_{name}", *args, "--run_dir", str(tmp_path / "one")],
                         capture_output=True, text=True, timeout=600, env=env)
    assert one.returncode == 0, one.stderr[-3000:]
    two = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()),
                          "-m", f"rl_cli.train_{name}", *args, "--run_dir", str(tmp_path / "two")],
                         capture_output=True, text=True, timeout=300, env=env)
    assert two.returncode == 0, two.stderr[-3000:]
    assert "accumulation 1 x data parallel 2" in two.stdout and "accumulation 2 x data parallel 1" in one.stdout
    a, b = losses_of(tmp_path / "one"), losses_of(tmp_path / "two")
    assert len(a) == len(b) == 4
    assert max(abs(x - y) for x, y in zip(a, b)) < 1e-5, (a, b)


def test_sft_checkpoints_only_the_layers_asked_for_and_names_a_bad_count(files, capsys, monkeypatch, caplog):
    monkeypatch.chdir(files)
    base = ["--pretrain", "tiny", "--dataset", "sft.jsonl", "--input_key", "q", "--output_key", "a",
            "--apply_chat_template", *COMMON, "--gradient_checkpointing"]
    with caplog.at_level("INFO", logger="rl_core.strategy"):
        assert run("sft", [*base, "--gradient_checkpointing_layers", "1", "--run_dir", "run-ckpt"]) == 0
    assert "gradient checkpointing: the first 1 of 2 decoder layers recompute" in caplog.text
    losses = losses_of(files / "run-ckpt")
    assert len(losses) == 2 and all(0 < x < 100 for x in losses), losses
    with pytest.raises(SystemExit) as exit_:
        run("sft", [*base, "--gradient_checkpointing_layers", "3"])
    assert exit_.value.code == 2
    assert ("rl sft: gradient_checkpointing_layers (--gradient_checkpointing_layers)=3 is more than the model's 2 "
            "decoder layers; pass 0..2, all or auto") in capsys.readouterr().err
    with pytest.raises(SystemExit):
        run("sft", [*base[:-1], "--gradient_checkpointing_layers", "1"])
    assert "add --gradient_checkpointing" in capsys.readouterr().err


def test_sft_with_openrlhfs_muon_flags_learns(files, monkeypatch):
    """``--optim muon`` in bf16 at ZeRO-2 (the defaults): the loss falls (the step's math: rl-core's test_core_muon)."""
    import torch

    monkeypatch.chdir(files)
    argv = ["--pretrain", "tiny", "--dataset", "sft.jsonl", "--input_key", "q", "--output_key", "a",
            "--apply_chat_template", "--micro_train_batch_size", "2", "--train_batch_size", "4", "--lr_warmup_ratio",
            "0", "--max_epochs", "3", "--optim", "muon", "--muon.lr", "0.05", "--muon.momentum", "0.9",
            "--muon.ns_steps", "5", "--muon.nesterov", "--adam.lr", "3e-3", "--max_norm", "0", "--run_dir", "run-muon"]
    with torch._dynamo.config.patch(disable=True):  # DeepSpeed compiles Newton-Schulz: ~40 s of inductor on CPU
        assert run("sft", argv) == 0
    losses = losses_of(files / "run-muon")
    assert len(losses) == 6 and losses[-1] < 0.7 * losses[0], losses


def test_sft_pretrain_mode_trains_on_every_token_of_the_text(files, monkeypatch, capsys):
    """OpenRLHF's --model.pretrain_mode_enable: the --input_key text is the whole sample and every token but the first
    is a target (the dataset report names PretrainDataset); the run trains (the loss falls)."""
    monkeypatch.chdir(files)
    (files / "text.jsonl").write_text("".join(json.dumps({"text": f"the word {w} reversed is {w[::-1]}"}) + "\n"
                                              for w in WORDS))
    argv = ["--pretrain", "tiny", "--dataset", "text.jsonl", "--input_key", "text", "--model.pretrain_mode_enable",
            *COMMON, "--max_epochs", "3", "--run_dir", "run-pretrain"]
    assert run("sft", argv) == 0
    losses = losses_of(files / "run-pretrain")
    assert len(losses) == 3 * (len(WORDS) // 4) and losses[-1] < losses[0], losses
    from transformers import AutoTokenizer

    from rl_core.data import DataConfig, PretrainDataset

    ds = PretrainDataset([{"text": "the word abc"}], AutoTokenizer.from_pretrained(files / "tiny"),
                         DataConfig(input_key="text"))
    assert ds[0]["loss_mask"].tolist() == [0] + [1] * (len(ds[0]["input_ids"]) - 1)
    with pytest.raises(SystemExit):
        run("sft", [*argv, "--output_key", "a"])
    assert "--pretrain_mode trains on the --input_key text as is; --output_key would not be used" in \
        capsys.readouterr().err


def test_sft_save_hf_ckpt_writes_an_hf_export_at_every_save_step(files, monkeypatch, capsys):
    """OpenRLHF's --ckpt.save_hf: an HF folder per --save_steps beside the DeepSpeed checkpoints, and with
    --ckpt.disable_ds the exports alone; without --save_steps the flag would do nothing, so it stops the run."""
    from transformers import AutoModelForCausalLM

    monkeypatch.chdir(files)
    base = ["--pretrain", "tiny", "--dataset", "sft.jsonl", "--input_key", "q", "--output_key", "a", *COMMON,
            "--max_epochs", "1"]
    assert run("sft", [*base, "--ckpt.path", "ck-hf", "--ckpt.save_steps", "1", "--ckpt.save_hf"]) == 0
    names = sorted(p.name for p in (files / "ck-hf").iterdir() if p.name != ".rl.lock")  # (the run's lock)
    assert names == ["step_00000001", "step_00000001_hf", "step_00000002", "step_00000002_hf"], names
    AutoModelForCausalLM.from_pretrained(files / "ck-hf" / "step_00000002_hf")  # loadable as is
    assert run("sft", [*base, "--ckpt.path", "ck-hf-only", "--ckpt.save_steps", "2", "--ckpt.save_hf",
                       "--ckpt.disable_ds"]) == 0
    assert sorted(p.name for p in (files / "ck-hf-only").iterdir()) == [".rl.lock", "step_00000002_hf"]
    with pytest.raises(SystemExit):
        run("sft", [*base, "--ckpt.save_hf"])
    assert "save_hf_ckpt (--save_hf_ckpt) writes an HF export at every --save_steps" in capsys.readouterr().err


def test_sft_resume_skips_a_damaged_checkpoint_and_refuses_none_usable_before_the_model_loads(files, monkeypatch,
                                                                                              capsys, caplog):
    """issue 40: the trainers' checkpoints carry the manifest too; rl sft --load_checkpoint takes the newest that
    verifies, and with none usable stops in one line before the model loads."""
    monkeypatch.chdir(files)
    base = ["--pretrain", "tiny", "--dataset", "sft.jsonl", "--input_key", "q", "--output_key", "a", *COMMON,
            "--max_epochs", "1", "--ckpt.path", "ck-damaged", "--ckpt.save_steps", "1"]
    assert run("sft", base) == 0
    steps = sorted((files / "ck-damaged").glob("step_*"))
    assert [p.name for p in steps] == ["step_00000001", "step_00000002"]
    states = next(steps[1].rglob("*model_states.pt"))
    states.write_bytes(states.read_bytes()[:100])
    capsys.readouterr()
    with caplog.at_level("WARNING", logger="rl_core.checkpoint"):
        assert run("sft", [*base, "--ckpt.load"]) == 0  # resumed from step 1
    assert re.search(r"step_00000002 cannot be resumed: ds/.*model_states.pt is 100 bytes", caplog.text), caplog.text
    for step in (files / "ck-damaged").glob("step_*"):
        (step / "rl_state.json").write_text("{")
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        run("sft", [*base, "--ckpt.load"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "Loading weights" not in err, err[-2000:]
    assert re.search(r"rl sft: no checkpoint under ck-damaged can be resumed \(step_00000002: its rl_state.json does "
                     r"not read .*; step_00000001: .*\): move the damaged folders away", err), err[-2000:]
