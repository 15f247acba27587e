"""Knowledge distillation in SFT (``rl sft --teacher_pretrain``, :class:`~rl_core.configs.KDConfig`).

Each micro-batch goes through the student and, without gradients, through the frozen teacher (the same padded rows
or packed row, in the trainer's precision; a frozen :class:`rl_core.models.Actor` prepared by the strategy, so
partitioned under ZeRO-3 and offloadable). Both give their ``[B, T, V]`` logits; the per-token divergence between the
two next-token distributions over the whole vocabulary (:func:`token_divergence`, :mod:`rl_algos.distill`) is moved
onto the token it predicts, as the log-probs are, and the loss (:func:`kd_loss`) is

    ``(1 - coef) x NLL + coef x D``,  both token means over the global batch's response tokens (SFT's loss mask),

invariant to micro-batching and data parallelism as SFT's NLL is. Logged each step: ``loss`` (the mixed loss),
``nll``, ``kd/loss`` (D, the divergence trained on) and ``kd/forward_kl`` (``KL(teacher || student)`` whatever the
divergence, comparable across runs).

OpenRLHF's ``train_kd`` (its ``KDLoss``) trains on the cross-entropy ``-sum_v p_t(v) log p_s(v)``, which is
``KL(teacher || student)`` plus the teacher's entropy: a constant for the student, so the same gradients, but its
logged ``distil_loss`` does not go to 0 when the student matches the teacher; ours (``kd/forward_kl``) does. Its
mask is the label mask at the logits' own positions (one token off the predicted one); ours is the predicted
token's, as SFT's NLL.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from rl_algos import aggregate_loss, forward_kl, generalized_jsd, reverse_kl, sft_loss
from rl_core.data import model_inputs
from rl_core.model_rows import align_to_tokens
from rl_core.trainers.configs import SFTConfig
from rl_core.trainers.sft import SFTTrainer

logger = logging.getLogger(__name__)

Tensor = torch.Tensor


def token_divergence(student_logits: Tensor, teacher_logits: Tensor, divergence: str, beta: float = 0.5) -> Tensor:
    """The per-position divergence ``[B, T]`` between two ``[B, T, V]`` logits: ``forward_kl`` (``KL(teacher ||
    student)``), ``reverse_kl`` or ``jsd`` (GKD's, mixture weight ``beta``)."""
    if divergence == "forward_kl":
        return forward_kl(student_logits, teacher_logits)
    if divergence == "reverse_kl":
        return reverse_kl(student_logits, teacher_logits)
    if divergence == "jsd":
        return generalized_jsd(student_logits, teacher_logits, beta=beta)
    raise ValueError(f"divergence {divergence!r}: pick one of forward_kl, reverse_kl, jsd")


@dataclass
class KDLoss:
    loss: Tensor  # [] (1 - coef) x nll + coef x kd, scaled for the global batch
    nll: Tensor  # [] this micro-batch's share of the global token-mean NLL
    kd: Tensor  # [] this micro-batch's share of the global token-mean divergence


def kd_loss(
    logprobs_BT: Tensor,
    divergence_BT: Tensor,
    mask_BT: Tensor,
    coef: float,
    *,
    global_tokens: float | Tensor | None = None,
    dp_size: int = 1,
) -> KDLoss:
    """``(1 - coef) x NLL + coef x D``: the token means over ``mask_BT`` (over ``global_tokens`` when given, as
    :func:`rl_algos.sft_loss`) of ``-logprobs_BT`` and of ``divergence_BT`` (each token's divergence, on the token's
    own place)."""
    if not 0.0 <= coef <= 1.0:
        raise ValueError(f"kd coef must be in [0, 1], got {coef}")
    nll = sft_loss(logprobs_BT, mask_BT, global_tokens=global_tokens, dp_size=dp_size)
    kd = aggregate_loss(divergence_BT, mask_BT, global_tokens=global_tokens, dp_size=dp_size)
    return KDLoss((1.0 - coef) * nll + coef * kd, nll, kd)


class KDSFTTrainer(SFTTrainer):
    """SFT towards a frozen teacher's distributions as well as the data's tokens (:func:`kd_loss`)."""

    name = "sft"
    progress_keys = ("loss", "nll", "kd/loss")
    supports_images = False  # the teacher's forward with images is not built
    cfg: SFTConfig  # the Trainer's cfg, as __init__ takes it

    def __init__(self, strategy, actor, teacher, tokenizer, dataset, cfg, *, eval_dataset=None, logger=None):
        if cfg.kd is None:
            raise ValueError("KDSFTTrainer needs the config's kd node (--teacher_pretrain); use SFTTrainer without one")
        if getattr(actor, "fused_lm_head", False):
            raise ValueError(
                "--teacher_pretrain compares the student's and the teacher's logits, which --fused_lm_head never "
                "holds whole: drop --fused_lm_head"
            )
        super().__init__(strategy, actor, tokenizer, dataset, cfg, eval_dataset=eval_dataset, logger=logger)
        self.teacher = strategy.prepare(teacher, train=False, offload=cfg.kd.teacher_offload)

    def train_step(self, indices: list[int]) -> dict[str, float]:
        kd_cfg = self.cfg.kd
        assert kd_cfg is not None  # __init__ refuses a config without it
        micro = [self.to_device(self.collate(items)) for items in self.micro_batches(indices)]
        total = self.s.dp_sum(sum(b["loss_mask"].sum() for b in micro).float())
        sums = torch.zeros(4, dtype=torch.float64, device=total.device)  # loss, nll, kd, forward kl
        for b in micro:
            inputs = model_inputs(b)
            with torch.no_grad():
                t_logits = self.teacher(**inputs, return_logits=True).logits
            out = self.engine(**inputs, return_logits=True)
            div = align_to_tokens(token_divergence(out.logits, t_logits, kd_cfg.divergence, kd_cfg.beta), inputs)
            parts = kd_loss(
                out.logprobs, div, b["loss_mask"], kd_cfg.coef, global_tokens=total, dp_size=self.plan.dp_size
            )
            with torch.no_grad():
                if kd_cfg.divergence == "forward_kl":
                    fkl = parts.kd
                else:
                    fkl_BT = align_to_tokens(forward_kl(out.logits.detach(), t_logits), inputs)
                    fkl = aggregate_loss(fkl_BT, b["loss_mask"], global_tokens=total, dp_size=self.plan.dp_size)
            del t_logits
            loss = parts.loss + self.moe_aux_loss(out)
            self.s.backward(loss, self.engine)
            self.s.optimizer_step(self.engine)
            sums += torch.stack([loss.detach(), parts.nll.detach(), parts.kd.detach(), fkl.detach()]).double()
        *vals, total = torch.cat([sums, total.double().reshape(1)]).tolist()
        loss, nll, kd, fkl = (self.s.all_reduce(v, "mean") for v in vals)
        return {
            "loss": loss,
            "nll": nll,
            "kd/loss": kd,
            "kd/forward_kl": fkl,
            "tokens": total,
            **self.aux_loss_metrics(),
        }
