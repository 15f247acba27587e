"""``rl ppo --agent_cmd`` learns: the example letter agent (``examples/letter_agent.py``, written only against the
``openai`` package, two chat calls per episode: the ask, then ``more``) trained on ``rl demo``'s tiny model and task,
HF engine and real DeepSpeed on CPU; the reward rises, every episode merges into one sequence, and the agent_cmd
metrics are curves of ``curves.png``."""

from __future__ import annotations

import json
import os
import struct
import sys
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from rl_cli.main import main
from rl_core.trainers.ppo_agent_cmd import AgentCmdEpisodes
from rl_rollout.agents.cmd_config import AgentCmdConfig
from rl_rollout.hf_engine import HFEngine
from rl_rollout.testing import make_tiny_model

pytestmark = [pytest.mark.timeout(600), pytest.mark.slow]
EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "letter_agent.py"
AGENT_METRICS = ("episodes_ok", "episodes_failed", "episodes_timed_out", "calls_per_episode", "tokens_per_episode")


@pytest.fixture(autouse=True)
def own_dist_env():
    keys = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    saved = {k: os.environ.get(k) for k in keys}
    yield
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    """``rl demo``'s model (make_tiny_model, seed 0) and two of its prompts."""
    root = tmp_path_factory.mktemp("agent-learns")
    model = make_tiny_model(root / "model", seed=0)
    rows = [{"prompt": f"Repeat the letter {c}: ", "label": c} for c in "ab"]
    (root / "prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return root, model


def png_size(path: Path) -> tuple[int, int]:
    with path.open("rb") as f:
        head = f.read(24)
    assert head[:8] == b"\x89PNG\r\n\x1a\n"
    return struct.unpack(">II", head[16:24])


def test_rl_ppo_agent_cmd_reward_rises(task, monkeypatch):
    """20 iterations, 2 prompts x 8 episodes, ``rl demo``'s settings (group_norm, fp32 ZeRO-0, constant lr 3e-3 as
    test_cli_demo uses for a rise within 10 iterations, 2 epochs, clip 1.0). Measured on 2 CPU cores, seed 0, two
    runs (concurrent episodes reach the engine in varying order, so runs differ a little): mean reward 0.139 / 0.142
    over the first 5 iterations -> 0.489 / 0.454 over the last 5 (0.125 at iteration 1); ~1 s per iteration, the
    test 37 s (+10 s making the model) on a loaded machine. The agent runs as the entry point
    ``letter_agent.py:agent``: as a command (``python letter_agent.py``) each episode is a Python process importing
    ``openai`` (~1.1 s of CPU), 18 s per iteration of 16 episodes here (12 iterations: 0.105 -> 0.312, 260 s);
    the command form is played in the next test."""
    root, model = task
    monkeypatch.setenv("AGENT_MAX_TOKENS", "8")
    run = root / "run"
    argv = ["ppo", "--pretrain", str(model), "--prompt_data", str(root / "prompts.jsonl"), "--input_key", "prompt",
            "--label_key", "label", "--agent_cmd", f"{EXAMPLE}:agent", "--agent_cmd_concurrency", "8",
            "--agent_cmd_timeout", "60", "--advantage_estimator", "group_norm", "--n_samples_per_prompt", "8",
            "--rollout_batch_size", "2", "--train_batch_size", "16", "--micro_train_batch_size", "8",
            "--max_iterations", "20", "--bf16", "false", "--zero_stage", "0", "--init_kl_coef", "0",
            "--learning_rate", "3e-3", "--lr_warmup_ratio", "0", "--lr_scheduler", "constant", "--max_norm", "1.0",
            "--max_epochs", "2", "--rollout_engine", "hf", "--seed", "0", "--run_dir", str(run)]
    assert main(argv) == 0
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 21))
    rewards = [r["rl/reward_mean"] for r in rows]
    first, last = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
    assert last > first + 0.15, rewards  # measured 0.139 -> 0.489, 0.142 -> 0.454
    for r in rows:
        # every episode played its two calls, the second spliced onto the first: one trained sequence each
        assert r["rl/agent_cmd/episodes_ok"] == r["rl/agent_cmd/merged"] == 16, r
        assert r["rl/agent_cmd/episodes_failed"] == r["rl/agent_cmd/episodes_timed_out"] == 0, r
        assert r["rl/agent_cmd/calls_per_episode"] == 2.0 and r["rl/agent_cmd/calls_spliced"] == 16, r
        assert r["rl/agent_cmd/drift"] == 0 and r["rl/agent_cmd/tokens_per_episode"] > 0, r
        assert r["rl/agent_cmd/reward_mean"] == pytest.approx(r["rl/reward_mean"]), r
    # curves.png draws one panel per metric of the run (MetricsLogger.close: every logged name, 3 columns,
    # 2.6 in x 80 dpi per row): its height says the agent_cmd curves are among the panels
    names = set(rows[0]) - {"step"}
    assert {f"rl/agent_cmd/{m}" for m in AGENT_METRICS} <= names
    width, height = png_size(run / "curves.png")
    assert (width, height) == (3 * 4 * 80, -(-len(names) // 3) * 208), (width, height, len(names))


def test_example_letter_agent_as_a_command_merges_its_two_calls(task, monkeypatch):
    """The same program started per episode (``python letter_agent.py``, the row on stdin, ``{"reward": x}`` on
    its last line): both episodes play two calls, merge, and the reward is the printed share of ``a``."""
    root, model = task
    monkeypatch.setenv("AGENT_MAX_TOKENS", "8")
    tok = AutoTokenizer.from_pretrained(model)
    cfg = AgentCmdConfig(cmd=f"{sys.executable} {EXAMPLE}", concurrency=2, timeout_s=60.0)
    eps = AgentCmdEpisodes(cfg, HFEngine(model), tok, reward_fn=False, eos=[tok.eos_token_id])
    try:
        eps.start()
        (group,) = eps.groups([{"prompt_ids": [1, 2], "row": {"prompt": "Repeat the letter a: ", "label": "a"}}], 2)
    finally:
        eps.close()
    m = eps.last_metrics
    assert m["agent_cmd/episodes_ok"] == m["agent_cmd/merged"] == 2 and m["agent_cmd/calls_per_episode"] == 2.0
    assert m["agent_cmd/drift"] == 0 and m["agent_cmd/calls_spliced"] == 2
    for s in group:
        assert s.info["mode"] == "merged" and 0.0 <= s.reward <= 1.0
        assert s.reward * 16 == pytest.approx(round(s.reward * 16))  # a share of the 2 x 8 reply slots
