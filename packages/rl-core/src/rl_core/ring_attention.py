"""Ring attention (sequence parallelism): one packed row split over the ranks of a ring group.

OpenRLHF's ``--ring_attn_size R`` (``--ds.ring_attn_size``): the ranks of a role form groups of ``R``
consecutive ranks; the ranks of a group hold the same micro-batches, each packed row is cut into ``R``
equal slices (padded to a multiple of ``R``), and rank ``r`` of the group runs the model on slice ``r`` only,
so a row ``R`` times longer fits in the same activation memory. Attention is the one place a token needs
the others: each layer gathers the group's keys and values (``--ring_head_stride`` KV heads at a time, as
ring-flash-attn's llama3 variant does) and attends its own queries to them under the packed row's causal
document mask. The per-token outputs (log-probs, entropy, values) are gathered back into the whole row, so
every loss and metric is computed as without ring attention.

Gradients: every collective here is differentiable and its backward sums over the group (an all-gather's
backward is a reduce-scatter). Every rank of a group computes the same loss from the gathered row, so the
group's summed gradient counts that loss ``R`` times, and DeepSpeed's average over all ``world`` ranks (``R``
per data-parallel group) takes it back to one: the ranks of a group count as data-parallel replicas of the
same data. The loss normalisers follow the same rule (token counts summed over every rank; sequence counts
times ``R``), which :class:`rl_core.rl.worker_base._Worker` does.

- :func:`setup`: the groups (collective: every rank calls it once, after the default group is up).
- :func:`current`: this process's group, or None (ring attention off).
- :func:`sharded`: the context a model forward runs in: the row's slices, its document mask, the gather.
- :func:`register`: the transformers attention function (:data:`NAME`); outside :func:`sharded` it is sdpa.

The local attention runs torch's ``scaled_dot_product_attention`` with the document mask of this slice's
queries against the whole row (``R x`` less than the row's square). OpenRLHF runs ring-flash-attn's varlen
flash kernels instead (flash-attn, CUDA only); ours runs on CPU too, which is how CI tests it (gloo).
"""

from __future__ import annotations

import contextlib
import functools
import logging
from dataclasses import dataclass

import torch
import torch.distributed as dist

NAME = "rl_ring"
logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RingGroup:
    """This rank's ring group: ``size`` consecutive ranks starting at ``first``; ``rank`` is ours in it."""

    group: object  # a torch.distributed ProcessGroup
    size: int
    rank: int
    first: int
    head_stride: int


_GROUP: RingGroup | None = None


def check_sizes(world: int, size: int, head_stride: int, what: str = "the role") -> None:
    """One-line errors for sizes that cannot be placed (the CLI checks before any process starts)."""
    if size < 1 or head_stride < 1:
        raise ValueError(f"--ring_attn_size {size} and --ring_head_stride {head_stride} must be at least 1")
    if world % size:
        raise ValueError(
            f"--ring_attn_size {size} must divide the {world} ranks of {what}: each ring group is "
            f"{size} ranks holding one data-parallel slice; give {what} a multiple of {size} ranks "
            f"or a ring size that divides {world}"
        )


def setup(size: int, head_stride: int = 1) -> RingGroup | None:
    """Make the ring groups of this world (collective) and remember this rank's; None when ``size`` is 1."""
    global _GROUP
    if size == 1:
        _GROUP = None
        return None
    world, me = dist.get_world_size(), dist.get_rank()
    check_sizes(world, size, head_stride, "this role")
    mine = None
    for first in range(0, world, size):  # every rank creates every group, in the same order
        g = dist.new_group(list(range(first, first + size)))
        if first <= me < first + size:
            mine = RingGroup(g, size, me - first, first, head_stride)
    if mine is None:  # not reached: check_sizes makes the groups cover every rank
        raise RuntimeError(f"ring attention: rank {me} of {world} is in none of the groups of {size} ranks")
    _GROUP = mine
    logger.info(
        "ring attention: rank %d is %d of %d in ranks %d-%d (head stride %d)",
        me,
        mine.rank,
        size,
        mine.first,
        mine.first + size - 1,
        head_stride,
    )
    return mine


