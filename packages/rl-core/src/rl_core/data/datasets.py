"""Torch datasets for RL prompts, SFT, preference pairs and KTO, tokenized eagerly.

Each class takes rows (from :func:`rl_core.data.loading.load_rows`, or any list of
dicts), a tokenizer and a :class:`DataConfig`; it tokenizes every row in ``__init__``
so malformed data fails at start-up, and leaves a :class:`DataReport` on ``.report``
(also logged at INFO). A malformed row (missing key, wrong type, empty response)
raises :class:`DataError` naming file, row, key and fix, unless ``skip_bad_rows``,
when it is counted and the first reasons are logged as warnings. A dataset left with
no rows raises: an empty dataset must not train silently.

Length policy: RL prompts longer than ``max_len`` are dropped, never cut (half a
prompt is a different task). SFT / preference / KTO sequences are cut from the right
to ``max_len`` (counted as truncated); a row with no response token left is dropped.

Loss-mask convention (as in :mod:`rl_core.data.collate`): ``loss_mask[t] == 1`` means
token ``t`` is a target; its logprob comes from the logits at position ``t - 1``, so
``loss_mask[0]`` is always 0.

Leaves out: file reading (loading.py), text/segment rules (encoding.py), batching.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch.utils.data import Dataset

from rl_core.data.config import DataConfig
from rl_core.data.encoding import (
    Encoded,
    as_messages,
    check_tokenizer,
    encode_chat,
    encode_completion,
    image_messages,
    render_prompt,
)
from rl_core.data.images import expand_placeholders, last_image_token, row_images, vision_processor
from rl_core.data.loading import DataError, Row, where_of

logger = logging.getLogger(__name__)

MAX_LOGGED_REASONS = 5


@dataclass
class DataReport:
    """What became of the rows: ``rows_in == rows_kept + dropped_too_long + bad_rows_skipped``."""

    kind: str
    max_len: int
    rows_in: int = 0
    rows_kept: int = 0
    truncated: int = 0
    dropped_too_long: int = 0
    bad_rows_skipped: int = 0
    bad_reasons: list[str] = field(default_factory=list)  # the first few, for the log

    def summary(self) -> str:
        return (
            f"{self.kind}: kept {self.rows_kept}/{self.rows_in} rows (max_len {self.max_len}); "
            f"{self.truncated} truncated, {self.dropped_too_long} dropped as too long, "
            f"{self.bad_rows_skipped} bad rows skipped"
        )


class _Dropped(Exception):
    """Internal: the row is well-formed but does not fit ``max_len``."""


class _EagerDataset(Dataset):
    """Shared loop: encode each row with ``_encode``, count outcomes, refuse emptiness."""

    def __init__(self, rows: Sequence[dict], tokenizer, cfg: DataConfig) -> None:
        self.tokenizer = tokenizer
        self.cfg = cfg
        check_tokenizer(tokenizer, cfg)
        self._check_config()
        report = DataReport(kind=type(self).__name__, max_len=cfg.max_len, rows_in=len(rows))
        self.items: list[dict] = []
        for i, row in enumerate(rows):
            where = where_of(row, i)
            try:
                if not isinstance(row, dict):
                    raise DataError(f"{where}: expected a dict of columns, got {type(row).__name__}")
                self._truncated = False
                item = self._encode(row, where)
            except _Dropped:
                report.dropped_too_long += 1
                continue
            except DataError as e:
                if not cfg.skip_bad_rows:
                    raise
                report.bad_rows_skipped += 1
                if len(report.bad_reasons) < MAX_LOGGED_REASONS:
                    report.bad_reasons.append(str(e))
                continue
            report.truncated += self._truncated
            self.items.append(item)
        report.rows_kept = len(self.items)
        self.report = report
        if report.bad_rows_skipped:
            logger.warning(
                "%s skipped %d bad rows (skip_bad_rows); first reasons:\n  %s",
                report.kind,
                report.bad_rows_skipped,
                "\n  ".join(report.bad_reasons),
            )
        logger.info(report.summary())
        if not self.items:
            sources = sorted({r.source for r in rows if isinstance(r, Row)})
            raise DataError(
                f"{report.summary()}{' in ' + ', '.join(sources) if sources else ''}: no usable rows, "
                "refusing to build an empty dataset; "
                "raise --max_len or fix the rows" + (f" (e.g. {report.bad_reasons[0]})" if report.bad_reasons else "")
            )

    def _check_config(self) -> None:
        pass

    def _encode(self, row: dict, where: str) -> dict:
        raise NotImplementedError

    def _fit(self, enc: Encoded) -> tuple[torch.Tensor, torch.Tensor]:
        """Right-truncate to max_len (noting it); raise _Dropped if no target token is left."""
        ids, mask = enc.input_ids, enc.loss_mask
        if len(ids) > self.cfg.max_len:
            ids, mask = ids[: self.cfg.max_len], mask[: self.cfg.max_len]
            self._truncated = True
        if not any(mask):
            raise _Dropped
        return torch.tensor(ids, dtype=torch.long), torch.tensor(mask, dtype=torch.long)

    def _fit_images(self, enc: Encoded, images: list, where: str, label: str) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`_fit` of a sequence whose prompt holds ``images`` (their placeholders expanded first); a cut
        at ``max_len`` through an image drops the row (the forward needs every image token)."""
        processor = getattr(self, "processor", None)
        if processor is None:
            return self._fit(enc)
        enc = expand_placeholders(processor, enc, images, where, label)
        if last_image_token(processor, enc.input_ids) >= self.cfg.max_len:
            raise _Dropped
        return self._fit(enc)

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int) -> dict:
        return self.items[index]


