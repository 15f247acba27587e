"""PlacementPlan without Ray: every colocation mode's GPU map, GPU shares, every error path.

Maps and messages are asserted as text: they are what a person reads before a
launch, so a change to them should be a deliberate one.
"""

import subprocess
import sys

import pytest

from rl_placement import (
    Colocation,
    EngineLayout,
    PlacementError,
    PlacementPlan,
    Role,
    RoleSpec,
    gpu_share,
)


def gpu_map(plan):
    """{group name: [[slot label, ...] per bundle]}"""
    return {g.name: [[s.label() for s in slots] for slots in g.bundles] for g in plan.bundle_groups()}


# ----- layouts of every mode ----------------------------------------------------------------------


def test_no_colocation_gives_every_role_and_engine_its_own_gpus():
    plan = PlacementPlan.from_flags(actor_num_gpus_per_node=2, critic_num_nodes=1, critic_num_gpus_per_node=1,
                                    ref_num_nodes=1, ref_num_gpus_per_node=1, reward_num_nodes=1,
                                    reward_num_gpus_per_node=1, vllm_num_engines=2, vllm_tensor_parallel_size=2)
    assert gpu_map(plan) == {
        "policy": [["policy r0"], ["policy r1"]], "ref": [["ref r0"]], "critic": [["critic r0"]],
        "reward": [["reward r0"]],
        "vllm_e0": [["vllm e0/tp0"], ["vllm e0/tp1"]], "vllm_e1": [["vllm e1/tp0"], ["vllm e1/tp1"]],
    }
    assert plan.total_gpus == 9
    assert [g.one_node for g in plan.bundle_groups()] == [False] * 4 + [True] * 2  # TP groups stay on a node
    assert {plan.placement(r).gpu_share for r in plan.roles} == {1.0}
    assert [(e.engine, e.group, e.bundle_indices, e.gpu_share) for e in plan.engine_bundles()] == [
        (0, "vllm_e0", (0, 1), 1.0), (1, "vllm_e1", (0, 1), 1.0)]


def test_actor_ref_colocation_shares_each_gpu_by_rank():
    plan = PlacementPlan(policy=RoleSpec(1, 4), ref=RoleSpec(1, 4), critic=RoleSpec(1, 2),
                         colocation=Colocation.POLICY_REF)
    assert plan.describe() == "\n".join([
        "PlacementPlan: 6 GPUs in 2 placement groups, colocation: policy+ref",
        "group policy_ref (1 node x 4 GPUs, 0.5 GPU per process):",
        "  node0: gpu0 [policy r0, ref r0]",
        "  node0: gpu1 [policy r1, ref r1]",
        "  node0: gpu2 [policy r2, ref r2]",
        "  node0: gpu3 [policy r3, ref r3]",
        "group critic (1 node x 2 GPUs, 1 GPU per process):",
        "  node0: gpu0 [critic r0]",
        "  node0: gpu1 [critic r1]",
        "(node and gpu numbers count within each group; Ray picks the physical nodes)",
    ])
    for role in (Role.POLICY, Role.REF):
        p = plan.placement(role)
        assert (p.group, p.bundle_indices, p.gpu_share) == ("policy_ref", (0, 1, 2, 3), 0.5)


def test_critic_reward_colocation_multi_node():
    plan = PlacementPlan.from_flags(actor_num_gpus_per_node=1, critic_num_nodes=2, critic_num_gpus_per_node=2,
                                    reward_num_nodes=2, reward_num_gpus_per_node=2, colocate_critic_reward=True)
    assert gpu_map(plan)["critic_reward"] == [["critic r0", "reward r0"], ["critic r1", "reward r1"],
                                              ["critic r2", "reward r2"], ["critic r3", "reward r3"]]
    text = plan.describe()
    assert "group critic_reward (2 nodes x 2 GPUs, 0.5 GPU per process):" in text
    assert "  node1: gpu0 [critic r2, reward r2]" in text and "  node1: gpu1 [critic r3, reward r3]" in text


def test_both_pair_colocations_at_once():
    plan = PlacementPlan(policy=RoleSpec(1, 2), ref=RoleSpec(1, 2), critic=RoleSpec(1, 1), reward=RoleSpec(1, 1),
                         colocation=Colocation.POLICY_REF | Colocation.CRITIC_REWARD)
    assert list(gpu_map(plan)) == ["policy_ref", "critic_reward"]
    assert plan.total_gpus == 3
    assert plan.colocation.label() == "policy+ref, critic+reward"


