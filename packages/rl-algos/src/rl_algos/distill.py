"""Distillation divergences between a student (the policy) and a teacher, per token.

On-policy distillation (Agarwal et al., "On-Policy Distillation of Language Models: Learning from
Self-Generated Mistakes" (GKD), arXiv:2306.13649; Gu et al., MiniLLM, arXiv:2306.08543): the student
samples, the teacher scores every sampled token, and the student lowers the reverse KL
``KL(student || teacher)``. Two ways in here:

- From the sampled tokens only (what crosses processes: two log-probs per token).
  :func:`distill_advantages` is the per-token signal ``teacher_lp - student_lp`` (minus the one-sample
  estimate of the reverse KL of that token, k1), used as each token's own advantage with no discount (as
  Tinker's on-policy distillation does); :func:`rl_algos.kl.approx_kl` gives the same estimate as a loss term
  (``k3`` for a non-negative, unbiased one).
- From full distributions where the teacher's logits are at hand (offline KD, one process):
  :func:`forward_kl`, :func:`reverse_kl`, :func:`generalized_jsd` (GKD's beta; TRL's
  ``generalized_jsd_loss`` definition: beta 0 is the forward KL, 1 the reverse KL, between them the
  JSD with the mixture ``beta x teacher + (1 - beta) x student``), and from the teacher's top-k tokens only (what a
  teacher in another process can send, the RL loop's ``--distill_topk``): :func:`topk_forward_kl` and
  :func:`topk_generalized_jsd`, the teacher's probabilities renormalised over its k tokens (0 elsewhere) against the
  student's whole distribution.

Shapes: log-probs ``[B, T]``; logits ``[B, T, V]`` (any leading shape works: the divergences reduce the last
axis); results ``[B, T]`` per token, 0 where ``mask`` is 0. Temperatures divide both sides' logits.
Computed in float32 (float64 when an input is float64).
"""

from __future__ import annotations

import math

import torch

from rl_algos._masked import check_same_shape

Tensor = torch.Tensor


def _dtype(*ts: Tensor) -> torch.dtype:
    return torch.float64 if any(t.dtype == torch.float64 for t in ts) else torch.float32


def _masked(x: Tensor, mask: Tensor | None) -> Tensor:
    return x if mask is None else x * mask.to(x.dtype)


def distill_advantages(student_logprobs: Tensor, teacher_logprobs: Tensor, mask: Tensor | None = None) -> Tensor:
    """Each sampled token's ``teacher_lp - student_lp`` (``[B, T]``): positive where the teacher likes the
    token more than the student did; its mean over the student's samples is minus the reverse KL."""
    check_same_shape(student_logprobs=student_logprobs, teacher_logprobs=teacher_logprobs, mask=mask)
    dt = _dtype(student_logprobs, teacher_logprobs)
    return _masked(teacher_logprobs.to(dt) - student_logprobs.to(dt), mask)


def _logp(logits: Tensor, temperature: float, dt: torch.dtype) -> Tensor:
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    return torch.log_softmax(logits.to(dt) / temperature, dim=-1)


def _check_logits(student_logits: Tensor, teacher_logits: Tensor, mask: Tensor | None) -> None:
    if student_logits.shape != teacher_logits.shape:
        raise ValueError(
            f"student logits {tuple(student_logits.shape)} and teacher logits {tuple(teacher_logits.shape)} differ: "
            "the two models must share a vocabulary (the same tokenizer) and score the same tokens"
        )
    if mask is not None and mask.shape != student_logits.shape[:-1]:
        raise ValueError(f"mask {tuple(mask.shape)} must be the logits' shape without the vocabulary axis")


def _kl(p_logp: Tensor, q_logp: Tensor) -> Tensor:
    """``KL(p || q)`` over the last axis, 0 x log 0 = 0."""
    p = p_logp.exp()
    return torch.where(p > 0, p * (p_logp - q_logp), torch.zeros_like(p)).sum(-1)


def forward_kl(
    student_logits: Tensor, teacher_logits: Tensor, mask: Tensor | None = None, temperature: float = 1.0
) -> Tensor:
    """``KL(teacher || student)`` per token: mode-covering, what classic knowledge distillation minimises."""
    _check_logits(student_logits, teacher_logits, mask)
    dt = _dtype(student_logits, teacher_logits)
    return _masked(_kl(_logp(teacher_logits, temperature, dt), _logp(student_logits, temperature, dt)), mask)


def reverse_kl(
    student_logits: Tensor, teacher_logits: Tensor, mask: Tensor | None = None, temperature: float = 1.0
) -> Tensor:
    """``KL(student || teacher)`` per token: mode-seeking, what on-policy distillation minimises."""
    _check_logits(student_logits, teacher_logits, mask)
    dt = _dtype(student_logits, teacher_logits)
    return _masked(_kl(_logp(student_logits, temperature, dt), _logp(teacher_logits, temperature, dt)), mask)


