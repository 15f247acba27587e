"""torch_varlen and flex_attention for packed rows: the sequence boundaries read from the position ids,
the refusals where the kernels cannot run, the sdpa deferral for padded rows (CPU), and on a GPU the
packed forward and backward equal padded sdpa's (skipped without CUDA, with the reason)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from rl_core.attention import attention_implementation
from rl_core.preflight import InputError
from rl_core.varlen_attention import cu_seqlens, register, varlen_available
from rl_rollout.testing import make_tiny_model

CUDA = torch.cuda.is_available()
NO_VARLEN = varlen_available()
LENS = [37, 1, 120, 64, 9]  # one packed row; a 1-token sequence included


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):  # 4 query heads over 2 KV heads: GQA goes through the kernel
    return make_tiny_model(tmp_path_factory.mktemp("m") / "tiny", hidden_size=128, num_heads=4, num_kv_heads=2,
                           peaked=True)


def _packed(lens, vocab=128, seed=0):
    g = torch.Generator().manual_seed(seed)
    seqs = [torch.randint(5, vocab, (n,), generator=g) for n in lens]
    return seqs, torch.cat(seqs)[None], torch.cat([torch.arange(n) for n in lens])[None]


def test_cu_seqlens_from_restarting_positions():
    cu, longest = cu_seqlens(torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2, 3, 0]]), 1)
    assert cu.tolist() == [0, 3, 5, 9, 10] and longest == 4 and cu.dtype == torch.int32
    # rows of a batch are separate even when positions continue across the row edge; (1, S) broadcasts
    cu, longest = cu_seqlens(torch.tensor([[0, 1, 2]]), 2)
    assert cu.tolist() == [0, 3, 6] and longest == 3
    cu, _ = cu_seqlens(torch.tensor([[3, 4, 5], [6, 7, 0]]), 2)  # offsets: a jump that is not +1 starts one
    assert cu.tolist() == [0, 3, 5, 6]


@pytest.mark.skipif(NO_VARLEN is None, reason="torch_varlen can run here, so asking for it is valid")
def test_torch_varlen_where_it_cannot_run_says_what_to_use():
    """An InputError: the CLI prints it as its one last line (exit code 2), before any weights load."""
    with pytest.raises(InputError, match=r"torch_varlen cannot run here: .*; use sdpa \(--attn_implementation sdpa"):
        attention_implementation("torch_varlen")


@pytest.mark.skipif(CUDA, reason="a CUDA device is visible, so flex_attention is valid")
def test_flex_attention_without_cuda_says_what_to_use():
    with pytest.raises(InputError, match=r"flex_attention needs a CUDA device.*use sdpa"):
        attention_implementation("flex_attention")


def test_padded_rows_defer_to_sdpa_and_packed_rows_off_gpu_are_refused(tiny):
    """On CPU the registered implementation still serves padded rows (its mask function builds sdpa's
    mask); a packed fp32 CPU row, which only the GPU kernel can run, is a one-line error, not a wrong answer."""
    from transformers import AutoModelForCausalLM

    register()  # bypasses attention_implementation's CUDA check on purpose: the padded path is sdpa's
    ours = AutoModelForCausalLM.from_pretrained(tiny, attn_implementation="torch_varlen").eval()
    sdpa = AutoModelForCausalLM.from_pretrained(tiny, attn_implementation="sdpa").eval()
    seqs, ids, pos = _packed([7, 3, 5])
    T = 7
    padded = torch.stack([F.pad(s, (T - len(s), 0)) for s in seqs])
    mask = torch.stack([F.pad(torch.ones(len(s), dtype=torch.long), (T - len(s), 0)) for s in seqs])
    with torch.no_grad():
        torch.testing.assert_close(ours(padded, attention_mask=mask).logits, sdpa(padded, attention_mask=mask).logits,
                                   atol=0, rtol=0)
        with pytest.raises(ValueError, match=r"torch_varlen runs torch's flash-attention varlen kernel.*torch.float32 "
                                             r"on cpu.*use --attn_implementation sdpa"):
            ours(ids, position_ids=pos)


def _logprobs_and_grads(model, ids, pos=None, mask=None):
    model.zero_grad(set_to_none=True)
    lp = model(ids, attention_mask=mask, position_ids=pos).logprobs
    (lp.float() if mask is None else lp.float() * mask).sum().backward()  # real tokens only: pads carry no loss
    grads = {n: p.grad.float().clone() for n, p in model.named_parameters() if p.grad is not None}
    return lp.detach().float(), grads


@pytest.mark.skipif(not CUDA, reason="torch_varlen and flex_attention run on CUDA only (no GPU here); the lead runs "
                                     "this on the H200")
@pytest.mark.parametrize("impl", ["torch_varlen", "flex_attention"])
def test_packed_forward_and_backward_equal_padded_sdpa_on_gpu(tiny, impl):
    """bf16 on the GPU: the packed row through ``impl`` is as close to the fp32 padded sdpa reference as
    bf16 padded sdpa is (a boundary leak or a wrong scale would be orders of magnitude further), for
    the per-token log-probs and for every parameter's gradient."""
    if impl == "torch_varlen" and NO_VARLEN is not None:
        pytest.skip(NO_VARLEN)
    from rl_core.models import Actor

    seqs, ids, pos = _packed(LENS)
    T = max(LENS)
    padded = torch.stack([F.pad(s, (0, T - len(s))) for s in seqs]).cuda()
    mask = torch.stack([F.pad(torch.ones(len(s), dtype=torch.long), (0, T - len(s))) for s in seqs]).cuda()

    def unpad(lp):
        return torch.cat([lp[i, :n] for i, n in enumerate(LENS)])

    runs = {}
    for name, dtype, attn, packed in [("ref", "fp32", "sdpa", False), ("sdpa", "bf16", "sdpa", False),
                                      (impl, "bf16", impl, True)]:
        model = Actor.from_pretrained(tiny, dtype=dtype, attn_implementation=attn).cuda()
        lp, grads = (_logprobs_and_grads(model, ids.cuda(), pos=pos.cuda()) if packed
                     else _logprobs_and_grads(model, padded, mask=mask))
        runs[name] = (lp[0] if packed else unpad(lp), grads)
    ref_lp, ref_g = runs["ref"]
    for name in ("sdpa", impl):
        assert runs[name][0].shape == ref_lp.shape
    err = {k: (runs[k][0] - ref_lp).abs().max().item() for k in ("sdpa", impl)}
    print(f"max |log-prob - fp32 ref|: {err}")
    assert err[impl] <= 3 * err["sdpa"] + 1e-2, err

    def rel(g):
        return max(((g[n] - ref_g[n]).norm() / ref_g[n].norm().clamp_min(1e-12)).item() for n in ref_g)

    gerr = {k: rel(runs[k][1]) for k in ("sdpa", impl)}
    print(f"max relative grad error vs fp32 ref: {gerr}")
    assert set(runs[impl][1]) == set(ref_g) and gerr[impl] <= 3 * gerr["sdpa"] + 1e-2, gerr


