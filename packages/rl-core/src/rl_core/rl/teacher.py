"""The distillation teacher (``--teacher_pretrain``, :class:`~rl_core.configs.DistillConfig`): a frozen role that
scores the student's sampled tokens, and the check that it can.

- :class:`TeacherWorker`: one rank of the teacher, the reference's worker on another folder (frozen log-probs of
  the sampled tokens at the sampling temperature, in the trainer's precision; no vLLM).
- :func:`check_teacher_tokenizer`: the teacher must tokenise as the student does (the same ids for the same
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
from rl_core.preflight import InputError, load_tokenizer
from rl_core.rl.frozen_workers import ReferenceWorker

_SPECIAL = ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id")


class TeacherWorker(ReferenceWorker):
    """One rank of the frozen distillation teacher: ``logprobs`` of the sampled tokens (the reference's forward
    on the teacher's weights)."""


def _describe(tok, folder: str) -> str:
    return f"{folder} ({type(tok).__name__}, {len(tok)} tokens)"


def check_teacher_tokenizer(student_folder: str, teacher_folder: str) -> None:
    """Refuse a teacher whose tokenizer maps tokens to other ids than the student's (its log-probs would score
    other tokens than the sampled ones), naming both tokenizers and the first difference."""
    student = load_tokenizer(student_folder)
    teacher = load_tokenizer(teacher_folder, flag="--teacher_pretrain")
    sv, tv = student.get_vocab(), teacher.get_vocab()
    problem = None
    if sv != tv:
        only_s = sorted(set(sv) - set(tv))[:3]
        only_t = sorted(set(tv) - set(sv))[:3]
        moved = sorted(k for k in set(sv) & set(tv) if sv[k] != tv[k])[:3]
        parts = []
        if only_s:
            parts.append(f"tokens only the student has: {only_s}")
        if only_t:
            parts.append(f"tokens only the teacher has: {only_t}")
        if moved:
            parts.append(f"tokens with other ids: {[(k, sv[k], tv[k]) for k in moved]}")
        problem = "; ".join(parts)
    else:
        diff = [n for n in _SPECIAL if n != "pad_token_id" and getattr(student, n) != getattr(teacher, n)]
        if diff:
            problem = ", ".join(f"{n} {getattr(student, n)} vs {getattr(teacher, n)}" for n in diff)
    if problem:
        raise InputError(
            f"--teacher_pretrain: the teacher's tokenizer {_describe(teacher, teacher_folder)} differs from the "
            f"policy's {_describe(student, student_folder)} ({problem}); on-policy distillation scores the "
            f"policy's sampled token ids with the teacher, so both must share one tokenizer: pick a teacher of the "
            f"same model family"
        )


def teacher_metrics(student_BT: torch.Tensor, teacher_BT: torch.Tensor, mask_BT: torch.Tensor) -> dict[str, float]:
    """``distill/reverse_kl`` and ``distill/teacher_logprob`` over the response tokens (``mask_BT``)."""
    return {
        "distill/reverse_kl": masked_mean(student_BT - teacher_BT, mask_BT).item(),
        "distill/teacher_logprob": masked_mean(teacher_BT, mask_BT).item(),
    }
