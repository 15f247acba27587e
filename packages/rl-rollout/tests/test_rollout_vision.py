"""rl_rollout.vision and the HF engine on a tiny random LLaVA: images from paths, bytes, datasets' dicts and PIL;
generation conditioned on the request's images, its log-probs those of a forward over the same pixels."""

from __future__ import annotations

import io

import pytest
import torch

from rl_rollout import RolloutRequest, SamplingParams
from rl_rollout.vision import cat_image_inputs, image_inputs, load_images, placeholder_token_ids


@pytest.fixture(scope="module")
def vlm(tmp_path_factory):
    from rl_rollout.testing import make_tiny_vlm, write_test_images

    root = tmp_path_factory.mktemp("vlm")
    return make_tiny_vlm(root / "model"), write_test_images(root / "images", 2)


def test_images_load_from_every_ref_a_dataset_holds_and_a_bad_one_is_named(vlm):
    from PIL import Image

    _, paths = vlm
    raw = paths[0].read_bytes()
    imgs = load_images([str(paths[0]), raw, {"bytes": raw, "path": None}, Image.open(paths[1]), None])
    assert [i.size for i in imgs] == [(40, 30)] * 4 and all(i.mode == "RGB" for i in imgs)
    assert load_images(None) == [] and len(load_images(str(paths[1]))) == 1
    with pytest.raises(ValueError, match=r"image /nonexistent.png does not load"):
        load_images(["/nonexistent.png"])
    with pytest.raises(ValueError, match=r"must be a local path, bytes or a PIL image, got int"):
        load_images([3])
    assert io.BytesIO(raw).read(4) == b"\x89PNG"


def test_hf_engine_generates_from_the_images_with_the_log_probs_of_a_forward_over_them(vlm):
    from transformers import AutoConfig, AutoModelForImageTextToText, AutoProcessor

    from rl_rollout.hf_engine import HFEngine

    path, paths = vlm
    proc = AutoProcessor.from_pretrained(path)
    assert placeholder_token_ids(AutoConfig.from_pretrained(path)) == [proc.tokenizer.convert_tokens_to_ids("<image>")]
    prompt = proc.apply_chat_template([{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "x?"}]}],
                                      tokenize=False, add_generation_prompt=True)
    images = [load_images(str(p)) for p in paths]
    ids = list(proc(text=[prompt], images=images[0], add_special_tokens=False)["input_ids"][0])
    assert ids.count(proc.tokenizer.convert_tokens_to_ids("<image>")) == 4  # the placeholder, expanded
    engine = HFEngine(path)
    params = SamplingParams(n=2, max_new_tokens=6, seed=3, ignore_eos=True)
    text_ids = proc.tokenizer("plain text", add_special_tokens=False)["input_ids"]
    reqs = [RolloutRequest(ids, params, multi_modal_data={"image": images[0]}),
            RolloutRequest(ids, params, multi_modal_data={"image": images[1]}),
            RolloutRequest(text_ids, params)]  # a text-only request in the same batch
    out = engine.generate(reqs)
    engine.partial_chunk_tokens = 2  # partial rollouts: every chunk generates from the images again
    partial = engine.generate(reqs)
    model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()
    ip = proc.image_processor
    for k, imgs in enumerate(images):
        for s in out[k] + partial[k]:
            seq = torch.tensor([ids + s.response_ids])
            with torch.no_grad():
                logits = model(input_ids=seq, **image_inputs(ip, imgs)).logits[0, len(ids) - 1:-1]
            logits[:, placeholder_token_ids(model.config)] = float("-inf")  # never sampled (the engine suppresses)
            lp = torch.log_softmax(logits, -1).gather(-1, torch.tensor(s.response_ids)[:, None])[:, 0]
            assert torch.allclose(lp, torch.tensor(s.rollout_logprobs), atol=1e-4), (lp, s.rollout_logprobs)
    # the two images give different next-token distributions: the pixels reached the model
    with torch.no_grad():
        a, b = (model(input_ids=torch.tensor([ids]), **image_inputs(ip, imgs)).logits[0, -1] for imgs in images)
    assert (a - b).abs().max() > 1e-4
    both = cat_image_inputs([image_inputs(ip, images[0]), {}, image_inputs(ip, images[1])])
    assert both["pixel_values"].shape[0] == 2


