"""DeepSpeed internals :class:`rl_core.strategy.DeepSpeedStrategy` works around or reaches into: gathering a
bucket of ZeRO-3 parameters, one reduction per step for ZeRO-2 on one rank, skipping the JIT build of
DeepSpeed's shared-memory all-reduce on CPU. Kept apart so the strategy reads as what it does."""

from __future__ import annotations

import contextlib
import importlib
from typing import Any

import torch
from torch import nn

from rl_core import qlora
from rl_core.strategy_config import StrategyConfig

Tensor = torch.Tensor


def _gather_bucket(bucket: list[tuple[str, nn.Parameter]], dtype: torch.dtype | None) -> list[tuple[str, Tensor]]:
    zero3 = [p for _, p in bucket if hasattr(p, "ds_id")]
    gathered = contextlib.nullcontext()
    if zero3:
        import deepspeed

        gathered = deepspeed.zero.GatheredParameters(zero3, modifier_rank=None)
    with gathered:
        return [(n, _full_copy(p, dtype)) for n, p in bucket]


def _full_copy(p: nn.Parameter, dtype: torch.dtype | None) -> Tensor:
    """A detached copy of a parameter's values; a bitsandbytes 4-bit weight (QLoRA's frozen base) dequantized
    to the dtype it was loaded from (:func:`rl_core.qlora.full_weight`): what the layer computes with."""
    if qlora.is_4bit(p):
        full = qlora.full_weight(p)
        return full.to(dtype) if dtype is not None else full
    return p.detach().clone().to(dtype or p.dtype)


def _coalescible(cfg: StrategyConfig, world_size: int, engine) -> bool:
    """ZeRO-2 alone (one rank, no ring group): reduce each step's gradients once instead of per micro-batch."""
    params_dtype = "bf16" if cfg.bf16 else "fp32"
    return (
        world_size == 1
        and cfg.zero_stage == 2
        and not cfg.adam_offload
        and not cfg.overlap_comm
        and cfg.grad_accum_dtype in (None, params_dtype)
        and hasattr(engine, "coalesce_grad_reduction")
        and hasattr(engine.optimizer, "_coalesce_grad_reduction")
    )


class _OneRankCoalescing:
    """ZeRO-2 on one rank partitions nothing, yet DeepSpeed reduces every micro-batch's gradients into its
    partition buffer (flatten, reduce over nobody, copy back: one pass over every gradient per micro-batch,
    7% of the policy's train step on CPU against stage 0). DeepSpeed's own ``coalesce_grad_reduction`` holds
    the gradients on the parameters across a step's micro-batches (autograd accumulates them, in the
    parameters' dtype as ZeRO-2's buffer does) and reduces once at the boundary: the same sums, one pass.

    The block spans a step's backwards: opened by the first, closed (the one reduction) just before the
    boundary's ``engine.step()``, which may not run inside it; off the boundary the micro-step DeepSpeed's
    ``step()`` would count is counted here, and a boundary the caller set by hand
    (:meth:`DeepSpeedStrategy.accumulation_boundary`) survives the block's exit."""

    def __init__(self, engine):
        self.engine = engine
        self.block = None

    def open(self) -> None:
        if self.block is None:
            self.block = self.engine.coalesce_grad_reduction()
            self.block.__enter__()

    def step(self) -> bool:
        e = self.engine
        if not e.is_gradient_accumulation_boundary():
            e.micro_steps += 1  # what engine.step() does off the boundary
            return False
        block, self.block = self.block, None
        if block is not None:
            manual = e._is_gradient_accumulation_boundary  # the exit restores the flag it saw on entry
            block.__exit__(None, None, None)
            e._is_gradient_accumulation_boundary = manual
        e.step()
        return True


def _skip_deepspeed_shm_comm() -> None:
    """On CPU DeepSpeed's comm backend JIT-builds a shared-memory all-reduce op (C++, torch's extension cache) in
    every new process and venv: tens of seconds the first time in each venv (a test run's subprocesses, Ray
    actors, ``rl demo`` on a fresh machine), and rebuilt whenever another venv built it last (the cache is keyed
    by Python and torch, not venv). gloo does the all-reduce without it; ``RL_DS_SHM_COMM=1`` keeps DeepSpeed's."""

    # (not `import deepspeed.comm.torch as m`: that reads the attribute `torch` of deepspeed.comm, the torch module)
    module: Any = importlib.import_module("deepspeed.comm.torch")  # a module: any attribute may be set
    module.build_shm_op = lambda: None


def _full_numel(p: nn.Parameter) -> int:
    if qlora.is_4bit(p):
        return qlora.full_numel(p)
    return p.ds_numel if hasattr(p, "ds_numel") else p.numel()
