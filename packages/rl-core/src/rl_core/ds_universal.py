"""DeepSpeed universal checkpoints (``--use_ds_universal_ckpt``): a checkpoint's ZeRO state (``ds/``) converted
once by DeepSpeed's ``ds_to_universal`` into ``ds_universal/`` beside it, so any number of ranks can resume
it (:func:`to_universal`, collective)."""

from __future__ import annotations

import datetime
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import torch.distributed as dist

from rl_core.durable_io import fsync_dir, fsync_tree

logger = logging.getLogger(__name__)
DS_TAG = "ds"
UNIVERSAL_TAG = "ds_universal"  # DS_TAG converted for --use_ds_universal_ckpt (to_universal)
# how long the other ranks wait for rank 0's universal conversion (a large model's takes longer than the
# collectives' timeout); seconds, RL_UNIVERSAL_CONVERT_TIMEOUT_S overrides
UNIVERSAL_CONVERT_TIMEOUT_S = 6 * 3600.0


def to_universal(path: Path) -> Path:
    """Collective (every rank of the engine's group): ``path/ds`` converted by DeepSpeed's ``ds_to_universal``
    into ``path/ds_universal`` (tag :data:`UNIVERSAL_TAG`) by the group's rank 0, once: a temp folder renamed
    when whole, kept for later resumes. ``inject_missing_state``: our checkpoints carry no Megatron
    ``universal_checkpoint_info``, which the converter would otherwise require. Returns ``path``.

    A failed conversion raises on every rank with rank 0's reason (the others would otherwise wait in a
    collective until its timeout). The others wait in a gloo group of their own whose timeout fits a
    conversion (:data:`UNIVERSAL_CONVERT_TIMEOUT_S`, ``RL_UNIVERSAL_CONVERT_TIMEOUT_S``): the run's collective
    timeout (DeepSpeed's default 30 minutes, less when set) can be shorter than converting a large model."""

    final = path / UNIVERSAL_TAG
    group = None
    if dist.is_initialized() and dist.get_world_size() > 1:  # made by every rank before rank 0 starts converting
        timeout = float(os.environ.get("RL_UNIVERSAL_CONVERT_TIMEOUT_S", UNIVERSAL_CONVERT_TIMEOUT_S))
        group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout))
    error = None
    if (not dist.is_initialized() or dist.get_rank() == 0) and not final.is_dir():
        try:
            _convert_to_universal(path, final)
        except Exception as e:  # noqa: BLE001 (told to every rank below, then raised)
            error = e
    if group is not None:
        said = [
            None
            if error is None
            else str(error)
            if isinstance(error, RuntimeError)
            else f"{type(error).__name__}: {error}"
        ]
        try:
            dist.broadcast_object_list(said, src=0, group=group)
        finally:
            dist.destroy_process_group(group)
        if error is None and said[0] is not None:  # rank 0's reason, here
            raise RuntimeError(f"rank 0: {said[0]}")
    if error is not None:
        raise error
    return path


def _convert_to_universal(path: Path, final: Path) -> None:
    tmp = path / f".tmp-{UNIVERSAL_TAG}"
    shutil.rmtree(tmp, ignore_errors=True)
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "deepspeed.checkpoint.ds_to_universal",
            "--input_folder",  # ds_to_universal's own options, as are the next two
            str(path / DS_TAG),
            "--output_folder",  # ds_to_universal's
            str(tmp),
            "--inject_missing_state",  # ds_to_universal's
        ],
        capture_output=True,
        text=True,
    )
    if out.returncode != 0:
        raise RuntimeError(
            f"DeepSpeed's ds_to_universal could not convert {path / DS_TAG} "
            f"(--use_ds_universal_ckpt): {out.stderr.strip().splitlines()[-1:]}; resume on the "
            f"number of ranks that saved it without the flag"
        )
    fsync_tree(tmp)
    tmp.rename(final)
    fsync_dir(path)
    logger.info("converted %s to DeepSpeed's universal checkpoint %s", path / DS_TAG, final)
