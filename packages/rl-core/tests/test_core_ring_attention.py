"""Ring attention (rl_core.ring_attention) against one rank computing whole rows: two gloo ranks in one ring group
(tiny Llama with grouped KV heads, fp32, CPU, real DeepSpeed) give the one-rank log-probs, values and reward
scores, and after one policy and one critic step the same weights, from packed rows and from padded ones (packed
inside the forward); the SFT and DPO trainers give the one-rank losses, eval metrics and weights; the layout
helpers and the errors."""

from __future__ import annotations

import os

import pytest
import torch

from rl_core.models import RewardModel
from rl_core.rl import CriticObjective, CriticWorker, PolicyObjective, PolicyWorker, make_item
from rl_core.rl.batching import MicroBatchConfig
from rl_core.rl.experience import ring_shards
from rl_core.rl.frozen_workers import RewardModelWorker
from rl_core.strategy import StrategyConfig
from rl_core.trainers.ppo import PPOConfig

pytestmark = [pytest.mark.timeout(900), pytest.mark.slow]
LENGTHS = [(5, 3), (9, 20), (4, 1), (12, 7), (6, 30), (3, 2), (8, 11), (5, 4)]  # 129 tokens: odd, so the row pads


def test_ring_shards_repeat_each_data_parallel_shard_for_its_group():
    items = list(range(8))
    assert ring_shards(items, 4, 1) == items
    assert ring_shards(items, 4, 2) == [0, 1, 2, 3, 0, 1, 2, 3, 4, 5, 6, 7, 4, 5, 6, 7]
    assert ring_shards(items, 2, 2) == items + items
    with pytest.raises(ValueError, match="7 items cannot be split over 2 data-parallel shards"):
        ring_shards(items[:7], 4, 2)


def test_ring_sizes_that_cannot_be_placed_fail_in_one_line():
    from rl_core.ring_attention import check_sizes

    with pytest.raises(ValueError, match=r"--ring_attn_size 4 must divide the 6 ranks of the policy"):
        check_sizes(6, 4, 1, "the policy")
    with pytest.raises(ValueError, match=r"ring_attn_size.*>= 1"):
        StrategyConfig(ring_attn_size=0)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from rl_rollout.testing import make_tiny_model

    return str(make_tiny_model(tmp_path_factory.mktemp("ring") / "tiny", num_heads=4, num_kv_heads=2))


def items_of():
    g = torch.Generator().manual_seed(0)
    out = []
    for p, r in LENGTHS:
        ids = torch.randint(3, 128, (p + r,), generator=g).tolist()
        it = make_item(ids[:p], ids[p:])
        it.advantages_T = torch.tensor(it.loss_mask_T, dtype=torch.float32) * torch.randn(p + r, generator=g)
        it.values_T = torch.randn(p + r, generator=g) * 0.1
        it.returns_T = torch.randn(p + r, generator=g)
        out.append(it)
    return out


def strategy(ring: int, **kw) -> StrategyConfig:
    return StrategyConfig(zero_stage=0, bf16=False, micro_train_batch_size=2, train_batch_size=8, learning_rate=1e-4,
                          lr_warmup_ratio=0.0, lr_scheduler="constant", max_norm=0.0, ring_attn_size=ring, **kw)


def params(worker):
    return {n: p.detach().clone() for n, p in worker.engine.module.named_parameters()}


