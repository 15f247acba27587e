"""Checkpoints: DeepSpeed state for exact resume, HF export, atomic writes, keep-last-N and a disk budget.

Layout under ``ckpt_path``::

    step_00000010/      a complete checkpoint: DeepSpeed state (tag "ds") + rl_state.json
    .tmp-step_00000012/ a write in progress or a crash's leftover: never loaded, removed on the next save

A checkpoint is written into ``.tmp-step_N`` and renamed to ``step_N`` only after
every rank has finished writing and rank 0 has written ``rl_state.json`` (the
commit marker), so a crash leaves either the old set or the new one, never a
half checkpoint that looks complete. :meth:`CheckpointManager.latest` skips (with a
warning) any ``step_*`` folder without the marker.

Pruning (:func:`prune_count`, shared with the RL loop's checkpoints), after each commit: the newest
``keep_last`` (``--max_ckpt_num``) complete checkpoints are kept, and with a budget (``--max_ckpt_mem``, GB)
the oldest of those go while the folder without the newest checkpoint holds more than the budget. That is
what OpenRLHF's ``save_ckpt`` keeps: it prunes the same way before writing the next one (it sums every
sub-folder's files), so its folder too is the budget plus one checkpoint at most. The newest complete
checkpoint is never removed, whatever the budget.

A peft (LoRA) model's checkpoint holds only its trainable parameters (the adapter, and a
reward or value head) with the optimizer, scheduler and RNG state: the frozen base weights
are the ones ``--pretrain`` loads again at resume, so writing them each time would only
cost disk and time. Loading such a checkpoint accepts missing keys only where the model's
parameter is frozen; any other missing or unexpected key fails with the names.

:func:`save_engine_state` / :func:`load_engine_state` are the one-engine part of a save and a load
(DeepSpeed state, tag "ds", with each rank's RNG), shared with the RL loop's per-iteration checkpoints
(:mod:`rl_core.rl.checkpoint`), which commit several roles' states with one marker.

Trust: a DeepSpeed checkpoint is a pickle. DeepSpeed reads it with ``torch.load(weights_only=False)``,
so loading one (``load_checkpoint`` / ``--load_checkpoint``) runs whatever code it holds. Resume only
checkpoints you wrote; for weights from elsewhere, start from an HF export (safetensors, no pickle:
``--pretrain EXPORT``, and ``--critic_pretrain EXPORT/critic`` for a critic).

Universal checkpoints (``--use_ds_universal_ckpt``, DeepSpeed's ``load_universal``): the saved state stays
as it is; at load, :func:`to_universal` converts ``ds/`` once into ``ds_universal/`` beside it and every
rank reads its share from there, whatever the number of ranks that saved it.

The HF export (a transformers/vLLM-loadable folder, LoRA merged) is :mod:`rl_core.hf_export`; the universal
conversion :mod:`rl_core.ds_universal`; the RNG state :mod:`rl_core.rng_state`; crash-safe writes
:mod:`rl_core.durable_io` (all importable from here as before).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

import rl_core.hf_export
from rl_core.checkpoint_manifest import manifest, newest_usable, verify
from rl_core.configs.checkpoint import check_max_gb, unset_infinite_budget  # noqa: F401 - also importable from here
from rl_core.disk_space import named_if_full
from rl_core.ds_universal import DS_TAG, UNIVERSAL_CONVERT_TIMEOUT_S, UNIVERSAL_TAG, to_universal  # noqa: F401 - also importable from here
from rl_core.durable_io import atomic_write_text, fsync_dir, fsync_tree
from rl_core.preflight import InputError
from rl_core.rng_state import rng_state, rng_state_from_json, rng_state_json, set_rng_state  # noqa: F401 - ditto

logger = logging.getLogger(__name__)
MARKER = "rl_state.json"


def save_engine_state(strategy, engine, path: str | Path, client_state: dict | None = None) -> Path:
    """Collective: every rank writes its part of ``engine``'s DeepSpeed state (tag "ds", with its RNG and
    ``client_state``, which :func:`load_engine_state` returns) into ``path`` and fsyncs it; returns when all
    ranks have. Frozen parameters are left out of a peft model's."""
    path = Path(path)
    if strategy.is_rank_0():
        path.mkdir(parents=True, exist_ok=True)
    strategy.barrier()
    engine.save_checkpoint(
        str(path),
        tag=DS_TAG,
        client_state={**(client_state or {}), "rng": rng_state()},
        exclude_frozen_parameters=is_peft(engine.module),
    )
    fsync_tree(path)
    strategy.barrier()
    return path


