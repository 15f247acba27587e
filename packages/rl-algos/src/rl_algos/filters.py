"""Dynamic sampling: drop prompt groups whose rewards carry no learning signal.

DAPO (Yu et al. 2025, arXiv:2503.14476, section 3.2) over-samples and keeps only
groups whose accuracy is neither 0 nor 1; with group-relative advantages such a
group contributes exactly zero gradient. OpenRLHF's ``dynamic_filtering_reward_range``
keeps groups whose mean score lies strictly inside ``(low, high)``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

Tensor = torch.Tensor


@dataclass(frozen=True)
class GroupFilterResult:
    """``keep_groups``: ``[P]`` bool; ``keep_samples``: ``[P * n]`` bool (the same decision
    repeated over each group's n samples); ``group_means``: ``[P]``."""

    keep_groups: Tensor
    keep_samples: Tensor
    group_means: Tensor

    @property
    def num_kept(self) -> int:
        return int(self.keep_groups.sum())


def filter_groups(
    scores_B: Tensor,
    n_samples: int,
    *,
    mean_range: tuple[float, float] | None = None,
    require_variance: bool = True,
) -> GroupFilterResult:
    """Which groups of ``n_samples`` contiguous samples to keep.

    A group is kept when every active rule holds:

    - ``mean_range=(low, high)``: ``low < mean(scores) < high`` (strict);
    - ``require_variance``: its scores are not all equal.

    Shape ``[P * n]`` -> :class:`GroupFilterResult`.
    """
    if scores_B.dim() != 1:
        raise ValueError(f"scores must be 1-D [num_prompts * n], got shape {tuple(scores_B.shape)}")
    B = scores_B.shape[0]
    if n_samples < 1 or B % n_samples != 0:
        raise ValueError(
            f"batch of {B} scores is not divisible by n_samples={n_samples}; "
            f"each prompt needs exactly n contiguous samples"
        )
    if mean_range is not None and not mean_range[0] < mean_range[1]:
        raise ValueError(f"mean_range needs low < high, got {mean_range}")
    s = scores_B.float().view(B // n_samples, n_samples)
    means = s.mean(-1)
    keep = torch.ones_like(means, dtype=torch.bool)
    if mean_range is not None:
        keep &= (means > mean_range[0]) & (means < mean_range[1])
    if require_variance:
        keep &= (s != s[:, :1]).any(-1)
    return GroupFilterResult(keep, keep.repeat_interleave(n_samples), means)
