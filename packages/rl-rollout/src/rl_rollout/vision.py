"""Vision-language models on both sides of the rollout: which class loads a model, images in, model inputs out.

- :func:`is_vision_config` / :func:`causal_lm_class`: a transformers config with a ``vision_config`` is a
  vision-language model (VLM), loaded with ``AutoModelForImageTextToText`` (LLaVA, Qwen2-VL ...), else
  ``AutoModelForCausalLM`` (how OpenRLHF tells them apart too).
- :func:`placeholder_token_ids`: the image/video placeholder tokens, which are never sampled (the engines
  suppress them, the trainer's log-probs leave them out: both sides compute the same distribution).
- :func:`token_types`: the image/video token marks some VLMs' forwards take beside the images (Qwen-VL's
  ``mm_token_type_ids``), rebuilt from the placeholders in the ids, as OpenRLHF does.
- :func:`load_images`: PIL images from what a dataset row holds: local paths, raw bytes, ``datasets``'
  ``{"bytes", "path"}`` dicts, or PIL images; one image or a list. A ref that does not load raises (naming it):
  a prompt whose image placeholder has no pixels would train on garbage.
- :func:`image_inputs`: the model's image tensors (``pixel_values`` and, per model, ``image_grid_thw`` /
  ``image_sizes``) for a list of images, from the model's image processor. The engine (for generation) and
  the trainer (for the log-prob forwards) call it on the same images, so both see the same pixels.
- :func:`cat_image_inputs`: several prompts' image tensors as one batch (images in row order).
- :func:`placeholder_id` / :func:`expanded_placeholder`: the token a processor expands per image, and its
  expansion for one image (LLaVA: N copies; Qwen-VL: as many as the image's grid asks). The prompt rows
  (:mod:`rl_core.data.images`) and an agent's observation images (:mod:`rl_rollout.agents.images`) both expand
  through it, so an image costs the same tokens wherever it appears.

A request carries its images as ``RolloutRequest.multi_modal_data = {"image": [PIL images]}`` (vLLM's form);
its ``prompt_token_ids`` hold each image's placeholder already expanded to the image's token count (what the
processor's ``__call__`` returns), as the model's forward wants them.
"""

from __future__ import annotations

import io
import os
from collections.abc import Sequence
from typing import Any


def is_vision_config(config) -> bool:
    """A transformers config of a vision-language model (it has a ``vision_config``)."""
    return getattr(config, "vision_config", None) is not None


def placeholder_token_ids(config) -> list[int]:
    """A VLM's image/video placeholder token ids (empty for a text model). The engines never sample them and
    the trainer's log-probs exclude them too (the same distribution on both sides): a placeholder in a
    response would ask the next forward for an image that is not there."""
    if not is_vision_config(config):
        return []
    ids = [getattr(config, name, None) for name in ("image_token_id", "image_token_index", "video_token_id")]
    return sorted({int(i) for i in ids if isinstance(i, int) and i >= 0})


def token_types(config, input_ids, images: dict) -> dict:
    """The per-token image/video marks some VLMs' forwards need beside ``images`` (0 text, 1 image, 2 video, from
    the placeholders in ``input_ids``, which may include a response): Qwen-VL's ``mm_token_type_ids`` (its
    multimodal RoPE), Gemma's ``token_type_ids`` (bidirectional attention over an image); ``{}`` for others
    (LLaVA) and for a batch without images. OpenRLHF rebuilds them the same way."""
    if not images:
        return {}
    if "image_grid_thw" in images or "video_grid_thw" in images:
        key = "mm_token_type_ids"
    elif str(getattr(config, "model_type", "")).startswith("gemma"):
        key = "token_type_ids"
    else:
        return {}
    types = (input_ids == getattr(config, "image_token_id", -1)).to(input_ids.dtype)
    video = getattr(config, "video_token_id", None)
    if video is not None:
        types[input_ids == video] = 2
    return {key: types}


def causal_lm_class(path: str | os.PathLike):
    """``AutoModelForImageTextToText`` for a VLM folder, else ``AutoModelForCausalLM``."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

    return (
        AutoModelForImageTextToText if is_vision_config(AutoConfig.from_pretrained(str(path))) else AutoModelForCausalLM
    )


def load_images(refs: Any) -> list:
    """PIL images (RGB) from one ref or a list of them; ``None`` (or a list of Nones): no image."""
    try:
        from PIL import Image
    except ImportError as e:
        raise ImportError(
            "image prompts need Pillow, which is not installed: pip install 'rl-rollout[vision]' (or pillow)"
        ) from e

    if refs is None:
        return []
    out = []
    for ref in refs if isinstance(refs, (list, tuple)) else [refs]:
        if ref is None:
            continue
        if isinstance(ref, dict):  # datasets' Image feature, undecoded
            ref = ref.get("bytes") or ref.get("path")
        try:
            if isinstance(ref, Image.Image):
                img = ref
            elif isinstance(ref, (bytes, bytearray)):
                img = Image.open(io.BytesIO(ref))
            elif isinstance(ref, (str, os.PathLike)):
                img = Image.open(ref)
            else:
                raise TypeError(f"an image must be a local path, bytes or a PIL image, got {type(ref).__name__}")
            out.append(img.convert("RGB"))
        except (OSError, TypeError, ValueError) as e:
            shown = ref if isinstance(ref, (str, os.PathLike)) else f"<{type(ref).__name__}>"
            raise ValueError(f"image {shown} does not load ({e})") from None
    return out


def image_inputs(image_processor, images: Sequence) -> dict:
    """The model's image tensors for ``images`` (``{}`` for none)."""
    if not images:
        return {}
    out = image_processor(images=list(images), return_tensors="pt")
    return {k: v for k, v in out.items() if hasattr(v, "shape")}


def cat_image_inputs(parts: Sequence[dict]) -> dict:
    """One batch's image tensors: each key's tensors concatenated along dim 0 in order (parts without images
    contribute nothing)."""
    import torch

    parts = [p for p in parts if p]
    if not parts:
        return {}
    keys = set(parts[0])
    for p in parts[1:]:
        if set(p) != keys:
            raise ValueError(f"image inputs of one batch differ in keys: {sorted(keys)} and {sorted(p)}")
    return {k: torch.cat([p[k] for p in parts], dim=0) for k in sorted(keys)}


def placeholder_id(processor) -> int:
    """The token id the processor expands per image (``processor.image_token``)."""
    tok_id = getattr(processor, "image_token_id", None)
    if isinstance(tok_id, int):
        return tok_id
    return int(processor.tokenizer.convert_tokens_to_ids(processor.image_token))


def expanded_placeholder(processor, image) -> list[int]:
    """The ids that stand for ``image`` in the model's input: the processor's expansion of one placeholder
    (what its ``__call__`` makes of ``image_token`` with that image). Raises the processor's ValueError for an
    image it rejects."""
    out = processor(text=[processor.image_token], images=[image], add_special_tokens=False)
    return [int(t) for t in out["input_ids"][0]]
