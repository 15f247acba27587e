"""DeepSpeed sleep (``--deepspeed_enable_sleep``, OpenRLHF's ``--ds.enable_sleep``): a trained role's DeepSpeed
states off the accelerator while the engines generate, back before the experience forwards.

:func:`offload` calls DeepSpeed's ``engine.offload_states`` (every state its ZeRO optimizer holds: the fp32
master weights and their Adam moments, the bf16/fp32 model weights, the gradient buffers) to host memory, then
empties the accelerator's cache so a colocated vLLM engine can take the memory; :func:`reload` is
``engine.reload_states``. ZeRO stages 1, 2 and 3 (the stages with a ZeRO optimizer); ZeRO-0 and
``--adam_offload`` are refused by :func:`check_ds_sleep`, at config time. Under ZeRO-3, DeepSpeed 0.19 moves the
master weights and Adam moments only for its own FusedAdam (it asserts the class), so with our torch AdamW
DeepSpeed moves the weights and gradient buffers and :func:`_zero3_master` the master weights and moments.

``optimizer_only`` (asynchronous training, where the policy's forwards and the engines' sampling overlap the
wait): the model weights stay, everything else moves (fp32 master weights, Adam moments, gradient buffers), as
OpenRLHF's ``offload_deepspeed_states`` does in every mode (its ``lp_params`` line is commented out) between its
train steps. The loop then sleeps from the iteration's start to its train step (:mod:`rl_core.trainers.ppo`).

Pinned host buffers (faster copies back) are used on CUDA only: pinning needs it. On the CPU accelerator the
"device" is host memory, so the calls run (the same code path, the states are re-pointed in place) but move
nothing and free nothing: ``ds_sleep_gb`` still counts what the offload covers, ``ds_sleep_freed_gb`` is CUDA-only.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import torch

from rl_core.rl.groups import concurrently

if TYPE_CHECKING:
    from rl_core.strategy import DeepSpeedStrategy


def check_ds_sleep(enabled: bool, strategy_cfg) -> None:
    """The one-line refusals of ``--deepspeed_enable_sleep`` the strategy (a StrategyConfig) decides (ValueError)."""
    if not enabled:
        return
    zero_stage, adam_offload = strategy_cfg.zero_stage, strategy_cfg.adam_offload
    if zero_stage not in (None, 1, 2, 3):  # None: auto, which picks 2 for it (rl_core.rl.auto)
        raise ValueError(
            f"--deepspeed_enable_sleep needs --zero_stage 1, 2 or 3 (DeepSpeed offloads the states "
            f"of a ZeRO optimizer), got --zero_stage {zero_stage}"
        )
    if adam_offload:
        raise ValueError(
            "--deepspeed_enable_sleep moves the optimizer states to the CPU between phases and "
            "--adam_offload keeps them there already: drop one of them"
        )
    if zero_stage == 1 and strategy_cfg.bf16 and strategy_cfg.grad_accum_dtype == "fp32":
        raise ValueError(
            "--deepspeed_enable_sleep with --zero_stage 1, bf16 and --grad_accum_dtype fp32: DeepSpeed "
            "trains that with its BF16 optimizer, which cannot offload its states; use --zero_stage 2 "
            "(or 3), or drop --grad_accum_dtype fp32"
        )


def _zero3_deepspeed_states(optimizer_only: bool):
    from deepspeed.runtime.zero.offload_config import OffloadStateTypeEnum as S

    return [S.lp_grads, S.contiguous_grad_buffer] + ([] if optimizer_only else [S.lp_params])


def _zero12_optimizer_states():
    """ZeRO-1/2 without the model weights: OpenRLHF's list (optimizer states, fp32 masters, gradient partitions)
    less ``contiguous_grad_buffer``, which DeepSpeed's stage 1/2 optimizer does not hold."""
    from deepspeed.runtime.zero.offload_config import OffloadStateTypeEnum as S

    return [S.optim_states, S.hp_params, S.lp_grads]


def _state_bytes(engine, optimizer_only: bool = False) -> int:
    """What one offload covers on this rank: the module's weights (this rank's partition under ZeRO-3; not with
    ``optimizer_only``), the fp32 master partitions and the inner optimizer's states (gradient buffers, small
    after a step, not counted)."""
    n = 0
    for p in [] if optimizer_only else engine.module.parameters():
        t = getattr(p, "ds_tensor", p)  # ZeRO-3: the partition this rank holds
        n += t.numel() * t.element_size()
    opt = engine.optimizer
    masters = getattr(opt, "fp32_partitioned_groups_flat", None) or opt.single_partition_of_fp32_groups
    n += sum(t.numel() * t.element_size() for t in masters)
    for state in opt.optimizer.state.values():  # keyed by the master partitions (ZeRO-3 detaches them between steps)
        n += sum(
            v.numel() * v.element_size()
            for k, v in state.items()
            if isinstance(v, torch.Tensor) and not k.endswith("_offload_buffer")
        )  # DeepSpeed's own copies
    return n


