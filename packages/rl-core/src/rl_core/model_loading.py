"""Loading a model for training: a local transformers folder checked, its dtype and attention kernel chosen,
liger kernels, gradient checkpointing, LoRA (peft) over a 4-bit base or not (:mod:`rl_core.qlora`), the MoE check, and OpenRLHF's reward/critic head read from
its weights. :mod:`rl_core.models` (Actor) and :mod:`rl_core.scalar_models` (Critic, RewardModel) load
through :func:`_load`."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from rl_core import qlora
from rl_core.attention import attention_implementation
from rl_core.liger import apply_liger_kernel, require_liger
from rl_core.preflight import InputError
from rl_core.qlora import Load4bitConfig
from rl_core.ring_attention import register

Tensor = torch.Tensor
HEAD_FILE, HEAD_META = "rl_head.safetensors", "rl_head.json"


@dataclass(frozen=True)
class LoraSpec:
    """peft LoRA settings (OpenRLHF flags ``--lora_rank``, ``--lora_alpha``, ``--target_modules``)."""

    rank: int = 0
    alpha: int = 16
    dropout: float = 0.0
    target_modules: tuple[str, ...] | str = "all-linear"

    @classmethod
    def of(cls, rank: int, alpha: int, dropout: float, target_modules: str) -> LoraSpec | None:
        """From the flags (``--target_modules`` names joined by commas, or ``all-linear``); None for rank 0."""
        if rank < 0:
            raise ValueError(f"lora_rank (--lora_rank) must be >= 0, got {rank}")
        if rank == 0:
            return None
        mods = (
            target_modules
            if target_modules == "all-linear"
            else tuple(m.strip() for m in target_modules.split(",") if m.strip())
        )
        if not mods:
            raise ValueError(
                f"--target_modules {target_modules!r} names no module; give module names joined by "
                f"commas (q_proj,v_proj) or all-linear"
            )
        return cls(rank, alpha, dropout, mods)


def _dtype(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    table = {
        "bf16": torch.bfloat16,
        "bfloat16": torch.bfloat16,
        "fp32": torch.float32,
        "float32": torch.float32,
        "fp16": torch.float16,
        "float16": torch.float16,
    }
    if name not in table:
        raise ValueError(f"unknown dtype {name!r}; valid: {', '.join(table)}")
    return table[name]


def _check_folder(path: str | Path) -> Path:
    p = Path(path)
    if not (p / "config.json").is_file():
        raise FileNotFoundError(
            f"{p} is not a transformers model folder (no config.json); pass --pretrain a local folder saved "
            f"with save_pretrained (this stack never downloads weights at run time)"
        )
    return p


def _load(
    auto_cls,
    path,
    dtype,
    attn,
    gradient_checkpointing,
    lora: LoraSpec | None,
    use_liger_kernel: bool = False,
    packed: bool = False,
    experts_implementation: str | None = None,
    load_in_4bit: Load4bitConfig | None = None,
):
    if use_liger_kernel:
        require_liger()  # before the weights load, not after
    model_config = None
    if attn is None and packed:  # the default for packed rows depends on the model's attention (sliding window)
        from transformers import AutoConfig

        model_config = AutoConfig.from_pretrained(_check_folder(path))
    if attn == "rl_ring":  # ring attention (rl_core.ring_attention): every role of a run with --ring_attn_size > 1
        impl = register()
    else:
        impl = attention_implementation(attn, packed=packed, dtype=dtype, model_config=model_config)
    extra = {"experts_implementation": experts_implementation} if experts_implementation else {}
    if load_in_4bit is not None:  # QLoRA: every linear layer but the LM head packed to 4 bits (rl_core.qlora)
        extra.update(qlora.from_pretrained_kwargs(load_in_4bit, _dtype(dtype)))
    try:
        model = auto_cls.from_pretrained(_check_folder(path), dtype=_dtype(dtype), attn_implementation=impl, **extra)
    except ValueError as e:
        if extra and "experts_implementation" in str(e):  # transformers' own check, which lists the valid ones
            raise InputError(f"--experts_implementation {experts_implementation}: {e}") from e
        raise
    if load_in_4bit is not None:
        qlora.prepare(model)
    if use_liger_kernel:
        apply_liger_kernel(model)
    if gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.config.use_cache = False
    if lora is not None and lora.rank > 0:
        model = _lora(model, lora)
    return model


def _lora(model, lora: LoraSpec, language_model_only: bool = False):
    """``model`` wrapped in peft's LoRA. ``language_model_only`` (a VLM under ``--freeze_visual_encoder``): no
    adapter outside the language model and the LM head, so the frozen vision tower and projector stay frozen (peft
    would put trainable adapters on their linear layers too, e.g. with ``all-linear``)."""
    from peft import LoraConfig, get_peft_model

    exclude = None
    if language_model_only:
        exclude = [
            n
            for n, m in model.named_modules()
            if n and isinstance(m, torch.nn.Linear) and "language_model" not in n and "lm_head" not in n
        ]
    model.enable_input_require_grads()
    return get_peft_model(
        model,
        LoraConfig(
            r=lora.rank,
            lora_alpha=lora.alpha,
            lora_dropout=lora.dropout,
            target_modules=lora.target_modules if isinstance(lora.target_modules, str) else list(lora.target_modules),
            exclude_modules=exclude or None,
            bias="none",
        ),
    )  # peft's type: a list


def check_moe_aux_loss(config) -> None:
    """Raises ValueError (one line) unless the transformers ``config`` is a mixture of experts whose forward
    returns the router's load-balancing loss (``output_router_logits``, as OpenRLHF checks)."""
    if "output_router_logits" not in config.to_dict():
        raise ValueError(
            f"--aux_loss_coef is the MoE load-balancing loss, but the model ({config.model_type}) is "
            f"not a mixture of experts (its config has no output_router_logits); drop --aux_loss_coef "
            f"or give 0"
        )


def _openrlhf_head(path: Path, prefix: str) -> Tensor | None:
    """``<prefix>.weight`` from a model folder's safetensors (one file or an index of shards), or None."""
    from safetensors import safe_open

    name = f"{prefix}.weight"
    index = path / "model.safetensors.index.json"
    if index.is_file():
        shard = json.loads(index.read_text()).get("weight_map", {}).get(name)
        files = [path / shard] if shard else []
    else:
        files = sorted(path.glob("*.safetensors"))
    for f in files:
        with safe_open(str(f), framework="pt") as st:
            if name in st.keys():
                return st.get_tensor(name).float()
    return None
