"""Remote reward model over HTTP: a client with timeouts, retries and a bearer token.

Wire format: :mod:`rl_rollout.rewards.server` (the server lives there). The client
speaks both dialects at once, so it talks to our server and to OpenRLHF-style ones::

    POST <url>   {"query": [prompt + response], "prompts": [str], "responses": [str],
                  "labels": [str | null] | null}
    200          {"rewards": [float], "scores"?: [float], "extra_logs"?: {name: [float] | float}}

It posts to each URL as given (OpenRLHF's server answers at ``/get_reward``). A
comma-separated list of URLs shares each batch between the servers in contiguous
shards, in parallel, as OpenRLHF does. It retries connection errors, timeouts, 5xx,
408 and 429 with exponential backoff (``backoff_s * 2**attempt``, capped at
``max_backoff_s``) and raises :class:`RemoteRewardError` with the server's message at
once on any other 4xx: a bad token or a bad batch will not get better by retrying.
:meth:`RemoteRewardClient.score` returns the rewards; :meth:`RemoteRewardClient.last_record`
the batch's scores and extra logs when the server sent them.

:func:`scorer_for_remote_rm_url` follows OpenRLHF's convention for ``--remote_rm_url``:
a ``.py`` path is a local reward file (:class:`~rl_rollout.rewards.openrlhf.OpenRLHFRewardFunc`),
anything else a server.
"""

from __future__ import annotations

import json
import logging
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from http.client import HTTPException
from typing import Any

from rl_rollout.rewards.loading import RewardRecord, query_texts, record_from
from rl_rollout.rewards.openrlhf import OpenRLHFRewardFunc
from rl_rollout.rewards.runner import RewardError
from rl_rollout.rewards.server import Batch, RewardServer, ScoreFn, parse_batch

__all__ = [
    "Batch",
    "RemoteRewardClient",
    "RemoteRewardError",
    "RewardServer",
    "ScoreFn",
    "parse_batch",
    "scorer_for_remote_rm_url",
]

logger = logging.getLogger(__name__)

RETRY_STATUS = frozenset({408, 429})  # plus every 5xx


class RemoteRewardError(RewardError):
    """The reward server refused a batch, or could not be reached after every retry (a :class:`RewardError`:
    ``rl ppo`` stops on it with the message, not a traceback)."""


def _check_lengths(prompts: Sequence, responses: Sequence, labels: Sequence | None) -> None:
    if len(responses) != len(prompts) or (labels is not None and len(labels) != len(prompts)):
        n_labels = "no" if labels is None else len(labels)
        raise ValueError(
            f"{len(prompts)} prompts, {len(responses)} responses and {n_labels} labels; pass one of each per sample"
        )


