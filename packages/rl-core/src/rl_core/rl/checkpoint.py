"""The RL loop's checkpoints: one commit per iteration over every role's state and the loop's.

Layout under ``ckpt_path``::

    iter_00000012/
        policy/           the policy group's DeepSpeed state (tag "ds"; each rank writes its part and its RNG)
        critic/           the critic group's, when the run has a critic
        hf/               with --save_hf_ckpt: the policy's Hugging Face export (hf/critic/: the critic's)
        loop_state.json   the loop: iteration, prompt cursor, KL coefficient, metrics history, the driver's RNG
        COMPLETE          the commit marker, written last: {"iteration": 12, "roles": ["policy", "critic"], "files":
                          {every other file: [bytes, sha256]}} (rl_core.checkpoint_manifest)
    best_iter_00000008/   with --best_metric_key: the same for the best eval so far (one folder, never pruned)

With --disable_ds_ckpt the roles write nothing (the marker's roles are empty): such a folder holds the
loop state and the HF exports, and resume refuses it, naming the export to start a new run from.

Save (:meth:`RLCheckpoints.save`, on the driver): each role's group writes its part
(``group.call("save_checkpoint", folder)``; the ranks may be Ray actors in other processes,
each fsyncs what it wrote before returning), then the HF exports when asked (``exports``:
each writes its folder, which is then fsynced), then the loop state, then the marker (temp
file, fsync, ``os.replace``, fsync of the folder), only after every role has returned.
Older iterations are pruned down to ``keep_last`` (``--max_ckpt_num``) and within ``max_gb``
(``--max_ckpt_mem``: :func:`rl_core.checkpoint.prune_count`, the newest never) only once the new
marker exists, each losing its marker before its files, so a crash in the middle of a
delete leaves a folder that resume ignores, never one that looks complete.

Resume (:meth:`RLCheckpoints.load`): the newest folder with a marker whose files match its manifest
(:meth:`RLCheckpoints.usable`: a newer one that does not is skipped with a warning naming the file and what is
wrong), every role and the loop from that one folder, never a mix. Folders without the marker (a save that did not
finish) are never read; they are removed, with a log line, at the next resume or save.

Trust: the role states are DeepSpeed checkpoints, which DeepSpeed reads with
``torch.load(weights_only=False)``: loading one runs whatever code it holds. Resume only
checkpoints you wrote; for weights from elsewhere start from an HF export (safetensors):
``--pretrain EXPORT`` and, for a critic, ``--critic_pretrain EXPORT/critic``. The loop
state and the marker are JSON.

Fault injection (tests only): :attr:`RLCheckpoints.crash_hook`, when set, is called with
the name of each step of a save and the iteration saved (``before:policy``, ``after:policy``, ``before:critic``,
``after:critic``, ``before:export:hf``, ``after:export:hf``..., ``before:commit``, ``after:commit``); the crash
tests SIGKILL the process
there. It is None in every run.
"""

from __future__ import annotations

import json
import logging
import re
import shutil
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from rl_core.checkpoint import check_max_gb, folder_bytes, prune
from rl_core.checkpoint_manifest import manifest, newest_usable, verify
from rl_core.disk_space import named_if_full
from rl_core.durable_io import atomic_write_text, fsync_dir, fsync_tree
from rl_core.preflight import InputError

logger = logging.getLogger(__name__)

MARKER = "COMPLETE"
LOOP_STATE = "loop_state.json"
_ITER = re.compile(r"^iter_(\d+)$")


def iter_dir(root: str | Path, iteration: int) -> Path:
    return Path(root) / f"iter_{iteration:08d}"


