"""``rl ppo-ray``'s placement flags (OpenRLHF's names: :class:`RayArgs`) and what they decide: the ranks of each
role (rl-core's :func:`rl_core.rl.roles.run_roles` says which roles the run has) and rl-placement's
:class:`rl_placement.PlacementPlan`, validated in pure Python before Ray starts."""

from __future__ import annotations

from dataclasses import dataclass, field

from rl_core.rl.roles import run_roles
from rl_rollout.config_fields import check_numbers, meta


@dataclass(frozen=True)
class RayArgs:
    """Placement (OpenRLHF names); a role's counts default to the actor's when the run needs it."""

    actor_num_nodes: int = field(default=1, metadata=meta("nodes of the actor (policy) group"))
    actor_num_gpus_per_node: int = field(
        default=1, metadata=meta("GPUs per node of the actor group (its data-parallel ranks)")
    )
    critic_num_nodes: int | None = field(
        default=None, metadata=meta("nodes of the critic group (default: the actor's, when the run has a critic)")
    )
    critic_num_gpus_per_node: int | None = field(
        default=None, metadata=meta("GPUs per node of the critic group (default: the actor's)")
    )
    ref_num_nodes: int | None = field(
        default=None, metadata=meta("nodes of the reference group (default: the actor's, when init_kl_coef > 0)")
    )
    ref_num_gpus_per_node: int | None = field(
        default=None, metadata=meta("GPUs per node of the reference group (default: the actor's)")
    )
    reward_num_nodes: int | None = field(
        default=None, metadata=meta("nodes of the reward-model group (default: the actor's, with --reward_pretrain)")
    )
    reward_num_gpus_per_node: int | None = field(
        default=None, metadata=meta("GPUs per node of the reward-model group (default: the actor's)")
    )
    teacher_num_nodes: int | None = field(
        default=None,
        metadata=meta(
            "nodes of the on-policy distillation teacher's group (default: the reference's, with --teacher_pretrain)"
        ),
    )
    teacher_num_gpus_per_node: int | None = field(
        default=None,
        metadata=meta(
            "GPUs per node of the teacher's group (default: the reference's); with --colocate_actor_ref or "
            "--colocate_all_models the teacher shares the policy's GPUs"
        ),
    )
    vllm_num_engines: int = field(default=1, metadata=meta("rollout engines (replicas)"))
    vllm_tensor_parallel_size: int = field(default=1, metadata=meta("GPUs per engine (vLLM tensor parallel)"))
    colocate_actor_ref: bool = field(
        default=False, metadata=meta("policy (actor) and reference (and a distillation teacher) share GPUs")
    )
    colocate_critic_reward: bool = field(default=False, metadata=meta("critic and reward model share GPUs"))
    colocate_all_models: bool = field(default=False, metadata=meta("the hybrid engine (every model with the engines)"))
    ray_address: str | None = field(
        default=None,
        metadata=meta(
            "an existing cluster (default: RAY_ADDRESS, else the cluster `ray start --head` runs on this machine, "
            "else a local Ray); token authentication is handled (rl_cli.ray_cluster)"
        ),
    )
    num_gpus: int | None = field(
        default=None,
        metadata=meta(
            "start a fresh local Ray with this many logical GPUs, even where a cluster runs (for machines without "
            "GPUs; tests, dry runs)"
        ),
    )
    placement_strategy: str = field(default="PACK", metadata=meta("PACK | SPREAD for the model groups"))
    call_timeout_s: float = field(
        default=3600.0, metadata=meta("a role call that takes longer fails, naming the role and rank")
    )

    def __post_init__(self) -> None:
        check_numbers(
            self,
            positive=("call_timeout_s",),
            non_negative=(
                "num_gpus",
                *(
                    f"{r}_{c}"
                    for r in ("critic", "ref", "reward", "teacher")
                    for c in ("num_nodes", "num_gpus_per_node")
                ),
            ),
            at_least_1=("actor_num_nodes", "actor_num_gpus_per_node", "vllm_num_engines", "vllm_tensor_parallel_size"),
        )


