"""Steps 3 and 4 of the PPO-family loop (:mod:`rl_core.trainers.ppo`): the experience forwards and the
advantages (:class:`ExperienceMaker`, OpenRLHF's name), and the alarm on the gap between the engine's and the
trainer's log-probs (:class:`GapAlarm`), both with the loop's groups and settings given explicitly."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import cast

import torch

from rl_algos import approx_kl, distill_advantages, masked_mean, masked_whiten
from rl_core.rl.experience import Experience, TokenField, collate, rows
from rl_core.rl.groups import concurrently
from rl_core.rl.teacher import teacher_metrics

logger = logging.getLogger(__name__)


def trains_on_policy(cfg, train_batch_size: int, *, kl_penalty: bool) -> bool:
    """One epoch and one global batch per iteration, no KL reward penalty: the policy trains once on weights
    the engine sampled with, so its old log-probs are its train forward's (detached): skip that forward.
    Asynchronous training samples with older weights than the ones that train: never on-policy. Distillation as an
    advantage needs the student's log-probs before training (the teacher's gap is the advantage)."""
    distill_advantage = cfg.distill is not None and cfg.distill.mode == "advantage"
    return (
        cfg.max_epochs == 1
        and cfg.rollout_batch_size * cfg.sampling.n_samples_per_prompt == train_batch_size
        and not kl_penalty
        and cfg.freezing_actor_steps == 0
        and not cfg.async_rl
        and not distill_advantage
    )


class GapAlarm:
    """Warns (in full once, then in one line) and counts (``logprob_gap_alarm``) when the mean |trainer - engine|
    log-prob gap of a batch exceeds ``threshold`` (0: off); ``warned`` is kept by checkpoints."""

    def __init__(self, threshold: float):
        self.threshold, self.warned = threshold, False

    def check(self, gap: float) -> dict[str, float]:
        """The engine sampled from another distribution than the trainer scores: say so, loudly."""
        if not self.threshold or gap <= self.threshold:
            return {"logprob_gap_alarm": 0.0}
        if self.warned:
            logger.warning(
                "rollout log-prob gap %.3g > --logprob_gap_alarm %.3g again (causes: see the first warning)",
                gap,
                self.threshold,
            )
            return {"logprob_gap_alarm": 1.0}
        self.warned = True
        logger.warning(
            "rollout log-prob gap %.3g > --logprob_gap_alarm %.3g: the engine samples from another distribution than "
            "the trainer's. Likely causes: stale weights in the engine (a weight sync that missed tensors, e.g. a "
            "tied LM head; run with --verify_weights), a dtype mismatch (engine bf16, trainer fp32: check --bf16), "
            "or a temperature/top-p mismatch (top_p < 1 changes the engine's log-probs)",
            gap,
            self.threshold,
        )
        return {"logprob_gap_alarm": 1.0}


class ExperienceMaker:
    """The experience of a batch of items: ``policy``, ``ref``, ``critic``, ``teacher`` are worker groups (all
    but the policy may be None) called through ``sharded(group, method, items)``, at the same time when ``parallel``;
    ``on_policy``: the policy's train forward gives the old log-probs (skip that forward here); ``kl``: the
    reward penalty's controller (None: KL as a loss, or off); ``cfg``: the run's PPOConfig (its estimator,
    agent turn rewards, importance correction)."""

    def __init__(
        self,
        cfg,
        *,
        policy,
        ref,
        critic,
        sharded: Callable,
        parallel: bool,
        on_policy: bool,
        pad_id: int,
        kl,
        gap_alarm: GapAlarm,
        teacher=None,
    ):
        self.cfg, self.policy, self.ref, self.critic, self.sharded = cfg, policy, ref, critic, sharded
        self.parallel, self.on_policy, self.pad_id, self.kl, self.gap_alarm = (
            parallel,
            on_policy,
            pad_id,
            kl,
            gap_alarm,
        )
        self.teacher = teacher

    def forwards(self, items: list[Experience]) -> None:
        """Step 3: the old log-probs (unless on-policy), the reference's and the teacher's log-probs and the
        critic's values, into each item; the groups on different devices compute at the same time."""
        calls: dict[str, Callable[[], list]] = {}
        if not self.on_policy:
            calls["old_logprobs"] = lambda: self.sharded(self.policy, "logprobs", items)
        if self.ref is not None:
            calls["ref_logprobs"] = lambda: self.sharded(self.ref, "logprobs", items)
        topk = self.cfg.distill.teacher_topk if self.teacher is not None else None
        if self.teacher is not None and topk is None:
            calls["teacher_logprobs"] = lambda: self.sharded(self.teacher, "logprobs", items)
        if topk is not None:  # the sampled tokens' log-probs and the top-k, from one teacher forward
            calls["teacher_topk"] = lambda: self.sharded(self.teacher, "topk_logprobs", items, topk)
        if self.critic is not None:
            calls["values"] = lambda: self.sharded(self.critic, "values", items)
        if self.parallel:
            results = dict(zip(calls, concurrently(*calls.values()), strict=True))
        else:
            results = {k: f() for k, f in calls.items()}
        for name, per_item in results.items():
            for it, t in zip(items, per_item, strict=True):
                if name == "teacher_topk":
                    it.teacher_logprobs_T, it.teacher_topk_ids_RK, it.teacher_topk_logprobs_RK = (
                        t.logprobs_T,
                        t.ids_RK,
                        t.logprobs_RK,
                    )
                else:
                    it.set_token(cast(TokenField, name), t)

    def advantages(
        self, items: list[Experience], scores: torch.Tensor, fresh: list[bool] | None = None
    ) -> dict[str, float]:
        """Step 4: KL (as a reward penalty with the controller's coefficient), the estimator, the whitening, into
        each item (``advantages``, ``returns``); the metrics. ``fresh`` (async): which items the policy that
        trains generated; only they measure the engine's gap."""

        c = self.cfg
        turns = bool(c.agent and c.agent.turn_rewards)
        fields: list[TokenField] = ["ref_logprobs", "values", "rollout_logprobs"]
        fields += [] if self.on_policy else ["old_logprobs"]
        fields += ["turn_rewards"] if turns else []
        fields += ["teacher_logprobs"] if self.teacher is not None else []
        b = collate(items, self.pad_id, fields)
        mask = b.loss_mask_BT.float()
        out: dict[str, float] = {}
        token_rewards = None
        if self.ref is not None and not self.on_policy:  # on-policy: the KL is a loss, measured in training
            kl = approx_kl(b.token("old_logprobs"), b.token("ref_logprobs"), c.kl.estimator, mask=mask)
            out["kl"] = masked_mean(kl, mask).item()
            if self.kl is not None:
                out["kl_coef"] = self.kl.value
                token_rewards = -self.kl.value * kl * mask
        if turns:  # each policy turn's step reward on its last token (ppo_rollout.place_turn_rewards)
            turn_BT = b.token("turn_rewards")
            token_rewards = turn_BT if token_rewards is None else token_rewards + turn_BT
            for it in items:
                it.turn_rewards_T = None  # not the workers' to train on
        if c.distill is not None and c.distill.only:  # pure distillation: the task's rewards are logged only
            scores = torch.zeros_like(scores)
        est = c.advantage  # the estimator gets the loop's inputs it declares, and its own parameters (--estimator_args)
        adv = est.spec(
            scores,
            mask,
            **est.inputs(
                n_samples=c.sampling.n_samples_per_prompt,
                token_rewards_BT=token_rewards,
                values_BT=b.token("values") * mask if c.needs_critic else None,
            ),
        )
        a = masked_whiten(adv.advantages, mask, scale=not est.no_std_norm) if est.whitens else adv.advantages
        if self.teacher is not None:
            out.update(self._distill(b, mask, items))
            if c.distill.mode == "advantage":  # each token's own teacher gap, whitened over the batch's tokens
                gap = distill_advantages(b.token("old_logprobs"), b.token("teacher_logprobs"), mask)
                a = a + c.distill.coef * masked_whiten(gap, mask) * mask
        for item, x in zip(items, rows(a * mask, items), strict=True):
            item.advantages_T = x
        if c.needs_critic:
            for item, x in zip(items, rows(adv.returns * mask, items), strict=True):
                item.returns_T = x
            out["value_mean"] = masked_mean(b.token("values"), mask).item()
            out["return_mean"] = masked_mean(adv.returns, mask).item()
        out["advantage_abs_mean"] = masked_mean(a.abs(), mask).item()
        has_rollout = [it.rollout_logprobs_T is not None for it in items]
        if all(has_rollout) and not self.on_policy:  # on-policy: measured in the policy's train forward
            m = mask.clone()
            m[:, 0] = 0
            gap_BT = (b.token("old_logprobs") - b.token("rollout_logprobs")).abs()
            if fresh is not None:  # older policies' samples differ by training, not by a faulty sync
                f = torch.tensor(fresh, dtype=m.dtype).unsqueeze(1)
                if (m * (1 - f)).sum() > 0:
                    out["stale_logprob_gap"] = masked_mean(gap_BT, m * (1 - f)).item()
                m = m * f
            if m.sum() > 0:
                out["rollout_logprob_gap"] = masked_mean(gap_BT, m).item()
                out.update(self.gap_alarm.check(out["rollout_logprob_gap"]))
        if c.is_correction_type and not all(has_rollout):
            raise ValueError(
                f"--is_correction {c.is_correction_type} needs the engine's rollout logprobs; this "
                "rollout returned samples without them"
            )
        return out

    def _distill(self, b, mask: torch.Tensor, items: list[Experience]) -> dict[str, float]:
        """The teacher's metrics against the student's log-probs at sampling time: the old ones, else (on-policy,
        loss mode) the engine's; none when neither is at hand."""
        if not self.on_policy:
            student = b.token("old_logprobs")
        elif all(it.rollout_logprobs_T is not None for it in items):
            student = b.token("rollout_logprobs")
        else:
            return {}
        return teacher_metrics(student, b.token("teacher_logprobs"), mask)
