"""The Actor on a Qwen2-VL (multimodal RoPE): its log-probs of image prompts equal the HF engine's rollout
log-probs, in a batch mixing image and text rows, because the model computes its own 3-D positions from the ids
and the rebuilt ``mm_token_type_ids``; 1-D positions would not. Built in code: Qwen-VL processors need
torchvision (absent here), so the ids are expanded by hand and the PIL image processor is used alone."""

from __future__ import annotations

import pytest
import torch

from rl_core.models import Actor, _positions
from rl_core.rl.batching import ModelInputs
from rl_core.rl.experience import make_item
from rl_rollout import RolloutRequest, SamplingParams
from rl_rollout.vision import image_inputs, load_images

IMG, START, END, PAD = 5, 6, 7, 3


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    from rl_rollout.testing import write_test_images

    cfg = Qwen2VLConfig(
        text_config=dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=1, num_key_value_heads=1, max_position_embeddings=512,
                         rope_parameters={"rope_type": "default", "mrope_section": [8, 12, 12], "rope_theta": 1e4},
                         bos_token_id=0, eos_token_id=2, pad_token_id=PAD),
        vision_config=dict(depth=1, embed_dim=32, hidden_size=64, num_heads=2, mlp_ratio=2),
        image_token_id=IMG, video_token_id=8, vision_start_token_id=START, vision_end_token_id=END,
        tie_word_embeddings=True)
    torch.manual_seed(0)
    model = Qwen2VLForConditionalGeneration(cfg).eval()
    with torch.no_grad():  # decisive logits, so that wrong positions show
        for p in model.parameters():
            if p.ndim == 2:
                p.mul_(20)
    model.generation_config.eos_token_id, model.generation_config.pad_token_id = 2, PAD
    images = [load_images(str(p)) for p in write_test_images(tmp_path_factory.mktemp("qimg"), 2, size=(60, 50))]
    return model, Qwen2VLImageProcessorPil(min_pixels=56 * 56, max_pixels=56 * 56 * 4), images


def test_actor_log_probs_of_image_prompts_equal_the_engines_with_multimodal_rope(qwen):
    from rl_rollout.hf_engine import HFEngine

    model, ip, images = qwen
    reqs = []
    for k, img in enumerate(images):
        n = int(image_inputs(ip, img)["image_grid_thw"].prod()) // 4  # merge 2 x 2
        ids = [1, 20, 21, START] + [IMG] * n + [END] + [30 + k] * (3 + 2 * k)  # prompts of different lengths
        reqs.append(RolloutRequest(ids, SamplingParams(n=2, max_new_tokens=6, seed=1), multi_modal_data={"image": img}))
    reqs.append(RolloutRequest([1, 20, 21, 40, 41], SamplingParams(n=2, max_new_tokens=6, seed=1)))
    items = []
    for r, group in zip(reqs, HFEngine(model, processor=ip).generate(reqs), strict=True):
        for s in group:
            assert IMG not in s.response_ids
            it = make_item(s.prompt_ids, s.response_ids, s.loss_mask, s.rollout_logprobs)
            if r.multi_modal_data:
                it.image_inputs = image_inputs(ip, r.multi_modal_data["image"])
            items.append(it)

    def gap(**extra):
        x = ModelInputs.of(items, PAD, False, "cpu", images=True)
        with torch.no_grad():
            lp = Actor(model)(**x.kwargs, **extra).logprobs
        return max((lp[b, it.prompt_len:it.T] - it.rollout_logprobs_T[it.prompt_len:])
                   .abs().max().item() for b, it in enumerate(items))

    assert gap() < 1e-4
    x = ModelInputs.of(items, PAD, False, "cpu", images=True)
    assert gap(position_ids=_positions(x.kwargs["attention_mask"])) > 0.1  # 1-D positions: another distribution
    with pytest.raises(ValueError, match="packing prompts with images is not built"):
        ModelInputs.of(items, PAD, True, "cpu", images=True)


def test_attach_images_processes_each_episodes_image_list_once():
    """Agent episodes (samples with their own images): episodes holding the same image objects (a prompt's n
    episodes whose environment returned none) share one run of the image processor; an episode with an
    observation image gets its own."""
    from types import SimpleNamespace

    import torch

    from rl_core.trainers.ppo_rollout import Sampler

    calls = []

    def processor(images, return_tensors):
        calls.append(len(images))
        return {"pixel_values": torch.full((len(images), 3, 2, 2), float(len(calls)))}

    prompt_img, obs_img = object(), object()
    lists = [[prompt_img], [prompt_img], [prompt_img, obs_img], [prompt_img]]
    samples = [SimpleNamespace(multi_modal_data={"image": list(imgs)}) for imgs in lists]
    items = [SimpleNamespace(image_inputs=None) for _ in samples]
    host = SimpleNamespace(prompts=SimpleNamespace(image_processor=processor))
    Sampler.attach_images(host, [{"images": None}], items, samples)
    assert calls == [1, 2]  # [prompt_img] once, [prompt_img, obs_img] once
    assert items[0].image_inputs is items[1].image_inputs is items[3].image_inputs
    assert items[2].image_inputs["pixel_values"].shape[0] == 2
