"""The vocabulary of a placement plan: roles, specs, slots, bundles, GPU shares.

This module owns the value types every other part of rl-placement speaks in:
:class:`PlacementError`, the model roles (:class:`Role`, ``MODEL_ROLES``), the
colocation modes (:class:`Colocation`), what a role or the vLLM engines ask for
(:class:`RoleSpec`, :class:`EngineLayout`), and what a layout is made of: a
process on a bundle (:class:`Slot`), a future placement group
(:class:`BundleGroup`), where a role's ranks or an engine's TP ranks go
(:class:`RolePlacement`, :class:`EngineBundles`), and :func:`gpu_share`.

Specs check their own numbers on construction; how roles combine into a layout,
and whether a layout fits a cluster, is :mod:`rl_placement.plan`'s business. It
imports only the standard library (no Ray, no torch).

GPU share: a bundle holding k processes gives each ``floor(100 / k) / 100`` of a
GPU (2 -> 0.5, 3 -> 0.33, 4 -> 0.25, 5 -> 0.2, the 0.2 OpenRLHF uses for its
hybrid engine). The share is only Ray's bookkeeping, so that k processes fit on
one bundle; it limits no memory (vLLM's ``gpu_memory_utilization`` and sleep
mode do that).
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass

__all__ = [
    "FLAG_PREFIX",
    "MODEL_ROLES",
    "BundleGroup",
    "Colocation",
    "EngineBundles",
    "EngineLayout",
    "PlacementError",
    "Role",
    "RolePlacement",
    "RoleSpec",
    "Slot",
    "gpu_share",
]


class PlacementError(ValueError):
    """A plan that cannot be placed; ``problems`` holds one sentence per problem."""

    def __init__(self, problems: list[str] | tuple[str, ...] | str):
        self.problems = (problems,) if isinstance(problems, str) else tuple(problems)
        if len(self.problems) == 1:
            message = self.problems[0]
        else:
            message = f"{len(self.problems)} problems:\n" + "\n".join(f"  - {p}" for p in self.problems)
        super().__init__(message)


class Role(str, enum.Enum):
    """The processes a plan places, named as rl-core names them (the trained model is the policy; the teacher is
    on-policy distillation's frozen teacher, placed as the reference is).

    ``Role("actor")`` is the policy: OpenRLHF calls it the actor, and its flags keep that prefix
    (``actor_num_nodes``); :data:`FLAG_PREFIX` maps each role to its flags' prefix.
    """

    POLICY = "policy"
    CRITIC = "critic"
    REF = "ref"
    REWARD = "reward"
    TEACHER = "teacher"
    VLLM = "vllm"

    def __str__(self) -> str:
        return self.value

    @classmethod
    def _missing_(cls, value: object) -> Role:
        if value == "actor":  # OpenRLHF's name for the policy
            return cls.POLICY
        raise PlacementError(
            f"unknown role {value!r}: valid roles are {', '.join(r.value for r in cls)} (OpenRLHF's actor is the policy)"
        )


MODEL_ROLES = (Role.POLICY, Role.CRITIC, Role.REF, Role.REWARD, Role.TEACHER)

# The prefix of each model role's OpenRLHF flags (actor_num_nodes, ref_num_gpus_per_node, ...).
FLAG_PREFIX = {
    Role.POLICY: "actor",
    Role.CRITIC: "critic",
    Role.REF: "ref",
    Role.REWARD: "reward",
    Role.TEACHER: "teacher",
}


class Colocation(enum.Flag):
    """Which roles share GPUs. Combine with ``|``; ``ALL`` is the hybrid engine."""

    NONE = 0
    POLICY_REF = enum.auto()
    CRITIC_REWARD = enum.auto()
    ALL = enum.auto()

    def label(self) -> str:
        names = {
            Colocation.POLICY_REF: "policy+ref",
            Colocation.CRITIC_REWARD: "critic+reward",
            Colocation.ALL: "all models + engines (hybrid engine)",
        }
        parts = [text for flag, text in names.items() if flag in self]
        return ", ".join(parts) if parts else "none"


def _plural(n: int, word: str) -> str:
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


def _check_count(value: object, what: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise PlacementError(f"{what} must be a positive integer, got {value!r}")


@dataclass(frozen=True)
class RoleSpec:
    """A model role: ``num_nodes`` x ``num_gpus_per_node`` ranks, one GPU (bundle) each."""

    num_nodes: int
    num_gpus_per_node: int

    def __post_init__(self) -> None:
        _check_count(self.num_nodes, "RoleSpec.num_nodes")
        _check_count(self.num_gpus_per_node, "RoleSpec.num_gpus_per_node")

    @property
    def num_gpus(self) -> int:
        return self.num_nodes * self.num_gpus_per_node

    def shape(self) -> str:
        return f"{_plural(self.num_nodes, 'node')} x {_plural(self.num_gpus_per_node, 'GPU')} = {self.num_gpus}"


@dataclass(frozen=True)
class EngineLayout:
    """vLLM engines: ``num_engines`` engines of ``tensor_parallel_size`` GPUs each."""

    num_engines: int
    tensor_parallel_size: int = 1

    def __post_init__(self) -> None:
        _check_count(self.num_engines, "EngineLayout.num_engines")
        _check_count(self.tensor_parallel_size, "EngineLayout.tensor_parallel_size")

    @property
    def num_gpus(self) -> int:
        return self.num_engines * self.tensor_parallel_size

    def shape(self) -> str:
        return f"{_plural(self.num_engines, 'engine')} x TP {self.tensor_parallel_size} = {self.num_gpus}"


@dataclass(frozen=True)
class Slot:
    """One process on one bundle: a model rank, or one TP rank of an engine."""

    role: Role
    rank: int
    tp_rank: int | None = None

    def label(self) -> str:
        if self.role is Role.VLLM:
            return f"vllm e{self.rank}/tp{self.tp_rank}"
        return f"{self.role.value} r{self.rank}"


@dataclass(frozen=True)
class BundleGroup:
    """One future Ray placement group: ``bundles[i]`` lists the slots on GPU bundle i.

    ``one_node`` groups (a separate engine's TP ranks) must sit on a single node
    and are created STRICT_PACK; the others take the strategy asked for.
    """

    name: str
    num_nodes: int
    gpus_per_node: int
    bundles: tuple[tuple[Slot, ...], ...]
    one_node: bool = False

    @property
    def num_bundles(self) -> int:
        return len(self.bundles)

    @property
    def gpu_share(self) -> float:
        return gpu_share(max(len(slots) for slots in self.bundles))


@dataclass(frozen=True)
class RolePlacement:
    """Where a model role's ranks go: rank i on ``bundle_indices[i]`` of ``group``."""

    role: Role
    group: str
    bundle_indices: tuple[int, ...]
    gpu_share: float


@dataclass(frozen=True)
class EngineBundles:
    """Engine ``engine``'s bundles, one per TP rank, in ``group`` (logical indices)."""

    engine: int
    group: str
    bundle_indices: tuple[int, ...]
    gpu_share: float


def gpu_share(processes_per_bundle: int) -> float:
    """The GPU fraction each of k processes on one bundle asks Ray for (floored to 0.01)."""
    _check_count(processes_per_bundle, "processes_per_bundle")
    return math.floor(100 / processes_per_bundle) / 100