def _get(row: dict, key: str, flag: str, where: str, what: str) -> object:
    if key not in row:
        present = ", ".join(map(str, row)) or "none"
        raise DataError(
            f"{where}: missing key {key!r} (keys present: {present}); set --{flag} to the column that holds {what}"
        )
    return row[key]


class PromptDataset(_EagerDataset):
    """RL prompts. Item: ``{"prompt": str, "prompt_ids": list[int], "label": object | None}``.

    ``label`` is ``row[label_key]`` (e.g. the reference answer for a verifier), or None
    when no ``label_key`` is set. Prompts over ``max_len`` tokens are dropped and counted.

    Vision-language prompts (``image_key``, with the model's ``processor``): the item also holds ``"images"``,
    the row's image refs (loaded again at each rollout, so no pixels stay in memory), and ``prompt_ids`` are
    the processor's, each image placeholder expanded to the image's tokens. Every row's images are loaded
    once here: a missing file, or more than ``max_images_per_prompt``, is a :class:`DataError` naming the row.
    """

    def __init__(self, rows: Sequence[dict], tokenizer, cfg: DataConfig, processor=None) -> None:
        self.processor = vision_processor(cfg, processor)
        # the rollout's image tensors (rl_core.trainers.ppo_rollout): the engine and the trainer see the same pixels
        self.image_processor = getattr(self.processor, "image_processor", None)
        super().__init__(rows, tokenizer, cfg)

    def _encode(self, row: dict, where: str) -> dict:
        cfg = self.cfg
        value = _get(row, cfg.input_key, "input_key", where, "the prompt")
        prompt = render_prompt(self.tokenizer, cfg, value, where, f"{cfg.input_key!r} (--input_key)")
        if not prompt.strip():
            raise DataError(f"{where}: prompt {cfg.input_key!r} is empty (fix or drop the row)")
        label = None if cfg.label_key is None else _get(row, cfg.label_key, "label_key", where, "the label")
        refs: object = None
        images: list = []
        if self.processor is not None:
            refs, images = row_images(row, cfg, where)
        if images and self.processor is not None:  # (images: loaded through the processor's branch above)
            try:
                ids = self.processor(text=[prompt], images=images, add_special_tokens=False)["input_ids"][0]
            except ValueError as e:  # e.g. placeholders and images do not match in number
                raise DataError(
                    f"{where}: the processor rejected the prompt with its {len(images)} images: {e}"
                ) from None
            ids = list(ids)
        else:
            ids = self.tokenizer(prompt, add_special_tokens=False)["input_ids"]
        if len(ids) > cfg.max_len:
            raise _Dropped
        item = {"prompt": prompt, "prompt_ids": ids, "label": label}
        # the row as written (every key, the prompt before any chat template): what an --agent_cmd program reads
        item["row"] = {**{k: v for k, v in row.items() if k != cfg.image_key}, "prompt": value, "label": label}
        if images:
            item["images"] = refs
        return item


