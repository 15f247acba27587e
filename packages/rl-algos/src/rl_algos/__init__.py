"""rl_algos: the math of RL for LLMs in pure torch.

Advantages (:mod:`rl_algos.advantages`), KL (:mod:`rl_algos.kl`), distillation (:mod:`rl_algos.distill`), losses
(:mod:`rl_algos.losses`), reward shaping (:mod:`rl_algos.shaping`) and
dynamic-sampling filters (:mod:`rl_algos.filters`). Every function takes padded
``[batch, seq]`` tensors with a 0/1 mask, is pure (no global state, no
distributed calls) and imports nothing but torch.

The names below load on first use (PEP 562): the settings (:class:`AdvantageConfig`, :class:`KLConfig`,
:class:`ShapingConfig`, :class:`PolicyLossConfig`) and the registries' names import no torch, so a command builds
its flags from them without it; the math does.
"""

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rl_algos import advantages, distill, filters, kl, losses, shaping
    from rl_algos._masked import masked_mean, masked_sum
    from rl_algos._settings import parse_settings
    from rl_algos.advantage_config import AdvantageConfig
    from rl_algos.advantages import Advantages, compute_advantages, masked_whiten
    from rl_algos.distill import (
        distill_advantages,
        forward_kl,
        generalized_jsd,
        reverse_kl,
        topk_forward_kl,
        topk_generalized_jsd,
    )
    from rl_algos.estimators import ESTIMATORS, EstimatorSpec, estimator_names, get_estimator
    from rl_algos.filters import GroupFilterResult, filter_groups
    from rl_algos.kl import approx_kl
    from rl_algos.kl_config import AdaptiveKLController, FixedKLController, KLConfig, KLEstimator
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
    from rl_algos.shaping import clip_rewards, kl_penalized_rewards, overlong_penalty, stop_properly_penalty
    from rl_algos.shaping_config import ShapingConfig

# name -> the submodule that defines it, imported on first use
_LAZY = {
    **dict.fromkeys(("masked_mean", "masked_sum"), "rl_algos._masked"),
    "parse_settings": "rl_algos._settings",
    "AdvantageConfig": "rl_algos.advantage_config",
    **dict.fromkeys(("Advantages", "compute_advantages", "masked_whiten"), "rl_algos.advantages"),
    **dict.fromkeys(("ESTIMATORS", "EstimatorSpec", "estimator_names", "get_estimator"), "rl_algos.estimators"),
    **dict.fromkeys(
        (
            "distill_advantages",
            "forward_kl",
            "generalized_jsd",
            "reverse_kl",
            "topk_forward_kl",
            "topk_generalized_jsd",
        ),
        "rl_algos.distill",
    ),
    **dict.fromkeys(("GroupFilterResult", "filter_groups"), "rl_algos.filters"),
    "approx_kl": "rl_algos.kl",
    **dict.fromkeys(("AdaptiveKLController", "FixedKLController", "KLConfig", "KLEstimator"), "rl_algos.kl_config"),
    **dict.fromkeys(
        (
            "POLICY_LOSSES",
            "GSPOLossConfig",
            "ISCorrectionConfig",
            "LogprobsEntropy",
            "PolicyLossConfig",
            "PPOLossConfig",
            "aggregate_loss",
            "dpo_loss",
            "entropy_from_logits",
            "kto_loss",
            "kto_reference_kl",
            "logprobs_and_entropy_from_logits",
            "logprobs_from_hidden",
            "logprobs_from_logits",
            "pairwise_loss",
            "policy_loss",
            "policy_loss_config",
            "policy_loss_params",
            "policy_loss_settings",
            "sft_loss",
            "value_loss",
            "weighted_logprob_sum_from_hidden",
        ),
        "rl_algos.losses",
    ),
    **dict.fromkeys(
        ("clip_rewards", "kl_penalized_rewards", "overlong_penalty", "stop_properly_penalty"), "rl_algos.shaping"
    ),
    "ShapingConfig": "rl_algos.shaping_config",
}


_SUBMODULES = (
    "advantages",
    "distill",
    "filters",
    "kl",
    "losses",
    "shaping",
)  # `rl_algos.kl.approx_kl` without an import


def __getattr__(name: str) -> Any:
    if name in _SUBMODULES:
        return importlib.import_module(f"rl_algos.{name}")
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value  # the next access skips this function
        return value
    raise AttributeError(f"module 'rl_algos' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *_LAZY, *_SUBMODULES])


__version__ = "0.9.0"

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
    "topk_generalized_jsd",
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
