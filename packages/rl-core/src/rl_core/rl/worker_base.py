"""What every RL role's rank shares (:class:`_Worker`): its DeepSpeed strategy and distributed init, the
micro-batches of a call (sequence counts or token budgets, the same count on every rank), the no-grad forwards
over them, the global batches and loss normalisers of a training call, ring-attention leaders, and DeepSpeed
checkpoints. The roles are :mod:`rl_core.rl.workers` (policy, critic) and :mod:`rl_core.rl.frozen_workers`
(reference, reward model)."""

from __future__ import annotations

import logging
import os
from typing import Any

import torch

from rl_core.checkpoint import load_engine_state, save_engine_state
from rl_core.rl.batching import MicroBatchConfig, ModelInputs, equalise, memory_budget, plan_micro_batches
from rl_core.rl.experience import Experience, rows
from rl_core.strategy import DeepSpeedStrategy

logger = logging.getLogger(__name__)


def read_once(sums: dict, device: torch.device) -> dict[str, float]:
    """A step's metrics, accumulated as device tensors (or floats) so that no micro-batch waits on the device,
    read to floats in one transfer."""
    keys = list(sums)
    flat = torch.stack([torch.as_tensor(sums[k], device=device).detach().double().reshape(()) for k in keys])
    return dict(zip(keys, flat.tolist(), strict=True))


