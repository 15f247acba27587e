"""Losses: policy (PPO/GSPO), value, SFT, preference (DPO, KTO, pairwise), and the
log-prob / entropy kernels they consume."""

from rl_algos.losses.aggregate import LossAggregation, aggregate_loss
from rl_algos.losses.fused_head import logprobs_from_hidden, weighted_logprob_sum_from_hidden
from rl_algos.losses.logits import (
    LogprobsEntropy,
    entropy_from_logits,
    logprobs_and_entropy_from_logits,
    logprobs_from_logits,
)
from rl_algos.losses.policy import (
    ISCorrection,
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