def run_roles(s: StrategyConfig, tiny: str, rm: str, attn: str | None, packing: bool = True) -> dict:
    """Every role's forward and one policy and critic step on the same 8 items (packed: a 40-token budget, so a
    36-token item alone and several rows of several items; padded: micro-batches of 2)."""
    kw = {"load_kw": {"dtype": "fp32", "attn_implementation": attn}, "packing": packing,
          "batching": MicroBatchConfig(max_tokens_per_gpu=40 if packing else None)}
    items = items_of()
    c = PPOConfig.from_flat(max_epochs=1, loss_agg_mode="seq-mean-token-mean", init_kl_coef=0.01, use_kl_loss=True)
    policy = PolicyWorker(s, tiny, PolicyObjective.of(c), 1, **kw)
    out = {"logprobs": policy.logprobs(items)}  # [] on a ring group's second rank
    full = policy._forward_items(lambda **x: policy.engine(**x).logprobs, items)  # every rank: the whole rows
    for it, lp in zip(items, full, strict=True):
        it.old_logprobs_T = lp.clone()
        it.ref_logprobs_T = lp - 0.01
    out["policy_metrics"] = policy.train(items, kl_coef=0.01)
    out["policy"] = params(policy)
    critic = CriticWorker(s, tiny, CriticObjective.of(c), 1, **kw)
    out["values"] = critic.values(items)
    out["critic_metrics"] = critic.train(items)
    out["critic"] = params(critic)
    out["scores"] = RewardModelWorker(s, rm, **kw).score(items)
    return out


SFT_ROWS = [{"q": f"reverse {w} " * (1 + i % 3), "a": w[::-1] * (1 + i % 4)}
            for i, w in enumerate(["abc", "hello", "xyz", "rl", "ppo", "grpo", "data", "kto"])]
PAIRS = [{"prompt": f"reverse {w}", "chosen": w[::-1] * (1 + i % 3) + ".", "rejected": w + "?"}
         for i, w in enumerate(["abc", "hello", "xyz", "rl", "ppo", "grpo", "data", "kto"])]


def run_offline(ring: int, tiny: str, attn: str | None) -> dict:
    """Two SFT steps (padded rows, an eval set) and two DPO steps (packed pairs, the NLL term, an eval set)."""
    from transformers import AutoTokenizer

    from rl_core.data import DataConfig, PreferenceDataset, SFTDataset
    from rl_core.models import Actor, frozen
    from rl_core.strategy import DeepSpeedStrategy
    from rl_core.trainers import DPOConfig, DPOTrainer, SFTConfig, SFTTrainer

    tok = AutoTokenizer.from_pretrained(tiny)
    s = StrategyConfig(zero_stage=2, bf16=False, micro_train_batch_size=2, train_batch_size=4, learning_rate=1e-4,
                       lr_warmup_ratio=0.0, lr_scheduler="constant", max_norm=0.0, ring_attn_size=ring)
    out = {}
    sft = SFTDataset(SFT_ROWS, tok, DataConfig(input_key="q", output_key="a", max_len=64))
    t = SFTTrainer(DeepSpeedStrategy(s), Actor.from_pretrained(tiny, dtype="fp32", attn_implementation=attn), tok,
                   sft, SFTConfig(max_epochs=1, eval_steps=1), eval_dataset=sft)
    out["sft_losses"], out["sft_eval"], out["sft"] = t.fit(), t.eval_history, params(t)
    pairs = PreferenceDataset(PAIRS, tok, DataConfig(prompt_key="prompt", max_len=64, packing=True))
    t = DPOTrainer(DeepSpeedStrategy(s), Actor.from_pretrained(tiny, dtype="fp32", attn_implementation=attn),
                   frozen(Actor.from_pretrained(tiny, dtype="fp32", attn_implementation=attn)), tok, pairs,
                   DPOConfig(max_epochs=1, nll_loss_coef=0.5, eval_steps=1), eval_dataset=pairs)
    out["dpo_losses"], out["dpo_eval"], out["dpo"] = t.fit(), t.eval_history, params(t)
    return out


def _rank(rank: int, port: int, tiny: str, rm: str, out: str) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    torch.set_num_threads(1)
    res = run_roles(strategy(2), tiny, rm, "rl_ring")
    res["padded"] = run_roles(strategy(2), tiny, rm, "rl_ring", packing=False)
    res["offline"] = run_offline(2, tiny, "rl_ring")
    # the layers' recompute runs in the backward, after the ring's shard context has exited
    res["checkpointed"] = run_roles(strategy(2, gradient_checkpointing=True), tiny, rm, "rl_ring")
    torch.save(res, out.format(rank))


