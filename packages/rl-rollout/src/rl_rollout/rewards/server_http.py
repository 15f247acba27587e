"""One connection of :class:`~rl_rollout.rewards.server.RewardServer`, one request: the HTTP/1.1 it speaks.

A mixin of the server (it uses the server's limits, counters, locks and worker pool, set by
``RewardServer.__init__``): :meth:`_connection` takes a pending slot, reads the headers within
``request_timeout_s`` (:func:`~rl_rollout.rewards.protocol._parse_head`), checks the token before anything
else is read, moves the request to one of ``max_connections`` slots, reads the body, scores it on the pool
(:meth:`_score`) and answers JSON; a refused body is drained (up to 64 MiB) so the client reads the reply,
not a reset. The request formats are :mod:`rl_rollout.rewards.protocol`; starting and stopping the server is
:mod:`rl_rollout.rewards.server`.
"""

from __future__ import annotations

import asyncio
import collections
import hmac
import json
import logging
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from http import HTTPStatus
from typing import Any

from rl_rollout.rewards.loading import record_from
from rl_rollout.rewards.protocol import Batch, _parse_head, _Refused, _takes_queries, parse_batch  # noqa: F401

logger = logging.getLogger("rl_rollout.rewards.server")  # the server's log: one logger for the whole server
SCORE_PATHS = ("/", "/score", "/get_reward")
_DRAIN_LIMIT = 64 << 20  # read and drop up to this much of a refused body, so the client sees the reply


