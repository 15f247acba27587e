"""``async_train``: the next batch is generated while the policy trains, no sample lags the policy it trains by
more than ``max_staleness`` versions, and the demo task still learns (tiny model, CPU, real DeepSpeed and
HFEngine), with DeepSpeed sleep too (all but the weights sleep until the train step). The pipeline's gate is also
checked alone, against a producer that would run ahead without it."""

from __future__ import annotations

import json
import threading
import time

import pytest
import torch

from rl_core.configs import AsyncConfig
from rl_core.data import DataConfig, PromptDataset, load_rows
from rl_core.rl.build import LocalFactory, RLModelConfig, RunConfig, build_run
from rl_core.rl.pipeline import AsyncRollout
from rl_core.strategy import StrategyConfig
from rl_core.trainers.ppo import PPOConfig
from rl_rollout import EngineConfig, RewardRunner, WeightSyncConfig
from rl_rollout.partial_modes import PartialRolloutMode, set_partial_rollout

pytestmark = [pytest.mark.timeout(900), pytest.mark.slow]


def letter_reward(prompt, response, label, **info):
    return min(response.count(label), 8) / 8


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from transformers import AutoTokenizer

    from rl_rollout.testing import make_tiny_model

    root = tmp_path_factory.mktemp("ppo-async")
    model = make_tiny_model(root / "tiny")
    (root / "prompts.jsonl").write_text(
        "".join(json.dumps({"p": f"Repeat the letter {c}: ", "y": c}) + "\n" for c in "abcd"))
    tok = AutoTokenizer.from_pretrained(model)
    prompts = PromptDataset(load_rows(str(root / "prompts.jsonl")), tok, DataConfig(input_key="p", label_key="y"))
    return model, tok, prompts


def build(setup, tmp_path, zero_stage=0, reward=letter_reward, **cfg):
    model, tok, prompts = setup
    kw = dict(advantage_estimator="group_norm", n_samples_per_prompt=8, rollout_batch_size=4, generate_max_len=8,
              max_iterations=3, init_kl_coef=0.0, max_epochs=2, async_train=True, run_dir=str(tmp_path / "run"))
    kw.update(cfg)
    c = PPOConfig.from_flat(**kw)
    s = StrategyConfig(zero_stage=zero_stage, bf16=False, micro_train_batch_size=16, train_batch_size=32,
                       learning_rate=3e-3, lr_warmup_ratio=0.0, lr_scheduler="constant", seed=0)
    return build_run(RunConfig(RLModelConfig(pretrain=str(model)), s, c, engine=EngineConfig(),
                               sync=WeightSyncConfig(verify=True)),
                     LocalFactory(engine_kind="hf"), prompts=prompts, tokenizer=tok,
                     reward_fn=RewardRunner(reward, workers=0))


def rows(tmp_path):
    return [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]


def test_async_grpo_learns_the_demo_task_within_the_staleness_bound(setup, tmp_path):
    """ZeRO-2 with DeepSpeed sleep, as OpenRLHF's async agent script runs (its states sleep between train steps)."""
    run = build(setup, tmp_path, max_iterations=16, max_staleness=1, zero_stage=2, deepspeed_enable_sleep=True)
    assert not run.trainer.on_policy  # the old log-probs must come from the policy's forward
    assert run.trainer.cfg.policy_loss_variant().is_correction.kind == "tis"  # off-policy samples are corrected
    try:
        run.trainer.fit()
    finally:
        run.close()
    r = rows(tmp_path)
    assert [x["step"] for x in r] == list(range(1, 17))
    for x in r:  # the bound, per iteration, from the versions the samples carry
        lag = x["rl/policy_version_trained"] - x["rl/policy_version_generated"]
        assert 0 <= lag <= 1, x
        assert x["rl/policy_version_trained"] == x["step"] - 1
        assert x["rl/staleness_violations"] == 0
        assert x["rl/staleness_max"] == lag
    # the pipeline really ran ahead: after the first batch, batches came from the previous version
    assert sum(x["rl/staleness_max"] == 1 for x in r) >= 8, [x["rl/staleness_max"] for x in r]
    assert r[0]["rl/rollout_logprob_gap"] < 1e-3  # version 0 generated and trains the first batch: same weights
    rewards = [x["rl/reward_mean"] for x in r]
    first, last = sum(rewards[:4]) / 4, sum(rewards[-4:]) / 4
    assert last > first + 0.04, rewards  # measured: 0.06 -> 0.17
    assert all(x["rl/ds_sleep_gb"] > 0 and x["rl/ds_wake_s"] > 0 for x in r)


