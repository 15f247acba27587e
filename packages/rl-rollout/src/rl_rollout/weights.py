"""Weight buckets: the wire format every weight transport hands to an engine.

A *bucket* is a group of named tensors flattened into one contiguous byte
payload plus msgpack metadata (name, dtype, shape, byte offset per tensor).
``update_weights`` of every engine consumes an iterable of ``(name, tensor)``;
the vLLM engine packs it into buckets of at most ``bucket_bytes`` and ships each
through ``collective_rpc`` (plain bytes, so no pickle and no
``VLLM_ALLOW_INSECURE_SERIALIZATION``). Later transports (CUDA IPC, a gloo or
NCCL broadcast) move the same payload by other means and reuse
:func:`unpack_bucket` on the receiving side.

Left out here: checksums across the wire and the transports themselves.
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


def pack_bucket(named_tensors: Iterable[tuple[str, torch.Tensor]]) -> WeightBucket:
    """Flatten ``named_tensors`` (any device) into one CPU byte payload."""
    metas: list[list] = []
    chunks: list[torch.Tensor] = []
    offset = 0
    for name, tensor in named_tensors:
        flat_U8 = tensor.detach().contiguous().reshape(-1).view(torch.uint8).cpu()
        metas.append([name, str(tensor.dtype).removeprefix("torch."), list(tensor.shape), offset, flat_U8.numel()])
        chunks.append(flat_U8)
        offset += flat_U8.numel()
    payload = torch.cat(chunks).numpy().tobytes() if chunks else b""
    return WeightBucket(meta=msgpack.packb(metas), payload=payload)


def unpack_bucket(meta: bytes, payload: bytes | bytearray | memoryview) -> list[tuple[str, torch.Tensor]]:
    """Inverse of :func:`pack_bucket`: CPU tensors viewing one copy of ``payload``."""
    buf_U8 = torch.frombuffer(bytearray(payload), dtype=torch.uint8) if len(payload) else torch.empty(0, dtype=torch.uint8)
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
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be > 0, got {bucket_bytes}")
    group: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, tensor in named_tensors:
        nbytes = tensor.numel() * tensor.element_size()
        if group and size + nbytes > bucket_bytes:
            yield pack_bucket(group)
            group, size = [], 0
        group.append((name, tensor))
        size += nbytes
    if group:
        yield pack_bucket(group)