_HYPER = ("betas", "eps", "weight_decay")


def _hyper(engine) -> list[dict]:
    """Each optimizer group's settings from this run's config: the peak learning rate (the schedule's base), betas,
    eps, weight decay."""
    groups = engine.optimizer.param_groups if engine.optimizer is not None else []
    peaks = list(getattr(engine.lr_scheduler, "base_lrs", ()))
    return [
        {"lr": peaks[i] if i < len(peaks) else g.get("initial_lr", g.get("lr")), **{k: g[k] for k in _HYPER if k in g}}
        for i, g in enumerate(groups)
    ]


def _plain(v):
    return tuple(float(x) for x in v) if isinstance(v, (list, tuple)) else float(v)


def _reapply(engine, configured: list[dict]) -> list[str]:
    """After a load: this run's optimizer settings where the checkpoint's differ (a loaded state dict brings the
    saved ones, so a new ``--learning_rate`` would be silently ignored); the current learning rate recomputed from
    the schedule at the restored step. Returns ``what old -> new`` for each change."""
    sched = engine.lr_scheduler
    groups = engine.optimizer.param_groups if engine.optimizer is not None else []
    changes = []
    for i, (g, want) in enumerate(zip(groups, configured, strict=False)):
        tag = f" (group {i})" if len(groups) > 1 else ""
        for k in _HYPER:
            if k in want and k in g and _plain(g[k]) != _plain(want[k]):
                changes.append(f"{k} {g[k]} -> {want[k]}{tag}")
                g[k] = want[k]
        peaks = getattr(sched, "base_lrs", None)
        if peaks is not None and i < len(peaks) and peaks[i] != want["lr"]:
            changes.append(f"learning rate (peak) {peaks[i]:g} -> {want['lr']:g}{tag}")
            peaks[i] = g["initial_lr"] = want["lr"]
    lambdas = getattr(sched, "lr_lambdas", None)
    if changes and lambdas is not None:  # LambdaLR: lr = peak x factor(step), at the step the checkpoint reached
        for g, peak, factor in zip(groups, sched.base_lrs, lambdas, strict=False):
            g["lr"] = peak * factor(sched.last_epoch)
        sched._last_lr = [g["lr"] for g in groups]
    return changes


def load_engine_state(engine, path: str | Path) -> dict:
    """Restore model, optimizer, scheduler and this rank's RNG from :func:`save_engine_state`'s ``path``;
    returns DeepSpeed's client state. A peft model keeps its frozen base and takes every trainable
    parameter from the checkpoint.

    Runs DeepSpeed's ``torch.load(weights_only=False)``: only load checkpoints you trust (module docstring)."""
    path = Path(path)
    configured = _hyper(engine)
    if engine.load_universal_checkpoint():  # --use_ds_universal_ckpt: any number of ranks
        if is_peft(engine.module):
            raise ValueError(
                f"--use_ds_universal_ckpt with a LoRA model: its checkpoint {path} holds only the "
                f"adapter, which DeepSpeed's universal conversion does not take; resume on the same "
                f"number of ranks without the flag"
            )
        load_path, client = engine.load_checkpoint(str(to_universal(path)), tag=UNIVERSAL_TAG, load_module_strict=True)
    elif is_peft(engine.module):  # saved without the frozen base weights (see the module docstring)
        load_path, client = engine.load_checkpoint(
            str(path), tag=DS_TAG, load_module_strict=False, custom_load_fn=_load_trainable(path)
        )
    else:
        load_path, client = engine.load_checkpoint(str(path), tag=DS_TAG, load_module_strict=True)
    if load_path is None:
        raise ValueError(
            f"checkpoint {path} has no DeepSpeed state under tag {DS_TAG!r}; delete the folder "
            f"to resume from the previous one"
        )
    set_rng_state(client["rng"])
    changed = _reapply(engine, configured)
    if changed and (not dist.is_initialized() or dist.get_rank() == 0):
        logger.warning(
            "resumed %s with optimizer settings other than the checkpoint's, applied from here on: %s",
            path,
            ", ".join(changed),
        )
    return client


