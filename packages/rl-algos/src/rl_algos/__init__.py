"""rl_algos: the math of RL for LLMs in pure torch.

Advantages (:mod:`rl_algos.advantages`), KL (:mod:`rl_algos.kl`), distillation divergences
(:mod:`rl_algos.distill`), losses (:mod:`rl_algos.losses`), reward shaping (:mod:`rl_algos.shaping`) and
dynamic-sampling filters (:mod:`rl_algos.filters`). Every function takes padded
``[batch, seq]`` tensors with a 0/1 mask, is pure (no global state, no
distributed calls) and imports nothing but torch.
"""

from rl_algos import advantages, distill, filters, kl, losses, shaping
from rl_algos._masked import masked_mean, masked_sum
from rl_algos._settings import parse_settings
from rl_algos.advantage_config import AdvantageConfig
from rl_algos.advantages import (
    ESTIMATORS,
    Advantages,
    EstimatorSpec,
    compute_advantages,
    estimator_names,
    get_estimator,
    masked_whiten,
)
from rl_algos.distill import distill_advantages, forward_kl, generalized_jsd, reverse_kl, topk_forward_kl
from rl_algos.filters import GroupFilterResult, filter_groups
from rl_algos.kl import AdaptiveKLController, FixedKLController, KLConfig, KLEstimator, approx_kl
from rl_algos.losses import (
    POLICY_LOSSES,
    GSPOLossConfig,
    ISCorrectionConfig,
    LogprobsEntropy,
    PolicyLossConfig,
    PPOLossConfig,
    aggregate_loss,
    dpo_loss,
    entropy_from_logits,
    kto_loss,
    kto_reference_kl,
    logprobs_and_entropy_from_logits,
    logprobs_from_hidden,
    logprobs_from_logits,
    pairwise_loss,
    policy_loss,
    policy_loss_config,
    policy_loss_params,
    policy_loss_settings,
    sft_loss,
    value_loss,
    weighted_logprob_sum_from_hidden,
)
from rl_algos.shaping import ShapingConfig, clip_rewards, kl_penalized_rewards, overlong_penalty, stop_properly_penalty

__version__ = "0.8.0"

__all__ = [
    "AdvantageConfig",
    "POLICY_LOSSES",
    "PolicyLossConfig",
    "EstimatorSpec",
    "GSPOLossConfig",
    "ISCorrectionConfig",
    "PPOLossConfig",
    "estimator_names",
    "policy_loss_config",
    "policy_loss_params",
    "policy_loss_settings",
    "parse_settings",
    "KLConfig",
    "KLEstimator",
    "ShapingConfig",
    "ESTIMATORS",
    "AdaptiveKLController",
    "Advantages",
    "FixedKLController",
    "GroupFilterResult",
    "advantages",
    "distill",
    "distill_advantages",
    "forward_kl",
    "generalized_jsd",
    "reverse_kl",
    "topk_forward_kl",
    "aggregate_loss",
    "approx_kl",
    "clip_rewards",
    "compute_advantages",
    "dpo_loss",
    "entropy_from_logits",
    "filter_groups",
    "filters",
    "get_estimator",
    "kl",
    "kl_penalized_rewards",
    "kto_loss",
    "kto_reference_kl",
    "LogprobsEntropy",
    "logprobs_and_entropy_from_logits",
    "logprobs_from_hidden",
    "logprobs_from_logits",
    "losses",
    "masked_mean",
    "masked_sum",
    "masked_whiten",
    "overlong_penalty",
    "pairwise_loss",
    "policy_loss",
    "sft_loss",
    "shaping",
    "stop_properly_penalty",
    "value_loss",
    "weighted_logprob_sum_from_hidden",
]
