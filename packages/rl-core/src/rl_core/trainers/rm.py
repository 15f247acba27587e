"""Reward-model trainer: pairwise ranking loss on chosen/rejected pairs; writes reward mean/std.

Each micro-batch of ``m`` pairs is one ``[2m, T]`` forward (:func:`rl_core.data.preference_collate`:
chosen rows first, then the matching rejected rows) through a
:class:`rl_core.models.RewardModel`, or with the dataset's ``packing`` one packed row of the ``2m``
sequences, each scored at its last token (OpenRLHF's ``--packing_samples``: the same scores, no
padding); the loss is ``rl_algos.pairwise_loss`` (``sigmoid`` = -log sigmoid(c - r - margin), or
``logexp``), averaged over the global batch. The dataset's ``margin`` column is used when ``margin_loss`` is on.
After training the scores of every chosen and rejected response of the training
set give the mean/std stored with the model (``rl_head.json``), which
``RewardModel(normalize=True)`` applies at inference, as OpenRLHF does.

Evaluation (:meth:`RewardModelTrainer.eval_metrics`): the same loss over every pair of the
eval set, ``acc`` (fraction of pairs with chosen score > rejected score), the mean reward gap
and the mean chosen / rejected scores.
"""

from __future__ import annotations

import torch

from rl_algos import pairwise_loss
from rl_core.data import model_inputs, preference_collate
from rl_core.trainers.base import Trainer
from rl_core.trainers.configs import RMConfig  # noqa: F401 - re-exported: the settings live beside, torch-free


class RewardModelTrainer(Trainer):
    name = "rm"
    progress_keys = ("loss", "acc")
    supports_packing = True
    cfg: RMConfig  # the Trainer's cfg (RewardModelTrainer takes the Trainer's __init__)

    def collate(self, items: list[dict]) -> dict:
        return preference_collate(items, self.pad_id, packing=self.packing)

    def _scores(self, items: list[dict]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        b = self.to_device(self.collate(items))
        scores = self.engine(**model_inputs(b))
        m = len(items)
        return scores[:m], scores[m:], b["margin"]

    def train_step(self, indices: list[int]) -> dict[str, float]:
        acc = self.plan.accumulation_steps
        loss_sum, correct, gap, chosen_mean, rejected_mean = 0.0, 0.0, 0.0, 0.0, 0.0
        for items in self.micro_batches(indices):
            chosen, rejected, margin = self._scores(items)
            loss = pairwise_loss(chosen, rejected, margin if self.cfg.margin_loss else None, kind=self.cfg.loss) / acc
            self.s.backward(loss, self.engine)
            self.s.optimizer_step(self.engine)
            loss_sum += loss.item()
            correct += (chosen > rejected).float().mean().item() / acc
            gap += (chosen - rejected).mean().item() / acc
            chosen_mean += chosen.mean().item() / acc
            rejected_mean += rejected.mean().item() / acc
        return self.s.all_reduce(
            {
                "loss": loss_sum,
                "acc": correct,
                "reward_gap": gap,
                "chosen_reward": chosen_mean,
                "rejected_reward": rejected_mean,
            },
            "mean",
        )

    def eval_metrics(self, dataset) -> dict[str, float]:
        scores = self.per_row(lambda items: torch.stack([x.float() for x in self._scores(items)], dim=1), 3, dataset)
        chosen, rejected, margin = scores.unbind(1)
        loss = pairwise_loss(chosen, rejected, margin if self.cfg.margin_loss else None, kind=self.cfg.loss)
        return {
            "loss": loss.item(),
            "acc": (chosen > rejected).double().mean().item(),
            "reward_gap": (chosen - rejected).mean().item(),
            "chosen_reward": chosen.mean().item(),
            "rejected_reward": rejected.mean().item(),
        }

    def reward_stats(self) -> tuple[float, float]:
        """Mean and std of the scores of every chosen and rejected training response."""
        self.engine.eval()
        scores = self.per_row(lambda items: torch.stack(self._scores(items)[:2], dim=1), 2)
        return scores.mean().item(), scores.std(unbiased=False).item()

    def before_export(self) -> None:
        if not self.cfg.normalize_reward:
            return
        mean, std = self.reward_stats()
        module = self.engine.module
        module.mean, module.std = mean, max(std, 1e-8)
        self.metrics.log(self.step, {"eval/reward_mean": mean, "eval/reward_std": std})
