"""Dynamic sampling (``--dynamic_filtering``, DAPO): groups without signal are dropped and new prompts sampled.
Present on :class:`~rl_core.trainers.ppo_config.PPOConfig` as ``dynamic_filtering`` when on; the loop's
rollout phase applies rl-algos' :func:`~rl_algos.filter_groups`."""

from __future__ import annotations

from dataclasses import dataclass, field

from rl_rollout.config_fields import meta


@dataclass(frozen=True)
class DynamicFilteringConfig:
    """Judged on the raw rewards (or a reward file's scores), before length penalties and clipping, as OpenRLHF."""

    reward_range: tuple[float, float] = field(
        default=(0.0, 1.0),
        metadata=meta(
            "keep groups whose mean reward lies strictly inside LOW HIGH",
            flags=("dynamic_filtering_reward_range",),
            openrlhf=("algo.dynamic_filtering_range",),
        ),
    )
    max_rounds: int = field(
        default=4,
        metadata=meta(
            "rollout rounds per iteration before dropped groups fill the batch", flags=("dynamic_filtering_max_rounds",)
        ),
    )

    def __post_init__(self) -> None:
        if self.max_rounds < 1:
            raise ValueError(
                f"dynamic_filtering_max_rounds (--dynamic_filtering_max_rounds) must be >= 1, got {self.max_rounds}"
            )
        low, high = self.reward_range
        if not low < high:
            raise ValueError(
                f"dynamic_filtering_reward_range (--dynamic_filtering_reward_range) must be LOW HIGH "
                f"with LOW < HIGH, got {self.reward_range}"
            )
