"""The weight syncs: the policy's new weights into the rollout engines after each train step (the loop's
``weight_sync(version) -> stats``), over the worker groups of :mod:`rl_core.rl.groups`.

- :class:`BroadcastWeightSync`: policy -> engines over rl-rollout's collective
  transport (gloo on CPU, NCCL on GPU): policy rank 0 is the sender, each engine's
  workers the receivers; the policy ranks and engines are called concurrently
  (a broadcast needs both ends).
- :class:`IpcWeightSync`: the hybrid engine on GPUs: policy rank i and engine i share a GPU;
  each rank gathers the full weights into CUDA IPC buckets its engine reads in place
  (rl-rollout's :class:`~rl_rollout.ipc.IpcSender`), only a few hundred bytes cross the
  process boundary per sync.
- :class:`DirectWeightSync`: an engine in the controller's process
  (``engine.update_weights``), for ``rl ppo`` with a :class:`~rl_core.rl.groups.LocalGroup` policy.
- :func:`verify_engines`: the engines hold what the policy sent.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Sequence
from typing import Any

from rl_core.rl.groups import GroupRollout, WorkerGroup, _engine_pid, concurrently, sync_calls

logger = logging.getLogger(__name__)


class BroadcastWeightSync:
    """Policy -> engines over the collective transport. ``engine_workers[i]``: engine i's TP size.

    :meth:`setup` builds the weight group once (policy rank 0 = rank 0, engine i's
    workers the next ``engine_workers[i]`` ranks); each call broadcasts one version.
    """

    def __init__(
        self,
        policy: WorkerGroup,
        rollout: GroupRollout,
        *,
        backend: str = "gloo",
        engine_workers: Sequence[int] | None = None,
        verify: bool = False,
        timeout_s: float = 600.0,
    ):
        self.policy, self.rollout, self.backend, self.verify, self.timeout_s = (
            policy,
            rollout,
            backend,
            verify,
            timeout_s,
        )
        self.engine_workers = list(engine_workers or [1] * len(rollout.engines))
        if len(self.engine_workers) != len(rollout.engines):
            raise ValueError(
                f"engine_workers has {len(self.engine_workers)} entries for {len(rollout.engines)} engines"
            )
        self.pids = [_engine_pid(g) for g in rollout.engines]  # while they live: to name one that dies later
        self._ready = False

    def setup(self) -> None:
        addr, port = self.policy.call_rank(0, "weight_sender_address")
        world = 1 + sum(self.engine_workers)
        offsets = [1 + sum(self.engine_workers[:i]) for i in range(len(self.engine_workers))]
        t = self.timeout_s
        sync_calls(
            "weight group setup",
            self.policy,
            ("init_weight_sender", lambda: self.policy.call("init_weight_sender", addr, port, world, self.backend, t)),
            self.rollout.engines,
            [
                (
                    "init_weight_group",
                    functools.partial(
                        g.call_rank,
                        0,
                        "init_weight_group",
                        addr,
                        port,
                        world,
                        rank_offset=off,
                        backend=self.backend,
                        timeout_s=t,
                    ),
                )
                for g, off in zip(self.rollout.engines, offsets, strict=True)
            ],
            self.pids,
        )
        logger.info("weight group: %s:%d, %d ranks (%s)", addr, port, world, self.backend)
        self._ready = True

    def __call__(self, version: int) -> dict:
        if not self._ready:
            self.setup()
        results = sync_calls(
            f"weight sync to version {version}",
            self.policy,
            ("broadcast_weights", lambda: self.policy.call("broadcast_weights", version, self.verify)),
            self.rollout.engines,
            [
                ("receive_weights", functools.partial(g.call_rank, 0, "receive_weights", verify=self.verify))
                for g in self.rollout.engines
            ],
            self.pids,
        )
        stats = results[0][0]
        stats = stats if isinstance(stats, dict) else {}
        if self.verify:
            stats["verify_s"] = verify_engines(self.policy, self.rollout.engines)
        return stats


class IpcWeightSync:
    """Policy rank i -> engine i over CUDA IPC (hybrid engine, tensor parallel 1: one engine per policy rank).

    ZeRO-0/1/2 without LoRA: each engine reads its rank's parameters where they are (no extra copy of the
    model on the GPU, the engine's load is the sync's one device copy), unless the weights move between
    syncs (DeepSpeed sleep offloads them): then, as under ZeRO-3 and LoRA, each rank keeps one packed copy
    of the full weights in its IPC buckets between syncs, and under ZeRO-3 a gathered copy as well while a
    sync runs: plan for one to two extra model copies per GPU there.
    """

    def __init__(self, policy: WorkerGroup, rollout: GroupRollout, *, verify: bool = False):
        if len(rollout.engines) != policy.world_size:
            raise ValueError(
                f"CUDA IPC sync pairs policy rank i with engine i on one GPU: {policy.world_size} policy "
                f"ranks but {len(rollout.engines)} engines; use --colocate_all_models with "
                f"vllm_num_engines == actor GPUs (tensor parallel 1), or the broadcast sync"
            )
        self.policy, self.rollout, self.verify = policy, rollout, verify

    def __call__(self, version: int) -> dict:
        t0 = time.perf_counter()
        shared = self.policy.call("share_weights_ipc", version, self.verify)
        t1 = time.perf_counter()
        loaded = concurrently(
            *[
                (lambda g=g, s=s: g.call_rank(0, "update_weights_ipc", s["sync"], version, verify=self.verify))
                for g, s in zip(self.rollout.engines, shared, strict=True)
            ]
        )
        sec = time.perf_counter() - t0
        nbytes = shared[0]["bytes"]  # what each engine loaded (every rank shares the full weights)
        # an engine actor answers {"tensors", "work_s"} (its own time in the load) or the tensor count alone
        work = [n.get("work_s") if isinstance(n, dict) else None for n in loaded]
        tensors = sum(int((n.get("tensors") if isinstance(n, dict) else n) or 0) for n in loaded)
        out = {
            "version": version,
            "tensors": tensors,
            "bytes": nbytes,
            "seconds": sec,
            "gb_per_s": nbytes / max(sec, 1e-9) / 1e9,
            "in_place": bool(shared[0].get("in_place")),
            "share_s": t1 - t0,
            "load_s": sec - (t1 - t0),
        }  # the policy's call, then the engines'
        if "work_s" in shared[0]:  # inside the policy's method; the rest of share_s is the Ray call
            out["share_work_s"] = max(s["work_s"] for s in shared)
        if all(w is not None for w in work):  # inside the engines' actors; the rest of load_s is the Ray call
            out["load_work_s"] = max(w for w in work if w is not None)  # all of them
        if self.verify:
            out["verify_s"] = verify_engines(self.policy, self.rollout.engines)
        return out


class DirectWeightSync:
    """Policy (a :class:`LocalGroup`) -> an engine object in this process, in one update (one vLLM session);
    ``verify``: the engine checks it holds what was sent after every sync."""

    def __init__(self, policy: WorkerGroup, engine: Any, *, verify: bool = False):  # call_rank is all it uses
        self.policy, self.engine, self.verify = policy, engine, verify

    def __call__(self, version: int) -> dict:
        return self.policy.call_rank(0, "push_weights", self.engine, version, self.verify)


def verify_engines(policy: WorkerGroup, engines: Sequence[WorkerGroup]) -> float:
    """Every engine checks it holds the policy's weights (per-tensor count, sum, sum of squares); raises the
    engine's WeightSyncError naming the tensors that differ. Returns the seconds it took."""

    t0 = time.perf_counter()
    expected = policy.call("weight_stats")[0]
    concurrently(*[(lambda g=g: g.call_rank(0, "verify_weights", expected)) for g in engines])
    return time.perf_counter() - t0
