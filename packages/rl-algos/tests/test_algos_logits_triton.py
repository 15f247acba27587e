"""The Triton log-prob / entropy kernels (rl_algos.losses.logits_triton) against float64.

They run on CUDA, or on CPU tensors under the Triton interpreter (``TRITON_INTERPRET=1``,
set before triton is imported) where triton is installed; elsewhere they skip, saying why.
Without CUDA but with triton (torch's CUDA wheels bring it), one test reruns a subset of
this file in a subprocess under the interpreter, so CI checks the kernels' arithmetic.
The dispatch rules (``RL_LOGPROBS_KERNEL``) are tested everywhere.
"""

import importlib.util
import os
import subprocess
import sys

import pytest
import torch

from rl_algos.losses import logits as L
from rl_algos.losses import entropy_from_logits, logprobs_and_entropy_from_logits, logprobs_from_logits

HAS_TRITON = importlib.util.find_spec("triton") is not None
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if not HAS_TRITON:
    SKIP = "triton is not installed (it ships with torch's CUDA builds)"
elif DEVICE == "cpu" and not INTERPRET:
    SKIP = "no CUDA device; set TRITON_INTERPRET=1 to interpret the kernels on CPU"
else:
    SKIP = None
needs_kernel = pytest.mark.skipif(SKIP is not None, reason=str(SKIP))


@pytest.fixture
def triton_path(monkeypatch):
    monkeypatch.setenv(L.KERNEL_ENV, "triton")


def ref(logits, labels, temperature):
    lp = torch.log_softmax(logits.double() / temperature, -1)
    return lp.gather(-1, labels.unsqueeze(-1)).squeeze(-1), -(lp.exp() * lp).sum(-1)


def data(shape, V, dtype, seed=0, scale=4.0):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(*shape, V, generator=g) * scale).to(dtype)
    y = torch.randint(0, V, shape, generator=g)
    y.view(-1)[0], y.view(-1)[-1] = 0, V - 1  # both ends of the vocabulary
    return x.to(DEVICE), y.to(DEVICE)


@needs_kernel
@pytest.mark.parametrize("block", [16, 64, 1024], ids=lambda b: f"block{b}")
@pytest.mark.parametrize("temperature", [1.0, 0.7, 1.6], ids=lambda t: f"T{t}")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=["bf16", "fp16", "fp32"])
def test_forward_matches_float64(triton_path, monkeypatch, block, temperature, dtype):
    monkeypatch.setattr("rl_algos.losses.logits_triton.BLOCK_V", block)
    x, y = data((3, 7), 1000, dtype)  # 1000 is a multiple of no block above
    out = logprobs_and_entropy_from_logits(x, y, temperature)
    lp_ref, ent_ref = ref(x, y, temperature)
    assert out.logprobs.dtype == torch.float32 and out.logprobs.shape == (3, 7) and out.entropy.shape == (3, 7)
    assert (out.logprobs.double() - lp_ref).abs().max().item() < 1e-5
    assert (out.entropy.double() - ent_ref).abs().max().item() < 1e-5
    torch.testing.assert_close(logprobs_from_logits(x, y, temperature), out.logprobs, rtol=0, atol=0)
    torch.testing.assert_close(entropy_from_logits(x, temperature), out.entropy, rtol=0, atol=0)


@needs_kernel
def test_entropy_has_no_cancellation_on_large_peaked_logits(triton_path):
    # lse - E_p[x] at |x| ~ 1e4 in float32 would be off by ~1e-3; log s - t/s is not
    x, y = data((2, 5), 777, torch.float32, seed=3, scale=30.0)
    x = x + 1e4
    out = logprobs_and_entropy_from_logits(x, y)
    lp_ref, ent_ref = ref(x, y, 1.0)
    assert (out.entropy.double() - ent_ref).abs().max().item() < 1e-5
    assert (out.logprobs.double() - lp_ref).abs().max().item() < 2e-3  # x_y - lse at 1e4: float32 ulp is 1e-3


@needs_kernel
def test_sliced_views_need_no_copy_and_match(triton_path):
    x, y = data((2, 9), 300, torch.bfloat16, seed=4)
    view = x[:, :-1]  # what the actor passes: a non-contiguous [B, T-1, V] view
    assert L._use_triton(view, None)
    from rl_algos.losses.logits_triton import row_view

    assert row_view(view)[0].data_ptr() == x.data_ptr()
    out = logprobs_and_entropy_from_logits(view, y[:, 1:], 0.9)
    lp_ref, ent_ref = ref(view, y[:, 1:], 0.9)
    assert (out.logprobs.double() - lp_ref).abs().max().item() < 1e-5
    assert (out.entropy.double() - ent_ref).abs().max().item() < 1e-5


