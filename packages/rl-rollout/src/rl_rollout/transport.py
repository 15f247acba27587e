"""Collective weight transport: a broadcast from trainer rank 0 to every engine worker.

This module owns the wire protocol and both of its ends. The trainer holds a
:class:`CollectiveSender` (rank 0); each engine worker holds a
:class:`CollectiveReceiver` (ranks 1..N; a vLLM engine with TP t takes t ranks).
They meet in a process group of their own, built from a ``TCPStore`` served by
rank 0 (``ProcessGroupGloo`` on CPU, ``ProcessGroupNCCL`` on GPU): it never
touches ``torch.distributed``'s default group, which the trainer (DeepSpeed)
and vLLM's workers already use.

Wire, per bucket (:func:`rl_rollout.weights.iter_groups`, at most
``bucket_bytes``): a header ``int64[kind, meta_len, payload_len]``, the msgpack
metadata as ``uint8[meta_len]`` (version, bucket index, the tensors' name /
dtype / shape / offset, the sha256 of the payload), then the payload as one flat
``uint8`` tensor. An ``end`` frame carries the version and the totals (buckets,
bytes, tensors); last, every rank all-reduces a failure count, so the sender
fails too when a worker could not load.

Verification (``verify=True``): a receiver hashes each payload it received and
compares with the sender's sha256 before loading it (wire integrity; an error
names the bucket and the version). An engine may also pass ``check_loaded``,
which re-reads its weights after the load: the HF engine does (exact where the
model's dtype is the wire dtype); vLLM fuses and repacks weights on load, so
there only the received bytes are verified. A failed check leaves the engine
with old and new weights mixed and its ``policy_version`` unchanged: send again
(the group stays usable, the receiver drains the stream before it raises).

Each sync logs one line (bytes, seconds, GB/s) and returns :class:`SyncStats`.
Not here: CUDA IPC, the choice of transport by placement, several trainers.
"""

from __future__ import annotations

import dataclasses
import datetime
import hashlib
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import msgpack
import torch

from rl_rollout.weights import DEFAULT_BUCKET_BYTES, iter_groups, pack_tensors, unpack_tensors

logger = logging.getLogger(__name__)

BACKENDS = ("gloo", "nccl")
_BUCKET, _END = 1, 2
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
        if backend == "gloo":
            self._pg = torch.distributed.ProcessGroupGloo(store, rank, world_size, timeout)
        else:
            torch.cuda.set_device(self.device)
            self._pg = torch.distributed.ProcessGroupNCCL(store, rank, world_size, timeout)

    def broadcast_(self, tensor: torch.Tensor) -> torch.Tensor:
        self._pg.broadcast(tensor, 0).wait()
        return tensor

    def send_frame(self, kind: int, meta: bytes, payload_U8: torch.Tensor) -> None:
        header = torch.tensor([kind, len(meta), payload_U8.numel()], dtype=torch.int64, device=self.device)
        self.broadcast_(header)
        self.broadcast_(torch.frombuffer(bytearray(meta), dtype=torch.uint8).to(self.device))
        if payload_U8.numel():
            self.broadcast_(payload_U8)

    def recv_frame(self) -> tuple[int, bytes, torch.Tensor]:
        kind, meta_len, payload_len = self.broadcast_(torch.empty(3, dtype=torch.int64, device=self.device)).tolist()
        meta = self.broadcast_(torch.empty(meta_len, dtype=torch.uint8, device=self.device)).cpu().numpy().tobytes()
        payload_U8 = torch.empty(payload_len, dtype=torch.uint8, device=self.device)
        if payload_len:
            self.broadcast_(payload_U8)
        return kind, meta, payload_U8

    def count_failures(self, failed: bool) -> int:
        """All-reduce (sum) of one flag per rank: how many ranks failed."""
        flag = torch.tensor([int(failed)], dtype=torch.int64, device=self.device)
        self._pg.allreduce([flag]).wait()
        return int(flag.item())

    def close(self) -> None:
        shutdown = getattr(self._pg, "shutdown", None)
        if shutdown is not None:
            shutdown()
        self._pg = None


def payload_sha256(payload_U8: torch.Tensor) -> str:
    """sha256 of a flat ``uint8`` tensor's bytes (copied to the host first when on an accelerator)."""
    return hashlib.sha256(payload_U8.detach().cpu().contiguous().numpy()).hexdigest()


def _stats(version: int, nbytes: int, buckets: int, tensors: int, seconds: float) -> SyncStats:
    return SyncStats(version, nbytes, buckets, tensors, seconds, nbytes / max(seconds, 1e-12) / 1e9)


