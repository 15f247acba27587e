"""VLLMEngine with images (issue 17): a tiny random LLaVA generates from each request's pixels, its rollout
log-probs are those of a transformers forward over the same pixels, its placeholder tokens are never sampled,
and a weight sync (language model, projector and vision tower under HF names) reaches the engine.

Needs vLLM's GPU build, a GPU and torchvision: vLLM's multimodal model modules import transformers' image
processors, which import torchvision, and vLLM's CPU build here has none (PyPI's torchvision is built for the
CUDA torch). On CPU the test skips and says so; on the GPU machine PyPI's torchvision 0.26.0 (+cu130, for the
image's torch 2.11.0) travels with scripts/device/vllm-loop-on-device.sh, and mistral_common with the wheels it
needs (vLLM's llava module imports them) in that script's extra images part (.vcarry-images). The prompt building it relies on is
tested on CPU (test_rollout_vision.py).
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from rl_rollout.testing import missing_modules

if why := missing_modules("vllm", where="run with vLLM's GPU build on a GPU"):
    pytest.skip(why, allow_module_level=True)

pytestmark = [
    pytest.mark.vllm, pytest.mark.timeout(600),
    pytest.mark.skipif(not torch.cuda.is_available(),
                       reason="vLLM with images runs on the GPU build only here: vLLM's multimodal models import "
                              "torchvision, which vLLM's CPU build (torch 2.13.0+cpu) cannot have from PyPI"),
    pytest.mark.skipif(importlib.util.find_spec("torchvision") is None,
                       reason="torchvision is not installed: vLLM's multimodal models import it (carry PyPI's "
                              "torchvision wheel for the installed torch)"),
]

TOL = 3e-2  # vLLM's GPU kernels against transformers in fp32 (text: up to 1.5e-2, VLLM_CPU_TESTS_ON_CUDA)


def forward_logprobs(model, ids, response, images, processor, placeholders):
    from rl_rollout.vision import image_inputs

    seq = torch.tensor([ids + response], device="cuda")
    pixels = {k: v.cuda() for k, v in image_inputs(processor.image_processor, images).items()}
    with torch.no_grad():
        logits = model(input_ids=seq, **pixels).logits[0, len(ids) - 1:-1].float()
    logits[:, placeholders] = float("-inf")  # the engines never sample them
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(response, device="cuda")[:, None])[:, 0].cpu()


def test_vllm_generates_from_the_images_with_the_log_probs_of_a_forward_over_them(tmp_path):
    from transformers import AutoModelForImageTextToText, AutoProcessor

    from rl_rollout import RolloutRequest, SamplingParams
    from rl_rollout.testing import make_tiny_vlm, stand_in_pixtral_names, write_test_images
    from rl_rollout.vision import load_images
    from rl_rollout.vllm_engine import VLLMEngine

    if added := stand_in_pixtral_names(tmp_path / "site"):
        print(f"\nstand-ins for Pixtral names this transformers lacks (vLLM's llava module imports them): {added}")
    path = make_tiny_vlm(tmp_path / "vlm")
    proc = AutoProcessor.from_pretrained(path)
    image_id = proc.tokenizer.convert_tokens_to_ids("<image>")
    prompt = proc.apply_chat_template([{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "x?"}]}],
                                      tokenize=False, add_generation_prompt=True)
    images = [load_images(str(p)) for p in write_test_images(tmp_path / "images", 2)]
    ids = list(proc(text=[prompt], images=images[0], add_special_tokens=False)["input_ids"][0])
    assert ids.count(image_id) == 4  # expanded, as the trainer's forward takes it
    engine = VLLMEngine(path, dtype="float32", enforce_eager=True, max_model_len=256, seed=0, in_process=True,
                        engine_kwargs={"gpu_memory_utilization": 0.2})
    model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).cuda().eval()
    params = SamplingParams(n=2, max_new_tokens=8, seed=3, ignore_eos=True)

    def check(label):
        out = engine.generate([RolloutRequest(ids, params, multi_modal_data={"image": imgs}) for imgs in images])
        gaps = {"own": 0.0, "other": 0.0}
        for k, samples in enumerate(out):
            for s in samples:
                assert s.prompt_ids == ids and image_id not in s.response_ids and len(s.response_ids) == 8
                got = torch.tensor(s.rollout_logprobs)
                for side, imgs in (("own", images[k]), ("other", images[1 - k])):
                    want = forward_logprobs(model, ids, s.response_ids, imgs, proc, [image_id])
                    gaps[side] = max(gaps[side], (got - want).abs().max().item())
        print(f"\n{label}: max |vLLM - transformers| log-prob, own image {gaps['own']:.2e}, other {gaps['other']:.2e}")
        assert gaps["own"] < TOL, (label, gaps)
        return gaps

    try:
        assert engine.takes_images
        check("folder's weights")
        # a sync of every tensor under HF names; the projector scaled up so that the pixels dominate
        with torch.no_grad():
            for name, p in model.named_parameters():
                p.mul_(8.0 if "multi_modal_projector" in name else 1.05)
        engine.update_weights([(n, p.detach()) for n, p in model.named_parameters()], version=1)
        gaps = check("after a sync")
        assert gaps["other"] > 2 * gaps["own"] and gaps["other"] > TOL  # the pixels reached vLLM's model
        assert engine.policy_version == 1
    finally:
        engine.shutdown()
