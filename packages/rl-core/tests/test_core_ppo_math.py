"""The loop's math against what it must compute: log-probs at the sampling temperature, Dr. GRPO's constant
normaliser, GSPO and the IS thresholds reaching the loss, the log-prob gap alarm, and every registered
estimator training the demo task in the loop (tiny model, CPU, real DeepSpeed and HFEngine, seeded)."""

from __future__ import annotations

import json

import pytest
import torch

from rl_algos import GSPOLossConfig, PolicyLossConfig, estimator_names
from rl_core.data import DataConfig, PromptDataset, load_rows
from rl_core.rl import PolicyObjective, PolicyWorker, make_item
from rl_core.rl.build import LocalFactory, RLModelConfig, RunConfig, build_run
from rl_core.strategy import StrategyConfig
from rl_core.trainers.ppo import PPOConfig
from rl_rollout import EngineConfig, WeightSyncConfig

pytestmark = [pytest.mark.timeout(900), pytest.mark.slow]
LETTERS = "abcd"


def letter_reward(prompt, response, label, **info):
    return min(response.count(label), 8) / 8


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from transformers import AutoTokenizer

    from rl_rollout.testing import make_tiny_model

    root = tmp_path_factory.mktemp("ppo-math")
    model = make_tiny_model(root / "tiny")
    (root / "prompts.jsonl").write_text(
        "".join(json.dumps({"p": f"Repeat the letter {c}: ", "y": c}) + "\n" for c in LETTERS))
    tok = AutoTokenizer.from_pretrained(model)
    prompts = PromptDataset(load_rows(str(root / "prompts.jsonl")), tok, DataConfig(input_key="p", label_key="y"))
    return model, tok, prompts


def build(setup, tmp_path, *, lr=3e-3, seed=0, engine=None, **cfg):
    from rl_rollout import RewardRunner

    model, tok, prompts = setup
    kw = dict(n_samples_per_prompt=8, rollout_batch_size=4, generate_max_len=8, max_iterations=2, init_kl_coef=0.0,
              run_dir=str(tmp_path / "run"))
    kw.update(cfg)
    c = PPOConfig.from_flat(**kw)
    G = c.rollout_batch_size * c.sampling.n_samples_per_prompt
    s = StrategyConfig(zero_stage=0, bf16=False, micro_train_batch_size=G // 2, train_batch_size=G, learning_rate=lr,
                       lr_warmup_ratio=0.0, lr_scheduler="constant", seed=seed)
    return build_run(RunConfig(RLModelConfig(pretrain=str(model)), s, c, engine=engine or EngineConfig(),
                               sync=WeightSyncConfig(verify=True)),
                     LocalFactory(engine_kind="hf"),
                     prompts=prompts, tokenizer=tok, reward_fn=RewardRunner(letter_reward, workers=0))


def test_trainer_logprobs_use_the_sampling_temperature(setup, tmp_path):
    """At T=0.7 the engine samples from softmax(logits / 0.7); the trainer must score the same distribution
    (before the fix the gap was the difference between T=1 and T=0.7 log-probs, ~1e-1)."""
    run = build(setup, tmp_path, temperature=0.7, init_kl_coef=0.01, advantage_estimator="group_norm")
    h = run.trainer.fit()
    run.close()
    assert all(m["rollout_logprob_gap"] < 1e-4 for m in h), [m["rollout_logprob_gap"] for m in h]
    assert h[0]["kl"] < 1e-6  # before any update the policy is the reference


def test_dr_grpo_divides_by_the_generation_budget_not_the_padded_length(setup):
    """ratio 1 (old log-probs = current), one advantage a_i per sequence of L_i response tokens:
    seq-mean-token-sum-norm = -mean_i(a_i * L_i) / generate_max_len, whatever the padded batch length."""
    model, tok, _ = setup
    c = PPOConfig.from_flat(advantage_estimator="dr_grpo", n_samples_per_prompt=2, generate_max_len=16, init_kl_coef=0,
                  loss_agg_mode="seq-mean-token-sum-norm")
    s = StrategyConfig(zero_stage=0, bf16=False, micro_train_batch_size=4, train_batch_size=4, learning_rate=0.0,
                       lr_warmup_ratio=0.0, lr_scheduler="constant")
    w = PolicyWorker(s, model, PolicyObjective.of(c), 1, load_kw={"dtype": "fp32"}, pad_id=tok.pad_token_id)
    lengths, adv = [3, 5, 2, 6], [1.0, -0.5, 2.0, 0.25]
    items = [make_item(tok.encode(f"Repeat the letter {x}: "), tok.encode(x * n)) for x, n in zip("abcd", lengths)]
    for it, lp, a in zip(items, w.logprobs(items), adv, strict=True):
        it.old_logprobs_T = lp
        it.advantages_T = torch.tensor(it.loss_mask_T, dtype=torch.float32) * a
    got = w.train(items)[0]["policy_loss"]
    want = -sum(a * n for a, n in zip(adv, lengths)) / len(adv) / 16
    assert got == pytest.approx(want, rel=1e-5, abs=1e-7)  # padded length here is 24, not 16


def test_gspo_and_is_thresholds_reach_the_loss_from_the_config():
    c = PPOConfig(policy_loss=PolicyLossConfig("gspo", is_correction="icepop", is_correction_threshold=(0.8, 1.25),
                                               eps_clip=3e-4, eps_clip_high=4e-4))
    loss = c.policy_loss_variant()
    assert isinstance(loss, GSPOLossConfig) and loss.ratio_type == "sequence"
    assert (loss.clip_eps_low, loss.clip_eps_high) == (3e-4, 4e-4)
    assert (loss.is_correction.kind, loss.is_correction.low, loss.is_correction.high) == ("icepop", 0.8, 1.25)
    with pytest.raises(ValueError, match=r"unknown policy loss type 'grpo'; valid: gspo, ppo"):
        PolicyLossConfig("grpo")
    with pytest.raises(ValueError, match=r"low <= high.*--is_correction_threshold"):
        PPOConfig.from_flat(is_correction="tis", is_correction_threshold=(2.0, 1.0))


