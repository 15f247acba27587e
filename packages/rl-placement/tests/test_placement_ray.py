"""RayActorGroup and placement groups on a real one-node Ray with 4 logical GPUs (CPU only).

One Ray session for the module. Checks: every colocation mode gives each actor
the GPU ids the plan says; the torch.distributed env of every rank; a gloo
all-reduce across two ranks; sharded calls; a plan that cannot fit fails before
any actor starts; a killed, raising or hung actor becomes an ActorCallError
naming role and rank, within the timeout.
"""

import os
import threading
import time

import pytest
import ray
from ray.util.placement_group import placement_group_table

from rl_placement import (
    ActorCallError,
    Colocation,
    EngineLayout,
    PlacementError,
    PlacementPlan,
    RayActorGroup,
    RoleSpec,
    create_placement_group,
    create_placement_groups,
)

ENV_KEYS = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "EXTRA")


class Worker:
    """A small real actor: reports where it runs, echoes shards, sleeps, fails on demand."""

    def __init__(self, marker_dir=None, fail_on_rank=None, mark=None, wait_for=None):
        if marker_dir is not None:
            open(os.path.join(marker_dir, f"started-{os.environ['RANK']}"), "w").close()
        if fail_on_rank is not None and int(os.environ["RANK"]) == fail_on_rank:
            raise RuntimeError("init failed on purpose")
        if mark is not None:  # this __init__ is running
            open(mark, "w").close()
        if wait_for is not None:  # ... and finishes only once another group's __init__ runs too
            deadline = time.monotonic() + 30
            while not os.path.exists(wait_for):
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{wait_for} never appeared: the other group's __init__ did not run meanwhile")
                time.sleep(0.05)

    def where(self):
        return {"gpus": [int(g) for g in ray.get_gpu_ids()],
                "node": ray.get_runtime_context().get_node_id(),
                "env": {k: os.environ.get(k) for k in ENV_KEYS}}

    def where_shard(self, shard):
        return self.where()

    def double(self, shard):
        return [2 * x for x in shard]

    def shard_size(self, shard):
        return [len(shard)]

    def fail_on(self, rank):
        if int(os.environ["RANK"]) == rank:
            raise ValueError(f"bad input on rank {rank}")
        return "ok"

    def sleep(self, seconds):
        time.sleep(seconds)
        return seconds

    def all_reduce(self, value):
        """init_process_group("gloo") from the env the group set (once), then all_reduce."""
        import torch
        import torch.distributed as dist

        if not dist.is_initialized():
            dist.init_process_group("gloo", init_method="env://")
        t = torch.tensor([float(value), 1.0])
        dist.all_reduce(t)
        return t.tolist()

    def all_reduce_shard(self, shard):
        (value,) = shard
        return [self.all_reduce(value)]


@pytest.fixture(scope="module", autouse=True)
def ray_session(ray_worker_env):
    ray.init(address="local", num_cpus=2, num_gpus=4, include_dashboard=False, log_to_driver=False)  # not a concurrent cluster
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def workers():
    """Two ranks on a 2-bundle PACK group, shared by the tests that leave them alive."""
    pg = create_placement_group(2, timeout_s=30)
    group = RayActorGroup(Worker, "actor", 2, placement_group=pg, env={"EXTRA": "x"}, start_timeout_s=60,
                          owns_placement_group=True)
    yield group
    group.shutdown()


def gpu_ids_per_rank(groups):
    return {role: [w["gpus"] for w in g.call("where", timeout=30)] for role, g in groups.items()}


def start_roles(plan, roles):
    placed = create_placement_groups(plan, timeout_s=30)
    groups = {}
    try:
        for role in roles:
            groups[role] = RayActorGroup.from_plan(Worker, placed, role, start_timeout_s=60)
        return placed, groups
    except BaseException:
        for g in groups.values():
            g.shutdown()
        placed.remove()
        raise


