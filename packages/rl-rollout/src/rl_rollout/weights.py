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

Weight statistics (:class:`TensorStats`, :func:`weight_stats`, :func:`compare_weight_stats`): per
tensor, the element count and the float64 sum and sum of squares. They are what an engine's
``verify_weights`` compares with what the trainer sent: sums add up over the parts vLLM fuses
(q/k/v into ``qkv_proj``, gate/up into ``gate_up_proj``) and over tensor-parallel shards, and do not
depend on the memory layout a kernel repacks a weight into; any changed value changes them.

Left out here: byte checksums and the transports themselves (:mod:`rl_rollout.transport`).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass

import msgpack
import torch

DEFAULT_BUCKET_BYTES = 256 * 1024**2
# float64 sums of the same values in another order differ by ~1e-15 relative; a weight that moved
# by one part in 1e7 (a small optimizer step) moves them far more than this.
DEFAULT_STATS_RTOL = 1e-9
_STATS_CHUNK = 1 << 24  # elements summed at a time: bounds the float64 copy


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
    buf_U8 = (
        torch.frombuffer(bytearray(payload), dtype=torch.uint8) if len(payload) else torch.empty(0, dtype=torch.uint8)
    )
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


_DTYPE_NAMES = {"fp32": "float32", "float": "float32", "bf16": "bfloat16", "fp16": "float16", "half": "float16"}


def as_torch_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """``"bf16"``/``"bfloat16"``/``torch.bfloat16`` -> ``torch.bfloat16`` (likewise fp32/float32, fp16/float16/half)."""
    if isinstance(dtype, torch.dtype):
        return dtype
    name = str(dtype).removeprefix("torch.")
    out = getattr(torch, _DTYPE_NAMES.get(name, name), None)
    if not isinstance(out, torch.dtype):
        raise ValueError(f"unknown dtype {dtype!r} (expected e.g. 'float32', 'fp32', 'bfloat16', 'bf16')")
    return out


@dataclass(frozen=True)
class TensorStats:
    """Element count, float64 sum and float64 sum of squares of a tensor's values."""

    numel: int
    sum: float
    sumsq: float

    def __add__(self, other: TensorStats) -> TensorStats:
        return TensorStats(self.numel + other.numel, self.sum + other.sum, self.sumsq + other.sumsq)

    def differs(self, other: TensorStats, rtol: float = DEFAULT_STATS_RTOL) -> str | None:
        """Why ``other`` (e.g. what an engine holds) is not these values, or ``None`` when it matches.

        ``sum`` is compared with tolerance ``rtol * sqrt(numel * sumsq)`` (a bound on the sum of
        absolute values), ``sumsq`` with ``rtol * sumsq``."""
        if other.numel != self.numel:
            return f"{other.numel} elements, expected {self.numel}"
        scale = math.sqrt(self.numel * self.sumsq)
        if abs(other.sum - self.sum) > rtol * scale or abs(other.sumsq - self.sumsq) > rtol * self.sumsq:
            return (
                f"sum {other.sum:.9g} / sum of squares {other.sumsq:.9g}, expected {self.sum:.9g} / {self.sumsq:.9g} "
                f"(relative difference {abs(other.sum - self.sum) / max(scale, 1e-300):.1e} / "
                f"{abs(other.sumsq - self.sumsq) / max(self.sumsq, 1e-300):.1e})"
            )
        return None


def tensor_stats(tensor: torch.Tensor, dtype: str | torch.dtype | None = None) -> TensorStats:
    """:class:`TensorStats` of ``tensor`` (on its device), after a cast to ``dtype`` when given:
    pass the engine's dtype when it holds the weights in another dtype than the one sent."""
    t = tensor.detach()
    if dtype is not None:
        t = t.to(as_torch_dtype(dtype))
    flat = t.reshape(-1)
    total = torch.zeros((), dtype=torch.float64, device=t.device)
    total_sq = torch.zeros((), dtype=torch.float64, device=t.device)
    for i in range(0, flat.numel(), _STATS_CHUNK):
        x = flat[i : i + _STATS_CHUNK].double()
        total += x.sum()
        total_sq += x.square().sum()
    return TensorStats(flat.numel(), total.item(), total_sq.item())


def weight_stats(
    named_tensors: Iterable[tuple[str, torch.Tensor]], *, dtype: str | torch.dtype | None = None
) -> dict[str, TensorStats]:
    """``{name: TensorStats}`` of the tensors a trainer sends (HF names): the ``expected`` argument of
    ``VLLMEngine.verify_weights``. ``dtype``: the engine's dtype (``VLLMEngine.dtype``) when the tensors
    are sent in another one (the engine rounds them to its dtype on load)."""
    return {name: tensor_stats(t, dtype) for name, t in named_tensors}


def compare_weight_stats(
    expected: Mapping[str, TensorStats],
    actual: Mapping[str, TensorStats],
    *,
    ties: Mapping[str, str] | None = None,
    missing: Mapping[str, str] | None = None,
    rtol: float = DEFAULT_STATS_RTOL,
) -> list[str]:
    """One line per tensor of ``expected`` that ``actual`` does not hold (empty: all match).

    ``ties`` maps a tied parameter the engine holds (``lm_head.weight``) to the one it is tied to
    (``model.embed_tokens.weight``): when only the latter was sent, the former must hold it too.
    ``missing`` gives the engine's reason for a name it could not report."""
    problems = []
    for name, want in expected.items():
        got = actual.get(name)
        if got is None:
            problems.append(f"{name}: {(missing or {}).get(name, 'not reported by the engine')}")
        elif why := want.differs(got, rtol):
            problems.append(f"{name}: {why}")
    for alias, source in (ties or {}).items():
        if alias in expected or source not in expected or alias not in actual:
            continue
        if why := expected[source].differs(actual[alias], rtol):
            problems.append(f"{alias} (tied to {source}, which was sent): {why}")
    return problems
