"""logprobs_from_logits / entropy_from_logits: accuracy vs float64, gradients, chunking, memory."""

import pytest
import torch

from rl_algos.losses import entropy_from_logits, logprobs_from_logits


def ref_logprobs(logits, labels, temperature=1.0):
    return torch.log_softmax(logits.double() / temperature, -1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)


def ref_entropy(logits, temperature=1.0):
    lp = torch.log_softmax(logits.double() / temperature, -1)
    return -(lp.exp() * lp).sum(-1)


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("temperature", [1.0, 0.7, 1.5])
@pytest.mark.parametrize("chunk_rows", [None, 1, 3, 1000])
def test_float32_matches_float64(seed, temperature, chunk_rows):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(3, 11, 257, generator=g) * 4
    labels = torch.randint(0, 257, (3, 11), generator=g)
    out = logprobs_from_logits(logits, labels, temperature=temperature, chunk_rows=chunk_rows)
    assert out.dtype == torch.float32 and out.shape == (3, 11)
    torch.testing.assert_close(out.double(), ref_logprobs(logits, labels, temperature), rtol=3e-7, atol=1e-6)
    ent = entropy_from_logits(logits, temperature=temperature, chunk_rows=chunk_rows)
    torch.testing.assert_close(ent.double(), ref_entropy(logits, temperature), rtol=0, atol=2e-5)


def test_bf16_logits_keep_float32_accuracy_where_bf16_log_softmax_does_not():
    g = torch.Generator().manual_seed(0)
    V = 50_000
    logits = (torch.randn(2, 64, V, generator=g) * 3).bfloat16()
    labels = torch.randint(0, V, (2, 64), generator=g)
    ref = ref_logprobs(logits, labels)
    ours = (logprobs_from_logits(logits, labels).double() - ref).abs().max().item()
    bf16 = (torch.log_softmax(logits, -1).gather(-1, labels[..., None]).squeeze(-1).double() - ref).abs().max().item()
    assert ours < 1e-5, ours
    assert bf16 > 1e-2, bf16  # the failure mode the chunked float32 path exists to avoid


def test_gradcheck_float64():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 4, 9, generator=g, dtype=torch.float64, requires_grad=True)
    y = torch.randint(0, 9, (2, 4), generator=g)
    assert torch.autograd.gradcheck(lambda a: logprobs_from_logits(a, y, 0.8, chunk_rows=3), (x,))
    assert torch.autograd.gradcheck(lambda a: entropy_from_logits(a, 1.3, chunk_rows=3), (x,))
    assert torch.autograd.gradgradcheck is not None


def test_gradients_match_autograd_reference_in_bf16():
    g = torch.Generator().manual_seed(2)
    x = (torch.randn(2, 5, 300, generator=g) * 2).bfloat16().requires_grad_(True)
    y = torch.randint(0, 300, (2, 5), generator=g)
    w = torch.randn(2, 5, generator=g)
    ((logprobs_from_logits(x, y, 0.9) * w).sum() + entropy_from_logits(x, 0.9).sum()).backward()
    xr = x.detach().float().requires_grad_(True)
    lp = torch.log_softmax(xr / 0.9, -1)
    ((lp.gather(-1, y[..., None]).squeeze(-1) * w).sum() - (lp.exp() * lp).sum()).backward()
    assert x.grad.dtype == torch.bfloat16
    torch.testing.assert_close(x.grad.float(), xr.grad, rtol=2e-2, atol=2e-3)


def test_non_contiguous_and_errors():
    x = torch.randn(7, 3, 20).transpose(0, 1)  # [3, 7, 20], non-contiguous
    y = torch.randint(0, 20, (3, 7))
    torch.testing.assert_close(logprobs_from_logits(x, y).double(), ref_logprobs(x, y), atol=2e-6, rtol=0)
    with pytest.raises(ValueError, match=r"labels shape \(3, 6\) must equal logits shape without the vocab axis \(3, 7\)"):
        logprobs_from_logits(x, y[:, :6])
    with pytest.raises(ValueError, match="temperature must be > 0, got 0"):
        logprobs_from_logits(x, y, temperature=0)
    with pytest.raises(ValueError, match="chunk_rows must be >= 1"):
        entropy_from_logits(x, chunk_rows=0)


# glibc is told (MALLOC_MMAP_THRESHOLD_) to mmap every block over 1 MiB, so freed tensors leave
# RSS at once and cannot hide a new allocation; the peak (VmHWM) is reset to the current RSS
# (clear_refs 5, Linux >= 4.0) just before the measured call.
PEAK_SCRIPT = """
import sys, torch

def hwm_kib():
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1])

from rl_algos.losses import logprobs_from_logits
V = 32_000
logits = torch.randn(2, 512, V, dtype=torch.bfloat16)  # 62.5 MiB (no float32 temporary)
labels = torch.randint(0, V, (2, 512))
logprobs_from_logits(logits[:, :8], labels[:, :8])  # warm up allocator and kernels
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")
before = hwm_kib()
mode = sys.argv[1]
if mode == "ours":
    logprobs_from_logits(logits, labels)
else:
    torch.log_softmax(logits.float(), -1).gather(-1, labels[..., None])
after = hwm_kib()
print((after - before) * 1024)
"""


def test_peak_memory_is_one_chunk_not_a_second_logits_tensor():
    """Peak resident memory (ru_maxrss, in a fresh process) grows by far less than one
    float32 copy of the logits, while the naive path grows by at least two."""
    import os
    import subprocess
    import sys

    def extra(mode):
        env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(1 << 20)}
        out = subprocess.run([sys.executable, "-c", PEAK_SCRIPT, mode], capture_output=True, text=True, check=True,
                             env=env)
        return int(out.stdout.strip().splitlines()[-1])

    full_copy = 2 * 512 * 32_000 * 4
    ours, naive = extra("ours"), extra("naive")
    assert naive >= 1.5 * full_copy, (naive, full_copy)  # the measurement can see a copy
    assert ours < full_copy / 10, (ours, full_copy)
