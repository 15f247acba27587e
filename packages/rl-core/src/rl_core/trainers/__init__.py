"""Trainers over rl_core's models, strategy and data: SFT (with knowledge distillation: :mod:`rl_core.trainers.sft_kd`),
reward model, DPO, KTO, and GRPO.

The offline ones share :class:`rl_core.trainers.base.Trainer` (seeded global batches,
eval sets, resume, metrics, export); each file holds one trainer's config, step and eval metrics.
:mod:`rl_core.trainers.ppo` is the RL loop (PPO, GRPO, REINFORCE++, RLOO) over worker groups.

The names below load on first use (PEP 562): importing a light module of the package (a config) imports no
torch.
"""

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rl_core.trainers.base import Trainer
    from rl_core.trainers.configs import DPOConfig, KTOConfig, LMTrainerConfig, RMConfig, SFTConfig, TrainerConfig
    from rl_core.trainers.dpo import DPOTrainer
    from rl_core.trainers.kto import KTOTrainer
    from rl_core.trainers.ppo import PPOTrainer
    from rl_core.trainers.ppo_config import PPOConfig
    from rl_core.trainers.rm import RewardModelTrainer
    from rl_core.trainers.sft import SFTTrainer
    from rl_core.trainers.sft_kd import KDSFTTrainer

# name -> the submodule that defines it, imported on first use
_LAZY = {
    "Trainer": "rl_core.trainers.base",
    **dict.fromkeys(
        ("DPOConfig", "KTOConfig", "LMTrainerConfig", "RMConfig", "SFTConfig", "TrainerConfig"),
        "rl_core.trainers.configs",
    ),
    "DPOTrainer": "rl_core.trainers.dpo",
    "KTOTrainer": "rl_core.trainers.kto",
    "PPOTrainer": "rl_core.trainers.ppo",
    "PPOConfig": "rl_core.trainers.ppo_config",
    "RewardModelTrainer": "rl_core.trainers.rm",
    "SFTTrainer": "rl_core.trainers.sft",
    "KDSFTTrainer": "rl_core.trainers.sft_kd",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value  # the next access skips this function
        return value
    raise AttributeError(f"module 'rl_core.trainers' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *_LAZY])


__all__ = [
    "DPOConfig",
    "DPOTrainer",
    "KDSFTTrainer",
    "KTOConfig",
    "KTOTrainer",
    "LMTrainerConfig",
    "PPOConfig",
    "PPOTrainer",
    "RMConfig",
    "RewardModelTrainer",
    "SFTConfig",
    "SFTTrainer",
    "Trainer",
    "TrainerConfig",
]
