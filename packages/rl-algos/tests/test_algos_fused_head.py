"""logprobs_from_hidden: the LM head and the log-probs chunk by chunk equal the unfused path (values and the
gradients of hidden, weight and bias), pass float64 gradcheck, and keep no [tokens, vocabulary] tensor for
backward."""

import pytest
import torch
import torch.nn.functional as F

from rl_algos import logprobs_and_entropy_from_logits, logprobs_from_hidden, logprobs_from_logits


def _inputs(dtype, seed=0, B=3, T=5, H=16, V=97):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(B, T, H, generator=g, dtype=dtype).requires_grad_()
    w = (torch.randn(V, H, generator=g, dtype=dtype) / 2).requires_grad_()
    b = torch.randn(V, generator=g, dtype=dtype).requires_grad_()
    labels = torch.randint(0, V, (B, T), generator=g)
    return h, w, b, labels, g


@pytest.mark.parametrize("chunk_tokens", [None, 1, 4, 1000])
@pytest.mark.parametrize("entropy", [False, True])
@pytest.mark.parametrize("with_bias", [False, True])
def test_equals_the_unfused_head_and_kernel_with_their_gradients(chunk_tokens, entropy, with_bias):
    h, w, b, labels, g = _inputs(torch.float32)
    bias = b if with_bias else None
    up = [torch.randn(labels.shape, generator=g) for _ in range(2)]
    out = logprobs_from_hidden(h, w, labels, bias=bias, temperature=0.7, return_entropy=entropy,
                               chunk_tokens=chunk_tokens)
    logits = F.linear(h, w, bias)
    ref = logprobs_and_entropy_from_logits(logits, labels, 0.7) if entropy else logprobs_from_logits(logits, labels, 0.7)
    outs, refs = (list(out), list(ref)) if entropy else ([out], [ref])
    assert all(o.dtype == torch.float32 and o.shape == labels.shape for o in outs)
    params = [h, w] + ([bias] if with_bias else [])
    got = torch.autograd.grad(sum((o * u).sum() for o, u in zip(outs, up)), params)
    want = torch.autograd.grad(sum((r * u).sum() for r, u in zip(refs, up)), params)
    for o, r in zip(outs, refs):
        torch.testing.assert_close(o, r, rtol=0, atol=1e-5)
    for name, x, y in zip(("hidden", "weight", "bias"), got, want):
        assert x.dtype == y.dtype
        torch.testing.assert_close(x, y, rtol=0, atol=1e-5, msg=name)


def test_float64_gradcheck_through_hidden_weight_and_bias_with_entropy_and_temperature():
    h, w, b, labels, _ = _inputs(torch.float64, B=2, T=3, H=5, V=11)

    def both(h_, w_, b_):
        return torch.stack(list(logprobs_from_hidden(h_, w_, labels, bias=b_, temperature=1.3,
                                                     return_entropy=True, chunk_tokens=4)))

    assert torch.autograd.gradcheck(both, (h, w, b))


def test_backward_keeps_no_tokens_by_vocabulary_tensor():
    """What autograd saves for backward: the unfused path keeps the [N, V] logits, the fused one the inputs only."""
    h, w, _, labels, _ = _inputs(torch.float32, B=4, T=8, H=16, V=4096)

    def saved_numels(fn):
        sizes = []

        def pack(t):
            sizes.append(t.numel())
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            fn()
        return sizes

    n_tokens, vocab = labels.numel(), w.shape[0]
    unfused = saved_numels(lambda: logprobs_from_logits(F.linear(h, w), labels))
    fused = saved_numels(lambda: logprobs_from_hidden(h, w, labels, chunk_tokens=8))
    assert max(unfused) >= n_tokens * vocab  # the logits
    assert sorted(fused) == sorted([n_tokens, n_tokens * h.shape[-1], vocab * h.shape[-1]])  # labels, hidden, weight


def test_errors_name_the_bad_value():
    h, w, _, labels, _ = _inputs(torch.float32)
    with pytest.raises(ValueError, match="labels shape"):
        logprobs_from_hidden(h, w, labels[:, :-1])
    with pytest.raises(ValueError, match=r"weight must be \[vocabulary, hidden\] with hidden 16"):
        logprobs_from_hidden(h, w[:, :8], labels)
    with pytest.raises(ValueError, match=r"bias must be \[97\]"):
        logprobs_from_hidden(h, w, labels, bias=torch.zeros(3))
    with pytest.raises(ValueError, match="chunk_tokens must be >= 1"):
        logprobs_from_hidden(h, w, labels, chunk_tokens=0)
    with pytest.raises(ValueError, match="temperature must be > 0"):
        logprobs_from_hidden(h, w, labels, temperature=0.0)


