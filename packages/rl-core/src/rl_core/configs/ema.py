"""An exponential moving average of the policy's weights (``--enable_ema``): present on
:class:`~rl_core.trainers.ppo_config.PPOConfig` as ``ema`` when on; the policy worker keeps it
(:mod:`rl_core.rl.ema`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from rl_rollout.config_fields import meta


@dataclass(frozen=True)
class EMAConfig:
    """Updated after each optimizer step, in the weights' dtype, on their device (ZeRO-3: each rank its
    partition), and exported instead of the policy (--save_path, --save_hf_ckpt); checkpoints keep it; the engines
    sample from the policy itself."""

    beta: float = field(
        default=0.992,
        metadata=meta("ema = beta x ema + (1 - beta) x weights", flags=("ema_beta",), openrlhf=("train.ema_beta",)),
    )

    def __post_init__(self) -> None:
        if not 0 <= self.beta <= 1:
            raise ValueError(f"ema_beta (--ema_beta) must be in [0, 1], got {self.beta}")
