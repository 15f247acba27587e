"""Weight buckets: the wire format every weight transport hands to an engine.

A *bucket* is a group of named tensors flattened into one contiguous byte
payload plus msgpack metadata (name, dtype, shape, byte offset per tensor).
``update_weights`` of every engine consumes an iterable of ``(name, tensor)``;
the vLLM engine packs it into buckets of at most ``bucket_bytes`` and ships each
through ``collective_rpc`` (plain bytes, so no pickle and no
``VLLM_ALLOW_INSECURE_SERIALIZATION``). Later transports (CUDA IPC, a gloo or
NCCL broadcast, :mod:`rl_rollout.transport`) move the same payload by other
means: :func:`pack_tensors` / :func:`unpack_tensors` are the same format on a
flat ``uint8`` tensor that stays on its device (no host bytes), which
:func:`pack_bucket` / :func:`unpack_bucket` wrap.

Left out here: checksums and the transports themselves (:mod:`rl_rollout.transport`).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import msgpack
import torch

DEFAULT_BUCKET_BYTES = 256 * 1024**2


@dataclass(frozen=True)
class WeightBucket:
    """Metadata (msgpack bytes) and payload (raw bytes) of a group of tensors.

    ``meta`` unpacks to a list of ``[name, dtype, shape, offset, nbytes]``, dtype
    a torch dtype name without the ``torch.`` prefix (e.g. ``"bfloat16"``) and
    offset the byte offset of the tensor in ``payload``.
    """

    meta: bytes
    payload: bytes

    @property
    def nbytes(self) -> int:
        return len(self.payload)


def _dtype_from_name(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown tensor dtype {name!r} in weight bucket metadata (expected e.g. 'bfloat16')")
    return dtype


def pack_tensors(
    named_tensors: Iterable[tuple[str, torch.Tensor]], device: str | torch.device = "cpu"
) -> tuple[bytes, torch.Tensor]:
    """Flatten ``named_tensors`` into one ``uint8`` tensor on ``device``: ``(meta, payload_U8)``."""
    metas: list[list] = []
    chunks: list[torch.Tensor] = []
    offset = 0
    for name, tensor in named_tensors:
        flat_U8 = tensor.detach().contiguous().reshape(-1).view(torch.uint8).to(device)
        metas.append([name, str(tensor.dtype).removeprefix("torch."), list(tensor.shape), offset, flat_U8.numel()])
        chunks.append(flat_U8)
        offset += flat_U8.numel()
    payload_U8 = torch.cat(chunks) if chunks else torch.empty(0, dtype=torch.uint8, device=device)
    return msgpack.packb(metas), payload_U8


def pack_bucket(named_tensors: Iterable[tuple[str, torch.Tensor]]) -> WeightBucket:
    """Flatten ``named_tensors`` (any device) into one CPU byte payload."""
    meta, payload_U8 = pack_tensors(named_tensors)
    return WeightBucket(meta=meta, payload=payload_U8.numpy().tobytes())


def unpack_bucket(meta: bytes, payload: bytes | bytearray | memoryview) -> list[tuple[str, torch.Tensor]]:
    """Inverse of :func:`pack_bucket`: CPU tensors viewing one copy of ``payload``."""
    buf_U8 = torch.frombuffer(bytearray(payload), dtype=torch.uint8) if len(payload) else torch.empty(0, dtype=torch.uint8)
    return unpack_tensors(meta, buf_U8)


def unpack_tensors(meta: bytes, buf_U8: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """Inverse of :func:`pack_tensors`: tensors viewing ``buf_U8`` (no copy, same device)."""
    out = []
    for name, dtype, shape, offset, nbytes in msgpack.unpackb(meta):
        if offset + nbytes > buf_U8.numel():
            raise ValueError(
                f"weight bucket metadata for {name!r} points past the payload "
                f"({offset}+{nbytes} > {buf_U8.numel()} bytes): meta and payload are from different buckets"
            )
        t = buf_U8[offset : offset + nbytes].view(_dtype_from_name(dtype)).reshape(shape)
        out.append((name, t))
    return out


def iter_buckets(
    named_tensors: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int = DEFAULT_BUCKET_BYTES
) -> Iterator[WeightBucket]:
    """Group tensors in order into buckets of at most ``bucket_bytes`` (one tensor may exceed it alone)."""
    for group in iter_groups(named_tensors, bucket_bytes):
        yield pack_bucket(group)


def iter_groups(
    named_tensors: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int = DEFAULT_BUCKET_BYTES
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """The grouping of :func:`iter_buckets`, unpacked: lists of ``(name, tensor)`` of at most ``bucket_bytes``."""
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be > 0, got {bucket_bytes}")
    group: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, tensor in named_tensors:
        nbytes = tensor.numel() * tensor.element_size()
        if group and size + nbytes > bucket_bytes:
            yield group
            group, size = [], 0
        group.append((name, tensor))
        size += nbytes
    if group:
        yield group
