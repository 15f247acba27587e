"""Ray placement groups from a plan: creating them, and where their bundles landed.

This module owns the Ray side of placement, before any actor exists: creating
placement groups (one GPU per bundle) after the plan has been validated against
the live cluster (:func:`create_placement_groups`, :func:`create_placement_group`,
:func:`cluster_gpus`), mapping each bundle to its node and GPU
(:func:`bundle_node_ids`, :func:`bundle_gpu_ids`), ordering bundles node-major
(:func:`node_ordered_bundles`), and :class:`PlacementGroups`, which maps a
plan's logical bundles to Ray's and gives each model role (:class:`PlacedRole`)
and vLLM engine (:class:`PlacedEngine`) its bundles. Removing groups waits until
their GPUs are free again.

Every wait has a timeout; a group that cannot be placed is removed and reported
as a :class:`~rl_placement.specs.PlacementError`. Starting actors on the
bundles is :mod:`rl_placement.groups`' business.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import ray
from ray.util.placement_group import PlacementGroup, placement_group, placement_group_table, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from rl_placement.plan import PlacementPlan
from rl_placement.specs import BundleGroup, PlacementError, Role

__all__ = [
    "STRATEGIES",
    "PlacedEngine",
    "PlacedRole",
    "PlacementGroups",
    "bundle_gpu_ids",
    "bundle_node_ids",
    "cluster_gpus",
    "create_placement_group",
    "create_placement_groups",
    "node_ordered_bundles",
]

STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")


def cluster_gpus() -> tuple[int, int]:
    """(total GPUs, most GPUs on one node) over the alive nodes of the connected cluster."""
    per_node = [int(n["Resources"].get("GPU", 0)) for n in ray.nodes() if n.get("Alive")]
    return sum(per_node), max(per_node, default=0)


def create_placement_group(
    num_bundles: int,
    *,
    strategy: str = "PACK",
    gpus_per_bundle: float = 1.0,
    cpus_per_bundle: float = 0.0,
    timeout_s: float = 60.0,
    name: str = "",
) -> PlacementGroup:
    """A placement group of ``num_bundles`` bundles, ready, or PlacementError after ``timeout_s``."""
    if strategy not in STRATEGIES:
        raise PlacementError(f"placement strategy {strategy!r} is not one of {', '.join(STRATEGIES)}")
    if num_bundles < 1:
        raise PlacementError(f"a placement group needs at least one bundle, got num_bundles={num_bundles}")
    bundle = {"GPU": gpus_per_bundle}
    if cpus_per_bundle:
        bundle["CPU"] = cpus_per_bundle
    if not any(bundle.values()):
        raise PlacementError("a bundle must ask for something: gpus_per_bundle and cpus_per_bundle are both 0")
    bundle = {k: v for k, v in bundle.items() if v}
    pg = placement_group([dict(bundle) for _ in range(num_bundles)], strategy=strategy)
    ready, _ = ray.wait([pg.ready()], timeout=timeout_s)
    if not ready:
        remove_placement_group(pg)
        free = ray.available_resources().get("GPU", 0)
        total, per_node = cluster_gpus()
        raise PlacementError(
            f"placement group {name or '(unnamed)'} of {num_bundles} bundles {bundle} ({strategy}) was not placed "
            f"within {timeout_s:g} s: the cluster has {free:g} of {total} GPUs free, at most {per_node} per node "
            f"(other placement groups or actors may hold the rest; STRICT_ strategies need the nodes to match)"
        )
    return pg


def bundle_node_ids(pg: PlacementGroup) -> dict[int, str]:
    """Ray bundle index -> id (hex) of the node it was placed on."""
    table = placement_group_table(pg)
    return {int(k): v for k, v in table["bundles_to_node_id"].items()}


@ray.remote(num_cpus=0)
def _visible_gpus() -> tuple[str, ...]:
    return tuple(str(g) for g in ray.get_gpu_ids())


def bundle_gpu_ids(pg: PlacementGroup, bundle_indices: Sequence[int], *, timeout_s: float = 60.0) -> list[str]:
    """The GPU id Ray gives each of ``bundle_indices`` (one-GPU bundles), in that order.

    For a process that drives several bundles' GPUs itself, such as a vLLM engine with
    tensor parallel > 1 and its own worker processes: it sets ``CUDA_VISIBLE_DEVICES`` to
    these. A tiny task on each bundle reads ``ray.get_gpu_ids()``; it needs 0.01 of the
    bundle's GPU free, so call this before actors fill the bundles.
    """
    nodes = bundle_node_ids(pg)
    refs = [
        _visible_gpus.options(
            num_gpus=0.01, scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=b)
        ).remote()
        for b in bundle_indices
    ]
    ready, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
    if len(ready) < len(refs):
        for r in refs:
            ray.cancel(r, force=True)
        raise PlacementError(
            f"bundles {list(bundle_indices)}: no GPU id within {timeout_s:g} s (a probe needs "
            f"0.01 GPU free on each: call bundle_gpu_ids before actors take the bundles)"
        )
    ids = ray.get(refs)
    bad = {b: g for b, g in zip(bundle_indices, ids, strict=True) if len(g) != 1}
    if bad:
        raise PlacementError(
            f"bundles {bad} see {'/'.join(map(str, bad.values()))} GPUs: bundle_gpu_ids needs one-GPU bundles"
        )
    if len({nodes[b] for b in bundle_indices}) > 1:
        raise PlacementError(
            f"bundles {list(bundle_indices)} are on several nodes: one process cannot drive their GPUs"
        )
    return [g[0] for g in ids]


def node_ordered_bundles(pg: PlacementGroup) -> list[int]:
    """Bundle indices grouped by node (nodes in order of their first bundle), so ranks run node-major.

    SPREAD may put bundles 0 and 2 on one node and 1 and 3 on another; ranks
    taken in this order keep each node's ranks contiguous (LOCAL_RANK 0..k-1).
    """
    by_node: dict[str, list[int]] = {}
    for index, node in sorted(bundle_node_ids(pg).items()):
        by_node.setdefault(node, []).append(index)
    return [i for indices in by_node.values() for i in indices]


@dataclass(frozen=True)
class PlacedRole:
    """A model role's placement: rank i on ``bundle_indices[i]`` of ``placement_group``."""

    role: Role
    placement_group: PlacementGroup
    bundle_indices: tuple[int, ...]
    gpu_share: float


