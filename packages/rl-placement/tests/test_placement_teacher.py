"""The on-policy distillation teacher in a plan: its own group by default, with the policy under
``colocate_actor_ref`` (beside the reference when there is one) and in the hybrid group under
``colocate_all_models``; its counts checked like every role's, naming the teacher's flags."""

import pytest

from rl_placement import FLAG_PREFIX, PlacementError, PlacementPlan, Role


def gpu_map(plan):
    return {g.name: [[s.label() for s in slots] for slots in g.bundles] for g in plan.bundle_groups()}


def test_the_teacher_has_its_own_group_without_colocation():
    plan = PlacementPlan.from_flags(actor_num_gpus_per_node=2, ref_num_nodes=1, ref_num_gpus_per_node=2,
                                    teacher_num_nodes=1, teacher_num_gpus_per_node=1, vllm_num_engines=1)
    assert gpu_map(plan) == {"policy": [["policy r0"], ["policy r1"]], "ref": [["ref r0"], ["ref r1"]],
                             "teacher": [["teacher r0"]], "vllm_e0": [["vllm e0/tp0"]]}
    assert plan.roles == (Role.POLICY, Role.REF, Role.TEACHER) and plan.total_gpus == 6
    assert plan.placement("teacher").gpu_share == 1.0 and FLAG_PREFIX[Role.TEACHER] == "teacher"


def test_colocate_actor_ref_puts_the_teacher_with_the_policy_and_the_reference():
    plan = PlacementPlan.from_flags(actor_num_gpus_per_node=2, ref_num_nodes=1, ref_num_gpus_per_node=2,
                                    teacher_num_nodes=1, teacher_num_gpus_per_node=2, colocate_actor_ref=True)
    assert gpu_map(plan) == {"policy_ref_teacher": [["policy r0", "ref r0", "teacher r0"],
                                                    ["policy r1", "ref r1", "teacher r1"]]}
    assert plan.placement("teacher").gpu_share == 0.33
    # no reference (KL off): the teacher alone joins the policy
    plan = PlacementPlan.from_flags(actor_num_gpus_per_node=2, teacher_num_nodes=1, teacher_num_gpus_per_node=2,
                                    colocate_actor_ref=True)
    assert gpu_map(plan) == {"policy_teacher": [["policy r0", "teacher r0"], ["policy r1", "teacher r1"]]}


def test_the_hybrid_engine_holds_the_teacher_too():
    plan = PlacementPlan.from_flags(actor_num_gpus_per_node=2, teacher_num_nodes=1, teacher_num_gpus_per_node=2,
                                    vllm_num_engines=2, colocate_all_models=True)
    assert gpu_map(plan) == {"hybrid": [["policy r0", "teacher r0", "vllm e0/tp0"],
                                        ["policy r1", "teacher r1", "vllm e1/tp0"]]}


@pytest.mark.parametrize(("flags", "says"), [
    (dict(teacher_num_gpus_per_node=1, colocate_actor_ref=True),
     "colocate_actor_ref puts teacher rank i on policy rank i's GPU, so both need the same nodes x GPUs per node: "
     "policy has 1 node x 2 GPUs = 2, teacher has 1 node x 1 GPU = 1; set teacher_num_nodes=1 and "
     "teacher_num_gpus_per_node=2, or drop colocate_actor_ref"),
    (dict(teacher_num_gpus_per_node=1, colocate_all_models=True),
     "colocate_all_models (hybrid engine) puts teacher rank i on policy rank i's GPU"),
    (dict(teacher_num_nodes=0, teacher_num_gpus_per_node=3),
     "teacher_num_nodes=0 but teacher_num_gpus_per_node=3: set both to 0 to leave the teacher model out"),
])
def test_a_teacher_that_cannot_sit_where_asked_is_refused_naming_its_flags(flags, says):
    flags = {"teacher_num_nodes": 1, **flags}
    with pytest.raises(PlacementError) as e:
        PlacementPlan.from_flags(actor_num_gpus_per_node=2, **flags)
    assert says in str(e.value)


def test_a_teacher_larger_than_the_cluster_is_refused_with_the_numbers():
    plan = PlacementPlan.from_flags(actor_num_gpus_per_node=1, teacher_num_nodes=1, teacher_num_gpus_per_node=4,
                                    vllm_num_engines=1)
    with pytest.raises(PlacementError) as e:
        plan.validate(cluster_gpus=3, gpus_per_node=3)
    msg = str(e.value)
    assert "teacher asks for 4 GPUs per node but the cluster's nodes have 3" in msg
    assert "teacher needs 4 GPUs (1 node x 4 GPUs = 4) but the cluster has 3" in msg
    assert "the plan needs 6 GPUs but the cluster has 3 (policy 1, teacher 4, vllm_e0 1)" in msg
