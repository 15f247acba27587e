"""GRPO side by side: TRL's GRPOTrainer and ``rl ppo``'s loop, same model, prompts, reward and batch.

    uv run --group bench python benchmarks/grpo_vs_trl.py                  # CPU: both generate with transformers
    uv run --group bench python benchmarks/grpo_vs_trl.py --steps 1        # a quick check (one measured step)
    python3 benchmarks/grpo_vs_trl.py --device cuda --shape 0.5b           # GPU: TRL's colocated vLLM vs ours on vLLM

TRL comes from the root pyproject's ``bench`` dependency group (``uv sync --group bench``),
which ``uv sync`` and CI leave out. With vLLM (``--rollout_engine vllm``, the default on a GPU)
both sides need vLLM as well (rl-rollout's ``vllm`` extra; TRL 1.16 supports vLLM 0.22-0.31 and
warns on others). On the lent GPU machine TRL and its pure-Python dependencies travel as wheels
(``.vcarry6/install.sh``, beside the vLLM carry: docs/performance.md says how).

The run (defaults, CPU): a random Llama of hidden 512, 4 layers, 8 heads, 2 KV heads,
intermediate 1408, a character vocabulary of 128 (11.3M parameters, built by
``rl_rollout.testing.make_tiny_model``; ``--shape 11m``), fp32; 8 prompts x 8 samples x 64 new tokens =
64 completions per step; both sides generate with transformers (``--rollout_engine hf``).
On ``--device cuda`` the defaults are ``--shape 0.5b`` (Qwen2.5-0.5B's layer sizes, the random
Llama benchmarks/rl_phases.py uses, vocabulary 128), bf16, 16 prompts x 8 samples x up to 128 new
tokens (varied lengths, varied prompts: below) and ``--rollout_engine vllm``. ``--shape qwen2.5-0.5b``
and ``--shape qwen2.5-1.5b`` are those models' real shapes (vocabulary 151,936, tied embeddings). Both devices: GRPO (group-normalised advantages, clipped ratio, token-mean
loss = TRL's default ``dapo``), no KL term (TRL's default ``beta`` is 0.0); micro-batches of 16,
gradient accumulation up to the batch: one optimizer step per batch on both sides; AdamW, lr 1e-6
constant, betas (0.9, 0.95), gradient clipping 1.0, no gradient checkpointing.

- ours: the run is built as ``rl ppo`` builds it (``rl_core.rl.build.build_run`` with
  ``LocalFactory``: a DeepSpeed policy, ``--zero_stage`` as given, default rl ppo's 2;
  rl-rollout's HFEngine, or with ``--rollout_engine vllm`` VLLMEngine in this process (``rl ppo
  --rollout_engine vllm``'s path), receiving the weights in memory after every step; the reward
  function through ``RewardRunner`` in-process). Seconds per step: the trainer's ``iteration_s``;
  breakdown from its history.
- TRL: ``GRPOTrainer`` with ``num_generations``, ``per_device_train_batch_size`` = ``--micro_batch``,
  ``gradient_accumulation_steps`` = batch / micro-batch (generation batch = the batch; ``--trl_micro_batch``
  sets TRL's own, ``--trl_use_liger_kernel`` its ``use_liger_kernel``: TRL at its best settings),
  ``use_vllm=False`` with ``--rollout_engine hf``, ``use_vllm=True, vllm_mode="colocate"`` with
  ``vllm``, ``report_to="none"``. Seconds per step: a ``TrainerCallback`` from ``on_step_begin``
  to ``on_step_end``; generation timed by wrapping the trainer's ``_generate_single_turn`` (less
  the weight sync into vLLM, which TRL runs inside it and which is timed apart by wrapping
  ``vllm_generation.sync_weights``), and the whole generate-and-score phase (rewards, advantages,
  old log-probs where TRL computes them) by wrapping ``_generate_and_score_completions``.
- vLLM on both sides: the same ``--vllm_gpu_memory_utilization`` (both engines live on the GPU at
  once, each in its process), sleep mode off on both unless ``--vllm_sleep`` (then TRL's
  ``vllm_enable_sleep_mode``, which sleeps at level 2, and ours ``--vllm_enable_sleep
  --vllm_sleep_level 2``), torch.compile and CUDA graphs on both (neither sets enforce_eager),
  TRL's importance-sampling correction off unless ``--trl_is_correction``. What each engine
  really runs with is read back from its vLLM config and printed for both (``engines``).
  TRL's colocated vLLM uses ``distributed_executor_backend="external_launcher"``: TRL sets
  RANK / LOCAL_RANK / WORLD_SIZE for one process itself, the benchmark gives its process
  MASTER_ADDR and a free MASTER_PORT.

Generation lengths forced on both sides, so both generate and train on the same tokens:
ours samples with ``ignore_eos`` and no stop tokens (the benchmark wraps the engine's
``generate``), TRL with ``min_new_tokens`` (transformers) or ``ignore_eos`` (vLLM) in
``generation_kwargs``. ``--lengths full`` forces every sample to ``--max_new_tokens``;
``--lengths varied`` (the default with vLLM, so on a GPU) draws each request's length from a
long tail the way RL answers spread: log-normal, median max_new_tokens / 4, sigma 0.8, clipped
to 64..max_new_tokens (about 4% of requests run to the cap), a deterministic function of
(``--seed``, prompt, sample, step). Ours splits each prompt's request into one per sample, each
with its own ``max_new_tokens`` (and seed), and gathers the samples back into their group; TRL's
colocated ``vllm.LLM.generate`` (called once per generation batch by ``VLLMGeneration.generate``
in TRL 1.16) is wrapped to pass one SamplingParams per prompt, TRL's own with ``max_tokens`` the
drawn length. The prompt of a request is known by its text (its letter), the sample by its order
among that prompt's requests in the call, the step by the conductor's count. TRL's transformers
path (``--rollout_engine hf``) has one length per generate call, so ``--lengths varied`` there
is refused. ``--prompt_lengths varied`` (default on a GPU) puts a filler of 8-256 characters
(log-uniform, seeded per prompt, no letters) before each prompt's instruction. The generated
tokens per step, and each request's length, are counted on each side, checked against the draws
and printed (a mismatch is a WARNING line, stored as ``tokens_check`` in ``--out``'s info).

Fairness of the timing: each side runs in its own process (spawned; both models stay
loaded) and the two alternate step by step, ours then TRL, under one conductor: while
one side runs a step the other waits on a pipe, so load from elsewhere on the machine
hits both alike. The first ``--warmup`` steps of each side are left out. Each step's CPU
seconds (``time.process_time`` of the side's process, all its threads, from the go to the
step's end) are recorded too; a step whose process kept its threads busy (CPU seconds
>= ``--quiet_util`` 0.9 x threads x wall seconds) counts as quiet, one that others' jobs
slowed down does not, and the quiet steps' means are printed apart: on a shared machine
whose load comes in bursts, they are the comparable numbers (CPU only: on a GPU the
processes wait on the device, and every step is reported).
Prints per-step seconds for both, the ratio ours / TRL, the breakdown and the tokens
per step; ``--out`` writes all of it as JSON.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import enum
import importlib.util
import json
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path

LETTERS = "abcdefghijklmnopqrstuvwxyz"
SIDES = ("ours", "trl")
# Model shapes (random Llamas, character vocabulary of 128): 11m is the CPU run's; 0.5b has Qwen2.5-0.5B's layer
# sizes, as benchmarks/rl_phases.py, rl_ray_gpus.py and async_rl.py build it.
SHAPES = {
    "11m": {"hidden_size": 512, "num_layers": 4, "num_heads": 8, "num_kv_heads": 2, "intermediate_size": 1408,
            "max_position_embeddings": 1024},
    "0.5b": {"hidden_size": 896, "num_layers": 24, "num_heads": 14, "num_kv_heads": 2, "intermediate_size": 4864,
             "max_position_embeddings": 2048},
    # Qwen2.5-0.5B's real shape: its vocabulary (151,936, tied embeddings: 494M parameters); the tokenizer stays the
    # character one, padded with <extra_N> tokens to that size, so sampled ids beyond ASCII decode as such
    "qwen2.5-0.5b": {"hidden_size": 896, "num_layers": 24, "num_heads": 14, "num_kv_heads": 2,
                     "intermediate_size": 4864, "max_position_embeddings": 4096, "vocab_size": 151_936},
    # Qwen2.5-1.5B's real shape, the same way (tied embeddings as the real model: 1.54B parameters)
    "qwen2.5-1.5b": {"hidden_size": 1536, "num_layers": 28, "num_heads": 12, "num_kv_heads": 2,
                     "intermediate_size": 8960, "max_position_embeddings": 4096, "vocab_size": 151_936},
}
for _shape in SHAPES.values():
    _shape.setdefault("vocab_size", 128)
# What a flag left unset means on each device (the CPU run of docs/performance.md; the GPU run of issue 16's table).
DEVICE_DEFAULTS = {
    "cpu": {"shape": "11m", "bf16": False, "prompts": 8, "samples": 8, "max_new_tokens": 64, "rollout_engine": "hf",
            "prompt_lengths": "fixed"},
    "cuda": {"shape": "0.5b", "bf16": True, "prompts": 16, "samples": 8, "max_new_tokens": 128,
             "rollout_engine": "vllm", "prompt_lengths": "varied"},
}



def _auto_int(text: str) -> int | None:
    """A number, or auto (unset: rl ppo decides)."""
    return None if text.strip().lower() == "auto" else int(text)


def _auto_bool(text: str) -> bool | None:
    t = text.strip().lower()
    if t == "auto":
        return None
    if t in ("1", "true", "yes", "on", "0", "false", "no", "off"):
        return t in ("1", "true", "yes", "on")
    raise argparse.ArgumentTypeError(f"expected true, false or auto, got {text!r}")

def letter_reward(prompt: str, response: str, label: str | None) -> float:
    """Share of the response's characters that are the prompt's letter (cheap, varies across samples)."""
    return response.count(label or "") / max(len(response), 1)


def reward_ours(prompt: str, response: str, label: str | None, **info) -> float:
    return letter_reward(prompt, response, label)


def reward_trl(prompts, completions, label, **kwargs) -> list[float]:
    return [letter_reward(p, c, y) for p, c, y in zip(prompts, completions, label, strict=True)]


# ----- varied lengths: the same number of tokens per request on both sides -----------------------------------
# A request's generated length is drawn from a log-normal (median max_new_tokens / 4, sigma 0.8: about 4% of the
# draws reach max_new_tokens), clipped to [LENGTH_MIN, max_new_tokens], as a deterministic function of (seed,
# prompt index, sample index, step); both sides then force exactly that many tokens (ignore_eos, max_tokens = the
# draw), so both train on the same tokens while a batch's lengths spread the way RL answers do.
LENGTH_MIN, LENGTH_SIGMA = 64, 0.8
# varied prompt lengths: a filler of PROMPT_FILL_MIN..PROMPT_FILL_MAX characters (the character tokenizer: one token
# each) after the instruction, log-uniform per prompt, deterministic in (seed, prompt index)
PROMPT_FILL_MIN, PROMPT_FILL_MAX = 8, 256
_PROMPT_RE = None


def response_length(seed: int, prompt: int, sample: int, step: int, max_new_tokens: int) -> int:
    """Generated tokens of sample ``sample`` of prompt ``prompt`` in step ``step`` (0-based, warm-up included)."""
    import math
    import random

    z = random.Random(f"grpo_vs_trl:{seed}:{prompt}:{sample}:{step}").gauss(0.0, 1.0)
    lo = min(LENGTH_MIN, max_new_tokens)
    return max(lo, min(max_new_tokens, round(max_new_tokens / 4 * math.exp(LENGTH_SIGMA * z))))


def step_lengths(seed: int, prompts: int, samples: int, step: int, max_new_tokens: int) -> list[int]:
    """Every request's length in one step (prompt-major): what both sides must generate."""
    return [response_length(seed, p, s, step, max_new_tokens) for p in range(prompts) for s in range(samples)]


