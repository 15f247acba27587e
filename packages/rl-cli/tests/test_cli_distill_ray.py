"""On-policy distillation over Ray (``rl ppo-ray --teacher_pretrain``, CPU, logical GPUs).

The teacher is a Ray role placed like the reference: its own placement group by default
(``--teacher_num_nodes`` / ``--teacher_num_gpus_per_node``, defaulting to the reference's counts), with the policy
under ``--colocate_actor_ref`` and in the hybrid group under ``--colocate_all_models``. Each run is ``rl ppo-ray``
in this process (its driver is the test), with the loop's experience forwards recorded on the way (the real
forwards run; a copy of each batch's items is kept): the teacher log-probs the Ray actor put into the experience
are then recomputed for the same tokens by the same teacher in this process (rl-core's ``TeacherWorker``, what
``rl ppo`` builds), and must agree. Measured on this 2-core machine: max |Ray - one process| = 0.0 in both
placements (the same fp32 forward on the same CPU; TOL 1e-5 leaves room for another BLAS path). The file took
146 s with other jobs loading the machine (load average 5 on 2 cores): the fixture 54 s (first imports, two tiny
models), the separate run 48 s, the hybrid run 35 s, the refusals 9 s.
"""

from __future__ import annotations

import copy
import json
import math

import pytest

from rl_cli.main import main

pytestmark = [pytest.mark.timeout(900), pytest.mark.slow]
REWARD = "def letter(prompt, response, label, **info):\n    return min(response.count(label), 8) / 8\n"
TOL = 1e-5  # max |teacher log-prob over Ray - the same teacher in one process|, per token (measured: 0.0)
ITERATIONS = 2


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    from rl_rollout.testing import make_tiny_model

    root = tmp_path_factory.mktemp("distill-ray")
    student = make_tiny_model(root / "student", seed=0)
    teacher = make_tiny_model(root / "teacher", seed=1)  # other weights, the same tokenizer
    (root / "prompts.jsonl").write_text(
        "".join(json.dumps({"prompt": f"Repeat the letter {c}: ", "label": c}) + "\n" for c in "abcd")
    )
    (root / "reward.py").write_text(REWARD)
    return root, student, teacher


def argv(root, student, teacher, run, *extra) -> list[str]:
    return ["ppo-ray", "--pretrain", str(student), "--teacher_pretrain", str(teacher), "--prompt_data",
            str(root / "prompts.jsonl"), "--input_key", "prompt", "--label_key", "label", "--reward_fn",
            f"{root / 'reward.py'}:letter", "--advantage_estimator", "group_norm", "--init_kl_coef", "0", "--n_samples_per_prompt", "4",
            "--rollout_batch_size", "4", "--train_batch_size", "16", "--micro_train_batch_size", "8",
            "--generate_max_len", "6", "--max_len", "64", "--max_iterations", str(ITERATIONS), "--bf16", "false",
            "--zero_stage", "0", "--rollout_engine", "hf", "--seed", "0", "--actor_num_gpus_per_node", "1",
            "--vllm_num_engines", "1", "--run_dir", str(root / run), *extra]


def run_recorded(monkeypatch, args: list[str]) -> tuple[list[dict], list]:
    """``rl ppo-ray`` here; the metrics rows and a copy of every batch the experience forwards filled."""
    from rl_core.trainers.ppo_experience import ExperienceMaker

    batches: list = []
    forwards = ExperienceMaker.forwards

    def recorded(self, items):
        forwards(self, items)
        batches.append(copy.deepcopy(items))

    monkeypatch.setattr(ExperienceMaker, "forwards", recorded)
    monkeypatch.setenv("RAY_memory_monitor_refresh_ms", "0")
    monkeypatch.setenv("RAY_DEDUP_LOGS", "0")
    assert main(args) == 0
    run_dir = args[args.index("--run_dir") + 1]
    with open(f"{run_dir}/metrics.jsonl") as f:
        return [json.loads(x) for x in f], batches


