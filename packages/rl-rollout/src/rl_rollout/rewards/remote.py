"""Remote reward model over HTTP: a client with timeouts, retries and a bearer token, and a server.

Wire format (JSON, UTF-8), one batch per request::

    POST <url>         {"prompts": [str], "responses": [str], "labels": [str | null] | null}
    200                {"rewards": [float]}             one per prompt, in order
    4xx / 5xx          {"error": "what was wrong"}
    GET  /health       {"status": "ok"}                 no token needed

:class:`RemoteRewardClient` posts to its URL as given (so it also talks to other
servers that speak this format). It retries connection errors, timeouts, 5xx,
408 and 429 with exponential backoff (``backoff_s * 2**attempt``, capped at
``max_backoff_s``) and raises :class:`RemoteRewardError` with the server's
message at once on any other 4xx: a bad token or a bad batch will not get
better by retrying.

:class:`RewardServer` serves ``score_fn(prompts, responses, labels) ->
list[float]`` (a reward model, say) on the stdlib ``ThreadingHTTPServer`` in a
background thread, at ``POST /`` and ``POST /score``. It requires a bearer
token unless built with ``allow_no_token=True``, and refuses oversized or
malformed requests before calling ``score_fn``. ``score_fn`` is called from one
thread at a time (a model on one device is not re-entrant); concurrent
requests queue. IPv4 only; no TLS (put it behind a proxy, or keep it on a
private network).
"""

from __future__ import annotations

import hmac
import json
import logging
import math
import numbers
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Sequence
from http import HTTPStatus
from http.client import HTTPException
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

logger = logging.getLogger(__name__)

ScoreFn = Callable[[list[str], list[str], list["str | None"]], Sequence[float]]
RETRY_STATUS = frozenset({408, 429})  # plus every 5xx
_DRAIN_LIMIT = 64 << 20  # read and drop up to this much of a refused body, so the client sees the reply


class RemoteRewardError(RuntimeError):
    """The reward server refused a batch, or could not be reached after every retry."""


def _check_lengths(prompts: Sequence, responses: Sequence, labels: Sequence | None) -> None:
    if len(responses) != len(prompts) or (labels is not None and len(labels) != len(prompts)):
        n_labels = "no" if labels is None else len(labels)
        raise ValueError(
            f"{len(prompts)} prompts, {len(responses)} responses and {n_labels} labels; pass one of each per sample"
        )


def _rewards_from(data: Any, n: int) -> list[float]:
    """The reward list in a response body, or ValueError saying what is wrong with it."""
    rewards = data.get("rewards") if isinstance(data, dict) else data
    if not isinstance(rewards, list) or len(rewards) != n:
        raise ValueError(f"expected {{'rewards': [{n} floats]}}, got {json.dumps(data)[:200]}")
    bad = [r for r in rewards if not isinstance(r, numbers.Real) or isinstance(r, bool) or not math.isfinite(r)]
    if bad:
        raise ValueError(f"rewards must be finite numbers, got {bad[:5]}")
    return [float(r) for r in rewards]


