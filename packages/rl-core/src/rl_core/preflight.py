"""Checks of a run's inputs that need no model in memory: run them before anything heavy.

- :func:`check_model`: a model argument (a folder, or a hub id in the local cache, resolved by
  :func:`rl_core.hub.resolve_model`) is a transformers model folder: a readable ``config.json`` with a
  ``model_type`` and weight files (safetensors or PyTorch ``.bin``, whole or sharded).
  :func:`check_models` does it for every model field of a config.
- :func:`load_tokenizer`: the model's tokenizer, or one line saying why it does not load (a folder
  without tokenizer files otherwise fails deep in transformers with "You need to have sentencepiece
  or tiktoken installed").
- :func:`check_rl_batches` / :func:`check_rl_arithmetic`: the RL loop's batch arithmetic against the prompt count
  and the ranks of each role (the one place of those rules: rl-cli runs it before any model loads, the loop
  again when it starts).

Each failure is a :class:`InputError` (a ValueError) whose message names the flag, the value and the
fix, in one line: the CLI prints it as such, without a traceback.

Leaves out: whether the weights match the config (that needs loading them).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from rl_core.hub import MODEL_FIELDS, resolve_model

WEIGHT_PATTERNS = ("*.safetensors", "*.safetensors.index.json", "pytorch_model*.bin", "pytorch_model.bin.index.json")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt")


class InputError(ValueError):
    """A user's input that cannot work; the message (one line) names the value and the fix."""


def _listing(folder: Path, n: int = 8) -> str:
    names = sorted(p.name for p in folder.iterdir())
    return ", ".join(names[:n]) + (f" ... ({len(names)} entries)" if len(names) > n else "") if names else "nothing"


def check_model(path_or_id: str, *, flag: str = "--pretrain") -> str:
    """The local folder of ``path_or_id`` once it is known to hold a transformers model; InputError otherwise.

    Raises :class:`rl_core.hub.ModelNotFoundError` for a value that is neither a folder nor a cached hub id."""
    folder = Path(resolve_model(path_or_id, flag=flag)).expanduser()
    shown = f"{flag} {path_or_id}" + ("" if str(path_or_id) == str(folder) else f" ({folder})")
    config = folder / "config.json"
    if not config.is_file():
        raise InputError(
            f"{shown} is not a transformers model folder: no config.json (it holds {_listing(folder)}); "
            f"pass the folder save_pretrained wrote (config.json, weights, tokenizer)"
        )
    try:
        model_type = json.loads(config.read_text()).get("model_type")
    except (ValueError, OSError, AttributeError) as e:
        raise InputError(
            f"{shown}: config.json is not a readable JSON object ({type(e).__name__}: {e}); "
            f"re-export the model with save_pretrained"
        ) from None
    if not model_type:
        raise InputError(
            f"{shown}: config.json has no model_type, so transformers cannot tell which model it is; "
            f"re-export the model with save_pretrained"
        )
    if not any(next(folder.glob(pattern), None) for pattern in WEIGHT_PATTERNS):
        raise InputError(
            f"{shown} has a config.json but no weights (*.safetensors or pytorch_model*.bin; it holds "
            f"{_listing(folder)}); copy the weight files there or pass the folder that has them"
        )
    return str(folder) if str(path_or_id) != str(folder) else str(path_or_id)


def check_models(cfg):
    """``cfg`` (a dataclass) with each set model field (:data:`rl_core.hub.MODEL_FIELDS`) checked and resolved."""
    changes = {
        name: check_model(getattr(cfg, name), flag=f"--{name}") for name in MODEL_FIELDS if getattr(cfg, name, None)
    }
    return dataclasses.replace(cfg, **changes) if changes else cfg


