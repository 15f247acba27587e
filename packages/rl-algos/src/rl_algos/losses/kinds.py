"""The names a policy-loss config chooses among, as enums, and no torch (a command's flags and checks read them
without it): how a loss is averaged (:class:`LossAggregation`, :func:`parse_aggregation`; used by
:mod:`rl_algos.losses.aggregate`) and the rollout-vs-trainer importance correction (:class:`ISCorrection`; used by
:mod:`rl_algos.losses.policy`). Both modules re-export them.
"""

from __future__ import annotations

import enum


class LossAggregation(str, enum.Enum):
    TOKEN_MEAN = "token-mean"
    SEQ_MEAN_TOKEN_MEAN = "seq-mean-token-mean"
    SEQ_MEAN_TOKEN_SUM = "seq-mean-token-sum"
    SEQ_MEAN_TOKEN_SUM_NORM = "seq-mean-token-sum-norm"


def parse_aggregation(mode: str) -> LossAggregation:
    try:
        return LossAggregation(mode)
    except ValueError:
        valid = ", ".join(m.value for m in LossAggregation)
        raise ValueError(f"unknown loss aggregation {mode!r}; valid: {valid}") from None


class ISCorrection(str, enum.Enum):
    TIS = "tis"
    ICEPOP = "icepop"
    SEQ_MASK_TIS = "seq-mask-tis"