def test_deepspeed_sleep_in_async_training_keeps_the_weights_and_changes_nothing(setup, tmp_path):
    """--deepspeed_enable_sleep with --async_train: the policy's forwards overlap the sampling, so its weights
    stay; the fp32 master weights, Adam moments and gradient buffers (OpenRLHF's offload_deepspeed_states list)
    sleep from the iteration's start through the experience forwards and are back for the train step. ZeRO-2 on
    DeepSpeed's CPU accelerator, max_staleness 0 (a fixed schedule): the run is the one without sleep, loss for
    loss and weight for weight."""
    from deepspeed.runtime.zero.offload_config import OffloadStateTypeEnum as S

    runs, hist, seen = {}, {}, []
    for on in (False, True):
        runs[on] = run = build(setup, tmp_path / str(on), zero_stage=2, max_staleness=0, deepspeed_enable_sleep=on)
        w = run.trainer.policy.worker
        for name in ("logprobs", "train") if on else ():  # what is asleep when each phase runs
            def spy(*a, _f=getattr(w, name), _name=name, **k):
                seen.append((_name, set(w.engine.optimizer.offloaded_states)))
                return _f(*a, **k)
            setattr(w, name, spy)
        try:
            hist[on] = run.trainer.fit()
        finally:
            run.close()
    asleep = {S.optim_states, S.hp_params, S.lp_grads}  # not S.lp_params: the weights
    assert seen == [("logprobs", asleep), ("train", set())] * 3
    for k in ("policy_loss", "reward_mean", "clip_fraction"):
        assert [m[k] for m in hist[True]] == pytest.approx([m[k] for m in hist[False]], abs=1e-6), k
    a, b = (dict(runs[on].trainer.policy.worker.engine.module.named_parameters()) for on in (False, True))
    for name, p in a.items():
        torch.testing.assert_close(b[name], p, rtol=0, atol=1e-6)
    assert not runs[True].trainer.policy.worker.engine.optimizer.offloaded_states
    n = sum(p.numel() for p in a.values())
    # the fp32 master copy; from the second iteration on also the two Adam moments (the weights stay)
    assert [m["ds_sleep_gb"] for m in hist[True]] == pytest.approx([4 * n / 1e9] + [12 * n / 1e9] * 2, abs=1e-6)
    assert all(m["ds_sleep_s"] > 0 and m["ds_wake_s"] > 0 for m in hist[True])


def test_max_staleness_0_is_the_synchronous_schedule(setup, tmp_path):
    """Every batch waits for the previous iteration's sync: generated by the very policy it trains, so the
    engine's log-probs equal the trainer's (a batch that ran ahead would show a gap of 0.1 to 0.4 here)."""
    run = build(setup, tmp_path, max_iterations=3, max_staleness=0)
    try:
        run.trainer.fit()
    finally:
        run.close()
    r = rows(tmp_path)
    assert [x["rl/staleness_max"] for x in r] == [0, 0, 0]
    assert [x["rl/policy_version_generated"] for x in r] == [0, 1, 2]
    assert all(x["rl/rollout_logprob_gap"] < 1e-3 and "rl/stale_logprob_gap" not in x for x in r)