class _Worker:
    """Strategy, distributed init and micro-batched no-grad forwards shared by every role."""

    engine: Any  # the role's DeepSpeed engine (Strategy.prepare), which each role's __init__ sets

    def __init__(
        self, strategy_cfg, *, pad_id: int = 0, batching: MicroBatchConfig | None = None, packing: bool = False
    ):

        self.s = DeepSpeedStrategy(strategy_cfg)
        self.s.setup_distributed()
        self.pad_id = pad_id
        self.batching = batching or MicroBatchConfig()
        self.packing = packing
        self.micro_batch = self.batching.forward_micro_batch_size or strategy_cfg.micro_train_batch_size
        self._budgets: dict[bool, int] = {}  # the last auto token budgets, train and forward (logged on change)
        self.images = False  # a vision-language policy/reference: forwards take the items' image_inputs

    @property
    def rank(self) -> int:
        return self.s.rank

    def release_device_cache(self) -> dict[str, float]:
        """Before engines on this GPU wake: hand the blocks torch's caching allocator keeps (a train step's freed
        activations) back to the device, where the engines map their memory (OpenRLHF empties the cache there
        too). ``{"freed_bytes"}`` on CUDA, ``{}`` elsewhere."""
        if self.s.device.type != "cuda":
            return {}
        before = torch.cuda.memory_reserved(self.s.device)
        torch.cuda.empty_cache()
        return {"freed_bytes": float(before - torch.cuda.memory_reserved(self.s.device))}

    def world(self) -> dict:
        """This rank's place: rank, world size, device (for the controller's log and checks)."""
        # lazy: import cycle (rl_core -> rl_core.rl.build -> rl_core.rl.frozen_workers -> rl_core.rl.worker_base -> rl_core)
        from rl_core import ring_attention

        ring = ring_attention.current()
        return {
            "rank": self.s.rank,
            "world_size": self.s.world_size,
            "device": str(self.s.device),
            "pid": os.getpid(),
            "ring_attn": ring and f"{ring.rank} of {ring.size} in ranks {ring.first}-{ring.first + ring.size - 1}",
        }

    def _micro_batches(self, items: list[Experience], *, train: bool) -> list[list[int]]:
        """Indices of ``items`` per micro-batch; with a token budget, as many on every rank (collective)."""
        lengths = [it.T for it in items]
        if train:
            budget, micro = self.batching.max_tokens_per_gpu, self.s.cfg.micro_train_batch_size
        else:
            (budget, _), micro = self.batching.forward_budget(), self.micro_batch
        if budget == "auto":  # a worker built without build_run: what rl_core.rl.auto would choose here
            budget = "memory" if self.s.device.type == "cuda" and self.packing else None
        if budget == "memory":  # from free device memory now (rl_core.rl.auto chooses it on CUDA)
            budget = self._memory_budget(train)
        if isinstance(budget, str):  # not reached: MicroBatchConfig leaves no other text than auto and memory
            raise ValueError(f"max_tokens_per_gpu {budget!r}: not a number of tokens, auto, memory or none")
        if budget is not None:  # per rank: with ring attention a rank holds 1/ring of each row (as OpenRLHF counts)
            budget *= self.s.cfg.ring_attn_size
        groups = plan_micro_batches(lengths, micro_batch=micro, max_tokens=budget, packing=self.packing)
        return groups if budget is None else equalise(groups, lengths, self.s, self.packing)

    def _memory_budget(self, train: bool) -> int | None:
        """The token budget from free memory (:func:`rl_core.rl.batching.memory_budget`); logged when it moves by a
        tenth.
        Without a CUDA device (a config resolved elsewhere) there is no memory to read: rows, with a warning."""
        if self.s.device.type != "cuda":
            if not getattr(self, "_warned_no_cuda", False):
                self._warned_no_cuda = True
                logger.warning(
                    "max_tokens_per_gpu memory on %s: no device memory to read, so micro-batches of "
                    "--micro_train_batch_size sequences",
                    self.s.device.type,
                )
            return None
        tokens, how = memory_budget(self.engine, self.s.device, train=train)
        last = self._budgets.get(train)
        if last is None or abs(tokens - last) > last // 10:
            if self.s.is_rank_0():
                logger.info("max_tokens_per_gpu from memory (%s): %s", "train" if train else "forward", how)
            self._budgets[train] = tokens
        return tokens

    def _model(self, fn, items: list[Experience]):
        """``fn(**model inputs)`` on one micro-batch; per-token results (a tensor or a tuple) as padded ``[B, T]``
        rows."""
        x = ModelInputs.of(items, self.pad_id, self.packing, self.s.device, images=self.images)
        return x.rows(fn(**x.kwargs))

    @torch.no_grad()
    def _forward_items(self, fn, items: list[Experience]) -> list:
        out: list = [None] * len(items)
        for idx in self._micro_batches(items, train=False):
            chunk = [items[i] for i in idx]
            res = self._model(fn, chunk)
            for i, r in zip(
                idx, rows(res, chunk) if res.dim() == 2 else [r.item() for r in res.float().cpu()], strict=True
            ):
                out[i] = r
        return out

    def _global_batches(self, items: list[Experience], epochs: int, local: int | None = None):
        """Each epoch's local slices of the global batches (items come in :func:`dp_order`), ``local`` items each
        (default ``train_batch_size / dp``; more when episodes hold several calls: rl_core.trainers.ppo_per_call)."""
        local = local or self.s.cfg.train_batch_size // self.s.dp_size
        if len(items) % local:
            raise ValueError(
                f"rank {self.rank}: {len(items)} items are not whole local batches of {local} "
                f"(train_batch_size {self.s.cfg.train_batch_size} / {self.s.dp_size} data-parallel "
                f"ranks, or the local batch the loop passed)"
            )
        for _ in range(epochs):
            for g in range(0, len(items), local):
                yield items[g : g + local]

    def _leader(self, out: list) -> list:
        """``out`` on the first rank of a ring attention group, ``[]`` on the others: they computed the same
        (``call_sharded`` concatenates the ranks' lists; :func:`rl_core.rl.experience.ring_shards` sent each
        group's ranks the same shard)."""
        return out if self.s.ring_rank == 0 else []

    def _global_seqs(self) -> int:
        """Sequences of a global batch counted over every rank (the seq-mean losses' normaliser): a ring
        attention group's ranks each count their shared slice, as :func:`_global_tokens` does."""
        return self.s.cfg.train_batch_size * self.s.cfg.ring_attn_size

    def _global_tokens(self, items: list[Experience]) -> torch.Tensor:
        """Loss tokens of this global batch over every rank (the losses' normaliser; a ring attention group's
        ranks each count their shared slice: rl_core.ring_attention says why that is the right gradient)."""
        local = torch.full((), float(sum(sum(it.loss_mask_T) for it in items)), device=self.s.device)  # no copy
        return self.s.all_reduce(local, "sum").clamp(min=1)

    def barrier(self) -> None:
        self.s.barrier()

    def save_checkpoint(self, path: str) -> str:
        """Collective: this rank's part of the model, optimizer, scheduler and RNG into ``path`` (DeepSpeed
        state), on disk when every rank returns. The loop's :class:`~rl_core.rl.checkpoint.RLCheckpoints`
        commits it with the other roles' parts."""

        return str(save_engine_state(self.s, self.engine, path, self._client_state()))

    def load_checkpoint(self, path: str) -> None:
        """Collective: restore what :meth:`save_checkpoint` wrote into ``path`` (unpickles: trusted only)."""

        self._restore_client_state(load_engine_state(self.engine, path), path)

    def _client_state(self) -> dict:
        """What this rank's checkpoint keeps beside the DeepSpeed state (a role's own cursors)."""
        return {}

    def _restore_client_state(self, client: dict, path: str) -> None:
        pass
