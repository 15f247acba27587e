"""Rendering prompts and responses to text, and text to token ids with a loss mask.

Owns the rules every dataset shares: a prompt is a string (``input_template`` applied
when set) or, with ``apply_chat_template``, a list of ``{"role", "content"}`` messages
(a bare string becomes one user message, as in OpenRLHF) rendered by the tokenizer's
chat template; responses end with eos (appended when the text or template lacks it);
the loss mask is 1 exactly on response / assistant tokens including that eos, and 0
on prompts, system and user turns, template headers and anything after the eos (e.g.
the template's trailing newline).

How: the text is cut into segments (prompt, response, prompt, ...) at character
positions found by rendering growing prefixes of the conversation, and each segment
is tokenized on its own (``add_special_tokens=False``: chat templates carry their own
bos). Concatenating per-segment ids makes the mask exact whatever the tokenizer merges
across a boundary, and matches what generation sees: prompt ids, then response ids.
The price: a sentencepiece tokenizer may add its prefix space at each segment start.

Leaves out: which columns feed it and length limits (:mod:`rl_core.data.datasets`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from rl_core.data.config import DataConfig
from rl_core.data.loading import DataError


@dataclass
class Encoded:
    """Token ids of one sequence and its 0/1 loss mask (same length)."""

    input_ids: list[int]
    loss_mask: list[int]


class _Segment(NamedTuple):
    text: str
    target: bool


def check_tokenizer(tokenizer, cfg: DataConfig) -> None:
    """Fail before any row is read if the tokenizer cannot do what ``cfg`` asks."""
    if tokenizer.eos_token_id is None:
        raise ValueError("the tokenizer has no eos_token; set tokenizer.eos_token (responses must end with it)")
    if cfg.apply_chat_template and not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            "apply_chat_template is set but the tokenizer has no chat_template; "
            "use an instruct model's tokenizer, set tokenizer.chat_template, or drop --apply_chat_template"
        )


def as_messages(value: object, where: str, label: str) -> list[dict]:
    """``value`` as chat messages: a string is one user message; a list must hold
    ``{"role": str, "content": str}`` dicts."""
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if not isinstance(value, list) or not value:
        raise DataError(f"{where}: {label} must be a string or a non-empty list of chat messages, got {_show(value)}")
    for j, m in enumerate(value):
        if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
            raise DataError(f"{where}: {label} message {j} must be {{'role': str, 'content': str}}, got {_show(m)}")
    return [dict(m) for m in value]


def image_messages(value: object, where: str, label: str) -> list[dict]:
    """A vision-language prompt as chat messages: :func:`as_messages`'s rules, except that a message's content
    may be a list of parts (``{"type": "image"}``, ``{"type": "text", "text": ...}``) and ``<image>`` in a
    string content becomes an image part there (OpenRLHF's rule)."""
    if isinstance(value, str):
        value = [{"role": "user", "content": value}]
    if not isinstance(value, list) or not value:
        raise DataError(f"{where}: {label} must be a string or a non-empty list of chat messages, got {_show(value)}")
    out = []
    for j, m in enumerate(value):
        content = m.get("content") if isinstance(m, dict) else None
        parts_ok = isinstance(content, list) and all(
            isinstance(p, dict) and isinstance(p.get("type"), str) for p in content
        )
        if not (isinstance(m, dict) and isinstance(m.get("role"), str) and (isinstance(content, str) or parts_ok)):
            raise DataError(
                f"{where}: {label} message {j} must be {{'role': str, 'content': str or a list of "
                f"{{'type': 'image' | 'text', ...}} parts}}, got {_show(m)}"
            )
        if isinstance(content, str) and "<image>" in content:
            pieces = content.split("<image>")
            content = [
                p
                for i, piece in enumerate(pieces)
                for p in ([{"type": "image"}] if i else []) + ([{"type": "text", "text": piece}] if piece else [])
            ]
        out.append({**m, "content": content})
    return out


def render_prompt(tokenizer, cfg: DataConfig, value: object, where: str, label: str) -> str:
    """The prompt text a model is given: chat-templated with the generation prompt,
    or ``input_template.format(value)``, or ``value`` itself."""
    if cfg.apply_chat_template:
        messages = image_messages(value, where, label) if cfg.image_key else as_messages(value, where, label)
        return _render(tokenizer, messages, True, where)
    text = _plain_text(value, where, label)
    return cfg.input_template.format(text) if cfg.input_template else text


def encode_completion(
    tokenizer, cfg: DataConfig, prompt: object, response: object, where: str, prompt_label: str, response_label: str
) -> Encoded:
    """Prompt (or ``None``: no prompt) followed by a response; the mask covers the response.

    With ``apply_chat_template`` the response may be a string (one assistant turn) or a
    list of messages appended to the prompt (loss on its assistant turns); with no prompt
    a message list is a whole conversation and the loss covers its last assistant turn.
    """
    if not cfg.apply_chat_template:
        text = _plain_text(response, where, response_label)
        _require_content(text, where, response_label)
        prompt_text = "" if prompt is None else render_prompt(tokenizer, cfg, prompt, where, prompt_label)
        return _encode_segments(tokenizer, [_Segment(prompt_text, False), _Segment(text, True)])
    if prompt is None and isinstance(response, str):
        raise DataError(
            f"{where}: {response_label} is a plain string but there is no prompt; "
            "set --prompt_key, or store it as a chat message list that includes the prompt"
        )
    messages_of = image_messages if cfg.image_key else as_messages  # image parts in vision-language rows
    head = [] if prompt is None else messages_of(prompt, where, prompt_label)
    if isinstance(response, str):
        tail = [{"role": "assistant", "content": response}]
    else:
        tail = messages_of(response, where, response_label)
    messages = head + tail
    if prompt is None:
        targets = [len(messages) - 1]
        if messages[-1]["role"] != "assistant":
            raise DataError(
                f"{where}: {response_label} must end with an assistant message (the response), "
                f"ends with role {messages[-1]['role']!r}"
            )
    else:
        targets = [len(head) + j for j, m in enumerate(tail) if m["role"] == "assistant"]
        if not targets:
            raise DataError(f"{where}: {response_label} has no assistant message to train on")
    return encode_chat(tokenizer, messages, targets, where, response_label)


def encode_chat(tokenizer, messages: list[dict], targets: list[int], where: str, label: str) -> Encoded:
    """The rendered conversation, mask 1 on the assistant turns at indices ``targets``.

    Needs a prefix-stable template: the rendering of ``messages[:i]`` plus the generation
    prompt must be a prefix of the rendering of ``messages[:i+1]``, itself a prefix of the
    whole (templates that rewrite earlier turns, e.g. by stripping old reasoning, are not).
    """
    eos = tokenizer.eos_token
    full = _render(tokenizer, messages, False, where)
    segments, pos = [], 0
    for i in sorted(set(targets)):
        msg = messages[i]
        if msg["role"] != "assistant":
            raise DataError(
                f"{where}: {label} message {i} has role {msg['role']!r}, only assistant turns are trained on"
            )
        if not isinstance(msg["content"], str):
            raise DataError(
                f"{where}: {label} message {i} (assistant) must be a string: images go in the prompt's turns"
            )
        _require_content(msg["content"], where, f"{label} message {i} (assistant)")
        if i == 0:
            raise DataError(f"{where}: {label} starts with an assistant turn; put a system or user message before it")
        before = _render(tokenizer, messages[:i], True, where)
        through = _render(tokenizer, messages[: i + 1], False, where)
        if not (through.startswith(before) and full.startswith(through)):
            raise DataError(
                f"{where}: the chat template is not prefix-stable at message {i} (rendering earlier turns changes "
                "when later ones are added), so assistant tokens cannot be located; use a template without "
                "history rewriting, or train single-turn with --output_key"
            )
        turn = through[len(before) :]
        k = turn.rfind(eos)
        end = len(before) + (k + len(eos) if k >= 0 else len(turn))
        segments += [_Segment(full[pos : len(before)], False), _Segment(full[len(before) : end], True)]
        pos = end
    segments.append(_Segment(full[pos:], False))
    return _encode_segments(tokenizer, segments)


def _encode_segments(tokenizer, segments: list[_Segment]) -> Encoded:
    eos_id = tokenizer.eos_token_id
    ids: list[int] = []
    mask: list[int] = []
    for seg in segments:
        seg_ids = tokenizer(seg.text, add_special_tokens=False)["input_ids"] if seg.text else []
        if seg.target and (not seg_ids or seg_ids[-1] != eos_id):
            seg_ids = seg_ids + [eos_id]
        ids += seg_ids
        mask += [int(seg.target)] * len(seg_ids)
    if mask:
        mask[0] = 0  # nothing precedes token 0, so no logit predicts it
    return Encoded(ids, mask)


def _render(tokenizer, messages: list[dict], generation_prompt: bool, where: str) -> str:
    try:
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)
    except Exception as e:  # jinja raises on role order etc.: a property of this row
        raise DataError(f"{where}: the chat template rejected these messages: {type(e).__name__}: {e}") from None


def _plain_text(value: object, where: str, label: str) -> str:
    if isinstance(value, str):
        return value
    hint = "; it holds chat messages, so set --apply_chat_template" if isinstance(value, list) else ""
    raise DataError(f"{where}: {label} must be a string, got {_show(value)}{hint}")


def _require_content(text: str, where: str, label: str) -> None:
    if not text.strip():
        raise DataError(f"{where}: {label} is empty; a response needs at least one token (fix or drop the row)")


def _show(value: object, limit: int = 60) -> str:
    text = repr(value)
    text = text if len(text) <= limit else text[: limit - 3] + "..."
    return f"{type(value).__name__} {text}"
