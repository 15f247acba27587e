"""Policy-loss variants as typed configs, chosen once by a ``type`` name from a registry.

Each variant is a frozen dataclass holding its own parameters, validated when it is
built, with a ``loss(...)`` method over the tensors of one micro-batch. A loop picks
the variant once at setup (:func:`policy_loss_config`) and calls ``cfg.loss(...)``
in its hot path, never an if/elif on names (the prime-rl habit)::

    cfg = policy_loss_config("gspo", clip_eps_low=3e-4, clip_eps_high=4e-4,
                             is_correction=ISCorrectionConfig("tis", 0.5, 5.0))
    out = cfg.loss(logprobs_BT, old_logprobs_BT, advantages_BT, mask_BT,
                   rollout_logprobs_BT=rollout_BT, global_tokens=n_tokens)

========  ===================================================================  =====================
``ppo``   token ratio, clip-higher ``[1 - eps_low, 1 + eps_high]``, dual clip  arXiv:1707.06347,
                                                                               2503.14476, 1912.09729
``gspo``  the sequence's geometric-mean ratio shared by its tokens             arXiv:2507.18071
========  ===================================================================  =====================

Both take an optional rollout-vs-trainer importance correction
(:class:`ISCorrectionConfig`: ``tis`` | ``icepop`` | ``seq-mask-tis`` with its
thresholds). Adding a variant: one config class with a ``type`` and a ``loss``
method, ``POLICY_LOSSES.register(cls)``, and its test; its own fields beyond the shared ones are set
by ``KEY=VALUE`` settings (:func:`policy_loss_settings`; rl ppo's ``--policy_loss_args``), so a
variant in a module outside the packages runs from the command line unchanged.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from rl_algos._settings import parse_settings
from rl_algos.losses.aggregate import parse_aggregation
from rl_algos.losses.policy import ISCorrection, PolicyLossOutput, policy_loss

Tensor = torch.Tensor


@dataclass(frozen=True)
class ISCorrectionConfig:
    """Importance correction of the engine's sampling distribution (``w = exp(old_logp - rollout_logp)``):
    ``kind`` tis | icepop | seq-mask-tis, weights kept or clamped to ``[low, high]``."""

    kind: str = "tis"
    low: float = 0.5
    high: float = 5.0

    def __post_init__(self) -> None:
        valid = [e.value for e in ISCorrection]
        if self.kind not in valid:
            raise ValueError(f"unknown importance correction {self.kind!r}; valid: {', '.join(valid)}")
        if not 0 <= self.low <= self.high:
            raise ValueError(f"importance-correction thresholds need 0 <= low <= high, got low={self.low}, "
                             f"high={self.high}")


@dataclass(frozen=True)
class PPOLossConfig:
    """PPO clip (token ratio) with clip-higher and dual clip."""

    type: ClassVar[str] = "ppo"
    ratio_type: ClassVar[str] = "token"
    clip_eps_low: float = 0.2
    clip_eps_high: float | None = None  # None: clip_eps_low
    dual_clip: float | None = None  # > 1, applied where the advantage is negative
    aggregation: str = "token-mean"
    is_correction: ISCorrectionConfig | None = None

    def __post_init__(self) -> None:
        parse_aggregation(self.aggregation)
        high = self.clip_eps_low if self.clip_eps_high is None else self.clip_eps_high
        if self.clip_eps_low < 0 or high < 0:
            raise ValueError(f"{self.type}: clip eps must be >= 0, got low={self.clip_eps_low}, high={high}")
        if self.dual_clip is not None and self.dual_clip <= 1.0:
            raise ValueError(f"{self.type}: dual_clip must be > 1 (e.g. 3.0), got {self.dual_clip}")

    @property
    def needs_rollout_logprobs(self) -> bool:
        return self.is_correction is not None

    def loss(self, logprobs_BT: Tensor, old_logprobs_BT: Tensor, advantages_BT: Tensor, mask_BT: Tensor, *,
             rollout_logprobs_BT: Tensor | None = None, global_tokens: float | Tensor | None = None,
             global_seqs: float | Tensor | None = None, dp_size: int = 1,
             norm_len: float | None = None) -> PolicyLossOutput:
        """:func:`rl_algos.losses.policy.policy_loss` with this variant's fields. Shapes ``[B, T]``."""
        c = self.is_correction
        return policy_loss(
            logprobs_BT, old_logprobs_BT, advantages_BT, mask_BT, clip_eps_low=self.clip_eps_low,
            clip_eps_high=self.clip_eps_high, dual_clip=self.dual_clip, ratio_type=self.ratio_type,
            rollout_logprobs_BT=rollout_logprobs_BT, correction=None if c is None else c.kind,
            correction_low=0.5 if c is None else c.low, correction_high=5.0 if c is None else c.high,
            aggregation=self.aggregation, global_tokens=global_tokens, global_seqs=global_seqs, dp_size=dp_size,
            norm_len=norm_len)


@dataclass(frozen=True)
class GSPOLossConfig(PPOLossConfig):
    """GSPO: the clipped ratio is the sequence's geometric mean (Zheng et al. 2025, arXiv:2507.18071).
    The paper clips at 3e-4 / 4e-4; the defaults here are PPO's, as OpenRLHF's ``--policy_loss_type gspo``."""

    type: ClassVar[str] = "gspo"
    ratio_type: ClassVar[str] = "sequence"


class _LossRegistry(dict[str, type]):
    """``type`` name -> config class; refuses duplicates and lists valid names on a miss."""

    def register(self, cls: Any) -> Any:
        if cls.type in self:
            raise ValueError(f"policy loss {cls.type!r} is already registered")
        self[cls.type] = cls
        return cls

    def __missing__(self, name: str):
        raise ValueError(f"unknown policy loss type {name!r}; valid: {', '.join(sorted(self))}")


POLICY_LOSSES = _LossRegistry()
POLICY_LOSSES.register(PPOLossConfig)
POLICY_LOSSES.register(GSPOLossConfig)


def policy_loss_params(type: str) -> dict[str, type]:
    """The variant's own fields (name -> type) beyond :class:`PPOLossConfig`'s shared ones: what a run sets with
    ``KEY=VALUE`` settings (:func:`policy_loss_settings`)."""
    import types
    import typing

    cls = POLICY_LOSSES[type]
    shared = {f.name for f in dataclasses.fields(PPOLossConfig)}
    hints = typing.get_type_hints(cls)
    out = {}
    for f in dataclasses.fields(cls):
        if f.name not in shared:
            tp = hints[f.name]
            args = [a for a in typing.get_args(tp) if a is not types.NoneType]
            out[f.name] = args[0] if typing.get_origin(tp) is not None and len(args) == 1 else tp
    return out


def policy_loss_settings(type: str, items) -> dict:
    """``KEY=VALUE`` texts -> the variant's own fields, typed (:func:`policy_loss_params`)."""
    return parse_settings(items, policy_loss_params(type), f"policy loss {type!r}")


def policy_loss_config(type: str = "ppo", **fields) -> PPOLossConfig:
    """Build the variant called ``type`` from its fields; an unknown type or field fails naming the valid ones."""
    cls = POLICY_LOSSES[type]
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(fields) - names)
    if unknown:
        raise ValueError(f"policy loss {type!r} has no field(s) {', '.join(unknown)}; its fields: "
                         f"{', '.join(sorted(names))}")
    return cls(**fields)