class RemoteRewardClient:
    """Score batches on a remote reward server (``score(prompts, responses, labels) -> list[float]``).

    ``attempts`` counts HTTP attempts made so far (for metrics). ``token`` is
    sent as ``Authorization: Bearer <token>``.
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
        parts = urllib.parse.urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.netloc:
            raise ValueError(f"reward server url must look like http://host:port[/path], got {url!r}")
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0 (seconds per attempt), got {timeout_s!r}")
        if not isinstance(retries, int) or retries < 0:
            raise ValueError(f"retries must be an int >= 0 (0 = one attempt), got {retries!r}")
        if not backoff_s >= 0 or not max_backoff_s >= 0:
            raise ValueError(f"backoff_s and max_backoff_s must be >= 0, got {backoff_s!r}, {max_backoff_s!r}")
        self.url = url
        self.health_url = urllib.parse.urlunsplit((parts.scheme, parts.netloc, "/health", "", ""))
        self._token = token
        self.timeout_s = timeout_s
        self.retries = retries
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self.attempts = 0

    def __repr__(self) -> str:  # never print the token
        return f"RemoteRewardClient({self.url!r}, token={'***' if self._token else None}, timeout_s={self.timeout_s})"

    def score(
        self, prompts: Sequence[str], responses: Sequence[str], labels: Sequence[str | None] | None = None
    ) -> list[float]:
        """One reward per prompt, in order; raises :class:`RemoteRewardError` when the server cannot give them."""
        _check_lengths(prompts, responses, labels)
        body = json.dumps(
            {"prompts": list(prompts), "responses": list(responses), "labels": None if labels is None else list(labels)}
        ).encode()
        headers = {"Content-Type": "application/json"}
        if self._token:
            headers["Authorization"] = f"Bearer {self._token}"
        request = urllib.request.Request(self.url, data=body, headers=headers, method="POST")
        last_error = ""
        for attempt in range(self.retries + 1):
            self.attempts += 1
            try:
                with urllib.request.urlopen(request, timeout=self.timeout_s) as reply:
                    payload = reply.read()
            except urllib.error.HTTPError as e:
                message = _server_message(e)
                if e.code < 500 and e.code not in RETRY_STATUS:
                    refused = f"reward server {self.url} refused the batch: HTTP {e.code}: {message}"
                    raise RemoteRewardError(refused) from None
                last_error = f"HTTP {e.code}: {message}"
            except (urllib.error.URLError, OSError, HTTPException) as e:  # refused, reset, timed out
                reason = e.reason if isinstance(e, urllib.error.URLError) else e
                last_error = f"{type(reason).__name__}: {reason}"
            else:
                try:
                    return _rewards_from(json.loads(payload), len(prompts))
                except ValueError as e:
                    raise RemoteRewardError(f"reward server {self.url} sent a bad reply: {e}") from None
            if attempt < self.retries:
                delay = min(self.backoff_s * 2**attempt, self.max_backoff_s)
                logger.warning(
                    "reward server %s: attempt %d/%d failed (%s); retrying in %.2fs",
                    self.url, attempt + 1, self.retries + 1, last_error, delay,
                )  # fmt: skip
                time.sleep(delay)
        raise RemoteRewardError(
            f"reward server {self.url} failed {self.retries + 1} attempt(s) (timeout_s={self.timeout_s}); last "
            f"error: {last_error}. Check that the server is up and reachable, or raise timeout_s / retries"
        )

    def health(self) -> bool:
        """Whether ``GET /health`` on the server's host answers 200 within ``timeout_s`` (no retries)."""
        try:
            with urllib.request.urlopen(self.health_url, timeout=self.timeout_s) as reply:
                return reply.status == 200
        except (urllib.error.URLError, OSError, HTTPException):
            return False


def _server_message(e: urllib.error.HTTPError) -> str:
    try:
        raw = e.read()
    except (OSError, HTTPException):
        return e.reason or ""
    try:
        return str(json.loads(raw)["error"])
    except (ValueError, KeyError, TypeError):
        return raw.decode("utf-8", errors="replace")[:500] or str(e.reason)