def folder_bytes(path: Path) -> int:
    """The bytes of every file under ``path`` (0 when it does not exist), as OpenRLHF's budget counts them."""
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


def prune_count(sizes: list[int], other_bytes: int, keep_last: int, max_gb: float | None) -> int:
    """How many of the oldest complete checkpoints to remove. ``sizes``: their bytes, oldest first, the newest
    (just committed, never removed) last; ``other_bytes``: what else the folder holds (a best checkpoint...).

    Beyond the newest ``keep_last`` all go; then, with ``max_gb``, the oldest kept ones go while
    ``other_bytes`` plus the older ones left exceed ``max_gb`` GiB (the newest is not counted: OpenRLHF
    prunes before it writes the next checkpoint, so its folder holds the budget plus one checkpoint)."""
    n = max(0, len(sizes) - keep_last)
    if max_gb is None:
        return n
    left = other_bytes + sum(sizes[n:-1])
    while n < len(sizes) - 1 and left > max_gb * 1024**3:
        left -= sizes[n]
        n += 1
    return n


def prune(
    root: Path, complete: list[Path], keep_last: int, max_gb: float | None, remove: Callable[[Path], None] | None = None
) -> list[Path]:
    """Remove what :func:`prune_count` says of ``complete`` (oldest first) under ``root``, each by ``remove``
    (default: :func:`_uncommit_and_remove`, marker first); returns the removed folders."""
    remove = remove or _uncommit_and_remove
    if not complete:
        return []
    sizes = [folder_bytes(d) for d in complete] if max_gb is not None else [0] * len(complete)
    other = folder_bytes(root) - sum(sizes) if max_gb is not None else 0
    gone = complete[: prune_count(sizes, other, keep_last, max_gb)]
    for old in gone:
        remove(old)
    if max_gb is not None and gone:
        logger.info(
            "checkpoints removed (--max_ckpt_num %d, --max_ckpt_mem %g GB): %s",
            keep_last,
            max_gb,
            ", ".join(d.name for d in gone),
        )
    return gone


def _step_dir(root: Path, step: int) -> Path:
    return root / f"step_{step:08d}"


def is_peft(module: torch.nn.Module) -> bool:
    """Whether ``module`` holds a peft model (e.g. an Actor from ``from_pretrained(lora=...)``)."""
    return any(hasattr(m, "peft_config") for m in module.modules())


def _load_trainable(where: Path):
    """DeepSpeed ``custom_load_fn``: a checkpoint without frozen parameters into the full model."""

    def load(src: dict, dst: torch.nn.Module) -> None:
        result = dst.load_state_dict(src, strict=False)
        frozen = {n for n, p in dst.named_parameters(remove_duplicate=False) if not p.requires_grad}
        missing = [k for k in result.missing_keys if k not in frozen]
        # a 4-bit frozen weight's quantization state (QLoRA: X.weight.absmax, ...) is saved beside the trainable
        # weights though the weight itself is not; the base it belongs to loaded from the model folder
        unexpected = [
            k for k in result.unexpected_keys if not any(k[:i] in frozen for i, c in enumerate(k) if c == ".")
        ]
        if missing or unexpected:
            raise ValueError(
                f"checkpoint {where} does not fit the model: missing trainable {missing[:5]} ({len(missing)}), "
                f"unexpected {unexpected[:5]} ({len(unexpected)}); it was written for a "
                f"different model or LoRA setting (--lora_rank, --target_modules): resume with the run's settings, "
                f"or point --ckpt_path at a new folder"
            )

    return load


