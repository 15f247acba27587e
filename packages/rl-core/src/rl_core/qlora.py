"""QLoRA: the trained roles' base weights loaded in 4 bits (bitsandbytes NF4 / FP4), LoRA adapters trained over them.

``--load_in_4bit`` (OpenRLHF's flag) turns on :class:`Load4bitConfig`, a node of the model settings of ``rl sft |
rm | dpo | kto`` and ``rl ppo | ppo-ray``. It needs ``--lora_rank`` (a 4-bit weight cannot train) and ZeRO 0-2
(ZeRO-3 cannot partition bitsandbytes' packed weights); both refused before a model loads (:meth:`check`).

What carries the quantization through the stack:

- loading (:func:`from_pretrained_kwargs`): transformers' ``BitsAndBytesConfig``, the compute dtype the run's
  (bf16 or fp32), every ``nn.Linear`` but the LM head packed to 4 bits, placed on this rank's device;
- the full weights anything reads (the weight sync to the engines, verify, exports, EMA copies):
  :func:`full_weight` dequantizes a packed weight where :func:`rl_core.ds_internals._gather_bucket` copies
  parameters, so the engines and the exported model hold ``dequant(W4) + scale * B @ A``, exactly what the policy
  computes with (the engines load the unquantized checkpoint first, so the trainer pushes version 0 before the
  first generation: ``PPOTrainer(sync_first=True)``);
- saving (:func:`saving_unquantized`): the exported folder is a plain bf16 / fp32 model (merged), its config.json
  without ``quantization_config``; the adapter beside it as with LoRA.

The reference of an RL run loads the same 4-bit base (its log-probs then match the policy's at step 0); reward
models and distillation teachers load unquantized. This module's top stays free of torch: ``rl ppo --help``
builds its flags from :class:`Load4bitConfig`.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

from rl_rollout.config_fields import meta

QUANT_TYPES = ("nf4", "fp4")
INSTALL = "pip install 'bitsandbytes>=0.46' (or the rl-core[qlora] extra)"


@dataclass(frozen=True)
class Load4bitConfig:
    """4-bit base weights for LoRA training (bitsandbytes; on with ``--load_in_4bit``)."""

    bnb_4bit_quant_type: str = field(
        default="nf4",
        metadata=meta("the 4-bit data type: nf4 (normal float, QLoRA's) | fp4"),
    )
    bnb_4bit_use_double_quant: bool = field(
        default=True,
        metadata=meta("quantize the quantization constants too (QLoRA's double quantization: ~0.4 bit a weight less)"),
    )

    def __post_init__(self) -> None:
        if self.bnb_4bit_quant_type not in QUANT_TYPES:
            raise ValueError(
                f"--bnb_4bit_quant_type {self.bnb_4bit_quant_type!r} is not a 4-bit type; give {' or '.join(QUANT_TYPES)}"
            )

    def check(self, *, lora_rank: int, zero_stage: int | None = None) -> None:
        """ValueError, one line naming the flag and the fix, for what 4-bit loading cannot do."""
        if lora_rank <= 0:
            raise ValueError(
                "--load_in_4bit trains LoRA adapters over a frozen 4-bit base: add --lora_rank N (e.g. --lora_rank 16), "
                "or drop --load_in_4bit to train every weight"
            )
        if zero_stage == 3:
            raise ValueError(
                "--load_in_4bit with --zero_stage 3: ZeRO-3 cannot partition bitsandbytes' packed 4-bit weights; use "
                "--zero_stage 2 (only the adapter trains, its optimizer state is small), or drop --load_in_4bit"
            )


def require_bitsandbytes():
    """The bitsandbytes module, or an ImportError naming the install."""
    try:
        # lazy: bitsandbytes is an optional dependency (rl-core[qlora]), needed only with --load_in_4bit
        import bitsandbytes
    except ImportError as e:
        raise ImportError(f"--load_in_4bit needs bitsandbytes, which is not installed: {INSTALL} ({e})") from e
    return bitsandbytes


def from_pretrained_kwargs(cfg: Load4bitConfig, dtype) -> dict:
    """What transformers' ``from_pretrained`` takes to load a model's linear layers in 4 bits, computing in
    ``dtype`` (a torch dtype), on this process's accelerator (its current CUDA device) or the CPU."""
    require_bitsandbytes()
    # lazy: torch and transformers are heavy; this module's config is read by `rl ppo --help`
    import torch
    from transformers import BitsAndBytesConfig

    device = torch.cuda.current_device() if torch.cuda.is_available() else "cpu"
    quant = BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type=cfg.bnb_4bit_quant_type,
        bnb_4bit_use_double_quant=cfg.bnb_4bit_use_double_quant,
        bnb_4bit_compute_dtype=dtype,
        bnb_4bit_quant_storage=torch.uint8,
    )
    return {"quantization_config": quant, "device_map": {"": device}}


def prepare(model) -> int:
    """After loading: keep every 4-bit weight in bitsandbytes' standard layout. On a CPU with AVX512-BF16,
    bitsandbytes repacks a weight in place at its first no-grad forward in eval mode (its CPU kernel's layout),
    which :func:`full_weight` cannot read back exactly (its inverse is best-effort); the weight sync, verify and
    the exports read every weight at every version, so the repacking is turned off. Returns the 4-bit layers."""
    n = 0
    for module in model.modules():
        if hasattr(module, "support_avx512bf16_for_cpu"):  # bitsandbytes' Linear4bit
            module.support_avx512bf16_for_cpu = False
            n += 1
    return n


def is_4bit(p) -> bool:
    """A bitsandbytes packed 4-bit parameter (it carries its quantization state)."""
    return getattr(p, "quant_state", None) is not None and getattr(p, "bnb_quantized", True)


def full_weight(p):
    """The values a packed 4-bit parameter stands for, in its original dtype and shape (a fresh tensor)."""
    # lazy: bitsandbytes is optional; a packed parameter exists only where it was imported to load the model
    from bitsandbytes.functional import dequantize_4bit

    state = p.quant_state
    if getattr(state, "packing_format_for_cpu", False):  # prepare() keeps it from happening
        raise RuntimeError(
            "a 4-bit weight is in bitsandbytes' CPU-packed layout, which cannot be read back exactly; load the model "
            "through rl_core (qlora.prepare turns the repacking off)"
        )
    return dequantize_4bit(p.data, state).to(state.dtype).reshape(state.shape)


def full_numel(p) -> int:
    """How many values a packed 4-bit parameter stands for (two a byte)."""
    return int(p.quant_state.shape.numel())


@contextlib.contextmanager
def saving_unquantized(model):
    """Within it, ``model.save_pretrained(path, state_dict=full)`` writes ``full`` (the dequantized, merged
    weights) as a plain model: transformers' 4-bit quantizer (which would save the packed weights of the module
    instead) and the config's ``quantization_config`` are set aside, then put back. A model that is not quantized
    passes through."""
    quantizer = getattr(model, "hf_quantizer", None)
    config = getattr(model, "config", None)
    quant = getattr(config, "quantization_config", None)
    if quantizer is None and quant is None:
        yield model
        return
    model.hf_quantizer = None
    if quant is not None:
        del config.quantization_config
    try:
        yield model
    finally:
        model.hf_quantizer = quantizer
        if quant is not None:
            config.quantization_config = quant