def test_oversampling_generates_once_for_two_iterations_and_resumes_at_the_buffer(setup, tmp_path):
    """--vllm_generate_batch_size 8 with --rollout_batch_size 4 (OpenRLHF's over-sampling): a round every other
    iteration, the second batch served from the buffer, its samples one version staler than --max_staleness 1
    alone would allow, within the bound the metrics check; a checkpoint resumes at the first buffered prompt."""
    run = build(setup, tmp_path, max_iterations=4, max_staleness=1, generate_batch_size=8,
                ckpt_path=str(tmp_path / "ckpt"), save_steps=1, max_ckpt_num=5)
    assert run.trainer.cfg.staleness_bound == 1 + (8 + 4 - 2) // 4
    try:
        run.trainer.fit()
    finally:
        run.close()
    r = rows(tmp_path)
    assert [x["rl/dynamic/rounds"] for x in r] == [1, 0, 1, 0]
    assert [x["rl/oversample/buffered"] for x in r] == [4, 0, 4, 0]
    assert all(x["rl/staleness_violations"] == 0 for x in r)
    # batch 2 was generated with batch 1, by version 0, and trains version 1; batch 4 with batch 3
    assert r[1]["rl/policy_version_generated"] == 0 and r[1]["rl/staleness_max"] == 1
    assert r[3]["rl/policy_version_generated"] == r[2]["rl/policy_version_generated"]
    assert max(x["rl/staleness_max"] for x in r) <= run.trainer.cfg.staleness_bound
    # resume points: after batch 1 the prompts of batch 2 (positions 4-7) wait in the buffer, so cursor 4
    states = {int(p.parent.name.rsplit("_", 1)[-1]): json.loads(p.read_text())
              for p in (tmp_path / "ckpt").rglob("loop_state.json")}
    assert {k: v["cursor"] for k, v in sorted(states.items())} == {1: 4, 2: 8, 3: 12, 4: 16}, states


def a_is_always_right(prompt, response, label, **info):
    """Every sample of an 'a' prompt scores 1 (no variance: dynamic filtering drops the group); the others score
    the parity of their characters' codes, which varies within a group."""
    return 1.0 if label == "a" else float(sum(map(ord, response)) % 2)


def test_oversampling_with_dynamic_filtering_buffers_what_passes(setup, tmp_path):
    """B 4, G 8 over 4 prompts (a, b, c, d): each round of 8 drops the two 'a' groups and keeps 6, so the buffer
    goes 2, 4 (the second round tops 2 up with 6), 0 (served, no round), 2; kept fraction 0.75 per round."""
    run = build(setup, tmp_path, reward=a_is_always_right, max_iterations=4, generate_batch_size=8,
                dynamic_filtering=True, dynamic_filtering_reward_range=(-0.5, 0.99))
    try:
        run.trainer.fit()
    finally:
        run.close()
    r = rows(tmp_path)
    assert [x["rl/dynamic/rounds"] for x in r] == [1, 1, 0, 1]
    assert [x["rl/oversample/buffered"] for x in r] == [2, 4, 0, 2]
    assert [x.get("rl/dynamic/kept_fraction") for x in r] == [0.75, 0.75, None, 0.75]
    assert all(x["rl/dynamic/filled"] == 0 and x["rl/staleness_violations"] == 0 for x in r)


def test_oversampling_flags_are_checked():
    with pytest.raises(ValueError, match="--generate_batch_size 2 is below --rollout_batch_size 4"):
        PPOConfig.from_flat(rollout_batch_size=4, generate_batch_size=2, async_train=True)
    with pytest.raises(ValueError, match="generate_batch_size set async_train's settings: add async_train=True"):
        PPOConfig.from_flat(rollout_batch_size=4, generate_batch_size=8)  # over-sampling is async's: refused without
    assert PPOConfig(rollout_batch_size=4, async_rl=AsyncConfig(generate_batch_size=4)).staleness_bound == 1
    assert PPOConfig.from_flat(rollout_batch_size=4, generate_batch_size=6, async_train=True).staleness_bound == 3


