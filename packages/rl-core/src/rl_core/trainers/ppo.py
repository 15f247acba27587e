"""The PPO-family RL loop (PPO with a critic, GRPO, REINFORCE++, RLOO, Dr.GRPO) over worker groups.

One class owns the loop's state and reads top to bottom (:meth:`PPOTrainer._iteration`); its parts are
objects with explicit inputs and outputs: steps 1-2 below (prompts to scored, filtered samples: a
:class:`~rl_core.trainers.ppo_rollout.RolloutBatch`) are the :class:`~rl_core.trainers.ppo_rollout.Sampler`,
steps 3-4 (experience forwards, advantages) :class:`~rl_core.trainers.ppo_experience.ExperienceMaker`, the eval
pass :class:`~rl_core.trainers.ppo_eval.EvalPass` and the checkpoints of step 6
:class:`~rl_core.trainers.ppo_checkpoint.LoopCheckpoints`; this module holds the rest of the iteration.

One loop, two transports: the roles are worker groups (:mod:`rl_core.rl.groups`),
in-process (:class:`~rl_core.rl.groups.LocalGroup`, ``rl ppo``) or Ray actors
(rl-placement's ``RayActorGroup``, ``rl ppo-ray``). One iteration:

1. ``rollout_batch_size`` prompts x ``n_samples_per_prompt`` samples from the rollout
   (an engine, an ``EnginePool`` or :class:`~rl_core.rl.groups.GroupRollout`).
2. Rewards: a reward function (``fn(prompt, response, label)``, run by a
   ``rl_rollout.RewardRunner`` on threads, 30 s per call; or anything with
   ``score(prompts, responses, labels)`` such as a configured ``RewardRunner``) and/or
   a reward-model group; optional clipping. A scorer's failed calls (its ``last_counts``)
   are logged per iteration; more than ``reward_max_failure_rate`` of them stops the run
   with the first failure's message (:class:`rl_rollout.rewards.RewardError`). Dynamic filtering (DAPO) drops groups
   whose mean reward is outside ``dynamic_filtering_reward_range`` or that have no
   variance, and samples new prompts (at most ``dynamic_filtering_max_rounds``
   rounds; short of that, dropped groups fill the batch and the count is logged).
   A scorer with ``last_record()`` (OpenRLHF reward files and servers, whose
   ``reward_func`` may return ``{"rewards", "scores", "extra_logs"}``) may report scores
   of its own: they drive the filter instead of the rewards, as in OpenRLHF (when it is
   the only reward); its extra logs are averaged into ``reward_extra/NAME``.
3. Experience: old logprobs (policy), reference logprobs, critic values; the
   groups on different GPUs compute at the same time.
4. Advantages (rl-algos): KL to the reference as a per-token reward penalty
   (``init_kl_coef``, adaptive with ``kl_target``) or as a loss (``use_kl_loss``),
   the chosen estimator, batch whitening where its rl-algos registry entry says so.
5. Train the critic, then the policy (``max_epochs`` passes, global batches of
   ``train_batch_size`` split over each group's data-parallel ranks the same way
   whatever their number; an ``--agent_cmd`` episode that could not merge brings one item per call into its
   global batch, with the episode's advantage: :mod:`rl_core.trainers.ppo_per_call`).
   With ``deepspeed_enable_sleep`` the policy's and critic's DeepSpeed states sleep in host memory from the
   start of the iteration (before step 1's generation) and are reloaded before step 3 (:mod:`rl_core.rl.ds_sleep`;
   ``ds_sleep_s``, ``ds_wake_s``, ``ds_sleep_gb``, on CUDA ``ds_sleep_freed_gb``); with ``async_train`` all but
   the model weights sleep, through step 4, and are reloaded here (OpenRLHF's split).
6. Weight sync policy -> engines (version = iteration), then metrics and a
   checkpoint every ``save_steps`` iterations: the policy's, the critic's and the
   loop's state committed together by one marker (:mod:`rl_core.rl.checkpoint`),
   resumable with ``load_checkpoint`` from the newest committed iteration (with ``save_hf_ckpt`` the
   checkpoint also holds the HF exports). With an eval set, the eval pass (:mod:`rl_core.trainers.ppo_eval`)
   runs after the sync every ``eval_steps`` iterations and after the last one (with ``async_train`` too: on
   the version just synced, the producer drained and paused meanwhile; ``eval/weight_version`` names it).

Asynchronous training (``async_train``, :mod:`rl_core.rl.pipeline`): a producer thread runs
step 1 and 2 for the next iterations while this thread runs 3 to 6; a batch waits to be
generated until the policy it will train is at most ``max_staleness`` versions newer than the
engines' (``rl/staleness_mean``, ``staleness_max``, ``staleness_violations`` (0 by
construction), ``policy_version_generated``, ``policy_version_trained``, ``rollout_wait_s``).
Its samples are off-policy: old log-probs always come from the policy's forward (no on-policy
shortcut) and the engine's sampling is corrected with ``is_correction`` (``tis`` unless set);
the log-prob gap alarm watches only the samples the training policy generated
(``stale_logprob_gap``: the others). The engines cannot sleep in this mode; DeepSpeed sleep keeps the model
weights on the accelerator (step 5).

Metrics per iteration (``metrics.jsonl``, TensorBoard, ``curves.png``, the console
bar): rewards, reward-call failures (``reward/failures``, ``errors``, ``timeouts``,
``nonfinite``), lengths, truncation, KL, losses, clip fractions, dynamic-filtering
counts, with a token budget the samples over it (``budget/over_train``, ``budget/over_forward``, each alone in
a micro-batch; warned once per phase), the policy-vs-engine logprob gap (a stale or wrong sync shows there),
sync GB/s and seconds per phase.
"""

