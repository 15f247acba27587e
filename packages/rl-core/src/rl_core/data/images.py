"""Images in the offline trainers' rows (``rl sft`` / ``rl dpo --image_key``): a row's images checked, their
placeholders expanded the way the model's processor does, and each micro-batch's pixels.

- :func:`vision_processor`: the processor a dataset uses (``image_key`` set), or None; refuses a missing one.
- :func:`row_images`: a row's image refs and PIL images (:func:`rl_rollout.vision.load_images`); more than
  ``max_images_per_prompt`` is a :class:`DataError` naming the row (shared with the RL prompts).
- :func:`expand_placeholders`: text ids (one placeholder token per image, as the chat template or ``<image>``
  writes it) -> the ids the model's forward takes, each placeholder replaced by the processor's expansion of it
  for its image (LLaVA: N copies; Qwen-VL: as many as the image's grid asks), loss mask 0 on them.
- :func:`with_images`: a collated batch plus ``image_inputs``, the image tensors of its rows in row order
  (:func:`rl_rollout.vision.image_inputs` / ``cat_image_inputs``: the RL path's), which
  :func:`rl_core.data.collate.model_inputs` hands to the Actor's forward. Rows keep refs, never pixels: the
  images are loaded again per micro-batch, as the RL prompts do.

Leaves out: packing with images (refused by :class:`rl_core.data.config.DataConfig`), KTO and reward models.
"""

from __future__ import annotations

from collections.abc import Sequence

from rl_core.data.config import DataConfig
from rl_core.data.encoding import Encoded
from rl_core.data.loading import DataError
from rl_rollout.vision import cat_image_inputs, expanded_placeholder, image_inputs, load_images, placeholder_id


def vision_processor(cfg: DataConfig, processor):
    """``processor`` when ``cfg.image_key`` is set (it must be given), else None (text rows)."""
    if cfg.image_key is not None and processor is None:
        raise ValueError(
            f"--image_key {cfg.image_key!r} reads images for a vision-language model, but no "
            f"processor was given: --pretrain must be a VLM folder with its processor "
            f"(processor_config.json), or leave --image_key unset"
        )
    return processor if cfg.image_key is not None else None


def row_images(row: dict, cfg: DataConfig, where: str) -> tuple[object, list]:
    """The row's ``image_key`` value as written and its images, loaded once (a bad ref stops here)."""
    refs = row.get(cfg.image_key) if cfg.image_key is not None else None
    try:
        images = load_images(refs)
    except ValueError as e:
        raise DataError(f"{where}: {cfg.image_key!r} (--image_key): {e}") from None
    if len(images) > cfg.max_images_per_prompt:
        raise DataError(
            f"{where}: {len(images)} images in {cfg.image_key!r}, more than --max_images_per_prompt "
            f"{cfg.max_images_per_prompt}; raise --max_images_per_prompt or drop the row"
        )
    return refs, images


def expand_placeholders(processor, enc: Encoded, images: Sequence, where: str, label: str) -> Encoded:
    """``enc`` with its i-th image placeholder replaced by the processor's ids for image i (mask 0 on them).
    The placeholders and the images must match in number: an image without its place (or a place without an
    image) is a :class:`DataError` naming the row."""
    ph = placeholder_id(processor)
    at = [i for i, t in enumerate(enc.input_ids) if t == ph]
    if len(at) != len(images):
        raise DataError(
            f"{where}: {label} marks {len(at)} image places for the row's {len(images)} images; mark each "
            f"image with a {{'type': 'image'}} content part (--apply_chat_template) or "
            f"{processor.image_token!r} in a string prompt"
        )
    ids: list[int] = []
    mask: list[int] = []
    prev = 0
    for pos, image in zip(at, images, strict=True):
        try:
            expanded = expanded_placeholder(processor, image)
        except ValueError as e:
            raise DataError(f"{where}: the processor rejected an image of the row: {e}") from None
        ids += enc.input_ids[prev:pos] + expanded
        mask += enc.loss_mask[prev:pos] + [0] * len(expanded)
        prev = pos + 1
    return Encoded(ids + enc.input_ids[prev:], mask + enc.loss_mask[prev:])


def last_image_token(processor, ids: Sequence[int]) -> int:
    """Index of the last image token in ``ids`` (-1 for none): a cut at ``max_len`` must not split an image."""
    ph = placeholder_id(processor)
    return max((i for i, t in enumerate(ids) if t == ph), default=-1)


def with_images(batch: dict, items: Sequence[dict], image_processor) -> dict:
    """``batch`` (whose rows are ``items``, in order) plus ``image_inputs``: the rows' image tensors
    concatenated in row order; unchanged when no row has images."""
    refs = [it.get("images") for it in items]
    if not any(refs):
        return batch
    if image_processor is None:
        raise ValueError(
            "these rows hold images (--image_key) but the trainer has no image processor: build the dataset "
            "with the model's processor (processor=)"
        )
    parts = [image_inputs(image_processor, load_images(r)) for r in refs if r]
    return {**batch, "image_inputs": cat_image_inputs(parts)}
