"""Which attention implementation transformers models load with.

flash_attention_2 when the ``flash_attn`` package is importable (it builds against CUDA),
torch's ``sdpa`` otherwise. The choice is logged once per process, so a run's log says
which kernel trained it. Asked for by name, two more run packed rows (``position_ids``
restarting at 0) without sdpa's dense block-diagonal mask: ``torch_varlen`` (torch's own
flash-attention varlen kernel, :mod:`rl_core.varlen_attention`; CUDA, bf16) and transformers'
``flex_attention`` (a block-sparse mask; compiled, CUDA for training).
"""

from __future__ import annotations

import functools
import importlib.util
import logging

import rl_core.varlen_attention as varlen_attention
from rl_core.preflight import InputError

logger = logging.getLogger(__name__)

VALID = ("flash_attention_2", "sdpa", "eager", "torch_varlen", "flex_attention")


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


@functools.cache
def _log_choice(choice: str, reason: str) -> None:
    logger.info("attention implementation: %s (%s)", choice, reason)


def requested_attention(attn_implementation: str | None, flash_attn: bool = False) -> str | None:
    """What a config's ``--attn_implementation`` / ``--flash_attn`` ask for (None: the default), checked."""
    if attn_implementation is not None and attn_implementation not in VALID:
        raise ValueError(f"--attn_implementation {attn_implementation!r} is not built; use one of {', '.join(VALID)}")
    if flash_attn and attn_implementation not in (None, "flash_attention_2"):
        raise ValueError(f"--flash_attn and --attn_implementation {attn_implementation} disagree; pass one of them")
    return attn_implementation or ("flash_attention_2" if flash_attn else None)


def _packed_default(dtype: str | None, model_config) -> tuple[str, str]:
    """The default for a model that will see packed rows, and why: torch_varlen where it runs (CUDA, bf16/fp16, a
    varlen kernel in this torch, full attention: a sliding window would need the mask varlen skips), else sdpa."""
    if (why := varlen_attention.varlen_available()) is not None:
        return "sdpa", f"packed rows, but {why}"
    if dtype not in ("bf16", "fp16"):
        return "sdpa", f"packed rows in {dtype}: torch's varlen kernel takes bf16/fp16 only"
    window = getattr(model_config, "sliding_window", None)
    if window and getattr(model_config, "use_sliding_window", True):
        return "sdpa", f"packed rows, but the model attends in a sliding window of {window}"
    return "torch_varlen", (
        "packed rows on CUDA in bf16, flash-attn not installed: torch's varlen kernel (3.6x sdpa's "
        "masked path on a packed 0.5B train step, H200; --attn_implementation sdpa to opt out)"
    )


def attention_implementation(
    requested: str | None = None, *, packed: bool = False, dtype: str | None = None, model_config=None
) -> str:
    """The ``attn_implementation`` to pass to ``from_pretrained``.

    ``requested=None`` picks flash_attention_2 if ``flash_attn`` is importable, else, for a model that will see
    packed rows (``packed``, with its ``dtype`` and ``model_config``), torch_varlen where it can run, else sdpa.
    Asking for flash_attention_2 without the package, or torch_varlen / flex_attention without
    CUDA, fails with the fix. torch_varlen is registered with transformers before it is returned.
    """
    has_flash = importlib.util.find_spec("flash_attn") is not None
    if requested is None:
        if has_flash:
            choice, why = "flash_attention_2", "flash_attn importable"
        elif packed:
            choice, why = _packed_default(dtype, model_config)
        else:
            choice, why = "sdpa", "flash_attn not installed"
        if choice == "torch_varlen":
            varlen_attention.register()
        _log_choice(choice, why)
        return choice
    if requested not in VALID:
        raise ValueError(f"unknown attention implementation {requested!r}; valid: {', '.join(VALID)}")

    if requested == "flash_attention_2" and not has_flash:
        raise InputError(
            "attention implementation flash_attention_2 (--flash_attn, or --attn_implementation / OpenRLHF's "
            "--ds.attn_implementation flash_attention_2) needs the flash-attn package, which is not importable "
            "here; install it (pip install flash-attn, CUDA only), or drop that flag / pass --attn_implementation "
            "sdpa"
        )
    if requested == "torch_varlen":
        if (unusable := varlen_attention.varlen_available()) is not None:
            raise InputError(
                f"attention implementation torch_varlen cannot run here: {unusable}; use sdpa "
                f"(--attn_implementation sdpa) on this machine"
            )
        varlen_attention.register()
    if requested == "flex_attention" and not _cuda():
        raise InputError(
            "attention implementation flex_attention needs a CUDA device here (torch's FlexAttention "
            "has no CPU backward); use sdpa (--attn_implementation sdpa) on this machine"
        )
    _log_choice(requested, "requested")
    return requested
