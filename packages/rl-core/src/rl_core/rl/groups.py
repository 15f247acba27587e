"""Worker groups and what the RL loop does over them: generation and weight sync.

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
- :class:`BroadcastWeightSync`: policy -> engines over rl-rollout's collective
  transport (gloo on CPU, NCCL on GPU): policy rank 0 is the sender, each engine's
  workers the receivers; the policy ranks and engines are called concurrently
  (a broadcast needs both ends).
- :class:`IpcWeightSync`: the hybrid engine on GPUs: policy rank i and engine i share a GPU;
  each rank gathers the full weights into CUDA IPC buckets its engine reads in place
  (rl-rollout's :class:`~rl_rollout.ipc.IpcSender`), only a few hundred bytes cross the
  process boundary per sync.
- :class:`DirectWeightSync`: an engine in the controller's process
  (``engine.update_weights``), for ``rl ppo`` with a :class:`LocalGroup` policy.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, Protocol

from rl_rollout.pool import EnginePool
from rl_rollout.tick_batch import TickBatcher

if TYPE_CHECKING:
    from rl_rollout.pool import EnginePool

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


class BroadcastWeightSync:
    """Policy -> engines over the collective transport. ``engine_workers[i]``: engine i's TP size.

    :meth:`setup` builds the weight group once (policy rank 0 = rank 0, engine i's
    workers the next ``engine_workers[i]`` ranks); each call broadcasts one version.
    """

    def __init__(
        self,
        policy: WorkerGroup,
        rollout: GroupRollout,
        *,
        backend: str = "gloo",
        engine_workers: Sequence[int] | None = None,
        verify: bool = False,
        timeout_s: float = 600.0,
    ):
        self.policy, self.rollout, self.backend, self.verify, self.timeout_s = (
            policy,
            rollout,
            backend,
            verify,
            timeout_s,
        )
        self.engine_workers = list(engine_workers or [1] * len(rollout.engines))
        if len(self.engine_workers) != len(rollout.engines):
            raise ValueError(
                f"engine_workers has {len(self.engine_workers)} entries for {len(rollout.engines)} engines"
            )
        self.pids = [_engine_pid(g) for g in rollout.engines]  # while they live: to name one that dies later
        self._ready = False

    def setup(self) -> None:
        addr, port = self.policy.call_rank(0, "weight_sender_address")
        world = 1 + sum(self.engine_workers)
        offsets = [1 + sum(self.engine_workers[:i]) for i in range(len(self.engine_workers))]
        t = self.timeout_s
        sync_calls(
            "weight group setup",
            self.policy,
            ("init_weight_sender", lambda: self.policy.call("init_weight_sender", addr, port, world, self.backend, t)),
            self.rollout.engines,
            [
                (
                    "init_weight_group",
                    functools.partial(
                        g.call_rank,
                        0,
                        "init_weight_group",
                        addr,
                        port,
                        world,
                        rank_offset=off,
                        backend=self.backend,
                        timeout_s=t,
                    ),
                )
                for g, off in zip(self.rollout.engines, offsets, strict=True)
            ],
            self.pids,
        )
        logger.info("weight group: %s:%d, %d ranks (%s)", addr, port, world, self.backend)
        self._ready = True

    def __call__(self, version: int) -> dict:
        if not self._ready:
            self.setup()
        results = sync_calls(
            f"weight sync to version {version}",
            self.policy,
            ("broadcast_weights", lambda: self.policy.call("broadcast_weights", version, self.verify)),
            self.rollout.engines,
            [
                ("receive_weights", functools.partial(g.call_rank, 0, "receive_weights", verify=self.verify))
                for g in self.rollout.engines
            ],
            self.pids,
        )
        stats = results[0][0]
        stats = stats if isinstance(stats, dict) else {}
        if self.verify:
            stats["verify_s"] = verify_engines(self.policy, self.rollout.engines)
        return stats


class IpcWeightSync:
    """Policy rank i -> engine i over CUDA IPC (hybrid engine, tensor parallel 1: one engine per policy rank).

    ZeRO-0/1/2 without LoRA: each engine reads its rank's parameters where they are (no extra copy of the
    model on the GPU, the engine's load is the sync's one device copy), unless the weights move between
    syncs (DeepSpeed sleep offloads them): then, as under ZeRO-3 and LoRA, each rank keeps one packed copy
    of the full weights in its IPC buckets between syncs, and under ZeRO-3 a gathered copy as well while a
    sync runs: plan for one to two extra model copies per GPU there.
    """

    def __init__(self, policy: WorkerGroup, rollout: GroupRollout, *, verify: bool = False):
        if len(rollout.engines) != policy.world_size:
            raise ValueError(
                f"CUDA IPC sync pairs policy rank i with engine i on one GPU: {policy.world_size} policy "
                f"ranks but {len(rollout.engines)} engines; use --colocate_all_models with "
                f"vllm_num_engines == actor GPUs (tensor parallel 1), or the broadcast sync"
            )
        self.policy, self.rollout, self.verify = policy, rollout, verify

    def __call__(self, version: int) -> dict:
        t0 = time.perf_counter()
        shared = self.policy.call("share_weights_ipc", version, self.verify)
        t1 = time.perf_counter()
        loaded = concurrently(
            *[
                (lambda g=g, s=s: g.call_rank(0, "update_weights_ipc", s["sync"], version, verify=self.verify))
                for g, s in zip(self.rollout.engines, shared, strict=True)
            ]
        )
        sec = time.perf_counter() - t0
        nbytes = shared[0]["bytes"]  # what each engine loaded (every rank shares the full weights)
        # an engine actor answers {"tensors", "work_s"} (its own time in the load) or the tensor count alone
        work = [n.get("work_s") if isinstance(n, dict) else None for n in loaded]
        tensors = sum(int((n.get("tensors") if isinstance(n, dict) else n) or 0) for n in loaded)
        out = {
            "version": version,
            "tensors": tensors,
            "bytes": nbytes,
            "seconds": sec,
            "gb_per_s": nbytes / max(sec, 1e-9) / 1e9,
            "in_place": bool(shared[0].get("in_place")),
            "share_s": t1 - t0,
            "load_s": sec - (t1 - t0),
        }  # the policy's call, then the engines'
        if "work_s" in shared[0]:  # inside the policy's method; the rest of share_s is the Ray call
            out["share_work_s"] = max(s["work_s"] for s in shared)
        if all(w is not None for w in work):  # inside the engines' actors; the rest of load_s is the Ray call
            out["load_work_s"] = max(w for w in work if w is not None)  # all of them
        if self.verify:
            out["verify_s"] = verify_engines(self.policy, self.rollout.engines)
        return out


class DirectWeightSync:
    """Policy (a :class:`LocalGroup`) -> an engine object in this process, in one update (one vLLM session);
    ``verify``: the engine checks it holds what was sent after every sync."""

    def __init__(self, policy: WorkerGroup, engine: Any, *, verify: bool = False):  # call_rank is all it uses
        self.policy, self.engine, self.verify = policy, engine, verify

    def __call__(self, version: int) -> dict:
        return self.policy.call_rank(0, "push_weights", self.engine, version, self.verify)


def verify_engines(policy: WorkerGroup, engines: Sequence[WorkerGroup]) -> float:
    """Every engine checks it holds the policy's weights (per-tensor count, sum, sum of squares); raises the
    engine's WeightSyncError naming the tensors that differ. Returns the seconds it took."""

    t0 = time.perf_counter()
    expected = policy.call("weight_stats")[0]
    concurrently(*[(lambda g=g: g.call_rank(0, "verify_weights", expected)) for g in engines])
    return time.perf_counter() - t0
