"""The tool-call parsers (rl_rollout.openai_api.tool_parsers) on hand-written replies of each format: calls with
their names and arguments (as JSON strings), several calls, the text around them as content, and malformed
calls kept as content and counted; the format read from real chat-template markers; the request checks of
tools / tool_choice and of earlier tool rounds (rl_rollout.openai_api.tools)."""

from __future__ import annotations

import json

import pytest

from rl_rollout.openai_api.config import OpenAIServerConfig, ToolCallConfig
from rl_rollout.openai_api.errors import RequestError
from rl_rollout.openai_api.tool_parsers import (
    HermesParser,
    Llama3JsonParser,
    MistralParser,
    detect_format,
    make_tool_parser,
)
from rl_rollout.openai_api.tools import parse_tools, template_message
from rl_rollout.testing import make_tokenizer

NAMES = frozenset({"add", "search"})


def args(call):
    return json.loads(call.arguments)


def test_hermes_one_call_with_text_around():
    out = HermesParser().parse(
        'Let me add.\n<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>\n', NAMES
    )
    (call,) = out.calls
    assert (call.name, args(call), out.content, out.failures) == ("add", {"a": 2, "b": 3}, "Let me add.", 0)
    assert call.id.startswith("call_") and len(call.id) == 29
    assert call.openai(0) == {
        "index": 0,
        "id": call.id,
        "type": "function",
        "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'},
    }


def test_hermes_several_calls_only_calls_give_no_content():
    text = (
        '<tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>\n'
        '<tool_call>{"name": "search", "arguments": {"q": "x y"}}</tool_call>'
    )
    out = HermesParser().parse(text, NAMES)
    assert [(c.name, args(c)) for c in out.calls] == [("add", {"a": 1}), ("search", {"q": "x y"})]
    assert out.content is None and out.failures == 0 and out.calls[0].id != out.calls[1].id


@pytest.mark.parametrize(
    ("bad", "why"),
    [
        ('<tool_call>{"name": "add", "arguments": {"a": 2,}}</tool_call>', "not JSON"),
        ('<tool_call>{"name": "mul", "arguments": {}}</tool_call>', "unknown function 'mul'"),
        ('<tool_call>{"name": "add", "arguments": [1]}</tool_call>', "not an object"),
        ('<tool_call>{"name": "add", "arguments": {"a": 1}}', "never closed"),
    ],
)
def test_hermes_malformed_call_is_content_and_counted(bad, why):
    text = 'ok <tool_call>{"name": "search", "arguments": {"q": "a"}}</tool_call> then ' + bad
    out = HermesParser().parse(text, NAMES)
    assert [c.name for c in out.calls] == ["search"]
    assert out.failures == 1 and why in out.errors[0]
    assert out.content == ("ok  then " + bad).strip()


def test_hermes_plain_text_is_content_unchanged():
    out = HermesParser().parse("  just text\n", NAMES)
    assert (out.content, out.calls, out.failures) == ("  just text\n", (), 0)


def test_llama3_json_calls_with_and_without_python_tag():
    p = Llama3JsonParser()
    out = p.parse('{"name": "add", "parameters": {"a": 1, "b": 2}}', NAMES)
    assert [(c.name, args(c)) for c in out.calls] == [("add", {"a": 1, "b": 2})] and out.content is None
    out = p.parse('<|python_tag|>{"name": "add", "parameters": {"a": 1}}; {"name": "search", "arguments": {}}', NAMES)
    assert [(c.name, args(c)) for c in out.calls] == [("add", {"a": 1}), ("search", {})] and out.failures == 0
    out = p.parse("The answer is {4}.", NAMES)
    assert (out.content, out.calls, out.failures) == ("The answer is {4}.", (), 0)


def test_llama3_json_malformed_is_content_and_counted():
    text = '{"name": "add", "parameters": {"a": 1'
    out = Llama3JsonParser().parse(text, NAMES)
    assert (out.content, out.calls, out.failures) == (text, (), 1)
    out = Llama3JsonParser().parse('<|python_tag|>print("hi")', NAMES)
    assert out.failures == 1 and out.calls == ()


