"""Losses: policy (PPO/GSPO), value, SFT, preference (DPO, KTO, pairwise), and the
log-prob / entropy kernels they consume.

The names below load on first use (PEP 562): the loss configs (:mod:`rl_algos.losses.variants`) and their enums
(:mod:`rl_algos.losses.kinds`) import no torch; the losses do."""

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rl_algos.losses.aggregate import aggregate_loss
    from rl_algos.losses.fused_head import logprobs_from_hidden, weighted_logprob_sum_from_hidden
    from rl_algos.losses.kinds import ISCorrection, LossAggregation
    from rl_algos.losses.logits import (
        LogprobsEntropy,
        entropy_from_logits,
        logprobs_and_entropy_from_logits,
        logprobs_from_logits,
    )
    from rl_algos.losses.policy import (
        PolicyLossOutput,
        RatioType,
        ValueLossOutput,
        policy_loss,
        value_loss,
    )
    from rl_algos.losses.supervised import (
        DPOOutput,
        KTOOutput,
        PairwiseKind,
        dpo_loss,
        kto_loss,
        kto_reference_kl,
        pairwise_loss,
        sft_loss,
    )
    from rl_algos.losses.variants import (
        POLICY_LOSSES,
        GSPOLossConfig,
        ISCorrectionConfig,
        PolicyLossConfig,
        PPOLossConfig,
        policy_loss_config,
        policy_loss_params,
        policy_loss_settings,
    )

# name -> the submodule that defines it, imported on first use
_LAZY = {
    "aggregate_loss": "rl_algos.losses.aggregate",
    **dict.fromkeys(("logprobs_from_hidden", "weighted_logprob_sum_from_hidden"), "rl_algos.losses.fused_head"),
    **dict.fromkeys(
        ("LogprobsEntropy", "entropy_from_logits", "logprobs_and_entropy_from_logits", "logprobs_from_logits"),
        "rl_algos.losses.logits",
    ),
    **dict.fromkeys(("ISCorrection", "LossAggregation"), "rl_algos.losses.kinds"),
    **dict.fromkeys(
        ("PolicyLossOutput", "RatioType", "ValueLossOutput", "policy_loss", "value_loss"), "rl_algos.losses.policy"
    ),
    **dict.fromkeys(
        (
            "DPOOutput",
            "KTOOutput",
            "PairwiseKind",
            "dpo_loss",
            "kto_loss",
            "kto_reference_kl",
            "pairwise_loss",
            "sft_loss",
        ),
        "rl_algos.losses.supervised",
    ),
    **dict.fromkeys(
        (
            "POLICY_LOSSES",
            "GSPOLossConfig",
            "ISCorrectionConfig",
            "PolicyLossConfig",
            "PPOLossConfig",
            "policy_loss_config",
            "policy_loss_params",
            "policy_loss_settings",
        ),
        "rl_algos.losses.variants",
    ),
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value  # the next access skips this function
        return value
    raise AttributeError(f"module 'rl_algos.losses' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *_LAZY])


__all__ = [
    "POLICY_LOSSES",
    "GSPOLossConfig",
    "ISCorrectionConfig",
    "PolicyLossConfig",
    "PPOLossConfig",
    "policy_loss_config",
    "policy_loss_params",
    "policy_loss_settings",
    "DPOOutput",
    "ISCorrection",
    "KTOOutput",
    "LossAggregation",
    "PairwiseKind",
    "PolicyLossOutput",
    "RatioType",
    "ValueLossOutput",
    "aggregate_loss",
    "dpo_loss",
    "entropy_from_logits",
    "kto_loss",
    "kto_reference_kl",
    "LogprobsEntropy",
    "logprobs_and_entropy_from_logits",
    "logprobs_from_hidden",
    "logprobs_from_logits",
    "pairwise_loss",
    "policy_loss",
    "sft_loss",
    "value_loss",
    "weighted_logprob_sum_from_hidden",
]
