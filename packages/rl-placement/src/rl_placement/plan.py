"""Placement plans: which model role sits on which GPU, checked before Ray runs.

This module owns :class:`PlacementPlan`: building one (directly or from
OpenRLHF's flag names), laying its roles and engines out on placement-group
bundles (one GPU each), validation whose errors name the numbers that disagree
and how to fix them, and a GPU map a person can read. The value types it is
made of (roles, specs, slots, bundle groups, GPU shares) live in
:mod:`rl_placement.specs` and are re-exported here.

It imports only the standard library (no Ray, no torch), so a plan is built and
checked anywhere; :mod:`rl_placement.bundles` turns it into Ray placement groups
and :mod:`rl_placement.groups` starts actors on them. Node and GPU numbers here
are logical, within one placement group: Ray chooses the physical nodes when the
groups are created.

Colocation modes (OpenRLHF's flags):

- ``colocate_actor_ref``: policy rank i, reference rank i and (on-policy distillation) teacher rank i share
  bundle i: the frozen models that score the policy's samples sit with it.
- ``colocate_critic_reward``: critic rank i and reward rank i share bundle i.
- ``colocate_all_models`` (hybrid engine): every model and every vLLM engine
  share one group; policy, critic, reference, reward and teacher rank i sit on bundle i,
  and engine e's tensor-parallel rank t on bundle ``e * tp + t``.

A bundle holding k processes gives each :func:`~rl_placement.specs.gpu_share`
(k) of its GPU.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from rl_placement.specs import (
    FLAG_PREFIX,
    MODEL_ROLES,
    BundleGroup,
    Colocation,
    EngineBundles,
    EngineLayout,
    PlacementError,
    Role,
    RolePlacement,
    RoleSpec,
    Slot,
    _plural,
    gpu_share,
)

__all__ = [
    "BundleGroup",
    "Colocation",
    "EngineBundles",
    "EngineLayout",
    "PlacementError",
    "PlacementPlan",
    "Role",
    "RolePlacement",
    "RoleSpec",
    "Slot",
    "gpu_share",
]


@dataclass(frozen=True)
class PlacementPlan:
    """Roles, engines and colocation; checked on construction (see :meth:`validate`).

    ``policy`` (OpenRLHF's actor) is required; ``critic``, ``ref``, ``reward``, ``engines`` and ``teacher`` are
    None when the run has no such model (GRPO has no critic, a reward function
    no reward model, generation without vLLM no engines, a run without on-policy distillation no teacher).
    ``teacher`` comes last so positional construction of the older fields keeps working.
    """

    policy: RoleSpec
    critic: RoleSpec | None = None
    ref: RoleSpec | None = None
    reward: RoleSpec | None = None
    engines: EngineLayout | None = None
    colocation: Colocation = Colocation.NONE
    teacher: RoleSpec | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.policy, RoleSpec):
            raise PlacementError(f"policy must be a RoleSpec (the policy is required), got {self.policy!r}")
        problems = self._consistency_problems()
        if problems:
            raise PlacementError(problems)

    # ----- construction from OpenRLHF-style flags -------------------------------------------

    @classmethod
    def from_flags(
        cls,
        *,
        actor_num_nodes: int = 1,
        actor_num_gpus_per_node: int = 1,
        critic_num_nodes: int | None = 0,
        critic_num_gpus_per_node: int | None = 0,
        ref_num_nodes: int | None = 0,
        ref_num_gpus_per_node: int | None = 0,
        reward_num_nodes: int | None = 0,
        reward_num_gpus_per_node: int | None = 0,
        vllm_num_engines: int | None = 0,
        vllm_tensor_parallel_size: int = 1,
        colocate_actor_ref: bool = False,
        colocate_critic_reward: bool = False,
        colocate_all_models: bool = False,
        teacher_num_nodes: int | None = 0,
        teacher_num_gpus_per_node: int | None = 0,
    ) -> PlacementPlan:
        """A plan from OpenRLHF's flag names. A role whose two counts are 0 (or None) is absent.

        Unlike OpenRLHF, which defaults every role to 1 node x 8 GPUs, absent is
        the default here: name the roles your run has.
        """
        problems: list[str] = []

        def role(prefix: str, nodes: int | None, gpus: int | None) -> RoleSpec | None:
            nodes, gpus = nodes or 0, gpus or 0
            for name, value in ((f"{prefix}_num_nodes", nodes), (f"{prefix}_num_gpus_per_node", gpus)):
                if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                    problems.append(f"{name} must be a non-negative integer, got {value!r}")
                    return None
            if nodes == 0 and gpus == 0:
                return None
            if nodes == 0 or gpus == 0:
                problems.append(
                    f"{prefix}_num_nodes={nodes} but {prefix}_num_gpus_per_node={gpus}: set both to 0 to "
                    f"leave the {prefix} model out, or both to positive numbers"
                )
                return None
            return RoleSpec(nodes, gpus)

        policy = role("actor", actor_num_nodes, actor_num_gpus_per_node)
        if policy is None and not problems:
            problems.append("actor_num_nodes and actor_num_gpus_per_node must be positive: the policy is required")
        critic = role("critic", critic_num_nodes, critic_num_gpus_per_node)
        ref = role("ref", ref_num_nodes, ref_num_gpus_per_node)
        reward = role("reward", reward_num_nodes, reward_num_gpus_per_node)
        teacher = role("teacher", teacher_num_nodes, teacher_num_gpus_per_node)
        engines = None
        n_engines = vllm_num_engines or 0
        if isinstance(n_engines, bool) or not isinstance(n_engines, int) or n_engines < 0:
            problems.append(f"vllm_num_engines must be a non-negative integer, got {vllm_num_engines!r}")
        elif (
            isinstance(vllm_tensor_parallel_size, bool)
            or not isinstance(vllm_tensor_parallel_size, int)
            or vllm_tensor_parallel_size < 1
        ):
            problems.append(f"vllm_tensor_parallel_size must be a positive integer, got {vllm_tensor_parallel_size!r}")
        elif n_engines:
            engines = EngineLayout(n_engines, vllm_tensor_parallel_size)
        if problems or policy is None:  # no policy always comes with its problem line
            raise PlacementError(problems)
        colocation = Colocation.NONE
        if colocate_actor_ref:
            colocation |= Colocation.POLICY_REF
        if colocate_critic_reward:
            colocation |= Colocation.CRITIC_REWARD
        if colocate_all_models:
            colocation |= Colocation.ALL
        return cls(
            policy=policy,
            critic=critic,
            ref=ref,
            reward=reward,
            engines=engines,
            colocation=colocation,
            teacher=teacher,
        )

    # ----- queries ------------------------------------------------------------------------------

    def role_spec(self, role: Role | str) -> RoleSpec | None:
        role = Role(role)
        if role is Role.VLLM:
            raise PlacementError("vllm is not a model role: use plan.engines and plan.engine_bundles()")
        return getattr(self, role.value)

    @property
    def roles(self) -> tuple[Role, ...]:
        """The model roles present, in the order policy, critic, ref, reward, teacher."""
        return tuple(r for r in MODEL_ROLES if getattr(self, r.value) is not None)

    @property
    def hybrid(self) -> bool:
        return Colocation.ALL in self.colocation

    def bundle_groups(self) -> tuple[BundleGroup, ...]:
        """The placement groups this plan needs, each a list of one-GPU bundles."""
        groups: list[BundleGroup] = []

        def model_group(name: str, roles: tuple[Role, ...]) -> BundleGroup:
            spec: RoleSpec = getattr(self, roles[0].value)
            bundles = [[Slot(role, i) for role in roles] for i in range(spec.num_gpus)]
            return BundleGroup(name, spec.num_nodes, spec.num_gpus_per_node, tuple(map(tuple, bundles)))

        if self.hybrid:
            bundles = [[Slot(role, i) for role in self.roles] for i in range(self.policy.num_gpus)]
            if self.engines is not None:
                tp = self.engines.tensor_parallel_size
                for e in range(self.engines.num_engines):
                    for t in range(tp):
                        bundles[e * tp + t].append(Slot(Role.VLLM, e, t))
            groups.append(
                BundleGroup("hybrid", self.policy.num_nodes, self.policy.num_gpus_per_node, tuple(map(tuple, bundles)))
            )
            return tuple(groups)
        if Colocation.POLICY_REF in self.colocation:  # the frozen models that score the policy's samples with it
            with_policy = tuple(r for r in (Role.POLICY, Role.REF, Role.TEACHER) if r in self.roles)
            groups.append(model_group("_".join(r.value for r in with_policy), with_policy))
        else:
            groups += [model_group(r.value, (r,)) for r in (Role.POLICY, Role.REF) if r in self.roles]
        if Colocation.CRITIC_REWARD in self.colocation:
            groups.append(model_group("critic_reward", (Role.CRITIC, Role.REWARD)))
        else:
            groups += [model_group(r.value, (r,)) for r in (Role.CRITIC, Role.REWARD) if r in self.roles]
        if Colocation.POLICY_REF not in self.colocation and Role.TEACHER in self.roles:
            groups.append(model_group("teacher", (Role.TEACHER,)))
        if self.engines is not None:
            tp = self.engines.tensor_parallel_size
            for e in range(self.engines.num_engines):
                slots = tuple((Slot(Role.VLLM, e, t),) for t in range(tp))
                groups.append(BundleGroup(f"vllm_e{e}", 1, tp, slots, one_node=True))
        return tuple(groups)

    @property
    def total_gpus(self) -> int:
        return sum(g.num_bundles for g in self.bundle_groups())

    def placement(self, role: Role | str) -> RolePlacement:
        """The group, bundles (rank order) and GPU share of a model role."""
        role = Role(role)
        if self.role_spec(role) is None:
            raise PlacementError(f"the plan has no {role.value} model (present: {', '.join(map(str, self.roles))})")
        for group in self.bundle_groups():
            indices = tuple(i for i, slots in enumerate(group.bundles) for s in slots if s.role is role)
            if indices:
                return RolePlacement(role, group.name, indices, group.gpu_share)
        raise AssertionError(f"{role} is in the plan but in no bundle group")  # a layout bug, not user error

    def engine_bundles(self) -> tuple[EngineBundles, ...]:
        """For each engine, its bundles (TP rank order) in its group; empty without engines."""
        out = []
        for group in self.bundle_groups():
            per_engine: dict[int, list[tuple[int, int]]] = {}
            for i, slots in enumerate(group.bundles):
                for s in slots:
                    if s.role is Role.VLLM:  # an engine's slots always carry their TP rank
                        per_engine.setdefault(s.rank, []).append((s.tp_rank or 0, i))
            for e, pairs in sorted(per_engine.items()):
                out.append(EngineBundles(e, group.name, tuple(i for _, i in sorted(pairs)), group.gpu_share))
        return tuple(out)

    # ----- validation ---------------------------------------------------------------------------

    def _consistency_problems(self) -> list[str]:
        problems: list[str] = []
        present = self.roles
        if Colocation.POLICY_REF in self.colocation and Role.REF not in present and Role.TEACHER not in present:
            problems.append(
                "colocate_actor_ref is set but the plan has no reference model: add ref_num_nodes/"
                "ref_num_gpus_per_node, or drop colocate_actor_ref"
            )
        if Colocation.CRITIC_REWARD in self.colocation:
            missing = [r.value for r in (Role.CRITIC, Role.REWARD) if r not in present]
            if missing:
                problems.append(
                    f"colocate_critic_reward is set but the plan has no {' or '.join(missing)} model: "
                    f"add it, or drop colocate_critic_reward"
                )
        if self.hybrid:
            for role in present[1:]:
                spec: RoleSpec = getattr(self, role.value)
                if spec != self.policy:
                    problems.append(self._shape_mismatch("colocate_all_models (hybrid engine)", Role.POLICY, role))
            if self.engines is not None:
                tp, n_policy = self.engines.tensor_parallel_size, self.policy.num_gpus
                if self.engines.num_gpus != n_policy:
                    fix = (
                        f"set vllm_num_engines={n_policy // tp} (with vllm_tensor_parallel_size={tp})"
                        if n_policy % tp == 0
                        else f"choose a vllm_tensor_parallel_size that divides {n_policy}"
                    )
                    problems.append(
                        f"colocate_all_models (hybrid engine) puts every vLLM engine on the policy's GPUs, so policy "
                        f"GPUs must equal vllm_num_engines x vllm_tensor_parallel_size: policy has "
                        f"{self.policy.shape()}, engines have {self.engines.shape()}; {fix}, or resize the policy to "
                        f"{self.engines.num_gpus} GPUs"
                    )
                elif self.policy.num_gpus_per_node % tp != 0:
                    problems.append(
                        f"vllm_tensor_parallel_size={tp} does not divide actor_num_gpus_per_node="
                        f"{self.policy.num_gpus_per_node}: in the hybrid engine an engine's TP ranks would span two "
                        f"nodes; use a TP that divides {self.policy.num_gpus_per_node}"
                    )
        else:
            if Colocation.POLICY_REF in self.colocation:
                for role in (Role.REF, Role.TEACHER):
                    spec = getattr(self, role.value)
                    if spec is not None and spec != self.policy:
                        problems.append(self._shape_mismatch("colocate_actor_ref", Role.POLICY, role))
            if (
                Colocation.CRITIC_REWARD in self.colocation
                and self.critic is not None
                and self.reward is not None
                and self.reward != self.critic
            ):
                problems.append(self._shape_mismatch("colocate_critic_reward", Role.CRITIC, Role.REWARD))
        return problems

    def _shape_mismatch(self, mode: str, lead: Role, other: Role) -> str:
        a: RoleSpec = getattr(self, lead.value)
        b: RoleSpec = getattr(self, other.value)
        return (
            f"{mode} puts {other.value} rank i on {lead.value} rank i's GPU, so both need the same nodes x GPUs "
            f"per node: {lead.value} has {a.shape()}, {other.value} has {b.shape()}; set "
            f"{FLAG_PREFIX[other]}_num_nodes={a.num_nodes} and {FLAG_PREFIX[other]}_num_gpus_per_node={a.num_gpus_per_node}, "
            f"or drop {mode.split(' ')[0]}"
        )

    def validate(self, cluster_gpus: int | None = None, gpus_per_node: int | None = None) -> None:
        """Check the plan against a cluster of ``cluster_gpus`` GPUs, ``gpus_per_node`` on each node.

        Pure Python: call it before any Ray call. Raises PlacementError listing
        every problem with the numbers involved. Internal consistency (colocated
        shapes, hybrid sizes) is already checked when the plan is built.
        """
        problems = self._consistency_problems()
        for name, value in (("cluster_gpus", cluster_gpus), ("gpus_per_node", gpus_per_node)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
                problems.append(f"{name} must be a non-negative integer, got {value!r}")
        if problems:
            raise PlacementError(problems)
        sized: list[tuple[str, int, str]] = [
            (r.value, getattr(self, r.value).num_gpus, getattr(self, r.value).shape()) for r in self.roles
        ]
        if self.engines is not None:
            sized.append(("vllm", self.engines.num_gpus, self.engines.shape()))
        if gpus_per_node is not None:
            for role in self.roles:
                spec: RoleSpec = getattr(self, role.value)
                if spec.num_gpus_per_node > gpus_per_node:
                    nodes = math.ceil(spec.num_gpus / gpus_per_node)
                    fix = (
                        f"use {FLAG_PREFIX[role]}_num_nodes={spec.num_gpus // gpus_per_node} and "
                        f"{FLAG_PREFIX[role]}_num_gpus_per_node={gpus_per_node}"
                        if spec.num_gpus % gpus_per_node == 0
                        else f"use at most {gpus_per_node} GPUs per node ({nodes} nodes or more)"
                    )
                    problems.append(
                        f"{role.value} asks for {spec.num_gpus_per_node} GPUs per node but the cluster's "
                        f"nodes have {gpus_per_node}: {fix}"
                    )
            if self.engines is not None and self.engines.tensor_parallel_size > gpus_per_node:
                problems.append(
                    f"vllm_tensor_parallel_size={self.engines.tensor_parallel_size} but the cluster's "
                    f"nodes have {gpus_per_node} GPUs: a tensor-parallel group cannot span nodes; use "
                    f"vllm_tensor_parallel_size <= {gpus_per_node} (and more engines)"
                )
            if cluster_gpus is not None and gpus_per_node > 0:
                cluster_nodes = cluster_gpus // gpus_per_node
                for role in self.roles:
                    spec = getattr(self, role.value)
                    if spec.num_nodes > cluster_nodes:
                        problems.append(
                            f"{role.value} asks for {spec.num_nodes} nodes but the cluster has "
                            f"{_plural(cluster_nodes, 'node')} of {gpus_per_node} GPUs: lower "
                            f"{FLAG_PREFIX[role]}_num_nodes or add nodes"
                        )
        if cluster_gpus is not None:
            for name, n, shape in sized:
                if n > cluster_gpus:
                    problems.append(
                        f"{name} needs {n} GPUs ({shape}) but the cluster has {cluster_gpus}: shrink "
                        f"{name} or add nodes"
                    )
            groups = self.bundle_groups()
            total = sum(g.num_bundles for g in groups)
            if total > cluster_gpus:
                parts = ", ".join(f"{g.name} {g.num_bundles}" for g in groups)
                hint = (
                    "colocate roles (colocate_actor_ref, colocate_critic_reward, or colocate_all_models), "
                    if not self.hybrid
                    else ""
                )
                problems.append(
                    f"the plan needs {total} GPUs but the cluster has {cluster_gpus} ({parts}): "
                    f"{hint}shrink roles or engines, or add nodes"
                )
        if problems:
            raise PlacementError(problems)

    # ----- the map ------------------------------------------------------------------------------

    def describe(self) -> str:
        """A GPU map: one line per GPU bundle, grouped by placement group and logical node."""
        groups = self.bundle_groups()
        total = sum(g.num_bundles for g in groups)
        lines = [
            f"PlacementPlan: {total} GPUs in {len(groups)} placement group"
            f"{'s' if len(groups) != 1 else ''}, colocation: {self.colocation.label()}"
        ]
        for g in groups:
            where = "one node" if g.one_node else f"{_plural(g.num_nodes, 'node')} x {_plural(g.gpus_per_node, 'GPU')}"
            lines.append(f"group {g.name} ({where}, {g.gpu_share:g} GPU per process):")
            for i, slots in enumerate(g.bundles):
                node, gpu = divmod(i, g.gpus_per_node)
                lines.append(f"  node{node}: gpu{gpu} [{', '.join(s.label() for s in slots)}]")
        lines.append("(node and gpu numbers count within each group; Ray picks the physical nodes)")
        return "\n".join(lines)
