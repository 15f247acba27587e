"""``rl eval --ray``: the prompts of each generate call spread over ``--vllm_num_engines`` rollout engines, each a Ray
actor (:class:`rl_cli.ray_engines.RolloutEngineActor`, the actors ``rl ppo-ray`` generates with) on one GPU (a
logical one on a CPU machine: a fresh local Ray cluster declares ``--num_gpus`` of them).

:class:`EvalRayConfig` is the ``ray`` group of ``rl eval``'s flags; :class:`RayEngines` stands where the in-process
engine stands in :func:`rl_cli.eval_run.evaluate_model` (``generate(requests)``, ``shutdown()``): it cuts each call's
requests into one contiguous share per engine, sends the shares at once and joins the results in request order.
Every request carries its own seed (:mod:`rl_cli.eval_run`), so which engine draws a prompt changes nothing:
the samples are those of one engine in this process (tested). One engine per GPU (tensor parallel size 1); the
engines start for each model and stop after it.

Imports neither Ray nor torch at module level: ``rl eval --help`` reads the config only.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from rl_rollout.config_fields import meta


@dataclass(frozen=True)
class EvalRayConfig:
    """Where ``rl eval`` generates: one engine in this process, or engine actors on Ray."""

    ray: bool = field(
        default=False,
        metadata=meta(
            "generate on --vllm_num_engines rollout engines, each a Ray actor on one GPU (a fresh local Ray cluster "
            "unless RAY_ADDRESS names one), each generate call's prompts spread over them"
        ),
    )
    vllm_num_engines: int = field(default=1, metadata=meta("with --ray: engine actors (one GPU each)"))
    num_gpus: int | None = field(
        default=None,
        metadata=meta(
            "with --ray: GPUs the fresh local Ray cluster declares (logical ones on a CPU machine); default "
            "--vllm_num_engines"
        ),
    )

    def __post_init__(self) -> None:
        if not self.ray and (self.vllm_num_engines != 1 or self.num_gpus is not None):
            given = "--vllm_num_engines" if self.vllm_num_engines != 1 else "--num_gpus"
            raise ValueError(f"{given} places engines on Ray: add --ray, or drop {given}")
        if self.vllm_num_engines < 1:
            raise ValueError(f"--vllm_num_engines must be >= 1, got {self.vllm_num_engines}")
        if self.num_gpus is not None and self.num_gpus < self.vllm_num_engines:
            raise ValueError(
                f"--num_gpus {self.num_gpus} is fewer than --vllm_num_engines {self.vllm_num_engines} (one GPU per "
                f"engine): raise --num_gpus or lower --vllm_num_engines"
            )

    @property
    def gpus(self) -> int:
        return self.num_gpus if self.num_gpus is not None else self.vllm_num_engines


def start_ray(cfg: EvalRayConfig) -> None:
    """Join the cluster RAY_ADDRESS names, else start a fresh local one with ``cfg.gpus`` GPUs."""
    # lazy: Ray is only for --ray
    import ray

    from rl_cli.ppo_ray import _local_ray_env  # lazy: rl ppo-ray's module loads rl-core, only for --ray
    from rl_cli.ray_cluster import connect  # lazy: Ray's cluster helpers, only for --ray

    address = os.environ.get("RAY_ADDRESS")
    if address:
        connect(address, prog="rl eval")
    else:
        _local_ray_env()
        ray.init(address="local", num_gpus=cfg.gpus, include_dashboard=False, log_to_driver=True)


def stop_ray() -> None:
    import ray

    ray.shutdown()


@dataclass(frozen=True)
class _Placed:
    """The engines' bundles as :func:`rl_cli.ray_engines.start_engines` reads a placement (``engines()``)."""

    engines_: tuple

    def engines(self) -> tuple:
        return self.engines_


class RayEngines:
    """``n`` engine actors of ``engine_cfg`` (an :class:`rl_rollout.config.EngineConfig`) on ``model``, one GPU
    bundle each, behind one ``generate``. ``requests_per_engine``: how many requests each engine drew so far."""

    def __init__(self, engine_cfg, model: str, *, n: int, dtype: str, seed: int):
        # lazy: Ray and rl-placement are only for --ray
        from ray.util.placement_group import remove_placement_group

        from rl_cli.ray_engines import start_engines  # lazy: imports Ray, only for --ray
        from rl_placement import PlacedEngine, create_placement_group  # lazy: imports Ray, only for --ray

        self._remove = remove_placement_group
        self.pg = create_placement_group(n, name="rl-eval-engines")
        placed = _Placed(tuple(PlacedEngine(e, self.pg, (e,), 1.0, "") for e in range(n)))
        try:
            self.groups = start_engines(placed, engine_cfg, model, dtype=dtype, seed=seed)
        except BaseException:
            self._remove(self.pg)
            raise
        self.requests_per_engine = [0] * n
        self._pool = ThreadPoolExecutor(max_workers=n)

    def describe(self) -> list[dict]:
        return [g.call_rank(0, "describe") for g in self.groups]

    def generate(self, requests: list) -> list[list[Any]]:
        n = len(self.groups)
        size, extra = divmod(len(requests), n)
        shares, start = [], 0
        for e in range(n):
            end = start + size + (e < extra)
            shares.append((e, requests[start:end]))
            start = end
        futures = [
            (e, self._pool.submit(self.groups[e].call_rank, 0, "generate", share)) for e, share in shares if share
        ]
        out: list[list[Any]] = []
        for e, f in futures:
            groups = f.result()
            self.requests_per_engine[e] += len(groups)
            out += groups
        return out

    def shutdown(self) -> None:
        try:
            for g in self.groups:
                try:
                    g.call_rank(0, "shutdown")
                finally:
                    g.shutdown()
        finally:
            self._pool.shutdown(wait=False)
            self._remove(self.pg)
