"""Liger kernels on a loaded transformers model: fused RMSNorm, SwiGLU MLP and RoPE
(liger-kernel's Triton kernels, the optional extra ``rl-core[liger]``; issue 18 item 3).

Owns only the switch (``use_liger_kernel`` on the model loaders, OpenRLHF's
``--use_liger_kernel``). The losses are left alone: liger's cross-entropy and fused
linear cross-entropy patches are off, because the trainers need per-token log-probs
(``rl_algos.logprobs_from_logits``, a Triton kernel on CUDA), not a mean loss.

The RoPE patch replaces the architecture's module-level ``apply_rotary_pos_emb`` in
transformers, so it applies to every model of that architecture in the process once
one is loaded with liger (the same function, computed by a fused kernel).
"""

from __future__ import annotations

import importlib.util

import torch
from torch import nn

LIGER_KWARGS = {
    "rope": True,
    "rms_norm": True,
    "swiglu": True,
    "cross_entropy": False,
    "fused_linear_cross_entropy": False,
}


def require_liger() -> None:
    """A one-line error unless liger-kernel imports and torch sees a CUDA device."""
    if importlib.util.find_spec("liger_kernel") is None:
        reason = "liger-kernel is not installed (pip install 'rl-core[liger]', or liger-kernel>=0.8)"
    elif not torch.cuda.is_available():
        reason = "liger-kernel's Triton kernels need a CUDA device and torch sees none"
    else:
        return
    raise RuntimeError(f"use_liger_kernel (--use_liger_kernel): {reason}; drop the flag or install it")


def apply_liger_kernel(model: nn.Module) -> nn.Module:
    """Patch ``model`` (a transformers ``PreTrainedModel``, before peft wraps it) in place."""
    require_liger()
    from liger_kernel.transformers.monkey_patch import MODEL_TYPE_TO_APPLY_LIGER_FN, _apply_liger_kernel_to_instance

    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if model_type not in MODEL_TYPE_TO_APPLY_LIGER_FN:
        raise ValueError(
            f"use_liger_kernel: liger-kernel has no kernels for model type {model_type!r}; drop "
            f"--use_liger_kernel (supported: {', '.join(sorted(MODEL_TYPE_TO_APPLY_LIGER_FN))})"
        )
    _apply_liger_kernel_to_instance(model, **LIGER_KWARGS)
    return model
