"""The RL loop with vLLM as its engine (run in .venv-vllm: vLLM's CPU build beside DeepSpeed and Ray).

What users run, end to end: ``rl ppo --rollout_engine vllm`` (vLLM inside the trainer's process,
weights handed over in memory), ``rl ppo-ray --rollout_engine vllm`` (the engine in a Ray actor on a
logical GPU, weights over the gloo broadcast) and ``rl demo --rollout_engine vllm``. GRPO on the demo
task: the reward must rise, and every iteration the engine's log-probs must equal the trainer's
recomputation (fp32: within 1e-3, the gap alarm's threshold), which fails if any weight, the tied LM
head included, stays stale after a sync.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from rl_rollout.testing import missing_modules

if why := missing_modules("deepspeed", "ray", "vllm"):
    pytest.skip(why, allow_module_level=True)

import torch  # noqa: E402

from rl_rollout.testing import VLLM_CPU_TESTS_ON_CUDA  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900),
              pytest.mark.skipif(torch.cuda.is_available(), reason=VLLM_CPU_TESTS_ON_CUDA)]
REWARD = "def letter(prompt, response, label, **info):\n    return min(response.count(label), 8) / 8\n"
GAP = 1e-3


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    from rl_rollout.testing import make_tiny_model

    root = tmp_path_factory.mktemp("vllm-loop")
    model = make_tiny_model(root / "tiny")
    (root / "prompts.jsonl").write_text(
        "".join(json.dumps({"prompt": f"Repeat the letter {c}: ", "label": c}) + "\n" for c in "abcd"))
    (root / "reward.py").write_text(REWARD)
    return root, model


def grpo(root, model, run, iterations):
    return ["--pretrain", str(model), "--prompt_data", str(root / "prompts.jsonl"), "--input_key", "prompt",
            "--label_key", "label", "--reward_fn", f"{root / 'reward.py'}:letter",
            "--advantage_estimator", "group_norm", "--init_kl_coef", "0", "--n_samples_per_prompt", "8",
            "--rollout_batch_size", "4", "--train_batch_size", "32", "--micro_train_batch_size", "16",
            "--max_epochs", "2", "--generate_max_len", "8", "--max_iterations", str(iterations), "--bf16", "false",
            "--zero_stage", "0", "--learning_rate", "3e-3", "--lr_warmup_ratio", "0", "--lr_scheduler", "constant",
            "--seed", "0", "--rollout_engine", "vllm", "--enforce_eager", "--verify_weights",
            "--run_dir", str(root / run)]


def run_cli(module, argv, timeout=850):
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"),
           "RAY_DEDUP_LOGS": "0", "RAY_ENABLE_UV_RUN_RUNTIME_ENV": "0"}
    out = subprocess.run([sys.executable, "-m", module, *argv], capture_output=True, text=True, timeout=timeout,
                         env=env)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-6000:]
    return out


def metrics(path):
    return [json.loads(x) for x in (path / "metrics.jsonl").read_text().splitlines()]


def check_run(rows, iterations):
    assert [r["step"] for r in rows] == list(range(1, iterations + 1))
    gaps = [r["rl/rollout_logprob_gap"] for r in rows]
    assert max(gaps) < GAP, f"the engine drifted from the policy: gaps {gaps}"
    assert all(r["rl/logprob_gap_alarm"] == 0 for r in rows)
    rewards = [r["rl/reward_mean"] for r in rows]
    k = max(2, iterations // 4)
    assert sum(rewards[-k:]) / k > sum(rewards[:k]) / k + 0.05, rewards


def test_rl_ppo_with_vllm_in_process_keeps_the_engine_on_the_policy_and_learns(task):
    root, model = task
    out = run_cli("rl_cli.train_ppo", grpo(root, model, "local", 14))
    assert "rollout VLLMEngine" in out.stdout, out.stdout[-2000:]
    rows = metrics(root / "local")
    check_run(rows, 14)
    assert all(r["rl/sync_verify_s"] > 0 for r in rows)  # the engine checked what it holds after every sync


def test_rl_ppo_lora_with_vllm_in_process_loads_the_merged_weights(task):
    """--lora_rank: vLLM gets the merged weights (HF names, no peft tensors) in memory every iteration, checked
    there by --verify_weights, and samples from the distribution the adapted policy scores."""
    root, model = task
    out = run_cli("rl_cli.train_ppo", grpo(root, model, "lora", 3) + ["--lora_rank", "4", "--lora_alpha", "8",
                                                                      "--learning_rate", "1e-2"])
    assert "rollout VLLMEngine" in out.stdout, out.stdout[-2000:]
    rows = metrics(root / "lora")
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all(r["rl/rollout_logprob_gap"] < GAP and r["rl/sync_verify_s"] > 0 for r in rows), rows


def test_rl_ppo_ray_with_a_vllm_engine_actor_over_gloo(task):
    """Also the sleep-level-2 sequence: sleep(2) while training, wake the weights, sync, wake the KV cache
    (on CPU vLLM's sleep only pauses, so the check is that every tensor arrives through that sequence)."""
    root, model = task
    argv = grpo(root, model, "ray", 10) + ["--num_gpus", "2", "--actor_num_gpus_per_node", "1",
                                           "--vllm_num_engines", "1", "--vllm_enable_sleep", "--vllm_sleep_level", "2"]
    out = run_cli("rl_cli.train_ppo_ray", argv)
    assert "VLLMEngine" in out.stdout and "weight sync gloo" in out.stdout, out.stdout[-2000:]
    rows = metrics(root / "ray")
    check_run(rows, 10)
    assert all(r["rl/sync_gb_per_s"] > 0 and r["rl/sync_verify_s"] > 0 for r in rows)


def test_rl_demo_with_vllm(task, tmp_path):
    out = run_cli("rl_cli.main", ["demo", "--rollout_engine", "vllm", "--iterations", "16", "--learning_rate", "3e-3",
                                  "--workdir", str(tmp_path / "demo")])  # 3e-3: the rise shows within 16 iterations
    assert "rollout VLLMEngine" in out.stdout, out.stdout[-2000:]
    check_run(metrics(tmp_path / "demo" / "run"), 16)


def test_rl_ppo_async_with_vllm_in_process_learns_within_the_staleness_bound(task):
    """``--async_train``: the next batch is generated (vLLM in this process, on the producer thread) while the
    policy trains; every batch's generating version is at most ``--max_staleness`` 1 behind the trained one,
    the pipeline really ran ahead, and the samples of the training policy itself match its log-probs.
    ``--partial_rollout --partial_rollout_mode chunks``: vLLM samples in chunks of 2 tokens, so a sync may land
    mid-response; every sample's tokens carry their versions (``partial_fraction`` is logged every iteration; the
    tags themselves are checked against transformers in rl-rollout's test_rollout_vllm_engine.py)."""
    root, model = task
    out = run_cli("rl_cli.train_ppo", grpo(root, model, "async", 14) + ["--async_train", "--max_staleness", "1",
                                                                         "--partial_rollout",
                                                                         "--partial_rollout_mode", "chunks",
                                                                         "--partial_rollout_tokens", "2"])
    assert "rollout VLLMEngine" in out.stdout, out.stdout[-2000:]
    assert "partial rollouts: chunks" in out.stderr, out.stderr[-2000:]
    rows = metrics(root / "async")
    assert [r["step"] for r in rows] == list(range(1, 15))
    lags = [r["rl/policy_version_trained"] - r["rl/policy_version_generated"] for r in rows]
    assert all(0 <= x <= 1 for x in lags) and all(r["rl/staleness_violations"] == 0 for r in rows), lags
    assert [r["rl/policy_version_trained"] for r in rows] == list(range(14))
    assert sum(x == 1 for x in lags) >= 7, lags  # generation overlapped training
    assert all(0 <= r["rl/partial_fraction"] <= 1 for r in rows), rows[-1]  # token versions came back tagged
    fresh = [r["rl/rollout_logprob_gap"] for r in rows if "rl/rollout_logprob_gap" in r]
    assert fresh and max(fresh) < GAP, fresh
    rewards = [r["rl/reward_mean"] for r in rows]
    assert sum(rewards[-4:]) / 4 > sum(rewards[:4]) / 4 + 0.05, rewards



def test_rl_ppo_async_partial_rollout_keeps_requests_in_the_in_process_vllm_engine(task):
    """``rl ppo --async_train --partial_rollout --rollout_engine vllm`` (mode auto: keep): the producer thread steps
    vLLM's engine with its requests kept across the in-memory sync (paused between two engine steps, resumed with
    the new weights), so syncs land inside responses of up to 256 tokens while the policy trains a few steps' worth
    of time; every token carries the version vLLM labelled it with, and the bound holds on each."""
    root, model = task
    argv = grpo(root, model, "keep", 4) + ["--generate_max_len", "256", "--max_epochs", "1", "--learning_rate", "1e-5",
                                           "--async_train", "--max_staleness", "1", "--partial_rollout"]
    out = run_cli("rl_cli.train_ppo", argv)
    assert "partial rollouts: keep (unfinished requests kept in vLLM" in out.stderr, out.stderr[-2000:]
    rows = metrics(root / "keep")
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert all(r["rl/staleness_max"] <= 1 and r["rl/staleness_violations"] == 0 for r in rows), rows
    assert all(0 <= r["rl/token_staleness_mean"] <= r["rl/staleness_max"] for r in rows), rows
    assert any(r["rl/partial_fraction"] > 0 for r in rows[1:]), [r["rl/partial_fraction"] for r in rows]
    assert rows[0]["rl/rollout_logprob_gap"] < GAP, rows[0]
    stale = [r["rl/stale_logprob_gap"] for r in rows if "rl/stale_logprob_gap" in r]
    assert stale and max(stale) < 0.05, stale  # the off-policy gap tis corrects: kept tokens included, small

AGENT = '''
from openrlhf.utils.agent import AgentInstanceBase


class AgentInstance(AgentInstanceBase):
    def __init__(self, *args, **kwargs):
        self.turn = 0

    async def step(self, states, **kwargs):
        self.turn += 1
        hits = min(states["action_text"].count(states["label"]), 4) / 4
        done = self.turn >= 2
        return {"rewards": hits / 2, "environment_feedback": "" if done else " again: ", "done": done}
'''


def test_rl_ppo_async_agent_episodes_with_vllm(task):
    """An OpenRLHF agent file (two turns, feedback between them) with vLLM in this process and --async_train:
    the engine's log-probs on the policy's tokens equal the trainer's (the environment's tokens are masked out
    of that comparison as of the loss), and the bound holds."""
    root, model = task
    (root / "agent.py").write_text(AGENT)
    argv = grpo(root, model, "agent", 3) + ["--agent_func_path", str(root / "agent.py"), "--agent_max_turns", "3",
                                            "--agent_max_len", "64", "--async_train", "--generate_max_len", "4"]
    run_cli("rl_cli.train_ppo", [a for a in argv if a not in ("--reward_fn", f"{root / 'reward.py'}:letter")])
    rows = metrics(root / "agent")
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all(r["rl/agent/turns"] == 2 and r["rl/agent/env_tokens"] == 8 for r in rows), rows
    assert all(r["rl/staleness_violations"] == 0 and r["rl/staleness_max"] <= 1 for r in rows)
    assert rows[0]["rl/rollout_logprob_gap"] < GAP


def test_rl_ppo_ray_agent_episodes_with_a_vllm_engine_actor(task):
    """``rl ppo-ray --agent_func_path`` with a vLLM engine actor: every turn goes to the actor
    (``generate_turns`` -> ``VLLMEngine.generate``), the environment's tokens are masked, and the engine's
    log-probs on the policy's tokens equal the trainer's after each gloo broadcast."""
    root, model = task
    (root / "agent.py").write_text(AGENT)
    argv = grpo(root, model, "ray-agent", 2) + ["--agent_func_path", str(root / "agent.py"), "--agent_max_turns",
                                                "3", "--agent_max_len", "64", "--generate_max_len", "4",
                                                "--num_gpus", "2", "--actor_num_gpus_per_node", "1",
                                                "--vllm_num_engines", "1"]
    out = run_cli("rl_cli.train_ppo_ray", [a for a in argv if a not in ("--reward_fn", f"{root / 'reward.py'}:letter")])
    assert "VLLMEngine" in out.stdout and "weight sync gloo" in out.stdout, out.stdout[-2000:]
    rows = metrics(root / "ray-agent")
    assert [r["step"] for r in rows] == [1, 2]
    assert all(r["rl/agent/turns"] == 2 and r["rl/agent/env_tokens"] == 8 for r in rows), rows
    assert all(r["rl/rollout_logprob_gap"] < GAP for r in rows), rows


def test_rl_ppo_distillation_with_vllm_scores_the_engines_tokens(task):
    """On-policy distillation with vLLM sampling (``--teacher_pretrain``, loss mode): the teacher here is the
    student's own starting weights, so at the first iteration the teacher's log-prob of every sampled token equals
    the policy's old one and the reverse KL is 0 (a teacher that scored tokens shifted by one, or other tokens than
    vLLM sampled, would not give 0); after training it has moved away from 0; the engine stays on the policy
    through every sync."""
    root, model = task
    argv = grpo(root, model, "distill", 4) + ["--teacher_pretrain", str(model), "--distill_mode", "loss",
                                              "--distill_coef", "0.1"]
    out = run_cli("rl_cli.train_ppo", argv)
    assert "rollout VLLMEngine" in out.stdout, out.stdout[-2000:]
    rows = metrics(root / "distill")
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert all(r["rl/rollout_logprob_gap"] < GAP for r in rows), [r["rl/rollout_logprob_gap"] for r in rows]
    kl = [r["rl/distill/reverse_kl"] for r in rows]
    assert abs(kl[0]) < 1e-5 and abs(kl[-1]) > 1e-3, kl
    assert all(r["rl/distill_loss"] >= 0 for r in rows)
