"""What every typed config of the rl-* packages shares: field metadata (:func:`meta`: help text and command-line
names, which rl-cli reads to build its parser) and the number checks run when a config is built
(:func:`check_numbers`). Kept apart from :mod:`rl_rollout.config` so the reward modules (the reward server's
settings) use them without importing the configs that build rewards.
"""

from __future__ import annotations

import dataclasses
import math


def meta(help: str, *, flags: tuple[str, ...] = (), openrlhf: tuple[str, ...] = ()) -> dict:
    """Field metadata read by command-line builders: help text and the flag names that set the field."""
    return {"help": help, "flags": flags, "openrlhf": openrlhf}


def check_numbers(
    cfg,
    *,
    positive: tuple[str, ...] = (),
    non_negative: tuple[str, ...] = (),
    unit: tuple[str, ...] = (),
    at_least_1: tuple[str, ...] = (),
) -> None:
    """A config's numbers, checked before anything heavy runs: every float field (and each number of a
    tuple field) finite, then ``positive`` fields > 0, ``non_negative`` >= 0, ``unit`` in [0, 1],
    ``at_least_1`` >= 1 (an unset optional field is skipped). ValueError naming the flag, the value and
    the range, so a typo such as ``--learning_rate -1e-5`` stops at parse time, not inside the optimizer."""

    def values(name):
        v = getattr(cfg, name)
        return [] if v is None or isinstance(v, (bool, str)) else list(v) if isinstance(v, tuple) else [v]

    fields = {f.name: f for f in dataclasses.fields(cfg)}

    def flag(name):  # the command line's name for the field (its first flag), else the field's own
        return (fields[name].metadata.get("flags") or (name,))[0]

    for f in fields.values():
        for v in values(f.name):
            if isinstance(v, float) and not math.isfinite(v):
                raise ValueError(f"{f.name} (--{flag(f.name)}) must be a finite number, got {getattr(cfg, f.name)}")
    rules = (
        (positive, lambda v: v > 0, "> 0"),
        (non_negative, lambda v: v >= 0, ">= 0"),
        (unit, lambda v: 0 <= v <= 1, "in [0, 1]"),
        (at_least_1, lambda v: v >= 1, ">= 1"),
    )
    for names, ok, text in rules:
        for name in names:
            if not all(ok(v) for v in values(name)):
                raise ValueError(f"{name} (--{flag(name)}) must be {text}, got {getattr(cfg, name)}")
