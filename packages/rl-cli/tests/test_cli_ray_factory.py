"""RayFactory tells ``build_run`` how many ranks the trained roles have, so ``auto`` sizes ZeRO by the plan (a
Python caller of ``build_run`` over Ray gets ZeRO-2 across several ranks, not one GPU's ZeRO-0). Real Ray, with
logical GPUs; no actor starts."""

from __future__ import annotations

import os

import pytest

pytest.importorskip("ray")


@pytest.mark.parametrize(("actor", "critic", "want"), [(2, 0, 2), (1, 3, 3), (1, 0, 1)])
def test_trained_ranks_come_from_the_plan(actor, critic, want):
    import ray

    from rl_cli.ray_factory import RayFactory
    from rl_core.rl.auto import Hardware
    from rl_core.strategy import StrategyConfig, auto_zero_stage
    from rl_placement import PlacementPlan, create_placement_groups

    os.environ.setdefault("RAY_memory_monitor_refresh_ms", "0")
    ray.init(address="local", num_cpus=2, num_gpus=actor + critic + 1, include_dashboard=False)
    placed = None
    try:
        plan = PlacementPlan.from_flags(actor_num_gpus_per_node=actor, critic_num_nodes=1 if critic else 0,
                                        critic_num_gpus_per_node=critic, vllm_num_engines=1)
        placed = create_placement_groups(plan)
        factory = RayFactory(placed, colocated=False)
        assert factory.trained_ranks == want
        hw = Hardware.here(trained_ranks=factory.trained_ranks)
        stage, _ = auto_zero_stage(StrategyConfig(), cuda=True, world_size=hw.trained_ranks)
        assert stage == (0 if want == 1 else 2)  # as build_run resolves it on CUDA
    finally:
        if placed is not None:
            placed.remove()
        ray.shutdown()
