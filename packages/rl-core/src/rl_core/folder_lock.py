"""A run owns the folders it writes: an exclusive lock per folder (its run_dir, ckpt_path, save_path) for the
run's whole life, so a second run given the same folder is refused at once, in one line naming the holder,
instead of interleaving its metrics and checkpoints with the first's (or deleting a checkpoint it is writing).

The lock is ``flock`` on ``FOLDER/.rl.lock`` (its text: the holder's host, pid and start time). The kernel
releases it when the holder's process ends, however it ends, so a lock whose process is gone is taken over,
with a warning naming the previous holder. ``flock`` is local to a machine: runs on two hosts sharing a network
folder are not kept apart by it (NFS maps it to byte-range locks only on some mounts).

Within one process a folder's lock is counted (:func:`hold` again on a held folder shares it), so rl-cli can take
the locks before any model loads and the trainer take them again where a Python caller starts it.
"""

from __future__ import annotations

import contextlib
import datetime
import fcntl
import logging
import os
import socket
from pathlib import Path

logger = logging.getLogger(__name__)

LOCK_NAME = ".rl.lock"


class FolderInUse(ValueError):
    """Another live process holds the folder's lock (the message names it and the fix)."""


class _Lock:
    def __init__(self, folder: Path, flag: str):
        self.folder, self.flag, self.count, self.fd = folder, flag, 0, -1
        self.created = False  # the folder did not exist: a run that wrote nothing into it leaves none behind

    def acquire(self) -> None:
        self.created = not self.folder.exists()
        self.folder.mkdir(parents=True, exist_ok=True)
        path = self.folder / LOCK_NAME
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 512, 0).decode(errors="replace").strip() or "a process that wrote no details"
            os.close(fd)
            raise FolderInUse(f"{self.flag} {self.folder} is in use by another run ({holder}): wait for it to end, "
                              f"stop it, or give this run another {self.flag}") from None
        previous = os.pread(fd, 512, 0).decode(errors="replace").strip()
        if previous:
            logger.warning("%s %s: taking over the lock of a run whose process is gone (%s)", self.flag, self.folder,
                           previous)
        since = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"host {socket.gethostname()}, pid {os.getpid()}, since {since}\n".encode(), 0)
        self.fd = fd

    def release(self) -> None:
        if self.fd < 0:
            return
        with contextlib.suppress(OSError):
            os.ftruncate(self.fd, 0)  # an ended run leaves no holder behind (a killed one does: taken over later)
        os.close(self.fd)  # closing the descriptor releases the flock
        self.fd = -1
        if self.created and [p.name for p in self.folder.iterdir()] == [LOCK_NAME]:
            with contextlib.suppress(OSError):  # a run stopped before it wrote anything leaves no folder
                (self.folder / LOCK_NAME).unlink()
                self.folder.rmdir()


_HELD: dict[Path, _Lock] = {}


class FolderLocks:
    """The locks one :func:`hold` took; :meth:`release` (or leaving its ``with``) gives them back."""

    def __init__(self, locks: list[_Lock]):
        self._locks = locks

    def release(self) -> None:
        locks, self._locks = self._locks, []
        for lock in locks:
            lock.count -= 1
            if lock.count == 0:
                lock.release()
                _HELD.pop(lock.folder, None)

    def __enter__(self) -> FolderLocks:
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    def __del__(self) -> None:
        self.release()


def hold(folders: dict[str, str | None]) -> FolderLocks:
    """Lock each folder (``{"--ckpt_path": "ck", "--run_dir": None}``: the flag that named it, the folder; None is
    skipped; one folder given twice is locked once); FolderInUse when another live process holds one (the locks
    taken so far are given back)."""
    taken: list[_Lock] = []
    seen: set[Path] = set()
    try:
        for flag, folder in folders.items():
            if not folder:
                continue
            path = Path(folder).resolve()
            if path in seen:
                continue
            seen.add(path)
            lock = _HELD.get(path)
            if lock is None:
                lock = _Lock(path, flag)
                lock.acquire()
                _HELD[path] = lock
            lock.count += 1
            taken.append(lock)
    except BaseException:
        FolderLocks(taken).release()
        raise
    return FolderLocks(taken)
