"""Benchmark: SFT tokens/s of rl-core's DeepSpeed path against a plain PyTorch loop, same run.

CPU (fp32; a drifting 2-core machine: read the ratio, not the rate):

    uv run python benchmarks/sft_throughput.py            # hidden 512, 4 layers, seq 256, 24 steps
    uv run python benchmarks/sft_throughput.py --small    # a quick shape

GPU (bf16; issue 18 item 4, the actor's training step at the Qwen2.5-0.5B shape):

    PYTHONPATH=packages/rl-algos/src:packages/rl-core/src:packages/rl-rollout/src \\
        python3 benchmarks/sft_throughput.py --device cuda --preset 0.5b --seq 2048 --micro 8 --accum 2 \\
        [--grad_ckpt] [--big_micro 16] [--muon] [--out sft_h200.json]

    Gradient checkpointing by layer (issue 18 item 3), one device call of about 3 minutes, on a machine
    that got the carry of scripts/device/vllm-loop-on-device.sh (DeepSpeed and liger-kernel ride in it):

    source /tmp/vllm-loop-on-device.sh env; python3 benchmarks/sft_throughput.py --device cuda --preset 0.5b --zero 0 \
        --liger on --ckpt none all 12 auto --auto_free_gib 32 --repeats 2 --out ckpt_h200.json

    The 0.5B preset is a random Llama (``rl_rollout.testing.make_tiny_model``) with hidden 896, 24
    layers, 14 heads, 2 KV heads, intermediate 4864, vocabulary 151,936, tied embeddings (494M
    parameters), every token a target. About 1.5 minutes on an H200 with the default sides; needs
    torch (CUDA, Triton), transformers, deepspeed, liger-kernel (for the liger sides) and the repo's
    packages on PYTHONPATH.

Sides, all built once in this process and timed in interleaved windows (plain, zero-0, zero-1,
..., plain, ...), each window ``--steps`` optimizer steps of micro-batch x accumulation rows after
``--warmup`` steps that are not timed:

- ``plain``: ``AutoModelForCausalLM`` with fp32 weights under ``torch.autocast(bf16)`` on CUDA
  (fp32, no autocast, on CPU), sdpa attention, token-mean NLL by the naive
  ``log_softmax(logits.float()).gather`` over the whole vocabulary, backward, ``clip_grad_norm_(1.0)``,
  ``torch.optim.AdamW`` (``fused=True`` on CUDA). The loop of issue 18's 75.8k tokens/s.
- ``zero-N``: :class:`rl_core.trainers.SFTTrainer` over :class:`rl_core.strategy.DeepSpeedStrategy` at
  ZeRO stage N, as ``rl sft`` runs it: bf16 weights with DeepSpeed's fp32 master copy on CUDA,
  sdpa, rl_algos' log-probs (the Triton kernel on CUDA), clipping 1.0, AdamW (fused on CUDA); timed as whole
  ``fit()`` calls (collate, token count, forward, loss, DeepSpeed backward/step, metrics).
- ``zero-N +liger``: the same with ``Actor.from_pretrained(use_liger_kernel=True)`` (``rl sft
  --use_liger_kernel``: liger-kernel's RMSNorm / SwiGLU / RoPE). Liger's RoPE patch replaces a
  function of transformers' modeling module for the whole process, so each side's window sets that
  module's functions to what the side was built with.
- ``--profile SIDE`` runs one more window of that side under torch.profiler and prints its top
  kernels and how busy the device was (where the step's time goes, for the next change).
- ``--ckpt none all N auto`` adds, per value, ``zero-Z +liger ckpt VALUE`` at the first ``--zero`` stage Z
  (``rl sft --gradient_checkpointing --gradient_checkpointing_layers VALUE``: ``all`` every decoder layer
  recomputes, ``N`` the first N, ``auto`` the fewest whose estimated activations fit the free device memory,
  chosen per micro-batch; ``none`` is the side without checkpointing, ``zero-Z +liger`` itself when that side
  runs). Each ckpt side also prints the estimate of its activation peak (rl_core.activation_checkpointing) and,
  for ``auto``, how many layers it chose. ``--auto_free_gib F``: while the ``auto`` side trains (warm-up and
  windows), a spare tensor holds all but F GiB of the free device memory, so ``auto`` sees a smaller card and
  has to choose (its peak is printed without that tensor). ``--grad_ckpt`` is ``--ckpt all``.
- ``--big_micro M`` adds ``zero-0 +liger micro M`` (the same global batch in fewer, larger micro-batches).
- ``--fused_lm_head`` adds ``zero-Z +liger fused`` at the first ``--zero`` stage Z (``rl sft --fused_lm_head``: the
  NLL's gradients made during forward, chunk by chunk, no ``[tokens, vocabulary]`` logits), and with
  ``--big_micro M`` also ``zero-Z +liger fused micro M``.
- ``--muon`` adds ``zero-Z +liger muon`` at the first ``--zero`` stage Z (``rl sft --optim muon``: DeepSpeed's
  Muon, Newton-Schulz compiled by torch.compile during the warm-up steps, for the weight matrices).
- All of these without ``+liger`` under ``--liger off``.

Printed per side: tokens/s (median over ``--repeats`` windows), ratio to ``plain``, MFU and the peak
memory. MFU convention: 6 x N x tokens/s / peak, N the unique parameters (tied embedding counted once,
as the LM head uses it), attention's score and value FLOPs NOT counted (the header says how much they
would add), peak ``--peak_tflops`` = 989 (H200 SXM dense bf16, spec sheet; issue 18 used the measured
796, which gives 1.24x the MFU printed here). Peak memory: the allocator's peak during the side's
windows minus what the other sides hold (so: its own weights, optimizer state and activations).
The target line checks issue 18 item 4 on CUDA (best rl-core side >= 1.5x plain) and the old
CPU target (rl-core ZeRO-0/1 within 10% of plain) on CPU.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import sys
import tempfile
import time

import torch

PRESETS = {  # hidden, layers, heads, kv heads, intermediate, vocab, seq, steps
    "small": dict(hidden_size=128, num_layers=2, num_heads=8, num_kv_heads=2, intermediate_size=384,
                  vocab_size=2048, seq=128, steps=8),
    "default": dict(hidden_size=512, num_layers=4, num_heads=8, num_kv_heads=2, intermediate_size=1536,
                    vocab_size=2048, seq=256, steps=24),
    "0.5b": dict(hidden_size=896, num_layers=24, num_heads=14, num_kv_heads=2, intermediate_size=4864,
                 vocab_size=151_936, seq=2048, steps=4),
}
LR = 1e-5


def rows(n: int, T: int, vocab: int, seed: int = 0) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(5, vocab, (n, T), generator=g)
    return [{"input_ids": ids[i], "loss_mask": torch.ones(T, dtype=torch.long)} for i in range(n)]


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Plain:
    """The hand-written loop; ``run(n)`` trains n optimizer steps and returns the seconds."""

    def __init__(self, path, data, micro: int, accum: int, device: torch.device):
        from transformers import AutoModelForCausalLM

        torch.manual_seed(0)
        with ModulePatches.record(False) as self.patches:
            self.model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa")
        self.model.to(device).train()
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=LR, betas=(0.9, 0.95), fused=device.type == "cuda")
        self.data, self.micro, self.accum, self.device, self.s = data, micro, accum, device, 0

    def run(self, steps: int) -> float:
        G, cuda = self.micro * self.accum, self.device.type == "cuda"
        self.patches.apply()
        sync(self.device)
        start = time.perf_counter()
        for _ in range(steps):
            batch = self.data[(self.s * G) % len(self.data):][:G]
            self.s += 1
            total = sum(int(r["loss_mask"][1:].sum()) for r in batch)
            for k in range(self.accum):
                ids = torch.stack([r["input_ids"] for r in batch[k * self.micro:(k + 1) * self.micro]])
                ids = ids.to(self.device)
                with torch.autocast("cuda", dtype=torch.bfloat16, enabled=cuda):
                    logits = self.model(input_ids=ids, use_cache=False).logits
                lp = torch.log_softmax(logits[:, :-1].float(), -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
                (-lp.sum() / total).backward()
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
            self.opt.step()
            self.opt.zero_grad(set_to_none=True)
        sync(self.device)
        return time.perf_counter() - start


class RlCore:
    """SFTTrainer on DeepSpeedStrategy; ``run(n)`` is one ``fit()`` of n optimizer steps."""

    def __init__(self, path, data, micro: int, accum: int, device: torch.device, zero: int, *,
                 liger: bool = False, grad_ckpt: str | None = None, optim: str = "adam", fused: bool = False):
        import dataclasses

        from transformers import AutoTokenizer

        from rl_core.models import Actor
        from rl_core.strategy import DeepSpeedStrategy, StrategyConfig
        from rl_core.trainers import SFTConfig, SFTTrainer

        bf16 = device.type == "cuda"
        strategy = DeepSpeedStrategy(StrategyConfig(
            zero_stage=zero, bf16=bf16, micro_train_batch_size=micro, train_batch_size=micro * accum,
            learning_rate=LR, lr_warmup_ratio=0.0, lr_scheduler="constant", gradient_checkpointing=bool(grad_ckpt),
            gradient_checkpointing_layers=grad_ckpt or "all", optim=optim))
        torch.manual_seed(0)
        with ModulePatches.record(liger) as self.patches:
            actor = Actor.from_pretrained(path, dtype="bf16" if bf16 else "fp32", attn_implementation="sdpa",
                                          use_liger_kernel=liger, gradient_checkpointing=bool(grad_ckpt),
                                          fused_lm_head=fused)
        self.trainer = SFTTrainer(strategy, actor, AutoTokenizer.from_pretrained(path), data, SFTConfig(max_epochs=1))
        self.device, self._replace = device, dataclasses.replace
        self.tokens = micro * len(data[0]["input_ids"])  # per micro-batch

    def checkpointing(self) -> str:
        """The estimated activation peak of one micro-batch and, under auto, the layers it chose (ckpt sides)."""
        from rl_core.activation_checkpointing import ActivationEstimate, AutoCheckpointing, decoder_layers

        module = self.trainer.engine.module
        layers = decoder_layers(module)
        est = ActivationEstimate.of(module, len(layers))
        hook = next((h for h in module._forward_pre_hooks.values() if isinstance(h, AutoCheckpointing)), None)
        n = sum(bool(layer.gradient_checkpointing) for layer in layers)  # under auto: as the last forward chose
        chose = f", auto chose {sorted({c[2] for c in hook.choices})} of {len(layers)}" if hook else ""
        return f"activation estimate {est.bytes(n, self.tokens) / 2**30:.2f} GiB at {n} layers{chose}"

    def run(self, steps: int) -> float:
        self.patches.apply()
        self.trainer.cfg = self._replace(self.trainer.cfg, max_steps=steps)
        sync(self.device)
        start = time.perf_counter()
        self.trainer.fit()
        sync(self.device)
        return time.perf_counter() - start


class ModulePatches:
    """What loading a model changed in transformers' modeling modules (liger rebinds
    ``apply_rotary_pos_emb``, ``LlamaRMSNorm``, ``LlamaMLP`` there); ``apply()`` sets the
    modules to this side's state, so liger and plain sides share one process."""

    originals: dict = {}  # (module, name) -> the value before any side patched it

    def __init__(self, changes: dict):
        self.changes = changes

    @classmethod
    def record(cls, enabled: bool):
        import contextlib

        @contextlib.contextmanager
        def ctx():
            mods = [m for n, m in list(sys.modules.items()) if n.startswith("transformers.models.")
                    and n.rsplit(".", 1)[-1].startswith("modeling_")]
            before = {(m, k): v for m in mods for k, v in vars(m).items()}
            side = cls({})
            yield side
            if not enabled:
                return
            for (m, k), v in before.items():
                if vars(m).get(k, v) is not v:
                    cls.originals.setdefault((m, k), v)
                    side.changes[(m, k)] = getattr(m, k)
                    setattr(m, k, v)  # sides built later see the unpatched module

        return ctx()

    def apply(self) -> None:
        for (m, k), v in self.originals.items():
            setattr(m, k, self.changes.get((m, k), v))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--preset", choices=tuple(PRESETS), help="model shape (default: 0.5b on cuda, default on cpu)")
    ap.add_argument("--small", action="store_true", help="same as --preset small (hidden 128, 2 layers, seq 128)")
    ap.add_argument("--seq", type=int, help="tokens per row (default: the preset's)")
    ap.add_argument("--micro", type=int, default=None, help="rows per micro-batch (default 8 on cuda, 4 on cpu)")
    ap.add_argument("--accum", type=int, default=2, help="micro-batches per optimizer step")
    ap.add_argument("--steps", type=int, help="optimizer steps per timed window (default: the preset's)")
    ap.add_argument("--warmup", type=int, default=2, help="untimed optimizer steps per side before the windows")
    ap.add_argument("--repeats", type=int, default=3, help="timed windows per side (the median is printed)")
    ap.add_argument("--zero", type=int, nargs="+", default=[0, 1], choices=(0, 1, 2, 3))
    ap.add_argument("--liger", choices=("off", "on", "both"), help="rl-core sides with --use_liger_kernel "
                    "(default: both on cuda, off on cpu; needs CUDA and liger-kernel)")
    ap.add_argument("--grad_ckpt", action="store_true", help="same as --ckpt all")
    ap.add_argument("--ckpt", nargs="+", default=[], metavar="none|all|N|auto", help="add a side per value with "
                    "--gradient_checkpointing_layers VALUE (none: without checkpointing) at the first --zero stage")
    ap.add_argument("--auto_free_gib", type=float, help="while the --ckpt auto side trains, leave only this much "
                    "device memory free (a spare tensor holds the rest), so it sees a smaller card")
    ap.add_argument("--big_micro", type=int, help="add a zero-0 +liger side with this micro-batch (same global batch)")
    ap.add_argument("--peak_tflops", type=float, default=989.0, help="MFU denominator (H200 SXM dense bf16: 989)")
    ap.add_argument("--profile", metavar="SIDE", help="after the windows, one more window of this side (e.g. "
                    "'zero-0 +liger') under torch.profiler: its top kernels and how busy the device was")
    ap.add_argument("--muon", action="store_true", help="add a zero-Z side (the first --zero stage) with rl sft --optim "
                    "muon: DeepSpeed's Muon for the weight matrices, AdamW for the rest")
    ap.add_argument("--fused_lm_head", action="store_true", help="add a zero-Z side (the first --zero stage) with rl "
                    "sft --fused_lm_head (the NLL's gradients made in forward, chunk by chunk: no [tokens, vocabulary] "
                    "logits), and one at --big_micro when given")
    ap.add_argument("--out", help="write the results as JSON here")
    args = ap.parse_args()
    preset = "small" if args.small else args.preset or ("0.5b" if args.device == "cuda" else "default")
    shape = dict(PRESETS[preset])
    T, steps = shape.pop("seq"), shape.pop("steps")
    T, steps = args.seq or T, args.steps or steps
    micro = args.micro or (8 if args.device == "cuda" else 4)
    liger = args.liger or ("both" if args.device == "cuda" else "off")
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("sft_throughput.py --device cuda: torch sees no CUDA device; run on a GPU or drop --device cuda")
    if liger != "off" and args.device != "cuda":
        sys.exit(f"sft_throughput.py --liger {liger}: liger-kernel's kernels need --device cuda; use --liger off")
    if liger != "off" and importlib.util.find_spec("liger_kernel") is None:
        sys.exit(f"sft_throughput.py --liger {liger}: liger-kernel is not installed (pip install liger-kernel>=0.8); "
                 "install it or pass --liger off")
    G = micro * args.accum
    if args.big_micro is not None and (args.big_micro < 1 or G % args.big_micro):
        sys.exit(f"--big_micro {args.big_micro} must divide the global batch {micro} x {args.accum} = {G}")
    ckpts = list(dict.fromkeys(([*args.ckpt, "all"] if args.grad_ckpt else args.ckpt)))
    for value in ckpts:
        if value != "none" and not (value in ("all", "auto") or value.isdigit()):
            sys.exit(f"--ckpt {value}: each value is none, all, auto or a number of decoder layers (0..layers)")
        if value.isdigit() and int(value) > shape["num_layers"]:
            sys.exit(f"--ckpt {value}: the {preset} preset has {shape['num_layers']} decoder layers; pass 0.."
                     f"{shape['num_layers']}, all, auto or none")
    if min(steps, args.repeats, micro, args.accum) < 1 or args.warmup < 0:
        sys.exit("--steps, --repeats, --micro, --accum must be >= 1 and --warmup >= 0")
    os.environ.setdefault("OMP_NUM_THREADS", str(os.cpu_count() or 1))
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")  # sides alternate on one pool
    logging_quiet()
    from rl_rollout.testing import make_tiny_model

    device = torch.device(args.device)
    if args.auto_free_gib is not None and (device.type != "cuda" or "auto" not in ckpts):
        sys.exit("--auto_free_gib limits the memory the --ckpt auto side sees: it needs --device cuda and --ckpt auto")
    with tempfile.TemporaryDirectory() as tmp:
        path = make_tiny_model(os.path.join(tmp, "m"), **shape, max_position_embeddings=T,
                               dtype="bfloat16" if device.type == "cuda" else "float32")  # half the bytes to load
        data = rows(G * max(steps, args.warmup, 1), T, shape["vocab_size"])
        builders = {"plain": lambda: Plain(path, data, micro, args.accum, device)}
        for lg in {"off": [False], "on": [True], "both": [False, True]}[liger]:
            for z in args.zero:
                builders[f"zero-{z}" + " +liger" * lg] = lambda z=z, lg=lg: RlCore(path, data, micro, args.accum,
                                                                                 device, z, liger=lg)
        lg = liger != "off"  # the extra sides take liger when any side does
        z0, ckpt_sides = args.zero[0], []
        for value in ckpts:
            base = f"zero-{z0}" + " +liger" * lg
            name = base if value == "none" and base in builders else f"{base} ckpt {value}"
            ckpt_sides.append(name)
            builders[name] = lambda v=value: RlCore(path, data, micro, args.accum, device, z0, liger=lg,
                                                    grad_ckpt=None if v == "none" else v)
        if args.big_micro:
            builders["zero-0" + " +liger" * lg + f" micro {args.big_micro}"] = lambda: RlCore(
                path, data, args.big_micro, G // args.big_micro, device, 0, liger=lg)
        if args.fused_lm_head:
            builders[f"zero-{z0}" + " +liger" * lg + " fused"] = lambda: RlCore(path, data, micro, args.accum, device,
                                                                              z0, liger=lg, fused=True)
            if args.big_micro:
                builders[f"zero-{z0}" + " +liger" * lg + f" fused micro {args.big_micro}"] = lambda: RlCore(
                    path, data, args.big_micro, G // args.big_micro, device, z0, liger=lg, fused=True)
        if args.muon:
            builders[f"zero-{z0}" + " +liger" * lg + " muon"] = lambda: RlCore(path, data, micro, args.accum, device, z0,
                                                                             liger=lg, optim="muon")
        if args.profile and args.profile not in builders:
            sys.exit(f"--profile {args.profile!r} is not a side of this run; pick one of: {', '.join(builders)}")
        sides, own = {}, {}
        for name, build in builders.items():  # warm-up: DeepSpeed builds its comm ops, Triton compiles
            before = mem(device)
            sides[name] = build()
            if args.warmup:
                spare = hold_free(device, args.auto_free_gib) if name.endswith(" ckpt auto") else None
                sides[name].run(args.warmup)
                del spare
            own[name] = mem(device) - before
        n_params = sum(p.numel() for p in sides["plain"].model.parameters())
        flops_per_token = 6 * n_params
        attn_share = 6 * shape["num_layers"] * T * shape["hidden_size"] / flops_per_token  # causal: half of 12LTd
        cpu = f"cpu ({torch.get_num_threads()} threads)"
        where = torch.cuda.get_device_name(device) if device.type == "cuda" else cpu
        print(f"preset {preset}: {n_params / 1e6:.0f}M parameters, seq {T}, global batch {micro}x{args.accum}, "
              f"{steps} steps x {args.repeats} windows per side, {G * T * steps} tokens per window, on {where}")
        if device.type == "cuda":
            print(f"MFU = 6 x {n_params / 1e6:.0f}M x tokens/s / {args.peak_tflops:g} TFLOP/s; causal attention FLOPs "
                  f"not counted (they would add {attn_share:.0%})")
        times: dict[str, list[float]] = {name: [] for name in sides}
        peaks: dict[str, float] = {}
        for _ in range(args.repeats):  # interleaved, so a drifting machine hits every side alike
            for name, side in sides.items():
                held_by_others = mem(device) - own[name]
                spare = hold_free(device, args.auto_free_gib) if name.endswith(" ckpt auto") else None
                reset_peak(device)
                times[name].append(side.run(steps))
                spare_bytes = 0 if spare is None else spare.numel()
                peaks[name] = max(peaks.get(name, 0.0), peak(device) - held_by_others - spare_bytes)
                del spare
    tokens = G * T * steps
    base = statistics.median(times["plain"])
    results = []
    print(f"{'side':<24} {'tokens/s':>10} {'vs plain':>9} {'MFU':>6} {'peak GiB':>9}  windows s")
    for name, ts in times.items():
        t = statistics.median(ts)
        r = {"side": name, "tokens_per_s": tokens / t, "speedup_vs_plain": base / t,
             "mfu": tokens / t * flops_per_token / (args.peak_tflops * 1e12) if device.type == "cuda" else None,
             "peak_gib": peaks[name] / 2**30 if device.type == "cuda" else None, "window_s": ts}
        results.append(r)
        gib, mfu = ("-", "-") if device.type != "cuda" else (f"{r['peak_gib']:.1f}", f"{r['mfu']:.1%}")
        print(f"{name:<24} {r['tokens_per_s']:>10.0f} {r['speedup_vs_plain']:>8.3f}x {mfu:>6} {gib:>9}  "
              + " ".join(f"{x:.2f}" for x in ts))
    core = [r for r in results if r["side"] != "plain"]
    if device.type == "cuda":
        best = max(core, key=lambda r: r["speedup_vs_plain"])
        verdict = "met" if best["speedup_vs_plain"] >= 1.5 else "NOT met"
        print(f"target (issue 18 item 4: an rl-core side >= 1.5x plain tokens/s): {verdict}, best {best['side']} "
              f"{best['speedup_vs_plain']:.3f}x")
    else:
        worst = min(r["speedup_vs_plain"] for r in core if "+" not in r["side"] and " ckpt " not in r["side"])
        verdict = "met" if 1 / worst <= 1.10 else "NOT met"
        print(f"target (rl_core wall time <= 1.10 x plain at ZeRO-0/1): {verdict}, worst {1 / worst:.3f}x")
    for r in results:
        if r["side"] in ckpt_sides:
            r["checkpointing"] = sides[r["side"]].checkpointing()
            print(f"{r['side']:<24} {r['checkpointing']}")
    if args.profile:
        profile_window(sides[args.profile], steps, device)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"preset": preset, "shape": shape, "seq": T, "micro": micro, "accum": args.accum,
                       "steps": steps, "repeats": args.repeats, "params": n_params, "peak_tflops": args.peak_tflops,
                       "mfu_convention": "6 x params x tokens/s / peak; attention not counted",
                       "device": str(device), "torch": torch.__version__, "auto_free_gib": args.auto_free_gib,
                       "results": results}, f, indent=1)


