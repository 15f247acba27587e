"""OpenRLHF v0.11.0's example scripts as data: each script's flags, and the overrides that scale it to a CPU.

OpenRLHF's examples/scripts/ at v0.11.0 (commit 3c3be623, the release openrlhf_flags.json lists) hold
13 training / serving commands. :data:`SCRIPTS` transcribes each (our own list of its flags and values;
models, datasets and reward/agent files replaced by local tiny fixtures, :func:`write_fixtures`;
``python3 -m openrlhf.cli.X`` -> our ``rl X``, launcher prefixes dropped: ``deepspeed --module`` leaves its
``--local_rank=0``, which is kept; ``ray job submit --`` and ``torchrun`` add nothing).

:data:`OVERRIDES` lists, per script, the flags appended to run it to the end on a CPU machine of two cores:
sizes scaled down (batches, samples, lengths, steps, GPUs per role and engines; Ray's GPUs are logical) and
each change of a feature with its reason. :func:`run_argv` builds the command line. The tests check
``--print_config`` of every script (packages/rl-cli/tests/test_openrlhf_scripts.py); the runner
``scripts/openrlhf_examples.py`` runs them and records the outcome in docs/openrlhf-examples.json, which the
README's table ("OpenRLHF's example scripts") shows.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

# what stops a script: the refusal line after "rl COMMAND: error: " ({flag}: the flag that asks for it)
FEATURES = {
    "reward server token": "the reward server needs a token: export RL_REWARD_TOKEN=<secret> (or --token; a flag "
    "shows in ps) and give clients the same (RL_REWARD_TOKEN or --remote_rm_token), or pass "
    "--allow_no_token to serve OpenRLHF's client, which sends none, on a network nobody else "
    "can reach",
    "reference placement without a reference": "--ref_num_nodes and --ref_num_gpus_per_node place the reference "
    "model, and this run has none (--init_kl_coef 0 and no KL loss): drop --ref_num_nodes and --ref_num_gpus_per_node",
}


@dataclass(frozen=True)
class Script:
    """One script: our command and its flags ({model} {rm} {moe} {vlm} {data} {vlm_data} {reward} {agent} {out}:
    :func:`write_fixtures`'s paths)."""

    command: str  # ours: openrlhf.cli.train_X -> rl_cli.train_X (rl X)
    argv: str  # the script's flags
    # (flags to drop, FEATURES key), in refusal order; None: not a flag (an override gives what is missing)
    blockers: tuple[tuple[str | None, str], ...] = ()

    def args(self, fx: dict[str, str]) -> list[str]:
        return self.argv.format(**fx).split()


_RAY_GPUS = "--ref.num_nodes 1 --ref.num_gpus_per_node {n} --actor.num_nodes 1 --actor.num_gpus_per_node {n} "
_PPO_COMMON = (
    "--train.micro_batch_size 8 --train.batch_size 128 --rollout.micro_batch_size 16 --rollout.batch_size "
    "1024 --data.max_samples 100000 --train.max_epochs 1 --data.max_len 2048 --ds.zero_stage 3 "
    "--ds.param_dtype bf16 --actor.adam.lr 5e-7 --critic.adam.lr 9e-6 --algo.kl.init_coef 0.01 "
    "--data.prompt_dataset {data} --data.input_key context_messages --data.apply_chat_template "
    "--reward.normalize_enable "
)
_REINFORCE_BASELINE = (
    "--actor.model_name_or_path {model} --ckpt.load_enable --ckpt.output_dir {out}/final --ckpt.path {out}/ckpt "
    "--ckpt.save_hf --ckpt.max_num 3 --ckpt.save_steps 10 --train.agent_func_path {agent} --data.prompt_dataset "
    "{data} --data.input_key prompt --data.label_key label --data.max_len 74240 --rollout.max_new_tokens 64000 "
    "--data.apply_chat_template --ds.packing_samples --rollout.batch_size 128 --rollout.n_samples_per_prompt 8 "
    "--train.batch_size 1024 --algo.dynamic_filtering_enable --algo.dynamic_filtering_range 0.0 1.0 "
    "--train.dynamic_batch_enable --train.max_tokens_per_gpu 16192 --rollout.max_tokens_per_gpu 32768 "
    "--train.micro_batch_size 1 --rollout.micro_batch_size 8 --data.max_samples 128000 --train.max_epochs 1 "
    "--train.num_episodes 1 {extra}" + _RAY_GPUS.format(n=4) + "--vllm.num_engines 2 --vllm.tensor_parallel_size 2 "
    "--vllm.gpu_memory_utilization {gmu} --train.colocate_all --ds.enable_sleep --vllm.sync_backend nccl "
    "--vllm.enforce_eager --ds.zero_stage 3 --actor.gradient_checkpointing_enable --ds.ring_attn_size 2 "
    "--ds.ring_attn_head_stride 2 --ds.param_dtype bf16 --algo.advantage.estimator reinforce_baseline "
    "--actor.adam.lr 5e-7 --actor.entropy_coef 0.0 --algo.kl.init_coef 1e-5 --algo.kl.use_loss --algo.kl.estimator "
    "k2 --algo.advantage.is_correction_enable --algo.advantage.is_correction_type icepop --logger.tensorboard_dir "
    "{out}/runs --logger.logging_steps 1 --eval.steps -1"
)
_OFFLINE = (
    "--ckpt.save_steps -1 --logger.logging_steps 1 --eval.steps -1 --train.max_epochs 1 --ds.param_dtype bf16 "
    "--model.model_name_or_path {model} --data.dataset {data} --ds.attn_implementation flash_attention_2 "
)
_PAIRS = (
    "--train.batch_size 256 --train.micro_batch_size 1 --data.max_len 8192 --ds.zero_stage 3 "
    "--data.apply_chat_template --data.chosen_key chosen --data.rejected_key rejected --ckpt.load_enable "
    "--ds.packing_samples --model.gradient_checkpointing_enable "
)
_DPO = "--ckpt.output_dir {out}/final " + _OFFLINE + _PAIRS + "--adam.lr 5e-7 --model.beta 0.1"
_SFT = (
    "--data.max_len 2048 --data.input_key question --data.output_key response --data.max_samples 500000 "
    "--ckpt.output_dir {out}/final " + _OFFLINE
)

SCRIPTS: dict[str, Script] = {
    "serve_remote_rm.sh": Script(
        "serve-rm",
        (
            "--reward.model_name_or_path {rm} --port 5000 --ds.param_dtype bf16 --ds.attn_implementation "
            "flash_attention_2 --reward.normalize_enable --data.max_len 8192 --batch_size 16"
        ),
        ((None, "reward server token"),),
    ),
    "train_dapo_ray_hybrid_engine.sh": Script(
        "ppo-ray",
        _RAY_GPUS.format(n=8)
        + (
            "--vllm.num_engines 4 --vllm.tensor_parallel_size 2 --train.colocate_all --vllm.gpu_memory_utilization 0.6 "
            "--algo.kl.init_coef 1e-3 --algo.advantage.gamma 1.0 --algo.kl.use_loss --algo.kl.estimator k3 "
            "--algo.advantage.estimator group_norm --algo.dynamic_filtering_enable --algo.dynamic_filtering_range 0 1 "
            "--actor.eps_clip_low_high 0.2 0.27 --actor.model_name_or_path {model} --reward.remote_url {reward} "
            "--ckpt.output_dir {out}/final --ckpt.path {out}/ckpt --ckpt.save_steps 20 --ckpt.save_hf "
            "--train.micro_batch_size 8 --train.batch_size 128 --rollout.micro_batch_size 16 --rollout.batch_size 128 "
            "--rollout.n_samples_per_prompt 8 --train.max_epochs 1 --data.max_len 2048 --data.max_samples 20000 "
            "--ds.zero_stage 3 --ds.param_dtype bf16 --actor.adam.lr 5e-7 --data.prompt_dataset {data} "
            "--data.input_key context_messages --data.apply_chat_template --actor.gradient_checkpointing_enable "
            "--ds.packing_samples --vllm.sync_backend nccl --vllm.enforce_eager --vllm.enable_sleep --ds.enable_sleep "
            "--algo.advantage.is_correction_enable"
        ),
    ),
    "train_dpo_llama.sh": Script("dpo", _DPO + " --local_rank=0"),
    "train_nonrl_slurm.sh": Script("dpo", _DPO),  # train_dpo_llama.sh's command under torchrun
    "train_ppo_ray_hybrid_engine.sh": Script(
        "ppo-ray",
        _RAY_GPUS.format(n=8)
        + (
            "--reward.num_nodes 1 --reward.num_gpus_per_node 8 --critic.num_nodes 1 --critic.num_gpus_per_node 8 "
            "--vllm.num_engines 4 --vllm.tensor_parallel_size 2 --train.colocate_all --vllm.gpu_memory_utilization 0.5 "
            "--actor.model_name_or_path {model} --reward.model_name_or_path {rm} --ckpt.output_dir {out}/final "
            "--ckpt.path {out}/ckpt --ckpt.save_hf --train.batch_size 128 --rollout.batch_size 1024 "
            "--rollout.n_samples_per_prompt 1 --train.max_epochs 1 --data.max_len 2048 --data.max_samples 100000 "
            "--ds.zero_stage 3 --ds.param_dtype bf16 --actor.adam.lr 5e-7 --critic.adam.lr 9e-6 --algo.kl.init_coef 0.01 "
            "--data.prompt_dataset {data} --data.input_key context_messages --data.apply_chat_template "
            "--reward.normalize_enable --actor.gradient_checkpointing_enable --ds.packing_samples --vllm.sync_backend "
            "nccl --vllm.enforce_eager --vllm.enable_sleep --ds.enable_sleep --train.dynamic_batch_enable "
            "--train.max_tokens_per_gpu 16384 --algo.advantage.is_correction_enable"
        ),
    ),
    "train_ppo_ray_slurm.sh": Script(
        "ppo-ray",
        _RAY_GPUS.format(n=4)
        + (
            "--reward.num_nodes 1 --reward.num_gpus_per_node 4 --critic.num_nodes 1 --critic.num_gpus_per_node 4 "
            "--vllm.num_engines 4 --vllm.tensor_parallel_size 2 --train.colocate_critic_reward --train.colocate_actor_ref "
            "--actor.model_name_or_path {model} --reward.model_name_or_path {rm} --ckpt.output_dir {out}/final "
            + _PPO_COMMON
            + "--ds.adam_offload --ds.packing_samples --vllm.sync_backend nccl "
            "--actor.gradient_checkpointing_enable --logger.wandb.key KEY"
        ),
    ),
    "train_ppo_with_reward_fn.sh": Script(
        "ppo-ray",
        (
            "--ref.num_nodes 1 --ref.num_gpus_per_node 2 --critic.num_nodes 1 --critic.num_gpus_per_node 2 "
            "--actor.num_nodes 1 --actor.num_gpus_per_node 2 --vllm.num_engines 2 --vllm.tensor_parallel_size 2 "
            "--train.colocate_actor_ref --actor.model_name_or_path {model} --reward.remote_url {reward} "
            "--ckpt.output_dir {out}/final " + _PPO_COMMON + "--ds.packing_samples --ds.adam_offload "
            "--ds.attn_implementation flash_attention_2 --actor.gradient_checkpointing_enable --logger.wandb.key KEY"
        ),
    ),
    "train_prorlv2_math_hybrid_engine.sh": Script(
        "ppo-ray",
        _RAY_GPUS.format(n=8)
        + (
            "--vllm.num_engines 8 --vllm.tensor_parallel_size 1 --train.colocate_all --vllm.gpu_memory_utilization 0.75 "
            "--algo.kl.init_coef 1e-4 --algo.advantage.gamma 1.0 --algo.kl.use_loss --algo.kl.estimator k2 "
            "--algo.advantage.estimator reinforce_baseline --algo.dynamic_filtering_enable "
            "--algo.dynamic_filtering_range 0 1 --actor.eps_clip_low_high 0.2 0.27 --actor.model_name_or_path {model} "
            "--reward.remote_url {reward} --ckpt.output_dir {out}/final --ckpt.path {out}/ckpt --ckpt.save_steps 5 "
            "--ckpt.save_hf --train.batch_size 1024 --rollout.batch_size 512 --rollout.n_samples_per_prompt 16 "
            "--train.dynamic_batch_enable --train.num_episodes 100 --data.max_len 9216 --rollout.max_new_tokens 8192 "
            "--ds.zero_stage 3 --ds.param_dtype bf16 --actor.adam.lr 1e-6 --data.prompt_dataset {data} "
            "--data.input_key prompt --data.label_key label --eval.dataset {data} --eval.steps 5 --eval.temperature 1.0 "
            "--eval.n_samples_per_prompt 4 --data.apply_chat_template --actor.gradient_checkpointing_enable "
            "--ds.packing_samples --vllm.sync_backend nccl --vllm.enforce_eager --vllm.enable_sleep --ds.enable_sleep "
            "--algo.advantage.is_correction_enable --algo.advantage.is_correction_threshold 0.5 5.0 "
            "--algo.advantage.is_correction_type icepop --train.max_tokens_per_gpu 32768 "
            "--reward.stop_properly_penalty_coef 0.0"
        ),
    ),
    "train_reinforce_baseline_hybrid_engine.sh": Script(
        "ppo-ray", _REINFORCE_BASELINE.replace("{extra}", "").replace("{gmu}", "0.7")
    ),
    "train_reinforce_baseline_ray_agent_async.sh": Script(
        "ppo-ray",
        _REINFORCE_BASELINE.replace("{extra}", "--train.async_enable --train.partial_rollout_enable ").replace(
            "{gmu}", "0.95"
        ),
    ),
    "train_rm.sh": Script("rm", "--ckpt.output_dir {out}/final " + _OFFLINE + _PAIRS + "--adam.lr 9e-6 --local_rank=0"),
    "train_sft.sh": Script(
        "sft",
        _SFT
        + (
            "--train.batch_size 256 --train.micro_batch_size 2 --ds.zero_stage 2 --adam.lr 5e-6 --ckpt.load_enable "
            "--ds.packing_samples --model.gradient_checkpointing_enable --local_rank=0"
        ),
    ),
    "train_sft_mixtral_lora.sh": Script(
        "sft",
        (
            _SFT
            + "--train.batch_size 128 --train.micro_batch_size 4 --ds.zero_stage 3 --model.gradient_checkpointing_enable "
            "--adam.lr 5e-6 --ds.lora.rank 64 --ds.lora.alpha 64 --ds.packing_samples --model.aux_loss_coef 0.001 "
            "--local_rank=0"
        ).replace("{model}", "{moe}"),  # the script trains a Mixtral
    ),
    "train_vlm_math_hybrid_engine.sh": Script(
        "ppo-ray",
        _RAY_GPUS.format(n=4)
        + (
            "--vllm.num_engines 4 --vllm.tensor_parallel_size 1 --train.colocate_all --vllm.gpu_memory_utilization 0.7 "
            "--algo.kl.init_coef 0 --algo.advantage.gamma 1.0 --algo.kl.use_loss --algo.kl.estimator k2 "
            "--algo.advantage.estimator reinforce_baseline --actor.model_name_or_path {model} --reward.remote_url {reward} "
            "--ckpt.output_dir {out}/final --ckpt.path {out}/ckpt --ckpt.save_hf --ckpt.save_steps 5 --eval.steps -1 "
            "--train.micro_batch_size 1 --rollout.micro_batch_size 1 --train.batch_size 1024 --rollout.batch_size 128 "
            "--rollout.n_samples_per_prompt 8 --train.num_episodes 100 --data.max_len 4096 --rollout.max_new_tokens 2048 "
            "--ds.zero_stage 3 --ds.param_dtype bf16 --actor.adam.lr 2e-6 --data.prompt_dataset {data} "
            "--data.input_key prompt --data.label_key label --data.image_key images --data.max_images_per_prompt 1 "
            "--actor.freeze_visual_encoder --data.apply_chat_template --actor.gradient_checkpointing_enable "
            "--ds.attn_implementation eager --vllm.sync_backend nccl --vllm.enforce_eager --vllm.enable_sleep "
            "--ds.enable_sleep"
        )
        .replace("{model}", "{vlm}")
        .replace("{data}", "{vlm_data}"),
        (("--ref.num_nodes --ref.num_gpus_per_node", "reference placement without a reference"),),
    ),
}
# the rest of examples/scripts/: no command of OpenRLHF's to run (README lists them)
NOT_COMMANDS = ("ckpt_ds_zero_to_universal.sh", "docker_run.sh", "nvidia_docker_install.sh")


@dataclass(frozen=True)
class Override:
    """Flags appended to a script's own (the last value of a flag wins), and why."""

    flags: str
    why: str


_SDPA = Override("--ds.attn_implementation sdpa", "flash_attention_2: flash-attn is CUDA only, not importable here")
_RUN = Override("--run_dir {out}/run", "metrics.jsonl, whose last line the runner records")
_OFFLINE_SMALL = (
    Override(
        "--data.max_samples 16 --data.max_len 64 --train.batch_size 4", "scale: 16 rows of <= 64 tokens, 4 a step"
    ),
    Override("--ckpt.path {out}/ckpt", "--ckpt.load_enable's folder in the run's temp dir, not ./ckpt"),
    _SDPA,
    _RUN,
)
_RL_SMALL = Override(
    "--data.max_samples 4 --data.max_len 64 --rollout.max_new_tokens 16 --rollout.batch_size 2 "
    "--rollout.n_samples_per_prompt 4 --train.batch_size 8 --train.micro_batch_size 2 --rollout.micro_batch_size 2 "
    "--train.num_episodes 1 --train.max_epochs 1",
    "scale: 4 prompts, 2 a step, 4 samples each, <= 16 new tokens: 2 steps",
)
_GLOO = Override("--vllm.sync_backend gloo", "weight sync: NCCL needs CUDA; gloo is the CPU's collective")
_SAVE_EACH_STEP = Override("--ckpt.save_steps 1", "a checkpoint (and its HF export) within the 2 steps")


def _gpus(total: int, roles: str, engines: int = 1) -> Override:
    return Override(
        f"--num_gpus {total} {roles} --vllm.num_engines {engines}",
        f"Ray's logical GPUs on this CPU: {total} in all, {engines} engine",
    )


_TP2_HYBRID = _gpus(2, "--actor.num_gpus_per_node 2 --ref.num_gpus_per_node 2")  # one TP 2 engine on the 2 bundles

OVERRIDES: dict[str, tuple[Override, ...]] = {
    "serve_remote_rm.sh": (
        Override("--allow_no_token", "OpenRLHF's client sends no token (the refusal above)"),
        _SDPA,
    ),
    "train_dapo_ray_hybrid_engine.sh": (_TP2_HYBRID, _RL_SMALL, _GLOO, _SAVE_EACH_STEP, _RUN),
    "train_dpo_llama.sh": _OFFLINE_SMALL,
    "train_nonrl_slurm.sh": _OFFLINE_SMALL,
    "train_ppo_ray_hybrid_engine.sh": (
        _gpus(
            2,
            "--actor.num_gpus_per_node 2 --ref.num_gpus_per_node 2 --critic.num_gpus_per_node 2 "
            "--reward.num_gpus_per_node 2",
        ),
        _RL_SMALL,
        _GLOO,
        _RUN,
    ),
    "train_ppo_ray_slurm.sh": (
        _gpus(
            4,
            "--actor.num_gpus_per_node 1 --ref.num_gpus_per_node 1 --critic.num_gpus_per_node 1 "
            "--reward.num_gpus_per_node 1",
        ),
        _RL_SMALL,
        _GLOO,
        _RUN,
    ),
    "train_ppo_with_reward_fn.sh": (
        _gpus(4, "--actor.num_gpus_per_node 1 --ref.num_gpus_per_node 1 --critic.num_gpus_per_node 1"),
        _RL_SMALL,
        _SDPA,
        _RUN,
    ),
    "train_prorlv2_math_hybrid_engine.sh": (
        _gpus(1, "--actor.num_gpus_per_node 1 --ref.num_gpus_per_node 1"),
        _RL_SMALL,
        _GLOO,
        _SAVE_EACH_STEP,
        Override("--eval.steps 1 --eval.n_samples_per_prompt 2", "scale: evaluate after each of the 2 steps"),
        _RUN,
    ),
    "train_reinforce_baseline_hybrid_engine.sh": (_TP2_HYBRID, _RL_SMALL, _GLOO, _SAVE_EACH_STEP, _RUN),
    "train_reinforce_baseline_ray_agent_async.sh": (_TP2_HYBRID, _RL_SMALL, _GLOO, _SAVE_EACH_STEP, _RUN),
    "train_rm.sh": _OFFLINE_SMALL,
    "train_sft.sh": _OFFLINE_SMALL,
    "train_sft_mixtral_lora.sh": _OFFLINE_SMALL,
    "train_vlm_math_hybrid_engine.sh": (
        _gpus(1, "--actor.num_gpus_per_node 1"),
        Override(
            "--rollout_engine hf",
            "vLLM's multimodal models import torchvision, which vLLM's CPU venv here lacks: the transformers engine "
            "generates from the images",
        ),
        _RL_SMALL,
        _GLOO,
        _SAVE_EACH_STEP,
        _RUN,
    ),
}


def record(name: str) -> dict:
    """What a run's record in docs/openrlhf-examples.json holds of how it was run (placeholders unfilled): a record
    that differs from this is stale."""
    s = SCRIPTS[name]
    return {
        "command": s.command,
        "argv": s.argv,
        "dropped": [[flags, FEATURES[f]] for flags, f in s.blockers if flags],
        "overrides": [[o.flags, o.why] for o in OVERRIDES[name]],
    }


def drop(argv: list[str], flags: str) -> list[str]:
    """``argv`` without each of ``flags`` (space-separated) and its values."""
    for flag in flags.split():
        i = argv.index(flag)
        j = i + 1
        while j < len(argv) and not argv[j].startswith("--"):
            j += 1
        argv = argv[:i] + argv[j:]
    return argv


def run_argv(name: str, fx: dict[str, str]) -> list[str]:
    """``rl COMMAND`` 's arguments for script ``name``: its own flags less its refused ones (``blockers``), then
    its :data:`OVERRIDES`."""
    s = SCRIPTS[name]
    argv = s.args(fx)
    for flags, _ in s.blockers:
        argv = drop(argv, flags) if flags else argv
    return [s.command, *argv, *" ".join(o.flags for o in OVERRIDES[name]).format(**fx).split()]


# a reward with a spread inside every group (dynamic filtering keeps the groups whose scores differ)
REWARD_FUNC = """import torch


def reward_func(queries, prompts, labels, **kwargs):
    return torch.tensor([sum(map(ord, q)) % 3 / 2 for q in queries], dtype=torch.float32)
"""
AGENT_FUNC = """from openrlhf.utils.agent import AgentInstanceBase


class AgentInstance(AgentInstanceBase):
    def __init__(self, *args, **kwargs):
        self.turn = 0

    async def reset(self, states, **kwargs):
        return {"observation": states["observation"]}

    async def step(self, states, **kwargs):
        self.turn += 1
        done = self.turn >= 2
        score = sum(map(ord, states["action_text"])) % 3 / 2
        return {"rewards": score, "scores": score, "environment_feedback": "" if done else " again: ", "done": done}
"""


def _reward_model(model: Path, out: Path) -> None:
    """``model`` with a random score head under OpenRLHF's name (``score.weight``): a reward model to serve."""
    import transformers  # lazy: the fixtures only; importing the scripts' data stays light

    if (out / "config.json").is_file():
        return
    shutil.copytree(model, out)  # the tokenizer; the weights are rewritten with the head
    rm = transformers.AutoModelForSequenceClassification.from_pretrained(model, num_labels=1)
    rm.save_pretrained(out)


def write_fixtures(root: str | Path) -> dict[str, str]:
    """Tiny models, data and reward/agent files under ``root`` (reused if there); the placeholders' values."""
    from rl_rollout.testing import make_tiny_model, make_tiny_vlm, write_test_images  # lazy: transformers, PIL

    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    # 2 KV heads of 64: one per rank of a vLLM TP 2 engine (vLLM's CPU attention takes head_dim >= 64)
    make_tiny_model(root / "tiny", num_kv_heads=2)
    make_tiny_model(root / "tiny-moe", num_experts=4)
    make_tiny_vlm(root / "tiny-vlm")
    _reward_model(root / "tiny", root / "tiny-rm")
    rows = []
    for c in "abcdefghijklmnop":
        q = f"Repeat the letter {c}: "
        rows.append(
            {
                "prompt": q,
                "label": c,
                "question": q,
                "response": c * 4,
                "context_messages": [{"role": "user", "content": q}],
                "chosen": [{"role": "user", "content": q}, {"role": "assistant", "content": c * 4}],
                "rejected": [{"role": "user", "content": q}, {"role": "assistant", "content": "zz"}],
            }
        )
    (root / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    images = write_test_images(root / "images", 3)
    (root / "vlm.jsonl").write_text(
        "".join(
            json.dumps({"prompt": "<image>Which colour? ", "label": c, "images": [str(images[i % 3])]}) + "\n"
            for i, c in enumerate(["red", "green", "blue", "red"])
        )
    )
    (root / "reward_func.py").write_text(REWARD_FUNC)
    (root / "agent_func.py").write_text(AGENT_FUNC)
    return {
        "model": str(root / "tiny"),
        "rm": str(root / "tiny-rm"),
        "moe": str(root / "tiny-moe"),
        "vlm": str(root / "tiny-vlm"),
        "data": str(root / "data.jsonl"),
        "vlm_data": str(root / "vlm.jsonl"),
        "reward": str(root / "reward_func.py"),
        "agent": str(root / "agent_func.py"),
        "out": str(root / "out"),
    }
