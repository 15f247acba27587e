"""``rl eval``'s numbers: moved to :mod:`rl_rollout.evaluation` (one code path with the RL loop's eval pass);
this module keeps the old import path."""

from __future__ import annotations

from rl_rollout.evaluation import (
    EvalTally,
    answer_key,
    answer_key_of,
    check_ks,
    dataset_metrics,
    maj_at_k,
    math_answer,
    metric_names,
    parse_ks,
    pass_at_k,
    sample_record,
    text_answer,
)

__all__ = [
    "EvalTally",
    "answer_key",
    "answer_key_of",
    "check_ks",
    "dataset_metrics",
    "maj_at_k",
    "math_answer",
    "metric_names",
    "parse_ks",
    "pass_at_k",
    "sample_record",
    "text_answer",
]