def prompt_text(index: int, varied: bool, seed: int) -> str:
    """Prompt ``index``'s text: the instruction for its letter, with a filler of varied length if ``varied``."""
    import math
    import random

    text = f"Repeat the letter {LETTERS[index]}: "
    if not varied:
        return text
    rng = random.Random(f"grpo_vs_trl:prompt:{seed}:{index}")
    n = round(math.exp(rng.uniform(math.log(PROMPT_FILL_MIN), math.log(PROMPT_FILL_MAX))))
    filler = "".join(rng.choice("0123456789 .,;-") for _ in range(n))  # no letters: the reward counts letters
    return f"[{filler}] {text}"


def prompt_index(text: str) -> int:
    """The prompt's index from its (decoded) text: the letter it asks for."""
    import re

    global _PROMPT_RE
    _PROMPT_RE = _PROMPT_RE or re.compile(r"Repeat the letter ([a-z]):")
    m = _PROMPT_RE.search(text)
    if m is None:
        raise ValueError(f"not one of the benchmark's prompts: {text[:80]!r}")
    return LETTERS.index(m.group(1))


def request_lengths(prompt_indices: list[int], seed: int, step: int, max_new_tokens: int) -> list[int]:
    """Lengths for one generate call's requests, one sample each, given each request's prompt index: the k-th
    request of a prompt in the call is its sample k."""
    seen: dict[int, int] = {}
    out = []
    for p in prompt_indices:
        k = seen.get(p, 0)
        seen[p] = k + 1
        out.append(response_length(seed, p, k, step, max_new_tokens))
    return out


class ThreadSampler:
    """The other threads of this process while a phase runs: every ``interval`` seconds, each thread's innermost
    Python frame (function, file:line, the line) is counted. A thread seen outside a wait (lock, queue, select,
    sleep: by the function's name or the line's call; marked ``*``) competes with the engine's Python decode loop
    for the GIL; cProfile sees only the calling thread."""

    WAITS = ("wait", "select", "poll", "sleep", "acquire", "get", "recv", "accept", "join", "read")

    def __init__(self, interval: float = 0.002) -> None:
        import threading

        self.interval, self.samples = interval, 0
        self.seen: dict[tuple[str, str], int] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="thread-sampler", daemon=True)

    def __enter__(self) -> ThreadSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        import linecache
        import threading

        me, main = threading.get_ident(), threading.main_thread().ident
        while not self._stop.wait(self.interval):
            names = {t.ident: t.name for t in threading.enumerate()}
            self.samples += 1
            for ident, frame in sys._current_frames().items():
                if ident in (me, main):
                    continue
                code = frame.f_code
                line = linecache.getline(code.co_filename, frame.f_lineno).strip()
                waits = any(w in code.co_name.lower() or f"{w}(" in line for w in self.WAITS)
                key = (names.get(ident, str(ident)), f"{code.co_name} {Path(code.co_filename).name}:{frame.f_lineno}"
                       f"{'' if waits else ' *'}  {line[:60]}")
                self.seen[key] = self.seen.get(key, 0) + 1

    def report(self, top: int = 20) -> str:
        lines = [f"[grpo_vs_trl] other threads during the phase ({self.samples} samples, every "
                 f"{self.interval * 1e3:.0f} ms; share of samples, innermost frame; * = not in a wait):"]
        for (name, where), n in sorted(self.seen.items(), key=lambda kv: -kv[1])[:top]:
            lines.append(f"  {n / max(self.samples, 1):6.1%}  {name:<28} {where}")
        return "\n".join(lines)


