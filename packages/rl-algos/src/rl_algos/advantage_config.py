"""The run's choice of advantage estimator, as a typed config: :class:`AdvantageConfig`.

It names a registered estimator (:data:`rl_algos.ESTIMATORS`) and carries what applies to it: the discount
``gamma``, GAE's ``lambd``, the batch whitening (default: what the estimator's entry says, OpenRLHF's habit)
and the estimator's own parameters (``args``: ``KEY=VALUE`` texts typed by its entry's ``params``). Built, it
has checked all of them, so a loop asks it, once, for the entry (:attr:`spec`) and the parsed parameters
(:attr:`kwargs`)::

    adv = AdvantageConfig("group_norm")
    out = adv.spec(scores_B, mask_BT, n_samples=4, **adv.kwargs)
"""

from __future__ import annotations

from dataclasses import dataclass, field

from rl_algos._settings import field_meta as _meta
from rl_algos.estimators import ESTIMATORS, EstimatorSpec, estimator_names, get_estimator


@dataclass(frozen=True)
class AdvantageConfig:
    """Which estimator turns rewards into advantages, and its settings."""

    estimator: str = field(
        default="gae",
        metadata={
            **_meta(
                "a registered estimator (rl_algos.ESTIMATORS): gae is PPO's (with a critic), group_norm GRPO's; an "
                "extension module (--extension) registers more",
                "advantage_estimator",
                "algo.advantage.estimator",
            ),
            "names": estimator_names,
        },
    )
    args: tuple[str, ...] = field(
        default=(),
        metadata=_meta(
            "KEY=VALUE settings of the estimator's own parameters (its registry entry's params; an extension's)",
            "estimator_args",
        ),
    )
    gamma: float = field(default=1.0, metadata=_meta("discount", None, "algo.advantage.gamma"))
    lambd: float = field(default=0.95, metadata=_meta("GAE lambda", None, "algo.advantage.lambd"))
    whiten: bool | None = field(
        default=None,
        metadata=_meta(
            "batch-whiten the advantages (default: what the estimator's registry entry says)", "whiten_advantages"
        ),
    )
    no_std_norm: bool = field(
        default=False,
        metadata=_meta(
            "batch normalisation of the advantages subtracts the mean only, without dividing by the std (OpenRLHF: "
            "gae, reinforce, reinforce_baseline, the estimators it whitens)",
            "no_advantage_std_norm",
            "algo.advantage.no_std_norm",
        ),
    )

    def __post_init__(self) -> None:
        spec = get_estimator(self.estimator)  # an unknown name fails listing the registered ones
        object.__setattr__(self, "args", tuple(self.args))
        for name in ("gamma", "lambd"):
            value = getattr(self, name)
            if not 0 <= value <= 1:
                raise ValueError(f"{name} (--{name}) must be in [0, 1], got {value}")
        try:
            spec.settings(self.args)
        except ValueError as e:
            raise ValueError(f"{e} (--estimator_args)") from None
        if self.no_std_norm and not self.whitens:
            raise ValueError(
                f"--no_advantage_std_norm changes the batch normalisation of the advantages, which "
                f"--advantage_estimator {self.estimator} does not do (as in OpenRLHF, where it then "
                f"has no effect): drop the flag, or use dr_grpo for the group mean without the std"
            )

    @property
    def spec(self) -> EstimatorSpec:
        """The estimator's registry entry (callable as the estimator)."""
        return ESTIMATORS[self.estimator]

    @property
    def kwargs(self) -> dict:
        """The estimator's own parameters from ``args``, typed by its entry's ``params``."""
        return self.spec.settings(self.args)

    @property
    def whitens(self) -> bool:
        """Batch whitening in force: ``whiten`` if given, else the entry's ``whiten_by_default``."""
        return self.spec.whiten_by_default if self.whiten is None else self.whiten

    def inputs(self, **loop) -> dict:
        """Of the loop's inputs (``n_samples``, ``token_rewards_BT``, ``values_BT``), the ones the estimator
        declares (its entry's ``inputs``), with this config's ``gamma`` / ``lambd`` and its own parameters:
        the keyword arguments of one call."""
        loop = {**loop, "gamma": self.gamma, "lambd": self.lambd}
        return {**{k: v for k, v in loop.items() if k in self.spec.inputs}, **self.kwargs}