@dataclass(frozen=True)
class PlacedEngine:
    """A vLLM engine's bundles (one per TP rank, Ray indices) in ``placement_group``, all on ``node_id``.

    Create the engine actor on ``bundle_indices[0]`` and hand vLLM's Ray
    executor the group and these indices; each TP worker asks for ``gpu_share``.
    """

    engine: int
    placement_group: PlacementGroup
    bundle_indices: tuple[int, ...]
    gpu_share: float
    node_id: str


class PlacementGroups:
    """The Ray placement groups of a plan, by group name, with logical -> Ray bundle order."""

    def __init__(self, plan: PlacementPlan, groups: dict[str, tuple[BundleGroup, PlacementGroup, list[int]]]):
        self.plan = plan
        self._groups = groups

    def placement_group(self, name: str) -> PlacementGroup:
        return self._groups[name][1]

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self._groups)

    def role(self, role: Role | str) -> PlacedRole:
        logical = self.plan.placement(role)
        _, pg, order = self._groups[logical.group]
        return PlacedRole(logical.role, pg, tuple(order[i] for i in logical.bundle_indices), logical.gpu_share)

    def engines(self) -> tuple[PlacedEngine, ...]:
        out = []
        for eb in self.plan.engine_bundles():
            _, pg, order = self._groups[eb.group]
            indices = tuple(order[i] for i in eb.bundle_indices)
            nodes = bundle_node_ids(pg)
            out.append(PlacedEngine(eb.engine, pg, indices, eb.gpu_share, nodes[indices[0]]))
        return tuple(out)

    def remove(self, timeout: float = 10.0) -> None:
        """Remove every placement group (shut the actor groups on them down first); waits up to ``timeout``."""
        _remove_and_wait([pg for _, pg, _ in self._groups.values()], time.monotonic() + timeout)
        self._groups = {}


def _remove_and_wait(pgs: list[PlacementGroup], deadline: float) -> None:
    """Remove ``pgs`` and wait until their bundles are gone from the nodes' resources.

    The GCS marks a group REMOVED before the raylets give its GPUs back; until
    then a new PACK group sees busy nodes and spreads.
    """
    for pg in pgs:
        try:
            remove_placement_group(pg)
        except Exception:  # already removed, or the cluster is gone: nothing left to free
            pass
    ids = {pg.id.hex() for pg in pgs}
    while ids and time.monotonic() < deadline:
        try:
            held = {key for key in ray.available_resources() if key.startswith("bundle_group_")}
        except Exception:
            return
        ids = {i for i in ids if any(key.endswith(i) for key in held)}
        if ids:
            time.sleep(0.05)


def create_placement_groups(
    plan: PlacementPlan, *, strategy: str = "PACK", cpus_per_bundle: float = 0.0, timeout_s: float = 60.0
) -> PlacementGroups:
    """Validate ``plan`` against the connected cluster, then create its placement groups.

    ``strategy`` applies to model groups (PACK: fewest nodes; SPREAD: across
    nodes); a separate engine's group is always STRICT_PACK so its TP ranks
    share a node. Nothing is created when validation fails; if a group cannot
    be placed in ``timeout_s``, the groups made so far are removed.
    """
    if strategy not in STRATEGIES:
        raise PlacementError(f"placement strategy {strategy!r} is not one of {', '.join(STRATEGIES)}")
    total, per_node = cluster_gpus()
    plan.validate(cluster_gpus=total, gpus_per_node=per_node)
    made: dict[str, tuple[BundleGroup, PlacementGroup, list[int]]] = {}
    try:
        for group in plan.bundle_groups():
            pg = create_placement_group(
                group.num_bundles,
                strategy="STRICT_PACK" if group.one_node else strategy,
                cpus_per_bundle=cpus_per_bundle,
                timeout_s=timeout_s,
                name=group.name,
            )
            made[group.name] = (group, pg, node_ordered_bundles(pg))
        placed = PlacementGroups(plan, made)
        for engine in placed.engines():
            nodes = bundle_node_ids(engine.placement_group)
            spans = sorted({nodes[i] for i in engine.bundle_indices})
            if len(spans) > 1:
                raise PlacementError(
                    f"vLLM engine {engine.engine}'s TP bundles {list(engine.bundle_indices)} landed on "
                    f"{len(spans)} nodes: a TP group must sit on one node; use strategy PACK and a "
                    f"vllm_tensor_parallel_size that divides the GPUs per node"
                )
    except BaseException:
        PlacementGroups(plan, made).remove()
        raise
    return placed
