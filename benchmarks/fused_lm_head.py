"""Benchmark: token log-probs from hidden states, the LM head fused with the log-probs (``--fused_lm_head``,
rl_algos.logprobs_from_hidden) against the head's full logits and the log-prob kernel (the default path).

    uv run python benchmarks/fused_lm_head.py                          # CPU: 512 tokens, fp32
    python benchmarks/fused_lm_head.py --device cuda                   # 8 x 2048 tokens, bf16

Qwen2.5-0.5B's head by default (hidden 896, vocabulary 151,936), random weights and hidden states. Sides, timed
alternating (median of ``--repeats``), each on the loss ``sum(u * logprobs)`` for random constants ``u``:
``full`` = ``F.linear`` then ``logprobs_from_logits`` (Triton on CUDA); ``fused`` = ``logprobs_from_hidden``
(the policy's path: backward recomputes each chunk's logits); ``fused-linear`` =
``weighted_logprob_sum_from_hidden`` (SFT's path for a loss linear in the log-probs: the gradients are made in
forward). Each forward alone (no grad) and forward + backward (gradients of the hidden states and the head). Printed per side: milliseconds and the ratio to ``full``; what autograd keeps for
backward beyond the inputs (the saved tensors of the graph's nodes after forward: the full side keeps the
logits, ``fused-linear`` the gradients it made); on
CUDA the allocator's peak above the inputs during forward + backward; and the largest difference of the
log-probs and of each gradient between the sides.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--tokens", type=int, default=None, help="positions (default: 512 on CPU, 16,384 on CUDA)")
    ap.add_argument("--hidden", type=int, default=896)
    ap.add_argument("--vocab", type=int, default=151_936)
    ap.add_argument("--chunk_tokens", type=int, default=None, help="the fused side's chunk (default: its own)")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()

    from rl_algos import logprobs_from_hidden, logprobs_from_logits, weighted_logprob_sum_from_hidden

    dev = torch.device(args.device)
    cuda = dev.type == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    N = args.tokens or (16_384 if cuda else 512)
    g = torch.Generator(device=dev).manual_seed(0)
    hidden = torch.randn(N, args.hidden, device=dev, dtype=dtype, generator=g)
    weight = (torch.randn(args.vocab, args.hidden, device=dev, dtype=dtype, generator=g) / args.hidden ** 0.5)
    labels = torch.randint(0, args.vocab, (N,), device=dev, generator=g)
    up = torch.randn(N, device=dev, generator=g)

    def per_token(lp):  # a loss sum(up * lp) and the log-probs
        return (lp * up).sum(), lp

    sides = {  # each: (h, w) -> (the loss, the log-probs)
        "full": lambda h, w: per_token(logprobs_from_logits(F.linear(h, w), labels)),
        "fused": lambda h, w: per_token(logprobs_from_hidden(h, w, labels, chunk_tokens=args.chunk_tokens)),
        "fused-linear": lambda h, w: weighted_logprob_sum_from_hidden(h, w, labels, up,
                                                                      chunk_tokens=args.chunk_tokens),
    }

    def sync():
        if cuda:
            torch.cuda.synchronize()

    def run(fn, backward: bool):
        h, w = hidden.detach().requires_grad_(backward), weight.detach().requires_grad_(backward)
        sync()
        t0 = time.perf_counter()
        if backward:
            loss, lp = fn(h, w)
            loss.backward()
        else:
            with torch.no_grad():
                loss, lp = fn(h, w)
        sync()
        return time.perf_counter() - t0, lp.detach(), (h.grad, w.grad)

    def saved_bytes(fn) -> int:
        """Bytes the autograd graph holds for backward after forward, beyond the inputs (the hidden states and the
        head are kept anyway): the saved tensors of every node, walked from the loss (custom Functions'
        ``saved_tensors``, built-in nodes' ``_saved_*``), each storage counted once."""
        loss, _ = fn(hidden.detach().requires_grad_(), weight.detach().requires_grad_())
        seen = {hidden.untyped_storage().data_ptr(), weight.untyped_storage().data_ptr()}
        total, stack, visited = 0, [loss.grad_fn], set()
        while stack:
            node = stack.pop()
            if node is None or node in visited:
                continue
            visited.add(node)
            tensors = list(getattr(node, "saved_tensors", None) or ())
            tensors += [getattr(node, k) for k in dir(node) if k.startswith("_saved_")]
            for t in tensors:
                if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in seen:
                    seen.add(t.untyped_storage().data_ptr())
                    total += t.untyped_storage().nbytes()
            stack += [f for f, _ in node.next_functions]
        return total

    times = {(s, b): [] for s in sides for b in (False, True)}
    results = {}
    for name, fn in sides.items():  # warm-up (Triton's first compile), results for the comparison
        run(fn, False)
        _, lp, grads = run(fn, True)
        results[name] = (lp, grads)
    for _ in range(args.repeats):
        for name, fn in sides.items():
            for backward in (False, True):
                times[(name, backward)].append(run(fn, backward)[0])
    peaks = {}
    if cuda:
        for name, fn in sides.items():
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            run(fn, True)
            peaks[name] = (torch.cuda.max_memory_allocated() - base) / 2**20

    print(f"{args.device}, {N} tokens x hidden {args.hidden} -> vocabulary {args.vocab}, {dtype}, "
          f"median of {args.repeats}; the full side's logits: {N * args.vocab * hidden.element_size() / 2**20:.0f} MiB")
    base_f, base_b = (statistics.median(times[("full", b)]) for b in (False, True))
    for name, fn in sides.items():
        f, b = statistics.median(times[(name, False)]), statistics.median(times[(name, True)])
        peak = f"  peak {peaks[name]:8.0f} MiB" if cuda else ""
        print(f"{name:12s} forward {f * 1e3:9.2f} ms x{f / base_f:5.2f}   forward+backward {b * 1e3:9.2f} ms "
              f"x{b / base_b:5.2f}   kept for backward {saved_bytes(fn) / 2**20:8.1f} MiB{peak}")
    lp_a, g_a = results["full"]
    for name in ("fused", "fused-linear"):
        lp_b, g_b = results[name]
        print(f"max |{name} - full|: log-probs {(lp_a - lp_b).abs().max().item():.2e}, hidden grad "
              f"{(g_a[0] - g_b[0]).abs().max().item():.2e}, head grad {(g_a[1] - g_b[1]).abs().max().item():.2e}")


if __name__ == "__main__":
    main()
