"""The Hugging Face export of a trained model: a transformers/vLLM-loadable folder (safetensors), and the LoRA
merge it and the weight sync use.

:func:`export_hf` gathers the weights (ZeRO-3 included), writes them into a temp folder beside ``save_path`` and
renames it over ``save_path``, so readers never see a half-written model. A LoRA model is written merged
(:func:`merge_lora_state`: ``W + scale * B @ A`` under the base model's names) with its adapter in ``adapter/``;
:func:`merge_lora_stream` merges a stream of named tensors layer by layer (the weight sync into the engines).
Checkpoints for resume (DeepSpeed state) are :mod:`rl_core.checkpoint`.
"""

from __future__ import annotations

import json
import logging
import shutil
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from rl_core.qlora import saving_unquantized
from rl_rollout.vllm_worker_model import with_tower_level

logger = logging.getLogger(__name__)


def lora_scale(peft_config: dict) -> tuple[str, float]:
    """The one adapter's name and its scale: ``alpha / r`` (``alpha / sqrt(r)`` with rsLoRA)."""
    if len(peft_config) != 1:
        raise NotImplementedError(f"merging a model with {len(peft_config)} LoRA adapters; merge one first")
    ((name, cfg),) = peft_config.items()
    return name, cfg.lora_alpha / (cfg.r**0.5 if getattr(cfg, "use_rslora", False) else cfg.r)


def merge_lora_stream(
    named: Iterable[tuple[str, torch.Tensor]], peft_config: dict
) -> Iterator[tuple[str, torch.Tensor]]:
    """A peft LoRA model's ``(name, tensor)`` stream -> the base model's, with ``W + scale * B @ A`` merged in.

    Names ``base_model.model.X.base_layer.weight`` / ``X.lora_A.NAME.weight`` / ``X.lora_B.NAME.weight``
    become one ``X.weight`` (a fresh tensor: merged in float32, cast back to the base weight's dtype), other
    ``.base_layer.`` names lose that part, the ``base_model.model.`` prefix goes: the names transformers and
    the engines load. A layer's three tensors may come in any order (bucket by bucket, as the weight sync
    streams them); only the layers not yet complete are held. Everything else passes through as it is.
    """
    adapter, scale = lora_scale(peft_config)
    prefix = "base_model.model."
    parts = {"base_layer.weight": "w", f"lora_A.{adapter}.weight": "a", f"lora_B.{adapter}.weight": "b"}
    pending: dict[str, dict[str, torch.Tensor]] = {}
    for key, value in named:
        k = key[len(prefix) :] if key.startswith(prefix) else key
        layer, part = _lora_part(k, parts)
        if part is None:
            if ".lora_" in k:  # another adapter's (or an embedding adapter's) tensors: not part of the base
                continue
            yield k.replace(".base_layer.", "."), value
            continue
        held = pending.setdefault(layer, {})
        held[part] = value
        if len(held) == 3:
            del pending[layer]
            w = held["w"]
            yield f"{layer}.weight", (w.float() + scale * (held["b"].float() @ held["a"].float())).to(w.dtype)
    for layer, held in pending.items():  # an adapted layer missing A or B (not expected): its base weight as is
        if "w" in held:
            yield f"{layer}.weight", held["w"]


def _lora_part(name: str, parts: dict[str, str]) -> tuple[str, str | None]:
    for suffix, part in parts.items():
        if name.endswith("." + suffix):
            return name[: -len(suffix) - 1], part
    return name, None


def merge_lora_state(state: dict[str, torch.Tensor], peft_config: dict) -> dict[str, torch.Tensor]:
    """A peft LoRA model's full state -> the base model's state with ``W + scale * B @ A`` merged in
    (:func:`merge_lora_stream` over the dict)."""
    return dict(merge_lora_stream(state.items(), peft_config))


# vision towers saved by transformers 5 one level shallower than the hub's checkpoints (its CLIPVisionModel prefix
# change): it reads both layouts, vLLM's LLaVA-family loaders (0.26-0.32) only the hub's
HUB_TOWER_TYPES = frozenset({"clip_vision_model", "siglip_vision_model", "siglip2_vision_model"})


def hub_tower_names(folder: Path) -> int:
    """Rename an exported vision-language model's CLIP / SigLIP tower to the hub checkpoints' layout
    (``vision_tower.vision_model.*``), which vLLM loads and transformers 5 reads as well; transformers 5 writes
    ``vision_tower.*`` for a model it built or loaded in its own layout. Rewrites each safetensors file that needs
    it and the shard index; returns the tensors renamed (0 for any other model)."""
    config = json.loads((folder / "config.json").read_text()) if (folder / "config.json").is_file() else {}
    if (config.get("vision_config") or {}).get("model_type") not in HUB_TOWER_TYPES:
        return 0
    renamed = 0
    for f in sorted(folder.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as st:
            keys, metadata = list(st.keys()), st.metadata()
        moved = sum(with_tower_level(k) != k for k in keys)
        if moved:
            save_file({with_tower_level(k): v for k, v in load_file(str(f)).items()}, str(f), metadata=metadata)
            renamed += moved
    index = folder / "model.safetensors.index.json"
    if renamed and index.is_file():
        data = json.loads(index.read_text())
        data["weight_map"] = {with_tower_level(k): v for k, v in data.get("weight_map", {}).items()}
        index.write_text(json.dumps(data, indent=2))
    if renamed:
        logger.info("%s: %d vision-tower tensors under the hub's names (what vLLM loads)", folder, renamed)
    return renamed


def export_hf(strategy, model, save_path: str | Path, tokenizer=None, state: dict | None = None) -> Path:
    """Write ``model`` (an Actor, Critic or RewardModel, possibly inside a DeepSpeed engine) as an HF folder;
    ``state``: these weights (``strategy.full_state_dict``'s names) instead of the model's own (EMA weights).

    A LoRA actor is written merged (:func:`merge_lora_state`, loadable by transformers
    and vLLM without peft), with the adapter alone in ``adapter/``. A vision-language actor's CLIP / SigLIP tower
    is written under the hub's names (:func:`hub_tower_names`), which vLLM loads.

    Collective under ZeRO-3 (every rank gathers); rank 0 writes into a temp folder
    and renames it over ``save_path``, so readers never see a half-written model.
    """
    module = getattr(model, "module", model)
    state = strategy.full_state_dict(module) if state is None else state
    save_path = Path(save_path)
    if strategy.is_rank_0():
        tmp = save_path.with_name(f".tmp-{save_path.name}")
        shutil.rmtree(tmp, ignore_errors=True)
        if hasattr(module, "body"):  # Critic / RewardModel: body + head
            module.save_pretrained(tmp, state_dict=state)
        else:
            inner = module.model
            state = {k[len("model.") :]: v for k, v in state.items()}
            if hasattr(inner, "peft_config"):  # LoRA: merged weights for transformers/vLLM + the adapter
                inner.save_pretrained(tmp / "adapter", state_dict=state)
                with saving_unquantized(inner.get_base_model()) as base:  # QLoRA: the full weights, unquantized
                    base.save_pretrained(tmp, state_dict=merge_lora_state(state, inner.peft_config))
            else:
                inner.save_pretrained(tmp, state_dict=state)
            hub_tower_names(tmp)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        if save_path.exists():
            shutil.rmtree(save_path)
        tmp.rename(save_path)
        logger.info("exported HF model to %s", save_path)
    strategy.barrier()
    return save_path
