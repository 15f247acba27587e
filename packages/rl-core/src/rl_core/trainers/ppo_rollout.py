"""The sampling half of the PPO-family loop: prompts in, scored samples out (:class:`Sampler`, whose
:meth:`~Sampler.collect` returns one iteration's :class:`RolloutBatch`).

The sampler takes ``rollout_batch_size`` prompts in the seeded order, generates ``n_samples_per_prompt``
samples each (single turns, or agent episodes with environment tokens masked), scores them
(reward functions, reward-model groups, episode rewards; the shaping after is
:mod:`rl_core.trainers.ppo_rewards`: overlong penalty, clipping), counts
failed reward calls and stops the run past ``reward_max_failure_rate``, applies dynamic
filtering over sampling rounds, and measures the staleness of asynchronous batches. The rest
of an iteration (experience, advantages, training, sync, checkpoints) is
:mod:`rl_core.trainers.ppo`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from rl_algos import filter_groups
from rl_core.rl.experience import Experience, make_item
from rl_core.trainers.ppo_rewards import (  # noqa: F401  (_bounded, place_turn_rewards: re-exported, their old home)
    Scored,
    _bounded,
    episode_rewards,
    place_turn_rewards,
    shape_rewards,
)
from rl_rollout import RolloutRequest
from rl_rollout.agents import AgentExecutor, AgentRequest
from rl_rollout.rewards import RewardError
from rl_rollout.vision import image_inputs, load_images

if TYPE_CHECKING:
    from rl_rollout.rewards import RewardCounts

logger = logging.getLogger(__name__)


def _images_of(prompt: dict) -> dict | None:
    """A vision-language prompt's images as a request carries them (``{"image": [PIL images]}``), or None."""
    if not prompt.get("images"):
        return None

    return {"image": load_images(prompt["images"])}


@dataclass
class RolloutBatch:
    """One iteration's scored samples: ``prompts`` (P rows of the prompt set), ``samples`` (P x n
    ``RolloutSample``, a prompt's n in a row), their experience ``items`` (one dict per sample, the workers'
    input: :mod:`rl_core.rl.experience`), the shaped rewards ``scores_B`` and the phase's ``metrics``
    (seconds, reward parts, failures, dynamic filtering); ``cursor``: the prompt cursor a checkpoint taken
    after this batch resumes from."""

    prompts: list[dict]
    samples: list
    items: list[Experience]
    scores_B: torch.Tensor
    metrics: dict[str, float] = field(default_factory=dict)
    cursor: int = 0

    def sample_metrics(self) -> dict[str, float]:
        """The batch's rewards (mean, std), response lengths (mean, max) and the share cut at the length limit."""
        scores, samples = self.scores_B, self.samples
        lengths = torch.tensor([len(s.response_ids) for s in samples], dtype=torch.float32)
        return {
            "reward_mean": scores.mean().item(),
            "reward_std": scores.std().item() if len(scores) > 1 else 0.0,
            "response_length": lengths.mean().item(),
            "response_length_max": lengths.max().item(),
            "truncated": sum(s.finish_reason == "length" for s in samples) / len(samples),
        }


