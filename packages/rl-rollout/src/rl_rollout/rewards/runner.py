"""Score batches with a reward function without letting it crash, hang or stall the trainer.

:class:`RewardRunner` calls one reward function (see
:mod:`rl_rollout.rewards.loading` for the signature and spec strings) on every
sample of a batch. Every call is bounded by ``timeout_s`` (default 30 s), in
either mode:

- ``workers >= 1``: worker processes, one call in flight per process. A worker
  whose call runs past ``timeout_s`` is killed (a running Python call cannot be
  cancelled any other way), so a hanging function costs its timeout and one
  worker restart, never the pool. Workers load the spec themselves, so
  ``path/to/file.py:func`` specs work; a callable must be picklable by
  reference (a module-level function of an importable module). The default
  start method is ``forkserver`` with this module preloaded: the server
  imports torch once and workers fork from it in milliseconds, without
  inheriting the trainer's threads as ``fork`` would (this sets the
  process-wide forkserver preload list). As with any spawn/forkserver pool,
  workers re-import the main script, so it needs an ``if __name__ ==
  "__main__":`` guard; ``info`` values must be picklable. Workers are daemonic
  (they may not start ``multiprocessing`` children of their own;
  ``subprocess`` is fine, but a killed worker's own children are not killed
  with it).
- ``workers == 0``: in this process, each call on a daemon thread. A call past
  ``timeout_s`` is *abandoned*, not stopped: it is counted as a timeout and
  gets the fallback at once, but its thread runs on until the function returns
  (Python cannot stop a thread), holding whatever memory and CPU it uses; each
  one is logged as a warning and :attr:`RewardRunner.abandoned_threads` counts
  those still running. Use ``workers >= 1`` for functions that can hang for good.

Calls run in parallel across the samples of a batch: ``workers``
calls (one in-process) run at once while they are quick; a call still running
after ``straggler_s`` (default ``timeout_s / 4``) is presumed stuck and stops
holding its slot, so another worker (or thread) starts on the next sample, up to
``max_in_flight`` calls at once (default 4 x ``max(workers, 1)``). So a batch with
H hanging samples costs about ``ceil(H / max_in_flight)`` timeouts, not H, plus the
straggler delays before each starts (measured in-process, ``timeout_s=3``: 4 hanging
samples 5.3 s, 16 hanging 14.3 s); raise ``max_in_flight`` or ``workers`` where many
samples can hang at once. The extra
workers are stopped when the batch ends. In-process, the extra threads share one
interpreter: a CPU-bound function gains nothing from them (the GIL), and if its
calls normally take more than ``straggler_s``, raise ``timeout_s`` or use
workers.

A call fails when it raises (``error``), returns a non-number or its worker
process dies (``error``), returns NaN or +-inf (``nonfinite``), or runs past
``timeout_s`` (``timeout``). A failed call gets ``fallback`` as its reward, is
logged as a warning naming the function, the sample and the error (the first
``max_logged_failures``; later ones are only counted) and is counted:
:attr:`RewardRunner.counts` over the runner's life, :attr:`RewardRunner.last_counts`
for the latest batch (both :class:`RewardCounts`, whose ``first_failure`` is the
message of the batch's first failing sample). A training loop reads
``last_counts`` after each ``score`` to log failures per iteration and to stop a
run whose calls mostly fail (rl-core's ``PPOTrainer`` does;
:class:`~rl_rollout.config.SummedRewards` sums its parts' counts). With
``on_error="raise"`` the first failure raises :class:`RewardError` (or
:class:`RewardTimeoutError`) after the pool is made whole again.
"""

from __future__ import annotations

import logging
import math
import multiprocessing
import multiprocessing.connection
import numbers
import threading
import time
import weakref
from collections import deque
from collections.abc import Sequence
from typing import Any

from rl_rollout.rewards.lanes import _Lane, _ProcessWorker, _stop_all, _ThreadWorker
from rl_rollout.rewards.loading import RewardLoadError, RewardSpec, load_reward_fn, reward_fn_name
from rl_rollout.rewards.results import (  # noqa: F401  (re-exported: the runner's public names)
    OnError,
    RewardCounts,
    RewardError,
    RewardResult,
    RewardStatus,
    RewardTimeoutError,
    _Tally,
)

logger = logging.getLogger(__name__)


