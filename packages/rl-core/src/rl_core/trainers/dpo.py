"""DPO trainer: sigmoid DPO, IPO, cDPO label smoothing and an NLL term, against a frozen reference.

Each micro-batch of ``m`` pairs is one ``[2m, T]`` forward of the policy
(:func:`rl_core.data.preference_collate`), or with the dataset's ``packing`` one packed row of
the ``2m`` sequences for the policy and the reference alike (OpenRLHF's ``--packing_samples``);
a response's log-probability is the sum of its token logprobs under the loss mask
(``rl_core.models`` alignment), per sequence either way. The
reference runs beside the policy (a frozen :class:`rl_core.models.Actor` wrapped by
``strategy.prepare(train=False)``, partitioned under ZeRO-3), or with
``precompute_ref`` once over the whole dataset before training, after which it is
released: the same losses at the memory of one model. The loss is
``rl_algos.dpo_loss`` averaged over the global batch; the NLL term (``nll_loss_coef``)
is the token-mean NLL of the chosen responses over the global batch.

Vision-language pairs (``--image_key``: :mod:`rl_core.data.images`): the chosen and the rejected row of a pair
carry their prompt's images, and the policy's and the reference's forwards get the same pixels.

Logged per step: loss, implicit rewards of chosen and rejected
(``beta * (logp - ref_logp)``), their margin, and the fraction of pairs whose
chosen reward is higher (``acc``).

Evaluation (:meth:`DPOTrainer.eval_metrics`): the same quantities over every pair of the
eval set (the NLL term as the token-mean over all its chosen tokens). With
``precompute_ref`` the eval set's reference logprobs are precomputed too, before the
reference is released.
"""

from __future__ import annotations

import gc
import logging

import torch

from rl_algos import dpo_loss
from rl_core.data import model_inputs, preference_collate, sequence_sums
from rl_core.data.images import with_images
from rl_core.trainers.base import Trainer
from rl_core.trainers.configs import DPOConfig  # noqa: F401 - re-exported: the settings live beside, torch-free

logger = logging.getLogger(__name__)


def sequence_logps(engine, batch: dict) -> torch.Tensor:
    """Per-sequence sum of response-token logprobs ``[R]`` of padded rows or a packed row."""
    return sequence_sums(engine(**model_inputs(batch)).logprobs, batch)


