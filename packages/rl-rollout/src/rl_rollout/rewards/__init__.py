"""Rewards: reward functions from specs, built-in verifiers, a safe runner, a remote reward model.

- :mod:`~rl_rollout.rewards.loading`: the reward-function signature
  ``fn(prompt, response, label, **info) -> float`` and :func:`load_reward_fn`
  for callables, ``path/to/file.py:func``, ``module:func`` and ``builtin:NAME``.
- :mod:`~rl_rollout.rewards.verifiers`: exact match, ``\\boxed{}``/numeric math
  answer, regex format check.
- :mod:`~rl_rollout.rewards.runner`: :class:`RewardRunner`, a process pool with
  per-call timeouts (or in-process), failures turned into a fallback reward
  and counted.
- :mod:`~rl_rollout.rewards.remote`: :class:`RemoteRewardClient` and
  :class:`RewardServer`, batches over HTTP with a bearer token.

Everything here is stdlib apart from the package's own imports. Left out:
batched reward functions (a batch-level scorer goes behind
:class:`RewardServer` or is called directly), reward models themselves (rl-core).
"""

from rl_rollout.rewards.loading import RewardFn, RewardLoadError, RewardSpec, load_reward_fn, reward_fn_name
from rl_rollout.rewards.remote import RemoteRewardClient, RemoteRewardError, RewardServer
from rl_rollout.rewards.runner import (
    RewardCounts,
    RewardError,
    RewardResult,
    RewardRunner,
    RewardTimeoutError,
)
from rl_rollout.rewards.verifiers import Builtin, ExactMatch, FormatCheck, MathAnswer, make_builtin

__all__ = [
    "Builtin",
    "ExactMatch",
    "FormatCheck",
    "MathAnswer",
    "RemoteRewardClient",
    "RemoteRewardError",
    "RewardCounts",
    "RewardError",
    "RewardFn",
    "RewardLoadError",
    "RewardResult",
    "RewardRunner",
    "RewardServer",
    "RewardSpec",
    "RewardTimeoutError",
    "load_reward_fn",
    "make_builtin",
    "reward_fn_name",
]
