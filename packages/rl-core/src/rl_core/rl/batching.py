"""Micro-batches of the RL workers: which experience items share a forward, and the layout they go in.

- :class:`MicroBatchConfig` (defined in :mod:`rl_core.rl.batching_config`, which imports no torch): the token
  budget of a training micro-batch (``--max_tokens_per_gpu``, OpenRLHF's dynamic batching), the budget and the
  sequence count of the no-grad experience forwards.
- :func:`plan_micro_batches`: a rank's items grouped into micro-batches: consecutive runs of ``micro_batch``
  items, or, with a token budget, first-fit decreasing bins whose cost stays within it (cost: the real
  tokens when packed, rows x longest row when padded); an item longer than the budget gets a micro-batch of its
  own, over the budget, as in OpenRLHF's dynamic batching (:func:`over_budget` counts them: the loop warns and
  logs the count, :mod:`rl_core.trainers.ppo`). :func:`equalise` then splits the largest bins until
  every data-parallel rank has the same count: DeepSpeed reduces gradients on each backward (ZeRO-2) or at
  the accumulation boundary, and gathers weights on each forward (ZeRO-3), so ranks must call it in step.
- :class:`ModelInputs`: one micro-batch as the model takes it, padded rows (``attention_mask``) or one
  packed row (``position_ids`` restarting at 0 per item, no mask: transformers keeps attention within each
  item; see :mod:`rl_core.models`), and :meth:`ModelInputs.rows` to lay a per-token result out as the
  padded ``[B, T]`` of :func:`rl_core.rl.experience.collate`, so the losses see the same tensors either way.
  With ``images`` (a vision-language model's workers), the items' ``image_inputs`` go along, concatenated in
  item order (padded rows only).

The loss normalisers are global counts (tokens, sequences over the global batch), so how items are grouped
does not change the gradient; only the time and memory per forward.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

import rl_core.activation_checkpointing as ac
from rl_core.data.collate import pack_greedy
from rl_core.preflight import InputError
from rl_core.rl.batching_config import MicroBatchConfig  # re-exported: the settings live beside, torch-free
from rl_core.rl.experience import Experience, collate
from rl_rollout.vision import cat_image_inputs

logger = logging.getLogger(__name__)


AUTO_MAX_TOKENS = 65_536  # an auto budget's ceiling: past it a micro-batch is no faster (docs/performance.md)
AUTO_MIN_TOKENS = 1_024
AUTO_SHARE = 0.85  # of the free memory: the estimate counts what autograd saves, not the allocator's fragments
FUSED_HEAD_RESERVE = 3 * 2**30  # --fused_lm_head's chunk of logits (512M elements, bf16 and an fp32 copy)


def memory_budget(engine, device: torch.device, *, train: bool) -> tuple[int, str]:
    """``(tokens, how)``: the token budget of a micro-batch that fits this device's free memory now (``memory``).

    Bytes per token from :class:`rl_core.activation_checkpointing.ActivationEstimate` (what autograd saves per
    decoder layer, less with liger's kernels; the logits and their gradient, none with ``--fused_lm_head``, whose
    chunk is reserved instead): a training micro-batch holds every kept layer and each checkpointed layer's
    input, a no-grad forward one layer at a time. Free memory as :func:`rl_core.activation_checkpointing.free_bytes` (gradients
    and Adam moments still to come left out). ``AUTO_SHARE`` of it, within ``AUTO_MIN_TOKENS``..``AUTO_MAX_TOKENS``.
    A training budget first checks that the optimizer step fits at all (:func:`check_optimizer_step`: an
    :class:`OptimizerStepDoesNotFit` naming the fixes, instead of CUDA's out-of-memory error inside DeepSpeed's step).
    """

    module = getattr(engine, "module", engine)
    layers = ac.decoder_layers(module)
    est = ac.ActivationEstimate.of(module, len(layers))
    fused = bool(getattr(module, "fused_lm_head", False))
    # rl_algos' log-probs keep the logits and, in backward, their gradient (2 e V; the fp32 work is per chunk or
    # inside the Triton kernel), not the estimate's e + 4 bytes per logit
    e = next(module.parameters()).element_size()
    head = 0 if fused or not est.head else 2 * e * est.head // (e + 4)
    if train:
        ckpt = sum(bool(getattr(layer, "gradient_checkpointing", False)) for layer in layers)
        per_token = est.bytes(ckpt, 1) - est.head + head
    else:
        per_token = est.per_layer + head
    optimizer = getattr(engine, "optimizer", None) if train else None
    free = ac.free_bytes(module, device, optimizer)
    if train:
        check_optimizer_step(free + ac.margin_bytes(device), ac.pending_step_grads(optimizer), device)
    free -= FUSED_HEAD_RESERVE if fused else 0
    tokens = int(AUTO_SHARE * max(free, 0) / max(per_token, 1))
    clamped = min(max(tokens, AUTO_MIN_TOKENS), AUTO_MAX_TOKENS)
    how = f"{clamped} tokens: {free / 2**30:.1f} GiB free x {AUTO_SHARE} / {per_token / 2**10:.0f} KiB per token" + (
        f" (clamped from {tokens})" if clamped != tokens else ""
    )
    return clamped, how


class OptimizerStepDoesNotFit(InputError, MemoryError):
    """The run's memory settings leave no room for its optimizer step (a user's setting: ``rl`` prints one line)."""


def check_optimizer_step(free: int, step_grads: int, device: torch.device) -> None:
    """Refuse a training step whose optimizer step cannot fit even with no activations and no margin: ``free`` is
    what is left once the gradients and Adam moments to come are counted (:func:`rl_core.activation_checkpointing
    .free_bytes` without its margin), ``step_grads`` the fp32 gradient copies DeepSpeed's ZeRO-0 optimizer makes in
    its step (:func:`~rl_core.activation_checkpointing.pending_step_grads`). Without this the run fails with
    CUDA's out-of-memory error inside DeepSpeed's step, after its first generation and backward."""
    short = step_grads - free
    if short <= 0:
        return
    gib = 2**30
    raise OptimizerStepDoesNotFit(
        f"the first optimizer step cannot fit on {device}: the gradients, Adam moments and DeepSpeed's fp32 "
        f"gradient copies ({step_grads / gib:.1f} GiB of them) need {short / gib:.1f} GiB more than this process "
        f"has ({max(free, 0) / gib:.1f} GiB left before the copies), with no activations at all. Free memory for "
        "training: a smaller --vllm_gpu_memory_utilization (an engine in this process holds its share), "
        "--adam_offload (Adam's states in host memory), --zero_stage 3 over more GPUs, or LoRA (--lora_rank)"
    )


def _cost(lengths: Sequence[int], packing: bool) -> int:
    return sum(lengths) if packing else len(lengths) * max(lengths, default=0)


def over_budget(lengths: Sequence[int], max_tokens: int) -> tuple[int, int]:
    """``(count, longest)`` of the lengths above ``max_tokens``: the items :func:`plan_micro_batches` puts in a
    micro-batch of their own, over the budget (``(0, 0)`` when none)."""
    over = [n for n in lengths if n > max_tokens]
    return len(over), max(over, default=0)


class BudgetWatch:
    """Samples longer than a token budget go alone into a micro-batch over it (as in OpenRLHF): :meth:`check`
    counts them each iteration (``budget/over_train``, ``budget/over_forward``, beside ``budget/longest``) and
    warns once per phase, the first time. ``batching``: the workers' budgets (None: nothing to watch)."""

    def __init__(self, batching: MicroBatchConfig | None):
        self.batching, self.warned = batching, set[str]()

    def check(self, it: int, lengths: list[int]) -> dict[str, float]:
        b = self.batching
        if b is None:
            return {}
        out = {}
        for phase, (budget, flag), what in (
            ("train", (b.max_tokens_per_gpu, "--max_tokens_per_gpu"), "trains"),
            ("forward", b.forward_budget(), "goes through the experience forwards"),
        ):
            # "auto" or "memory" (the only text MicroBatchConfig leaves): sized from free memory on each rank, not
            # known here
            if budget is None or isinstance(budget, str):
                continue
            n, longest = over_budget(lengths, budget)
            out[f"budget/over_{phase}"] = float(n)
            if n and phase not in self.warned:
                self.warned.add(phase)
                logger.warning(
                    "iteration %d: %d of %d samples are longer than %s %d (the longest %d tokens, prompt "
                    "+ response); each %s in a micro-batch of its own, over the budget, as in OpenRLHF. "
                    "Raise %s to at least %d or lower --generate_max_len to stay within it; counted every "
                    "iteration in budget/over_%s (this warning is not repeated)",
                    it,
                    n,
                    len(lengths),
                    flag,
                    budget,
                    longest,
                    what,
                    flag,
                    longest,
                    phase,
                )
        if out:
            out["budget/longest"] = float(max(lengths))
        return out