def arg_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                    help="where both sides run; it picks the defaults of the flags below that say 'default: cpu X, "
                         "cuda Y'")
    ap.add_argument("--rollout_engine", default=None, choices=("hf", "vllm"),
                    help="hf: transformers generate on both sides (TRL use_vllm=False); vllm: TRL's colocated vLLM "
                         "vs ours on VLLMEngine in-process (GPU only). Default: cpu hf, cuda vllm")
    ap.add_argument("--shape", default=None, choices=list(SHAPES),
                    help="the random Llama's layer sizes (11m: hidden 512, 4 layers; 0.5b: Qwen2.5-0.5B's). "
                         "Default: cpu 11m, cuda 0.5b; the --hidden_size ... flags override single sizes")
    ap.add_argument("--steps", type=int, default=5, help="measured steps per side (after the warm-up)")
    ap.add_argument("--warmup", type=int, default=1, help="first steps of each side left out of the means")
    ap.add_argument("--prompts", type=int, default=None,
                    help="prompts per step (rollout_batch_size). Default: cpu 8, cuda 16")
    ap.add_argument("--samples", type=int, default=None, help="samples per prompt (num_generations). Default: 8")
    ap.add_argument("--max_new_tokens", type=int, default=None,
                    help="generated tokens per sample: every sample's with --lengths full, the longest with "
                         "--lengths varied. Default: cpu 64, cuda 128")
    ap.add_argument("--lengths", default=None, choices=("full", "varied"),
                    help="full: every sample forced to --max_new_tokens; varied: each request's length drawn from a "
                         "long-tailed spread (log-normal, median max_new_tokens / 4, clipped to 64..max_new_tokens, "
                         "seeded by (--seed, prompt, sample, step)) and forced on both sides, so both generate and "
                         "train on the same tokens (vllm only: TRL's transformers generate takes one length per "
                         "batch). Default: varied with --rollout_engine vllm, else full")
    ap.add_argument("--prompt_lengths", default=None, choices=("fixed", "varied"),
                    help="fixed: 'Repeat the letter x: ' (21 tokens); varied: a filler of 8-256 characters "
                         "(log-uniform, seeded per prompt) before it, the same prompts on both sides. Default: cpu "
                         "fixed, cuda varied")
    ap.add_argument("--micro_batch", type=int, default=16,
                    help="sequences per forward (ours: micro_train_batch_size; TRL: per_device_train_batch_size)")
    ap.add_argument("--zero_stage", type=_auto_int, default=None,
                    help="ours: DeepSpeed ZeRO stage; default auto, as rl ppo (0 on one GPU, else 2)")
    ap.add_argument("--ours_packing", type=_auto_bool, nargs="?", const=True, default=None,
                    help="ours only: rl ppo --packing true|false (each forward's rows packed into one, no padding); "
                         "default auto, as rl ppo (packed on CUDA)")
    ap.add_argument("--ours_max_tokens_per_gpu", default="auto",
                    help="ours only: rl ppo --max_tokens_per_gpu N|auto|none (token-budget micro-batches instead of "
                         "--micro_batch rows; TRL keeps --micro_batch); default auto, as rl ppo (from free memory on "
                         "CUDA with packed rows, else rows). The report names every ours-only setting")
    ap.add_argument("--ours_use_liger_kernel", type=_auto_bool, nargs="?", const=True, default=None,
                    help="ours only: rl ppo --use_liger_kernel true|false (liger-kernel's RMSNorm, SwiGLU, RoPE); "
                         "default auto, as rl ppo (on with CUDA and liger-kernel installed)")
    ap.add_argument("--ours_fused_lm_head", type=_auto_bool, nargs="?", const=True, default=None,
                    help="ours only: rl ppo --fused_lm_head true|false (the LM head and the log-probs chunk by chunk: "
                         "the [tokens, vocabulary] logits never held whole, so the token budget from memory grows; "
                         "TRL's --trl_use_liger_kernel does the same on its side); default auto, as rl ppo (on on "
                         "CUDA at a vocabulary of 32,768 or more)")
    ap.add_argument("--ours_async", action="store_true",
                    help="ours only: rl ppo --async_train --max_staleness 1 (generation of the next batch overlaps "
                         "training; the importance correction it then applies by default: tis). The sides then run "
                         "one after the other, ours' steps back to back, not alternating: an async side keeps "
                         "generating while it waits, which would overlap the other side's step. Seconds per step: "
                         "the wall time between two of our finished iterations")
    ap.add_argument("--ours_unseeded", action="store_true",
                    help="ours only: requests without their own seed (vLLM's engine-wide random stream, as TRL "
                         "samples) instead of rl ppo's per-request seeds (vLLM draws each seeded row's noise apart)")
    ap.add_argument("--ours_vllm_kwargs", default=None, metavar="JSON",
                    help='ours only: more vLLM engine arguments, e.g. \'{"async_scheduling": false}\' (to try one)')
    ap.add_argument("--ours_rows", action="store_true",
                    help="ours only: --micro_batch rows even where rl ppo would size micro-batches from free memory "
                         "(as a user passing --micro_train_batch_size)")
    ap.add_argument("--ours_profile_generate", action="store_true",
                    help="cProfile our generate phase (prompts, engine, items, rewards) in the first measured step: "
                         "top 30 by cumulative time, and where this process's other threads were (sampled every 2 "
                         "ms), printed by our process; that step's time includes the profiler's overhead")
    ap.add_argument("--ours_profile_train", action="store_true",
                    help="torch.profiler over our policy's training call in the last measured step (CUDA only): GPU "
                         "busy and idle seconds, time by kind of kernel, the host's waits on the device, the "
                         "forward / backward / optimizer regions, top kernels (benchmarks/cuda_profile.py); that "
                         "step's time includes the profiler's overhead")
    ap.add_argument("--bf16", action=argparse.BooleanOptionalAction, default=None,
                    help="bf16 on both sides (--no-bf16: fp32). Default: cpu fp32, cuda bf16")
    ap.add_argument("--learning_rate", type=float, default=1e-6, help="both sides (TRL's default)")
    ap.add_argument("--model", default=None, help="a local HF model folder (default: build the random Llama of "
                                                  "--shape)")
    for name in ("hidden_size", "num_layers", "num_heads", "num_kv_heads", "intermediate_size", "vocab_size"):
        ap.add_argument(f"--{name}", type=int, default=None, help="overrides --shape's")
    ap.add_argument("--vllm_gpu_memory_utilization", type=float, default=0.3,
                    help="vllm: each side's vLLM share of the GPU (both engines live at once; TRL's "
                         "vllm_gpu_memory_utilization, ours --vllm_gpu_memory_utilization)")
    ap.add_argument("--memory_share", type=float, default=0.5,
                    help="cuda: each side's process may hold at most this share of the GPU (torch's per-process "
                         "memory fraction, its vLLM engine included): the two sides share one GPU, and our "
                         "token budget from free memory would otherwise take what the other side is not using yet")
    ap.add_argument("--vllm_sleep", action="store_true",
                    help="vllm: both engines sleep while the policy trains (TRL's vllm_enable_sleep_mode, level 2; "
                         "ours --vllm_enable_sleep --vllm_sleep_level 2)")
    ap.add_argument("--trl_micro_batch", type=int, default=None,
                    help="TRL only: per_device_train_batch_size (gradient accumulation up to the batch); default "
                         "--micro_batch. TRL at its best: the largest that fits its --memory_share")
    ap.add_argument("--trl_use_liger_kernel", action="store_true",
                    help="TRL only: GRPOConfig(use_liger_kernel=True): liger-kernel's model kernels and, in GRPO, "
                         "TRL's chunked log-prob path (the full logits never materialised; TRL >= 1.14). TRL at its "
                         "best on CUDA; off by default (TRL's default)")
    ap.add_argument("--trl_is_correction", action="store_true",
                    help="vllm: TRL's vLLM importance-sampling correction (its default; costs TRL a no-grad forward "
                         "for old log-probs). Off by default to match ours, whose --is_correction is off by default")
    ap.add_argument("--seed", type=int, default=42)
    ap.add_argument("--workdir", default=None, help="model, prompts and TRL's output_dir (default: a temp folder)")
    ap.add_argument("--quiet_util", type=float, default=0.9,
                    help="cpu: a step counts as quiet (not slowed by others' jobs) when its process's CPU seconds are "
                         "at least this share of threads x wall seconds")
    ap.add_argument("--step_timeout", type=float, default=1800.0, help="seconds one step may take before giving up")
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    return ap


def resolve_args(a: argparse.Namespace) -> argparse.Namespace:
    """Fill the flags left unset from --device's defaults and --shape's sizes; one clear error for bad values."""
    for k, v in DEVICE_DEFAULTS[a.device].items():
        if getattr(a, k) is None:
            setattr(a, k, v)
    for k, v in SHAPES[a.shape].items():
        if getattr(a, k, None) is None:
            setattr(a, k, v)
    if a.lengths is None:
        a.lengths = "varied" if a.rollout_engine == "vllm" else "full"
    if a.lengths == "varied" and a.rollout_engine != "vllm":
        sys.exit("--lengths varied needs --rollout_engine vllm: TRL's transformers generate (use_vllm=False) runs "
                 "one generate call per batch with one max_new_tokens / min_new_tokens for every row, so it cannot "
                 "force a length per request; use --lengths full with --rollout_engine hf")
    n_seq = a.prompts * a.samples
    if a.samples < 2:
        sys.exit(f"--samples {a.samples}: must be >= 2 (GRPO's group baseline)")
    if a.trl_micro_batch is None:
        a.trl_micro_batch = a.micro_batch
    for flag in ("micro_batch", "trl_micro_batch"):
        if getattr(a, flag) < 1 or n_seq % getattr(a, flag):
            sys.exit(f"--{flag} {getattr(a, flag)} must divide prompts x samples = {n_seq}")
    if not 1 <= a.prompts <= len(LETTERS):
        sys.exit(f"--prompts {a.prompts}: must be 1 to {len(LETTERS)} (one prompt per letter)")
    if a.device == "cpu" and a.rollout_engine == "vllm":
        # seen 2026-12-04 with vLLM 0.32's CPU build: both engines start and ours runs its steps, TRL's first sync
        # fails with "AttributeError: 'Parameter' object has no attribute 'weight_loader'"
        sys.exit("--rollout_engine vllm on --device cpu: TRL's colocated weight sync loads each parameter through "
                 "vLLM's model.load_weights, which vLLM's CPU build refuses once it has repacked the linear layers "
                 "for its CPU GEMM; use --device cuda, or --rollout_engine hf on CPU")
    from rl_core.rl.batching import MicroBatchConfig

    try:
        MicroBatchConfig(max_tokens_per_gpu=a.ours_max_tokens_per_gpu)
    except ValueError as e:
        sys.exit(f"--ours_max_tokens_per_gpu: {e}")
    if not 0 < a.vllm_gpu_memory_utilization <= 1:
        sys.exit(f"--vllm_gpu_memory_utilization {a.vllm_gpu_memory_utilization}: must be in (0, 1]")
    return a


