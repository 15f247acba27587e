"""Collective weight transport: a broadcast from trainer rank 0 to every engine worker.

This module owns the wire protocol and both of its ends. The trainer holds a
:class:`CollectiveSender` (rank 0); each engine worker holds a
:class:`CollectiveReceiver` (ranks 1..N; a vLLM engine with TP t takes t ranks).
They meet in a process group of their own, built from a ``TCPStore`` served by
rank 0 (``ProcessGroupGloo`` on CPU, ``ProcessGroupNCCL`` on GPU): it never
touches ``torch.distributed``'s default group, which the trainer (DeepSpeed)
and vLLM's workers already use.

Wire, per bucket (:func:`rl_rollout.weights.iter_groups`, at most
``bucket_bytes``): a header ``int64[kind, meta_len, payload_len]`` (checked before
anything is allocated from it: ``meta_len`` at most ``MAX_META_BYTES``, ``payload_len``
equal to the metadata's tensor sizes), the msgpack
metadata as ``uint8[meta_len]`` (version, bucket index, the tensors' name /
dtype / shape / offset, the sha256 of their bytes in order), then one broadcast
per tensor of its bytes. Nothing is packed: the sender broadcasts its tensors'
own memory, and a receiver given ``targets`` (an engine's parameters, same name,
dtype and shape, on the group's device) receives straight into them; the other
tensors land at their offsets in a reused buffer and go to ``load``. So a sync
costs the collective's own time plus at most the engine's one copy. An ``end``
frame carries the version and the totals (buckets, bytes, tensors); last, every
rank all-reduces a failure count, so the sender fails too when a worker could not
load. The sender keeps bucket k's broadcasts in flight while it prepares (and
hashes) bucket k+1.

Verification (``verify=True``): a receiver hashes each payload it received and
compares with the sender's sha256 before loading it (wire integrity; an error
names the bucket and the version). An engine may also pass ``check_loaded``,
which re-reads its weights after the load: the HF engine does (exact where the
model's dtype is the wire dtype); vLLM fuses and repacks weights on load, so
there only the received bytes are verified. A failed check leaves the engine
with old and new weights mixed (with ``targets``, including the bad bucket's bytes)
and its ``policy_version`` unchanged: send again (the group stays usable, the
receiver drains the stream before it raises).

Each sync logs one line (bytes, seconds, GB/s) and returns :class:`SyncStats`.
Not here: CUDA IPC, the choice of transport by placement, several trainers.
"""

from __future__ import annotations

import dataclasses
import datetime
import hashlib
import logging
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol, cast

import msgpack
import torch

from rl_rollout.weights import DEFAULT_BUCKET_BYTES, _dtype_from_name, iter_groups

