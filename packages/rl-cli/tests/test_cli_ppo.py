"""``rl ppo`` and ``rl ppo-ray``: OpenRLHF's flags, placement checked before actors start, and the same
PPO run in one process and over Ray (actor ZeRO-3 on two logical GPUs, critic, colocated reference, an HF
engine actor fed over a gloo broadcast) giving the same rewards and losses."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
import yaml

from rl_cli.config import build_parser
from rl_cli.loading import resolve
from rl_cli.main import main
from rl_cli.placement_args import plan_from
from rl_cli.ppo import _groups

pytestmark = [pytest.mark.timeout(900), pytest.mark.slow]
REWARD = "def letter(prompt, response, label, **info):\n    return min(response.count(label), 8) / 8\n"


def parse(argv, ray=True):
    groups = _groups(ray)
    parser, flags = build_parser("rl ppo-ray", "", groups)
    return resolve(groups, parser.parse_args(argv), flags)


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    from rl_rollout.testing import make_tiny_model

    root = tmp_path_factory.mktemp("ppo-cli")
    model = make_tiny_model(root / "tiny")
    (root / "prompts.jsonl").write_text(
        "".join(json.dumps({"prompt": f"Repeat the letter {c}: ", "label": c}) + "\n" for c in "abcd"))
    (root / "reward.py").write_text(REWARD)
    return root, model


def common(root, model, run):
    return ["--pretrain", str(model), "--prompt_data", str(root / "prompts.jsonl"), "--input_key", "prompt",
            "--label_key", "label", "--reward_fn", f"{root / 'reward.py'}:letter", "--advantage_estimator", "gae",
            "--n_samples_per_prompt", "4", "--rollout_batch_size", "4", "--train_batch_size", "16",
            "--generate_max_len", "8", "--max_iterations", "3", "--bf16", "false", "--learning_rate", "1e-3",
            "--init_kl_coef", "0.01", "--seed", "7", "--run_dir", str(root / run)]


def metrics(path):
    return [json.loads(x) for x in (path / "metrics.jsonl").read_text().splitlines()]


def local_run(root, model):
    """The one-process, padded ZeRO-2 run that other layouts of the same run must reproduce (made once)."""
    if not (root / "local" / "metrics.jsonl").is_file():
        assert main(["ppo", *common(root, model, "local"), "--zero_stage", "2", "--micro_train_batch_size", "8"]) == 0
    return metrics(root / "local")


def assert_same_run(local, rows):
    """Every iteration's rewards, KL, losses and values within 1e-4, and the engine on the policy's weights."""
    assert [r["step"] for r in rows] == [1, 2, 3]
    for a, b in zip(local, rows, strict=True):
        assert b["rl/rollout_logprob_gap"] < 1e-4, b
        for k in ("rl/reward_mean", "rl/kl", "rl/critic_loss", "rl/policy_loss", "rl/value_mean"):
            assert b[k] == pytest.approx(a[k], abs=1e-4), (k, a["step"], a[k], b[k])


def test_openrlhf_flags_parse_and_the_plan_has_the_roles_the_run_needs():
    c = parse(["--pretrain", "/m", "--prompt_data", "p.jsonl", "--prompt_max_len", "256", "--reward_pretrain", "/rm",
               "--advantage_estimator", "group_norm", "--n_samples_per_prompt", "8", "--eps_clip_high", "0.28",
               "--dynamic_filtering", "--dynamic_filtering_reward_range", "0.1", "0.9", "--use_kl_loss",
               "--init_kl_coef", "0.001", "--actor_num_gpus_per_node", "4", "--vllm_num_engines", "2",
               "--colocate_actor_ref", "--zero_stage", "3", "--vllm_enable_sleep", "--seed", "3"])
    m, d, p, r, a = c["model"], c["data"], c["ppo"], c["rollout"], c["ray"]
    assert (m.pretrain, m.reward_pretrain, d.dataset, d.max_len) == ("/m", "/rm", "p.jsonl", 256)
    assert (p.advantage.estimator, p.sampling.n_samples_per_prompt, p.policy_loss.eps_clip_high, p.kl.use_loss) == ("group_norm", 8, 0.28, True)
    assert p.dynamic_filtering and p.dynamic_filtering.reward_range == (0.1, 0.9)
    assert (a.actor_num_gpus_per_node, a.vllm_num_engines, r.enable_sleep, c["strategy"].seed) == (4, 2, True, 3)
    plan = plan_from(a, p, m)
    assert plan.critic is None  # group_norm: no critic
    assert plan.ref.num_gpus == 4 and plan.reward.num_gpus == 4 and plan.total_gpus == 4 + 4 + 2
    gae = parse(["--advantage_estimator", "gae", "--init_kl_coef", "0", "--critic_num_gpus_per_node", "2"])
    plan = plan_from(gae["ray"], gae["ppo"], gae["model"])
    assert plan.critic.num_gpus == 2 and plan.ref is None and plan.reward is None


def test_bad_runs_fail_before_any_model_loads_naming_the_fix(task, capsys):
    root, model = task
    with pytest.raises(SystemExit, match=r"placement cannot work: .*colocate_all_models"):  # before Ray starts
        main(["ppo-ray", *common(root, model, "bad"), "--actor_num_gpus_per_node", "2", "--colocate_all_models",
              "--vllm_num_engines", "1"])
    with pytest.raises(SystemExit, match=r"vllm_sync_backend ipc .*--colocate_all_models"):  # before Ray starts
        main(["ppo-ray", *common(root, model, "bad"), "--vllm_sync_backend", "ipc", "--vllm_num_engines", "1"])
    with pytest.raises(SystemExit, match=r"tensor_parallel_size 2 shards each engine over 2 GPUs, which the hf engine"):
        main(["ppo-ray", *common(root, model, "bad"), "--vllm_tensor_parallel_size", "2", "--rollout_engine", "hf"])
    with pytest.raises(SystemExit, match=r"ipc .* with --vllm_tensor_parallel_size 1"):
        main(["ppo-ray", *common(root, model, "bad"), "--vllm_sync_backend", "ipc", "--colocate_all_models",
              "--actor_num_gpus_per_node", "2",
              "--vllm_tensor_parallel_size", "2", "--rollout_engine", "vllm"])
    with pytest.raises(SystemExit):
        main(["ppo-ray", *common(root, model, "bad"), "--vllm_sync_backend", "shm"])
    assert "weight-sync backend 'shm' is not one of auto, direct, gloo, nccl, ipc" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # one process: the engine takes the tensors in memory
        main(["ppo", *common(root, model, "bad"), "--vllm_sync_backend", "gloo"])
    assert "in one process (rl ppo) the engine takes the trainer's tensors in memory" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # a shared flag the RL loop would ignore is refused
        main(["ppo", *common(root, model, "bad"), "--output_key", "answer"])
    assert "--output_key: the RL loop generates the responses" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["ppo", *common(root, model, "bad"), "--advantage_estimator", "rlooo"])
    assert "unknown advantage estimator 'rlooo'; valid: dr_grpo, gae" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["ppo", *common(root, model, "bad"), "--advantage_estimator", "rloo", "--n_samples_per_prompt", "1"])
    assert "--n_samples_per_prompt >= 2" in capsys.readouterr().err
    assert not (root / "bad").exists()  # nothing ran


def test_a_cluster_too_small_fails_before_any_actor_starts(task):
    root, model = task
    out = subprocess.run([sys.executable, "-m", "rl_cli.train_ppo_ray", *common(root, model, "small"), "--num_gpus",
                          "2", "--actor_num_gpus_per_node", "2", "--critic_num_gpus_per_node", "1"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode != 0
    assert "does not fit this cluster" in out.stderr, out.stderr[-3000:]
    assert re.search(r"the plan needs 6 GPUs but the cluster has 2", out.stderr), out.stderr[-3000:]
    assert "RayPolicyWorker" not in out.stderr + out.stdout  # no actor was started


def test_rl_ppo_runs_one_process_writes_metrics_checkpoints_and_the_model(task):
    root, model = task
    argv = common(root, model, "local") + ["--zero_stage", "2", "--micro_train_batch_size", "8", "--save_path",
                                           str(root / "final"), "--ckpt_path", str(root / "ck"), "--save_steps", "2"]
    assert main(["ppo", *argv]) == 0
    rows = metrics(root / "local")
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all(r["rl/rollout_logprob_gap"] < 1e-4 for r in rows)
    assert (root / "final" / "config.json").is_file() and (root / "local" / "curves.png").is_file()
    assert sorted(p.name for p in (root / "ck").iterdir()) == [".rl.lock", "iter_00000002", "iter_00000003"]  # one
    # folder per save, and the run's lock (rl_core.folder_lock), which an ended run leaves without a holder
    assert (root / "ck" / ".rl.lock").read_text() == "" and (root / "local" / ".rl.lock").read_text() == ""


def test_rl_ppo_packed_with_a_token_budget_trains_like_the_padded_run(task, capsys):
    """OpenRLHF's dynamic batching flags: every forward packs its items into one row and a training micro-batch
    holds 64 tokens (two samples here, against 8 padded rows in the reference run): the same run, within fp32
    rounding. --print_config shows what the flags set."""
    root, model = task
    local = local_run(root, model)
    argv = common(root, model, "packed") + ["--zero_stage", "2", "--micro_train_batch_size", "8", "--packing_samples",
                                            "--use_dynamic_batch", "--train_max_tokens_per_gpu", "64",
                                            "--rollout_max_tokens_per_gpu", "200"]
    capsys.readouterr()
    assert main(["ppo", *argv, "--print_config"]) == 0
    out = capsys.readouterr().out
    shown = yaml.safe_load(out[:out.index("\n# [rl ppo]")])  # the config as YAML, then the arithmetic as comments
    assert shown["data"]["packing"] and shown["batching"] == {
        "max_tokens_per_gpu": 64, "forward_max_tokens_per_gpu": 200, "forward_micro_batch_size": None}
    assert "micro-batches per rank: packed rows; training at most 64 tokens, experience forwards at most 200" in out
    assert main(["ppo", *argv]) == 0
    assert_same_run(local, metrics(root / "packed"))


def test_rl_ppo_with_a_fused_lm_head_trains_like_the_full_logits_run(task):
    """--fused_lm_head on the policy and the reference (the head and the log-probs chunk by chunk): the same run."""
    root, model = task
    local = local_run(root, model)
    argv = common(root, model, "fused") + ["--zero_stage", "2", "--micro_train_batch_size", "8", "--fused_lm_head"]
    assert main(["ppo", *argv]) == 0
    assert_same_run(local, metrics(root / "fused"))


def test_an_engine_plugin_runs_the_loop_by_name(task, tmp_path):
    """One module and its entry point (rl_rollout.testing.write_engine_plugin): `rl ppo --rollout_engine
    hf-probe` builds it through the registry, generates with it every iteration and syncs into it."""
    from rl_rollout.testing import write_engine_plugin

    root, model = task
    plugin = write_engine_plugin(tmp_path / "site")
    argv = common(root, model, "plugin") + ["--rollout_engine", "hf-probe", "--max_iterations", "2",
                                            "--advantage_estimator", "group_norm", "--init_kl_coef", "0"]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR",
                                                             "MASTER_PORT")}  # a fresh process, as a user's
    env["PYTHONPATH"] = os.pathsep.join([str(plugin), os.environ.get("PYTHONPATH", "")])
    out = subprocess.run([sys.executable, "-m", "rl_cli.train_ppo", *argv], capture_output=True, text=True,
                         env=env, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert re.findall(r"\[hf-probe\] generate \d+ requests at version (\d+)", out.stderr) == ["0", "1"]
    assert re.findall(r"\[hf-probe\] weights of version (\d+)", out.stderr) == ["1", "2"]
    assert [r["step"] for r in metrics(root / "plugin")] == [1, 2]


@pytest.mark.multiprocess
def test_rl_ppo_ray_over_logical_gpus_matches_the_one_process_run(task):
    """Actor: 2 ranks ZeRO-3 (DeepSpeed over gloo), critic 1, reference colocated with the actor, one HF engine
    actor that receives every version over a gloo broadcast; the same seeds as the one-process run."""
    root, model = task
    local = local_run(root, model)
    argv = common(root, model, "ray") + ["--zero_stage", "3", "--micro_train_batch_size", "4", "--num_gpus", "4",
                                         "--actor_num_gpus_per_node", "2", "--critic_num_gpus_per_node", "1",
                                         "--colocate_actor_ref", "--vllm_num_engines", "1"]
    env = {**os.environ, "RAY_DEDUP_LOGS": "0"}
    out = subprocess.run([sys.executable, "-m", "rl_cli.train_ppo_ray", *argv], capture_output=True, text=True,
                         timeout=800, env=env)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-6000:]
    assert "policy on cpu x 2" in out.stdout and "weight sync gloo" in out.stdout, out.stdout[-2000:]
    assert "GPU" in out.stdout  # the placement map was printed
    ray_rows = metrics(root / "ray")
    assert_same_run(local, ray_rows)  # the engine actor holds the broadcast weights
    assert all(b["rl/sync_gb_per_s"] > 0 for b in ray_rows)


@pytest.mark.multiprocess
def test_rl_ppo_ray_packed_under_a_budget_on_two_zero3_ranks_matches_the_one_process_run(task):
    """ZeRO-3 gathers weights on every forward, so two ranks whose slices can need different numbers of 48-token
    bins (responses stop at different lengths; two 22-29-token samples fit a bin or not) must still run as
    many forwards and backwards: the counts are equalised (policy and critic on two ranks each, packed rows),
    and the run equals the padded one-process run."""
    root, model = task
    local = local_run(root, model)
    argv = common(root, model, "ray-packed") + [
        "--zero_stage", "3", "--micro_train_batch_size", "4", "--num_gpus", "5", "--actor_num_gpus_per_node", "2",
        "--critic_num_gpus_per_node", "2", "--colocate_actor_ref", "--vllm_num_engines", "1", "--packing",
        "--max_tokens_per_gpu", "48"]
    out = subprocess.run([sys.executable, "-m", "rl_cli.train_ppo_ray", *argv], capture_output=True, text=True,
                         timeout=800, env={**os.environ, "RAY_DEDUP_LOGS": "0"})
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-6000:]
    assert_same_run(local, metrics(root / "ray-packed"))


@pytest.mark.multiprocess
def test_rl_ppo_ray_hybrid_engine_sleeps_and_wakes_with_the_new_weights(task):
    """--colocate_all_models: the actor and the engine share one (logical) GPU; the engine sleeps while the
    policy trains and takes every version after waking; the actor's DeepSpeed states sleep while the engine
    generates (--ds.enable_sleep, as OpenRLHF's hybrid-engine scripts pair them), called over Ray."""
    root, model = task
    argv = common(root, model, "hybrid") + ["--advantage_estimator", "group_norm", "--init_kl_coef", "0",
                                            "--micro_train_batch_size", "8", "--num_gpus", "1",
                                            "--colocate_all_models", "--vllm_num_engines", "1", "--vllm_enable_sleep",
                                            "--ds.enable_sleep"]
    out = subprocess.run([sys.executable, "-m", "rl_cli.train_ppo_ray", *argv], capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-6000:]
    assert "gpu0 [policy r0, vllm e0/tp0]" in out.stdout, out.stdout[-2000:]
    rows = metrics(root / "hybrid")
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all(r["rl/rollout_logprob_gap"] < 1e-4 for r in rows), rows
    assert all(r["rl/ds_sleep_gb"] > 0 and r["rl/ds_wake_s"] > 0 for r in rows), rows


LORA = ["--lora_rank", "4", "--lora_alpha", "8", "--target_modules", "all-linear", "--verify_weights",
        "--learning_rate", "1e-2"]


@pytest.mark.multiprocess
def test_rl_ppo_ray_with_lora_syncs_merged_weights_and_matches_the_one_process_lora_run(task):
    """OpenRLHF's LoRA flags on the policy and the critic: `rl ppo` (ZeRO-2, weights handed over in memory) and
    `rl ppo-ray` (actor ZeRO-3 on two logical GPUs gathering the frozen base and the adapters, a gloo broadcast
    of the merged weights to an HF engine actor, checked there every iteration by --verify_weights) give the
    same run; the export is the merged model with the adapter beside it."""
    root, model = task
    assert main(["ppo", *common(root, model, "lora"), *LORA, "--zero_stage", "2", "--micro_train_batch_size", "8",
                 "--save_path", str(root / "lora-final")]) == 0
    local = metrics(root / "lora")
    assert all(r["rl/rollout_logprob_gap"] < 1e-4 for r in local), local
    assert (root / "lora-final" / "config.json").is_file()
    assert (root / "lora-final" / "adapter" / "adapter_config.json").is_file()
    argv = common(root, model, "lora-ray") + LORA + [
        "--zero_stage", "3", "--micro_train_batch_size", "4", "--num_gpus", "4", "--actor_num_gpus_per_node", "2",
        "--critic_num_gpus_per_node", "1", "--colocate_actor_ref", "--vllm_num_engines", "1"]
    out = subprocess.run([sys.executable, "-m", "rl_cli.train_ppo_ray", *argv], capture_output=True, text=True,
                         timeout=800, env={**os.environ, "RAY_DEDUP_LOGS": "0"})
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-6000:]
    assert "weight sync gloo" in out.stdout, out.stdout[-2000:]
    assert_same_run(local, metrics(root / "lora-ray"))