# ----- the two sides (each runs in its own spawned process) -----------------------------------------------


class _Conductor:
    """The child's end of the pipe: report a finished step, then wait for the next go."""

    def __init__(self, conn):
        import gc

        self.conn = conn
        self.go_t = self.go_cpu = 0.0
        self.steps = 0  # steps handed over so far: the step now running (0-based, warm-up included)
        self.gc_s, self.gc_full, self._gc_t0 = 0.0, 0, 0.0  # Python's garbage collector inside the step
        gc.callbacks.append(self._gc)

    def _gc(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._gc_t0 = time.perf_counter()
        else:
            self.gc_s += time.perf_counter() - self._gc_t0
            self.gc_full += info["generation"] == 2

    def ready(self, info: dict) -> None:
        self.conn.send(("ready", info))
        self.wait()

    def wait(self) -> None:
        msg = self.conn.recv()
        if msg not in ("go", "stop"):
            raise RuntimeError(f"unexpected message from the conductor: {msg!r}")
        self.go_t, self.go_cpu = time.perf_counter(), time.process_time()
        self.gc_s, self.gc_full = 0.0, 0

    def step(self, record: dict) -> None:
        record["go_to_done_s"] = time.perf_counter() - self.go_t  # the step as the conductor saw it
        record["cpu_s"] = time.process_time() - self.go_cpu  # CPU seconds of this process (all threads) in it
        record["gc_s"], record["gc_full"] = self.gc_s, self.gc_full
        self.steps += 1
        import torch

        if torch.cuda.is_available():  # the waiting side keeps no allocator cache: both sides must fit one GPU
            torch.cuda.empty_cache()
        self.conn.send(("step", record))
        self.wait()


def _child(side: str, conn, cfg: dict) -> None:
    import torch

    c = _Conductor(conn)
    try:
        torch.manual_seed(cfg["seed"])
        if cfg["device"] == "cuda" and cfg["memory_share"] < 1:  # the same cap for both sides' processes
            torch.cuda.set_per_process_memory_fraction(cfg["memory_share"])
        (_run_ours if side == "ours" else _run_trl)(c, cfg)
        conn.send(("done", {}))
    except BaseException:  # noqa: BLE001 - everything goes back to the conductor, which prints it
        conn.send(("error", traceback.format_exc()))
    finally:
        conn.close()


def _run_ours(c: _Conductor, cfg: dict) -> None:
    import torch
    from transformers import AutoTokenizer

    from rl_core.data import DataConfig, PromptDataset, load_rows
    from rl_core.metrics import MetricsLogger
    from rl_core.rl.auto import Hardware
    from rl_core.rl.auto import resolve as resolve_auto
    from rl_core.rl.batching import MicroBatchConfig
    from rl_core.rl.build import LocalFactory, RLModelConfig, RunConfig, build_run
    from rl_core.strategy import StrategyConfig
    from rl_core.trainers.ppo import PPOConfig
    from rl_rollout import EngineConfig, RewardRunner, WeightSyncConfig

    n_seq = cfg["prompts"] * cfg["samples"]
    tok = AutoTokenizer.from_pretrained(cfg["model"])
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    prompts = PromptDataset(load_rows(cfg["prompt_file"]), tok,
                            DataConfig(input_key="prompt", label_key="label", max_len=1024))
    strategy = StrategyConfig(zero_stage=cfg["zero_stage"], bf16=cfg["bf16"],
                              micro_train_batch_size=cfg["micro_batch"], train_batch_size=n_seq,
                              learning_rate=cfg["learning_rate"], lr_warmup_ratio=0.0, lr_scheduler="constant",
                              adam_betas=(0.9, 0.95), weight_decay=0.0, max_norm=1.0, seed=cfg["seed"])
    ppo = PPOConfig.from_flat(advantage_estimator="group_norm", init_kl_coef=0.0, n_samples_per_prompt=cfg["samples"],
                    rollout_batch_size=cfg["prompts"], generate_max_len=cfg["max_new_tokens"], temperature=1.0,
                    max_epochs=1, max_iterations=cfg["warmup"] + cfg["steps"],
                    **({"async_train": True, "max_staleness": 1} if cfg["ours_async"] else {}))
    if cfg["ours_vllm_kwargs"]:  # to try an engine argument: merged into what EngineConfig builds
        extra_kwargs, vllm_options = json.loads(cfg["ours_vllm_kwargs"]), EngineConfig.vllm_options

        def with_extra(self, **kw):
            opts = vllm_options(self, **kw)
            return {**opts, "engine_kwargs": {**opts["engine_kwargs"], **extra_kwargs}}

        EngineConfig.vllm_options = with_extra
    engine = (EngineConfig(kind="vllm", gpu_memory_utilization=cfg["vllm_gpu_memory_utilization"],
                           enable_sleep=cfg["vllm_sleep"], sleep_level=2)
              if cfg["rollout_engine"] == "vllm" else EngineConfig(kind="hf"))

    class StepLogger(MetricsLogger):
        """The trainer logs each finished iteration here: hand the step to the conductor and wait."""

        def log(self, step: int, metrics: dict[str, float]) -> None:
            super().log(step, metrics)
            record = {k.removeprefix("rl/"): float(v) for k, v in metrics.items()}
            # the batch this iteration trained on: generations finish in order (async: the next one may be running)
            tokens, sequences, lengths = generated.popleft() if generated else (0, 0, [])
            step_s = time.perf_counter() - c.go_t if cfg["ours_async"] else record["iteration_s"]
            record.update(step_s=step_s, generated_tokens=tokens, sequences=sequences, lengths=sorted(lengths))
            c.step(record)

    counts = {"calls": 0, "trains": 0, "generations": 0}
    generated: collections.deque = collections.deque()  # (tokens, sequences, lengths) per generate call, in order
    run_cfg = RunConfig(RLModelConfig(pretrain=cfg["model"], use_liger_kernel=cfg["ours_use_liger_kernel"],
                                      fused_lm_head=cfg["ours_fused_lm_head"]),
                        strategy, ppo, engine, WeightSyncConfig(),
                        batching=MicroBatchConfig(max_tokens_per_gpu=cfg["ours_max_tokens_per_gpu"]),
                        packing=cfg["ours_packing"])
    # rl ppo's auto choices, as its banner prints them (build_run resolves the same way)
    run_cfg, chosen = resolve_auto(run_cfg, Hardware.here(), given=frozenset(
        {"strategy.micro_train_batch_size"} if cfg["ours_rows"] else ()))  # --micro_batch is TRL's unless --ours_rows
    run = build_run(run_cfg, LocalFactory(), prompts=prompts, tokenizer=tok,
                    reward_fn=RewardRunner(reward_ours, workers=0), metrics=StepLogger(None))
    rollout = run.trainer.rollout
    generate = rollout.generate

    index_of = {tuple(p["prompt_ids"]): prompt_index(tok.decode(p["prompt_ids"])) for p in prompts}

    def full_length_generate(requests):
        """The loop's requests with ignore_eos and no stop tokens: every sample is max_new_tokens long, or with
        --lengths varied the length response_length draws for it (each request split into one per sample, given
        its own max_new_tokens and seed, the samples gathered back into their group)."""
        forced = [dataclasses.replace(r, params=dataclasses.replace(
                      r.params, ignore_eos=True, stop_token_ids=(),
                      **({"seed": None} if cfg["ours_unseeded"] else {}))) for r in requests]
        if cfg["lengths"] == "varied":
            keys = [index_of[tuple(r.prompt_token_ids)] for r in forced for _ in range(r.params.n)]
            # the draws of the step this batch is for: the generate call's count (async: one step ahead of c.steps)
            lengths = iter(request_lengths(keys, cfg["seed"], counts["generations"], cfg["max_new_tokens"]))
            split = [dataclasses.replace(r, request_id=f"{r.request_id}-{j}", params=dataclasses.replace(
                         r.params, n=1, max_new_tokens=next(lengths),
                         seed=None if r.params.seed is None else (r.params.seed * 1_000_003 + j) % 2**31))
                     for r in forced for j in range(r.params.n)]
            singles, groups, at = generate(split), [], 0
            for r in forced:
                group = [g[0] for g in singles[at:at + r.params.n]]
                for j, sample in enumerate(group):
                    sample.info.update(request_id=r.request_id, sample_index=j)
                groups.append(group)
                at += r.params.n
        else:
            groups = generate(forced)
        counts["generations"] += 1
        out = [len(s.response_ids) for g in groups for s in g]
        generated.append((sum(out), len(out), out))
        return groups

    rollout.generate = full_length_generate
    sample_round = run.trainer.sampler.sample_round  # the generate phase: prompts, the engine, the items, the rewards

    def profiled_round(*args, **kwargs):
        counts["calls"] += 1
        if counts["calls"] != cfg["warmup"] + 1:
            return sample_round(*args, **kwargs)
        import cProfile
        import pstats

        prof = cProfile.Profile()
        with ThreadSampler() as threads:
            out = prof.runcall(sample_round, *args, **kwargs)
        print(f"[grpo_vs_trl] ours: cProfile of the generate phase (rewards included) of step {counts['calls']}")
        pstats.Stats(prof, stream=sys.stdout).sort_stats("cumulative").print_stats(30)
        print(threads.report())
        sys.stdout.flush()
        return out

    if cfg["ours_profile_generate"]:
        run.trainer.sampler.sample_round = profiled_round
    worker = run.trainer.policy.worker  # LocalFactory: the policy rank lives in this process
    train = worker.train

    def profiled_train(*args, **kwargs):
        counts["trains"] += 1
        if counts["trains"] != cfg["warmup"] + cfg["steps"]:
            return train(*args, **kwargs)
        from cuda_profile import profile_cuda

        out, text = profile_cuda(train, *args, label=f"ours: the policy's training call of step {counts['trains']}",
                                 regions={"forward": (worker, "_model"), "backward": (worker.s, "backward"),
                                          "optimizer_step": (worker.s, "optimizer_step"),
                                          "micro_batches": (worker, "_micro_batches"),
                                          "global_tokens": (worker, "_global_tokens")}, **kwargs)
        print(text)
        sys.stdout.flush()
        return out

    if cfg["ours_profile_train"]:
        if cfg["device"] != "cuda":
            raise SystemExit("--ours_profile_train profiles CUDA kernels: run it with --device cuda")
        worker.train = profiled_train
    llm = getattr(rollout, "_llm", None)  # VLLMEngine's vllm.LLM (in this process)
    c.ready({"engine": type(rollout).__name__, "torch_threads": torch.get_num_threads(),
             "auto": [str(x) for x in chosen],
             "prompt_tokens": [len(p["prompt_ids"]) for p in prompts],
             "on_policy": bool(getattr(run.trainer, "on_policy", False)), "roles": run.roles(),
             "engine_config": engine_config(engine, llm),
             **device_memory()})
    try:
        run.trainer.fit()
    finally:
        run.close()


def _run_trl(c: _Conductor, cfg: dict) -> None:
    import torch
    import trl
    from datasets import Dataset
    from transformers import AutoTokenizer, TrainerCallback
    from transformers.trainer_callback import PrinterCallback
    from trl import GRPOConfig, GRPOTrainer

    n_seq = cfg["prompts"] * cfg["samples"]
    cuda = cfg["device"] == "cuda"
    tok = AutoTokenizer.from_pretrained(cfg["model"])
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    rows = [json.loads(line) for line in Path(cfg["prompt_file"]).read_text().splitlines()]
    dataset = Dataset.from_list(rows)
    use_vllm = cfg["rollout_engine"] == "vllm"
    full_length = {"ignore_eos": True} if use_vllm else {"min_new_tokens": cfg["max_new_tokens"]}
    extra = {"use_vllm": False}
    if use_vllm:
        extra = {"use_vllm": True, "vllm_mode": "colocate",
                 "vllm_gpu_memory_utilization": cfg["vllm_gpu_memory_utilization"],
                 "vllm_enable_sleep_mode": cfg["vllm_sleep"],
                 "vllm_importance_sampling_correction": cfg["trl_is_correction"]}
        # colocate = vLLM's external_launcher executor, which joins a torch.distributed world of this one process
        # (env://). TRL sets RANK / LOCAL_RANK / WORLD_SIZE itself when it builds the engine (setting them here
        # would make accelerate start a process group of its own); the rendezvous address is ours to give.
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(_free_port()))
    args = GRPOConfig(
        output_dir=str(Path(cfg["workdir"]) / "trl"), report_to="none", save_strategy="no", eval_strategy="no",
        logging_steps=1, disable_tqdm=True, max_steps=cfg["warmup"] + cfg["steps"], seed=cfg["seed"],
        num_generations=cfg["samples"], per_device_train_batch_size=cfg["trl_micro_batch"],
        gradient_accumulation_steps=n_seq // cfg["trl_micro_batch"], max_completion_length=cfg["max_new_tokens"],
        use_liger_kernel=cfg["trl_use_liger_kernel"],
        temperature=1.0, top_p=1.0, top_k=0, beta=0.0, num_iterations=1, loss_type="dapo", scale_rewards="group",
        learning_rate=cfg["learning_rate"], lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0,
        adam_beta1=0.9, adam_beta2=0.95, max_grad_norm=1.0, bf16=cfg["bf16"], gradient_checkpointing=False,
        generation_kwargs=full_length, model_init_kwargs={"dtype": torch.bfloat16 if cfg["bf16"] else torch.float32},
        dataloader_pin_memory=cuda, use_cpu=not cuda, **extra)
    if args.generation_batch_size != n_seq or args.steps_per_generation != args.gradient_accumulation_steps:
        raise RuntimeError(f"TRL's generation batch {args.generation_batch_size} / steps_per_generation "
                           f"{args.steps_per_generation}: expected {n_seq} completions per optimizer step")

    timing = {"generate_s": 0.0, "generate_and_score_s": 0.0, "sync_s": 0.0, "tokens": 0, "sequences": 0}

    class StepTimer(TrainerCallback):
        def __init__(self):
            self.t0 = 0.0
            self.record: dict | None = None

        def on_step_begin(self, args, state, control, **kwargs):
            timing.update(generate_s=0.0, generate_and_score_s=0.0, sync_s=0.0, tokens=0, sequences=0)
            self.t0 = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            step_s = time.perf_counter() - self.t0
            self.record = {"step_s": step_s, "generate_s": timing["generate_s"] - timing["sync_s"],
                           "sync_s": timing["sync_s"],
                           "score_and_prepare_s": timing["generate_and_score_s"] - timing["generate_s"],
                           "train_s": step_s - timing["generate_and_score_s"],
                           "generated_tokens": timing["tokens"], "sequences": timing["sequences"],
                           "lengths": sorted(timing.get("lengths", []))}

        def on_log(self, args, state, control, logs=None, **kwargs):
            if self.record is None:  # the end-of-training summary: no step to hand over
                return
            record, self.record = self.record, None
            record.update({k: float(v) for k, v in (logs or {}).items() if isinstance(v, (int, float))})
            c.step(record)

    trainer = GRPOTrainer(model=cfg["model"], reward_funcs=reward_trl, args=args, train_dataset=dataset,
                          processing_class=tok, callbacks=[StepTimer()])

    def timed(fn, key: str):
        """fn, with the seconds of every call (device work included) added to timing[key]."""

        def wrapper(*a, **kw):
            t0 = time.perf_counter()
            out = fn(*a, **kw)
            if cuda:
                torch.cuda.synchronize()
            timing[key] += time.perf_counter() - t0
            return out

        return wrapper

    gen_single = trainer._generate_single_turn

    def counted_generate(*a, **kw):
        completion_ids, logprobs = gen_single(*a, **kw)
        timing["tokens"] += sum(len(ids) for ids in completion_ids)
        timing["sequences"] += len(completion_ids)
        timing["lengths"] = [len(ids) for ids in completion_ids]
        return completion_ids, logprobs

    trainer._generate_single_turn = timed(counted_generate, "generate_s")
    trainer._generate_and_score_completions = timed(trainer._generate_and_score_completions, "generate_and_score_s")
    trainer.remove_callback(PrinterCallback)  # with disable_tqdm the Trainer prints every log dict; we print steps
    engine_config = {"use_vllm": args.use_vllm}
    if use_vllm:
        vgen = trainer.vllm_generation
        # TRL syncs inside _generate_single_turn (and inside generate after a level-2 sleep): timed apart
        vgen.sync_weights = timed(vgen.sync_weights, "sync_s")
        if cfg["lengths"] == "varied":
            vgen.llm.generate = varied_length_generate(vgen.llm.generate, tok, cfg, c)
        engine_config.update(vllm_mode=args.vllm_mode, enable_sleep=args.vllm_enable_sleep_mode,
                             **({"sleep_level": 2} if args.vllm_enable_sleep_mode else {}),  # TRL's only level
                             importance_sampling_correction=args.vllm_importance_sampling_correction,
                             **vllm_settings(vgen.llm))
    prompt_tokens = [len(ids) for ids in tok([r["prompt"] for r in rows])["input_ids"]]
    c.ready({"trl": trl.__version__, "torch_threads": torch.get_num_threads(), "prompt_tokens": prompt_tokens,
             "use_vllm": args.use_vllm, "generation_kwargs": full_length, "engine_config": engine_config,
             **device_memory()})
    trainer.train()


