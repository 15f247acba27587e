"""The reward server's wire format: the JSON batch both clients send (ours: prompts/responses/labels;
OpenRLHF's: query = prompt + response), parsed with limits. Every parse error is a :class:`_Refused` with
the HTTP status and a one-line reason (:mod:`rl_rollout.rewards.server_app` answers it). HTTP itself is
uvicorn's (h11): nothing here reads a request head.
"""

from __future__ import annotations

import inspect
import json
from collections.abc import Callable
from dataclasses import dataclass


class _Refused(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class Batch:
    """A parsed request: one prompt, response and label per sample; ``queries`` when the client sent them."""

    prompts: list[str]
    responses: list[str]
    labels: list[str | None]
    queries: list[str] | None = None


def _strings(data: dict, key: str) -> list[str]:
    value = data.get(key)
    if not isinstance(value, list) or not all(isinstance(x, str) for x in value):
        raise _Refused(400, f"'{key}' must be a list of strings, got {json.dumps(value)[:100]}")
    return value


def parse_batch(body: bytes, max_batch: int) -> Batch:
    """The :class:`Batch` in a request body (either dialect), or :class:`_Refused` with 400/413 and the reason."""
    try:
        data = json.loads(body)
    except (ValueError, RecursionError) as e:  # RecursionError: nesting deeper than the parser's stack
        raise _Refused(400, f"request body is not valid JSON ({type(e).__name__}: {str(e)[:200]})") from None
    if not isinstance(data, dict):
        kind = type(data).__name__
        raise _Refused(
            400,
            f"request body must be a JSON object with 'prompts' and 'responses' (or OpenRLHF's 'query'), got a {kind}",
        )
    queries = None
    if "responses" in data or "query" not in data:
        prompts, responses = _strings(data, "prompts"), _strings(data, "responses")
        if "query" in data:
            queries = _strings(data, "query")
    else:  # OpenRLHF: query = prompt + response; prompts since 2025, labels since 2025-02
        queries = _strings(data, "query")
        prompts = [""] * len(queries) if data.get("prompts") is None else _strings(data, "prompts")
        if len(prompts) != len(queries):
            raise _Refused(400, f"{len(queries)} queries and {len(prompts)} prompts; send one prompt per query")
        responses = [q[len(p) :] if q.startswith(p) else q for q, p in zip(queries, prompts, strict=True)]
    labels = data.get("labels")
    if labels is None:
        labels = [None] * len(prompts)
    elif not isinstance(labels, list) or not all(x is None or isinstance(x, (str, int, float)) for x in labels):
        raise _Refused(400, f"'labels' must be null or a list of strings/numbers/nulls, got {json.dumps(labels)[:100]}")
    labels = [x if x is None or isinstance(x, str) else str(x) for x in labels]  # a numeric answer as text
    if not len(prompts) == len(responses) == len(labels) or (queries is not None and len(queries) != len(prompts)):
        n_q = "" if queries is None else f", {len(queries)} queries"
        raise _Refused(
            400, f"{len(prompts)} prompts, {len(responses)} responses, {len(labels)} labels{n_q}; send one per sample"
        )
    if len(prompts) > max_batch:
        raise _Refused(413, f"batch of {len(prompts)} samples exceeds the server's max_batch={max_batch}; split it")
    return Batch(prompts, responses, labels, queries)


def _takes_queries(fn: Callable) -> bool:
    try:
        return "queries" in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False
