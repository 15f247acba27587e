"""The four training commands of ``rl sft | rm | dpo | kto``: the model flags they share (:class:`ModelArgs`) and,
per command (:data:`COMMANDS`), its trainer config class, its dataset class and how to build its trainer from the
loaded models. :mod:`rl_cli.train` parses the flags and runs them; it re-exports these names.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass, field

from rl_cli.errors import CliArgs
from rl_core.qlora import Load4bitConfig
from rl_rollout.config_fields import check_numbers, meta


@dataclass(frozen=True)
class ModelArgs:
    """Which model folders to load, and how (OpenRLHF flag names)."""

    pretrain: str | None = field(
        default=None,
        metadata=meta(
            "the model to train: a local HF folder, or a hub id (org/name) in the local HF cache (HF_HOME, HF_HUB_CACHE)"
        ),
    )
    ref_pretrain: str | None = field(
        default=None, metadata=meta("reference for DPO/KTO, a folder or a cached hub id (default: --pretrain)")
    )
    flash_attn: bool = field(default=False, metadata=meta("flash_attention_2 (needs flash-attn; default sdpa)"))
    attn_implementation: str | None = field(
        default=None,
        metadata=meta(
            "the attention kernel: sdpa | eager | flash_attention_2 | torch_varlen | flex_attention (default: "
            "flash-attn when importable, else sdpa); with --packing_samples, torch_varlen / flex_attention skip sdpa's "
            "dense block-diagonal mask (CUDA; rl-core README)",
            openrlhf=("ds.attn_implementation",),
        ),
    )
    use_liger_kernel: bool = field(
        default=False,
        metadata=meta("liger-kernel's fused RMSNorm / SwiGLU / RoPE on the model (CUDA; the rl-core[liger] extra)"),
    )
    experts_implementation: str | None = field(
        default=None,
        metadata=meta(
            "MoE expert kernels, passed to transformers' from_pretrained: eager | batched_mm | grouped_mm | deepgemm "
            "(default: transformers' choice, grouped_mm where it runs, else eager); the trained and frozen models",
            openrlhf=("ds.experts_implementation",),
        ),
    )
    fused_lm_head: bool = field(
        default=False,
        metadata=meta(
            "the LM head and the token log-probs computed together, chunk by chunk: the [tokens, vocabulary] logits are "
            "never held whole (rl_algos.logprobs_from_hidden; one more LM-head matmul in backward); sft, dpo and kto, "
            "Llama / Mistral / Qwen2 / Qwen3 / Mixtral text models, not with --zero_stage 3"
        ),
    )
    lora_rank: int = field(default=0, metadata=meta(">0 trains a LoRA adapter (peft) instead of all weights"))
    lora_alpha: int = field(default=16, metadata=meta("LoRA scaling alpha"))
    lora_dropout: float = field(default=0.0, metadata=meta("LoRA dropout"))
    target_modules: str = field(default="all-linear", metadata=meta("comma-separated module names or all-linear"))
    load_in_4bit: Load4bitConfig | None = field(
        default=None,
        metadata={
            **meta(
                "QLoRA: the model's base weights (and a DPO/KTO reference's) loaded in 4 bits (bitsandbytes), LoRA "
                "adapters (--lora_rank) trained over them; the saved model is the dequantized base plus the adapter, "
                "merged, unquantized (the adapter beside it); ZeRO 0-2",
                openrlhf=("ds.load_in_4bit",),
            ),
            "switch": True,
        },
    )

    def __post_init__(self) -> None:
        if self.lora_rank < 0:
            raise ValueError(f"lora_rank (--lora_rank) must be >= 0, got {self.lora_rank}")
        if self.load_in_4bit is not None:
            self.load_in_4bit.check(lora_rank=self.lora_rank)
        check_numbers(self, at_least_1=("lora_alpha",), unit=("lora_dropout",))
        # lazy: rl-core (numpy, the hub, its models); `rl --help` imports this module for the command list and stays light
        from rl_core.attention import requested_attention

        requested_attention(self.attn_implementation, self.flash_attn)

    def lora(self):
        # lazy: rl-core (numpy, the hub, its models); `rl --help` imports this module for the command list and stays light
        from rl_core.models import LoraSpec

        return LoraSpec.of(self.lora_rank, self.lora_alpha, self.lora_dropout, self.target_modules)


@dataclass(frozen=True)
class Command:
    name: str
    help: str
    config_cls: Callable[[], type]
    dataset_cls: Callable[[], type]
    build: Callable  # (strategy, configs, tokenizer, dataset, train_cfg, eval_dataset or None) -> Trainer


def _load_kw(cfgs: dict, strategy_cfg) -> dict:
    # lazy: rl-core (numpy, the hub, its models); `rl --help` imports this module for the command list and stays light
    from rl_core.attention import requested_attention

    model = cfgs["model"]
    attn = requested_attention(model.attn_implementation, model.flash_attn)
    return {
        "dtype": "bf16" if strategy_cfg.bf16 else "fp32",
        # ring attention: every model of the run computes its slice of each row (rl_core.ring_attention)
        "attn_implementation": "rl_ring" if strategy_cfg.ring_attn_size > 1 else attn,
        "gradient_checkpointing": strategy_cfg.gradient_checkpointing,
        "lora": model.lora(),
        "use_liger_kernel": model.use_liger_kernel,
        "packed": bool(getattr(cfgs.get("data"), "packing", False)),  # the default attention for packed rows
        "experts_implementation": model.experts_implementation,
        "load_in_4bit": model.load_in_4bit,  # QLoRA (rl_core.qlora)
    }


def _build_sft(strategy, cfgs, tok, ds, train, eval_ds):
    # lazy: rl-core (numpy, the hub, its models); `rl --help` imports this module for the command list and stays light
    from rl_core.models import Actor
    from rl_core.trainers import SFTTrainer

    m = cfgs["model"]
    kw = {**_load_kw(cfgs, strategy.cfg), "fused_lm_head": m.fused_lm_head}
    if train.kd is not None:  # knowledge distillation: a frozen teacher beside the student (rl_core.trainers.sft_kd)
        # lazy: rl-core (numpy, the hub, its models); `rl --help` imports this module for the command list and stays light
        from rl_core.models import frozen
        from rl_core.trainers.sft_kd import KDSFTTrainer

        # the teacher is its own model: unquantized under --load_in_4bit, as in the RL loop
        teacher_kw = {**kw, "lora": None, "gradient_checkpointing": False, "fused_lm_head": False, "load_in_4bit": None}
        teacher = frozen(Actor.from_pretrained(train.kd.teacher_pretrain, **teacher_kw))
        student = Actor.from_pretrained(m.pretrain, **kw)
        return KDSFTTrainer(strategy, student, teacher, tok, ds, train, eval_dataset=eval_ds, logger=cfgs["logger"])
    return SFTTrainer(
        strategy, Actor.from_pretrained(m.pretrain, **kw), tok, ds, train, eval_dataset=eval_ds, logger=cfgs["logger"]
    )


def _build_rm(strategy, cfgs, tok, ds, train, eval_ds):
    # lazy: rl-core (numpy, the hub, its models); `rl --help` imports this module for the command list and stays light
    from rl_core.models import RewardModel
    from rl_core.trainers import RewardModelTrainer

    m = cfgs["model"]
    return RewardModelTrainer(
        strategy,
        RewardModel.from_pretrained(m.pretrain, **_load_kw(cfgs, strategy.cfg)),
        tok,
        ds,
        train,
        eval_dataset=eval_ds,
        logger=cfgs["logger"],
    )


def _with_reference(trainer_name: str):
    def build(strategy, cfgs, tok, ds, train, eval_ds):
        # lazy: rl-core (numpy, the hub, its models); `rl --help` imports this module for the command list and stays light
        from rl_core import trainers
        from rl_core.models import Actor, frozen

        m = cfgs["model"]
        kw = {**_load_kw(cfgs, strategy.cfg), "fused_lm_head": m.fused_lm_head}
        ref = frozen(
            Actor.from_pretrained(m.ref_pretrain or m.pretrain, **{**kw, "lora": None, "gradient_checkpointing": False})
        )
        return getattr(trainers, trainer_name)(
            strategy,
            Actor.from_pretrained(m.pretrain, **kw),
            ref,
            tok,
            ds,
            train,
            eval_dataset=eval_ds,
            logger=cfgs["logger"],
        )

    return build


def _cls(module: str, name: str):
    def get():
        return getattr(importlib.import_module(module), name)

    return get


COMMANDS = {
    "sft": Command(
        "sft",
        "supervised fine-tuning",
        _cls("rl_core.trainers.configs", "SFTConfig"),
        _cls("rl_core.data", "SFTDataset"),
        _build_sft,
    ),
    "rm": Command(
        "rm",
        "reward model (pairwise)",
        _cls("rl_core.trainers.configs", "RMConfig"),
        _cls("rl_core.data", "PreferenceDataset"),
        _build_rm,
    ),
    "dpo": Command(
        "dpo",
        "direct preference optimization (DPO, IPO, cDPO)",
        _cls("rl_core.trainers.configs", "DPOConfig"),
        _cls("rl_core.data", "PreferenceDataset"),
        _with_reference("DPOTrainer"),
    ),
    "kto": Command(
        "kto",
        "Kahneman-Tversky optimization",
        _cls("rl_core.trainers.configs", "KTOConfig"),
        _cls("rl_core.data", "KTODataset"),
        _with_reference("KTOTrainer"),
    ),
}


def _groups(cmd: Command) -> dict[str, type]:
    # lazy: rl-core (numpy, the hub, its models); `rl --help` imports this module for the command list and stays light
    from rl_core.data import DataConfig
    from rl_core.metrics import LoggerConfig
    from rl_core.strategy_config import StrategyConfig

    return {
        "model": ModelArgs,
        "data": DataConfig,
        "strategy": StrategyConfig,
        "train": cmd.config_cls(),
        "logger": LoggerConfig,
        "cli": CliArgs,
    }