@pytest.mark.skipif(NO_VARLEN is not None, reason=f"torch_varlen cannot run here: {NO_VARLEN}")
def test_varlen_kernel_call_equals_per_sequence_sdpa_with_gqa_and_scale():
    """The attention function alone: bf16 q/k/v of a packed row with 8 query heads over 2 KV heads and a
    non-default scale, against fp32 sdpa of each sequence separately (forward and input gradients)."""
    from types import SimpleNamespace

    from rl_core.varlen_attention import torch_varlen_attention_forward

    torch.manual_seed(0)
    S, D = sum(LENS), 64
    q = torch.randn(1, 8, S, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(1, 2, S, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(1, 2, S, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    pos = torch.cat([torch.arange(n) for n in LENS])[None].cuda()
    out, _ = torch_varlen_attention_forward(SimpleNamespace(is_causal=True, training=True), q, k, v, None,
                                            scaling=0.05, position_ids=pos)
    go = torch.randn_like(out)
    gq, gk, gv = torch.autograd.grad(out, (q, k, v), go)
    qf, kf, vf = (t.detach().float().requires_grad_() for t in (q, k, v))
    parts, start = [], 0
    for n in LENS:
        sl = slice(start, start + n)
        parts.append(F.scaled_dot_product_attention(qf[:, :, sl], kf[:, :, sl].repeat_interleave(4, 1),
                                                    vf[:, :, sl].repeat_interleave(4, 1), is_causal=True, scale=0.05))
        start += n
    ref = torch.cat(parts, 2).transpose(1, 2)
    rq, rk, rv = torch.autograd.grad(ref, (qf, kf, vf), go.float())
    torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2)
    for a, b in ((gq, rq), (gk, rk), (gv, rv)):
        torch.testing.assert_close(a.float(), b, atol=5e-2, rtol=5e-2)
