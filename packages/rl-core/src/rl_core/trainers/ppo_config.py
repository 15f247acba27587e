"""The RL loop's settings (:class:`PPOConfig`) and what follows from them.

What an estimator or a policy-loss variant needs is asked of its registry entry in
rl-algos (``get_estimator(name).needs_critic``, ``.min_group_size``,
``.whiten_by_default``, ``.turn_rewards``; ``policy_loss_config(type, ...)``), never listed here. Each
field carries its help text and command-line names as metadata (``flags``: our flat
names, ``openrlhf``: OpenRLHF's), which rl-cli reads to build its parser.
"""

from __future__ import annotations

import math

from dataclasses import dataclass, field

from rl_algos import ESTIMATORS, ISCorrectionConfig, get_estimator, policy_loss_config
from rl_core.strategy import MUON_DEFAULTS, check_optimizer
from rl_rollout.config import check_numbers, meta


@dataclass(frozen=True)
class PPOConfig:
    """RL loop settings (the PPO family: PPO with a critic, GRPO, REINFORCE++, RLOO, Dr. GRPO)."""

    advantage_estimator: str = field(default="gae", metadata=meta(
        "gae (PPO, needs a critic) | group_norm (GRPO) | rloo | reinforce | reinforce_baseline | dr_grpo",
        openrlhf=("algo.advantage.estimator",)))
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
    policy_loss_type: str = field(default="ppo", metadata=meta(
        "ppo (token ratio) | gspo (sequence ratio, arXiv:2507.18071)", openrlhf=("actor.policy_loss_type",)))
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
    init_kl_coef: float = field(default=0.01, metadata=meta(
        "KL to the reference (0: no reference model)", openrlhf=("algo.kl.init_coef",)))
    kl_target: float | None = field(default=None, metadata=meta(
        "adaptive KL coefficient steering to this KL", openrlhf=("algo.kl.target",)))
    kl_horizon: int = field(default=10000, metadata=meta("adaptive KL horizon", openrlhf=("algo.kl.horizon",)))
    use_kl_loss: bool = field(default=False, metadata=meta(
        "KL as a loss term (GRPO) instead of a reward penalty", openrlhf=("algo.kl.use_loss",)))
    kl_estimator: str = field(default="k1", metadata=meta("k1 | k2 | k3", openrlhf=("algo.kl.estimator",)))
    entropy_loss_coef: float | None = field(default=None, metadata=meta(
        "entropy bonus: the policy loss minus COEF x the token-mean entropy of the policy; any value, 0 included, "
        "also logs rl/entropy (OpenRLHF's semantics)", openrlhf=("actor.entropy_coef",)))
    is_correction: str | None = field(default=None, metadata=meta(
        "importance correction for the engine's sampling: tis | icepop | seq-mask-tis (uses rollout log-probs)",
        openrlhf=("algo.advantage.is_correction_type",)))
    is_correction_threshold: tuple[float, float] = field(default=(0.5, 5.0), metadata=meta(
        "LOW HIGH bounds of the importance weights (clamp for tis, keep-range for icepop / seq-mask-tis)",
        openrlhf=("algo.advantage.is_correction_threshold",)))
    async_train: bool = field(default=False, metadata=meta(
        "generate the next batch while the policy trains on this one (one-step-off-policy pipelining): a sample "
        "trains a policy at most --max_staleness versions newer than the one that generated it; old log-probs "
        "are the trainer's and the engine's sampling is corrected by --is_correction (tis unless set)",
        openrlhf=("train.async_enable",)))
    max_staleness: int = field(default=1, metadata=meta(
        "with --async_train: how many policy versions a sample may lag the policy it trains (generation waits "
        "for the weight sync otherwise; 0: the synchronous schedule)"))
    generate_batch_size: int | None = field(default=None, metadata=meta(
        "with --async_train: prompts per generation round (default: --rollout_batch_size). Larger over-samples, as "
        "OpenRLHF's --vllm_generate_batch_size: one round generates for several iterations and the groups past the "
        "first batch wait in a buffer, in prompt order, for the next ones; a buffered group trains up to "
        "floor((G + B - 2) / B) versions later than --max_staleness alone allows (B: --rollout_batch_size), which "
        "is the bound the staleness metrics check. Dynamic filtering's refill rounds generate only the shortfall; "
        "a round's own metrics (generate_s, reward and agent means) are logged by the iteration that ran it",
        openrlhf=("rollout.vllm_generate_batch_size",)))
    partial_rollout: bool = field(default=False, metadata=meta(
        "with --async_train: a weight update lands between chunks of the responses being generated instead of "
        "waiting for them; the rest is sampled with the new weights, each token tagged with its version (the "
        "importance correction then uses each token's own rollout log-prob). HF engine",
        openrlhf=("train.partial_rollout_enable",)))
    partial_rollout_tokens: int = field(default=16, metadata=meta(
        "with --partial_rollout: tokens sampled between two points where a weight update may land"))
    deepspeed_enable_sleep: bool = field(default=False, metadata=meta(
        "DeepSpeed sleep: the policy's and critic's DeepSpeed states (weights, fp32 master weights, Adam moments, "
        "gradient buffers) go to host memory while the engines generate and come back before the experience "
        "forwards, so a colocated engine gets the accelerator's memory (ZeRO 1, 2 or 3; not with --adam_offload). "
        "With --async_train the weights stay (the policy's forwards overlap the sampling) and the rest sleeps "
        "from the iteration's start to its train step, as in OpenRLHF; metrics ds_sleep_s, ds_wake_s, "
        "ds_sleep_gb, on CUDA ds_sleep_freed_gb",
        openrlhf=("ds.enable_sleep",)))
    agent_func_path: str | None = field(default=None, metadata=meta(
        "multi-turn episodes against an environment: file.py with OpenRLHF's AgentInstance (async reset/step "
        "returning rewards, environment_feedback, done), file.py:NAME returning an rl_rollout Environment, or "
        "builtin:calculator. Environment tokens are masked out of the loss; the episode's reward (the sum of its "
        "step rewards, plus --reward_fn's if given) trains", openrlhf=("train.agent_func_path",)))
    agent_turn_rewards: bool = field(default=False, metadata=meta(
        "with --agent_func_path: each step reward goes on the last token of the policy turn it answers (token-level "
        "rewards: earlier turns' tokens see only the rewards from their turn on) instead of their sum on the "
        "episode's last token; for the estimators that take token rewards: gae, reinforce, reinforce_baseline"))
    agent_max_turns: int = field(default=4, metadata=meta(
        "with --agent_func_path: policy turns per episode at most (each up to --generate_max_len tokens)"))
    agent_max_len: int = field(default=1024, metadata=meta(
        "with --agent_func_path: prompt + response tokens of an episode (policy and environment turns) at most"))
    reward_max_failure_rate: float = field(default=0.5, metadata=meta(
        "stop the run, with the first failure's message, when more than this fraction of an iteration's reward "
        "calls fail (raise, time out, return a non-number, NaN or inf; each gets --reward_fallback); in [0, 1), so "
        "an iteration whose calls all fail always stops; 0: any failure stops. Default 0.5: past half, fallback "
        "rewards outweigh real ones and the advantages mostly measure the failures"))
    reward_clip_range: tuple[float, float] | None = field(default=None, metadata=meta(
        "clip rewards to LOW HIGH", openrlhf=("reward.clip_range",)))
    overlong_buffer_len: int | None = field(default=None, metadata=meta(
        "DAPO overlong penalty: the last N tokens before generate_max_len ramp the penalty up",
        openrlhf=("reward.overlong_buffer_len",)))
    overlong_penalty_factor: float = field(default=1.0, metadata=meta(
        "DAPO overlong penalty at generate_max_len", openrlhf=("reward.overlong_penalty_factor",)))
    stop_properly_penalty_coef: float | None = field(default=None, metadata=meta(
        "ProRL stop-properly penalty on samples cut at --generate_max_len (finish reason length, no EOS): their "
        "reward is scaled by this coefficient in [0, 1], or, when negative, replaced by it (a fixed reward)",
        openrlhf=("reward.stop_properly_penalty_coef",)))
    whiten_advantages: bool | None = field(default=None, metadata=meta(
        "batch-whiten the advantages (default: what the estimator's registry entry says)"))
    no_advantage_std_norm: bool = field(default=False, metadata=meta(
        "batch normalisation of the advantages subtracts the mean only, without dividing by the std (OpenRLHF: "
        "gae, reinforce, reinforce_baseline, the estimators it whitens)", openrlhf=("algo.advantage.no_std_norm",)))
    dynamic_filtering: bool = field(default=False, metadata=meta(
        "drop groups without signal and sample new prompts (DAPO); judged on the raw rewards (or a reward "
        "file's scores), before length penalties and clipping, as OpenRLHF", openrlhf=("algo.dynamic_filtering_enable",)))
    dynamic_filtering_reward_range: tuple[float, float] = field(default=(0.0, 1.0), metadata=meta(
        "keep groups whose mean reward lies strictly inside LOW HIGH", openrlhf=("algo.dynamic_filtering_range",)))
    dynamic_filtering_max_rounds: int = field(default=4, metadata=meta(
        "rollout rounds per iteration before dropped groups fill the batch"))
    critic_learning_rate: float | None = field(default=None, metadata=meta(
        "critic learning rate (default: --learning_rate)", openrlhf=("critic.adam.lr",)))
    # the critic's own optimizer settings (OpenRLHF's --critic.*); unset: the actor's (ours, and OpenRLHF's flat
    # v0.10.1 dialect, where one --adam_betas / --l2 / --lr_scheduler ... served both)
    critic_adam_betas: tuple[float, float] | None = field(default=None, metadata=meta(
        "critic AdamW betas B1 B2 (default: --adam_betas)", openrlhf=("critic.adam.betas",)))
    critic_adam_eps: float | None = field(default=None, metadata=meta(
        "critic AdamW epsilon (default: --adam_eps)", openrlhf=("critic.adam.eps",)))
    critic_weight_decay: float | None = field(default=None, metadata=meta(
        "critic AdamW weight decay (default: --l2)", openrlhf=("critic.adam.weight_decay",)))
    critic_lr_scheduler: str | None = field(default=None, metadata=meta(
        "critic LR schedule: cosine_with_min_lr | constant_with_warmup | constant (default: --lr_scheduler)",
        openrlhf=("critic.lr_scheduler",)))
    critic_lr_warmup_ratio: float | None = field(default=None, metadata=meta(
        "critic LR warmup share of the steps (default: --lr_warmup_ratio)", openrlhf=("critic.lr_warmup_ratio",)))
    critic_min_lr_ratio: float | None = field(default=None, metadata=meta(
        "critic cosine floor as a share of its learning rate (default: --min_lr_ratio)",
        openrlhf=("critic.min_lr_ratio",)))
    critic_max_norm: float | None = field(default=None, metadata=meta(
        "critic gradient clipping, 0 disables (default: --max_norm)", openrlhf=("critic.max_norm",)))
    critic_optim: str = field(default="adam", metadata=meta(
        "the critic's optimizer: adam | muon, as --optim (which is the actor's); adam unless given, as OpenRLHF's "
        "--critic.optim (its value head trains in the Muon group too: a 2-D weight)", openrlhf=("critic.optim",)))
    critic_muon_lr: float = field(default=MUON_DEFAULTS["muon_lr"], metadata=meta(
        "with --critic_optim muon: the critic's Muon learning rate (its AdamW group's: --critic_learning_rate)",
        openrlhf=("critic.muon.lr",)))
    critic_muon_momentum: float = field(default=MUON_DEFAULTS["muon_momentum"], metadata=meta(
        "with --critic_optim muon: the critic's Muon momentum", openrlhf=("critic.muon.momentum",)))
    aux_loss_coef: float = field(default=0.0, metadata=meta(
        "mixture-of-experts policy: + coef x the router's load-balancing loss in its loss, per micro-batch weighted "
        "by its share of the samples, as OpenRLHF's actor (0: off; the critic's value head is left without it); a "
        "model without experts is refused", openrlhf=("actor.aux_loss_coef",)))
    pretrain_data: str | None = field(default=None, metadata=meta(
        "PPO-ptx (Ouyang et al. 2022, as OpenRLHF): pretraining text mixed into the policy's update, files as "
        "--dataset, the text in --input_key, cut at --max_len + --generate_max_len tokens, at most max_epochs x "
        "prompts x n_samples_per_prompt rows; each policy micro-batch adds --ptx_coef x the token-mean NLL of "
        "--micro_train_batch_size of them (metric ptx_loss)"))
    pretrain_data_probs: str | None = field(default=None, metadata=meta(
        "with --pretrain_data: mix its comma-separated files by these probabilities (as --dataset_probs)"))
    pretrain_split: str = field(default="train", metadata=meta("with --pretrain_data: the split to read"))
    ptx_coef: float = field(default=0.05, metadata=meta("with --pretrain_data: the weight of its NLL loss"))
    enable_ema: bool = field(default=False, metadata=meta(
        "keep an exponential moving average of the policy's trained weights (updated after each optimizer step, "
        "in the weights' dtype, on their device; ZeRO-3: each rank its partition) and export it instead of the "
        "policy (--save_path, --save_hf_ckpt); checkpoints keep it; the engines sample from the policy itself",
        openrlhf=("train.enable_ema",)))
    ema_beta: float = field(default=0.992, metadata=meta(
        "with --enable_ema: ema = beta x ema + (1 - beta) x weights", openrlhf=("train.ema_beta",)))
    freezing_actor_steps: int = field(default=0, metadata=meta(
        "first iterations train the critic only", openrlhf=("critic.freezing_steps",)))
    logprob_gap_alarm: float | None = field(default=None, metadata=meta(
        "warn (and count rl/logprob_gap_alarm) when the mean |trainer - engine| log-prob gap exceeds this "
        "(default: 1e-3 in fp32, 5e-2 in bf16; 0: off)"))
    save_steps: int = field(default=-1, metadata=meta(
        "checkpoint every N iterations (-1: none)", openrlhf=("ckpt.save_steps",)))
    ckpt_path: str | None = field(default=None, metadata=meta(
        "checkpoint folder: one iter_N/ per save (policy/, critic/, loop_state.json), committed by its COMPLETE "
        "marker, written last", openrlhf=("ckpt.path",)))
    max_ckpt_num: int = field(default=3, metadata=meta(
        "committed checkpoints kept (older ones go only after a newer one is committed)", openrlhf=("ckpt.max_num",)))
    max_ckpt_mem: float | None = field(default=None, metadata=meta(
        "disk budget of --ckpt_path in GB: after each commit the oldest checkpoints go while the folder without the "
        "newest one holds more (as OpenRLHF, which prunes before each save); the newest is never removed, nor the "
        "best one (unset or inf, OpenRLHF's PPO default: no budget)", openrlhf=("ckpt.max_mem",)))
    disable_ds_ckpt: bool = field(default=False, metadata=meta(
        "checkpoints without the roles' DeepSpeed state (weights, optimizer), as OpenRLHF's flag: with "
        "--save_hf_ckpt a checkpoint holds only the HF exports (iter_N/hf/) and the loop state, without it none is "
        "written; --load_checkpoint cannot resume from one (start a new run from iter_N/hf with --pretrain)",
        openrlhf=("ckpt.disable_ds",)))
    best_metric_key: str = field(default="", metadata=meta(
        "with --ckpt_path and --eval_dataset: keep the checkpoint of the best eval so far (higher is better) in "
        "best_iter_N/ beside the iter_N/ ones, replacing the previous best, never pruned; the key is an eval "
        "metric (reward_mean, pass@N, ...; eval/ prefix optional). Empty: eval/reward_mean (OpenRLHF's auto "
        "choice, its pass1); none: off", openrlhf=("ckpt.best_metric_key",)))
    load_checkpoint: bool = field(default=False, metadata=meta(
        "resume every role and the loop from the newest committed checkpoint under --ckpt_path. Trusted "
        "checkpoints only: DeepSpeed reads them with torch.load(weights_only=False), so loading one runs any code "
        "it holds; for weights from elsewhere start from their HF export (safetensors) with --pretrain and "
        "--critic_pretrain", openrlhf=("ckpt.load_enable",)))
    save_hf_ckpt: bool = field(default=False, metadata=meta(
        "every checkpoint also holds the Hugging Face export of the policy (iter_N/hf/) and of the critic, if any "
        "(iter_N/hf/critic/), written before the checkpoint's COMPLETE marker; without --save_steps no checkpoint is "
        "written, so neither is this (as in OpenRLHF; the final model goes to --save_path)",
        openrlhf=("ckpt.save_hf",)))
    save_path: str | None = field(default=None, metadata=meta(
        "final HF export of the policy", openrlhf=("ckpt.output_dir",)))
    save_value_network: bool = field(default=False, metadata=meta(
        "also export the critic (save_path/critic)", openrlhf=("critic.save_value_network",)))
    run_dir: str | None = field(default=None, metadata=meta("metrics.jsonl, tensorboard/, curves.png"))
    logging_steps: int = field(default=1, metadata=meta(
        "write the metrics (metrics.jsonl, TensorBoard, wandb) every N iterations, the last one and every eval pass "
        "included; the progress bar and the metrics history in checkpoints still see every iteration"))
    eval_steps: int = field(default=-1, metadata=meta(
        "with --eval_dataset: evaluate every N iterations and after the last one (-1: only after the last one)",
        openrlhf=("eval.steps",)))
    eval_n_samples_per_prompt: int = field(default=4, metadata=meta(
        "with --eval_dataset: samples per eval prompt; eval/pass@N is the mean over prompts of the best sample's "
        "reward", openrlhf=("eval.n_samples_per_prompt",)))
    eval_temperature: float = field(default=0.6, metadata=meta(
        "with --eval_dataset: sampling temperature of the eval pass (0: greedy)", openrlhf=("eval.temperature",)))

    def __post_init__(self) -> None:
        from rl_core.checkpoint import unset_infinite_budget

        unset_infinite_budget(self)  # inf: no budget
        spec = get_estimator(self.advantage_estimator)  # an unknown name fails listing the valid ones
        check_numbers(self, positive=("eps_clip", "critic_learning_rate", "kl_target", "top_p"),
                      non_negative=("value_clip", "overlong_penalty_factor", "freezing_actor_steps"),
                      unit=("gamma", "lambd", "top_p"), at_least_1=("kl_horizon",))
        check_optimizer(self.critic_optim, self.critic_muon_lr, self.critic_muon_momentum, prefix="critic_")
        for name in ("n_samples_per_prompt", "rollout_batch_size", "generate_max_len", "num_episodes", "max_epochs",
                     "dynamic_filtering_max_rounds", "max_ckpt_num", "agent_max_turns",
                     "partial_rollout_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} (--{name}) must be >= 1, got {getattr(self, name)}")
        if self.n_samples_per_prompt < spec.min_group_size:
            raise ValueError(f"--advantage_estimator {self.advantage_estimator} compares the samples of a prompt: "
                             f"set --n_samples_per_prompt >= {spec.min_group_size} (got {self.n_samples_per_prompt})")
        if self.dynamic_filtering and self.n_samples_per_prompt < 2:
            raise ValueError("--dynamic_filtering judges groups of samples: set --n_samples_per_prompt >= 2")
        if self.temperature <= 0:
            raise ValueError(f"temperature (--temperature) must be > 0, got {self.temperature}")
        if self.init_kl_coef < 0:
            raise ValueError(f"init_kl_coef (--init_kl_coef) must be >= 0, got {self.init_kl_coef}")
        if self.entropy_loss_coef is not None and not math.isfinite(self.entropy_loss_coef):
            raise ValueError(f"entropy_loss_coef (--entropy_loss_coef) must be a finite number, got "
                             f"{self.entropy_loss_coef}")
        if self.kl_estimator not in ("k1", "k2", "k3"):
            raise ValueError(f"kl_estimator (--kl_estimator) must be k1, k2 or k3, got {self.kl_estimator!r}")
        if self.load_checkpoint and not self.ckpt_path:
            raise ValueError("load_checkpoint needs ckpt_path (--ckpt_path DIR) to find checkpoints in")
        if self.save_steps > 0 and not self.ckpt_path:
            raise ValueError(f"save_steps={self.save_steps} needs ckpt_path (--ckpt_path DIR) to write them to")
        from rl_core.checkpoint import check_max_gb
        from rl_core.trainers.ppo_eval import best_metric_name

        check_max_gb(self.max_ckpt_mem)
        best_metric_name(self.best_metric_key, self.eval_n_samples_per_prompt)  # a metric the eval never logs fails
        if self.max_iterations < 0:
            raise ValueError(f"max_iterations must be >= 0 (0: num_episodes passes), got {self.max_iterations}")
        if self.overlong_buffer_len is not None and not 0 < self.overlong_buffer_len <= self.generate_max_len:
            raise ValueError(f"overlong_buffer_len (--overlong_buffer_len) must be in 1..generate_max_len="
                             f"{self.generate_max_len}, got {self.overlong_buffer_len}")
        if not 0 <= self.reward_max_failure_rate < 1:
            raise ValueError(f"reward_max_failure_rate (--reward_max_failure_rate) must be in [0, 1), got "
                             f"{self.reward_max_failure_rate}: an iteration whose reward calls all fail always "
                             "stops the run (0: any failure stops it)")
        if self.logprob_gap_alarm is not None and self.logprob_gap_alarm < 0:
            raise ValueError(f"logprob_gap_alarm must be >= 0 (0: off), got {self.logprob_gap_alarm}")
        if self.agent_max_len < 2:
            raise ValueError(f"agent_max_len (--agent_max_len) must be >= 2 (prompt + response tokens), got "
                             f"{self.agent_max_len}")
        if self.agent_turn_rewards and not self.agent_func_path:
            raise ValueError("--agent_turn_rewards places an environment's per-turn rewards: add --agent_func_path "
                             "FILE.py, or drop --agent_turn_rewards")
        if self.agent_turn_rewards and not spec.turn_rewards:
            fit = ", ".join(n for n, e in ESTIMATORS.items() if e.turn_rewards)
            raise ValueError(f"--agent_turn_rewards gives token-level rewards, which --advantage_estimator "
                             f"{self.advantage_estimator} (one scalar per sample, compared within its group) does not "
                             f"take: use {fit}, or drop --agent_turn_rewards")
        if self.logging_steps < 1:
            raise ValueError(f"logging_steps (--logging_steps) must be >= 1, got {self.logging_steps}")
        if self.max_staleness < 0:
            raise ValueError(f"max_staleness (--max_staleness) must be >= 0, got {self.max_staleness}")
        if self.partial_rollout and not self.async_train:
            raise ValueError("--partial_rollout lets weight updates land mid-generation, which only happens when "
                             "generation runs beside training: add --async_train")
        if self.generate_batch_size is not None and self.generate_batch_size < self.rollout_batch_size:
            raise ValueError(f"--generate_batch_size {self.generate_batch_size} is below --rollout_batch_size "
                             f"{self.rollout_batch_size}: a round must fill a batch; raise it or drop the flag")
        if self.generate_batch_size is not None and self.generate_batch_size > self.rollout_batch_size \
                and not self.async_train:
            raise ValueError(f"--generate_batch_size {self.generate_batch_size} > --rollout_batch_size "
                             f"{self.rollout_batch_size} over-samples into a buffer that later iterations train on, "
                             "which needs --async_train (as in OpenRLHF); add it or drop the flag")
        if self.max_staleness != 1 and not self.async_train:
            raise ValueError(f"--max_staleness {self.max_staleness} bounds --async_train's pipelining; add "
                             "--async_train or drop --max_staleness")
        self._check_extras()
        self._check_training_extras()
        try:
            self.policy_loss  # noqa: B018 - builds (and so validates) the variant
        except ValueError as e:
            raise ValueError(f"{e} (--policy_loss_type, --eps_clip, --eps_clip_high, --dual_clip, --loss_agg_mode, "
                             f"--is_correction, --is_correction_threshold)") from None

    def _check_extras(self) -> None:
        """Evaluation, the stop-properly penalty, HF exports in checkpoints, centre-only advantages."""
        if self.eval_steps == 0 or self.eval_steps < -1:
            raise ValueError(f"eval_steps (--eval_steps) must be >= 1, or -1 to evaluate only after the last "
                             f"iteration, got {self.eval_steps}")
        if self.eval_n_samples_per_prompt < 1:
            raise ValueError(f"eval_n_samples_per_prompt (--eval_n_samples_per_prompt) must be >= 1, got "
                             f"{self.eval_n_samples_per_prompt}")
        if self.eval_temperature < 0:
            raise ValueError(f"eval_temperature (--eval_temperature) must be >= 0 (0: greedy), got "
                             f"{self.eval_temperature}")
        if self.stop_properly_penalty_coef is not None and self.stop_properly_penalty_coef > 1:
            raise ValueError(f"stop_properly_penalty_coef (--stop_properly_penalty_coef) must be in [0, 1] (a "
                             f"scale) or negative (a fixed reward), got {self.stop_properly_penalty_coef}")
        if self.no_advantage_std_norm and not self.whiten:
            raise ValueError(f"--no_advantage_std_norm changes the batch normalisation of the advantages, which "
                             f"--advantage_estimator {self.advantage_estimator} does not do (as in OpenRLHF, where "
                             f"it then has no effect): drop the flag, or use dr_grpo for the group mean without the "
                             f"std")

    def _check_training_extras(self) -> None:
        """The critic's own optimizer settings, the MoE aux loss and EMA numbers."""
        from rl_core.strategy import SCHEDULES

        check_numbers(self, positive=("critic_adam_eps",), unit=("critic_min_lr_ratio", "ema_beta"),
                      non_negative=("critic_weight_decay", "critic_max_norm", "aux_loss_coef", "ptx_coef"))
        if self.pretrain_data_probs is not None and not self.pretrain_data:
            raise ValueError(f"pretrain_data_probs={self.pretrain_data_probs!r} (--pretrain_data_probs) mixes the "
                             f"--pretrain_data files: add --pretrain_data FILES or drop it")
        if self.ema_beta != 0.992 and not self.enable_ema:
            raise ValueError(f"ema_beta={self.ema_beta} (--ema_beta) sets the EMA weights' decay: add --enable_ema, "
                             f"or drop --ema_beta")
        if self.critic_adam_betas is not None and not all(0 <= b < 1 for b in self.critic_adam_betas):
            raise ValueError(f"critic_adam_betas (--critic_adam_betas) must be two numbers in [0, 1), got "
                             f"{self.critic_adam_betas}")
        if self.critic_lr_scheduler is not None and self.critic_lr_scheduler not in SCHEDULES:
            raise ValueError(f"critic_lr_scheduler (--critic_lr_scheduler) {self.critic_lr_scheduler!r} is not a "
                             f"schedule; valid: {', '.join(SCHEDULES)}")
        if self.critic_lr_warmup_ratio is not None and not 0 <= self.critic_lr_warmup_ratio < 1:
            raise ValueError(f"critic_lr_warmup_ratio (--critic_lr_warmup_ratio) must be in [0, 1), got "
                             f"{self.critic_lr_warmup_ratio}")

    def critic_optimizer(self) -> dict:
        """The critic's own optimizer settings that are set, and its optimizer (adam unless given: never the
        actor's, as OpenRLHF's --critic.optim), as :class:`~rl_core.strategy.StrategyConfig` field names (the
        critic's strategy is the actor's with these replaced)."""
        ours = {"learning_rate": self.critic_learning_rate, "adam_betas": self.critic_adam_betas,
                "adam_eps": self.critic_adam_eps, "weight_decay": self.critic_weight_decay,
                "lr_scheduler": self.critic_lr_scheduler, "lr_warmup_ratio": self.critic_lr_warmup_ratio,
                "min_lr_ratio": self.critic_min_lr_ratio, "max_norm": self.critic_max_norm}
        return {**{k: v for k, v in ours.items() if v is not None}, "optim": self.critic_optim,
                "muon_lr": self.critic_muon_lr, "muon_momentum": self.critic_muon_momentum}

    @property
    def estimator(self):
        """The estimator's registry entry (rl-algos' :class:`~rl_algos.advantages.EstimatorSpec`)."""
        return get_estimator(self.advantage_estimator)

    @property
    def policy_loss(self):
        """The policy-loss variant (rl-algos typed config), built once per access from these fields."""
        kind = self.is_correction_type
        corr = None if kind is None else ISCorrectionConfig(kind, *self.is_correction_threshold)
        return policy_loss_config(self.policy_loss_type, clip_eps_low=self.eps_clip, clip_eps_high=self.eps_clip_high,
                                  dual_clip=self.dual_clip, aggregation=self.loss_agg_mode, is_correction=corr)

    @property
    def is_correction_type(self) -> str | None:
        """The importance correction in force: ``--is_correction``, else ``tis`` with ``--async_train`` (its
        samples come from older policies than the one that trains), else none."""
        return self.is_correction or ("tis" if self.async_train else None)

    @property
    def loss_norm_len(self) -> float:
        """The constant that ``seq-mean-token-sum-norm`` divides by (Dr. GRPO): the generation budget."""
        return float(self.generate_max_len)

    @property
    def needs_critic(self) -> bool:
        return self.estimator.needs_critic

    @property
    def needs_reference(self) -> bool:
        return self.init_kl_coef > 0

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
        """The most versions a sample may lag the policy it trains: ``max_staleness``, plus what over-sampling's
        buffer adds (``generate_batch_size`` G over ``rollout_batch_size`` B: up to ``(G + B - 2) // B``)."""
        g, b = self.generate_batch_size or self.rollout_batch_size, self.rollout_batch_size
        return self.max_staleness + ((g + b - 2) // b if g > b else 0)

    def iterations(self, num_prompts: int) -> int:
        return self.max_iterations or max(1, self.num_episodes * num_prompts // self.rollout_batch_size)

    def optimizer_steps(self, num_prompts: int, train_batch_size: int) -> int:
        """Policy (and critic) optimizer steps over the run, for the LR schedule."""
        samples = self.rollout_batch_size * self.n_samples_per_prompt
        return self.iterations(num_prompts) * (samples // train_batch_size) * self.max_epochs

