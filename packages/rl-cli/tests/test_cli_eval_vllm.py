"""``rl eval --rollout_engine vllm`` (run in .venv-vllm: vLLM's CPU build): two tiny models in turn, each in a vLLM
engine of its own that is shut down before the next starts (builtin:exact_match: .venv-vllm has no math-verify)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from rl_rollout.testing import missing_modules

if why := missing_modules("vllm"):
    pytest.skip(why, allow_module_level=True)

import torch  # noqa: E402

from rl_rollout.testing import VLLM_CPU_TESTS_ON_CUDA  # noqa: E402

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.timeout(900),
    pytest.mark.skipif(torch.cuda.is_available(), reason=VLLM_CPU_TESTS_ON_CUDA),
]


def test_eval_on_vllm_two_models(tmp_path):
    from rl_rollout.testing import make_tiny_model

    a, b = make_tiny_model(tmp_path / "model_a", seed=0), make_tiny_model(tmp_path / "model_b", seed=1)
    (tmp_path / "sums.jsonl").write_text(
        "".join(json.dumps({"prompt": f"{x}+{y}=", "label": str(x + y)}) + "\n" for x, y in ((1, 2), (3, 4), (2, 2)))
    )
    out = tmp_path / "out"
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env["VLLM_CPU_KVCACHE_SPACE"] = env.get("VLLM_CPU_KVCACHE_SPACE", "1")
    argv = [
        "eval",
        "--model",
        f"{a},{b}",
        "--dataset",
        str(tmp_path / "sums.jsonl"),
        "--input_key",
        "prompt",
        "--label_key",
        "label",
        "--reward_fn",
        "builtin:exact_match",
        "--n_samples_per_prompt",
        "4",
        "--pass_k",
        "1,2,4",
        "--generate_max_len",
        "6",
        "--rollout_engine",
        "vllm",
        "--enforce_eager",
        "--output_dir",
        str(out),
    ]
    run = subprocess.run(
        [sys.executable, "-m", "rl_cli.main", *argv], capture_output=True, text=True, timeout=850, env=env
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-6000:]
    assert run.stdout.count("VLLMEngine on cpu") == 2, run.stdout
    rows = [json.loads(x) for x in (out / "samples.jsonl").read_text().splitlines()]
    assert len(rows) == 3 * 4 * 2
    assert all(r["finish_reason"] in ("stop", "length") and 1 <= r["response_tokens"] <= 6 for r in rows)
    summary = json.loads((out / "summary.json").read_text())
    for per_set in summary["metrics"].values():
        m = per_set["sums"]
        assert 0 <= m["pass@1"] <= m["pass@2"] <= m["pass@4"] <= 1 and m["samples"] == 12
