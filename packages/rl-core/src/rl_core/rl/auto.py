"""The settings the hardware decides (``auto``), resolved once, before any model loads.

Each of them is unset in the config that owns it, and :func:`resolve` fills it from what is there,
returning the choices with their reasons (``rl ppo``'s banner and ``--print_config`` print them; a
value the user set is never changed):

- ``strategy.zero_stage`` (None): :func:`rl_core.strategy.auto_zero_stage`: 0 on one GPU, else 2.
- ``RunConfig.packing`` (the CLI's ``data.packing``, None): packed rows where the packed attention runs
  without sdpa's dense block-diagonal mask (CUDA and torch's varlen flash-attention, or flash-attn, in
  bf16/fp16, full attention), padded rows elsewhere.
- ``model.use_liger_kernel`` (None): on where liger-kernel imports, on CUDA, for the model types it has
  kernels for.
- ``batching.max_tokens_per_gpu`` (``"auto"``): ``"memory"`` on CUDA with packed rows (each phase sizes
  its micro-batches from free device memory: :func:`rl_core.rl.batching.memory_budget`), else None
  (``--micro_train_batch_size`` rows); rows as well when ``--micro_train_batch_size`` was given.

- ``model.fused_lm_head`` (None): off, with the reason: on one H100 at Qwen2.5-0.5B's real shape the chunked
  head made the policy phase 1.15-1.31x slower than the full logits at the token budget free memory gives
  (benchmarks/policy_train_mfu.py, docs/performance.md); it buys memory, for runs that memory bounds.

Not decided here: which layers recompute (``--gradient_checkpointing_layers auto``), the log-prob kernel
(Triton wherever CUDA is).

The hardware is read in the process that resolves (:meth:`Hardware.here`): the driver of ``rl ppo`` is the
process that trains, ``rl ppo-ray``'s is assumed to have the workers' software and GPU kind (a head node
without GPUs resolves as CPU: set the values by hand there).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import rl_core.varlen_attention as varlen_attention
from rl_core.attention import requested_attention
from rl_core.strategy import auto_zero_stage


@dataclass(frozen=True)
class Hardware:
    """What :func:`resolve` decides from: a CUDA device, the trained roles' data-parallel ranks, and why
    torch's varlen kernel or liger-kernel cannot be used here (None when they can)."""

    cuda: bool
    trained_ranks: int = 1
    varlen: str | None = "not probed"
    liger: str | None = "not probed"

    @classmethod
    def here(cls, trained_ranks: int = 1) -> Hardware:
        import torch

        liger = None
        if importlib.util.find_spec("liger_kernel") is None:
            liger = "liger-kernel is not installed (pip install 'rl-core[liger]')"
        elif not torch.cuda.is_available():
            liger = "no CUDA device"
        return cls(
            cuda=torch.cuda.is_available(),
            trained_ranks=trained_ranks,
            varlen=varlen_attention.varlen_available(),
            liger=liger,
        )


@dataclass(frozen=True)
class Choice:
    """One setting the builder chose: its dotted name, the value, and why."""

    setting: str
    value: Any
    why: str

    def __str__(self) -> str:  # the value as YAML writes it
        shown = (
            "none" if self.value is None else str(self.value).lower() if isinstance(self.value, bool) else self.value
        )
        return f"{self.setting} = {shown}: {self.why}"


