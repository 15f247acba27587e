"""Packed rows and token-budget micro-batches in the RL workers against padded rows (tiny Llama, fp32, CPU,
real DeepSpeed): the same log-probs and values, the same loss and weights after a training step (an item over the
budget alone in its micro-batch included), and two
data-parallel ranks (gloo) with unequal micro-batch counts stepping as one rank does over the same batch."""

from __future__ import annotations

import os

import pytest
import torch

from rl_core.rl import CriticObjective, CriticWorker, PolicyObjective, PolicyWorker, make_item
from rl_core.rl.batching import MicroBatchConfig, ModelInputs, _cost, over_budget, plan_micro_batches, split_to
from rl_core.rl.experience import sequence
from rl_core.strategy import StrategyConfig
from rl_core.trainers.ppo import PPOConfig

pytestmark = [pytest.mark.timeout(900), pytest.mark.slow]
LENGTHS = [(5, 3), (9, 20), (4, 1), (12, 7), (6, 30), (3, 2), (8, 11), (5, 4)]  # (prompt, response): skewed
SHARDS = ([0, 2, 5, 7], [1, 3, 4, 6])  # two ranks' halves of one global batch: the short items, the long ones


def test_a_budget_groups_items_under_it_and_puts_a_longer_item_alone():
    lengths = [30, 5, 12, 7, 25, 3]
    packed = plan_micro_batches(lengths, micro_batch=2, max_tokens=32, packing=True)
    assert sorted(i for g in packed for i in g) == list(range(6))
    assert all(sum(lengths[i] for i in g) <= 32 for g in packed) and len(packed) == 3
    padded = plan_micro_batches(lengths, micro_batch=2, max_tokens=32, packing=False)
    assert all(len(g) * max(lengths[i] for i in g) <= 32 for g in padded)
    assert len(padded) > len(packed)  # padding costs the rows' longest length each
    assert plan_micro_batches(lengths, micro_batch=4) == [[0, 1, 2, 3], [4, 5]]
    for packing in (True, False):  # 30 and 25 over a budget of 20: alone, longest first (OpenRLHF's first-fit)
        over = plan_micro_batches(lengths, micro_batch=2, max_tokens=20, packing=packing)
        assert over[:2] == [[0], [4]] and sorted(i for g in over for i in g) == list(range(6))
        assert all(_cost([lengths[i] for i in g], packing) <= 20 for g in over[2:])
    assert over_budget(lengths, 20) == (2, 30) and over_budget(lengths, 30) == (0, 0)
    assert len(split_to(packed, 5, lengths, packing=True)) == 5
    with pytest.raises(ValueError, match=r"6 items cannot fill 7 micro-batches"):
        split_to(packed, 7, lengths)
    with pytest.raises(ValueError, match=r"max_tokens_per_gpu.*>= 1.*0"):
        MicroBatchConfig(max_tokens_per_gpu=0)


def test_packed_rows_map_back_to_the_padded_layout():
    items = [sequence(ids, [1] * len(ids)) for ids in ([1, 2, 3], [4], [5, 6])]
    x = ModelInputs.of(items, 0, True, "cpu")
    assert x.kwargs["position_ids"].tolist() == [[0, 1, 2, 0, 0, 1]] and "attention_mask" not in x.kwargs
    assert x.rows(x.kwargs["input_ids"]).tolist() == [[1, 2, 3], [4, 0, 0], [5, 6, 0]]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from rl_rollout.testing import make_tiny_model

    return str(make_tiny_model(tmp_path_factory.mktemp("pack") / "tiny"))


