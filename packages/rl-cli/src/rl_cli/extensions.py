"""``--extension``: Python files or modules imported before a command reads its settings.

An extension registers what it adds with the packages' registries (an advantage estimator with
``rl_algos.ESTIMATORS.register``, a policy-loss variant with ``rl_algos.POLICY_LOSSES.register``, a rollout
engine with ``rl_rollout.register_engine``); the run then names it like a built-in one
(``--advantage_estimator NAME --estimator_args k=v``, ``--policy_loss_type NAME --policy_loss_args k=v``).
Each file is imported once per process (under a name derived from its resolved path), so a second run in
the same process does not register twice. ``--extension`` on the command line is imported before the parser
is built, so ``--help`` lists what it registers; one in a ``--config`` YAML (``cli: {extension: [...]}``)
before the settings are built. ``rl ppo-ray`` hands the absolute paths to its role actors (:data:`ENV`), which
import them before they build: a file must be at the same path on every node (a shared folder), a module
importable there.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Iterable
from pathlib import Path

from rl_cli.errors import UserError
from rl_rollout.rewards.loading import exec_file

FLAGS = ("--extension", "--cli.extension")
ENV = "RL_EXTENSIONS"  # what rl ppo-ray's role actors import before they build (os.pathsep-separated)


def in_argv(argv: list[str]) -> list[str]:
    """The ``--extension`` values of a command line (``--extension a.py b.py``, ``--extension=a.py``)."""
    out, taking = [], False
    for arg in argv:
        if arg.startswith("--"):
            name, eq, value = arg.partition("=")
            taking = name in FLAGS and not eq
            if name in FLAGS and eq:
                out.append(value)
        elif taking:
            out.append(arg)
    return out


def resolved(specs: Iterable[str]) -> list[str]:
    """The specs as another process on this machine can import them: files as absolute paths."""
    return [str(Path(s).expanduser().resolve()) if s.endswith(".py") or "/" in s else s for s in specs]


def from_env() -> list[str]:
    """Import what :data:`ENV` lists (set by ``rl ppo-ray`` for its role actors: the policy builds the loss
    variant, the loop's estimator runs in the driver that imported them already)."""

    return load([s for s in os.environ.get(ENV, "").split(os.pathsep) if s])


def load(specs: Iterable[str]) -> list[str]:
    """Import each file (``*.py``) or module name once; the module names, in order. A missing file or a module
    that fails to import stops the command in one line naming it."""
    names = []
    for spec in specs:
        if spec.endswith(".py") or "/" in spec:
            if not Path(spec).expanduser().is_file():
                raise UserError(f"--extension {spec}: no such file")
            try:
                name = exec_file(spec, "rl_extension", reuse=True).__name__  # registers once per process
            except Exception as e:
                raise UserError(f"--extension {spec} failed to import: {type(e).__name__}: {e}") from e
        else:
            name = spec
            try:
                importlib.import_module(spec)
            except ImportError as e:
                raise UserError(f"--extension {spec}: no such module ({e})") from e
        names.append(name)
    return names
