"""The RL run's models (:class:`RLModelConfig`): which folders each role loads and how, apart from
:mod:`rl_core.rl.build` (which builds the run with torch) so that ``rl ppo --help`` builds its flags without
importing torch; its checks import what they need when a config is made.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from rl_core.qlora import Load4bitConfig
from rl_rollout.config_fields import check_numbers, meta


@dataclass(frozen=True)
class RLModelConfig:
    """The RL run's models: local HF folders (the CLI resolves cached hub ids to them; nothing is downloaded)."""

    pretrain: str | None = field(
        default=None,
        metadata=meta(
            "the policy to train: a local HF folder, or a hub id (org/name) in the local HF cache (HF_HOME, "
            "HF_HUB_CACHE)",
            openrlhf=("actor.model_name_or_path",),
        ),
    )
    critic_pretrain: str | None = field(
        default=None,
        metadata=meta(
            "critic init for gae (default: --reward_pretrain, else --pretrain)", openrlhf=("critic.model_name_or_path",)
        ),
    )
    reward_pretrain: str | None = field(
        default=None,
        metadata=meta(
            "a reward model folder (rl rm's output), or a cached hub id", openrlhf=("reward.model_name_or_path",)
        ),
    )
    ref_pretrain: str | None = field(default=None, metadata=meta("reference policy (default: --pretrain)"))
    flash_attn: bool = field(default=False, metadata=meta("flash_attention_2 (needs flash-attn; default sdpa)"))
    attn_implementation: str | None = field(
        default=None,
        metadata=meta(
            "sdpa | eager | flash_attention_2 | torch_varlen | flex_attention (default: flash_attention_2 if "
            "flash-attn is importable, else sdpa); with --packing, torch_varlen / flex_attention run packed rows "
            "without sdpa's dense block-diagonal mask (CUDA)",
            openrlhf=("ds.attn_implementation",),
        ),
    )
    use_liger_kernel: bool | None = field(
        default=None,
        metadata=meta(
            "liger-kernel's fused RMSNorm / SwiGLU / RoPE on every trained and frozen model (CUDA; rl-core[liger]); "
            "unset (auto): on where liger-kernel is installed, on CUDA, for the model types it has kernels for"
        ),
    )
    experts_implementation: str | None = field(
        default=None,
        metadata=meta(
            "MoE expert kernels, passed to transformers' from_pretrained: eager | batched_mm | grouped_mm | deepgemm "
            "(default: transformers' choice, grouped_mm where it runs, else eager); the trained and frozen models",
            openrlhf=("ds.experts_implementation",),
        ),
    )
    fused_lm_head: bool | None = field(
        default=None,
        metadata=meta(
            "the policy's and the reference's LM head and token log-probs computed together, chunk by chunk: the "
            "[tokens, vocabulary] logits are never held whole (rl_algos.logprobs_from_hidden; one more LM-head matmul "
            "in backward); Llama / Mistral / Qwen2 / Qwen3 / Mixtral text models, not with --zero_stage 3; unset "
            "(auto): off (on one H100 it made the policy phase slower at a real shape: it buys memory, not time)"
        ),
    )
    normalize_reward: bool = field(
        default=True, metadata=meta("apply the reward model's stored mean/std", openrlhf=("reward.normalize_enable",))
    )
    value_head_prefix: str | None = field(
        default=None,
        metadata=meta(
            "the head of an OpenRLHF-format reward model or critic folder: <prefix>.weight in its weights (default: "
            "its config.json's value_head_prefix, else score); rl rm's folders keep theirs in rl_head.safetensors",
            openrlhf=("ds.value_head_prefix",),
        ),
    )
    lora_rank: int = field(
        default=0,
        metadata=meta(
            ">0 trains LoRA adapters (peft) on the policy and the critic instead of all weights; the engines get "
            "the merged weights, the reference is the frozen base"
        ),
    )
    lora_alpha: int = field(default=16, metadata=meta("LoRA scaling alpha (scale alpha / rank)"))
    lora_dropout: float = field(default=0.0, metadata=meta("LoRA dropout"))
    target_modules: str = field(default="all-linear", metadata=meta("comma-separated module names or all-linear"))
    load_in_4bit: Load4bitConfig | None = field(
        default=None,
        metadata={
            **meta(
                "QLoRA: the policy's, the critic's and the reference's base weights loaded in 4 bits (bitsandbytes), "
                "LoRA adapters (--lora_rank) trained over them; the engines get the dequantized base plus the "
                "adapter, merged, from version 0 on; reward models and teachers load unquantized; ZeRO 0-2",
                openrlhf=("ds.load_in_4bit",),
            ),
            "switch": True,
        },
    )
    ref_offload: bool = field(
        default=False,
        metadata=meta(
            "the reference's parameters on the CPU, gathered layer by layer for each forward (DeepSpeed ZeRO-3 "
            "offload_param; needs --zero_stage 3)",
            openrlhf=("ref.offload",),
        ),
    )
    reward_offload: bool = field(
        default=False,
        metadata=meta(
            "the reward model's parameters on the CPU, as --ref_offload (needs --zero_stage 3)",
            openrlhf=("reward.offload",),
        ),
    )
    freeze_visual_encoder: bool = field(
        default=False,
        metadata=meta(
            "a vision-language policy trains its language model only: the vision tower and projector stay frozen",
            openrlhf=("actor.freeze_visual_encoder",),
        ),
    )

    def __post_init__(self) -> None:
        # lazy: rl_core.attention imports torch; rl ppo --help builds its flags from this class without it
        from rl_core.attention import requested_attention

        requested_attention(self.attn_implementation, self.flash_attn)
        check_numbers(self, at_least_1=("lora_alpha",), unit=("lora_dropout",))
        self.lora()  # a bad rank or an empty --target_modules fails here, before any model loads
        if self.load_in_4bit is not None:
            self.load_in_4bit.check(lora_rank=self.lora_rank)

    def lora(self):
        """The LoRA settings of the trained roles (policy, critic), or None."""
        # lazy: rl_core.models imports torch; rl ppo --help builds its flags from this class without it
        from rl_core.models import LoraSpec

        return LoraSpec.of(self.lora_rank, self.lora_alpha, self.lora_dropout, self.target_modules)

    @property
    def critic_path(self) -> str | None:
        return self.critic_pretrain or self.reward_pretrain or self.pretrain

    @property
    def ref_path(self) -> str | None:
        return self.ref_pretrain or self.pretrain