def check_against_one_process(rows: list[dict], batches: list, teacher, student, topk: int | None = None) -> float:
    """The teacher log-probs in the experience are the one-process teacher's for the same tokens; the logged
    reverse KL is finite. With ``topk`` (``--distill_divergence forward_kl``) the teacher's top-k ids and log-probs
    of each response token too. Returns the largest per-token difference."""
    import torch
    from transformers import AutoTokenizer

    from rl_core.rl.teacher import TeacherWorker
    from rl_core.strategy_config import StrategyConfig

    assert [r["step"] for r in rows] == list(range(1, ITERATIONS + 1))
    for r in rows:
        assert math.isfinite(r["rl/distill/reverse_kl"]) and math.isfinite(r["rl/distill/teacher_logprob"]), r
        assert r["rl/distill/teacher_logprob"] < 0, r
    assert len(batches) == ITERATIONS and all(len(b) == 16 for b in batches)
    tok = AutoTokenizer.from_pretrained(student)
    local = TeacherWorker(StrategyConfig(bf16=False, zero_stage=0, seed=0), str(teacher), load_kw={"dtype": "fp32"},
                          pad_id=tok.pad_token_id, temperature=1.0)
    worst = 0.0
    for items in batches:
        here = local.logprobs([copy.deepcopy(it) for it in items])
        if topk is not None:
            top = local.topk_logprobs([copy.deepcopy(it) for it in items], topk)
            for it, want_top, want in zip(items, top, here, strict=True):
                R = it.T - it.prompt_len
                assert it.teacher_topk_ids_RK.shape == (R, topk) and it.teacher_topk_ids_RK.dtype == torch.int32
                assert torch.equal(it.teacher_topk_ids_RK, want_top.ids_RK)
                worst = max(worst, (it.teacher_topk_logprobs_RK - want_top.logprobs_RK).abs().max().item())
                # the sampled tokens' log-probs come from the same forward, as the reverse-KL path's
                assert torch.allclose(want_top.logprobs_T[it.prompt_len :], want[it.prompt_len :], atol=TOL)
        for it, want in zip(items, here, strict=True):
            got = it.teacher_logprobs_T
            assert got is not None and got.shape == want.shape
            mask = torch.tensor(it.loss_mask_T, dtype=torch.bool)
            assert mask.sum() > 0 and (got[mask] < 0).all()  # real log-probs on the response tokens
            worst = max(worst, (got.float() - want.float()).abs().max().item())
        # and the logged teacher log-prob is the experience's mean over the response tokens (one batch per row)
    for r, items in zip(rows, batches, strict=True):
        mask = torch.cat([torch.tensor(it.loss_mask_T, dtype=torch.float) for it in items])
        lp = torch.cat([it.teacher_logprobs_T.float() for it in items])
        assert r["rl/distill/teacher_logprob"] == pytest.approx(((lp * mask).sum() / mask.sum()).item(), abs=1e-5)
    print(f"max |teacher log-prob over Ray - one process| = {worst:.3g}")
    assert worst <= TOL, worst
    return worst


def test_the_teacher_in_its_own_placement_group_scores_as_in_one_process(task, monkeypatch, capsys):
    root, student, teacher = task
    rows, batches = run_recorded(monkeypatch, argv(root, student, teacher, "separate", "--num_gpus", "3"))
    out = capsys.readouterr().out
    assert "group teacher (1 node x 1 GPU, 1 GPU per process):\n  node0: gpu0 [teacher r0]" in out, out
    assert "3 actor groups up" in out  # policy, teacher, engine
    check_against_one_process(rows, batches, teacher, student)


