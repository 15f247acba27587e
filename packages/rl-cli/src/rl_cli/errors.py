"""A user's mistake ends a command in one line; a bug keeps its traceback.

:func:`user_errors` wraps a command's entry: a :class:`UserError`, or one of the packages' input
errors (:data:`INPUT_ERRORS`: an unreadable model folder, a reward spec that does not load, a dead
reward server, bad data, a placement that cannot work), prints ``rl <command>: <message>`` on stderr
and exits with code 2, without a traceback. ``--debug`` (:class:`CliArgs`, on every command) re-raises
it with the traceback instead. Ctrl-C and SIGTERM end it in one line too, ``rl <command>: stopped by Ctrl-C``
with where the run stood when the loop says so (the iteration, the last checkpoint), exit code 130 / 143.
Anything else is a bug and propagates as usual.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import signal
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from rl_cli.config import FALSE, TRUE
from rl_rollout.config_fields import meta

EXIT_USER_ERROR = 2  # argparse's code for a usage error too

# (module, class): a user's input that cannot work. Looked up only in modules already imported: an error
# can only come from one that was.
INPUT_ERRORS = (
    ("rl_core.preflight", "InputError"),
    ("rl_core.folder_lock", "FolderInUse"),
    ("rl_core.folder_lock", "FolderInsideReplaced"),
    ("rl_core.hub", "ModelNotFoundError"),
    ("rl_core.data.loading", "DataError"),
    ("rl_rollout.rewards.loading", "RewardLoadError"),
    ("rl_rollout.rewards.remote", "RemoteRewardError"),
    ("rl_placement.specs", "PlacementError"),
)


class UserError(Exception):
    """A mistake in what the user asked for; the message names the value and the fix (one line)."""


@dataclass(frozen=True)
class CliArgs:
    """Settings of the command itself."""

    debug: bool = field(
        default=False,
        metadata=meta(
            "on a user mistake (a bad path, value or URL) also print the Python traceback; without it the command "
            "prints one line and exits with code 2"
        ),
    )
    extension: tuple[str, ...] = field(
        default=(),
        metadata=meta(
            "Python files or modules imported before the settings are read: each registers what it adds with the "
            "packages' registries (rl_algos.ESTIMATORS.register, rl_algos.POLICY_LOSSES.register, "
            "rl_rollout.register_engine), which the settings then name (rl_cli.extensions)"
        ),
    )


_debug = False


def set_debug(on: bool) -> None:
    """The resolved ``--debug`` (a YAML ``debug: true`` too), once a command has read its settings."""
    global _debug
    _debug = bool(on)


def _debug_in(argv: list[str]) -> bool:
    on = False
    for i, a in enumerate(argv):
        name, _, value = a.partition("=")
        if name in ("--debug", "--cli.debug"):
            nxt = value or (argv[i + 1] if i + 1 < len(argv) else "")
            on = nxt.lower() not in FALSE if nxt.lower() in TRUE | FALSE else True
    return on


def _input_error_types() -> tuple[type, ...]:
    found: list[type] = [UserError]
    for module, name in INPUT_ERRORS:
        if module in sys.modules:
            found.append(getattr(importlib.import_module(module), name))
    return tuple(found)


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised where the command runs as Ctrl-C is (the same unwinding: workers stopped, folders released)."""


def _terminate(signum, frame):
    raise Terminated


def user_errors(prog: str | Callable[..., str]):
    """Decorate a command ``fn(..., argv)``: user errors -> ``prog: message`` on stderr, exit code 2.

    ``prog``: the command's name, or a function of the call's arguments giving it (``rl sft`` ...)."""

    def wrap(fn):
        @functools.wraps(fn)
        def run(*args, **kwargs):
            global _debug
            argv = inspect.signature(fn).bind(*args, **kwargs).arguments.get("argv")
            _debug = _debug_in(sys.argv[1:] if argv is None else list(argv))
            main = threading.current_thread() is threading.main_thread()
            previous = signal.signal(signal.SIGTERM, _terminate) if main else None
            try:
                return fn(*args, **kwargs)
            except KeyboardInterrupt as e:  # Ctrl-C, or SIGTERM (_terminate): one line, where the run stood
                if _debug:
                    raise
                name = prog(*args, **kwargs) if callable(prog) else prog
                how = "SIGTERM" if isinstance(e, Terminated) else "Ctrl-C"
                notes = "; ".join(getattr(e, "__notes__", ()))
                print(f"{name}: stopped by {how}{' ' + notes if notes else ''}", file=sys.stderr, flush=True)
                raise SystemExit(128 + (signal.SIGTERM if isinstance(e, Terminated) else signal.SIGINT)) from None
            except _input_error_types() as e:
                if _debug:
                    raise
                name = prog(*args, **kwargs) if callable(prog) else prog
                message = "; ".join(line.strip() for line in str(e).splitlines() if line.strip())
                print(f"{name}: {message or type(e).__name__}", file=sys.stderr, flush=True)
                raise SystemExit(EXIT_USER_ERROR) from None
            finally:
                if main and signal.getsignal(signal.SIGTERM) is _terminate:
                    signal.signal(signal.SIGTERM, previous)

        return run

    return wrap
