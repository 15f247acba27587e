"""An OpenAI-compatible endpoint served over a rollout engine, recording every call token-exact (issue 38,
item 1): :class:`OpenAIServer` (:mod:`rl_rollout.openai_api.server`), its settings
:class:`OpenAIServerConfig` (tool calls: :class:`ToolCallConfig`, :mod:`rl_rollout.openai_api.tool_parsers`), the records :class:`RecordedCall` / :class:`RecordedChoice`, and the request
rules (:mod:`rl_rollout.openai_api.protocol`: :data:`IGNORED_FIELDS`)."""

from rl_rollout.openai_api.config import OpenAIServerConfig, ToolCallConfig
from rl_rollout.openai_api.episodes import Episodes, RecordedCall, RecordedChoice
from rl_rollout.openai_api.protocol import IGNORED_FIELDS
from rl_rollout.openai_api.server import OpenAIServer

__all__ = [
    "IGNORED_FIELDS",
    "Episodes",
    "OpenAIServer",
    "OpenAIServerConfig",
    "RecordedCall",
    "RecordedChoice",
    "ToolCallConfig",
]
