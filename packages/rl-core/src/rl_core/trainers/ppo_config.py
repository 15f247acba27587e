"""The RL loop's settings (:class:`PPOConfig`): the root of the run's config tree, and what follows from them.

The tree: the loop's own fields here, and one node per concern, each owned by the package whose code reads
it: rl-algos' :class:`~rl_algos.KLConfig` (``kl``) and :class:`~rl_algos.ShapingConfig` (``shaping``),
rl-core's :mod:`rl_core.configs` (``ckpt``, ``eval``, ``critic_optimizer``, and the optional features, present
when on: ``async_rl``, ``agent``, ``ptx``, ``ema``, ``dynamic_filtering``). Each node checks its own fields; the rules that cross nodes are here, in
``__post_init__``, once. Migrating from the flat config of rl-core 0.15: ``PPOConfig(init_kl_coef=0)`` is
``PPOConfig(kl=KLConfig(init_coef=0))``, ``async_train=True, max_staleness=2`` is
``async_rl=AsyncConfig(max_staleness=2)``, ``save_steps=..., ckpt_path=...`` is ``ckpt=CheckpointConfig(...)``
(CHANGELOG.md lists every field).

What an estimator or a policy-loss variant needs is asked of its registry entry in
rl-algos (``get_estimator(name).needs_critic``, ``.min_group_size``,
``.whiten_by_default``, ``.turn_rewards``; ``policy_loss_config(type, ...)``), never listed here. Each
field carries its help text and command-line names as metadata (``flags``: our flat
names, ``openrlhf``: OpenRLHF's), which rl-cli reads to build its parser.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from rl_algos import (
    ESTIMATORS,
    POLICY_LOSSES,
    ISCorrectionConfig,
    KLConfig,
    ShapingConfig,
    estimator_names,
    get_estimator,
    policy_loss_config,
    policy_loss_settings,
)
from rl_core.configs import (
    AgentConfig,
    AsyncConfig,
    CheckpointConfig,
    CriticOptimizerConfig,
    DynamicFilteringConfig,
    EMAConfig,
    EvalConfig,
    PtxConfig,
    from_flat,
)
from rl_rollout.config import check_numbers, meta


@dataclass(frozen=True)
class PPOConfig:
    """RL loop settings (the PPO family: PPO with a critic, GRPO, REINFORCE++, RLOO, Dr. GRPO)."""

    advantage_estimator: str = field(default="gae", metadata={**meta(
        "a registered estimator (rl_algos.ESTIMATORS): gae is PPO's (with a critic), group_norm GRPO's; an "
        "extension module (--extension) registers more", openrlhf=("algo.advantage.estimator",)),
        "names": estimator_names})
    estimator_args: tuple[str, ...] = field(default=(), metadata=meta(
        "KEY=VALUE settings of the estimator's own parameters (its registry entry's params; an extension's)"))
    gamma: float = field(default=1.0, metadata=meta("discount", openrlhf=("algo.advantage.gamma",)))
    lambd: float = field(default=0.95, metadata=meta("GAE lambda", openrlhf=("algo.advantage.lambd",)))
    n_samples_per_prompt: int = field(default=1, metadata=meta(
        "samples per prompt (a group)", openrlhf=("rollout.n_samples_per_prompt",)))
    rollout_batch_size: int = field(default=8, metadata=meta("prompts per iteration", openrlhf=("rollout.batch_size",)))
    generate_max_len: int = field(default=64, metadata=meta(
        "new tokens per sample (also Dr. GRPO's constant normaliser)", flags=("max_new_tokens",),
        openrlhf=("rollout.max_new_tokens",)))
    temperature: float = field(default=1.0, metadata=meta(
        "sampling temperature; the trainer's log-probs use the same one", openrlhf=("rollout.temperature",)))
    top_p: float = field(default=1.0, metadata=meta("nucleus sampling", openrlhf=("rollout.top_p",)))
    num_episodes: int = field(default=1, metadata=meta("passes over the prompts", openrlhf=("train.num_episodes",)))
    max_iterations: int = field(default=0, metadata=meta("stop after this many iterations (0: num_episodes passes)"))
    max_epochs: int = field(default=1, metadata=meta(
        "passes over each iteration's samples", openrlhf=("train.max_epochs",)))
    policy_loss_type: str = field(default="ppo", metadata={**meta(
        "a registered policy-loss variant (rl_algos.POLICY_LOSSES): ppo (token ratio), gspo (sequence ratio, "
        "arXiv:2507.18071); an extension module (--extension) registers more", openrlhf=("actor.policy_loss_type",)),
        "names": lambda: sorted(POLICY_LOSSES)})
    policy_loss_args: tuple[str, ...] = field(default=(), metadata=meta(
        "KEY=VALUE settings of the variant's own fields beyond the shared clip / dual clip / aggregation / "
        "correction ones (an extension's variant)"))
    eps_clip: float = field(default=0.2, metadata=meta("PPO clip range (low side)", openrlhf=("actor.eps_clip",)))
    eps_clip_high: float | None = field(default=None, metadata=meta(
        "clip-higher (DAPO) upper range; default: eps_clip"))
    dual_clip: float | None = field(default=None, metadata=meta(
        "dual-clip PPO constant (> 1)", openrlhf=("actor.dual_clip",)))
    value_clip: float | None = field(default=0.5, metadata=meta(
        "critic value clip (None: plain squared error)", openrlhf=("critic.value_clip",)))
    loss_agg_mode: str = field(default="token-mean", metadata=meta(
        "token-mean | seq-mean-token-mean | seq-mean-token-sum | seq-mean-token-sum-norm (Dr. GRPO: divides by "
        "generate_max_len)"))
    kl: KLConfig = field(default_factory=KLConfig, metadata=meta("KL to the reference policy (rl-algos)"))
    entropy_loss_coef: float | None = field(default=None, metadata=meta(
        "entropy bonus: the policy loss minus COEF x the token-mean entropy of the policy; any value, 0 included, "
        "also logs rl/entropy (OpenRLHF's semantics)", openrlhf=("actor.entropy_coef",)))
    is_correction: str | None = field(default=None, metadata=meta(
        "importance correction for the engine's sampling: tis | icepop | seq-mask-tis (uses rollout log-probs)",
        openrlhf=("algo.advantage.is_correction_type",)))
    is_correction_threshold: tuple[float, float] = field(default=(0.5, 5.0), metadata=meta(
        "LOW HIGH bounds of the importance weights (clamp for tis, keep-range for icepop / seq-mask-tis)",
        openrlhf=("algo.advantage.is_correction_threshold",)))
    async_rl: AsyncConfig | None = field(default=None, metadata={**meta(
        "generate the next batch while the policy trains on this one (one-step-off-policy pipelining): a sample "
        "trains a policy at most --max_staleness versions newer than the one that generated it; old log-probs "
        "are the trainer's and the engine's sampling is corrected by --is_correction (tis unless set)",
        flags=("async_train",), openrlhf=("train.async_enable",)), "switch": True})
    deepspeed_enable_sleep: bool = field(default=False, metadata=meta(
        "DeepSpeed sleep: the policy's and critic's DeepSpeed states (weights, fp32 master weights, Adam moments, "
        "gradient buffers) go to host memory while the engines generate and come back before the experience "
        "forwards, so a colocated engine gets the accelerator's memory (ZeRO 1, 2 or 3; not with --adam_offload). "
        "With --async_train the weights stay (the policy's forwards overlap the sampling) and the rest sleeps "
        "from the iteration's start to its train step, as in OpenRLHF; metrics ds_sleep_s, ds_wake_s, "
        "ds_sleep_gb, on CUDA ds_sleep_freed_gb",
        openrlhf=("ds.enable_sleep",)))
    agent: AgentConfig | None = field(default=None, metadata=meta(
        "multi-turn episodes against an environment (on with --agent_func_path)"))
    reward_max_failure_rate: float = field(default=0.5, metadata=meta(
        "stop the run, with the first failure's message, when more than this fraction of an iteration's reward "
        "calls fail (raise, time out, return a non-number, NaN or inf; each gets --reward_fallback); in [0, 1), so "
        "an iteration whose calls all fail always stops; 0: any failure stops. Default 0.5: past half, fallback "
        "rewards outweigh real ones and the advantages mostly measure the failures"))
    shaping: ShapingConfig = field(default_factory=ShapingConfig, metadata=meta(
        "reward shaping before the advantages: length penalties and clipping (rl-algos)"))
    whiten_advantages: bool | None = field(default=None, metadata=meta(
        "batch-whiten the advantages (default: what the estimator's registry entry says)"))
    no_advantage_std_norm: bool = field(default=False, metadata=meta(
        "batch normalisation of the advantages subtracts the mean only, without dividing by the std (OpenRLHF: "
        "gae, reinforce, reinforce_baseline, the estimators it whitens)", openrlhf=("algo.advantage.no_std_norm",)))
    dynamic_filtering: DynamicFilteringConfig | None = field(default=None, metadata={**meta(
        "drop groups without signal and sample new prompts (DAPO); judged on the raw rewards (or a reward "
        "file's scores), before length penalties and clipping, as OpenRLHF",
        flags=("dynamic_filtering",), openrlhf=("algo.dynamic_filtering_enable",)), "switch": True})
    critic_optimizer: CriticOptimizerConfig = field(default_factory=CriticOptimizerConfig, metadata=meta(
        "the critic's own optimizer settings (unset: the actor's)"))
    aux_loss_coef: float = field(default=0.0, metadata=meta(
        "mixture-of-experts policy: + coef x the router's load-balancing loss in its loss, per micro-batch weighted "
        "by its share of the samples, as OpenRLHF's actor (0: off; the critic's value head is left without it); a "
        "model without experts is refused", openrlhf=("actor.aux_loss_coef",)))
    ptx: PtxConfig | None = field(default=None, metadata=meta("PPO-ptx (on with --pretrain_data)"))
    ema: EMAConfig | None = field(default=None, metadata={**meta(
        "keep an exponential moving average of the policy's trained weights (updated after each optimizer step, "
        "in the weights' dtype, on their device; ZeRO-3: each rank its partition) and export it instead of the "
        "policy (--save_path, --save_hf_ckpt); checkpoints keep it; the engines sample from the policy itself",
        flags=("enable_ema",), openrlhf=("train.enable_ema",)), "switch": True})
    freezing_actor_steps: int = field(default=0, metadata=meta(
        "first iterations train the critic only", openrlhf=("critic.freezing_steps",)))
    logprob_gap_alarm: float | None = field(default=None, metadata=meta(
        "warn (and count rl/logprob_gap_alarm) when the mean |trainer - engine| log-prob gap exceeds this "
        "(default: 1e-3 in fp32, 5e-2 in bf16; 0: off)"))
    ckpt: CheckpointConfig = field(default_factory=CheckpointConfig, metadata=meta(
        "checkpoints, resume and the final export"))
    save_value_network: bool = field(default=False, metadata=meta(
        "also export the critic (save_path/critic)", openrlhf=("critic.save_value_network",)))
    run_dir: str | None = field(default=None, metadata=meta("metrics.jsonl, tensorboard/, curves.png"))
    logging_steps: int = field(default=1, metadata=meta(
        "write the metrics (metrics.jsonl, TensorBoard, wandb) every N iterations, the last one and every eval pass "
        "included; the progress bar and the metrics history in checkpoints still see every iteration"))
    eval: EvalConfig = field(default_factory=EvalConfig, metadata=meta("the eval pass (with --eval_dataset)"))

    def __post_init__(self) -> None:
        spec = get_estimator(self.advantage_estimator)  # an unknown name fails listing the valid ones
        check_numbers(self, positive=("eps_clip", "top_p"), non_negative=(
            "value_clip", "freezing_actor_steps", "aux_loss_coef"),
            unit=("gamma", "lambd", "top_p"))
        for name in ("n_samples_per_prompt", "rollout_batch_size", "generate_max_len", "num_episodes", "max_epochs",
                     "logging_steps"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} (--{name}) must be >= 1, got {getattr(self, name)}")
        if self.max_iterations < 0:
            raise ValueError(f"max_iterations must be >= 0 (0: num_episodes passes), got {self.max_iterations}")
        if self.temperature <= 0:
            raise ValueError(f"temperature (--temperature) must be > 0, got {self.temperature}")
        if self.entropy_loss_coef is not None and not math.isfinite(self.entropy_loss_coef):
            raise ValueError(f"entropy_loss_coef (--entropy_loss_coef) must be a finite number, got "
                             f"{self.entropy_loss_coef}")
        if not 0 <= self.reward_max_failure_rate < 1:
            raise ValueError(f"reward_max_failure_rate (--reward_max_failure_rate) must be in [0, 1), got "
                             f"{self.reward_max_failure_rate}: an iteration whose reward calls all fail always "
                             "stops the run (0: any failure stops it)")
        if self.logprob_gap_alarm is not None and self.logprob_gap_alarm < 0:
            raise ValueError(f"logprob_gap_alarm must be >= 0 (0: off), got {self.logprob_gap_alarm}")
        self._check_across(spec)
        try:
            self.estimator_kwargs  # noqa: B018 - parses (and so validates) --estimator_args
        except ValueError as e:
            raise ValueError(f"{e} (--estimator_args)") from None
        try:
            self.policy_loss  # noqa: B018 - builds (and so validates) the variant
        except ValueError as e:
            raise ValueError(f"{e} (--policy_loss_type, --eps_clip, --eps_clip_high, --dual_clip, --loss_agg_mode, "
                             f"--is_correction, --is_correction_threshold, --policy_loss_args)") from None

    def _check_across(self, spec) -> None:
        """The rules that cross this config's nodes (each node checked its own fields when it was built)."""
        if self.n_samples_per_prompt < spec.min_group_size:
            raise ValueError(f"--advantage_estimator {self.advantage_estimator} compares the samples of a prompt: "
                             f"set --n_samples_per_prompt >= {spec.min_group_size} (got {self.n_samples_per_prompt})")
        buffer = self.shaping.overlong_buffer_len
        if buffer is not None and buffer > self.generate_max_len:
            raise ValueError(f"overlong_buffer_len (--overlong_buffer_len) must be in 1..generate_max_len="
                             f"{self.generate_max_len}, got {buffer}")
        if self.dynamic_filtering and self.n_samples_per_prompt < 2:
            raise ValueError("--dynamic_filtering judges groups of samples: set --n_samples_per_prompt >= 2")
        if self.agent and self.agent.turn_rewards and not spec.turn_rewards:
            fit = ", ".join(n for n, e in ESTIMATORS.items() if e.turn_rewards)
            raise ValueError(f"--agent_turn_rewards gives token-level rewards, which --advantage_estimator "
                             f"{self.advantage_estimator} (one scalar per sample, compared within its group) does not "
                             f"take: use {fit}, or drop --agent_turn_rewards")
        a = self.async_rl
        if a is not None and a.generate_batch_size is not None and a.generate_batch_size < self.rollout_batch_size:
            raise ValueError(f"--generate_batch_size {a.generate_batch_size} is below --rollout_batch_size "
                             f"{self.rollout_batch_size}: a round must fill a batch; raise it or drop the flag")
        if self.no_advantage_std_norm and not self.whiten:
            raise ValueError(f"--no_advantage_std_norm changes the batch normalisation of the advantages, which "
                             f"--advantage_estimator {self.advantage_estimator} does not do (as in OpenRLHF, where "
                             f"it then has no effect): drop the flag, or use dr_grpo for the group mean without the "
                             f"std")

    @classmethod
    def from_flat(cls, **flat) -> PPOConfig:
        """The tree from rl-core 0.15's flat names (``init_kl_coef=0, async_train=True, max_staleness=2``), the
        same names the command line takes (:func:`rl_core.configs.from_flat`)."""
        return from_flat(cls, **flat)

    @property
    def estimator(self):
        """The estimator's registry entry (rl-algos' :class:`~rl_algos.advantages.EstimatorSpec`)."""
        return get_estimator(self.advantage_estimator)

    @property
    def policy_loss(self):
        """The policy-loss variant (rl-algos typed config), built once per access from these fields."""
        kind = self.is_correction_type
        corr = None if kind is None else ISCorrectionConfig(kind, *self.is_correction_threshold)
        own = policy_loss_settings(self.policy_loss_type, self.policy_loss_args)
        return policy_loss_config(self.policy_loss_type, clip_eps_low=self.eps_clip, clip_eps_high=self.eps_clip_high,
                                  dual_clip=self.dual_clip, aggregation=self.loss_agg_mode, is_correction=corr, **own)

    @property
    def estimator_kwargs(self) -> dict:
        """The estimator's own parameters from ``estimator_args`` (typed by its registry entry's ``params``)."""
        return self.estimator.settings(self.estimator_args)

    @property
    def is_correction_type(self) -> str | None:
        """The importance correction in force: ``--is_correction``, else ``tis`` with ``--async_train`` (its
        samples come from older policies than the one that trains), else none."""
        return self.is_correction or ("tis" if self.async_rl else None)

    @property
    def loss_norm_len(self) -> float:
        """The constant that ``seq-mean-token-sum-norm`` divides by (Dr. GRPO): the generation budget."""
        return float(self.generate_max_len)

    @property
    def needs_critic(self) -> bool:
        return self.estimator.needs_critic

    @property
    def needs_reference(self) -> bool:
        return self.kl.enabled

    @property
    def whiten(self) -> bool:
        if self.whiten_advantages is not None:
            return self.whiten_advantages
        return self.estimator.whiten_by_default

    def gap_alarm(self, bf16: bool) -> float:
        """The logprob-gap threshold in force (0: off)."""
        if self.logprob_gap_alarm is not None:
            return self.logprob_gap_alarm
        return 5e-2 if bf16 else 1e-3

    @property
    def staleness_bound(self) -> int:
        """The most versions a sample may lag the policy it trains (0 without ``async_rl``)."""
        return self.async_rl.staleness_bound(self.rollout_batch_size) if self.async_rl else 0

    def iterations(self, num_prompts: int) -> int:
        return self.max_iterations or max(1, self.num_episodes * num_prompts // self.rollout_batch_size)

    def optimizer_steps(self, num_prompts: int, train_batch_size: int) -> int:
        """Policy (and critic) optimizer steps over the run, for the LR schedule."""
        samples = self.rollout_batch_size * self.n_samples_per_prompt
        return self.iterations(num_prompts) * (samples // train_batch_size) * self.max_epochs