class SFTDataset(_EagerDataset):
    """Supervised fine-tuning. Item: ``{"input_ids": LongTensor[T], "loss_mask": LongTensor[T]}``.

    Single-turn: prompt from ``input_key``, response (a string) from ``output_key``.
    Multi-turn: ``output_key`` unset and ``input_key`` holds a chat message list (needs
    ``apply_chat_template``); the loss covers every assistant turn.

    Vision-language rows (``image_key``, with the model's ``processor``): the prompt marks each image with a
    ``{"type": "image"}`` part (or ``<image>`` in a string), the ids hold each placeholder expanded as the
    processor does (:mod:`rl_core.data.images`) and the item also holds ``"images"`` (the row's refs, loaded
    again per micro-batch); rows without images train as text.
    """

    def __init__(self, rows: Sequence[dict], tokenizer, cfg: DataConfig, processor=None) -> None:
        self.processor = vision_processor(cfg, processor)
        self.image_processor = getattr(self.processor, "image_processor", None)  # the trainers' collate reads it
        super().__init__(rows, tokenizer, cfg)

    def _check_config(self) -> None:
        if self.cfg.output_key is None and not self.cfg.apply_chat_template:
            raise ValueError(
                "SFTDataset needs --output_key (the response column) for single-turn data, or "
                "--apply_chat_template for multi-turn chat messages in --input_key"
            )

    def _encode(self, row: dict, where: str) -> dict:
        cfg = self.cfg
        in_label = f"{cfg.input_key!r} (--input_key)"
        value = _get(row, cfg.input_key, "input_key", where, "the prompt or conversation")
        if cfg.output_key is None:
            if not isinstance(value, list):
                raise DataError(
                    f"{where}: {in_label} must be a chat message list for multi-turn SFT, got "
                    f"{type(value).__name__}; set --output_key for single-turn prompt/response data"
                )
            messages = (image_messages if cfg.image_key else as_messages)(value, where, in_label)
            targets = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
            if not targets:
                raise DataError(f"{where}: {in_label} has no assistant message to train on")
            enc = encode_chat(self.tokenizer, messages, targets, where, in_label)
        else:
            response = _get(row, cfg.output_key, "output_key", where, "the response")
            if not isinstance(response, str):
                raise DataError(
                    f"{where}: {cfg.output_key!r} (--output_key) must be a string (the response), "
                    f"got {type(response).__name__}"
                )
            enc = encode_completion(
                self.tokenizer, cfg, value, response, where, in_label, f"{cfg.output_key!r} (--output_key)"
            )
        refs, images = row_images(row, cfg, where) if self.processor is not None else (None, [])
        input_ids, loss_mask = self._fit_images(enc, images, where, in_label)
        item: dict = {"input_ids": input_ids, "loss_mask": loss_mask}
        if images:
            item["images"] = refs
        return item


class PretrainDataset(_EagerDataset):
    """PPO-ptx's pretraining text (OpenRLHF's SFTDataset in pretrain_mode). Item: ``{"input_ids", "loss_mask"}``:
    the ``input_key`` string tokenized as is (no template, no special tokens), cut at ``max_len``, every token a
    target but the first."""

    def _check_config(self) -> None:
        if self.cfg.image_key is not None:
            raise ValueError(
                f"--image_key {self.cfg.image_key!r}: pretraining text has no images (rl sft without "
                f"--pretrain_mode takes them); drop --image_key"
            )

    def _encode(self, row: dict, where: str) -> dict:
        text = _get(row, self.cfg.input_key, "input_key", where, "the pretraining text")
        if not isinstance(text, str) or not text.strip():
            raise DataError(
                f"{where}: {self.cfg.input_key!r} (--input_key) of --pretrain_data must be a non-empty "
                f"string, got {type(text).__name__}"
            )
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        input_ids, loss_mask = self._fit(Encoded(ids, [0] + [1] * (len(ids) - 1)))
        return {"input_ids": input_ids, "loss_mask": loss_mask}


