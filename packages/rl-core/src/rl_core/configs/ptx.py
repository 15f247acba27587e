"""PPO-ptx (``--pretrain_data``; Ouyang et al. 2022, as OpenRLHF): pretraining text mixed into the policy's
update. Present on :class:`~rl_core.trainers.ppo_config.PPOConfig` as ``ptx`` when a pretraining set is given."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from rl_rollout.config_fields import meta


@dataclass(frozen=True)
class PtxConfig:
    """The pretraining set (files as --dataset, the text in --input_key, cut at --max_len + --generate_max_len
    tokens, at most max_epochs x prompts x n_samples_per_prompt rows); each policy micro-batch adds ``coef`` x
    the token-mean NLL of --micro_train_batch_size of them (metric ptx_loss)."""

    data: str = field(
        default="", metadata=meta("PPO-ptx's pretraining text: files as --dataset", flags=("pretrain_data",))
    )
    data_probs: str | None = field(
        default=None,
        metadata=meta(
            "mix the comma-separated --pretrain_data files by these probabilities (as --dataset_probs)",
            flags=("pretrain_data_probs",),
        ),
    )
    split: str = field(
        default="train", metadata=meta("the split of --pretrain_data to read", flags=("pretrain_split",))
    )
    coef: float = field(default=0.05, metadata=meta("the weight of the pretraining NLL loss", flags=("ptx_coef",)))

    def __post_init__(self) -> None:
        if not self.data:
            raise ValueError(
                "--pretrain_data_probs, --pretrain_split and --ptx_coef set PPO-ptx's pretraining "
                "mix: add --pretrain_data FILES, or drop them"
            )
        if not (math.isfinite(self.coef) and self.coef >= 0):
            raise ValueError(f"ptx_coef (--ptx_coef) must be a finite number >= 0, got {self.coef}")