class RemoteRewardClient:
    """Score batches on remote reward servers (``score(prompts, responses, labels) -> list[float]``).

    ``url``: one URL, or several separated by commas (each batch is split between them).
    ``attempts`` counts HTTP attempts made so far (for metrics). ``token`` is sent as
    ``Authorization: Bearer <token>`` (OpenRLHF's servers ignore it).
    """

    def __init__(
        self,
        url: str,
        token: str | None = None,
        *,
        timeout_s: float = 30.0,
        retries: int = 3,
        backoff_s: float = 0.5,
        max_backoff_s: float = 30.0,
    ) -> None:
        urls = [u.strip() for u in str(url).split(",") if u.strip()]
        for u in urls or [url]:
            parts = urllib.parse.urlsplit(u)
            if parts.scheme not in ("http", "https") or not parts.netloc:
                raise ValueError(
                    f"reward server url must look like http://host:port[/path] (several: comma-separated), got "
                    f"{u!r}; a local OpenRLHF reward file is a path ending in .py"
                )
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0 (seconds per attempt), got {timeout_s!r}")
        if not isinstance(retries, int) or retries < 0:
            raise ValueError(f"retries must be an int >= 0 (0 = one attempt), got {retries!r}")
        if not backoff_s >= 0 or not max_backoff_s >= 0:
            raise ValueError(f"backoff_s and max_backoff_s must be >= 0, got {backoff_s!r}, {max_backoff_s!r}")
        self.url = url
        self.urls = urls
        self.health_urls = [_health_url(u) for u in urls]
        self.health_url = self.health_urls[0]
        self._token = token
        self.timeout_s = timeout_s
        self.retries = retries
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self.attempts = 0
        self._last: RewardRecord | None = None

    def __repr__(self) -> str:  # never print the token
        return f"RemoteRewardClient({self.url!r}, token={'***' if self._token else None}, timeout_s={self.timeout_s})"

    def score(
        self, prompts: Sequence[str], responses: Sequence[str], labels: Sequence[str | None] | None = None
    ) -> list[float]:
        """One reward per prompt, in order; raises :class:`RemoteRewardError` when a server cannot give them."""
        return self.score_record(prompts, responses, labels).rewards

    def last_record(self) -> RewardRecord | None:
        """The latest batch's :class:`RewardRecord`: rewards, and the servers' scores and extra logs if sent."""
        return self._last

    def score_record(
        self, prompts: Sequence[str], responses: Sequence[str], labels: Sequence[str | None] | None = None
    ) -> RewardRecord:
        _check_lengths(prompts, responses, labels)
        n, k = len(prompts), len(self.urls)
        if n == 0:
            return RewardRecord([])
        labels = [None] * n if labels is None else list(labels)
        size = max(1, -(-n // k))  # OpenRLHF's sharding: contiguous, ceil(n / servers) each
        shards = [
            (u, i, min(i + size, n)) for u, i in zip(self.urls, range(0, n, size), strict=False)
        ]  # fewer shards than servers: some idle
        if len(shards) == 1:
            parts = [self._post(shards[0][0], prompts, responses, labels)]
        else:
            with ThreadPoolExecutor(len(shards), thread_name_prefix="rl-reward-client") as pool:
                futures = [pool.submit(self._post, u, prompts[a:b], responses[a:b], labels[a:b]) for u, a, b in shards]
                parts = [f.result() for f in futures]
        record = parts[0] if len(parts) == 1 else _concat(parts)
        self._last = record
        return record

    def _post(self, url: str, prompts: Sequence[str], responses: Sequence[str], labels: list) -> RewardRecord:
        body = json.dumps(
            {
                "query": query_texts(prompts, responses),
                "prompts": list(prompts),
                "responses": list(responses),
                "labels": labels,
            }
        ).encode()
        headers = {"Content-Type": "application/json"}
        if self._token:
            headers["Authorization"] = f"Bearer {self._token}"
        request = urllib.request.Request(url, data=body, headers=headers, method="POST")
        last_error = ""
        for attempt in range(self.retries + 1):
            self.attempts += 1
            try:
                with urllib.request.urlopen(request, timeout=self.timeout_s) as reply:
                    payload = reply.read()
            except urllib.error.HTTPError as e:
                message = _server_message(e)
                if e.code < 500 and e.code not in RETRY_STATUS:
                    raise RemoteRewardError(
                        f"reward server {url} refused the batch: HTTP {e.code}: {message}"
                    ) from None
                last_error = f"HTTP {e.code}: {message}"
            except (urllib.error.URLError, OSError, HTTPException) as e:  # refused, reset, timed out
                reason = e.reason if isinstance(e, urllib.error.URLError) else e
                last_error = f"{type(reason).__name__}: {reason}"
            else:
                try:
                    return record_from(json.loads(payload), len(prompts), "the reply")
                except (ValueError, RecursionError) as e:
                    raise RemoteRewardError(f"reward server {url} sent a bad reply: {e}") from None
            if attempt < self.retries:
                delay = min(self.backoff_s * 2**attempt, self.max_backoff_s)
                logger.warning(
                    "reward server %s: attempt %d/%d failed (%s); retrying in %.2fs",
                    url, attempt + 1, self.retries + 1, last_error, delay,
                )  # fmt: skip
                time.sleep(delay)
        raise RemoteRewardError(
            f"reward server {url} failed {self.retries + 1} attempt(s) (timeout_s={self.timeout_s}); last "
            f"error: {last_error}. Check that the server is up and reachable, or raise timeout_s / retries"
        )

    def probe(self, timeout_s: float = 5.0) -> None:
        """Check every server answers at all, before a run relies on it; :class:`RemoteRewardError` naming the
        URL that does not (refused, unresolvable, no answer within ``timeout_s``).

        Sends ``GET /health`` on each server's host (ours answers 200; nothing is scored). Any HTTP answer
        counts, an error status included: OpenRLHF's servers have no ``/health`` and answer 404, yet score POSTs."""
        for url, health in zip(self.urls, self.health_urls, strict=True):
            request = urllib.request.Request(health, method="GET")
            if self._token:
                request.add_header("Authorization", f"Bearer {self._token}")
            try:
                with urllib.request.urlopen(request, timeout=timeout_s):
                    pass
            except urllib.error.HTTPError:  # it answered: reachable
                continue
            except (urllib.error.URLError, OSError, HTTPException) as e:  # refused, unknown host, timed out
                reason = e.reason if isinstance(e, urllib.error.URLError) else e
                raise RemoteRewardError(
                    f"reward server {url} does not answer ({type(reason).__name__}: {reason}, probed for "
                    f"{timeout_s:g} s): start it (rl serve-rm, or OpenRLHF's serve_rm) or fix --remote_rm_url"
                ) from None

    def health(self) -> bool:
        """Whether ``GET /health`` on every server's host answers 200 within ``timeout_s`` (no retries)."""
        for url in self.health_urls:
            try:
                with urllib.request.urlopen(url, timeout=self.timeout_s) as reply:
                    if reply.status != 200:
                        return False
            except (urllib.error.URLError, OSError, HTTPException):
                return False
        return True


def _health_url(url: str) -> str:
    parts = urllib.parse.urlsplit(url)
    return urllib.parse.urlunsplit((parts.scheme, parts.netloc, "/health", "", ""))


def _concat(parts: list[RewardRecord]) -> RewardRecord:
    """Shards' records in order, as one; scores and a log only where every shard sent them."""
    rewards = [r for p in parts for r in p.rewards]
    scores = (
        None if any(p.scores is None for p in parts) else [s for p in parts if p.scores is not None for s in p.scores]
    )
    keys = set.intersection(*(set(p.extra_logs) for p in parts))
    return RewardRecord(rewards, scores, {k: [v for p in parts for v in p.extra_logs[k]] for k in sorted(keys)})


def _server_message(e: urllib.error.HTTPError) -> str:
    try:
        raw = e.read()
    except (OSError, HTTPException):
        return e.reason or ""
    try:
        return str(json.loads(raw)["error"])
    except (ValueError, KeyError, TypeError):
        return raw.decode("utf-8", errors="replace")[:500] or str(e.reason)


def scorer_for_remote_rm_url(url: str, *, token: str | None = None, timeout_s: float | None = None) -> Any:
    """What OpenRLHF makes of ``--remote_rm_url``: a path ending in ``.py`` is a local reward file
    (:class:`OpenRLHFRewardFunc`, ``timeout_s`` per batch), anything else one or more servers
    (:class:`RemoteRewardClient`, ``token``, its own per-attempt timeout)."""
    first = str(url).split(",")[0].strip()
    if first.endswith(".py"):
        return OpenRLHFRewardFunc(first, timeout_s=timeout_s)
    return RemoteRewardClient(url, token=token)
