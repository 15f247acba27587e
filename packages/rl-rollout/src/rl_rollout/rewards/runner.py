"""Score batches with a reward function without letting it crash or hang the trainer.

:class:`RewardRunner` calls one reward function (see
:mod:`rl_rollout.rewards.loading` for the signature and spec strings) on every
sample of a batch, in one of two modes:

- ``workers >= 1``: a pool of worker processes, one sample in flight per
  worker, each call bounded by ``timeout_s``. A worker that runs past it is
  killed and replaced (a running Python call cannot be cancelled any other
  way), so a hanging function costs ``timeout_s`` and one worker restart, never
  the pool. Workers load the spec themselves, so ``path/to/file.py:func``
  specs work; a callable must be picklable by reference (a module-level
  function of an importable module). The default start method is
  ``forkserver`` with this module preloaded: the server imports torch once
  and workers fork from it in milliseconds, without inheriting the trainer's
  threads as ``fork`` would (this sets the process-wide forkserver preload
  list). As with any spawn/forkserver pool, workers re-import the main script,
  so it needs an ``if __name__ == "__main__":`` guard; ``info`` values must be
  picklable. Workers are daemonic (they may not start ``multiprocessing``
  children of their own; ``subprocess`` is fine, but a killed worker's own
  children are not killed with it).
- ``workers == 0``: in the calling thread, for cheap functions. Exceptions are
  handled the same way; timeouts cannot be enforced (a Python call cannot be
  interrupted safely in its own thread), so asking for one is an error.

A call that raises, returns a non-number or NaN, kills its worker, or times out
gets ``fallback`` as its reward, is counted (:meth:`RewardRunner.metrics`) and
is logged as a warning naming the function, the sample and the error (the
first ``max_logged_failures`` failures; later ones are only counted). With
``on_error="raise"`` the first failure raises :class:`RewardError` (or
:class:`RewardTimeoutError`) after the pool is made whole again.
"""

from __future__ import annotations

import logging
import math
import multiprocessing
import multiprocessing.connection
import signal
import threading
import time
import traceback
import weakref
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Any, Literal

from rl_rollout.rewards.loading import RewardLoadError, RewardSpec, as_reward, load_reward_fn, reward_fn_name

logger = logging.getLogger(__name__)

RewardStatus = Literal["ok", "error", "timeout"]


class OnError(str, Enum):
    FALLBACK = "fallback"
    RAISE = "raise"


class RewardError(RuntimeError):
    """A reward call failed and ``on_error="raise"``; the message names the function, sample and error."""


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
    ok: int = 0
    errors: int = 0
    timeouts: int = 0


def _describe(e: BaseException) -> str:
    frames = traceback.extract_tb(e.__traceback__)
    where = f" (at {frames[-1].filename}:{frames[-1].lineno})" if frames else ""
    return f"{type(e).__name__}: {e}{where}"


