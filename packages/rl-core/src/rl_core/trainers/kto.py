"""KTO trainer: unpaired desirable/undesirable responses against a frozen reference.

Rows are :class:`rl_core.data.KTODataset` items (prompt + response, loss mask on the
response, ``desirable`` flag). The reference point ``kl`` of each step is
``max(0, mean(logp - ref_logp))`` over mismatched pairs (each row's prompt with the
next row's response, within this rank's share of the step), averaged over
data-parallel ranks, without gradient (Ethayarajh et al. 2024; OpenRLHF builds the same
pairs). The loss is ``rl_algos.kto_loss`` on sequence log-probabilities (sum over the
loss mask), averaged over the global batch. With the dataset's ``packing`` each micro-batch, and each
micro-batch of the mismatched pairs, is one packed row (:func:`rl_core.data.pack_collate`) for the
policy and the reference: the same log-probabilities without padding.

Logged per step: loss, kl, the mean implicit reward ``beta * (logp - ref_logp)`` of
desirable and of undesirable rows, and their margin.

Evaluation (:meth:`KTOTrainer.eval_metrics`): the same quantities over the whole eval set,
its reference point ``kl`` taken over the set's mismatched pairs (cyclic over all its rows).
"""

from __future__ import annotations

import torch

from rl_algos import kto_loss
from rl_core.data import model_inputs, sequence_sums
from rl_core.trainers.base import Trainer
from rl_core.trainers.configs import KTOConfig  # noqa: F401 - re-exported: the settings live beside, torch-free
from rl_core.trainers.dpo import sequence_logps


def mismatched_pairs(items: list[dict]) -> list[dict]:
    """Row ``i``'s prompt with row ``i+1``'s response (cyclic): the KL reference set."""

    def split(it):
        on = torch.nonzero(it["loss_mask"]).flatten()
        start = int(on[0]) if len(on) else len(it["input_ids"])
        return it["input_ids"][:start], it["input_ids"][start:]

    parts = [split(it) for it in items]
    out = []
    for i, (prompt, _) in enumerate(parts):
        j = (i + 1) % len(parts)
        budget = max(len(items[i]["input_ids"]), len(items[j]["input_ids"]))  # stay within max_len
        resp = parts[j][1][: max(1, budget - len(prompt))]
        out.append(
            {
                "input_ids": torch.cat([prompt, resp]),
                "loss_mask": torch.cat([torch.zeros_like(prompt), torch.ones_like(resp)]),
            }
        )
    return out


class KTOTrainer(Trainer):
    name = "kto"
    progress_keys = ("loss", "kl", "reward_margin")
    supports_packing = True
    cfg: KTOConfig  # the Trainer's cfg, as __init__ takes it

    def __init__(
        self, strategy, actor, ref_actor, tokenizer, dataset, cfg: KTOConfig, *, eval_dataset=None, logger=None
    ):
        super().__init__(strategy, actor, tokenizer, dataset, cfg, eval_dataset=eval_dataset, logger=logger)
        self.ref = strategy.prepare(ref_actor, train=False, offload=cfg.ref_offload)

    @torch.no_grad()
    def reference_kl(self, groups: list[list[dict]]) -> torch.Tensor:
        pairs, mb, diffs = mismatched_pairs([it for g in groups for it in g]), self.plan.micro_batch, []
        for k in range(0, len(pairs), mb):
            b = self.to_device(self.collate(pairs[k : k + mb]))
            diffs.append(sequence_logps(self.engine, b) - sequence_logps(self.ref, b))
        local = torch.cat(diffs).float().mean()
        return self.s.all_reduce(local, "mean").clamp(min=0)

    def train_step(self, indices: list[int]) -> dict[str, float]:
        cfg, acc = self.cfg, self.plan.accumulation_steps
        groups = self.micro_batches(indices)
        kl = self.reference_kl(groups)
        loss_sum = 0.0
        rewards, flags = [], []
        for items in groups:
            b = self.to_device(self.collate(items))
            with torch.no_grad():
                ref = sequence_logps(self.ref, b)
            pol = self.engine(**model_inputs(b))
            logps = sequence_sums(pol.logprobs, b)
            out = kto_loss(
                logps,
                ref,
                b["desirable"],
                kl,
                beta=cfg.beta,
                desirable_weight=cfg.desirable_loss_weight,
                undesirable_weight=cfg.undesirable_loss_weight,
            )
            loss = out.loss / acc + self.moe_aux_loss(pol)
            self.s.backward(loss, self.engine)
            self.s.optimizer_step(self.engine)
            loss_sum += loss.item()
            rewards.append(out.rewards.cpu())
            flags.append(b["desirable"].cpu())
        r, d = torch.cat(rewards).double(), torch.cat(flags)
        sums = self.s.all_reduce(torch.stack([r[d].sum(), d.sum().double(), r[~d].sum(), (~d).sum().double()]), "sum")
        good = (sums[0] / sums[1]).item() if sums[1] > 0 else float("nan")
        bad = (sums[2] / sums[3]).item() if sums[3] > 0 else float("nan")
        return {
            "loss": self.s.all_reduce(loss_sum, "mean"),
            "kl": kl.item(),
            "desirable_reward": good,
            "undesirable_reward": bad,
            "reward_margin": good - bad,
            **self.aux_loss_metrics(),
        }

    def eval_metrics(self, dataset) -> dict[str, float]:
        cfg = self.cfg

        def policy_and_ref(items: list[dict]) -> torch.Tensor:  # [m, 2]
            b = self.to_device(self.collate(items))
            return torch.stack([sequence_logps(self.engine, b), sequence_logps(self.ref, b)], dim=1)

        rows = [dataset[i] for i in range(len(dataset))]
        lp = self.per_row(policy_and_ref, 2, rows)
        pairs = self.per_row(policy_and_ref, 2, mismatched_pairs(rows))
        kl = (pairs[:, 0] - pairs[:, 1]).mean().clamp(min=0)
        d = torch.tensor([bool(r["desirable"]) for r in rows])
        out = kto_loss(
            lp[:, 0],
            lp[:, 1],
            d,
            kl,
            beta=cfg.beta,
            desirable_weight=cfg.desirable_loss_weight,
            undesirable_weight=cfg.undesirable_loss_weight,
        )
        good = out.rewards[d].mean().item() if d.any() else float("nan")
        bad = out.rewards[~d].mean().item() if (~d).any() else float("nan")
        return {
            "loss": out.loss.item(),
            "kl": kl.item(),
            "desirable_reward": good,
            "undesirable_reward": bad,
            "reward_margin": good - bad,
        }
