"""rl-rollout: generation engines for RL on LLMs (token ids in, samples with logprobs out).

Importing this package imports torch and nothing heavy; the engines import
transformers or vLLM when they are built (``make_engine``, or their modules).
"""

from rl_rollout.engine import EngineKind, RolloutEngine, make_engine, vllm_usable
from rl_rollout.pool import EnginePool
from rl_rollout.types import RolloutRequest, RolloutSample, SamplingParams

__version__ = "0.1.0"

__all__ = [
    "EngineKind",
    "EnginePool",
    "RolloutEngine",
    "RolloutRequest",
    "RolloutSample",
    "SamplingParams",
    "make_engine",
    "vllm_usable",
]