class Sampler:
    """Prompts in the seeded order -> samples (single turns, or agent episodes) -> rewards, shaped and filtered.

    ``cfg``: the run's :class:`~rl_core.trainers.ppo_config.PPOConfig` (its sampling, shaping, agent, dynamic
    filtering, over-sampling and reward-failure settings); ``rollout``: ``generate(requests)``; ``prompts``: a
    PromptDataset; ``reward_fn``: a scorer with ``score(prompts, responses, labels)`` (or None);
    ``reward_model``: a worker group scoring items (or None), called through ``sharded(group, method, items)``
    over ``reward_ranks`` data-parallel ranks; ``agent``: a factory of environments (or None); ``metrics``:
    where the failed reward calls of a stopping iteration are logged. State: ``cursor`` (prompts taken so
    far) and ``group_buffer`` (over-sampled groups waiting for a batch), both kept by checkpoints."""

    def __init__(
        self,
        cfg,
        *,
        rollout,
        prompts,
        tokenizer,
        seed: int,
        eos: list[int],
        reward_fn=None,
        reward_model=None,
        reward_ranks: int = 1,
        sharded: Callable | None = None,
        agent=None,
        metrics=None,
        agent_cmd=None,
    ):
        self.cfg, self.rollout, self.prompts, self.tokenizer, self.seed, self.eos = (
            cfg,
            rollout,
            prompts,
            tokenizer,
            seed,
            eos,
        )
        self.reward_fn, self.reward_model, self.reward_ranks, self.sharded = (
            reward_fn,
            reward_model,
            reward_ranks,
            sharded,
        )
        self.agent, self.metrics = agent, metrics
        self.agent_cmd = agent_cmd  # an AgentCmdEpisodes (rl_core.trainers.ppo_agent_cmd), or None
        self.cursor = 0  # prompts consumed so far (over epochs of seeded permutations)
        self.group_buffer: list[tuple] = []  # over-sampled groups waiting for a batch (generate_batch_size)
        self.generate_batch_size = cfg.async_rl.generate_batch_size if cfg.async_rl else None

    def take_prompts(self, k: int) -> list[dict]:
        n = len(self.prompts)
        out: list[dict] = []
        while len(out) < k:
            epoch, i = divmod(self.cursor, n)
            order = torch.randperm(n, generator=torch.Generator().manual_seed(self.seed + epoch)).tolist()
            out.append(self.prompts[order[i]])
            self.cursor += 1
        return out

    # ----- rollout and rewards --------------------------------------------------------------

    def generate(self, prompts: list[dict], seed: int, *, n: int | None = None, temperature: float | None = None):
        """``n`` samples per prompt (default: the run's); the eval pass gives its own ``n`` and ``temperature``."""

        sampling = self.cfg.sampling
        over: dict[str, float] = {"n": n} if n is not None else {}
        if temperature is not None:
            over["temperature"] = temperature
        params = sampling.params(stop_token_ids=self.eos, seed=seed, **over)
        if self.agent is not None:
            groups = self.episodes(prompts, params)
        elif self.agent_cmd is not None:  # the program decides its calls' sampling; n episodes per prompt
            if any(p.get("images") for p in prompts):
                raise ValueError("agent programs with images are not built: drop --image_key or --agent_cmd")
            groups = self.agent_cmd.groups(prompts, params.n)
        else:
            groups = self.rollout.generate(
                [RolloutRequest(list(p["prompt_ids"]), params, multi_modal_data=_images_of(p)) for p in prompts]
            )
        if len(groups) != len(prompts) or any(len(g) != params.n for g in groups):
            raise RuntimeError(
                f"the rollout returned {[len(g) for g in groups]} samples for {len(prompts)} prompts x n={params.n}"
            )
        return [s for g in groups for s in g]

    def episodes(self, prompts: list[dict], params):
        """Multi-turn episodes (rl-rollout's AgentExecutor): environment tokens carry loss mask 0. A
        vision-language run (the prompts' processor, ``--image_key``) hands the executor its processor: the
        prompts' images and the observations' go with every turn, and each sample carries them all."""

        c = self.cfg
        executor = AgentExecutor(
            self.rollout,
            self.tokenizer,
            self.agent,
            max_turns=c.agent.max_turns,
            max_len=c.agent.max_len,
            params=params,
            processor=getattr(self.prompts, "processor", None),
        )
        return executor.run(
            [
                AgentRequest(
                    list(p["prompt_ids"]),
                    prompt=p.get("prompt"),
                    label=p.get("label"),
                    images=(_images_of(p) or {}).get("image", []),
                )
                for p in prompts
            ]
        )

    def rewards(self, prompts: list[dict], samples, items: list[Experience]) -> Scored:
        """The run's rewards (:meth:`score`), then the length penalties and the clipping. Dynamic filtering
        judges the raw rewards (or the scorer's own scores: ``filter_B``), before penalties and clipping, as
        OpenRLHF does (its filter reads each sample's ``scores``; the overlong penalty lands on the rewards only)."""
        raw = self.score(prompts, samples, items, self.cfg.sampling.n_samples_per_prompt)
        scores, info = raw.scores_B, raw.info
        scores = shape_rewards(self.cfg, samples, items, scores, info)
        return Scored(scores, info, raw.filter_B, raw.counts)

    def score(self, prompts: list[dict], samples, items: list[Experience], n: int) -> Scored:
        """Raw rewards of ``n`` samples per prompt: episode rewards, the reward function's, the reward model's
        (their sum). Also the eval pass's scorer (:mod:`rl_core.trainers.ppo_eval`)."""
        parts, info = [], {}
        own = None  # the scorer's own scores for dynamic filtering, when it reports them
        counts = None
        if self.agent is not None:
            rewards, agent_scores, agent_info = episode_rewards(samples)
            parts.append(rewards)
            info.update(agent_info)
            if self.reward_fn is None and self.reward_model is None:
                own = agent_scores
        program = None  # --agent_cmd: which samples' programs printed a reward (the reward function scores the rest)
        if self.agent_cmd is not None:
            program = torch.tensor([s.reward is not None for s in samples])
            parts.append(torch.tensor([float(s.reward or 0.0) for s in samples]))
            info.update(self.agent_cmd.last_metrics)
            info["agent_cmd/reward_mean"] = parts[-1].mean().item()
        if self.reward_fn is not None:
            ps = [prompts[i // n]["prompt"] for i in range(len(samples))]
            labels = [prompts[i // n].get("label") for i in range(len(samples))]
            texts = [self.tokenizer.decode(s.response_ids, skip_special_tokens=True) for s in samples]
            r = self.reward_fn.score(ps, texts, labels)
            counts = getattr(self.reward_fn, "last_counts", None)
            parts.append(torch.tensor(r, dtype=torch.float32))
            if program is not None:  # the transcripts of programs that printed no reward (dropped ones: 0)
                dropped = torch.tensor([bool(s.info.get("dropped")) for s in samples])
                parts[-1] = torch.where(program | dropped, 0.0, parts[-1])
            info["reward_fn_mean"] = parts[-1].mean().item()
            record = self.reward_fn.last_record() if callable(getattr(self.reward_fn, "last_record", None)) else None
            if record is not None:
                info.update({f"reward_extra/{k}": v for k, v in record.log_means().items()})
                if record.scores is not None and self.reward_model is None:
                    own = torch.tensor(record.scores, dtype=torch.float32)
        if self.reward_model is not None:
            pad = -len(items) % self.reward_ranks  # eval sets need not split over the ranks: repeat one
            if self.sharded is None:
                raise ValueError("Sampler: a reward_model needs sharded (the call that spreads items over its ranks)")
            scored = self.sharded(self.reward_model, "score", items + items[-1:] * pad)
            parts.append(torch.tensor(scored[: len(items)], dtype=torch.float32))
            info["reward_model_mean"] = parts[-1].mean().item()
        if not parts:  # pure distillation (--distill_only) without a reward source: the teacher is the signal
            parts.append(torch.zeros(len(samples), dtype=torch.float32))
        total = sum(parts[1:], parts[0])
        return Scored(total, info, total if own is None else own, counts)

    def sample_round(self, k: int, seed: int) -> tuple[RolloutBatch, Scored, float]:
        """One round: ``k`` prompts, their samples and items, scored; and the seconds the rewards took."""
        prompts = self.take_prompts(k)
        samples = self.generate(prompts, seed)
        items = [make_item(s.prompt_ids, s.response_ids, s.loss_mask, s.rollout_logprobs) for s in samples]
        self.attach_images(prompts, items, samples)
        t0 = time.perf_counter()
        scored = self.rewards(prompts, samples, items)
        return RolloutBatch(prompts, samples, items, scored.scores_B), scored, time.perf_counter() - t0

    def attach_images(self, prompts: list[dict], items: list[Experience], samples=()) -> None:
        """Vision-language prompts: each item gets its prompt's image tensors (``image_inputs``), from the same
        images and image processor the engine generated with, for the policy's and reference's forwards. An
        agent episode whose observations carried images has its own list (its sample's ``multi_modal_data``:
        the prompt's images, then the observations'), which its item gets instead."""
        own = [s.multi_modal_data for s in samples]
        if not any(p.get("images") for p in prompts) and not any(own):
            return

        n = len(items) // len(prompts)
        proc = self.prompts.image_processor
        if any(own):
            done: dict[tuple[int, ...], dict] = {}  # episodes with the same images (objects) share one processing
            for item, mm in zip(items, own, strict=True):
                if mm and mm.get("image"):
                    key = tuple(map(id, mm["image"]))  # the objects stay alive in ``own`` for the whole call
                    if key not in done:
                        done[key] = image_inputs(proc, mm["image"])
                    item.image_inputs = done[key]
            return
        for g, p in enumerate(prompts):
            mm = _images_of(p)
            if mm:
                tensors = image_inputs(proc, mm["image"])
                for item in items[g * n : (g + 1) * n]:
                    item.image_inputs = tensors

    def collect(self, it: int) -> RolloutBatch:
        """Samples of ``rollout_batch_size`` prompts, filtered dynamically when asked; per-phase seconds.

        Over-sampling (``generate_batch_size`` G > ``rollout_batch_size``, async only): when the buffer of groups
        left by earlier rounds cannot fill the batch, one round generates G prompts; the batch takes the oldest
        groups and the rest wait, in prompt order, for the next iterations (``oversample/buffered``)."""

        c, n, want = self.cfg, self.cfg.sampling.n_samples_per_prompt, self.cfg.rollout_batch_size
        buffer = self.group_buffer
        kept: list[tuple] = buffer[:want]  # (prompt, samples, items, scores, cursor position)
        del buffer[:want]
        dropped: list[tuple] = []
        stats = {"generate_s": 0.0, "reward_s": 0.0, "rounds": 0, "groups_seen": 0}
        counts: list[RewardCounts] = []  # the reward scorer's counts, one per round
        kept_new = 0
        for r in range(c.dynamic_filtering.max_rounds if c.dynamic_filtering else 1):
            if len(kept) >= want:
                break
            t0 = time.perf_counter()
            need = want - len(kept)
            size = max(need, self.generate_batch_size or 0) if r == 0 else need  # refill rounds: the shortfall only
            first = self.cursor
            batch, scored, reward_s = self.sample_round(size, self.seed + 1000 * it + r)
            prompts, samples, items, scores = batch.prompts, batch.samples, batch.items, batch.scores_B
            stats["generate_s"] += time.perf_counter() - t0 - reward_s
            stats["reward_s"] += reward_s
            stats["rounds"] += 1
            stats["groups_seen"] += size
            stats.update(scored.info)
            if scored.counts is not None:
                counts.append(scored.counts)
            groups = [
                (
                    prompts[g],
                    samples[g * n : (g + 1) * n],
                    items[g * n : (g + 1) * n],
                    scores[g * n : (g + 1) * n],
                    first + g,
                )
                for g in range(size)
            ]
            if not c.dynamic_filtering:
                kept += groups
                kept_new += size
                break
            keep = filter_groups(
                scored.filter_B, n, mean_range=tuple(c.dynamic_filtering.reward_range)
            ).keep_groups.tolist()
            kept += [g for g, k in zip(groups, keep, strict=True) if k]
            kept_new += sum(keep)
            dropped += [g for g, k in zip(groups, keep, strict=True) if not k]
        if c.dynamic_filtering and stats["groups_seen"]:
            stats["dynamic/kept_fraction"] = kept_new / stats["groups_seen"]
        if c.dynamic_filtering:
            filled = max(0, want - len(kept))
            if filled:
                logger.warning(
                    "iteration %d: dynamic filtering kept %d of %d groups in %d rounds; %d filtered-out "
                    "groups fill the batch (raise --dynamic_filtering_max_rounds or widen the range)",
                    it,
                    len(kept),
                    want,
                    stats["rounds"],
                    filled,
                )
            stats["dynamic/filled"] = filled
            kept += dropped[:filled]
        buffer[:0] = kept[want:]  # over-sampled groups, oldest first, for the next iterations
        kept = kept[:want]
        if self.generate_batch_size is not None and self.generate_batch_size > want:
            stats["oversample/buffered"] = len(buffer)
        stats["dynamic/rounds"] = stats.pop("rounds")
        stats.pop("groups_seen")
        if counts:
            self._check_reward_calls(it, sum(counts[1:], counts[0]), stats)
        # a checkpoint after this batch resumes right after it, or at the first over-sampled group still
        # buffered (a resumed run generates those again)
        return RolloutBatch(
            [g[0] for g in kept],
            [s for g in kept for s in g[1]],
            [x for g in kept for x in g[2]],
            torch.cat([g[3] for g in kept]),
            stats,
            buffer[0][4] if buffer else self.cursor,
        )

    def _check_reward_calls(self, it: int, counts, stats: dict) -> None:
        """Log the iteration's failed reward calls; stop the run when more than the tolerated fraction failed."""
        stats.update(counts.metrics("reward/"))
        if not counts.failures:
            return
        limit = self.cfg.reward_max_failure_rate
        summary = (
            f"{counts.failures} of {counts.calls} reward calls failed (errors {counts.errors}, timeouts "
            f"{counts.timeouts}, non-finite {counts.nonfinite})"
        )
        if counts.failures > limit * counts.calls:
            self.metrics.log(it, {"rl/" + k: v for k, v in stats.items() if k.startswith("reward/")})
            if not self.cfg.async_rl:  # async: the trainer thread, still logging, closes it when it re-raises
                self.metrics.close()
            raise RewardError(
                f"iteration {it}: {summary}, more than --reward_max_failure_rate {limit} allows; "
                f"first: {counts.first_failure}. Fix the reward function or the data it reads, or "
                f"raise --reward_max_failure_rate to train on --reward_fallback for failed calls"
            )
        logger.warning("iteration %d: %s, each scored with the fallback; first: %s", it, summary, counts.first_failure)

    def staleness(self, samples, trained: int) -> tuple[dict[str, float], list[bool]]:
        """How many versions each sample's policy lags the one that trains (``trained``), against the bound."""
        lag = [trained - s.policy_version for s in samples]
        bound = self.cfg.staleness_bound
        violations = sum(x > bound or x < 0 for x in lag)
        if violations:
            logger.warning(
                "%d samples break the staleness bound %d: versions %s trained at %d",
                violations,
                bound,
                sorted({s.policy_version for s in samples}),
                trained,
            )
        out = {
            "staleness_mean": sum(lag) / len(lag),
            "staleness_max": float(max(lag)),
            "staleness_violations": float(violations),
            "policy_version_generated": float(trained - max(lag)),
            "policy_version_trained": float(trained),
        }
        tagged = [s.info["token_versions"] for s in samples if "token_versions" in s.info]
        if tagged:  # partial rollouts: responses that span a weight update, and the lag per token
            out["partial_fraction"] = sum(len(set(v)) > 1 for v in tagged) / len(tagged)
            tokens = [trained - v for vs in tagged for v in vs]
            out["token_staleness_mean"] = sum(tokens) / max(len(tokens), 1)
        return out, [x == 0 for x in lag]