def test_mistral_v3_list_and_v11_segments():
    p = MistralParser()
    out = p.parse(
        'Sure.[TOOL_CALLS][{"name": "add", "arguments": {"a": 1}}, {"name": "search", "arguments": {}}]', NAMES
    )
    assert [(c.name, args(c)) for c in out.calls] == [("add", {"a": 1}), ("search", {})]
    assert out.content == "Sure." and all(len(c.id) == 9 and c.id.isalnum() for c in out.calls)
    out = p.parse('[TOOL_CALLS]add[ARGS]{"a": 5}[TOOL_CALLS]search[ARGS]{"q": "z"}', NAMES)
    assert [(c.name, args(c)) for c in out.calls] == [("add", {"a": 5}), ("search", {"q": "z"})]
    bad = 'x[TOOL_CALLS][{"name": "add", "arguments": {"a": }]'
    out = p.parse(bad, NAMES)
    assert (out.content, out.calls, out.failures) == (bad, (), 1)


def test_format_from_chat_template_and_config_refuses_unknown_names():
    tok = make_tokenizer()
    assert detect_format(tok) is None and make_tool_parser("auto", tok) is None
    tok.chat_template = "{% for tool in tools %}{{ tool | tojson }}{% endfor %}<tool_call>"
    assert detect_format(tok) == "hermes" and make_tool_parser("auto", tok).name == "hermes"
    tok.chat_template = "{{ '[TOOL_CALLS]' }}"
    assert detect_format(tok) == "mistral"
    tok.chat_template = "<|start_header_id|>ipython<|end_header_id|>{{ '<|python_tag|>' }}"
    assert detect_format(tok) == "llama3_json"
    assert make_tool_parser("mistral", tok).name == "mistral"
    with pytest.raises(ValueError, match="tool_parser='qwen'.*auto, hermes, llama3_json, mistral, vllm:NAME"):
        OpenAIServerConfig(tool_calls=ToolCallConfig(parser="qwen"))


TOOL = {"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}
TOOL2 = {"type": "function", "function": {"name": "search"}}


def test_tool_choice_auto_none_named_and_required_refused():
    assert parse_tools({"tools": [TOOL, TOOL2]}).choice == "auto"
    assert parse_tools({"tools": [TOOL], "tool_choice": "none"}).parse is False
    named = parse_tools({"tools": [TOOL, TOOL2], "tool_choice": {"type": "function", "function": {"name": "search"}}})
    assert named.names == {"search"} and named.specs == (TOOL2,)
    assert parse_tools({"tool_choice": "none"}) is None
    for body, match in [
        ({"tools": [TOOL], "tool_choice": "required"}, "required.*constrained decoding"),
        ({"tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "x"}}}, "names 'x'"),
        ({"tools": [TOOL, TOOL]}, "twice"),
        ({"tools": [{"type": "code"}]}, r"tools\[0\]"),
        ({"functions": [{"name": "add"}]}, "deprecated"),
        ({"tool_choice": "required"}, "needs tools"),
    ]:
        with pytest.raises(RequestError, match=match):
            parse_tools(body)


def test_earlier_tool_round_is_made_ready_for_the_template():
    m = {
        "role": "assistant",
        "content": None,
        "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 2}'}}],
    }
    assert template_message(0, m)["tool_calls"][0]["function"]["arguments"] == {"a": 2}
    assert template_message(1, {"role": "tool", "tool_call_id": "call_1", "content": "5"})["content"] == "5"
    with pytest.raises(RequestError, match=r"messages\[0\].tool_calls\[0\].function.arguments is not JSON"):
        template_message(0, {**m, "tool_calls": [{"function": {"name": "add", "arguments": "{a"}}]})
    with pytest.raises(RequestError, match="string content"):
        template_message(2, {"role": "tool", "content": None})
