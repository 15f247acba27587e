"""A reward server that hostile clients cannot take down: batches in, rewards out, over HTTP/1.1 (uvicorn).

Wire format (JSON, UTF-8), one batch per request, two dialects of the same thing::

    POST / | /score | /get_reward
        ours:     {"prompts": [str], "responses": [str], "labels": [str | null] | null}
        OpenRLHF: {"query": [prompt + response], "prompts": [str]?, "labels": [...]?}
    200  {"rewards": [float], "scores": [float], "extra_logs": {name: [float]}}
    4xx / 5xx  {"error": "what was wrong"}
    GET /health  {"status": "ok"}    no token needed

OpenRLHF's client POSTs the second form to ``/get_reward`` without a token and reads
``rewards`` (older ones also ``scores`` and ``extra_logs``, so every reply has all
three: ``scores`` are the rewards unless ``score_fn`` gave its own). Where only
``query`` comes, each response is the query after its prompt (the whole query when it
does not start with the prompt, or no prompts came); both are handed to a ``score_fn``
that has a ``queries`` parameter. A request with both ``responses`` and ``query`` uses
the responses.

``score_fn(prompts, responses, labels[, queries=...])`` returns one reward per sample as
a list or tensor, OpenRLHF's dict ``{"rewards", "scores", "extra_logs"}``, or a
:class:`~rl_rollout.rewards.loading.RewardRecord`; it is called from one thread at a
time (a model on one device is not re-entrant).

HTTP is uvicorn's (h11 parses it; one event loop on a thread of its own holds the connections, so a slow
client costs a socket, not a thread) under a small Starlette app. Hardening (each a constructor argument,
checked in :mod:`rl_rollout.rewards.server_app` and the tests):

- One deadline per request, ``request_timeout_s``: its head within it of the connection's start (or of the
  previous reply: connections are kept alive for ``keep_alive_s`` between requests), its body by the same
  deadline: a client that trickles bytes gets 408 when it runs out, however often it sends. Scoring is not
  under it.
- A request takes one of ``max_connections`` slots only once its token is checked, so idle or
  unauthenticated clients cannot keep an authorised one waiting; past the slots it gets 503 with
  ``Retry-After``. uvicorn bounds all connections at 16 x ``max_connections`` (past that, its own 503).
  Parsing and scoring run on a small thread pool. Memory is bounded by ``max_connections x
  max_request_bytes`` (bodies) plus the connections' headers (``max_header_bytes`` each).
- Every parse error is a 400 with the reason (deeply nested JSON included), headers over
  ``max_header_bytes`` a 431, a body over ``max_request_bytes`` a 413 (announced, or counted as it is read),
  a batch over ``max_batch`` a 413, a body without ``Content-Length`` a 411; ``score_fn`` failing a 500. A
  refused body is read and dropped (up to 64 MiB, within the deadline) so the client sees the reply.
- A bearer token is required unless built with ``allow_no_token=True`` (OpenRLHF's client
  sends none). IPv4/IPv6 as the host resolves; no TLS (put it behind a proxy, or keep it
  on a network nobody else can reach).

Here: the server's settings, start and stop (:class:`RewardServer`, :class:`RewardServerConfig`); the
HTTP app and what it adds to uvicorn is :mod:`rl_rollout.rewards.server_app` (imported on :meth:`start`:
uvicorn and Starlette are not paid for by ``rl --help``), the request formats :mod:`rl_rollout.rewards.protocol`.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from rl_rollout.config_fields import meta
from rl_rollout.rewards.protocol import Batch, _takes_queries, parse_batch  # noqa: F401 - re-exported

logger = logging.getLogger(__name__)

ScoreFn = Callable[..., Any]
TOKEN_ENV = "RL_REWARD_TOKEN"
_WORKER_THREADS = 4  # parse + score; score_fn itself runs one call at a time


class RewardServer:
    """Serve ``score_fn`` over HTTP (see the module docstring).

    ``port=0`` picks a free port; :attr:`url` says which, once started. Use as a context
    manager, or call :meth:`start` and :meth:`stop`. :attr:`counts` counts replies by
    status (503s included) for logs and tests: a copy, safe to read while it serves.
    """

    def __init__(
        self,
        score_fn: ScoreFn,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        token: str | None = None,
        allow_no_token: bool = False,
        max_request_bytes: int = 16 << 20,
        max_batch: int = 4096,
        request_timeout_s: float = 30.0,
        max_connections: int = 64,
        max_header_bytes: int = 16 << 10,
        keep_alive_s: float = 5.0,
    ) -> None:
        if not callable(score_fn):
            raise TypeError(f"score_fn must be callable (prompts, responses, labels) -> list[float], got {score_fn!r}")
        if not token and not allow_no_token:
            raise ValueError(
                "RewardServer needs a token= (clients send it as 'Authorization: Bearer <token>'); pass "
                "allow_no_token=True only for a server nobody else can reach (OpenRLHF's client sends no token)"
            )
        for name, value in (
            ("max_request_bytes", max_request_bytes),
            ("max_batch", max_batch),
            ("max_connections", max_connections),
            ("max_header_bytes", max_header_bytes),
        ):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        for name, seconds in (("request_timeout_s", request_timeout_s), ("keep_alive_s", keep_alive_s)):
            if not seconds > 0:
                raise ValueError(f"{name} must be > 0 seconds, got {seconds!r}")
        self.score_fn = score_fn
        self.host, self.port = host, port
        self.token = token or None
        self.max_request_bytes = max_request_bytes
        self.max_batch = max_batch
        self.request_timeout_s = float(request_timeout_s)
        self.max_connections = max_connections
        self.max_header_bytes = max_header_bytes
        self.keep_alive_s = float(keep_alive_s)
        self.backlog = max(128, 2 * max_connections)
        self._counts: collections.Counter[int] = collections.Counter()
        self._counts_lock = threading.Lock()
        self._pass_queries = _takes_queries(score_fn)
        self._score_lock = threading.Lock()
        self._sock: socket.socket | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._pool: ThreadPoolExecutor | None = None
        self._uvicorn: Any = None  # uvicorn.Server while serving

    @property
    def counts(self) -> collections.Counter[int]:
        with self._counts_lock:
            return collections.Counter(self._counts)

    def _count(self, status: int) -> None:
        with self._counts_lock:
            self._counts[status] += 1

    # ----- lifetime --------------------------------------------------------------------------

    @property
    def url(self) -> str:
        if self._sock is None:
            raise RuntimeError("RewardServer.url is known once the server is started; call start() first")
        host, port = self._sock.getsockname()[:2]
        if host in ("0.0.0.0", "::", ""):
            host = "127.0.0.1"
        return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"

    def start(self) -> RewardServer:
        if self._sock is not None:
            raise RuntimeError(f"RewardServer is already serving at {self.url}")
        from rl_rollout.rewards import server_app  # lazy: uvicorn + Starlette cost 0.3 s; rl ppo --help imports us

        try:
            sock = socket.create_server((self.host, self.port), backlog=self.backlog)
        except OSError as e:
            raise OSError(f"RewardServer cannot listen on {self.host}:{self.port} ({e}); pick another port or 0") from e
        self._sock = sock
        self._pool = ThreadPoolExecutor(_WORKER_THREADS, thread_name_prefix="rl-reward-work")
        self._uvicorn = server_app.make_uvicorn(self)
        failed: list[BaseException] = []
        self._thread = threading.Thread(target=self._run, args=(failed,), name="rl-reward-server", daemon=True)
        self._thread.start()
        while not self._uvicorn.started and self._thread.is_alive():
            time.sleep(0.005)
        if not self._uvicorn.started:
            self.stop()
            raise RuntimeError(f"RewardServer did not start: {failed[0] if failed else 'uvicorn exited'}")
        logger.info(
            "reward server listening at %s (max_connections=%d, request_timeout_s=%s, token %s)",
            self.url,
            self.max_connections,
            self.request_timeout_s,
            "required" if self.token else "NOT required",
        )
        return self

    def _run(self, failed: list[BaseException]) -> None:
        async def serve() -> None:
            self._loop = asyncio.get_running_loop()
            await self._uvicorn.serve(sockets=[self._sock])

        try:
            asyncio.run(serve())
        except BaseException as e:  # noqa: BLE001 - reported by start() (uvicorn exits with SystemExit)
            failed.append(e)

    def stop(self) -> None:
        """Stop serving and free the port (idempotent). Requests in flight are dropped; calls still in
        ``score_fn`` are not waited for."""
        if self._loop is not None and self._thread is not None and self._thread.is_alive():
            # lazy: loaded by start(), which set self._loop
            from rl_rollout.rewards.server_app import stop_now

            self._loop.call_soon_threadsafe(stop_now, self._uvicorn)
            self._thread.join(10)
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
        if self._sock is not None:
            self._sock.close()
        self._sock = self._loop = self._thread = self._pool = self._uvicorn = None

    def __enter__(self) -> RewardServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


@dataclass(frozen=True)
class RewardServerConfig:
    """How ``rl serve-rm`` listens (the :class:`RewardServer` arguments); :meth:`make` builds the server."""

    host: str = field(
        default="127.0.0.1",
        metadata=meta(
            "address to listen on (0.0.0.0: every interface, OpenRLHF's default: then anyone who reaches the "
            "machine reaches the server)"
        ),
    )
    port: int = field(default=5000, metadata=meta("port to listen on (0: any free one; OpenRLHF's default is 5000)"))
    token: str | None = field(
        default=None,
        metadata=meta(
            f"bearer token every request must carry (default: env {TOKEN_ENV}; prefer the variable, a flag shows in ps)"
        ),
    )
    allow_no_token: bool = field(
        default=False,
        metadata=meta(
            "serve without a token, for OpenRLHF's client (it sends none); only on a network nobody else can reach"
        ),
    )
    max_request_bytes: int = field(default=16 << 20, metadata=meta("largest request body; larger ones get 413"))
    max_batch: int = field(default=4096, metadata=meta("most samples in one request; more get 413"))
    request_timeout_s: float = field(
        default=30.0,
        metadata=meta(
            "seconds for a request's head (from connect, or from the previous reply on a kept-alive connection) "
            "and its body; slower ones get 408"
        ),
    )
    max_connections: int = field(
        default=64,
        metadata=meta(
            "connections served at once (each may hold a request of up to --max_request_bytes); more get 503"
        ),
    )

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be 0..65535, got {self.port}")
        for name in ("max_request_bytes", "max_batch", "max_connections"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not self.request_timeout_s > 0:
            raise ValueError(f"request_timeout_s must be > 0 seconds, got {self.request_timeout_s}")

    def resolved_token(self) -> str | None:
        """The token the server will require: ``--token``, else ``$RL_REWARD_TOKEN``; None with
        ``--allow_no_token``. ValueError with the fix when there is none, or both a flag and ``--allow_no_token``."""
        if self.allow_no_token:
            if self.token:
                raise ValueError(
                    "--token and --allow_no_token contradict each other: drop one (OpenRLHF's client "
                    "sends no token, so it needs --allow_no_token)"
                )
            return None
        token = self.token or os.environ.get(TOKEN_ENV) or None
        if token is None:
            raise ValueError(
                f"the reward server needs a token: export {TOKEN_ENV}=<secret> (or --token; a flag shows in ps) and "
                f"give clients the same ({TOKEN_ENV} or --remote_rm_token), or pass --allow_no_token to serve "
                "OpenRLHF's client, which sends none, on a network nobody else can reach"
            )
        return token

    def make(self, score_fn: ScoreFn) -> RewardServer:
        """A :class:`RewardServer` (not started) for ``score_fn`` with these settings."""
        token = self.resolved_token()
        return RewardServer(
            score_fn,
            self.host,
            self.port,
            token=token,
            allow_no_token=token is None,
            max_request_bytes=self.max_request_bytes,
            max_batch=self.max_batch,
            request_timeout_s=self.request_timeout_s,
            max_connections=self.max_connections,
        )
