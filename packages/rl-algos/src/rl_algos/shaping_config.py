"""The run's reward shaping settings (:class:`ShapingConfig`): plain Python, no torch, so a command's flags are built
without it. The shaping itself is :mod:`rl_algos.shaping`'s (which re-exports this name).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from rl_algos._settings import field_meta


def _meta(help: str, flat: str) -> dict:
    """OpenRLHF's name of a shaping flag is ``reward.<flat name less reward_>``."""
    return field_meta(help, flat, f"reward.{flat.removeprefix('reward_')}")


@dataclass(frozen=True)
class ShapingConfig:
    """Which shaping a run applies to its scalar rewards, in order: the overlong penalty, the stop-properly
    penalty, then clipping. Unset: off."""

    clip_range: tuple[float, float] | None = field(
        default=None, metadata=_meta("clip rewards to LOW HIGH", "reward_clip_range")
    )
    overlong_buffer_len: int | None = field(
        default=None,
        metadata=_meta(
            "DAPO overlong penalty: the last N tokens before generate_max_len ramp the penalty up",
            "overlong_buffer_len",
        ),
    )
    overlong_penalty_factor: float = field(
        default=1.0, metadata=_meta("DAPO overlong penalty at generate_max_len", "overlong_penalty_factor")
    )
    stop_properly_penalty_coef: float | None = field(
        default=None,
        metadata=_meta(
            "ProRL stop-properly penalty on samples cut at --generate_max_len (finish reason length, no EOS): their "
            "reward is scaled by this coefficient in [0, 1], or, when negative, replaced by it (a fixed reward)",
            "stop_properly_penalty_coef",
        ),
    )

    def __post_init__(self) -> None:
        if self.clip_range is not None:
            low, high = self.clip_range
            if not (math.isfinite(low) and math.isfinite(high) and low <= high):
                raise ValueError(
                    f"reward_clip_range (--reward_clip_range) must be LOW HIGH, finite, LOW <= HIGH, got "
                    f"{self.clip_range}"
                )
        if self.overlong_buffer_len is not None and self.overlong_buffer_len < 1:
            raise ValueError(
                f"overlong_buffer_len (--overlong_buffer_len) must be >= 1, got {self.overlong_buffer_len}"
            )
        if not (math.isfinite(self.overlong_penalty_factor) and self.overlong_penalty_factor >= 0):
            raise ValueError(
                f"overlong_penalty_factor (--overlong_penalty_factor) must be >= 0, got {self.overlong_penalty_factor}"
            )
        coef = self.stop_properly_penalty_coef
        if coef is not None and not (math.isfinite(coef) and coef <= 1):
            raise ValueError(
                f"stop_properly_penalty_coef (--stop_properly_penalty_coef) must be in [0, 1] (a "
                f"scale) or negative (a fixed reward), got {coef}"
            )
