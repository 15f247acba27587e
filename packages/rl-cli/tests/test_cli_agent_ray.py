"""``rl ppo-ray --agent_func_path``: multi-turn episodes with the engines in Ray actors (CPU, logical GPUs).

rl-rollout's ``AgentExecutor`` drives the episodes through rl-core's ``GroupRollout.agenerate``: the turns
waiting at once go to the HF engine actors together, spread over them, each actor sampling its share in one
batch. Checked on the samples (environment tokens masked, the step rewards summed into the episode reward,
the turns waiting at once sent together, both engines used) and end to end: ``rl ppo-ray`` with an OpenRLHF
agent file and ``--agent_turn_rewards`` completes with the agent's metrics.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.timeout(900), pytest.mark.slow]
FEEDBACK = " again: "

AGENT = f'''
from openrlhf.utils.agent import AgentInstanceBase


class AgentInstance(AgentInstanceBase):
    def __init__(self, *args, **kwargs):
        self.turn = 0

    async def reset(self, states, **kwargs):
        return {{"observation": states["observation"]}}

    async def step(self, states, **kwargs):
        self.turn += 1
        hits = min(states["action_text"].count(states["label"]), 4) / 4
        done = self.turn >= 2
        return {{"rewards": 0.25 + hits / 2, "scores": hits / 2, "environment_feedback": "" if done else {FEEDBACK!r},
                "done": done, "extra_logs": {{"hits": hits}}}}
'''


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    from rl_rollout.testing import make_tiny_model

    root = tmp_path_factory.mktemp("agent-ray")
    model = make_tiny_model(root / "tiny")
    (root / "prompts.jsonl").write_text(
        "".join(json.dumps({"prompt": f"Repeat the letter {c}: ", "label": c}) + "\n" for c in "abcd"))
    (root / "agent.py").write_text(AGENT)
    return root, model


def test_engine_actors_play_agent_episodes_turn_by_turn(task):
    import ray
    from transformers import AutoTokenizer

    from rl_cli.ray_engines import start_engines
    from rl_core.rl import GroupRollout
    from rl_placement import PlacementPlan, create_placement_groups
    from rl_rollout import SamplingParams
    from rl_rollout.agents import AgentExecutor, AgentRequest
    from rl_rollout.agents.openrlhf import load_agent

    root, model = task
    tok = AutoTokenizer.from_pretrained(model)
    os.environ.setdefault("RAY_memory_monitor_refresh_ms", "0")
    ray.init(address="local", num_cpus=2, num_gpus=3, include_dashboard=False)  # never a cluster another test left
    placed, engines = None, []
    try:
        placed = create_placement_groups(PlacementPlan.from_flags(actor_num_gpus_per_node=1, vllm_num_engines=2))
        engines = start_engines(placed, "hf", str(model))
        rollout = GroupRollout(engines)
        calls = []  # (engine, requests) of every call the rollout makes to an engine actor
        for i, g in enumerate(engines):
            call_rank = g.call_rank

            def counted(rank, method, *args, _i=i, _call=call_rank, **kw):
                if method == "generate_turns":
                    calls.append((_i, len(args[0])))
                return _call(rank, method, *args, **kw)

            g.call_rank = counted
        params = SamplingParams(max_new_tokens=4, n=4, seed=3, stop_token_ids=(10_000,))
        reqs = [AgentRequest(tok.encode(f"Repeat the letter {c}: ", add_special_tokens=False), label=c,
                             prompt=f"Repeat the letter {c}: ") for c in "ab"]
        executor = AgentExecutor(rollout, tok, load_agent(str(root / "agent.py")), max_turns=3, max_len=64,
                                 params=params)
        groups = executor.run(reqs)
    finally:
        for g in engines:
            g.shutdown()
        if placed is not None:
            placed.remove()
        ray.shutdown()
    samples = [s for g in groups for s in g]
    assert len(samples) == 8 and all(s.info["turns"] == 2 for s in samples)  # the agent ends at its 2nd step
    # the first turns of the 8 episodes went out at once, one call per engine with 4 each; the second turns
    # follow as each engine answers (how they group depends on which answer lands first)
    assert sorted(calls[:2]) == [(0, 4), (1, 4)], calls
    assert sum(k for _, k in calls) == 16 and len(calls) <= 10, calls  # 16 turns, in at most 2 + 8 calls
    assert sum(rollout.pool.assigned) == 16 and rollout.pool.outstanding == [0, 0]  # all answered, counted off
    feedback = tok.encode(FEEDBACK, add_special_tokens=False)
    for s in samples:
        (s1, e1), (s2, e2) = s.info["action_spans"]
        assert s.response_ids[e1:s2] == feedback  # the environment's tokens sit between the turns ...
        assert s.loss_mask == [1] * (e1 - s1) + [0] * len(feedback) + [1] * (e2 - s2)  # ... masked
        assert s.rollout_logprobs[e1:s2] == [0.0] * len(feedback) and any(s.rollout_logprobs[s1:e1])
        r = s.info["turn_rewards"]
        assert len(r) == 2 and all(x >= 0.25 for x in r) and s.reward == pytest.approx(sum(r))


def test_rl_ppo_ray_trains_an_agent_file_with_turn_rewards(task):
    root, model = task
    run = root / "ray"
    argv = ["--pretrain", str(model), "--prompt_data", str(root / "prompts.jsonl"), "--input_key", "prompt",
            "--label_key", "label", "--agent_func_path", str(root / "agent.py"), "--agent_max_turns", "3",
            "--agent_max_len", "64", "--advantage_estimator", "reinforce", "--agent_turn_rewards",
            "--n_samples_per_prompt", "4", "--rollout_batch_size", "4", "--train_batch_size", "16",
            "--micro_train_batch_size", "8", "--generate_max_len", "4", "--max_iterations", "2", "--bf16", "false",
            "--init_kl_coef", "0", "--seed", "1", "--num_gpus", "3", "--actor_num_gpus_per_node", "1",
            "--vllm_num_engines", "2", "--run_dir", str(run)]
    out = subprocess.run([sys.executable, "-m", "rl_cli.train_ppo_ray", *argv], capture_output=True, text=True,
                         timeout=800, env={**os.environ, "RAY_DEDUP_LOGS": "0"})
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-6000:]
    assert "2 engine(s) HFEngine" in out.stdout, out.stdout[-2000:]
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert r["rl/agent/turns"] == 2 and r["rl/agent/env_tokens"] > 0 and "rl/agent_extra/hits" in r, r
        # turn rewards: the episode's sum is logged, the score keeps the last turn's part only
        assert r["rl/agent/reward_mean"] >= 0.5 and r["rl/reward_mean"] < r["rl/agent/reward_mean"] - 0.2, r
        assert r["rl/rollout_logprob_gap"] < 1e-4, r  # the engine actors sample with the synced weights