def _zero3_master(opt, device: str, pin: bool) -> None:
    """ZeRO-3: the inner optimizer's fp32 master partitions (``.data`` swapped, so the optimizer's references
    hold) and its states to ``device``, pinned on the host when ``pin``."""
    from deepspeed.runtime.zero.offload_states import offload_optimizer_states, reload_optimizer_states

    for buf in opt.fp32_partitioned_groups_flat:
        if device == "cpu":
            host = torch.empty(buf.shape, dtype=buf.dtype, device="cpu", pin_memory=pin)
            host.copy_(buf)
            buf.data = host
        else:
            buf.data = buf.data.to(device)
    if device == "cpu":
        offload_optimizer_states(opt.optimizer, "cpu", pin_memory=pin)
    else:
        reload_optimizer_states(opt.optimizer, device)


def offload(strategy, engine, optimizer_only: bool = False) -> dict[str, float]:
    """Move this rank's DeepSpeed states to host memory (with ``optimizer_only`` all but the model weights);
    ``{"seconds", "bytes"}``, and on CUDA ``"freed_bytes"``: the device memory torch gave back (its reserved
    memory before minus after)."""
    from deepspeed.runtime.zero.offload_config import OffloadDeviceEnum

    check_ds_sleep(True, strategy.cfg)
    dev = strategy.device
    t0 = time.perf_counter()
    before = torch.cuda.memory_reserved(dev) if dev.type == "cuda" else 0
    if strategy.cfg.zero_stage == 3 and any(not p.requires_grad for p in engine.module.parameters()):
        # frozen parameters (a frozen vision tower, LoRA's base): DeepSpeed's stage-3 offload of the weights maps
        # every parameter onto a buffer of the trained ones only and fails ("start + length exceeds dimension
        # size"); the weights stay on the device, as OpenRLHF always leaves them
        optimizer_only = True
    nbytes, pin = _state_bytes(engine, optimizer_only), dev.type == "cuda"
    if strategy.cfg.zero_stage == 3:  # DeepSpeed's stage 3 moves the master weights and Adam moments of its own
        # FusedAdam only (it asserts the class); ours is torch's AdamW, whose states move here the same way
        engine.offload_states(
            include=_zero3_deepspeed_states(optimizer_only), device=OffloadDeviceEnum.cpu, pin_memory=pin
        )
        _zero3_master(engine.optimizer, "cpu", pin)
    else:
        engine.offload_states(
            include=_zero12_optimizer_states() if optimizer_only else None,
            device=OffloadDeviceEnum.cpu,
            pin_memory=pin,
            non_blocking=False,
        )
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
        torch.cuda.empty_cache()
    out = {"seconds": time.perf_counter() - t0, "bytes": float(nbytes)}
    if dev.type == "cuda":
        out["freed_bytes"] = float(before - torch.cuda.memory_reserved(dev))
    return out


def reload(strategy, engine) -> dict[str, float]:
    """Bring what :func:`offload` moved back onto the accelerator; ``{"seconds"}``."""
    t0 = time.perf_counter()
    engine.reload_states(non_blocking=False)
    if strategy.cfg.zero_stage == 3:
        _zero3_master(engine.optimizer, str(strategy.device), False)
    if strategy.device.type == "cuda":
        torch.cuda.synchronize(strategy.device)
    return {"seconds": time.perf_counter() - t0}


def call_roles(groups, method: str, parallel: bool, *args) -> dict[str, float]:
    """``method`` (``ds_offload`` / ``ds_reload``, with ``args``) on every rank of the trained roles' groups (at
    once when they live apart) -> the loop's metrics: the slowest rank's seconds (``ds_sleep_s`` / ``ds_wake_s``),
    and for an offload every rank's bytes (``ds_sleep_gb``; on CUDA ``ds_sleep_freed_gb``)."""

    calls = [lambda g=g: g.call(method, *args) for g in groups]
    ranks = [r for rs in (concurrently(*calls) if parallel else [f() for f in calls]) for r in rs]
    seconds = max(r["seconds"] for r in ranks)
    if method == "ds_reload":
        return {"ds_wake_s": seconds}
    out = {"ds_sleep_s": seconds, "ds_sleep_gb": sum(r["bytes"] for r in ranks) / 1e9}
    if all("freed_bytes" in r for r in ranks):  # CUDA: the memory torch gave back to the device
        out["ds_sleep_freed_gb"] = sum(r["freed_bytes"] for r in ranks) / 1e9
    return out


class DeepSpeedSleep:
    """The worker methods (a mixin of the trained roles' workers, whose ``s`` is the strategy and ``engine`` the
    DeepSpeed engine): called through the groups, so they run in-process and over Ray alike."""

    s: DeepSpeedStrategy  # the worker's
    engine: Any  # the worker's

    def ds_offload(self, optimizer_only: bool = False) -> dict[str, float]:
        return offload(self.s, self.engine, optimizer_only)

    def ds_reload(self) -> dict[str, float]:
        return reload(self.s, self.engine)
