"""DeepSpeed's config for a :class:`~rl_core.strategy_config.StrategyConfig`: the engine's JSON
(:func:`deepspeed_config`: ZeRO stage, buckets, offload, bf16, batch arithmetic, the Muon optimizer section of
:func:`muon_section`) and the optimizer's parameter groups (:func:`trainable_param_groups`). Pure functions
of the settings; :class:`rl_core.strategy.DeepSpeedStrategy` calls them (its ``ds_config``, ``param_groups``,
``muon_config``) and builds the engine.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from rl_core.strategy_config import BatchPlan, StrategyConfig


def deepspeed_config(
    c: StrategyConfig, batch_plan: Callable[[], BatchPlan], *, train: bool = True, offload: bool = False
) -> dict:
    """DeepSpeed's config: the training one, or with ``train=False`` a frozen model's (OpenRLHF's
    get_eval_ds_config: ZeRO-3 when training runs it, else stage 0), whose parameters ``offload`` keeps on
    the CPU (ZeRO-3's offload_param, as OpenRLHF's --ref.offload / --reward.offload). ``batch_plan``: the
    strategy's :meth:`~rl_core.strategy.DeepSpeedStrategy.batch_plan` (called after the offload checks)."""
    if offload and train:
        raise ValueError(
            "offload=True is for frozen models (train=False); trained ones offload their "
            "optimizer states: --adam_offload"
        )
    if offload:
        c.check_param_offload("--ref_offload / --reward_offload")
    plan = batch_plan()
    zero: dict = {
        "stage": c.zero_stage if train else (3 if c.zero_stage == 3 else 0),
        "reduce_bucket_size": c.zero_bucket_bytes,
        "allgather_bucket_size": c.zero_bucket_bytes,
    }
    if zero["stage"] in (1, 2):
        # the contiguous gradient buffer serves the reduce over ranks; alone, it is one more copy of
        # every gradient per step (SFT benchmark, one process: ZeRO-1 1.19x -> 1.05x a plain loop)
        zero["contiguous_gradients"] = plan.dp_size > 1
    if c.zero_stage == 3:
        zero.update(
            stage3_prefetch_bucket_size=c.zero_bucket_bytes,
            stage3_param_persistence_threshold=10_000,
            stage3_gather_16bit_weights_on_model_save=True,
        )
    if offload:
        zero["offload_param"] = {"device": "cpu", "pin_memory": torch.cuda.is_available()}
    if train and c.adam_offload:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": torch.cuda.is_available()}
    extra: dict[str, Any] = {}  # DeepSpeed config sections
    if train:  # OpenRLHF's get_train_ds_config (its eval config has none of these)
        if c.overlap_comm:
            zero.update(overlap_comm=True, contiguous_gradients=True)
        if c.zpg > 1:
            zero["zero_hpz_partition_size"] = c.zpg
        if c.grad_accum_dtype is not None:
            extra["data_types"] = {"grad_accum_dtype": c.grad_accum_dtype}
        if c.use_ds_universal_ckpt:  # as OpenRLHF's get_train_ds_config; rl_core.checkpoint converts at load
            extra["checkpoint"] = {"load_universal": True}
        if c.optim == "muon":
            extra["optimizer"] = muon_section(c)
            if c.zero_stage == 3:  # DeepSpeed: "Muon and reduce scatter cannot be used together"
                zero["reduce_scatter"] = False
    return {
        **extra,
        "train_micro_batch_size_per_gpu": plan.micro_batch,
        "gradient_accumulation_steps": plan.accumulation_steps,
        # DeepSpeed counts every rank as data parallel: a ring group's ranks are replicas of one slice
        "train_batch_size": plan.global_batch * c.ring_attn_size,
        "gradient_clipping": c.max_norm if c.max_norm > 0 else 0.0,
        "zero_optimization": zero,
        "bf16": {"enabled": c.bf16},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
        # DeepSpeed's throughput timer (on by default) synchronises the whole device at every forward and every
        # step() to time a samples/s figure nobody prints here: the host then waits for the GPU twice per
        # micro-batch and the GPU idles while the next one is launched (a third of the policy's training call
        # at the 0.5B shape on an H100, docs/performance.md)
        "timers": {"throughput": {"enabled": False, "synchronized": False}},
    }


def trainable_param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """The trainable parameters in two groups: decayed by --l2, and norms and biases, not decayed."""
    decay: list[nn.Parameter] = []
    no_decay: list[nn.Parameter] = []
    for name, p in model.named_parameters():
        if p.requires_grad:
            (no_decay if p.ndim < 2 or "norm" in name.lower() or name.endswith(".bias") else decay).append(p)
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    groups = [g for g in groups if g["params"]]
    if not groups:
        raise ValueError("the model has no trainable parameters (all requires_grad=False): nothing to train")
    return groups


def muon_section(c: StrategyConfig) -> dict:
    """DeepSpeed's ``optimizer`` section for ``optim="muon"``, as OpenRLHF's ``_ds_init_train_model`` writes it
    (Muon: Jordan et al. 2024, kellerjordan.github.io/posts/muon; at LLM scale: Liu et al. 2025,
    arXiv:2502.16982).

    ``deepspeed.initialize`` then tags each parameter (``use_muon``: 2-D, name without ``embed`` /
    ``lm_head``) and builds ``MuonWithAuxAdam``, splitting each of :func:`trainable_param_groups` into a Muon half
    (``muon_lr``, ``momentum``) and an AdamW half (``adam_lr``, ``betas``, ``eps``); a group's own
    ``weight_decay`` applies to both halves. DeepSpeed runs Newton-Schulz with 5 steps and Nesterov
    momentum (neither is configurable there). The AdamW half is torch's AdamW, as our ``adam`` path's, or
    DeepSpeedCPUAdam with ``adam_offload``."""
    params = {
        "lr": c.muon_lr,
        "muon_lr": c.muon_lr,
        "adam_lr": c.learning_rate,
        "momentum": c.muon_momentum,
        "betas": list(c.adam_betas),
        "eps": c.adam_eps,
        "weight_decay": c.weight_decay,
    }
    if not c.adam_offload:
        params["torch_adam"] = True  # instead of DeepSpeed's FusedAdam, a CUDA op built at first use
    return {"type": "Muon", "params": params}
