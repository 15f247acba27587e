"""Checkpoints and the final export, one config for every trainer (``rl sft`` to ``rl ppo``): the
:class:`CheckpointConfig` node of :class:`~rl_core.trainers.ppo_config.PPOConfig` (``ckpt``) and of the offline
trainers' :class:`~rl_core.trainers.base.TrainerConfig`. A step is an iteration of the RL loop and an optimizer
step of the offline trainers."""

from __future__ import annotations

from dataclasses import dataclass, field

from rl_rollout.config_fields import check_numbers, meta


@dataclass(frozen=True)
class CheckpointConfig:
    """Where checkpoints go, how often, how many are kept, and whether the run resumes from one."""

    save_path: str | None = field(
        default=None, metadata=meta("final HF export of the trained model", openrlhf=("ckpt.output_dir",))
    )
    ckpt_path: str | None = field(
        default=None,
        metadata=meta(
            "checkpoint folder: one folder per save (the RL loop: iter_N/ with policy/, critic/, loop_state.json), "
            "committed by its COMPLETE marker, written last",
            openrlhf=("ckpt.path",),
        ),
    )
    save_steps: int = field(
        default=-1,
        metadata=meta(
            "checkpoint every N steps (RL: iterations; offline trainers: optimizer steps; -1: none)",
            openrlhf=("ckpt.save_steps",),
        ),
    )
    max_ckpt_num: int = field(
        default=3,
        metadata=meta(
            "committed checkpoints kept (older ones go only after a newer one is committed)", openrlhf=("ckpt.max_num",)
        ),
    )
    max_ckpt_mem: float | None = field(
        default=None,
        metadata=meta(
            "disk budget of --ckpt_path in GB: after each commit the oldest checkpoints go while the folder without the "
            "newest one holds more (as OpenRLHF, which prunes before each save); the newest is never removed, nor the "
            "RL loop's best one (unset or inf, OpenRLHF's PPO default: no budget)",
            openrlhf=("ckpt.max_mem",),
        ),
    )
    disable_ds_ckpt: bool = field(
        default=False,
        metadata=meta(
            "checkpoints without the DeepSpeed state (weights, optimizer), as OpenRLHF's flag: with --save_hf_ckpt a "
            "checkpoint holds only the HF exports (and the RL loop's state), without it none is written; "
            "--load_checkpoint cannot resume from one (start a new run from the HF export with --pretrain)",
            openrlhf=("ckpt.disable_ds",),
        ),
    )
    save_hf_ckpt: bool = field(
        default=False,
        metadata=meta(
            "every checkpoint also holds the Hugging Face export of the model (RL: iter_N/hf/, and of the critic, if "
            "any, iter_N/hf/critic/; offline: --ckpt_path/step_N_hf, kept, not pruned), written before the "
            "checkpoint's COMPLETE marker; without --save_steps no checkpoint is written, so neither is this (as in "
            "OpenRLHF; the final model goes to --save_path)",
            openrlhf=("ckpt.save_hf",),
        ),
    )
    load_checkpoint: bool = field(
        default=False,
        metadata=meta(
            "resume from the newest committed checkpoint under --ckpt_path. Trusted checkpoints only: DeepSpeed reads "
            "them with torch.load(weights_only=False), so loading one runs any code it holds; for weights from "
            "elsewhere start from their HF export (safetensors) with --pretrain",
            openrlhf=("ckpt.load_enable",),
        ),
    )

    def __post_init__(self) -> None:
        unset_infinite_budget(self)  # inf, OpenRLHF's PPO default: no budget
        check_numbers(self, at_least_1=("max_ckpt_num",))  # a nan budget fails here, as not finite
        check_max_gb(self.max_ckpt_mem)
        if self.load_checkpoint and not self.ckpt_path:
            raise ValueError("load_checkpoint needs ckpt_path (--ckpt_path DIR) to find checkpoints in")
        if self.save_steps > 0 and not self.ckpt_path:
            raise ValueError(f"save_steps={self.save_steps} needs ckpt_path (--ckpt_path DIR) to write them to")


def unset_infinite_budget(cfg) -> None:
    """``max_ckpt_mem`` of ``inf`` (OpenRLHF's --ckpt.max_mem default in train_ppo_ray) is no budget: None, before
    the config's numbers are checked (where every float must be finite). ``cfg`` may be frozen."""
    if cfg.max_ckpt_mem is not None and cfg.max_ckpt_mem == float("inf"):
        object.__setattr__(cfg, "max_ckpt_mem", None)


def check_max_gb(max_gb: float | None) -> None:
    if max_gb is not None and not max_gb > 0:
        raise ValueError(
            f"max_ckpt_mem (--max_ckpt_mem) is a budget in GB and must be > 0, got {max_gb}; leave it "
            f"unset for no budget"
        )