def varied_length_generate(llm_generate, tok, cfg: dict, c: _Conductor):
    """TRL's colocated ``vllm.LLM.generate`` (TRL 1.16 calls it once per generation batch from
    ``VLLMGeneration.generate``, one prompt per completion, ``n=1``, one SamplingParams for all) given one
    SamplingParams per prompt: TRL's own, with ``max_tokens`` the length response_length draws for that request
    and ``ignore_eos`` (from generation_kwargs) kept."""
    cache: dict[tuple[int, ...], int] = {}

    def generate(prompts, sampling_params=None, *args, **kwargs):
        if sampling_params is None or isinstance(sampling_params, (list, tuple)) or sampling_params.n != 1:
            raise RuntimeError(f"--lengths varied expects TRL to call vllm.LLM.generate with one SamplingParams of "
                               f"n=1 (TRL 1.16's colocate mode), got {sampling_params!r}")
        keys = []
        for prompt in prompts:
            ids = tuple(prompt["prompt_token_ids"])
            if ids not in cache:
                cache[ids] = prompt_index(tok.decode(list(ids)))
            keys.append(cache[ids])
        per_request = []
        for n in request_lengths(keys, cfg["seed"], c.steps, cfg["max_new_tokens"]):
            sp = sampling_params.clone()
            sp.max_tokens = n
            per_request.append(sp)
        return llm_generate(prompts, per_request, *args, **kwargs)

    return generate


