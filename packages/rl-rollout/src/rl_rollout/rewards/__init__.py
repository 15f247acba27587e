"""Rewards: reward functions from specs, built-in verifiers, a safe runner, a remote reward model.

- :mod:`~rl_rollout.rewards.loading`: the reward-function signature
  ``fn(prompt, response, label, **info) -> float`` and :func:`load_reward_fn`
  for callables, ``path/to/file.py:func``, ``module:func`` and ``builtin:NAME``.
- :mod:`~rl_rollout.rewards.verifiers`: exact match, ``\\boxed{}``/numeric math
  answer, regex format check.
- :mod:`~rl_rollout.rewards.runner`: :class:`RewardRunner`, every call bounded by
  a timeout, in worker processes or on threads of this process, hanging samples
  in parallel; failures (errors, timeouts, non-finite values) turned into a
  fallback reward and counted (:class:`RewardCounts`); where one call runs (a worker
  process or an abandonable thread) is :mod:`~rl_rollout.rewards.lanes`, the result and
  count types every scorer shares are :mod:`~rl_rollout.rewards.results`.
- :mod:`~rl_rollout.rewards.remote`: :class:`RemoteRewardClient`, batches over
  HTTP (httpx) with a bearer token, in our format and OpenRLHF's at once.
- :mod:`~rl_rollout.rewards.server`: :class:`RewardServer`, uvicorn + Starlette hardened
  against slow, oversized and malformed clients (:mod:`~rl_rollout.rewards.server_app`);
  answers our clients and OpenRLHF's. The request formats and their parsing are
  :mod:`~rl_rollout.rewards.protocol`.
- :mod:`~rl_rollout.rewards.openrlhf`: :class:`OpenRLHFRewardFunc`, OpenRLHF's reward
  files (``reward_func(queries, prompts, labels)`` returning a tensor or
  ``{"rewards", "scores", "extra_logs"}``) as a batch scorer; :class:`RewardRecord`
  holds what they return.

Everything here is stdlib apart from the package's own imports; math-verify, which builtin:math runs in
a sandbox process (:mod:`~rl_rollout.rewards.math_sandbox`); and the HTTP stack (uvicorn, Starlette, httpx),
imported only when a server starts or a client sends. Left out: reward
models themselves (rl-core; ``rl serve-rm --reward_pretrain`` serves one).
"""

from rl_rollout.rewards.loading import (
    RewardFn,
    RewardLoadError,
    RewardRecord,
    RewardSpec,
    load_openrlhf_reward_func,
    load_reward_fn,
    record_from,
    reward_fn_name,
)
from rl_rollout.rewards.openrlhf import OpenRLHFRewardFunc
from rl_rollout.rewards.remote import RemoteRewardClient, RemoteRewardError, scorer_for_remote_rm_url
from rl_rollout.rewards.runner import (
    RewardCounts,
    RewardError,
    RewardResult,
    RewardRunner,
    RewardTimeoutError,
)
from rl_rollout.rewards.server import RewardServer
from rl_rollout.rewards.verifiers import Builtin, ExactMatch, FormatCheck, MathAnswer, make_builtin

__all__ = [
    "Builtin",
    "ExactMatch",
    "FormatCheck",
    "MathAnswer",
    "OpenRLHFRewardFunc",
    "RemoteRewardClient",
    "RemoteRewardError",
    "RewardCounts",
    "RewardError",
    "RewardFn",
    "RewardLoadError",
    "RewardRecord",
    "RewardResult",
    "RewardRunner",
    "RewardServer",
    "RewardSpec",
    "RewardTimeoutError",
    "load_openrlhf_reward_func",
    "load_reward_fn",
    "make_builtin",
    "record_from",
    "reward_fn_name",
    "scorer_for_remote_rm_url",
]
