"""Ray actor groups: one actor per rank on placed bundles, and calls that never hang.

This module owns :class:`RayActorGroup`, which starts one actor of any class per
rank with the torch.distributed environment set (:class:`RankInfo` says where
each rank sits), fans calls out, shards calls over data-parallel ranks, checks
health and shuts down. Its calls wait through :mod:`rl_placement.calls`, which
owns the errors they raise (:class:`ActorCallError`, one :class:`RankFailure`
per failed rank; re-exported here).

Every wait has a timeout. A dead, failing or hung actor becomes an
:class:`ActorCallError` naming role, rank and method; the caller is never left
hanging. It knows nothing of models: wiring vLLM or DeepSpeed into the actors is
the caller's business. The placement groups the actors sit on come from
:mod:`rl_placement.bundles`, whose public names are re-exported here.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import ray
from ray.util.placement_group import PlacementGroup
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy, PlacementGroupSchedulingStrategy

from rl_placement.bundles import (
    STRATEGIES,
    PlacedEngine,
    PlacedRole,
    PlacementGroups,
    _remove_and_wait,
    bundle_node_ids,
    cluster_gpus,
    create_placement_group,
    create_placement_groups,
    node_ordered_bundles,
)
from rl_placement.calls import ActorCallError, RankFailure
from rl_placement.calls import gather as _gather
from rl_placement.specs import PlacementError, Role

# The placement-group names above are re-exported: they were importable from here before
# rl_placement.bundles existed, and callers still import them from rl_placement.groups.
__all__ = [
    "STRATEGIES",
    "ActorCallError",
    "PlacedEngine",
    "PlacedRole",
    "PlacementGroups",
    "RankFailure",
    "RankInfo",
    "RayActorGroup",
    "bundle_node_ids",
    "cluster_gpus",
    "create_placement_group",
    "create_placement_groups",
    "node_ordered_bundles",
]

# ----- actor groups ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class RankInfo:
    rank: int
    local_rank: int
    local_world_size: int
    bundle_index: int
    node_id: str


def _free_port() -> tuple[str, int]:
    """This node's IP and a port free on it now (run on rank 0's node)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        port = s.getsockname()[1]
    return ray.util.get_node_ip_address(), port


_ENV_KWARG = "_rl_placement_env"


def _with_env(cls: type) -> type:
    """A subclass of ``cls`` whose __init__ first sets the rank's environment.

    Setting os.environ here rather than through Ray's runtime_env keeps actor
    start-up cheap (a runtime_env per rank costs seconds each) and still runs
    before the user's __init__, where init_process_group("env://") reads it.
    """

    class Ranked(cls):  # type: ignore[misc, valid-type]
        def __init__(self, *args, **kwargs):
            os.environ.update(kwargs.pop(_ENV_KWARG))
            super().__init__(*args, **kwargs)

    Ranked.__name__ = cls.__name__
    Ranked.__qualname__ = cls.__qualname__  # Ray's task names (ray::Worker.step) show the user's class
    Ranked.__doc__ = cls.__doc__
    return Ranked


