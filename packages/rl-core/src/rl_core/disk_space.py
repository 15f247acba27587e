"""A save that fails because the disk is full says so: the folder, the bytes free, the bytes it needs.

torch's zip writer reports a full disk as ``RuntimeError: basic_ios::clear: iostream error`` (no path, no
reason), DeepSpeed passes it on, and over Ray it arrives wrapped in a ``RayTaskError``. :func:`named_if_full`
wraps a save: when it fails and the disk holding the folder is full (an ``ENOSPC`` anywhere in the error's
chain, or less free space than the save needs), the error becomes one :class:`~rl_core.preflight.InputError`
line naming the folder, the free bytes and the estimate of what is needed; any other failure passes unchanged.
"""

from __future__ import annotations

import errno
import shutil
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from rl_core.preflight import InputError

_FULL_TEXT = ("No space left on device", "iostream error", "ENOSPC", "Disk quota exceeded")


def _says_full(e: BaseException | None) -> bool:
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        if any(t in str(e) for t in _FULL_TEXT):
            return True
        e = e.__cause__ or e.__context__
    return False


def free_bytes(folder: str | Path) -> int:
    """Free bytes on the file system that holds ``folder`` (its nearest existing ancestor)."""
    p = Path(folder).absolute()
    while not p.exists() and p != p.parent:
        p = p.parent
    return shutil.disk_usage(p).free


@contextmanager
def named_if_full(
    folder: str | Path,
    what: str,
    need: Callable[[], int | None] = lambda: None,
    fix: str = "free space there or point --ckpt_path at another disk",
    on_full: Callable[[], None] | None = None,
) -> Iterator[None]:
    """Run the block (a save into ``folder``); a failure from a full disk becomes one InputError line: ``what``
    (e.g. "the checkpoint of iteration 3"), the folder, the free bytes, ``need()`` (bytes, estimated only on
    failure; None: unknown) and ``fix``. ``on_full`` runs first (removing the half-written folder)."""
    try:
        yield
    except Exception as e:
        free = free_bytes(folder)
        needed = need()
        if not (_says_full(e) or (needed is not None and free < needed) or free < (1 << 20)):
            raise
        if on_full is not None:
            on_full()
        wanted = f", about {needed:,} needed" if needed else ""
        raise InputError(
            f"{what} into {folder} failed: the disk is full ({free:,} bytes free{wanted}); {fix} "
            f"({type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''})"
        ) from e
