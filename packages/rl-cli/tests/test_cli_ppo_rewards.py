"""``rl ppo`` with reward functions that fail: refused before any model loads when it can be told, bounded when
they hang (also in-process), counted per iteration, and a run whose calls all fail exits non-zero with the
first error's message instead of training on fallbacks."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from rl_cli.main import main

pytestmark = [pytest.mark.timeout(900), pytest.mark.slow]
REWARDS = """
import time

def hangs_on_a(prompt, response, label, **info):
    if label == "a":
        time.sleep(60)
    return min(response.count(label), 8) / 8

def broken(prompt, response, label, **info):
    return info["score"]  # a field no caller passes: every call raises
"""


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    from rl_rollout.testing import make_tiny_model

    root = tmp_path_factory.mktemp("ppo-rewards-cli")
    model = make_tiny_model(root / "tiny")
    (root / "prompts.jsonl").write_text(
        "".join(json.dumps({"prompt": f"Repeat the letter {c}: ", "label": c}) + "\n" for c in "abcd"))
    (root / "rewards.py").write_text(REWARDS)
    return root, model


def argv(root, model, run, reward_fn, *extra):
    return ["--pretrain", str(model), "--prompt_data", str(root / "prompts.jsonl"), "--input_key", "prompt",
            "--reward_fn", reward_fn, "--advantage_estimator", "group_norm", "--init_kl_coef", "0",
            "--n_samples_per_prompt", "4", "--rollout_batch_size", "4", "--train_batch_size", "16",
            "--micro_train_batch_size", "8", "--generate_max_len", "8", "--max_iterations", "2", "--bf16", "false",
            "--run_dir", str(root / run), *extra]


def test_exact_match_without_a_label_key_fails_before_any_model_loads(task, capsys):
    root, model = task
    start = time.monotonic()
    with pytest.raises(SystemExit) as e:
        main(["ppo", *argv(root, model, "nolabel", "builtin:exact_match")])
    assert e.value.code == 2  # a user mistake: one line on stderr (rl_cli.errors), no traceback
    assert ("--reward_fn builtin:exact_match compares each response with the dataset's reference answer, but no "
            "--label_key is set: pass --label_key FIELD (the field of each row that holds the answer)"
            ) in capsys.readouterr().err
    assert time.monotonic() - start < 5 and not (root / "nolabel").exists()


def test_a_hanging_reward_function_in_process_costs_its_timeout_and_is_counted(task):
    """The default --reward_workers 0 used to drop --reward_timeout: this run hung for good."""
    root, model = task
    start = time.monotonic()
    assert main(["ppo", *argv(root, model, "hang", f"{root / 'rewards.py'}:hangs_on_a", "--label_key", "label",
                             "--reward_timeout", "1")]) == 0
    assert time.monotonic() - start < 120
    rows = [json.loads(x) for x in (root / "hang" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:  # the 'a' prompt's 4 samples time out each iteration: 4 of 16, tolerated
        assert (r["rl/reward/timeouts"], r["rl/reward/failures"], r["rl/reward/ok"]) == (4, 4, 12), r


def test_a_run_whose_reward_calls_all_fail_exits_non_zero_with_the_first_error(task):
    root, model = task
    # a fresh process, as a user's: not this one's torch.distributed settings (its MASTER_PORT is taken)
    dist = {"RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"}
    env = {k: v for k, v in os.environ.items() if k not in dist}
    out = subprocess.run([sys.executable, "-m", "rl_cli.train_ppo",
                          *argv(root, model, "broken", f"{root / 'rewards.py'}:broken", "--reward_workers", "1")],
                         capture_output=True, text=True, timeout=600, env=env)
    assert out.returncode == 1, out.stdout[-2000:] + out.stderr[-4000:]
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith("rl ppo: iteration 1: 16 of 16 reward calls failed (errors 16, timeouts 0, non-finite 0), "
                           "more than --reward_max_failure_rate 0.5 allows; first: reward function "
                           f"{root / 'rewards.py'}:broken failed on sample 0: KeyError: 'score'"), last
    assert "Traceback" not in out.stderr
    row = json.loads((root / "broken" / "metrics.jsonl").read_text())
    assert row["rl/reward/errors"] == 16 and "rl/policy_loss" not in row