def test_hybrid_engine_puts_everything_on_the_actor_gpus():
    plan = PlacementPlan.from_flags(actor_num_nodes=2, actor_num_gpus_per_node=2, ref_num_nodes=2,
                                    ref_num_gpus_per_node=2, vllm_num_engines=2, vllm_tensor_parallel_size=2,
                                    colocate_all_models=True)
    assert plan.hybrid and plan.total_gpus == 4
    assert plan.describe() == "\n".join([
        "PlacementPlan: 4 GPUs in 1 placement group, colocation: all models + engines (hybrid engine)",
        "group hybrid (2 nodes x 2 GPUs, 0.33 GPU per process):",
        "  node0: gpu0 [policy r0, ref r0, vllm e0/tp0]",
        "  node0: gpu1 [policy r1, ref r1, vllm e0/tp1]",
        "  node1: gpu0 [policy r2, ref r2, vllm e1/tp0]",
        "  node1: gpu1 [policy r3, ref r3, vllm e1/tp1]",
        "(node and gpu numbers count within each group; Ray picks the physical nodes)",
    ])
    assert [(e.engine, e.group, e.bundle_indices) for e in plan.engine_bundles()] == [
        (0, "hybrid", (0, 1)), (1, "hybrid", (2, 3))]


def test_hybrid_with_all_five_roles_takes_a_fifth_each():
    spec = RoleSpec(1, 4)
    plan = PlacementPlan(policy=spec, critic=spec, ref=spec, reward=spec, engines=EngineLayout(4, 1),
                         colocation=Colocation.ALL)
    assert gpu_map(plan)["hybrid"][3] == ["policy r3", "critic r3", "ref r3", "reward r3", "vllm e3/tp0"]
    assert {plan.placement(r).gpu_share for r in plan.roles} == {0.2}
    assert {e.gpu_share for e in plan.engine_bundles()} == {0.2}


def test_hybrid_without_engines_colocates_the_models():
    plan = PlacementPlan(policy=RoleSpec(1, 2), ref=RoleSpec(1, 2), colocation=Colocation.ALL)
    assert gpu_map(plan) == {"hybrid": [["policy r0", "ref r0"], ["policy r1", "ref r1"]]}
    assert plan.engine_bundles() == ()


@pytest.mark.parametrize("k, share", [(1, 1.0), (2, 0.5), (3, 0.33), (4, 0.25), (5, 0.2), (6, 0.16)])
def test_gpu_share_fits_k_processes_on_one_gpu(k, share):
    assert gpu_share(k) == share and k * share <= 1.0


def test_from_flags_matches_the_constructor_and_drops_absent_roles():
    flags = PlacementPlan.from_flags(actor_num_nodes=1, actor_num_gpus_per_node=2, ref_num_nodes=1,
                                     ref_num_gpus_per_node=2, critic_num_nodes=None, critic_num_gpus_per_node=None,
                                     vllm_num_engines=None, colocate_actor_ref=True)
    direct = PlacementPlan(policy=RoleSpec(1, 2), ref=RoleSpec(1, 2), colocation=Colocation.POLICY_REF)
    assert flags == direct and flags.roles == (Role.POLICY, Role.REF) and flags.engines is None


def test_exact_fit_validates():
    plan = PlacementPlan(policy=RoleSpec(2, 4), critic=RoleSpec(1, 4), engines=EngineLayout(2, 2))
    plan.validate(cluster_gpus=16, gpus_per_node=4)
    plan.validate()  # without a cluster only the plan's own consistency is checked


def test_plan_needs_no_ray():
    code = ("import sys, rl_placement; p = rl_placement.PlacementPlan.from_flags(actor_num_gpus_per_node=2); "
            "p.validate(cluster_gpus=2); p.describe(); assert 'ray' not in sys.modules, 'ray was imported'")
    subprocess.run([sys.executable, "-c", code], check=True)


# ----- errors: what is wrong, with the numbers, and the fix ------------------------------------------


@pytest.mark.parametrize("make, message", [
    (lambda: RoleSpec(0, 4), "RoleSpec.num_nodes must be a positive integer, got 0"),
    (lambda: RoleSpec(1, 2.5), "RoleSpec.num_gpus_per_node must be a positive integer, got 2.5"),
    (lambda: EngineLayout(2, 0), "EngineLayout.tensor_parallel_size must be a positive integer, got 0"),
    (lambda: PlacementPlan(policy=None), "policy must be a RoleSpec (the policy is required), got None"),
])
def test_spec_errors(make, message):
    with pytest.raises(PlacementError) as info:
        make()
    assert str(info.value) == message


