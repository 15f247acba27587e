"""Asynchronous rollout for the RL loop (``--async_train``): batch k+1 is generated while the policy trains on batch k.

One-step-off-policy pipelining as in OpenRLHF (``--train.async_enable``) and verl's
one-step-off trainer: a producer thread collects batches (generation, rewards,
dynamic filtering) in iteration order; the trainer takes them one by one, trains and
syncs the engines. Weight versions: the engines start at version ``v0`` (0, or the
resumed iteration) and the sync after iteration ``k`` pushes version ``k``, so
iteration ``k`` trains the policy of version ``k - 1``.

Bounded staleness (``max_staleness`` = S): the producer starts batch ``k`` only once
version ``k - 1 - S`` has been synced, so every sample of batch ``k`` was generated
by a policy at most S versions older than the one it trains (the engines never go
back a version). The producer *waits* for the trainer (nothing is generated and
thrown away); at most S + 1 batches are ahead of the trainer. S = 0 is the
synchronous schedule on a thread. The loop measures the bound on every sample
(``policy_version`` of each :class:`~rl_rollout.types.RolloutSample`) and counts
violations (``rl/staleness_violations``, 0 by construction).

Thread safety: the engines lock each generate and each weight update (an update
waits for the generate in flight and the next generate waits for the update), so a
batch holds one version per generate call. Not here: several engines whose versions
differ within a batch (the bound then holds per sample, which is what is checked),
reproducibility across runs (the two threads interleave differently).

Pausing (:meth:`AsyncRollout.paused`): the trainer may drain the producer (wait for the batch in flight) and keep
it from starting another, e.g. for the eval pass (:mod:`rl_core.trainers.ppo_eval`), which then has the engines
alone at one weight version.

Partial rollouts (``--partial_rollout``, :func:`start_partial_rollout`): the engines let an update land inside a
generate in flight, kept in vLLM (keep) or between chunks (chunks); each token carries its version.
"""

from __future__ import annotations

import contextlib
import functools
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from rl_rollout.partial_modes import set_partial_rollout

__all__ = ["AsyncRollout", "start_partial_rollout"]


def start_partial_rollout(rollout: Any, cfg: Any) -> str:
    """Turn ``cfg``'s (an :class:`~rl_core.configs.async_rl.AsyncConfig`) partial rollouts on for ``rollout``: an
    engine of this process, or engine groups with their own ``set_partial_rollout`` (rl_core.rl.groups.GroupRollout).
    Returns the mode the engines run, ``keep`` or ``chunks`` (``auto`` resolved by the engine's kind)."""
    mode, tokens = cfg.partial_rollout_mode, cfg.partial_rollout_tokens
    own = getattr(rollout, "set_partial_rollout", None)
    return str(own(mode.value, tokens)) if callable(own) else set_partial_rollout(rollout, mode, tokens).value


class AsyncRollout:
    """Collect batches ``first..last`` on a producer thread, ``max_staleness`` versions ahead at most.

    ``collect(k)`` returns batch ``k`` (any value); ``version`` is the engines' version now.
    The trainer calls :meth:`get` (blocks until batch ``k`` is ready; re-raises the producer's
    error), :meth:`synced` after each weight sync, and :meth:`close` at the end (also on error); :meth:`paused`
    holds the producer between batches.
    """

    def __init__(self, collect: Callable[[int], Any], first: int, last: int, *, max_staleness: int, version: int):
        if max_staleness < 0:
            raise ValueError(f"max_staleness must be >= 0, got {max_staleness}")
        self.collect, self.first, self.last, self.max_staleness = collect, first, last, max_staleness
        self._version = version
        self._ready: dict[int, Any] = {}
        self._error: BaseException | None = None
        self._stop = False
        self._paused = False  # the trainer holds the producer between batches (paused())
        self._busy = False  # a collect() is in flight
        self._cond = threading.Condition()
        self.gate_wait_s = 0.0  # producer time spent waiting for a sync (the bound at work)
        self._thread = threading.Thread(target=self._produce, name="rl-async-rollout", daemon=True)
        self._thread.start()

    def _may_start(self, k: int) -> bool:
        return self._stop or (not self._paused and self._version >= k - 1 - self.max_staleness)

    def _produce(self) -> None:
        for k in range(self.first, self.last + 1):
            t0 = time.perf_counter()
            with self._cond:
                self._cond.wait_for(functools.partial(self._may_start, k))
                if self._stop:
                    return
                self._busy = True
            self.gate_wait_s += time.perf_counter() - t0
            try:
                batch = self.collect(k)
            except BaseException as e:  # handed to the trainer thread, which re-raises it
                with self._cond:
                    self._error, self._busy = e, False
                    self._cond.notify_all()
                return
            with self._cond:
                self._ready[k], self._busy = batch, False
                self._cond.notify_all()

    def get(self, k: int) -> tuple[Any, float]:
        """Batch ``k`` and the seconds the trainer waited for it."""
        t0 = time.perf_counter()
        with self._cond:
            self._cond.wait_for(lambda: k in self._ready or self._error is not None or self._stop)
            if k in self._ready:
                return self._ready.pop(k), time.perf_counter() - t0
            if self._error is not None:
                raise self._error
            raise RuntimeError("AsyncRollout was closed")

    @contextlib.contextmanager
    def paused(self) -> Iterator[float]:
        """Drain the producer (wait for the batch in flight, if any, to be collected) and start no batch until the
        block ends; yields the seconds the drain waited. A producer error surfaces at the next :meth:`get`."""
        t0 = time.perf_counter()
        with self._cond:
            self._paused = True
            self._cond.wait_for(lambda: not self._busy)
        try:
            yield time.perf_counter() - t0
        finally:
            with self._cond:
                self._paused = False
                self._cond.notify_all()

    def synced(self, version: int) -> None:
        """The engines now hold ``version``: batches up to ``version + 1 + max_staleness`` may start."""
        with self._cond:
            self._version = version
            self._cond.notify_all()

    def close(self, timeout: float = 600.0) -> None:
        """Stop after the batch in progress (a generate call is not interrupted) and wait for the thread."""
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        self._thread.join(timeout)