def engine_config(engine, llm) -> dict:
    """Ours: the EngineConfig fields the engine kind reads that vLLM's config does not show, and what its vllm.LLM
    runs with (vllm_settings)."""
    fields = ("max_batch_sequences",) if engine.kind != "vllm" else (
        ("enable_sleep", "sleep_level") if engine.enable_sleep else ("enable_sleep",))
    return {"kind": engine.kind, **{k: getattr(engine, k) for k in fields},
            **(vllm_settings(llm) if llm is not None else {})}


def vllm_settings(llm) -> dict:
    """What a vllm.LLM really runs with, read back from its config: the same keys for both sides."""

    def read(path: str):
        obj = llm.llm_engine.vllm_config
        for name in path.split("."):
            obj = getattr(obj, name, None)
        if isinstance(obj, enum.Enum):
            return obj.name
        return obj if obj is None or isinstance(obj, (bool, int, float, str)) else str(obj)

    keys = {"gpu_memory_utilization": "cache_config.gpu_memory_utilization",
            "kv_cache_blocks": "cache_config.num_gpu_blocks", "block_size": "cache_config.block_size",
            "prefix_caching": "cache_config.enable_prefix_caching", "sleep_mode": "model_config.enable_sleep_mode",
            "enforce_eager": "model_config.enforce_eager", "dtype": "model_config.dtype",
            "max_model_len": "model_config.max_model_len", "logprobs_mode": "model_config.logprobs_mode",
            "max_num_seqs": "scheduler_config.max_num_seqs", "async_scheduling": "scheduler_config.async_scheduling",
            "max_num_batched_tokens": "scheduler_config.max_num_batched_tokens",
            "executor": "parallel_config.distributed_executor_backend", "compile_mode": "compilation_config.mode",
            "cudagraph_mode": "compilation_config.cudagraph_mode"}
    return {"vllm_" + k: read(v) for k, v in keys.items()}


def device_memory() -> dict:
    """The GPU's memory in use by every process (total - free) once this side is built; {} on CPU."""
    import torch

    if not torch.cuda.is_available():
        return {}
    free, total = torch.cuda.mem_get_info()
    return {"gpu_in_use_gib": round((total - free) / 2**30, 2), "gpu_total_gib": round(total / 2**30, 2)}


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# ----- the conductor --------------------------------------------------------------------------------------


def _recv(name: str, proc, conn, timeout: float):
    deadline = time.monotonic() + timeout
    while not conn.poll(1.0):
        if not proc.is_alive():
            raise RuntimeError(f"{name}: the process died (exit code {proc.exitcode}) without a word")
        if time.monotonic() > deadline:
            raise TimeoutError(f"{name}: no answer in {timeout:.0f} s")
    kind, payload = conn.recv()
    if kind == "error":
        raise RuntimeError(f"{name} failed:\n{payload}")
    return kind, payload


def _check_environment(device: str, engine: str) -> None:
    if importlib.util.find_spec("trl") is None:
        sys.exit("TRL is not installed: it is in the root pyproject's `bench` dependency group; run\n"
                 "    uv run --group bench python benchmarks/grpo_vs_trl.py\n"
                 "(on the lent GPU machine: `bash .vcarry6/install.sh` after the vLLM carry's install)")
    if device == "cuda":
        import torch

        if not torch.cuda.is_available():
            sys.exit("--device cuda: torch sees no CUDA device here; run on a GPU machine or use --device cpu")
    if engine == "vllm" and importlib.util.find_spec("vllm") is None:
        sys.exit("--rollout_engine vllm (the default on --device cuda) compares TRL's colocated vLLM "
                 "(use_vllm=True, vllm_mode='colocate') with ours on VLLMEngine, and vLLM is not installed: install "
                 "it (rl-rollout's `vllm` extra, or `pip install vllm`), or pass --rollout_engine hf")


def _mean(xs: list[float]) -> float | None:
    return statistics.fmean(xs) if xs else None


def summarize(records: dict[str, list[dict]], warmup: int, threads: dict[str, int], quiet_util: float | None) -> dict:
    """Means over the steps after the warm-up; "quiet" steps are those whose process kept its threads busy
    (CPU seconds / wall seconds >= quiet_util x threads), i.e. that others' jobs did not slow down (none counted
    when quiet_util is None: on a GPU)."""
    out: dict = {}
    breakdown = {"ours": ("generate_s", "reward_s", "experience_s", "critic_train_s", "policy_train_s", "sync_s"),
                 "trl": ("generate_s", "sync_s", "score_and_prepare_s", "train_s")}
    for side in SIDES:
        kept = records[side][warmup:]
        steps = [r["step_s"] for r in kept]
        quiet_recs = ([] if quiet_util is None else
                      [r for r in kept if r["cpu_s"] >= quiet_util * threads[side] * r["go_to_done_s"]])
        quiet = [r["step_s"] for r in quiet_recs]
        out[side] = {
            "step_s": steps,
            "step_s_mean": _mean(steps),
            "step_s_median": statistics.median(steps) if steps else None,
            "step_s_min": min(steps) if steps else None,
            "go_to_done_s_mean": _mean([r["go_to_done_s"] for r in kept]),
            "cpu_s": [r["cpu_s"] for r in kept],
            "cpu_s_mean": _mean([r["cpu_s"] for r in kept]),
            "cpu_s_median": statistics.median([r["cpu_s"] for r in kept]) if kept else None,
            "breakdown_mean": {k: _mean([r.get(k, 0.0) for r in kept]) for k in breakdown[side]},
            "breakdown_quiet_mean": {k: _mean([r.get(k, 0.0) for r in quiet_recs]) for k in breakdown[side]},
            "generated_tokens_per_step": _mean([r["generated_tokens"] for r in kept]),
            "sequences_per_step": _mean([r["sequences"] for r in kept]),
            "warmup_step_s": [r["step_s"] for r in records[side][:warmup]],
            "generate_s": [r.get("generate_s", 0.0) for r in kept],
            "gc_s": [r.get("gc_s", 0.0) for r in kept],
            "gc_full": [r.get("gc_full", 0) for r in kept],
            "loadavg_1m_mean": _mean([r["loadavg_1m"] for r in kept]),
            "cpu_per_wall": [r["cpu_s"] / r["go_to_done_s"] for r in kept],
            "quiet_step_s": quiet,
            "quiet_step_s_mean": _mean(quiet),
            "quiet_step_s_median": statistics.median(quiet) if quiet else None,
        }
    if out["ours"]["step_s_mean"] and out["trl"]["step_s_mean"]:
        out["ratio_ours_over_trl"] = {
            "mean": out["ours"]["step_s_mean"] / out["trl"]["step_s_mean"],
            "median": out["ours"]["step_s_median"] / out["trl"]["step_s_median"],
            "min": out["ours"]["step_s_min"] / out["trl"]["step_s_min"],
            "go_to_done_mean": out["ours"]["go_to_done_s_mean"] / out["trl"]["go_to_done_s_mean"],
            "cpu_s_mean": out["ours"]["cpu_s_mean"] / out["trl"]["cpu_s_mean"],
            "cpu_s_median": out["ours"]["cpu_s_median"] / out["trl"]["cpu_s_median"],
        }
        if out["ours"]["quiet_step_s"] and out["trl"]["quiet_step_s"]:
            out["ratio_ours_over_trl"]["quiet_mean"] = (out["ours"]["quiet_step_s_mean"]
                                                        / out["trl"]["quiet_step_s_mean"])
            out["ratio_ours_over_trl"]["quiet_median"] = (out["ours"]["quiet_step_s_median"]
                                                          / out["trl"]["quiet_step_s_median"])
    return out


