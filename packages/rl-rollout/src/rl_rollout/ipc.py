"""CUDA IPC weight transport: an engine colocated on the trainer's GPU reads the weights in place.

When the trainer and the engine share a GPU but not a process (OpenRLHF's hybrid
engine), copying weights through the host or a collective is wasted work: the
trainer packs each bucket into one flat ``uint8`` CUDA tensor (:func:`rl_rollout.weights.pack_tensors`)
and hands out a CUDA IPC handle to it (``torch.multiprocessing``'s ``reduce_tensor``);
the engine process opens the handle (a view of the same device memory), copies the
tensors into its model, and closes it. Only the handle and the msgpack metadata
cross the process boundary: a few hundred bytes per bucket.

:func:`share_buckets` (trainer side) yields :class:`IpcBucket`s; each must stay alive
(the trainer holds it) until the engine has loaded it. :func:`open_bucket` (engine
side) gives ``(name, tensor)`` views. ``sha256`` (optional) is computed by the sender
over the payload and checked by the receiver before loading, so a stale or wrong
handle fails loudly instead of loading garbage.

The handle is a pickled ``(rebuild function, args)`` pair: open handles only from the
trainer you trust, exactly as vLLM's own IPC weight path does. Needs CUDA (a CPU
tensor has no IPC handle); on a CPU machine use the in-process or gloo transports.

Repeated syncs (every RL step) should not pay for new handles each time: opening one
costs milliseconds (``cudaIpcOpenMemHandle``), which dominated the one-shot path's time.
:class:`IpcSender` allocates its buckets once, shares their handles with the first
sync, and afterwards refills the same device memory and sends only keys;
:class:`IpcReceiver` keeps each opened bucket (and its tensor views) by key. With
``pack=False`` the sender shares the trainer's tensors themselves, and a sync is then
the engine's single device copy. A new layout (names, shapes, dtypes, or, in place,
addresses) starts a new generation with fresh handles; a receiver asked for a generation
it never opened (a restarted engine) fails with the fix (:meth:`IpcSender.reset`). What
crosses per repeated sync is an :class:`IpcSync` of a few hundred bytes, not a handle
and metadata per bucket (pickling a thousand of those cost more than the copy).
"""

from __future__ import annotations

import hashlib
import logging
import pickle
import uuid
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import msgpack
import torch

from rl_rollout.weights import DEFAULT_BUCKET_BYTES, iter_groups, pack_tensors, unpack_tensors

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class IpcBucket:
    """What crosses the process boundary for one bucket: metadata, the IPC handle, a checksum."""

    meta: bytes  # msgpack, see rl_rollout.weights
    handle: bytes  # pickled (rebuild_fn, args) from torch.multiprocessing.reductions.reduce_tensor
    nbytes: int
    sha256: str | None = None
    _payload: torch.Tensor | None = None  # the sender's tensor: keeps the memory alive while shared

    def __reduce__(self):  # pickling (e.g. through a queue or an RPC) drops the sender-side tensor
        return (IpcBucket, (self.meta, self.handle, self.nbytes, self.sha256, None))

    def _sender_payload(self) -> torch.Tensor:
        """The sender's tensor (sender side only: a bucket that was pickled across processes has none)."""
        if self._payload is None:
            raise ValueError("this IpcBucket came through pickling: its payload tensor stays with the sender")
        return self._payload


def _digest(payload_U8: torch.Tensor) -> str:
    return hashlib.sha256(payload_U8.cpu().numpy().tobytes()).hexdigest()