class RLCheckpoints:
    """Per-iteration RL checkpoints under ``root``, the newest ``keep_last`` complete ones kept (within ``max_gb``
    GB: :func:`rl_core.checkpoint.prune_count`)."""

    crash_hook: Callable[[str, int], None] | None = None  # tests only (module docstring)

    def __init__(self, root: str | Path, keep_last: int = 3, max_gb: float | None = None):
        if keep_last < 1:
            raise ValueError(f"keep_last (--max_ckpt_num) must be >= 1, got {keep_last}")
        check_max_gb(max_gb)
        self.root, self.keep_last, self.max_gb = Path(root), keep_last, max_gb

    # ----- what is on disk ----------------------------------------------------------------------

    def _folders(self) -> list[tuple[int, Path]]:
        if not self.root.is_dir():
            return []
        found = [(int(m.group(1)), d) for d in self.root.iterdir() if d.is_dir() and (m := _ITER.match(d.name))]
        return sorted(found)

    def complete(self) -> list[Path]:
        """Committed iterations, oldest first."""
        return [d for _, d in self._folders() if (d / MARKER).is_file()]

    def latest(self) -> Path | None:
        done = self.complete()
        return done[-1] if done else None

    def problem(self, d: Path) -> str | None:
        """What keeps committed folder ``d`` from being resumed, as a phrase (None: nothing), from its files alone:
        the marker, the loop state, and every file against the marker's manifest (rl_core.checkpoint_manifest;
        folders saved before manifests, by rl-core < 0.19, are checked without one)."""
        try:
            marker = json.loads((d / MARKER).read_text())
            marker["roles"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            return f"its {MARKER} marker does not read ({type(e).__name__}: {e})"
        if "files" in marker:
            wrong = verify(d, marker["files"], d / MARKER)
            if wrong is not None:
                return wrong
        try:
            json.loads((d / LOOP_STATE).read_text())
        except (OSError, ValueError) as e:
            return f"{LOOP_STATE} does not read ({type(e).__name__}: {e})"
        return None

    def usable(self) -> Path | None:
        """The newest committed folder whose files verify (:meth:`problem`); each newer one skipped is named in a
        warning with what is wrong with it. None when there is none; a ValueError (one line) when there are
        committed folders and none verifies."""
        return newest_usable(self.complete(), self.problem, self.root, logger)

    def remove_incomplete(self) -> list[Path]:
        """Delete the folders without a marker (saves that did not finish), each with a log line."""
        gone = [d for _, d in self._folders() if not (d / MARKER).is_file()]
        for d in gone:
            logger.warning(
                "removing %s: it has no %s marker (a save that did not finish); it was never used", d, MARKER
            )
            shutil.rmtree(d, ignore_errors=True)
        return gone

    def _check_layout(self) -> None:
        legacy = [self.root / role for role in ("policy", "critic") if any((self.root / role).glob("step_*"))]
        if legacy:
            raise InputError(
                f"{self.root} holds RL checkpoints in the per-role layout of rl-core 0.7 and earlier "
                f"({', '.join(str(p / 'step_*') for p in legacy)}), saved apart and able to disagree; this version "
                f"resumes only iter_*/ folders with a {MARKER} marker: finish that run with the version that wrote "
                f"it, or point --ckpt_path at a new folder"
            )

    # ----- save and load ------------------------------------------------------------------------

    def _point(self, name: str, iteration: int) -> None:
        if self.crash_hook is not None:
            self.crash_hook(name, iteration)

    def save(
        self,
        iteration: int,
        roles: Mapping[str, Any],
        loop_state: dict,
        exports: Mapping[str, Callable[[str], Any]] | None = None,
        *,
        best: bool = False,
    ) -> Path:
        """Every role's state (``roles``: name -> worker group), then each of ``exports`` (relative folder ->
        ``write(path)``, in order: an HF export), then ``loop_state`` (JSON values), then the marker; then
        prune. Returns the committed folder. ``best``: into ``best_iter_N/`` instead (``--best_metric_key``),
        which then replaces the previous best folder; best folders are never pruned nor resumed from."""
        self.root.mkdir(parents=True, exist_ok=True)
        self.remove_incomplete()
        d = self.root / f"best_iter_{iteration:08d}" if best else iter_dir(self.root, iteration)
        if d.exists():  # the same iteration again: take the old one out of the committed set first
            _uncommit_and_remove(d)
        previous = self.latest()
        d.mkdir()
        with named_if_full(
            d,
            f"the checkpoint of iteration {iteration}",
            need=lambda: folder_bytes(previous) if previous is not None else None,
            fix="the half-written folder was removed and the checkpoints before it are intact; free "
            "space there or point --ckpt_path at another disk",
            on_full=lambda: shutil.rmtree(d, ignore_errors=True),
        ):
            for name, group in roles.items():
                self._point(f"before:{name}", iteration)
                group.call("save_checkpoint", str(d / name))
                self._point(f"after:{name}", iteration)
            for rel, write in (exports or {}).items():
                self._point(f"before:export:{rel}", iteration)
                write(str(d / rel))
                self._point(f"after:export:{rel}", iteration)
            for rel in exports or {}:
                fsync_tree(d / rel)  # on disk before the marker says the folder is whole
            atomic_write_text(d / LOOP_STATE, json.dumps(loop_state))
            self._point("before:commit", iteration)
            files = manifest(d, skip=(MARKER,))  # every file's size and sha256: resume verifies before it loads
            atomic_write_text(d / MARKER, json.dumps({"iteration": iteration, "roles": list(roles), "files": files}))
            fsync_dir(self.root)
        self._point("after:commit", iteration)
        if best:
            for old in self.root.glob("best_iter_*"):
                if old != d:
                    _uncommit_and_remove(old)
            logger.info("best checkpoint committed: %s", d)
            return d
        prune(self.root, self.complete(), self.keep_last, self.max_gb, _uncommit_and_remove)
        logger.info("checkpoint of iteration %d committed: %s (%s)", iteration, d, ", ".join(roles))
        return d

    def load(self, roles: Mapping[str, Any]) -> dict | None:
        """Restore every role and return the loop state from the newest committed iteration (None: none)."""
        self._check_layout()
        self.remove_incomplete()
        d = self.usable()
        if d is None:
            return None
        marker = json.loads((d / MARKER).read_text())  # usable() read it
        saved = marker["roles"]
        if not saved and roles:
            raise InputError(
                f"checkpoint {d} was written with --disable_ds_ckpt: it holds the loop state and, with "
                f"--save_hf_ckpt, the HF exports ({d / 'hf'}), no DeepSpeed state (weights, optimizer) "
                f"to resume from; start a new run from the export (--pretrain {d / 'hf'}) or point "
                f"--ckpt_path at a new folder"
            )
        if sorted(saved) != sorted(roles):
            raise InputError(
                f"checkpoint {d} holds the roles {sorted(saved)}, this run has {sorted(roles)}: resume "
                f"with the settings that wrote it (--advantage_estimator decides the critic), or point "
                f"--ckpt_path at a new folder"
            )
        for name, group in roles.items():
            group.call("load_checkpoint", str(d / name))
        state = json.loads((d / LOOP_STATE).read_text())
        logger.info("resumed from %s (iteration %d; %s)", d, marker["iteration"], ", ".join(roles))
        return state


def _uncommit_and_remove(path: Path) -> None:
    (path / MARKER).unlink(missing_ok=True)
    fsync_dir(path)
    shutil.rmtree(path, ignore_errors=True)