def _model_config(path: str | None):
    """The policy's config.json as a namespace, or None where it cannot be read yet (a hub id before the CLI
    resolves it to a local folder)."""
    if not path or not (Path(path) / "config.json").is_file():
        return None
    try:
        data = json.loads((Path(path) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    text = data.get("text_config") or {}
    return type("ModelConfig", (), {**data, **{k: v for k, v in text.items() if k not in data}})


def _liger_types() -> tuple[str, ...] | None:
    try:
        from liger_kernel.transformers.monkey_patch import MODEL_TYPE_TO_APPLY_LIGER_FN
    except Exception:  # noqa: BLE001 - any import failure means: not usable here
        return None
    return tuple(MODEL_TYPE_TO_APPLY_LIGER_FN)


def _packing(cfg, hw: Hardware, model_config, images: bool) -> tuple[bool, str]:
    attn = requested_attention(cfg.model.attn_implementation, cfg.model.flash_attn)
    if images:
        return False, "prompts with images go in padded rows"
    if not hw.cuda:
        return False, "no CUDA device: packed rows would run sdpa with a dense block-diagonal mask"
    if attn in ("sdpa", "eager"):
        return False, f"--attn_implementation {attn} would run packed rows with a dense block-diagonal mask"
    if attn is None and importlib.util.find_spec("flash_attn") is None:
        if hw.varlen is not None:
            return False, f"torch's varlen kernel cannot run: {hw.varlen}"
        if not cfg.strategy.bf16:
            return False, "fp32: torch's varlen kernel takes bf16/fp16 only"
        window = getattr(model_config, "sliding_window", None)
        if window and getattr(model_config, "use_sliding_window", True):
            return False, f"the model attends in a sliding window of {window}, which the varlen kernel skips"
    return True, "CUDA: packed rows run flash-attention over each sequence, no padding computed"


def _liger(cfg, hw: Hardware, model_config) -> tuple[bool, str]:
    if hw.liger is not None:
        return False, hw.liger
    if model_config is None:
        return True, "CUDA and liger-kernel installed (the model's type is checked when it loads)"
    kinds = _liger_types()
    model_type = getattr(model_config, "model_type", None)
    if kinds is None:
        return False, f"liger-kernel's kernel table does not import, so none for model type {model_type!r}"
    if model_type not in kinds:
        return False, f"liger-kernel has no kernels for model type {model_type!r}"
    return True, f"CUDA: liger-kernel's fused RMSNorm / SwiGLU / RoPE for {model_type} (0.79x the step time)"


def _fused_head(hw: Hardware) -> tuple[bool, str]:
    if not hw.cuda:
        return False, "no CUDA device: the full logits cost no more time than the chunked head there"
    return False, (
        "the chunked head made the policy phase 1.15-1.31x slower at Qwen2.5-0.5B's shape on one H100 "
        "(benchmarks/policy_train_mfu.py, docs/performance.md): it buys memory, not time; set it where memory "
        "bounds the run"
    )


def resolve(cfg, hw: Hardware, *, given: frozenset[str] | None = None, images: bool = False):
    """``(cfg, choices)``: the RunConfig with every auto setting decided (none is left ``auto``, so resolving again
    changes nothing), and what was decided, with why. ``given``: the dotted settings the user set (the CLI's
    command line and YAML); None (a Python caller): a ``micro_train_batch_size`` other than 1 counts as given.
    ``images``: the prompts carry images."""

    choices: list[Choice] = []
    model, strategy, batching, packing = cfg.model, cfg.strategy, cfg.batching, cfg.packing
    model_config = _model_config(model.pretrain)
    if strategy.zero_stage is None:
        stage, why = auto_zero_stage(
            strategy,
            cuda=hw.cuda,
            world_size=hw.trained_ranks,
            needs_zero="--deepspeed_enable_sleep" if cfg.ppo.deepspeed_enable_sleep else None,
        )
        strategy = dataclasses.replace(strategy, zero_stage=stage)
        choices.append(Choice("strategy.zero_stage", stage, why))
    if packing is None:
        packing, why = _packing(cfg, hw, model_config, images)
        choices.append(Choice("data.packing", packing, why))
    if model.use_liger_kernel is None:
        on, why = _liger(cfg, hw, model_config)
        model = dataclasses.replace(model, use_liger_kernel=on)
        choices.append(Choice("model.use_liger_kernel", on, why))
    if model.fused_lm_head is None:
        on, why = _fused_head(hw)
        model = dataclasses.replace(model, fused_lm_head=on)
        choices.append(Choice("model.fused_lm_head", on, why))
    if batching.max_tokens_per_gpu == "auto":
        rows = strategy.micro_train_batch_size != 1 if given is None else "strategy.micro_train_batch_size" in given
        if hw.cuda and packing and not rows:
            value, why = "memory", "CUDA, packed rows: each phase's token budget from free device memory"
        else:
            value = None
            why = (
                f"--micro_train_batch_size {strategy.micro_train_batch_size} given"
                if rows
                else "no CUDA device"
                if not hw.cuda
                else "padded rows"
            )
            why += f", so micro-batches of --micro_train_batch_size {strategy.micro_train_batch_size}"
        batching = dataclasses.replace(batching, max_tokens_per_gpu=value)
        choices.append(Choice("batching.max_tokens_per_gpu", value, why))
    out = dataclasses.replace(cfg, model=model, strategy=strategy, batching=batching, packing=packing)
    return out, tuple(choices)
