"""The OpenAI endpoint's HTTP: a Starlette app on uvicorn, and the queue that batches requests into engine calls.

Imported by :meth:`~rl_rollout.openai_api.server.OpenAIServer.start` only (uvicorn and Starlette are not paid
for by ``import rl_rollout``). Order of the checks per request: route (404), key (401 missing or unknown, 410
closed), a slot of ``max_concurrent_requests`` (503 + ``Retry-After``), the body under ``max_request_bytes``
(413) and the deadline, the fields (400), then the batch queue and the engine, all under
``request_timeout_s`` (504). Tokenizer work (chat template, decoding, stream chunks) runs on one thread of its
own: off the event loop, and one call at a time (a fast tokenizer is not safe to share across threads).
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

import uvicorn
from starlette.applications import Starlette
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from rl_rollout.openai_api.episodes import RecordedChoice
from rl_rollout.openai_api.protocol import ParsedRequest, RequestError, parse_body, parse_request
from rl_rollout.types import RolloutSample

if TYPE_CHECKING:
    from rl_rollout.openai_api.server import OpenAIServer

_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "timeout",
    410: "episode_closed",
    413: "invalid_request_error",
    503: "server_busy",
    504: "timeout",
}


class _TooBig(Exception):
    pass


class Batcher:
    """Requests queued on the server's loop; a runner hands those that arrive within the window to the engine
    as one call (on the engine thread), the next batch gathering while one generates."""

    def __init__(self, server: OpenAIServer) -> None:
        self.server = server
        self._queue: asyncio.Queue[tuple[ParsedRequest, asyncio.Future]] | None = None
        self._runner: asyncio.Task | None = None

    @property
    def queued(self) -> int:
        """Requests waiting for an engine call (not yet handed to one)."""
        return 0 if self._queue is None else self._queue.qsize()

    async def submit(self, parsed: ParsedRequest) -> list[RolloutSample]:
        loop = asyncio.get_running_loop()
        if self._queue is None:
            self._queue = asyncio.Queue()
            self._runner = loop.create_task(self._run())
        future: asyncio.Future = loop.create_future()
        await self._queue.put((parsed, future))
        return await future

    async def _run(self) -> None:
        assert self._queue is not None
        cfg, loop = self.server.config, asyncio.get_running_loop()
        while True:
            batch = [await self._queue.get()]
            deadline = loop.time() + cfg.batch_window_ms / 1000
            while len(batch) < cfg.max_batch_requests:
                left = deadline - loop.time()
                try:
                    batch.append(
                        self._queue.get_nowait() if left <= 0 else await asyncio.wait_for(self._queue.get(), left)
                    )
                except (asyncio.QueueEmpty, asyncio.TimeoutError):
                    break
            batch = [(p, f) for p, f in batch if not f.done()]  # timed out while queued: not generated
            if not batch:
                continue
            try:
                results = await loop.run_in_executor(
                    self.server._engine_pool, self.server._generate, [p for p, _ in batch]
                )
                if len(results) != len(batch):
                    raise RuntimeError(f"the engine returned {len(results)} results for {len(batch)} requests")
            except Exception as e:  # every caller of the batch gets the failure
                for _, f in batch:
                    if not f.done():
                        f.set_exception(e)
                continue
            for (_, f), samples in zip(batch, results, strict=True):
                if not f.done():
                    f.set_result(samples)


class OpenAIApp:
    def __init__(self, server: OpenAIServer) -> None:
        self.server = server
        self.batcher = Batcher(server)
        self._active = 0
        self.asgi = Starlette(routes=[Route("/{path:path}", self._endpoint, methods=["GET", "POST"])])

    def _error(self, status: int, message: str, param: str | None = None, headers: dict | None = None) -> JSONResponse:
        self.server.count(f"status_{status}")
        if status == 401:
            headers = {**(headers or {}), "WWW-Authenticate": "Bearer"}
        body = {
            "error": {
                "message": message,
                "type": _ERROR_TYPES.get(status, "server_error"),
                "param": param,
                "code": status,
            }
        }
        return JSONResponse(body, status, headers)

    def _ok(self, obj: dict) -> JSONResponse:
        self.server.count("status_200")
        return JSONResponse(obj)

    def _key(self, request: Request) -> tuple[str | None, JSONResponse | None]:
        auth = request.headers.get("authorization", "")
        key = auth[7:].strip() if auth[:7].lower() == "bearer " else ""
        state = self.server.episodes.state(key) if key else "unknown"
        if state == "open":
            return key, None
        if state == "closed":
            self.server.count("gone")
            return None, self._error(410, "this episode is closed; its key no longer serves (open a new episode)")
        return None, self._error(401, "missing or unknown API key; send 'Authorization: Bearer <episode key>'")

    async def _endpoint(self, request: Request) -> Response:
        srv, path, method = self.server, request.scope["path"].rstrip("/"), request.method
        srv.count("requests")
        if path == "/health" and method == "GET":
            return self._ok({"status": "ok"})
        routes = {("GET", "/v1/models"), ("POST", "/v1/chat/completions"), ("POST", "/v1/completions")}
        if (method, path) not in routes:
            return self._error(404, f"no route {method} {path}; use {', '.join(' '.join(r) for r in sorted(routes))}")
        key, refused = self._key(request)
        if refused is not None:
            return refused
        if path == "/v1/models":
            model = {"id": srv.config.model_name, "object": "model", "created": 0, "owned_by": "rl-rollout"}
            return self._ok({"object": "list", "data": [model]})
        if self._active >= srv.config.max_concurrent_requests:
            return self._error(
                503,
                f"server busy: {srv.config.max_concurrent_requests} requests in progress; retry shortly",
                headers={"Retry-After": "1"},
            )
        self._active += 1
        try:
            return await asyncio.wait_for(self._serve(request, key or "", path), srv.config.request_timeout_s)
        except asyncio.TimeoutError:
            srv.count("timeouts")
            return self._error(
                504, f"not answered within request_timeout_s={srv.config.request_timeout_s}; not recorded"
            )
        finally:
            self._active -= 1

    async def _serve(self, request: Request, key: str, path: str) -> Response:
        srv, cfg = self.server, self.server.config
        length = request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > cfg.max_request_bytes:
            return self._error(413, f"request body of {length} bytes exceeds max_request_bytes={cfg.max_request_bytes}")
        try:
            body = await _read_capped(request, cfg.max_request_bytes)
        except _TooBig:
            return self._error(
                413, f"request body exceeds max_request_bytes={cfg.max_request_bytes}", headers={"Connection": "close"}
            )
        except ClientDisconnect:
            return JSONResponse({}, 400)
        kind = "chat" if path.endswith("chat/completions") else "completion"
        loop = asyncio.get_running_loop()
        try:
            obj = parse_body(body)
            parsed = await loop.run_in_executor(
                srv._tokenizer_pool,
                lambda: parse_request(
                    obj,
                    kind,
                    srv.tokenizer,
                    vocab_size=srv.vocab_size,
                    default_max_tokens=cfg.default_max_tokens,
                    max_tokens_limit=cfg.max_tokens_limit,
                    max_n=cfg.max_n,
                    max_model_len=srv.max_model_len,
                ),
            )
            source, refused = await loop.run_in_executor(srv._tokenizer_pool, srv.episode_prompt, key, obj, parsed)
        except RequestError as e:
            return self._error(e.status, str(e), e.param)
        if parsed.tools is not None and parsed.tools.parse and srv.tool_parser is None:
            return self._error(
                400,
                f"tool_parser={srv.config.tool_calls.parser!r} found no tool-call format in this model's chat template; "
                "set the endpoint's tool_parser (--agent_cmd_tool_parser: hermes, llama3_json, mistral or vllm:NAME)",
                "tools",
            )
        try:
            samples = await self.batcher.submit(parsed)
        except Exception as e:  # the engine failed on the batch: every request of it hears why
            return self._error(500, f"the engine failed: {type(e).__name__}: {e}")
        choices = await loop.run_in_executor(srv._tokenizer_pool, srv.choices, parsed, samples)
        if not srv.episodes.record(key, kind, parsed.prompt_ids, choices, obj, source, refused):
            srv.count("gone")
            return self._error(410, "the episode was closed while this call ran; not recorded")
        usage = {
            "prompt_tokens": len(parsed.prompt_ids),
            "completion_tokens": sum(len(c.response_ids) for c in choices),
        }
        usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
        srv.count("prompt_tokens", usage["prompt_tokens"])
        srv.count("completion_tokens", usage["completion_tokens"])
        rid = ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex
        head = {"id": rid, "created": int(time.time()), "model": srv.config.model_name}
        if parsed.stream:
            srv.count("status_200")
            chunks = await loop.run_in_executor(srv._tokenizer_pool, self._chunks, parsed, choices, usage, head)
            return StreamingResponse(
                _sse(chunks), media_type="text/event-stream", headers={"Cache-Control": "no-cache"}
            )
        if kind == "chat":
            out = [
                {
                    "index": i,
                    "message": _message(c),
                    "finish_reason": c.reply_finish_reason,
                    "logprobs": self._chat_logprobs(c) if parsed.logprobs else None,
                }
                for i, c in enumerate(choices)
            ]
            return self._ok({**head, "object": "chat.completion", "choices": out, "usage": usage})
        texts: list[dict[str, Any]] = [
            {
                "index": i,
                "text": c.text,
                "finish_reason": c.finish_reason,
                "logprobs": self._completion_logprobs(c) if parsed.logprobs else None,
            }
            for i, c in enumerate(choices)
        ]
        return self._ok({**head, "object": "text_completion", "choices": texts, "usage": usage})

    def _pieces(self, c: RecordedChoice) -> list[str]:
        """Each recorded token's text as streamed: the growth of the decoded prefix, clamped to the text sent."""
        tok, pieces, prev = self.server.tokenizer, [], 0
        for i in range(len(c.response_ids)):
            upto = min(len(tok.decode(c.response_ids[: i + 1], skip_special_tokens=True)), len(c.text))
            pieces.append(c.text[prev:upto])
            prev = max(prev, upto)
        if prev < len(c.text):
            pieces.append(c.text[prev:])
        return pieces

    def _chat_logprobs(self, c: RecordedChoice) -> dict:
        texts = [self.server.tokenizer.decode([t]) for t in c.response_ids]
        return {
            "content": [
                {"token": t, "logprob": lp, "bytes": list(t.encode()), "top_logprobs": []}
                for t, lp in zip(texts, c.logprobs, strict=True)
            ]
        }

    def _completion_logprobs(self, c: RecordedChoice) -> dict:
        texts = [self.server.tokenizer.decode([t]) for t in c.response_ids]
        offsets, pos = [], 0
        for t in texts:
            offsets.append(pos)
            pos += len(t)
        return {"tokens": texts, "token_logprobs": list(c.logprobs), "top_logprobs": None, "text_offset": offsets}

    def _chunks(self, parsed: ParsedRequest, choices: list[RecordedChoice], usage: dict, head: dict) -> list[dict]:
        chat = parsed.kind == "chat"
        obj = "chat.completion.chunk" if chat else "text_completion"
        out: list[dict] = []

        def chunk(i: int, piece: str, lp: dict | None, finish: str | None, first: bool = False) -> dict:
            if chat:
                delta: dict[str, Any] = (
                    {"role": "assistant", "content": piece} if first else ({"content": piece} if finish is None else {})
                )
                body = {"index": i, "delta": delta, "logprobs": lp, "finish_reason": finish}
            else:
                body = {"index": i, "text": piece, "logprobs": lp, "finish_reason": finish}
            return {**head, "object": obj, "choices": [body], **({"usage": None} if parsed.include_usage else {})}

        for i, c in enumerate(choices):
            full = (self._chat_logprobs(c) if chat else self._completion_logprobs(c)) if parsed.logprobs else None
            if chat and c.tool_parse is not None and (c.tool_calls or c.content != c.text):
                # the content whole (calls cut out of it, or failed ones as the parser read them), then the calls
                lp0 = None if full is None else (full if not c.content else {"content": []})
                out.append(chunk(i, "", lp0, None, first=True))
                if c.content:
                    out.append(chunk(i, c.content, full, None))
                for k, tc in enumerate(c.tool_calls):
                    body = {
                        "index": i,
                        "delta": {"tool_calls": [tc.openai(k)]},
                        "logprobs": None,
                        "finish_reason": None,
                    }
                    out.append(
                        {**head, "object": obj, "choices": [body], **({"usage": None} if parsed.include_usage else {})}
                    )
                out.append(chunk(i, "", None, c.reply_finish_reason))
                continue
            if chat:
                out.append(chunk(i, "", {"content": []} if full else None, None, first=True))
            for t, piece in enumerate(self._pieces(c)):
                lp = None
                if full is not None and t < len(c.response_ids):  # this token's entry of the whole choice's
                    lp = {k: (v[t : t + 1] if isinstance(v, list) else v) for k, v in full.items()}
                elif full is not None:
                    lp = {k: ([] if isinstance(v, list) else v) for k, v in full.items()}
                out.append(chunk(i, piece, lp, None))
            out.append(chunk(i, "", None, c.finish_reason))
        if parsed.include_usage:
            out.append({**head, "object": obj, "choices": [], "usage": usage})
        return out