class PreferenceDataset(_EagerDataset):
    """Pairs for DPO / reward models. Item: ``{"chosen_ids", "chosen_mask", "rejected_ids",
    "rejected_mask"}`` (LongTensor[T_c], [T_r]) and ``"margin": float``.

    The prompt comes from ``prompt_key`` when set; chosen / rejected are response
    strings, or (with ``apply_chat_template``) message lists: appended to the prompt, or
    whole conversations whose last assistant turn is the response when there is no
    prompt column. ``margin`` is ``float(row[margin_key])``, 0.0 without ``margin_key``.

    Vision-language rows (``image_key``, with the model's ``processor``): chosen and rejected share the prompt's
    images (each side's placeholders expanded as :class:`SFTDataset` does); the item holds ``"images"`` once.
    """

    def __init__(self, rows: Sequence[dict], tokenizer, cfg: DataConfig, processor=None) -> None:
        self.processor = vision_processor(cfg, processor)
        self.image_processor = getattr(self.processor, "image_processor", None)  # the trainers' collate reads it
        super().__init__(rows, tokenizer, cfg)

    def _encode(self, row: dict, where: str) -> dict:
        cfg = self.cfg
        prompt = None
        p_label = f"{cfg.prompt_key!r} (--prompt_key)"
        if cfg.prompt_key is not None:
            prompt = _get(row, cfg.prompt_key, "prompt_key", where, "the prompt")
        out: dict = {}
        refs, images = row_images(row, cfg, where) if self.processor is not None else (None, [])
        for side, key, flag in (
            ("chosen", cfg.chosen_key, "chosen_key"),
            ("rejected", cfg.rejected_key, "rejected_key"),
        ):
            response = _get(row, key, flag, where, f"the {side} response")
            if not isinstance(response, (str, list)):
                raise DataError(
                    f"{where}: {key!r} (--{flag}) must be a string or chat message list, got {type(response).__name__}"
                )
            r_label = f"{key!r} (--{flag})"
            enc = encode_completion(self.tokenizer, cfg, prompt, response, where, p_label, r_label)
            out[f"{side}_ids"], out[f"{side}_mask"] = self._fit_images(enc, images, where, r_label)
        out["margin"] = 0.0
        if cfg.margin_key is not None:
            margin = _get(row, cfg.margin_key, "margin_key", where, "the margin")
            if isinstance(margin, bool) or not isinstance(margin, (int, float)):
                raise DataError(f"{where}: {cfg.margin_key!r} (--margin_key) must be a number, got {margin!r}")
            out["margin"] = float(margin)
        if images:
            out["images"] = refs
        return out


class KTODataset(_EagerDataset):
    """Unpaired KTO data. Item: ``{"input_ids", "loss_mask", "desirable": bool}``.

    Prompt from ``input_key``, completion (a string) from ``output_key``, the flag from
    ``desirable_key``: a bool or the integers 0 / 1; anything else is a bad row.
    """

    def __init__(self, rows: Sequence[dict], tokenizer, cfg: DataConfig) -> None:
        super().__init__(rows, tokenizer, cfg)
        n_good = sum(item["desirable"] for item in self.items)
        if n_good in (0, len(self.items)):
            logger.warning(
                "KTODataset: all %d kept rows are %s; KTO weighs desirable against undesirable examples, "
                "check --desirable_key",
                len(self.items),
                "desirable" if n_good else "undesirable",
            )

    def _check_config(self) -> None:
        if self.cfg.output_key is None:
            raise ValueError("KTODataset needs --output_key: the column that holds each completion")
        if self.cfg.image_key is not None:
            raise ValueError(
                f"--image_key {self.cfg.image_key!r}: KTO with images is not built (rl sft, rl dpo and rl ppo "
                f"take images); drop --image_key"
            )

    def _encode(self, row: dict, where: str) -> dict:
        cfg = self.cfg
        prompt = _get(row, cfg.input_key, "input_key", where, "the prompt")
        if cfg.output_key is None:  # not reached: _check_config refuses it
            raise ValueError("KTODataset needs --output_key: the column that holds each completion")
        completion = _get(row, cfg.output_key, "output_key", where, "the completion")
        if not isinstance(completion, str):
            raise DataError(
                f"{where}: {cfg.output_key!r} (--output_key) must be a string (the completion), "
                f"got {type(completion).__name__}"
            )
        flag = _get(row, cfg.desirable_key, "desirable_key", where, "the desirable flag")
        if not (isinstance(flag, bool) or (type(flag) is int and flag in (0, 1))):
            raise DataError(f"{where}: {cfg.desirable_key!r} (--desirable_key) must be true/false or 0/1, got {flag!r}")
        enc = encode_completion(
            self.tokenizer,
            cfg,
            prompt,
            completion,
            where,
            f"{cfg.input_key!r} (--input_key)",
            f"{cfg.output_key!r} (--output_key)",
        )
        input_ids, loss_mask = self._fit(enc)
        return {"input_ids": input_ids, "loss_mask": loss_mask, "desirable": bool(flag)}
