"""The typed data config: which file, which columns, how prompts are rendered, length limits.

Field names follow OpenRLHF's flags (``--input_key``, ``--apply_chat_template``,
``--max_len`` ...) so its users' command lines carry over. This is the one source of
data defaults; the CLI and YAML only override it. Values are checked once, here, so a
bad flag fails at start-up with the fix rather than mid-epoch. What a column must
*contain* is checked per row by :mod:`rl_core.data.datasets`; reading files is
:mod:`rl_core.data.loading`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from rl_rollout.config_fields import meta


@dataclass
class DataConfig:
    """Where the data is and how rows become token sequences.

    ``dataset``: a .jsonl / .json / .parquet file, a ``save_to_disk`` folder, or a
    comma-separated list of files (concatenated). ``input_key`` holds the prompt (a
    string, or a list of ``{"role", "content"}`` messages with ``apply_chat_template``);
    ``output_key`` the response (SFT single-turn, KTO); ``label_key`` the answer handed to
    reward functions (prompt datasets); ``chosen_key`` / ``rejected_key`` / ``prompt_key`` /
    ``margin_key`` the preference columns; ``desirable_key`` KTO's bool column.
    ``input_template`` is a ``str.format`` pattern with one ``{}`` used when no chat
    template is applied. ``max_len`` bounds every tokenized sequence (prompts for
    prompt datasets). ``skip_bad_rows`` counts and skips malformed rows instead of
    failing. ``packing`` asks trainers to use :func:`rl_core.data.collate.pack_collate`.

    ``eval_dataset`` (OpenRLHF's ``--eval_dataset``): an evaluation set in the same formats,
    read with the same keys and limits, from split ``eval_split`` (``train`` by default, as
    OpenRLHF: a separate eval file usually holds one split), at most ``max_eval_samples`` rows.
    """

    dataset: str | None = field(default=None, metadata=meta("jsonl / json / parquet file or a datasets folder"))
    split: str = field(default="train", metadata=meta("split to read"))
    input_key: str = field(default="input", metadata=meta("column of the prompt (or the text)"))
    output_key: str | None = field(default=None, metadata=meta("SFT: column of the response"))
    label_key: str | None = field(default=None, metadata=meta("RL: column of the label handed to the reward function"))
    chosen_key: str = field(default="chosen", metadata=meta("preference data: column of the preferred response"))
    rejected_key: str = field(default="rejected", metadata=meta("preference data: column of the rejected response"))
    prompt_key: str | None = field(default=None, metadata=meta("preference data: column of a shared prompt"))
    margin_key: str | None = field(default=None, metadata=meta("preference data: column of a margin"))
    desirable_key: str = field(default="label", metadata=meta("KTO: bool column, desirable or not"))
    apply_chat_template: bool = field(default=False, metadata=meta("apply the tokenizer's chat template to the prompt"))
    tokenizer_chat_template: str | None = field(
        default=None,
        metadata=meta(
            "with --apply_chat_template, a Jinja chat template that replaces the tokenizer's for the run: the rows "
            "are rendered with it and the saved tokenizer keeps it (OpenRLHF sets tokenizer.chat_template the same "
            "way)"
        ),
    )
    input_template: str | None = field(
        default=None, metadata=meta("str.format pattern with one {} used without a chat template")
    )
    max_len: int = field(default=2048, metadata=meta("token limit of every sequence (prompts for RL)"))
    max_samples: int | None = field(default=None, metadata=meta("read at most this many rows"))
    skip_bad_rows: bool = field(default=False, metadata=meta("count and skip malformed rows instead of failing"))
    packing: bool | None = field(
        default=None,
        metadata=meta(
            "pack several samples per row (no padding); unset (auto): rl ppo packs where the packed attention runs "
            "without a dense mask (CUDA, rl_core.rl.auto), the offline trainers pad"
        ),
    )
    eval_dataset: str | None = field(default=None, metadata=meta("an evaluation set in the same formats and keys"))
    eval_split: str = field(default="train", metadata=meta("split of --eval_dataset"))
    max_eval_samples: int | None = field(default=None, metadata=meta("read at most this many eval rows"))
    dataset_probs: str | None = field(
        default=None,
        metadata=meta(
            "mix the comma-separated --dataset files by these probabilities, one per file, summing to 1 (e.g. "
            "0.7,0.3): OpenRLHF's blending_datasets, seeded by --seed (rl_core.data.blending)",
            openrlhf=("prompt_data_probs", "data.prompt_probs"),
        ),
    )
    image_key: str | None = field(
        default=None,
        metadata=meta(
            "rows of a vision-language model (rl ppo prompts, rl sft and rl dpo rows): column of each prompt's "
            "images (a local path, bytes or a PIL image, or a list of them; none: a text-only row); the prompt "
            "marks where they go with {'type': 'image'} content parts (or <image> in a string) under "
            "--apply_chat_template"
        ),
    )
    max_images_per_prompt: int = field(
        default=1,
        metadata=meta(
            "with --image_key: the most images one dataset row may have (a row with more stops the run, naming it); "
            "an agent's observation images are not counted"
        ),
    )
    disable_fast_tokenizer: bool = field(
        default=False,
        metadata=meta(
            "load the tokenizer with AutoTokenizer(use_fast=False), as OpenRLHF does; transformers 5 (which both pin) "
            "ignores use_fast and always loads the tokenizers backend"
        ),
    )

    def __post_init__(self) -> None:
        if self.dataset is not None and (not isinstance(self.dataset, str) or not self.dataset.strip()):
            raise ValueError(f"dataset (--dataset) must be a non-empty path, got {self.dataset!r}")
        if not isinstance(self.split, str) or not self.split:
            raise ValueError(f"split (--split) must be a non-empty name such as 'train', got {self.split!r}")
        if self.eval_dataset is not None and (not isinstance(self.eval_dataset, str) or not self.eval_dataset.strip()):
            raise ValueError(
                f"eval_dataset (--eval_dataset) must be a non-empty path or unset, got {self.eval_dataset!r}"
            )
        if not isinstance(self.eval_split, str) or not self.eval_split:
            raise ValueError(
                f"eval_split (--eval_split) must be a non-empty name such as 'test', got {self.eval_split!r}"
            )
        for name in ("input_key", "chosen_key", "rejected_key", "desirable_key"):
            _check_key(name, getattr(self, name), optional=False)
        for name in ("output_key", "label_key", "prompt_key", "margin_key", "image_key"):
            _check_key(name, getattr(self, name), optional=True)
        if self.chosen_key == self.rejected_key:
            raise ValueError(
                f"chosen_key and rejected_key are both {self.chosen_key!r}; "
                "set --chosen_key and --rejected_key to two different columns"
            )
        for name in ("apply_chat_template", "skip_bad_rows", "packing", "disable_fast_tokenizer"):
            if not isinstance(getattr(self, name), bool) and not (name == "packing" and self.packing is None):
                raise ValueError(f"{name} (--{name}) must be true or false, got {getattr(self, name)!r}")
        self._check_template()
        self._check_probs()
        if self.image_key is not None and self.packing:
            raise ValueError(
                "packing prompts with images is not built: drop --packing (OpenRLHF: --packing_samples) "
                "for vision-language prompts (--image_key); padded rows train the same"
            )
        m = self.max_images_per_prompt
        if isinstance(m, bool) or not isinstance(m, int) or m < 1:
            raise ValueError(
                f"max_images_per_prompt (--max_images_per_prompt) must be >= 1, got {m!r}; leave "
                f"--image_key unset for text-only prompts"
            )
        if isinstance(self.max_len, bool) or not isinstance(self.max_len, int) or self.max_len <= 0:
            raise ValueError(f"max_len (--max_len) must be a positive number of tokens, got {self.max_len!r}")
        for name in ("max_samples", "max_eval_samples"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v <= 0):
                raise ValueError(f"{name} (--{name}) must be a positive row count or unset (all rows), got {v!r}")

    def _check_template(self) -> None:
        chat = self.tokenizer_chat_template
        if chat is not None and (not isinstance(chat, str) or not chat.strip()):
            raise ValueError(
                f"tokenizer_chat_template (--tokenizer_chat_template) must be a Jinja template, got "
                f"{chat!r}; drop the flag to keep the tokenizer's own"
            )
        if chat is not None and not self.apply_chat_template:
            # OpenRLHF reads it only under --apply_chat_template; a flag that does nothing is a trap.
            raise ValueError(
                "tokenizer_chat_template (--tokenizer_chat_template) is used only with "
                "--apply_chat_template; add --apply_chat_template or drop the template"
            )
        tpl = self.input_template
        if tpl is None:
            return
        if not isinstance(tpl, str) or "{}" not in tpl:
            raise ValueError(
                f"input_template (--input_template) must contain '{{}}' where the prompt goes, got {tpl!r}; "
                "e.g. 'User: {}\\nAssistant: '"
            )
        try:
            tpl.format("x")
        except (IndexError, KeyError, ValueError) as e:
            raise ValueError(
                f"input_template {tpl!r} is not a valid str.format pattern with one '{{}}' ({e!r}); "
                "write literal braces as '{{' and '}}'"
            ) from None
        if self.apply_chat_template:
            # OpenRLHF silently ignores the template here; a flag that does nothing is a trap.
            raise ValueError(
                f"input_template {tpl!r} and apply_chat_template are both set, but the chat template replaces "
                "the input template; drop --input_template or --apply_chat_template"
            )

    @property
    def probabilities(self) -> tuple[float, ...] | None:
        """``dataset_probs`` as numbers (checked in ``__post_init__``); None: concatenate the files."""
        if self.dataset_probs is None:
            return None
        return tuple(float(p) for p in str(self.dataset_probs).split(","))

    def _check_probs(self) -> None:
        text = self.dataset_probs
        if text is None:
            return
        flag = f"dataset_probs {text!r} (--dataset_probs)"
        try:
            probs = self.probabilities
        except ValueError:
            raise ValueError(
                f"{flag} must be numbers separated by commas, one per --dataset file, e.g. 0.7,0.3"
            ) from None
        if probs is None:  # not reached: dataset_probs is set
            return
        if self.dataset is not None:
            files = [p for p in self.dataset.split(",") if p.strip()]
            if len(files) != len(probs):
                raise ValueError(
                    f"{flag} gives {len(probs)} probabilities for {len(files)} --dataset files "
                    f"({self.dataset!r}); give one per file, in the same order"
                )
        if not all(math.isfinite(p) and p > 0 for p in probs):
            raise ValueError(
                f"{flag}: every probability must be > 0 (a source never drawn is never exhausted, and "
                f"OpenRLHF's mixture only ends when all are); drop that file from --dataset instead"
            )
        if abs(sum(probs) - 1) > 1e-6:
            raise ValueError(
                f"{flag} sums to {sum(probs):g}; the probabilities must sum to 1 (numpy's draw in "
                f"OpenRLHF refuses others), e.g. {','.join(f'{p / sum(probs):.4g}' for p in probs)}"
            )


def _check_key(name: str, value: object, *, optional: bool) -> None:
    if value is None and optional:
        return
    if not isinstance(value, str) or not value:
        allowed = "a column name or unset" if optional else "a column name"
        raise ValueError(f"{name} (--{name}) must be {allowed}, got {value!r}")
