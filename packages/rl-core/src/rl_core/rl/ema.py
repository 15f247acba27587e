"""EMA weights of the policy (OpenRLHF's ``--enable_ema`` / ``--ema_beta``): a shadow copy of the trained
parameters, ``ema = beta x ema + (1 - beta) x param`` after every optimizer step, exported instead of the policy.

As OpenRLHF's ``DeepspeedStrategy.moving_average``: only the parameters that train (``requires_grad``; with LoRA
the adapter, whose EMA the export merges), in the parameters' dtype (bf16 in a bf16 run; the update itself is
computed in fp32 and rounded once), starting from the initial weights, updated after each optimizer step (not
each micro-batch). The engines keep sampling from the trained policy, not from the EMA.

Where it lives: on the parameters' device, this rank's part only. ZeRO-0/1/2 ranks hold every parameter, so the
shadow is a full copy per rank (OpenRLHF's is a full copy in its eval engine too); under ZeRO-3 it is the
rank's partition of each parameter (``ds_tensor``), so the update needs no gather and costs ``1 / ranks`` of a
copy; :meth:`EmaWeights.full_state` gathers it for the export. :meth:`to` moves it off the accelerator while
DeepSpeed sleep has the policy's states off. Checkpoints keep each rank's shadow (``ema_rank{R}.safetensors``
beside the DeepSpeed state), so a resume continues the same average (same world size, as DeepSpeed's).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

EMA_FILE = "ema_rank{rank}.safetensors"


def _local(p: nn.Parameter) -> torch.Tensor:
    """This rank's part of ``p``: ZeRO-3's partition (``ds_tensor``, flat) or the whole tensor."""
    return p.ds_tensor if hasattr(p, "ds_tensor") else p.data


class EmaWeights:
    """The shadow of ``module``'s trainable parameters (this rank's part of each)."""

    def __init__(self, module: nn.Module, beta: float):
        if not 0 <= beta <= 1:
            raise ValueError(f"ema_beta (--ema_beta) must be in [0, 1], got {beta}")
        self.beta = beta
        self.params = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        with torch.no_grad():
            self.shadow = {n: _local(p).detach().clone() for n, p in self.params}

    @property
    def nbytes(self) -> int:
        """Bytes of the shadow on this rank (its memory cost)."""
        return sum(t.numel() * t.element_size() for t in self.shadow.values())

    @torch.no_grad()
    def update(self) -> None:
        """``ema = beta x ema + (1 - beta) x param`` for every trained parameter (after an optimizer step)."""
        for n, p in self.params:
            e, x = self.shadow[n], _local(p)
            if e.dtype == torch.float32:
                e.mul_(self.beta).add_(x.to(e.device), alpha=1 - self.beta)
            else:  # one rounding to bf16, not one per operation
                e.copy_(e.float().mul_(self.beta).add_(x.to(e.device).float(), alpha=1 - self.beta))

    def to(self, device) -> None:
        for n in self.shadow:
            self.shadow[n] = self.shadow[n].to(device)

    def full_state(self) -> Iterator[tuple[str, torch.Tensor]]:
        """``(name, full EMA tensor on CPU)`` per trained parameter. Collective under ZeRO-3 (every rank gathers
        each parameter's partitions; every rank must iterate to the end)."""
        for n, p in self.params:
            e = self.shadow[n]
            if not hasattr(p, "ds_tensor"):
                yield n, e.detach().cpu()
                continue
            group = getattr(p, "ds_process_group", None)
            parts = [torch.empty_like(e, device=p.ds_tensor.device) for _ in range(dist.get_world_size(group))]
            dist.all_gather(parts, e.to(p.ds_tensor.device), group=group)
            # ds_numel, ds_shape: what DeepSpeed ZeRO-3 adds to the parameters it partitions (p has ds_tensor)
            yield n, torch.cat(parts)[: p.ds_numel].view(p.ds_shape).cpu()  # type: ignore[attr-defined]

    def save(self, folder: str | Path, rank: int) -> Path:
        """This rank's shadow into ``folder`` (a checkpoint's role folder), on disk when it returns."""
        from safetensors.torch import save_file

        f = Path(folder) / EMA_FILE.format(rank=rank)
        save_file(self.state_dict(), str(f))
        with open(f, "rb") as fh:
            os.fsync(fh.fileno())
        return f

    def load(self, folder: str | Path, rank: int) -> None:
        from safetensors.torch import load_file

        f = Path(folder) / EMA_FILE.format(rank=rank)
        if not f.is_file():
            raise ValueError(
                f"--enable_ema: the checkpoint {folder} has no EMA weights ({f.name}): it was saved "
                f"without --enable_ema; resume without it, or start a new run"
            )
        self.load_state_dict(load_file(str(f)))

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {n: t.detach().cpu().contiguous() for n, t in self.shadow.items()}

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        missing = sorted(set(self.shadow) ^ set(state))
        if missing:
            raise ValueError(
                f"the checkpoint's EMA weights do not match the policy's trained parameters "
                f"({len(missing)} names differ, e.g. {missing[0]}); resume with the same model, "
                f"--lora_rank and --zero_stage, or without --load_checkpoint"
            )
        for n, t in state.items():
            if t.shape != self.shadow[n].shape:
                raise ValueError(
                    f"the checkpoint's EMA of {n} has shape {tuple(t.shape)}, this rank's part is "
                    f"{tuple(self.shadow[n].shape)}: resume on the same number of ranks"
                )
            self.shadow[n].copy_(t)