class CheckpointManager:
    """Save and find DeepSpeed checkpoints under ``root``, keeping the last ``keep_last`` within ``max_gb``
    (module docstring: pruning)."""

    def __init__(self, root: str | Path, strategy, keep_last: int = 3, max_gb: float | None = None):
        if keep_last < 1:
            raise ValueError(f"keep_last (--max_ckpt_num) must be >= 1, got {keep_last}")
        check_max_gb(max_gb)
        self.root, self.strategy, self.keep_last, self.max_gb = Path(root), strategy, keep_last, max_gb

    def complete(self) -> list[Path]:
        """Complete checkpoints, oldest first; warns about incomplete ones."""
        if not self.root.is_dir():
            return []
        done = []
        for d in sorted(self.root.glob("step_*")):
            if (d / MARKER).is_file():
                done.append(d)
            else:
                logger.warning(
                    "ignoring %s: it has no %s (a save that did not finish); resuming from the last "
                    "complete checkpoint instead",
                    d,
                    MARKER,
                )
        return done

    def latest(self) -> Path | None:
        done = self.complete()
        return done[-1] if done else None

    def problem(self, d: Path) -> str | None:
        """What keeps complete checkpoint ``d`` from being resumed (None: nothing), from its files alone: the
        marker, and every file against the marker's manifest (rl_core.checkpoint_manifest; markers from before
        manifests, rl-core < 0.19, are only read)."""
        try:
            meta = json.loads((d / MARKER).read_text())
            meta["step"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            return f"its {MARKER} does not read ({type(e).__name__}: {e})"
        return verify(d, meta["files"], d / MARKER) if "files" in meta else None

    def usable(self) -> Path | None:
        """The newest complete checkpoint whose files verify; each newer one skipped is named in a warning. None
        when there is none; an InputError (one line) when none of several verifies."""
        return newest_usable(self.complete(), self.problem, self.root, logger)

    def save(self, engine, step: int, client_state: dict) -> Path:
        """Collective: every rank calls it. ``client_state`` must be JSON-serialisable (data position...)."""
        s = self.strategy
        final, tmp = _step_dir(self.root, step), self.root / f".tmp-step_{step:08d}"
        if s.is_rank_0():
            self.root.mkdir(parents=True, exist_ok=True)
            for old in self.root.glob(".tmp-step_*"):
                shutil.rmtree(old, ignore_errors=True)
        s.barrier()
        previous = self.latest()  # its size: what a save needs, said if the disk is full
        with named_if_full(
            tmp,
            f"the checkpoint of step {step}",
            need=lambda: folder_bytes(previous) if previous is not None else None,
            fix="the checkpoints before it are intact; free space there or point --ckpt_path at another disk",
        ):
            save_engine_state(s, engine, tmp)
            if s.is_rank_0():
                files = manifest(tmp, skip=(MARKER,))
                atomic_write_text(tmp / MARKER, json.dumps({"step": step, **client_state, "files": files}))
        if s.is_rank_0():
            if final.exists():
                _uncommit_and_remove(final)
            tmp.rename(final)
            fsync_dir(self.root)
            prune(self.root, self.complete(), self.keep_last, self.max_gb)
        s.barrier()
        logger.info("checkpoint saved: %s", final)
        return final

    def load(self, engine, path: Path | None = None) -> dict | None:
        """Restore model, optimizer, scheduler and RNG from ``path`` (default: the newest that verifies,
        :meth:`usable`); returns its client state.

        A peft model keeps its current frozen weights (the base it was built from) and takes
        every trainable parameter from the checkpoint. Unpickles: load only checkpoints you trust."""
        path = path or self.usable()
        if path is None:
            return None
        wrong = self.problem(path)
        if wrong is not None:
            raise InputError(
                f"checkpoint {path} cannot be resumed: {wrong}; delete the folder to resume from the previous one"
            )
        meta = json.loads((path / MARKER).read_text())
        meta.pop("files", None)
        load_engine_state(engine, path)
        logger.info("resumed from %s (step %s)", path, meta["step"])
        return meta


def _uncommit_and_remove(path: Path) -> None:
    """Delete a checkpoint folder marker first: a crash mid-delete leaves a folder resume ignores."""
    (path / MARKER).unlink(missing_ok=True)
    fsync_dir(path)
    shutil.rmtree(path, ignore_errors=True)


def __getattr__(name: str):  # the HF export and the LoRA merge live in rl_core.hf_export; old imports keep working
    if name in ("export_hf", "lora_scale", "merge_lora_state", "merge_lora_stream"):
        return getattr(rl_core.hf_export, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