class _Refused(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def parse_batch(body: bytes, max_batch: int) -> tuple[list[str], list[str], list[str | None]]:
    """``(prompts, responses, labels)`` from a request body, or :class:`_Refused` with 400/413 and the reason."""
    try:
        data = json.loads(body)
    except ValueError as e:
        raise _Refused(400, f"request body is not valid JSON ({e})") from None
    if not isinstance(data, dict):
        kind = type(data).__name__
        raise _Refused(400, f"request body must be a JSON object with 'prompts' and 'responses', got a {kind}")
    for key in ("prompts", "responses"):
        value = data.get(key)
        if not isinstance(value, list) or not all(isinstance(x, str) for x in value):
            raise _Refused(400, f"'{key}' must be a list of strings, got {json.dumps(value)[:100]}")
    prompts, responses = data["prompts"], data["responses"]
    labels = data.get("labels")
    if labels is None:
        labels = [None] * len(prompts)
    elif not isinstance(labels, list) or not all(x is None or isinstance(x, str) for x in labels):
        raise _Refused(400, f"'labels' must be null or a list of strings/nulls, got {json.dumps(labels)[:100]}")
    if not len(prompts) == len(responses) == len(labels):
        raise _Refused(
            400, f"{len(prompts)} prompts, {len(responses)} responses, {len(labels)} labels; send one per sample"
        )
    if len(prompts) > max_batch:
        raise _Refused(413, f"batch of {len(prompts)} samples exceeds the server's max_batch={max_batch}; split it")
    return prompts, responses, labels


class _Handler(BaseHTTPRequestHandler):
    server_version = "rl-reward"
    server: Any  # the ThreadingHTTPServer, with .owner = the RewardServer

    def setup(self) -> None:
        self.timeout = self.server.owner.request_timeout_s  # a stalled client cannot hold a thread forever
        super().setup()

    def log_message(self, format: str, *args: Any) -> None:
        logger.debug("reward server %s: " + format, self.address_string(), *args)

    def _reply(self, status: int, obj: dict[str, Any]) -> None:
        body = json.dumps(obj).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        if status == HTTPStatus.UNAUTHORIZED:
            self.send_header("WWW-Authenticate", "Bearer")
        self.end_headers()
        self.wfile.write(body)

    def _discard(self, n: int) -> None:
        if n > _DRAIN_LIMIT:
            self.close_connection = True
            return
        while n > 0 and (chunk := self.rfile.read(min(n, 1 << 16))):
            n -= len(chunk)

    def do_GET(self) -> None:
        if self.path.split("?")[0] == "/health":
            self._reply(200, {"status": "ok"})
        else:
            self._reply(404, {"error": f"no such path {self.path!r}; GET /health or POST /score"})

    def do_POST(self) -> None:
        try:
            self._score()
        except OSError as e:  # the client went away or stalled past request_timeout_s
            logger.debug("reward server: dropped a request from %s: %s", self.address_string(), e)
            self.close_connection = True

    def _score(self) -> None:
        owner: RewardServer = self.server.owner
        length_text = self.headers.get("Content-Length")
        try:
            length = int(length_text) if length_text is not None else None
        except ValueError:
            length = -1
        if owner.token is not None:
            sent = self.headers.get("Authorization", "").encode()
            if not hmac.compare_digest(sent, f"Bearer {owner.token}".encode()):
                self._discard(length if length is not None and 0 < length <= owner.max_request_bytes else 0)
                self.close_connection = True
                return self._reply(401, {"error": "missing or wrong token; send 'Authorization: Bearer <token>'"})
        if self.path.split("?")[0] not in ("/", "/score"):
            self._discard(length if length is not None and 0 < length <= owner.max_request_bytes else 0)
            self.close_connection = True
            return self._reply(404, {"error": f"no such path {self.path!r}; POST / or /score"})
        if length is None or length < 0:
            self.close_connection = True
            return self._reply(411, {"error": "send a Content-Length header (an integer >= 0; no chunked bodies)"})
        if length > owner.max_request_bytes:
            self._discard(length)
            message = f"request body of {length} bytes exceeds max_request_bytes={owner.max_request_bytes}"
            return self._reply(413, {"error": message + "; send smaller batches"})
        try:
            prompts, responses, labels = parse_batch(self.rfile.read(length), owner.max_batch)
        except _Refused as e:
            return self._reply(e.status, {"error": str(e)})
        try:
            with owner._score_lock:
                scores = owner.score_fn(prompts, responses, labels)
            scores = scores.tolist() if hasattr(scores, "tolist") else list(scores)  # a tensor is fine too
            rewards = _rewards_from(scores, len(prompts))
        except Exception as e:
            logger.exception("reward server: score_fn failed on a batch of %d", len(prompts))
            return self._reply(500, {"error": f"score_fn failed: {type(e).__name__}: {e}"})
        self._reply(200, {"rewards": rewards})


class RewardServer:
    """Serve ``score_fn(prompts, responses, labels) -> list[float]`` over HTTP (see the module docstring).

    ``port=0`` picks a free port; :attr:`url` says which, once started. Use as
    a context manager, or call :meth:`start` and :meth:`stop`.
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
        request_timeout_s: float = 60.0,
    ) -> None:
        if not callable(score_fn):
            raise TypeError(f"score_fn must be callable (prompts, responses, labels) -> list[float], got {score_fn!r}")
        if not token and not allow_no_token:
            raise ValueError(
                "RewardServer needs a token= (clients send it as 'Authorization: Bearer <token>'); pass "
                "allow_no_token=True only for a server nobody else can reach"
            )
        if max_request_bytes < 1 or max_batch < 1:
            raise ValueError(f"max_request_bytes and max_batch must be >= 1, got {max_request_bytes}, {max_batch}")
        self.score_fn = score_fn
        self.host = host
        self.port = port
        self.token = token or None
        self.max_request_bytes = max_request_bytes
        self.max_batch = max_batch
        self.request_timeout_s = request_timeout_s
        self._score_lock = threading.Lock()
        self._httpd: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        if self._httpd is None:
            raise RuntimeError("RewardServer.url is known once the server is started; call start() first")
        host, port = self._httpd.server_address[:2]
        return f"http://{'127.0.0.1' if host in ('0.0.0.0', '') else host}:{port}"

    def start(self) -> RewardServer:
        if self._httpd is not None:
            raise RuntimeError(f"RewardServer is already serving at {self.url}")
        try:
            self._httpd = ThreadingHTTPServer((self.host, self.port), _Handler)
        except OSError as e:
            raise OSError(f"RewardServer cannot listen on {self.host}:{self.port} ({e}); pick another port or 0") from e
        self._httpd.owner = self  # type: ignore[attr-defined]
        self._thread = threading.Thread(
            target=self._httpd.serve_forever, kwargs={"poll_interval": 0.1}, name="rl-reward-server", daemon=True
        )
        self._thread.start()
        logger.info("reward server listening at %s", self.url)
        return self

    def stop(self) -> None:
        """Stop serving and free the port (idempotent). Requests still in ``score_fn`` are not waited for."""
        if self._httpd is None:
            return
        self._httpd.shutdown()
        self._httpd.server_close()
        if self._thread is not None:
            self._thread.join(5)
        self._httpd = self._thread = None

    def __enter__(self) -> RewardServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