def items_of(lengths=LENGTHS, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for p, r in lengths:
        ids = torch.randint(3, 128, (p + r,), generator=g).tolist()
        it = make_item(ids[:p], ids[p:])
        it.advantages_T = torch.tensor(it.loss_mask_T, dtype=torch.float32) * torch.randn(p + r, generator=g)
        it.values_T = torch.randn(p + r, generator=g) * 0.1
        it.returns_T = torch.randn(p + r, generator=g)
        out.append(it)
    return out


def strategy(n, lr=1e-3, micro=2):
    return StrategyConfig(zero_stage=0, bf16=False, micro_train_batch_size=micro, train_batch_size=n,
                          learning_rate=lr, lr_warmup_ratio=0.0, lr_scheduler="constant", max_norm=0.0)


def params(worker):
    return {n: p.detach().clone() for n, p in worker.engine.module.named_parameters()}


def test_packed_forwards_give_the_padded_logprobs_and_values(tiny):
    items = items_of()
    c = PPOConfig.from_flat(temperature=0.7)
    s = strategy(len(items))
    got = {}
    for packing in (False, True):
        kw = {"load_kw": {"dtype": "fp32"}, "packing": packing,  # 32: the 36-token item goes alone, over it
              "batching": MicroBatchConfig(forward_max_tokens_per_gpu=32 if packing else None)}
        got[packing] = (PolicyWorker(s, tiny, PolicyObjective.of(c), 1, **kw).logprobs(items),
                        CriticWorker(s, tiny, CriticObjective.of(c), 1, **kw).values(items))
    for kind in (0, 1):
        for it, a, b in zip(items, got[False][kind], got[True][kind], strict=True):
            assert a.shape == b.shape == (it.T,)
            torch.testing.assert_close(b, a, atol=1e-5, rtol=0)
    assert any(a.abs().sum() > 0 for a in got[False][0])


@pytest.mark.parametrize("loss_agg_mode", ["token-mean", "seq-mean-token-mean"])
def test_a_packed_budgeted_train_step_gives_the_padded_loss_and_weights(tiny, loss_agg_mode):
    """Padded micro-batches of 2 (accumulation 4) against packed rows under a 64-token budget (3) (a varying count
    of micro-batches, boundary set by hand), and under 32 tokens packed and padded, where the 36-token item trains
    alone over the budget: the losses normalise by global counts, so one step must agree.
    Adam's first step is about lr x sign(gradient), so an element whose gradient is at rounding level may move
    either way: at lr 1e-3 one element in 32k differed by 1.1e-5; lr 1e-4 keeps that under the 1e-5 bound,
    while a wrong mask or normaliser moves whole tensors by ~lr."""
    items = items_of()
    c = PPOConfig.from_flat(max_epochs=1, loss_agg_mode=loss_agg_mode, init_kl_coef=0.01, use_kl_loss=True)
    s = strategy(len(items), lr=1e-4)
    out, before = {}, None
    for packing, budget in ((False, None), (True, 64), (True, 32), (False, 32)):
        kw = {"load_kw": {"dtype": "fp32"}, "packing": packing, "batching": MicroBatchConfig(max_tokens_per_gpu=budget)}
        w = PolicyWorker(s, tiny, PolicyObjective.of(c), 1, **kw)
        before = params(w)
        for it, lp in zip(items, w.logprobs(items), strict=True):
            it.old_logprobs_T = lp.clone()
            it.ref_logprobs_T = lp - 0.01
        if budget:
            groups = w._micro_batches(items, train=True)
            assert len(groups) != 4  # the budget made another grouping
            assert ([4] in groups) == (budget == 32)  # 36 tokens: alone, over the budget
        metrics = w.train(items, kl_coef=0.01)[0]
        critic = CriticWorker(s, tiny, CriticObjective.of(c), 1, **kw)
        out[packing, budget] = metrics, params(w), critic.train(items)[0], params(critic)
    m0, w0, c0, v0 = out.pop((False, None))
    moved = max((w0[n] - before[n]).abs().max().item() for n in w0)
    assert moved > 5e-5  # the step did something
    for key, (m1, w1, c1, v1) in out.items():
        assert m1["policy_loss"] == pytest.approx(m0["policy_loss"], abs=1e-6), key
        assert m1["kl_loss"] == pytest.approx(m0["kl_loss"], abs=1e-7), key
        assert c1["critic_loss"] == pytest.approx(c0["critic_loss"], abs=1e-6), key
        for n in w0:
            torch.testing.assert_close(w1[n], w0[n], atol=1e-5, rtol=0, msg=lambda m: f"{key} policy {n}: {m}")
        for n in v0:
            torch.testing.assert_close(v1[n], v0[n], atol=1e-5, rtol=0, msg=lambda m: f"{key} critic {n}: {m}")


def _rank(rank: int, port: int, tiny: str, out: str) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    torch.set_num_threads(1)
    items = items_of()
    mine = [items[i] for i in SHARDS[rank]]
    w = PolicyWorker(strategy(8, lr=1e-4), tiny, PolicyObjective(), 1, load_kw={"dtype": "fp32"},
                     packing=True, batching=MicroBatchConfig(max_tokens_per_gpu=40))
    for it, lp in zip(mine, w.logprobs(mine), strict=True):
        it.old_logprobs_T = lp.clone()
    w.train(mine)
    torch.save({"groups": len(w._micro_batches(mine, train=True)), "params": params(w)}, out.format(rank))


def test_two_ranks_with_unequal_micro_batch_counts_step_like_one_rank(tiny, tmp_path):
    """Rank 0's slice fits one 40-token bin, rank 1's needs three: rank 0 splits its bin to run three
    micro-batches too, and the two ranks' step equals one rank's step over the whole batch (atol 1e-5 at
    lr 1e-4, as in the single-rank test above: Adam amplifies rounding-level gradients to ~lr)."""
    from rl_rollout.testing import run_ranks

    lengths = [p + r for p, r in LENGTHS]
    counts = [len(plan_micro_batches([lengths[i] for i in shard], micro_batch=1, max_tokens=40, packing=True))
              for shard in SHARDS]
    assert counts == [1, 3]
    run_ranks(__file__, "_rank", 2, tiny, str(tmp_path / "rank{}.pt"))  # each rank a fresh interpreter
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt") for r in (0, 1))
    assert r0["groups"] == r1["groups"] == 3
    items = items_of()
    w = PolicyWorker(strategy(8, lr=1e-4), tiny, PolicyObjective(), 1, load_kw={"dtype": "fp32"})
    for it, lp in zip(items, w.logprobs(items), strict=True):
        it.old_logprobs_T = lp.clone()
    w.train(items)
    one = params(w)
    for n in one:
        torch.testing.assert_close(r0["params"][n], r1["params"][n], atol=0, rtol=0)
        torch.testing.assert_close(r0["params"][n], one[n], atol=1e-5, rtol=0, msg=lambda m: f"{n}: {m}")


def test_the_kl_loss_without_a_reference_is_not_measured(tiny):
    """--use_kl_loss with --init_kl_coef 0 (OpenRLHF's VLM script) has no reference model: the policy step neither
    reads reference log-probs nor logs a KL (it logged ~9.9, a KL against zeros), and trains as without the flag."""
    items = items_of()[:4]
    out = {}
    for kl in (True, False):
        objective = PolicyObjective.of(PPOConfig.from_flat(max_epochs=1, use_kl_loss=kl, init_kl_coef=0))
        assert objective.kl_loss is None  # no reference: no KL term, whatever --use_kl_loss says
        w = PolicyWorker(strategy(4, lr=1e-4), tiny, objective, 1, load_kw={"dtype": "fp32"})
        for it, lp in zip(items, w.logprobs(items), strict=True):
            it.old_logprobs_T = lp.clone()
        out[kl] = w.train(items, kl_coef=0.0)[0]
    assert out[True]["kl_loss"] == 0.0 and out[True]["policy_loss"] == pytest.approx(out[False]["policy_loss"])
