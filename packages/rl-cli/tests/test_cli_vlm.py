"""Vision-language models in the RL loop (OpenRLHF's train_vlm_math_hybrid_engine.sh): ``rl ppo`` on a tiny
random LLaVA with image prompts (paths, a string prompt with ``<image>``, a text-only row), the vision tower
frozen, the engine and the trainer seeing the same pixels (rollout log-prob gap ~0); ``rl ppo-ray`` as a hybrid
engine (an HF engine actor fed over a gloo broadcast of the VLM's parameter names, ZeRO-3 and both sleeps) gives
the same run."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest

from rl_cli.main import main

pytestmark = [pytest.mark.timeout(900), pytest.mark.slow]
REWARD = "def letter(prompt, response, label, **info):\n    return min(response.count(label), 8) / 8\n"


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    from rl_rollout.testing import make_tiny_vlm, write_test_images

    root = tmp_path_factory.mktemp("vlm-cli")
    model = make_tiny_vlm(root / "tiny-vlm")
    imgs = write_test_images(root / "images", 3)
    rows = [{"prompt": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": f"Say {c}: "}]}],
             "images": [str(imgs[i])], "label": c} for i, c in enumerate("abc")]
    rows += [{"prompt": "<image>Say d: ", "images": str(imgs[0]), "label": "d"},  # OpenRLHF's <image> in a string
             {"prompt": "Say e: ", "images": None, "label": "e"}]  # a text-only row in the same set
    rows += [{"prompt": "Say f: ", "label": "f"}, {"prompt": "<image>Say g: ", "images": [str(imgs[1])], "label": "g"},
             {"prompt": "<image>Say h: ", "images": [str(imgs[2])], "label": "h"}]
    (root / "prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (root / "reward.py").write_text(REWARD)
    return root, model


def argv_of(root, model, run):
    return ["--pretrain", str(model), "--prompt_data", str(root / "prompts.jsonl"), "--input_key", "prompt",
            "--label_key", "label", "--image_key", "images", "--max_images_per_prompt", "1", "--apply_chat_template",
            "--freeze_visual_encoder", "--reward_fn", f"{root / 'reward.py'}:letter",
            "--advantage_estimator", "reinforce_baseline", "--n_samples_per_prompt", "2", "--rollout_batch_size", "4",
            "--train_batch_size", "8", "--micro_train_batch_size", "4", "--generate_max_len", "8",
            "--max_iterations", "2", "--bf16", "false", "--learning_rate", "1e-2", "--init_kl_coef", "0.01",
            "--use_kl_loss", "--seed", "7", "--rollout_engine", "hf", "--run_dir", str(root / run),
            "--eval_dataset", str(root / "prompts.jsonl"), "--eval_n_samples_per_prompt", "1"]


def metrics(path):
    return [json.loads(x) for x in (path / "metrics.jsonl").read_text().splitlines()]


def local_run(root, model):
    if not (root / "local" / "metrics.jsonl").is_file():
        assert main(["ppo", *argv_of(root, model, "local"), "--save_path", str(root / "local" / "final")]) == 0
    return metrics(root / "local")


def test_rl_ppo_trains_a_vlm_on_image_prompts_with_the_vision_tower_frozen(task):
    from safetensors.torch import load_file

    root, model = task
    rows = local_run(root, model)
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:  # the engine generated from the same images the policy's forward reads
        assert r["rl/rollout_logprob_gap"] < 1e-5, r
    assert rows[1]["rl/kl_loss"] > 0  # the policy moved after the first step
    assert "eval/reward_mean" in rows[-1]  # the eval set's image prompts generate too
    before, after = load_file(model / "model.safetensors"), load_file(root / "local" / "final" / "model.safetensors")
    # the export keeps the hub's names (vision_tower.vision_model.*, what vLLM's LLaVA loads): transformers 5
    # saves a model it loaded from them under them again, though its own module names lack the vision_model level
    assert set(after) == set(before) and any(k.startswith("vision_tower.vision_model.") for k in after)
    vision = [k for k in before if "language_model" not in k and "lm_head" not in k]
    assert vision and all((before[k] == after[k]).all() for k in vision)  # --freeze_visual_encoder
    assert any(not (before[k] == after[k]).all() for k in before if "language_model" in k and "layers" in k)


@pytest.mark.skipif(importlib.util.find_spec("bitsandbytes") is None, reason="--load_in_4bit needs bitsandbytes")
def test_rl_ppo_trains_a_4bit_lora_vlm_and_the_engine_gets_the_merged_weights(task):
    """QLoRA on a VLM (issue 41): the language model's linear layers 4-bit with adapters, the vision tower frozen,
    the reference 4-bit too; every iteration the engine generates from the merged weights of the version before
    (the gap stays ~0 once the adapters have moved) and the same pixels reach both sides; the export is a plain
    VLM under the hub's names whose language model moved and whose vision tower did not."""
    from safetensors.torch import load_file

    root, model = task
    argv = [*argv_of(root, model, "qlora"), "--lora_rank", "8", "--lora_alpha", "16", "--target_modules",
            "all-linear", "--load_in_4bit", "--max_iterations", "3", "--save_path", str(root / "qlora" / "final")]
    assert main(["ppo", *argv]) == 0
    rows = metrics(root / "qlora")
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all(r["rl/rollout_logprob_gap"] < 1e-4 for r in rows), [r["rl/rollout_logprob_gap"] for r in rows]
    assert rows[-1]["rl/kl_loss"] > 0  # the adapters moved the policy away from the (4-bit) reference
    out = root / "qlora" / "final"
    assert "quantization_config" not in json.loads((out / "config.json").read_text())
    before, after = load_file(model / "model.safetensors"), load_file(out / "model.safetensors")
    assert set(after) == set(before)
    assert any(not (before[k] == after[k]).all() for k in before if "language_model" in k and "layers" in k)
    # --freeze_visual_encoder under LoRA too: the vision tower's tensors that stay unquantized are untouched (its
    # linear weights come back dequantized from 4 bits, not trained: no adapter sits on them, below)
    vision = [k for k in before if "language_model" not in k and "lm_head" not in k and not k.endswith("proj.weight")
              and ".fc" not in k and "linear_" not in k]
    assert vision and all((before[k] == after[k]).all() for k in vision)
    adapter = load_file(out / "adapter" / "adapter_model.safetensors")
    assert not any("language_model" not in k for k in adapter), sorted(adapter)[:4]  # no adapter on frozen parts


