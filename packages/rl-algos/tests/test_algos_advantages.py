"""Advantage estimators: hand-computed cases, loop references, error paths."""

import pytest
import torch

from rl_algos.advantages import (
    ESTIMATORS,
    compute_advantages,
    discounted_cumsum,
    gae_advantages,
    get_estimator,
    masked_whiten,
)


def loop_returns(r, mask, gamma):
    r = r * mask
    out = torch.zeros_like(r)
    c = torch.zeros(r.shape[0], dtype=r.dtype)
    for t in reversed(range(r.shape[1])):
        c = r[:, t] + gamma * c
        out[:, t] = c
    return out


def loop_gae(r, v, mask, gamma, lambd):
    """OpenRLHF get_advantages_and_returns, written as its loop."""
    r, v = r * mask, v * mask
    T = r.shape[1]
    adv = torch.zeros_like(r)
    last = torch.zeros(r.shape[0], dtype=r.dtype)
    for t in reversed(range(T)):
        nv = v[:, t + 1] if t < T - 1 else 0.0
        delta = r[:, t] + gamma * nv - v[:, t]
        last = delta + gamma * lambd * last
        adv[:, t] = last
    return adv, adv + v


def response_mask(B, T, gen):
    lengths = torch.randint(1, T + 1, (B,), generator=gen)
    return (torch.arange(T)[None] < lengths[:, None]).double()


def test_registry_has_every_estimator_and_refuses_unknown():
    assert set(ESTIMATORS) == {"gae", "reinforce", "reinforce_baseline", "rloo", "group_norm", "dr_grpo"}
    with pytest.raises(ValueError, match=r"unknown advantage estimator 'grpo'; valid: dr_grpo, gae, group_norm"):
        get_estimator("grpo")
    with pytest.raises(ValueError, match="already registered"):
        ESTIMATORS.register("gae", ESTIMATORS["gae"])
    assert get_estimator("rloo") is ESTIMATORS["rloo"]


def test_an_estimators_own_parameters_are_typed_from_key_value_texts():
    import dataclasses

    spec = dataclasses.replace(ESTIMATORS["group_norm"], params={"temperature": float, "hard": bool})
    assert spec.settings(["temperature=0.5", "hard=true"]) == {"temperature": 0.5, "hard": True}
    with pytest.raises(ValueError, match=r"has no parameter 'temp'; its parameters: temperature \(float\), hard"):
        spec.settings(["temp=1"])
    with pytest.raises(ValueError, match=r"temperature='x' is not a float"):
        spec.settings(["temperature=x"])
    with pytest.raises(ValueError, match=r"'temperature' is not KEY=VALUE"):
        spec.settings(["temperature"])
    with pytest.raises(ValueError, match=r"has no parameter 'x'; its parameters: none"):
        ESTIMATORS["gae"].settings(["x=1"])


def test_hand_computed_group_baselines():
    scores = torch.tensor([1.0, 0.0, 0.0, 3.0, 1.0, 2.0])  # two prompts x 3 samples
    mask = torch.ones(6, 1)
    rloo = compute_advantages("rloo", scores, mask, n_samples=3).scores
    assert torch.allclose(rloo, torch.tensor([1.0, -0.5, -0.5, 1.5, -1.5, 0.0]))
    for name in ("reinforce_baseline", "dr_grpo"):
        out = compute_advantages(name, scores, mask, n_samples=3).scores
        assert torch.allclose(out, torch.tensor([2 / 3, -1 / 3, -1 / 3, 1.0, -1.0, 0.0]))
    gn = compute_advantages("group_norm", scores, mask, n_samples=3).scores
    std1 = torch.tensor([1.0, 0.0, 0.0]).std()  # unbiased, 0.57735
    assert torch.allclose(gn[:3], torch.tensor([2 / 3, -1 / 3, -1 / 3]) / (std1 + 1e-9))
    assert torch.allclose(gn[3:], torch.tensor([1.0, -1.0, 0.0]))  # std = 1


def test_score_lands_on_last_response_token_and_discounts():
    scores = torch.tensor([2.0, 1.0])
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]], dtype=torch.float32)
    out = compute_advantages("reinforce", scores, mask, gamma=0.5)
    expected = torch.tensor([[0.5, 1.0, 2.0, 0.0], [0.5, 1.0, 0.0, 0.0]])
    assert torch.allclose(out.advantages, expected)
    assert torch.equal(out.advantages, out.returns)


def test_token_rewards_are_added_before_discounting():
    scores = torch.tensor([1.0])
    mask = torch.ones(1, 3)
    kl_pen = torch.tensor([[-0.1, -0.2, -0.3]])
    out = compute_advantages("reinforce", scores, mask, token_rewards_BT=kl_pen)
    assert torch.allclose(out.advantages, torch.tensor([[0.4, 0.5, 0.7]]))


