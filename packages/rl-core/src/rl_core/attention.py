"""Which attention implementation transformers models load with.

flash_attention_2 when the ``flash_attn`` package is importable (it builds against CUDA),
torch's ``sdpa`` otherwise. The choice is logged once per process, so a run's log says
which kernel trained it.
"""

from __future__ import annotations

import functools
import importlib.util
import logging

logger = logging.getLogger(__name__)

VALID = ("flash_attention_2", "sdpa", "eager")


@functools.lru_cache(maxsize=None)
def _log_choice(choice: str, reason: str) -> None:
    logger.info("attention implementation: %s (%s)", choice, reason)


def attention_implementation(requested: str | None = None) -> str:
    """The ``attn_implementation`` to pass to ``from_pretrained``.

    ``requested=None`` picks flash_attention_2 if ``flash_attn`` is importable, else sdpa.
    Asking for flash_attention_2 without the package fails with the fix.
    """
    has_flash = importlib.util.find_spec("flash_attn") is not None
    if requested is None:
        choice = "flash_attention_2" if has_flash else "sdpa"
        _log_choice(choice, "flash_attn importable" if has_flash else "flash_attn not installed")
        return choice
    if requested not in VALID:
        raise ValueError(f"unknown attention implementation {requested!r}; valid: {', '.join(VALID)}")
    if requested == "flash_attention_2" and not has_flash:
        raise ValueError(
            "attention implementation flash_attention_2 (--flash_attn) needs the flash-attn package, "
            "which is not importable here; install it (pip install flash-attn, CUDA only) or drop --flash_attn "
            "to use sdpa"
        )
    _log_choice(requested, "requested")
    return requested