def test_async_refuses_sleeping_engines_and_a_bound_without_async(setup, tmp_path):
    with pytest.raises(ValueError, match="cannot sleep"):
        model, tok, prompts = setup
        c = PPOConfig.from_flat(advantage_estimator="group_norm", n_samples_per_prompt=8, rollout_batch_size=4,
                      init_kl_coef=0.0, async_train=True, run_dir=str(tmp_path / "run"))
        s = StrategyConfig(zero_stage=0, bf16=False, micro_train_batch_size=16, train_batch_size=32)
        build_run(RunConfig(RLModelConfig(pretrain=str(model)), s, c, engine=EngineConfig(enable_sleep=True)),
                  LocalFactory(engine_kind="hf"), prompts=prompts, tokenizer=tok, reward_fn=letter_reward)
    with pytest.raises(ValueError, match="max_staleness set async_train's settings: add async_train=True"):
        PPOConfig.from_flat(max_staleness=2)
    with pytest.raises(ValueError, match="must be >= 0"):
        PPOConfig.from_flat(async_train=True, max_staleness=-1)


@pytest.mark.parametrize("bound", [0, 1, 2])
def test_the_gate_holds_a_producer_that_would_run_ahead(bound):
    """``collect`` is instant and the trainer slow: without the gate every batch would come from version 0."""
    seen, version = {}, [0]

    def collect(k):
        seen[k] = version[0]
        return k

    p = AsyncRollout(collect, 1, 8, max_staleness=bound, version=0)
    try:
        for k in range(1, 9):
            batch, _ = p.get(k)
            assert batch == k
            assert (k - 1) - seen[k] <= bound, (k, seen)  # trains version k-1
            time.sleep(0.02)  # the trainer is slower than the producer
            version[0] = k
            p.synced(k)
    finally:
        p.close()
    assert max((k - 1) - v for k, v in seen.items()) == bound  # it did run ahead as far as allowed


def test_a_producer_error_reaches_the_trainer_and_close_stops_a_waiting_producer():
    def collect(k):
        if k == 2:
            raise RuntimeError("reward server down")
        return k

    p = AsyncRollout(collect, 1, 5, max_staleness=3, version=0)
    assert p.get(1)[0] == 1
    with pytest.raises(RuntimeError, match="reward server down"):
        p.get(2)
    p.close()
    waiting = AsyncRollout(lambda k: k, 1, 5, max_staleness=0, version=0)
    assert waiting.get(1)[0] == 1  # batch 2 waits for version 1, which never comes
    waiting.close(timeout=5)
    assert not any(t.name == "rl-async-rollout" and t.is_alive() for t in threading.enumerate())


def test_paused_drains_the_batch_in_flight_and_starts_none_until_the_block_ends():
    """The eval pass's hold on the producer: entering waits for the collect in flight, inside none runs."""
    running, log = threading.Event(), []

    def collect(k):
        log.append(("start", k))
        if k == 2:
            running.set()
            time.sleep(0.3)  # batch 2 is in flight when the trainer pauses
        log.append(("end", k))
        return k

    p = AsyncRollout(collect, 1, 4, max_staleness=5, version=0)
    try:
        assert p.get(1)[0] == 1
        assert running.wait(5)
        with p.paused() as drained_s:
            assert drained_s >= 0.1 and log[-1] == ("end", 2)  # it waited for batch 2 to finish
            seen = len(log)
            time.sleep(0.2)
            assert len(log) == seen  # batch 3 (allowed by the gate) does not start while paused
        assert p.get(3)[0] == 3 and p.get(4)[0] == 4  # and starts after
        assert [e for e in log if e[0] == "start"] == [("start", k) for k in range(1, 5)]
    finally:
        p.close()


