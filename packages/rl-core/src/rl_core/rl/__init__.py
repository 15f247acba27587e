"""The RL loop's moving parts, apart from the loop itself (:mod:`rl_core.trainers.ppo`).

- :mod:`rl_core.rl.experience`: the typed per-sample record (:class:`Experience`), its padded batch, data-parallel
  order.
- :mod:`rl_core.rl.batching`: micro-batches (sequence counts or token budgets, equal over ranks), padded
  or packed rows.
- :mod:`rl_core.rl.workers`: one class per trained role's rank (policy, critic); :mod:`rl_core.rl.frozen_workers`
  the reference and the reward model; :mod:`rl_core.rl.worker_base` what they share;
  :mod:`rl_core.rl.policy_weights` the policy's weights on their way to the engines.
- :mod:`rl_core.rl.objectives`: what the trained roles' ranks train against (the policy's loss and its terms, the
  critic's value loss and optimizer), resolved once from the run's config and handed to the workers.
- :mod:`rl_core.rl.ds_sleep`: DeepSpeed sleep, the trained roles' states in host memory while the engines generate.
- :mod:`rl_core.rl.groups`: the worker-group protocol, the in-process group, generation over
  engine groups; :mod:`rl_core.rl.weight_syncs`: the weight syncs (collective broadcast, CUDA IPC, in-process).
- :mod:`rl_core.rl.roles`: which roles a run has (decided once) and the check that it has a reward.
- :mod:`rl_core.rl.build` (import it by name: it needs the trainers): the one builder: a run config and a group factory in, the roles, engines,
  weight sync and loop of a run out (``rl ppo``, ``rl ppo-ray``, ``rl demo``, benchmarks, tests).

The names below load on first use (PEP 562): importing a light module of the package (a config) imports no
torch.
"""

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rl_core.rl.batching import plan_micro_batches
    from rl_core.rl.batching_config import MicroBatchConfig
    from rl_core.rl.experience import Experience, ExperienceBatch, collate, dp_order, make_item, rows
    from rl_core.rl.frozen_workers import ReferenceWorker, RewardModelWorker
    from rl_core.rl.groups import EngineFailure, GroupRollout, LocalGroup, WorkerGroup, concurrently
    from rl_core.rl.objectives import CriticObjective, PolicyObjective
    from rl_core.rl.policy_weights import PolicyWeights, hf_names
    from rl_core.rl.weight_syncs import BroadcastWeightSync, DirectWeightSync, IpcWeightSync
    from rl_core.rl.workers import CriticWorker, PolicyWorker

# name -> the submodule that defines it, imported on first use
_LAZY = {
    "plan_micro_batches": "rl_core.rl.batching",
    "MicroBatchConfig": "rl_core.rl.batching_config",
    **dict.fromkeys(
        ("Experience", "ExperienceBatch", "collate", "dp_order", "make_item", "rows"), "rl_core.rl.experience"
    ),
    **dict.fromkeys(("ReferenceWorker", "RewardModelWorker"), "rl_core.rl.frozen_workers"),
    **dict.fromkeys(
        ("EngineFailure", "GroupRollout", "LocalGroup", "WorkerGroup", "concurrently"), "rl_core.rl.groups"
    ),
    **dict.fromkeys(("CriticObjective", "PolicyObjective"), "rl_core.rl.objectives"),
    **dict.fromkeys(("PolicyWeights", "hf_names"), "rl_core.rl.policy_weights"),
    **dict.fromkeys(("BroadcastWeightSync", "DirectWeightSync", "IpcWeightSync"), "rl_core.rl.weight_syncs"),
    **dict.fromkeys(("CriticWorker", "PolicyWorker"), "rl_core.rl.workers"),
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value  # the next access skips this function
        return value
    raise AttributeError(f"module 'rl_core.rl' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *_LAZY])


__all__ = [
    "BroadcastWeightSync",
    "CriticObjective",
    "CriticWorker",
    "DirectWeightSync",
    "EngineFailure",
    "Experience",
    "ExperienceBatch",
    "GroupRollout",
    "IpcWeightSync",
    "LocalGroup",
    "MicroBatchConfig",
    "PolicyObjective",
    "PolicyWeights",
    "PolicyWorker",
    "ReferenceWorker",
    "RewardModelWorker",
    "WorkerGroup",
    "collate",
    "concurrently",
    "dp_order",
    "hf_names",
    "make_item",
    "plan_micro_batches",
    "rows",
]
