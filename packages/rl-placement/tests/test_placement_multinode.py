"""Two Ray nodes on this machine (ray.cluster_utils.Cluster), 2 logical GPUs each.

Checks what one node cannot show: SPREAD puts ranks on different nodes and PACK
on one, LOCAL_RANK counts within a node, ranks run node-major even when Ray
interleaves bundles, a hybrid engine's TP ranks stay on one node, and the live
cluster's shape feeds plan validation.
"""

import os

import pytest
import ray
from ray.cluster_utils import Cluster

from rl_placement import (
    Colocation,
    EngineLayout,
    PlacementError,
    PlacementPlan,
    RayActorGroup,
    RoleSpec,
    bundle_node_ids,
    cluster_gpus,
    create_placement_group,
    create_placement_groups,
)


class Where:
    def where(self):
        return {"node": ray.get_runtime_context().get_node_id(), "gpus": [int(g) for g in ray.get_gpu_ids()],
                **{k: os.environ[k] for k in ("MASTER_ADDR", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")}}


@pytest.fixture(scope="module", autouse=True)
def two_nodes(ray_worker_env):
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "num_gpus": 2, "include_dashboard": False})
    cluster.add_node(num_cpus=1, num_gpus=2)
    ray.init(address=cluster.address, log_to_driver=False)
    cluster.wait_for_nodes()
    yield cluster
    ray.shutdown()
    cluster.shutdown()


def start(pg, n, **kwargs):
    return RayActorGroup(Where, "actor", n, placement_group=pg, start_timeout_s=60, owns_placement_group=True,
                         **kwargs)


def test_cluster_shape_feeds_validation():
    assert cluster_gpus() == (4, 2)
    with pytest.raises(PlacementError, match=r"policy asks for 4 GPUs per node but the cluster's nodes have 2: use "
                                             r"actor_num_nodes=2 and actor_num_gpus_per_node=2"):
        create_placement_groups(PlacementPlan(policy=RoleSpec(1, 4)))
    with pytest.raises(PlacementError, match=r"vllm_tensor_parallel_size=4 but the cluster's nodes have 2 GPUs"):
        create_placement_groups(PlacementPlan(policy=RoleSpec(1, 1), engines=EngineLayout(1, 4)))


def test_spread_and_pack_choose_the_nodes():
    with start(create_placement_group(2, strategy="SPREAD"), 2) as group:
        a, b = group.call("where", timeout=30)
        assert a["node"] != b["node"]
        assert (a["LOCAL_RANK"], b["LOCAL_RANK"]) == ("0", "0") and a["LOCAL_WORLD_SIZE"] == "1"
        assert a["MASTER_ADDR"] == b["MASTER_ADDR"]  # rank 0's node; both nodes share this machine's IP
    with start(create_placement_group(2, strategy="PACK"), 2) as group:
        a, b = group.call("where", timeout=30)
        assert a["node"] == b["node"] and a["gpus"] != b["gpus"]
        assert (a["LOCAL_RANK"], b["LOCAL_RANK"]) == ("0", "1") and a["LOCAL_WORLD_SIZE"] == "2"


def test_multinode_hybrid_keeps_tp_groups_on_one_node():
    # 2 nodes x 2 GPUs of actor, two TP=2 engines on the same GPUs. SPREAD interleaves the
    # bundles over the nodes (0 and 2 on one, 1 and 3 on the other); ranks must still run node-major.
    plan = PlacementPlan(policy=RoleSpec(2, 2), engines=EngineLayout(2, 2), colocation=Colocation.ALL)
    placed = create_placement_groups(plan, strategy="SPREAD", timeout_s=30)
    try:
        nodes = bundle_node_ids(placed.placement_group("hybrid"))
        assert len(set(nodes.values())) == 2
        with RayActorGroup.from_plan(Where, placed, "policy", start_timeout_s=60) as group:
            info = group.call("where", timeout=30)
            rank_nodes = [i["node"] for i in info]
            assert rank_nodes[0] == rank_nodes[1] != rank_nodes[2] == rank_nodes[3]
            assert [i["LOCAL_RANK"] for i in info] == ["0", "1", "0", "1"]
            assert {i["WORLD_SIZE"] for i in info} == {"4"} and [i["RANK"] for i in info] == ["0", "1", "2", "3"]
            assert info[0]["gpus"] != info[1]["gpus"] and info[2]["gpus"] != info[3]["gpus"]
            actor_bundles = placed.role("policy").bundle_indices
            for engine in placed.engines():
                e = engine.engine
                assert engine.bundle_indices == actor_bundles[2 * e:2 * e + 2]  # on actor ranks 2e, 2e+1
                assert {nodes[b] for b in engine.bundle_indices} == {engine.node_id} == {rank_nodes[2 * e]}
                assert engine.gpu_share == 0.5
    finally:
        placed.remove()