class ConnectionMixin:
    """Serving one connection, for :class:`~rl_rollout.rewards.server.RewardServer`."""

    # The server's state this mixin uses, set by RewardServer.__init__ (annotations only: no class attributes).
    score_fn: Callable[..., Any]
    token: str | None
    max_request_bytes: int
    max_batch: int
    request_timeout_s: float
    max_connections: int
    max_header_bytes: int
    _counts: collections.Counter[int]
    _counts_lock: threading.Lock
    _pass_queries: bool
    _score_lock: threading.Lock
    _active: int
    _pending: int
    _pool: ThreadPoolExecutor | None

    def _busy(self) -> dict:
        return {"error": f"server busy: {self.max_connections} requests in progress (max_connections); retry shortly"}

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self._pending >= 16 * self.max_connections:
            await self._send(writer, 503, self._busy(), timeout=1.0, extra=("Retry-After: 1",))
            writer.close()
            return
        self._pending += 1
        held = [False]  # set by _request once the token is checked and a slot taken
        try:
            reply = await self._request(reader, writer, held)
            if reply is not None:
                status, obj, unread = reply
                await self._send(
                    writer,
                    status,
                    obj,
                    timeout=self.request_timeout_s,
                    extra=("Retry-After: 1",) if status == 503 else (),
                )
                if unread:
                    await self._linger(reader, writer, unread)
        except (ConnectionError, asyncio.IncompleteReadError, asyncio.TimeoutError, OSError):
            pass  # the client went away or stopped reading its reply
        except Exception:  # a bug here must not take the loop down: log it, answer 500 if we still can
            logger.exception("reward server: request failed")
            await self._send(writer, 500, {"error": "internal error in the reward server (logged)"}, timeout=1.0)
        finally:
            if held[0]:
                self._active -= 1
            else:
                self._pending -= 1
            writer.close()

    async def _request(self, reader, writer, held: list[bool]) -> tuple[int, dict, int] | None:
        """``(status, body, unread body bytes)``; None when the client left before sending a request. A request
        past the token check moves from the pending connections to a slot (``held[0]`` set)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.request_timeout_s
        late = (
            408,
            {
                "error": f"request not received in full within request_timeout_s={self.request_timeout_s}"
                "; send it faster or in smaller batches"
            },
            0,
        )
        try:
            raw = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), self.request_timeout_s)
            head = _parse_head(raw)
        except asyncio.TimeoutError:
            return late
        except asyncio.LimitOverrunError:
            return 431, {"error": f"request headers exceed max_header_bytes={self.max_header_bytes}"}, 0
        except asyncio.IncompleteReadError as e:
            return None if not e.partial.strip() else (400, {"error": "connection closed mid-headers"}, 0)
        except _Refused as e:
            return e.status, {"error": str(e)}, 0
        if head.method in ("GET", "HEAD") and head.path == "/health":
            return 200, {"status": "ok"}, 0
        if head.method != "POST":
            return 405, {"error": f"{head.method} {head.path}: use POST {' or '.join(SCORE_PATHS)}, or GET /health"}, 0
        if head.get("transfer-encoding") is not None:
            return 411, {"error": "chunked bodies are not accepted; send a Content-Length header"}, 0
        lengths = set(head.headers.get("content-length", []))
        if len(lengths) != 1 or not next(iter(lengths)).isdigit():
            return 411, {"error": f"send one Content-Length header (an integer >= 0), got {sorted(lengths)}"}, 0
        length = int(next(iter(lengths)))
        if self.token is not None:
            sent = (head.get("authorization") or "").encode()
            if not hmac.compare_digest(sent, f"Bearer {self.token}".encode()):
                return 401, {"error": "missing or wrong token; send 'Authorization: Bearer <token>'"}, length
        if head.path not in SCORE_PATHS:
            return 404, {"error": f"no such path {head.path!r}; POST {' or '.join(SCORE_PATHS)}"}, length
        if self._active >= self.max_connections:
            return 503, self._busy(), length
        self._pending -= 1
        self._active += 1
        held[0] = True
        if length > self.max_request_bytes:
            return (
                413,
                {
                    "error": f"request body of {length} bytes exceeds max_request_bytes="
                    f"{self.max_request_bytes}; send smaller batches"
                },
                length,
            )
        if (head.get("expect") or "").lower() == "100-continue":
            writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        try:
            body = await asyncio.wait_for(reader.readexactly(length), max(0.0, deadline - loop.time()))
        except asyncio.TimeoutError:
            return late
        status, obj = await loop.run_in_executor(self._pool, self._score, body)
        return status, obj, 0

    def _score(self, body: bytes) -> tuple[int, dict]:
        """Parse and score one body (on the worker pool)."""
        try:
            batch = parse_batch(body, self.max_batch)
        except _Refused as e:
            return e.status, {"error": str(e)}
        extra = {"queries": batch.queries} if self._pass_queries and batch.queries is not None else {}
        try:
            with self._score_lock:
                value = self.score_fn(batch.prompts, batch.responses, batch.labels, **extra)
            record = record_from(value, len(batch.prompts), "score_fn")
        except Exception as e:
            logger.exception("reward server: score_fn failed on a batch of %d", len(batch.prompts))
            return 500, {"error": f"score_fn failed: {type(e).__name__}: {e}"}
        return 200, record.as_json()

    async def _send(self, writer, status: int, obj: dict, *, timeout: float, extra: tuple[str, ...] = ()) -> None:
        with self._counts_lock:
            self._counts[status] += 1
        body = json.dumps(obj).encode()
        lines = [
            f"HTTP/1.1 {status} {HTTPStatus(status).phrase}",
            "Server: rl-reward",
            "Content-Type: application/json",
            f"Content-Length: {len(body)}",
            "Connection: close",
            *extra,
        ]
        if status == 401:
            lines.append("WWW-Authenticate: Bearer")
        try:
            writer.write(("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body)
            await asyncio.wait_for(writer.drain(), timeout)
        except (ConnectionError, asyncio.TimeoutError, OSError):
            pass
        logger.debug("reward server: %d %s", status, obj.get("error", ""))

    async def _linger(self, reader, writer, unread: int) -> None:
        """Drop a refused body (up to 64 MiB, within the deadline) so the client reads the reply, not a reset."""
        if unread > _DRAIN_LIMIT:
            return
        try:
            writer.write_eof()
        except (OSError, RuntimeError):
            return
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.request_timeout_s
        while unread > 0 and loop.time() < deadline:
            chunk = await asyncio.wait_for(reader.read(min(unread, 1 << 16)), deadline - loop.time())
            if not chunk:
                return
            unread -= len(chunk)
