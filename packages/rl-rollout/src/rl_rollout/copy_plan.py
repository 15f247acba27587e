"""Record how a weight loader copies each named tensor into a model, then replay it as one fused copy.

An engine's ``load_weights`` turns trainer tensors (HF names and layouts) into its own layout: q, k
and v rows into one ``qkv_proj`` weight, gate and up into ``gate_up_proj``, a tensor-parallel shard
of each. For a plain (unquantized) model every such load ends in ``dst_view.copy_(src_view)``, where
``dst_view`` is a slice of a live parameter and ``src_view`` a slice of the input tensor. Those views
are the same at every sync, so :class:`CopyPlan` records them once, by running the loader one input
at a time under a :class:`~torch.utils._python_dispatch.TorchDispatchMode` that sees every aten op,
and afterwards a sync is a single ``torch._foreach_copy_`` over all of them (a few fused kernels on
CUDA, instead of hundreds of Python loader calls).

An input is planned only when everything its load did to the model was ``copy_`` from a view of that
input into a view of a parameter (or buffer) given to :meth:`CopyPlan.record`; anything else (a
loader that transforms the values, concatenates, writes through another op, writes outside the
given parameters, or writes nothing) leaves the input out, and :meth:`CopyPlan.replay` returns it
for the ordinary loader. A replay first checks every input against the layout it was recorded with
and every destination parameter against the storage it had: a mismatch raises
:class:`CopyPlanStale` (record again), so a plan can be slow to build but never writes to the wrong
place. What it leaves out: quantized layers (their loaders compute), and engines whose kernels do
not read the parameters in place (vLLM's CPU build packs linear weights for oneDNN after loading).
"""

from __future__ import annotations

