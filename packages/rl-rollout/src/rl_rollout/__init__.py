"""rl-rollout: generation engines for RL on LLMs (token ids in, samples with logprobs out),
rewards (:mod:`rl_rollout.rewards`) and multi-turn agents (:mod:`rl_rollout.agents`).

The names below load on first use (PEP 562), so ``import rl_rollout`` imports nothing heavy and a light
module of it (``rl_rollout.config_fields``) can be imported without torch: ``rl --help`` lists its commands in
a fraction of a second. Each name's module imports torch, and the engines transformers or vLLM when they are
built (``make_engine``, or their modules).
"""

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
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
    from rl_rollout.openai_api import OpenAIServer, OpenAIServerConfig, RecordedCall, RecordedChoice
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


__version__ = "0.26.0"

# name -> the submodule that defines it, imported on first use
_LAZY = {
    **dict.fromkeys(
        ("AgentExecutor", "AgentRequest", "CalculatorEnv", "Environment", "EnvStepError", "StepResult"),
        "rl_rollout.agents",
    ),
    **dict.fromkeys(
        ("EngineConfig", "RewardConfig", "SyncBackend", "WeightSyncConfig", "canonical_dtype"), "rl_rollout.config"
    ),
    **dict.fromkeys(
        (
            "EngineContext",
            "EngineKind",
            "EngineSpec",
            "RolloutEngine",
            "engine_names",
            "engine_spec",
            "make_engine",
            "register_engine",
            "resolve_engine",
            "vllm_usable",
        ),
        "rl_rollout.engine",
    ),
    **dict.fromkeys(
        ("IpcBucket", "IpcReceiver", "IpcSender", "IpcSync", "open_bucket", "share_buckets"), "rl_rollout.ipc"
    ),
    **dict.fromkeys(("OpenAIServer", "OpenAIServerConfig", "RecordedCall", "RecordedChoice"), "rl_rollout.openai_api"),
    **dict.fromkeys(("EnginePool",), "rl_rollout.pool"),
    **dict.fromkeys(
        ("RemoteRewardClient", "RemoteRewardError", "RewardRunner", "RewardServer", "load_reward_fn"),
        "rl_rollout.rewards",
    ),
    **dict.fromkeys(("SamplingConfig",), "rl_rollout.sampling"),
    **dict.fromkeys(("CollectiveReceiver", "CollectiveSender", "SyncStats", "WeightSyncError"), "rl_rollout.transport"),
    **dict.fromkeys(("RolloutRequest", "RolloutSample", "SamplingParams"), "rl_rollout.types"),
    **dict.fromkeys(("TensorStats", "compare_weight_stats", "tensor_stats", "weight_stats"), "rl_rollout.weights"),
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value  # the next access skips this function
        return value
    raise AttributeError(f"module 'rl_rollout' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *_LAZY])


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
    "OpenAIServer",
    "OpenAIServerConfig",
    "RecordedCall",
    "RecordedChoice",
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