def share_buckets(
    named_tensors: Iterable[tuple[str, torch.Tensor]],
    *,
    device: str | torch.device = "cuda",
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    checksum: bool = False,
    pack: bool = True,
) -> Iterator[IpcBucket]:
    """Trainer side: pack tensors into CUDA buckets of at most ``bucket_bytes`` and share each.

    ``pack=False`` shares every (contiguous, CUDA) tensor's own memory instead, one bucket
    per tensor: no packing copy, so the engine's copy is the only one (the trainer must not
    update those tensors until the engine has loaded them). Packing costs one device copy
    but gives a few large handles and a snapshot the optimizer may overwrite right away.
    """
    from torch.multiprocessing.reductions import reduce_tensor

    device = torch.device(device)
    if device.type != "cuda":
        raise ValueError(
            f"CUDA IPC shares CUDA memory; got device {device}. On CPU use the in-process "
            "update_weights or the gloo transport (rl_rollout.transport)"
        )
    if not pack:
        for name, t in named_tensors:
            if not t.is_cuda:
                raise ValueError(
                    f"share_buckets(pack=False): {name!r} is on {t.device}; only CUDA memory can be "
                    "shared in place (use pack=True to copy it onto the GPU)"
                )
            if not t.is_contiguous():  # .contiguous() would share a copy the trainer never updates
                raise ValueError(
                    f"share_buckets(pack=False): {name!r} is not contiguous (strides {t.stride()}), "
                    "so it cannot be shared in place; use pack=True"
                )
            flat_U8 = t.detach().reshape(-1).view(torch.uint8)
            meta = msgpack.packb([[name, str(t.dtype).removeprefix("torch."), list(t.shape), 0, flat_U8.numel()]])
            yield IpcBucket(
                meta,
                pickle.dumps(reduce_tensor(flat_U8)),
                flat_U8.numel(),
                _digest(flat_U8) if checksum else None,
                flat_U8,
            )
        return
    for group in iter_groups(named_tensors, bucket_bytes):
        meta, payload_U8 = pack_tensors(group, device)
        torch.cuda.current_stream(device).synchronize()  # the copy must be done before another process reads
        yield IpcBucket(
            meta,
            pickle.dumps(reduce_tensor(payload_U8)),
            payload_U8.numel(),
            _digest(payload_U8) if checksum else None,
            payload_U8,
        )


def _open_handle(bucket: IpcBucket) -> torch.Tensor:
    rebuild, args = pickle.loads(bucket.handle)
    payload_U8 = rebuild(*args)
    if payload_U8.numel() != bucket.nbytes:
        raise ValueError(
            f"IPC bucket handle opens {payload_U8.numel()} bytes, its metadata says {bucket.nbytes}: "
            "the handle and the metadata come from different buckets"
        )
    return payload_U8


def open_bucket(bucket: IpcBucket, *, verify: bool = True) -> list[tuple[str, torch.Tensor]]:
    """Engine side: views of the sender's tensors (same device memory, no copy).

    Copy them into the model before the sender drops the bucket. With ``verify`` and a
    sender checksum, a payload whose sha256 differs raises before anything is loaded.
    Opens the handle every call; for repeated syncs use :class:`IpcReceiver`.
    """
    payload_U8 = _open_handle(bucket)
    if verify and bucket.sha256 is not None:
        got = _digest(payload_U8)
        if got != bucket.sha256:
            raise ValueError(
                f"IPC bucket checksum mismatch (sender {bucket.sha256[:16]}..., read "
                f"{got[:16]}...): the sender changed or freed the memory before the engine loaded it"
            )
    return unpack_tensors(bucket.meta, payload_U8)


def _layout(named: list[tuple[str, torch.Tensor]], in_place: bool) -> list:
    if in_place:
        return [(n, t.dtype, t.shape, t.data_ptr()) for n, t in named]
    return [(n, t.dtype, t.shape) for n, t in named]


@dataclass(frozen=True)
class IpcSync:
    """One sync from an :class:`IpcSender`; what crosses the process boundary is a few hundred bytes
    once the receiver holds the generation's buckets.

    ``buckets`` (with handles) comes with a generation's first sync only; later syncs carry the
    ``key`` (``"sender/generation"``) and ``count`` alone, plus a sha256 per bucket when the
    sender checksums.
    """

    key: str
    count: int
    buckets: tuple[IpcBucket, ...] | None = None
    sha256: tuple[str, ...] | None = None


