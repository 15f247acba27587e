"""``rl eval`` end to end on CPU: two tiny random models side by side on two tiny prompt sets, the HF engine, the
math verifier; the samples file, the summary, the table, the chart; a run's checkpoint as a model; bad input
refused in one line naming the value and the fix; ``--ray``: the same samples from two HF engine actors on Ray."""

from __future__ import annotations

import importlib.util
import json
import shutil

import pytest

from rl_cli.eval_run import resolve_model
from rl_cli.main import main

pytestmark = [pytest.mark.timeout(600)]


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    from rl_rollout.testing import make_tiny_model

    root = tmp_path_factory.mktemp("eval")
    a, b = make_tiny_model(root / "model_a", seed=0), make_tiny_model(root / "model_b", seed=1)
    (root / "letters.jsonl").write_text(
        "".join(json.dumps({"prompt": f"Repeat the letter {c}: ", "label": c}) + "\n" for c in "abc")
    )
    (root / "sums.jsonl").write_text(
        "".join(json.dumps({"prompt": f"{x}+{y}=", "label": str(x + y)}) + "\n" for x, y in ((1, 2), (3, 4)))
    )
    return root, a, b


def flags(root, a, b, out, *extra):
    return [
        "eval", "--model", f"{a},{b}", "--dataset", str(root / "letters.jsonl"), "--dataset", str(root / "sums.jsonl"),
        "--input_key", "prompt", "--label_key", "label", "--reward_fn", "builtin:math", "--n_samples_per_prompt", "4",
        "--pass_k", "1,4", "--generate_max_len", "6", "--rollout_engine", "hf", "--output_dir", str(out), *extra,
    ]  # fmt: skip


def test_two_models_side_by_side(task, tmp_path, capsys):
    root, a, b = task
    assert main(flags(root, a, b, tmp_path / "out")) == 0
    out = capsys.readouterr().out
    rows = [json.loads(x) for x in (tmp_path / "out" / "samples.jsonl").read_text().splitlines()]
    assert len(rows) == (3 + 2) * 4 * 2  # prompts x n x models
    assert {r["model"] for r in rows} == {"model_a", "model_b"}
    assert {r["dataset"] for r in rows} == {"letters", "sums"}
    for r in rows:
        assert {"prompt", "response", "reward", "response_tokens", "finish_reason", "sample_index"} <= set(r)
        assert 0 <= r["sample_index"] < 4 and 1 <= r["response_tokens"] <= 6
        assert r["finish_reason"] in ("stop", "length") and r["reward"] in (0.0, 1.0)
    # same prompts, same seeds for both models
    seeds = {(r["model"], r["dataset"], r["prompt_index"]): r["seed"] for r in rows}
    assert all(seeds[("model_a", d, i)] == s for (m, d, i), s in seeds.items())
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert list(summary["metrics"]) == ["model_a", "model_b"] and summary["pass_k"] == [1, 4]
    for per_set in summary["metrics"].values():
        assert list(per_set) == ["letters", "sums"]
        for m in per_set.values():
            for key in ("pass@1", "pass@4", "maj@1", "maj@4", "reward_mean", "correct", "truncated"):
                assert 0.0 <= m[key] <= 1.0, (key, m)
            assert m["pass@1"] <= m["pass@4"]
            assert 1.0 <= m["response_length"] <= 6.0
        assert per_set["letters"]["prompts"] == 3 and per_set["sums"]["samples"] == 8
    header = next(line for line in out.splitlines() if line.startswith("dataset"))
    assert header.split() == ["dataset", "metric", "model_a", "model_b"]
    assert any(line.split()[:2] == ["sums", "pass@4"] for line in out.splitlines())
    png = tmp_path / "out" / "pass_at_k.png"
    if importlib.util.find_spec("matplotlib") is not None:
        assert png.stat().st_size > 1000 and "chart:" in out
    else:
        assert not png.exists() and "matplotlib is not installed" in out


def test_checkpoint_folders_resolve_to_their_hf_export(task, tmp_path):
    root, a, _ = task
    ckpt = tmp_path / "ckpt"
    shutil.copytree(a, ckpt / "iter_00000002" / "hf")
    (ckpt / "iter_00000002" / "COMPLETE").write_text("{}")
    shutil.copytree(a, ckpt / "iter_00000003" / "hf")  # no marker: a write that never finished, skipped
    assert resolve_model(str(ckpt / "iter_00000002")) == str(ckpt / "iter_00000002" / "hf")
    assert resolve_model(str(ckpt)) == str(ckpt / "iter_00000002" / "hf")
    assert resolve_model(str(a)) == str(a)
    (ckpt / "iter_00000004").mkdir()
    bare = tmp_path / "ds_only"
    (bare / "iter_00000001").mkdir(parents=True)
    (bare / "iter_00000001" / "COMPLETE").write_text("{}")
    with pytest.raises(Exception, match="--save_hf_ckpt"):
        resolve_model(str(bare))