def check_reward_head(folder: str, *, value_head_prefix: str | None = None, flag: str = "--reward_pretrain") -> None:
    """A reward model folder holds a score head: rl rm's (``rl_head.json`` + ``rl_head.safetensors``) or
    OpenRLHF's (``<value_head_prefix>.weight`` in its weights, the prefix from the flag, its config.json, else
    ``score``); InputError otherwise, before any model loads (the reward model's loader would refuse it inside its
    worker: under Ray, a traceback from an actor). Reads file headers and at most one tensor."""
    # lazy: the head's reader opens safetensors (torch); --help never reaches it
    from rl_core.model_loading import HEAD_FILE, HEAD_META, _openrlhf_head

    path = Path(folder)
    if (path / HEAD_META).is_file() and (path / HEAD_FILE).is_file():
        return
    config = json.loads((path / "config.json").read_text()) if (path / "config.json").is_file() else {}
    prefix = value_head_prefix or config.get("value_head_prefix") or "score"
    if _openrlhf_head(path, prefix) is None:
        raise InputError(
            f"{flag} {folder} holds no reward head: no {HEAD_META} (rl rm's) and no {prefix}.weight in its weights "
            f"(OpenRLHF's); it is not a trained reward model. Train one with rl rm, give --value_head_prefix if its "
            f"head has another name, or score with --reward_fn / --remote_rm_url"
        )


