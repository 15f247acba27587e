"""Images in an agent's observations, for a vision-language policy: :class:`ObservationImages`.

An environment returns images beside an observation's text (``StepResult.images``, or an
:class:`~rl_rollout.agents.env.Observation` from ``reset``). :meth:`ObservationImages.encode` turns both into
the tokens the policy's context gets: the text tokenized as any observation, each image's place (the
processor's image token, LLaVA's ``<image>``, written by the environment, or put before the text when it writes
none) expanded to that image's token count by the processor, exactly as a prompt's images are
(:func:`rl_rollout.vision.expanded_placeholder`). The executor appends those tokens with loss mask 0, adds the
images to the episode's list (prompt images first, then each observation's, in order), and every later turn's
request carries the whole list (``multi_modal_data``), so the engine and the trainer's forward see the same
pixels at the same placeholders.

Refused, naming the fix: images for a policy without an image processor (a text-only model), a processor that
has no image token, a text that marks more or fewer places than it has images, an image the processor rejects.

Not here: videos, images in the policy's own turns (the engines never sample a placeholder).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from rl_rollout.vision import expanded_placeholder, load_images, placeholder_id


class ObservationImages:
    """Encodes observations with images for ``processor`` (a VLM's ``AutoProcessor``; None: the policy takes
    none, and an observation with images is refused)."""

    def __init__(self, processor: Any | None) -> None:
        self.processor = processor

    def encode(
        self, encode_text: Callable[[str], list[int]], text: str, refs: Sequence[Any], where: str
    ) -> tuple[list[int], list]:
        """``(ids, images)``: the observation's token ids with each image's placeholder expanded, and its images
        loaded (PIL, RGB). ``encode_text`` tokenizes (and formats) an observation's text; ``where`` names the
        observation in errors (``"CalcEnv.step at turn 2"``)."""
        images = load_images(list(refs)) if refs else []  # (text observations need no Pillow)
        if not images:
            return encode_text(text), []
        proc = self._processor(len(images), where)
        token = proc.image_token
        marks = text.count(token)
        if marks == 0:
            text = token * len(images) + text
        elif marks != len(images):
            raise ValueError(
                f"{where} returned {len(images)} image(s) but its text marks {marks} image places ({token!r}); "
                f"write {token!r} once per image, or not at all (the images then go before the text)"
            )
        ph = placeholder_id(proc)
        ids: list[int] = []
        k = 0
        for t in encode_text(text):
            if t != ph:
                ids.append(t)
                continue
            if k == len(images):
                raise ValueError(
                    f"{where}: the formatted observation holds more {token!r} tokens than its {len(images)} "
                    "image(s) (format_observation adds some?); keep image tokens out of the formatting"
                )
            try:
                ids += expanded_placeholder(proc, images[k])
            except ValueError as e:
                raise ValueError(f"{where}: the processor rejected image {k} of the observation: {e}") from None
            k += 1
        if k != len(images):
            raise ValueError(
                f"{where}: the tokenizer split {token!r} ({k} of {len(images)} image places kept as one token); "
                "the processor's tokenizer must hold the image token as a special token"
            )
        return ids, images

    def _processor(self, n: int, where: str) -> Any:
        proc = self.processor
        if proc is None:
            raise ValueError(
                f"{where} returned {n} image(s) but the policy takes no images (no image processor: a text-only "
                "model); train a vision-language model with its processor (rl ppo: a VLM --pretrain with "
                "--image_key; AgentExecutor(processor=...)), or return observations without images"
            )
        if not isinstance(getattr(proc, "image_token", None), str) or getattr(proc, "image_processor", None) is None:
            raise ValueError(
                f"{where} returned {n} image(s) but the policy's processor ({type(proc).__name__}) has no "
                "image_token / image_processor, so it cannot place them; use the vision-language model's "
                "AutoProcessor, or return observations without images"
            )
        return proc
