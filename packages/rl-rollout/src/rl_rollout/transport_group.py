"""The weight group both ends of :mod:`rl_rollout.transport` meet in, and what they share.

:class:`WeightGroup`: a process group for weight broadcasts only (rank 0 serves the ``TCPStore``; gloo on CPU,
NCCL on GPU), with the frame primitives the sender and receiver speak (a checked ``int64`` header, msgpack
metadata, payload broadcasts) and the closing all-reduce of failures. Also the wire's constants
(:data:`BACKENDS`, :data:`MAX_META_BYTES`), :class:`WeightSyncError`, :class:`SyncStats` and
:func:`payload_sha256`. The wire protocol itself is described in :mod:`rl_rollout.transport`, which re-exports
every name here.
"""

from __future__ import annotations

import dataclasses
import datetime
import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, cast

import torch

BACKENDS = ("gloo", "nccl")
_BUCKET, _END = 1, 2
# A bucket's metadata is ~100 bytes per tensor (name, dtype, shape, offset, size) plus a sha256:
# 64 MiB is ~600k tensors in one bucket, far past any model, and bounds what a bad header can allocate.
MAX_META_BYTES = 64 << 20
_STORE_PREFIX = "rl_rollout.weights"

NamedTensors = list[tuple[str, torch.Tensor]]


class WeightSyncError(RuntimeError):
    """A weight sync failed: corrupted bytes, a failed load, or a worker that reported failure."""


@dataclass(frozen=True)
class SyncStats:
    """One weight sync as seen by one end: payload ``bytes`` (the tensors' sizes), wall ``seconds``."""

    version: int
    bytes: int
    buckets: int
    tensors: int
    seconds: float
    gb_per_s: float  # bytes / seconds / 1e9

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


class _Collectives(Protocol):
    """What :class:`WeightGroup` calls on its c10d backend. ProcessGroupGloo and ProcessGroupNCCL have these
    methods (their pybind bindings, inherited from ``Backend``), but torch's stubs leave them out, so the
    backends are cast to this."""

    def broadcast(self, tensor: torch.Tensor, root: int) -> torch.distributed.Work: ...

    def allreduce(self, tensors: list[torch.Tensor]) -> torch.distributed.Work: ...


