"""Evaluation numbers (rl_rollout.evaluation: what rl eval and the RL loop's eval pass both report): Chen et al.'s
unbiased pass@k against a brute-force count of k-subsets, its edge cases, maj@k's votes and ties, the answer extraction maj@k votes on, a dataset's summary."""

from __future__ import annotations

import itertools
import math

import pytest

from rl_rollout.evaluation import answer_key, check_ks, dataset_metrics, maj_at_k, math_answer, parse_ks, pass_at_k


def brute_pass_at_k(n: int, c: int, k: int) -> float:
    """The share of the k-subsets of n samples (c of them correct) that hold a correct sample."""
    samples = [True] * c + [False] * (n - c)
    subsets = list(itertools.combinations(range(n), k))
    return sum(any(samples[i] for i in s) for s in subsets) / len(subsets)


@pytest.mark.parametrize("n", range(1, 9))
def test_pass_at_k_equals_brute_force_enumeration(n):
    for c in range(n + 1):
        for k in range(1, n + 1):
            assert abs(pass_at_k(n, c, k) - brute_pass_at_k(n, c, k)) <= 1e-12, (n, c, k)
            assert abs(pass_at_k(n, c, k) - (1 - math.comb(n - c, k) / math.comb(n, k))) <= 1e-12


def test_pass_at_k_edge_cases():
    assert pass_at_k(10, 0, 1) == 0.0 and pass_at_k(10, 0, 10) == 0.0  # c = 0: never
    assert pass_at_k(10, 10, 1) == 1.0 and pass_at_k(10, 10, 10) == 1.0  # c = n: always
    assert pass_at_k(10, 1, 10) == 1.0  # k = n: any correct sample is drawn
    assert pass_at_k(10, 3, 1) == pytest.approx(0.3, abs=1e-12)  # pass@1 is c / n
    # large n: no factorial overflow, and still in [0, 1]
    assert 0.0 < pass_at_k(10_000, 1, 100) < 1.0
    assert pass_at_k(10_000, 1, 100) == pytest.approx(100 / 10_000, abs=1e-12)


@pytest.mark.parametrize("bad", [(4, 5, 1), (4, -1, 1), (4, 2, 0), (4, 2, 5)])
def test_pass_at_k_refuses_impossible_counts(bad):
    with pytest.raises(ValueError, match="pass@k needs"):
        pass_at_k(*bad)


def test_maj_at_k_votes_on_the_first_k_answers():
    answers = ["3", "4", "4", "3", "3"]
    correct = [True, False, False, True, True]
    assert maj_at_k(answers, correct, 3) == 0.0  # "4" twice among the first 3
    assert maj_at_k(answers, correct, 5) == 1.0  # "3" three times among 5
    assert maj_at_k(answers, correct, 2) == 1.0  # a tie: the answer seen first ("3") wins
    assert maj_at_k(["4", "3"], [False, True], 2) == 0.0  # a tie, "4" first
    assert maj_at_k([None, None, "4"], [False, False, False], 3) == 0.0  # no answer does not vote
    assert maj_at_k([None, None], [False, False], 2) == 0.0  # nothing to vote on: unsolved
    with pytest.raises(ValueError):
        maj_at_k(["1"], [True], 2)


def test_answer_key_uses_the_math_verifiers_extraction():
    key = answer_key("builtin:math")
    assert key is math_answer
    assert key("so \\boxed{1/2}") == key("the answer is 0.5") == repr(0.5)  # numbers by value
    assert key("no number here") is None
    text = answer_key("builtin:exact_match")
    assert text("  Hello   World ") == text("hello world")
    assert answer_key(None)("A") == "a"


