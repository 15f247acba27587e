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
Not here: CUDA IPC, the choice of transport by placement, several trainers. The group both ends join, the frame
primitives, :class:`WeightSyncError` and :class:`SyncStats` are :mod:`rl_rollout.transport_group` (re-exported here).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Mapping

import msgpack
import torch

from rl_rollout.transport_group import (  # noqa: F401 - re-exported: the transport's names, imported from here
    _BUCKET,
    _END,
    _STORE_PREFIX,
    BACKENDS,
    MAX_META_BYTES,
    NamedTensors,
    SyncStats,
    WeightGroup,
    WeightSyncError,
    _flat_bytes,
    _stats,
    payload_sha256,
)
from rl_rollout.weights import DEFAULT_BUCKET_BYTES, _dtype_from_name, iter_groups

logger = logging.getLogger(__name__)


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
