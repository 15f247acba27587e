"""The critic's own optimizer settings (OpenRLHF's ``--critic.*``): the :class:`CriticOptimizerConfig` node of
:class:`~rl_core.trainers.ppo_config.PPOConfig` (``critic_optimizer``). An unset field is the actor's
(:class:`~rl_core.strategy.StrategyConfig`'s, ours and OpenRLHF's flat v0.10.1 dialect, where one --adam_betas /
--l2 / --lr_scheduler ... served both); the optimizer itself is adam unless given, as OpenRLHF's
``--critic.optim``."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from rl_core.strategy_config import MUON_DEFAULTS, SCHEDULES, check_optimizer
from rl_rollout.config_fields import check_numbers, meta


@dataclass(frozen=True)
class CriticOptimizerConfig:
    """The critic's optimizer, schedule and clipping, as :class:`~rl_core.strategy.StrategyConfig` field names."""

    learning_rate: float | None = field(
        default=None,
        metadata=meta(
            "critic learning rate (default: --learning_rate)",
            flags=("critic_learning_rate",),
            openrlhf=("critic.adam.lr",),
        ),
    )
    adam_betas: tuple[float, float] | None = field(
        default=None,
        metadata=meta(
            "critic AdamW betas B1 B2 (default: --adam_betas)",
            flags=("critic_adam_betas",),
            openrlhf=("critic.adam.betas",),
        ),
    )
    adam_eps: float | None = field(
        default=None,
        metadata=meta(
            "critic AdamW epsilon (default: --adam_eps)", flags=("critic_adam_eps",), openrlhf=("critic.adam.eps",)
        ),
    )
    weight_decay: float | None = field(
        default=None,
        metadata=meta(
            "critic AdamW weight decay (default: --l2)",
            flags=("critic_weight_decay",),
            openrlhf=("critic.adam.weight_decay",),
        ),
    )
    lr_scheduler: str | None = field(
        default=None,
        metadata=meta(
            f"critic LR schedule: {' | '.join(SCHEDULES)} (default: --lr_scheduler)",
            flags=("critic_lr_scheduler",),
            openrlhf=("critic.lr_scheduler",),
        ),
    )
    lr_warmup_ratio: float | None = field(
        default=None,
        metadata=meta(
            "critic LR warmup share of the steps (default: --lr_warmup_ratio)",
            flags=("critic_lr_warmup_ratio",),
            openrlhf=("critic.lr_warmup_ratio",),
        ),
    )
    min_lr_ratio: float | None = field(
        default=None,
        metadata=meta(
            "critic cosine floor as a share of its learning rate (default: --min_lr_ratio)",
            flags=("critic_min_lr_ratio",),
            openrlhf=("critic.min_lr_ratio",),
        ),
    )
    max_norm: float | None = field(
        default=None,
        metadata=meta(
            "critic gradient clipping, 0 disables (default: --max_norm)",
            flags=("critic_max_norm",),
            openrlhf=("critic.max_norm",),
        ),
    )
    optim: str = field(
        default="adam",
        metadata=meta(
            "the critic's optimizer: adam | muon, as --optim (which is the actor's); adam unless given, as OpenRLHF's "
            "--critic.optim (its value head trains in the Muon group too: a 2-D weight)",
            flags=("critic_optim",),
            openrlhf=("critic.optim",),
        ),
    )
    muon_lr: float = field(
        default=MUON_DEFAULTS["muon_lr"],
        metadata=meta(
            "with --critic_optim muon: the critic's Muon learning rate (its AdamW group's: --critic_learning_rate)",
            flags=("critic_muon_lr",),
            openrlhf=("critic.muon.lr",),
        ),
    )
    muon_momentum: float = field(
        default=MUON_DEFAULTS["muon_momentum"],
        metadata=meta(
            "with --critic_optim muon: the critic's Muon momentum",
            flags=("critic_muon_momentum",),
            openrlhf=("critic.muon.momentum",),
        ),
    )

    def __post_init__(self) -> None:
        try:
            check_numbers(
                self,
                positive=("learning_rate", "adam_eps"),
                unit=("min_lr_ratio",),
                non_negative=("weight_decay", "max_norm"),
            )
        except ValueError as e:  # check_numbers names the flag (critic_ + the field); name the flat setting the same
            raise ValueError("critic_" + str(e)) from None
        check_optimizer(self.optim, self.muon_lr, self.muon_momentum, prefix="critic_")
        if self.adam_betas is not None and not all(0 <= b < 1 for b in self.adam_betas):
            raise ValueError(
                f"critic_adam_betas (--critic_adam_betas) must be two numbers in [0, 1), got {self.adam_betas}"
            )
        if self.lr_scheduler is not None and self.lr_scheduler not in SCHEDULES:
            raise ValueError(
                f"critic_lr_scheduler (--critic_lr_scheduler) {self.lr_scheduler!r} is not a "
                f"schedule; valid: {', '.join(SCHEDULES)}"
            )
        if self.lr_warmup_ratio is not None and not 0 <= self.lr_warmup_ratio < 1:
            raise ValueError(
                f"critic_lr_warmup_ratio (--critic_lr_warmup_ratio) must be in [0, 1), got {self.lr_warmup_ratio}"
            )

    def overrides(self) -> dict:
        """The settings to replace on the actor's :class:`~rl_core.strategy.StrategyConfig` for the critic: those
        set, and the optimizer (adam unless given: never the actor's)."""
        return {
            **{
                f.name: getattr(self, f.name)
                for f in dataclasses.fields(self)
                if getattr(self, f.name) is not None and f.name not in ("optim", "muon_lr", "muon_momentum")
            },
            "optim": self.optim,
            "muon_lr": self.muon_lr,
            "muon_momentum": self.muon_momentum,
        }
