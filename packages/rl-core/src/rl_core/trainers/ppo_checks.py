"""What the PPO-family loop (:class:`rl_core.trainers.ppo.PPOTrainer`) refuses about the parts it is given, each in
one line naming the fix: combinations of features that are not built (:func:`check_combinations`, which rl-cli
also calls before any model loads) and roles or engines that the run's settings need but that are missing or
cannot serve (:func:`check_parts`). The batch arithmetic is :func:`rl_core.preflight.check_rl_arithmetic`."""

from __future__ import annotations

from rl_algos import estimator_names
from rl_core.rl.roles import require_reward


def check_combinations(cfg, *, eval_set: bool, sleep_engines: bool) -> None:
    """Features of ``cfg`` (a PPOConfig) that do not go together with sleeping engines (an eval set goes with
    every mode, ``--async_train`` included: :mod:`rl_core.trainers.ppo_eval`)."""
    if cfg.agent_cmd and eval_set:
        raise ValueError(
            "the eval pass with --agent_cmd is not built (its n and temperature cannot reach the program's calls): "
            "drop --eval_dataset"
        )
    if sleep_engines and cfg.async_rl:
        raise ValueError(
            "--async_train generates while the policy trains, so the engines cannot sleep meanwhile: drop "
            "--vllm_enable_sleep (or --async_train); with --colocate_all_models the engines then stay awake beside "
            "the policy on its GPUs"
        )


def check_parts(cfg, *, rollout, critic, ref, reward_fn, reward_model, teacher=None) -> None:
    """The roles and the engine ``cfg`` needs are there and can serve: a reward, an engine that plays agent
    episodes turn by turn (``agenerate``) with an agent, a critic for a critic-based estimator, a reference with a
    KL term, a teacher with distillation (and none without), an engine that samples in chunks with partial
    rollouts."""
    require_reward(
        reward_fn=reward_fn is not None,
        reward_model=reward_model is not None,
        agent=bool(cfg.agent or cfg.agent_cmd),
        distill_only=bool(cfg.distill and cfg.distill.only),
    )
    if (cfg.distill is None) != (teacher is None):
        raise ValueError(
            "PPOTrainer: a teacher group goes with PPOConfig.distill (--teacher_pretrain) and only with it: "
            + ("build the teacher's group (TeacherWorker)" if teacher is None else "set distill, or drop the teacher")
        )
    if cfg.agent and not callable(getattr(rollout, "agenerate", None)):
        raise ValueError(
            f"--agent_func_path plays episodes turn by turn through the engine's agenerate, which this rollout "
            f"({type(rollout).__name__}) lacks: use an engine, an EnginePool or a GroupRollout (rl ppo, rl ppo-ray)"
        )
    if cfg.needs_critic and critic is None:
        raise ValueError(
            f"--advantage_estimator {cfg.advantage.estimator} needs a critic (--critic_pretrain); or pick a "
            f"critic-free estimator: {', '.join(estimator_names(critic_free=True))}"
        )
    if cfg.needs_reference and ref is None:
        raise ValueError(f"init_kl_coef={cfg.kl.init_coef} needs a reference model; or set --init_kl_coef 0")
    partial_paths = ("partial_chunk_tokens", "keep_requests", "set_partial_rollout")  # rl_rollout.partial_modes
    if cfg.async_rl and cfg.async_rl.partial_rollout and not any(hasattr(rollout, a) for a in partial_paths):
        raise ValueError(
            f"--partial_rollout needs an engine that samples in chunks or keeps requests across a weight update; "
            f"{type(rollout).__name__} does neither: use --rollout_engine hf or vllm (rl ppo, rl ppo-ray), or drop "
            f"--partial_rollout"
        )
