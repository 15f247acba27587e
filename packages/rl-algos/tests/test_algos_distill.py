"""rl_algos.distill against hand-computed values and plain-Python loops (fp64, 1e-6)."""

import math

import pytest
import torch

from rl_algos.distill import (
    distill_advantages,
    forward_kl,
    generalized_jsd,
    reverse_kl,
    topk_forward_kl,
    topk_generalized_jsd,
)


def _probs(logits, temperature=1.0):
    z = [x / temperature for x in logits]
    mx = max(z)
    e = [math.exp(x - mx) for x in z]
    s = sum(e)
    return [x / s for x in e]


def _kl_loop(p, q):
    return sum(pi * (math.log(pi) - math.log(qi)) for pi, qi in zip(p, q) if pi > 0)


def _jsd_loop(s_logits, t_logits, beta, temperature=1.0):
    s, t = _probs(s_logits, temperature), _probs(t_logits, temperature)
    m = [beta * ti + (1 - beta) * si for si, ti in zip(s, t)]
    return beta * _kl_loop(t, m) + (1 - beta) * _kl_loop(s, m)


def test_hand_computed_two_token_case():
    # student (0.5, 0.5), teacher (0.75, 0.25): KL(t||s) = .75 ln 1.5 + .25 ln .5, KL(s||t) = .5 ln(2/3) + .5 ln 2
    s = torch.tensor([[[0.0, 0.0]]], dtype=torch.float64)
    t = torch.tensor([[[math.log(3.0), 0.0]]], dtype=torch.float64)
    assert forward_kl(s, t).item() == pytest.approx(0.75 * math.log(1.5) + 0.25 * math.log(0.5), abs=1e-12)
    assert reverse_kl(s, t).item() == pytest.approx(0.5 * math.log(2 / 3) + 0.5 * math.log(2.0), abs=1e-12)
    # the JSD with beta 0.5: m = (0.625, 0.375)
    m = (0.625, 0.375)
    jsd = 0.5 * (0.75 * math.log(0.75 / m[0]) + 0.25 * math.log(0.25 / m[1]))
    jsd += 0.5 * (0.5 * math.log(0.5 / m[0]) + 0.5 * math.log(0.5 / m[1]))
    assert generalized_jsd(s, t, beta=0.5).item() == pytest.approx(jsd, abs=1e-12)


@pytest.mark.parametrize("beta", [0.0, 0.1, 0.5, 0.9, 1.0])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_divergences_match_a_loop_in_fp64(beta, temperature):
    g = torch.Generator().manual_seed(0)
    B, T, V = 2, 3, 7
    s = torch.randn(B, T, V, generator=g, dtype=torch.float64) * 2
    t = torch.randn(B, T, V, generator=g, dtype=torch.float64) * 2
    mask = torch.tensor([[1, 1, 0], [0, 1, 1]], dtype=torch.float64)
    got_f = forward_kl(s, t, mask, temperature)
    got_r = reverse_kl(s, t, mask, temperature)
    got_j = generalized_jsd(s, t, mask, beta=beta, temperature=temperature)
    for b in range(B):
        for i in range(T):
            sl, tl, m = s[b, i].tolist(), t[b, i].tolist(), mask[b, i].item()
            ps, pt = _probs(sl, temperature), _probs(tl, temperature)
            assert got_f[b, i].item() == pytest.approx(m * _kl_loop(pt, ps), abs=1e-6)
            assert got_r[b, i].item() == pytest.approx(m * _kl_loop(ps, pt), abs=1e-6)
            want_j = (
                _kl_loop(pt, ps)
                if beta == 0
                else _kl_loop(ps, pt)
                if beta == 1
                else _jsd_loop(sl, tl, beta, temperature)
            )
            assert got_j[b, i].item() == pytest.approx(m * want_j, abs=1e-6)
    assert (got_f >= -1e-12).all() and (got_r >= -1e-12).all() and (got_j >= -1e-12).all()


def test_jsd_ends_are_the_two_kls_as_trl_defines_them():
    g = torch.Generator().manual_seed(1)
    s = torch.randn(4, 9, generator=g, dtype=torch.float64)
    t = torch.randn(4, 9, generator=g, dtype=torch.float64)
    # the mixture JSD itself tends to 0 at both ends; beta 0 and 1 are defined as the two KLs (TRL's convention)
    assert torch.allclose(generalized_jsd(s, t, beta=1e-9), torch.zeros(4, dtype=torch.float64), atol=1e-6)
    assert torch.equal(generalized_jsd(s, t, beta=0.0), forward_kl(s, t))
    assert torch.equal(generalized_jsd(s, t, beta=1.0), reverse_kl(s, t))


def test_topk_forward_kl_matches_a_loop_and_is_forward_kl_at_full_k():
    g = torch.Generator().manual_seed(2)
    V, K = 11, 4
    s = torch.randn(2, 3, V, generator=g, dtype=torch.float64)
    t = torch.randn(2, 3, V, generator=g, dtype=torch.float64)
    t_lp = torch.log_softmax(t, -1)
    top_lp, top_ids = t_lp.topk(K, dim=-1)
    got = topk_forward_kl(s, top_lp, top_ids)
    for b in range(2):
        for i in range(3):
            pt = _probs(top_lp[b, i].tolist())  # renormalised over the k tokens
            ps_all = _probs(s[b, i].tolist())
            ps = [ps_all[j] for j in top_ids[b, i].tolist()]
            want = sum(p * (math.log(p) - math.log(q)) for p, q in zip(pt, ps))
            assert got[b, i].item() == pytest.approx(want, abs=1e-6)
    full_lp, full_ids = t_lp.topk(V, dim=-1)
    assert torch.allclose(topk_forward_kl(s, full_lp, full_ids), forward_kl(s, t), atol=1e-10)


