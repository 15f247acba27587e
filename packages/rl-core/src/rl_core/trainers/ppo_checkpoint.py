"""The RL loop's checkpoints, from the loop's side: a mixin of :class:`rl_core.trainers.ppo.PPOTrainer`
(whose ``__init__`` sets every attribute used here) that hands :class:`~rl_core.rl.checkpoint.RLCheckpoints`
the roles with state (policy, critic), the loop's state and, with ``save_hf_ckpt``, the HF exports to
write into the checkpoint before its marker; and restores all of it on resume. The commit protocol
itself (layout, marker, pruning, crash safety) is :mod:`rl_core.rl.checkpoint`.

As OpenRLHF's PPO trainer: ``best_metric_key`` keeps one more checkpoint, of the eval pass with the
highest value of that metric so far (``best_iter_N/``, written right after that pass, the previous
best removed; the best value is in every checkpoint's loop state, so a resumed run keeps beating it);
``disable_ds_ckpt`` leaves the roles' DeepSpeed state out (only the HF exports and the loop state,
nothing at all without ``save_hf_ckpt``), so such a checkpoint cannot be resumed.
"""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)


class CheckpointPhase:
    def _roles_with_state(self) -> dict:
        return {name: g for name, g in (("policy", self.policy), ("critic", self.critic)) if g is not None}

    def save_checkpoint(self, it: int, best: bool = False) -> None:
        """One commit for iteration ``it``: every role's state, the loop's, then the marker
        (:class:`~rl_core.rl.checkpoint.RLCheckpoints`); ``best``: into ``best_iter_N/``."""
        from rl_core.checkpoint import rng_state_json

        cursor = self.cursor if self._ckpt_cursor is None else self._ckpt_cursor
        state = {"iteration": it, "cursor": cursor, "kl_coef": self.kl.value if self.kl is not None else None,
                 "history": self.history, "gap_warned": self._gap_warned, "rng": rng_state_json(),
                 "best": self._best}
        roles = {} if self.cfg.ckpt.disable_ds_ckpt else self._roles_with_state()
        exports = self._hf_exports() if self.cfg.ckpt.save_hf_ckpt else None
        if not roles and not exports:  # --disable_ds_ckpt without --save_hf_ckpt: OpenRLHF writes nothing either
            return
        self.ckpt.save(it, roles, state, exports, best=best)

    def _best_metric_key(self, eval_prompts) -> str | None:
        """``--best_metric_key`` checked at start: the ``eval/NAME`` it follows, None when no best is kept."""
        c = self.cfg
        name = c.eval.best_metric
        if name is None or (c.ckpt.ckpt_path and eval_prompts is not None):
            return name
        if not c.eval.best_metric_key:  # the default follows OpenRLHF's auto choice only where there is an eval pass
            return None
        raise ValueError(f"--best_metric_key {c.eval.best_metric_key!r} needs an eval pass and a folder to keep the "
                         f"checkpoint in: add --eval_dataset and --ckpt_path, or drop the flag")

    def save_best_checkpoint(self, it: int, evaluated: dict[str, float]) -> None:
        """After an eval pass: a checkpoint in ``best_iter_N/`` when its metric beats the best so far."""
        key = self._best_key
        if key is None or (self._best is not None and not evaluated[key] > self._best["value"]):
            return
        logger.info("iteration %d: new best %s %.4g (was %s): saving it", it, key, evaluated[key],
                    "none" if self._best is None else f"{self._best['value']:.4g}")
        self._best = {"key": key, "value": evaluated[key], "iteration": it}
        self.save_checkpoint(it, best=True)

    def _hf_exports(self) -> dict:
        """``--save_hf_ckpt``: the policy's HF export into the checkpoint (``hf/``), the critic's in ``hf/critic``,
        written as the final export is (the critic's after the policy's, which replaces its folder)."""
        tok_path = getattr(self.tokenizer, "name_or_path", None)
        out = {"hf": lambda path: self.policy.call("export", path, tok_path)}
        if self.critic is not None:
            out["hf/critic"] = lambda path: self.critic.call("export", path)
        return out

    def load_checkpoint(self) -> int:
        """Restore the newest committed iteration (every role and the loop); returns it (0 when none)."""
        from rl_core.checkpoint import rng_state_from_json, set_rng_state

        state = self.ckpt.load(self._roles_with_state())
        if state is None:
            logger.info("no checkpoint under %s: starting fresh", self.cfg.ckpt.ckpt_path)
            return 0
        self.cursor = state["cursor"]
        if self.kl is not None and state["kl_coef"] is not None:
            self.kl.value = state["kl_coef"]
        self.history = list(state["history"])
        self._gap_warned = state["gap_warned"]
        best = state.get("best")  # checkpoints from before --best_metric_key have none
        self._best = best if best is not None and best["key"] == self._best_key else None
        set_rng_state(rng_state_from_json(state["rng"]))  # last: the roles' loads set this process's RNG too
        return state["iteration"]
