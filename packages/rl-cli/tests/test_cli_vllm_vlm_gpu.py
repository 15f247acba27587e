"""Vision-language RL with vLLM in the loop on a GPU (issue 41 item 2): ``rl ppo --image_key`` with
``--rollout_engine vllm`` (the engine in the trainer's process) and ``rl ppo-ray`` with a vLLM engine actor, on a tiny
random LLaVA: each request's images reach vLLM's multimodal inputs and the same pixels the trainer's forward, so the
rollout log-prob gap stays within the GPU kernels' tolerance every iteration (a weight sync that missed the vision
tower or the projector, or pixels that differ, would show), every sync verified; the exported model loads in vLLM
and generates from an image.

Needs a GPU, vLLM's GPU build, torchvision (vLLM's multimodal models import it) and DeepSpeed; ``rl ppo-ray`` also
Ray: skipped with the reason otherwise (CI has none of them; the GPU machine gets them from
scripts/device/vllm-loop-on-device.sh with its images and Ray parts). Last run: one H100 80GB HBM3, 2026-12-07,
vLLM 0.26.0: both passed (125 s and 97 s), `python3 -m pytest packages/rl-cli/tests/test_cli_vllm_vlm_gpu.py`.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest
import torch

from rl_rollout.testing import missing_modules

if why := missing_modules("vllm", "deepspeed", where="run with vLLM's GPU build on a GPU"):
    pytest.skip(why, allow_module_level=True)

pytestmark = [
    pytest.mark.vllm, pytest.mark.timeout(900),
    pytest.mark.skipif(not torch.cuda.is_available(), reason="vLLM with images runs on the GPU build only (no GPU here)"),
    pytest.mark.skipif(importlib.util.find_spec("torchvision") is None,
                       reason="torchvision is not installed: vLLM's multimodal models import it"),
]
GAP = 3e-2  # vLLM's GPU kernels against transformers in fp32 (the engine-alone vision test's tolerance)
REWARD = "def letter(prompt, response, label, **info):\n    return min(response.count(label), 8) / 8\n"


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    from rl_rollout.testing import make_tiny_vlm, stand_in_pixtral_names, write_test_images

    root = tmp_path_factory.mktemp("vllm-vlm-gpu")
    if added := stand_in_pixtral_names(root / "site"):  # into the rl commands' processes through sitecustomize
        print(f"\nstand-ins for Pixtral names this transformers lacks (vLLM's llava module imports them): {added}")
    model = make_tiny_vlm(root / "tiny-vlm")
    imgs = write_test_images(root / "images", 3)
    rows = [{"prompt": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": f"Say {c}: "}]}],
             "images": [str(imgs[i])], "label": c} for i, c in enumerate("abc")]
    rows += [{"prompt": "<image>Say d: ", "images": str(imgs[0]), "label": "d"},
             {"prompt": "Say e: ", "images": None, "label": "e"}]
    (root / "prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (root / "reward.py").write_text(REWARD)
    return root, model, imgs


def argv(root, model, run):
    return ["--pretrain", str(model), "--prompt_data", str(root / "prompts.jsonl"), "--input_key", "prompt",
            "--label_key", "label", "--image_key", "images", "--max_images_per_prompt", "1", "--apply_chat_template",
            "--freeze_visual_encoder", "--reward_fn", f"{root / 'reward.py'}:letter",
            "--advantage_estimator", "reinforce_baseline", "--n_samples_per_prompt", "4", "--rollout_batch_size", "4",
            "--train_batch_size", "16", "--micro_train_batch_size", "8", "--generate_max_len", "16",
            "--max_iterations", "3", "--bf16", "false", "--learning_rate", "1e-2", "--init_kl_coef", "0.01",
            "--use_kl_loss", "--seed", "7", "--rollout_engine", "vllm", "--enforce_eager", "--verify_weights",
            "--vllm_gpu_memory_utilization", "0.2", "--run_dir", str(root / run)]


def run_rl(module, args):
    out = subprocess.run([sys.executable, "-m", module, *args], capture_output=True, text=True, timeout=850,
                         env={**os.environ, "PYTHONUNBUFFERED": "1", "RAY_DEDUP_LOGS": "0"})
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-6000:]
    return out


def check_rows(run_dir):
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    gaps = [r["rl/rollout_logprob_gap"] for r in rows]
    print(f"\n{run_dir.name}: log-prob gaps {[f'{g:.2e}' for g in gaps]}")
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert max(gaps) < GAP, gaps
    assert all(r["rl/sync_verify_s"] > 0 for r in rows)  # every sync checked by the engine
    assert rows[-1]["rl/kl_loss"] > 0  # the policy moved: the later gaps are after real syncs
    return rows


def test_rl_ppo_vlm_with_vllm_in_process_and_the_export_loads_in_vllm(task):
    from transformers import AutoProcessor

    from rl_rollout import RolloutRequest, SamplingParams
    from rl_rollout.vision import load_images
    from rl_rollout.vllm_engine import VLLMEngine

    root, model, imgs = task
    run_rl("rl_cli.train_ppo", [*argv(root, model, "ppo"), "--save_path", str(root / "final")])
    check_rows(root / "ppo")
    final = root / "final"
    assert (final / "config.json").is_file()
    proc = AutoProcessor.from_pretrained(model)
    prompt = proc.apply_chat_template([{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "x"}]}],
                                      tokenize=False, add_generation_prompt=True)
    image = load_images(str(imgs[0]))
    ids = list(proc(text=[prompt], images=image, add_special_tokens=False)["input_ids"][0])
    engine = VLLMEngine(str(final), dtype="float32", enforce_eager=True, max_model_len=256, seed=0, in_process=True,
                        engine_kwargs={"gpu_memory_utilization": 0.2})
    try:
        out = engine.generate([RolloutRequest(ids, SamplingParams(n=1, max_new_tokens=4, ignore_eos=True),
                                              multi_modal_data={"image": image})])
        assert len(out[0][0].response_ids) == 4
    finally:
        engine.shutdown()


def test_rl_ppo_ray_vlm_with_a_vllm_engine_actor(task):
    if importlib.util.find_spec("ray") is None:
        pytest.skip("rl ppo-ray needs Ray (carry scripts/device/vllm-loop-on-device.sh's Ray part)")
    root, model, _ = task
    run_rl("rl_cli.train_ppo_ray", [*argv(root, model, "ray"), "--num_gpus", "1", "--colocate_all_models",
                                    "--vllm_num_engines", "1"])
    check_rows(root / "ray")
