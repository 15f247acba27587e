"""A run owns the folders it writes: an exclusive lock per folder (its run_dir, ckpt_path, save_path) for the
run's whole life, so a second run given the same folder is refused at once, in one line naming the holder,
instead of interleaving its metrics and checkpoints with the first's (or deleting a checkpoint it is writing).

The lock is ``flock`` on ``FOLDER/.rl.lock`` (its text: the holder's host, pid and start time). A folder the run
replaces whole (``save_path``: the HF export is written beside it and renamed over it, which would take a lock
file inside it away) is locked beside it instead, on ``PARENT/.NAME.rl.lock``. The kernel
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


class FolderInsideReplaced(ValueError):
    """A folder the run writes lies inside one its final export replaces whole (and so would delete)."""


class _Lock:
    def __init__(self, folder: Path, flag: str, beside: bool = False):
        self.folder, self.flag, self.count, self.fd = folder, flag, 0, -1
        # the lock file: in the folder, or beside it for a folder the run replaces whole
        self.path = folder.parent / f".{folder.name}{LOCK_NAME}" if beside else folder / LOCK_NAME
        self.created = False  # the lock's folder did not exist: a run that wrote nothing there leaves none behind

    def acquire(self) -> None:
        where = self.path.parent
        self.created = not where.exists()
        where.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 512, 0).decode(errors="replace").strip() or "a process that wrote no details"
            os.close(fd)
            raise FolderInUse(
                f"{self.flag} {self.folder} is in use by another run ({holder}): wait for it to end, "
                f"stop it, or give this run another {self.flag}"
            ) from None
        previous = os.pread(fd, 512, 0).decode(errors="replace").strip()
        if previous:
            logger.warning(
                "%s %s: taking over the lock of a run whose process is gone (%s)", self.flag, self.folder, previous
            )
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
        where = self.path.parent
        with contextlib.suppress(OSError):  # a run stopped before it wrote anything leaves no folder
            if self.created and [p.name for p in where.iterdir()] == [self.path.name]:
                self.path.unlink()
                where.rmdir()


_HELD: dict[Path, _Lock] = {}  # by lock file


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
                _HELD.pop(lock.path, None)

    def __enter__(self) -> FolderLocks:
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    def __del__(self) -> None:
        self.release()


def _check_replaceable(flag: str, folder: str | None) -> None:
    """A folder the run replaces whole at its end is new, empty, or an earlier export (it holds a config.json):
    anything else would be deleted by the final export, so it is refused before the run starts (FolderInsideReplaced,
    one line naming a few of the files)."""
    if not folder:
        return
    path = Path(folder)
    if path.exists() and not path.is_dir():
        raise FolderInsideReplaced(f"{flag} {folder} is a file; the export writes a folder there: give a folder path")
    if not path.is_dir() or (path / "config.json").is_file():
        return
    held = sorted(p.name for p in path.iterdir() if p.name != LOCK_NAME)
    if held:
        shown = ", ".join(held[:4]) + (f" and {len(held) - 4} more" if len(held) > 4 else "")
        raise FolderInsideReplaced(
            f"{flag} {folder} holds files that are not a model export ({shown}); the final export replaces the "
            f"folder whole, deleting them: give {flag} a new or empty folder, or an earlier export's"
        )


def hold(folders: dict[str, str | None], replaced: dict[str, str | None] | None = None) -> FolderLocks:
    """Lock each folder (``{"--ckpt_path": "ck", "--run_dir": None}``: the flag that named it, the folder; None is
    skipped; one folder given twice is locked once) and each folder of ``replaced`` (folders the run replaces
    whole, ``{"--save_path": "out"}``: locked beside them); FolderInUse when another live process holds one (the
    locks taken so far are given back); FolderInsideReplaced, before any lock, when a folder of ``folders`` is or
    lies inside one of ``replaced`` (the export would delete it: a run's metrics, its checkpoints)."""
    for flag, folder in folders.items():
        for whole_flag, whole in (replaced or {}).items():
            if folder and whole and Path(folder).resolve().is_relative_to(Path(whole).resolve()):
                raise FolderInsideReplaced(
                    f"{flag} {folder} lies inside {whole_flag} {whole}, which the final export replaces whole "
                    f"(deleting what is in it): give {flag} a folder outside it, e.g. beside it"
                )
    for whole_flag, whole in (replaced or {}).items():
        _check_replaceable(whole_flag, whole)
    taken: list[_Lock] = []
    seen: set[Path] = set()
    wanted = [(flag, folder, False) for flag, folder in folders.items()]
    wanted += [(flag, folder, True) for flag, folder in (replaced or {}).items()]
    try:
        for flag, folder, beside in wanted:
            if not folder:
                continue
            candidate = _Lock(Path(folder).resolve(), flag, beside)
            if candidate.path in seen:
                continue
            seen.add(candidate.path)
            lock = _HELD.get(candidate.path)
            if lock is None:
                lock = candidate
                lock.acquire()
                _HELD[lock.path] = lock
            lock.count += 1
            taken.append(lock)
    except BaseException:
        FolderLocks(taken).release()
        raise
    return FolderLocks(taken)
