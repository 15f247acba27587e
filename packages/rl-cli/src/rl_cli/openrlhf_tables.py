"""The data of the OpenRLHF mapping: OpenRLHF's flag list per command and the three tables that settle
every flag the fields' own metadata does not (:data:`ALIAS`, :data:`CONVERT`, :data:`REFUSED`, plus the
per-command refusals). One line per flag; :mod:`rl_cli.openrlhf` installs them on the parsers and writes
docs/openrlhf.md from them. The refusals live in :mod:`rl_cli.openrlhf_refused` and are re-exported here.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

from rl_cli.openrlhf_refused import (  # noqa: F401  (the refusal tables, re-exported from their old home)
    COMMAND_REFUSED,
    REFUSED,
    Refuse,
    command_refusal,
)

FLAGS_FILE = Path(__file__).with_name("openrlhf_flags.json")
COMMANDS = ("sft", "rm", "dpo", "kto", "ppo", "ppo-ray")


@cache
def openrlhf_flags() -> dict:
    return json.loads(FLAGS_FILE.read_text())


def flags_of(command: str) -> dict[str, dict[str, dict]]:
    """``{"flat": {name: shape}, "grouped": {...}}`` of one of our commands."""
    return openrlhf_flags()["commands"][command]


# ----- the tables ---------------------------------------------------------------------------------

# OpenRLHF name -> our dotted field(s); the first one the command has is the target.
ALIAS: dict[str, tuple[str, ...]] = {
    "actor_learning_rate": ("strategy.learning_rate",),
    "actor.adam.lr": ("strategy.learning_rate",),
    "adam.lr": ("strategy.learning_rate",),
    "actor.adam.betas": ("strategy.adam_betas",),
    "adam.betas": ("strategy.adam_betas",),
    "actor.adam.weight_decay": ("strategy.weight_decay",),
    "adam.weight_decay": ("strategy.weight_decay",),
    "actor.lr_scheduler": ("strategy.lr_scheduler",),
    "actor.lr_warmup_ratio": ("strategy.lr_warmup_ratio",),
    "actor.min_lr_ratio": ("strategy.min_lr_ratio",),
    "actor.max_norm": ("strategy.max_norm",),
    "actor.gradient_checkpointing_enable": ("strategy.gradient_checkpointing",),
    "model.gradient_checkpointing_enable": ("strategy.gradient_checkpointing",),
    "ds.zero_stage": ("strategy.zero_stage",),
    "vllm_generate_batch_size": ("ppo.async_rl.generate_batch_size",),
    # OpenRLHF's async queue: q slot tokens, one taken per batch generated and returned when the trainer takes a
    # batch, so batch k+q starts once batch k is taken (weights of version k-1): our bound max_staleness = q
    "async_queue_size": ("ppo.async_rl.max_staleness",),
    "train.async_queue_size": ("ppo.async_rl.max_staleness",),
    "ds.adam_offload": ("strategy.adam_offload",),
    "train.seed": ("strategy.seed",),
    "train.batch_size": ("strategy.train_batch_size",),
    "train.micro_batch_size": ("strategy.micro_train_batch_size",),
    "model.model_name_or_path": ("model.pretrain",),
    "ref.model_name_or_path": ("model.ref_pretrain",),
    "ds.use_liger_kernel": ("model.use_liger_kernel",),
    "ds.lora.rank": ("model.lora_rank",),
    "ds.lora.alpha": ("model.lora_alpha",),
    "ds.lora.dropout": ("model.lora_dropout",),
    "model.beta": ("train.beta",),
    "model.ipo_enable": ("train.ipo",),
    "model.label_smoothing": ("train.label_smoothing",),
    "model.nll_loss_coef": ("train.nll_loss_coef",),
    "model.loss_type": ("train.loss",),
    "model.margin_loss_enable": ("train.margin_loss",),
    "ckpt.output_dir": ("train.ckpt.save_path", "ppo.ckpt.save_path"),
    "ckpt.path": ("train.ckpt.ckpt_path", "ppo.ckpt.ckpt_path"),
    "ckpt.max_num": ("train.ckpt.max_ckpt_num", "ppo.ckpt.max_ckpt_num"),
    "logger.logging_steps": ("train.logging_steps", "ppo.logging_steps"),
    "ds.packing_samples": ("data.packing",),
    "packing_samples": ("data.packing",),
    "dataset_split": ("data.split",),
    "data.dataset_split": ("data.split",),
    "train_split": ("data.split",),
    "prompt_split": ("data.split",),
    "data.prompt_split": ("data.split",),
    "data.prompt_dataset": ("data.dataset",),
    "eval.dataset": ("data.eval_dataset",),
    "eval.split": ("data.eval_split",),
    "eval.steps": ("train.eval_steps",),
    "eval_steps": ("train.eval_steps",),
    "train.colocate_actor_ref": ("ray.colocate_actor_ref",),
    "train.colocate_critic_reward": ("ray.colocate_critic_reward",),
    "train.colocate_all": ("ray.colocate_all_models",),
    "actor.num_nodes": ("ray.actor_num_nodes",),
    "actor.num_gpus_per_node": ("ray.actor_num_gpus_per_node",),
    "critic.num_nodes": ("ray.critic_num_nodes",),
    "critic.num_gpus_per_node": ("ray.critic_num_gpus_per_node",),
    "ref.num_nodes": ("ray.ref_num_nodes",),
    "ref.num_gpus_per_node": ("ray.ref_num_gpus_per_node",),
    "reward.num_nodes": ("ray.reward_num_nodes",),
    "reward.num_gpus_per_node": ("ray.reward_num_gpus_per_node",),
    "vllm.num_engines": ("ray.vllm_num_engines",),
    "vllm.tensor_parallel_size": ("ray.vllm_tensor_parallel_size",),
    "vllm_is_truncated_threshold": ("ppo.policy_loss.is_correction_threshold",),
    "micro_rollout_batch_size": ("batching.forward_micro_batch_size",),
    "rollout.micro_batch_size": ("batching.forward_micro_batch_size",),
}


@dataclass(frozen=True)
class Convert:
    """An OpenRLHF flag whose value becomes other values of ours: ``convert(value) -> {dotted: value}``."""

    ours: str  # what it sets, for the table
    convert: Callable[[Any, argparse.Namespace], dict[str, object]]  # the value: whatever nargs/type parse
    nargs: int | str | None = None  # None: one value; 0: a switch; "*", 2 ...
    type: Callable = str


def _param_dtype(v, _ns):
    if v == "bf16":
        return {"strategy.bf16": True}
    raise ValueError(f"{v!r}: fp16 training is not built; use bf16 (the default) or --bf16 false for fp32")


def _ns_steps(v, _ns):
    if v == 5:
        return {}
    raise ValueError(
        f"{v}: DeepSpeed's Muon runs 5 Newton-Schulz steps, fixed in its muon_update (OpenRLHF's run "
        f"ignores the flag there); drop the flag or pass 5"
    )


_IS_TYPE = "_openrlhf_is_correction_type"  # OpenRLHF's type takes effect only with its enable flag


def _is_enable(_v, ns):
    return {"ppo.policy_loss.is_correction": getattr(ns, _IS_TYPE, "tis")}


def _is_type(v, ns):
    out = {_IS_TYPE: v}
    if getattr(ns, "ppo.policy_loss.is_correction", None):  # already enabled: the type applies
        out["ppo.policy_loss.is_correction"] = v
    return out


_BUDGETS = "_openrlhf_token_budgets"  # OpenRLHF's budgets take effect only with its dynamic-batch flag
_DYNAMIC = "_openrlhf_dynamic_batch"
_BUDGET_FIELD = {"train": "batching.max_tokens_per_gpu", "rollout": "batching.forward_max_tokens_per_gpu"}
OPENRLHF_TRAIN_TOKENS = 16192  # OpenRLHF's --train_max_tokens_per_gpu default


def _dynamic_batch(_v, ns):
    """OpenRLHF's --use_dynamic_batch: packing on (it forces packing_samples), the train budget (its default
    16192 unless given) and the rollout budget (default: the train budget, as ours)."""
    budgets = getattr(ns, _BUDGETS, {})
    train = budgets.get("train") or getattr(ns, _BUDGET_FIELD["train"], None) or OPENRLHF_TRAIN_TOKENS
    out = {_DYNAMIC: True, "data.packing": True, _BUDGET_FIELD["train"]: train}
    if "rollout" in budgets:
        out[_BUDGET_FIELD["rollout"]] = budgets["rollout"]
    return out


def _budget(kind: str):
    def convert(v, ns):
        out = {_BUDGETS: {**getattr(ns, _BUDGETS, {}), kind: v}}
        if getattr(ns, _DYNAMIC, False):  # already enabled: the budget applies
            out[_BUDGET_FIELD[kind]] = v
        return out

    return convert


def _not_negative(field: str):
    return lambda v, _ns: {field: max(0, v)}  # OpenRLHF's -1 means "none", as our 0 does


CONVERT: dict[str, Convert] = {
    "eps_clip_low_high": Convert(
        "ppo.policy_loss.eps_clip, ppo.policy_loss.eps_clip_high",
        lambda v, _ns: {"ppo.policy_loss.eps_clip": v[0], "ppo.policy_loss.eps_clip_high": v[1]},
        2,
        float,
    ),
    "actor.eps_clip_low_high": Convert(
        "ppo.policy_loss.eps_clip, ppo.policy_loss.eps_clip_high",
        lambda v, _ns: {"ppo.policy_loss.eps_clip": v[0], "ppo.policy_loss.eps_clip_high": v[1]},
        2,
        float,
    ),
    "target_modules": Convert(
        "model.target_modules (names joined by commas)",
        lambda v, _ns: {"model.target_modules": ",".join(v) if v else "all-linear"},
        "*",
    ),
    "ds.lora.target_modules": Convert(
        "model.target_modules (names joined by commas)",
        lambda v, _ns: {"model.target_modules": ",".join(v) if v else "all-linear"},
        "*",
    ),
    "param_dtype": Convert("strategy.bf16 (bf16 only)", _param_dtype),
    "ds.param_dtype": Convert("strategy.bf16 (bf16 only)", _param_dtype),
    **{
        f"{p}muon.ns_steps": Convert(
            "nothing: 5 only, DeepSpeed's Muon runs 5 Newton-Schulz steps", _ns_steps, None, int
        )
        for p in ("", "actor.", "critic.")
    },
    **{
        f"{p}muon.nesterov": Convert("nothing: DeepSpeed's Muon always uses Nesterov momentum", lambda _v, _ns: {}, 0)
        for p in ("", "actor.", "critic.")
    },
    "multiturn": Convert(
        "data.apply_chat_template (multi-turn = a message list in --input_key, no --output_key)",
        lambda _v, _ns: {"data.apply_chat_template": True},
        0,
    ),
    "data.multiturn": Convert(
        "data.apply_chat_template (multi-turn = a message list in --input_key, no --output_key)",
        lambda _v, _ns: {"data.apply_chat_template": True},
        0,
    ),
    "enable_vllm_is_correction": Convert("ppo.policy_loss.is_correction (tis unless a type is given)", _is_enable, 0),
    "algo.advantage.is_correction_enable": Convert(
        "ppo.policy_loss.is_correction (tis unless a type is given)", _is_enable, 0
    ),
    "vllm_is_correction_type": Convert("ppo.policy_loss.is_correction (with --enable_vllm_is_correction)", _is_type),
    "algo.advantage.is_correction_type": Convert(
        "ppo.policy_loss.is_correction (with --algo.advantage.is_correction_enable)", _is_type
    ),
    "freezing_actor_steps": Convert(
        "ppo.freezing_actor_steps (-1: 0)", _not_negative("ppo.freezing_actor_steps"), None, int
    ),
    "critic.freezing_steps": Convert(
        "ppo.freezing_actor_steps (-1: 0)", _not_negative("ppo.freezing_actor_steps"), None, int
    ),
    "ref_reward_offload": Convert(
        "model.ref_offload, model.reward_offload",
        lambda _v, _ns: {"model.ref_offload": True, "model.reward_offload": True},
        0,
    ),
    **{
        k: Convert("data.packing, batching.max_tokens_per_gpu (16192 unless given)", _dynamic_batch, 0)
        for k in ("use_dynamic_batch", "train.dynamic_batch_enable")
    },
    **{
        k: Convert(
            "batching.max_tokens_per_gpu (with --use_dynamic_batch, as in OpenRLHF)", _budget("train"), None, int
        )
        for k in ("train_max_tokens_per_gpu", "train.max_tokens_per_gpu")
    },
    **{
        k: Convert(
            "batching.forward_max_tokens_per_gpu (with --use_dynamic_batch, as in OpenRLHF)",
            _budget("rollout"),
            None,
            int,
        )
        for k in ("rollout_max_tokens_per_gpu", "rollout.max_tokens_per_gpu")
    },
}

DEFAULTS = "_openrlhf_defaults"  # {dotted: value} below YAML and the command line (rl_cli.loading.resolve)


def _ckpt(group: str, folder: str, field: str):
    """OpenRLHF's --ckpt.load_enable / --ckpt.save_steps N read / write its default --ckpt.path when none is
    given (``./ckpt/checkpoints_sft`` ...); ours has no default folder, so these flags bring OpenRLHF's."""

    def convert(v, ns):
        value = True if field == "load_checkpoint" else v  # the switch, or the step count
        out = {f"{group}.{field}": value}
        if value is True or value > 0:  # below YAML and --ckpt.path / --ckpt_path, wherever they stand
            out[DEFAULTS] = {**getattr(ns, DEFAULTS, {}), f"{group}.ckpt_path": folder}
        return out

    return convert


