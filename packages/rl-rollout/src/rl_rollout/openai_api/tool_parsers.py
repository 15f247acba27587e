"""Tool calls in a model's text, by the chat template's format: :func:`make_tool_parser` and the parsers.

A parser turns one sampled choice's text into OpenAI ``tool_calls`` (:class:`ToolCall`: id, function name,
arguments as a JSON string) and the text outside them (``content``). It never touches the sampled token ids:
what the trainer trains on is the engine's tokens, whatever the parse gave the client.

Formats (:data:`PARSERS`, chosen by :class:`~rl_rollout.openai_api.config.ToolCallConfig` ``parser``):

- ``hermes`` (Hermes 2 Pro, Qwen2.5 / Qwen3): ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``,
  any number of them, text around them kept as content.
- ``llama3_json`` (Llama 3.1 / 3.2 / 3.3): the reply is ``{"name": ..., "parameters": {...}}`` (or
  ``"arguments"``), optionally after ``<|python_tag|>``, several separated by ``;``; a reply that does not
  open with one is plain content.
- ``mistral``: ``[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`` (tokenizer v3) or
  ``[TOOL_CALLS]name[ARGS]{...}`` repeated (v11+); the text before the first ``[TOOL_CALLS]`` is content.
- ``vllm:NAME``: vLLM's own parser NAME (``ToolParserManager``; vLLM imported lazily), for the vLLM engine.
- ``auto``: from the chat template (``<tool_call>`` -> hermes, ``[TOOL_CALLS]`` -> mistral,
  ``<|python_tag|>`` / Llama 3 headers -> llama3_json); on the vLLM engine vLLM's parser of that name where
  it builds with this tokenizer, else ours (:func:`make_tool_parser`).

A failure (a call marker whose body is not a JSON object with a string ``name``, a name the request's
``tools`` do not offer, non-object arguments, a block never closed) keeps its text in ``content`` and is
counted in :attr:`ToolParse.failures`; the endpoint counts it per episode and in its stats, never drops it.
"""

from __future__ import annotations

import json
import logging
import re
import secrets
import string
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

logger = logging.getLogger(__name__)

#: the formats with a parser of ours; ``auto`` and ``vllm:NAME`` are resolved by :func:`make_tool_parser`
PARSERS = ("hermes", "llama3_json", "mistral")
PARSER_CHOICES = ("auto", *PARSERS, "vllm:NAME")


@dataclass(frozen=True)
class ToolCall:
    """One parsed call: ``arguments`` a JSON object as a string (OpenAI's shape)."""

    id: str
    name: str
    arguments: str

    def openai(self, index: int | None = None) -> dict[str, Any]:
        out: dict[str, Any] = {"id": self.id, "type": "function", "function": {"name": self.name}}
        out["function"]["arguments"] = self.arguments
        if index is not None:
            out = {"index": index, **out}
        return out


@dataclass(frozen=True)
class ToolParse:
    """A choice's text split: ``content`` (None when only calls were sent), ``calls``, ``failures`` (blocks
    that looked like a call and were not one, their text left in ``content``) and why each failed."""

    content: str | None
    calls: tuple[ToolCall, ...] = ()
    failures: int = 0
    errors: tuple[str, ...] = field(default_factory=tuple)


class ToolParser(Protocol):
    """``parse(text, names)``: ``names`` the functions the request offers (a call to another is a failure)."""

    name: str
    #: token strings of this format's markers, kept in the text the parser reads even when the tokenizer
    #: marks them special (``<|python_tag|>``, ``[TOOL_CALLS]``)
    markers: tuple[str, ...]

    def parse(self, text: str, names: frozenset[str]) -> ToolParse: ...


def call_id(style: str = "openai") -> str:
    """A fresh call id: ``call_`` + 24 hex (OpenAI's look), or 9 alphanumerics (Mistral's templates check it)."""
    if style == "mistral":
        return "".join(secrets.choice(string.ascii_letters + string.digits) for _ in range(9))
    return "call_" + secrets.token_hex(12)