@pytest.mark.parametrize("chunk_tokens", [None, 1, 4])
@pytest.mark.parametrize("with_bias", [False, True])
def test_a_weighted_sum_made_with_its_gradients_in_forward_equals_the_unfused_one(chunk_tokens, with_bias):
    """weighted_logprob_sum_from_hidden: sum(w * lp) and its gradients (scaled by the upstream gradient) as the
    unfused path's; the log-probs it returns carry no gradient."""
    from rl_algos import weighted_logprob_sum_from_hidden

    h, w, b, labels, g = _inputs(torch.float32)
    bias = b if with_bias else None
    weights = torch.randn(labels.shape, generator=g)
    total, lp = weighted_logprob_sum_from_hidden(h, w, labels, weights, bias=bias, temperature=0.8,
                                                 chunk_tokens=chunk_tokens)
    ref_lp = logprobs_from_logits(F.linear(h, w, bias), labels, 0.8)
    ref = (ref_lp * weights).sum()
    assert not lp.requires_grad and total.requires_grad
    torch.testing.assert_close(lp, ref_lp.detach(), rtol=0, atol=1e-5)
    torch.testing.assert_close(total, ref, rtol=1e-6, atol=1e-5)
    params = [h, w] + ([bias] if with_bias else [])
    for name, x, y in zip(("hidden", "weight", "bias"), torch.autograd.grad(2.5 * total, params),
                          torch.autograd.grad(2.5 * ref, params)):
        torch.testing.assert_close(x, y, rtol=0, atol=1e-5, msg=name)


def test_the_weighted_sum_passes_float64_gradcheck():
    from rl_algos import weighted_logprob_sum_from_hidden

    h, w, b, labels, g = _inputs(torch.float64, B=2, T=3, H=5, V=11)
    weights = torch.randn(labels.shape, generator=g, dtype=torch.float64)
    assert torch.autograd.gradcheck(
        lambda h_, w_, b_: weighted_logprob_sum_from_hidden(h_, w_, labels, weights, bias=b_, temperature=1.3,
                                                            chunk_tokens=4)[0], (h, w, b))


@pytest.mark.skipif(not torch.cuda.is_available(),
                    reason="needs a CUDA device: the bf16 head in chunks through the Triton log-prob kernel")
@pytest.mark.parametrize("entropy", [False, True])
def test_cuda_bf16_is_as_close_to_float64_as_the_full_logits_path(entropy):
    """On the GPU both paths round the head's logits to bf16 (the fused one per chunk, whose matmul may tile
    differently): the fused log-probs, entropy and gradients must be as close to float64 as the full path's."""
    g = torch.Generator(device="cuda").manual_seed(0)
    N, H, V = 4096, 896, 32_771  # an odd vocabulary: the kernel's masked tail block
    h = torch.randn(N, H, device="cuda", generator=g).bfloat16().requires_grad_()
    w = (torch.randn(V, H, device="cuda", generator=g) / H ** 0.5).bfloat16().requires_grad_()
    labels = torch.randint(0, V, (N,), device="cuda", generator=g)
    up = torch.randn(N, device="cuda", generator=g)

    def run(fn):
        outs = fn()
        outs = list(outs) if entropy else [outs]
        grads = torch.autograd.grad(sum((o.float() * up).sum() for o in outs), (h, w))
        return [o.detach().double() for o in outs] + [x.double() for x in grads]

    fused = run(lambda: logprobs_from_hidden(h, w, labels, temperature=0.9, return_entropy=entropy,
                                             chunk_tokens=1024))
    full = run(lambda: (logprobs_and_entropy_from_logits if entropy else logprobs_from_logits)(
        F.linear(h, w), labels, 0.9))
    h64, w64 = h.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    lp = torch.log_softmax(F.linear(h64, w64) / 0.9, -1)
    ref = [lp.gather(-1, labels[:, None])[:, 0]] + ([-(lp.exp() * lp).sum(-1)] if entropy else [])
    ref = [r.detach() for r in ref] + list(torch.autograd.grad(sum((r * up.double()).sum() for r in ref), (h64, w64)))
    names = ["logprobs"] + (["entropy"] if entropy else []) + ["grad hidden", "grad weight"]
    for name, a, b, r in zip(names, fused, full, ref):
        err_fused, err_full = (a - r).abs().max().item(), (b - r).abs().max().item()
        scale = r.abs().max().item()
        assert err_fused <= 1.5 * err_full + 1e-3 * scale, (name, err_fused, err_full, scale)
