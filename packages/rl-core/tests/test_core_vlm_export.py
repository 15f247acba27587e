"""A vision-language export vLLM can load: transformers 5 saves a LLaVA's CLIP tower as ``vision_tower.*`` when the
model was built or loaded in its own layout; ``rl_core.hf_export.hub_tower_names`` (run by every export) writes the
hub checkpoints' ``vision_tower.vision_model.*``, which vLLM's LLaVA loader needs and transformers reads back to the
same weights. (vLLM's CPU build runs no vision model: its load of the export is the GPU test's.)"""

from __future__ import annotations

import json

import torch

from rl_core.hf_export import hub_tower_names


def test_a_transformers_5_layout_vlm_export_is_written_under_the_hub_tower_names(tmp_path):
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    from rl_rollout.testing import make_tiny_model, make_tiny_vlm

    src = make_tiny_vlm(tmp_path / "vlm")
    hub = load_file(src / "model.safetensors")
    save_file({k.replace("vision_tower.vision_model.", "vision_tower."): v for k, v in hub.items()},
              src / "model.safetensors", metadata={"format": "pt"})  # the layout transformers 5 writes itself
    model = AutoModelForImageTextToText.from_pretrained(src, dtype=torch.float32)
    model.save_pretrained(tmp_path / "out")
    saved = load_file(tmp_path / "out" / "model.safetensors")
    shallow = [k for k in saved if k.startswith("vision_tower.") and not k.startswith("vision_tower.vision_model.")]
    assert shallow  # what vLLM 0.26-0.32 cannot load: "no module or parameter named 'vision_tower.embeddings'"

    assert hub_tower_names(tmp_path / "out") == len(shallow)
    fixed = load_file(tmp_path / "out" / "model.safetensors")
    assert set(fixed) == set(hub)  # the hub checkpoint's names, every tensor
    again = AutoModelForImageTextToText.from_pretrained(tmp_path / "out", dtype=torch.float32)
    theirs = dict(model.named_parameters())
    for n, p in again.named_parameters():
        torch.testing.assert_close(p, theirs[n], rtol=0, atol=0, msg=n)
    assert hub_tower_names(tmp_path / "out") == 0  # idempotent

    text = make_tiny_model(tmp_path / "text")  # no vision tower: untouched
    before = (text / "model.safetensors").read_bytes()
    assert hub_tower_names(text) == 0 and (text / "model.safetensors").read_bytes() == before
    assert json.loads((text / "config.json").read_text())["model_type"] == "llama"
    AutoModelForCausalLM.from_pretrained(text)
