"""The distillation teacher (``--teacher_pretrain``, :class:`~rl_core.configs.DistillConfig`): a frozen role that
scores the student's sampled tokens, and the check that it can.

- :class:`TeacherWorker`: one rank of the teacher, the reference's worker on another folder (frozen log-probs of
  the sampled tokens at the sampling temperature, in the trainer's precision; no vLLM); with ``--distill_divergence
  forward_kl | jsd`` also its top-k tokens per response token (:meth:`TeacherWorker.topk_logprobs`,
  :mod:`rl_core.rl.distill_topk`).
- :func:`check_teacher_tokenizer` (:mod:`rl_core.preflight`, shared with ``rl sft``'s knowledge distillation): the
  teacher must tokenise as the student does (the same ids for the same
  tokens, the same special tokens), checked on the two tokenizers before any model loads; a mismatch names both.
- :func:`teacher_metrics`: what the loop logs of the teacher each iteration (``distill/reverse_kl``: the mean
  over response tokens of ``student_lp - teacher_lp``, the one-sample estimate of KL(student || teacher);
  ``distill/teacher_logprob``).

The signal itself (advantage or loss term) is applied by the loop (:mod:`rl_core.trainers.ppo_experience`) and
the policy worker (:mod:`rl_core.rl.workers`); its math is :mod:`rl_algos.distill`.
"""

from __future__ import annotations

import torch

from rl_algos import masked_mean
from rl_core.preflight import check_teacher_tokenizer  # noqa: F401 - re-exported: its home before rl-core 0.23
from rl_core.rl.batching import ModelInputs
from rl_core.rl.distill_topk import TeacherTopK, spans, teacher_topk
from rl_core.rl.experience import Experience, rows
from rl_core.rl.frozen_workers import ReferenceWorker


class TeacherWorker(ReferenceWorker):
    """One rank of the frozen distillation teacher: ``logprobs`` of the sampled tokens (the reference's forward
    on the teacher's weights), or ``topk_logprobs``: those and its top ``k`` tokens at each response token."""

    @torch.no_grad()
    def topk_logprobs(self, items: list[Experience], k: int) -> list[TeacherTopK]:
        """One :class:`~rl_core.rl.distill_topk.TeacherTopK` per item, from one forward (the logits whole: no ring
        attention, no fused head) at the sampling temperature."""
        out: list = [None] * len(items)
        for idx in self._micro_batches(items, train=False):
            chunk = [items[i] for i in idx]
            x = ModelInputs.of(chunk, self.pad_id, self.packing, self.s.device, images=self.images)
            res = self.engine(**x.kwargs, temperature=self.temperature, return_logits=True)
            lps = rows(x.rows(res.logprobs), chunk)  # the sampled tokens', exactly as logprobs() gives them
            for i, it, lp_T, (row, start) in zip(idx, chunk, lps, spans(x.lengths, x.packed), strict=True):
                out[i] = teacher_topk(res.logits[row, start : start + it.T], it, k, self.temperature, lp_T)
            del res
        return self._leader(out)


def teacher_metrics(student_BT: torch.Tensor, teacher_BT: torch.Tensor, mask_BT: torch.Tensor) -> dict[str, float]:
    """``distill/reverse_kl`` and ``distill/teacher_logprob`` over the response tokens (``mask_BT``)."""
    return {
        "distill/reverse_kl": masked_mean(student_BT - teacher_BT, mask_BT).item(),
        "distill/teacher_logprob": masked_mean(teacher_BT, mask_BT).item(),
    }
