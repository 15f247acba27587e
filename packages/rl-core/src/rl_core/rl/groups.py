"""Worker groups and what the RL loop does over them: generation, and the calls a weight sync makes.

The loop (:class:`rl_core.trainers.ppo.PPOTrainer`) talks to each role through the
*worker-group protocol*: ``world_size``, ``call(method, *args)`` (every rank,
results in rank order), ``call_rank(rank, method, ...)``, ``call_sharded(method,
items, ...)`` (contiguous shards, concatenated results) and ``shutdown()``.
:class:`LocalGroup` is the in-process one (a single rank, ``rl ppo``);
rl-placement's ``RayActorGroup`` is the Ray one (``rl ppo-ray``), with the same
methods. rl-core never imports Ray.

- :class:`GroupRollout`: ``generate(requests)`` spread over rollout-engine groups
  (each a group whose rank 0 is an engine: ``HFEngine`` / ``VLLMEngine`` in a Ray
  actor), in parallel, results in request order; ``agenerate(request)``, one agent
  turn at a time, the turns of one event-loop tick batched per engine.
- :func:`sync_calls`: the calls of a weight sync on both ends, an engine that fails or dies named
  (:class:`EngineFailure`).

The weight syncs themselves (collective broadcast, CUDA IPC, in-process) are :mod:`rl_core.rl.weight_syncs`;
their names still import from here.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Protocol

from rl_rollout.pool import EnginePool
from rl_rollout.tick_batch import TickBatcher

logger = logging.getLogger(__name__)


class WorkerGroup(Protocol):
    world_size: int

    def call(self, method: str, *args: Any, **kwargs: Any) -> list[Any]: ...

    def call_rank(self, rank: int, method: str, *args: Any, **kwargs: Any) -> Any: ...

    def call_sharded(self, method: str, items: Sequence[Any], *args: Any, **kwargs: Any) -> list[Any]: ...

    def shutdown(self) -> None: ...


class LocalGroup:
    """A one-rank group over an object in this process (the same calls as a ``RayActorGroup``)."""

    world_size = 1

    def __init__(self, worker: Any, role: str = "local"):
        self.worker, self.role = worker, role

    def call(self, method: str, *args: Any, timeout: float | None = None, **kwargs: Any) -> list[Any]:
        return [getattr(self.worker, method)(*args, **kwargs)]

    def call_rank(self, rank: int, method: str, *args: Any, timeout: float | None = None, **kwargs: Any) -> Any:
        if rank != 0:
            raise ValueError(f"{self.role}: rank {rank} is out of range 0..0 (a local group has one rank)")
        return getattr(self.worker, method)(*args, **kwargs)

    def call_sharded(
        self,
        method: str,
        items: Sequence[Any],
        *args: Any,
        timeout: float | None = None,
        allow_uneven: bool = False,
        **kwargs: Any,
    ) -> list[Any]:
        out = getattr(self.worker, method)(list(items), *args, **kwargs)
        if not isinstance(out, (list, tuple)):
            raise TypeError(f"{self.role}: {method!r} returned {type(out).__name__}, call_sharded needs a list")
        return list(out)

    def shutdown(self, timeout: float = 10.0) -> None:
        close = getattr(self.worker, "shutdown", None)
        if callable(close):
            close()


def settle(*calls: Callable[[], Any]) -> list[tuple[Any, BaseException | None]]:
    """Run blocking calls at once (threads), wait for all; ``(result, None)`` or ``(None, error)`` each, in order."""
    if len(calls) == 1:  # one engine (the usual hybrid placement): no pool to start and join on the sync's path
        try:
            return [(calls[0](), None)]
        except BaseException as e:  # noqa: BLE001 - the caller decides what to raise
            return [(None, e)]
    with ThreadPoolExecutor(max_workers=max(len(calls), 1)) as pool:
        futures = [pool.submit(c) for c in calls]
        out: list[tuple[Any, BaseException | None]] = []
        for f in futures:
            try:
                out.append((f.result(), None))
            except BaseException as e:  # noqa: BLE001 - the caller decides what to raise
                out.append((None, e))
    return out


def concurrently(*calls: Callable[[], Any]) -> list[Any]:
    """Run blocking calls at once (threads), wait for all, re-raise the first failure; results in order."""
    outcomes = settle(*calls)
    for _, error in outcomes:
        if error is not None:
            raise error
    return [result for result, _ in outcomes]


class EngineFailure(RuntimeError):
    """A rollout engine that died (or raised) during a weight-sync call, named: its index, its group and
    rank, its process id and the call. ``engine``, ``call``, ``died``; the engine's own error is chained."""

    def __init__(self, message: str, *, engine: int, call: str, died: bool):
        super().__init__(message)
        self.engine, self.call, self.died = engine, call, died


