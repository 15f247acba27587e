"""Model arguments as OpenRLHF users pass them: a local folder, or a hub id found in the local cache.

:func:`resolve_model` turns ``--pretrain Qwen/Qwen2.5-7B-Instruct`` into the snapshot
folder that ``huggingface-cli download`` / ``hf download`` left in the Hugging Face
cache (``HF_HUB_CACHE``, else ``HF_HOME/hub``, else ``~/.cache/huggingface/hub``:
``models--Qwen--Qwen2.5-7B-Instruct/snapshots/<sha>/``, the one ``refs/main`` names).
It never touches the network (``local_files_only``), so it behaves the same with
``HF_HUB_OFFLINE=1`` and without. A value that is neither an existing folder nor a
cached id fails with one line naming the value, the flag and the cache searched.
:func:`resolve_models` applies it to every model field of a config (``pretrain``,
``ref_pretrain``, ``critic_pretrain``, ``reward_pretrain``), which is what every
command does before it loads anything.

Leaves out: downloading (this stack never fetches weights at run time) and
revisions other than ``main`` (``org/name@<rev>`` is not parsed).
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

from huggingface_hub import snapshot_download
from huggingface_hub.errors import LocalEntryNotFoundError
from huggingface_hub.utils import HFValidationError, validate_repo_id

MODEL_FIELDS = ("pretrain", "ref_pretrain", "critic_pretrain", "reward_pretrain")


class ModelNotFoundError(FileNotFoundError):
    """A model argument that is neither a local folder nor a hub id in the local cache."""


def hub_cache_dir() -> Path:
    """The cache huggingface_hub reads now (env read at call time, not at import)."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    if os.environ.get("HUGGINGFACE_HUB_CACHE"):  # the older name, still honoured by huggingface_hub
        return Path(os.environ["HUGGINGFACE_HUB_CACHE"]).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hub"
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "huggingface" / "hub"


def _is_repo_id(value: str) -> bool:
    if value.startswith((".", "/", "~")) or value.count("/") > 1:
        return False
    try:
        validate_repo_id(value)
    except HFValidationError:
        return False
    return True


def resolve_model(path_or_id: str, *, flag: str = "--pretrain") -> str:
    """A local folder for ``path_or_id``: the folder itself, or the cached snapshot of a hub id.

    ``flag`` names the argument in the error. Raises :class:`ModelNotFoundError` (one line).
    """
    value = str(path_or_id)
    if Path(value).expanduser().is_dir():
        return value
    cache = hub_cache_dir()
    if not _is_repo_id(value):
        raise ModelNotFoundError(
            f"{flag} {value}: no such folder (and not a hub id like org/name to look up in "
            f"the Hugging Face cache {cache})"
        )
    try:
        return snapshot_download(value, cache_dir=str(cache), local_files_only=True)
    except (LocalEntryNotFoundError, FileNotFoundError, OSError):
        raise ModelNotFoundError(
            f"{flag} {value}: not a local folder, and model {value} is not in the Hugging Face cache {cache} "
            f"(HF_HUB_CACHE / HF_HOME); this stack never downloads: fetch it first (hf download {value}) "
            f"or pass a local folder"
        ) from None


def resolve_models(cfg):
    """``cfg`` (a dataclass) with each set model field (:data:`MODEL_FIELDS`) replaced by its local folder."""
    changes = {}
    for name in MODEL_FIELDS:
        value = getattr(cfg, name, None)
        if value:
            changes[name] = resolve_model(value, flag=f"--{name}")
    return dataclasses.replace(cfg, **changes) if changes else cfg
