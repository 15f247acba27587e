"""rl-rollout: generation engines for RL on LLMs (token ids in, samples with logprobs out),
rewards (:mod:`rl_rollout.rewards`) and multi-turn agents (:mod:`rl_rollout.agents`).

Importing this package imports torch and nothing heavy; the engines import
transformers or vLLM when they are built (``make_engine``, or their modules).
"""

from rl_rollout.agents import AgentExecutor, AgentRequest, CalculatorEnv, Environment, EnvStepError, StepResult
from rl_rollout.config import EngineConfig, RewardConfig, SyncBackend, WeightSyncConfig, canonical_dtype
from rl_rollout.engine import (
    EngineContext,
    EngineKind,
    EngineSpec,
    RolloutEngine,
    engine_names,
    engine_spec,
    make_engine,
    register_engine,
    resolve_engine,
    vllm_usable,
)
from rl_rollout.ipc import IpcBucket, IpcReceiver, IpcSender, IpcSync, open_bucket, share_buckets
from rl_rollout.pool import EnginePool
from rl_rollout.rewards import (
    RemoteRewardClient,
    RemoteRewardError,
    RewardRunner,
    RewardServer,
    load_reward_fn,
)
from rl_rollout.sampling import SamplingConfig
from rl_rollout.transport import CollectiveReceiver, CollectiveSender, SyncStats, WeightSyncError
from rl_rollout.types import RolloutRequest, RolloutSample, SamplingParams
from rl_rollout.weights import TensorStats, compare_weight_stats, tensor_stats, weight_stats

__version__ = "0.20.0"

__all__ = [
    "AgentExecutor",
    "AgentRequest",
    "CalculatorEnv",
    "CollectiveReceiver",
    "CollectiveSender",
    "EngineConfig",
    "EngineContext",
    "EngineKind",
    "EngineSpec",
    "EnginePool",
    "EnvStepError",
    "Environment",
    "IpcBucket",
    "IpcReceiver",
    "IpcSender",
    "IpcSync",
    "RemoteRewardClient",
    "RewardConfig",
    "RemoteRewardError",
    "RewardRunner",
    "RewardServer",
    "RolloutEngine",
    "RolloutRequest",
    "RolloutSample",
    "SamplingConfig",
    "SamplingParams",
    "StepResult",
    "SyncBackend",
    "SyncStats",
    "TensorStats",
    "compare_weight_stats",
    "tensor_stats",
    "weight_stats",
    "WeightSyncConfig",
    "WeightSyncError",
    "canonical_dtype",
    "load_reward_fn",
    "open_bucket",
    "share_buckets",
    "engine_names",
    "engine_spec",
    "make_engine",
    "register_engine",
    "resolve_engine",
    "vllm_usable",
]
