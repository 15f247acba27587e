"""Device memory around a vLLM engine's sleep and wake-up: torch's cached blocks handed back before the engine
maps its memory, what is free, the one-line hint an out-of-memory wake-up gets (which share to lower), and
``sleep`` / ``wake_up`` themselves (:class:`VLLMSleepMixin`, a mixin of :class:`rl_rollout.vllm_engine.VLLMEngine`)."""

from __future__ import annotations

import threading
from collections.abc import Coroutine
from typing import TYPE_CHECKING, Any, TypeVar

import torch

_T = TypeVar("_T")


def _release_cached_device_memory() -> None:
    """Before an engine in this process wakes: hand the blocks torch's caching allocator keeps (a train step's
    freed activations) back to the driver, where vLLM's allocator maps the engine's memory (as OpenRLHF does)."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()


def _device_free_total() -> tuple[int | None, int | None]:
    if not (torch.cuda.is_available() and torch.cuda.is_initialized()):
        return None, None
    return torch.cuda.mem_get_info()


def wake_oom_hint(share: float | None, free: int | None, total: int | None) -> str:
    """The fix for an engine that cannot wake: a ``--vllm_gpu_memory_utilization`` that fits in what is ``free``
    now (bytes of ``total``, with the trainers' caches emptied), or ``--deepspeed_enable_sleep`` where none does."""
    now = f"{share:.2f}" if share is not None else "vLLM's default"
    sleep = "free the trainer's memory before the engine wakes (--deepspeed_enable_sleep)"
    if not free or not total:
        return f"lower --vllm_gpu_memory_utilization (now {now}), or {sleep}"
    fits = int(free / total * 20) / 20  # down to a multiple of 0.05: the engine also keeps some memory asleep
    if fits < 0.05:
        return f"no share of the device is free beside the trainer: {sleep}"
    return f"set --vllm_gpu_memory_utilization {fits:.2f} or lower (what is free now; it is {now}), or {sleep}"


def _device_memory_note() -> str:
    if not (torch.cuda.is_available() and torch.cuda.is_initialized()):
        return "no CUDA device in this process"
    free, total = torch.cuda.mem_get_info()
    return (
        f"{free / 2**30:.2f} of {total / 2**30:.2f} GiB of the device free, this process's torch tensors hold "
        f"{torch.cuda.memory_allocated() / 2**30:.2f} GiB (the trainer's ranks hold theirs in their own processes "
        f"when the engine runs apart, as over Ray)"
    )


class VLLMSleepMixin:
    """``sleep`` and ``wake_up`` for :class:`~rl_rollout.vllm_engine.VLLMEngine`."""

    # The engine's state this mixin uses, set by VLLMEngine.__init__ (annotations only: no class attributes).
    mode: str  # "sync" | "async"
    _llm: Any  # vllm.LLM (sync mode) or vllm's AsyncLLM (async mode): vLLM's own objects
    _lock: threading.RLock
    _weights_epoch: int
    _asleep: set[str]
    _memory_share: float | None

    if TYPE_CHECKING:  # the engine's methods this mixin calls (defined by VLLMEngine)

        def _check_usable(self, need: str | None = None) -> None: ...

        def _run(self, coro: Coroutine[Any, Any, _T]) -> _T: ...

    def sleep(self, level: int = 1) -> None:
        """vLLM sleep; on platforms without sleep mode it only pauses scheduling (module docstring)."""
        if level not in (1, 2):
            raise ValueError(f"sleep level must be 1 (offload weights) or 2 (discard weights), got {level}")
        self._check_usable()
        if self.mode == "async":
            self._run(self._llm.sleep(level))
        else:
            with self._lock:
                self._llm.sleep(level)
        self._weights_epoch += 1  # the KV is gone (vLLM drops its prefix cache too); level 2 drops the weights
        self._asleep = {"weights", "kv_cache"}

    def wake_up(self, tags: list[str] | None = None) -> None:
        unknown = set(tags or ()) - {"weights", "kv_cache"}
        if unknown:
            raise ValueError(
                f"wake_up tags must be among ['weights', 'kv_cache'] (or None for all), got {sorted(unknown)}"
            )
        _release_cached_device_memory()
        try:
            if self.mode == "async":
                awake = self._run(self._llm.wake_up(tags))
            else:
                with self._lock:
                    awake = self._llm.wake_up(tags)
        except Exception as e:  # in-process vLLM raises cumem's RuntimeError; an engine core of its own process
            # answers a plain Exception ("Call to wake_up method failed: CUDA Error: out of memory ...")
            if "out of memory" not in str(e):
                raise
            raise RuntimeError(
                f"VLLMEngine.wake_up({tags}): the engine's memory no longer fits on the device ({e}); "
                f"{_device_memory_note()}. What the trainer holds while the engine is awake must fit beside the "
                f"engine's share: {wake_oom_hint(self._memory_share, *_device_free_total())}"
            ) from e
        self._asleep = set() if awake else self._asleep - set(tags or self._asleep)