class CollectiveSender:
    """Trainer end (rank 0): ``send`` broadcasts weights to every engine worker of the group."""

    def __init__(
        self,
        master_addr: str,
        master_port: int,
        world_size: int,
        *,
        backend: str = "gloo",
        device: str | torch.device | None = None,
        timeout_s: float = 600.0,
    ) -> None:
        self.group = WeightGroup(
            master_addr, master_port, 0, world_size, backend=backend, device=device, timeout_s=timeout_s
        )

    def send(
        self,
        named_tensors: Iterable[tuple[str, torch.Tensor]],
        version: int,
        *,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        checksum: bool = True,
        corrupt_bucket_for_test: int | None = None,
    ) -> SyncStats:
        """Broadcast ``(hf_name, tensor)`` pairs as policy ``version``; blocks until every receiver is done.

        ``checksum=False`` sends no sha256 (receivers then cannot verify).
        ``corrupt_bucket_for_test``: flip one byte of that bucket after its checksum (tests of the check).
        Raises :class:`WeightSyncError` when a receiver reported failure.
        """
        t0 = time.perf_counter()
        nbytes = n_buckets = n_tensors = 0
        for index, group in enumerate(iter_groups(named_tensors, bucket_bytes)):
            meta, payload_U8 = pack_tensors(group, self.group.device)
            sha = payload_sha256(payload_U8) if checksum else None
            if corrupt_bucket_for_test == index and payload_U8.numel():
                payload_U8[payload_U8.numel() // 2] ^= 0xFF
            info = {"version": version, "index": index, "tensors": meta, "sha256": sha}
            self.group.send_frame(_BUCKET, msgpack.packb(info), payload_U8)
            nbytes += payload_U8.numel()
            n_buckets += 1
            n_tensors += len(group)
        end = {"version": version, "buckets": n_buckets, "bytes": nbytes, "tensors": n_tensors}
        self.group.send_frame(_END, msgpack.packb(end), torch.empty(0, dtype=torch.uint8, device=self.group.device))
        failed = self.group.count_failures(False)
        stats = _stats(version, nbytes, n_buckets, n_tensors, time.perf_counter() - t0)
        logger.info(
            "weight sync v%d sent: %d tensors in %d buckets, %.1f MB in %.3f s (%.3f GB/s, %s)",
            version, n_tensors, n_buckets, nbytes / 1e6, stats.seconds, stats.gb_per_s, self.group.backend,
        )
        if failed:
            raise WeightSyncError(
                f"{failed} of {self.group.world_size - 1} engine workers failed to load weights version {version} "
                "(their errors name the bucket); those engines hold mixed weights and their old version: send again"
            )
        return stats

    def close(self) -> None:
        self.group.close()


class CollectiveReceiver:
    """Engine-worker end (rank >= 1): ``receive`` takes one sync, handing each bucket to ``load``."""

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
        if rank == 0:
            raise ValueError("rank 0 is the trainer (CollectiveSender); engine workers take ranks 1..world_size-1")
        self.group = WeightGroup(
            master_addr, master_port, rank, world_size, backend=backend, device=device, timeout_s=timeout_s
        )

    def receive(
        self,
        load: Callable[[NamedTensors], None],
        *,
        verify: bool = True,
        check_loaded: Callable[[NamedTensors], str | None] | None = None,
    ) -> SyncStats:
        """Receive buckets until the end frame; ``load(named_tensors)`` per bucket (views into the payload).

        ``check_loaded(named_tensors)`` (with ``verify``) returns the sha256 of the engine's weights
        for those names after the load, in the wire layout, or ``None`` where not comparable.
        Raises :class:`WeightSyncError` naming bucket and version on a mismatch; the rest of the
        stream is drained first so that the sender and the group stay in step.
        """
        t0 = time.perf_counter()
        failure: BaseException | None = None
        nbytes = n_buckets = n_tensors = 0
        while True:
            kind, meta, payload_U8 = self.group.recv_frame()
            info = msgpack.unpackb(meta)
            if kind == _END:
                break
            n_buckets += 1
            nbytes += payload_U8.numel()
            if failure is not None:
                continue  # drain: the sender broadcasts the whole stream regardless
            try:
                n_tensors += self._load_bucket(info, payload_U8, load, verify, check_loaded)
            except Exception as e:  # reported after the stream ends
                failure = e
        version = info["version"]
        if failure is None and (info["buckets"], info["bytes"]) != (n_buckets, nbytes):
            failure = WeightSyncError(
                f"weights version {version}: the sender sent {info['buckets']} buckets / {info['bytes']} bytes, "
                f"this worker received {n_buckets} / {nbytes}"
            )
        self.group.count_failures(failure is not None)
        if failure is not None:
            raise failure
        stats = _stats(version, nbytes, n_buckets, n_tensors, time.perf_counter() - t0)
        logger.info(
            "weight sync v%d received (rank %d): %d tensors in %d buckets, %.1f MB in %.3f s (%.3f GB/s)",
            version, self.group.rank, n_tensors, n_buckets, nbytes / 1e6, stats.seconds, stats.gb_per_s,
        )
        return stats

    @staticmethod
    def _load_bucket(info: dict, payload_U8: torch.Tensor, load, verify: bool, check_loaded) -> int:
        where = f"weight bucket {info['index']} of version {info['version']} ({payload_U8.numel()} bytes)"
        expected = info["sha256"]
        if verify and expected is not None:
            got = payload_sha256(payload_U8)
            if got != expected:
                raise WeightSyncError(
                    f"{where} arrived corrupted: sha256 {got[:16]}... != the sender's {expected[:16]}...; "
                    "nothing of it was loaded (earlier buckets were): send again"
                )
        named = unpack_tensors(info["tensors"], payload_U8)
        load(named)
        if verify and expected is not None and check_loaded is not None:
            loaded = check_loaded(named)
            if loaded is not None and loaded != expected:
                names = ", ".join(n for n, _ in named[:3]) + (", ..." if len(named) > 3 else "")
                raise WeightSyncError(
                    f"{where}: after the load the engine's weights ({names}) differ from the bytes sent "
                    f"(sha256 {loaded[:16]}... != {expected[:16]}...)"
                )
        return len(named)

    def close(self) -> None:
        self.group.close()
