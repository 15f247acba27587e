"""What :class:`rl_rollout.vllm_worker.WorkerExtension` reads off vLLM's model, as plain functions.

- Direct load or a reload session: :data:`DIRECT_LOAD_ARCHITECTURES` and ``RL_VLLM_DIRECT_LOAD``
  (:func:`_direct_load`);
- tied parameters, recorded before a reload splits them (:func:`_tied_parameters`);
- vision-tower names: transformers 5 saves LLaVA's CLIP tower one level shallower than vLLM's loader expects
  (:func:`with_tower_level`, :func:`tower_names_for_vllm`);
- an HF name's vLLM name through the model's mapper (:func:`_vllm_name`) and the session report of
  ``rl_finish_weight_update`` (:func:`_session_report`: layers that kept old weights or got part of theirs).

vLLM is imported inside the functions that need it; :mod:`rl_rollout.vllm_worker` re-exports every name here.
"""

from __future__ import annotations

import os

import torch

# Architectures whose vLLM loaders only copy (no weight transform after loading on CUDA): direct load by
# default there. LlamaForCausalLM ran on an H200 (tests/test_cli_vllm_gpu.py, benchmarks/vllm_sync.py);
# the others share its loader (stacked qkv/gate_up parameters, plain copies). Anything else keeps the
# layerwise reload unless RL_VLLM_DIRECT_LOAD=1.
DIRECT_LOAD_ARCHITECTURES = frozenset(
    {"LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "MistralForCausalLM"}
)


def _direct_load(model_config) -> bool:
    """Whether a sync loads straight into the live parameters: ``RL_VLLM_DIRECT_LOAD=1`` forces it and ``0``
    turns it off; unset, it is on for :data:`DIRECT_LOAD_ARCHITECTURES`. Never on CPU or for quantized models."""
    if not torch.cuda.is_available() or getattr(model_config, "quantization", None) is not None:
        return False
    flag = os.environ.get("RL_VLLM_DIRECT_LOAD")
    if flag in ("0", "1"):
        return flag == "1"
    archs = getattr(model_config, "architectures", None) or getattr(model_config.hf_config, "architectures", None) or []
    return bool(archs) and all(a in DIRECT_LOAD_ARCHITECTURES for a in archs)


def _tied_parameters(model) -> dict[str, str]:
    """``{alias: source}``: parameters registered on several modules (``lm_head.weight`` ->
    ``model.embed_tokens.weight`` under ``tie_word_embeddings``), by vLLM name, first registration
    the source. Only valid outside a reload session (the reload gives each module its own tensor)."""
    seen: dict[int, str] = {}
    ties = {}
    for mod_name, module in model.named_modules():
        for pname, param in module._parameters.items():
            if param is None:
                continue
            full = f"{mod_name}.{pname}" if mod_name else pname
            if id(param) in seen:
                ties[full] = seen[id(param)]
            else:
                seen[id(param)] = full
    return ties


# transformers 5 names a CLIP/SigLIP vision tower without its ``vision_model.`` level (``model.vision_tower.embeddings.*``,
# saved as ``vision_tower.embeddings.*``); vLLM's LLaVA-family models keep that level, as the hub checkpoints do
# (``vision_tower.vision_model.embeddings.*``): "no module or parameter named 'vision_tower.embeddings'".
TOWER_PREFIXES = ("model.vision_tower.", "vision_tower.")


def with_tower_level(name: str) -> str:
    """A transformers-5 vision tower name given back its ``vision_model.`` level; any other name unchanged."""
    for prefix in TOWER_PREFIXES:
        if name.startswith(prefix) and not name.startswith(prefix + "vision_model."):
            return prefix + "vision_model." + name[len(prefix) :]
    return name


def tower_names_for_vllm(model, weights: list) -> list:
    """``(hf_name, tensor)`` pairs with a vision tower's transformers-5 names given back the ``vision_model.`` level
    that ``model`` (vLLM's) has under ``vision_tower``; everything else, and every model without such a tower,
    unchanged."""
    if not _has_tower_level(model):
        return weights
    return [(with_tower_level(name), tensor) for name, tensor in weights]


def _has_tower_level(model) -> bool:
    return hasattr(getattr(model, "vision_tower", None), "vision_model")


def _vllm_name(mapper, hf_name: str) -> str | None:
    if mapper is None:
        return hf_name
    return (getattr(mapper, "map_name", None) or mapper._map_name)(hf_name)


def _session_report(model) -> dict:
    """Layers of the open session that got none / part of their weights; quiets the ones with nothing to load.

    Before ``finalize_layerwise_reload``, a layer whose info still ``can_load()`` was not processed yet."""
    from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding

    try:
        from vllm.model_executor.layers.attention import is_deferred_attention_layer
        from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO
    except ImportError:  # another vLLM layout: no report
        return {"kept_old": [], "partial": []}
    kept_old, partial = [], []
    for name, layer in model.named_modules():
        info = LAYERWISE_INFO.get(layer)
        fields = ("can_load", "kernel_tensors", "load_numel", "load_numel_total")
        if info is None or not all(hasattr(info, a) for a in fields):
            continue  # not in this session, or another vLLM's bookkeeping: no report
        if not info.can_load() or info.kernel_tensors is None or is_deferred_attention_layer(layer):
            continue
        params, buffers = info.kernel_tensors
        if info.load_numel <= 0:
            if not params and set(buffers) <= set(getattr(info, "kernel_non_persistent_buffers", ())):
                # computed, not loaded (a rotary embedding's cos/sin cache): vLLM restores it as it
                # does for a layer with nothing loadable, without "Failed to load weights"
                info.load_numel_total = 0
            elif info.load_numel_total:
                kept_old.append(name)
        elif info.load_numel < info.load_numel_total and not isinstance(layer, VocabParallelEmbedding):
            partial.append(name)  # a vocabulary's padding rows are never loaded: not partial
    return {"kept_old": kept_old, "partial": partial}