def _alive(group: WorkerGroup, timeout: float = 10.0) -> bool:
    """Whether every rank of ``group`` still answers (groups without a health check are taken as alive)."""
    check = getattr(group, "health_check", None)
    if not callable(check):
        return True
    try:
        check(timeout=timeout)
    except Exception:  # noqa: BLE001 - any failure to answer is the answer
        return False
    return True


def _engine_pid(group: WorkerGroup) -> int | None:
    try:
        return group.call_rank(0, "describe", timeout=60.0).get("pid")
    except Exception:  # noqa: BLE001 - an engine without describe: its pid is unknown, the rest still names it
        return None


def sync_calls(
    what: str,
    policy: WorkerGroup,
    policy_call: tuple[str, Callable[[], Any]],
    engines: Sequence[WorkerGroup],
    engine_calls: Sequence[tuple[str, Callable[[], Any]]],
    pids: Sequence[int | None],
) -> list[Any]:
    """Run one step of a weight sync on the policy and every engine at once; results (policy first).

    When a call fails, the error names the party that failed, not the one that noticed: an engine that died
    (its group no longer answers) makes the policy's side fail too (a broadcast to a dead peer: "Connection
    reset by peer", or a wait for it until the weight group's timeout), so a dead engine is reported as soon as
    it is known, as :class:`EngineFailure` naming the engine, its rank, pid and call, without waiting for the
    other ends; then a dead policy (its own error); then an engine that raised; then the policy's error.
    The calls run in daemon threads: one still waiting on a dead peer ends when the run shuts its actors down."""
    calls = [policy_call, *engine_calls]
    outcomes: list[tuple[Any, BaseException | None] | None] = [None] * len(calls)
    done: queue.Queue = queue.Queue()

    def run(k: int, fn: Callable[[], Any]) -> None:
        try:
            done.put((k, (fn(), None)))
        except BaseException as e:  # noqa: BLE001 - reported below, naming the party
            done.put((k, (None, e)))

    for k, (name, fn) in enumerate(calls):
        threading.Thread(target=run, args=(k, fn), name=f"rl-sync-{name}-{k}", daemon=True).start()

    def engine_failure(i: int, err: BaseException, died: bool) -> EngineFailure:
        group, call = engines[i], engine_calls[i][0]
        who = f"rollout engine {i} ({getattr(group, 'role', 'engine')} rank 0, pid {pids[i] or 'unknown'})"
        policy_error = outcomes[0][1] if outcomes[0] is not None else None
        also = f"; the policy's {policy_call[0]!r} failed with it: {policy_error}" if policy_error is not None else ""
        how = "died during" if died else "failed in"
        return EngineFailure(f"{who} {how} {call!r} ({what}): {err}{also}", engine=i, call=call, died=died)

    for _ in calls:
        k, outcome = done.get()
        outcomes[k] = outcome
        if k > 0 and outcome[1] is not None and not _alive(engines[k - 1]):
            raise engine_failure(k - 1, outcome[1], died=True) from outcome[1]
    ended: list[tuple[Any, BaseException | None]] = []
    for o in outcomes:
        if o is None:  # not reached: the loop above takes one outcome per call
            raise RuntimeError(f"{what}: a call ended without an outcome")
        ended.append(o)
    policy_error = ended[0][1]
    failed = [(i, o[1]) for i, o in enumerate(ended[1:]) if o[1] is not None]
    if policy_error is None and not failed:
        return [o[0] for o in ended]
    if policy_error is not None and not _alive(policy):
        raise policy_error
    if failed or policy_error is None:  # (policy_error None: then failed is not empty)
        raise engine_failure(*failed[0], died=False) from failed[0][1]
    raise policy_error