import operator
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class ParamIndex:
    """A model's parameters and buffers by name, looked up once and reused across syncs while :meth:`current`.

    The lookup walks every module (``named_parameters`` + ``named_buffers``: 1.2 ms for a 24-layer vLLM Llama on a
    2-core CPU, part of every sync when done per sync). :meth:`current` checks, in a tenth of that, that the lookup
    would return the same: every submodule still registered under its name on its parent, every parameter and
    buffer still the one registered on its module, at the same address (``p.data = ...`` moves it). Anything
    replaced makes it ``False``; then look up again."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.params: dict[str, torch.Tensor] = dict(model.named_parameters(remove_duplicate=False))
        self.params.update(model.named_buffers(remove_duplicate=False))
        self._modules = [
            (parent._modules, name, child)
            for _, parent in model.named_modules(remove_duplicate=False)
            for name, child in parent._modules.items()
            if child is not None
        ]
        self._tensors = []
        for name, t in self.params.items():
            owner, _, attr = name.rpartition(".")
            module = model.get_submodule(owner)
            registry = module._parameters if attr in module._parameters else module._buffers
            self._tensors.append((registry, attr, t, t.data_ptr()))

    def current(self) -> bool:
        return all(reg.get(name) is child for reg, name, child in self._modules) and all(
            reg.get(attr) is t and t.data_ptr() == ptr for reg, attr, t, ptr in self._tensors
        )


class CopyPlanStale(RuntimeError):
    """The plan no longer matches the inputs or the model (another shape, dtype, device or storage)."""


def _storage_ptr(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def _layout(t: torch.Tensor) -> tuple:
    return (tuple(t.shape), tuple(t.stride()), t.storage_offset(), t.dtype, t.device)


class _Recorder(TorchDispatchMode):
    """Every aten op under it: keeps the ``copy_`` calls and the other writes (their targets)."""

    def __init__(self) -> None:
        super().__init__()
        self.copies: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.other_writes: list[tuple[str, torch.Tensor]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten.copy_.default:
            self.copies.append((args[0], args[1]))
        else:
            schema = func._schema
            for i, a in enumerate(schema.arguments):
                if a.alias_info is None or not a.alias_info.is_write:
                    continue
                value = kwargs[a.name] if a.name in kwargs else (args[i] if i < len(args) else None)
                for t in tree_flatten(value)[0]:
                    if isinstance(t, torch.Tensor) and t.numel():  # an empty view writes nothing (vLLM's
                        self.other_writes.append((str(func), t))  # zero-fill of no padding rows)
        return func(*args, **kwargs)


@dataclass
class _Entry:
    layout: tuple  # the input's (shape, stride, offset, dtype, device) at record time
    dsts: list[torch.Tensor]  # views of live parameters
    srcs: list[tuple[tuple, tuple, int]]  # (size, stride, storage offset) of each source view of the input
    params: list[str]  # the parameter each destination lies in


@dataclass
class CopyPlan:
    """Per input name, the destination views its load writes and the source views it reads."""

    entries: dict[str, _Entry] = field(default_factory=dict)
    skipped: dict[str, str] = field(default_factory=dict)  # input name -> why it is left to the loader
    param_ptrs: dict[str, int] = field(default_factory=dict)  # parameter -> storage pointer at record time
    record_s: float = 0.0
    last_copies: int = 0  # copies the last replay made
    # live=True replays: the inputs' (name, data pointer, shape, stride) and the views built for them
    _live_key: tuple | None = field(default=None, repr=False)
    _live_views: tuple[list, list] | None = field(default=None, repr=False)

    @classmethod
    def record(
        cls,
        load: Callable[[list[tuple[str, torch.Tensor]]], None],
        weights: Iterable[tuple[str, torch.Tensor]],
        params: dict[str, torch.Tensor],
    ) -> CopyPlan:
        """A new plan of ``weights`` (:meth:`add`)."""
        plan = cls()
        plan.add(load, weights, params)
        return plan

    def add(
        self,
        load: Callable[[list[tuple[str, torch.Tensor]]], None],
        weights: Iterable[tuple[str, torch.Tensor]],
        params: dict[str, torch.Tensor],
    ) -> None:
        """Run ``load`` on each ``(name, tensor)`` alone under the recorder (this loads the weights: a
        recording sync is a normal one), and plan the inputs whose load was pure copies into ``params``
        (the model's parameters and buffers by name). A sync that arrives in several groups adds each."""
        t0 = time.perf_counter()
        self._live_key = self._live_views = None  # kept views would miss the inputs planned now
        owners = {_storage_ptr(p): n for n, p in params.items() if p.numel()}
        self.param_ptrs.update({n: _storage_ptr(p) for n, p in params.items() if p.numel()})
        for name, tensor in weights:
            rec = _Recorder()
            with rec:
                load([(name, tensor)])
            why = self._plan_one(name, tensor, rec, owners)
            if why:
                self.skipped[name] = why
        self.record_s += time.perf_counter() - t0

    def _plan_one(self, name: str, tensor: torch.Tensor, rec: _Recorder, owners: dict[int, str]) -> str | None:
        for op, t in rec.other_writes:
            if _storage_ptr(t) in owners:
                return f"its load writes {owners[_storage_ptr(t)]} with {op}, not a copy"
        if not rec.copies:
            return "its load copied nothing into the model"
        src_ptr = _storage_ptr(tensor)
        entry = _Entry(_layout(tensor), [], [], [])
        for dst, src in rec.copies:
            owner = owners.get(_storage_ptr(dst))
            if owner is None:
                return "its load copies outside the given parameters"
            if _storage_ptr(src) != src_ptr:
                return f"its load computes what it copies into {owner} (not a view of the input)"
            if tuple(src.shape) != tuple(dst.shape):
                return f"its load broadcasts into {owner}"
            offset = int(src.storage_offset() - tensor.storage_offset())  # an int (SymInt only when traced)
            entry.dsts.append(dst)
            entry.srcs.append((tuple(src.shape), tuple(src.stride()), offset))
            entry.params.append(owner)
        self.entries[name] = entry
        return None

    @property
    def copies(self) -> int:
        return sum(len(e.dsts) for e in self.entries.values())

    def check_params(self, params: dict[str, torch.Tensor]) -> None:
        """Raise :class:`CopyPlanStale` if a destination parameter moved to other storage since recording."""
        for e in self.entries.values():
            for p in e.params:
                now = params.get(p)
                if now is None or _storage_ptr(now) != self.param_ptrs[p]:
                    raise CopyPlanStale(f"parameter {p} is no longer the storage the plan writes to")

    def replay(
        self, weights: Iterable[tuple[str, torch.Tensor]], *, live: bool = False
    ) -> list[tuple[str, torch.Tensor]]:
        """Copy every planned input in one fused copy; returns the others (left out, or not recorded yet).

        Raises :class:`CopyPlanStale` when a planned input's layout (shape, strides, dtype, device)
        differs from the recorded one. Source views are rebuilt every time, unless ``live``: the inputs
        are a trainer's live parameters, the same storage at every sync (ZeRO-0/1/2, no cast), and then
        the views of the last replay are kept and reused while the inputs are the same tensor objects under the same
        names at the same data pointers (a sync is then one ``torch._foreach_copy_``). Never pass ``live`` for
        copies made for the sync (a ZeRO-3 gather): the kept views would keep them alive."""
        weights = list(weights)
        if live:
            names, tensors = [n for n, _ in weights], [t for _, t in weights]
            ptrs = list(map(torch.Tensor.data_ptr, tensors))
            last = self._live_key
            # the same tensor objects (not only equal ones) at the same addresses: a tensor object keeps its shape
            # and strides unless resized in place, which a trainer's parameters never are
            if (
                last is not None
                and self._live_views is not None
                and names == last[0]
                and ptrs == last[2]
                and all(map(operator.is_, tensors, last[1]))
            ):
                self._copy(*self._live_views)
                return [(n, t) for n, t in weights if n not in self.entries]
        self._live_key = self._live_views = None
        rest, planned = [], []
        for name, tensor in weights:
            e = self.entries.get(name)
            if e is None:
                rest.append((name, tensor))
                continue
            if (tuple(tensor.shape), tuple(tensor.stride()), tensor.dtype, tensor.device) != (
                e.layout[0],
                e.layout[1],
                e.layout[3],
                e.layout[4],
            ):
                raise CopyPlanStale(
                    f"{name}: {tuple(tensor.shape)} {tensor.dtype} on {tensor.device}, recorded "
                    f"as {e.layout[0]} {e.layout[3]} on {e.layout[4]}"
                )
            planned.append((name, tensor))
        dsts: list[torch.Tensor] = []
        srcs: list[torch.Tensor] = []
        for name, tensor in planned:
            e = self.entries[name]
            dsts.extend(e.dsts)
            whole = (tuple(tensor.shape), tuple(tensor.stride()), 0)
            base = tensor.storage_offset()
            srcs.extend(tensor if v == whole else tensor.as_strided(v[0], v[1], base + v[2]) for v in e.srcs)
        self._copy(dsts, srcs)
        if live:
            self._live_key, self._live_views = (names, tensors, ptrs), (dsts, srcs)
        return rest

    def _copy(self, dsts: list[torch.Tensor], srcs: list[torch.Tensor]) -> None:
        if dsts:
            with torch.no_grad():
                torch._foreach_copy_(dsts, srcs)
        self.last_copies = len(dsts)
