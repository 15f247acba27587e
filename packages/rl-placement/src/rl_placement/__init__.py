"""rl_placement: where the processes of an RL run go, on Ray.

:mod:`rl_placement.plan` is pure Python: a :class:`PlacementPlan` of model roles
(actor, critic, ref, reward) and vLLM engines, its colocation modes, validation
with errors that say which numbers disagree, and a readable GPU map.
:mod:`rl_placement.groups` turns a plan into Ray placement groups and starts
:class:`RayActorGroup` s of any class on them with the torch.distributed
environment set. Knows nothing of models; depends on Ray only.

The Ray names load on first use, so ``import rl_placement`` and building or
validating a plan do not import Ray (a CLI can check its flags in milliseconds).
"""

from typing import TYPE_CHECKING

from rl_placement.plan import (
    BundleGroup,
    Colocation,
    EngineBundles,
    EngineSpec,
    PlacementError,
    PlacementPlan,
    Role,
    RolePlacement,
    RoleSpec,
    Slot,
    gpu_share,
)

if TYPE_CHECKING:
    from rl_placement.groups import (
        STRATEGIES,
        ActorCallError,
        PlacedEngine,
        PlacedRole,
        PlacementGroups,
        RankFailure,
        RankInfo,
        RayActorGroup,
        bundle_gpu_ids,
        bundle_node_ids,
        cluster_gpus,
        create_placement_group,
        create_placement_groups,
        node_ordered_bundles,
    )

__version__ = "0.2.0"

_RAY_NAMES = {
    "STRATEGIES", "ActorCallError", "PlacedEngine", "PlacedRole", "PlacementGroups", "RankFailure", "RankInfo",
    "RayActorGroup", "bundle_gpu_ids", "bundle_node_ids", "cluster_gpus", "create_placement_group", "create_placement_groups",
    "node_ordered_bundles",
}


def __getattr__(name: str):
    if name in _RAY_NAMES:
        from rl_placement import groups

        return getattr(groups, name)
    raise AttributeError(f"module 'rl_placement' has no attribute {name!r}")

__all__ = [
    "STRATEGIES", "ActorCallError", "BundleGroup", "Colocation", "EngineBundles", "EngineSpec", "PlacedEngine",
    "PlacedRole", "PlacementError", "PlacementGroups", "PlacementPlan", "RankFailure", "RankInfo", "RayActorGroup",
    "Role", "RolePlacement", "RoleSpec", "Slot", "bundle_node_ids", "cluster_gpus", "create_placement_group",
    "create_placement_groups", "gpu_share", "node_ordered_bundles",
]
