"""The group factory ``rl ppo-ray`` hands rl-core's :func:`~rl_core.rl.build.build_run`: roles as Ray actors.

Each role is a ``RayActorGroup`` of rl-placement (one actor per rank, on the
plan's bundles, with the torch.distributed environment of a DeepSpeed world); the
engines are :class:`~rl_cli.ray_engines.RolloutEngineActor` groups behind rl-core's
:class:`~rl_core.rl.groups.GroupRollout`; the weight sync is the collective broadcast
(gloo / NCCL) or, for the hybrid engine on GPUs, CUDA IPC, chosen by
:meth:`rl_rollout.WeightSyncConfig.resolve` from where the policy runs.
"""

from __future__ import annotations

from typing import Any

from rl_cli import ray_workers as rw
from rl_cli.ray_engines import engine_gpus, spawn_engines, start_engines
from rl_core.rl import (
    BroadcastWeightSync,
    CriticWorker,
    GroupRollout,
    IpcWeightSync,
    PolicyWorker,
    ReferenceWorker,
    RewardModelWorker,
)
from rl_core.rl.teacher import TeacherWorker
from rl_placement import RayActorGroup
from rl_rollout.config import EngineConfig, WeightSyncConfig

# rl-core's role -> (the Ray actor class, the plan's role name)
RAY_ROLES = {
    PolicyWorker: (rw.RayPolicyWorker, "policy"),
    CriticWorker: (rw.RayCriticWorker, "critic"),
    ReferenceWorker: (rw.RayReferenceWorker, "ref"),
    RewardModelWorker: (rw.RayRewardModelWorker, "reward"),
    TeacherWorker: (rw.RayTeacherWorker, "teacher"),  # on-policy distillation's frozen teacher, placed as the ref
}


class RayFactory:
    """Roles, engines and weight sync over a placed plan (``rl_placement.create_placement_groups``)."""

    def __init__(
        self,
        placed,
        *,
        colocated: bool,
        call_timeout_s: float = 3600.0,
        engine_env: dict[str, str] | None = None,
        role_env: dict[str, str] | None = None,
        partial_rollout: bool = False,
    ):
        self.placed, self.colocated, self.call_timeout_s = placed, colocated, call_timeout_s
        # partial rollouts: a weight load must reach an engine actor while its generate samples (between chunks)
        self.engine_concurrency = 4 if partial_rollout else 1
        self.engine_env = engine_env  # set in each engine actor before its engine starts
        self.role_env = role_env  # set in each role actor before it builds (e.g. rl_cli.extensions.ENV)
        self.gpus = engine_gpus(placed)  # TP > 1 engines' GPU ids, read before any actor fills the bundles
        self.groups: list[Any] = []
        self.engines: list[Any] = []
        self.backend: str | None = None
        self.device = "?"
        self._spawned: list[Any] | None = None  # empty engine actors (spawn_engines), filled by rollout()

    @property
    def trained_ranks(self) -> int:
        """Ranks of the larger trained role (policy, critic) of the plan: what ``build_run``'s ``auto`` choices size
        ZeRO by (rl_core.rl.auto: ZeRO-2 over several ranks; ZeRO-0 on one GPU)."""
        specs = (self.placed.plan.role_spec(r) for r in ("policy", "critic"))
        return max((s.num_gpus for s in specs if s is not None), default=1)

    def spawn_engines(self, engine_kind: str) -> None:
        """Start the engine actors now, empty: their processes start and import ``engine_kind``'s libraries
        while the models load (vLLM's import alone takes seconds); :meth:`rollout` builds the engines in them
        after the models, as before. Call before :meth:`role`."""
        self._spawned = spawn_engines(
            self.placed,
            engine_kind=engine_kind,
            gpus=self.gpus,
            env=self.engine_env,
            call_timeout_s=self.call_timeout_s,
            max_concurrency=self.engine_concurrency,
        )

    def role(self, name: str, worker_cls: type, *args: Any, **kwargs: Any):
        """The role's actors, asked for without waiting for their ``__init__`` (model load, DeepSpeed): the roles
        load at the same time, as OpenRLHF's do; the first call to a group, or :meth:`rollout`, waits."""
        ray_cls, plan_role = RAY_ROLES[worker_cls]
        g = RayActorGroup.from_plan(
            ray_cls,
            self.placed,
            plan_role,
            init_args=args,
            init_kwargs=kwargs,
            call_timeout_s=self.call_timeout_s,
            wait=False,
            env=self.role_env,
        )
        self.groups.append(g)
        return g

    def rollout(self, engine_cfg: EngineConfig, model: str, *, dtype: str, seed: int, device: str) -> GroupRollout:
        # the roles first: an engine sizes its KV cache from the GPU memory it finds free, so it starts after the
        # models that share its GPUs are loaded (the engines then start together)
        for g in self.groups:
            g.wait_ready()
        # each engine actor builds its own options (its device is the GPU Ray gives it; seed + its index)
        if self._spawned is None and self.engine_concurrency > 1:  # threaded actors: start_engines' own are not
            self.spawn_engines(engine_cfg.kind)
        spawned, self._spawned = self._spawned, None  # start_engines owns them now (shuts them down on a failure)
        self.engines = start_engines(
            self.placed,
            engine_cfg,
            model,
            gpus=self.gpus,
            dtype=dtype,
            seed=seed,
            env=self.engine_env,
            call_timeout_s=self.call_timeout_s,
            actors=spawned,
        )
        self.groups.extend(self.engines)
        return GroupRollout(self.engines)

    def weight_sync(self, policy, rollout: GroupRollout, sync_cfg: WeightSyncConfig):
        ranks = policy.call("world")
        self.device = f"{ranks[0]['device']} x {policy.world_size}"
        if ranks[0].get("ring_attn"):  # what the ranks themselves report: their place in their ring group
            self.device += " in ring attention groups (" + ", ".join(r["ring_attn"] for r in ranks) + ")"
        tps = [g.call_rank(0, "describe")["tensor_parallel_size"] for g in self.engines]
        self.backend = sync_cfg.resolve(
            in_process=False,
            on_gpu=self.device.startswith("cuda"),
            colocated=self.colocated,
            tensor_parallel_size=max(tps),
        )
        if self.backend == "ipc":
            return IpcWeightSync(policy, rollout, verify=sync_cfg.verify)
        return BroadcastWeightSync(policy, rollout, backend=self.backend, engine_workers=tps, verify=sync_cfg.verify)

    def describe(self) -> str:
        e0 = self.engines[0].call_rank(0, "describe") if self.engines else {}
        gpus = ",".join(e0.get("visible_devices") or [])
        return (
            f"{len(self.groups)} actor groups up; policy on {self.device}; {len(self.engines)} engine(s) "
            f"{e0.get('kind')} TP {e0.get('tensor_parallel_size')}{' on GPUs ' + gpus if gpus else ''}; "
            f"weight sync {self.backend}"
        )

    def shutdown(self) -> None:
        for g in reversed(self.groups + (self._spawned or [])):
            g.shutdown()