@pytest.mark.parametrize("flags, message", [
    (dict(ref_num_nodes=0, ref_num_gpus_per_node=3),
     "ref_num_nodes=0 but ref_num_gpus_per_node=3: set both to 0 to leave the ref model out, or both to positive "
     "numbers"),
    (dict(critic_num_nodes=-1, critic_num_gpus_per_node=2), "critic_num_nodes must be a non-negative integer, got -1"),
    (dict(actor_num_nodes=0, actor_num_gpus_per_node=0),
     "actor_num_nodes and actor_num_gpus_per_node must be positive: the policy is required"),
    (dict(vllm_num_engines=2, vllm_tensor_parallel_size=0),
     "vllm_tensor_parallel_size must be a positive integer, got 0"),
    (dict(vllm_num_engines=-2), "vllm_num_engines must be a non-negative integer, got -2"),
])
def test_flag_errors(flags, message):
    with pytest.raises(PlacementError) as info:
        PlacementPlan.from_flags(**flags)
    assert str(info.value) == message


def test_colocation_without_the_roles():
    with pytest.raises(PlacementError) as info:
        PlacementPlan(policy=RoleSpec(1, 1), critic=RoleSpec(1, 1),
                      colocation=Colocation.POLICY_REF | Colocation.CRITIC_REWARD)
    assert info.value.problems == (
        "colocate_actor_ref is set but the plan has no reference model: add ref_num_nodes/ref_num_gpus_per_node, "
        "or drop colocate_actor_ref",
        "colocate_critic_reward is set but the plan has no reward model: add it, or drop colocate_critic_reward",
    )
    assert str(info.value).startswith("2 problems:\n  - colocate_actor_ref is set")


def test_colocated_shapes_must_match():
    with pytest.raises(PlacementError) as info:
        PlacementPlan.from_flags(actor_num_gpus_per_node=4, ref_num_nodes=1, ref_num_gpus_per_node=2,
                                 colocate_actor_ref=True)
    assert str(info.value) == (
        "colocate_actor_ref puts ref rank i on policy rank i's GPU, so both need the same nodes x GPUs per node: "
        "policy has 1 node x 4 GPUs = 4, ref has 1 node x 2 GPUs = 2; set ref_num_nodes=1 and "
        "ref_num_gpus_per_node=4, or drop colocate_actor_ref")
    # Same GPU count, different shape: still a mismatch (rank i would sit on another node).
    with pytest.raises(PlacementError, match=r"critic has 2 nodes x 2 GPUs = 4, reward has 1 node x 4 GPUs = 4; "
                                             r"set reward_num_nodes=2 and reward_num_gpus_per_node=2"):
        PlacementPlan(policy=RoleSpec(1, 1), critic=RoleSpec(2, 2), reward=RoleSpec(1, 4),
                      colocation=Colocation.CRITIC_REWARD)


def test_hybrid_needs_actor_gpus_equal_engines_times_tp():
    with pytest.raises(PlacementError) as info:
        PlacementPlan.from_flags(actor_num_gpus_per_node=8, vllm_num_engines=2, vllm_tensor_parallel_size=2,
                                 colocate_all_models=True)
    assert str(info.value) == (
        "colocate_all_models (hybrid engine) puts every vLLM engine on the policy's GPUs, so policy GPUs must equal "
        "vllm_num_engines x vllm_tensor_parallel_size: policy has 1 node x 8 GPUs = 8, engines have 2 engines x TP 2 "
        "= 4; set vllm_num_engines=4 (with vllm_tensor_parallel_size=2), or resize the policy to 4 GPUs")
    with pytest.raises(PlacementError, match=r"choose a vllm_tensor_parallel_size that divides 4"):
        PlacementPlan(policy=RoleSpec(1, 4), engines=EngineLayout(1, 3), colocation=Colocation.ALL)


def test_hybrid_tp_may_not_span_nodes():
    with pytest.raises(PlacementError) as info:
        PlacementPlan(policy=RoleSpec(2, 2), engines=EngineLayout(1, 4), colocation=Colocation.ALL)
    assert str(info.value) == (
        "vllm_tensor_parallel_size=4 does not divide actor_num_gpus_per_node=2: in the hybrid engine an engine's "
        "TP ranks would span two nodes; use a TP that divides 2")


