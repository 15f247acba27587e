"""``rl ppo-ray --rollout_engine vllm --async_train``: the producer thread of rl-core's loop
(:mod:`rl_core.rl.pipeline`) generates the next batch on a vLLM engine actor (CPU, logical GPUs, weights over the
gloo broadcast) while the policy actor trains on this one (run in .venv-vllm).

The vLLM half of test_cli_async_ray.py (HF engine actors), checked the same way from ``metrics.jsonl``: the
staleness bound on every sample, that generation ran ahead of training, that the trainer's log-probs match the
engine's on the fresh batch and lie within a small off-policy gap on the stale ones; with ``--partial_rollout``
(the engine actor samples 1 token per chunk while the weight broadcast arrives on another of its threads), that
the sync after iteration 2 lands inside batch 3's responses. Also what ``--async_train`` over Ray refuses.
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

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.slow,
    pytest.mark.timeout(900),
    pytest.mark.skipif(torch.cuda.is_available(), reason=VLLM_CPU_TESTS_ON_CUDA),
]
REWARD = "def letter(prompt, response, label, **info):\n    return min(response.count(label), 8) / 8\n"
GAP = 1e-3  # fp32 vLLM against the trainer's recomputation (test_cli_vllm_loop.py)


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    from rl_rollout.testing import make_tiny_model

    root = tmp_path_factory.mktemp("vllm-async-ray")
    model = make_tiny_model(root / "tiny")
    (root / "prompts.jsonl").write_text(
        "".join(json.dumps({"prompt": f"Repeat the letter {c}: ", "label": c}) + "\n" for c in "abcdefgh")
    )
    (root / "reward.py").write_text(REWARD)
    return root, model


def argv(root, model, run, *extra):
    return [
        "--pretrain", str(model), "--prompt_data", str(root / "prompts.jsonl"), "--input_key", "prompt",
        "--label_key", "label", "--reward_fn", f"{root / 'reward.py'}:letter", "--advantage_estimator", "group_norm",
        "--init_kl_coef", "0", "--n_samples_per_prompt", "4", "--rollout_batch_size", "4", "--train_batch_size", "16",
        "--micro_train_batch_size", "8", "--max_iterations", "3", "--bf16", "false", "--zero_stage", "0",
        "--seed", "1", "--rollout_engine", "vllm", "--enforce_eager", "--async_train", "--max_staleness", "1",
        "--run_dir", str(root / run), *extra,
    ]  # fmt: skip


def run_ray(args, timeout=850):
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env.update(
        VLLM_CPU_KVCACHE_SPACE=os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"),
        RAY_DEDUP_LOGS="0",
        RAY_ENABLE_UV_RUN_RUNTIME_ENV="0",
    )
    out = subprocess.run(
        [sys.executable, "-m", "rl_cli.train_ppo_ray", *args], capture_output=True, text=True, timeout=timeout, env=env
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-6000:]
    return out


def rows_of(path):
    return [json.loads(x) for x in (path / "metrics.jsonl").read_text().splitlines()]


def test_rl_ppo_ray_async_with_a_vllm_engine_actor_generates_ahead_within_the_bound(task):
    root, model = task
    out = run_ray(
        argv(
            root, model, "separate", "--generate_max_len", "8", "--num_gpus", "2", "--actor_num_gpus_per_node", "1",
            "--vllm_num_engines", "1",
        )
    )  # fmt: skip
    assert "1 engine(s) VLLMEngine" in out.stdout and "weight sync gloo" in out.stdout, out.stdout[-2000:]
    rows = rows_of(root / "separate")
    assert [r["step"] for r in rows] == [1, 2, 3]
    # every sample within the bound: the largest lag of any sample is at most --max_staleness, none counted over
    assert all(r["rl/staleness_max"] <= 1 and r["rl/staleness_violations"] == 0 for r in rows), rows
    assert [r["rl/policy_version_trained"] for r in rows] == [0, 1, 2]
    # overlap: batches 2 and 3 came from the version before the previous iteration's sync, so they were
    # generated while that iteration trained, and the trainer waited for them less than generating took
    assert [r["rl/policy_version_generated"] for r in rows] == [0, 0, 1], rows
    for r in rows[1:]:
        assert r["rl/rollout_wait_s"] < r["rl/generate_s"], r
    # the first batch is the training policy's own: the engine's log-probs are the trainer's
    assert rows[0]["rl/rollout_logprob_gap"] < GAP, rows[0]
    # the stale ones lag one optimizer step: a gap that is there (the weights moved) and small (tis corrects it)
    for r in rows[1:]:
        assert 0 < r["rl/stale_logprob_gap"] < 0.05, r


def test_rl_ppo_ray_partial_rollout_in_chunks_with_a_vllm_engine_actor_lands_a_sync_mid_response(task):
    """``--colocate_all_models`` (the vLLM engine awake beside the policy on one logical GPU) with
    ``--partial_rollout --partial_rollout_mode chunks``: the engine actor takes the gloo broadcast on another thread while its generate samples
    1 token per chunk (the engine lock is released between chunks, and a waiting update goes first), so the sync
    after iteration 2 lands inside batch 3's responses (64 chunks; the iteration it waits on is a few chunks
    long). Every token carries its version, and the bound holds on each."""
    root, model = task
    out = run_ray(
        argv(
            root, model, "hybrid", "--generate_max_len", "64", "--partial_rollout", "--partial_rollout_mode",
            "chunks", "--partial_rollout_tokens", "1", "--num_gpus", "1", "--colocate_all_models",
            "--vllm_num_engines", "1",
        )
    )  # fmt: skip
    assert "1 engine(s) VLLMEngine" in out.stdout and "weight sync gloo" in out.stdout, out.stdout[-2000:]
    assert "partial rollouts: chunks" in out.stderr, out.stderr[-2000:]
    rows = rows_of(root / "hybrid")
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all(r["rl/staleness_max"] <= 1 and r["rl/staleness_violations"] == 0 for r in rows), rows
    assert all(0 <= r["rl/token_staleness_mean"] <= r["rl/staleness_max"] for r in rows), rows
    # batch 3 started after sync 1 and was sampling when sync 2 came: its responses span two versions
    assert rows[2]["rl/policy_version_generated"] == 1 and rows[2]["rl/partial_fraction"] > 0, rows[2]
    assert rows[2]["rl/token_staleness_mean"] < 1, rows[2]  # some of its tokens came from version 2, the trained one
    assert rows[0]["rl/rollout_logprob_gap"] < GAP, rows[0]
    assert all(0 < r["rl/stale_logprob_gap"] < 0.05 for r in rows[1:]), rows


def test_rl_ppo_ray_partial_rollout_keeps_requests_in_the_vllm_engine_actor_across_a_sync(task):
    """``--partial_rollout`` on a vLLM engine (``--partial_rollout_mode auto``: keep): the engine actor keeps its
    unfinished requests in vLLM while the gloo broadcast arrives on another of its threads (paused between two
    engine steps, resumed with the new weights, nothing re-submitted), so the sync after iteration 2 lands inside
    batch 3's responses (256 engine steps; the iteration it waits on is a few of them long). vLLM labels every
    token with the weights that sampled it; the bound holds on each."""
    root, model = task
    out = run_ray(
        argv(
            root, model, "keep", "--generate_max_len", "256", "--partial_rollout", "--num_gpus", "1",
            "--colocate_all_models", "--vllm_num_engines", "1",
        )
    )  # fmt: skip
    assert "1 engine(s) VLLMEngine" in out.stdout and "weight sync gloo" in out.stdout, out.stdout[-2000:]
    assert "partial rollouts: keep (unfinished requests kept in vLLM" in out.stderr, out.stderr[-2000:]
    rows = rows_of(root / "keep")
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all(r["rl/staleness_max"] <= 1 and r["rl/staleness_violations"] == 0 for r in rows), rows
    assert all(0 <= r["rl/token_staleness_mean"] <= r["rl/staleness_max"] for r in rows), rows
    assert rows[2]["rl/policy_version_generated"] == 1 and rows[2]["rl/partial_fraction"] > 0, rows[2]
    assert rows[2]["rl/token_staleness_mean"] < 1, rows[2]  # some of its tokens came from version 2, the trained one
    assert rows[0]["rl/rollout_logprob_gap"] < GAP, rows[0]
    # a kept request's tokens after the sync come from the new weights over the old weights' KV cache: the
    # trainer recomputes them with its own weights throughout, a gap that tis corrects and that stays small
    assert all(0 < r["rl/stale_logprob_gap"] < 0.05 for r in rows[1:]), rows


@pytest.mark.parametrize(
    "extra, says",
    [
        (["--vllm_enable_sleep"], "drop --vllm_enable_sleep (or --async_train)"),
        (["--max_staleness", "0", "--partial_rollout"], "raise --max_staleness to 1, or drop --partial_rollout"),
        (["--partial_rollout_tokens", "4"], "add --partial_rollout, or drop --partial_rollout_tokens"),
    ],
    ids=["sleeping-engines", "partial-without-staleness", "chunk-without-partial"],
)
def test_rl_ppo_ray_async_with_vllm_refuses_what_it_cannot_do_before_anything_loads(task, capsys, extra, says):
    """Sleeping engines (they would sleep while the producer generates), and partial rollouts settings that would
    do nothing: refused in one line naming the flag and the fix, before the run's folder, Ray or a model."""
    from rl_cli.main import main

    root, model = task
    run = "refused-" + extra[0].strip("-")
    args = argv(root, model, run, "--num_gpus", "1", "--colocate_all_models", "--vllm_num_engines", "1", *extra)
    if "--max_staleness" in extra:  # the later value wins; drop argv's own
        i = args.index("--max_staleness")
        del args[i : i + 2]
    with pytest.raises(SystemExit):
        main(["ppo-ray", *args])
    err = capsys.readouterr().err
    assert says in err and len(err.strip().splitlines()[-1]) < 400, err
    assert not (root / run).exists()
