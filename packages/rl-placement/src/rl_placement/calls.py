"""Calls on Ray actors that never hang: a bounded wait over every rank, and the error it raises.

This module owns :func:`gather` (results by rank within one deadline, every failure described) and the errors
(:class:`ActorCallError`, one :class:`RankFailure` per failed rank). A dead, failing or hung actor becomes an
:class:`ActorCallError` naming role, rank and method, with the remote error chained.
:class:`~rl_placement.groups.RayActorGroup` makes its calls through it.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import ray

__all__ = ["ActorCallError", "RankFailure", "gather"]

_MAX_CAUSE = 400  # characters of a remote traceback kept in a message; the full error is chained


@dataclass(frozen=True)
class RankFailure:
    rank: int
    cause: str
    error: BaseException | None = None


class ActorCallError(RuntimeError):
    """A call that failed on some ranks. ``rank``/``cause`` are the first failure; ``failures`` all."""

    def __init__(self, role: str, method: str, failures: Sequence[RankFailure]):
        self.role, self.method, self.failures = role, method, tuple(failures)
        self.rank, self.cause = self.failures[0].rank, self.failures[0].cause
        if len(self.failures) == 1:
            msg = f"{role} rank {self.rank} failed in {method!r}: {self.cause}"
        else:
            detail = "; ".join(f"rank {f.rank}: {f.cause}" for f in self.failures)
            msg = f"{role}: {len(self.failures)} ranks failed in {method!r}: {detail}"
        super().__init__(msg)


def _describe_error(err: BaseException) -> str:
    def short(e: BaseException) -> str:
        # Ray's messages carry the remote traceback; the head says where, the tail says what.
        text = str(e).strip()
        half = _MAX_CAUSE // 2
        return text if len(text) <= _MAX_CAUSE else f"{text[:half]} ... {text[-half:]}"

    if isinstance(err, ray.exceptions.RayActorError):
        how = "its __init__ raised, so the actor died" if err.actor_init_failed else "the actor died"
        return f"{how} ({type(err).__name__}: {short(err)})"
    if isinstance(err, ray.exceptions.RayTaskError):
        cause = err.cause
        if cause is None:
            return f"it raised: {short(err)}"
        return f"it raised {type(cause).__name__}: {short(cause)} (remote traceback in __cause__)"
    return f"{type(err).__name__}: {short(err)}"


def gather(
    role: str, method: str, refs: dict[int, ray.ObjectRef], timeout: float, fail_fast: bool = True
) -> dict[int, Any]:
    """Results by rank, or ActorCallError. Waits at most ``timeout`` seconds in all."""
    deadline = time.monotonic() + timeout
    pending = {ref: rank for rank, ref in refs.items()}
    results: dict[int, Any] = {}
    failures: list[RankFailure] = []
    while pending:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            break
        ready, _ = ray.wait(list(pending), num_returns=1, timeout=remaining)
        for ref in ready:
            rank = pending.pop(ref)
            try:
                # Ready objects may still travel from another node: bounded as well.
                results[rank] = ray.get(ref, timeout=max(deadline - time.monotonic(), 1.0))
            except (ray.exceptions.RayError, ray.exceptions.GetTimeoutError) as err:
                failures.append(RankFailure(rank, _describe_error(err), err))
        if failures and fail_fast:
            break
    if not (fail_fast and failures):  # what is still pending ran out of time
        failures += [
            RankFailure(rank, f"no answer within {timeout:g} s (hung, or still busy with an earlier call)")
            for rank in sorted(pending.values())
        ]
    if failures:
        failures.sort(key=lambda f: f.rank)
        raise ActorCallError(role, method, failures) from failures[0].error
    return results