from __future__ import annotations

import logging
import math
import time
from pathlib import Path

from tqdm import tqdm

from rl_core.configs import check_eval_set
from rl_core.folder_lock import hold
from rl_core.metrics import MetricsLogger
from rl_core.preflight import check_rl_arithmetic
from rl_core.rl import ds_sleep
from rl_core.rl.batching import BudgetWatch, MicroBatchConfig
from rl_core.rl.experience import Experience, ring_shards
from rl_core.rl.groups import LocalGroup
from rl_core.rl.pipeline import AsyncRollout, start_partial_rollout
from rl_core.rng_state import rng_state_from_json, set_rng_state
from rl_core.trainers.ppo_agent_cmd import AgentCmdEpisodes
from rl_core.trainers.ppo_checkpoint import loop_checkpoints, loop_settings, loop_state, resume_state
from rl_core.trainers.ppo_checks import check_combinations, check_parts
from rl_core.trainers.ppo_config import PPOConfig
from rl_core.trainers.ppo_eval import EvalPass
from rl_core.trainers.ppo_experience import ExperienceMaker, GapAlarm, trains_on_policy
from rl_core.trainers.ppo_per_call import EpisodeItems
from rl_core.trainers.ppo_rewards import _bounded
from rl_core.trainers.ppo_rollout import Sampler
from rl_core.trainers.ppo_sync import release_device_caches, sync_engines
from rl_rollout.agents.openrlhf import load_agent

__all__ = ["PPOConfig", "PPOTrainer"]

logger = logging.getLogger(__name__)