def _message(c: RecordedChoice) -> dict[str, Any]:
    msg: dict[str, Any] = {"role": "assistant", "content": c.content}
    if c.tool_calls:
        msg["tool_calls"] = [tc.openai() for tc in c.tool_calls]
    return msg


async def _sse(chunks: list[dict]) -> AsyncIterator[bytes]:
    for c in chunks:
        yield b"data: " + json.dumps(c).encode() + b"\n\n"
    yield b"data: [DONE]\n\n"


async def _read_capped(request: Request, cap: int) -> bytes:
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > cap:
            raise _TooBig
        chunks.append(chunk)
    return b"".join(chunks)


def make_uvicorn(server: OpenAIServer) -> uvicorn.Server:
    """A uvicorn server (not started; ``serve`` takes the listening socket) for ``server``."""
    cfg = server.config
    app = OpenAIApp(server)
    server._queued = lambda: app.batcher.queued
    config = uvicorn.Config(
        app.asgi,
        http="h11",
        ws="none",
        lifespan="off",
        interface="asgi3",
        loop="asyncio",
        log_config=None,  # leave the process's logging alone
        log_level="warning",
        access_log=False,
        proxy_headers=False,
        server_header=False,
        headers=[("Server", "rl-openai")],
        limit_concurrency=4 * cfg.max_concurrent_requests,  # every connection: past it, uvicorn's own 503
        timeout_keep_alive=5,
        backlog=max(128, 2 * cfg.max_concurrent_requests),
    )
    return uvicorn.Server(config)
