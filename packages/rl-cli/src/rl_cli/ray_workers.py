"""The classes ``rl ppo-ray`` starts as Ray actors: rl-core's role workers and a rollout engine host.

They are the plain classes plus one fix a Ray actor needs: Ray narrows
``CUDA_VISIBLE_DEVICES`` to the actor's own GPU, so the local device index is 0
whatever LOCAL_RANK the group computed from the node's ranks (DeepSpeed and the
strategy read LOCAL_RANK to pick the device).
"""

from __future__ import annotations

import os

from rl_core.rl.workers import CriticWorker, PolicyWorker, ReferenceWorker, RewardModelWorker


def _one_visible_gpu() -> None:
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and visible.strip() and "," not in visible:
        os.environ["LOCAL_RANK"] = "0"


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


class RolloutEngineActor:
    """One rollout engine (rl-rollout's HFEngine or VLLMEngine) in a Ray actor, with the methods the loop calls."""

    def __init__(self, kind: str, model: str, hf_options: dict | None = None, vllm_options: dict | None = None):
        _one_visible_gpu()
        import torch

        from rl_rollout import make_engine

        hf = {"device": "cuda" if torch.cuda.is_available() else "cpu", **(hf_options or {})}
        self.engine = make_engine(kind, model, hf_options=hf, vllm_options=vllm_options)
        self.kind = type(self.engine).__name__

    def describe(self) -> dict:
        return {"kind": self.kind, "pid": os.getpid(), "policy_version": self.engine.policy_version}

    def generate(self, requests: list) -> list[list]:
        return self.engine.generate(requests)

    def update_weights(self, named_tensors: list, version: int) -> None:
        self.engine.update_weights(named_tensors, version)

    def update_weights_ipc(self, sync, version: int, verify: bool = False) -> int:
        return self.engine.update_weights_ipc(sync, version, verify=verify)

    def init_weight_group(self, master_addr: str, master_port: int, world_size: int, **kw):
        return self.engine.init_weight_group(master_addr, master_port, world_size, **kw)

    def receive_weights(self, verify: bool = False) -> dict:
        return self.engine.receive_weights(verify=verify).as_dict()

    def weights_digest(self) -> dict[str, float]:
        """Per-parameter sums of an HF engine's weights (HF names), to compare with the policy's."""
        model = getattr(self.engine, "model", None)
        if model is None:
            raise NotImplementedError(f"{self.kind} fuses its weights on load; compare generations instead")
        return {n: p.detach().double().sum().item() for n, p in model.named_parameters()}

    def sleep(self, level: int = 1) -> None:
        self.engine.sleep(level)

    def wake_up(self, tags: list[str] | None = None) -> None:
        self.engine.wake_up(tags)

    def shutdown(self) -> None:
        self.engine.shutdown()
