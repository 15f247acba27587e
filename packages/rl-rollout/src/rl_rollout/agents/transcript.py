"""An episode's recorded calls (:class:`~rl_rollout.openai_api.RecordedCall`) as training samples:
:func:`episode_samples`.

- ``merged``: every call has one choice and its prompt ids start with the previous call's prompt + sampled
  ids, token for token. The episode is then one sequence: the first call's prompt, then each call's sampled
  ids (loss mask 1, the engine's log-probs) and, between them, the tokens the program added (tool results, the
  next user turn, the chat template's markup: loss mask 0, rollout log-prob 0.0, a placeholder the mask hides).
- ``per_call``: otherwise one sample per choice of every call, each its own prompt as rendered.
- ``drift``: a per-call episode where a call's prompt is *text*-wise an extension of the previous transcript
  but not token-wise (the chat template re-tokenised the sampled text differently), or where the endpoint
  refused to splice the call onto the previous one (``RecordedCall.splice_refused``). It is never merged:
  merging would train tokens the engine did not sample, or mask the ones it did. The endpoint avoids drift for
  chat calls that continue their episode by splicing their prompt onto the recorded ids
  (:mod:`rl_rollout.openai_api.splice`), so drift here means a splice whose checks failed, or a program that
  re-sends the transcript as a completion's text.

Nothing here re-tokenises: the ids are the recorded ones; text is decoded only to tell drift from a program
that rewrote its history.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from rl_rollout.openai_api.episodes import RecordedCall
from rl_rollout.types import RolloutSample

Mode = Literal["merged", "per_call"]


@dataclass(frozen=True)
class EpisodeSamples:
    """What :func:`episode_samples` made of one episode: ``samples`` (one when merged), ``mode``, ``drift``
    (True when per-call because of re-tokenisation drift), ``break_at`` (the first call that did not extend
    the transcript, or None)."""

    samples: list[RolloutSample]
    mode: Mode
    drift: bool = False
    break_at: int | None = None


def episode_samples(calls: list[RecordedCall], tokenizer: Any = None) -> EpisodeSamples:
    """The episode's calls (in order) as samples; ``tokenizer`` (``decode``) tells drift apart (without one a
    non-extension is never called drift). Raises ValueError for an episode without calls."""
    if not calls:
        raise ValueError("an episode without calls has no samples: the program made no chat or completion call")
    calls = sorted(calls, key=lambda c: c.index)
    break_at = _first_break(calls)
    if break_at is None:
        return EpisodeSamples([_merge(calls)], "merged")
    per_call = [s for c in calls for s in c.samples()]
    return EpisodeSamples(per_call, "per_call", _drifted(calls, break_at, tokenizer), break_at)


def _first_break(calls: list[RecordedCall]) -> int | None:
    """The index (in ``calls``) of the first call that does not extend the transcript token-wise (0 when a call
    has several choices: which one the program continued is unknown), or None."""
    if any(len(c.choices) != 1 for c in calls):
        return 0
    for i in range(1, len(calls)):
        prev = calls[i - 1].prompt_ids + calls[i - 1].choices[0].response_ids
        if calls[i].prompt_ids[: len(prev)] != prev:
            return i
    return None


def _drifted(calls: list[RecordedCall], i: int, tokenizer: Any) -> bool:
    if i > 0 and calls[i].splice_refused:  # the endpoint saw the continuation and could not splice it
        return True
    if tokenizer is None or i == 0 or len(calls[i - 1].choices) != 1:
        return False
    prev = calls[i - 1].prompt_ids + calls[i - 1].choices[0].response_ids
    now = calls[i].prompt_ids
    # the sampled turn's text, kept as text by the program, but its ids differ: the same text re-tokenised
    return tokenizer.decode(now, skip_special_tokens=False).startswith(
        tokenizer.decode(prev, skip_special_tokens=False)
    ) or _strip_eos_prefix(tokenizer, prev, now)


def _strip_eos_prefix(tokenizer: Any, prev: list[int], now: list[int]) -> bool:
    """Drift also when the text extends the transcript without the sampled turn's special tokens (a stop token
    the template writes its own way)."""
    skip = tokenizer.decode(prev, skip_special_tokens=True)
    return bool(skip) and tokenizer.decode(now, skip_special_tokens=True).startswith(skip)


def _merge(calls: list[RecordedCall]) -> RolloutSample:
    first = calls[0]
    response: list[int] = []
    logprobs: list[float] = []
    mask: list[int] = []
    spans: list[list[int]] = []
    versions: list[int] = []
    done = len(first.prompt_ids)  # tokens of the transcript so far (prompt + response)
    for c in calls:
        env = c.prompt_ids[done:]
        response += env
        logprobs += [0.0] * len(env)
        mask += [0] * len(env)
        (ch,) = c.choices
        spans.append([len(response), len(response) + len(ch.response_ids)])
        response += ch.response_ids
        logprobs += ch.logprobs
        mask += [1] * len(ch.response_ids)
        versions.append(ch.policy_version)
        done = len(c.prompt_ids) + len(ch.response_ids)
    return RolloutSample(
        prompt_ids=list(first.prompt_ids),
        response_ids=response,
        rollout_logprobs=logprobs,
        loss_mask=mask,
        finish_reason=calls[-1].choices[0].finish_reason,
        policy_version=min(versions),
        info={"calls": len(calls), "action_spans": spans, "turn_policy_versions": versions},
    )