def current() -> RingGroup | None:
    return _GROUP


# ----- differentiable collectives over the ring group -------------------------------------------------------------


def _all_gather(x: torch.Tensor, ring: RingGroup, dim: int) -> torch.Tensor:
    parts = [torch.empty_like(x) for _ in range(ring.size)]
    dist.all_gather(parts, x.contiguous(), group=ring.group)
    return torch.cat(parts, dim=dim)


class _GatherSeq(torch.autograd.Function):
    """All-gather along ``dim``; the backward sums the gradient over the group and keeps this rank's slice."""

    @staticmethod
    def forward(ctx, x, ring, dim):
        ctx.ring, ctx.dim, ctx.n = ring, dim, x.shape[dim]
        return _all_gather(x, ring, dim)

    @staticmethod
    def backward(ctx, grad):
        ring, dim, n = ctx.ring, ctx.dim, ctx.n
        if dist.get_backend(ring.group) == "nccl":  # a reduce-scatter: each rank receives its slice's sum
            g = grad.movedim(dim, 0).contiguous()
            out = g.new_empty((n, *g.shape[1:]))
            dist.reduce_scatter_tensor(out, g, group=ring.group)
            return out.movedim(0, dim), None, None
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ring.group)  # gloo has no reduce-scatter
        return grad.narrow(dim, ring.rank * n, n), None, None


def gather_seq(x: torch.Tensor, ring: RingGroup, dim: int = 1) -> torch.Tensor:
    """The group's slices of ``x`` joined along ``dim`` (differentiable)."""
    if torch.is_grad_enabled() and x.requires_grad:
        return _GatherSeq.apply(x, ring, dim)
    return _all_gather(x, ring, dim)


# ----- one forward's slice of a packed row ------------------------------------------------------------------------


class Shard:
    """A packed row ``[1, T]`` cut for this rank: padded to ``T_pad = R x L``, slice ``[rank x L, (rank+1) x L)``."""

    def __init__(self, ring: RingGroup, position_ids: torch.Tensor):
        if position_ids.dim() != 2 or position_ids.shape[0] != 1:
            raise ValueError(
                f"ring attention splits one packed row [1, T]; got position_ids of shape "
                f"{tuple(position_ids.shape)} (run with --packing so each micro-batch is one row)"
            )
        self.ring = ring
        self.length = position_ids.shape[1]
        self.pad = -self.length % ring.size
        self.local_len = (self.length + self.pad) // ring.size
        self.start = ring.rank * self.local_len
        pos = self.local(position_ids, 0)  # padding: position 0, so each pad token is a sequence of its own
        self.positions = pos
        full = torch.nn.functional.pad(position_ids, (0, self.pad), value=0)[0]
        start = torch.ones_like(full, dtype=torch.bool)
        start[1:] = full[1:] != full[:-1] + 1  # transformers' rule for where a packed sequence starts
        doc = start.long().cumsum(0)
        q = torch.arange(self.start, self.start + self.local_len, device=full.device)
        k = torch.arange(full.numel(), device=full.device)
        # [L, T_pad]: a query sees the keys of its own sequence up to itself
        self.mask = (doc[q][:, None] == doc[None, :]) & (k[None, :] <= q[:, None])

    def local(self, x: torch.Tensor, pad_value) -> torch.Tensor:
        """This rank's slice of a ``[1, T, ...]`` tensor (padded with ``pad_value`` first)."""
        if self.pad:
            shape = list(x.shape)
            shape[1] = self.pad
            x = torch.cat([x, x.new_full(shape, pad_value)], dim=1)
        return x[:, self.start : self.start + self.local_len]

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """The whole row ``[1, T, ...]`` from every rank's ``[1, L, ...]`` slice (differentiable)."""
        return gather_seq(x, self.ring, dim=1)[:, : self.length]


_SHARD: Shard | None = None