def check_tokens(records: dict[str, list[dict]], a: argparse.Namespace) -> dict:
    """Did both sides generate the same tokens in every step (totals, and each request's length as a multiset), and
    what the lengths asked for?"""
    n = min(len(records[side]) for side in SIDES)
    expected = [sum(step_lengths(a.seed, a.prompts, a.samples, i, a.max_new_tokens)) if a.lengths == "varied"
                else a.prompts * a.samples * a.max_new_tokens for i in range(n)]
    got = {side: [r["generated_tokens"] for r in records[side][:n]] for side in SIDES}
    same_lengths = all(records["ours"][i].get("lengths") == records["trl"][i].get("lengths") for i in range(n))
    ok = got["ours"] == got["trl"] == expected and same_lengths
    line = (f"generated tokens per step, identical on both sides and as asked ({a.lengths} lengths): {expected}"
            if ok else f"WARNING: the sides generated different tokens ({a.lengths} lengths): asked {expected}, ours "
                       f"{got['ours']}, TRL {got['trl']}, per-request lengths the same: {same_lengths}")
    return {"ok": ok, "expected": expected, **got, "same_lengths": same_lengths, "line": line}


def report(summary: dict, info: dict) -> None:
    o, t = summary["ours"], summary["trl"]
    print(f"\n== GRPO, {info['shape']}, {info['batch']}, {info['dtype']}, device {info['device']} ==")
    print(f"TRL {info['trl_version']} "
          f"({'vLLM colocate' if info['rollout_engine'] == 'vllm' else 'transformers generate'}) "
          f"vs ours ({info['ours_engine']}, ZeRO-{info['zero_stage']}); torch threads per side: {info['threads']}")
    if info.get("ours_only"):
        print(f"ours only, set by hand (TRL runs without them): {info['ours_only']}")
    if info.get("trl_only"):
        print(f"TRL only (its own best settings; ours runs without them): {info['trl_only']}")
    for line in info.get("ours_auto", []):
        print(f"ours, chosen by rl ppo's auto: {line}")
    for side in SIDES:
        print(f"engine, {side}: " + ", ".join(f"{k} {v}" for k, v in info["engine_config"][side].items()))
    dtypes = {side: info["engine_config"][side].get("vllm_dtype") for side in SIDES}
    if None not in dtypes.values() and len(set(dtypes.values())) > 1:  # TRL gives vLLM no dtype: "auto" makes fp32 bf16
        print(f"WARNING: the two vLLM engines sample in different dtypes: {dtypes}")
    if info.get("gpu_in_use_gib"):
        print(f"GPU memory in use (all processes) once each side was built: {info['gpu_in_use_gib']} GiB")
    print(f"{'':28s}{'ours':>10s}{'TRL':>10s}")
    print(f"{'seconds per step, mean':28s}{o['step_s_mean']:10.3f}{t['step_s_mean']:10.3f}")
    print(f"{'seconds per step, median':28s}{o['step_s_median']:10.3f}{t['step_s_median']:10.3f}")
    print(f"{'seconds per step, min':28s}{o['step_s_min']:10.3f}{t['step_s_min']:10.3f}")
    q = (o["quiet_step_s_mean"], t["quiet_step_s_mean"])
    if None not in q:
        print(f"{'quiet steps, mean':28s}{q[0]:10.3f}{q[1]:10.3f}   ({len(o['quiet_step_s'])} and "
              f"{len(t['quiet_step_s'])} steps: CPU / wall >= {info['quiet_util']} x threads)")
    print(f"{'CPU seconds per step, mean':28s}{o['cpu_s_mean']:10.3f}{t['cpu_s_mean']:10.3f}")
    print(f"{'CPU seconds per step, median':28s}{o['cpu_s_median']:10.3f}{t['cpu_s_median']:10.3f}")
    print(f"{'generated tokens per step':28s}{o['generated_tokens_per_step']:10.0f}"
          f"{t['generated_tokens_per_step']:10.0f}")
    print(f"{'sequences per step':28s}{o['sequences_per_step']:10.0f}{t['sequences_per_step']:10.0f}")
    r = summary.get("ratio_ours_over_trl", {})
    nan = float("nan")
    print(f"ratio ours / TRL, wall: mean {r.get('mean', nan):.3f}, median {r.get('median', nan):.3f}, min "
          f"{r.get('min', nan):.3f} (conductor's go-to-done, mean: {r.get('go_to_done_mean', nan):.3f}); "
          f"CPU seconds: mean {r.get('cpu_s_mean', nan):.3f}, median {r.get('cpu_s_median', nan):.3f}; "
          + (f"quiet steps: mean {r['quiet_mean']:.3f}, median {r['quiet_median']:.3f}" if "quiet_mean" in r else
             "quiet steps: not counted on a GPU (the processes wait on the device)" if info["quiet_util"] is None
             else "quiet steps: none on both sides (the machine was loaded throughout: read the CPU-seconds ratio)"))
    for label, key in (("all", "breakdown_mean"), ("quiet", "breakdown_quiet_mean")):
        for name, x in (("ours", o), ("TRL", t)):
            if None not in x[key].values():
                print(f"{name} per step ({label} steps): " + ", ".join(f"{k} {v:.3f}" for k, v in x[key].items()))
    print("steps (s):      ours " + " ".join(f"{x:.2f}" for x in o["step_s"]) +
          " | TRL " + " ".join(f"{x:.2f}" for x in t["step_s"]) +
          f"  (warm-up left out: ours {[round(x, 2) for x in o['warmup_step_s']]}, "
          f"TRL {[round(x, 2) for x in t['warmup_step_s']]})")
    print("generate (s):   ours " + " ".join(f"{x:.2f}" for x in o["generate_s"]) +
          " | TRL " + " ".join(f"{x:.2f}" for x in t["generate_s"]))
    print("Python GC (s):  ours " + " ".join(f"{x:.3f}" for x in o["gc_s"]) +
          " | TRL " + " ".join(f"{x:.3f}" for x in t["gc_s"]) +
          f"  (full collections: ours {o['gc_full']}, TRL {t['gc_full']})")
    if info.get("ours_async"):  # overlap: the step near max(generate, train), not their sum
        g, tr = o["breakdown_mean"]["generate_s"], o["breakdown_mean"]["policy_train_s"]
        steady = o["step_s"][:-1]  # the last step only trains (nothing left to generate): the pipeline's tail
        if steady:
            print(f"ours async, steady state (all but the last measured step, which only trains): "
                  f"{statistics.mean(steady):.3f} s a step, {statistics.mean(steady) / t['step_s_mean']:.3f}x TRL's mean")
        print(f"ours async (--max_staleness 1, tis correction): step {o['step_s_mean']:.3f} s against generate "
              f"{g:.3f} + train {tr:.3f} = {g + tr:.3f} s run one after the other, max {max(g, tr):.3f} s; sides "
              "run one after the other (ours' steps back to back, then TRL's), not alternating")
    if "tokens_check" in info:
        print(info["tokens_check"]["line"])
    print(f"machine load (1-min average, {info['cpu_count']} cores) after the measured steps: ours "
          f"{o['loadavg_1m_mean']:.1f}, TRL {t['loadavg_1m_mean']:.1f}; ours skips the old-logprob forward: "
          f"{info['ours_skips_old_logprob_forward']}")


