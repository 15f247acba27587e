"""On-policy distillation on whole next-token distributions (``--distill_divergence forward_kl | jsd``,
:class:`~rl_core.configs.DistillConfig`): the teacher's top-k tokens travel with the experience, the policy
compares its full log-softmax with them in its loss.

- :func:`teacher_topk`: what the teacher's rank computes per item from one forward (:class:`TeacherTopK`: the
  sampled tokens' log-probs, as the reverse-KL path's, and each response token's top ``k`` ids and log-probs, ``[R, K]``
  over the ``R`` response tokens; prompt positions are not sent). ``k`` at or above the vocabulary's size: every
  token, so the divergence is exact.
- :func:`predicting_layout`: those ``[R, K]`` rows laid out as the policy's forward takes its items (padded rows
  or one packed row), at the positions whose logits predict each response token (``p - 1`` for token ``p``).
- :class:`LogitDivergence`: the loss term, resolved once from the config and handed to the policy's ranks
  (:class:`~rl_core.rl.objectives.PolicyObjective`): :func:`rl_algos.topk_forward_kl` or
  :func:`rl_algos.topk_generalized_jsd` at the sampling temperature, per response token, masked by the loss mask
  (an agent's environment tokens are 0 there) and aggregated as the other loss terms.
- :func:`check_logit_distill`: what it cannot run with (the logits must be whole on one rank).

Where the teacher's logits are at hand whole (one process) the full vocabulary could be compared without
shipping it; the loop's teacher is its own role (another Ray actor in ``rl ppo-ray``), so what crosses is
``K`` ids and log-probs per response token, bounded by :data:`~rl_core.configs.distill.MAX_TOPK`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from rl_algos import topk_forward_kl, topk_generalized_jsd
from rl_core.rl.experience import Experience

Tensor = torch.Tensor


@dataclass
class TeacherTopK:
    """One item's teacher scores: ``logprobs_T`` (the sampled tokens', as the teacher's ``logprobs``), ``ids_RK`` (int32) and
    ``logprobs_RK`` (float32) of the teacher's top ``K`` tokens at each of the ``R`` response tokens."""

    logprobs_T: Tensor
    ids_RK: Tensor
    logprobs_RK: Tensor


def spans(lengths: Sequence[int], packed: bool) -> list[tuple[int, int]]:
    """``(row, start)`` of each item in a forward's input: its own row from 0, or its offset in the packed row."""
    if not packed:
        return [(b, 0) for b in range(len(lengths))]
    starts = torch.tensor([0, *lengths[:-1]]).cumsum(0).tolist()
    return [(0, s) for s in starts]


def teacher_topk(logits_TV: Tensor, item: Experience, k: int, temperature: float, logprobs_T: Tensor) -> TeacherTopK:
    """An item's :class:`TeacherTopK` from its raw logits ``[T, V]`` (row t: the distribution of token t + 1) at
    ``temperature`` and the sampled tokens' log-probs of the same forward; ``k`` above the vocabulary's size is the
    vocabulary."""
    P, T = item.prompt_len, item.T
    if P < 1:
        raise ValueError("a distillation item needs a prompt of at least one token (its first response token's logits)")
    lp_RV = torch.log_softmax(logits_TV[P - 1 : T - 1].float() / temperature, dim=-1)
    top_lp, top_ids = lp_RV.topk(min(k, lp_RV.shape[-1]), dim=-1)
    return TeacherTopK(logprobs_T, top_ids.to(torch.int32).cpu(), top_lp.cpu())


def predicting_layout(items: Sequence[Experience], packed: bool, device) -> tuple[Tensor, Tensor]:
    """``(ids, logprobs)``, ``[B, T, K]`` (``[1, N, K]`` packed) on ``device``: each item's teacher top-k at the
    positions of the forward's input whose logits predict its response tokens; zeros elsewhere (masked out)."""
    missing = [i for i, it in enumerate(items) if it.teacher_topk_ids_RK is None or it.teacher_topk_logprobs_RK is None]
    if missing:
        raise ValueError(
            f"items {missing[:5]} carry no teacher top-k: --distill_divergence forward_kl | jsd needs the teacher's "
            "topk_logprobs in the experience (ExperienceMaker.forwards)"
        )
    K = items[0].teacher_topk_ids_RK.shape[-1]  # type: ignore[union-attr]
    lengths = [it.T for it in items]
    shape = (1, sum(lengths), K) if packed else (len(items), max(lengths), K)
    ids, lps = torch.zeros(shape, dtype=torch.long), torch.zeros(shape)
    for (row, start), it in zip(spans(lengths, packed), items, strict=True):
        a, b = start + it.prompt_len - 1, start + it.T - 1
        ids[row, a:b] = it.teacher_topk_ids_RK  # type: ignore[assignment]
        lps[row, a:b] = it.teacher_topk_logprobs_RK  # type: ignore[assignment]
    return ids.to(device), lps.to(device)


@dataclass(frozen=True)
class LogitDivergence:
    """The distillation loss term on distributions: ``name`` (``forward_kl`` or ``jsd``), the JSD's ``beta``, the
    teacher's ``topk``."""

    name: str
    topk: int
    beta: float = 0.5

    def __post_init__(self) -> None:
        if self.name not in ("forward_kl", "jsd"):
            raise ValueError(f"LogitDivergence {self.name!r}: pick forward_kl or jsd")

    @classmethod
    def of(cls, distill) -> LogitDivergence | None:
        """From a :class:`~rl_core.configs.DistillConfig` (None: no distillation, or the sampled reverse KL)."""
        if distill is None or distill.teacher_topk is None:
            return None
        return cls(distill.divergence, distill.teacher_topk, distill.beta)

    def __call__(self, student_logits: Tensor, teacher_lp: Tensor, teacher_ids: Tensor, temperature: float) -> Tensor:
        """Per position ``[B, T]`` of the raw logits (about the next token)."""
        if self.name == "forward_kl":
            return topk_forward_kl(student_logits, teacher_lp, teacher_ids, temperature=temperature)
        return topk_generalized_jsd(student_logits, teacher_lp, teacher_ids, beta=self.beta, temperature=temperature)


def check_logit_distill(distill, *, fused_lm_head: bool | None, ring_attn_size: int) -> None:
    """Before any model loads: the divergence needs the policy's and the teacher's logits whole on one rank."""
    if distill is None or distill.teacher_topk is None:
        return
    flag = f"--distill_divergence {distill.divergence}"
    if fused_lm_head:
        raise ValueError(
            f"{flag} compares the policy's whole next-token distribution with the teacher's, and --fused_lm_head "
            "never holds the logits: drop --fused_lm_head, or use --distill_divergence reverse_kl"
        )
    if ring_attn_size > 1:
        raise ValueError(
            f"{flag} needs each sequence's logits on one rank, and --ring_attn_size {ring_attn_size} splits them "
            "over the ring: use --ring_attn_size 1, or --distill_divergence reverse_kl"
        )