def _call(obj: Any, names: frozenset[str], arg_keys: tuple[str, ...], id_style: str) -> ToolCall | str:
    """A :class:`ToolCall` from a decoded JSON value, or why it is not one."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return f"not an object with a string name: {str(obj)[:80]!r}"
    name = obj["name"]
    if name not in names:
        return f"unknown function {name!r} (offered: {', '.join(sorted(names)) or 'none'})"
    args: Any = next((obj[k] for k in arg_keys if k in obj), {})
    if isinstance(args, str):  # some models send the arguments as a JSON string already
        try:
            args = json.loads(args)
        except ValueError:
            return f"arguments of {name!r} are a string that is not JSON"
    if not isinstance(args, dict):
        return f"arguments of {name!r} are a {type(args).__name__}, not an object"
    return ToolCall(call_id(id_style), name, json.dumps(args, ensure_ascii=False))


def _finish(pieces: list[str], calls: list[ToolCall], errors: list[str]) -> ToolParse:
    content = "".join(pieces).strip() if calls else "".join(pieces)
    return ToolParse((content or None) if calls else content, tuple(calls), len(errors), tuple(errors))


class HermesParser:
    """``<tool_call>JSON</tool_call>`` blocks anywhere in the text (module docstring)."""

    name: str = "hermes"
    markers: tuple[str, ...] = ("<tool_call>", "</tool_call>")
    _block = re.compile(r"<tool_call>(.*?)(</tool_call>|\Z)", re.DOTALL)

    def parse(self, text: str, names: frozenset[str]) -> ToolParse:
        pieces, calls, errors, pos = [], [], [], 0
        for m in self._block.finditer(text):
            pieces.append(text[pos : m.start()])
            pos = m.end()
            if not m.group(2):
                errors.append("a <tool_call> block is never closed")
                pieces.append(m.group(0))
                continue
            try:
                got = _call(json.loads(m.group(1)), names, ("arguments", "parameters"), "openai")
            except ValueError as e:
                got = f"not JSON ({e})"
            if isinstance(got, str):
                errors.append(got)
                pieces.append(m.group(0))
            else:
                calls.append(got)
        pieces.append(text[pos:])
        return _finish(pieces, calls, errors)


class Llama3JsonParser:
    """The whole reply is one or more JSON calls (optionally after ``<|python_tag|>``, separated by ``;``)."""

    name: str = "llama3_json"
    markers: tuple[str, ...] = ("<|python_tag|>",)

    def parse(self, text: str, names: frozenset[str]) -> ToolParse:
        body = text.lstrip()
        tagged = body.startswith("<|python_tag|>")
        if tagged:
            body = body[len("<|python_tag|>") :].lstrip()
        if not body.startswith("{") or (not tagged and '"name"' not in body):
            if tagged:
                return ToolParse(text, (), 1, ("<|python_tag|> not followed by a JSON call",))
            return ToolParse(text)
        decoder, calls, errors, pos = json.JSONDecoder(), [], [], 0
        while pos < len(body):
            try:
                obj, end = decoder.raw_decode(body, pos)
            except ValueError as e:
                errors.append(f"not JSON ({e})")
                break
            got = _call(obj, names, ("parameters", "arguments"), "openai")
            if isinstance(got, str):
                errors.append(got)
                break
            calls.append(got)
            pos = end
            rest = body[pos:].lstrip()
            if not rest.startswith(";"):
                break
            pos = len(body) - len(rest) + 1
            while pos < len(body) and body[pos].isspace():
                pos += 1
        if errors:  # a reply that is partly calls and partly broken: all of it goes back as text
            return ToolParse(text, (), len(errors), tuple(errors))
        return _finish([body[pos:]], calls, errors)


class MistralParser:
    """``[TOOL_CALLS]`` followed by a JSON list (v3) or by ``name[ARGS]{...}`` segments (v11+)."""

    name: str = "mistral"
    markers: tuple[str, ...] = ("[TOOL_CALLS]", "[ARGS]")

    def parse(self, text: str, names: frozenset[str]) -> ToolParse:
        at = text.find("[TOOL_CALLS]")
        if at < 0:
            return ToolParse(text)
        head, body = text[:at], text[at:]
        calls: list[ToolCall] = []
        errors: list[str] = []
        segments = [s for s in body.split("[TOOL_CALLS]") if s.strip()]
        if not segments:
            errors.append("[TOOL_CALLS] with no call after it")
        for seg in segments:
            seg = seg.strip()
            try:
                if seg.startswith("["):
                    objs, _ = json.JSONDecoder().raw_decode(seg)
                    objs = objs if isinstance(objs, list) else [objs]
                elif "[ARGS]" in seg:
                    fname, args = seg.split("[ARGS]", 1)
                    objs = [{"name": fname.strip(), "arguments": json.JSONDecoder().raw_decode(args.strip())[0]}]
                else:
                    objs = [json.JSONDecoder().raw_decode(seg)[0]]
            except ValueError as e:
                errors.append(f"not JSON ({e})")
                continue
            for obj in objs:
                got = _call(obj, names, ("arguments", "parameters"), "mistral")
                (errors.append if isinstance(got, str) else calls.append)(got)  # type: ignore[arg-type]
        if errors:
            return ToolParse(text, (), len(errors), tuple(errors))
        return _finish([head], calls, errors)


_OURS: dict[str, Callable[[], ToolParser]] = {
    "hermes": HermesParser,
    "llama3_json": Llama3JsonParser,
    "mistral": MistralParser,
}


class VLLMToolParser:
    """vLLM's parser ``vllm_name`` over our protocol: its calls, its content; a reply that shows this
    format's start marker and yields no call, or a call to a function not offered, is a failure (the whole
    text then goes back as content)."""

    def __init__(self, vllm_name: str, tokenizer: Any, markers: tuple[str, ...] = ()) -> None:
        manager, self._request_cls = _vllm_tool_api()
        try:
            cls = manager.get_tool_parser(vllm_name)
        except KeyError as e:
            raise ValueError(f"vLLM has no tool parser {vllm_name!r}: {e}") from None
        self._parser = cls(tokenizer)
        self.name = f"vllm:{vllm_name}"
        self.markers = markers or tuple(
            m
            for m in (getattr(self._parser, "tool_call_start_token", None), getattr(self._parser, "bot_token", None))
            if isinstance(m, str)
        )

    def parse(self, text: str, names: frozenset[str]) -> ToolParse:
        tools = [{"type": "function", "function": {"name": n, "parameters": {"type": "object"}}} for n in names]
        request = self._request_cls(model="policy", messages=[{"role": "user", "content": ""}], tools=tools)
        info = self._parser.extract_tool_calls(text, request)
        starts = [m for m in self.markers if m and not m.startswith("</") and m in text]
        if not info.tools_called:
            return ToolParse(text, (), 1 if starts else 0, ("vLLM's parser found no call",) if starts else ())
        calls = []
        for tc in info.tool_calls:
            got = _call({"name": tc.function.name, "arguments": tc.function.arguments}, names, ("arguments",), "")
            if isinstance(got, str):
                return ToolParse(text, (), 1, (got,))
            calls.append(ToolCall(tc.id or got.id, got.name, got.arguments))
        content = info.content if info.content and info.content.strip() else None
        return ToolParse(content, tuple(calls))


def _vllm_tool_api() -> tuple[Any, type]:
    """vLLM's ``ToolParserManager`` and ``ChatCompletionRequest``, wherever this vLLM keeps them."""
    import importlib  # lazy: only the vLLM path needs it

    manager = request = None
    for mod in ("vllm.tool_parsers", "vllm.entrypoints.openai.tool_parsers"):
        try:
            manager = importlib.import_module(mod).ToolParserManager
            break
        except (ImportError, AttributeError):
            continue
    for mod in ("vllm.entrypoints.openai.protocol", "vllm.entrypoints.openai.chat_completion.protocol"):
        try:
            request = importlib.import_module(mod).ChatCompletionRequest
            break
        except (ImportError, AttributeError):
            continue
    if manager is None or request is None:
        raise ImportError("vLLM's tool parsers are not importable (no ToolParserManager / ChatCompletionRequest)")
    return manager, request