def test_vllm_prompts_carry_the_images_with_each_expanded_placeholder_collapsed_back():
    """VLLMEngine's prompt for an image request (vLLM expands a token prompt's placeholders itself): one placeholder
    per image, whether images are apart (Qwen-VL) or side by side (LLaVA: equal counts); bad shapes named."""
    from rl_rollout.vllm_engine import _vllm_prompt

    P = 9

    def prompt(ids, n_images, placeholders=(P,)):
        images = [f"img{i}" for i in range(n_images)]
        out = _vllm_prompt(RolloutRequest(ids, multi_modal_data={"image": images}), list(placeholders))
        assert out["multi_modal_data"] == {"image": images}
        return out["prompt_token_ids"]

    assert prompt([1, P, P, P, P, 2], 1) == [1, P, 2]
    assert prompt([1, P, P, P, 2, P, P, P, P, P, 3], 2) == [1, P, 2, P, 3]  # one run per image, any lengths
    assert prompt([1, P, P, P, P, P, P, 3], 2) == [1, P, P, 3]  # side by side: 3 tokens each
    assert prompt([1, P, P, 2, P, P, P, P, 3], 3) == [1, P, 2, P, P, 3]
    assert _vllm_prompt(RolloutRequest([1, 2]), None) == {"prompt_token_ids": [1, 2]}  # text: as it is
    assert _vllm_prompt(RolloutRequest([1, P, P], multi_modal_data={"image": []}), [P]) == {"prompt_token_ids": [1, P, P]}
    with pytest.raises(ValueError, match=r"2 image\(s\) but its placeholder runs have \[3\] tokens"):
        prompt([1, P, P, P, 2], 2)
    with pytest.raises(ValueError, match=r"1 image\(s\) but its placeholder runs have \[\] tokens"):
        prompt([1, 2], 1)
    with pytest.raises(ValueError, match=r"carries 1 image\(s\) but the engine's model is not a vision-language"):
        _vllm_prompt(RolloutRequest([1, P], multi_modal_data={"image": ["img"]}), None)


@pytest.mark.vllm
def test_vllm_engine_knows_a_vlm_folder_and_bans_its_placeholders(vlm):
    """The engine reads whether its model takes images (and which tokens it never samples) from the folder;
    vLLM's sampling parameters then carry the ban as a logit bias."""
    pytest.importorskip("vllm", reason="vllm is not importable here (its SamplingParams build the ban)")
    from transformers import AutoConfig

    from rl_rollout.testing import make_tiny_model
    from rl_rollout.vllm_engine import _placeholder_ids, _to_vllm_params

    path, _ = vlm
    ids = _placeholder_ids(path)
    assert ids == placeholder_token_ids(AutoConfig.from_pretrained(path)) and ids
    assert _placeholder_ids(make_tiny_model(path.parent / "text")) is None
    params = _to_vllm_params(SamplingParams(max_new_tokens=3), banned=ids)
    assert params.logit_bias == {ids[0]: -100.0}
    assert _to_vllm_params(SamplingParams(max_new_tokens=3)).logit_bias is None


def test_a_transformers_5_vision_tower_syncs_under_the_names_vllm_knows(vlm):
    """transformers 5 names the tiny LLaVA's CLIP tower ``model.vision_tower.embeddings.*`` (no ``vision_model.``
    level); vLLM's LLaVA keeps that level, as hub checkpoints do. The worker gives it back before loading and before
    looking up what it holds; other names, and a model without such a tower, pass unchanged."""
    from transformers import AutoModelForImageTextToText

    from rl_rollout.vllm_worker import tower_names_for_vllm

    trainer = AutoModelForImageTextToText.from_pretrained(vlm[0])
    names = [n for n, _ in trainer.named_parameters()]
    assert "model.vision_tower.embeddings.patch_embedding.weight" in names  # the names a sync sends

    class Tower(torch.nn.Module):  # the module layout of vLLM's LLaVA: vision_tower.vision_model.*
        def __init__(self):
            super().__init__()
            self.vision_model = torch.nn.Linear(2, 2)

    vllm_like, text_only = torch.nn.Module(), torch.nn.Module()
    vllm_like.vision_tower = Tower()
    pairs = [(n, None) for n in names]
    out = dict(zip(names, (n for n, _ in tower_names_for_vllm(vllm_like, pairs)), strict=True))
    assert out["model.vision_tower.embeddings.patch_embedding.weight"] == \
        "model.vision_tower.vision_model.embeddings.patch_embedding.weight"
    assert all(v.startswith("model.vision_tower.vision_model.") for k, v in out.items() if "vision_tower" in k)
    assert all(v == k for k, v in out.items() if "vision_tower" not in k)
    legacy = [("vision_tower.vision_model.post_layernorm.weight", None)]  # hub names stay as they are
    assert tower_names_for_vllm(vllm_like, legacy) == legacy
    assert tower_names_for_vllm(text_only, pairs) == pairs
