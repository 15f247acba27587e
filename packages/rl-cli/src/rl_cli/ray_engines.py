"""Rollout engines as Ray actors for ``rl ppo-ray``: one actor per engine, on the plan's bundles.

An engine of tensor parallel size 1 is one actor on its bundle with the plan's GPU
share (Ray narrows ``CUDA_VISIBLE_DEVICES`` to that GPU). An engine of TP > 1 is
one actor on its first bundle that runs vLLM's multiprocessing executor: its TP
worker processes use the GPUs of all the engine's bundles, which :func:`engine_gpus`
reads from Ray (``rl_placement.bundle_gpu_ids``) before any actor fills the
bundles, and the actor sets ``CUDA_VISIBLE_DEVICES`` to them before vLLM starts.
(OpenRLHF hands vLLM's Ray executor the bundles instead; the vLLM CPU build has no
Ray executor, so this path is the one that runs and is tested on CPU too.)

Imports neither rl-core nor vLLM at module level: the vLLM CPU environment tests
it with Ray, rl-placement and rl-rollout alone.
"""

from __future__ import annotations

import dataclasses
import os
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from rl_placement import RayActorGroup, bundle_gpu_ids
from rl_rollout.partial_modes import set_partial_rollout


def _one_visible_gpu() -> None:
    """Ray narrows CUDA_VISIBLE_DEVICES to the actor's own GPU: its local index is 0, whatever
    LOCAL_RANK the group computed from the node's ranks (DeepSpeed and the strategy read it)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and visible.strip() and "," not in visible:
        os.environ["LOCAL_RANK"] = "0"


class RolloutEngineActor:
    """One rollout engine (rl-rollout's HFEngine or VLLMEngine) in a Ray actor, with the methods the loop calls.

    ``visible_devices``: the GPU ids of a TP > 1 engine's bundles (its workers' devices). The actor starts empty
    (:func:`spawn_engines`), importing ``engine_kind``'s libraries if given (vLLM's import takes seconds) while the
    models load; :meth:`start` builds the engine afterwards (:func:`start_engines`)."""

    def __init__(self, visible_devices: list[str] | None = None, engine_kind: str | None = None):
        if visible_devices:
            os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(visible_devices)
        else:
            _one_visible_gpu()
        self.visible_devices = list(visible_devices or [])
        self.engine: Any = None
        self.kind: str | None = None
        if engine_kind is not None:
            _preload(engine_kind)

    def start(self, engine_cfg, model: str, context, extra: dict | None = None) -> str:
        """Build the engine (once); returns its class name."""
        if self.engine is not None:
            raise RuntimeError(f"this engine actor already runs a {self.kind}")
        import torch

        # the actor's own device: Ray narrowed CUDA_VISIBLE_DEVICES to its GPU (none on a CPU cluster)
        context = dataclasses.replace(context, device="cuda" if torch.cuda.is_available() else "cpu")
        self.engine = engine_cfg.make(
            model,
            dtype=context.dtype,
            seed=context.seed,
            device=context.device,
            in_process=context.in_process,
            tensor_parallel_size=context.tensor_parallel_size,
            extra=extra,
        )
        self.kind = type(self.engine).__name__
        return self.kind

    def describe(self) -> dict:
        return {
            "kind": self.kind,
            "pid": os.getpid(),
            "policy_version": self.engine.policy_version,
            "tensor_parallel_size": getattr(self.engine, "tensor_parallel_size", 1),
            "visible_devices": self.visible_devices,
        }

    def generate(self, requests: list) -> list[list]:
        return self.engine.generate(requests)

    def generate_turns(self, requests: list) -> list[list]:
        """One turn of several agent episodes (rl-core's ``GroupRollout.agenerate``): the HF engine's
        ``generate_batch`` (one generate call, seeds merged), any other engine's ``generate``."""
        batch = getattr(self.engine, "generate_batch", None)
        return batch(requests) if callable(batch) else self.engine.generate(requests)

    def set_partial_rollout(self, mode: str, tokens: int | None) -> str:
        """Partial rollouts (``--partial_rollout``, rl_rollout.partial_modes): the engine keeps its requests across
        a weight load (keep, vLLM) or samples ``tokens`` at a time (chunks), so a load arriving on another thread of
        this actor (``max_concurrency`` > 1: :func:`spawn_engines`) lands inside a generate in flight. Returns the
        mode the engine runs (``auto`` resolved)."""
        return set_partial_rollout(self.engine, mode, tokens).value

    def update_weights(self, named_tensors: list, version: int) -> None:
        self.engine.update_weights(named_tensors, version)

    def update_weights_ipc(self, sync, version: int, verify: bool = False) -> dict:
        """``{"tensors": n, "work_s": seconds in the engine's load}`` (the rest of the trainer's call is Ray's)."""
        t0 = time.perf_counter()
        n = self.engine.update_weights_ipc(sync, version, verify=verify)
        return {"tensors": n, "work_s": time.perf_counter() - t0}

    def init_weight_group(self, master_addr: str, master_port: int, world_size: int, **kw):
        return self.engine.init_weight_group(master_addr, master_port, world_size, **kw)

    def receive_weights(self, verify: bool = False) -> dict:
        return self.engine.receive_weights(verify=verify).as_dict()

    def verify_weights(self, expected: dict) -> dict:
        """The engine checks it holds ``expected`` (rl_rollout.weights.weight_stats); raises WeightSyncError."""
        return self.engine.verify_weights(expected)

    def weights_digest(self) -> dict[str, float]:
        """An HF engine's per-parameter sums (HF names, to compare with the policy's); a VLLMEngine's own digest."""
        digest = getattr(self.engine, "weights_digest", None)
        if callable(digest):
            return digest()
        return {n: p.detach().double().sum().item() for n, p in self.engine.model.named_parameters()}

    def sleep(self, level: int = 1) -> None:
        self.engine.sleep(level)

    def wake_up(self, tags: list[str] | None = None) -> None:
        self.engine.wake_up(tags)

    def shutdown(self) -> None:
        if self.engine is not None:
            self.engine.shutdown()


def _preload(kind: str) -> None:
    """Import the engine class of ``kind`` (``auto`` resolved here) and, for vLLM, vLLM itself: no CUDA yet."""
    # lazy: rl-rollout pulls torch; this module loads without it
    from rl_rollout.engine import resolve_engine

    spec = resolve_engine(kind)
    spec.load()
    if spec.name == "vllm":
        import vllm  # noqa: F401


def engine_gpus(placed) -> dict[int, list[str]]:
    """Engine index -> the GPU ids of its bundles, for the engines with TP > 1 (call before any actor starts)."""

    return {
        pe.engine: bundle_gpu_ids(pe.placement_group, pe.bundle_indices)
        for pe in placed.engines()
        if len(pe.bundle_indices) > 1
    }


def spawn_engines(
    placed,
    *,
    engine_kind: str | None = None,
    gpus: dict[int, list[str]] | None = None,
    env: dict[str, str] | None = None,
    call_timeout_s: float = 3600.0,
    start_timeout_s: float = 600.0,
    max_concurrency: int = 1,
) -> list[Any]:
    """One empty :class:`RolloutEngineActor` group per engine of the plan, not waited for: the actors start and
    import ``engine_kind``'s libraries while the models load; :func:`start_engines` with ``actors=`` builds the
    engines in them later (an engine sizes its KV cache from the GPU memory the models left).

    ``max_concurrency`` > 1: threaded actors, so that a weight load runs while a generate is in flight (partial
    rollouts; the engine's own lock orders the two, and releases it between a partial rollout's chunks)."""

    groups = []
    try:
        for pe in placed.engines():
            visible = (gpus or {}).get(pe.engine) if len(pe.bundle_indices) > 1 else None
            groups.append(
                RayActorGroup(
                    RolloutEngineActor,
                    f"engine{pe.engine}",
                    1,
                    placement_group=pe.placement_group,
                    bundle_indices=[pe.bundle_indices[0]],
                    num_gpus_per_actor=pe.gpu_share,
                    env=env,
                    init_kwargs={"visible_devices": visible, "engine_kind": engine_kind},
                    call_timeout_s=call_timeout_s,
                    start_timeout_s=start_timeout_s,
                    actor_options={"max_concurrency": max_concurrency} if max_concurrency > 1 else None,
                    wait=False,
                )
            )
    except BaseException:
        for g in groups:
            g.shutdown()
        raise
    return groups


def start_engines(
    placed,
    engine_cfg,
    model: str,
    *,
    gpus: dict[int, list[str]] | None = None,
    dtype: str = "float32",
    seed: int = 0,
    extra: dict | None = None,
    env: dict[str, str] | None = None,
    call_timeout_s: float = 3600.0,
    start_timeout_s: float = 600.0,
    actors: list[Any] | None = None,
) -> list[Any]:
    """One :class:`RolloutEngineActor` group per engine of the plan; ``gpus`` from :func:`engine_gpus`.

    ``engine_cfg``: an :class:`rl_rollout.config.EngineConfig` (or a backend's name); each actor
    builds its engine through the backend's registry entry, engine e with seed ``seed + e``.
    ``extra``: keyword arguments for the engine class over the config's. A TP > 1 engine needs a
    backend whose entry has ``tensor_parallel`` (``auto`` takes the first such; vLLM's spans
    ``gpus[e]`` with its multiprocessing executor). ``actors``: the groups :func:`spawn_engines` made
    for this plan (with the same ``gpus``), to build the engines in; without, they are spawned here.
    On any failure every group is shut down, ``actors`` included."""

    # lazy: rl-rollout pulls torch; this module loads without it
    from rl_rollout import engine_names, engine_spec
    from rl_rollout.config import EngineConfig
    from rl_rollout.engine import EngineContext

    if isinstance(engine_cfg, str):
        engine_cfg = EngineConfig(kind=engine_cfg)
    groups = list(actors or [])
    try:
        todo = []
        for pe in placed.engines():
            tp = len(pe.bundle_indices)
            cfg = engine_cfg
            if tp > 1:
                if cfg.kind == "auto":
                    sharded = [n for n in engine_names() if engine_spec(n).tensor_parallel]
                    cfg = dataclasses.replace(cfg, kind=sharded[0])
                elif not engine_spec(cfg.kind).tensor_parallel:
                    raise ValueError(
                        f"engine {pe.engine} has tensor parallel size {tp}: the {cfg.kind} engine "
                        f"runs on one GPU; use --rollout_engine vllm (or tensor parallel 1 with "
                        f"more engines)"
                    )
                visible = (gpus or {}).get(pe.engine)
                if not visible or len(visible) != tp:
                    raise ValueError(
                        f"engine {pe.engine} (TP {tp}) needs the GPU ids of its {tp} bundles: "
                        f"pass gpus=engine_gpus(placed), read before any actor started"
                    )
            todo.append((cfg, EngineContext(dtype=dtype, seed=seed + pe.engine, tensor_parallel_size=tp)))
        if actors is None:
            groups = actors = spawn_engines(
                placed, gpus=gpus, env=env, call_timeout_s=call_timeout_s, start_timeout_s=start_timeout_s
            )
        elif len(actors) != len(todo):
            raise ValueError(
                f"{len(actors)} spawned engine actors for a plan of {len(todo)} engines: pass "
                f"the groups spawn_engines made for this plan"
            )
        # the engines start together; an actor that could not start (its __init__, its bundle) is named here
        with ThreadPoolExecutor(max_workers=max(1, len(todo))) as pool:
            done = [
                pool.submit(g.call_rank, 0, "start", cfg, model, ctx, extra, timeout=start_timeout_s)
                for g, (cfg, ctx) in zip(actors, todo, strict=True)
            ]
            for f in done:
                f.result()
    except BaseException:
        for g in groups:
            g.shutdown()
        raise
    return groups