def _ckpt_converts(command: str) -> dict[str, Convert]:
    folder = flags_of(command)["flat"]["ckpt_path"]["default"]
    group = "ppo.ckpt" if command in ("ppo", "ppo-ray") else "train.ckpt"
    return {
        "ckpt.load_enable": Convert(
            f"{group}.load_checkpoint (no --ckpt.path: {folder})", _ckpt(group, folder, "load_checkpoint"), 0
        ),
        "ckpt.save_steps": Convert(
            f"{group}.save_steps (N > 0, no --ckpt.path: {folder})", _ckpt(group, folder, "save_steps"), None, int
        ),
    }


# Conversions of one command only (they come before CONVERT).
COMMAND_CONVERT: dict[str, dict[str, Convert]] = {c: _ckpt_converts(c) for c in COMMANDS}


def convert_of(command: str | None, name: str) -> Convert | None:
    return COMMAND_CONVERT.get(command or "", {}).get(name) or CONVERT.get(name)


# Accepted flags whose meaning differs in a way a user should know: shown in the table.
NOTES: dict[tuple[str, str], str] = {
    **{
        (c, n): "OpenRLHF: prompt + response; here it caps the prompt, and --max_new_tokens the response"
        for c in ("ppo", "ppo-ray")
        for n in ("max_len", "data.max_len")
    },
    **{
        (c, n): "OpenRLHF -1: no evaluation; here -1 evaluates the --eval_dataset once, after the last iteration"
        for c in ("ppo", "ppo-ray")
        for n in ("eval_steps", "eval.steps")
    },
    **{
        (c, n): "gae, reinforce, reinforce_baseline (the batch-normalised estimators); refused with the others, "
        "where OpenRLHF ignores it"
        for c in ("ppo", "ppo-ray")
        for n in ("no_advantage_std_norm", "algo.advantage.no_std_norm")
    },
    **{
        (c, n): "AutoTokenizer(use_fast=False), as OpenRLHF; transformers 5 (both pin it) ignores use_fast"
        for c in COMMANDS
        for n in ("disable_fast_tokenizer", "data.disable_fast_tokenizer")
    },
    **{
        (c, n): "groups of this many ranks compute each row in slices (padded rows packed first); local attention "
        "by torch sdpa with a document mask (OpenRLHF: ring-flash-attn)"
        for c in ("sft", "rm", "dpo", "kto")
        for n in ("ring_attn_size", "ds.ring_attn_size")
    },
    **{
        ("ppo", n): "rl ppo runs each role as one process: a value above 1 stops the run at start (use rl ppo-ray)"
        for n in ("ring_attn_size", "ds.ring_attn_size")
    },
    **{
        ("ppo-ray", n): "every role (policy, critic, reference, reward model) in groups of this many ranks, each "
        "row in slices (padded rows packed first); local attention by torch sdpa with a document "
        "mask (OpenRLHF: ring-flash-attn)"
        for n in ("ring_attn_size", "ds.ring_attn_size")
    },
}


def converted_names(command: str | None) -> set[str]:
    """Names the parser must leave to :data:`CONVERT` (their value has another shape than our field's)."""
    if command not in COMMANDS:
        return set()
    names = set(flags_of(command)["flat"]) | set(flags_of(command)["grouped"])
    return {n for n in names if convert_of(command, n) is not None and command_refusal(command, n) is None}
