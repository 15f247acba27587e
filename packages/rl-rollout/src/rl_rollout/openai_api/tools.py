"""Tool calls at the endpoint: a request's ``tools`` / ``tool_choice`` checked (:func:`parse_tools`), the
messages of an earlier tool round made ready for the chat template (:func:`template_message`), and a sampled
choice read for calls (:func:`parse_choice`, with :mod:`rl_rollout.openai_api.tool_parsers`).

``tool_choice``: ``"auto"`` (the default with tools) renders the tools and parses every reply; ``"none"``
renders them and parses nothing; ``{"type": "function", "function": {"name": F}}`` renders only F and
accepts only calls to F (the engines do not constrain decoding, so the reply may still hold none; a call to
another function is a counted failure). ``"required"`` is refused: it needs constrained decoding, which the
engines here do not do. ``functions`` / ``function_call`` (the deprecated form) are refused with the fix.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from rl_rollout.openai_api.errors import RequestError
from rl_rollout.openai_api.tool_parsers import ToolParse, ToolParser


@dataclass(frozen=True)
class ToolRequest:
    """A request's tools: ``specs`` as the chat template gets them, ``names`` the callable functions,
    ``choice`` ``"auto"`` | ``"none"`` | ``"function"`` (then ``names`` is that one function)."""

    specs: tuple[dict[str, Any], ...]
    names: frozenset[str]
    choice: str

    @property
    def parse(self) -> bool:
        return self.choice != "none"


def parse_tools(obj: dict[str, Any]) -> ToolRequest | None:
    """The request's ``tools`` and ``tool_choice``, checked; None without tools."""
    for legacy in ("functions", "function_call"):
        if obj.get(legacy) is not None:
            raise RequestError(
                f"{legacy} is OpenAI's deprecated form; send tools=[{{'type': 'function', 'function': {{...}}}}] "
                "and tool_choice instead",
                param=legacy,
            )
    tools, choice = obj.get("tools"), obj.get("tool_choice")
    if not tools:
        if choice not in (None, "none", "auto"):
            raise RequestError(f"tool_choice={choice!r} needs tools; send tools or leave it out", param="tool_choice")
        return None
    if not isinstance(tools, list):
        raise RequestError(f"tools must be a list of function tools, got {type(tools).__name__}", param="tools")
    specs: list[dict[str, Any]] = []
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(fn, dict):
            raise RequestError(
                f"tools[{i}] must be {{'type': 'function', 'function': {{'name': ..., 'parameters': {{...}}}}}}, "
                f"got {str(t)[:120]!r}",
                param="tools",
            )
        if not isinstance(fn.get("name"), str) or not fn["name"]:
            raise RequestError(f"tools[{i}].function.name must be a non-empty string", param="tools")
        if "parameters" in fn and not isinstance(fn["parameters"], dict):
            raise RequestError(f"tools[{i}].function.parameters must be a JSON schema object", param="tools")
        specs.append(t)
    names = [t["function"]["name"] for t in specs]
    if len(set(names)) != len(names):
        raise RequestError(f"tools name a function twice: {names}", param="tools")
    if choice in (None, "auto", "none"):
        return ToolRequest(tuple(specs), frozenset(names), choice or "auto")
    if choice == "required":
        raise RequestError(
            "tool_choice='required' is not supported: forcing a call needs constrained decoding, which these "
            "engines do not do; send 'auto' (the reply is parsed for calls) or name one function",
            param="tool_choice",
        )
    fn = choice.get("function") if isinstance(choice, dict) else None
    if not isinstance(choice, dict) or choice.get("type") != "function" or not isinstance(fn, dict):
        raise RequestError(
            f"tool_choice must be 'auto', 'none' or {{'type': 'function', 'function': {{'name': ...}}}}, "
            f"got {choice!r}",
            param="tool_choice",
        )
    if fn.get("name") not in names:
        raise RequestError(
            f"tool_choice names {fn.get('name')!r}, which tools do not offer ({', '.join(names)})", param="tool_choice"
        )
    chosen = next(t for t in specs if t["function"]["name"] == fn["name"])
    return ToolRequest((chosen,), frozenset([fn["name"]]), "function")


def template_message(i: int, m: dict[str, Any]) -> dict[str, Any]:
    """Message ``i`` as the chat template takes it: an assistant's ``tool_calls`` checked and their
    ``arguments`` (a JSON string on the wire) decoded to an object, as transformers' templates expect
    (vLLM does the same); a ``tool`` message needs string content."""
    if m["role"] == "tool":
        if not isinstance(m.get("content"), str):
            raise RequestError(f"messages[{i}]: a tool message needs its result as string content", param="messages")
        if "tool_call_id" in m and not isinstance(m["tool_call_id"], str):
            raise RequestError(f"messages[{i}].tool_call_id must be a string", param="messages")
        return m
    calls = m.get("tool_calls")
    if calls is None:
        return m
    if m["role"] != "assistant" or not isinstance(calls, list):
        raise RequestError(f"messages[{i}]: tool_calls belong to an assistant message, as a list", param="messages")
    out = []
    for k, tc in enumerate(calls):
        fn = tc.get("function") if isinstance(tc, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise RequestError(f"messages[{i}].tool_calls[{k}] needs function.name", param="messages")
        args = fn.get("arguments", "{}")
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except ValueError as e:
                raise RequestError(
                    f"messages[{i}].tool_calls[{k}].function.arguments is not JSON ({e}); send the string the "
                    "endpoint returned",
                    param="messages",
                ) from None
        if not isinstance(args, dict):
            raise RequestError(
                f"messages[{i}].tool_calls[{k}].function.arguments must encode an object", param="messages"
            )
        out.append({**tc, "type": "function", "function": {**fn, "arguments": args}})
    return {**m, "tool_calls": out}


def check_template_renders_tools(tokenizer: Any) -> None:
    """Refuse tools the chat template would silently drop."""
    template = getattr(tokenizer, "chat_template", None) or ""
    if isinstance(template, dict):
        template = " ".join(str(v) for v in template.values())
    if "tools" not in template:
        raise RequestError(
            "the model's chat template does not render tools (it never reads 'tools'), so the model would not see "
            "them; serve a tokenizer whose template does (Qwen2.5, Hermes, Llama 3.1, Mistral) or leave tools out",
            param="tools",
        )


def marker_ids(tokenizer: Any, markers: tuple[str, ...]) -> frozenset[int]:
    """The ids of ``markers`` that are single special tokens (decoding would skip them)."""
    special, unk = set(tokenizer.all_special_ids), tokenizer.unk_token_id
    ids = (tokenizer.convert_tokens_to_ids(m) for m in markers)
    return frozenset(t for t in ids if isinstance(t, int) and t != unk and t in special)


def parse_choice(
    parser: ToolParser,
    tokenizer: Any,
    keep: frozenset[int],
    ids: list[int],
    text: str,
    stops: tuple[str, ...],
    names: frozenset[str],
) -> ToolParse:
    """Parse one choice: ``text`` as the client got it, or, where this format's markers are special tokens
    (``keep``) and sampled, the same ids decoded with those markers kept (cut at the first stop string)."""
    if keep and keep & set(ids):
        special = set(tokenizer.all_special_ids)
        text = tokenizer.decode([t for t in ids if t not in special or t in keep], skip_special_tokens=False)
        cuts = [i for i in (text.find(s) for s in stops) if i >= 0]
        if cuts:
            text = text[: min(cuts)]
    return parser.parse(text, names)
