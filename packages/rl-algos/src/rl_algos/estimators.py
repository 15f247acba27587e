"""The advantage estimators' registry: :data:`ESTIMATORS` (name -> :class:`EstimatorSpec`), :func:`get_estimator`
and :func:`estimator_names`, with the built-in estimators' entries, and no torch: a command's flags list the
registered names, and its config checks a name, without importing it. The built-in estimators are
:mod:`rl_algos.advantages`'s functions, imported (with torch) on an entry's first call; an extension registers its
own function as it is.
"""

from __future__ import annotations

import enum
import importlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from rl_algos._settings import parse_settings

if TYPE_CHECKING:
    from torch import Tensor

    from rl_algos.advantages import Advantages, EstimatorFn


class _Builtin:
    """A built-in estimator of :mod:`rl_algos.advantages`, imported (with torch) when first called;
    ``inspect.signature`` sees the function itself (``__wrapped__``)."""

    def __init__(self, name: str) -> None:
        self.__name__ = name

    @property
    def __wrapped__(self) -> EstimatorFn:
        return getattr(importlib.import_module("rl_algos.advantages"), self.__name__)

    def __call__(self, *args: Any, **kwargs: Any) -> Advantages:
        return self.__wrapped__(*args, **kwargs)

    def __repr__(self) -> str:
        return f"rl_algos.advantages.{self.__name__}"


@dataclass(frozen=True)
class EstimatorSpec:
    """A registry entry: the estimator and what a loop must give it.

    ``needs_critic``: it reads critic values (``values_BT``); ``min_group_size``: the
    ``n_samples`` it needs (2 for estimators that compare a prompt's samples);
    ``whiten_by_default``: OpenRLHF whitens its advantages over the batch;
    ``turn_rewards``: its advantages are returns of token rewards, so rewards given per
    turn of a multi-turn episode (on each turn's last token, as ``token_rewards_BT``) keep
    their place (``reinforce_baseline`` baselines the scalar score only); the others
    compare one scalar per sample within its group;
    ``inputs``: the loop's keyword arguments beyond ``scores_B``/``mask_BT`` it reads (a loop passes
    only these); ``params``: its own settings a run may give (name -> type, e.g. ``{"temperature": float}``,
    set with ``--estimator_args temperature=0.5``; :meth:`settings` parses them).
    Calling the entry calls the estimator.
    """

    name: str
    fn: EstimatorFn
    needs_critic: bool = False
    min_group_size: int = 1
    whiten_by_default: bool = False
    turn_rewards: bool = False
    inputs: tuple[str, ...] = ("n_samples", "token_rewards_BT", "gamma")
    params: Mapping[str, type] = field(default_factory=dict)

    def __call__(self, scores_B: Tensor, mask_BT: Tensor, **kwargs) -> Advantages:
        return self.fn(scores_B, mask_BT, **kwargs)

    def settings(self, items: Sequence[str]) -> dict:
        """``KEY=VALUE`` texts -> this estimator's own parameters, typed; unknown keys fail naming the valid."""
        return parse_settings(items, self.params, f"advantage estimator {self.name!r}")


class _Registry(dict[str, EstimatorSpec]):
    """name -> :class:`EstimatorSpec`; refuses duplicates and lists valid names on a miss."""

    def register(self, name: str, fn: EstimatorFn | EstimatorSpec, **facts) -> EstimatorSpec:
        if name in self:
            raise ValueError(f"advantage estimator {name!r} is already registered")
        spec = fn if isinstance(fn, EstimatorSpec) else EstimatorSpec(name, fn, **facts)
        self[name] = spec
        return spec

    def __missing__(self, name: str) -> EstimatorSpec:
        raise ValueError(f"unknown advantage estimator {name!r}; valid: {', '.join(sorted(self))}")


ESTIMATORS = _Registry()
ESTIMATORS.register(
    "gae",
    _Builtin("gae"),
    needs_critic=True,
    whiten_by_default=True,
    turn_rewards=True,
    inputs=("token_rewards_BT", "values_BT", "gamma", "lambd"),
)
ESTIMATORS.register("reinforce", _Builtin("reinforce"), whiten_by_default=True, turn_rewards=True)
ESTIMATORS.register(
    "reinforce_baseline", _Builtin("reinforce_baseline"), min_group_size=2, whiten_by_default=True, turn_rewards=True
)
ESTIMATORS.register("rloo", _Builtin("rloo"), min_group_size=2)
ESTIMATORS.register("group_norm", _Builtin("group_norm"), min_group_size=2)
ESTIMATORS.register("dr_grpo", _Builtin("dr_grpo"), min_group_size=2)


def get_estimator(name: str) -> EstimatorSpec:
    """The registry entry called ``name`` (callable as the estimator); a ValueError lists the valid names."""
    return ESTIMATORS[str(name.value if isinstance(name, enum.Enum) else name)]


def estimator_names(*, critic_free: bool | None = None) -> list[str]:
    """Registered names, optionally only those with (``False``) or without (``True``) a critic."""
    return sorted(n for n, s in ESTIMATORS.items() if critic_free is None or s.needs_critic != critic_free)