def test_a_row_with_more_images_than_allowed_stops_the_run_naming_it(task, tmp_path, capsys):
    root, model = task
    bad = tmp_path / "bad.jsonl"
    images = sorted(str(p) for p in (root / "images").iterdir())
    bad.write_text(json.dumps({"prompt": "<image><image>Say a: ", "images": images[:2], "label": "a"}) + "\n")
    args = argv_of(root, model, "bad")
    args[args.index("--prompt_data") + 1] = str(bad)
    with pytest.raises(SystemExit):
        main(["ppo", *args])
    err = capsys.readouterr().err
    assert "bad.jsonl" in err and "2 images in 'images', more than --max_images_per_prompt 1" in err, err
    with pytest.raises(SystemExit):
        main(["ppo", *args, "--packing"])
    assert "packing prompts with images is not built: drop --packing" in capsys.readouterr().err
    args[args.index("--prompt_data") + 1] = str(root / "prompts.jsonl")
    if importlib.util.find_spec("torchvision") is None:  # vLLM's multimodal models import it
        with pytest.raises(SystemExit):  # before any model loads
            main(["ppo", *args, "--rollout_engine", "vllm"])
        assert ("images (--image_key) on vLLM engines need torchvision" in (err := capsys.readouterr().err)
                and "--rollout_engine hf" in err), err


@pytest.mark.multiprocess
def test_rl_ppo_ray_vlm_hybrid_engine_matches_the_one_process_run(task):
    """As OpenRLHF's VLM script runs it: every role and the HF engine actor on one (logical) GPU, the engine and
    the policy's ZeRO-3 states sleeping in turn (the frozen vision tower keeps the weights awake: DeepSpeed's
    stage-3 weight offload fails with frozen parameters), images to the engine actor in the requests, the VLM's
    weights over a gloo broadcast; the same run as in one process."""
    root, model = task
    local = local_run(root, model)
    extra = ["--num_gpus", "1", "--colocate_all_models", "--vllm_num_engines", "1", "--vllm_enable_sleep",
             "--ds.enable_sleep", "--zero_stage", "3"]
    out = subprocess.run([sys.executable, "-m", "rl_cli.train_ppo_ray", *argv_of(root, model, "ray"), *extra],
                         capture_output=True, text=True, timeout=800, env={**os.environ, "RAY_DEDUP_LOGS": "0"})
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-6000:]
    assert "weight sync gloo" in out.stdout, out.stdout[-2000:]
    for a, b in zip(local, metrics(root / "ray"), strict=True):
        assert b["rl/rollout_logprob_gap"] < 1e-5 and b["rl/ds_sleep_gb"] > 0, b
        for k in ("rl/reward_mean", "rl/kl_loss", "rl/policy_loss"):
            assert b[k] == pytest.approx(a[k], abs=1e-5), (k, a["step"], a[k], b[k])
