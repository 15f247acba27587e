"""Which roles an RL run has, decided once: :func:`run_roles` (read by :func:`~rl_core.rl.build.build_run`, by
rl-cli's placement plan and GPU counts, and by ``--print_config``), and :func:`require_reward`, the one check that
a run has something to score its samples with.

A run always has the policy; a critic when the estimator's rl-algos registry entry needs one (``gae``), a
reference when KL to it is on (``kl.init_coef > 0``), a reward-model role when a reward model is given, a teacher
with on-policy distillation (``--teacher_pretrain``).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Roles:
    """The model roles of a run besides the policy."""

    critic: bool
    ref: bool
    reward_model: bool
    teacher: bool = False

    def names(self) -> list[str]:
        on = (
            ("critic", self.critic),
            ("reference", self.ref),
            ("reward model", self.reward_model),
            ("teacher", self.teacher),
        )
        return ["policy"] + [n for n, yes in on if yes]


def run_roles(ppo, *, reward_model: bool) -> Roles:
    """``ppo``: the run's :class:`~rl_core.trainers.ppo_config.PPOConfig`; ``reward_model``: a reward model is
    given (``--reward_pretrain``)."""
    return Roles(
        critic=ppo.needs_critic,
        ref=ppo.needs_reference,
        reward_model=bool(reward_model),
        teacher=ppo.distill is not None,
    )


def require_reward(*, reward_fn: bool, reward_model: bool, agent: bool, distill_only: bool = False) -> None:
    """A run scores its samples with a reward function, a reward model or an environment's rewards (pure
    distillation, ``--distill_only``, needs none: the teacher is the signal)."""
    if not (reward_fn or reward_model or agent or distill_only):
        raise ValueError(
            "no reward: give a reward function (--reward_fn file.py:func, builtin:math ..., or "
            "--remote_rm_url URL), a reward model (--reward_pretrain FOLDER) or an environment "
            "(--agent_func_path FILE.py, whose step rewards score the episodes; or --agent_cmd PROGRAM, which prints "
            "its reward); or distil from a teacher "
            "alone (--teacher_pretrain FOLDER --distill_only)"
        )