class RayActorGroup:
    """One Ray actor of ``cls`` per rank, on the given bundles, with torch.distributed env set.

    Each rank gets MASTER_ADDR / MASTER_PORT (rank 0's node IP and a port free
    there), RANK, WORLD_SIZE, LOCAL_RANK (its index among this group's ranks on
    its node), LOCAL_WORLD_SIZE, plus ``env``, in os.environ before
    ``cls.__init__`` runs. Ranks follow ``bundle_indices`` (default: the
    group's bundles in node order). ``cls`` is a plain class; Ray options go in
    ``actor_options``.

    Calls: :meth:`call` (all ranks, results in rank order), :meth:`call_rank`,
    :meth:`call_sharded` (a list split across ranks), :meth:`health_check`,
    :meth:`shutdown`. ``timeout`` bounds every call (``call_timeout_s`` when
    omitted); a rank that dies, raises or does not answer in time raises
    ActorCallError. After such an error the other ranks may still be busy or
    stuck in a collective: shut the group down rather than call it again.

    The constructor waits for every rank's ``__init__`` (``start_timeout_s``); with ``wait=False`` it returns once
    the actors are asked for, and :meth:`wait_ready` (or the first call) waits: make several groups that way to
    load their models at the same time.
    """

    def __init__(
        self,
        cls: type,
        role: str,
        num_ranks: int,
        *,
        placement_group: PlacementGroup,
        bundle_indices: Sequence[int] | None = None,
        num_gpus_per_actor: float = 1.0,
        num_cpus_per_actor: float = 0.0,
        env: dict[str, str] | None = None,
        init_args: Sequence[Any] = (),
        init_kwargs: dict[str, Any] | None = None,
        actor_options: dict[str, Any] | None = None,
        master_port: int | None = None,
        start_timeout_s: float = 120.0,
        call_timeout_s: float = 3600.0,
        owns_placement_group: bool = False,
        wait: bool = True,
    ):
        if isinstance(cls, ray.actor.ActorClass):
            raise TypeError(
                f"RayActorGroup({role!r}) needs the plain class, not a @ray.remote one: drop the "
                f"decorator and pass its options as actor_options={{...}}"
            )
        if isinstance(num_ranks, bool) or not isinstance(num_ranks, int) or num_ranks < 1:
            raise ValueError(f"{role}: num_ranks must be a positive integer, got {num_ranks!r}")
        self.role = str(role)
        self.call_timeout_s = call_timeout_s
        self._init: tuple[dict[int, Any], float, float, float] | None = None  # pending __init__s (wait=False)
        self._pg = placement_group
        self._owns_pg = owns_placement_group
        self._closed = False
        self.actors: list[Any] = []
        nodes = bundle_node_ids(placement_group)
        if bundle_indices is None:
            ordered = node_ordered_bundles(placement_group)
            if num_ranks > len(ordered):
                raise PlacementError(
                    f"{role}: {num_ranks} ranks need {num_ranks} bundles but the placement group has {len(ordered)}"
                )
            bundle_indices = ordered[:num_ranks]
        bundle_indices = list(bundle_indices)
        if len(bundle_indices) != num_ranks:
            raise PlacementError(
                f"{role}: {num_ranks} ranks but {len(bundle_indices)} bundle indices "
                f"{bundle_indices}: give one bundle index per rank"
            )
        unknown = [b for b in bundle_indices if b not in nodes]
        if unknown:
            raise PlacementError(
                f"{role}: bundle indices {unknown} are not in the placement group (it has bundles 0..{len(nodes) - 1})"
            )
        rank_nodes = [nodes[b] for b in bundle_indices]
        self.ranks = [
            RankInfo(r, rank_nodes[:r].count(node), rank_nodes.count(node), b, node)
            for r, (b, node) in enumerate(zip(bundle_indices, rank_nodes, strict=True))
        ]
        try:
            master_addr, port = self._master(rank_nodes[0], master_port, start_timeout_s)
            remote_cls: Any = ray.remote(_with_env(cls))
            for info in self.ranks:
                rank_env = {
                    **(env or {}),
                    "MASTER_ADDR": master_addr,
                    "MASTER_PORT": str(port),
                    "RANK": str(info.rank),
                    "WORLD_SIZE": str(num_ranks),
                    "LOCAL_RANK": str(info.local_rank),
                    "LOCAL_WORLD_SIZE": str(info.local_world_size),
                }
                options = {
                    "num_cpus": num_cpus_per_actor,
                    "num_gpus": num_gpus_per_actor,
                    "max_restarts": 0,
                    **(actor_options or {}),
                    "scheduling_strategy": PlacementGroupSchedulingStrategy(
                        placement_group, placement_group_bundle_index=info.bundle_index
                    ),
                }
                self.actors.append(
                    remote_cls.options(**options).remote(*init_args, **(init_kwargs or {}), **{_ENV_KWARG: rank_env})
                )
            refs = {r: a.__ray_ready__.remote() for r, a in enumerate(self.actors)}
            self._init = (refs, time.monotonic() + start_timeout_s, num_gpus_per_actor, num_cpus_per_actor)
            if wait:
                self.wait_ready()
        except BaseException:
            self.shutdown()
            raise

    def wait_ready(self) -> None:
        """Wait for every rank's ``__init__`` (at most ``start_timeout_s`` from the group's creation); raise
        :class:`ActorCallError` for the ranks that failed or did not start, and shut the group down then. A group
        made with ``wait=False`` is waited for here, or at its first call: several groups made that way load
        their models at the same time (OpenRLHF starts its models' ``__init__``s together the same way)."""
        if self._init is None:
            return
        refs, deadline, gpus, cpus = self._init
        try:
            _gather(self.role, "__init__", refs, max(deadline - time.monotonic(), 0.0), fail_fast=False)
        except ActorCallError as err:
            # An actor Ray cannot schedule looks like a hung __init__: say what it asked for.
            lacks = f"; or its bundle lacks the {gpus:g} GPU / {cpus:g} CPU it asks for"
            failures = [f if f.error else replace(f, cause=f.cause + lacks) for f in err.failures]
            self.shutdown()
            raise ActorCallError(self.role, "__init__", failures) from err.__cause__
        self._init = None

    @classmethod
    def from_plan(cls, actor_cls: type, placed: PlacementGroups, role: Role | str, **kwargs: Any) -> RayActorGroup:
        """The group of a plan's model role: its ranks, bundles and GPU share from the plan."""
        where = placed.role(role)
        return cls(
            actor_cls,
            where.role.value,
            len(where.bundle_indices),
            placement_group=where.placement_group,
            bundle_indices=where.bundle_indices,
            num_gpus_per_actor=where.gpu_share,
            **kwargs,
        )

    def _master(self, node_id: str, port: int | None, timeout: float) -> tuple[str, int]:
        probe = ray.remote(num_cpus=0)(_free_port).options(
            scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False)
        )
        addr, free = _gather(self.role, "find MASTER_ADDR/MASTER_PORT", {0: probe.remote()}, timeout)[0]
        return addr, port if port is not None else free

    @property
    def world_size(self) -> int:
        return len(self.ranks)

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"the {self.role} group was shut down: make a new RayActorGroup")
        self.wait_ready()

    def call(self, method: str, *args: Any, timeout: float | None = None, **kwargs: Any) -> list[Any]:
        """``method(*args, **kwargs)`` on every rank; results in rank order."""
        self._check_open()
        refs = {r: getattr(a, method).remote(*args, **kwargs) for r, a in enumerate(self.actors)}
        results = _gather(self.role, method, refs, self.call_timeout_s if timeout is None else timeout)
        return [results[r] for r in range(self.world_size)]

    def call_rank(self, rank: int, method: str, *args: Any, timeout: float | None = None, **kwargs: Any) -> Any:
        """``method`` on one rank (rank 0 saving a checkpoint, say)."""
        self._check_open()
        if not 0 <= rank < self.world_size:
            raise ValueError(f"{self.role}: rank {rank} is out of range 0..{self.world_size - 1}")
        ref = getattr(self.actors[rank], method).remote(*args, **kwargs)
        return _gather(self.role, method, {rank: ref}, self.call_timeout_s if timeout is None else timeout)[rank]

    def call_sharded(
        self,
        method: str,
        items: Sequence[Any],
        *args: Any,
        timeout: float | None = None,
        allow_uneven: bool = False,
        **kwargs: Any,
    ) -> list[Any]:
        """Split ``items`` into contiguous shards, rank r gets shard r; concatenate the returned lists.

        ``method(shard, *args, **kwargs)`` must return a list. By default the
        items must divide evenly (data-parallel ranks step together); with
        ``allow_uneven`` the first ``len(items) % world_size`` ranks get one
        more, and ranks may get an empty shard (every rank is still called,
        since a collective needs them all).
        """
        self._check_open()
        n, world = len(items), self.world_size
        base, extra = divmod(n, world)
        if extra and not allow_uneven:
            sizes = [base + (r < extra) for r in range(world)]
            raise ValueError(
                f"{self.role}.call_sharded({method!r}): {n} items do not split evenly over {world} ranks "
                f"({n} = {world} x {base} + {extra}); pad to {(base + 1) * world} items, or pass "
                f"allow_uneven=True for shards of {', '.join(map(str, sizes))}"
            )
        bounds = [0]
        for r in range(world):
            bounds.append(bounds[-1] + base + (r < extra))
        refs = {
            r: getattr(a, method).remote(list(items[bounds[r] : bounds[r + 1]]), *args, **kwargs)
            for r, a in enumerate(self.actors)
        }
        results = _gather(self.role, method, refs, self.call_timeout_s if timeout is None else timeout)
        out: list[Any] = []
        for r in range(world):
            if not isinstance(results[r], (list, tuple)):
                raise TypeError(
                    f"{self.role} rank {r}: {method!r} returned {type(results[r]).__name__}, "
                    f"call_sharded needs a list per shard"
                )
            out.extend(results[r])
        return out

    def health_check(self, timeout: float = 10.0) -> None:
        """Ping every rank; ActorCallError listing every dead or unresponsive one.

        A ping waits behind a call still running on that actor, so a rank busy
        past ``timeout`` is reported as unresponsive: check between calls.
        """
        self._check_open()
        refs = {r: a.__ray_ready__.remote() for r, a in enumerate(self.actors)}
        _gather(self.role, "health_check", refs, timeout, fail_fast=False)

    def shutdown(self, timeout: float = 10.0) -> None:
        """Kill every actor and, if this group owns it, remove the placement group. Idempotent.

        Waits (up to ``timeout``) until the actors are dead and the group is
        removed, so their GPUs are free for whatever is placed next; Ray frees
        them asynchronously, and a PACK group made meanwhile would spread.
        """
        deadline = time.monotonic() + timeout
        self._init = None  # nothing left to wait for
        for actor in self.actors:
            try:
                ray.kill(actor, no_restart=True)
            except Exception:  # already dead or the cluster is gone: nothing to stop
                pass
        pings = []
        for actor in self.actors:
            try:
                pings.append(actor.__ray_ready__.remote())
            except Exception:
                pass
        if pings:  # a killed actor's ping fails once Ray has it dead
            ray.wait(pings, num_returns=len(pings), timeout=max(deadline - time.monotonic(), 0))
        self.actors = []
        if self._owns_pg and not self._closed:
            _remove_and_wait([self._pg], deadline)
        self._closed = True

    def __enter__(self) -> RayActorGroup:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()
