"""Multi-turn episodes against an environment (``--agent_func_path``): present on
:class:`~rl_core.trainers.ppo_config.PPOConfig` as ``agent`` when an environment is given; the loop loads
it (rl-rollout's agents) and plays each sample as an episode."""

from __future__ import annotations

from dataclasses import dataclass, field

from rl_rollout.config_fields import meta


@dataclass(frozen=True)
class AgentConfig:
    """The environment and the bounds of its episodes. Environment tokens are masked out of the loss; the
    episode's reward (the sum of its step rewards, plus --reward_fn's if given) trains."""

    func_path: str = field(
        default="",
        metadata=meta(
            "multi-turn episodes against an environment: file.py with OpenRLHF's AgentInstance (async reset/step "
            "returning rewards, environment_feedback, done), file.py:NAME returning an rl_rollout Environment, or "
            "builtin:calculator",
            flags=("agent_func_path",),
            openrlhf=("train.agent_func_path",),
        ),
    )
    turn_rewards: bool = field(
        default=False,
        metadata=meta(
            "each step reward goes on the last token of the policy turn it answers (token-level rewards: earlier "
            "turns' tokens see only the rewards from their turn on) instead of their sum on the episode's last token; "
            "for the estimators that take token rewards: gae, reinforce, reinforce_baseline",
            flags=("agent_turn_rewards",),
        ),
    )
    max_turns: int = field(
        default=4,
        metadata=meta(
            "policy turns per episode at most (each up to --generate_max_len tokens)", flags=("agent_max_turns",)
        ),
    )
    max_len: int = field(
        default=1024,
        metadata=meta(
            "prompt + response tokens of an episode (policy and environment turns) at most", flags=("agent_max_len",)
        ),
    )

    def __post_init__(self) -> None:
        if not self.func_path:
            raise ValueError(
                "--agent_turn_rewards, --agent_max_turns and --agent_max_len shape an environment's "
                "episodes: add --agent_func_path FILE.py (or builtin:calculator), or drop them"
            )
        if self.max_turns < 1:
            raise ValueError(f"agent_max_turns (--agent_max_turns) must be >= 1, got {self.max_turns}")
        if self.max_len < 2:
            raise ValueError(
                f"agent_max_len (--agent_max_len) must be >= 2 (prompt + response tokens), got {self.max_len}"
            )