class IpcSender:
    """Trainer side of repeated CUDA IPC syncs: buckets allocated and shared once, refilled in place.

    ``share(named_tensors)`` returns the :class:`IpcSync` of one sync. The first call (and any
    call whose layout differs from the last) allocates the buckets and sends their handles;
    later calls copy the new values into the same memory and send the key only. The protocol
    is synchronous: call ``share`` for the next version only after the engine finished loading
    the previous one (its update call returned), since the buckets are overwritten in place.
    ``pack=False`` shares the tensors' own memory (each must be CUDA and contiguous and stay
    where it is; the trainer must not update it until the engine has loaded it): a sync is then
    the engine's single copy, and no second copy of the weights stays on the GPU.
    ``nbytes``: the tensors' bytes in the current layout (set when the layout changes, not summed every sync).
    ``pack="auto"`` shares in place when every tensor can be, and packs from the first sync that
    finds them elsewhere than the last one did (weights offloaded and reloaded between syncs: in
    place, every sync would open new handles, and the engine's open handles would keep the old
    memory from being freed). ``pack`` then tells the mode in use.
    """

    def __init__(
        self,
        *,
        device: str | torch.device = "cuda",
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        pack: bool | str = True,
        checksum: bool = False,
    ) -> None:
        if pack not in (True, False, "auto"):
            raise ValueError(
                f"IpcSender(pack={pack!r}): use True (copy into buckets), False (share in place) or 'auto'"
            )
        self.auto = pack == "auto"
        self.pack = pack != "auto" and bool(pack)  # the mode in use ("auto" starts in place)
        self.device, self.bucket_bytes, self.checksum = torch.device(device), bucket_bytes, checksum
        if self.device.type != "cuda":
            raise ValueError(
                f"CUDA IPC shares CUDA memory; got device {self.device}. On CPU use the in-process "
                "update_weights or the gloo transport (rl_rollout.transport)"
            )
        self.id = uuid.uuid4().hex[:12]
        self.generation = 0
        self._layout: list | None = None
        self._buckets: list[IpcBucket] = []
        self._views: list[torch.Tensor] = []  # every tensor's view in the buckets, in order (pack=True)
        self.nbytes = 0  # the bytes one sync of the current layout carries

    def reset(self) -> None:
        """Forget the shared buckets: the next ``share`` starts a new generation with fresh handles."""
        self._layout, self._buckets, self._views = None, [], []

    @torch.no_grad()
    def share(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> IpcSync:
        named = list(named_tensors)
        layout = None
        if self.auto and not self.pack:
            movable = any(not (t.is_cuda and t.is_contiguous()) for _, t in named)
            layout = _layout(named, True)  # in place: also the layout this sync keeps if nothing moved
            if movable or (self._layout is not None and layout != self._layout):
                logger.info(
                    "IpcSender %s: %s; packing into buckets from now on",
                    self.id,
                    "a tensor is not contiguous CUDA memory" if movable else "the weights moved since the last sync",
                )
                self.pack, layout = True, None
        if layout is None:
            layout = _layout(named, not self.pack)
        fresh = layout != self._layout
        if fresh:
            self.generation += 1
            self._buckets = list(
                share_buckets(named, device=self.device, bucket_bytes=self.bucket_bytes, pack=self.pack)
            )
            self._views = (
                [t for b in self._buckets for _, t in unpack_tensors(b.meta, b._sender_payload())] if self.pack else []
            )
            self._layout = layout
            self.nbytes = sum(t.numel() * t.element_size() for _, t in named)
        elif self.pack:
            torch._foreach_copy_(
                self._views, [t.reshape(v.shape) for v, (_, t) in zip(self._views, named, strict=True)]
            )
        torch.cuda.current_stream(self.device).synchronize()  # written before another process reads
        sha = tuple(_digest(b._sender_payload()) for b in self._buckets) if self.checksum else None
        return IpcSync(f"{self.id}/{self.generation}", len(self._buckets), tuple(self._buckets) if fresh else None, sha)


class IpcReceiver:
    """Engine side of :class:`IpcSender`: opens a generation's handles once and keeps its views.

    ``load(sync)`` returns, per bucket, ``(name, view)`` pairs of the sender's memory. A newer
    generation of the same sender releases the older one.
    """

    def __init__(self) -> None:
        self._open: dict[str, list[tuple[torch.Tensor, list[tuple[str, torch.Tensor]]]]] = {}

    def load(self, sync: IpcSync, *, verify: bool = True) -> list[list[tuple[str, torch.Tensor]]]:
        if sync.buckets is not None:
            sender = sync.key.split("/")[0]
            for k in [k for k in self._open if k.split("/")[0] == sender]:
                del self._open[k]
            opened = [_open_handle(b) for b in sync.buckets]
            self._open[sync.key] = [(p, unpack_tensors(b.meta, p)) for p, b in zip(opened, sync.buckets, strict=True)]
        elif sync.key not in self._open:
            raise ValueError(
                f"IPC sync {sync.key} carries no handles and this engine never opened that generation "
                "(it was restarted or missed the generation's first sync): call the trainer's "
                "IpcSender.reset() so that the next sync sends fresh handles"
            )
        buckets = self._open[sync.key]
        if len(buckets) != sync.count:
            raise ValueError(f"IPC sync {sync.key} has {sync.count} buckets, this engine opened {len(buckets)}")
        if verify and sync.sha256 is not None:
            for index, ((payload_U8, _), sha) in enumerate(zip(buckets, sync.sha256, strict=True)):
                got = _digest(payload_U8)
                if got != sha:
                    raise ValueError(
                        f"IPC sync {sync.key} bucket {index}: checksum mismatch (sender {sha[:16]}..., "
                        f"read {got[:16]}...): the sender changed the memory before the engine loaded it"
                    )
        return [named for _, named in buckets]

    def close(self) -> None:
        self._open.clear()
