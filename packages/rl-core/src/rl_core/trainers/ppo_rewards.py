"""The rewards of the PPO-family loop's samples, apart from how they are sampled (:mod:`rl_core.trainers.ppo_rollout`):
a plain reward function made a bounded runner (:func:`_bounded`), agent episodes' rewards and logs
(:func:`episode_rewards`, :func:`place_turn_rewards`), the shaping after scoring (:func:`shape_rewards`: turn
rewards, overlong and stop-properly penalties, clipping) and a scorer's answer (:class:`Scored`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from rl_algos import clip_rewards, overlong_penalty, stop_properly_penalty
from rl_core.rl.experience import Experience
from rl_rollout.rewards import RewardRunner

if TYPE_CHECKING:
    from rl_rollout.rewards import RewardCounts


def _bounded(fn):
    """A plain ``fn(prompt, response, label)`` as a :class:`rl_rollout.RewardRunner`: its calls run on threads,
    30 s each at most, failures counted (the runner's defaults)."""

    def call(prompt, response, label, **info):
        return fn(prompt, response, label)

    call.__qualname__ = getattr(fn, "__qualname__", type(fn).__name__)  # the name in failure messages
    call.__module__ = getattr(fn, "__module__", None) or "?"
    return RewardRunner(call)


def place_turn_rewards(samples, items: list[Experience]) -> torch.Tensor:
    """``--agent_turn_rewards``: ``item.turn_rewards_T`` (per token, 0 elsewhere) holds each policy turn's step reward
    on that turn's last token, for every turn but the episode's last policy turn, whose reward stays in the
    sample's scalar score (placed on the last response token, that turn's last token). Returns the rewards
    placed, per sample, to take out of the scalar score."""
    placed = []
    for s, item in zip(samples, items, strict=True):
        T, P = item.T, item.prompt_len
        token = torch.zeros(T, dtype=torch.float32)
        spans, rewards = s.info["action_spans"], s.info["turn_rewards"]
        for (start, end), r in zip(spans[:-1], rewards, strict=False):  # rewards[i]: the step after turn i
            if end > start:  # a turn of no tokens (none sampled) leaves its reward in the score
                token[P + end - 1] += r
        item.turn_rewards_T = token
        placed.append(token.sum().item())
    return torch.tensor(placed)


@dataclass
class Scored:
    """A scorer's answer for samples: the raw rewards ``scores_B`` (their sum over the run's scorers), what to
    log, the scores dynamic filtering judges (``filter_B``: the rewards, or a scorer's own scores) and the
    reward function's call counts (None without one)."""

    scores_B: torch.Tensor
    info: dict[str, float]
    filter_B: torch.Tensor
    counts: RewardCounts | None = None


def episode_rewards(samples) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
    """The episodes' rewards (sums of step rewards), their scores (OpenRLHF's last ``scores``, else the
    reward) and what to log: turns, policy and environment tokens, stop causes, the agent's extra logs."""
    rewards = torch.tensor([float(s.reward or 0.0) for s in samples])
    scores = torch.tensor([float((s.info["env_info"] or [{}])[-1].get("score", s.reward or 0.0)) for s in samples])
    k = len(samples)
    info = {
        "agent/reward_mean": rewards.mean().item(),
        "agent/turns": sum(s.info["turns"] for s in samples) / k,
        "agent/policy_tokens": sum(sum(s.loss_mask) for s in samples) / k,
        "agent/env_tokens": sum(len(s.loss_mask) - sum(s.loss_mask) for s in samples) / k,
        "agent/done_fraction": sum(s.info["stop_cause"] == "done" for s in samples) / k,
    }
    extra: dict[str, list[float]] = {}
    for s in samples:
        for step in s.info["env_info"]:
            for name, v in (step.get("extra_logs") or {}).items():
                extra.setdefault(name, []).append(float(v))
    info.update({f"agent_extra/{n}": sum(v) / len(v) for n, v in extra.items()})
    return rewards, scores, info


def shape_rewards(cfg, samples, items: list[Experience], scores: torch.Tensor, info: dict) -> torch.Tensor:
    """The raw rewards ``scores`` (B) shaped: agent turn rewards taken out (placed on their own tokens), the
    overlong and stop-properly penalties, the clipping; what it did is logged into ``info``."""
    c = cfg
    if (
        c.agent and c.agent.turn_rewards
    ):  # earlier turns' rewards go on their own last tokens; the last turn's stays here
        scores = scores - place_turn_rewards(samples, items)
    sh = c.shaping
    if sh.overlong_buffer_len is not None:
        lengths = torch.tensor([len(s.response_ids) for s in samples])
        penalty = overlong_penalty(
            lengths, c.sampling.max_new_tokens, sh.overlong_buffer_len, sh.overlong_penalty_factor
        )
        scores = scores + penalty
        info["overlong_penalty_mean"] = penalty.mean().item()
    if sh.stop_properly_penalty_coef is not None:  # ProRL, as OpenRLHF: cut samples (no EOS) lose their reward
        cut = torch.tensor([s.finish_reason == "length" for s in samples])
        scores = stop_properly_penalty(scores, cut, sh.stop_properly_penalty_coef)
        info["stop_properly_penalized"] = cut.float().mean().item()
    if sh.clip_range is not None:
        scores = clip_rewards(scores, *sh.clip_range)
    return scores
