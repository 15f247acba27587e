"""Evaluation numbers, pure (no torch, no model): pass@k, maj@k and one dataset's metrics from its scored samples,
and the JSON line of one scored sample. One code path for ``rl eval`` (rl-cli) and the RL loop's eval pass
(``rl ppo --eval_dataset``, :mod:`rl_core.trainers.ppo_eval`): both tally their samples with :class:`EvalTally`
and write them with :func:`sample_record`, so the two report the same metrics under the same names.

- :func:`pass_at_k`: the unbiased estimator of Chen et al. 2021 (arXiv:2107.03374, "Evaluating Large Language
  Models Trained on Code"), ``1 - C(n-c, k) / C(n, k)`` for ``c`` correct samples among ``n``, computed as the
  product ``1 - prod_{i=n-c+1..n} (1 - k / i)`` (no factorials, so no overflow at large n).
- :func:`maj_at_k`: majority vote over the answers of a prompt's first ``k`` samples (sample indices 0..k-1,
  which the same seeds make the same for every model): the most frequent answer wins, a tie goes to the answer
  seen first; samples without an answer (None) do not vote. The prompt counts as solved when a sample carrying
  the winning answer is correct; no answer at all counts as unsolved.
- :func:`answer_key`: what maj@k votes on. ``builtin:math`` rewards: the verifier's own extraction
  (:func:`rl_rollout.rewards.verifiers.extract_math_answer`, the last ``\\boxed{}`` else the last number),
  numbers compared by value (``0.5`` and ``1/2`` vote together); any other reward: the response text normalised
  (:func:`~rl_rollout.rewards.verifiers.normalize_text`: stripped, whitespace collapsed, casefolded).
- :func:`answer_key_of`: the same choice for a built scorer (``RewardConfig.build()``: a reward runner whose
  ``spec`` names the function, or several summed), for callers that hold the scorer and not its flags.
- :func:`dataset_metrics`: one dataset's summary: ``pass@k`` and ``maj@k`` for each k, ``reward_mean``,
  ``response_length`` (tokens), ``truncated`` (finish reason ``length``), ``correct`` (share of correct samples),
  ``prompts``, ``samples``.

A sample is correct when its reward is >= the threshold (``--correct_threshold``, default 1.0: a verifier's
full marks; pass 0.5 for rewards that are "more right than wrong").

The answer extraction imports the verifiers (:mod:`rl_rollout.rewards.verifiers`) on first use, so a config
module may import :func:`parse_ks` / :func:`check_ks` from here without loading the reward machinery.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any


def pass_at_k(n: int, c: int, k: int) -> float:
    """Chen et al.'s unbiased pass@k for ``c`` correct of ``n`` samples: the chance that ``k`` samples drawn
    without replacement from the ``n`` hold at least one correct one."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:  # every k-subset holds a correct sample
        return 1.0
    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))


def answer_key(reward_fn: str | None) -> Callable[[str], str | None]:
    """The function that maps a response to the answer maj@k votes on, for the ``--reward_fn`` spec."""
    if reward_fn and str(reward_fn).startswith("builtin:math"):
        return math_answer
    return text_answer


def answer_key_of(scorer: Any) -> Callable[[str], str | None]:
    """:func:`answer_key` for a built scorer: the first part (a summed scorer's ``fns``, or the scorer itself)
    whose ``spec`` is a ``builtin:math`` name picks :func:`math_answer`; otherwise the normalised text."""
    parts = list(getattr(scorer, "fns", None) or ([scorer] if scorer is not None else []))
    for part in parts:
        spec = getattr(part, "spec", None)
        if isinstance(spec, str) and spec.startswith("builtin:math"):
            return math_answer
    return text_answer


def text_answer(response: str) -> str | None:
    """The response text normalised (stripped, whitespace collapsed, casefolded): what maj@k votes on by default."""
    from rl_rollout.rewards.verifiers import normalize_text  # lazy: see the module doc

    return normalize_text(response)


def math_answer(response: str) -> str | None:
    """builtin:math's extracted answer; a number as its value, so equal numbers written apart vote together."""
    from rl_rollout.rewards.verifiers import extract_math_answer, normalize_text, parse_number  # lazy: module doc

    answer = extract_math_answer(response)
    if answer is None:
        return None
    number = parse_number(answer)
    return repr(number) if number is not None else normalize_text(answer)


def maj_at_k(answers: Sequence[str | None], correct: Sequence[bool], k: int) -> float:
    """1.0 when the majority answer of the first ``k`` samples is a correct one, else 0.0 (see the module doc)."""
    if not 1 <= k <= len(answers) or len(answers) != len(correct):
        raise ValueError(f"maj@{k} needs 1 <= k <= n and one verdict per answer, got {len(answers)} answers")
    votes: dict[str, int] = {}
    solved: dict[str, bool] = {}
    for a, ok in zip(answers[:k], correct[:k], strict=True):
        if a is None:
            continue
        votes[a] = votes.get(a, 0) + 1  # dicts keep first-seen order: max() breaks ties by it
        solved[a] = solved.get(a, False) or bool(ok)
    if not votes:
        return 0.0
    winner = max(votes, key=lambda a: votes[a])
    return float(solved[winner])


