"""The OpenAI request bodies the endpoint takes, checked field by field, and the replies it writes.

Every field of a request is used, refused or on the documented ignore list (:data:`IGNORED_FIELDS`); an
unknown field, or a known one whose value would change sampling in a way the engines cannot honour, is a 400
naming it. Used fields (chat: :data:`CHAT_FIELDS`, completions: :data:`COMPLETION_FIELDS`):

- ``model`` (any string: one policy serves; the reply names the configured ``model_name``), ``messages``
  (chat; rendered by the tokenizer's chat template with ``add_generation_prompt=True``) or ``prompt``
  (completions: one string, or one list of token ids taken as is), ``n``, ``temperature`` (0..2, 0 greedy),
  ``top_p``, ``top_k`` (vLLM's extension), ``max_tokens`` / ``max_completion_tokens`` (the same; both given
  must agree), ``stop`` (up to 4 strings: a choice ends at the first, which is cut from the text; the tokens
  sampled up to and including the one that completed it are recorded), ``seed``, ``stream`` and
  ``stream_options.include_usage``.
- ``logprobs`` (chat: bool; completions: 0 or null) returns the engine's log-probs of the sampled tokens.
  ``top_logprobs`` > 0 (chat) and ``logprobs`` > 0 (completions) are refused: the engines report the sampled
  token's log-prob only.
- Accepted only at their neutral value (else 400): ``frequency_penalty`` / ``presence_penalty`` 0,
  ``logit_bias`` empty, ``response_format`` ``{"type": "text"}``, ``best_of`` equal to ``n``, ``echo`` false,
  ``suffix`` null.
- ``tools`` / ``tool_choice`` (chat): the tools are rendered by the chat template (``tools=``), each reply is
  parsed for calls in the template's format and answered as OpenAI ``tool_calls``; earlier rounds come back
  as assistant messages with ``tool_calls`` and ``tool`` messages (:mod:`rl_rollout.openai_api.tools`, which
  also says what each ``tool_choice`` does; ``"required"`` and the deprecated ``functions`` /
  ``function_call`` are refused).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

from rl_rollout.openai_api.errors import RequestError
from rl_rollout.openai_api.tools import ToolRequest, check_template_renders_tools, parse_tools, template_message
from rl_rollout.types import SamplingParams

#: fields that change nothing the engine does, read and dropped on purpose
IGNORED_FIELDS = ("user", "metadata", "store", "service_tier", "parallel_tool_calls")
_COMMON = (
    "model",
    "n",
    "temperature",
    "top_p",
    "top_k",
    "max_tokens",
    "stop",
    "seed",
    "logprobs",
    "stream",
    "stream_options",
    "frequency_penalty",
    "presence_penalty",
    "logit_bias",
)
CHAT_FIELDS = (
    *_COMMON,
    "messages",
    "max_completion_tokens",
    "top_logprobs",
    "response_format",
    "tools",
    "tool_choice",
    "functions",
    "function_call",
)
COMPLETION_FIELDS = (*_COMMON, "prompt", "best_of", "echo", "suffix")
MAX_STOP = 4


@dataclass
class ParsedRequest:
    """One request, ready for the engine: the prompt's token ids, the engine's sampling, what the reply needs."""

    kind: str  # "chat" | "completion"
    prompt_ids: list[int]
    params: SamplingParams
    stop: tuple[str, ...]
    logprobs: bool
    stream: bool
    include_usage: bool
    model: str
    tools: ToolRequest | None = None  # chat with tools (rl_rollout.openai_api.tools)


def parse_body(body: bytes) -> dict[str, Any]:
    try:
        obj = json.loads(body)
    except (ValueError, RecursionError) as e:
        raise RequestError(f"the body is not JSON: {e}") from None
    if not isinstance(obj, dict):
        raise RequestError(f"the body must be a JSON object, got {type(obj).__name__}")
    return obj


def _num(obj: dict, name: str, default: float, lo: float, hi: float) -> float:
    v = obj.get(name)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or not lo <= v <= hi:
        raise RequestError(f"{name} must be a number in [{lo}, {hi}], got {v!r}", param=name)
    return float(v)


def _int(obj: dict, name: str, default: int | None, lo: int, hi: int) -> int | None:
    v = obj.get(name)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
        raise RequestError(f"{name} must be an integer in [{lo}, {hi}], got {v!r}", param=name)
    return v


def _neutral(obj: dict, name: str, ok: Any, why: str) -> None:
    v = obj.get(name)
    if v is not None and v != ok and not (ok == {} and v == {}):
        raise RequestError(f"{name}={v!r} is not supported: {why}", param=name)


def _chat_prompt(tokenizer: Any, messages: Any, tools: ToolRequest | None = None) -> list[int]:
    if not isinstance(messages, list) or not messages:
        raise RequestError("messages must be a non-empty list of {role, content} objects", param="messages")
    rendered = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise RequestError(f"messages[{i}] must be an object with a string role", param="messages")
        content = m.get("content")
        if isinstance(content, list):  # content parts: text only
            texts = []
            for part in content:
                if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise RequestError(
                        f"messages[{i}].content: only text parts ({{'type': 'text', 'text': ...}}) are supported, "
                        f"got {part!r}",
                        param="messages",
                    )
                texts.append(part["text"])
            m = {**m, "content": "".join(texts)}
        elif content is not None and not isinstance(content, str):
            raise RequestError(f"messages[{i}].content must be a string or text parts", param="messages")
        rendered.append(template_message(i, m))
    extra: dict[str, Any] = {}
    if tools is not None:
        check_template_renders_tools(tokenizer)
        extra["tools"] = list(tools.specs)
    try:
        ids = tokenizer.apply_chat_template(
            rendered, add_generation_prompt=True, tokenize=True, return_dict=False, **extra
        )
    except Exception as e:  # the template's own refusal (a role it does not know, say)
        raise RequestError(f"the chat template refused the messages: {type(e).__name__}: {e}") from None
    return [int(t) for t in ids]


def _completion_prompt(tokenizer: Any, prompt: Any, vocab_size: int) -> list[int]:
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        if not prompt:
            raise RequestError("prompt is empty", param="prompt")
        return [int(t) for t in tokenizer.encode(prompt, add_special_tokens=False)]
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        bad = [t for t in prompt if not 0 <= t < vocab_size]
        if bad:
            raise RequestError(f"prompt token ids must be in [0, {vocab_size}), got {bad[:5]}", param="prompt")
        return list(prompt)
    raise RequestError(
        "prompt must be one string or one list of token ids (send one request per prompt)", param="prompt"
    )


def parse_request(
    obj: dict[str, Any],
    kind: str,
    tokenizer: Any,
    *,
    vocab_size: int,
    default_max_tokens: int,
    max_tokens_limit: int,
    max_n: int,
    max_model_len: int | None = None,
) -> ParsedRequest:
    """Check every field of ``obj`` (a chat or completion request) and turn it into a :class:`ParsedRequest`."""
    allowed = CHAT_FIELDS if kind == "chat" else COMPLETION_FIELDS
    for name in obj:
        if name not in allowed and name not in IGNORED_FIELDS:
            raise RequestError(
                f"field {name!r} is not supported by this endpoint; remove it (supported: {', '.join(allowed)}; "
                f"ignored: {', '.join(IGNORED_FIELDS)})",
                param=name,
            )
    model = obj.get("model")
    if not isinstance(model, str) or not model:
        raise RequestError("model must be a non-empty string", param="model")
    n = _int(obj, "n", 1, 1, max_n)
    assert n is not None
    temperature = _num(obj, "temperature", 1.0, 0.0, 2.0)
    top_p = _num(obj, "top_p", 1.0, 0.0, 1.0)
    if top_p == 0:
        raise RequestError("top_p must be > 0 (1 disables it)", param="top_p")
    top_k = _int(obj, "top_k", 0, -1, 1 << 30) or 0
    seed = _int(obj, "seed", None, -(1 << 63), (1 << 63) - 1)
    lims = [(f, _int(obj, f, None, 1, max_tokens_limit)) for f in ("max_tokens", "max_completion_tokens")]
    given = {v for _, v in lims if v is not None}
    if len(given) > 1:
        raise RequestError(f"max_tokens and max_completion_tokens disagree ({given}); send one", param="max_tokens")
    max_new = given.pop() if given else default_max_tokens
    stop = obj.get("stop")
    stops: tuple[str, ...] = ()
    if isinstance(stop, str):
        stops = (stop,)
    elif isinstance(stop, list) and all(isinstance(s, str) for s in stop) and len(stop) <= MAX_STOP:
        stops = tuple(stop)
    elif stop is not None:
        raise RequestError(f"stop must be a string or a list of up to {MAX_STOP} strings, got {stop!r}", param="stop")
    if any(not s for s in stops):
        raise RequestError("stop strings must be non-empty", param="stop")
    for name in ("frequency_penalty", "presence_penalty"):
        _neutral(obj, name, 0, "the engines sample without penalties; send 0 or leave it out")
    _neutral(obj, "logit_bias", {}, "the engines take no logit bias; leave it out")
    stream = obj.get("stream") or False
    if not isinstance(stream, bool):
        raise RequestError(f"stream must be a boolean, got {stream!r}", param="stream")
    opts = obj.get("stream_options")
    include_usage = False
    if opts is not None:
        if not isinstance(opts, dict) or set(opts) - {"include_usage"}:
            raise RequestError(f"stream_options supports include_usage only, got {opts!r}", param="stream_options")
        if not stream:
            raise RequestError("stream_options needs stream=true", param="stream_options")
        include_usage = bool(opts.get("include_usage"))
    logprobs_field = obj.get("logprobs")
    tools = None
    if kind == "chat":
        if logprobs_field is not None and not isinstance(logprobs_field, bool):
            raise RequestError(f"logprobs must be a boolean, got {logprobs_field!r}", param="logprobs")
        top = _int(obj, "top_logprobs", 0, 0, 20)
        if top:
            raise RequestError(
                f"top_logprobs={top} is not supported: the engine reports the sampled token's log-prob only; "
                "send top_logprobs=0 or leave it out",
                param="top_logprobs",
            )
        logprobs = bool(logprobs_field)
        rf = obj.get("response_format")
        if rf is not None and rf != {"type": "text"}:
            raise RequestError(
                f"response_format={rf!r} is not supported; only {{'type': 'text'}}", param="response_format"
            )
        tools = parse_tools(obj)
        prompt_ids = _chat_prompt(tokenizer, obj.get("messages"), tools)
    else:
        top = _int(obj, "logprobs", None, 0, 5)
        if top:
            raise RequestError(
                f"logprobs={top} is not supported: the engine reports the sampled token's log-prob only; "
                "send logprobs=0 (the sampled tokens' log-probs) or leave it out",
                param="logprobs",
            )
        logprobs = top is not None
        best_of = _int(obj, "best_of", None, 1, max_n)
        if best_of is not None and best_of != n:
            raise RequestError(f"best_of={best_of} differs from n={n}; not supported", param="best_of")
        _neutral(obj, "echo", False, "the prompt is not echoed; leave it out")
        _neutral(obj, "suffix", None, "no insertion mode; leave it out")
        if "prompt" not in obj:
            raise RequestError("prompt is required", param="prompt")
        prompt_ids = _completion_prompt(tokenizer, obj["prompt"], vocab_size)
    if not prompt_ids:
        raise RequestError("the prompt renders to no tokens", param="prompt")
    if max_model_len is not None and len(prompt_ids) + max_new > max_model_len:
        raise RequestError(
            f"the prompt's {len(prompt_ids)} tokens + max_tokens={max_new} exceed the model's length "
            f"{max_model_len}; shorten the prompt or lower max_tokens",
            param="max_tokens",
        )
    params = SamplingParams(
        temperature=temperature, top_p=top_p, top_k=top_k, max_new_tokens=max_new, n=n, seed=seed, logprobs=True
    )
    return ParsedRequest(kind, prompt_ids, params, stops, logprobs, stream, include_usage, model, tools)
