"""Vision-language rows for the offline trainers (rl_core.data.images) on a tiny random LLaVA: SFT and preference
rows with images hold each placeholder expanded as the processor does, the loss only on the response, a row with
too many images stops naming the row, text rows mix in, and the collated pixels change the Actor's log-probs."""

from __future__ import annotations

import pytest
import torch

from rl_core.data import DataConfig, DataError, PreferenceDataset, SFTDataset, model_inputs, pad_collate
from rl_core.data.images import with_images


@pytest.fixture(scope="module")
def vlm(tmp_path_factory):
    from transformers import AutoProcessor

    from rl_rollout.testing import make_tiny_vlm, write_test_images

    root = tmp_path_factory.mktemp("vlm-data")
    model = make_tiny_vlm(root / "tiny-vlm")
    return model, AutoProcessor.from_pretrained(model), write_test_images(root / "images", 3)


def _cfg(**kw):
    return DataConfig(input_key="prompt", output_key="response", image_key="images", apply_chat_template=True, **kw)


def test_sft_rows_expand_placeholders_as_the_processor_and_mask_the_response(vlm):
    _, proc, imgs = vlm
    rows = [
        {"prompt": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Say a"}]}],
         "images": [str(imgs[0])], "response": "aaa"},
        {"prompt": "<image>Say b", "images": str(imgs[1]), "response": "bb"},  # OpenRLHF's <image> in a string
        {"prompt": "Say c", "response": "c"},  # a text-only row, no image column
    ]
    ds = SFTDataset(rows, proc.tokenizer, _cfg(max_len=256), processor=proc)
    assert len(ds) == 3 and "images" not in ds[2]
    image_id = proc.image_token_id
    for item, row in zip(ds.items[:2], rows[:2], strict=True):
        prompt = proc.tokenizer.apply_chat_template(
            [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": row["prompt"][-5:]}]}]
            if isinstance(row["prompt"], str) else row["prompt"], tokenize=False, add_generation_prompt=True)
        from rl_rollout.vision import load_images

        want = proc(text=[prompt], images=load_images(row["images"]), add_special_tokens=False)["input_ids"][0]
        ids, mask = item["input_ids"].tolist(), item["loss_mask"].tolist()
        assert ids[: len(want)] == list(want)  # the prompt as the processor expands it
        assert ids.count(image_id) == 4  # (28 / 14) ** 2 tokens for the one image
        targets = [i for i, m in enumerate(mask) if m]  # the loss on the response and its eos only
        assert targets == list(range(len(want), len(want) + len(row["response"]) + 1))
        assert proc.tokenizer.decode([ids[i] for i in targets]).startswith(row["response"])
    assert ds[2]["input_ids"].tolist().count(image_id) == 0


def test_a_row_with_too_many_images_or_unmarked_images_stops_naming_the_row(vlm):
    _, proc, imgs = vlm
    ok = {"prompt": "<image>x", "images": str(imgs[0]), "response": "y"}
    two = {"prompt": "<image><image>x", "images": [str(imgs[0]), str(imgs[1])], "response": "y"}
    with pytest.raises(DataError, match=r"row 2\).*2 images in 'images', more than --max_images_per_prompt 1"):
        SFTDataset([ok, two], proc.tokenizer, _cfg(), processor=proc)
    assert len(SFTDataset([ok, two], proc.tokenizer, _cfg(max_images_per_prompt=2), processor=proc)) == 2
    unmarked = {"prompt": "x", "images": str(imgs[0]), "response": "y"}
    with pytest.raises(DataError, match=r"row 1\).*0 image places for the row's 1 images"):
        SFTDataset([unmarked], proc.tokenizer, _cfg(), processor=proc)
    late = {"prompt": "a long prompt then <image>", "images": str(imgs[0]), "response": "y"}
    ds = SFTDataset([ok, late], proc.tokenizer, _cfg(max_len=28), processor=proc)  # the cut would split the image
    assert len(ds) == 1 and ds.report.dropped_too_long == 1
    with pytest.raises(ValueError, match="no processor was given"):
        SFTDataset([ok], proc.tokenizer, _cfg())


def test_preference_rows_share_the_prompts_images_and_pixels_reach_the_model(vlm):
    from rl_core.models import Actor

    model, proc, imgs = vlm
    rows = [{"prompt": "<image>Say a", "images": str(imgs[i]), "chosen": "aa", "rejected": "bbb"} for i in range(2)]
    rows.append({"prompt": "Say c", "chosen": "c", "rejected": "d"})
    cfg = DataConfig(prompt_key="prompt", image_key="images", apply_chat_template=True)
    ds = PreferenceDataset(rows, proc.tokenizer, cfg, processor=proc)
    for it in ds.items[:2]:
        for side in ("chosen", "rejected"):
            assert it[f"{side}_ids"].tolist().count(proc.image_token_id) == 4
    items = ds.items
    batch = with_images(pad_collate(
        [{"input_ids": it["chosen_ids"], "loss_mask": it["chosen_mask"]} for it in items], 0), items,
        proc.image_processor)
    assert batch["image_inputs"]["pixel_values"].shape[0] == 2  # the text row adds none
    actor = Actor.from_pretrained(str(model), dtype="fp32").eval()
    with torch.no_grad():
        real = actor(**model_inputs(batch)).logprobs
        blank = {**batch, "image_inputs": {"pixel_values": torch.zeros_like(batch["image_inputs"]["pixel_values"])}}
        other = actor(**model_inputs(blank)).logprobs
    m = batch["loss_mask"].bool()
    assert (real[:2][m[:2]] - other[:2][m[:2]]).abs().max() > 1e-4  # the images reach the response's log-probs
    assert torch.allclose(real[2], other[2])  # the text row is untouched


def test_kto_refuses_images(vlm):
    from rl_core.data import KTODataset

    _, proc, imgs = vlm
    with pytest.raises(ValueError, match="KTO with images is not built"):
        KTODataset([{"prompt": "x", "response": "y", "label": True}], proc.tokenizer, _cfg())