def test_two_ranks_in_one_ring_group_compute_what_one_rank_does(tiny, tmp_path):
    """Ring 2 over 2 ranks (data parallel 1, each row split in two, padded to an even length; 2 KV heads gathered
    one at a time) against one rank: forwards within 1e-5, and one step of each trained role equal within 1e-5 (lr
    1e-4: Adam's first step is about lr x sign, so a wrong gradient scale or slice moves whole tensors by ~lr).
    Also with gradient checkpointing (the recompute in the backward gets the forward's shard; before, it ran
    plain attention and torch refused the mismatched recompute). Padded rows are packed inside the ring forward.
    With two or more CUDA devices the ranks run on cuda:0 and cuda:1 over NCCL (the backward's reduce-scatter)."""
    if torch.cuda.is_available() and torch.cuda.device_count() < 2:
        pytest.skip(f"one CUDA device here ({torch.cuda.get_device_name(0)}): the two ranks need a device each "
                    f"(NCCL); run on a machine with two GPUs, or with CUDA_VISIBLE_DEVICES='' for gloo on CPU")
    from rl_rollout.testing import run_ranks

    rm = tmp_path / "rm"  # a reward model with its (random) score head
    RewardModel.from_pretrained(tiny, dtype="fp32").save_pretrained(rm)
    run_ranks(__file__, "_rank", 2, tiny, str(rm), str(tmp_path / "rank{}.pt"))
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in (0, 1))
    one = run_roles(strategy(1), tiny, str(rm), None)
    for r0_, r1_ in ((r0, r1), (r0["padded"], r1["padded"]), (r0["checkpointed"], r1["checkpointed"])):
        assert_same_roles(r0_, r1_, one)
    a, b, one = r0["offline"], r1["offline"], run_offline(1, tiny, None)
    for key in ("sft_losses", "dpo_losses"):
        assert a[key] == b[key] and a[key] == pytest.approx(one[key], abs=1e-6), key
    for key in ("sft_eval", "dpo_eval"):
        assert len(a[key]) == len(one[key]) >= 2
        for x, y in zip(a[key], one[key], strict=True):
            assert x == pytest.approx(y, abs=1e-6), key
    for role in ("sft", "dpo"):
        for n in one[role]:
            torch.testing.assert_close(a[role][n], b[role][n], atol=0, rtol=0)
            torch.testing.assert_close(a[role][n], one[role][n], atol=1e-5, rtol=0, msg=lambda m: f"{role} {n}: {m}")


def assert_same_roles(r0: dict, r1: dict, one: dict) -> None:
    for key in ("logprobs", "values", "scores", "policy_metrics", "critic_metrics"):
        assert r1[key] == [], key  # the group's second rank returns nothing: its leader answers for both
    for key in ("logprobs", "values"):
        for a, b in zip(r0[key], one[key], strict=True):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=0, msg=lambda m: f"{key}: {m}")
    assert r0["scores"] == pytest.approx(one["scores"], abs=1e-5)
    for key, loss in (("policy_metrics", "policy_loss"), ("critic_metrics", "critic_loss")):
        assert r0[key][0][loss] == pytest.approx(one[key][0][loss], abs=1e-6), key
    assert r0["policy_metrics"][0]["kl_loss"] == pytest.approx(one["policy_metrics"][0]["kl_loss"], abs=1e-7)
    for role in ("policy", "critic"):
        for n in one[role]:
            torch.testing.assert_close(r0[role][n], r1[role][n], atol=0, rtol=0)
            torch.testing.assert_close(r0[role][n], one[role][n], atol=1e-5, rtol=0, msg=lambda m: f"{role} {n}: {m}")
