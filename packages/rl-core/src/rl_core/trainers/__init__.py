"""Trainers over rl_core's models, strategy and data: SFT, reward model, DPO, KTO, and GRPO.

The offline ones share :class:`rl_core.trainers.base.Trainer` (seeded global batches,
eval sets, resume, metrics, export); each file holds one trainer's config, step and eval metrics.
:mod:`rl_core.trainers.ppo` is the RL loop (PPO, GRPO, REINFORCE++, RLOO) over worker groups.
"""

from rl_core.trainers.base import LMTrainerConfig, Trainer, TrainerConfig
from rl_core.trainers.dpo import DPOConfig, DPOTrainer
from rl_core.trainers.kto import KTOConfig, KTOTrainer
from rl_core.trainers.ppo import PPOConfig, PPOTrainer
from rl_core.trainers.rm import RewardModelTrainer, RMConfig
from rl_core.trainers.sft import SFTConfig, SFTTrainer

__all__ = [
    "DPOConfig",
    "DPOTrainer",
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
