"""SFT trainer: next-token NLL on response tokens (loss mask), token mean over the global batch.

The loss is ``rl_algos.sft_loss`` with the token count all-reduced over the whole
global batch, so micro-batching and data parallelism do not change it. Rows are
right-padded (:func:`rl_core.data.pad_collate`), or with the dataset's
``packing`` each micro-batch becomes one packed row (:func:`rl_core.data.pack_collate`,
position ids restarting per sequence, no padding computed): the same loss, fewer FLOPs.
Vision-language rows (``--image_key``: :mod:`rl_core.data.images`): each micro-batch's image tensors go to the
forward beside the ids (padded rows only). Evaluation (:meth:`SFTTrainer.eval_metrics`): the same token-mean NLL over every response
token of the eval set (padded rows, also with ``packing``: the value does not depend on it).
With the fused LM head (``--fused_lm_head``) the loss is the forward's ``weighted`` sum of the log-probs (weights
``d loss / d logprobs``): its gradients are made during forward, chunk by chunk, and no logits are kept.
The loop, resume and export are :class:`rl_core.trainers.base.Trainer`'s.
"""

from __future__ import annotations

import torch

from rl_algos import masked_sum, sft_loss
from rl_core.data import model_inputs, pad_collate
from rl_core.data.images import with_images
from rl_core.trainers.base import Trainer
from rl_core.trainers.configs import SFTConfig  # noqa: F401 - re-exported: the settings live beside, torch-free


class SFTTrainer(Trainer):
    name = "sft"
    supports_packing = True
    supports_images = True  # vision-language rows: each micro-batch's pixels go to the forward (model_inputs)

    def train_step(self, indices: list[int]) -> dict[str, float]:
        micro = [self.to_device(self.collate(items)) for items in self.micro_batches(indices)]
        total = self.s.dp_sum(sum(b["loss_mask"].sum() for b in micro).float())
        loss_sum = torch.zeros((), dtype=torch.float64, device=total.device)
        fused = getattr(self.engine.module, "fused_lm_head", False)
        for b in micro:
            if fused:  # the NLL is linear in the log-probs: the fused head makes its gradients in forward
                out = self.engine(**model_inputs(b), lp_weights=self._nll_weights(b["loss_mask"], total))
                loss = out.weighted
            else:
                out = self.engine(**model_inputs(b))
                loss = sft_loss(out.logprobs, b["loss_mask"], global_tokens=total, dp_size=self.plan.dp_size)
            loss = loss + self.moe_aux_loss(out)
            self.s.backward(loss, self.engine)
            self.s.optimizer_step(self.engine)
            loss_sum += loss.detach()  # on the device: no host sync per micro-batch, one .item() per step
        loss_sum, total = torch.stack([loss_sum, total.double()]).tolist()
        return {"loss": self.s.all_reduce(loss_sum, "mean"), "tokens": total, **self.aux_loss_metrics()}

    def _nll_weights(self, mask: torch.Tensor, total: torch.Tensor) -> torch.Tensor:
        """d sft_loss / d logprobs: the loss is linear in them, so it is ``sum(weights * logprobs)``."""
        lp = torch.zeros(mask.shape, device=mask.device, requires_grad=True)
        with torch.enable_grad():
            (w,) = torch.autograd.grad(sft_loss(lp, mask, global_tokens=total, dp_size=self.plan.dp_size), lp)
        return w

    def eval_metrics(self, dataset) -> dict[str, float]:
        """``loss``: sum of response-token NLL / number of response tokens over the whole set; ``tokens``."""

        def nll_and_tokens(items: list[dict]) -> torch.Tensor:  # [len(items), 2]
            b = self.to_device(with_images(pad_collate(items, self.pad_id), items, self.image_processor))
            lp = self.engine(**model_inputs(b)).logprobs
            mask = b["loss_mask"].to(lp.dtype)
            return torch.stack([-masked_sum(lp, mask, dim=1), mask.sum(1)], dim=1)

        nll, tokens = self.per_row(nll_and_tokens, 2, dataset).sum(0)
        return {"loss": (nll / tokens).item(), "tokens": tokens.item()}