def stop_roles(placed, groups):
    for g in groups.values():
        g.shutdown()
    placed.remove()


def test_every_colocation_mode_gets_the_planned_gpus():
    roles = ["policy", "critic", "ref", "reward"]
    # No colocation: four roles, four distinct GPUs.
    plan = PlacementPlan(policy=RoleSpec(1, 1), critic=RoleSpec(1, 1), ref=RoleSpec(1, 1), reward=RoleSpec(1, 1))
    placed, groups = start_roles(plan, roles)
    try:
        ids = gpu_ids_per_rank(groups)
        assert sorted(i for per_rank in ids.values() for (i,) in per_rank) == [0, 1, 2, 3]
    finally:
        stop_roles(placed, groups)

    # actor+ref and critic+reward: each pair on one GPU, half a GPU each; the pairs on different GPUs.
    plan = PlacementPlan(policy=RoleSpec(1, 1), critic=RoleSpec(1, 1), ref=RoleSpec(1, 1), reward=RoleSpec(1, 1),
                         colocation=Colocation.POLICY_REF | Colocation.CRITIC_REWARD)
    assert {plan.placement(r).gpu_share for r in roles} == {0.5}
    placed, groups = start_roles(plan, roles)
    try:
        ids = gpu_ids_per_rank(groups)
        assert ids["policy"] == ids["ref"] and ids["critic"] == ids["reward"] and ids["policy"] != ids["critic"]
    finally:
        stop_roles(placed, groups)


def test_hybrid_engine_gpus_and_engine_bundles():
    # Hybrid: the actor and a TP=2 engine on the same two GPUs, half each; engine TP rank i on actor rank i's
    # GPU. (More roles on the bundle only shrink the share: see test_placement_plan.py.)
    plan = PlacementPlan(policy=RoleSpec(1, 2), engines=EngineLayout(1, 2), colocation=Colocation.ALL)
    placed, groups = start_roles(plan, ["policy"])
    try:
        (engine,) = placed.engines()
        assert engine.bundle_indices == (0, 1) and engine.gpu_share == 0.5
        # Stand-ins for the engine's two TP workers, one per bundle, as vLLM's executor would place them.
        tp = RayActorGroup(Worker, "vllm", 2, placement_group=engine.placement_group,
                           bundle_indices=engine.bundle_indices, num_gpus_per_actor=engine.gpu_share,
                           start_timeout_s=60)
        groups["vllm"] = tp
        ids = gpu_ids_per_rank(groups)
        assert ids["policy"] == ids["vllm"]
        assert len({i for (i,) in ids["policy"]}) == 2
        assert placed.role("policy").gpu_share == 0.5
    finally:
        stop_roles(placed, groups)


def test_bundle_gpu_ids_are_the_gpus_the_bundles_actors_get():
    """What a TP>1 engine sets CUDA_VISIBLE_DEVICES to: its bundles' GPUs, the ones Ray gives actors there."""
    from rl_placement import bundle_gpu_ids

    pg = create_placement_group(3, timeout_s=30)
    try:
        ids = bundle_gpu_ids(pg, [2, 0])
        assert len(set(ids)) == 2 and all(i.isdigit() for i in ids)
        with RayActorGroup(Worker, "vllm", 2, placement_group=pg, bundle_indices=[2, 0], start_timeout_s=60) as g:
            assert [str(w["gpus"][0]) for w in g.call("where")] == ids
            with pytest.raises(PlacementError, match=r"bundles \[0\]: no GPU id within 2 s .*before actors take"):
                bundle_gpu_ids(pg, [0], timeout_s=2)  # the actor holds bundle 0's whole GPU
    finally:
        ray.util.remove_placement_group(pg)