def test_gae_hand_computed():
    # T=2, gamma=1, lambda=1: A_1 = r_1 - V_1; A_0 = r_0 + V_1 - V_0 + A_1
    r = torch.tensor([[0.0, 1.0]])
    v = torch.tensor([[0.5, 0.25]])
    adv, ret = gae_advantages(r, v, torch.ones(1, 2), gamma=1.0, lambd=1.0)
    assert torch.allclose(adv, torch.tensor([[0.5, 0.75]]))
    assert torch.allclose(ret, torch.tensor([[1.0, 1.0]]))


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
@pytest.mark.parametrize("gamma,lambd", [(1.0, 1.0), (0.99, 0.95), (0.9, 0.5), (0.5, 0.0)])
def test_vectorised_scans_match_loops(seed, gamma, lambd):
    g = torch.Generator().manual_seed(seed)
    B, T = 5, 300  # longer than one scan block
    mask = response_mask(B, T, g)
    r = torch.randn(B, T, generator=g, dtype=torch.float64)
    v = torch.randn(B, T, generator=g, dtype=torch.float64)
    from rl_algos.advantages import discounted_returns

    torch.testing.assert_close(discounted_returns(r, mask, gamma), loop_returns(r, mask, gamma), rtol=1e-10, atol=1e-10)
    adv, ret = gae_advantages(r, v, mask, gamma, lambd)
    ref_adv, ref_ret = loop_gae(r, v, mask, gamma, lambd)
    torch.testing.assert_close(adv, ref_adv, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(ret, ref_ret, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("gamma", [1.0, 0.999])
def test_discounted_cumsum_float32_no_worse_than_float32_loop(gamma):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 4096, generator=g)
    ones = torch.ones_like(x)
    ref = loop_returns(x.double(), ones.double(), gamma)
    err_ours = (discounted_cumsum(x, gamma).double() - ref).abs().max().item()
    err_loop32 = (loop_returns(x, ones, gamma).double() - ref).abs().max().item()
    assert err_ours <= 1.5 * err_loop32 + 1e-6, (err_ours, err_loop32)


@pytest.mark.parametrize("name", ["rloo", "group_norm", "reinforce_baseline", "dr_grpo"])
def test_group_estimators_match_per_group_loop(name):
    g = torch.Generator().manual_seed(7)
    P, n, T = 4, 5, 6
    scores = torch.randn(P * n, generator=g, dtype=torch.float64)
    mask = response_mask(P * n, T, g)
    out = compute_advantages(name, scores, mask, n_samples=n)
    for p in range(P):
        grp = scores[p * n : (p + 1) * n]
        for i in range(n):
            r = grp[i].item()
            others = [grp[j].item() for j in range(n) if j != i]
            if name == "rloo":
                expect = r - sum(others) / (n - 1)
            elif name == "group_norm":
                expect = (r - grp.mean().item()) / (grp.std().item() + 1e-9)
            else:
                expect = r - grp.mean().item()
            assert out.scores[p * n + i].item() == pytest.approx(expect, abs=1e-12)
    # gamma=1: every response token carries the (shaped) score
    torch.testing.assert_close(out.advantages, out.scores[:, None] * mask)


def test_bf16_scores_computed_in_float32():
    scores = torch.tensor([1.0, 0.0, 0.5, 0.25], dtype=torch.bfloat16)
    out = compute_advantages("group_norm", scores, torch.ones(4, 3, dtype=torch.bfloat16), n_samples=2)
    assert out.advantages.dtype == torch.float32
    ref = compute_advantages("group_norm", scores.float(), torch.ones(4, 3), n_samples=2)
    torch.testing.assert_close(out.advantages, ref.advantages)


def test_error_paths_name_the_numbers():
    mask = torch.ones(6, 2)
    with pytest.raises(ValueError, match=r"batch of 6 scores is not divisible by n_samples=4 \(6 = 1 \* 4 \+ 2\)"):
        compute_advantages("rloo", torch.zeros(6), mask, n_samples=4)
    with pytest.raises(ValueError, match="rloo needs n_samples_per_prompt >= 2, got 1"):
        compute_advantages("rloo", torch.zeros(6), mask, n_samples=1)
    with pytest.raises(ValueError, match="group_norm needs n_samples_per_prompt >= 2"):
        compute_advantages("group_norm", torch.zeros(6), mask, n_samples=1)
    with pytest.raises(ValueError, match="gae needs critic values"):
        compute_advantages("gae", torch.zeros(6), mask)
    with pytest.raises(ValueError, match=r"scores must be \[batch\]=\[6\], got shape \(5,\)"):
        compute_advantages("reinforce", torch.zeros(5), mask)
    with pytest.raises(ValueError, match="shape mismatch"):
        compute_advantages("gae", torch.zeros(6), mask, values_BT=torch.zeros(6, 3))


def test_masked_whiten():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(4, 7, generator=g, dtype=torch.float64) * 3 + 2
    mask = response_mask(4, 7, g)
    w = masked_whiten(x, mask)
    sel = w[mask.bool()]
    assert sel.mean().item() == pytest.approx(0.0, abs=1e-12)
    assert sel.var(unbiased=False).item() == pytest.approx(1.0, abs=1e-9)
    assert torch.all(w[~mask.bool()] == 0)
    ref = (x[mask.bool()] - x[mask.bool()].mean()) / x[mask.bool()].std(unbiased=False)
    torch.testing.assert_close(sel, ref)
    kept = masked_whiten(x, mask, shift_mean=False)[mask.bool()]
    assert kept.mean().item() == pytest.approx(x[mask.bool()].mean().item(), abs=1e-9)
    centred = masked_whiten(x, mask, scale=False)  # OpenRLHF's --no_advantage_std_norm: the mean only
    torch.testing.assert_close(centred[mask.bool()], x[mask.bool()] - x[mask.bool()].mean())
    assert torch.all(centred[~mask.bool()] == 0)


def test_empty_rows_get_no_reward():
    mask = torch.tensor([[1.0, 1.0], [0.0, 0.0]])
    out = compute_advantages("reinforce", torch.tensor([1.0, 5.0]), mask)
    assert torch.all(out.advantages[1] == 0)
