"""Chat prompts of an episode built token-in-token-out: :func:`splice_prompt`.

An agent program keeps its conversation as text: it sends back the assistant's reply as a message and the chat
template renders the whole transcript again. Re-rendered, the reply's text need not tokenize to the ids the
engine sampled (a token whose text re-tokenizes as several, a special token the client's text drops, the
end-of-turn token the template writes itself), so the next call's prompt would not extend the previous call's
prompt + sampled ids, and the calls could not be merged into one training sequence (re-tokenisation drift).

So, as AReaL, ART and verl do, a chat request that continues an earlier call of its episode (its messages are
that call's messages, then an assistant message whose content is one of that call's replies, then new messages)
gets the prompt ids

    previous prompt ids + the reply's sampled ids [+ the template's end-of-turn, less what the sampled ids
    already end with] + the template's rendering of the new messages, tokenized

where "the template's rendering of the new messages" is the full conversation rendered as text minus the
rendering of the conversation up to the reply. The splice is used only when it checks out:

- the template renders the earlier turns the same once more messages follow (the full rendering starts with
  the rendering up to the reply, which starts with the previous prompt's rendering + the reply's text);
- the new tokens decode back to exactly the new text;
- the spliced ids decode (special tokens skipped) to the same text as the plain rendering with the reply's
  sampled text in place of the text the client got (the known normalisation: a stop string cut from the reply
  stays in the prompt, since the engine sampled it, and so do the sampled turns of earlier splices); a
  previous call whose prompt was rendered must decode to the rendering of its messages.

Otherwise the prompt is rendered as usual and the miss is recorded (:attr:`Splice.refused`), counted as drift.
A reply that carries ``tool_calls`` is not spliced (refused): its rendering by the template is not the
sampled text.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    from rl_rollout.openai_api.episodes import RecordedCall, RecordedChoice

#: how a call's prompt ids were built: the chat template's rendering, a splice (:func:`splice_prompt`), or a
#: completion's prompt (its text tokenized, or its ids as given)
PromptSource = Literal["rendered", "spliced", "completion"]


@dataclass(frozen=True)
class Splice:
    """What :func:`splice_prompt` made of a chat request: ``prompt_ids`` (None: render the messages as usual),
    ``continues`` (the index of the call continued, or None), ``refused`` (why a continuation was not spliced,
    "" when spliced or when the request continues no call)."""

    prompt_ids: list[int] | None
    continues: int | None = None
    refused: str = ""


def text_messages(messages: list[dict]) -> list[dict]:
    """``messages`` (already checked by the protocol) as the template gets them: text parts joined, keys whose
    value is None dropped (the ``openai`` client may send ``tool_calls: null``)."""
    out = []
    for m in messages:
        m = {k: v for k, v in m.items() if v is not None}
        if isinstance(m.get("content"), list):
            m["content"] = "".join(p["text"] for p in m["content"])
        out.append(m)
    return out


def splice_prompt(tokenizer: Any, messages: list[dict], calls: list[RecordedCall], **template: Any) -> Splice:
    """The prompt ids of a chat request of ``messages`` in an episode whose earlier calls are ``calls`` (module
    docstring); ``template``: extra keyword arguments of ``apply_chat_template`` (``tools``)."""
    msgs = text_messages(messages)
    for call in reversed(calls):
        if call.endpoint != "chat":
            continue
        prev = text_messages(call.request.get("messages") or [])
        if not prev or len(msgs) <= len(prev) or msgs[: len(prev)] != prev:
            continue
        reply = msgs[len(prev)]
        if reply.get("role") != "assistant":
            continue
        choice = next((c for c in call.choices if c.text == reply.get("content", "")), None)
        if choice is None:  # the program rewrote the reply: a new transcript, not drift
            continue
        if reply.get("tool_calls") or reply.get("function_call"):
            return Splice(None, call.index, "the reply carries tool_calls (their rendering is not the sampled text)")
        ids, why = _splice(tokenizer, prev, reply, msgs, call, choice, template)
        return Splice(ids, call.index, why)
    return Splice(None)


def _splice(
    tok: Any, prev: list[dict], reply: dict, msgs: list[dict], call: RecordedCall, choice: RecordedChoice, kw: dict
) -> tuple[list[int] | None, str]:
    def render(ms: list[dict], gen: bool) -> str:
        return tok.apply_chat_template(ms, add_generation_prompt=gen, tokenize=False, **kw)

    try:
        head, turn, full = render(prev, True), render([*prev, reply], False), render(msgs, True)
    except Exception as e:  # noqa: BLE001 - the template's refusal: the plain rendering reports it
        return None, f"the chat template failed: {type(e).__name__}: {e}"
    if not turn.startswith(head + choice.text):
        return None, "the chat template renders the reply other than as its text after the generation prompt"
    if not full.startswith(turn):
        return None, "the chat template renders the earlier turns differently once more messages follow"
    tail, new = turn[len(head) + len(choice.text) :], full[len(turn) :]
    sampled = choice.response_ids
    if sampled and sampled[-1] in set(tok.all_special_ids):  # an end-of-turn the engine sampled (eos)
        last = tok.decode(sampled[-1:], skip_special_tokens=False)
        if tail.startswith(last):
            tail = tail[len(last) :]
    added = _encode(tok, tail + new)
    if tok.decode(added, skip_special_tokens=False) != tail + new:
        return None, f"the new turns' text does not survive encode/decode: {(tail + new)[:60]!r}"
    ids = [*call.prompt_ids, *sampled, *added]
    if call.prompt_source == "rendered" and _text(tok, call.prompt_ids) != _text(tok, _encode(tok, head)):
        return None, "the previous call's prompt ids are not the rendering of its messages"
    said = tok.decode(sampled, skip_special_tokens=True)  # the reply as sampled (the client's text + a cut stop)
    rest = said + turn[len(head) + len(choice.text) :] + new
    if _text(tok, ids) != _text(tok, call.prompt_ids) + _text(tok, _encode(tok, rest)):
        return None, "the spliced ids do not decode to the rendered conversation"
    return [int(t) for t in ids], ""


def _encode(tok: Any, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


def _text(tok: Any, ids: list[int]) -> str:
    return tok.decode(ids, skip_special_tokens=True)