def test_plan_that_cannot_fit_fails_before_any_actor(tmp_path):
    pgs_before = len(placement_group_table())
    plan = PlacementPlan(policy=RoleSpec(1, 4), critic=RoleSpec(1, 4))
    with pytest.raises(PlacementError, match=r"the plan needs 8 GPUs but the cluster has 4 \(policy 4, critic 4\)"):
        placed = create_placement_groups(plan)
        RayActorGroup.from_plan(Worker, placed, "actor", init_kwargs={"marker_dir": str(tmp_path)})
    too_wide = PlacementPlan(policy=RoleSpec(1, 8))
    with pytest.raises(PlacementError, match=r"policy asks for 8 GPUs per node but the cluster's nodes have 4"):
        create_placement_groups(too_wide)
    assert len(placement_group_table()) == pgs_before  # no placement group was made
    assert list(tmp_path.iterdir()) == []  # no actor ran


def test_placement_group_that_cannot_be_placed_times_out_cleanly():
    hold = create_placement_group(3, timeout_s=30)  # leaves one GPU free
    try:
        t0 = time.monotonic()
        with pytest.raises(PlacementError, match=r"2 bundles .* not placed within 1 s: the cluster has 1 of 4 GPUs"):
            create_placement_group(2, timeout_s=1, name="two")
        assert time.monotonic() - t0 < 10
    finally:
        ray.util.remove_placement_group(hold)


def test_failing_init_names_the_rank(tmp_path):
    pg = create_placement_group(2, timeout_s=30)
    with pytest.raises(ActorCallError, match=r"actor rank 1 failed in '__init__': its __init__ raised") as info:
        RayActorGroup(Worker, "actor", 2, placement_group=pg, init_kwargs={"fail_on_rank": 1},
                      start_timeout_s=60, owns_placement_group=True)
    assert info.value.rank == 1 and "init failed on purpose" in str(info.value)


def test_groups_made_without_waiting_start_their_inits_together(tmp_path):
    """wait=False: the constructor returns with the __init__s under way, so a second group's __init__ runs while the
    first one's does (each waits for the other's marker: made one after the other, the first would time out)."""
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    pga, pgb = create_placement_group(1, timeout_s=30), create_placement_group(1, timeout_s=30)
    first = RayActorGroup(Worker, "actor", 1, placement_group=pga, init_kwargs={"mark": a, "wait_for": b},
                          start_timeout_s=60, owns_placement_group=True, wait=False)
    second = RayActorGroup(Worker, "critic", 1, placement_group=pgb, init_kwargs={"mark": b, "wait_for": a},
                           start_timeout_s=60, owns_placement_group=True, wait=False)
    try:
        first.wait_ready()
        assert second.call("where", timeout=30)[0]["env"]["WORLD_SIZE"] == "1"  # a call waits for the __init__
    finally:
        first.shutdown()
        second.shutdown()
    # a failing __init__ of a group made without waiting is reported when it is waited for, as in the constructor
    pg = create_placement_group(2, timeout_s=30)
    late = RayActorGroup(Worker, "ref", 2, placement_group=pg, init_kwargs={"fail_on_rank": 0}, start_timeout_s=60,
                         owns_placement_group=True, wait=False)
    with pytest.raises(ActorCallError, match=r"ref rank 0 failed in '__init__': its __init__ raised"):
        late.call("where", timeout=30)
    with pytest.raises(RuntimeError, match="was shut down"):  # and the group is gone
        late.call("where", timeout=30)