def test_dataset_metrics_summary():
    rewards = [[1.0, 0.0, 0.0, 1.0], [0.0, 0.0, 0.0, 0.0]]
    answers = [["2", "5", "5", "2"], [None, "7", "7", "8"]]
    m = dataset_metrics(rewards, answers, [3, 4, 5, 8, 2, 2, 2, 8], [False] * 6 + [True, True], (1, 4))
    assert m["pass@1"] == pytest.approx(0.25)
    assert m["pass@4"] == pytest.approx(0.5)
    assert m["maj@1"] == 0.5 and m["maj@4"] == 0.5  # prompt 0: "2" first, tied with "5"; prompt 1: wrong
    assert m["reward_mean"] == pytest.approx(0.25) and m["correct"] == pytest.approx(0.25)
    assert m["response_length"] == pytest.approx(34 / 8) and m["truncated"] == pytest.approx(0.25)
    assert m["prompts"] == 2 and m["samples"] == 8
    # a partial reward counts at a lower threshold
    half = dataset_metrics([[0.6, 0.2]], [["a", "b"]], [1, 1], [False, False], (1,), threshold=0.5)
    assert half["pass@1"] == pytest.approx(0.5)


def test_k_parsing_and_range():
    assert parse_ks("4, 1,4") == (1, 4)
    with pytest.raises(ValueError, match="not a whole number"):
        parse_ks("1,x")
    with pytest.raises(ValueError, match="--pass_k 8: k must be in 1..4"):
        check_ks((1, 8), 4)


class _Sample:
    def __init__(self, n_tokens, finish_reason="stop"):
        self.response_ids, self.finish_reason = list(range(n_tokens)), finish_reason


def test_tally_and_records_are_the_dataset_metrics_of_the_samples_added():
    from rl_rollout.evaluation import EvalTally, answer_key_of, metric_names, sample_record, text_answer

    tally = EvalTally(answer_key("builtin:math"))
    assert tally.add([1.0, 0.0], ["\\boxed{2}", "3"], [_Sample(4), _Sample(8, "length")]) == [repr(2.0), repr(3.0)]
    assert tally.add([0.0, 0.0], ["x", "7"], [_Sample(2), _Sample(2)]) == [None, repr(7.0)]
    m = tally.metrics((1, 2))
    assert list(m) == metric_names((1, 2))
    assert m == dataset_metrics([[1.0, 0.0], [0.0, 0.0]], [[repr(2.0), repr(3.0)], [None, repr(7.0)]],
                                [4, 8, 2, 2], [False, True, False, False], (1, 2))
    assert m["pass@2"] == 0.5 and m["maj@1"] == 0.5 and m["truncated"] == 0.25 and m["response_length"] == 4.0
    with pytest.raises(ValueError, match="2 rewards, 1 texts"):
        tally.add([1.0, 0.0], ["a"], [_Sample(1)])
    row = sample_record(_Sample(3, "length"), prompt={"prompt": "p", "label": "2"}, prompt_index=5, sample_index=1,
                        response="r", reward=0.5, answer="a", threshold=0.5, seed=9, iteration=2)
    assert list(row)[0] == "iteration" and row["correct"] is True and row["response_tokens"] == 3
    assert row["finish_reason"] == "length" and row["label"] == "2" and row["seed"] == 9

    class Runner:
        spec = "builtin:math_verify"

    class Summed:
        fns = [object(), Runner()]

    assert answer_key_of(Summed()) is math_answer and answer_key_of(Runner()) is math_answer
    assert answer_key_of(None) is text_answer and answer_key_of(object()) is text_answer


def test_ks_errors_name_the_callers_flags():
    with pytest.raises(ValueError, match=r"--eval_pass_k 8: k must be in 1..4 \(--eval_n_samples_per_prompt 4\)"):
        check_ks((8,), 4, flag="--eval_pass_k", n_flag="--eval_n_samples_per_prompt")
    with pytest.raises(ValueError, match=r"--eval_pass_k 'x'.*e.g. --eval_pass_k 1,4"):
        parse_ks("x", flag="--eval_pass_k")


def test_rl_cli_keeps_the_old_import_path():
    from rl_rollout import evaluation

    rl_cli_metrics = pytest.importorskip("rl_cli.eval_metrics")
    assert rl_cli_metrics.pass_at_k is evaluation.pass_at_k and rl_cli_metrics.dataset_metrics is evaluation.dataset_metrics