logger = logging.getLogger(__name__)

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
        in_flight: list[list] = []  # bucket k's broadcasts run while bucket k+1 is prepared and hashed
        for index, group in enumerate(iter_groups(named_tensors, bucket_bytes)):
            chunks = [_flat_bytes(t, self.group.device) for _, t in group]  # views, copies only across devices
            metas, offset = [], 0
            for (name, t), chunk in zip(group, chunks, strict=True):
                metas.append([name, str(t.dtype).removeprefix("torch."), list(t.shape), offset, chunk.numel()])
                offset += chunk.numel()
            sha = payload_sha256(*chunks) if checksum else None
            if corrupt_bucket_for_test == index and offset:
                k = max(range(len(chunks)), key=lambda i: chunks[i].numel())
                chunks[k] = chunks[k].clone()  # never the trainer's own weights
                chunks[k][chunks[k].numel() // 2] ^= 0xFF
            info = {"version": version, "index": index, "tensors": metas, "sha256": sha}
            in_flight.append(self.group.send_frame(_BUCKET, msgpack.packb(info), chunks))
            while len(in_flight) > 1:
                for work, _ in in_flight.pop(0):
                    work.wait()
            nbytes += offset
            n_buckets += 1
            n_tensors += len(group)
        for frame in in_flight:
            for work, _ in frame:
                work.wait()
        end = {"version": version, "buckets": n_buckets, "bytes": nbytes, "tensors": n_tensors}
        for work, _ in self.group.send_frame(_END, msgpack.packb(end)):
            work.wait()
        failed = self.group.count_failures(False)
        stats = _stats(version, nbytes, n_buckets, n_tensors, time.perf_counter() - t0)
        logger.info(
            "weight sync v%d sent: %d tensors in %d buckets, %.1f MB in %.3f s (%.3f GB/s, %s)",
            version,
            n_tensors,
            n_buckets,
            nbytes / 1e6,
            stats.seconds,
            stats.gb_per_s,
            self.group.backend,
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
        targets: Mapping[str, torch.Tensor] | None = None,
        reuse_buffer: bool = True,
    ) -> SyncStats:
        """Receive buckets until the end frame; ``load(named_tensors)`` per bucket.

        ``targets``: tensors that take their bytes in place (an engine's parameters by name);
        a tensor of the same name, dtype and shape, contiguous and on the group's device is
        received straight into its target and not passed to ``load``. The others are views
        into a buffer that the next bucket reuses, valid only during the ``load`` call; a loader
        that keeps references (vLLM's layerwise reload holds a layer's tensors until the layer is
        complete) passes ``reuse_buffer=False`` and gets a fresh buffer per bucket.
        ``check_loaded(named_tensors)`` (with ``verify``) returns the sha256 of the engine's weights
        for those names after the load, in the wire layout, or ``None`` where not comparable.
        Raises :class:`WeightSyncError` naming bucket and version on a mismatch; the rest of the
        stream is drained first so that the sender and the group stay in step.
        """
        t0 = time.perf_counter()
        failure: BaseException | None = None
        nbytes = n_buckets = n_tensors = 0
        while True:
            kind, meta, payload_len = self.group.recv_header()
            info = msgpack.unpackb(meta)
            if kind == _END:
                break
            n_buckets += 1
            nbytes += payload_len
            try:
                n_tensors += self._receive_bucket(
                    info,
                    payload_len,
                    load,
                    verify,
                    check_loaded,
                    targets if failure is None else None,
                    drain=failure is not None,
                    reuse_buffer=reuse_buffer,
                )
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
            version,
            self.group.rank,
            n_tensors,
            n_buckets,
            nbytes / 1e6,
            stats.seconds,
            stats.gb_per_s,
        )
        return stats

    def _receive_bucket(
        self, info: dict, payload_len: int, load, verify: bool, check_loaded, targets, drain: bool, reuse_buffer: bool
    ) -> int:
        """Receive one bucket's tensors (all of them, even when it fails: the stream must stay in step)."""
        declared = sum(t[4] for t in info["tensors"])
        if declared != payload_len:  # checked before the buffer is sized from payload_len
            raise WeightSyncError(
                f"weight bucket {info['index']}: the header says {payload_len} payload bytes, its "
                f"metadata's tensors {declared}; the stream is out of step"
            )
        if reuse_buffer:
            buf = self.group.buffer(payload_len)
        else:
            buf = torch.empty(payload_len, dtype=torch.uint8, device=self.group.device)
        named, chunks, to_load = [], [], []
        for name, dtype, shape, offset, nbytes in info["tensors"]:
            if offset + nbytes > payload_len:
                raise WeightSyncError(
                    f"weight bucket metadata for {name!r} points past the payload "
                    f"({offset}+{nbytes} > {payload_len} bytes)"
                )
            target = None if targets is None else targets.get(name)
            if (
                target is not None
                and str(target.dtype).removeprefix("torch.") == dtype
                and list(target.shape) == shape
                and target.is_contiguous()
                and target.device == self.group.device
            ):
                chunk = target.detach().reshape(-1).view(torch.uint8)
                view = target
            else:
                chunk = buf[offset : offset + nbytes]
                view = chunk.view(_dtype_from_name(dtype)).reshape(shape)
                to_load.append((name, view))
            chunks.append(chunk)
            named.append((name, view))
        pg = self.group._live_pg()
        for work in [pg.broadcast(c, 0) for c in chunks if c.numel()]:
            work.wait()
        if drain:
            return 0
        where = f"weight bucket {info['index']} of version {info['version']} ({payload_len} bytes)"
        expected = info["sha256"]
        if verify and expected is not None:
            got = payload_sha256(*chunks)
            if got != expected:
                raise WeightSyncError(
                    f"{where} arrived corrupted: sha256 {got[:16]}... != the sender's {expected[:16]}...; "
                    f"{len(named) - len(to_load)} of its {len(named)} tensors were received in place (earlier "
                    "buckets were loaded): send again"
                )
        if to_load:
            load(to_load)
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
