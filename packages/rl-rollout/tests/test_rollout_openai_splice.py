"""Token-in-token-out chat prompts across an episode's calls (rl_rollout.openai_api.splice) with the tiny
character tokenizer and its chat template: the sampled ids that the plain rendering re-tokenises otherwise (a
multi-character vocabulary entry, a special token the client's text drops, the end-of-turn sampled or not, a
cut stop string) are kept and the new turns appended, so the episode merges; a template that renders the reply
otherwise is refused (rendered, counted as drift); a rewritten reply is a new transcript, not a refusal."""

from __future__ import annotations

import pytest

from rl_rollout.agents.transcript import episode_samples
from rl_rollout.openai_api import RecordedCall, RecordedChoice
from rl_rollout.openai_api.splice import splice_prompt
from rl_rollout.testing import make_tokenizer

SYSTEM = [{"role": "system", "content": "calc"}, {"role": "user", "content": "1+2?"}]
MORE = {"role": "user", "content": "again"}


@pytest.fixture(scope="module")
def tok():
    return make_tokenizer()


def _first_call(tok, sampled, text=None, finish="stop"):
    prompt = tok.apply_chat_template(SYSTEM, add_generation_prompt=True, tokenize=True, return_dict=False)
    text = tok.decode(sampled, skip_special_tokens=True) if text is None else text
    choice = RecordedChoice(list(sampled), [-0.25] * len(sampled), finish, 0, text)
    return RecordedCall("chat", list(prompt), [choice], {"messages": SYSTEM}, 0), text


def _plain(tok, msgs):
    return tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True, return_dict=False)


@pytest.mark.parametrize("ends", ["eos", "length", "stop_string"])
def test_splice_keeps_the_sampled_ids_where_the_rendering_drifts(tok, ends):
    extra = tok.convert_tokens_to_ids("<extra_110>")  # one id whose text re-tokenises as 11 characters
    start = tok.convert_tokens_to_ids("<|im_start|>")  # special: dropped from the client's text
    sampled = [*tok.encode("4", add_special_tokens=False), extra, start, *tok.encode("2", add_special_tokens=False)]
    text = None
    if ends == "eos":
        sampled.append(tok.eos_token_id)
    elif ends == "stop_string":  # the engine sampled "!" and the client's text stops before it
        sampled += tok.encode("!", add_special_tokens=False)
        text = tok.decode(sampled, skip_special_tokens=True)[:-1]
    call, text = _first_call(tok, sampled, text, "length" if ends == "length" else "stop")
    msgs = [*SYSTEM, {"role": "assistant", "content": text}, MORE]
    plain = _plain(tok, msgs)
    head = call.prompt_ids + sampled
    assert plain[: len(head)] != head  # rendered as usual, call 2 would not extend call 1: drift

    sp = splice_prompt(tok, msgs, [call])
    assert sp.refused == "" and sp.continues == 0 and sp.prompt_ids is not None
    added = sp.prompt_ids[len(head) :]
    assert sp.prompt_ids[: len(head)] == head
    end = "\n" if ends == "eos" else "<|im_end|>\n"  # the template's end of turn, less the sampled eos
    assert tok.decode(added) == end + "<|im_start|>user\nagain<|im_end|>\n<|im_start|>assistant\n"
    # the same conversation as the plain rendering, special tokens aside, the sampled "!" kept
    want = tok.decode(plain, skip_special_tokens=True)
    if ends == "stop_string":
        want = want.replace(text, text + "!", 1)
    assert tok.decode(sp.prompt_ids, skip_special_tokens=True) == want

    # recorded that way, the episode is one sequence: mask 1 exactly on the sampled ids
    second = RecordedCall("chat", sp.prompt_ids, [RecordedChoice([7, 8], [-1.0, -2.0], "stop", 1, "")], {}, 1,
                          "spliced")
    out = episode_samples([call, second], tok)
    assert out.mode == "merged" and not out.drift
    (s,) = out.samples
    assert s.response_ids == sampled + added + [7, 8]
    assert s.loss_mask == [1] * len(sampled) + [0] * len(added) + [1, 1]
    assert s.rollout_logprobs == [-0.25] * len(sampled) + [0.0] * len(added) + [-1.0, -2.0]


def test_a_third_call_splices_onto_a_spliced_one(tok):
    sampled = [tok.convert_tokens_to_ids("<extra_120>"), tok.eos_token_id]
    call, text = _first_call(tok, sampled)
    msgs = [*SYSTEM, {"role": "assistant", "content": text}, MORE]
    ids2 = splice_prompt(tok, msgs, [call]).prompt_ids
    assert ids2 is not None
    sampled2 = [tok.convert_tokens_to_ids("<extra_121>")]
    second = RecordedCall("chat", ids2, [RecordedChoice(sampled2, [-0.5], "length", 0, "<extra_121>")],
                          {"messages": msgs}, 1, "spliced")
    msgs3 = [*msgs, {"role": "assistant", "content": "<extra_121>"}, {"role": "user", "content": "last"}]
    sp = splice_prompt(tok, msgs3, [call, second])
    assert sp.continues == 1 and sp.prompt_ids is not None and sp.prompt_ids[: len(ids2) + 1] == ids2 + sampled2


def test_refused_rewritten_and_tool_call_replies(tok):
    sampled = tok.encode(" 7 ", add_special_tokens=False) + [tok.eos_token_id]
    call, text = _first_call(tok, sampled)
    msgs = [*SYSTEM, {"role": "assistant", "content": text}, MORE]
    # a template that trims the reply renders other text than was sampled: refused, rendered, counted as drift
    trims = tok.chat_template.replace("{{ message['content'] }}", "{{ message['content'] | trim }}")
    sp = splice_prompt(tok, msgs, [call], chat_template=trims)
    assert sp.prompt_ids is None and sp.continues == 0 and "renders the reply other" in sp.refused
    rendered = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True, return_dict=False,
                                       chat_template=trims)
    second = RecordedCall("chat", rendered, [RecordedChoice([9], [-1.0], "stop", 0, "")], {}, 1, "rendered",
                          sp.refused)
    out = episode_samples([call, second], tok)
    assert out.mode == "per_call" and out.drift and out.break_at == 1
    # the program rewrote the reply: a new transcript, rendered, no refusal
    edited = [*SYSTEM, {"role": "assistant", "content": "8"}, MORE]
    assert splice_prompt(tok, edited, [call]).prompt_ids is None and splice_prompt(tok, edited, [call]).refused == ""
    # a first call (nothing to continue) and a reply with tool calls (refused: rendered by the template's format)
    assert splice_prompt(tok, SYSTEM, [call]).prompt_ids is None
    tool = [*SYSTEM, {"role": "assistant", "content": text, "tool_calls": [{"id": "1"}]}, MORE]
    assert "tool_calls" in splice_prompt(tok, tool, [call]).refused
