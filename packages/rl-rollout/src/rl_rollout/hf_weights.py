"""``HFEngine``'s weight loading: in-process tensors, CUDA IPC, the collective broadcast, and the checks.

A mixin of :class:`rl_rollout.hf_engine.HFEngine` (it uses the engine's ``model``, ``_lock``, ``device``
and ``_check_awake``). Every path copies into the model's parameters in place under the engine's lock and
sets ``policy_version``:

- ``update_weights(named_tensors, version)``: ``(hf_name, tensor)`` pairs from this process;
- ``update_weights_ipc(sync, version)``: a trainer on the same GPU shares its memory (:mod:`rl_rollout.ipc`);
- ``init_weight_group`` + ``receive_weights``: the trainer's broadcast (:mod:`rl_rollout.transport`), received
  straight into the parameters and re-read after the load (``_loaded_sha256``) where the dtypes match.

``verify_weights(expected)`` checks the model holds what was sent (:func:`rl_rollout.weights.weight_stats`).
"""

from __future__ import annotations

import contextlib
import hashlib
import threading
import time
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING

import torch

from rl_rollout.ipc import IpcReceiver, IpcSync, open_bucket
from rl_rollout.transport import CollectiveReceiver, WeightSyncError
from rl_rollout.weights import DEFAULT_STATS_RTOL, compare_weight_stats, tensor_stats

if TYPE_CHECKING:
    from rl_rollout.hf_engine import _CausalLM


