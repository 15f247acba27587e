"""Tool calls on the vLLM engine (vLLM's CPU build; run in .venv-vllm: scripts/vllm-cpu-env.sh test): the
endpoint's ``auto`` parser is vLLM's own ``hermes`` (``ToolParserManager``) where it builds with the tokenizer,
ours where it does not (a tokenizer without the format's tokens); vLLM's parser's calls, its content, and the
failures (not JSON, an unknown function) counted; and the taught tiny model (rl_rollout.testing_tools) served by
VLLMEngine returns its call as OpenAI ``tool_calls`` through the ``openai`` client."""

from __future__ import annotations

import json
import os

import pytest
import torch

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

from rl_rollout.testing import missing_modules

if why := missing_modules("vllm", "openai"):
    print(f"skipping the vLLM tool-call tests: {why}")
    pytest.skip(why, allow_module_level=True)

import openai  # noqa: E402
from transformers import AutoTokenizer  # noqa: E402

from rl_rollout.openai_api import OpenAIServer, OpenAIServerConfig  # noqa: E402
from rl_rollout.openai_api.tool_parsers import VLLMToolParser, make_tool_parser  # noqa: E402
from rl_rollout.testing import VLLM_CPU_TESTS_ON_CUDA, make_tokenizer  # noqa: E402
from rl_rollout.testing_tools import ASK, CALL, TOOLS, make_tiny_tool_model  # noqa: E402

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.timeout(300),
    pytest.mark.skipif(torch.cuda.is_available(), reason=VLLM_CPU_TESTS_ON_CUDA),
]
NAMES = frozenset({"add"})


def test_auto_on_vllm_is_vllms_hermes_parser_and_failures_are_counted():
    tok = make_tokenizer(128, extra_special=("<tool_call>", "</tool_call>"))
    tok.chat_template = "{{ tools }}<tool_call>"
    p = make_tool_parser("auto", tok, vllm_engine=True)
    assert isinstance(p, VLLMToolParser) and p.name == "vllm:hermes" and "<tool_call>" in p.markers
    out = p.parse('Adding.<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>', NAMES)
    (call,) = out.calls
    assert (call.name, json.loads(call.arguments), out.content, out.failures) == ("add", {"a": 2, "b": 3}, "Adding.", 0)
    for bad in (
        '<tool_call>{"name": "add", "arguments": {"a": 2,}}</tool_call>',
        '<tool_call>{"name": "mul"}</tool_call>',
    ):
        out = p.parse(bad, NAMES)
        assert (out.content, out.calls, out.failures) == (bad, (), 1)
    assert p.parse("plain", NAMES).failures == 0
    # vLLM's llama3_json parser needs <|python_tag|> in the vocabulary: this tokenizer has none, so ours serves
    assert type(make_tool_parser("llama3_json", tok, vllm_engine=True)).__name__ == "Llama3JsonParser"
    with pytest.raises(ValueError, match="vLLM has no tool parser 'nope'"):
        make_tool_parser("vllm:nope", tok)


def test_vllm_engine_serves_the_taught_call(tmp_path):
    from rl_rollout.vllm_engine import VLLMEngine  # lazy: starts nothing, but imports vLLM's engine

    path = make_tiny_tool_model(tmp_path / "m")
    engine = VLLMEngine(path, dtype="float32", enforce_eager=True, max_model_len=512, seed=0, in_process=True)
    try:
        with OpenAIServer(
            engine, AutoTokenizer.from_pretrained(path), OpenAIServerConfig(default_max_tokens=80)
        ) as srv:
            assert srv.tool_parser is not None and srv.tool_parser.name == "vllm:hermes"
            key, base = srv.open_episode("v")
            c = openai.OpenAI(base_url=base, api_key=key, max_retries=0)
            r = c.chat.completions.create(model="policy", messages=ASK, tools=TOOLS, temperature=0)
            (choice,) = r.choices
            (tc,) = choice.message.tool_calls
            assert choice.finish_reason == "tool_calls" and choice.message.content == "Adding."
            assert tc.function.name == "add" and json.loads(tc.function.arguments) == {"a": 2, "b": 3}
            (call,) = srv.close_episode(key)
            tok = srv.tokenizer
            assert tok.decode(call.choices[0].response_ids, skip_special_tokens=False).startswith("Adding." + CALL)
    finally:
        engine.shutdown()
