"""The reward server's HTTP: a Starlette app on uvicorn, plus the few limits uvicorn has no setting for.

uvicorn (h11) parses HTTP and holds the connections; :func:`make_uvicorn` gives it the server's limits as its
own settings (``limit_concurrency``: 16 x ``max_connections`` connections, past which uvicorn answers 503;
``h11_max_incomplete_event_size``: ``max_header_bytes``; ``timeout_keep_alive``; ``backlog``). What it lacks:

- :class:`DeadlineProtocol` (uvicorn's ``H11Protocol``): a request's head must be in within
  ``request_timeout_s`` of the connection's start, or of the previous reply on a kept-alive connection (the
  rest of a refused body included): a client trickling headers gets 408 and the connection is closed; headers
  over ``max_header_bytes`` get 431 where uvicorn says 400. The deadline travels to the app in the scope.
- :class:`ScoreApp`, the Starlette app: ``GET /health``; ``POST /``, ``/score``, ``/get_reward`` with the
  token (401), a ``Content-Length`` (411), one of ``max_connections`` slots (503 with ``Retry-After``), the
  body read under a size cap (413) and the same deadline (408); then parsed and scored on the worker pool
  (400 / 413 with the reason, 500 when ``score_fn`` fails). A refused body is left to uvicorn, which reads
  and drops it so the client sees the reply (up to 64 MiB; a larger or late one closes the connection).

Imported only when a :class:`~rl_rollout.rewards.server.RewardServer` starts (uvicorn and Starlette take a
third of a second to import, and ``rl ppo --help`` imports the server module).
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import socket
from http import HTTPStatus
from typing import TYPE_CHECKING, Any, ClassVar

import h11
import uvicorn
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse
from starlette.routing import Route
from uvicorn.protocols.http.h11_impl import H11Protocol

from rl_rollout.rewards.loading import record_from
from rl_rollout.rewards.protocol import _Refused, parse_batch

if TYPE_CHECKING:
    from rl_rollout.rewards.server import RewardServer

logger = logging.getLogger("rl_rollout.rewards.server")  # the server's log: one logger for the whole server
SCORE_PATHS = ("/", "/score", "/get_reward")
DRAIN_LIMIT = 64 << 20  # a refused body up to this size is read and dropped (by uvicorn) so the client sees the reply
DEADLINE_KEY = "rl_reward.deadline"  # scope key: the loop time by which the request's body must be in
_CLOSE = {"Connection": "close"}


class DeadlineProtocol(H11Protocol):
    """uvicorn's HTTP/1.1 connection with a deadline on each request's head, and 431 for oversized headers."""

    reward: ClassVar[RewardServer]  # set by protocol_for(): the server whose limits and counts this uses

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._deadline = 0.0
        self._timer: asyncio.TimerHandle | None = None
        inner = self.app

        async def app(scope: Any, receive: Any, send: Any) -> None:
            scope[DEADLINE_KEY] = self._deadline  # the head came within it; the body must too
            await inner(scope, receive, send)

        self.app = app

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            # asyncio sets this only on sockets made with proto=IPPROTO_TCP (not socket.create_server's): without
            # it a reply's head and body wait on the client's delayed ACK, 40 ms a request on a kept connection
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._arm()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing():
            self._arm()  # the next request (or the rest of a refused body) gets its own deadline

    def connection_lost(self, exc: Exception | None) -> None:
        if self._timer is not None:
            self._timer.cancel()
        super().connection_lost(exc)

    def _arm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._deadline = self.loop.time() + self.reward.request_timeout_s
        self._timer = self.loop.call_at(self._deadline, self._late)

    def _late(self) -> None:
        self._timer = None
        if self.transport.is_closing() or (self.cycle is not None and not self.cycle.response_complete):
            return  # closed, or the app has the request: it holds the body to the same deadline
        if self.conn.our_state is h11.IDLE and self.conn.trailing_data[0]:  # part of a head came: say why
            self._refuse(408, _late_message(self.reward))
        self.transport.close()  # an idle connection, or a refused body still coming: just close

    def send_400_response(self, msg: str) -> None:  # h11 refused the request (uvicorn answers 400 to all)
        if len(self.conn.trailing_data[0]) > self.reward.max_header_bytes:
            self._refuse(431, f"request headers exceed max_header_bytes={self.reward.max_header_bytes}")
        else:
            self._refuse(400, f"malformed HTTP request ({msg.rstrip('.')}); send HTTP/1.1 with a JSON body")
        self.transport.close()

    def _refuse(self, status: int, message: str) -> None:
        body = json.dumps({"error": message}).encode()
        head = (
            f"HTTP/1.1 {status} {HTTPStatus(status).phrase}\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\nconnection: close\r\n\r\n"
        )
        self.transport.write(head.encode("latin-1") + body)
        self.reward._count(status)


def _late_message(server: RewardServer) -> str:
    return (
        f"request not received in full within request_timeout_s={server.request_timeout_s}"
        "; send it faster or in smaller batches"
    )


class ScoreApp:
    """The ASGI app: one request, one JSON reply (see the module docstring for the order of the checks)."""

    def __init__(self, server: RewardServer) -> None:
        self.server = server
        self._active = 0  # requests past the token check, holding one of max_connections slots
        self.asgi = Starlette(
            routes=[Route("/{path:path}", self._endpoint, methods=["GET", "POST"])],  # GET brings HEAD
            exception_handlers={HTTPException: self._refused},  # other methods: 405, as JSON like the rest
        )

    def _reply(self, status: int, obj: dict, headers: dict[str, str] | None = None) -> JSONResponse:
        self.server._count(status)
        if status == 401:
            headers = {**(headers or {}), "WWW-Authenticate": "Bearer"}
        logger.debug("reward server: %d %s", status, obj.get("error", ""))
        return JSONResponse(obj, status, headers)

    async def _refused(self, request: Request, exc: Exception) -> JSONResponse:
        status = exc.status_code if isinstance(exc, HTTPException) else 500
        if status == 405:
            return self._not_allowed(request)
        return self._reply(status, {"error": str(getattr(exc, "detail", exc))})

    def _not_allowed(self, request: Request) -> JSONResponse:
        where = f"{request.method} {request.scope['path']}"
        return self._reply(405, {"error": f"{where}: use POST {' or '.join(SCORE_PATHS)}, or GET /health"})

    async def _endpoint(self, request: Request) -> JSONResponse:
        srv, path, method = self.server, request.scope["path"], request.method
        if path == "/health" and method in ("GET", "HEAD"):
            return self._reply(200, {"status": "ok"})
        if method != "POST":
            return self._not_allowed(request)
        head = sum(len(k) + len(v) + 4 for k, v in request.scope["headers"])  # h11 bounds only a head still coming
        if head > srv.max_header_bytes:
            return self._reply(
                431, {"error": f"request headers exceed max_header_bytes={srv.max_header_bytes}"}, _CLOSE
            )
        if "transfer-encoding" in request.headers:
            return self._reply(411, {"error": "chunked bodies are not accepted; send a Content-Length header"}, _CLOSE)
        sent = request.headers.get("content-length")
        if sent is None:  # h11 checked that any it got are one integer
            return self._reply(411, {"error": "send a Content-Length header (an integer >= 0)"})
        length = int(sent)
        keep = None if length <= DRAIN_LIMIT else _CLOSE  # a refused body uvicorn reads and drops, or not
        if srv.token is not None:
            given = request.headers.get("authorization", "").encode()
            if not hmac.compare_digest(given, f"Bearer {srv.token}".encode()):
                return self._reply(401, {"error": "missing or wrong token; send 'Authorization: Bearer <token>'"}, keep)
        if path not in SCORE_PATHS:
            return self._reply(404, {"error": f"no such path {path!r}; POST {' or '.join(SCORE_PATHS)}"}, keep)
        if self._active >= srv.max_connections:
            busy = f"server busy: {srv.max_connections} requests in progress (max_connections); retry shortly"
            return self._reply(503, {"error": busy}, {"Retry-After": "1", **(keep or {})})
        self._active += 1
        try:
            return await self._scored(request, length, keep)
        finally:
            self._active -= 1

    async def _scored(self, request: Request, length: int, keep: dict[str, str] | None) -> JSONResponse:
        srv = self.server
        if length > srv.max_request_bytes:
            too_big = f"request body of {length} bytes exceeds max_request_bytes={srv.max_request_bytes}"
            return self._reply(413, {"error": f"{too_big}; send smaller batches"}, keep)
        loop = asyncio.get_running_loop()
        try:
            left = request.scope.get(DEADLINE_KEY, loop.time() + srv.request_timeout_s) - loop.time()
            body = await asyncio.wait_for(_read_capped(request, srv.max_request_bytes), max(0.0, left))
        except asyncio.TimeoutError:
            return self._reply(408, {"error": _late_message(srv)}, _CLOSE)
        except _Refused as e:
            return self._reply(e.status, {"error": str(e)}, _CLOSE)
        except ClientDisconnect:  # gone: nobody reads a reply, none is counted
            return JSONResponse({"error": "the client closed the connection mid-body"}, 400, _CLOSE)
        status, obj = await loop.run_in_executor(srv._pool, self._score, body)
        return self._reply(status, obj)

    def _score(self, body: bytes) -> tuple[int, dict]:
        """Parse and score one body (on the worker pool; ``score_fn`` one call at a time)."""
        srv = self.server
        try:
            batch = parse_batch(body, srv.max_batch)
        except _Refused as e:
            return e.status, {"error": str(e)}
        extra = {"queries": batch.queries} if srv._pass_queries and batch.queries is not None else {}
        try:
            with srv._score_lock:
                value = srv.score_fn(batch.prompts, batch.responses, batch.labels, **extra)
            record = record_from(value, len(batch.prompts), "score_fn")
        except Exception as e:
            logger.exception("reward server: score_fn failed on a batch of %d", len(batch.prompts))
            return 500, {"error": f"score_fn failed: {type(e).__name__}: {e}"}
        return 200, record.as_json()


async def _read_capped(request: Request, cap: int) -> bytes:
    """The body, or :class:`_Refused` 413 as soon as more than ``cap`` bytes came (h11 also holds the client
    to its Content-Length, which was checked against the cap: this is the second lock on the door)."""
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > cap:
            raise _Refused(413, f"request body exceeds max_request_bytes={cap}; send smaller batches")
        chunks.append(chunk)
    return b"".join(chunks)


def make_uvicorn(server: RewardServer) -> uvicorn.Server:
    """A uvicorn server (not started; :meth:`uvicorn.Server.serve` takes the listening socket) for ``server``:
    the app, the protocol and the limits uvicorn has settings for."""
    protocol = type("RewardProtocol", (DeadlineProtocol,), {"reward": server})
    config = uvicorn.Config(
        ScoreApp(server).asgi,
        http=protocol,
        ws="none",
        lifespan="off",
        interface="asgi3",
        loop="asyncio",
        log_config=None,  # leave the process's logging alone
        log_level="warning",
        access_log=False,
        proxy_headers=False,
        server_header=False,
        headers=[("Server", "rl-reward")],
        limit_concurrency=16 * server.max_connections,  # every connection, authorised or not: past it, 503
        timeout_keep_alive=server.keep_alive_s,  # type: ignore[arg-type]  # typed int; loop.call_later takes a float
        h11_max_incomplete_event_size=server.max_header_bytes,
        backlog=server.backlog,
    )
    return uvicorn.Server(config)


def stop_now(userver: uvicorn.Server) -> None:
    """On the server's loop: stop accepting, drop every connection, do not wait for requests in flight."""
    userver.should_exit = userver.force_exit = True
    for conn in list(userver.server_state.connections):
        transport = getattr(conn, "transport", None)
        if transport is not None:
            transport.close()