class HFWeightsMixin:
    """Weight loading and checks for :class:`~rl_rollout.hf_engine.HFEngine`."""

    # The engine's state this mixin uses, set by HFEngine.__init__ (annotations only: no class attributes).
    device: torch.device
    policy_version: int
    _lock: threading.Lock
    _updates_waiting: int
    _receiver: CollectiveReceiver | None

    if TYPE_CHECKING:  # the engine's members this mixin uses (defined by HFEngine)

        @property
        def model(self) -> _CausalLM: ...

        def _check_awake(self) -> None: ...

    @torch.no_grad()
    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Copy ``(hf_name, tensor)`` pairs into the model in place; a subset is fine."""
        with self._waiting_update(), self._lock:
            self._copy_weights(named_tensors)
            self.policy_version = version

    @contextlib.contextmanager
    def _waiting_update(self) -> Iterator[None]:
        """Count an update waiting for the lock: a partial rollout's next chunk waits for it (a lock is not fair, so
        a loop of chunks could otherwise starve it). Every weight path counts, the Ray engine actors' broadcast
        and IPC loads included (they arrive on another thread of the actor while a partial rollout samples)."""
        self._updates_waiting += 1
        try:
            yield
        finally:
            self._updates_waiting -= 1

    @torch.no_grad()
    def update_weights_ipc(self, sync, version: int, *, verify: bool = True) -> int:
        """Load weights a trainer on this GPU shares over CUDA IPC (no copy through the host);
        returns the number of tensors loaded.

        ``sync`` is an :class:`~rl_rollout.ipc.IpcSync` from an :class:`~rl_rollout.ipc.IpcSender`
        (handles opened once, reused on later syncs) or a list of one-shot
        :class:`~rl_rollout.ipc.IpcBucket` objects from :func:`~rl_rollout.ipc.share_buckets`. The
        trainer must not touch the shared memory until this returns.
        """
        n = 0
        groups: Iterable[list[tuple[str, torch.Tensor]]]
        with self._waiting_update(), self._lock:
            if isinstance(sync, IpcSync):
                if getattr(self, "_ipc", None) is None:
                    self._ipc = IpcReceiver()
                groups = self._ipc.load(sync, verify=verify)
            else:
                groups = (open_bucket(bucket, verify=verify) for bucket in sync)
            for named in groups:
                self._copy_weights(named)
                n += len(named)
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            self.policy_version = version
        return n

    def init_weight_group(
        self,
        master_addr: str,
        master_port: int,
        world_size: int,
        *,
        rank: int | None = None,
        rank_offset: int | None = None,
        backend: str = "gloo",
        timeout_s: float = 600.0,
    ) -> None:
        """Join the trainer's weight broadcast group as ``rank`` (blocks until every rank joined).

        ``rank_offset`` is the same number under VLLMEngine's name (an HF engine has one worker),
        so a trainer can set up any engine with one call; default rank 1.
        """
        if rank is not None and rank_offset is not None and rank != rank_offset:
            raise ValueError(f"init_weight_group: rank={rank} and rank_offset={rank_offset} disagree; give one")
        rank = rank if rank is not None else (rank_offset if rank_offset is not None else 1)

        device = self.device if backend == "nccl" else "cpu"
        self._receiver = CollectiveReceiver(
            master_addr, master_port, rank, world_size, backend=backend, device=device, timeout_s=timeout_s
        )

    receive_in_place = True  # broadcast bytes land straight in matching parameters (no copy through a buffer)

    @torch.no_grad()
    def receive_weights(self, *, verify: bool = True):
        """Take one broadcast sync (blocks until the sender's end frame); returns its ``SyncStats``.

        Generation waits meanwhile. ``policy_version`` becomes the version sent; on a failed check
        (:class:`~rl_rollout.transport.WeightSyncError`) it stays and the weights are mixed.
        """
        receiver = self._receiver
        if receiver is None:
            raise RuntimeError("receive_weights needs a weight group: call init_weight_group(...) first")
        with self._waiting_update(), self._lock:
            self._check_awake()
            stats = receiver.receive(
                self._copy_weights,
                verify=verify,
                check_loaded=self._loaded_sha256,
                targets=self.model.state_dict() if self.receive_in_place else None,
            )
            self.policy_version = stats.version
        return stats

    @property
    def dtype(self) -> torch.dtype:
        """The dtype the engine holds its weights in."""
        return next(self.model.parameters()).dtype

    @torch.no_grad()
    def verify_weights(self, expected, *, rtol: float | None = None) -> dict:
        """Check that the model holds ``expected`` (:func:`rl_rollout.weights.weight_stats` of what was sent):
        each name's element count, sum and sum of squares; a tied head is the embedding's tensor itself.
        Raises :class:`~rl_rollout.transport.WeightSyncError` naming every tensor that differs or is missing;
        returns ``{"tensors": n checked, "seconds": s}`` (the same contract as ``VLLMEngine.verify_weights``)."""

        t0 = time.perf_counter()
        state = self.model.state_dict()
        actual = {n: tensor_stats(state[n]) for n in expected if n in state}
        problems = compare_weight_stats(expected, actual, rtol=DEFAULT_STATS_RTOL if rtol is None else rtol)
        if problems:
            raise WeightSyncError(
                f"the engine does not hold the weights sent: {len(problems)} of {len(expected)} "
                "tensors differ or are missing:\n  " + "\n  ".join(problems)
            )
        return {"tensors": len(expected), "seconds": time.perf_counter() - t0}

    def _copy_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        state = self.model.state_dict()
        for name, tensor in named_tensors:
            if name not in state:
                known = ", ".join(list(state)[:4])
                raise KeyError(
                    f"update_weights: {name!r} is not a parameter of this model "
                    f"(names look like {known}, ...); send Hugging Face parameter names"
                )
            if state[name].shape != tensor.shape:
                raise ValueError(
                    f"update_weights: {name!r} has shape {tuple(tensor.shape)}, "
                    f"the model expects {tuple(state[name].shape)}"
                )
            state[name].copy_(tensor)

    def _loaded_sha256(self, named_tensors: list[tuple[str, torch.Tensor]]) -> str | None:
        """sha256 of the model's tensors of those names, in wire layout; None if a dtype differs (no exact check)."""
        state = self.model.state_dict()
        h = hashlib.sha256()
        for name, wire in named_tensors:
            loaded = state[name]
            if loaded.dtype != wire.dtype:
                return None
            h.update(loaded.detach().contiguous().reshape(-1).view(torch.uint8).cpu().numpy())
        return h.hexdigest()
