"""rl_placement: where the processes of an RL run go, on Ray.

Pure Python (no Ray): :mod:`rl_placement.specs` holds the value types (model
roles, colocation modes, role and engine specs, slots, bundle groups, GPU
shares); :mod:`rl_placement.plan` holds :class:`PlacementPlan` (policy, critic,
ref and reward roles and vLLM engines), its layout on one-GPU bundles,
validation with errors that say which numbers disagree, and a readable GPU map.

On Ray: :mod:`rl_placement.bundles` turns a plan into Ray placement groups and
says where each bundle landed; :mod:`rl_placement.groups` starts
:class:`RayActorGroup` s of any class on them with the torch.distributed
environment set, whose calls wait through :mod:`rl_placement.calls` (bounded, errors naming role and rank). Knows nothing of models; depends on Ray only.

The Ray names load on first use, so ``import rl_placement`` and building or
validating a plan do not import Ray (a CLI can check its flags in milliseconds).
"""

import importlib
from typing import TYPE_CHECKING

from rl_placement.plan import PlacementPlan
from rl_placement.specs import (
    FLAG_PREFIX,
    MODEL_ROLES,
    BundleGroup,
    Colocation,
    EngineBundles,
    EngineLayout,
    PlacementError,
    Role,
    RolePlacement,
    RoleSpec,
    Slot,
    gpu_share,
)

if TYPE_CHECKING:
    from rl_placement.bundles import (
        STRATEGIES,
        PlacedEngine,
        PlacedRole,
        PlacementGroups,
        bundle_gpu_ids,
        bundle_node_ids,
        cluster_gpus,
        create_placement_group,
        create_placement_groups,
        node_ordered_bundles,
    )
    from rl_placement.calls import ActorCallError, RankFailure
    from rl_placement.groups import RankInfo, RayActorGroup

__version__ = "0.6.0"

# Ray names -> the submodule that defines them, imported on first use.
_RAY_NAMES = {
    **dict.fromkeys(
        (
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
        ),
        "rl_placement.bundles",
    ),
    **dict.fromkeys(("ActorCallError", "RankFailure"), "rl_placement.calls"),
    **dict.fromkeys(("RankInfo", "RayActorGroup"), "rl_placement.groups"),
}


def __getattr__(name: str):
    if name in _RAY_NAMES:
        return getattr(importlib.import_module(_RAY_NAMES[name]), name)
    raise AttributeError(f"module 'rl_placement' has no attribute {name!r}")


__all__ = [
    "FLAG_PREFIX",
    "MODEL_ROLES",
    "STRATEGIES",
    "ActorCallError",
    "BundleGroup",
    "Colocation",
    "EngineBundles",
    "EngineLayout",
    "PlacedEngine",
    "PlacedRole",
    "PlacementError",
    "PlacementGroups",
    "PlacementPlan",
    "RankFailure",
    "RankInfo",
    "RayActorGroup",
    "Role",
    "RolePlacement",
    "RoleSpec",
    "Slot",
    "bundle_gpu_ids",
    "bundle_node_ids",
    "cluster_gpus",
    "create_placement_group",
    "create_placement_groups",
    "gpu_share",
    "node_ordered_bundles",
]