def detect_format(tokenizer: Any) -> str | None:
    """The tool-call format the tokenizer's chat template writes (:data:`PARSERS`), or None."""
    template = getattr(tokenizer, "chat_template", None) or ""
    if isinstance(template, dict):
        template = " ".join(str(v) for v in template.values())
    if "<tool_call>" in template:
        return "hermes"
    if "[TOOL_CALLS]" in template:
        return "mistral"
    if "<|python_tag|>" in template or ("<|start_header_id|>" in template and "tools" in template):
        return "llama3_json"
    return None


def make_tool_parser(name: str, tokenizer: Any, *, vllm_engine: bool = False) -> ToolParser | None:
    """The parser for config ``name`` (:data:`PARSER_CHOICES`); None when ``auto`` finds no format in the
    template (then a request with ``tools`` is refused, naming the config field). On a vLLM engine a format
    of ours is served by vLLM's parser of the same name when it builds with ``tokenizer``, else by ours."""
    if name.startswith("vllm:"):
        return VLLMToolParser(name[5:], tokenizer)
    fmt = detect_format(tokenizer) if name == "auto" else name
    if fmt is None:
        return None
    if fmt not in _OURS:
        raise ValueError(f"tool_parser={name!r} is not one of {', '.join(PARSER_CHOICES)}")
    ours = _OURS[fmt]()
    if vllm_engine:
        try:
            return VLLMToolParser(fmt, tokenizer, ours.markers)
        except Exception as e:  # noqa: BLE001 - vLLM missing or its parser refuses this tokenizer: ours serves
            logger.warning(
                "vLLM's %s tool parser is not usable here (%s: %s); using rl_rollout's", fmt, type(e).__name__, e
            )
    return ours