def test_gspo_with_tis_trains_in_the_loop(setup, tmp_path):
    run = build(setup, tmp_path, advantage_estimator="group_norm", policy_loss_type="gspo", is_correction="tis",
                max_iterations=2)
    h = run.trainer.fit()
    run.close()
    assert all(torch.isfinite(torch.tensor(m["policy_loss"])) for m in h)


def test_a_stale_engine_raises_the_logprob_gap_alarm(setup, tmp_path, caplog):
    """A sync that moves nothing (the silent failure) while the policy learns fast: the gap crosses the
    threshold, a warning names the likely causes, and rl/logprob_gap_alarm counts it."""
    run = build(setup, tmp_path, advantage_estimator="group_norm", max_iterations=4, lr=2e-2, logprob_gap_alarm=1e-3)
    run.trainer.weight_sync = lambda version: {}
    with caplog.at_level("WARNING"):
        h = run.trainer.fit()
    run.close()
    assert h[0]["logprob_gap_alarm"] == 0.0 and h[-1]["logprob_gap_alarm"] == 1.0, [m["rollout_logprob_gap"] for m in h]
    assert "stale weights in the engine" in caplog.text and "--logprob_gap_alarm" in caplog.text
    lines = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert lines[-1]["rl/logprob_gap_alarm"] == 1.0


def test_sleep_level_2_wakes_the_weights_syncs_then_wakes_the_cache(setup, tmp_path):
    run = build(setup, tmp_path, advantage_estimator="group_norm", max_iterations=2,
                engine=EngineConfig(enable_sleep=True, sleep_level=2))
    calls = []
    engine = run.rollout
    sleep, wake = engine.sleep, engine.wake_up
    engine.sleep = lambda level=1: calls.append(("sleep", level)) or sleep(level)
    engine.wake_up = lambda tags=None: calls.append(("wake", tags)) or wake(tags)
    worker = run.policy.worker  # before the engines wake, the trainers give back torch's cached device memory
    release = worker.release_device_cache
    worker.release_device_cache = lambda: calls.append(("release", None)) or release()
    h = run.trainer.fit()
    run.close()
    assert calls == [("sleep", 2), ("release", None), ("wake", ["weights"]), ("wake", ["kv_cache"])] * 2
    assert all("device_cache_freed_gb" not in m for m in h)  # CUDA only: nothing is cached on the CPU
    assert all(m["rollout_logprob_gap"] < 1e-4 for m in h)


def test_a_sync_that_drops_a_tensor_fails_loudly_naming_it(setup, tmp_path):
    """With verify on (the tests' default), an engine that did not take every tensor stops the run."""
    from rl_rollout import WeightSyncError

    run = build(setup, tmp_path, advantage_estimator="group_norm", max_iterations=2)
    engine, update = run.rollout, run.rollout.update_weights
    engine.update_weights = lambda named, version: update(
        ((n, t) for n, t in named if n != "model.embed_tokens.weight"), version)
    with pytest.raises(WeightSyncError, match=r"model.embed_tokens.weight: sum"):
        run.trainer.fit()
    run.close()


def test_one_step_per_batch_skips_the_old_logprob_forward_and_trains_the_same(setup, tmp_path):
    """max_epochs 1, one global batch per iteration, no KL penalty: the old log-probs are the train forward's
    (the weights have not moved since sampling), so the experience phase skips the policy forward. The run
    must equal the one that computes them (rewards, losses, gap), within fp32 rounding."""
    kw = dict(advantage_estimator="group_norm", max_iterations=3, max_epochs=1)
    fast = build(setup, tmp_path / "fast", **kw)
    assert fast.trainer.on_policy
    calls = []
    logprobs = fast.policy.worker.logprobs
    fast.policy.worker.logprobs = lambda items: calls.append(len(items)) or logprobs(items)
    a = fast.trainer.fit()
    fast.close()
    assert calls == []  # no separate old-logprob forward
    slow = build(setup, tmp_path / "slow", **kw)
    slow.trainer.on_policy = False
    b = slow.trainer.fit()
    slow.close()
    for x, y in zip(a, b, strict=True):
        assert x["reward_mean"] == pytest.approx(y["reward_mean"], abs=1e-6)
        assert x["policy_loss"] == pytest.approx(y["policy_loss"], abs=1e-5)
        assert x["rollout_logprob_gap"] < 1e-4 and y["rollout_logprob_gap"] < 1e-4


@pytest.mark.parametrize("estimator", estimator_names())
def test_every_estimator_raises_the_reward_in_the_loop(setup, tmp_path, estimator):
    extra = {"loss_agg_mode": "seq-mean-token-sum-norm"} if estimator == "dr_grpo" else {}
    run = build(setup, tmp_path, advantage_estimator=estimator, max_iterations=14, max_epochs=2, **extra)
    assert (run.critic is not None) == (estimator == "gae")
    h = run.trainer.fit()
    run.close()
    first = sum(m["reward_mean"] for m in h[:4]) / 4
    last = sum(m["reward_mean"] for m in h[-4:]) / 4
    assert last > first + 0.05, (estimator, [round(m["reward_mean"], 3) for m in h])
