"""``OpenAIServer``: an OpenAI-compatible endpoint over a rollout engine, recording every call token-exact.

A program under training (an agent written against the ``openai`` client) gets a ``base_url`` and an API key
per episode (:meth:`OpenAIServer.open_episode`); it calls ``POST /v1/chat/completions`` or
``/v1/completions`` (plain or streamed as server-sent events) and ``GET /v1/models``. The server renders chat
messages with the tokenizer's chat template (``add_generation_prompt=True``; a call that continues an earlier
call of its episode gets that call's prompt + sampled ids and the new turns' tokens, token-in-token-out:
:mod:`rl_rollout.openai_api.splice`), hands token ids to the engine
(any :class:`~rl_rollout.engine.RolloutEngine`), and answers text, ``usage``, ``finish_reason`` and, when
asked, the engine's log-probs of the sampled tokens. :meth:`OpenAIServer.close_episode` returns the calls of
the episode as the engine saw them (:class:`~rl_rollout.openai_api.episodes.RecordedCall`): prompt ids exactly
as the engine got them (and whether rendered or spliced), sampled ids, their log-probs, finish reason and the weight version (the engine's
``policy_version``) of each choice. No text is re-tokenized on the way to the trainer.

Batching: the engines are batch APIs, so requests arriving within ``batch_window_ms`` of the first waiting
one (at most ``max_batch_requests``) go to the engine as one ``generate`` call on one engine thread; a stream
is sent once its choices are generated (one SSE chunk per token, then ``data: [DONE]``), never one engine
call per token.

Bounds (:class:`~rl_rollout.openai_api.config.OpenAIServerConfig`): a missing or unknown key is 401, a closed
episode's key 410 (counted as ``gone``), past ``max_concurrent_requests`` requests in progress 503 with
``Retry-After``, a body over ``max_request_bytes`` 413, an unsupported field 400 naming it
(:mod:`rl_rollout.openai_api.protocol`), a request not answered within ``request_timeout_s`` 504 (not
recorded). :meth:`OpenAIServer.stats` counts them. HTTP is uvicorn's in a thread with its own event loop
(the pattern of :class:`~rl_rollout.rewards.RewardServer`), on 127.0.0.1 unless told otherwise; no TLS.

Stop strings are applied to the generated text: a choice is cut at the first stop string (the text excludes
it, OpenAI's rule) and its recorded ids end with the token that completed it, so the recorded ids decode to
the text plus the stop string (and whatever else that token held).

Tool calls (a chat request with ``tools``): the reply is parsed by the format of
``config.tool_calls.parser`` (:mod:`rl_rollout.openai_api.tool_parsers`) into OpenAI ``tool_calls`` with
``finish_reason: "tool_calls"`` and the text outside them as content; a parse failure goes back as content and
is counted (``stats()["tool_parse_failures"]``, and per call in the record). Parsing reads the text; the
recorded ids stay the sampled ones.
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
from typing import Any

from rl_rollout.openai_api.config import OpenAIServerConfig
from rl_rollout.openai_api.episodes import Episodes, RecordedCall, RecordedChoice
from rl_rollout.openai_api.protocol import ParsedRequest, RequestError
from rl_rollout.openai_api.splice import PromptSource, splice_prompt
from rl_rollout.openai_api.tool_parsers import ToolParse, make_tool_parser
from rl_rollout.openai_api.tools import marker_ids, parse_choice
from rl_rollout.types import RolloutRequest, RolloutSample

logger = logging.getLogger(__name__)


class OpenAIServer:
    """Serve ``engine`` as an OpenAI-compatible endpoint (see the module docstring).

    ``tokenizer``: the policy's (a transformers tokenizer, or a folder to load one from) with a chat
    template for chat requests. Use as a context manager, or :meth:`start` and :meth:`stop`.
    """

    def __init__(self, engine: Any, tokenizer: Any, config: OpenAIServerConfig | None = None) -> None:
        if not callable(getattr(engine, "generate", None)):
            raise TypeError(f"engine must be a RolloutEngine (with generate(requests)), got {type(engine).__name__}")
        if isinstance(tokenizer, (str, os.PathLike)):
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(str(tokenizer))
        self.engine = engine
        self.tokenizer = tokenizer
        self.config = config or OpenAIServerConfig()
        self.vocab_size = len(tokenizer)
        self.max_model_len = self.config.max_model_len or _model_len(engine)
        self.episodes = Episodes()
        #: the tool-call parser (None: ``auto`` found no format in the chat template; requests with tools 400)
        self.tool_parser = make_tool_parser(
            self.config.tool_calls.parser,
            tokenizer,
            vllm_engine=type(engine).__module__.startswith("rl_rollout.vllm"),
        )
        self._tool_marker_ids = marker_ids(tokenizer, self.tool_parser.markers) if self.tool_parser else frozenset()
        self._counts: collections.Counter[str] = collections.Counter()
        self._counts_lock = threading.Lock()
        self._sock: socket.socket | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._engine_pool: ThreadPoolExecutor | None = None
        self._tokenizer_pool: ThreadPoolExecutor | None = None
        self._uvicorn: Any = None
        self._queued: Callable[[], int] = lambda: 0  # requests waiting for an engine call (set by start)

    # ----- episodes ------------------------------------------------------------------------------

    def open_episode(self, row_id: Any = None) -> tuple[str, str]:
        """A fresh API key for one episode of ``row_id`` and the ``base_url`` to call (``.../v1``)."""
        return self.episodes.open(row_id), self.base_url

    def close_episode(self, key: str) -> list[RecordedCall]:
        """The episode's recorded calls; its key then gets 410 Gone. KeyError for a key not open."""
        return self.episodes.close(key)

    # ----- counters ------------------------------------------------------------------------------

    def count(self, name: str, by: int = 1) -> None:
        with self._counts_lock:
            self._counts[name] += by

    def stats(self) -> dict[str, int | float]:
        """Counters: ``requests``, ``status_<code>`` per reply, ``gone`` (calls after close), ``timeouts``,
        ``batches`` / ``batched_requests`` / ``max_batch`` (engine calls and their sizes), ``engine_ms``,
        ``prompt_tokens``, ``completion_tokens``, ``prompt_spliced`` / ``splice_refused`` (chat calls that continued
        an earlier call of their episode, spliced or, failing its checks, rendered), ``tool_calls`` /
        ``tool_parse_failures`` (parsed calls, and text that looked like a call and was not one), ``queued`` (requests
        waiting for an engine call now), and the
        episodes' counts."""
        with self._counts_lock:
            out: dict[str, int | float] = dict(self._counts)
        out["queued"] = self._queued()
        out.update(self.episodes.counts())
        return out

    # ----- prompts -------------------------------------------------------------------------------

    def episode_prompt(self, key: str, obj: dict[str, Any], parsed: ParsedRequest) -> tuple[PromptSource, str]:
        """Token-in-token-out across an episode's calls (on the tokenizer thread): a chat request that continues
        an earlier call of the episode gets that call's prompt + sampled ids and the new turns' tokens as its
        prompt (:mod:`rl_rollout.openai_api.splice`, set on ``parsed``); returns how the prompt was built and,
        when a continuation could not be spliced (then the rendering stands), why."""
        if parsed.kind != "chat":
            return "completion", ""
        calls = self.episodes.calls(key)
        if not calls:
            return "rendered", ""
        tools = {"tools": obj["tools"]} if obj.get("tools") else {}
        sp = splice_prompt(self.tokenizer, obj["messages"], calls, **tools)
        if sp.prompt_ids is None:
            if sp.refused:
                self.count("splice_refused")
                logger.warning("chat call not spliced onto call %s of its episode: %s", sp.continues, sp.refused)
            return "rendered", sp.refused
        limit = self.max_model_len
        if limit is not None and len(sp.prompt_ids) + parsed.params.max_new_tokens > limit:
            raise RequestError(
                f"the prompt's {len(sp.prompt_ids)} tokens + max_tokens={parsed.params.max_new_tokens} exceed the "
                f"model's length {limit}; shorten the prompt or lower max_tokens",
                param="max_tokens",
            )
        parsed.prompt_ids = sp.prompt_ids
        self.count("prompt_spliced")
        return "spliced", ""

    # ----- engine --------------------------------------------------------------------------------

    def _generate(self, parsed: list[ParsedRequest]) -> list[list[RolloutSample]]:
        """One engine call for a batch (on the engine thread)."""
        t0 = time.perf_counter()
        out = self.engine.generate([RolloutRequest(p.prompt_ids, p.params) for p in parsed])
        self.count("batches")
        self.count("batched_requests", len(parsed))
        with self._counts_lock:
            self._counts["max_batch"] = max(self._counts["max_batch"], len(parsed))
            self._counts["engine_ms"] += round(1000 * (time.perf_counter() - t0))
        return out

    def choices(self, parsed: ParsedRequest, samples: list[RolloutSample]) -> list[RecordedChoice]:
        """The samples as the client sees them: decoded, cut at a stop string (module docstring)."""
        out = []
        for s in samples:
            ids, lps = list(s.response_ids), list(s.rollout_logprobs)
            text = self.tokenizer.decode(ids, skip_special_tokens=True)
            finish = s.finish_reason
            cut = _first_stop(text, parsed.stop)
            if cut is not None:
                lo, hi = 1, len(ids)  # the fewest tokens whose text holds a stop string (monotone in the count)
                while lo < hi:
                    mid = (lo + hi) // 2
                    if _first_stop(self.tokenizer.decode(ids[:mid], skip_special_tokens=True), parsed.stop) is None:
                        lo = mid + 1
                    else:
                        hi = mid
                ids, lps = ids[:lo], lps[:lo]
                head = self.tokenizer.decode(ids, skip_special_tokens=True)
                text, finish = head[: _first_stop(head, parsed.stop) or 0], "stop"
            out.append(RecordedChoice(ids, lps, finish, s.policy_version, text, self._tool_parse(parsed, ids, text)))
        return out

    def _tool_parse(self, parsed: ParsedRequest, ids: list[int], text: str) -> ToolParse | None:
        if parsed.tools is None or not parsed.tools.parse or self.tool_parser is None:
            return None
        got = parse_choice(
            self.tool_parser, self.tokenizer, self._tool_marker_ids, ids, text, parsed.stop, parsed.tools.names
        )
        self.count("tool_calls", len(got.calls))
        self.count("tool_parse_failures", got.failures)
        if got.failures:
            logger.info("tool-call parse failure (returned as content): %s", "; ".join(got.errors))
        return got

    # ----- lifetime ------------------------------------------------------------------------------

    @property
    def url(self) -> str:
        if self._sock is None:
            raise RuntimeError("OpenAIServer.url is known once the server is started; call start() first")
        host, port = self._sock.getsockname()[:2]
        if host in ("0.0.0.0", "::", ""):
            host = "127.0.0.1"
        return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"

    @property
    def base_url(self) -> str:
        """What an OpenAI client takes as ``base_url``."""
        return self.url + "/v1"

    def start(self) -> OpenAIServer:
        if self._sock is not None:
            raise RuntimeError(f"OpenAIServer is already serving at {self.url}")
        from rl_rollout.openai_api import app  # lazy: uvicorn + Starlette

        cfg = self.config
        try:
            sock = socket.create_server((cfg.host, cfg.port), backlog=max(128, 2 * cfg.max_concurrent_requests))
        except OSError as e:
            raise OSError(f"OpenAIServer cannot listen on {cfg.host}:{cfg.port} ({e}); pick another port or 0") from e
        self._sock = sock
        self._engine_pool = ThreadPoolExecutor(1, thread_name_prefix="rl-openai-engine")
        self._tokenizer_pool = ThreadPoolExecutor(1, thread_name_prefix="rl-openai-tokenizer")
        self._uvicorn = app.make_uvicorn(self)
        failed: list[BaseException] = []
        self._thread = threading.Thread(target=self._run, args=(failed,), name="rl-openai-server", daemon=True)
        self._thread.start()
        while not self._uvicorn.started and self._thread.is_alive():
            time.sleep(0.005)
        if not self._uvicorn.started:
            self.stop()
            raise RuntimeError(f"OpenAIServer did not start: {failed[0] if failed else 'uvicorn exited'}")
        logger.info("OpenAI-compatible endpoint at %s", self.base_url)
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
        """Stop serving and free the port (idempotent); requests in flight are dropped."""
        if self._loop is not None and self._thread is not None and self._thread.is_alive():
            from rl_rollout.rewards.server_app import stop_now  # lazy: uvicorn + Starlette, loaded by start()

            self._loop.call_soon_threadsafe(stop_now, self._uvicorn)
            self._thread.join(10)
        for pool in (self._engine_pool, self._tokenizer_pool):
            if pool is not None:
                pool.shutdown(wait=False, cancel_futures=True)
        if self._sock is not None:
            self._sock.close()
        self._sock = self._loop = self._thread = self._engine_pool = self._tokenizer_pool = self._uvicorn = None

    def __enter__(self) -> OpenAIServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _model_len(engine: Any) -> int | None:
    """The engine's model's context length where it says (an HFEngine's ``model.config``; vLLM's
    ``max_model_len``), else None."""
    for get in (
        lambda: engine.max_model_len,
        lambda: engine.model.config.get_text_config().max_position_embeddings,
    ):
        try:
            value = get()
        except Exception:  # noqa: BLE001 - not this kind of engine
            continue
        if isinstance(value, int) and value > 1:
            return value
    return None


def _first_stop(text: str, stops: tuple[str, ...]) -> int | None:
    found = [i for i in (text.find(s) for s in stops) if i >= 0]
    return min(found) if found else None
