"""Remote reward model over HTTP: a client with timeouts, retries and a bearer token, on httpx.

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
Connections are kept alive between batches (one ``httpx.Client`` per client, made on
first use: httpx is imported then, not by ``rl --help``); ``timeout_s`` bounds the
connect, each read and each write of an attempt.
:meth:`RemoteRewardClient.score` returns the rewards; :meth:`RemoteRewardClient.last_record`
the batch's scores and extra logs when the server sent them.

:func:`scorer_for_remote_rm_url` follows OpenRLHF's convention for ``--remote_rm_url``:
a ``.py`` path is a local reward file (:class:`~rl_rollout.rewards.openrlhf.OpenRLHFRewardFunc`),
anything else a server.
"""

from __future__ import annotations

import json
import logging
import threading
import time
import urllib.parse
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from rl_rollout.rewards.loading import RewardRecord, query_texts, record_from
from rl_rollout.rewards.openrlhf import OpenRLHFRewardFunc
from rl_rollout.rewards.runner import RewardError
from rl_rollout.rewards.server import Batch, RewardServer, ScoreFn, parse_batch

if TYPE_CHECKING:
    import httpx

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
        self._http: httpx.Client | None = None
        self._http_lock = threading.Lock()

    def _client(self) -> httpx.Client:
        """The keep-alive connection pool, made on first use (shards of one batch share it, from threads)."""
        with self._http_lock:
            if self._http is None:
                import httpx  # lazy: 0.35 s to import, and rl ppo --help imports this module

                self._http = httpx.Client(
                    timeout=httpx.Timeout(self.timeout_s),
                    limits=httpx.Limits(max_keepalive_connections=max(4, len(self.urls))),
                )  # proxies from the environment (HTTP_PROXY, NO_PROXY) apply, as they did with urllib
            return self._http

    def close(self) -> None:
        """Close the kept-alive connections (idempotent; the next call opens new ones)."""
        with self._http_lock:
            if self._http is not None:
                self._http.close()
                self._http = None

    def __getstate__(self) -> dict:  # pickled to another process: connections and locks stay here
        return {k: v for k, v in self.__dict__.items() if k not in ("_http", "_http_lock")} | {"_http": None}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._http_lock = threading.Lock()

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
        import httpx  # lazy: 0.35 s to import, and rl ppo --help imports this module

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
        last_error = ""
        for attempt in range(self.retries + 1):
            self.attempts += 1
            try:
                reply = self._client().post(url, content=body, headers=headers)
            except httpx.TransportError as e:  # refused, reset, timed out, unresolvable
                last_error = _reason(e)
            else:
                if reply.status_code >= 400:
                    message = _server_message(reply)
                    if reply.status_code < 500 and reply.status_code not in RETRY_STATUS:
                        raise RemoteRewardError(
                            f"reward server {url} refused the batch: HTTP {reply.status_code}: {message}"
                        ) from None
                    last_error = f"HTTP {reply.status_code}: {message}"
                else:
                    try:
                        return record_from(json.loads(reply.content), len(prompts), "the reply")
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
        import httpx  # lazy: 0.35 s to import, and rl ppo --help imports this module

        headers = {"Authorization": f"Bearer {self._token}"} if self._token else {}
        for url, health in zip(self.urls, self.health_urls, strict=True):
            try:  # any HTTP answer counts: it is reachable
                httpx.get(health, headers=headers, timeout=timeout_s)
            except httpx.TransportError as e:  # refused, unknown host, timed out
                raise RemoteRewardError(
                    f"reward server {url} does not answer ({_reason(e)}, probed for "
                    f"{timeout_s:g} s): start it (rl serve-rm, or OpenRLHF's serve_rm) or fix --remote_rm_url"
                ) from None

    def health(self) -> bool:
        """Whether ``GET /health`` on every server's host answers 200 within ``timeout_s`` (no retries)."""
        import httpx  # lazy: 0.35 s to import, and rl ppo --help imports this module

        for url in self.health_urls:
            try:
                if self._client().get(url).status_code != 200:
                    return False
            except httpx.TransportError:
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


def _reason(e: Exception) -> str:
    """The root cause of a transport error, as the OS said it (``ConnectionRefusedError: ...``), else httpx's."""
    cause: BaseException | None = e
    while cause is not None and not isinstance(cause, OSError):
        cause = cause.__cause__ or cause.__context__
    shown = cause if cause is not None and str(cause) else e
    return f"{type(shown).__name__}: {shown}"


def _server_message(reply: httpx.Response) -> str:
    try:
        return str(json.loads(reply.content)["error"])
    except (ValueError, KeyError, TypeError):
        return reply.content.decode("utf-8", errors="replace")[:500] or reply.reason_phrase


def scorer_for_remote_rm_url(url: str, *, token: str | None = None, timeout_s: float | None = None) -> Any:
    """What OpenRLHF makes of ``--remote_rm_url``: a path ending in ``.py`` is a local reward file
    (:class:`OpenRLHFRewardFunc`, ``timeout_s`` per batch), anything else one or more servers
    (:class:`RemoteRewardClient`, ``token``, its own per-attempt timeout)."""
    first = str(url).split(",")[0].strip()
    if first.endswith(".py"):
        return OpenRLHFRewardFunc(first, timeout_s=timeout_s)
    return RemoteRewardClient(url, token=token)
