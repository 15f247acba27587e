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
import math
import types
import typing
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

from rl_algos._settings import field_meta as _meta
from rl_algos._settings import parse_settings
from rl_algos.losses.kinds import ISCorrection, parse_aggregation

if TYPE_CHECKING:  # annotations only: the configs import no torch (a command's flags are built without it)
    from torch import Tensor

    from rl_algos.losses.policy import PolicyLossOutput


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
            raise ValueError(
                f"importance-correction thresholds need 0 <= low <= high, got low={self.low}, high={self.high}"
            )


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

    def loss(
        self,
        logprobs_BT: Tensor,
        old_logprobs_BT: Tensor,
        advantages_BT: Tensor,
        mask_BT: Tensor,
        *,
        rollout_logprobs_BT: Tensor | None = None,
        global_tokens: float | Tensor | None = None,
        global_seqs: float | Tensor | None = None,
        dp_size: int = 1,
        norm_len: float | None = None,
    ) -> PolicyLossOutput:
        """:func:`rl_algos.losses.policy.policy_loss` with this variant's fields. Shapes ``[B, T]``."""
        # lazy: rl_algos.losses.policy imports torch; the config is built (rl ppo --help, its checks) without it
        from rl_algos.losses.policy import policy_loss

        c = self.is_correction
        return policy_loss(
            logprobs_BT,
            old_logprobs_BT,
            advantages_BT,
            mask_BT,
            clip_eps_low=self.clip_eps_low,
            clip_eps_high=self.clip_eps_high,
            dual_clip=self.dual_clip,
            ratio_type=self.ratio_type,
            rollout_logprobs_BT=rollout_logprobs_BT,
            correction=None if c is None else c.kind,
            correction_low=0.5 if c is None else c.low,
            correction_high=5.0 if c is None else c.high,
            aggregation=self.aggregation,
            global_tokens=global_tokens,
            global_seqs=global_seqs,
            dp_size=dp_size,
            norm_len=norm_len,
        )


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
        raise ValueError(
            f"policy loss {type!r} has no field(s) {', '.join(unknown)}; its fields: {', '.join(sorted(names))}"
        )
    return cls(**fields)


@dataclass(frozen=True)
class PolicyLossConfig:
    """The run's policy loss: a registered variant (``type``) with the fields every variant shares (clip, dual
    clip, aggregation, importance correction) and its own (``args``: ``KEY=VALUE`` texts), and the terms a loop
    adds to it (entropy bonus, MoE load-balancing loss). Built, it has built the variant once (so every field
    is checked); :meth:`variant` gives it with the correction in force."""

    type: str = field(
        default="ppo",
        metadata={
            **_meta(
                "a registered policy-loss variant (rl_algos.POLICY_LOSSES): ppo (token ratio), gspo (sequence ratio, "
                "arXiv:2507.18071); an extension module (--extension) registers more",
                "policy_loss_type",
                "actor.policy_loss_type",
            ),
            "names": lambda: sorted(POLICY_LOSSES),
        },
    )
    args: tuple[str, ...] = field(
        default=(),
        metadata=_meta(
            "KEY=VALUE settings of the variant's own fields beyond the shared clip / dual clip / aggregation / "
            "correction ones (an extension's variant)",
            "policy_loss_args",
        ),
    )
    eps_clip: float = field(default=0.2, metadata=_meta("PPO clip range (low side)", None, "actor.eps_clip"))
    eps_clip_high: float | None = field(
        default=None, metadata=_meta("clip-higher (DAPO) upper range; default: eps_clip")
    )
    dual_clip: float | None = field(
        default=None, metadata=_meta("dual-clip PPO constant (> 1)", None, "actor.dual_clip")
    )
    agg_mode: str = field(
        default="token-mean",
        metadata=_meta(
            "token-mean | seq-mean-token-mean | seq-mean-token-sum | seq-mean-token-sum-norm (Dr. GRPO: divides by "
            "generate_max_len)",
            "loss_agg_mode",
        ),
    )
    is_correction: str | None = field(
        default=None,
        metadata=_meta(
            "importance correction for the engine's sampling: tis | icepop | seq-mask-tis (uses rollout log-probs)",
            None,
            "algo.advantage.is_correction_type",
        ),
    )
    is_correction_threshold: tuple[float, float] = field(
        default=(0.5, 5.0),
        metadata=_meta(
            "LOW HIGH bounds of the importance weights (clamp for tis, keep-range for icepop / seq-mask-tis)",
            None,
            "algo.advantage.is_correction_threshold",
        ),
    )
    entropy_coef: float | None = field(
        default=None,
        metadata=_meta(
            "entropy bonus: the policy loss minus COEF x the token-mean entropy of the policy; any value, 0 included, "
            "also logs rl/entropy (OpenRLHF's semantics)",
            "entropy_loss_coef",
            "actor.entropy_coef",
        ),
    )
    aux_loss_coef: float = field(
        default=0.0,
        metadata=_meta(
            "mixture-of-experts policy: + coef x the router's load-balancing loss in its loss, per micro-batch weighted "
            "by its share of the samples, as OpenRLHF's actor (0: off; the critic's value head is left without it); a "
            "model without experts is refused",
            None,
            "actor.aux_loss_coef",
        ),
    )

    def __post_init__(self) -> None:
        if self.entropy_coef is not None and not math.isfinite(self.entropy_coef):
            raise ValueError(
                f"entropy_loss_coef (--entropy_loss_coef) must be a finite number, got {self.entropy_coef}"
            )
        if not self.aux_loss_coef >= 0 or not math.isfinite(self.aux_loss_coef):
            raise ValueError(f"aux_loss_coef (--aux_loss_coef) must be a finite number >= 0, got {self.aux_loss_coef}")
        object.__setattr__(self, "args", tuple(self.args))
        object.__setattr__(self, "is_correction_threshold", tuple(self.is_correction_threshold))
        try:
            self.variant()
        except ValueError as e:
            raise ValueError(
                f"{e} (--policy_loss_type, --eps_clip, --eps_clip_high, --dual_clip, --loss_agg_mode, "
                f"--is_correction, --is_correction_threshold, --policy_loss_args)"
            ) from None

    def variant(self, correction: str | None = None) -> PPOLossConfig:
        """The variant these fields describe; ``correction``: the importance correction in force when
        ``is_correction`` is unset (a run that trains on older policies' samples asks for ``tis``)."""
        kind = self.is_correction or correction
        corr = None if kind is None else ISCorrectionConfig(kind, *self.is_correction_threshold)
        return policy_loss_config(
            self.type,
            clip_eps_low=self.eps_clip,
            clip_eps_high=self.eps_clip_high,
            dual_clip=self.dual_clip,
            aggregation=self.agg_mode,
            is_correction=corr,
            **policy_loss_settings(self.type, self.args),
        )