def load_tokenizer(folder: str, *, flag: str = "--pretrain", use_fast: bool = True, chat_template: str | None = None):
    """``AutoTokenizer.from_pretrained(folder, use_fast=use_fast)`` with a pad token (eos when it has none), or
    one-line InputError. ``use_fast=False`` is OpenRLHF's ``--disable_fast_tokenizer``; transformers 5 ignores it.
    ``chat_template`` (``--tokenizer_chat_template``) replaces the tokenizer's, checked by rendering one user
    message."""
    from transformers import AutoTokenizer

    path = Path(folder)
    if path.is_dir() and not any((path / f).is_file() for f in TOKENIZER_FILES):
        raise InputError(
            f"{flag} {folder} has no tokenizer (none of {', '.join(TOKENIZER_FILES)}); copy the "
            f"tokenizer files of the model it was trained from into it (tokenizer.save_pretrained)"
        )
    try:
        tok = AutoTokenizer.from_pretrained(folder, use_fast=use_fast)
    except (OSError, ValueError, ImportError, KeyError, TypeError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise InputError(
            f"{flag} {folder}: its tokenizer does not load ({type(e).__name__}: {first}); save the "
            f"model's tokenizer there with tokenizer.save_pretrained"
        ) from e
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    if chat_template is not None:
        tok.chat_template = chat_template
        try:
            tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
        except Exception as e:  # jinja's syntax and undefined-name errors, the template's own raise_exception
            first = str(e).strip().splitlines()[0] if str(e).strip() else ""
            raise InputError(
                f"--tokenizer_chat_template does not render a user message ({type(e).__name__}: "
                f"{first}); fix the Jinja template or drop the flag"
            ) from None
    return tok


def load_processor(folder: str, *, flag: str = "--pretrain"):
    """A vision-language model's ``AutoProcessor`` (tokenizer, image processor, chat template), or one-line
    InputError (``--image_key`` needs it)."""
    from transformers import AutoProcessor

    try:
        proc = AutoProcessor.from_pretrained(folder)
    except (OSError, ValueError, ImportError, KeyError, TypeError, AttributeError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise InputError(
            f"{flag} {folder}: its processor does not load ({type(e).__name__}: {first}); --image_key "
            f"needs a vision-language model saved with its processor (processor.save_pretrained; "
            f"Qwen-VL processors also need torchvision installed)"
        ) from e
    if getattr(proc, "image_processor", None) is None:
        raise InputError(
            f"{flag} {folder} has no image processor ({type(proc).__name__}): --image_key needs a "
            f"vision-language model; leave --image_key unset for text-only prompts"
        )
    return proc


def check_rl_batches(ppo, strategy, num_prompts: int | None = None, world_sizes: dict[str, int] | None = None) -> None:
    """The PPO loop's batch arithmetic (``ppo``: a PPOConfig, ``strategy``: a StrategyConfig) for
    ``num_prompts`` prompts (None: not known yet) and the ranks of each role (``{"policy": 2, "critic": 1}``);
    InputError with the flag to change. :func:`check_rl_arithmetic` with the strategy's numbers."""
    check_rl_arithmetic(
        ppo,
        strategy.train_batch_size,
        micro=strategy.micro_train_batch_size,
        ring=strategy.ring_attn_size,
        num_prompts=num_prompts,
        world_sizes=world_sizes,
    )


def check_rl_arithmetic(
    ppo,
    train_batch_size: int,
    *,
    micro: int | None = None,
    ring: int = 1,
    num_prompts: int | None = None,
    world_sizes: dict[str, int] | None = None,
) -> None:
    """The one place of the RL loop's batch rules, run by rl-cli before any model loads (``--print_config``
    too) and by the loop when it starts (a Python caller's first check): the samples of an iteration fill
    whole global batches, there are enough prompts, each role's ranks split into ring groups and divide the
    samples and the global batch, and a trained role's micro-batches fill its share of a global batch."""
    samples = ppo.rollout_batch_size * ppo.sampling.n_samples_per_prompt
    g = train_batch_size
    if samples % g:
        fit = [t for t in range(g, 0, -1) if samples % t == 0][0]
        raise InputError(
            f"--rollout_batch_size {ppo.rollout_batch_size} x --n_samples_per_prompt "
            f"{ppo.sampling.n_samples_per_prompt} = {samples} samples per iteration is not a multiple of "
            f"--train_batch_size {g}; use --train_batch_size {fit} (or {samples}), or change the "
            f"rollout batch"
        )
    if num_prompts is not None and num_prompts < ppo.rollout_batch_size:
        raise InputError(
            f"the prompt set has {num_prompts} prompts, fewer than --rollout_batch_size "
            f"{ppo.rollout_batch_size}; lower it to at most {num_prompts} or add prompts"
        )
    for role, ranks in (world_sizes or {}).items():
        if ranks < 1:
            continue
        if ranks % ring:
            raise InputError(
                f"{role}: --ring_attn_size {ring} must divide its {ranks} ranks (each ring group of "
                f"{ring} ranks holds one data-parallel slice); give {role} a multiple of {ring} ranks "
                f"(--*_num_gpus_per_node) or a ring size that divides {ranks}"
            )
        world = ranks // ring  # data-parallel ranks
        if samples % world or g % world:
            raise InputError(
                f"{role}: {world} ranks do not divide the {samples} samples per iteration and "
                f"--train_batch_size {g}; use a rank count that divides both"
            )
        if micro is not None and role in ("policy", "critic") and g % (micro * world):
            raise InputError(
                f"--train_batch_size {g} is not a multiple of --micro_train_batch_size {micro} x "
                f"{world} {role} rank(s) = {micro * world}; use --micro_train_batch_size "
                f"{max(d for d in range(1, g // world + 1) if (g // world) % d == 0 and d <= micro)} "
                f"or a --train_batch_size that is a multiple of {micro * world}"
            )


_SPECIAL = ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id")


def _describe(tok, folder: str) -> str:
    return f"{folder} ({type(tok).__name__}, {len(tok)} tokens)"


def check_teacher_tokenizer(
    student_folder: str,
    teacher_folder: str,
    *,
    use: str = "on-policy distillation scores the policy's sampled token ids with the teacher",
) -> None:
    """Refuse a teacher (``--teacher_pretrain``: ``rl ppo``'s on-policy distillation, ``rl sft``'s knowledge
    distillation) whose tokenizer maps tokens to other ids than the student's, naming both tokenizers and the
    first difference; ``use`` says why they must agree. Reads the two tokenizers only, before any model loads."""
    student = load_tokenizer(student_folder)
    teacher = load_tokenizer(teacher_folder, flag="--teacher_pretrain")
    sv, tv = student.get_vocab(), teacher.get_vocab()
    problem = None
    if sv != tv:
        only_s = sorted(set(sv) - set(tv))[:3]
        only_t = sorted(set(tv) - set(sv))[:3]
        moved = sorted(k for k in set(sv) & set(tv) if sv[k] != tv[k])[:3]
        parts = []
        if only_s:
            parts.append(f"tokens only the student has: {only_s}")
        if only_t:
            parts.append(f"tokens only the teacher has: {only_t}")
        if moved:
            parts.append(f"tokens with other ids: {[(k, sv[k], tv[k]) for k in moved]}")
        problem = "; ".join(parts)
    else:
        diff = [n for n in _SPECIAL if n != "pad_token_id" and getattr(student, n) != getattr(teacher, n)]
        if diff:
            problem = ", ".join(f"{n} {getattr(student, n)} vs {getattr(teacher, n)}" for n in diff)
    if problem:
        raise InputError(
            f"--teacher_pretrain: the teacher's tokenizer {_describe(teacher, teacher_folder)} differs from the "
            f"student's (--pretrain) {_describe(student, student_folder)} ({problem}); {use}, so both must share "
            f"one tokenizer: pick a teacher of the same model family"
        )
