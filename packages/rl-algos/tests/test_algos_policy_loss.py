"""Policy/value losses and aggregation: hand cases, loop references, sharding invariance."""

import math

import pytest
import torch

from rl_algos.losses import aggregate_loss, policy_loss, value_loss


def rand_batch(seed, B=6, T=9, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    mask = (torch.arange(T)[None] < lengths[:, None]).to(dtype)
    old = -torch.rand(B, T, generator=g, dtype=dtype) * 3
    logp = old + 0.3 * torch.randn(B, T, generator=g, dtype=dtype)
    rollout = old + 0.2 * torch.randn(B, T, generator=g, dtype=dtype)
    adv = torch.randn(B, T, generator=g, dtype=dtype)
    return logp, old, rollout, adv, mask


def loop_ppo(logp, old, adv, mask, lo, hi, dual):
    """Per-token PPO loss written element by element."""
    out = torch.zeros_like(logp)
    for b in range(logp.shape[0]):
        for t in range(logp.shape[1]):
            r = math.exp(logp[b, t] - old[b, t])
            a = adv[b, t].item()
            v = min(r * a, min(max(r, 1 - lo), 1 + hi) * a)
            if dual is not None and a < 0:
                v = max(v, dual * a)
            out[b, t] = -v
    return out


def test_hand_computed_clip():
    # ratio e^{0.5}=1.6487 > 1.2, A=+1 -> clipped to 1.2; ratio e^{-0.5}=0.6065 < 0.8, A=-1 -> -0.8 ... min(-0.6065, -0.8) = -0.8
    logp = torch.tensor([[0.5, -0.5]])
    old = torch.zeros(1, 2)
    adv = torch.tensor([[1.0, -1.0]])
    out = policy_loss(logp, old, adv, torch.ones(1, 2))
    assert out.loss.item() == pytest.approx((-1.2 + 0.8) / 2, abs=1e-6)
    assert out.clip_fraction.item() == pytest.approx(1.0)
    assert out.approx_kl.item() == pytest.approx(0.0, abs=1e-7)
    assert out.rollout_kl is None


def test_clip_higher_and_dual_clip_hand_computed():
    logp = torch.tensor([[math.log(1.5), math.log(4.0)]])
    old = torch.zeros(1, 2)
    adv = torch.tensor([[1.0, -1.0]])
    out = policy_loss(logp, old, adv, torch.ones(1, 2), clip_eps_low=0.2, clip_eps_high=0.28, dual_clip=3.0)
    # token 0: min(1.5, 1.28) = 1.28 ; token 1: min(-4, -1.28) = -4, dual: max(-4, -3) = -3
    assert out.loss.item() == pytest.approx((-1.28 + 3.0) / 2, abs=1e-6)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("lo,hi,dual", [(0.2, 0.2, None), (0.2, 0.28, None), (0.1, 0.3, 3.0)])
def test_matches_elementwise_loop(seed, lo, hi, dual):
    logp, old, _, adv, mask = rand_batch(seed)
    ref_tok = loop_ppo(logp, old, adv, mask, lo, hi, dual)
    out = policy_loss(logp, old, adv, mask, clip_eps_low=lo, clip_eps_high=hi, dual_clip=dual)
    expect = (ref_tok * mask).sum() / mask.sum()
    assert out.loss.item() == pytest.approx(expect.item(), rel=1e-12, abs=1e-12)


def test_gradient_float64_matches_autograd_of_loop_formula():
    logp, old, _, adv, mask = rand_batch(5)
    logp.requires_grad_(True)
    policy_loss(logp, old, adv, mask, clip_eps_low=0.2, clip_eps_high=0.28).loss.backward()
    g_ours = logp.grad.clone()
    lp = logp.detach().clone().requires_grad_(True)
    r = (lp - old).exp()
    tok = -torch.min(r * adv, r.clamp(0.8, 1.28) * adv)
    ((tok * mask).sum() / mask.sum()).backward()
    torch.testing.assert_close(g_ours, lp.grad, rtol=1e-12, atol=1e-12)
    # gradcheck through the whole function
    lp2 = logp.detach().clone().requires_grad_(True)
    assert torch.autograd.gradcheck(lambda x: policy_loss(x, old, adv, mask).loss, (lp2,))


def test_gspo_sequence_ratio():
    logp, old, _, adv, mask = rand_batch(1)
    out = policy_loss(logp, old, adv, mask, ratio_type="sequence", clip_eps_low=3e-4, clip_eps_high=4e-4)
    seq_ratio = (((logp - old) * mask).sum(-1) / mask.sum(-1)).exp()[:, None].expand_as(logp)
    tok = -torch.min(seq_ratio * adv, seq_ratio.clamp(1 - 3e-4, 1 + 4e-4) * adv)
    assert out.loss.item() == pytest.approx(((tok * mask).sum() / mask.sum()).item(), rel=1e-12)


def test_importance_corrections():
    logp, old, rollout, adv, mask = rand_batch(2)
    base = policy_loss(logp, old, adv, mask, aggregation="token-mean")
    base_tok = loop_ppo(logp, old, adv, mask, 0.2, 0.2, None)
    w = (old - rollout).exp()
    lo, hi = 0.8, 1.25
    expected = {
        "tis": w.clamp(lo, hi),
        "icepop": w * ((w >= lo) & (w <= hi)),
    }
    seq_w = (((old - rollout) * mask).sum(-1) / mask.sum(-1)).exp()
    expected["seq-mask-tis"] = w * ((seq_w >= lo) & (seq_w <= hi))[:, None]
    for kind, weight in expected.items():
        out = policy_loss(logp, old, adv, mask, rollout_logprobs_BT=rollout, correction=kind,
                          correction_low=lo, correction_high=hi)
        ref = (base_tok * weight * mask).sum() / mask.sum()
        assert out.loss.item() == pytest.approx(ref.item(), rel=1e-12), kind
        assert out.is_weight_mean.item() == pytest.approx(((weight * mask).sum() / mask.sum()).item(), rel=1e-12)
        assert out.rollout_kl.item() == pytest.approx((((rollout - old) * mask).sum() / mask.sum()).item())
    assert base.is_weight_mean is None
    # icepop with wide thresholds is the plain ratio-weighted loss and differs from tis clamping
    assert expected["icepop"].ne(expected["tis"]).any()


AGGS = ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"]


def test_aggregation_hand_computed():
    loss = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    assert aggregate_loss(loss, mask, "token-mean").item() == pytest.approx(10 / 4)
    assert aggregate_loss(loss, mask, "seq-mean-token-mean").item() == pytest.approx((2 + 4) / 2)
    assert aggregate_loss(loss, mask, "seq-mean-token-sum").item() == pytest.approx((6 + 4) / 2)
    assert aggregate_loss(loss, mask, "seq-mean-token-sum-norm", norm_len=5).item() == pytest.approx((6 / 5 + 4 / 5) / 2)
    assert aggregate_loss(loss, mask, "seq-mean-token-sum-norm").item() == pytest.approx((6 / 3 + 4 / 3) / 2)


@pytest.mark.parametrize("agg", AGGS)
@pytest.mark.parametrize("seed", range(3))
def test_invariant_to_dp_shards_and_micro_batches(agg, seed):
    logp, old, rollout, adv, mask = rand_batch(seed, B=8, T=7)
    kw = dict(clip_eps_low=0.2, clip_eps_high=0.28, aggregation=agg, norm_len=7, correction="tis")
    full = policy_loss(logp, old, adv, mask, rollout_logprobs_BT=rollout, **kw).loss
    n_tok, n_seq = mask.sum(), mask.shape[0]
    # two data-parallel shards: the all-reduce averages the per-rank losses
    shards = [
        policy_loss(logp[s], old[s], adv[s], mask[s], rollout_logprobs_BT=rollout[s],
                    global_tokens=n_tok, global_seqs=n_seq, dp_size=2, **kw).loss
        for s in (slice(0, 4), slice(4, 8))
    ]
    assert ((shards[0] + shards[1]) / 2).item() == pytest.approx(full.item(), rel=1e-12)
    # four micro-batches of one rank: gradient accumulation sums them
    micro = [
        policy_loss(logp[s : s + 2], old[s : s + 2], adv[s : s + 2], mask[s : s + 2],
                    rollout_logprobs_BT=rollout[s : s + 2], global_tokens=n_tok, global_seqs=n_seq, **kw).loss
        for s in range(0, 8, 2)
    ]
    assert sum(micro).item() == pytest.approx(full.item(), rel=1e-12)
    # gradients agree too
    lp = logp.clone().requires_grad_(True)
    policy_loss(lp, old, adv, mask, rollout_logprobs_BT=rollout, **kw).loss.backward()
    lp2 = logp.clone().requires_grad_(True)
    for s in range(0, 8, 2):
        policy_loss(lp2[s : s + 2], old[s : s + 2], adv[s : s + 2], mask[s : s + 2],
                    rollout_logprobs_BT=rollout[s : s + 2], global_tokens=n_tok, global_seqs=n_seq,
                    **kw).loss.backward()
    torch.testing.assert_close(lp.grad, lp2.grad, rtol=1e-12, atol=1e-14)


def test_local_token_mean_is_not_invariant_which_is_why_global_counts_exist():
    logp, old, _, adv, mask = rand_batch(0, B=8, T=7)
    full = policy_loss(logp, old, adv, mask).loss
    halves = [policy_loss(logp[s], old[s], adv[s], mask[s]).loss for s in (slice(0, 4), slice(4, 8))]
    assert abs(((halves[0] + halves[1]) / 2 - full).item()) > 1e-4


def test_bf16_inputs():
    logp, old, _, adv, mask = rand_batch(3, dtype=torch.float32)
    ref = policy_loss(logp.bfloat16().float(), old.bfloat16().float(), adv.bfloat16().float(), mask).loss
    out = policy_loss(logp.bfloat16(), old.bfloat16(), adv.bfloat16(), mask.bfloat16())
    assert out.loss.dtype == torch.float32
    assert out.loss.item() == pytest.approx(ref.item(), rel=1e-6)


def test_policy_loss_errors():
    logp, old, rollout, adv, mask = rand_batch(0, dtype=torch.float32)
    with pytest.raises(ValueError, match="dual_clip must be > 1"):
        policy_loss(logp, old, adv, mask, dual_clip=0.5)
    with pytest.raises(ValueError, match=r"unknown importance correction 'is'; valid: tis, icepop, seq-mask-tis"):
        policy_loss(logp, old, adv, mask, rollout_logprobs_BT=rollout, correction="is")
    with pytest.raises(ValueError, match="needs rollout_logprobs_BT"):
        policy_loss(logp, old, adv, mask, correction="tis")
    with pytest.raises(ValueError, match="unknown loss aggregation 'mean'; valid: token-mean"):
        policy_loss(logp, old, adv, mask, aggregation="mean")
    with pytest.raises(ValueError, match="unknown ratio_type 'seq'"):
        policy_loss(logp, old, adv, mask, ratio_type="seq")
    with pytest.raises(ValueError, match="needs global_tokens"):
        policy_loss(logp, old, adv, mask, dp_size=2)
    with pytest.raises(ValueError, match="needs global_seqs"):
        policy_loss(logp, old, adv, mask, dp_size=2, aggregation="seq-mean-token-mean")
    with pytest.raises(ValueError, match=r"shape mismatch: .*advantages_BT=\(6, 8\)"):
        policy_loss(logp, old, adv[:, :8], mask)
    with pytest.raises(ValueError, match="0 <= low <= high"):
        policy_loss(logp, old, adv, mask, rollout_logprobs_BT=rollout, correction="tis", correction_low=6.0)


def test_value_loss_clipped_hand_computed():
    v = torch.tensor([[1.0, 0.0]])
    old = torch.tensor([[0.0, 0.0]])
    ret = torch.tensor([[2.0, 1.0]])
    out = value_loss(v, old, ret, torch.ones(1, 2), clip_eps=0.5)
    # token 0: unclipped (1-2)^2=1, clipped (0.5-2)^2=2.25 -> 2.25; token 1: both (0-1)^2 = 1
    assert out.loss.item() == pytest.approx(0.5 * (2.25 + 1) / 2)
    assert out.clip_fraction.item() == pytest.approx(0.5)
    plain = value_loss(v, old, ret, torch.ones(1, 2))
    assert plain.loss.item() == pytest.approx(0.5 * (1 + 1) / 2)
    with pytest.raises(ValueError, match="clip_eps must be > 0"):
        value_loss(v, old, ret, torch.ones(1, 2), clip_eps=0.0)
