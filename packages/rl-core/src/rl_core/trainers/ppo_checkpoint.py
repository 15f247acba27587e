"""The RL loop's checkpoints, from the loop's side: a mixin of :class:`rl_core.trainers.ppo.PPOTrainer`
(whose ``__init__`` sets every attribute used here) that hands :class:`~rl_core.rl.checkpoint.RLCheckpoints`
the roles with state (policy, critic), the loop's state and, with ``save_hf_ckpt``, the HF exports to
write into the checkpoint before its marker; and restores all of it on resume. The commit protocol
itself (layout, marker, pruning, crash safety) is :mod:`rl_core.rl.checkpoint`.
"""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)


class CheckpointPhase:
    def _roles_with_state(self) -> dict:
        return {name: g for name, g in (("policy", self.policy), ("critic", self.critic)) if g is not None}

    def save_checkpoint(self, it: int) -> None:
        """One commit for iteration ``it``: every role's state, the loop's, then the marker
        (:class:`~rl_core.rl.checkpoint.RLCheckpoints`)."""
        from rl_core.checkpoint import rng_state_json

        cursor = self.cursor if self._ckpt_cursor is None else self._ckpt_cursor
        state = {"iteration": it, "cursor": cursor, "kl_coef": self.kl.value if self.kl is not None else None,
                 "history": self.history, "gap_warned": self._gap_warned, "rng": rng_state_json()}
        self.ckpt.save(it, self._roles_with_state(), state, self._hf_exports() if self.cfg.save_hf_ckpt else None)

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
            logger.info("no checkpoint under %s: starting fresh", self.cfg.ckpt_path)
            return 0
        self.cursor = state["cursor"]
        if self.kl is not None and state["kl_coef"] is not None:
            self.kl.value = state["kl_coef"]
        self.history = list(state["history"])
        self._gap_warned = state["gap_warned"]
        set_rng_state(rng_state_from_json(state["rng"]))  # last: the roles' loads set this process's RNG too
        return state["iteration"]
