"""The RL loop's checkpoints, from the loop's side: :class:`LoopCheckpoints` hands
:class:`~rl_core.rl.checkpoint.RLCheckpoints` the roles with state (policy, critic), the loop's state (a dict the
loop gives it: iteration, prompt cursor, KL coefficient, metrics history, ...) and, with ``save_hf_ckpt``, the HF
exports to write into the checkpoint before its marker; and gives the loop's state back on resume. The commit
protocol itself (layout, marker, pruning, crash safety) is :mod:`rl_core.rl.checkpoint`.

As OpenRLHF's PPO trainer: ``best_metric_key`` keeps one more checkpoint, of the eval pass with the
highest value of that metric so far (``best_iter_N/``, written right after that pass, the previous
best removed; the best value is in every checkpoint's loop state, so a resumed run keeps beating it);
``disable_ds_ckpt`` leaves the roles' DeepSpeed state out (only the HF exports and the loop state,
nothing at all without ``save_hf_ckpt``), so such a checkpoint cannot be resumed.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from rl_core.preflight import InputError
from rl_core.rl.checkpoint import LOOP_STATE, RLCheckpoints
from rl_core.rng_state import rng_state_json

logger = logging.getLogger(__name__)


def best_metric_key(cfg, eval_set: bool) -> str | None:
    """``--best_metric_key`` checked at start (``cfg``: the run's PPOConfig): the ``eval/NAME`` it follows, None
    when no best is kept."""
    name = cfg.eval.best_metric
    if name is None or (cfg.ckpt.ckpt_path and eval_set):
        return name
    if not cfg.eval.best_metric_key:  # the default follows OpenRLHF's auto choice only where there is an eval pass
        return None
    raise ValueError(
        f"--best_metric_key {cfg.eval.best_metric_key!r} needs an eval pass and a folder to keep the "
        f"checkpoint in: add --eval_dataset and --ckpt_path, or drop the flag"
    )


def _refuse_mixing(cfg, store: RLCheckpoints) -> None:
    if cfg.save_steps > 0 and not cfg.load_checkpoint and store.complete():
        raise InputError(
            f"--ckpt_path {cfg.ckpt_path} already holds checkpoints of a run "
            f"({', '.join(d.name for d in store.complete())}) that this run would mix with its "
            f"own: resume it with --load_checkpoint, or point --ckpt_path at a new folder"
        )


def check_folder(cfg):
    """Before any model loads (``cfg``: the run's :class:`~rl_core.configs.CheckpointConfig`): the folder resume
    will take (None: no resume, or nothing to resume), with each newer damaged one named in a warning; a
    one-line ValueError where the folder cannot serve this run (checkpoints of another run without
    ``--load_checkpoint``, the old layout, none that verifies). The trainer decides the same way again at
    resume; the files are hashed once per process (rl_core.checkpoint_manifest)."""
    if not cfg.ckpt_path:
        return None
    store = RLCheckpoints(cfg.ckpt_path, cfg.max_ckpt_num, cfg.max_ckpt_mem)
    _refuse_mixing(cfg, store)
    if not cfg.load_checkpoint:
        return None
    store._check_layout()
    return store.usable()


def resumed_settings(saved: dict | None, now: dict) -> list[str]:
    """What differs between the settings a checkpoint's loop state kept (``saved``; None: written before they were
    kept) and this run's (``now``): the prompt order (``seed``, ``prompts``) cannot change, the saved cursor indexes
    the saved order (one-line InputError); anything else is applied from here on and returned as ``name old ->
    new`` for the resume line."""
    if not saved:
        return []
    for key, flag in (("seed", "--seed"), ("prompts", "the prompt set's size")):
        if key in saved and saved[key] != now.get(key):
            raise InputError(
                f"--load_checkpoint: {flag} is {now.get(key)}, the checkpoint's run had {saved[key]}: "
                f"the prompts are taken in an order drawn from the seed over the whole set, and the saved "
                f"position continues only that order; resume with the same {flag.split()[-1]} or give "
                f"a fresh --ckpt_path"
            )
    return [f"{k} {saved[k]} -> {v}" for k, v in now.items() if k in saved and saved[k] != v]


class LoopCheckpoints:
    """The checkpoints of one run (``cfg``: its :class:`~rl_core.configs.CheckpointConfig`, with ``ckpt_path``
    set) over the roles with state; ``tokenizer_path`` goes with the HF exports; ``best_key``: the eval metric
    the best checkpoint follows (None: none kept). ``best``: ``{"key", "value", "iteration"}`` so far."""

    def __init__(self, cfg, *, policy, critic=None, tokenizer_path: str | None = None, best_key: str | None = None):
        self.cfg, self.policy, self.critic, self.tokenizer_path = cfg, policy, critic, tokenizer_path
        self.store = RLCheckpoints(cfg.ckpt_path, cfg.max_ckpt_num, cfg.max_ckpt_mem)
        self.best_key = best_key
        self.best: dict[str, Any] | None = None  # {"key", "value", "iteration"}: JSON in the loop state
        _refuse_mixing(cfg, self.store)

    def _roles_with_state(self) -> dict:
        return {name: g for name, g in (("policy", self.policy), ("critic", self.critic)) if g is not None}

    def due(self, it: int, last: int) -> bool:
        """A checkpoint after iteration ``it`` (every ``save_steps``, and the last of ``last``)."""
        return self.cfg.save_steps > 0 and (it % self.cfg.save_steps == 0 or it == last)

    def save(self, it: int, loop_state: dict, best: bool = False) -> None:
        """One commit for iteration ``it``: every role's state, the loop's (with the best so far), then the marker
        (:class:`~rl_core.rl.checkpoint.RLCheckpoints`); ``best``: into ``best_iter_N/``."""
        roles = {} if self.cfg.disable_ds_ckpt else self._roles_with_state()
        exports = self._hf_exports() if self.cfg.save_hf_ckpt else None
        if not roles and not exports:  # --disable_ds_ckpt without --save_hf_ckpt: OpenRLHF writes nothing either
            return
        self.store.save(it, roles, {**loop_state, "best": self.best}, exports, best=best)

    def save_if_best(self, it: int, evaluated: dict[str, float], loop_state: dict) -> None:
        """After an eval pass: a checkpoint in ``best_iter_N/`` when its metric beats the best so far."""
        key = self.best_key
        if key is None or (self.best is not None and not evaluated[key] > self.best["value"]):
            return
        logger.info(
            "iteration %d: new best %s %.4g (was %s): saving it",
            it,
            key,
            evaluated[key],
            "none" if self.best is None else f"{self.best['value']:.4g}",
        )
        self.best = {"key": key, "value": evaluated[key], "iteration": it}
        self.save(it, loop_state, best=True)

    def _hf_exports(self) -> dict:
        """``--save_hf_ckpt``: the policy's HF export into the checkpoint (``hf/``), the critic's in ``hf/critic``,
        written as the final export is (the critic's after the policy's, which replaces its folder)."""
        out = {"hf": lambda path: self.policy.call("export", path, self.tokenizer_path)}
        if self.critic is not None:
            out["hf/critic"] = lambda path: self.critic.call("export", path)
        return out

    def newest(self) -> int | None:
        """The iteration resume would take: the newest committed one whose files verify (nothing loaded), or
        None."""
        latest = self.store.usable()
        return int(latest.name.split("_")[-1]) if latest is not None else None

    def peek(self) -> dict | None:
        """The loop state resume would restore (JSON only: no role loaded), or None."""
        d = self.store.usable()
        return json.loads((d / LOOP_STATE).read_text()) if d is not None else None

    def load(self) -> dict | None:
        """Restore the newest committed iteration's roles; the loop's state it saved (None when there is none)."""
        state = self.store.load(self._roles_with_state())
        if state is None:
            logger.info("no checkpoint under %s: starting fresh", self.cfg.ckpt_path)
            return None
        best = state.get("best")  # checkpoints from before --best_metric_key have none
        self.best = best if best is not None and best["key"] == self.best_key else None
        return state


def loop_state(it: int, settings: dict, cursor: int, kl_coef: float | None, history: list, gap_warned: bool) -> dict:
    """What a checkpoint after iteration ``it`` keeps of the loop (the roles' states are the workers'): the run's
    settings (compared on resume: :func:`resumed_settings`), the prompt cursor, the KL coefficient, the metrics
    history, the gap alarm's state and this process's RNG state."""
    return {
        "iteration": it,
        "settings": settings,
        "cursor": cursor,
        "kl_coef": kl_coef,
        "history": history,
        "gap_warned": gap_warned,
        "rng": rng_state_json(),
    }


def resume_state(ckpt: LoopCheckpoints, num_iterations: int, ckpt_path: str | None, settings: dict) -> dict | None:
    """The loop's state of the newest committed checkpoint, every role's state restored (None when there is none).

    Refused before any role's state is read: a checkpoint at or past this run's last iteration (nothing would
    train). Settings other than the checkpoint's run are warned of (applied from the next iteration on)."""
    newest = ckpt.newest()
    if newest is not None and newest >= num_iterations:  # before any role's state is read
        raise InputError(
            f"--load_checkpoint: the newest checkpoint under --ckpt_path {ckpt_path} "
            f"is iteration {newest}, at or past this run's last ({num_iterations}): nothing "
            f"would train; raise --max_iterations (or --num_episodes) above {newest}, or give a "
            f"fresh --ckpt_path"
        )
    # before any role's state is read: a prompt order it cannot continue
    changed = resumed_settings((ckpt.peek() or {}).get("settings"), settings) if newest is not None else []
    state = ckpt.load()
    if state is not None and changed:
        logger.warning(
            "resumed with settings other than the checkpoint's, applied from iteration %d on: %s",
            state["iteration"] + 1,
            ", ".join(changed),
        )
    return state


def loop_checkpoints(cfg, *, policy, critic, eval_set: bool, tokenizer) -> LoopCheckpoints | None:
    """The loop's checkpoints under ``--ckpt_path`` (None without one), with the best eval pass's kept apart when
    ``--best_metric_key`` names an eval metric (:func:`best_metric_key`)."""
    if not cfg.ckpt.ckpt_path:
        return None
    best_key = best_metric_key(cfg, eval_set)  # --best_metric_key as eval/NAME (None: no best)
    tokenizer_path = getattr(tokenizer, "name_or_path", None)
    return LoopCheckpoints(cfg.ckpt, policy=policy, critic=critic, best_key=best_key, tokenizer_path=tokenizer_path)


def loop_settings(cfg, *, seed: int, prompts: int, train_batch_size: int) -> dict:
    """What a resume compares with the checkpoint's run (:func:`resumed_settings`): the prompt order's seed and
    set size, and the batch shape."""
    return {
        "seed": seed,
        "prompts": prompts,
        "rollout_batch_size": cfg.rollout_batch_size,
        "n_samples_per_prompt": cfg.sampling.n_samples_per_prompt,
        "train_batch_size": train_batch_size,
        "max_epochs": cfg.max_epochs,
    }
