"""Trainers over rl_core's models, strategy and data. Today: SFT."""

from rl_core.trainers.sft import SFTConfig, SFTTrainer

__all__ = ["SFTConfig", "SFTTrainer"]