def test_hybrid_needs_every_model_the_actor_shape():
    with pytest.raises(PlacementError) as info:
        PlacementPlan(policy=RoleSpec(1, 4), critic=RoleSpec(1, 2), ref=RoleSpec(1, 4), reward=RoleSpec(1, 1),
                      engines=EngineLayout(4), colocation=Colocation.ALL)
    assert len(info.value.problems) == 2
    assert "critic has 1 node x 2 GPUs = 2; set critic_num_nodes=1 and critic_num_gpus_per_node=4" in str(info.value)
    assert "reward has 1 node x 1 GPU = 1; set reward_num_nodes=1 and reward_num_gpus_per_node=4" in str(info.value)


def test_role_larger_than_the_cluster():
    plan = PlacementPlan(policy=RoleSpec(2, 4))
    with pytest.raises(PlacementError) as info:
        plan.validate(cluster_gpus=4, gpus_per_node=4)
    assert info.value.problems == (
        "policy asks for 2 nodes but the cluster has 1 node of 4 GPUs: lower actor_num_nodes or add nodes",
        "policy needs 8 GPUs (2 nodes x 4 GPUs = 8) but the cluster has 4: shrink policy or add nodes",
        "the plan needs 8 GPUs but the cluster has 4 (policy 8): colocate roles (colocate_actor_ref, "
        "colocate_critic_reward, or colocate_all_models), shrink roles or engines, or add nodes",
    )


def test_total_larger_than_the_cluster_lists_each_group():
    plan = PlacementPlan(policy=RoleSpec(1, 4), ref=RoleSpec(1, 4), critic=RoleSpec(1, 2), engines=EngineLayout(2, 1),
                         colocation=Colocation.POLICY_REF)
    with pytest.raises(PlacementError) as info:
        plan.validate(cluster_gpus=6)
    assert str(info.value) == (
        "the plan needs 8 GPUs but the cluster has 6 (policy_ref 4, critic 2, vllm_e0 1, vllm_e1 1): colocate roles "
        "(colocate_actor_ref, colocate_critic_reward, or colocate_all_models), shrink roles or engines, or add nodes")


def test_roles_and_tp_wider_than_a_node():
    plan = PlacementPlan(policy=RoleSpec(1, 8), critic=RoleSpec(1, 6), engines=EngineLayout(1, 8))
    with pytest.raises(PlacementError) as info:
        plan.validate(gpus_per_node=4)
    assert info.value.problems == (
        "policy asks for 8 GPUs per node but the cluster's nodes have 4: use actor_num_nodes=2 and "
        "actor_num_gpus_per_node=4",
        "critic asks for 6 GPUs per node but the cluster's nodes have 4: use at most 4 GPUs per node (2 nodes or "
        "more)",
        "vllm_tensor_parallel_size=8 but the cluster's nodes have 4 GPUs: a tensor-parallel group cannot span nodes; "
        "use vllm_tensor_parallel_size <= 4 (and more engines)",
    )


def test_bad_cluster_numbers_and_lookups():
    plan = PlacementPlan(policy=RoleSpec(1, 1))
    with pytest.raises(PlacementError, match=r"cluster_gpus must be a non-negative integer, got -1"):
        plan.validate(cluster_gpus=-1)
    with pytest.raises(PlacementError, match=r"the plan has no critic model \(present: policy\)"):
        plan.placement("critic")
    with pytest.raises(PlacementError, match=r"vllm is not a model role: use plan.engines"):
        plan.role_spec("vllm")
    with pytest.raises(PlacementError, match=r"unknown role 'critc': valid roles are policy, critic, ref, reward, teacher, vllm \(OpenRLHF's actor is the policy\)"):
        plan.placement("critc")


def test_one_role_vocabulary_policy_with_openrlhfs_actor_as_its_alias():
    # rl-core calls the trained model the policy; OpenRLHF calls it the actor and its flags keep that prefix.
    plan = PlacementPlan.from_flags(actor_num_gpus_per_node=2, ref_num_nodes=1, ref_num_gpus_per_node=2,
                                    colocate_actor_ref=True)
    assert Role("actor") is Role.POLICY and str(Role.POLICY) == "policy"
    assert plan.placement("actor") == plan.placement("policy") == plan.placement(Role.POLICY)
    assert plan.roles == (Role.POLICY, Role.REF) and plan.colocation.label() == "policy+ref"
    from rl_placement import FLAG_PREFIX
    assert FLAG_PREFIX[Role.POLICY] == "actor"
