"""The classes ``rl ppo-ray`` starts as Ray actors for rl-core's roles (the engines' are in ray_engines).

They are the plain role workers plus one fix a Ray actor needs: Ray narrows
``CUDA_VISIBLE_DEVICES`` to the actor's own GPU, so the local device index is 0
whatever LOCAL_RANK the group computed from the node's ranks (DeepSpeed and the
strategy read LOCAL_RANK to pick the device).
"""

from __future__ import annotations

from rl_cli.ray_engines import RolloutEngineActor, _one_visible_gpu
from rl_core.rl.frozen_workers import ReferenceWorker, RewardModelWorker
from rl_core.rl.workers import CriticWorker, PolicyWorker

__all__ = ["RayCriticWorker", "RayPolicyWorker", "RayReferenceWorker", "RayRewardModelWorker", "RolloutEngineActor"]


class RayPolicyWorker(PolicyWorker):
    def __init__(self, *args, **kwargs):
        _one_visible_gpu()
        super().__init__(*args, **kwargs)


class RayCriticWorker(CriticWorker):
    def __init__(self, *args, **kwargs):
        _one_visible_gpu()
        super().__init__(*args, **kwargs)


class RayReferenceWorker(ReferenceWorker):
    def __init__(self, *args, **kwargs):
        _one_visible_gpu()
        super().__init__(*args, **kwargs)


class RayRewardModelWorker(RewardModelWorker):
    def __init__(self, *args, **kwargs):
        _one_visible_gpu()
        super().__init__(*args, **kwargs)