def test_partial_rollouts_let_the_sync_land_mid_batch_with_every_token_tagged(setup, tmp_path):
    """Generation (32 tokens in chunks of 2) is slower than training here, so each sync lands while the next
    batch is being sampled: its responses continue with the new weights, and every token's version lies within
    the bound of the policy it trains."""
    run = build(setup, tmp_path, max_iterations=5, max_staleness=1, partial_rollout=True, partial_rollout_tokens=2,
                generate_max_len=32, max_epochs=1)
    batches = []
    collect = run.trainer.sampler.collect

    def collect_and_keep(it):
        out = collect(it)
        batches.append((it, out.samples))
        return out

    run.trainer.sampler.collect = collect_and_keep
    try:
        run.trainer.fit()
    finally:
        run.close()
    r = rows(tmp_path)
    assert all(x["rl/staleness_violations"] == 0 for x in r)
    for it, samples in batches:
        for s in samples:
            v = s.info["token_versions"]
            assert v == sorted(v) and it - 2 <= v[0] and v[-1] <= it - 1, (it, v)  # trains version it - 1
    assert sum(x["rl/partial_fraction"] > 0 for x in r) >= 2, [x["rl/partial_fraction"] for x in r]
    assert any(len(set(s.info["token_versions"])) > 1 for _, b in batches for s in b)
    with pytest.raises(ValueError, match="partial_rollout set async_train's settings: add async_train=True"):
        PPOConfig.from_flat(partial_rollout=True)


def test_partial_rollout_settings_that_would_do_nothing_are_refused():
    """--max_staleness 0 starts each generation after the sync it waits for (no sync can land mid-response), and
    a chunk size without --partial_rollout has nothing to size: each refused in one line naming the fix."""
    with pytest.raises(ValueError, match="--max_staleness 0 starts every generation after the sync.*raise --max_st"):
        AsyncConfig(max_staleness=0, partial_rollout=True)
    with pytest.raises(ValueError, match="--partial_rollout_tokens 4 sets the chunk of --partial_rollout, which is off"):
        AsyncConfig(partial_rollout_tokens=4)
    with pytest.raises(ValueError, match="--partial_rollout_mode keep sets how --partial_rollout runs, which is off"):
        AsyncConfig(partial_rollout_mode=PartialRolloutMode.KEEP)
    assert AsyncConfig(max_staleness=0).max_staleness == 0  # the synchronous schedule alone stays allowed


def test_partial_rollout_mode_resolves_by_engine_and_refuses_keep_without_vllm():
    """auto: keep where the engine keeps requests (vLLM), chunks elsewhere (HF); --partial_rollout_tokens sizes
    the chunk, or the engine steps per turn in keep mode (each mode's default when unset). An explicit keep on an
    engine without it is refused naming the fix: from the flags (``check_engine``) and by the engine itself."""

    class Chunks:  # an HFEngine's partial-rollout surface
        partial_chunk_tokens = None

    class Keeps(Chunks):  # a VLLMEngine's
        keep_requests = None

    hf, vllm = Chunks(), Keeps()
    assert set_partial_rollout(hf, "auto", None) is PartialRolloutMode.CHUNKS and hf.partial_chunk_tokens == 16
    assert set_partial_rollout(hf, "chunks", 4) is PartialRolloutMode.CHUNKS and hf.partial_chunk_tokens == 4
    assert set_partial_rollout(vllm, "auto", None) is PartialRolloutMode.KEEP
    assert vllm.keep_requests.steps_per_turn == 1 and vllm.partial_chunk_tokens is None
    assert set_partial_rollout(Keeps(), "keep", 3).value == "keep"
    with pytest.raises(ValueError, match="the Chunks engine cannot: use --rollout_engine vllm, or --partial_rollout_m"):
        set_partial_rollout(Chunks(), "keep", None)
    with pytest.raises(ValueError, match="the object engine does neither.*drop --partial_rollout"):
        set_partial_rollout(object(), "auto", None)
    keep = AsyncConfig(partial_rollout=True, partial_rollout_mode=PartialRolloutMode("keep"))
    with pytest.raises(ValueError, match="--rollout_engine hf samples with transformers: use --rollout_engine vllm"):
        keep.check_engine("hf")
    keep.check_engine("vllm")
    keep.check_engine("auto")  # resolved when the engine is built, which then refuses as above