@pytest.mark.multiprocess
def test_rl_ppo_ray_with_ring_attention_matches_the_one_process_run(task, capsys):
    """Ring attention in every role (OpenRLHF's --ds.ring_attn_size 2): policy, its colocated reference and the
    critic on two ranks each, one ring group per role, so each packed row is computed in two slices whose keys
    and values meet in attention; ZeRO-3. The run equals the padded one-process run."""
    root, model = task
    local = local_run(root, model)
    argv = common(root, model, "ray-ring") + [
        "--zero_stage", "3", "--micro_train_batch_size", "4", "--num_gpus", "5", "--actor_num_gpus_per_node", "2",
        "--critic_num_gpus_per_node", "2", "--colocate_actor_ref", "--vllm_num_engines", "1", "--packing_samples",
        "--ds.ring_attn_size", "2", "--ds.ring_attn_head_stride", "1"]
    out = subprocess.run([sys.executable, "-m", "rl_cli.train_ppo_ray", *argv], capture_output=True, text=True,
                         timeout=800, env={**os.environ, "RAY_DEDUP_LOGS": "0"})
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-6000:]
    assert "policy on cpu x 2 in ring attention groups (0 of 2 in ranks 0-1, 1 of 2 in ranks 0-1)" in out.stdout, \
        out.stdout[-2000:]
    assert_same_run(local, metrics(root / "ray-ring"))
    capsys.readouterr()
    with pytest.raises(SystemExit) as refused:  # at parse time, before anything loads: no process of its own needed
        main(["ppo", *common(root, model, "ring-local"), "--packing", "--ring_attn_size", "2"])
    err = capsys.readouterr().err
    assert refused.value.code == 2 and "use rl ppo-ray" in err, err[-2000:]
