"""One way to build an RL run: a run config and a group factory in, the roles, engines, weight sync and loop out.

:func:`build_run` is the only place that decides which roles a run has (a critic when
the estimator's registry entry needs one, a reference when the KL coefficient is above
0, a reward-model role when a reward model is given, a teacher with on-policy distillation), what each is built from, which
engines generate and how their weights are kept in sync. Where the roles live is the
factory's business:

- :class:`LocalFactory` (here): every role and the engine in this process
  (:class:`~rl_core.rl.groups.LocalGroup`, weights handed over in memory), the
  single-controller ``rl ppo``, ``rl demo``, benchmarks and tests.
- rl-cli's Ray factory: one Ray actor per rank from rl-placement's plan, engines as
  Ray actors, collective or CUDA IPC weight sync (``rl ppo-ray``). rl-core never
  imports Ray.

A factory has three methods: ``role(name, worker_cls, *args, **kwargs)`` returns a
worker group of ``worker_cls`` built with those arguments (``name`` is one of
``policy``, ``critic``, ``ref``, ``reward``, ``teacher``); ``rollout(engine_cfg, model, *, dtype,
seed, device)`` returns the rollout (``generate`` / ``sleep`` / ``wake_up`` /
``shutdown``); ``weight_sync(policy, rollout, sync_cfg)`` returns the callable the loop
syncs with, after resolving the backend with :meth:`rl_rollout.WeightSyncConfig.resolve`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Protocol

from rl_algos import estimator_names
from rl_core.attention import requested_attention
from rl_core.metrics import MetricsLogger
from rl_core.models import check_fused_lm_head
from rl_core.rl.auto import Hardware
from rl_core.rl.auto import resolve as resolve_auto
from rl_core.rl.batching import MicroBatchConfig
from rl_core.rl.distill_topk import check_logit_distill
from rl_core.rl.ds_sleep import check_ds_sleep
from rl_core.rl.frozen_workers import ReferenceWorker, RewardModelWorker
from rl_core.rl.groups import LocalGroup, WorkerGroup
from rl_core.rl.model_config import RLModelConfig  # re-exported: the settings live beside, torch-free
from rl_core.rl.objectives import CriticObjective, PolicyObjective
from rl_core.rl.roles import require_reward, run_roles
from rl_core.rl.teacher import TeacherWorker
from rl_core.rl.weight_syncs import DirectWeightSync
from rl_core.rl.workers import CriticWorker, PolicyWorker
from rl_core.strategy import StrategyConfig
from rl_core.trainers.ppo import PPOTrainer
from rl_core.trainers.ppo_config import PPOConfig
from rl_rollout.config import EngineConfig, WeightSyncConfig
from rl_rollout.vision import is_vision_config

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RunConfig:
    """Everything :func:`build_run` needs, each part owned by its package."""

    model: RLModelConfig
    strategy: StrategyConfig
    ppo: PPOConfig
    engine: EngineConfig = EngineConfig()
    sync: WeightSyncConfig = WeightSyncConfig()
    batching: MicroBatchConfig = MicroBatchConfig()
    packing: bool | None = None  # every forward's items in one row (rl_core.rl.batching); the CLI's data.packing;
    # None: auto (rl_core.rl.auto: packed where the packed attention runs without a dense mask, CUDA)

    def __post_init__(self) -> None:
        check_ds_sleep(self.ppo.deepspeed_enable_sleep, self.strategy)

        check_fused_lm_head(self.model.fused_lm_head, self.strategy)
        if self.model.load_in_4bit is not None:  # QLoRA: ZeRO-3 cannot partition 4-bit weights
            self.model.load_in_4bit.check(lora_rank=self.model.lora_rank, zero_stage=self.strategy.zero_stage)
        check_logit_distill(
            self.ppo.distill, fused_lm_head=self.model.fused_lm_head, ring_attn_size=self.strategy.ring_attn_size
        )
        offloaded = [f"--{n}" for n in ("ref_offload", "reward_offload") if getattr(self.model, n)]
        offloaded += ["--teacher_offload"] if self.ppo.distill is not None and self.ppo.distill.offload else []
        if offloaded:
            self.strategy.check_param_offload(" and ".join(offloaded))

    @property
    def dtype(self) -> str:
        return "bf16" if self.strategy.bf16 else "fp32"

    def load_kw(self) -> dict:
        attn = requested_attention(self.model.attn_implementation, self.model.flash_attn)
        if self.strategy.ring_attn_size > 1:  # every role computes its slice of each row (rl_core.ring_attention)
            attn = "rl_ring"
        return {
            "dtype": self.dtype,
            "attn_implementation": attn,
            "gradient_checkpointing": self.strategy.gradient_checkpointing,
            "use_liger_kernel": self.model.use_liger_kernel,
            "packed": self.packing,
            "lora": self.model.lora(),  # the frozen roles (reference, reward model) drop it
            "experts_implementation": self.model.experts_implementation,
            "load_in_4bit": self.model.load_in_4bit,  # QLoRA (rl_core.qlora): the reference keeps it, as the base
        }


class GroupFactory(Protocol):
    def role(self, name: str, worker_cls: type, *args: Any, **kwargs: Any) -> WorkerGroup: ...

    def rollout(self, engine_cfg: EngineConfig, model: str, *, dtype: str, seed: int, device: str) -> Any: ...

    def weight_sync(self, policy: WorkerGroup, rollout: Any, sync_cfg: WeightSyncConfig) -> Any: ...


class LocalFactory:
    """Every role and the engine in this process (one rank each); weights handed over in memory."""

    def __init__(self, engine_kind: str | None = None):
        self.engine_kind = engine_kind  # overrides EngineConfig.kind (e.g. a test forcing "hf")

    def role(self, name: str, worker_cls: type, *args: Any, **kwargs: Any) -> LocalGroup:
        return LocalGroup(worker_cls(*args, **kwargs), name)

    def rollout(self, engine_cfg: EngineConfig, model: str, *, dtype: str, seed: int, device: str):
        return engine_cfg.make(model, dtype=dtype, seed=seed, device=device, in_process=True, kind=self.engine_kind)

    # policy: a WorkerGroup, as GroupFactory's (this factory's roles are LocalGroups)
    def weight_sync(self, policy: WorkerGroup, rollout: Any, sync_cfg: WeightSyncConfig) -> DirectWeightSync:
        sync_cfg.resolve(in_process=True, on_gpu=False)  # refuses gloo/nccl/ipc with the reason
        return DirectWeightSync(policy, rollout, verify=sync_cfg.verify)


@dataclass
class Run:
    """A built run: the loop and what it holds, and :meth:`close` to release the engines and pools."""

    trainer: PPOTrainer
    policy: WorkerGroup
    rollout: Any
    weight_sync: Any
    critic: WorkerGroup | None = None
    ref: WorkerGroup | None = None
    reward_model: WorkerGroup | None = None
    reward_fn: Any = None
    teacher: WorkerGroup | None = None

    def roles(self) -> str:
        groups = (
            ("critic", self.critic),
            ("ref", self.ref),
            ("reward model", self.reward_model),
            ("teacher", self.teacher),
        )
        names = ["policy"] + [n for n, g in groups if g is not None]
        return ", ".join(names)

    def close(self) -> None:
        close = getattr(self.reward_fn, "close", None)
        if callable(close):
            close()
        self.rollout.shutdown()


def _is_vlm(path: str) -> bool:
    from transformers import AutoConfig

    return is_vision_config(AutoConfig.from_pretrained(path))


def build_run(
    cfg: RunConfig,
    factory: GroupFactory,
    *,
    prompts,
    tokenizer,
    reward_fn=None,
    metrics: MetricsLogger | None = None,
    eval_prompts=None,
    ptx=None,
) -> Run:
    """The roles the run needs, the rollout, the weight sync and the :class:`PPOTrainer` over them
    (``eval_prompts``: the eval set, a PromptDataset, or None; ``ptx``: PPO-ptx's pretraining items, a
    :class:`~rl_core.data.PretrainDataset`, or None)."""
    if not cfg.model.pretrain:
        raise ValueError("RLModelConfig.pretrain (--pretrain) is required: a local HF model folder")
    # a factory over several ranks says how many the trained roles have (rl-cli's RayFactory); in-process: one
    cfg, choices = resolve_auto(
        cfg,
        Hardware.here(trained_ranks=getattr(factory, "trained_ranks", 1)),
        images=cfg.packing is None and _is_vlm(cfg.model.pretrain),
    )
    for choice in choices:  # the CLI resolved them already and printed why; a Python caller learns it here
        logger.info("auto: %s", choice)
    m, s, p = cfg.model, cfg.strategy, cfg.ppo
    if m.pretrain is None:  # not reached: checked above, and resolve_auto keeps the model folder
        raise ValueError("RLModelConfig.pretrain (--pretrain) is required: a local HF model folder")
    require_reward(
        reward_fn=reward_fn is not None,
        reward_model=bool(m.reward_pretrain),
        agent=bool(p.agent or p.agent_cmd),
        distill_only=bool(p.distill and p.distill.only),
    )
    roles = run_roles(p, reward_model=bool(m.reward_pretrain))
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    samples = p.rollout_batch_size * p.sampling.n_samples_per_prompt
    steps = p.optimizer_steps(len(prompts), s.train_batch_size) if samples % s.train_batch_size == 0 else 1
    kw = cfg.load_kw()
    mb = {"batching": cfg.batching, "packing": cfg.packing}
    if roles.critic and _is_vlm(m.pretrain):
        raise ValueError(
            f"a critic for a vision-language policy ({m.pretrain}) is not built: pick an estimator "
            f"without one (--advantage_estimator {' | '.join(estimator_names(critic_free=True))}), "
            f"as OpenRLHF"
        )
    actor_kw = {**kw, "fused_lm_head": m.fused_lm_head}  # the policy and the reference: the critic has no LM head
    # QLoRA quantizes the trained roles' base and the reference (the same base); a teacher or reward model is its own
    unquantized = {k: v for k, v in kw.items() if k != "load_in_4bit"}
    policy_kw = {**actor_kw, "freeze_visual_encoder": True} if m.freeze_visual_encoder else actor_kw
    ptx_items = list(ptx) if ptx is not None else None
    policy = factory.role(
        "policy",
        PolicyWorker,
        s,
        m.pretrain,
        PolicyObjective.of(p),
        steps,
        load_kw=policy_kw,
        pad_id=pad,
        ptx=ptx_items,
        **mb,
    )
    head = {"value_head_prefix": m.value_head_prefix}  # where an OpenRLHF-format folder keeps its head
    critic = (
        factory.role(
            "critic",
            CriticWorker,
            s,
            m.critic_path,
            CriticObjective.of(p),
            steps,
            load_kw={**kw, **head},
            pad_id=pad,
            **mb,
        )
        if roles.critic
        else None
    )
    ref = (
        factory.role(
            "ref",
            ReferenceWorker,
            s,
            m.ref_path,
            load_kw=actor_kw,
            pad_id=pad,
            temperature=p.sampling.temperature,
            offload=m.ref_offload,
            **mb,
        )
        if roles.ref
        else None
    )
    teacher = (
        factory.role(
            "teacher",
            TeacherWorker,
            s,
            p.distill.teacher_pretrain,
            load_kw={**unquantized, "fused_lm_head": m.fused_lm_head},
            pad_id=pad,
            temperature=p.sampling.temperature,
            offload=p.distill.offload,
            **mb,
        )
        if p.distill is not None
        else None
    )
    rm = (
        factory.role(
            "reward",
            RewardModelWorker,
            s,
            m.reward_pretrain,
            load_kw={**unquantized, **head},
            pad_id=pad,
            normalize=m.normalize_reward,
            offload=m.reward_offload,
            **mb,
        )
        if roles.reward_model
        else None
    )
    device = policy.call_rank(0, "world")["device"]
    rollout = factory.rollout(cfg.engine, m.pretrain, dtype=cfg.dtype, seed=s.seed, device=device)
    sync = factory.weight_sync(policy, rollout, cfg.sync)
    trainer = PPOTrainer(
        p,
        policy=policy,
        rollout=rollout,
        weight_sync=sync,
        prompts=prompts,
        tokenizer=tokenizer,
        train_batch_size=s.train_batch_size,
        reward_fn=reward_fn,
        reward_model=rm,
        critic=critic,
        ref=ref,
        sleep_engines=cfg.engine.enable_sleep,
        metrics=metrics,
        seed=s.seed,
        gap_alarm=p.gap_alarm(bf16=s.bf16),
        sleep_level=cfg.engine.sleep_level,
        eval_prompts=eval_prompts,
        batching=cfg.batching,
        ring_attn_size=s.ring_attn_size,
        teacher=teacher,
        sync_first=m.load_in_4bit is not None,  # QLoRA: the engines loaded the unquantized checkpoint
    )
    return Run(
        trainer, policy, rollout, sync, critic=critic, ref=ref, reward_model=rm, reward_fn=reward_fn, teacher=teacher
    )
