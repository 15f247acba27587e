"""A checkpoint's manifest: every file's size and sha256, written into its commit marker and checked before
anything is loaded from it.

A commit marker says a save finished; it cannot say the files stayed whole afterwards (a disk that filled or
failed, a copy cut short, a file deleted by hand). :func:`manifest` records, when the save commits, each file
under the checkpoint folder (relative path -> ``[bytes, sha256]``); :func:`verify` reads them back and names the
first file that is missing, of another size or of other contents, without loading a model. Resume
(:meth:`rl_core.rl.checkpoint.RLCheckpoints.usable`, :meth:`rl_core.checkpoint.CheckpointManager.usable`)
takes the newest checkpoint that verifies and says, in one line each, what was wrong with the newer ones it
skipped.

Hashing reads every byte once (about 1 GB/s per core; files are hashed on up to 8 threads, which hashlib runs
in parallel): a few seconds per save of a 0.5B model's weights and optimizer state, written just before and
still in the page cache. Results are remembered per folder and marker (size and mtime), so a process that
verifies before loading any model (``rl ppo``) and again at resume reads the files once.
"""

from __future__ import annotations

import hashlib
import logging
import os
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from rl_core.preflight import InputError

_CHUNK = 1 << 24
_checked: dict[tuple[str, int, int], str | None] = {}  # (folder, marker size, marker mtime_ns) -> verdict


def _sha256(path: Path) -> str:
    with path.open("rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _files(folder: Path, skip: frozenset[str]) -> list[Path]:
    return sorted(p for p in folder.rglob("*") if p.is_file() and p.relative_to(folder).as_posix() not in skip)


def manifest(folder: str | Path, skip: tuple[str, ...] = ()) -> dict[str, list]:
    """``{relative path: [bytes, sha256 hex]}`` of every file under ``folder`` except ``skip`` (the marker)."""
    folder = Path(folder)
    files = _files(folder, frozenset(skip))
    with ThreadPoolExecutor(max_workers=max(1, min(8, len(files), os.cpu_count() or 1))) as pool:
        digests = list(pool.map(_sha256, files))
    return {p.relative_to(folder).as_posix(): [p.stat().st_size, d] for p, d in zip(files, digests, strict=True)}


def verify(folder: str | Path, files: dict[str, list], marker: str | Path | None = None) -> str | None:
    """None when every file of ``files`` (:func:`manifest`) is in ``folder`` with its size and sha256; else what
    is wrong, as a phrase ("policy/ds/mp_rank_00_model_states.pt is 1,024 bytes, 4,096 when saved").
    ``marker``: the file holding ``files``; the verdict is remembered while it is unchanged."""
    folder = Path(folder)
    key = None
    if marker is not None:
        st = Path(marker).stat()
        key = (str(folder.resolve()), st.st_size, st.st_mtime_ns)
        if key in _checked:
            return _checked[key]
    verdict = _verify(folder, files)
    if key is not None:
        _checked[key] = verdict
    return verdict


def _verify(folder: Path, files: dict[str, list]) -> str | None:
    if not isinstance(files, dict):
        return f"its manifest is not a mapping of files ({type(files).__name__})"
    for rel, entry in sorted(files.items()):
        size = entry[0] if isinstance(entry, list) and entry else None
        p = folder / rel
        if not p.is_file():
            return f"{rel} is missing"
        if p.stat().st_size != size:
            return (
                f"{rel} is {p.stat().st_size:,} bytes, {size:,} when saved"
                if isinstance(size, int)
                else f"{rel} has a malformed manifest entry {entry!r}"
            )
    paths = [folder / rel for rel in sorted(files)]
    with ThreadPoolExecutor(max_workers=max(1, min(8, len(paths), os.cpu_count() or 1))) as pool:
        digests = list(pool.map(_sha256, paths))
    for (rel, entry), digest in zip(sorted(files.items()), digests, strict=True):
        saved = entry[1] if len(entry) > 1 else None
        if digest != saved:
            return f"{rel} has other contents than when saved (sha256 {digest[:12]}, saved {str(saved)[:12]})"
    return None


def newest_usable(
    folders: Sequence[Path], problem: Callable[[Path], str | None], root: Path, log: logging.Logger
) -> Path | None:
    """The newest of ``folders`` (committed checkpoints, oldest first) for which ``problem`` says nothing; each
    newer one skipped is named in a warning with what is wrong. None when there are none; an InputError (one
    line, every skipped folder and its problem) when there are some and none is usable."""
    skipped = []
    for d in reversed(folders):
        wrong = problem(d)
        if wrong is None:
            return d
        log.warning("checkpoint %s cannot be resumed: %s; falling back to the previous one", d, wrong)
        skipped.append(f"{d.name}: {wrong}")
    if skipped:
        raise InputError(
            f"no checkpoint under {root} can be resumed ({'; '.join(skipped)}): move the damaged "
            f"folders away to start over, or point --ckpt_path at a new folder"
        )
    return None
