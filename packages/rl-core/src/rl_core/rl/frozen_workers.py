"""The frozen RL roles' workers: one object per rank of the reference policy and of the reward model.

Same base (:class:`rl_core.rl.worker_base._Worker`: strategy, distributed init, micro-batched no-grad forwards) and
the same calling convention as the trained roles in :mod:`rl_core.rl.workers`; no optimizer, nothing to sync.
``offload`` keeps a role's parameters on the CPU under ZeRO-3 (OpenRLHF's --ref.offload / --reward.offload).

- :class:`ReferenceWorker`: frozen log-probs at the sampling temperature (the KL compares the same distributions).
- :class:`RewardModelWorker`: one score per sample.
"""

from __future__ import annotations

import torch

from rl_core.models import Actor, RewardModel, frozen
from rl_core.rl.batching import MicroBatchConfig
from rl_core.rl.experience import Experience
from rl_core.rl.worker_base import _Worker

__all__ = ["ReferenceWorker", "RewardModelWorker"]


class ReferenceWorker(_Worker):
    """One rank of the frozen reference policy: ``logprobs``."""

    def __init__(
        self,
        strategy_cfg,
        pretrain: str,
        *,
        load_kw: dict | None = None,
        pad_id: int = 0,
        temperature: float = 1.0,
        batching: MicroBatchConfig | None = None,
        packing: bool = False,
        offload: bool = False,
    ):
        super().__init__(strategy_cfg, pad_id=pad_id, batching=batching, packing=packing)

        self.temperature = temperature
        kw = {
            k: v
            for k, v in (load_kw or {}).items()
            if k not in ("lora", "gradient_checkpointing", "freeze_visual_encoder")
        }
        actor = frozen(Actor.from_pretrained(pretrain, **kw))
        self.images = actor.is_vlm
        self.engine = self.s.prepare(actor, train=False, offload=offload)

    def logprobs(self, items: list[Experience]) -> list[torch.Tensor]:
        """Log-probs at the sampling temperature, like the policy's (the KL compares the same distributions)."""
        t = self.temperature
        return self._leader(self._forward_items(lambda **x: self.engine(**x, temperature=t).logprobs, items))


class RewardModelWorker(_Worker):
    """One rank of a reward model: ``score`` (normalised by the stored mean/std unless told otherwise), one
    score per sample read at its last real token, from padded rows or, with ``packing``, packed ones; the
    token budget applies."""

    def __init__(
        self,
        strategy_cfg,
        pretrain: str,
        *,
        load_kw: dict | None = None,
        pad_id: int = 0,
        normalize: bool = True,
        batching: MicroBatchConfig | None = None,
        packing: bool = False,
        offload: bool = False,
    ):
        super().__init__(strategy_cfg, pad_id=pad_id, batching=batching, packing=packing)

        kw = {
            k: v
            for k, v in (load_kw or {}).items()
            if k not in ("lora", "gradient_checkpointing", "freeze_visual_encoder")
        }
        model = RewardModel.from_pretrained(pretrain, require_head=True, **kw)  # a random head scores noise
        for p in model.parameters():
            p.requires_grad_(False)
        self.engine = self.s.prepare(model, train=False, offload=offload)
        self.normalize = normalize

    def score(self, items: list[Experience]) -> list[float]:
        return self._leader(self._forward_items(lambda **x: self.engine(**x, normalize=self.normalize), items))
