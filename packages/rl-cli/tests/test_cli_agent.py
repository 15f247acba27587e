"""``rl ppo --agent_func_path``: an OpenRLHF agent file (unchanged, importing ``openrlhf.utils.agent``) trains
with multi-turn episodes from the command line, also under ``--async_train``; OpenRLHF's dialect names the
same fields (``rl ppo-ray --agent_func_path``: test_cli_agent_ray.py)."""

from __future__ import annotations

import json
import os

import pytest

from rl_cli.config import build_parser
from rl_cli.loading import resolve
from rl_cli.main import main
from rl_cli.ppo import _groups

pytestmark = [pytest.mark.timeout(900), pytest.mark.slow]

AGENT = '''
from openrlhf.utils.agent import AgentInstanceBase


class AgentInstance(AgentInstanceBase):
    def __init__(self, *args, **kwargs):
        self.turn = 0

    async def reset(self, states, **kwargs):
        return {"observation": states["observation"]}

    async def step(self, states, **kwargs):
        self.turn += 1
        hits = min(states["action_text"].count(states["label"]), 4) / 4
        done = self.turn >= 2
        return {"rewards": hits / 2, "scores": hits / 2, "environment_feedback": "" if done else " again: ",
                "done": done, "extra_logs": {"hits": hits}}
'''


@pytest.fixture(autouse=True)
def own_dist_env():
    """The in-process runs set RANK, MASTER_PORT...: leave none for later tests' subprocesses (their rendezvous
    would try this process's port)."""
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
    from rl_rollout.testing import make_tiny_model

    root = tmp_path_factory.mktemp("agent-cli")
    model = make_tiny_model(root / "tiny")
    (root / "prompts.jsonl").write_text(
        "".join(json.dumps({"prompt": f"Repeat the letter {c}: ", "label": c}) + "\n" for c in "abcd"))
    (root / "agent.py").write_text(AGENT)
    return root, model


def argv(root, model, run, *extra):
    return ["ppo", "--pretrain", str(model), "--prompt_data", str(root / "prompts.jsonl"), "--input_key", "prompt",
            "--label_key", "label", "--agent_func_path", str(root / "agent.py"), "--agent_max_turns", "3",
            "--agent_max_len", "64", "--advantage_estimator", "group_norm", "--n_samples_per_prompt", "4",
            "--rollout_batch_size", "4", "--train_batch_size", "16", "--generate_max_len", "4", "--max_iterations",
            "2", "--bf16", "false", "--init_kl_coef", "0", "--rollout_engine", "hf", "--seed", "1", "--run_dir",
            str(root / run), *extra]


def test_rl_ppo_trains_an_openrlhf_agent_file_sync_and_async(task):
    root, model = task
    assert main(argv(root, model, "sync")) == 0
    # OpenRLHF's over-sampling too: one round of 8 prompts serves both iterations of 4
    assert main(argv(root, model, "async", "--async_train", "--vllm_generate_batch_size", "8")) == 0
    for run in ("sync", "async"):
        rows = [json.loads(x) for x in (root / run / "metrics.jsonl").read_text().splitlines()]
        assert [r["step"] for r in rows] == [1, 2]
        # a generation round's metrics are logged by the iteration that ran it (async: every other one)
        assert all(r["rl/agent/turns"] >= 1 and r["rl/agent/env_tokens"] > 0 and "rl/agent_extra/hits" in r
                   for r in rows if r["rl/dynamic/rounds"]), rows
    rows = [json.loads(x) for x in (root / "async" / "metrics.jsonl").read_text().splitlines()]
    assert all(r["rl/staleness_violations"] == 0 for r in rows)
    assert [(r["rl/dynamic/rounds"], r["rl/oversample/buffered"]) for r in rows] == [(1, 4), (0, 0)]


def test_agent_episodes_with_partial_rollouts_keep_each_tokens_version(task):
    """``--partial_rollout`` with agent episodes: every turn's tokens come back tagged with their versions, and the
    episode keeps them (one per policy token), so the per-token metrics are logged as for single-turn responses."""
    root, model = task
    assert main(argv(root, model, "partial", "--async_train", "--partial_rollout", "--partial_rollout_tokens", "2")) == 0
    rows = [json.loads(x) for x in (root / "partial" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2] and all(r["rl/staleness_violations"] == 0 for r in rows), rows
    assert all(0 <= r["rl/partial_fraction"] <= 1 for r in rows), rows
    assert all(0 <= r["rl/token_staleness_mean"] <= r["rl/staleness_max"] for r in rows), rows


def test_logging_steps_writes_every_nth_iteration_and_the_last(task):
    """OpenRLHF's --logging_steps (was refused in the RL loop): metrics.jsonl gets iterations 2, 4 and 5 of 5."""
    root, model = task
    assert main(argv(root, model, "thin", "--max_iterations", "5", "--logger.logging_steps", "2")) == 0
    rows = [json.loads(x) for x in (root / "thin" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [2, 4, 5]


def test_the_flags_in_both_dialects(task, capsys):
    groups = _groups(False)
    parser, flags = build_parser("rl ppo", "", groups)
    p = resolve(groups, parser.parse_args(["--agent_func_path", "a.py", "--async_train", "--max_staleness", "2",
                                           "--partial_rollout", "--partial_rollout_tokens", "4"]), flags)["ppo"]
    assert (p.agent.func_path, p.async_rl is not None, p.async_rl.max_staleness) == ("a.py", True, 2)
    assert (p.async_rl.partial_rollout, p.async_rl.partial_rollout_tokens) == (True, 4)
    root, model = task
    with pytest.raises(SystemExit):  # group_norm compares one scalar per sample: no per-turn rewards
        main(argv(root, model, "turns", "--agent_turn_rewards"))
    assert "--advantage_estimator group_norm" in capsys.readouterr().err
