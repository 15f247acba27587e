"""``--pretrain org/name`` as OpenRLHF users pass it: found in the local Hugging Face cache (HF_HOME,
HF_HUB_CACHE) with HF_HUB_OFFLINE=1, for rl sft and rl ppo; a missing id stops before any model loads, in
one line naming the id and the cache searched."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from rl_cli.main import main

pytestmark = [pytest.mark.timeout(900), pytest.mark.slow]


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    from rl_rollout.testing import cache_as_hub, make_tiny_model

    root = tmp_path_factory.mktemp("hub")
    cache_as_hub(make_tiny_model(root / "tiny"), "org/tiny", root / "hf" / "hub")
    (root / "sft.jsonl").write_text("".join(json.dumps({"q": f"say {w}", "a": w}) + "\n" for w in "abcd"))
    (root / "prompts.jsonl").write_text(
        "".join(json.dumps({"prompt": f"Repeat the letter {c}: ", "label": c}) + "\n" for c in "ab"))
    (root / "reward.py").write_text("def letter(prompt, response, label, **info):\n"
                                    "    return float(label in response)\n")
    return root


@pytest.fixture
def offline(hub, monkeypatch):
    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "RANK", "LOCAL_RANK", "WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HF_HOME", str(hub / "hf"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return hub


def test_rl_sft_trains_a_model_given_by_hub_id(offline, capsys):
    root = offline
    assert main(["sft", "--pretrain", "org/tiny", "--dataset", str(root / "sft.jsonl"), "--input_key", "q",
                 "--output_key", "a", "--train_batch_size", "4", "--micro_train_batch_size", "4", "--bf16", "false",
                 "--max_steps", "1", "--run_dir", str(root / "sft-run")]) == 0
    assert "[rl sft] done: 1 steps" in capsys.readouterr().out


def test_rl_ppo_trains_a_policy_given_by_hub_id(offline, capsys):
    root = offline
    assert main(["ppo", "--pretrain", "org/tiny", "--prompt_data", str(root / "prompts.jsonl"), "--input_key",
                 "prompt", "--label_key", "label", "--reward_fn", f"{root / 'reward.py'}:letter",
                 "--advantage_estimator", "group_norm", "--n_samples_per_prompt", "2", "--rollout_batch_size", "2",
                 "--train_batch_size", "4", "--generate_max_len", "4", "--max_iterations", "1", "--init_kl_coef",
                 "0", "--bf16", "false", "--run_dir", str(root / "ppo-run")]) == 0
    assert "[rl ppo] done: 1 iterations" in capsys.readouterr().out


@pytest.mark.parametrize("command,flag", [("rl_cli.train_sft", "--pretrain"), ("rl_cli.train_ppo", "--pretrain"),
                                          ("rl_cli.train_ppo", "--reward_pretrain")])
def test_a_missing_hub_id_fails_in_one_line_naming_the_id_and_the_cache(offline, command, flag):
    root = offline
    argv = ["--pretrain", "org/tiny", "--dataset", str(root / "sft.jsonl"), flag, "Qwen/Qwen2.5-7B-Instruct"]
    if command.endswith("ppo"):
        argv += ["--reward_fn", f"{root / 'reward.py'}:letter", "--label_key", "label"]
    out = subprocess.run([sys.executable, "-m", command, *argv], capture_output=True, text=True, timeout=300,
                         env=dict(os.environ))
    assert out.returncode != 0
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1, out.stderr[-3000:]
    assert f"{flag} Qwen/Qwen2.5-7B-Instruct" in lines[0] and str(root / "hf" / "hub") in lines[0], lines[0]
    assert "Traceback" not in out.stderr and "[rl " not in out.stdout  # stopped before any data or model loaded
