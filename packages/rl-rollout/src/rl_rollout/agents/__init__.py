"""Agents: multi-turn environments run against a rollout engine, token in / token out.

:class:`Environment` (async ``reset`` / ``step`` over text) and
:class:`StepResult` are the contract; :class:`AgentExecutor` plays episodes
and returns :class:`~rl_rollout.types.RolloutSample` objects whose
environment tokens carry loss mask 0; :class:`ChatTurnFormat` wraps
observations as chat turns; :class:`CalculatorEnv` is the worked example.
Observations may carry images for a vision-language policy (``StepResult.images``,
:class:`Observation`; :mod:`rl_rollout.agents.images`).
"""

from rl_rollout.agents.calculator import CalcError, CalculatorEnv, safe_eval
from rl_rollout.agents.env import ChatTurnFormat, Environment, Observation, StepResult
from rl_rollout.agents.executor import AgentExecutor, AgentRequest, EnvStepError

__all__ = [
    "AgentExecutor",
    "AgentRequest",
    "CalcError",
    "CalculatorEnv",
    "ChatTurnFormat",
    "EnvStepError",
    "Environment",
    "Observation",
    "StepResult",
    "safe_eval",
]
