"""The classes ``rl ppo-ray`` starts as Ray actors for rl-core's roles (the engines' are in ray_engines).

They are the plain role workers plus what a Ray actor needs before it builds: Ray narrows
``CUDA_VISIBLE_DEVICES`` to the actor's own GPU, so the local device index is 0 whatever LOCAL_RANK the
group computed from the node's ranks (DeepSpeed and the strategy read LOCAL_RANK to pick the device); and
the run's ``--extension`` modules are imported (:data:`rl_cli.extensions.ENV`), so the registries the
worker reads (the policy-loss variant) hold what the driver's do.
"""

from __future__ import annotations

from rl_cli import extensions
from rl_cli.ray_engines import RolloutEngineActor, _one_visible_gpu
from rl_core.rl.frozen_workers import ReferenceWorker, RewardModelWorker
from rl_core.rl.teacher import TeacherWorker
from rl_core.rl.workers import CriticWorker, PolicyWorker

__all__ = [
    "RayCriticWorker",
    "RayPolicyWorker",
    "RayReferenceWorker",
    "RayRewardModelWorker",
    "RayTeacherWorker",
    "RolloutEngineActor",
]


def _as_actor(cls: type) -> type:
    """``cls`` whose ``__init__`` first sets the actor's device and imports the run's extensions."""

    def __init__(self, *args, **kwargs):
        _one_visible_gpu()
        extensions.from_env()
        cls.__init__(self, *args, **kwargs)

    return type(
        f"Ray{cls.__name__}",
        (cls,),
        {"__init__": __init__, "__module__": __name__, "__qualname__": f"Ray{cls.__name__}"},
    )


RayPolicyWorker = _as_actor(PolicyWorker)
RayCriticWorker = _as_actor(CriticWorker)
RayReferenceWorker = _as_actor(ReferenceWorker)
RayRewardModelWorker = _as_actor(RewardModelWorker)
RayTeacherWorker = _as_actor(TeacherWorker)
