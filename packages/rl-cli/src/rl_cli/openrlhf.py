"""OpenRLHF's flags, both dialects, onto our configs: every one maps onto a field or is refused in one line.

:file:`openrlhf_flags.json` lists, per command, the flags of OpenRLHF's own argparse
definitions (``scripts/extract_openrlhf_flags.py`` reads them from its releases: the flat
dialect of v0.10.1 and before, the grouped ``--actor.*`` / ``--train.*`` dialect of its
latest release). Most are accepted by the fields' own metadata (``openrlhf=(...)``) or by a
bare field name; the rest are settled by the three tables below, one line per flag:

- :data:`ALIAS`: OpenRLHF name -> our dotted field(s), the first one the command has;
- :data:`CONVERT`: names whose value needs converting (``--eps_clip_low_high LOW HIGH``,
  ``--target_modules q_proj v_proj``, ``--ds.param_dtype bf16`` ...);
- :data:`REFUSED`: why we do not take it and what to use instead. ``off`` values (the
  ones that mean "feature off" in OpenRLHF, e.g. ``--ring_attn_size 1``) are accepted as
  the no-ops they are; anything else stops the parse with the one line.

A refusal whose feature gets built turns into an ``ALIAS`` line (or simply disappears: a
real flag of the same name always wins). ``python -m rl_cli.openrlhf > docs/openrlhf.md``
writes the table from the parsers themselves, and the tests fail when an OpenRLHF flag of
the list is neither accepted nor refused, or when the docs drift from the code.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from pathlib import Path

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
    "ds.adam_offload": ("strategy.adam_offload",),
    "train.seed": ("strategy.seed",),
    "train.batch_size": ("strategy.train_batch_size",),
    "train.micro_batch_size": ("strategy.micro_train_batch_size",),
    "model.model_name_or_path": ("model.pretrain",),
    "ref.model_name_or_path": ("model.ref_pretrain",),
    "ds.lora.rank": ("model.lora_rank",),
    "ds.lora.alpha": ("model.lora_alpha",),
    "ds.lora.dropout": ("model.lora_dropout",),
    "model.beta": ("train.beta",),
    "model.ipo_enable": ("train.ipo",),
    "model.label_smoothing": ("train.label_smoothing",),
    "model.nll_loss_coef": ("train.nll_loss_coef",),
    "model.loss_type": ("train.loss",),
    "model.margin_loss_enable": ("train.margin_loss",),
    "ckpt.output_dir": ("train.save_path", "ppo.save_path"),
    "ckpt.path": ("train.ckpt_path", "ppo.ckpt_path"),
    "ckpt.save_steps": ("train.save_steps", "ppo.save_steps"),
    "ckpt.max_num": ("train.max_ckpt_num", "ppo.max_ckpt_num"),
    "ckpt.load_enable": ("train.load_checkpoint", "ppo.load_checkpoint"),
    "logger.logging_steps": ("train.logging_steps",),
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
    "vllm_is_truncated_threshold": ("ppo.is_correction_threshold",),
}


@dataclass(frozen=True)
class Convert:
    """An OpenRLHF flag whose value becomes other values of ours: ``convert(value) -> {dotted: value}``."""

    ours: str  # what it sets, for the table
    convert: Callable[[object, argparse.Namespace], dict[str, object]]
    nargs: object = None  # None: one value; 0: a switch; "*", 2 ...
    type: Callable = str


def _param_dtype(v, _ns):
    if v == "bf16":
        return {"strategy.bf16": True}
    raise ValueError(f"{v!r}: fp16 training is not built; use bf16 (the default) or --bf16 false for fp32")


def _attn(v, _ns):
    if v in ("flash_attention_2", "flash_attn", "flash_attention"):
        return {"model.flash_attn": True}
    if v == "sdpa":
        return {"model.flash_attn": False}
    raise ValueError(f"{v!r}: only flash_attention_2 (needs flash-attn) and sdpa are built; use one of those")


def _optim(v, _ns):
    if v == "adam":
        return {}
    raise ValueError(f"{v!r}: only AdamW is built (the Muon optimizer is not); use --optim adam or drop the flag")


_IS_TYPE = "_openrlhf_is_correction_type"  # OpenRLHF's type takes effect only with its enable flag


def _is_enable(_v, ns):
    return {"ppo.is_correction": getattr(ns, _IS_TYPE, "tis")}


def _is_type(v, ns):
    out = {_IS_TYPE: v}
    if getattr(ns, "ppo.is_correction", None):  # already enabled: the type applies
        out["ppo.is_correction"] = v
    return out


def _not_negative(field: str):
    return lambda v, _ns: {field: max(0, v)}  # OpenRLHF's -1 means "none", as our 0 does


CONVERT: dict[str, Convert] = {
    "eps_clip_low_high": Convert("ppo.eps_clip, ppo.eps_clip_high",
                                 lambda v, _ns: {"ppo.eps_clip": v[0], "ppo.eps_clip_high": v[1]}, 2, float),
    "actor.eps_clip_low_high": Convert("ppo.eps_clip, ppo.eps_clip_high",
                                       lambda v, _ns: {"ppo.eps_clip": v[0], "ppo.eps_clip_high": v[1]}, 2, float),
    "target_modules": Convert("model.target_modules (names joined by commas)",
                              lambda v, _ns: {"model.target_modules": ",".join(v) if v else "all-linear"}, "*"),
    "ds.lora.target_modules": Convert("model.target_modules (names joined by commas)",
                                      lambda v, _ns: {"model.target_modules": ",".join(v) if v else "all-linear"},
                                      "*"),
    "param_dtype": Convert("strategy.bf16 (bf16 only)", _param_dtype),
    "ds.param_dtype": Convert("strategy.bf16 (bf16 only)", _param_dtype),
    "attn_implementation": Convert("model.flash_attn (flash_attention_2 | sdpa)", _attn),
    "ds.attn_implementation": Convert("model.flash_attn (flash_attention_2 | sdpa)", _attn),
    "optim": Convert("AdamW (adam only)", _optim),
    "actor.optim": Convert("AdamW (adam only)", _optim),
    "critic.optim": Convert("AdamW (adam only)", _optim),
    "multiturn": Convert("data.apply_chat_template (multi-turn = a message list in --input_key, no --output_key)",
                         lambda _v, _ns: {"data.apply_chat_template": True}, 0),
    "data.multiturn": Convert("data.apply_chat_template (multi-turn = a message list in --input_key, no --output_key)",
                              lambda _v, _ns: {"data.apply_chat_template": True}, 0),
    "enable_vllm_is_correction": Convert("ppo.is_correction (tis unless a type is given)", _is_enable, 0),
    "algo.advantage.is_correction_enable": Convert("ppo.is_correction (tis unless a type is given)", _is_enable, 0),
    "vllm_is_correction_type": Convert("ppo.is_correction (with --enable_vllm_is_correction)", _is_type),
    "algo.advantage.is_correction_type": Convert("ppo.is_correction (with --algo.advantage.is_correction_enable)",
                                                 _is_type),
    "freezing_actor_steps": Convert("ppo.freezing_actor_steps (-1: 0)", _not_negative("ppo.freezing_actor_steps"),
                                    None, int),
    "critic.freezing_steps": Convert("ppo.freezing_actor_steps (-1: 0)", _not_negative("ppo.freezing_actor_steps"),
                                     None, int),
}

# Accepted flags whose meaning differs in a way a user should know: shown in the table.
NOTES: dict[tuple[str, str], str] = {
    **{(c, n): "OpenRLHF: prompt + response; here it caps the prompt, and --max_new_tokens the response"
       for c in ("ppo", "ppo-ray") for n in ("max_len", "data.max_len")},
}


@dataclass(frozen=True)
class Refuse:
    why: str  # one line: why not, and what to use instead
    off: tuple = ()  # values that leave the feature off in OpenRLHF: accepted as the no-ops they are


_PENDING_ASYNC = "being built (issue 19)"
_NO_TOKEN_BATCH = "token-budget dynamic batching is not built; batches count sequences: --micro_train_batch_size"
_NO_VLM = "vision-language models are not built (text only)"
_NO_MUON = "the Muon optimizer is not built (AdamW only); drop the --*.muon.* flags"
_CRITIC_OPT = ("the critic shares the actor's optimizer settings (--adam_betas, --l2, --lr_scheduler, --max_norm ...); "
               "only its learning rate is its own: --critic_learning_rate")
_NO_OFFLOAD = ("offloading frozen models to CPU is not built; colocate them (--colocate_actor_ref, "
               "--colocate_critic_reward) or give them their own GPUs")
_NO_EVAL_RL = "the RL loop has no evaluation pass yet"
_NO_RING = "ring attention (sequence parallelism) is not built; use a shorter --max_len or ZeRO-3"
_NO_DS_TP = "DeepSpeed tensor-parallel training (AutoTP) is not built; use ZeRO-3 (--zero_stage 3)"
_NO_EMA = "EMA weights are not built; the policy's own weights are saved"
_NO_PTX = "PPO-ptx (a pretraining loss mixed into the RL loss) is not built; run rl sft separately"
_NO_MIX = "mixing several datasets by probability is not built; give one dataset (merge the files first)"
_NO_HEAD = ("our reward/critic heads are saved as rl_head.safetensors beside the model, under a fixed name "
            "(rl rm writes them, rl ppo reads them)")

REFUSED: dict[str, Refuse] = {
    # being built by others right now: an ALIAS line when they land
    "agent_func_path": Refuse("agent functions are " + _PENDING_ASYNC + "; rewards: --reward_fn file.py:func"),
    "train.agent_func_path": Refuse("agent functions are " + _PENDING_ASYNC + "; rewards: --reward_fn file.py:func"),
    "async_train": Refuse("async training is " + _PENDING_ASYNC),
    "train.async_enable": Refuse("async training is " + _PENDING_ASYNC),
    "partial_rollout": Refuse("partial rollouts are " + _PENDING_ASYNC),
    "train.partial_rollout_enable": Refuse("partial rollouts are " + _PENDING_ASYNC),
    "async_queue_size": Refuse("async training (issue 19) counts its queue in policy versions: the max_staleness "
                               "setting", off=(1,)),
    "train.async_queue_size": Refuse("async training (issue 19) counts its queue in policy versions: the "
                                     "max_staleness setting", off=(1,)),
    # not built
    "train_max_tokens_per_gpu": Refuse(_NO_TOKEN_BATCH),
    "train.max_tokens_per_gpu": Refuse(_NO_TOKEN_BATCH),
    "rollout_max_tokens_per_gpu": Refuse(_NO_TOKEN_BATCH),
    "rollout.max_tokens_per_gpu": Refuse(_NO_TOKEN_BATCH),
    "use_dynamic_batch": Refuse(_NO_TOKEN_BATCH),
    "train.dynamic_batch_enable": Refuse(_NO_TOKEN_BATCH),
    "ring_attn_size": Refuse(_NO_RING, off=(1,)),
    "ds.ring_attn_size": Refuse(_NO_RING, off=(1,)),
    "ring_head_stride": Refuse(_NO_RING, off=(1,)),
    "ds.ring_attn_head_stride": Refuse(_NO_RING, off=(1,)),
    "ds_tensor_parallel_size": Refuse(_NO_DS_TP, off=(1,)),
    "ds.tensor_parallel_size": Refuse(_NO_DS_TP, off=(1,)),
    "zpg": Refuse("ZeRO++ hierarchical partitioning is not wired; plain ZeRO (--zero_stage)", off=(1,)),
    "ds.zpg": Refuse("ZeRO++ hierarchical partitioning is not wired; plain ZeRO (--zero_stage)", off=(1,)),
    "overlap_comm": Refuse("DeepSpeed overlap_comm is not exposed; --zero_bucket_bytes tunes the ZeRO buckets"),
    "ds.overlap_comm": Refuse("DeepSpeed overlap_comm is not exposed; --zero_bucket_bytes tunes the ZeRO buckets"),
    "deepcompile": Refuse("DeepSpeed deepcompile is not wired"),
    "ds.deepcompile": Refuse("DeepSpeed deepcompile is not wired"),
    "grad_accum_dtype": Refuse("the gradient accumulation dtype is DeepSpeed's default (fp32 master weights); "
                               "not a flag here"),
    "ds.grad_accum_dtype": Refuse("the gradient accumulation dtype is DeepSpeed's default (fp32 master weights); "
                                  "not a flag here"),
    "ds.experts_implementation": Refuse("MoE expert kernels are transformers' default; not selectable here"),
    "use_liger_kernel": Refuse("Liger kernels are not wired"),
    "ds.use_liger_kernel": Refuse("Liger kernels are not wired"),
    "load_in_4bit": Refuse("4-bit (QLoRA) loading is not built; use --lora_rank with bf16 weights"),
    "ds.load_in_4bit": Refuse("4-bit (QLoRA) loading is not built; use --lora_rank with bf16 weights"),
    "use_ds_universal_ckpt": Refuse("DeepSpeed universal checkpoints are not wired; resume with --load_checkpoint "
                                    "on the same world size"),
    "ds.use_universal_ckpt": Refuse("DeepSpeed universal checkpoints are not wired; resume with --load_checkpoint "
                                    "on the same world size"),
    "deepspeed_enable_sleep": Refuse("sleeping the DeepSpeed models between phases is not built; "
                                     "--vllm_enable_sleep frees the engines' memory"),
    "ds.enable_sleep": Refuse("sleeping the DeepSpeed models between phases is not built; "
                              "--vllm_enable_sleep frees the engines' memory"),
    "gradient_checkpointing_use_reentrant": Refuse("gradient checkpointing is always non-reentrant (torch's "
                                                   "recommended mode); --gradient_checkpointing turns it on"),
    "actor.gradient_checkpointing_reentrant": Refuse("gradient checkpointing is always non-reentrant (torch's "
                                                     "recommended mode); --gradient_checkpointing turns it on"),
    "model.gradient_checkpointing_reentrant": Refuse("gradient checkpointing is always non-reentrant (torch's "
                                                     "recommended mode); --gradient_checkpointing turns it on"),
    "full_determinism": Refuse("full determinism mode is not built; --seed fixes init, data order and sampling"),
    "train.full_determinism_enable": Refuse("full determinism mode is not built; --seed fixes init, data order and "
                                            "sampling"),
    "aux_loss_coef": Refuse("the MoE load-balancing loss is not built", off=(0,)),
    "actor.aux_loss_coef": Refuse("the MoE load-balancing loss is not built", off=(0,)),
    "model.aux_loss_coef": Refuse("the MoE load-balancing loss is not built", off=(0,)),
    "compute_fp32_loss": Refuse("not a switch here: the losses are computed from fp32 log-probs"),
    "model.compute_fp32_loss_enable": Refuse("not a switch here: the losses are computed from fp32 log-probs"),
    "pretrain_mode": Refuse("SFT trains on the response tokens only; for plain text put it in the --output_key "
                            "column with an empty prompt"),
    "model.pretrain_mode_enable": Refuse("SFT trains on the response tokens only; for plain text put it in the "
                                         "--output_key column with an empty prompt"),
    "tokenizer_chat_template": Refuse("the tokenizer's own chat template is used; put a custom one in the model's "
                                      "tokenizer_config.json"),
    "data.tokenizer_chat_template": Refuse("the tokenizer's own chat template is used; put a custom one in the "
                                           "model's tokenizer_config.json"),
    "dataset_probs": Refuse(_NO_MIX, off=("1.0", "1")),
    "data.dataset_probs": Refuse(_NO_MIX, off=("1.0", "1")),
    "prompt_data_probs": Refuse(_NO_MIX, off=("1.0", "1")),
    "data.prompt_probs": Refuse(_NO_MIX, off=("1.0", "1")),
    "dataloader_num_workers": Refuse("the data loads in the main process (tokenized once, up front)", off=(0,)),
    "data.dataloader_num_workers": Refuse("the data loads in the main process (tokenized once, up front)", off=(0,)),
    "disable_fast_tokenizer": Refuse("tokenizers load with AutoTokenizer's default (the fast one when the model "
                                     "has it)"),
    "data.disable_fast_tokenizer": Refuse("tokenizers load with AutoTokenizer's default (the fast one when the "
                                          "model has it)"),
    "use_ms": Refuse("ModelScope downloads are not built; pass a local folder or a Hugging Face id"),
    "image_key": Refuse(_NO_VLM),
    "data.image_key": Refuse(_NO_VLM),
    "max_images_per_prompt": Refuse(_NO_VLM),
    "data.max_images_per_prompt": Refuse(_NO_VLM),
    "freeze_visual_encoder": Refuse(_NO_VLM),
    "actor.freeze_visual_encoder": Refuse(_NO_VLM),
    "value_head_prefix": Refuse(_NO_HEAD, off=("score", "value_head")),
    "ds.value_head_prefix": Refuse(_NO_HEAD, off=("score", "value_head")),
    "save_hf_ckpt": Refuse("checkpoints hold the DeepSpeed state for exact resume; the HF export is written to "
                           "--save_path at the end"),
    "ckpt.save_hf": Refuse("checkpoints hold the DeepSpeed state for exact resume; the HF export is written to "
                           "--save_path at the end"),
    "disable_ds_ckpt": Refuse("checkpoints always hold the DeepSpeed state (exact resume); --save_steps -1 saves "
                              "none"),
    "ckpt.disable_ds": Refuse("checkpoints always hold the DeepSpeed state (exact resume); --save_steps -1 saves "
                              "none"),
    "max_ckpt_mem": Refuse("checkpoints are bounded by count: --max_ckpt_num"),
    "ckpt.max_mem": Refuse("checkpoints are bounded by count: --max_ckpt_num"),
    "best_metric_key": Refuse("best-checkpoint tracking is not built; the last --max_ckpt_num are kept"),
    "ckpt.best_metric_key": Refuse("best-checkpoint tracking is not built; the last --max_ckpt_num are kept"),
    "ref_offload": Refuse(_NO_OFFLOAD + "; rl dpo: --precompute_ref releases the reference after one pass"),
    "ref.offload": Refuse(_NO_OFFLOAD + "; rl dpo: --precompute_ref releases the reference after one pass"),
    "reward.offload": Refuse(_NO_OFFLOAD),
    "ref_reward_offload": Refuse(_NO_OFFLOAD),
    "actor_init_on_gpu": Refuse("not needed: every model loads straight onto its device"),
    "perf": Refuse("OpenRLHF's timing printout is not built; per-phase seconds are in the metrics (--run_dir)"),
    "micro_rollout_batch_size": Refuse("experience passes (old/reference log-probs, values) run in "
                                       "--micro_train_batch_size chunks; set that"),
    "rollout.micro_batch_size": Refuse("experience passes (old/reference log-probs, values) run in "
                                       "--micro_train_batch_size chunks; set that"),
    "vllm_generate_batch_size": Refuse("oversampling is not built: an iteration generates --rollout_batch_size "
                                       "prompts (dynamic filtering refills)"),
    "rollout.vllm_generate_batch_size": Refuse("oversampling is not built: an iteration generates "
                                               "--rollout_batch_size prompts (dynamic filtering refills)"),
    "vllm_sync_with_ray": Refuse("weights go over rl-rollout's transport, not Ray's object store: "
                                 "--vllm_sync_backend nccl | gloo | ipc"),
    "vllm.sync_with_ray": Refuse("weights go over rl-rollout's transport, not Ray's object store: "
                                 "--vllm_sync_backend nccl | gloo | ipc"),
    "entropy_loss_coef": Refuse("the policy loss has no entropy term (entropy regularisation is not built)"),
    "actor.entropy_coef": Refuse("the policy loss has no entropy term (entropy regularisation is not built)"),
    "no_advantage_std_norm": Refuse("use --advantage_estimator dr_grpo (group mean, no std) or "
                                    "--whiten_advantages false"),
    "algo.advantage.no_std_norm": Refuse("use --advantage_estimator dr_grpo (group mean, no std) or "
                                         "--whiten_advantages false"),
    "stop_properly_penalty_coef": Refuse("the stop-properly penalty (rl_algos.shaping) is not applied by the RL "
                                         "loop yet"),
    "reward.stop_properly_penalty_coef": Refuse("the stop-properly penalty (rl_algos.shaping) is not applied by "
                                                "the RL loop yet"),
    "ptx_coef": Refuse(_NO_PTX),
    "pretrain_data": Refuse(_NO_PTX),
    "pretrain_data_probs": Refuse(_NO_PTX),
    "pretrain_split": Refuse(_NO_PTX),
    "enable_ema": Refuse(_NO_EMA),
    "train.enable_ema": Refuse(_NO_EMA),
    "ema_beta": Refuse(_NO_EMA),
    "train.ema_beta": Refuse(_NO_EMA),
    "eval_n_samples_per_prompt": Refuse(_NO_EVAL_RL),
    "eval.n_samples_per_prompt": Refuse(_NO_EVAL_RL),
    "eval_temperature": Refuse(_NO_EVAL_RL),
    "eval.temperature": Refuse(_NO_EVAL_RL),
    "logging_steps": Refuse("the RL loop logs every iteration", off=(1,)),
    **{f"critic.{k}": Refuse(_CRITIC_OPT) for k in (
        "adam.betas", "adam.eps", "adam.weight_decay", "lr_scheduler", "lr_warmup_ratio", "max_norm",
        "min_lr_ratio")},
    "adam.eps": Refuse("AdamW's eps is fixed at 1e-8 (OpenRLHF's default)", off=(1e-8,)),
    "actor.adam.eps": Refuse("AdamW's eps is fixed at 1e-8 (OpenRLHF's default)", off=(1e-8,)),
    **{f"{p}muon.{k}": Refuse(_NO_MUON) for p in ("", "actor.", "critic.")
       for k in ("lr", "momentum", "nesterov", "no_nesterov", "ns_steps")},
    **{k: Refuse("LoRA is not wired into the RL roles (the weight sync sends full weights); train full weights, or "
                 "rl sft / rl dpo --lora_rank") for k in (
        "lora_rank", "lora_alpha", "lora_dropout", "ds.lora.rank", "ds.lora.alpha", "ds.lora.dropout")},
}

_PLACEMENT = "placement is rl ppo-ray's: rl ppo runs every role in this process"
_PACKING_SFT = "packing is built for SFT only (rl sft --packing_samples); drop the flag"
_RL_ONLY: dict[str, Refuse] = {
    "target_modules": REFUSED["lora_rank"], "ds.lora.target_modules": REFUSED["lora_rank"],
    "eval.dataset": Refuse(_NO_EVAL_RL), "eval.split": Refuse(_NO_EVAL_RL), "eval.steps": Refuse(_NO_EVAL_RL),
    "eval_steps": Refuse(_NO_EVAL_RL), "logger.logging_steps": Refuse("the RL loop logs every iteration", off=(1,)),
    "ds.packing_samples": Refuse("packed sequences are not wired into the RL loop yet (every row is padded)"),
    "packing_samples": Refuse("packed sequences are not wired into the RL loop yet (every row is padded)"),
}
# Refusals of one command only (the same name works elsewhere); they come before ALIAS and CONVERT.
COMMAND_REFUSED: dict[str, dict[str, Refuse]] = {
    "ppo-ray": _RL_ONLY,
    "ppo": {**_RL_ONLY, **{k: Refuse(_PLACEMENT) for k in (
        "actor_num_nodes", "actor_num_gpus_per_node", "critic_num_nodes", "critic_num_gpus_per_node",
        "ref_num_nodes", "ref_num_gpus_per_node", "reward_num_nodes", "reward_num_gpus_per_node",
        "vllm_num_engines", "vllm_tensor_parallel_size", "colocate_actor_ref", "colocate_critic_reward",
        "colocate_all_models", "actor.num_nodes", "actor.num_gpus_per_node", "critic.num_nodes",
        "critic.num_gpus_per_node", "ref.num_nodes", "ref.num_gpus_per_node", "reward.num_nodes",
        "reward.num_gpus_per_node", "vllm.num_engines", "vllm.tensor_parallel_size", "train.colocate_actor_ref",
        "train.colocate_critic_reward", "train.colocate_all")}},
    **{c: {"packing_samples": Refuse(_PACKING_SFT), "ds.packing_samples": Refuse(_PACKING_SFT)}
       for c in ("rm", "dpo", "kto")},
}


def command_refusal(command: str | None, name: str) -> Refuse | None:
    return COMMAND_REFUSED.get(command or "", {}).get(name)


def converted_names(command: str | None) -> set[str]:
    """Names the parser must leave to :data:`CONVERT` (their value has another shape than our field's)."""
    if command not in COMMANDS:
        return set()
    names = set(flags_of(command)["flat"]) | set(flags_of(command)["grouped"])
    return {n for n in names & set(CONVERT) if command_refusal(command, n) is None}


# ----- argparse actions ---------------------------------------------------------------------------


class _Converted(argparse.Action):
    def __init__(self, option_strings, dest, conv: Convert, **kw):
        self.conv = conv
        super().__init__(option_strings, dest, nargs=conv.nargs, type=conv.type if conv.nargs != 0 else None, **kw)

    def __call__(self, parser, namespace, values, option_string=None):
        try:
            out = self.conv.convert(values, namespace)
        except ValueError as e:
            parser.error(f"{option_string} {e}")
        for k, v in out.items():
            setattr(namespace, k, v)


def _is_off(values, off: tuple) -> bool:
    if not off:
        return False
    vals = values if isinstance(values, list) else [values]
    if not vals:
        return False

    def same(a, b):
        try:
            return float(a) == float(b)
        except (TypeError, ValueError):
            return str(a) == str(b)

    return all(any(same(v, o) for o in off) for v in vals)


class _Refused(argparse.Action):
    def __init__(self, option_strings, dest, refuse: Refuse, switch: bool, **kw):
        self.refuse = refuse
        super().__init__(option_strings, dest, nargs=0 if switch else "*", **kw)

    def __call__(self, parser, namespace, values, option_string=None):
        if _is_off(values, self.refuse.off):
            return  # the value that leaves the feature off in OpenRLHF: nothing to do here either
        parser.error(f"{option_string} (OpenRLHF) is not supported: {self.refuse.why}")


def install(parser: argparse.ArgumentParser, command: str | None, owner: dict[str, str],
            kwargs_of: dict[str, dict]) -> list[str]:
    """Add the command's OpenRLHF flags that the fields did not already give; returns the names added."""
    if command not in COMMANDS:
        return []
    flags = {**flags_of(command)["grouped"], **flags_of(command)["flat"]}
    group = parser.add_argument_group("OpenRLHF names (docs/openrlhf.md)")
    added = []
    for name, shape in sorted(flags.items()):
        opt = f"--{name}"
        if opt in owner:
            continue
        # a refusal of this command first, then what maps onto a field of ours, then the general refusal
        refuse = command_refusal(command, name)
        target = next((t for t in ALIAS.get(name, ()) if t in kwargs_of), None)
        if refuse is None and name not in CONVERT and target is None:
            refuse = REFUSED.get(name)
        if refuse is None and name in CONVERT:
            meta = {} if CONVERT[name].nargs == 0 else {"metavar": name.split(".")[-1].upper()}
            group.add_argument(opt, action=_Converted, conv=CONVERT[name], dest=argparse.SUPPRESS,
                               help=f"OpenRLHF's flag; sets {CONVERT[name].ours}", **meta)
            owner[opt] = f"openrlhf:{name}"
        elif refuse is None and target is not None:
            group.add_argument(opt, dest=target, **{**kwargs_of[target], "help": f"OpenRLHF's name of --{target}"})
            owner[opt] = target
        elif refuse is not None:
            group.add_argument(opt, action=_Refused, refuse=refuse, switch=shape.get("action") == "store_true",
                               dest=argparse.SUPPRESS, help=argparse.SUPPRESS)
            owner[opt] = f"refused:{name}"
        else:
            continue  # missing from every table: tests/test_openrlhf_flags.py names it
        added.append(opt)
    return added


# ----- the table: docs/openrlhf.md ----------------------------------------------------------------


def groups_of(command: str) -> dict[str, type]:
    if command in ("ppo", "ppo-ray"):
        from rl_cli import ppo

        return ppo._groups(command == "ppo-ray")
    from rl_cli import train

    return train._groups(train.COMMANDS[command])


def parser_of(command: str) -> argparse.ArgumentParser:
    """The command's real parser (the one ``rl COMMAND`` runs), built without loading anything heavy."""
    from rl_cli.config import build_parser

    return build_parser(f"rl {command}", command, groups_of(command))[0]


def _default_gap(command: str, dest: str, shape: dict) -> str:
    """'X / Y' (OpenRLHF's default / ours) where a run that omits the flag would differ; else ''."""
    theirs = shape.get("default")
    if shape.get("action") == "store_true" and theirs is None:
        theirs = False
    if isinstance(theirs, str) and ("(" in theirs or "%" in theirs):  # an expression or a run-name pattern
        return ""
    group, field = dest.split(".", 1)
    f = next(f for f in dataclasses.fields(groups_of(command)[group]) if f.name == field)
    ours = f.default if f.default is not dataclasses.MISSING else (
        f.default_factory() if f.default_factory is not dataclasses.MISSING else None)
    same = theirs == ours or (isinstance(theirs, list) and ours is not None and tuple(theirs) == tuple(ours))
    return "" if same else f"{theirs!r} / {ours!r}"


@dataclass(frozen=True)
class Row:
    flag: str
    dialect: str
    ours: str
    status: str  # "accepted" | "refused" | "MISSING"
    why: str = ""
    defaults: str = ""  # "OpenRLHF X / ours Y" where a run that omits the flag differs


def rows(command: str) -> list[Row]:
    from rl_cli.ppo import UNUSED_BY_RL

    parser = parser_of(command)
    acts = parser._option_string_actions
    out = []
    for dialect in ("flat", "grouped"):
        for name, shape in flags_of(command)[dialect].items():
            act = acts.get(f"--{name}")
            if act is None:
                out.append(Row(name, dialect, "", "MISSING"))
            elif isinstance(act, _Refused):
                off = f" (accepted as a no-op: {', '.join(map(str, act.refuse.off))})" if act.refuse.off else ""
                out.append(Row(name, dialect, "", "refused", act.refuse.why + off))
            elif isinstance(act, _Converted):
                out.append(Row(name, dialect, act.conv.ours, "accepted", NOTES.get((command, name), "")))
            elif command in ("ppo", "ppo-ray") and act.dest.split(".")[-1] in UNUSED_BY_RL \
                    and act.dest.startswith("data."):
                out.append(Row(name, dialect, act.dest, "refused", UNUSED_BY_RL[act.dest.split(".")[-1]]))
            else:
                out.append(Row(name, dialect, act.dest, "accepted", NOTES.get((command, name), ""),
                               _default_gap(command, act.dest, shape)))
    return out


def markdown() -> str:
    data = openrlhf_flags()
    lines = [
        "# OpenRLHF flags in rl",
        "",
        "<!-- generated by `python -m rl_cli.openrlhf > docs/openrlhf.md`; edit the tables in "
        "packages/rl-cli/src/rl_cli/openrlhf.py (or a field's `openrlhf=` metadata), not this file -->",
        "",
        "Every flag of OpenRLHF's own argument definitions works here under the same name, or stops the run "
        "with one line saying why and what to use instead; nothing is ignored. Both dialects: the flat flags "
        "of the releases up to v0.10.1 (`--actor_learning_rate`, `--micro_rollout_batch_size` ...) and the "
        "grouped flags of its latest release (`--actor.adam.lr`, `--train.batch_size` ...). The lists come "
        "from OpenRLHF's `openrlhf/cli/train_*.py` (packages/rl-cli/scripts/extract_openrlhf_flags.py) at:",
        "",
    ]
    for tag, commit in data["releases"].items():
        lines.append(f"- {tag}: {data['source']}/tree/{commit}")
    lines += ["", "`python -m openrlhf.cli.train_X` becomes `python -m rl_cli.train_X` or `rl X`. `ours` is the "
              "setting the flag sets (`rl X --print_config` shows them all resolved). A refused flag given "
              "the value that leaves its feature off in OpenRLHF (e.g. `--ring_attn_size 1`) is accepted as the "
              "no-op it is. The last column shows where a run that leaves a flag out differs from OpenRLHF's "
              "(pass the flag to get OpenRLHF's value; `None` on our side means derived, see `rl X --help`).", ""]
    for command in COMMANDS:
        rs = rows(command)
        acc = sum(r.status == "accepted" for r in rs)
        src = sorted({s["from"] for d in flags_of(command).values() for s in d.values()})
        lines += [f"## rl {command}", "",
                  f"{len(rs)} OpenRLHF flags ({', '.join(src)}): {acc} accepted, {len(rs) - acc} refused.", "",
                  "| OpenRLHF flag | ours | status | default: OpenRLHF / ours, where they differ |",
                  "|---|---|---|---|"]
        for r in rs:
            status = r.status if not r.why else f"{r.status}: {r.why}"
            cells = [f"`--{r.flag}`", f"`{r.ours}`" if r.ours else "", status, f"`{r.defaults}`" if r.defaults else ""]
            lines.append("| " + " | ".join(c.replace("|", "&#124;") for c in cells) + " |")
        lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    from rl_cli import openrlhf  # the parsers use that module's actions, not this __main__ copy's

    print(openrlhf.markdown(), end="")