@contextlib.contextmanager
def sharded(position_ids: torch.Tensor):
    """Run a model forward on this rank's slice of the packed row ``position_ids`` belongs to: yields the
    :class:`Shard`; the model's attention layers (:data:`NAME`) read it. No-op (yields None) when ring
    attention is off."""
    global _SHARD
    ring = current()
    if ring is None:
        yield None
        return
    outer, _SHARD = _SHARD, Shard(ring, position_ids)
    try:
        yield _SHARD
    finally:
        _SHARD = outer


@contextlib.contextmanager
def _using(shard: Shard | None):
    global _SHARD
    outer, _SHARD = _SHARD, shard
    try:
        yield
    finally:
        _SHARD = outer


def checkpoint_context():
    """torch.utils.checkpoint's ``context_fn`` (non-reentrant): a checkpointed layer's recompute runs in the
    backward, after :func:`sharded` has exited; it gets the shard its forward saw, so it recomputes the same ring
    attention (without it the recompute ran plain attention on the slice: other values, and torch's check of the
    saved tensors' count failed)."""
    return contextlib.nullcontext(), _using(_SHARD)


def checkpoint_kwargs(use_reentrant: bool) -> dict:
    """``gradient_checkpointing_kwargs`` for transformers' ``gradient_checkpointing_enable``."""
    return {"use_reentrant": True} if use_reentrant else {"use_reentrant": False, "context_fn": checkpoint_context}


# ----- the attention function ------------------------------------------------------------------------------------


def ring_attention_forward(
    module,
    query,
    key,
    value,
    attention_mask,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    is_causal: bool | None = None,
    **kwargs,
):
    """transformers' attention-function contract: q/k/v ``(B, H, S, D)`` -> ``((B, S, H, D), None)``."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    shard = _SHARD
    if shard is None:  # not inside sharded(): a plain forward (export checks, generation)
        return sdpa_attention_forward(
            module,
            query,
            key,
            value,
            attention_mask,
            dropout=dropout,
            scaling=scaling,
            sliding_window=sliding_window,
            is_causal=is_causal,
            **kwargs,
        )
    if sliding_window is not None or (dropout > 0 and module.training):
        raise ValueError(
            f"ring attention runs causal full attention without dropout; this layer asks for "
            f"sliding_window={sliding_window}, dropout={dropout}: use --ring_attn_size 1"
        )
    ring = shard.ring
    B, H, L, D = query.shape
    Hkv = key.shape[1]
    stride = min(ring.head_stride, Hkv)
    if Hkv % stride:
        raise ValueError(f"--ring_head_stride {ring.head_stride} must divide the model's {Hkv} key/value heads")
    rep = H // Hkv
    mask = shard.mask.to(query.device)[None, None]
    outs = []
    for h in range(0, Hkv, stride):  # gather `stride` KV heads at a time: less memory per collective
        k = gather_seq(key[:, h : h + stride], ring, dim=2)
        v = gather_seq(value[:, h : h + stride], ring, dim=2)
        q = query[:, h * rep : (h + stride) * rep]
        if rep > 1:
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        outs.append(torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scaling))
    return torch.cat(outs, dim=1).transpose(1, 2).contiguous(), None


def ring_mask(batch_size: int, q_length: int, kv_length: int, q_offset=0, kv_offset=0, attention_mask=None, **kwargs):
    """No transformers mask inside :func:`sharded` (the shard has its own); sdpa's otherwise."""
    from transformers.masking_utils import sdpa_mask

    if _SHARD is not None:
        return None
    return sdpa_mask(
        batch_size=batch_size,
        q_length=q_length,
        kv_length=kv_length,
        q_offset=q_offset,
        kv_offset=kv_offset,
        attention_mask=attention_mask,
        **kwargs,
    )


@functools.cache
def register() -> str:
    """Register :data:`NAME` with transformers (attention function and mask); returns the name."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(NAME, ring_attention_forward)
    AttentionMaskInterface.register(NAME, ring_mask)
    return NAME