def generalized_jsd(
    student_logits: Tensor,
    teacher_logits: Tensor,
    mask: Tensor | None = None,
    *,
    beta: float = 0.5,
    temperature: float = 1.0,
) -> Tensor:
    """GKD's generalised Jensen-Shannon divergence per token, as TRL's ``generalized_jsd_loss``: with the
    mixture ``m = beta x teacher + (1 - beta) x student``, ``beta x KL(teacher || m) + (1 - beta) x
    KL(student || m)``; beta 0 is :func:`forward_kl`, beta 1 :func:`reverse_kl` (the limits, not 0)."""
    if not 0.0 <= beta <= 1.0:
        raise ValueError(f"beta must be in [0, 1] (0: forward KL, 1: reverse KL), got {beta}")
    if beta == 0.0:
        return forward_kl(student_logits, teacher_logits, mask, temperature)
    if beta == 1.0:
        return reverse_kl(student_logits, teacher_logits, mask, temperature)
    _check_logits(student_logits, teacher_logits, mask)
    dt = _dtype(student_logits, teacher_logits)
    s, t = _logp(student_logits, temperature, dt), _logp(teacher_logits, temperature, dt)
    m = torch.logsumexp(torch.stack([s + math.log(1 - beta), t + math.log(beta)]), dim=0)
    return _masked(beta * _kl(t, m) + (1 - beta) * _kl(s, m), mask)


def _check_topk(student_logits: Tensor, teacher_topk_logprobs: Tensor, teacher_topk_ids: Tensor, mask) -> None:
    if teacher_topk_logprobs.shape != teacher_topk_ids.shape:
        raise ValueError(
            f"teacher top-k log-probs {tuple(teacher_topk_logprobs.shape)} and ids {tuple(teacher_topk_ids.shape)} "
            "must have the same shape"
        )
    if teacher_topk_ids.shape[:-1] != student_logits.shape[:-1]:
        raise ValueError(
            f"teacher top-k {tuple(teacher_topk_ids.shape)} and student logits {tuple(student_logits.shape)} must "
            "share every axis but the last"
        )
    if mask is not None and mask.shape != student_logits.shape[:-1]:
        raise ValueError(f"mask {tuple(mask.shape)} must be the logits' shape without the vocabulary axis")


def topk_forward_kl(
    student_logits: Tensor,
    teacher_topk_logprobs: Tensor,
    teacher_topk_ids: Tensor,
    mask: Tensor | None = None,
    temperature: float = 1.0,
) -> Tensor:
    """Forward KL on the teacher's top-k tokens only (``[..., K]`` log-probs and ids, what a teacher in another
    process can send): the teacher's probabilities renormalised over its k tokens, the student's full-vocabulary
    log-probs at those ids; ``sum_k p_t(k) (log p_t(k) - log p_s(k))``. With k = V it is :func:`forward_kl`."""
    _check_topk(student_logits, teacher_topk_logprobs, teacher_topk_ids, mask)
    dt = _dtype(student_logits, teacher_topk_logprobs)
    s = _logp(student_logits, temperature, dt).gather(-1, teacher_topk_ids.long())
    t = torch.log_softmax(teacher_topk_logprobs.to(dt), dim=-1)  # renormalised over the k tokens
    return _masked(_kl(t, s), mask)


def topk_generalized_jsd(
    student_logits: Tensor,
    teacher_topk_logprobs: Tensor,
    teacher_topk_ids: Tensor,
    mask: Tensor | None = None,
    *,
    beta: float = 0.5,
    temperature: float = 1.0,
) -> Tensor:
    """GKD's generalised JSD (:func:`generalized_jsd`) between the teacher's top-k distribution (renormalised over
    its k tokens, 0 elsewhere: the one :func:`topk_forward_kl` uses) and the student's whole distribution.

    With ``t`` the teacher's k probabilities, ``s`` the student's at the same ids, ``S = sum_k s(k)`` and
    ``m = beta t + (1 - beta) s``: ``beta sum_k t (log t - log m) + (1 - beta) [sum_k s (log s - log m)
    - (1 - S) log(1 - beta)]``, the last term the student's mass outside the k tokens, where ``m = (1 - beta) s``.
    Exact (no approximation beyond the teacher's truncation); with k = V it is :func:`generalized_jsd`; beta 0 is
    :func:`topk_forward_kl` (TRL's convention, as :func:`generalized_jsd`). Beta 1 (the reverse KL) is infinite wherever the student puts mass outside the
    k tokens, so beta must lie in ``[0, 1)``."""
    if not 0.0 <= beta < 1.0:
        raise ValueError(
            f"beta must be in [0, 1) for a top-k teacher (0: its forward KL; 1, the reverse KL, is infinite where "
            f"the student puts mass outside the teacher's k tokens), got {beta}"
        )
    if beta == 0.0:
        return topk_forward_kl(student_logits, teacher_topk_logprobs, teacher_topk_ids, mask, temperature)
    _check_topk(student_logits, teacher_topk_logprobs, teacher_topk_ids, mask)
    dt = _dtype(student_logits, teacher_topk_logprobs)
    s = _logp(student_logits, temperature, dt).gather(-1, teacher_topk_ids.long())
    t = torch.log_softmax(teacher_topk_logprobs.to(dt), dim=-1)
    m = torch.logsumexp(torch.stack([t + math.log(beta), s + math.log(1 - beta)]), dim=0)
    tail = (1 - s.exp().sum(-1)).clamp(min=0)  # the student's mass off the teacher's k tokens
    jsd = beta * _kl(t, m) + (1 - beta) * (_kl(s, m) - tail * math.log(1 - beta))
    return _masked(jsd, mask)