def check_ks(ks: Sequence[int], n: int, *, flag: str = "--pass_k", n_flag: str = "--n_samples_per_prompt") -> None:
    """Every k of ``--pass_k`` (``flag``) is in 1..n; ValueError naming the bad k and the fix."""
    for k in ks:
        if not 1 <= k <= n:
            raise ValueError(
                f"{flag} {k}: k must be in 1..{n} ({n_flag} {n}); lower k or raise {n_flag} to at least {k}"
            )


def dataset_metrics(
    rewards: Sequence[Sequence[float]],
    answers: Sequence[Sequence[str | None]],
    lengths: Sequence[int],
    truncated: Sequence[bool],
    ks: Sequence[int],
    threshold: float = 1.0,
) -> dict[str, float]:
    """One dataset's summary. ``rewards`` / ``answers``: one row per prompt, its n samples in index order;
    ``lengths`` / ``truncated``: one entry per sample."""
    if not rewards:
        raise ValueError("dataset_metrics needs at least one prompt")
    n = len(rewards[0])
    if any(len(r) != n for r in rewards) or len(answers) != len(rewards):
        raise ValueError("dataset_metrics: every prompt needs the same number of samples and answers")
    check_ks(ks, n)
    correct = [[r >= threshold for r in row] for row in rewards]
    p = len(rewards)
    out: dict[str, float] = {}
    for k in ks:
        out[f"pass@{k}"] = sum(pass_at_k(n, sum(row), k) for row in correct) / p
    for k in ks:
        out[f"maj@{k}"] = sum(maj_at_k(a, c, k) for a, c in zip(answers, correct, strict=True)) / p
    flat = [r for row in rewards for r in row]
    out["reward_mean"] = sum(flat) / len(flat)
    out["correct"] = sum(sum(row) for row in correct) / len(flat)
    out["response_length"] = sum(lengths) / len(lengths) if lengths else 0.0
    out["truncated"] = sum(truncated) / len(truncated) if truncated else 0.0
    out["prompts"] = float(p)
    out["samples"] = float(len(flat))
    return out


def parse_ks(text: str, *, flag: str = "--pass_k") -> tuple[int, ...]:
    """``--pass_k 1,4`` as ``(1, 4)``, sorted, no repeats; ValueError naming the bad entry (and ``flag``)."""
    ks = []
    for part in str(text).split(","):
        part = part.strip()
        try:
            ks.append(int(part))
        except ValueError:
            raise ValueError(f"{flag} {text!r}: {part!r} is not a whole number; write e.g. {flag} 1,4") from None
    if not ks:
        raise ValueError(f"{flag} {text!r}: give at least one k, e.g. {flag} 1")
    return tuple(sorted(set(ks)))


def metric_names(ks: Sequence[int]) -> list[str]:
    """The names :func:`dataset_metrics` returns for ``ks``, in its order."""
    return [
        *(f"pass@{k}" for k in ks),
        *(f"maj@{k}" for k in ks),
        "reward_mean",
        "correct",
        "response_length",
        "truncated",
        "prompts",
        "samples",
    ]


@dataclass
class EvalTally:
    """One dataset's scored samples, prompt by prompt (:meth:`add`), summarised by :meth:`metrics`; ``answer``
    maps a response text to what maj@k votes on (:func:`answer_key`, :func:`answer_key_of`)."""

    answer: Callable[[str], str | None]
    rewards: list[list[float]] = field(default_factory=list)
    answers: list[list[str | None]] = field(default_factory=list)
    lengths: list[int] = field(default_factory=list)
    truncated: list[bool] = field(default_factory=list)

    def add(self, rewards: Sequence[float], texts: Sequence[str], samples: Sequence[Any]) -> list[str | None]:
        """One prompt's n samples (``RolloutSample``-like: ``response_ids``, ``finish_reason``), their rewards
        and decoded texts, in sample-index order; returns their answers."""
        if not len(rewards) == len(texts) == len(samples):
            raise ValueError(f"EvalTally.add: {len(rewards)} rewards, {len(texts)} texts, {len(samples)} samples")
        answers = [self.answer(t) for t in texts]
        self.rewards.append([float(r) for r in rewards])
        self.answers.append(answers)
        self.lengths += [len(s.response_ids) for s in samples]
        self.truncated += [s.finish_reason == "length" for s in samples]
        return answers

    def metrics(self, ks: Sequence[int], threshold: float = 1.0) -> dict[str, float]:
        return dataset_metrics(self.rewards, self.answers, self.lengths, self.truncated, ks, threshold)


def sample_record(
    sample: Any,
    *,
    prompt: dict,
    prompt_index: int,
    sample_index: int,
    response: str,
    reward: float,
    answer: str | None,
    threshold: float,
    seed: int,
    **where: Any,
) -> dict:
    """One scored sample as a JSON-able dict: ``where`` first (rl eval: ``model``, ``dataset``; the loop:
    ``iteration``, ``weight_version``), then the prompt, the response and its verdict."""
    return {
        **where,
        "prompt_index": prompt_index,
        "sample_index": sample_index,
        "prompt": prompt.get("prompt"),
        "label": prompt.get("label"),
        "response": response,
        "reward": float(reward),
        "correct": float(reward) >= threshold,
        "answer": answer,
        "response_tokens": len(sample.response_ids),
        "finish_reason": sample.finish_reason,
        "seed": seed,
    }