def plan_micro_batches(
    lengths: Sequence[int], *, micro_batch: int, max_tokens: int | None = None, packing: bool = False
) -> list[list[int]]:
    """Item indices per micro-batch, each list ascending.

    Without ``max_tokens``: consecutive runs of ``micro_batch``. With it: first-fit decreasing bins of cost
    at most ``max_tokens``, and each item longer than the budget alone in a micro-batch (first, longest first):
    OpenRLHF's first-fit opens a bin for such an item too. It trains exactly as the others (the losses
    normalise by global counts); only that forward exceeds the budget's memory. The caller says so
    (:func:`over_budget`)."""
    n = len(lengths)
    if max_tokens is None:
        return [list(range(k, min(k + micro_batch, n))) for k in range(0, n, micro_batch)]
    order = sorted(range(n), key=lambda i: (-lengths[i], i))
    alone = [[i] for i in order if lengths[i] > max_tokens]
    fit = [i for i in range(n) if lengths[i] <= max_tokens]
    if packing:
        return alone + [[fit[j] for j in b] for b in pack_greedy([lengths[i] for i in fit], max_tokens)]
    bins: list[list[int]] = []  # padded: longest first, so a bin's first item sets its row length
    for i in (i for i in order if lengths[i] <= max_tokens):
        for b in bins:
            if (len(b) + 1) * lengths[b[0]] <= max_tokens:
                b.append(i)
                break
        else:
            bins.append([i])
    return alone + [sorted(b) for b in bins]


