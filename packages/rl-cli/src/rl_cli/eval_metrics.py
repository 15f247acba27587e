"""``rl eval``'s numbers, pure (no torch, no model): pass@k, maj@k and one dataset's metrics from its scored samples.

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
- :func:`dataset_metrics`: one dataset's summary: ``pass@k`` and ``maj@k`` for each k, ``reward_mean``,
  ``response_length`` (tokens), ``truncated`` (finish reason ``length``), ``correct`` (share of correct samples),
  ``prompts``, ``samples``.

A sample is correct when its reward is >= the threshold (``--correct_threshold``, default 1.0: a verifier's
full marks; pass 0.5 for rewards that are "more right than wrong").
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

from rl_rollout.rewards.verifiers import extract_math_answer, normalize_text, parse_number


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
    return normalize_text


def math_answer(response: str) -> str | None:
    """builtin:math's extracted answer; a number as its value, so equal numbers written apart vote together."""
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


def check_ks(ks: Sequence[int], n: int) -> None:
    """Every k of ``--pass_k`` is in 1..n; ValueError naming the bad k and the fix."""
    for k in ks:
        if not 1 <= k <= n:
            raise ValueError(
                f"--pass_k {k}: k must be in 1..{n} (--n_samples_per_prompt {n}); lower k or raise "
                f"--n_samples_per_prompt to at least {k}"
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


def parse_ks(text: str) -> tuple[int, ...]:
    """``--pass_k 1,4`` as ``(1, 4)``, sorted, no repeats; ValueError naming the bad entry."""
    ks = []
    for part in str(text).split(","):
        part = part.strip()
        try:
            ks.append(int(part))
        except ValueError:
            raise ValueError(f"--pass_k {text!r}: {part!r} is not a whole number; write e.g. --pass_k 1,4") from None
    if not ks:
        raise ValueError(f"--pass_k {text!r}: give at least one k, e.g. --pass_k 1")
    return tuple(sorted(set(ks)))
