"""Writes that survive a crash: a file holds the new text or the old, never a part (:func:`atomic_write_text`),
and a folder's renames and files reach the disk (:func:`fsync_dir`, :func:`fsync_tree`). Checkpoints commit
through these."""

from __future__ import annotations

import os
from pathlib import Path


def fsync_dir(path: Path) -> None:
    """Make a rename or a new entry in ``path`` durable (a no-op where directories cannot be opened)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def fsync_tree(path: Path) -> None:
    """fsync every file and folder under ``path``: what this process wrote there reaches the disk."""
    for d, _, files in os.walk(path):
        for name in files:
            fd = os.open(os.path.join(d, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fsync_dir(Path(d))


def atomic_write_text(path: Path, text: str) -> None:
    """``path`` holds ``text`` or what it held before, never a part: temp file, fsync, ``os.replace``,
    fsync of the folder."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)