def profile_window(side, steps: int, device: torch.device) -> None:
    """One window of ``side`` under torch.profiler: the 15 ops with the most self time on the device (CPU on a
    CPU run) and the share of the wall time the device spent in kernels and copies (their durations summed:
    overlapping streams count twice; profiling slows the host a little)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    with profile(activities=[ProfilerActivity.CPU] + [ProfilerActivity.CUDA] * cuda) as prof:
        wall = side.run(steps)
    table = prof.key_averages()
    print(table.table(sort_by="self_device_time_total" if cuda else "self_cpu_time_total", row_limit=15))
    if cuda:
        busy = sum(e.time_range.elapsed_us() for e in prof.events() if e.device_type == DeviceType.CUDA) / 1e6
        print(f"profiled window: {wall:.3f} s wall, device kernels {busy:.3f} s ({busy / wall:.0%} busy)")


def hold_free(device: torch.device, free_gib: float | None):
    """A spare tensor that leaves about ``free_gib`` GiB of the device free (None without a limit, or when less is
    free already); the allocator's cache is emptied first, so what it held unused counts as free."""
    if free_gib is None:
        return None
    torch.cuda.empty_cache()
    extra = torch.cuda.mem_get_info(device)[0] - int(free_gib * 2**30)
    return torch.empty(extra, dtype=torch.uint8, device=device) if extra > 0 else None


def mem(device: torch.device) -> int:
    return torch.cuda.memory_allocated(device) if device.type == "cuda" else 0


def reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak(device: torch.device) -> int:
    return torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0


def logging_quiet() -> None:
    import logging
    import warnings

    logging.disable(logging.WARNING)
    warnings.filterwarnings("ignore")
    os.environ.setdefault("TQDM_DISABLE", "1")
    import transformers

    transformers.utils.logging.disable_progress_bar()


if __name__ == "__main__":
    sys.exit(main())
