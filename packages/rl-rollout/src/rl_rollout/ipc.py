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
"""

from __future__ import annotations

import hashlib
import pickle
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import msgpack
import torch

from rl_rollout.weights import DEFAULT_BUCKET_BYTES, iter_groups, pack_tensors, unpack_tensors


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


def _digest(payload_U8: torch.Tensor) -> str:
    return hashlib.sha256(payload_U8.cpu().numpy().tobytes()).hexdigest()


def share_buckets(named_tensors: Iterable[tuple[str, torch.Tensor]], *, device: str | torch.device = "cuda",
                  bucket_bytes: int = DEFAULT_BUCKET_BYTES, checksum: bool = False,
                  pack: bool = True) -> Iterator[IpcBucket]:
    """Trainer side: pack tensors into CUDA buckets of at most ``bucket_bytes`` and share each.

    ``pack=False`` shares every (contiguous, CUDA) tensor's own memory instead, one bucket
    per tensor: no packing copy, so the engine's copy is the only one (the trainer must not
    update those tensors until the engine has loaded them). Packing costs one device copy
    but gives a few large handles and a snapshot the optimizer may overwrite right away.
    """
    from torch.multiprocessing.reductions import reduce_tensor

    device = torch.device(device)
    if device.type != "cuda":
        raise ValueError(f"CUDA IPC shares CUDA memory; got device {device}. On CPU use the in-process "
                         "update_weights or the gloo transport (rl_rollout.transport)")
    if not pack:
        for name, t in named_tensors:
            if not t.is_cuda:
                raise ValueError(f"share_buckets(pack=False): {name!r} is on {t.device}; only CUDA memory can be "
                                 "shared in place (use pack=True to copy it onto the GPU)")
            flat_U8 = t.detach().contiguous().reshape(-1).view(torch.uint8)
            meta = msgpack.packb([[name, str(t.dtype).removeprefix("torch."), list(t.shape), 0, flat_U8.numel()]])
            yield IpcBucket(meta, pickle.dumps(reduce_tensor(flat_U8)), flat_U8.numel(),
                            _digest(flat_U8) if checksum else None, flat_U8)
        return
    for group in iter_groups(named_tensors, bucket_bytes):
        meta, payload_U8 = pack_tensors(group, device)
        torch.cuda.current_stream(device).synchronize()  # the copy must be done before another process reads
        yield IpcBucket(meta, pickle.dumps(reduce_tensor(payload_U8)), payload_U8.numel(),
                        _digest(payload_U8) if checksum else None, payload_U8)


def open_bucket(bucket: IpcBucket, *, verify: bool = True) -> list[tuple[str, torch.Tensor]]:
    """Engine side: views of the sender's tensors (same device memory, no copy).

    Copy them into the model before the sender drops the bucket. With ``verify`` and a
    sender checksum, a payload whose sha256 differs raises before anything is loaded.
    """
    rebuild, args = pickle.loads(bucket.handle)
    payload_U8 = rebuild(*args)
    if payload_U8.numel() != bucket.nbytes:
        raise ValueError(f"IPC bucket handle opens {payload_U8.numel()} bytes, its metadata says {bucket.nbytes}: "
                         "the handle and the metadata come from different buckets")
    if verify and bucket.sha256 is not None:
        got = _digest(payload_U8)
        if got != bucket.sha256:
            raise ValueError(f"IPC bucket checksum mismatch (sender {bucket.sha256[:16]}..., read "
                             f"{got[:16]}...): the sender changed or freed the memory before the engine loaded it")
    return unpack_tensors(bucket.meta, payload_U8)
