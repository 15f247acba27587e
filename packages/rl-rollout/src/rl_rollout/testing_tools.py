"""A tiny model that makes tool calls, for tests of the OpenAI endpoint's tool calls and of agents using them.

:func:`make_tiny_tool_model` saves :func:`~rl_rollout.testing.make_tiny_model`'s Llama with a Hermes-style chat
template (``<tool_call>`` / ``</tool_call>`` single special tokens, as Qwen2.5's are single tokens) and teaches
it, by a few hundred plain torch steps on CPU (about 8 s), three greedy replies: ``"Adding." + CALL`` to
:data:`ASK` with :data:`TOOLS`, ``"The sum is 5."`` once the tool round (:func:`followup`) comes back, and the
malformed :data:`BAD_CALL` to :data:`BAD_ASK`. The random models never emit a tool call; this one does, through
the real engine."""

from __future__ import annotations

from pathlib import Path
from typing import Any

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
TOOLS: list[dict[str, Any]] = [
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
ANSWER = "The sum is 5."


def followup(arguments: dict) -> list[dict]:
    """:data:`ASK`, the assistant's call of ``add`` with ``arguments`` after "Adding.", and the tool's "5"."""
    call = {"id": "call_x", "type": "function", "function": {"name": "add", "arguments": arguments}}
    return [
        *ASK,
        {"role": "assistant", "content": "Adding.", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_x", "content": "5"},
    ]


def make_tiny_tool_model(path: str | Path, *, seed: int = 5, max_steps: int = 400) -> Path:
    """The taught model at ``path`` (module docstring); idempotent like ``make_tiny_model``. AssertionError
    when greedy decoding does not give back every taught reply."""
    import torch  # lazy: the module's constants are read without torch
    from transformers import AutoModelForCausalLM

    from rl_rollout.testing import make_tiny_model, make_tokenizer  # lazy: it imports torch (the IPC helpers)

    path = Path(path)
    if (path / "taught").exists():
        return path
    make_tiny_model(path, seed=seed)
    tok = make_tokenizer(128, extra_special=("<tool_call>", "</tool_call>"))
    tok.chat_template = TEMPLATE
    tok.save_pretrained(path)
    model: Any = AutoModelForCausalLM.from_pretrained(path)
    torch.manual_seed(seed)
    seqs = []
    for messages, target in [(ASK, "Adding." + CALL), (followup({"a": 2, "b": 3}), ANSWER), (BAD_ASK, BAD_CALL)]:
        prompt = tok.apply_chat_template(messages, tools=TOOLS, add_generation_prompt=True, return_dict=False)
        seqs.append((prompt, tok.encode(target, add_special_tokens=False) + [tok.eos_token_id]))
    width = max(len(p) + len(t) for p, t in seqs)
    ids_BT = torch.full((len(seqs), width), tok.pad_token_id)
    labels_BT = torch.full_like(ids_BT, -100)
    for i, (p, t) in enumerate(seqs):
        ids_BT[i, : len(p) + len(t)] = torch.tensor(p + t)
        labels_BT[i, len(p) : len(p) + len(t)] = torch.tensor(t)
    mask_BT = (labels_BT != -100) | (torch.arange(width) < torch.tensor([len(p) for p, _ in seqs])[:, None])
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    model.train()
    for _ in range(max_steps):
        loss = model(input_ids=ids_BT, attention_mask=mask_BT.long(), labels=labels_BT).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        if loss.item() < 0.02:  # every target token far above the rest: greedy gives it back (checked below)
            break
    model.eval()
    for p, t in seqs:
        with torch.no_grad():
            out = model.generate(torch.tensor([p]), max_new_tokens=len(t), do_sample=False)
        assert out[0, len(p) :].tolist() == t, f"the tiny model did not learn its reply (loss {loss.item():.2e})"
    model.save_pretrained(path)
    (path / "taught").write_text("")
    return path