def main(argv: list[str] | None = None) -> int:
    a = resolve_args(arg_parser().parse_args(argv))
    _check_environment(a.device, a.rollout_engine)

    tmp = None
    if a.workdir is None:
        tmp = tempfile.TemporaryDirectory(prefix="grpo_vs_trl_")
        a.workdir = tmp.name
    work = Path(a.workdir)
    work.mkdir(parents=True, exist_ok=True)
    if a.model is None:
        from rl_rollout.testing import make_tiny_model

        name = (f"llama_h{a.hidden_size}_l{a.num_layers}_a{a.num_heads}_kv{a.num_kv_heads}_i{a.intermediate_size}"
                f"_p{a.max_position_embeddings}_v{a.vocab_size}_{'bf16' if a.bf16 else 'fp32'}")
        a.model = str(make_tiny_model(work / name, hidden_size=a.hidden_size, num_layers=a.num_layers,
                                      vocab_size=a.vocab_size,
                                      num_heads=a.num_heads, num_kv_heads=a.num_kv_heads,
                                      intermediate_size=a.intermediate_size, seed=a.seed,
                                      max_position_embeddings=a.max_position_embeddings,
                                      dtype="bfloat16" if a.bf16 else "float32"))
    prompt_file = work / "prompts.jsonl"
    prompt_file.write_text("".join(json.dumps({"prompt": prompt_text(i, a.prompt_lengths == "varied", a.seed),
                                               "label": x}) + "\n" for i, x in enumerate(LETTERS[:a.prompts])))
    cfg = {**vars(a), "prompt_file": str(prompt_file)}

    import torch
    from transformers import AutoConfig

    mcfg = AutoConfig.from_pretrained(a.model)
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        params = sum(p.numel() for p in AutoModelForCausalLM.from_config(mcfg).parameters())
    info = {"device": a.device, "rollout_engine": a.rollout_engine, "dtype": "bf16" if a.bf16 else "fp32",
            "shape": (f"{mcfg.model_type} hidden {mcfg.hidden_size}, {mcfg.num_hidden_layers} layers, "
                      f"{mcfg.num_attention_heads} heads, {mcfg.num_key_value_heads} KV heads, intermediate "
                      f"{mcfg.intermediate_size}, vocab {mcfg.vocab_size}, {params / 1e6:.2f}M params"),
            "batch": f"{a.prompts} prompts ({a.prompt_lengths} length) x {a.samples} samples x "
                     + (f"{a.max_new_tokens} new tokens" if a.lengths == "full" else
                        f"varied lengths {min(LENGTH_MIN, a.max_new_tokens)}-{a.max_new_tokens} new tokens "
                        f"(log-normal, median {a.max_new_tokens // 4}; step 1: "
                        f"{sum(step_lengths(a.seed, a.prompts, a.samples, 0, a.max_new_tokens))} tokens)")
                     + (f", each side capped at {a.memory_share} of the GPU" if a.device == "cuda" else ""),
            "params": params, "cpu_count": os.cpu_count(), "zero_stage": "auto" if a.zero_stage is None else a.zero_stage,
            "ours_only": ", ".join(f"{flag} {getattr(a, key)}" for flag, key in (
                ("--zero_stage", "zero_stage"), ("--packing", "ours_packing"),
                ("--max_tokens_per_gpu", "ours_max_tokens_per_gpu"), ("--use_liger_kernel", "ours_use_liger_kernel"),
                ("--micro_train_batch_size rows", "ours_rows"), ("--fused_lm_head", "ours_fused_lm_head"),
                ("--async_train --max_staleness 1 (tis correction)", "ours_async"),
                ("requests unseeded", "ours_unseeded"), ("vLLM engine arguments", "ours_vllm_kwargs"))
                if getattr(a, key) not in (None, "auto", False)),
            "trl_only": ", ".join(f"{name} {value}" for name, value in (
                ("per_device_train_batch_size", a.trl_micro_batch if a.trl_micro_batch != a.micro_batch else None),
                ("use_liger_kernel", a.trl_use_liger_kernel or None)) if value is not None)}

    ctx = mp.get_context("spawn")
    procs, conns, ready = {}, {}, {}
    records: dict[str, list[dict]] = {s: [] for s in SIDES}
    t_start = time.perf_counter()
    try:
        for side in SIDES:  # one at a time: each side's start-up runs alone
            parent, child = ctx.Pipe()
            procs[side] = ctx.Process(target=_child, args=(side, child, cfg), name=f"grpo-{side}")
            procs[side].start()
            child.close()
            conns[side] = parent
            t0 = time.perf_counter()
            _, ready[side] = _recv(side, procs[side], parent, a.step_timeout)
            print(f"[grpo_vs_trl] {side} ready in {time.perf_counter() - t0:.1f} s: {ready[side]}", flush=True)
        # A B A B ...: the same machine load for both; --ours_async: A A A B B B (an async side keeps generating
        # while it waits for its go, which would overlap the other side's step)
        order = ([(i, side) for side in SIDES for i in range(a.warmup + a.steps)] if a.ours_async else
                 [(i, side) for i in range(a.warmup + a.steps) for side in SIDES])
        for i, side in order:
            conns[side].send("go")
            kind, rec = _recv(side, procs[side], conns[side], a.step_timeout)
            if kind != "step":
                raise RuntimeError(f"{side}: ended after {len(records[side])} steps, expected "
                                   f"{a.warmup + a.steps}")
            rec["loadavg_1m"] = os.getloadavg()[0]  # the machine's load (others' jobs too) as the step ended
            records[side].append(rec)
            print(f"[grpo_vs_trl] step {i + 1}{' (warm-up)' if i < a.warmup else ''} {side}: "
                  f"{rec['step_s']:.3f} s ({rec['cpu_s']:.1f} CPU s), {rec['generated_tokens']} tokens, "
                  f"load {rec['loadavg_1m']:.1f}",
                  flush=True)
            if a.ours_async and side == "ours" and i == a.warmup + a.steps - 1:  # ours is done: free its GPU
                conns[side].send("stop")  # memory before TRL's steps (it would hold it while TRL runs)
                _recv(side, procs[side], conns[side], a.step_timeout)
                procs[side].join(60)
        for side in SIDES:
            if not procs[side].is_alive():
                continue
            conns[side].send("stop")
            kind, _ = _recv(side, procs[side], conns[side], a.step_timeout)
            procs[side].join(60)
    finally:
        for p in procs.values():
            if p.is_alive():
                p.terminate()
                p.join(10)
        if tmp is not None:
            tmp.cleanup()

    info.update(trl_version=ready["trl"]["trl"], ours_engine=ready["ours"]["engine"],
                threads={s: ready[s]["torch_threads"] for s in SIDES}, wall_s=time.perf_counter() - t_start,
                prompt_tokens={s: ready[s]["prompt_tokens"] for s in SIDES},
                ours_skips_old_logprob_forward=ready["ours"]["on_policy"], ours_auto=ready["ours"].get("auto", []))
    if info["prompt_tokens"]["ours"] != info["prompt_tokens"]["trl"]:
        print(f"[grpo_vs_trl] WARNING: the prompts tokenize differently: {info['prompt_tokens']}", flush=True)
    info["lengths"], info["prompt_lengths"], info["ours_async"] = a.lengths, a.prompt_lengths, a.ours_async
    info["tokens_check"] = check_tokens(records, a)
    print(f"[grpo_vs_trl] {info['tokens_check']['line']}", flush=True)
    info["quiet_util"] = a.quiet_util if a.device == "cpu" else None
    info["engine_config"] = {s: ready[s]["engine_config"] for s in SIDES}
    info["gpu_in_use_gib"] = {s: ready[s].get("gpu_in_use_gib") for s in SIDES if "gpu_in_use_gib" in ready[s]}
    summary = summarize(records, a.warmup, info["threads"], info["quiet_util"])
    report(summary, info)
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps({"config": {k: v for k, v in vars(a).items() if k != "workdir"},
                                           "info": info, "summary": summary, "records": records}, indent=2) + "\n")
        print(f"[grpo_vs_trl] wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