class DPOTrainer(Trainer):
    name = "dpo"
    progress_keys = ("loss", "acc", "reward_margin")
    supports_packing = True
    supports_images = True  # chosen and rejected rows share their prompt's pixels, in both models' forwards
    cfg: DPOConfig  # the Trainer's cfg, as __init__ takes it

    def __init__(
        self, strategy, actor, ref_actor, tokenizer, dataset, cfg: DPOConfig, *, eval_dataset=None, logger=None
    ):
        super().__init__(strategy, actor, tokenizer, dataset, cfg, eval_dataset=eval_dataset, logger=logger)
        self.ref = strategy.prepare(ref_actor, train=False, offload=cfg.ref_offload)
        self.ref_logps: torch.Tensor | None = None  # [N, 2] chosen, rejected when precomputed
        self.eval_ref_logps: torch.Tensor | None = None  # [N_eval, 2], the same for the eval set

    def collate(self, items: list[dict]) -> dict:
        batch = preference_collate(items, self.pad_id, packing=self.packing)
        return with_images(batch, [*items, *items], self.image_processor)  # rows: chosen 0..m-1, rejected m..2m-1

    def _ref_pair(self, items: list[dict]) -> torch.Tensor:
        b = self.to_device(self.collate(items))
        with torch.no_grad():
            s = sequence_logps(self.ref, b)
        m = len(items)
        return torch.stack([s[:m], s[m:]], dim=1)

    def before_fit(self) -> None:
        if not self.cfg.precompute_ref or self.ref_logps is not None:
            return
        self.ref_logps = self.per_row(self._ref_pair, 2).float()
        if self.eval_dataset is not None:
            self.eval_ref_logps = self.per_row(self._ref_pair, 2, self.eval_dataset).float()
        self.ref = None  # release the reference: its logprobs are all we need
        gc.collect()
        logger.info(
            "dpo: reference logprobs precomputed for %d pairs (+%d eval pairs); reference model released",
            len(self.dataset),
            0 if self.eval_dataset is None else len(self.eval_dataset),
        )

    def train_step(self, indices: list[int]) -> dict[str, float]:
        cfg, acc = self.cfg, self.plan.accumulation_steps
        mb = self.plan.micro_batch
        groups = self.micro_batches(indices)
        micro = [self.to_device(self.collate(items)) for items in groups]
        chosen_tokens = None
        if cfg.nll_loss_coef:  # the chosen sequences come first in every micro-batch of mb pairs
            chosen_tokens = self.s.dp_sum(sum(sequence_sums(b["loss_mask"], b)[:mb].sum() for b in micro))
        totals = dict.fromkeys(("loss", "chosen_reward", "rejected_reward", "reward_margin", "acc", "nll"), 0.0)
        for k, (items, b) in enumerate(zip(groups, micro, strict=True)):
            m = len(items)
            if self.ref_logps is not None:
                ref = self.ref_logps[indices[k * mb : k * mb + m]].to(self.s.device)
            else:
                ref = self._ref_pair(items)
            pol = self.engine(**model_inputs(b))
            logps = sequence_sums(pol.logprobs, b)
            nll = None
            if chosen_tokens is not None:  # set above iff cfg.nll_loss_coef
                # token-mean over the global batch's chosen tokens, times dp (DeepSpeed averages ranks)
                nll = -logps[:m].sum() / chosen_tokens * self.plan.dp_size * acc
            out = dpo_loss(
                logps[:m],
                logps[m:],
                ref[:, 0],
                ref[:, 1],
                beta=cfg.beta,
                label_smoothing=cfg.label_smoothing,
                ipo=cfg.ipo,
                chosen_nll=nll,
                nll_coef=cfg.nll_loss_coef,
            )
            loss = out.loss / acc + self.moe_aux_loss(pol)
            self.s.backward(loss, self.engine)
            self.s.optimizer_step(self.engine)
            totals["loss"] += loss.item()
            totals["chosen_reward"] += out.chosen_rewards.mean().item() / acc
            totals["rejected_reward"] += out.rejected_rewards.mean().item() / acc
            totals["reward_margin"] += (out.chosen_rewards - out.rejected_rewards).mean().item() / acc
            totals["acc"] += (out.chosen_rewards > out.rejected_rewards).float().mean().item() / acc
            if nll is not None:
                totals["nll"] += nll.item() / acc  # this rank's share x dp: the mean over ranks is the global NLL
        if not cfg.nll_loss_coef:
            del totals["nll"]
        return {**self.s.all_reduce(totals, "mean"), **self.aux_loss_metrics()}

    def _eval_ref(self, dataset) -> torch.Tensor:
        if dataset is self.eval_dataset and self.eval_ref_logps is not None:
            return self.eval_ref_logps.double()
        if self.ref is None:
            raise ValueError(
                "the reference model was released after precompute_ref, and its logprobs were "
                "precomputed for the training and eval sets only; pass this dataset as the "
                "trainer's eval_dataset, or evaluate it before fit()"
            )
        return self.per_row(self._ref_pair, 2, dataset)

    def eval_metrics(self, dataset) -> dict[str, float]:
        cfg = self.cfg

        def policy(items: list[dict]) -> torch.Tensor:  # [m, 4]: logp chosen, rejected; chosen NLL sum, tokens
            b = self.to_device(self.collate(items))
            s, tokens = sequence_logps(self.engine, b), sequence_sums(b["loss_mask"], b)
            m = len(items)
            return torch.stack([s[:m], s[m:], -s[:m], tokens[:m]], dim=1)

        pol, ref = self.per_row(policy, 4, dataset), self._eval_ref(dataset)
        nll = pol[:, 2].sum() / pol[:, 3].sum()
        out = dpo_loss(
            pol[:, 0],
            pol[:, 1],
            ref[:, 0],
            ref[:, 1],
            beta=cfg.beta,
            label_smoothing=cfg.label_smoothing,
            ipo=cfg.ipo,
            chosen_nll=nll if cfg.nll_loss_coef else None,
            nll_coef=cfg.nll_loss_coef,
        )
        m = {
            "loss": out.loss.item(),
            "chosen_reward": out.chosen_rewards.mean().item(),
            "rejected_reward": out.rejected_rewards.mean().item(),
            "reward_margin": (out.chosen_rewards - out.rejected_rewards).mean().item(),
            "acc": (out.chosen_rewards > out.rejected_rewards).double().mean().item(),
        }
        if cfg.nll_loss_coef:
            m["nll"] = nll.item()
        return m