def _worker_main(spec: RewardSpec, conn: multiprocessing.connection.Connection) -> None:
    """Worker loop: load the spec, say ready, then answer ``(index, prompt, response, label, info)`` tasks."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle; it kills the workers
    try:
        fn = load_reward_fn(spec)
    except Exception as e:
        conn.send(("load_error", str(e) if isinstance(e, RewardLoadError) else _describe(e)))
        return
    name = reward_fn_name(spec)
    conn.send(("ready", None))
    while True:
        try:
            task = conn.recv()
        except (EOFError, OSError):  # the parent is gone
            return
        if task is None:
            return
        index, prompt, response, label, info = task
        try:
            conn.send(("ok", index, as_reward(fn(prompt, response, label, **info), name)))
        except Exception as e:
            conn.send(("error", index, _describe(e)))


class _Worker:
    def __init__(self, ctx: Any, spec: RewardSpec) -> None:
        self.conn, child_conn = ctx.Pipe()
        self.proc = ctx.Process(target=_worker_main, args=(spec, child_conn), daemon=True, name="rl-reward-worker")
        try:
            self.proc.start()
        finally:
            child_conn.close()  # only the child holds its end, so its death reads as EOF here
        self.ready = False
        self.born = time.monotonic()
        self.task: int | None = None  # index of the sample in flight
        self.deadline = math.inf

    def stop(self, grace_s: float = 0.0) -> None:
        if grace_s > 0 and self.proc.is_alive():
            try:
                self.conn.send(None)
            except OSError:
                pass
            self.proc.join(grace_s)
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join(5)
        self.conn.close()


def _stop_all(workers: list[_Worker]) -> None:
    for w in workers:
        w.stop(grace_s=1.0)
    workers.clear()


class RewardRunner:
    """Run reward function ``fn`` over batches: ``workers`` processes with ``timeout_s`` per call, or in-process.

    ``fn`` is a callable or a spec string (:func:`~rl_rollout.rewards.loading.load_reward_fn`).
    In pool mode the constructor waits until every worker has loaded ``fn``
    (at most ``startup_timeout_s``), so a bad spec fails here, not mid-training.
    """

    def __init__(
        self,
        fn: RewardSpec,
        *,
        workers: int = 0,
        timeout_s: float | None = None,
        fallback: float = 0.0,
        on_error: str = "fallback",
        start_method: str = "forkserver",
        startup_timeout_s: float = 120.0,
        max_logged_failures: int = 20,
    ) -> None:
        if not isinstance(workers, int) or workers < 0:
            raise ValueError(f"workers must be an int >= 0 (0 = in-process), got {workers!r}")
        try:
            self.on_error = OnError(on_error)
        except ValueError:
            raise ValueError(f"on_error must be one of {[m.value for m in OnError]}, got {on_error!r}") from None
        if not math.isfinite(fallback):
            raise ValueError(f"fallback must be a finite float, got {fallback!r}")
        if workers == 0 and timeout_s is not None:
            raise ValueError(
                f"timeout_s={timeout_s} cannot be enforced in-process (workers=0): a running Python call cannot "
                "be interrupted safely in its own thread. Use workers >= 1 for timeouts, or timeout_s=None"
            )
        if workers > 0 and (timeout_s is None or not timeout_s > 0):
            raise ValueError(
                f"the process pool (workers={workers}) needs a timeout_s > 0 so a hanging function cannot block "
                f"it, got {timeout_s!r}; pass e.g. timeout_s=30"
            )
        if start_method not in multiprocessing.get_all_start_methods():
            raise ValueError(
                f"start_method {start_method!r} is not available here; choose one of "
                f"{multiprocessing.get_all_start_methods()}"
            )
        self.spec = fn
        self.name = reward_fn_name(fn)
        self.workers = workers
        self.timeout_s = timeout_s
        self.fallback = float(fallback)
        self.startup_timeout_s = startup_timeout_s
        self.max_logged_failures = max_logged_failures
        self._counts = {"ok": 0, "error": 0, "timeout": 0}
        self._lock = threading.Lock()
        self._pool: list[_Worker] = []
        self._finalizer = weakref.finalize(self, _stop_all, self._pool)
        if workers == 0:
            self._fn = load_reward_fn(fn)
            return
        self._ctx = multiprocessing.get_context(start_method)
        if start_method == "forkserver":
            self._ctx.set_forkserver_preload([__name__])
        try:
            for _ in range(workers):
                self._pool.append(self._new_worker())
            while not all(w.ready for w in self._pool):
                self._poll([])
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
            if self.workers == 0:
                return [self._run_inline(i, task) for i, task in enumerate(tasks)]
            if not self._pool:
                raise RuntimeError(f"RewardRunner for {self.name} is closed; build a new one")
            return self._run_pool(tasks)

    def score(
        self,
        prompts: Sequence[str],
        responses: Sequence[str],
        labels: Sequence[str | None] | None = None,
        infos: Sequence[dict[str, Any]] | None = None,
    ) -> list[float]:
        """The rewards of :meth:`run`, fallbacks included."""
        return [r.reward for r in self.run(prompts, responses, labels, infos)]

    def __call__(self, prompt: str, response: str, label: str | None = None, **info: Any) -> float:
        return self.run([prompt], [response], [label], [info])[0].reward

    @property
    def counts(self) -> RewardCounts:
        """Calls so far: ok, errors (raised, bad value, worker died) and timeouts."""
        c = self._counts
        return RewardCounts(ok=c["ok"], errors=c["error"], timeouts=c["timeout"])

    def metrics(self, prefix: str = "reward/") -> dict[str, int]:
        """:attr:`counts` as a flat dict for a metrics logger, e.g. ``{"reward/errors": 1, ...}``."""
        c = self.counts
        return {f"{prefix}ok": c.ok, f"{prefix}errors": c.errors, f"{prefix}timeouts": c.timeouts}

    def close(self) -> None:
        """Stop the workers (idempotent)."""
        self._finalizer()

    def __enter__(self) -> RewardRunner:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- internals ------------------------------------------------------------------------------

    def _failure(self, index: int, status: RewardStatus, message: str) -> RewardResult:
        self._counts[status] += 1
        failures = self._counts["error"] + self._counts["timeout"]
        what = "timed out" if status == "timeout" else "failed"
        if self.on_error is OnError.RAISE:
            cls = RewardTimeoutError if status == "timeout" else RewardError
            raise cls(f"reward function {self.name} {what} on sample {index}: {message}")
        if failures <= self.max_logged_failures:
            logger.warning(
                "reward function %s %s on sample %d: %s; using fallback reward %s",
                self.name, what, index, message, self.fallback,
            )  # fmt: skip
            if failures == self.max_logged_failures:
                logger.warning("reward function %s: further failures are counted in metrics() only", self.name)
        return RewardResult(self.fallback, status, message)

    def _run_inline(self, index: int, task: tuple) -> RewardResult:
        prompt, response, label, info = task
        try:
            reward = as_reward(self._fn(prompt, response, label, **info), self.name)
        except Exception as e:
            return self._failure(index, "error", _describe(e))
        self._counts["ok"] += 1
        return RewardResult(reward, "ok")

    def _new_worker(self) -> _Worker:
        try:
            return _Worker(self._ctx, self.spec)
        except Exception as e:  # pickling a lambda or a closure fails here
            raise RewardLoadError(
                f"cannot send reward function {self.name} to a worker process ({type(e).__name__}: {e}); pass a "
                "'path/to/file.py:func' or 'module:func' spec, a module-level function, or use workers=0"
            ) from e

    def _replace(self, w: _Worker) -> None:
        w.stop()
        self._pool[self._pool.index(w)] = self._new_worker()

    def _run_pool(self, tasks: list[tuple]) -> list[RewardResult]:
        results: list[RewardResult | None] = [None] * len(tasks)
        pending = deque(range(len(tasks)))
        try:
            while pending or any(w.task is not None for w in self._pool):
                for w in self._pool:
                    if pending and w.ready and w.task is None:
                        i = pending.popleft()
                        try:
                            w.conn.send((i, *tasks[i]))
                        except OSError:  # the worker died while idle: requeue, replace it
                            pending.appendleft(i)
                            self._replace(w)
                            continue
                        w.task, w.deadline = i, time.monotonic() + self.timeout_s
                self._poll(results)
        except BaseException:
            for w in list(self._pool):  # leave no stale task behind in a worker
                if w.task is not None:
                    self._replace(w)
            raise
        return results  # type: ignore[return-value]  # every slot is filled when the loop ends

    def _poll(self, results: list[RewardResult | None]) -> None:
        """Wait for the next message or deadline, then handle results, deaths, timeouts and slow starts."""
        waiting = [w for w in self._pool if w.task is not None or not w.ready]
        if not waiting:
            return
        deadline = min((w.deadline if w.ready else w.born + self.startup_timeout_s) for w in waiting)
        by_conn = {w.conn: w for w in waiting}
        for conn in multiprocessing.connection.wait(list(by_conn), timeout=max(0.0, deadline - time.monotonic())):
            self._receive(by_conn[conn], results)
        now = time.monotonic()
        for w in list(self._pool):
            if w.task is not None and w.deadline <= now:
                i = w.task
                self._replace(w)
                results[i] = self._failure(
                    i, "timeout", f"no result within timeout_s={self.timeout_s}; its worker was killed and replaced"
                )
            elif not w.ready and w.born + self.startup_timeout_s <= now:
                raise RuntimeError(
                    f"reward worker for {self.name} did not load it within startup_timeout_s="
                    f"{self.startup_timeout_s}; loading the spec (or importing its modules) is too slow or hangs"
                )

    def _receive(self, w: _Worker, results: list[RewardResult | None]) -> None:
        try:
            msg = w.conn.recv()
        except (EOFError, OSError):
            w.proc.join(1)
            code = w.proc.exitcode
            if not w.ready:
                hint = "" if isinstance(self.spec, str) else "; a callable must be importable in a fresh process"
                raise RuntimeError(
                    f"reward worker for {self.name} exited with code {code} before it was ready (its stderr says "
                    f"why){hint}. Pass a spec string, or run from a script file (not stdin) under a __main__ guard"
                ) from None
            i = w.task
            self._replace(w)
            if i is not None:
                results[i] = self._failure(i, "error", f"its worker process died (exit code {code}); replaced it")
            return
        kind = msg[0]
        if kind == "ready":
            w.ready = True
        elif kind == "load_error":
            raise RewardLoadError(msg[1])
        elif kind == "ok":
            w.task = None
            self._counts["ok"] += 1
            results[msg[1]] = RewardResult(msg[2], "ok")
        else:
            w.task = None
            results[msg[1]] = self._failure(msg[1], "error", msg[2])
