"""Tool calls through the OpenAI endpoint over the real HF engine, called with the ``openai`` client.

A tiny model (rl_rollout.testing) with a Hermes-style chat template (``<tool_call>`` / ``</tool_call>`` single
special tokens, as Qwen2.5's are single tokens) is first taught, by a few hundred plain torch steps on CPU, three
greedy replies: a call ``add(a=2, b=3)`` after a sentence, the final answer once the tool's result comes back,
and a malformed call. The test then checks what an agent sees: ``tool_calls`` with the name and JSON arguments
and ``finish_reason="tool_calls"``, the sentence as content, streamed and not; the follow-up with the
assistant's ``tool_calls`` and a ``tool`` message renders as the model was taught (it answers "The sum is 5.");
the malformed call comes back as content and is counted per call and in the server's stats; and the recorded
ids are the sampled ones, markers included."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from rl_rollout.hf_engine import HFEngine
from rl_rollout.openai_api import OpenAIServer, OpenAIServerConfig
from rl_rollout.testing import make_tiny_model, make_tokenizer, missing_modules

if why := missing_modules("openai"):
    pytest.skip(why, allow_module_level=True)

import openai  # noqa: E402

TEMPLATE = (
    "{% if tools %}<|im_start|>system\nTools:{% for t in tools %} {{ t['function']['name'] }}{% endfor %}. "
    "Reply <tool_call>JSON</tool_call>.<|im_end|>\n{% endif %}"
    "{% for m in messages %}"
    "{% if m['role'] == 'tool' %}<|im_start|>user\n<tool_response>{{ m['content'] }}</tool_response><|im_end|>\n"
    "{% elif m['role'] == 'assistant' and m['tool_calls'] is defined and m['tool_calls'] %}<|im_start|>assistant\n"
    "{% if m['content'] %}{{ m['content'] }}{% endif %}{% for tc in m['tool_calls'] %}<tool_call>"
    "{\"name\": \"{{ tc['function']['name'] }}\", \"arguments\": {{ tc['function']['arguments'] | tojson }}}"
    "</tool_call>{% endfor %}<|im_end|>\n"
    "{% else %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "add",
            "description": "a + b",
            "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}},
        },
    }
]
ASK = [{"role": "user", "content": "2 plus 3?"}]
BAD_ASK = [{"role": "user", "content": "2 plus 3, badly"}]
CALL = '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>'
BAD_CALL = '<tool_call>{"name": "add", "arguments": {"a": 2,}}</tool_call>'


def _followup(arguments: dict) -> list[dict]:
    call = {"id": "call_x", "type": "function", "function": {"name": "add", "arguments": arguments}}
    return [
        *ASK,
        {"role": "assistant", "content": "Adding.", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_x", "content": "5"},
    ]


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    """The tiny model taught its three replies (greedy decoding reproduces each; checked here)."""
    path = make_tiny_model(tmp_path_factory.mktemp("tools") / "m", seed=5)
    tok = make_tokenizer(128, extra_special=("<tool_call>", "</tool_call>"))
    tok.chat_template = TEMPLATE
    tok.save_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path)
    torch.manual_seed(0)
    examples = [
        (ASK, "Adding." + CALL),
        (_followup({"a": 2, "b": 3}), "The sum is 5."),
        (BAD_ASK, BAD_CALL),
    ]
    seqs = []
    for messages, target in examples:
        prompt = tok.apply_chat_template(messages, tools=TOOLS, add_generation_prompt=True, return_dict=False)
        seqs.append((prompt, tok.encode(target, add_special_tokens=False) + [tok.eos_token_id]))
    width = max(len(p) + len(t) for p, t in seqs)
    ids = torch.full((len(seqs), width), tok.pad_token_id)
    labels = torch.full_like(ids, -100)
    for i, (p, t) in enumerate(seqs):
        ids[i, : len(p) + len(t)] = torch.tensor(p + t)
        labels[i, len(p) : len(p) + len(t)] = torch.tensor(t)
    attn = (labels != -100) | (torch.arange(width) < torch.tensor([len(p) for p, _ in seqs])[:, None])
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    model.train()
    for step in range(400):
        loss = model(input_ids=ids, attention_mask=attn.long(), labels=labels).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        if loss.item() < 0.02:  # every target token's probability well above the rest: greedy reproduces it
            break
    print(f"taught in {step + 1} steps, loss {loss.item():.3g}")
    model.eval()
    for p, t in seqs:  # taught: greedy reproduces every target token
        with torch.no_grad():
            out = model.generate(torch.tensor([p]), max_new_tokens=len(t), do_sample=False)
        assert out[0, len(p) :].tolist() == t, f"the tiny model did not learn its reply (loss {loss.item():.2e})"
    model.save_pretrained(path)
    return path


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
    assert r2.choices[0].message.content == "The sum is 5." and r2.choices[0].finish_reason == "stop"
    assert not r2.choices[0].message.tool_calls

    first, second = server.close_episode(key)
    (rec,) = first.choices
    # the recorded ids are the sampled ones: the markers' special tokens in place, the text they decode to
    assert tok.decode(rec.response_ids, skip_special_tokens=False) == "Adding." + CALL + tok.eos_token
    assert rec.text == tok.decode(rec.response_ids, skip_special_tokens=True)
    assert first.tool_calls == 1 and first.tool_parse_failures == 0 and first.request["tools"] == TOOLS
    # the follow-up's prompt is the template's rendering of the tool round, arguments as an object
    assert second.prompt_ids == tok.apply_chat_template(
        _followup({"a": 2, "b": 3}), tools=TOOLS, add_generation_prompt=True, return_dict=False
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