@needs_kernel
@pytest.mark.parametrize("block", [32, 512], ids=lambda b: f"block{b}")
@pytest.mark.parametrize("which", ["logprobs", "entropy", "both"])
def test_backward_matches_float64_autograd(triton_path, monkeypatch, block, which):
    monkeypatch.setattr("rl_algos.losses.logits_triton.BLOCK_V", block)
    T = 0.8
    x, y = data((2, 6), 700, torch.float32, seed=5, scale=3.0)
    g = torch.Generator().manual_seed(6)
    w_lp, w_ent = torch.randn(2, 6, generator=g).to(DEVICE), torch.randn(2, 6, generator=g).to(DEVICE)

    def loss(lp, ent):
        return {"logprobs": (lp * w_lp).sum(), "entropy": (ent * w_ent).sum(),
                "both": (lp * w_lp).sum() + (ent * w_ent).sum()}[which]

    xk = x.clone().requires_grad_(True)
    out = logprobs_and_entropy_from_logits(xk, y, T)
    loss(out.logprobs, out.entropy).backward()
    xr = x.double().requires_grad_(True)
    loss(*ref(xr, y, T)).backward()
    assert xk.grad.dtype == torch.float32
    assert (xk.grad.double() - xr.grad).abs().max().item() < 1e-5  # float32 arithmetic, gradients up to ~0.5


@needs_kernel
def test_backward_in_bf16_writes_bf16_gradients(triton_path):
    x, y = data((2, 5), 300, torch.bfloat16, seed=7, scale=2.0)
    x.requires_grad_(True)
    (logprobs_from_logits(x, y, 0.9).sum() + entropy_from_logits(x, 0.9).sum()).backward()
    xr = x.detach().double().requires_grad_(True)
    lp, ent = ref(xr, y, 0.9)
    (lp.sum() + ent.sum()).backward()
    assert x.grad.dtype == torch.bfloat16
    torch.testing.assert_close(x.grad.double(), xr.grad, rtol=1e-2, atol=1e-3)


@needs_kernel
def test_out_of_range_label_gives_nan_not_a_read_outside_the_row(triton_path):
    x, y = data((1, 3), 50, torch.float32)
    y[0, 1] = 50
    lp = logprobs_from_logits(x, y)
    assert torch.isnan(lp[0, 1]) and torch.isfinite(lp[0, 0]) and torch.isfinite(lp[0, 2])


def test_dispatch_rules(monkeypatch):
    x = torch.randn(2, 3, 10)
    monkeypatch.setenv(L.KERNEL_ENV, "torch")
    assert not L._use_triton(x, None)
    monkeypatch.setenv(L.KERNEL_ENV, "cuda")
    with pytest.raises(ValueError, match="RL_LOGPROBS_KERNEL='cuda' is not one of auto, torch, triton"):
        logprobs_from_logits(x, torch.zeros(2, 3, dtype=torch.long))
    monkeypatch.setenv(L.KERNEL_ENV, "triton")
    with pytest.raises(RuntimeError, match="RL_LOGPROBS_KERNEL=triton but logits dtype torch.float64 has no triton kernel"):
        entropy_from_logits(x.double())
    monkeypatch.delenv(L.KERNEL_ENV)
    assert not L._use_triton(x.double(), None)  # auto: float64 takes the torch path
    if SKIP is None:
        assert L._use_triton(x.to(DEVICE), None) == (DEVICE == "cuda")  # auto never interprets on CPU
        assert not L._use_triton(x.to(DEVICE), 4)  # chunk_rows is the torch path's knob
        monkeypatch.setenv(L.KERNEL_ENV, "triton")
        with pytest.raises(ValueError, match="chunk_rows=4 applies to the chunked torch path only"):
            entropy_from_logits(x.to(DEVICE), chunk_rows=4)


def test_combined_function_on_the_torch_path_equals_the_two_functions(monkeypatch):
    monkeypatch.setenv(L.KERNEL_ENV, "torch")
    x, y = torch.randn(3, 4, 57), torch.randint(0, 57, (3, 4))
    out = logprobs_and_entropy_from_logits(x, y, 1.3, chunk_rows=2)
    torch.testing.assert_close(out.logprobs, logprobs_from_logits(x, y, 1.3), rtol=0, atol=1e-7)
    torch.testing.assert_close(out.entropy, entropy_from_logits(x, 1.3), rtol=0, atol=1e-7)


@pytest.mark.skipif(not HAS_TRITON or DEVICE == "cuda" or INTERPRET,
                    reason="runs only without CUDA, with triton, outside the interpreter (the tests above run directly then)")
@pytest.mark.skipif(importlib.util.find_spec("numpy") is None,
                    reason="the Triton interpreter needs numpy, which rl-algos does not depend on (its own venv has "
                           "none); the workspace venv has it and runs this test")
def test_kernels_under_the_triton_interpreter_on_cpu():
    subset = ("(forward and block64 and (bf16 or T0.7)) or (backward and block32) or sliced or cancellation"
              " or bf16_gradients or nan")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-W", "ignore::RuntimeWarning",
                        __file__, "-k", subset], env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    assert " passed" in r.stdout and "skipped" not in r.stdout, r.stdout[-1000:]
