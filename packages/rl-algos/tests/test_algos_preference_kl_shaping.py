"""SFT, DPO, KTO, pairwise losses; KL estimators and controllers; shaping; dynamic-sampling filter."""

import math

import pytest
import torch
import torch.nn.functional as F

from rl_algos import (
    AdaptiveKLController,
    FixedKLController,
    approx_kl,
    clip_rewards,
    dpo_loss,
    filter_groups,
    kl_penalized_rewards,
    kto_loss,
    kto_reference_kl,
    overlong_penalty,
    pairwise_loss,
    sft_loss,
    stop_properly_penalty,
)


def test_sft_loss_token_mean_and_sharding():
    lp = torch.tensor([[-1.0, -2.0, -3.0], [-4.0, -5.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    assert sft_loss(lp, mask).item() == pytest.approx((1 + 2 + 4 + 5 + 0) / 5)
    halves = [sft_loss(lp[i : i + 1], mask[i : i + 1], global_tokens=5, dp_size=2) for i in range(2)]
    assert ((halves[0] + halves[1]) / 2).item() == pytest.approx(sft_loss(lp, mask).item())


def test_dpo_hand_computed_sigmoid_cdpo_ipo_nll():
    pc, pr = torch.tensor([-1.0, -2.0]), torch.tensor([-3.0, -1.0])
    rc, rr = torch.tensor([-1.5, -2.0]), torch.tensor([-2.5, -1.5])
    h = (pc - pr) - (rc - rr)  # [1.0, -1.5]
    beta = 0.5
    out = dpo_loss(pc, pr, rc, rr, beta=beta)
    torch.testing.assert_close(out.losses, -F.logsigmoid(beta * h))
    assert out.losses[0].item() == pytest.approx(math.log(1 + math.exp(-0.5)))
    torch.testing.assert_close(out.chosen_rewards, beta * (pc - rc))
    torch.testing.assert_close(out.rejected_rewards, beta * (pr - rr))
    smooth = dpo_loss(pc, pr, rc, rr, beta=beta, label_smoothing=0.1)
    torch.testing.assert_close(smooth.losses, -0.9 * F.logsigmoid(beta * h) - 0.1 * F.logsigmoid(-beta * h))
    ipo = dpo_loss(pc, pr, rc, rr, beta=beta, ipo=True)
    torch.testing.assert_close(ipo.losses, (h - 1.0) ** 2)
    nll = dpo_loss(pc, pr, rc, rr, beta=beta, chosen_nll=torch.tensor(2.0), nll_coef=0.5)
    assert nll.loss.item() == pytest.approx(out.loss.item() + 1.0)


def test_dpo_gradient_pushes_chosen_up_and_errors():
    pc = torch.tensor([-2.0], dtype=torch.float64, requires_grad=True)
    pr = torch.tensor([-2.0], dtype=torch.float64, requires_grad=True)
    dpo_loss(pc, pr, torch.tensor([-2.0]), torch.tensor([-2.0]), beta=0.1).loss.backward()
    assert pc.grad.item() < 0 < pr.grad.item()
    assert pc.grad.item() == pytest.approx(-0.05)  # -beta * sigmoid(0)
    z = torch.zeros(2)
    with pytest.raises(ValueError, match="beta must be > 0"):
        dpo_loss(z, z, z, z, beta=0)
    with pytest.raises(ValueError, match="label_smoothing must be in"):
        dpo_loss(z, z, z, z, label_smoothing=0.7)
    with pytest.raises(ValueError, match="alternatives"):
        dpo_loss(z, z, z, z, label_smoothing=0.1, ipo=True)
    with pytest.raises(ValueError, match="needs chosen_nll"):
        dpo_loss(z, z, z, z, nll_coef=1.0)


def test_kto_hand_computed():
    logp = torch.tensor([-1.0, -2.0, -3.0])
    ref = torch.tensor([-1.5, -1.0, -3.0])
    desirable = torch.tensor([True, False, True])
    kl = kto_reference_kl(torch.tensor([-1.0, -2.0]), torch.tensor([-1.2, -2.2]))
    assert kl.item() == pytest.approx(0.2)
    assert kto_reference_kl(torch.tensor([-3.0]), torch.tensor([-1.0])).item() == 0.0  # clamped at 0
    out = kto_loss(logp, ref, desirable, kl, beta=0.5, desirable_weight=1.0, undesirable_weight=2.0)
    z = logp - ref  # [0.5, -1.0, 0.0]
    expect = torch.stack([
        1 - torch.sigmoid(0.5 * (z[0] - 0.2)),
        2.0 * (1 - torch.sigmoid(0.5 * (0.2 - z[1]))),
        1 - torch.sigmoid(0.5 * (z[2] - 0.2)),
    ])
    torch.testing.assert_close(out.losses, expect)
    assert out.loss.item() == pytest.approx(expect.mean().item())
    torch.testing.assert_close(out.rewards, 0.5 * z)
    with pytest.raises(ValueError, match="KTO weights must be >= 0"):
        kto_loss(logp, ref, desirable, kl, undesirable_weight=-1)


def test_pairwise_losses():
    c, r = torch.tensor([1.0, 0.0]), torch.tensor([0.0, 2.0])
    assert pairwise_loss(c, r).item() == pytest.approx((-math.log(torch.sigmoid(torch.tensor(1.0)).item())
                                                        - math.log(torch.sigmoid(torch.tensor(-2.0)).item())) / 2)
    assert pairwise_loss(c, r, kind="logexp").item() == pytest.approx(
        (math.log(1 + math.exp(-1)) + math.log(1 + math.exp(2))) / 2)
    m = torch.tensor([0.5, 0.5])
    assert pairwise_loss(c, r, m).item() == pytest.approx(pairwise_loss(c - 0.5, r).item())
    # stable for large gaps
    assert torch.isfinite(pairwise_loss(torch.tensor([1e4]), torch.tensor([-1e4]), kind="logexp"))
    with pytest.raises(ValueError, match="unknown pairwise loss 'hinge'; valid: sigmoid, logexp"):
        pairwise_loss(c, r, kind="hinge")


def test_kl_estimators_hand_computed_and_clamped():
    lp = torch.tensor([[0.0, 1.0, -20.0]])
    ref = torch.tensor([[0.5, 0.0, 0.0]])
    d = lp - ref
    torch.testing.assert_close(approx_kl(lp, ref, "k1"), d.clamp(-10, 10))
    torch.testing.assert_close(approx_kl(lp, ref, "k2"), (d**2 / 2).clamp(-10, 10))
    k3 = approx_kl(lp, ref, "k3")
    assert k3[0, 0].item() == pytest.approx(math.exp(0.5) - 1 - 0.5, rel=1e-6)
    assert k3[0, 2].item() == 10.0  # exp(20) - 21 clamped
    assert torch.all(approx_kl(torch.randn(4, 5), torch.randn(4, 5), "k3") >= 0)
    m = torch.tensor([[1.0, 0.0, 1.0]])
    assert approx_kl(lp, ref, "k1", mask=m)[0, 1].item() == 0.0
    assert approx_kl(lp.bfloat16(), ref.bfloat16()).dtype == torch.float32
    with pytest.raises(ValueError, match="unknown KL estimator 'k4'; valid: k1, k2, k3"):
        approx_kl(lp, ref, "k4")


def test_kl_controllers():
    assert FixedKLController(0.1).update(5.0, 100) == 0.1
    c = AdaptiveKLController(value=0.1, target=6.0, horizon=10000)
    # KL far above target: error clipped to +0.2 -> value * (1 + 0.2 * 256 / 10000)
    assert c.update(100.0, 256) == pytest.approx(0.1 * (1 + 0.2 * 256 / 10000))
    before = c.value
    assert c.update(3.0, 256) == pytest.approx(before * (1 - 0.2 * 256 / 10000))
    with pytest.raises(ValueError, match="target > 0 and horizon > 0"):
        AdaptiveKLController(0.1, 0.0, 10)


def test_shaping():
    torch.testing.assert_close(clip_rewards(torch.tensor([-5.0, 0.5, 9.0]), -1, 1), torch.tensor([-1.0, 0.5, 1.0]))
    with pytest.raises(ValueError, match="low <= high"):
        clip_rewards(torch.zeros(1), 1, -1)
    pen = overlong_penalty(torch.tensor([10, 90, 95, 100, 150]), max_len=100, buffer_len=20, penalty_factor=2.0)
    torch.testing.assert_close(pen, torch.tensor([0.0, -1.0, -1.5, -2.0, -2.0]))
    with pytest.raises(ValueError, match=r"buffer_len must be in \(0, max_len=100\], got 0"):
        overlong_penalty(torch.tensor([1]), 100, 0)
    s = torch.tensor([1.0, 1.0, 0.5])
    t = torch.tensor([True, False, True])
    torch.testing.assert_close(stop_properly_penalty(s, t, 0.5), torch.tensor([0.5, 1.0, 0.25]))
    torch.testing.assert_close(stop_properly_penalty(s, t, -0.5), torch.tensor([-0.5, 1.0, -0.5]))
    with pytest.raises(ValueError, match="coef must be <= 1"):
        stop_properly_penalty(s, t, 2.0)
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    kl = torch.tensor([[0.1, 0.2, 0.3], [0.4, 0.5, 0.6]])
    r = kl_penalized_rewards(torch.tensor([1.0, 2.0]), kl, mask, kl_coef=0.5)
    torch.testing.assert_close(r, torch.tensor([[-0.05, 1.0 - 0.1, 0.0], [-0.2, -0.25, 2.0 - 0.3]]))
    torch.testing.assert_close(kl_penalized_rewards(torch.tensor([1.0, 2.0]), None, mask, 0.5),
                               torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, 2.0]]))


def test_dynamic_sampling_filter():
    scores = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.0, 0.0, 0.5, 0.5])  # groups of 2
    res = filter_groups(scores, 2)
    assert res.keep_groups.tolist() == [False, True, False, False]
    assert res.keep_samples.tolist() == [False, False, True, True, False, False, False, False]
    assert res.num_kept == 1
    res2 = filter_groups(scores, 2, mean_range=(0.0, 1.0), require_variance=False)
    assert res2.keep_groups.tolist() == [False, True, False, True]
    torch.testing.assert_close(res2.group_means, torch.tensor([1.0, 0.5, 0.0, 0.5]))
    with pytest.raises(ValueError, match="batch of 8 scores is not divisible by n_samples=3"):
        filter_groups(scores, 3)
    with pytest.raises(ValueError, match="mean_range needs low < high"):
        filter_groups(scores, 2, mean_range=(1.0, 0.0))
