"""Device memory around a vLLM engine's sleep and wake-up: torch's cached blocks handed back before the engine
maps its memory, what is free, and the one-line hint an out-of-memory wake-up gets (which share to lower)."""

from __future__ import annotations

import torch


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
