"""``rl ppo`` / ``rl ppo-ray`` with the OpenRLHF RL features of issue 17's leftovers, each through the real
command on the tiny model: the eval pass (``--eval_dataset``, ``--eval_steps``, ``--eval.n_samples_per_prompt``,
``--eval_temperature``) logged beside the training metrics and leaving the training trajectory alone, the HF
export inside every checkpoint (``--save_hf_ckpt`` / ``--ckpt.save_hf``; without ``--save_steps``: none, as in
OpenRLHF, test_openrlhf_scripts.py), the stop-properly penalty on
truncated samples and centre-only advantage normalisation (``--no_advantage_std_norm``)."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from rl_cli.main import main

pytestmark = [pytest.mark.timeout(900), pytest.mark.slow]
REWARDS = """
def hits(prompt, response, label, **info):
    return sum(ch in label for ch in response) / 8

def one(prompt, response, label, **info):
    return 1.0
"""


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    from rl_rollout.testing import make_tiny_model

    root = tmp_path_factory.mktemp("ppo-extras-cli")
    model = make_tiny_model(root / "tiny")
    from rl_core.models import RewardModel

    RewardModel.from_pretrained(model, dtype="fp32").save_pretrained(root / "rm")  # the tiny body, a random head
    (root / "prompts.jsonl").write_text(
        "".join(json.dumps({"prompt": f"Repeat the letter {c}: ", "label": c}) + "\n" for c in "abcd"))
    letters = "abcdefghijklmnopqrstuvwxyz"
    (root / "eval.jsonl").write_text("".join(json.dumps({"prompt": f"Spell {w}: ", "label": letters[i::2],
                                                         "datasource": source}) + "\n"  # OpenRLHF's key
                                             for i, (w, source) in enumerate((("cat", "pets"), ("dog", "pets"),
                                                                              ("emu", "birds")))))
    (root / "rewards.py").write_text(REWARDS)
    return root, model


def argv(root, model, run, *extra, reward="hits", estimator="group_norm"):
    scorer = ["--reward_fn", f"{root / 'rewards.py'}:{reward}"] if reward else ["--reward_pretrain", str(root / "rm")]
    return ["--pretrain", str(model), "--prompt_data", str(root / "prompts.jsonl"), "--input_key", "prompt",
            "--label_key", "label", *scorer, "--advantage_estimator", estimator, "--init_kl_coef", "0", "--n_samples_per_prompt", "4", "--rollout_batch_size", "4",
            "--train_batch_size", "16", "--micro_train_batch_size", "8", "--generate_max_len", "8",
            "--max_iterations", "3", "--bf16", "false", "--learning_rate", "1e-3", "--seed", "7",
            "--run_dir", str(root / run), *extra]


def metrics(path):
    return [json.loads(x) for x in (path / "metrics.jsonl").read_text().splitlines()]


def with_eval(root, *extra):
    return ["--eval_dataset", str(root / "eval.jsonl"), "--eval.steps", "2", "--eval.n_samples_per_prompt", "2",
            *extra]


def test_bad_combinations_fail_before_any_model_loads_naming_the_fix(task, capsys):
    root, model = task
    cases = [
        (["--eval_steps", "2"], r"--eval_steps 2 needs --eval_dataset PATH"),
        (["--eval_steps", "0", "--eval_dataset", "x.jsonl"], r"eval_steps \(--eval_steps\) must be >= 1, or -1"),
        (["--eval_pass_k", "1,8", "--eval_dataset", "x.jsonl"],
         r"--eval_pass_k 8: k must be in 1..4 \(--eval_n_samples_per_prompt 4\)"),
        (["--eval_temperature", "-1"], r"eval_temperature \(--eval_temperature\) must be >= 0 \(0: greedy\)"),
        (["--stop_properly_penalty_coef", "2"], r"must be in \[0, 1\] \(a scale\) or negative \(a fixed reward\)"),
        (["--algo.advantage.no_std_norm"], r"--advantage_estimator group_norm does not do .*dr_grpo"),
        (["--ckpt.best_metric_key", "eval_default_pass8", "--eval_dataset", "x.jsonl"],
         r"--best_metric_key 'eval_default_pass8': the eval pass logs eval/reward_mean, eval/pass@1, eval/pass@4, "
         r"eval/maj@1, .*or none"),
        (["--ckpt.max_mem", "0"], r"max_ckpt_mem \(--max_ckpt_mem\) is a budget in GB and must be > 0, got 0"),
    ]
    for extra, message in cases:
        with pytest.raises(SystemExit) as e:
            main(["ppo", *argv(root, model, "bad", *extra)])
        assert e.value.code == 2, extra
        assert re.search(message, capsys.readouterr().err), (extra, message)


def test_eval_pass_logs_reward_and_pass_at_n_and_leaves_the_training_trajectory_alone(task):
    """Two runs from the same seed, one evaluating at iterations 2 and 3 (every 2 and the last), greedy with
    2 samples per prompt: the same training metrics and final weights; eval/* only in the evaluated rows."""
    root, model = task
    assert main(["ppo", *argv(root, model, "plain", "--save_path", str(root / "plain-final"))]) == 0
    assert main(["ppo", *argv(root, model, "eval", "--save_path", str(root / "eval-final"),
                              *with_eval(root, "--eval_temperature", "0"))]) == 0
    plain, evaluated = metrics(root / "plain"), metrics(root / "eval")
    assert [r["step"] for r in evaluated] == [1, 2, 3]
    for a, b in zip(plain, evaluated, strict=True):
        for k in ("rl/reward_mean", "rl/policy_loss", "rl/advantage_abs_mean", "rl/response_length",
                  "rl/rollout_logprob_gap"):
            assert b[k] == a[k], (k, a["step"], a[k], b[k])  # bit for bit: the eval pass drew no training RNG
    w_plain = load_file(root / "plain-final" / "model.safetensors")
    w_eval = load_file(root / "eval-final" / "model.safetensors")
    assert all(torch.equal(w_plain[k], w_eval[k]) for k in w_plain)
    assert not any(k.startswith("eval/") for k in evaluated[0])
    for r in evaluated[1:]:
        assert r["eval/samples"] == 3 * 2 and r["eval/reward_failures"] == 0
        assert 0 < r["eval/reward_mean"] <= 1
        # greedy: both samples of a prompt are the same, so k does not matter (rl eval's metrics, rl_rollout.evaluation)
        assert r["eval/pass@2"] == r["eval/pass@1"] == r["eval/correct"] and r["eval/maj@2"] == r["eval/maj@1"]
        assert r["eval/weight_version"] == r["step"] and r["eval/prompts"] == 3
        assert 0 < r["eval/response_length"] <= 8 and 0 <= r["eval/truncated"] <= 1
        # per data source (OpenRLHF's eval_{datasource}_*): each source's own metrics, which add up to the set's
        assert (r["eval/pets/prompts"], r["eval/birds/prompts"], r["eval/pets/samples"]) == (2, 1, 4)
        both = (2 * r["eval/pets/reward_mean"] + r["eval/birds/reward_mean"]) / 3
        assert abs(both - r["eval/reward_mean"]) < 1e-9, (both, r["eval/reward_mean"])
    lines = [json.loads(x) for x in (root / "eval" / "eval_samples" / "iter_2.jsonl").read_text().splitlines()]
    assert sorted(x["datasource"] for x in lines) == ["birds"] * 2 + ["pets"] * 4


@pytest.mark.multiprocess
def test_rl_ppo_ray_evaluates_as_the_one_process_run(task):
    """The eval pass over Ray at OpenRLHF's default eval temperature (0.6, sampled): the engine is an actor, the
    policy another; same seeds, same eval numbers as in one process."""
    root, model = task
    assert main(["ppo", *argv(root, model, "eval-sampled", *with_eval(root))]) == 0
    local = metrics(root / "eval-sampled")
    assert all(r["eval/pass@2"] >= r["eval/pass@1"] for r in local[1:])
    samples = [json.loads(x) for x in (root / "eval-sampled" / "eval_samples" / "iter_3.jsonl").read_text().splitlines()]
    responses = {}
    for x in samples:
        responses.setdefault(x["prompt_index"], []).append(x["response"])
    assert any(len(set(r)) > 1 for r in responses.values())  # sampled: the two samples of a prompt differ
    out = subprocess.run([sys.executable, "-m", "rl_cli.train_ppo_ray", *argv(root, model, "eval-ray"),
                          *with_eval(root), "--num_gpus", "2", "--vllm_num_engines", "1"],
                         capture_output=True, text=True, timeout=800)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-6000:]
    rows = metrics(root / "eval-ray")
    assert [r["step"] for r in rows] == [1, 2, 3] and not any(k.startswith("eval/") for k in rows[0])
    for a, b in zip(local[1:], rows[1:], strict=True):
        for k in ("eval/reward_mean", "eval/pass@2", "eval/maj@2", "eval/response_length", "eval/samples",
                  "eval/weight_version"):
            assert b[k] == pytest.approx(a[k], abs=1e-6), (k, a["step"], a[k], b[k])


@pytest.mark.multiprocess
def test_eval_pass_scores_with_a_reward_model_group_whose_ranks_do_not_divide_the_eval_set(task):
    """3 eval prompts x 1 sample over a 2-rank reward-model group (the tiny model with a random head): the eval
    samples are padded to split evenly over the ranks, and only the real ones count."""
    root, model = task
    out = subprocess.run([sys.executable, "-m", "rl_cli.train_ppo_ray", *argv(root, model, "eval-rm", reward=None),
                          "--max_iterations", "1", "--eval_dataset", str(root / "eval.jsonl"),
                          "--eval_n_samples_per_prompt", "1", "--num_gpus", "4", "--reward_num_gpus_per_node", "2",
                          "--vllm_num_engines", "1"], capture_output=True, text=True, timeout=800)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-6000:]
    (row,) = metrics(root / "eval-rm")
    assert row["eval/samples"] == 3 and "eval/pass@2" not in row and "eval/pass@1" in row
    assert row["eval/reward_mean"] != 0 and abs(row["eval/reward_mean"]) < 1e3  # the reward model's scores


def test_async_train_evaluates_the_weight_version_just_synced(task):
    """``--async_train --max_staleness 1 --eval_steps 1``: every iteration evaluates the version its sync pushed
    (``eval/weight_version`` == the iteration, every eval sample tagged with it) with the producer drained, rl
    eval's metrics in the row, and each pass's samples as JSON lines in the run dir that add up to those metrics."""
    root, model = task
    assert main(["ppo", *argv(root, model, "eval-async", "--async_train", "--max_staleness", "1",
                              "--eval_dataset", str(root / "eval.jsonl"), "--eval_steps", "1",
                              "--eval_n_samples_per_prompt", "2", "--eval_pass_k", "1,2",
                              "--eval_correct_threshold", "0.25")]) == 0
    rows = metrics(root / "eval-async")
    assert [r["step"] for r in rows] == [1, 2, 3]
    for r in rows:
        it = r["step"]
        assert r["eval/weight_version"] == it  # the version just synced, not one the producer generated with
        assert r["rl/staleness_violations"] == 0 and r["rl/eval_drain_s"] >= 0
        assert r["eval/samples"] == 6 and r["eval/prompts"] == 3 and r["eval/reward_failures"] == 0
        lines = [json.loads(x) for x in (root / "eval-async" / "eval_samples" / f"iter_{it}.jsonl").read_text()
                 .splitlines()]
        assert len(lines) == 6 and {(x["iteration"], x["weight_version"]) for x in lines} == {(it, it)}
        assert sorted((x["prompt_index"], x["sample_index"]) for x in lines) == [(p, s) for p in range(3)
                                                                                  for s in range(2)]
        assert r["eval/reward_mean"] == pytest.approx(sum(x["reward"] for x in lines) / 6)
        assert r["eval/correct"] == pytest.approx(sum(x["reward"] >= 0.25 for x in lines) / 6)
        assert all(x["correct"] == (x["reward"] >= 0.25) for x in lines)
        assert r["eval/pass@1"] == pytest.approx(r["eval/correct"])  # n equal per prompt: pass@1 is the share correct
        by_prompt = {}
        for x in lines:
            by_prompt.setdefault(x["prompt_index"], []).append(x["correct"])
        assert r["eval/pass@2"] == pytest.approx(sum(any(v) for v in by_prompt.values()) / 3)
        assert 0 <= r["eval/maj@1"] <= 1 and 0 <= r["eval/maj@2"] <= 1
        assert r["eval/response_length"] == pytest.approx(sum(x["response_tokens"] for x in lines) / 6)


def test_save_hf_ckpt_puts_a_loadable_export_of_the_policy_and_critic_in_every_checkpoint(task):
    from transformers import AutoModelForCausalLM

    root, model = task
    ck, final = root / "hf-ck", root / "hf-final"
    assert main(["ppo", *argv(root, model, "hf", "--max_iterations", "2", "--ckpt.save_hf", "--save_steps", "1",
                              "--ckpt_path", str(ck), "--save_path", str(final), "--save_value_network",
                              estimator="gae")]) == 0
    iters = [ck / "iter_00000001", ck / "iter_00000002"]
    assert sorted(p.name for p in ck.iterdir() if p.name != ".rl.lock") == [p.name for p in iters]
    for d in iters:
        assert (d / "COMPLETE").is_file() and (d / "hf" / "critic" / "config.json").is_file()
        AutoModelForCausalLM.from_pretrained(d / "hf")  # loads as transformers reads it (tokenizer beside it)
        assert (d / "hf" / "tokenizer_config.json").is_file()
    first, last = (load_file(d / "hf" / "model.safetensors") for d in iters)
    exported = load_file(final / "model.safetensors")  # the policy after iteration 2
    assert first.keys() == last.keys() == exported.keys()
    assert all(torch.equal(last[k], exported[k]) for k in last)  # iteration 2's checkpoint holds its weights
    assert any(not torch.equal(first[k], last[k]) for k in first)  # iteration 1's are the earlier ones
    critic_last = load_file(iters[1] / "hf" / "critic" / "model.safetensors")
    critic_final = load_file(final / "critic" / "model.safetensors")
    assert all(torch.equal(critic_last[k], critic_final[k]) for k in critic_final)


def test_checkpoints_without_deepspeed_state_within_a_disk_budget_and_the_best_one(task, capsys):
    """OpenRLHF's checkpoint flags together: --ckpt.disable_ds with --ckpt.save_hf writes only the HF export and
    the loop state (resume refuses it, naming the export), --ckpt.max_mem keeps the newest iteration alone
    (a budget below one checkpoint), --ckpt.best_metric_key keeps best_iter_N/ of the best eval pass apart."""
    root, model = task
    ck = root / "best-ck"
    common = ["--ckpt_path", str(ck), "--ckpt.save_steps", "1", "--ckpt.disable_ds", "--ckpt.save_hf",
              "--ckpt.max_mem", "1e-6", "--eval.steps", "1", "--ckpt.best_metric_key", "eval_default_pass2"]
    assert main(["ppo", *argv(root, model, "best", "--max_iterations", "2", *with_eval(root), *common)]) == 0
    evals = [r["eval/pass@2"] for r in metrics(root / "best")]
    best = 1 + max(range(2), key=lambda i: (evals[i], -i))  # the first of the highest: a tie keeps the earlier
    assert sorted(p.name for p in ck.iterdir() if p.is_dir()) == sorted({f"best_iter_{best:08d}", "iter_00000002"})
    for d in (d for d in ck.iterdir() if d.is_dir()):  # (and the run's .rl.lock)
        assert json.loads((d / "COMPLETE").read_text())["roles"] == [] and (d / "hf" / "model.safetensors").is_file()
        assert not (d / "policy").exists()
    state = json.loads((ck / "iter_00000002" / "loop_state.json").read_text())
    assert state["best"] == {"key": "eval/pass@2", "value": evals[best - 1], "iteration": best}
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:  # a user's input error: one line, exit 2
        main(["ppo", *argv(root, model, "best-resume", "--load_checkpoint", *with_eval(root), *common)])
    assert e.value.code == 2
    assert re.search(r"rl ppo: checkpoint .* was written with --disable_ds_ckpt: .*--pretrain .*iter_00000002/hf",
                     capsys.readouterr().err)


def test_stop_properly_penalty_scales_the_reward_of_truncated_samples(task):
    """A constant reward of 1 and --reward.stop_properly_penalty_coef 0.5: a truncated sample (no EOS within 4
    tokens) trains on 0.5, the others on 1, so the iteration's mean reward is 1 - 0.5 x the truncated share.
    With reinforce and --no_advantage_std_norm the advantages are only centred: |A| <= 0.25 on average."""
    root, model = task
    assert main(["ppo", *argv(root, model, "stop", "--generate_max_len", "4", "--max_iterations", "2",
                              "--reward.stop_properly_penalty_coef", "0.5", "--no_advantage_std_norm",
                              reward="one", estimator="reinforce")]) == 0
    rows = metrics(root / "stop")
    assert any(r["rl/truncated"] > 0 for r in rows)
    for r in rows:
        assert r["rl/reward_fn_mean"] == 1.0
        assert r["rl/stop_properly_penalized"] == r["rl/truncated"]
        assert r["rl/reward_mean"] == pytest.approx(1 - 0.5 * r["rl/truncated"], abs=1e-6)
        assert r["rl/advantage_abs_mean"] <= 0.25 + 1e-6  # whitened it would be 2 sqrt(p(1-p)) > p(1-p)
