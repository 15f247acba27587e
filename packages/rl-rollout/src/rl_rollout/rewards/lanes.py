"""Where one reward call runs: a worker process (killed past its deadline) or an in-process thread
(abandoned past it: a Python call cannot be interrupted in its own thread). Both answer
``(status, index, reward or error text)`` over a pipe, so :class:`~rl_rollout.rewards.runner.RewardRunner`
watches processes and threads with one ``multiprocessing.connection.wait``.
"""

from __future__ import annotations

import math
import multiprocessing
import multiprocessing.connection
import numbers
import os
import queue
import signal
import threading
import time
import traceback
from typing import Any, NoReturn

from rl_rollout.rewards.loading import RewardLoadError, RewardSpec, as_reward, load_reward_fn, reward_fn_name

_MAX_MESSAGE = 2000
_lane = threading.local()  # .calling: this thread is an in-process lane inside a reward call
_real_exit = os._exit


class ProcessExitCalled(Exception):
    """A reward function called ``os._exit`` on an in-process lane, where it would end the trainer's process."""


def _guarded_exit(status: int) -> NoReturn:  # os._exit's parameter name: it replaces os._exit
    """``os._exit`` while reward lanes run in this process: on a lane inside a reward call, an error of that call
    instead of the end of the trainer (issue 40: the run died with no message and an empty metrics file);
    anywhere else, the real exit."""
    if getattr(_lane, "calling", False):
        raise ProcessExitCalled(
            f"the reward function called os._exit({status}), which on the trainer's thread lanes would end the whole "
            f"run; return a reward or raise instead, or run rewards in processes (--reward_workers N)"
        )
    _real_exit(status)


def _guard_exit() -> None:
    """Route ``os._exit`` through :func:`_guarded_exit` (idempotent; threads are the default lanes)."""
    if os._exit is not _guarded_exit:
        os._exit = _guarded_exit


def _describe(e: BaseException) -> str:
    frames = traceback.extract_tb(e.__traceback__)
    where = f" (at {frames[-1].filename}:{frames[-1].lineno})" if frames else ""
    text = str(e)
    if len(text) > _MAX_MESSAGE:  # an exception can carry megabytes; logs and metrics need the start
        text = text[:_MAX_MESSAGE] + f"... ({len(text)} characters)"
    return f"{type(e).__name__}: {text}{where}"


def _call(fn: Any, name: str, task: tuple) -> tuple:
    """Run one task ``(index, prompt, response, label, info)``: ``(status, index, reward or error text)``."""
    index, prompt, response, label, info = task
    try:
        value = fn(prompt, response, label, **info)
        scalar = value.item() if getattr(value, "ndim", None) == 0 and hasattr(value, "item") else value
        if isinstance(scalar, numbers.Real):
            try:
                finite = math.isfinite(float(scalar))
            except OverflowError:  # an int too large for a float
                finite = False
            if not finite:
                return ("nonfinite", index, f"returned {scalar!r:.80}; a reward must be a finite float")
        return ("ok", index, as_reward(value, name))
    except (Exception, SystemExit) as e:
        return ("error", index, _describe(e))


def _worker_main(spec: RewardSpec, conn: multiprocessing.connection.Connection) -> None:
    """Worker process: load the spec, say ready, then answer tasks until None or the parent is gone."""
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
        conn.send(_call(fn, name, task))


def _thread_main(fn: Any, name: str, tasks: queue.SimpleQueue, conn: multiprocessing.connection.Connection) -> None:
    """In-process lane: answer tasks until None; an abandoned lane ends when its call returns (its pipe is shut)."""
    try:
        while (task := tasks.get()) is not None:
            _lane.calling = True
            try:
                result = _call(fn, name, task)
            finally:
                _lane.calling = False
            conn.send(result)
    except OSError:  # abandoned: the runner closed its end of the pipe
        pass
    finally:
        conn.close()


class _ProcessWorker:
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
        self.started = self.deadline = math.inf

    def submit(self, task: tuple) -> None:
        self.conn.send(task)

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


class _ThreadWorker:
    """One daemon thread calling ``fn``; results come back over a pipe so one ``wait`` watches threads too."""

    def __init__(self, fn: Any, name: str) -> None:
        _guard_exit()
        self.conn, writer = multiprocessing.Pipe(duplex=False)
        self._tasks: queue.SimpleQueue = queue.SimpleQueue()
        self.thread = threading.Thread(
            target=_thread_main, args=(fn, name, self._tasks, writer), daemon=True, name="rl-reward-call"
        )
        self.thread.start()
        self.ready = True
        self.born = time.monotonic()
        self.task: int | None = None
        self.started = self.deadline = math.inf

    def submit(self, task: tuple) -> None:
        self._tasks.put(task)

    def stop(self, grace_s: float = 0.0) -> None:
        """Ask the thread to end; a call in progress is abandoned (it finishes, its result is dropped)."""
        self._tasks.put(None)
        self.conn.close()


_Lane = _ProcessWorker | _ThreadWorker


def _stop_all(workers: list[_Lane]) -> None:
    for w in workers:
        w.stop(grace_s=1.0)
    workers.clear()