@pytest.mark.parametrize(
    "change, needle",
    [
        ({"--dataset": "missing.jsonl"}, "--dataset {root}/missing.jsonl: no such file"),
        ({"--pass_k": "1,8"}, "--pass_k 8: k must be in 1..4"),
        ({"--model": "{root}/no_model"}, "--model {root}/no_model: no such folder"),
        ({"--num_gpus": "4"}, "--num_gpus places engines on Ray: add --ray, or drop --num_gpus"),
        ({"--vllm_tensor_parallel_size": "2"}, "--vllm_tensor_parallel_size: rl eval places one engine per GPU"),
        ({"--ray": "true", "--vllm_num_engines": "3", "--num_gpus": "2"},
         "--num_gpus 2 is fewer than --vllm_num_engines 3"),
        ({"--eval_dataset": "x.jsonl"}, "--eval_dataset: every --dataset is evaluated"),
    ],
)
def test_bad_input_is_one_line_naming_the_value_and_the_fix(task, tmp_path, capsys, change, needle):
    root, a, b = task
    argv = ["eval", "--model", f"{a},{b}", "--dataset", str(root / "sums.jsonl"), "--input_key", "prompt",
            "--label_key", "label", "--reward_fn", "builtin:math", "--n_samples_per_prompt", "4",
            "--output_dir", str(tmp_path / "out")]  # fmt: skip
    for flag, value in change.items():
        value = value.format(root=root)
        if flag in argv:
            argv[argv.index(flag) + 1] = value if flag != "--dataset" else str(root / value)
        else:
            argv += [flag, value]
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert needle.format(root=root) in err, err
    assert len(err.splitlines()) <= 2, err  # argparse adds its usage line above its own errors
    assert not (tmp_path / "out").exists()


@pytest.mark.multiprocess
def test_ray_engines_draw_the_samples_one_engine_in_process_draws(task, tmp_path, capsys):
    """``--ray --vllm_num_engines 2`` on a CPU machine (two logical GPUs, the HF engine in two actors): every
    prompt's samples, rewards and the metrics are those of the in-process engine, and both actors drew prompts."""
    root, a, _ = task
    argv = ["eval", "--model", str(a), "--dataset", str(root / "letters.jsonl"), "--dataset", str(root / "sums.jsonl"),
            "--input_key", "prompt", "--label_key", "label", "--reward_fn", "builtin:math",
            "--n_samples_per_prompt", "4", "--pass_k", "1,4", "--generate_max_len", "6", "--rollout_engine", "hf",
            "--temperature", "1.0"]  # fmt: skip
    assert main([*argv, "--output_dir", str(tmp_path / "local")]) == 0
    assert main([*argv, "--output_dir", str(tmp_path / "ray"), "--ray", "--vllm_num_engines", "2"]) == 0
    out = capsys.readouterr().out
    assert "2 engine actors on Ray (HFEngine, HFEngine" in out
    per_engine = [line for line in out.splitlines() if "prompts per engine actor" in line]
    assert len(per_engine) == 1 and per_engine[0].endswith("[3, 2]")  # 3 + 2 prompts, split per generate call

    def rows(d):
        return sorted((r["dataset"], r["prompt_index"], r["sample_index"], r["response"], r["reward"], r["seed"])
                      for r in map(json.loads, (tmp_path / d / "samples.jsonl").read_text().splitlines()))

    local, ray = rows("local"), rows("ray")
    assert len(local) == (3 + 2) * 4 and ray == local
    assert len({r[3] for r in local}) > 1  # sampled: not one response everywhere
    m_local = json.loads((tmp_path / "local" / "summary.json").read_text())
    m_ray = json.loads((tmp_path / "ray" / "summary.json").read_text())
    assert m_ray["engine_actors"] == 2 and m_local["engine_actors"] is None
    for name, m in m_local["metrics"]["model_a"].items():
        for key, v in m.items():
            if key != "seconds":
                assert m_ray["metrics"]["model_a"][name][key] == v, (name, key)