def _is_real(x: object) -> bool:
    """Whether ``x`` is a real number (int, float, numpy scalar, ...). A function, not an inline ``isinstance``:
    typeshed's ``float`` is no ``numbers.Real``, so mypy would take the code after the check as unreachable."""
    return isinstance(x, numbers.Real)


class RewardRunner:
    """Run reward function ``fn`` over batches, every call bounded by ``timeout_s``: in ``workers`` processes,
    or (``workers=0``) on daemon threads of this process.

    ``fn`` is a callable or a spec string (:func:`~rl_rollout.rewards.loading.load_reward_fn`).
    In pool mode the constructor waits until every worker has loaded ``fn``
    (at most ``startup_timeout_s``), so a bad spec fails here, not mid-training.
    ``straggler_s`` and ``max_in_flight``: see the module docstring.
    """

    def __init__(
        self,
        fn: RewardSpec,
        *,
        workers: int = 0,
        timeout_s: float = 30.0,
        fallback: float = 0.0,
        on_error: str = "fallback",
        straggler_s: float | None = None,
        max_in_flight: int | None = None,
        start_method: str = "forkserver",
        startup_timeout_s: float = 120.0,
        max_logged_failures: int = 20,
    ) -> None:
        if not isinstance(workers, int) or workers < 0:
            raise ValueError(f"workers must be an int >= 0 (0 = threads of this process), got {workers!r}")
        try:
            self.on_error = OnError(on_error)
        except ValueError:
            raise ValueError(f"on_error must be one of {[m.value for m in OnError]}, got {on_error!r}") from None
        if not math.isfinite(fallback):
            raise ValueError(f"fallback must be a finite float, got {fallback!r}")
        if not _is_real(timeout_s) or not (0 < timeout_s < math.inf):
            raise ValueError(
                f"timeout_s must be a finite number of seconds > 0, got {timeout_s!r}: every reward "
                "call is bounded; pass a large one (e.g. 3600) for slow functions"
            )
        straggler_s = timeout_s / 4 if straggler_s is None else straggler_s
        if not 0 < straggler_s <= timeout_s:
            raise ValueError(f"straggler_s must be in (0, timeout_s={timeout_s}], got {straggler_s!r}")
        slots = max(workers, 1)
        max_in_flight = 4 * slots if max_in_flight is None else max_in_flight
        if not isinstance(max_in_flight, int) or max_in_flight < slots:
            raise ValueError(f"max_in_flight must be an int >= max(workers, 1) = {slots}, got {max_in_flight!r}")
        if start_method not in multiprocessing.get_all_start_methods():
            raise ValueError(
                f"start_method {start_method!r} is not available here; choose one of "
                f"{multiprocessing.get_all_start_methods()}"
            )
        self.spec = fn
        self.name = reward_fn_name(fn)
        self.workers = workers
        self.timeout_s = float(timeout_s)
        self.straggler_s = float(straggler_s)
        self.slots, self.max_in_flight = slots, max_in_flight
        self.fallback = float(fallback)
        self.startup_timeout_s = startup_timeout_s
        self.max_logged_failures = max_logged_failures
        self._total = RewardCounts()
        self.last_counts = RewardCounts()  # of the latest batch
        self._tally = _Tally()
        self._logged = 0
        self._abandoned: list[threading.Thread] = []
        self._lock = threading.Lock()
        self._closed = False
        self._pool: list[_Lane] = []
        self._finalizer = weakref.finalize(self, _stop_all, self._pool)
        if workers == 0:
            self._fn = load_reward_fn(fn)
            self._pool.append(self._new_worker())
            return
        self._ctx = multiprocessing.get_context(start_method)
        if start_method == "forkserver":
            self._ctx.set_forkserver_preload([__name__])
        try:
            for _ in range(workers):
                self._pool.append(self._new_worker())
            while not all(w.ready for w in self._pool):
                self._poll([], pending=False)
        except BaseException:
            self.close()
            raise

    # -- public ---------------------------------------------------------------------------------

    def run(
        self,
        prompts: Sequence[str],
        responses: Sequence[str],
        labels: Sequence[str | None] | None = None,
        infos: Sequence[dict[str, Any]] | None = None,
    ) -> list[RewardResult]:
        """One :class:`RewardResult` per sample, in order. ``labels`` and ``infos`` default to None and ``{}``."""
        n = len(prompts)
        labels = [None] * n if labels is None else list(labels)
        infos = [{}] * n if infos is None else list(infos)
        for what, seq in (("responses", responses), ("labels", labels), ("infos", infos)):
            if len(seq) != n:
                raise ValueError(f"RewardRunner.run: {len(seq)} {what} for {n} prompts; pass one per prompt")
        tasks = list(zip(prompts, responses, labels, infos, strict=True))
        with self._lock:
            if self._closed:
                raise RuntimeError(f"RewardRunner for {self.name} is closed; build a new one")
            self._tally = _Tally()
            try:
                return self._run_batch(tasks)
            finally:
                self.last_counts = self._tally.counts()
                self._total = self._total + self.last_counts

    def score(
        self,
        prompts: Sequence[str],
        responses: Sequence[str],
        labels: Sequence[str | None] | None = None,
        infos: Sequence[dict[str, Any]] | None = None,
    ) -> list[float]:
        """The rewards of :meth:`run`, fallbacks included (:attr:`last_counts` says how many)."""
        return [r.reward for r in self.run(prompts, responses, labels, infos)]

    def __call__(self, prompt: str, response: str, label: str | None = None, **info: Any) -> float:
        return self.run([prompt], [response], [label], [info])[0].reward

    @property
    def counts(self) -> RewardCounts:
        """Calls so far, by outcome (``first_failure``: the first one of the runner's life)."""
        return self._total

    def metrics(self, prefix: str = "reward/") -> dict[str, int]:
        """:attr:`counts` as a flat dict for a metrics logger, e.g. ``{"reward/errors": 1, ...}``."""
        return self._total.metrics(prefix)

    @property
    def abandoned_threads(self) -> int:
        """In-process calls that timed out and still run on their threads."""
        self._abandoned = [t for t in self._abandoned if t.is_alive()]
        return len(self._abandoned)

    def close(self) -> None:
        """Stop the workers (idempotent). Abandoned in-process calls run on until they return."""
        self._closed = True
        self._finalizer()

    def __enter__(self) -> RewardRunner:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- internals ------------------------------------------------------------------------------

    def _failure(self, index: int, status: RewardStatus, message: str) -> RewardResult:
        what = "timed out" if status == "timeout" else "failed"
        self._tally.add(index, status, f"reward function {self.name} {what} on sample {index}: {message}")
        if self.on_error is OnError.RAISE:
            cls = RewardTimeoutError if status == "timeout" else RewardError
            raise cls(f"reward function {self.name} {what} on sample {index}: {message}")
        self._logged += 1
        if self._logged <= self.max_logged_failures:
            logger.warning(
                "reward function %s %s on sample %d: %s; using fallback reward %s",
                self.name, what, index, message, self.fallback,
            )  # fmt: skip
            if self._logged == self.max_logged_failures:
                logger.warning("reward function %s: further failures are counted only", self.name)
        return RewardResult(self.fallback, status, message)

    def _new_worker(self) -> _Lane:
        if self.workers == 0:
            return _ThreadWorker(self._fn, self.name)
        try:
            return _ProcessWorker(self._ctx, self.spec)
        except Exception as e:  # pickling a lambda or a closure fails here
            raise RewardLoadError(
                f"cannot send reward function {self.name} to a worker process ({type(e).__name__}: {e}); pass a "
                "'path/to/file.py:func' or 'module:func' spec, a module-level function, or use workers=0"
            ) from e

    def _drop(self, w: _Lane) -> None:
        """Take ``w`` out of the pool: a process is killed, a thread's call in progress abandoned."""
        w.stop()
        self._pool.remove(w)
        if isinstance(w, _ThreadWorker) and w.task is not None and w.thread.is_alive():
            if not self._abandoned:
                logger.warning(
                    "reward function %s: a call past timeout_s=%s was abandoned; Python cannot stop a thread, so "
                    "it runs on in this process, using its memory and CPU, until the function returns. Use "
                    "workers >= 1 (--reward_workers) for functions that can hang: their processes are killed",
                    self.name, self.timeout_s,
                )  # fmt: skip
            self._abandoned.append(w.thread)

    def _run_batch(self, tasks: list[tuple]) -> list[RewardResult]:
        results: list[RewardResult | None] = [None] * len(tasks)
        pending = deque(range(len(tasks)))
        try:
            while pending or any(w.task is not None for w in self._pool):
                self._dispatch(tasks, pending)
                self._poll(results, pending=bool(pending))
        except BaseException:
            for w in [w for w in self._pool if w.task is not None]:  # leave no stale task behind
                self._drop(w)
            raise
        finally:
            self._resize()
        return results  # type: ignore[return-value]  # every slot is filled when the loop ends

    def _dispatch(self, tasks: list[tuple], pending: deque) -> None:
        """Hand pending samples to idle workers; start one more while fewer than ``slots`` calls are fresh."""
        now = time.monotonic()
        while pending:
            idle = next((w for w in self._pool if w.ready and w.task is None), None)
            if idle is None:
                holding = sum(
                    1 for w in self._pool if not w.ready or (w.task is not None and now - w.started < self.straggler_s)
                )
                if holding >= self.slots or len(self._pool) >= self.max_in_flight:
                    return
                self._pool.append(self._new_worker())
                continue
            i = pending.popleft()
            try:
                idle.submit((i, *tasks[i]))
            except OSError:  # a worker process that died while idle: requeue the sample, drop the worker
                pending.appendleft(i)
                self._drop(idle)
                continue
            idle.task, idle.started, idle.deadline = i, now, now + self.timeout_s

    def _poll(self, results: list[RewardResult | None], *, pending: bool) -> None:
        """Wait for the next message, deadline or straggler mark; then handle results, deaths, timeouts."""
        waiting = [w for w in self._pool if w.task is not None or not w.ready]
        if not waiting:
            return
        now = time.monotonic()
        marks = []
        for w in waiting:
            if not w.ready:
                marks.append(w.born + self.startup_timeout_s)
                continue
            marks.append(w.deadline)
            if pending and now - w.started < self.straggler_s:  # then another worker may start
                marks.append(w.started + self.straggler_s)
        by_conn = {w.conn: w for w in waiting}
        for conn in multiprocessing.connection.wait(list(by_conn), timeout=max(0.0, min(marks) - now)):
            self._receive(by_conn[conn], results)
        now = time.monotonic()
        for w in list(self._pool):
            if w.task is not None and w.deadline <= now:
                i = w.task
                self._drop(w)
                how = (
                    "its worker process was killed"
                    if isinstance(w, _ProcessWorker)
                    else f"abandoned ({self.abandoned_threads} abandoned call(s) still running on threads)"
                )
                results[i] = self._failure(i, "timeout", f"no result within timeout_s={self.timeout_s}; {how}")
            elif not w.ready and w.born + self.startup_timeout_s <= now:
                raise RuntimeError(
                    f"reward worker for {self.name} did not load it within startup_timeout_s="
                    f"{self.startup_timeout_s}; loading the spec (or importing its modules) is too slow or hangs"
                )

    def _receive(self, w: _Lane, results: list[RewardResult | None]) -> None:
        try:
            msg = w.conn.recv()
        except (EOFError, OSError):
            code = None
            if isinstance(w, _ProcessWorker):
                w.proc.join(1)
                code = w.proc.exitcode
            if not w.ready:
                hint = "" if isinstance(self.spec, str) else "; a callable must be importable in a fresh process"
                raise RuntimeError(
                    f"reward worker for {self.name} exited with code {code} before it was ready (its stderr says "
                    f"why){hint}. Pass a spec string, or run from a script file (not stdin) under a __main__ guard"
                ) from None
            i = w.task
            w.task = None
            self._drop(w)
            if i is not None:
                results[i] = self._failure(i, "error", f"its worker died (exit code {code}); replaced it")
            return
        kind = msg[0]
        if kind == "ready":
            w.ready = True
        elif kind == "load_error":
            raise RewardLoadError(msg[1])
        elif kind == "ok":
            w.task = None
            self._tally.add(msg[1], "ok")
            results[msg[1]] = RewardResult(msg[2], "ok")
        else:  # "error" | "nonfinite"
            w.task = None
            results[msg[1]] = self._failure(msg[1], kind, msg[2])

    def _resize(self) -> None:
        """Back to ``slots`` workers after a batch: stop the extra idle ones, replace the ones lost."""
        extra = max(0, len(self._pool) - self.slots)
        for w in [w for w in reversed(self._pool) if w.ready and w.task is None][:extra]:
            self._pool.remove(w)
            w.stop(grace_s=1.0)
        while len(self._pool) < self.slots and not self._closed:
            self._pool.append(self._new_worker())