def test_killed_and_hung_actors_raise_instead_of_hanging():
    pg = create_placement_group(2, timeout_s=30)
    with RayActorGroup(Worker, "critic", 2, placement_group=pg, start_timeout_s=60,
                       owns_placement_group=True) as group:
        # Hung: both ranks sleep past the timeout.
        t0 = time.monotonic()
        with pytest.raises(ActorCallError, match=r"critic: 2 ranks failed in 'sleep': rank 0: no answer within 1 s"):
            group.call("sleep", 3, timeout=1)
        assert time.monotonic() - t0 < 3
        group.call("sleep", 0, timeout=30)  # the earlier sleeps drain; the actors are alive
        # Dead: rank 1 is killed in the middle of a long call.
        victim = group.actors[1]
        killer = threading.Timer(1.0, lambda: ray.kill(victim, no_restart=True))
        killer.start()
        t0 = time.monotonic()
        with pytest.raises(ActorCallError, match=r"critic rank 1 failed in 'sleep': the actor died") as info:
            group.call("sleep", 30, timeout=20)
        killer.join()
        assert time.monotonic() - t0 < 10
        assert (info.value.role, info.value.rank) == ("critic", 1)
        # Health check: rank 1 is dead, rank 0 is still in its 30 s sleep; both are reported.
        with pytest.raises(ActorCallError, match=r"critic: 2 ranks failed in 'health_check'") as info:
            group.health_check(timeout=1)
        assert "rank 0: no answer within 1 s" in str(info.value) and "rank 1: the actor died" in str(info.value)


# The shared `workers` group holds two GPUs from its first use to the end of the module, so the
# tests using it come last: those above need all four GPUs.


def test_env_of_every_rank(workers):
    info = workers.call("where", timeout=30)
    env0, env1 = info[0]["env"], info[1]["env"]
    assert env0["MASTER_ADDR"] == env1["MASTER_ADDR"] == ray.util.get_node_ip_address()
    assert env0["MASTER_PORT"] == env1["MASTER_PORT"] and int(env0["MASTER_PORT"]) > 0
    assert [e["env"]["RANK"] for e in info] == ["0", "1"]
    assert {e["env"]["WORLD_SIZE"] for e in info} == {"2"}
    assert [e["env"]["LOCAL_RANK"] for e in info] == ["0", "1"]  # one node: local rank == rank
    assert {e["env"]["LOCAL_WORLD_SIZE"] for e in info} == {"2"}
    assert {e["env"]["EXTRA"] for e in info} == {"x"}
    assert [r.rank for r in workers.ranks] == [0, 1] and [r.local_rank for r in workers.ranks] == [0, 1]
    # One whole GPU per rank, on different bundles.
    gpus = [e["gpus"] for e in info]
    assert all(len(g) == 1 for g in gpus) and gpus[0] != gpus[1]


def test_call_sharded(workers):
    assert workers.call_sharded("double", [1, 2, 3, 4], timeout=30) == [2, 4, 6, 8]
    with pytest.raises(ValueError, match=r"5 items do not split evenly over 2 ranks .*pad to 6 items.*shards of 3, 2"):
        workers.call_sharded("double", [1, 2, 3, 4, 5], timeout=30)
    assert workers.call_sharded("double", [1, 2, 3, 4, 5], timeout=30, allow_uneven=True) == [2, 4, 6, 8, 10]
    assert workers.call_sharded("shard_size", [7], timeout=30, allow_uneven=True) == [1, 0]
    assert workers.call_rank(1, "double", [5], timeout=30) == [10]
    with pytest.raises(TypeError, match=r"actor rank 0: 'where_shard' returned dict, call_sharded needs a list per shard"):
        workers.call_sharded("where_shard", [1, 2], timeout=30)


def test_remote_exception_names_role_and_rank(workers):
    with pytest.raises(ActorCallError, match=r"actor rank 1 failed in 'fail_on': it raised ValueError") as info:
        workers.call("fail_on", 1, timeout=30)
    assert (info.value.role, info.value.rank, info.value.method) == ("actor", 1, "fail_on")
    assert "bad input on rank 1" in str(info.value)
    workers.health_check(timeout=30)  # a raising method leaves the actors alive


def test_gloo_all_reduce_in_a_group(workers):
    pytest.importorskip("torch", reason="the gloo all-reduce needs torch (not a dependency of rl-placement)")
    # Rank r contributes r + 1: the sum is 1 + 2 = 3, and the ones count the ranks.
    assert workers.call_sharded("all_reduce_shard", [1, 2], timeout=90) == [[3.0, 2.0], [3.0, 2.0]]
