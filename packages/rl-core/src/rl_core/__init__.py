"""rl_core: models, DeepSpeed training, data, trainers and checkpoints.

- :mod:`rl_core.models`: Actor (per-token logprobs aligned with input_ids, entropy,
  packing), Critic (value head), RewardModel (score head, stored mean/std), frozen reference.
- :mod:`rl_core.strategy`: DeepSpeedStrategy (distributed init, ZeRO 0-3, AdamW or Muon + LR
  schedule, accumulation, reductions, full-weight buckets under ZeRO-3).
- :mod:`rl_core.data`: datasets from local files, collate and packing.
- :mod:`rl_core.checkpoint`: atomic DeepSpeed checkpoints for exact resume, HF export.

It never imports Ray or rl-placement: its loops talk to worker-group protocols.
- :mod:`rl_core.trainers`: SFT, reward-model, DPO and KTO trainers over one shared loop, and the PPO-family
  RL loop (:mod:`rl_core.trainers.ppo`: PPO with a critic, GRPO, REINFORCE++, RLOO, Dr.GRPO).
- :mod:`rl_core.rl`: the RL roles' workers (policy, critic, reference, reward model), the in-process
  worker group, generation over engine groups and weight syncs.
- :mod:`rl_core.metrics`: metrics.jsonl, TensorBoard and curves.png per run.

The names below load on first use (PEP 562), so ``import rl_core`` and its light modules (the config dataclasses
``rl ppo --help`` builds its flags from) import no torch, DeepSpeed or transformers; each name's module does.
"""

import importlib
from typing import TYPE_CHECKING, Any

from rl_core import _quiet  # noqa: F401 - first: drops DeepSpeed's CPU notice before deepspeed loads

if TYPE_CHECKING:
    from rl_core.attention import attention_implementation
    from rl_core.checkpoint import CheckpointManager
    from rl_core.hf_export import export_hf
    from rl_core.metrics import MetricsLogger
    from rl_core.models import Actor, ActorOutput, Critic, LoraSpec, RewardModel, frozen
    from rl_core.rl.build import LocalFactory, Run, RunConfig, build_run
    from rl_core.rl.model_config import RLModelConfig
    from rl_core.strategy import DeepSpeedStrategy
    from rl_core.strategy_config import BatchPlan, StrategyConfig
    from rl_core.trainers import (
        DPOConfig,
        DPOTrainer,
        KTOConfig,
        KTOTrainer,
        PPOConfig,
        PPOTrainer,
        RewardModelTrainer,
        RMConfig,
        SFTConfig,
        SFTTrainer,
        Trainer,
        TrainerConfig,
    )

__version__ = "0.28.0"

# name -> the submodule that defines it, imported on first use
_LAZY = {
    "attention_implementation": "rl_core.attention",
    "CheckpointManager": "rl_core.checkpoint",
    "export_hf": "rl_core.hf_export",
    "MetricsLogger": "rl_core.metrics",
    **dict.fromkeys(("Actor", "ActorOutput", "Critic", "LoraSpec", "RewardModel", "frozen"), "rl_core.models"),
    **dict.fromkeys(("LocalFactory", "Run", "RunConfig", "build_run"), "rl_core.rl.build"),
    "RLModelConfig": "rl_core.rl.model_config",
    "DeepSpeedStrategy": "rl_core.strategy",
    **dict.fromkeys(("BatchPlan", "StrategyConfig"), "rl_core.strategy_config"),
    **dict.fromkeys(
        (
            "DPOConfig",
            "DPOTrainer",
            "KTOConfig",
            "KTOTrainer",
            "PPOConfig",
            "PPOTrainer",
            "RewardModelTrainer",
            "RMConfig",
            "SFTConfig",
            "SFTTrainer",
            "Trainer",
            "TrainerConfig",
        ),
        "rl_core.trainers",
    ),
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value  # the next access skips this function
        return value
    raise AttributeError(f"module 'rl_core' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *_LAZY])


__all__ = [
    "LocalFactory",
    "RLModelConfig",
    "Run",
    "RunConfig",
    "build_run",
    "Actor",
    "ActorOutput",
    "BatchPlan",
    "CheckpointManager",
    "Critic",
    "DPOConfig",
    "DPOTrainer",
    "DeepSpeedStrategy",
    "KTOConfig",
    "KTOTrainer",
    "LoraSpec",
    "MetricsLogger",
    "PPOConfig",
    "PPOTrainer",
    "RMConfig",
    "RewardModel",
    "RewardModelTrainer",
    "SFTConfig",
    "SFTTrainer",
    "StrategyConfig",
    "Trainer",
    "TrainerConfig",
    "attention_implementation",
    "export_hf",
    "frozen",
]
