"""The RL loop's settings (:class:`PPOConfig`): the root of the run's config tree, and what follows from them.

The tree: the loop's own fields here, and one node per concern, each owned by the package whose code reads
it: rl-algos' :class:`~rl_algos.AdvantageConfig` (``advantage``), :class:`~rl_algos.PolicyLossConfig`
(``policy_loss``), :class:`~rl_algos.KLConfig` (``kl``) and :class:`~rl_algos.ShapingConfig` (``shaping``),
rl-rollout's :class:`~rl_rollout.SamplingConfig` (``sampling``),
rl-core's :mod:`rl_core.configs` (``ckpt``, ``eval``, ``critic_optimizer``, and the optional features, present
when on: ``async_rl``, ``agent``, ``agent_cmd`` (rl-rollout's), ``ptx``, ``ema``, ``dynamic_filtering``, ``distill``). Each node checks its own fields; the rules that cross nodes are here, in
``__post_init__``, once. Migrating from the flat config of rl-core 0.15: ``PPOConfig(init_kl_coef=0)`` is
``PPOConfig(kl=KLConfig(init_coef=0))``, ``async_train=True, max_staleness=2`` is
``async_rl=AsyncConfig(max_staleness=2)``, ``save_steps=..., ckpt_path=...`` is ``ckpt=CheckpointConfig(...)``,
rl-core 0.17's ``advantage_estimator="rloo", eps_clip=0.1`` is ``advantage=AdvantageConfig("rloo"),
policy_loss=PolicyLossConfig(eps_clip=0.1)``, ``n_samples_per_prompt=8, temperature=0.7`` is
``sampling=SamplingConfig(8, temperature=0.7)``, ``entropy_loss_coef=...`` is ``PolicyLossConfig(entropy_coef=...)``
(CHANGELOG.md lists every field).

What an estimator or a policy-loss variant needs is asked of its registry entry in
rl-algos (``advantage.spec.needs_critic``, ``.min_group_size``, ``.whiten_by_default``, ``.turn_rewards``;
``policy_loss.variant()``), never listed here. Each
field carries its help text and command-line names as metadata (``flags``: our flat
names, ``openrlhf``: OpenRLHF's), which rl-cli reads to build its parser.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from rl_algos import ESTIMATORS, AdvantageConfig, KLConfig, PolicyLossConfig, ShapingConfig
from rl_core.configs import (
    AgentConfig,
    AsyncConfig,
    CheckpointConfig,
    CriticOptimizerConfig,
    DistillConfig,
    DynamicFilteringConfig,
    EMAConfig,
    EvalConfig,
    PtxConfig,
    from_flat,
)
from rl_rollout import SamplingConfig
from rl_rollout.agents.cmd_config import AgentCmdConfig
from rl_rollout.config_fields import check_numbers, meta


@dataclass(frozen=True)
class PPOConfig:
    """RL loop settings (the PPO family: PPO with a critic, GRPO, REINFORCE++, RLOO, Dr. GRPO)."""

    advantage: AdvantageConfig = field(
        default_factory=AdvantageConfig, metadata=meta("the advantage estimator and its settings (rl-algos)")
    )
    sampling: SamplingConfig = field(
        default_factory=SamplingConfig,
        metadata=meta("samples per prompt, new tokens, temperature, nucleus (rl-rollout)"),
    )
    rollout_batch_size: int = field(default=8, metadata=meta("prompts per iteration", openrlhf=("rollout.batch_size",)))
    num_episodes: int = field(default=1, metadata=meta("passes over the prompts", openrlhf=("train.num_episodes",)))
    max_iterations: int = field(default=0, metadata=meta("stop after this many iterations (0: num_episodes passes)"))
    max_epochs: int = field(
        default=1, metadata=meta("passes over each iteration's samples", openrlhf=("train.max_epochs",))
    )
    policy_loss: PolicyLossConfig = field(
        default_factory=PolicyLossConfig,
        metadata=meta("the policy-loss variant and its clip, aggregation and importance correction (rl-algos)"),
    )
    value_clip: float | None = field(
        default=0.5, metadata=meta("critic value clip (None: plain squared error)", openrlhf=("critic.value_clip",))
    )
    kl: KLConfig = field(default_factory=KLConfig, metadata=meta("KL to the reference policy (rl-algos)"))
    async_rl: AsyncConfig | None = field(
        default=None,
        metadata={
            **meta(
                "generate the next batch while the policy trains on this one (one-step-off-policy pipelining): a sample "
                "trains a policy at most --max_staleness versions newer than the one that generated it; old log-probs "
                "are the trainer's and the engine's sampling is corrected by --is_correction (tis unless set)",
                flags=("async_train",),
                openrlhf=("train.async_enable",),
            ),
            "switch": True,
        },
    )
    deepspeed_enable_sleep: bool = field(
        default=False,
        metadata=meta(
            "DeepSpeed sleep: the policy's and critic's DeepSpeed states (weights, fp32 master weights, Adam moments, "
            "gradient buffers) go to host memory while the engines generate and come back before the experience "
            "forwards, so a colocated engine gets the accelerator's memory (ZeRO 1, 2 or 3; not with --adam_offload). "
            "With --async_train the weights stay (the policy's forwards overlap the sampling) and the rest sleeps "
            "from the iteration's start to its train step, as in OpenRLHF; metrics ds_sleep_s, ds_wake_s, "
            "ds_sleep_gb, on CUDA ds_sleep_freed_gb",
            openrlhf=("ds.enable_sleep",),
        ),
    )
    agent: AgentConfig | None = field(
        default=None, metadata=meta("multi-turn episodes against an environment (on with --agent_func_path)")
    )
    agent_cmd: AgentCmdConfig | None = field(
        default=None,
        metadata=meta(
            "episodes played by an agent program against the policy's OpenAI-compatible endpoint (on with --agent_cmd)"
        ),
    )
    reward_max_failure_rate: float = field(
        default=0.5,
        metadata=meta(
            "stop the run, with the first failure's message, when more than this fraction of an iteration's reward "
            "calls fail (raise, time out, return a non-number, NaN or inf; each gets --reward_fallback); in [0, 1), so "
            "an iteration whose calls all fail always stops; 0: any failure stops. Default 0.5: past half, fallback "
            "rewards outweigh real ones and the advantages mostly measure the failures"
        ),
    )
    shaping: ShapingConfig = field(
        default_factory=ShapingConfig,
        metadata=meta("reward shaping before the advantages: length penalties and clipping (rl-algos)"),
    )
    dynamic_filtering: DynamicFilteringConfig | None = field(
        default=None,
        metadata={
            **meta(
                "drop groups without signal and sample new prompts (DAPO); judged on the raw rewards (or a reward "
                "file's scores), before length penalties and clipping, as OpenRLHF",
                flags=("dynamic_filtering",),
                openrlhf=("algo.dynamic_filtering_enable",),
            ),
            "switch": True,
        },
    )
    critic_optimizer: CriticOptimizerConfig = field(
        default_factory=CriticOptimizerConfig, metadata=meta("the critic's own optimizer settings (unset: the actor's)")
    )
    ptx: PtxConfig | None = field(default=None, metadata=meta("PPO-ptx (on with --pretrain_data)"))
    ema: EMAConfig | None = field(
        default=None,
        metadata={
            **meta(
                "keep an exponential moving average of the policy's trained weights (updated after each optimizer step, "
                "in the weights' dtype, on their device; ZeRO-3: each rank its partition) and export it instead of the "
                "policy (--save_path, --save_hf_ckpt); checkpoints keep it; the engines sample from the policy itself",
                flags=("enable_ema",),
                openrlhf=("train.enable_ema",),
            ),
            "switch": True,
        },
    )
    distill: DistillConfig | None = field(
        default=None, metadata=meta("on-policy distillation from a teacher (on with --teacher_pretrain)")
    )
    freezing_actor_steps: int = field(
        default=0, metadata=meta("first iterations train the critic only", openrlhf=("critic.freezing_steps",))
    )
    logprob_gap_alarm: float | None = field(
        default=None,
        metadata=meta(
            "warn (and count rl/logprob_gap_alarm) when the mean |trainer - engine| log-prob gap exceeds this "
            "(default: 1e-3 in fp32, 5e-2 in bf16; 0: off)"
        ),
    )
    ckpt: CheckpointConfig = field(
        default_factory=CheckpointConfig, metadata=meta("checkpoints, resume and the final export")
    )
    save_value_network: bool = field(
        default=False,
        metadata=meta("also export the critic (save_path/critic)", openrlhf=("critic.save_value_network",)),
    )
    run_dir: str | None = field(default=None, metadata=meta("metrics.jsonl, tensorboard/, curves.png"))
    logging_steps: int = field(
        default=1,
        metadata=meta(
            "write the metrics (metrics.jsonl, TensorBoard, wandb) every N iterations, the last one and every eval pass "
            "included; the progress bar and the metrics history in checkpoints still see every iteration"
        ),
    )
    eval: EvalConfig = field(default_factory=EvalConfig, metadata=meta("the eval pass (with --eval_dataset)"))

    def __post_init__(self) -> None:
        spec = self.advantage.spec
        check_numbers(self, non_negative=("value_clip", "freezing_actor_steps"))
        for name in ("rollout_batch_size", "num_episodes", "max_epochs", "logging_steps"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} (--{name}) must be >= 1, got {getattr(self, name)}")
        if self.max_iterations < 0:
            raise ValueError(f"max_iterations must be >= 0 (0: num_episodes passes), got {self.max_iterations}")
        if not 0 <= self.reward_max_failure_rate < 1:
            raise ValueError(
                f"reward_max_failure_rate (--reward_max_failure_rate) must be in [0, 1), got "
                f"{self.reward_max_failure_rate}: an iteration whose reward calls all fail always "
                "stops the run (0: any failure stops it)"
            )
        if self.logprob_gap_alarm is not None and self.logprob_gap_alarm < 0:
            raise ValueError(f"logprob_gap_alarm must be >= 0 (0: off), got {self.logprob_gap_alarm}")
        self._check_across(spec)

    def _check_across(self, spec) -> None:
        """The rules that cross this config's nodes (each node checked its own fields when it was built)."""
        if self.sampling.n_samples_per_prompt < spec.min_group_size:
            raise ValueError(
                f"--advantage_estimator {self.advantage.estimator} compares the samples of a prompt: "
                f"set --n_samples_per_prompt >= {spec.min_group_size} (got {self.sampling.n_samples_per_prompt})"
            )
        buffer = self.shaping.overlong_buffer_len
        if buffer is not None and buffer > self.sampling.max_new_tokens:
            raise ValueError(
                f"overlong_buffer_len (--overlong_buffer_len) must be in 1..generate_max_len="
                f"{self.sampling.max_new_tokens}, got {buffer}"
            )
        if self.dynamic_filtering and self.sampling.n_samples_per_prompt < 2:
            raise ValueError("--dynamic_filtering judges groups of samples: set --n_samples_per_prompt >= 2")
        if self.agent and self.agent.turn_rewards and not spec.turn_rewards:
            fit = ", ".join(n for n, e in ESTIMATORS.items() if e.turn_rewards)
            raise ValueError(
                f"--agent_turn_rewards gives token-level rewards, which --advantage_estimator "
                f"{self.advantage.estimator} (one scalar per sample, compared within its group) does not "
                f"take: use {fit}, or drop --agent_turn_rewards"
            )
        if self.agent_cmd and self.agent:
            raise ValueError(
                "--agent_cmd runs an agent program and --agent_func_path an environment the loop steps: one "
                "source of episodes per run, drop one of them"
            )
        if self.agent_cmd and self.async_rl:
            raise ValueError(
                "--agent_cmd with --async_train is not built (the endpoint would sample while the weights update): "
                "drop --async_train"
            )
        if self.distill and self.distill.only and self.dynamic_filtering:
            raise ValueError(
                "--dynamic_filtering keeps groups whose rewards differ, and --distill_only trains on none of the "
                "rewards: drop one of them"
            )
        a = self.async_rl
        if a is not None and a.generate_batch_size is not None and a.generate_batch_size < self.rollout_batch_size:
            raise ValueError(
                f"--generate_batch_size {a.generate_batch_size} is below --rollout_batch_size "
                f"{self.rollout_batch_size}: a round must fill a batch; raise it or drop the flag"
            )

    @classmethod
    def from_flat(cls, **flat) -> PPOConfig:
        """The tree from rl-core 0.15's flat names (``init_kl_coef=0, async_train=True, max_staleness=2``), the
        same names the command line takes (:func:`rl_core.configs.from_flat`)."""
        return from_flat(cls, **flat)

    @property
    def estimator(self):
        """The estimator's registry entry (rl-algos' :class:`~rl_algos.advantages.EstimatorSpec`)."""
        return self.advantage.spec

    def policy_loss_variant(self):
        """The policy-loss variant (rl-algos typed config) with the importance correction in force: build it
        once, where the loop starts, and call its ``loss`` in the hot path."""
        return self.policy_loss.variant(self.is_correction_type)

    @property
    def is_correction_type(self) -> str | None:
        """The importance correction in force: ``--is_correction``, else ``tis`` with ``--async_train`` (its
        samples come from older policies than the one that trains), else none."""
        return self.policy_loss.is_correction or ("tis" if self.async_rl else None)

    @property
    def loss_norm_len(self) -> float:
        """The constant that ``seq-mean-token-sum-norm`` divides by (Dr. GRPO): the generation budget."""
        return float(self.sampling.max_new_tokens)

    @property
    def needs_critic(self) -> bool:
        return self.estimator.needs_critic

    @property
    def needs_reference(self) -> bool:
        return self.kl.enabled

    @property
    def whiten(self) -> bool:
        return self.advantage.whitens

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
        samples = self.rollout_batch_size * self.sampling.n_samples_per_prompt
        return self.iterations(num_prompts) * (samples // train_batch_size) * self.max_epochs