def test_colocated_with_the_policy_and_the_sleeping_engine_on_one_gpu(task, monkeypatch, capsys):
    """This run trains on the top-k forward KL (``--distill_divergence forward_kl --distill_topk 8``): the Ray
    teacher's top-k reaches the policy's actor through the experience and is the one-process teacher's."""
    root, student, teacher = task
    rows, batches = run_recorded(
        monkeypatch,
        argv(root, student, teacher, "hybrid", "--num_gpus", "1", "--colocate_all_models", "--vllm_enable_sleep",
             "--distill_mode", "loss", "--distill_divergence", "forward_kl", "--distill_topk", "8"))
    out = capsys.readouterr().out
    assert "  node0: gpu0 [policy r0, teacher r0, vllm e0/tp0]" in out, out
    # the engine slept while the models worked and woke for each sync, every model role's ranks (the teacher's
    # too) releasing their cached device memory first
    assert all(r["rl/wake_s"] > 0 for r in rows), rows
    assert all(r["rl/distill_loss"] > 0 for r in rows), rows  # the forward KL to the teacher's top 8, trained on
    check_against_one_process(rows, batches, teacher, student, topk=8)


def test_a_teacher_that_cannot_be_placed_is_refused_before_models_load(task, capsys):
    root, student, teacher = task
    # more GPUs than the cluster has: refused when the plan meets the cluster, before any actor starts
    with pytest.raises(SystemExit) as e:
        main(argv(root, student, teacher, "too-big", "--num_gpus", "2", "--teacher_num_gpus_per_node", "2"))
    msg = str(e.value.code)
    assert "the placement does not fit this cluster" in msg, msg
    assert "the plan needs 4 GPUs but the cluster has 2 (policy 1, teacher 2, vllm_e0 1)" in msg, msg
    assert "actor groups up" not in capsys.readouterr().out and not (root / "too-big" / "metrics.jsonl").exists()
    # colocated with a policy of another shape: refused before Ray starts, naming the teacher's flags
    with pytest.raises(SystemExit) as e:
        main(argv(root, student, teacher, "shape", "--num_gpus", "2", "--teacher_num_gpus_per_node", "2",
                  "--colocate_actor_ref"))
    msg = str(e.value.code)
    assert "the placement cannot work" in msg and "teacher has 1 node x 2 GPUs = 2" in msg, msg
    assert "set teacher_num_nodes=1 and teacher_num_gpus_per_node=1, or drop colocate_actor_ref" in msg, msg
    # the teacher's placement without a teacher: refused, not ignored
    args = [a for a in argv(root, student, teacher, "none", "--teacher_num_gpus_per_node", "1")]
    i = args.index("--teacher_pretrain")
    del args[i : i + 2]
    with pytest.raises(SystemExit) as e:
        main(args)
    assert e.value.code == 2
    assert "--teacher_num_gpus_per_node place the on-policy distillation teacher" in capsys.readouterr().err


def test_the_teachers_counts_default_to_the_references():
    from rl_cli.config import build_parser
    from rl_cli.loading import resolve
    from rl_cli.placement_args import plan_from
    from rl_cli.ppo import _groups

    def plan(*extra):
        groups = _groups(True)
        parser, flags = build_parser("rl ppo-ray", "", groups)
        c = resolve(groups, parser.parse_args(["--pretrain", "/m", "--teacher_pretrain", "/t", *extra]), flags)
        return plan_from(c["ray"], c["ppo"], c["model"])

    p = plan("--actor_num_gpus_per_node", "2", "--init_kl_coef", "0")  # no reference: its counts, the actor's
    assert p.ref is None and (p.teacher.num_nodes, p.teacher.num_gpus_per_node) == (1, 2)
    p = plan("--actor_num_gpus_per_node", "2", "--ref_num_gpus_per_node", "1")  # the reference's, as given
    assert p.ref.num_gpus == 1 and p.teacher.num_gpus == 1
    p = plan("--ref_num_gpus_per_node", "1", "--teacher_num_nodes", "2", "--teacher_num_gpus_per_node", "3")
    assert (p.teacher.num_nodes, p.teacher.num_gpus_per_node) == (2, 3)