class PPOTrainer:
    """The loop. ``policy``, ``critic``, ``ref``, ``reward_model``, ``teacher`` (the distillation teacher,
    with ``cfg.distill``): worker groups (or None);
    ``rollout``: ``generate(requests) -> [[RolloutSample]]`` (+ optional ``sleep``/``wake_up``);
    ``weight_sync``: ``sync(version) -> stats dict``; ``prompts``: a PromptDataset; ``seed`` fixes the
    prompt order (one permutation per pass) and the sampling (seed + 1000 x iteration + round);
    ``eval_prompts``: a PromptDataset evaluated every ``eval_steps`` iterations and after the last one
    (:mod:`rl_core.trainers.ppo_eval`); ``batching``: the workers' token budgets (:class:`~rl_core.rl.batching.BudgetWatch`);
    ``sync_first``: push version 0 to the engines before the first generation (the policy's weights are not the
    checkpoint the engines loaded: a 4-bit base, :mod:`rl_core.qlora`).

    Its parts: ``sampler`` (steps 1-2), ``evaluator`` (the eval pass, or None), ``ckpt`` (checkpoints, or None);
    the loop's own state: ``history``, ``eval_history``, ``kl`` (the penalty's controller), the gap alarm.
    """

    def __init__(
        self,
        cfg: PPOConfig,
        *,
        policy,
        rollout,
        weight_sync,
        prompts,
        tokenizer,
        train_batch_size: int,
        reward_fn=None,
        reward_model=None,
        critic=None,
        ref=None,
        sleep_engines: bool = False,
        metrics: MetricsLogger | None = None,
        seed: int = 42,
        gap_alarm: float | None = None,
        sleep_level: int = 1,
        eval_prompts=None,
        batching: MicroBatchConfig | None = None,
        ring_attn_size: int = 1,
        teacher=None,
        sync_first: bool = False,
    ):
        self.ring = ring_attn_size  # every role's ranks in ring attention groups of this size (rl_core.ring_attention)
        self.cfg, self.policy, self.rollout, self.weight_sync, self.seed = cfg, policy, rollout, weight_sync, seed
        if reward_fn is not None and not callable(getattr(reward_fn, "score", None)):
            reward_fn = _bounded(reward_fn)
        self.critic, self.ref, self.reward_model, self.reward_fn = critic, ref, reward_model, reward_fn
        self.teacher = teacher
        self.sync_first = sync_first  # the engines' checkpoint is not the policy (QLoRA): push version 0 first
        self.prompts, self.tokenizer, self.G, self.sleep_engines = prompts, tokenizer, train_batch_size, sleep_engines
        self.gap_alarm = GapAlarm(cfg.gap_alarm(bf16=False) if gap_alarm is None else gap_alarm)
        if sleep_level not in (1, 2):
            raise ValueError(f"sleep_level must be 1 or 2, got {sleep_level}")
        self.sleep_level = sleep_level
        self.budgets = BudgetWatch(batching)  # samples over the workers' token budgets, counted and warned of
        check_eval_set(cfg.eval.steps, eval_prompts is not None)
        check_combinations(cfg, eval_set=eval_prompts is not None, sleep_engines=sleep_engines)
        check_parts(
            cfg,
            rollout=rollout,
            critic=critic,
            ref=ref,
            reward_fn=reward_fn,
            reward_model=reward_model,
            teacher=teacher,
        )
        agent = None  # a factory of fresh environments, one per episode
        if cfg.agent:
            agent = load_agent(cfg.agent.func_path)
            if hasattr(rollout, "batch_agenerate"):  # the HF engine: one generate per turn of all episodes
                rollout.batch_agenerate = True
        agent_cmd = (
            AgentCmdEpisodes(
                cfg.agent_cmd,
                rollout,
                tokenizer,
                reward_fn=reward_fn is not None,
                eos=[t for t in {tokenizer.eos_token_id} if t is not None],
            )
            if cfg.agent_cmd
            else None
        )
        roles = {"policy": policy, "critic": critic, "ref": ref, "reward": reward_model, "teacher": teacher}
        ranks = {role: g.world_size for role, g in roles.items() if g is not None}
        check_rl_arithmetic(cfg, train_batch_size, ring=self.ring, num_prompts=len(prompts), world_sizes=ranks)
        self.num_iterations = cfg.iterations(len(prompts))
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self.eos = [t for t in {tokenizer.eos_token_id} if t is not None]
        self.metrics = metrics or MetricsLogger(cfg.run_dir)
        self.sampler = Sampler(
            cfg,
            rollout=rollout,
            prompts=prompts,
            tokenizer=tokenizer,
            seed=seed,
            eos=self.eos,
            reward_fn=reward_fn,
            reward_model=reward_model,
            reward_ranks=reward_model.world_size // self.ring if reward_model is not None else 1,
            sharded=self._sharded,
            agent=agent,
            metrics=self.metrics,
            agent_cmd=agent_cmd,
        )
        run_dir = getattr(self.metrics, "run_dir", None) if getattr(self.metrics, "enabled", False) else None
        self.evaluator = (
            EvalPass(
                cfg.eval,
                eval_prompts,
                self.sampler,
                chunk=cfg.rollout_batch_size,
                num_iterations=self.num_iterations,
                samples_dir=Path(run_dir) / "eval_samples" if run_dir is not None else None,
            )
            if eval_prompts is not None
            else None
        )
        self.ckpt = loop_checkpoints(
            cfg, policy=policy, critic=critic, eval_set=eval_prompts is not None, tokenizer=tokenizer
        )
        self.history: list[dict[str, float]] = []
        self.eval_history: list[dict[str, float]] = []  # the eval passes' metrics, with their iteration
        self.kl = cfg.kl.controller()  # the reward penalty's coefficient (None: KL as a loss, or off)
        on_policy = trains_on_policy(cfg, train_batch_size, kl_penalty=self.kl is not None)
        self.partial_mode: str | None = None  # --partial_rollout: keep or chunks (auto resolved by the engine)
        if cfg.async_rl and cfg.async_rl.partial_rollout:  # before the first generation
            self.partial_mode = start_partial_rollout(rollout, cfg.async_rl)
            logger.info(
                "partial rollouts: %s (%s)",
                self.partial_mode,
                "unfinished requests kept in vLLM across a weight update"
                if self.partial_mode == "keep"
                else "responses sampled in chunks, a weight update landing between two",
            )
        self._ckpt_cursor = 0  # the prompt cursor after the batch trained last (async: the producer runs ahead)
        local = [g for g in (policy, critic, ref, reward_model, teacher) if g is not None]
        # the experience forwards' items split evenly over every group's data-parallel ranks (per-call episodes pad)
        self._forward_multiple = math.lcm(
            *(g.world_size // self.ring for g in (policy, critic, ref, teacher) if g is not None)
        )
        self.parallel = not all(isinstance(g, LocalGroup) for g in local)
        self.experience = ExperienceMaker(
            cfg,
            policy=policy,
            ref=ref,
            critic=critic,
            sharded=self._sharded,
            parallel=self.parallel,
            on_policy=on_policy,
            pad_id=self.pad_id,
            kl=self.kl,
            gap_alarm=self.gap_alarm,
            teacher=teacher,
        )
        # last, once every check passed: the folders it writes are this run's until fit ends (a second run on them
        # is refused: rl_core.folder_lock)
        self._locks = hold(
            {"--run_dir": cfg.run_dir, "--ckpt_path": cfg.ckpt.ckpt_path}, {"--save_path": cfg.ckpt.save_path}
        )

    # ----- prompts -----------------------------------------------------------------------

    @property
    def on_policy(self) -> bool:
        """The policy trains once per batch on the weights that sampled it: its train forward gives the old
        log-probs (the experience phase skips that forward). One flag, the experience maker's."""
        return self.experience.on_policy

    @on_policy.setter
    def on_policy(self, value: bool) -> None:
        self.experience.on_policy = value

    def _sharded(self, group, method: str, items: list, *args, **kwargs):
        """``group.call_sharded``: each data-parallel rank its contiguous shard (a ring attention group's ranks
        the same one: :func:`ring_shards`), results in ``items``' order."""
        return group.call_sharded(method, ring_shards(items, group.world_size, self.ring), *args, **kwargs)

    # ----- train and sync --------------------------------------------------------------------

    def _train(self, calls: EpisodeItems, it: int) -> dict[str, float]:
        """Critic, then policy (unless still frozen); each gets every global batch (``train_batch_size`` episodes,
        their calls: :mod:`rl_core.trainers.ppo_per_call`) split over its ranks."""

        def ordered(group) -> tuple[list[Experience], int]:
            return calls.train_order(self.G, group.world_size // self.ring, self.pad_id)

        out: dict[str, float] = {}
        t0 = time.perf_counter()
        if self.critic is not None:
            items, local = ordered(self.critic)
            out.update(self._sharded(self.critic, "train", items, local_batch=local)[0])
        t1 = time.perf_counter()
        out["critic_train_s"] = t1 - t0
        if it > self.cfg.freezing_actor_steps:
            kl_coef = self.cfg.kl.init_coef if self.cfg.kl.use_loss else 0.0
            items, local = ordered(self.policy)
            out.update(self._sharded(self.policy, "train", items, kl_coef, self.on_policy, local_batch=local)[0])
            if "rollout_logprob_gap" in out:
                out.update(self.gap_alarm.check(out["rollout_logprob_gap"]))
        out["policy_train_s"] = time.perf_counter() - t1
        return out

    def _release_device_caches(self) -> dict[str, float]:
        """Every model role's ranks empty torch's CUDA cache before the sleeping engines wake into that memory
        (:func:`~rl_core.trainers.ppo_sync.release_device_caches`)."""
        groups = [g for g in (self.policy, self.critic, self.ref, self.reward_model, self.teacher) if g is not None]
        return release_device_caches(groups, self.parallel)

    def _sync(self, version: int) -> dict[str, float]:
        """Wake the engines, then push this version's weights (:func:`~rl_core.trainers.ppo_sync.sync_engines`)."""
        return sync_engines(
            self.rollout,
            self.weight_sync,
            version,
            sleep_engines=self.sleep_engines,
            sleep_level=self.sleep_level,
            release=self._release_device_caches,
        )

    def _evaluate(self, it: int, pipeline: AsyncRollout | None, m: dict[str, float]) -> dict[str, float]:
        """The eval pass on version ``it`` when due (``{}`` otherwise); async: with the producer drained and paused
        (:mod:`rl_core.trainers.ppo_eval` says why), the wait for its batch in flight in ``m`` (``eval_drain_s``)."""
        if self.evaluator is None or not self.evaluator.due(it):
            return {}
        if pipeline is None:
            return self.evaluator.run(it)
        with pipeline.paused() as drain_s:
            m["eval_drain_s"] = drain_s
            return self.evaluator.run(it)

    # ----- the loop --------------------------------------------------------------------------

    def _iteration(self, it: int, bar, pipeline: AsyncRollout | None) -> None:
        c = self.cfg
        t0 = time.perf_counter()
        fresh = None
        trained = [g for g in (self.policy, self.critic) if g is not None]
        # async: the policy's forwards and sampling overlap, so only the optimizer side sleeps, until the train step
        asleep = (
            ds_sleep.call_roles(trained, "ds_offload", self.parallel, pipeline is not None)
            if c.deepspeed_enable_sleep
            else {}
        )
        if pipeline is None:
            batch = self.sampler.collect(it)
        else:
            batch, wait_s = pipeline.get(it)
            stale, fresh = self.sampler.staleness(batch.samples, it - 1)
            batch.metrics.update(stale, rollout_wait_s=wait_s)
        self._ckpt_cursor = batch.cursor
        items, scores, m = batch.items, batch.scores_B, batch.metrics
        calls = EpisodeItems.of(batch.samples, items)  # per-call agent episodes: one item per call (ppo_per_call)
        if self.sleep_engines:
            self.rollout.sleep(self.sleep_level)
        if c.deepspeed_enable_sleep and pipeline is None:
            m.update(asleep, **ds_sleep.call_roles(trained, "ds_reload", self.parallel))
        m.update(self.budgets.check(it, [x.T for x in calls.items]))
        t1 = time.perf_counter()
        self.experience.forwards(calls.padded(self._forward_multiple, self.pad_id))
        rows = calls.episode_rows()  # one per episode: group baselines count episodes, not calls
        m.update(self.experience.advantages(rows, scores, fresh))
        calls.split(rows)
        if self.sampler.agent_cmd is not None:
            m["agent_cmd/per_call_items_added"] = float(calls.added)
        t2 = time.perf_counter()
        if c.deepspeed_enable_sleep and pipeline is not None:
            m.update(asleep, **ds_sleep.call_roles(trained, "ds_reload", self.parallel))
        m.update(self._train(calls, it))
        m.update(self._sync(it))
        evaluated = self._evaluate(it, pipeline, m)  # async: before the producer may generate with version it
        if pipeline is not None:
            pipeline.synced(it)
        if self.kl is not None and "kl" in m:
            self.kl.update(m["kl"], len(items))
        m.update(batch.sample_metrics(), experience_s=t2 - t1, iteration_s=time.perf_counter() - t0)
        if not all(math.isfinite(v) for v in m.values()):
            logger.warning("iteration %d: non-finite metrics %s", it, m)
        self.history.append(m)
        if evaluated:
            self.eval_history.append({"iteration": it, **evaluated})
            if self.ckpt is not None:
                self.ckpt.save_if_best(it, evaluated, self._loop_state(it))
        if evaluated or it % c.logging_steps == 0 or it == self.num_iterations:
            self.metrics.log(it, {**{"rl/" + k: v for k, v in m.items()}, **evaluated})
        bar.update(1)
        post = {"reward": f"{m['reward_mean']:.3f}", "kl": f"{m.get('kl', 0.0):.4f}"}
        if m.get("reward/failures"):
            post["reward_failed"] = f"{m['reward/failures']}/{m['reward/failures'] + m['reward/ok']}"
        bar.set_postfix(**post)
        if self.ckpt is not None and self.ckpt.due(it, self.num_iterations):
            self.ckpt.save(it, self._loop_state(it))

    # ----- checkpoints of the loop's state ----------------------------------------------------

    def _settings(self) -> dict:
        """What a resume compares with the checkpoint's run (:func:`~rl_core.trainers.ppo_checkpoint.loop_settings`)."""
        return loop_settings(self.cfg, seed=self.sampler.seed, prompts=len(self.prompts), train_batch_size=self.G)

    def _loop_state(self, it: int) -> dict:
        """What a checkpoint after iteration ``it`` keeps of the loop (the roles' states are the workers')."""
        kl_coef = self.kl.value if self.kl is not None else None
        return loop_state(it, self._settings(), self._ckpt_cursor, kl_coef, self.history, self.gap_alarm.warned)

    def _resume(self) -> int:
        """Restore the newest committed iteration (every role and the loop); returns it (0 when none)."""
        if self.ckpt is None:
            return 0
        state = resume_state(self.ckpt, self.num_iterations, self.cfg.ckpt.ckpt_path, self._settings())
        if state is None:
            return 0
        self.sampler.cursor = self._ckpt_cursor = state["cursor"]
        if self.kl is not None and state["kl_coef"] is not None:
            self.kl.value = state["kl_coef"]
        self.history = list(state["history"])
        self.gap_alarm.warned = state["gap_warned"]
        set_rng_state(rng_state_from_json(state["rng"]))  # last: the roles' loads set this process's RNG too
        return state["iteration"]

    # ----- the run ----------------------------------------------------------------------------

    def fit(self) -> list[dict[str, float]]:
        """The run: resume if asked, the iterations, the final export; the run's folders are released after."""
        try:
            return self._fit()
        finally:
            if self.sampler.agent_cmd is not None:
                self.sampler.agent_cmd.close()
            self._locks.release()

    def _fit(self) -> list[dict[str, float]]:
        c = self.cfg
        start = self._resume() if c.ckpt.load_checkpoint else 0
        if start:
            dropped = self.metrics.rewind(start)
            logger.info(
                "resumed at iteration %d of %d; pushing its weights to the engines (%d metrics rows logged "
                "after it before the run stopped are dropped: those iterations run again)",
                start,
                self.num_iterations,
                dropped,
            )
            self._sync(start)
        elif self.sync_first:  # the engines loaded the checkpoint, the policy computes with other weights (QLoRA)
            logger.info("pushing the policy's weights (version 0) to the engines before the first generation")
            self._sync(0)
        bar = tqdm(total=self.num_iterations, initial=start, desc=f"rl {c.advantage.estimator}")
        pipeline = None
        if c.async_rl:  # the producer thread collects batch k+1.. while this thread trains on batch k
            pipeline = AsyncRollout(
                self.sampler.collect,
                start + 1,
                self.num_iterations,
                max_staleness=c.async_rl.max_staleness,
                version=start,
            )
        it = start
        try:
            for it in range(start + 1, self.num_iterations + 1):
                self._iteration(it, bar, pipeline)
        except BaseException as e:
            bar.close()  # now, not at garbage collection: after the CLI's last line
            if pipeline is not None:
                pipeline.close(timeout=60.0)
                self.metrics.close()
            if isinstance(e, KeyboardInterrupt):  # the CLI's one line on Ctrl-C / SIGTERM says where the run stood
                newest = self.ckpt.store.latest() if self.ckpt is not None else None
                e.add_note(
                    f"at iteration {it} of {self.num_iterations}, {len(self.history)} done; last checkpoint: "
                    f"{newest if newest is not None else 'none'}"
                )
            raise
        if pipeline is not None:
            pipeline.close()
        bar.close()
        self.metrics.close()
        if c.ckpt.save_path:
            tok_path = getattr(self.tokenizer, "name_or_path", None)
            self.policy.call("export", c.ckpt.save_path, tok_path)
            if c.save_value_network and self.critic is not None:
                self.critic.call("export", f"{c.ckpt.save_path.rstrip('/')}/critic")
        return self.history