class _EngineTurns:
    """An engine group as an ``EnginePool`` member: its ``agenerate`` calls of one event-loop tick go to the
    engine (rank 0) as one ``generate_turns`` call, made on a thread."""

    def __init__(self, group: WorkerGroup):
        self._ticks = TickBatcher(lambda reqs: asyncio.to_thread(group.call_rank, 0, "generate_turns", reqs))

    async def agenerate(self, request) -> list:
        return await self._ticks.submit(request)


class GroupRollout:
    """``generate`` over rollout-engine groups (rank 0 of each holds the engine), requests split evenly."""

    def __init__(self, engines: Sequence[WorkerGroup]):
        if not engines:
            raise ValueError("GroupRollout needs at least one engine group")
        self.engines = list(engines)
        self.pool: EnginePool | None = None  # agenerate's EnginePool of _EngineTurns, made on first use
        self._partial_mode: str | None = None

    @property
    def partial_mode(self) -> str | None:
        """Partial rollouts (the loop's ``--partial_rollout``): the mode the engines run (``keep`` or ``chunks``,
        :mod:`rl_rollout.partial_modes`) once :meth:`set_partial_rollout` turned them on; None: whole responses."""
        return self._partial_mode

    def set_partial_rollout(self, mode: str, tokens: int | None = None) -> str:
        """Every engine keeps its requests across a weight sync (keep) or samples ``tokens`` at a time (chunks), so
        a sync lands inside a generate in flight (the engine actors must take calls concurrently: rl-cli's
        ``RayFactory(partial_rollout=True)``). Returns the mode the engines run (``auto`` resolved by each: they are
        of one kind)."""
        modes = set(self.call("set_partial_rollout", str(getattr(mode, "value", mode)), tokens))
        if len(modes) != 1:  # not reached: every engine of a run is built from one EngineConfig
            raise RuntimeError(f"the engines resolved --partial_rollout_mode {mode} differently: {sorted(modes)}")
        self._partial_mode = modes.pop()
        return self._partial_mode

    def generate(self, requests: list) -> list[list]:
        n, k = len(requests), len(self.engines)
        bounds = [round(i * n / k) for i in range(k + 1)]
        shards = [
            (g, requests[bounds[i] : bounds[i + 1]]) for i, g in enumerate(self.engines) if bounds[i + 1] > bounds[i]
        ]
        parts = concurrently(*[(lambda g=g, s=s: g.call_rank(0, "generate", s)) for g, s in shards])
        return [group for part in parts for group in part]

    async def agenerate(self, request) -> list:
        """One request (an agent episode's turn, rl-rollout's ``AgentExecutor``) through :attr:`pool`, an
        ``EnginePool`` over the engines: the engine with the fewest sequences in flight takes it, and an
        engine's requests of one event-loop tick go as one ``generate_turns`` call, made on a thread (the
        engines sample at once; the episodes one engine answered go on while the others still sample)."""
        if self.pool is None:
            self.pool = EnginePool([_EngineTurns(g) for g in self.engines])
        return await self.pool.agenerate(request)

    def sleep(self, level: int = 1) -> None:
        concurrently(*[(lambda g=g: g.call_rank(0, "sleep", level)) for g in self.engines])

    def wake_up(self, tags: list[str] | None = None) -> None:
        concurrently(*[(lambda g=g: g.call_rank(0, "wake_up", tags)) for g in self.engines])

    def call(self, method: str, *args: Any) -> list[Any]:
        """``method`` on every engine (rank 0 of each group), in parallel."""
        return concurrently(*[(lambda g=g: g.call_rank(0, method, *args)) for g in self.engines])

    def shutdown(self) -> None:
        for g in self.engines:
            g.shutdown()


_MOVED = ("BroadcastWeightSync", "IpcWeightSync", "DirectWeightSync", "verify_engines")


def __getattr__(name: str):  # the weight syncs live in rl_core.rl.weight_syncs; old imports keep working
    if name in _MOVED:
        # lazy: import cycle (rl_core.rl.weight_syncs imports this module)
        from rl_core.rl import weight_syncs

        return getattr(weight_syncs, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
