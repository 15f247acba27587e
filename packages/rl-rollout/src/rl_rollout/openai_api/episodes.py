"""Episodes: one API key per agent run, and the token-exact record of every call made with it.

:meth:`Episodes.open` hands out a fresh key for a row (the program under training calls the endpoint with
it as its OpenAI key); each answered request appends a :class:`RecordedCall` (the prompt ids exactly as the
engine got them, rendered or spliced (:mod:`rl_rollout.openai_api.splice`), each choice's sampled ids, their engine log-probs, finish reason and weight version);
:meth:`Episodes.close` returns the calls and retires the key: a later request with it is 410 Gone. Thread-safe.
"""

from __future__ import annotations

import secrets
import threading
from dataclasses import dataclass, field
from typing import Any

from rl_rollout.openai_api.splice import PromptSource
from rl_rollout.openai_api.tool_parsers import ToolCall, ToolParse
from rl_rollout.types import FinishReason, RolloutSample


@dataclass(frozen=True)
class RecordedChoice:
    """One sampled choice: ``response_ids`` as sampled (cut after the token that completed a stop string),
    ``logprobs`` the engine's for them, ``text`` their decoded text; ``tool_parse`` the reply read for tool
    calls (None: the request had no tools, or ``tool_choice="none"``): the client then got its content and
    calls in place of ``text``. The ids are the sampled ones either way."""

    response_ids: list[int]
    logprobs: list[float]
    finish_reason: FinishReason
    policy_version: int
    text: str
    tool_parse: ToolParse | None = None

    @property
    def tool_calls(self) -> tuple[ToolCall, ...]:
        return self.tool_parse.calls if self.tool_parse is not None else ()

    @property
    def content(self) -> str | None:
        """The message content the client got: the text outside the calls (None: calls only), failed calls
        included as the parser read them (a format's special-token markers kept)."""
        return self.tool_parse.content if self.tool_parse is not None else self.text

    @property
    def reply_finish_reason(self) -> str:
        """``tool_calls`` when the reply holds calls (OpenAI's rule), else the engine's reason."""
        return "tool_calls" if self.tool_calls else self.finish_reason


@dataclass(frozen=True)
class RecordedCall:
    """One answered request of an episode, in arrival order of completion. ``prompt_source``: how the prompt ids
    were built ("rendered" by the chat template, "spliced" from an earlier call's prompt + sampled ids and the
    new turns, or a "completion"'s prompt); ``splice_refused``: why a chat call that continued an earlier one
    was rendered instead of spliced (re-tokenisation drift at the endpoint), else ""."""

    endpoint: str  # "chat" | "completion"
    prompt_ids: list[int]
    choices: list[RecordedChoice]
    request: dict[str, Any]  # the request body as sent (messages, sampling fields)
    index: int  # the call's position in its episode
    prompt_source: PromptSource = "rendered"
    splice_refused: str = ""

    @property
    def tool_calls(self) -> int:
        """Tool calls parsed from this call's choices."""
        return sum(len(c.tool_calls) for c in self.choices)

    @property
    def tool_parse_failures(self) -> int:
        """Text that looked like a tool call and was not one (returned to the client as content)."""
        return sum(c.tool_parse.failures for c in self.choices if c.tool_parse is not None)

    def samples(self) -> list[RolloutSample]:
        """The choices as :class:`~rl_rollout.types.RolloutSample` (what a trainer takes)."""
        return [
            RolloutSample(
                prompt_ids=list(self.prompt_ids),
                response_ids=list(c.response_ids),
                rollout_logprobs=list(c.logprobs),
                loss_mask=[1] * len(c.response_ids),
                finish_reason=c.finish_reason,
                policy_version=c.policy_version,
                info={
                    "call_index": self.index,
                    "choice_index": i,
                    "endpoint": self.endpoint,
                    "tool_calls": len(c.tool_calls),
                },
            )
            for i, c in enumerate(self.choices)
        ]


@dataclass
class _Episode:
    row_id: Any
    calls: list[RecordedCall] = field(default_factory=list)


class Episodes:
    """The open episodes by key; closed keys are remembered (410) until :meth:`forget_closed`."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._open: dict[str, _Episode] = {}
        self._closed: set[str] = set()
        self.opened = 0

    def open(self, row_id: Any) -> str:
        key = "ep-" + secrets.token_urlsafe(24)
        with self._lock:
            self._open[key] = _Episode(row_id)
            self.opened += 1
        return key

    def state(self, key: str) -> str:
        """``"open"``, ``"closed"`` or ``"unknown"``."""
        with self._lock:
            return "open" if key in self._open else "closed" if key in self._closed else "unknown"

    def record(
        self,
        key: str,
        endpoint: str,
        prompt_ids: list[int],
        choices: list[RecordedChoice],
        request: dict,
        prompt_source: PromptSource = "rendered",
        splice_refused: str = "",
    ) -> bool:
        """Append a call to the episode; False when it was closed meanwhile (nothing recorded)."""
        with self._lock:
            ep = self._open.get(key)
            if ep is None:
                return False
            ep.calls.append(
                RecordedCall(endpoint, list(prompt_ids), choices, request, len(ep.calls), prompt_source, splice_refused)
            )
            return True

    def calls(self, key: str) -> list[RecordedCall]:
        """The calls recorded so far for an open episode (a copy; [] for a key not open)."""
        with self._lock:
            ep = self._open.get(key)
            return [] if ep is None else list(ep.calls)

    def close(self, key: str) -> list[RecordedCall]:
        with self._lock:
            ep = self._open.pop(key, None)
            if ep is None:
                why = "already closed" if key in self._closed else "unknown"
                raise KeyError(f"episode key {key[:8]}...: {why}; close_episode takes a key open_episode returned")
            self._closed.add(key)
            return ep.calls

    def row_id(self, key: str) -> Any:
        with self._lock:
            return self._open[key].row_id

    def counts(self) -> dict[str, int]:
        with self._lock:
            return {
                "episodes_open": len(self._open),
                "episodes_closed": len(self._closed),
                "episodes_opened": self.opened,
            }

    def forget_closed(self) -> None:
        """Drop the closed keys (their requests then get 401 instead of 410)."""
        with self._lock:
            self._closed.clear()