def _role_counts(ray_args: RayArgs, ppo, model) -> dict[str, tuple[int, int]]:
    """``{role: (nodes, GPUs per node)}`` of an ``rl ppo-ray`` run: the roles rl-core's :func:`run_roles` decides
    the run has (0, 0 for the others), each defaulting to the actor's counts; the teacher's to the reference's
    (given or defaulted, also when the run has no reference: the teacher is placed as the reference would be)."""

    a, roles = ray_args, run_roles(ppo, reward_model=bool(model.reward_pretrain))

    def given(prefix: str) -> tuple[int | None, int | None]:
        return getattr(a, f"{prefix}_num_nodes"), getattr(a, f"{prefix}_num_gpus_per_node")

    def counts(prefix: str, needed: bool, default: tuple[int, int]) -> tuple[int, int]:
        nodes, gpus = given(prefix)
        if not needed:
            return 0, 0
        return (default[0] if nodes is None else nodes), (default[1] if gpus is None else gpus)

    actor = (a.actor_num_nodes, a.actor_num_gpus_per_node)
    ref = counts("ref", True, actor)  # the reference's counts, whether or not the run has one
    return {
        "policy": actor,
        "critic": counts("critic", roles.critic, actor),
        "ref": ref if roles.ref else (0, 0),
        "reward": counts("reward", roles.reward_model, actor),
        "teacher": counts("teacher", roles.teacher, ref),
    }


def check_role_placement(ray_args: RayArgs, ppo, model) -> None:
    """The placement flags of a role this run does not have (``--critic_*`` without a critic, ``--ref_*`` without a
    reference, ``--reward_*`` without a reward model, ``--teacher_*`` without a teacher) are refused, naming them and
    why the run has no such role (ValueError), not ignored."""
    roles = run_roles(ppo, reward_model=bool(model.reward_pretrain))
    why = {
        "critic": (
            roles.critic,
            f"place the critic, and this run has none (--advantage_estimator "
            f"{ppo.advantage.estimator} needs no value model; gae does)",
        ),
        "ref": (roles.ref, "place the reference model, and this run has none (--init_kl_coef 0 and no KL loss)"),
        "reward": (roles.reward_model, "place the reward model, and this run has none (no --reward_pretrain)"),
        "teacher": (
            roles.teacher,
            "place the on-policy distillation teacher, and this run has none: add "
            "--teacher_pretrain FOLDER, or drop them",
        ),
    }
    for role, (present, reason) in why.items():
        given = [
            f"--{role}_{n}" for n in ("num_nodes", "num_gpus_per_node") if getattr(ray_args, f"{role}_{n}") is not None
        ]
        if given and not present:
            flags = " and ".join(given)
            raise ValueError(f"{flags} {reason}" + ("" if role == "teacher" else f": drop {flags}"))


def _world_sizes(cfgs: dict) -> dict[str, int]:
    """Ranks of each model role of an ``rl ppo-ray`` run, from the flags (the plan's own checks come later)."""
    c = _role_counts(cfgs["ray"], cfgs["ppo"], cfgs["model"])
    return {role: nodes * gpus for role, (nodes, gpus) in c.items()}


def plan_from(ray_args: RayArgs, ppo, model):
    """The placement plan: roles the run needs (critic for gae, ref for KL, reward for a reward model, teacher for
    on-policy distillation)."""
    # lazy: rl-placement imports ray; `rl ppo --help` stays light
    from rl_placement import PlacementPlan

    a, c = ray_args, _role_counts(ray_args, ppo, model)
    return PlacementPlan.from_flags(
        actor_num_nodes=a.actor_num_nodes,
        actor_num_gpus_per_node=a.actor_num_gpus_per_node,
        critic_num_nodes=c["critic"][0],
        critic_num_gpus_per_node=c["critic"][1],
        ref_num_nodes=c["ref"][0],
        ref_num_gpus_per_node=c["ref"][1],
        reward_num_nodes=c["reward"][0],
        reward_num_gpus_per_node=c["reward"][1],
        teacher_num_nodes=c["teacher"][0],
        teacher_num_gpus_per_node=c["teacher"][1],
        vllm_num_engines=a.vllm_num_engines,
        vllm_tensor_parallel_size=a.vllm_tensor_parallel_size,
        colocate_actor_ref=a.colocate_actor_ref,
        colocate_critic_reward=a.colocate_critic_reward,
        colocate_all_models=a.colocate_all_models,
    )