def split_to(groups: list[list[int]], n: int, lengths: Sequence[int], packing: bool = False) -> list[list[int]]:
    """Split the costliest splittable group in two until there are ``n`` groups (each half stays in budget)."""
    groups = [list(g) for g in groups]
    while len(groups) < n:
        splittable = [k for k, g in enumerate(groups) if len(g) > 1]
        if not splittable:
            raise ValueError(
                f"{sum(map(len, groups))} items cannot fill {n} micro-batches: every data-parallel "
                "rank must hold the same number of items"
            )
        k = max(splittable, key=lambda k: _cost([lengths[i] for i in groups[k]], packing))
        g = groups.pop(k)
        half = len(g) // 2
        groups[k:k] = [g[:half], g[half:]]
    return groups


def equalise(groups: list[list[int]], lengths: Sequence[int], strategy, packing: bool = False) -> list[list[int]]:
    """Every rank ends with the largest rank's micro-batch count (collective: call on every rank)."""
    if strategy.world_size == 1:
        return groups
    n = int(strategy.all_reduce(float(len(groups)), "max"))
    return split_to(groups, n, lengths, packing)


def to_device(t: torch.Tensor, device) -> torch.Tensor:
    """A host tensor on ``device``; to CUDA from pinned memory without blocking, so the host does not wait for
    the device's queued work (a pageable copy would)."""
    if torch.device(device).type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


@dataclass
class ModelInputs:
    """One micro-batch as the model takes it; :meth:`rows` maps a per-token result back to padded rows."""

    kwargs: dict[str, torch.Tensor]
    lengths: list[int]
    packed: bool
    _slots: torch.Tensor | None = field(default=None, repr=False)

    @classmethod
    def of(cls, items: Sequence[Experience], pad_id: int, packing: bool, device, images: bool = False) -> ModelInputs:
        lengths = [it.T for it in items]
        pixels = images and any(it.image_inputs for it in items)
        if pixels and packing:
            raise ValueError(
                "packing prompts with images is not built: drop --packing (OpenRLHF: "
                "--packing_samples) for vision-language prompts"
            )
        if packing:
            ids = torch.tensor([t for it in items for t in it.input_ids_T], dtype=torch.long)
            pos = torch.cat([torch.arange(n, dtype=torch.long) for n in lengths])
            kw = {"input_ids": to_device(ids[None], device), "position_ids": to_device(pos[None], device)}
        else:
            b = collate(items, pad_id)
            kw = {
                "input_ids": to_device(b.input_ids_BT, device),
                "attention_mask": to_device(b.attention_mask_BT, device),
            }
        if pixels:
            parts = [it.image_inputs for it in items if it.image_inputs]  # (cat_image_inputs skips the rest too)
            kw.update({k: v.to(device) for k, v in cat_image_inputs(parts).items()})
        return cls(kw, lengths, packing)

    def rows(self, out):
        """``[B, T]`` (padded, 0 past each item's end) from the model's per-token output; differentiable. A
        tuple of outputs (log-probs and entropy of one forward) maps each."""
        if isinstance(out, tuple):
            return tuple(self.rows(t) for t in out)
        if not self.packed or out.dim() == 1:  # padded rows, or one number per sequence (a reward model's)
            return out
        T = max(self.lengths)
        if self._slots is None or self._slots.device != out.device:  # where each packed token sits in [B, T]
            self._slots = to_device(
                torch.cat([torch.arange(n) + b * T for b, n in enumerate(self.lengths)]), out.device
            )
        # index_copy with the slots built on the host: a boolean mask would make the host wait for the device
        return out.new_zeros(len(self.lengths) * T).index_copy(0, self._slots, out[0]).view(len(self.lengths), T)
