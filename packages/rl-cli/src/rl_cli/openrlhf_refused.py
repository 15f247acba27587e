"""The refusal tables of the OpenRLHF mapping: flags we do not take, each with one line on why not and what to
use instead (:data:`REFUSED`), and the refusals of one command only (:data:`COMMAND_REFUSED`). The accepted
flags' tables (aliases, conversions, notes) are :mod:`rl_cli.openrlhf_tables`, which re-exports these names.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Refuse:
    why: str  # one line: why not, and what to use instead
    off: tuple = ()  # values that leave the feature off in OpenRLHF: accepted as the no-ops they are


_MUON_NESTEROV = (
    "DeepSpeed's Muon always uses Nesterov momentum, fixed in its muon_update (OpenRLHF's run ignores "
    "the flag there); drop the flag"
)
_NO_DS_TP = "DeepSpeed tensor-parallel training (AutoTP) is not built; use ZeRO-3 (--zero_stage 3)"
_MOE_AUX = (
    "the MoE load-balancing loss is built for the causal-LM trainers (rl sft, dpo, kto) and the RL loop's "
    "policy (rl ppo, ppo-ray), not for a reward or value head (OpenRLHF's fails there: its body returns no "
    "aux_loss)"
)
_NO_HEAD = (
    "rl rm saves its head as rl_head.safetensors beside the model, under a fixed name; rl ppo / ppo-ray "
    "and rl serve-rm read it, and read OpenRLHF's <prefix>.weight heads (--value_head_prefix in rl ppo)"
)

REFUSED: dict[str, Refuse] = {
    # not built
    "ds_tensor_parallel_size": Refuse(_NO_DS_TP, off=(1,)),
    "ds.tensor_parallel_size": Refuse(_NO_DS_TP, off=(1,)),
    "deepcompile": Refuse("DeepSpeed deepcompile is not wired"),
    "ds.deepcompile": Refuse("DeepSpeed deepcompile is not wired"),
    # rl sft / dpo / kto / ppo / ppo-ray have it (a field of theirs wins over these lines): rl rm
    "aux_loss_coef": Refuse(_MOE_AUX, off=(0,)),
    "model.aux_loss_coef": Refuse(_MOE_AUX, off=(0,)),
    "compute_fp32_loss": Refuse("not a switch here: the losses are computed from fp32 log-probs"),
    "model.compute_fp32_loss_enable": Refuse("not a switch here: the losses are computed from fp32 log-probs"),
    "dataloader_num_workers": Refuse("the data loads in the main process (tokenized once, up front)", off=(0,)),
    "data.dataloader_num_workers": Refuse("the data loads in the main process (tokenized once, up front)", off=(0,)),
    "use_ms": Refuse("ModelScope downloads are not built; pass a local folder or a Hugging Face id"),
    "value_head_prefix": Refuse(_NO_HEAD, off=("score", "value_head")),
    "ds.value_head_prefix": Refuse(_NO_HEAD, off=("score", "value_head")),
    "actor_init_on_gpu": Refuse("not needed: every model loads straight onto its device"),
    "perf": Refuse(
        "OpenRLHF defines --perf and never reads it (v0.10.1's train_ppo_ray.py); per-phase seconds are "
        "in the metrics (--run_dir)"
    ),
    "vllm_sync_with_ray": Refuse(
        "weights go over rl-rollout's transport, not Ray's object store: --vllm_sync_backend nccl | gloo | ipc"
    ),
    "vllm.sync_with_ray": Refuse(
        "weights go over rl-rollout's transport, not Ray's object store: --vllm_sync_backend nccl | gloo | ipc"
    ),
    **{f"{p}muon.no_nesterov": Refuse(_MUON_NESTEROV) for p in ("", "actor.", "critic.")},
}

_PLACEMENT = "placement is rl ppo-ray's: rl ppo runs every role in this process"
# Refusals of one command only (the same name works elsewhere); they come before ALIAS and CONVERT.
COMMAND_REFUSED: dict[str, dict[str, Refuse]] = {
    "ppo-ray": {},
    "ppo": {
        **{
            k: Refuse(_PLACEMENT)
            for k in (
                "actor_num_nodes",
                "actor_num_gpus_per_node",
                "critic_num_nodes",
                "critic_num_gpus_per_node",
                "ref_num_nodes",
                "ref_num_gpus_per_node",
                "reward_num_nodes",
                "reward_num_gpus_per_node",
                "vllm_num_engines",
                "vllm_tensor_parallel_size",
                "colocate_actor_ref",
                "colocate_critic_reward",
                "colocate_all_models",
                "actor.num_nodes",
                "actor.num_gpus_per_node",
                "critic.num_nodes",
                "critic.num_gpus_per_node",
                "ref.num_nodes",
                "ref.num_gpus_per_node",
                "reward.num_nodes",
                "reward.num_gpus_per_node",
                "vllm.num_engines",
                "vllm.tensor_parallel_size",
                "train.colocate_actor_ref",
                "train.colocate_critic_reward",
                "train.colocate_all",
            )
        }
    },
}


def command_refusal(command: str | None, name: str) -> Refuse | None:
    return COMMAND_REFUSED.get(command or "", {}).get(name)