class WeightGroup:
    """A process group for weight broadcasts only: rank 0 serves the ``TCPStore``; root is always 0.

    Construction blocks until all ``world_size`` ranks joined (or ``timeout_s``).
    """

    def __init__(
        self,
        master_addr: str,
        master_port: int,
        rank: int,
        world_size: int,
        *,
        backend: str = "gloo",
        device: str | torch.device | None = None,
        timeout_s: float = 600.0,
    ) -> None:
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
        if world_size < 2 or not 0 <= rank < world_size:
            raise ValueError(
                f"need world_size >= 2 (trainer + at least one engine worker) and 0 <= rank < world_size, "
                f"got rank={rank}, world_size={world_size}"
            )
        if device is None:
            device = "cpu" if backend == "gloo" else f"cuda:{torch.cuda.current_device()}"
        self.device = torch.device(device)
        if (backend == "gloo") != (self.device.type == "cpu"):
            raise ValueError(f"backend {backend!r} does not move tensors on {self.device}: gloo takes cpu, nccl cuda")
        self.rank, self.world_size, self.backend = rank, world_size, backend
        timeout = datetime.timedelta(seconds=timeout_s)
        self._store = torch.distributed.TCPStore(
            master_addr, master_port, world_size, is_master=rank == 0, timeout=timeout, wait_for_workers=False
        )
        store = torch.distributed.PrefixStore(_STORE_PREFIX, self._store)
        self._pg: _Collectives | None  # None once closed
        if backend == "gloo":
            self._pg = cast(_Collectives, torch.distributed.ProcessGroupGloo(store, rank, world_size, timeout))
        else:
            torch.cuda.set_device(self.device)
            # torch's stub lists only the binding's (store, rank, size, options) form; it takes a timeout as well
            nccl = torch.distributed.ProcessGroupNCCL(store, rank, world_size, timeout)  # type: ignore[arg-type]
            self._pg = cast(_Collectives, nccl)

    def _live_pg(self) -> _Collectives:
        if self._pg is None:
            raise RuntimeError("this WeightGroup was closed; build a new one (init_weight_group)")
        return self._pg

    def broadcast_(self, tensor: torch.Tensor) -> torch.Tensor:
        self._live_pg().broadcast(tensor, 0).wait()
        return tensor

    def send_frame(self, kind: int, meta: bytes, chunks: Sequence[torch.Tensor] = ()) -> list:
        """Broadcast a frame: header, metadata, then each chunk (flat ``uint8``). Returns the
        in-flight ``(work, tensor)`` pairs; the tensors must stay unchanged until each is waited on."""
        if len(meta) > MAX_META_BYTES:
            raise WeightSyncError(
                f"weight-sync metadata of {len(meta)} bytes exceeds MAX_META_BYTES={MAX_META_BYTES} "
                "(too many tensors in one bucket); lower bucket_bytes"
            )
        payload_len = sum(c.numel() for c in chunks)
        header = torch.tensor([kind, len(meta), payload_len], dtype=torch.int64, device=self.device)
        tensors = [header, torch.frombuffer(bytearray(meta), dtype=torch.uint8).to(self.device), *chunks]
        pg = self._live_pg()
        return [(pg.broadcast(t, 0), t) for t in tensors if t.numel()]

    def recv_header(self) -> tuple[int, bytes, int]:
        """A frame's kind, metadata and payload length; the payload's broadcasts follow.

        The header is checked before anything is allocated from it: a kind this protocol does not
        have, a negative length or metadata over ``MAX_META_BYTES`` means the stream is out of step
        (or not ours), and raises :class:`WeightSyncError` instead of allocating what it says.
        """
        kind, meta_len, payload_len = self.broadcast_(torch.empty(3, dtype=torch.int64, device=self.device)).tolist()
        if kind not in (_BUCKET, _END) or not 0 <= meta_len <= MAX_META_BYTES or payload_len < 0:
            raise WeightSyncError(
                f"weight-sync frame header [kind={kind}, meta_len={meta_len}, payload_len={payload_len}] is not "
                f"valid (kinds {_BUCKET}/{_END}, 0 <= meta_len <= MAX_META_BYTES={MAX_META_BYTES}, payload_len >= "
                "0): the stream is out of step or another program joined the group; rebuild the weight group"
            )
        meta = self.broadcast_(torch.empty(meta_len, dtype=torch.uint8, device=self.device)).cpu().numpy().tobytes()
        return kind, meta, payload_len

    def buffer(self, nbytes: int) -> torch.Tensor:
        """A ``uint8[nbytes]`` view of a receive buffer reused by every frame (warm memory: no page faults)."""
        buf = getattr(self, "_recv_buf", None)
        if buf is None or buf.numel() < nbytes:
            buf = self._recv_buf = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        return buf[:nbytes]

    def count_failures(self, failed: bool) -> int:
        """All-reduce (sum) of one flag per rank: how many ranks failed."""
        flag = torch.tensor([int(failed)], dtype=torch.int64, device=self.device)
        self._live_pg().allreduce([flag]).wait()
        return int(flag.item())

    def close(self) -> None:
        shutdown = getattr(self._pg, "shutdown", None)
        if shutdown is not None:
            shutdown()
        self._pg = None


def payload_sha256(*chunks_U8: torch.Tensor) -> str:
    """sha256 of flat ``uint8`` tensors' bytes in order (copied to the host first when on an accelerator)."""
    h = hashlib.sha256()
    for chunk in chunks_U8:
        # numpy's stubs give ndarray its __buffer__ on Python >= 3.12 only; it is a buffer on every version
        h.update(chunk.detach().cpu().contiguous().numpy())  # type: ignore[arg-type]
    return h.hexdigest()


def _flat_bytes(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8).to(device)


def _stats(version: int, nbytes: int, buckets: int, tensors: int, seconds: float) -> SyncStats:
    return SyncStats(version, nbytes, buckets, tensors, seconds, nbytes / max(seconds, 1e-12) / 1e9)
