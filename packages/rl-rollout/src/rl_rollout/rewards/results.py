"""What reward calls return and how their failures are counted: the types every scorer shares.

:class:`RewardResult` (one sample), :class:`RewardCounts` (calls by outcome, added across scorers and
flattened into metrics), :class:`RewardError` / :class:`RewardTimeoutError` (a run that stops on its
reward calls), :class:`OnError` (fall back or raise); ``_Tally``, one batch's outcomes as the runner
collects them.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Literal

RewardStatus = Literal["ok", "error", "timeout", "nonfinite"]


class OnError(str, Enum):
    FALLBACK = "fallback"
    RAISE = "raise"


class RewardError(RuntimeError):
    """Reward calls failed (``on_error="raise"``, or more of them than a run tolerates); the message names the
    function, the sample and the error."""


class RewardTimeoutError(RewardError):
    """A reward call ran past ``timeout_s`` and ``on_error="raise"``."""


@dataclass(frozen=True)
class RewardResult:
    """One sample's outcome: the reward (``fallback`` unless ``status == "ok"``) and the error text if any."""

    reward: float
    status: RewardStatus
    error: str | None = None


@dataclass(frozen=True)
class RewardCounts:
    """Reward calls by outcome; ``first_failure`` is the message of the first failing sample (None when none).

    The common interface of scorers that count their failures (``counts``, ``last_counts``): counts add up
    (``a + b``, the first failure of ``a`` kept), and :meth:`metrics` flattens them for a metrics logger.
    """

    ok: int = 0
    errors: int = 0  # raised, returned a non-number, or the worker process died
    timeouts: int = 0
    nonfinite: int = 0  # returned NaN or +-inf
    first_failure: str | None = None

    @property
    def failures(self) -> int:
        return self.errors + self.timeouts + self.nonfinite

    @property
    def calls(self) -> int:
        return self.ok + self.failures

    def __add__(self, other: RewardCounts) -> RewardCounts:
        return RewardCounts(
            self.ok + other.ok,
            self.errors + other.errors,
            self.timeouts + other.timeouts,
            self.nonfinite + other.nonfinite,
            self.first_failure or other.first_failure,
        )

    def metrics(self, prefix: str = "reward/") -> dict[str, int]:
        """``{"reward/ok": .., "reward/failures": .., "reward/errors": .., "reward/timeouts": ..,
        "reward/nonfinite": ..}``."""
        return {
            f"{prefix}ok": self.ok,
            f"{prefix}failures": self.failures,
            f"{prefix}errors": self.errors,
            f"{prefix}timeouts": self.timeouts,
            f"{prefix}nonfinite": self.nonfinite,
        }


class _Tally:
    """The current batch's outcomes; the first failure is the lowest sample index that failed."""

    def __init__(self) -> None:
        self.n = {"ok": 0, "error": 0, "timeout": 0, "nonfinite": 0}
        self.first: tuple[int, str] | None = None

    def add(self, index: int, status: RewardStatus, message: str | None = None) -> None:
        self.n[status] += 1
        if message is not None and (self.first is None or index < self.first[0]):
            self.first = (index, message)

    def counts(self) -> RewardCounts:
        n = self.n
        return RewardCounts(n["ok"], n["error"], n["timeout"], n["nonfinite"], self.first and self.first[1])