def test_topk_jsd_by_hand():
    """V = 3, the teacher's top 2 of [log .5, log .3, log .2] (ids 0, 1; renormalised: 5/8, 3/8), a uniform
    student, beta 0.5: m = (5/16 + 1/6, 3/16 + 1/6) on the two ids; the student's third token (1/3) lies outside
    them, where m = s / 2, and adds 1/3 x log 2 to KL(s || m)."""
    s = torch.zeros(1, 3, dtype=torch.float64)
    top_lp = torch.tensor([[math.log(0.5), math.log(0.3)]], dtype=torch.float64)
    top_ids = torch.tensor([[0, 1]])
    t, q = [5 / 8, 3 / 8], [1 / 3, 1 / 3]
    m = [0.5 * a + 0.5 * b for a, b in zip(t, q)]
    kl_tm = sum(a * math.log(a / c) for a, c in zip(t, m))
    kl_sm = sum(b * math.log(b / c) for b, c in zip(q, m)) + (1 / 3) * math.log(2)
    want = 0.5 * kl_tm + 0.5 * kl_sm
    assert topk_generalized_jsd(s, top_lp, top_ids, beta=0.5).item() == pytest.approx(want, abs=1e-12)
    assert want == pytest.approx(0.1386856, abs=1e-6)  # by hand: (0.187499 + 0.089872) / 2


@pytest.mark.parametrize("beta", [0.1, 0.5, 0.9])
def test_topk_jsd_is_the_jsd_to_the_truncated_teacher_and_the_full_one_at_full_k(beta):
    """Against :func:`generalized_jsd` with the teacher's logits at -inf off its k tokens (the same distributions,
    computed over the whole vocabulary), masked, fp64 to 1e-10; and at k = V the plain JSD."""
    g = torch.Generator().manual_seed(3)
    V, K = 13, 5
    s = torch.randn(2, 4, V, generator=g, dtype=torch.float64)
    t = torch.randn(2, 4, V, generator=g, dtype=torch.float64) * 2
    mask = torch.tensor([[1, 1, 0, 1], [0, 1, 1, 1]], dtype=torch.float64)
    t_lp = torch.log_softmax(t, -1)
    top_lp, top_ids = t_lp.topk(K, dim=-1)
    truncated = torch.full_like(t, -math.inf).scatter(-1, top_ids, top_lp)
    got = topk_generalized_jsd(s, top_lp, top_ids, mask, beta=beta, temperature=0.7)
    want = generalized_jsd(s, truncated * 0.7, mask, beta=beta, temperature=0.7)  # the teacher's lp stay as given
    assert torch.allclose(got, want, atol=1e-10), (got, want)
    assert (got[mask == 0] == 0).all() and (got[mask == 1] > 0).all()
    full_lp, full_ids = t_lp.topk(V, dim=-1)
    assert torch.allclose(
        topk_generalized_jsd(s, full_lp, full_ids, beta=beta), generalized_jsd(s, t, beta=beta), atol=1e-10
    )
    assert torch.equal(topk_generalized_jsd(s, top_lp, top_ids, beta=0.0), topk_forward_kl(s, top_lp, top_ids))


def test_distill_advantages_is_minus_the_sampled_reverse_kl():
    student = torch.tensor([[-1.0, -2.0, -0.5]], dtype=torch.float64)
    teacher = torch.tensor([[-0.5, -3.0, -0.5]], dtype=torch.float64)
    mask = torch.tensor([[1.0, 1.0, 0.0]], dtype=torch.float64)
    assert distill_advantages(student, teacher, mask).tolist() == [[0.5, -1.0, 0.0]]


def test_the_gradient_of_the_reverse_kl_moves_the_student_to_the_teacher():
    t = torch.tensor([[2.0, 0.0, -1.0]])
    s = torch.zeros(1, 3, requires_grad=True)
    opt = torch.optim.SGD([s], lr=1.0)
    before = reverse_kl(s, t).item()
    for _ in range(50):
        opt.zero_grad()
        reverse_kl(s, t).sum().backward()
        opt.step()
    assert reverse_kl(s, t).item() < before / 100


def test_bad_shapes_and_settings_are_named():
    s, t = torch.zeros(2, 5), torch.zeros(2, 6)
    with pytest.raises(ValueError, match="share a vocabulary"):
        forward_kl(s, t)
    with pytest.raises(ValueError, match="beta must be in"):
        generalized_jsd(s, s, beta=1.5)
    with pytest.raises(ValueError, match="temperature must be > 0"):
        reverse_kl(s, s, temperature=0)
    with pytest.raises(ValueError, match="same shape"):
        topk_forward_kl(s, torch.zeros(2, 3), torch.zeros(2, 2, dtype=torch.long))
    with pytest.raises(ValueError, match=r"beta must be in \[0, 1\) for a top-k teacher"):
        topk_generalized_jsd(s, torch.zeros(2, 2), torch.zeros(2, 2, dtype=torch.long), beta=1.0)
