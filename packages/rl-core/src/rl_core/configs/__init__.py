"""The RL run's typed sub-configs that rl-core owns, one file each; :class:`~rl_core.trainers.ppo_config.PPOConfig`
composes them (with rl-algos' :class:`~rl_algos.KLConfig`), and the offline trainers share
:class:`CheckpointConfig`.

An optional feature is an optional node: present means on (``PPOConfig(async_rl=AsyncConfig(max_staleness=2))``),
``None`` means off, so no setting of a feature can be given while the feature is off. Each node checks its own
fields in its constructor; rules that cross nodes live in ``PPOConfig.__post_init__`` (the run's).
Command-line names come from each field's metadata (``flags``: our flat names, ``openrlhf``: OpenRLHF's);
:func:`from_flat` builds a tree from those flat names in Python (``PPOConfig.from_flat(init_kl_coef=0)``).
"""

from rl_core.configs.agent import AgentConfig
from rl_core.configs.async_rl import AsyncConfig
from rl_core.configs.checkpoint import CheckpointConfig
from rl_core.configs.distill import DistillConfig
from rl_core.configs.ema import EMAConfig
from rl_core.configs.eval import EvalConfig, best_metric_name, check_eval_rows, check_eval_set, eval_metric_names
from rl_core.configs.filtering import DynamicFilteringConfig
from rl_core.configs.flat import flat_table, from_flat
from rl_core.configs.kd import KDConfig
from rl_core.configs.mlflow import MLflowConfig
from rl_core.configs.optimizer import CriticOptimizerConfig
from rl_core.configs.ptx import PtxConfig

__all__ = [
    "AgentConfig",
    "AsyncConfig",
    "CheckpointConfig",
    "CriticOptimizerConfig",
    "DistillConfig",
    "DynamicFilteringConfig",
    "EMAConfig",
    "EvalConfig",
    "KDConfig",
    "MLflowConfig",
    "PtxConfig",
    "best_metric_name",
    "check_eval_rows",
    "check_eval_set",
    "eval_metric_names",
    "flat_table",
    "from_flat",
]
