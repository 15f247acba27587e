"""Tool calls through the OpenAI endpoint over the real HF engine, called with the ``openai`` client.

A tiny model with a Hermes-style chat template (``<tool_call>`` / ``</tool_call>`` single special tokens, as
Qwen2.5's are single tokens) is first taught (rl_rollout.testing_tools, about 100 plain torch steps on CPU) three
greedy replies: a call ``add(a=2, b=3)`` after a sentence, the final answer once the tool's result comes back,
and a malformed call. The test then checks what an agent sees: ``tool_calls`` with the name and JSON arguments
and ``finish_reason="tool_calls"``, the sentence as content, streamed and not; the follow-up with the
assistant's ``tool_calls`` and a ``tool`` message renders as the model was taught (it answers ANSWER);
the malformed call comes back as content and is counted per call and in the server's stats; and the recorded
ids are the sampled ones, markers included."""

from __future__ import annotations

import json

import pytest
from transformers import AutoTokenizer

from rl_rollout.hf_engine import HFEngine
from rl_rollout.openai_api import OpenAIServer, OpenAIServerConfig
from rl_rollout.testing import missing_modules
from rl_rollout.testing_tools import ANSWER, ASK, BAD_ASK, BAD_CALL, CALL, TOOLS, followup, make_tiny_tool_model

if why := missing_modules("openai"):
    pytest.skip(why, allow_module_level=True)

import openai  # noqa: E402


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return make_tiny_tool_model(tmp_path_factory.mktemp("tools") / "m")


@pytest.fixture(scope="module")
def server(model_path):
    tok = AutoTokenizer.from_pretrained(model_path)
    with OpenAIServer(HFEngine(model_path), tok, OpenAIServerConfig(default_max_tokens=80)) as srv:
        yield srv


def client(server):
    key, base = server.open_episode("tools")
    return key, openai.OpenAI(base_url=base, api_key=key, max_retries=0)


def test_tool_call_reaches_the_client_and_the_tool_round_renders(server):
    tok = server.tokenizer
    key, c = client(server)
    r = c.chat.completions.create(model="policy", messages=ASK, tools=TOOLS, temperature=0)
    (choice,) = r.choices
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Adding."
    (tc,) = choice.message.tool_calls
    assert tc.type == "function" and tc.function.name == "add" and tc.id.startswith("call_")
    assert json.loads(tc.function.arguments) == {"a": 2, "b": 3}

    messages = [
        *ASK,
        choice.message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": tc.id, "content": "5"},
    ]
    r2 = c.chat.completions.create(model="policy", messages=messages, tools=TOOLS, temperature=0)
    assert r2.choices[0].message.content == ANSWER and r2.choices[0].finish_reason == "stop"
    assert not r2.choices[0].message.tool_calls

    first, second = server.close_episode(key)
    (rec,) = first.choices
    # the recorded ids are the sampled ones: the markers' special tokens in place, the text they decode to
    assert tok.decode(rec.response_ids, skip_special_tokens=False) == "Adding." + CALL + tok.eos_token
    assert rec.text == tok.decode(rec.response_ids, skip_special_tokens=True)
    assert first.tool_calls == 1 and first.tool_parse_failures == 0 and first.request["tools"] == TOOLS
    # the follow-up's prompt is the template's rendering of the tool round, arguments as an object
    assert second.prompt_ids == tok.apply_chat_template(
        followup({"a": 2, "b": 3}), tools=TOOLS, add_generation_prompt=True, return_dict=False
    )
    assert second.tool_calls == 0 and second.samples()[0].info["tool_calls"] == 0


def test_streamed_tool_call(server):
    _, c = client(server)
    chunks = list(c.chat.completions.create(model="policy", messages=ASK, tools=TOOLS, temperature=0, stream=True))
    content = "".join(ch.choices[0].delta.content or "" for ch in chunks)
    calls = [tc for ch in chunks for tc in (ch.choices[0].delta.tool_calls or [])]
    assert content == "Adding." and [ch.choices[0].finish_reason for ch in chunks][-1] == "tool_calls"
    (tc,) = calls
    assert tc.index == 0 and tc.function.name == "add" and json.loads(tc.function.arguments) == {"a": 2, "b": 3}


def test_malformed_call_is_content_and_counted(server):
    before = server.stats().get("tool_parse_failures", 0)
    key, c = client(server)
    r = c.chat.completions.create(model="policy", messages=BAD_ASK, tools=TOOLS, temperature=0)
    (choice,) = r.choices
    assert choice.message.content == BAD_CALL and not choice.message.tool_calls and choice.finish_reason == "stop"
    (call,) = server.close_episode(key)
    assert call.tool_parse_failures == 1 and call.tool_calls == 0
    assert server.stats()["tool_parse_failures"] == before + 1


def test_tool_choice_none_and_required(server):
    key, c = client(server)
    r = c.chat.completions.create(model="policy", messages=ASK, tools=TOOLS, tool_choice="none", temperature=0)
    # not parsed: the text as decoded (the markers are special tokens, skipped as in any reply)
    assert r.choices[0].message.content == "Adding." + CALL[11:-12] and not r.choices[0].message.tool_calls
    with pytest.raises(openai.BadRequestError, match="required.*constrained decoding"):
        c.chat.completions.create(model="policy", messages=ASK, tools=TOOLS, tool_choice="required")
    server.close_episode(key)
