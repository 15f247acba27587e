"""OpenRLHF's own example scripts, flag for flag, through our parsers with ``--print_config``.

OpenRLHF's examples/scripts/ at v0.11.0 (commit 3c3be623, the release openrlhf_flags.json lists) hold
13 training / serving commands. Each is transcribed here as data (our own list of its flags and values;
models, datasets and reward/agent files replaced by local tiny fixtures; ``python3 -m openrlhf.cli.X``
-> our ``rl X``, launcher prefixes dropped: ``deepspeed --module`` leaves its ``--local_rank=0``, which
is kept; ``ray job submit --`` and ``torchrun`` add nothing). For each script the test asserts that every
flag is known to our parser (mapped or refused, never unrecognized), and that ``--print_config`` exits 0,
or exits 2 with exactly the one-line refusal of each blocker in turn, and 0 once the blockers are
dropped. A feature that lands changes a refusal: update :data:`SCRIPTS` and the README table
(packages/rl-cli/README.md, "OpenRLHF's example scripts"), which the last test checks against this data.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pytest

from rl_cli import openrlhf, serve_rm
from rl_cli.config import build_parser
from rl_cli.main import main

README = Path(__file__).resolve().parents[1] / "README.md"

# what stops a script: the refusal line after "rl COMMAND: error: " ({flag}: the flag that asks for it)
FEATURES = {
    "reward server token": "the reward server needs a token: export RL_REWARD_TOKEN=<secret> (or --token; a flag "
                           "shows in ps) and give clients the same (RL_REWARD_TOKEN or --remote_rm_token), or pass "
                           "--allow_no_token to serve OpenRLHF's client, which sends none, on a network nobody else "
                           "can reach",
}


@dataclass(frozen=True)
class Script:
    command: str  # ours: openrlhf.cli.train_X -> rl_cli.train_X (rl X)
    argv: str  # the script's flags; {model} {data} {reward} {agent} {out}: local fixtures
    blockers: tuple[tuple[str | None, str], ...] = ()  # (flag to drop, FEATURES key), in refusal order

    def args(self, fx: dict[str, str]) -> list[str]:
        return self.argv.format(**fx).split()


_RAY_GPUS = "--ref.num_nodes 1 --ref.num_gpus_per_node {n} --actor.num_nodes 1 --actor.num_gpus_per_node {n} "
_PPO_COMMON = ("--train.micro_batch_size 8 --train.batch_size 128 --rollout.micro_batch_size 16 --rollout.batch_size "
               "1024 --data.max_samples 100000 --train.max_epochs 1 --data.max_len 2048 --ds.zero_stage 3 "
               "--ds.param_dtype bf16 --actor.adam.lr 5e-7 --critic.adam.lr 9e-6 --algo.kl.init_coef 0.01 "
               "--data.prompt_dataset {data} --data.input_key context_messages --data.apply_chat_template "
               "--reward.normalize_enable ")
_REINFORCE_BASELINE = (
    "--actor.model_name_or_path {model} --ckpt.load_enable --ckpt.output_dir {out} --ckpt.path {out}/ckpt "
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
    "{out}/runs --logger.logging_steps 1 --eval.steps -1")
_OFFLINE = ("--ckpt.save_steps -1 --logger.logging_steps 1 --eval.steps -1 --train.max_epochs 1 --ds.param_dtype bf16 "
            "--model.model_name_or_path {model} --data.dataset {data} --ds.attn_implementation flash_attention_2 ")
_PAIRS = ("--train.batch_size 256 --train.micro_batch_size 1 --data.max_len 8192 --ds.zero_stage 3 "
          "--data.apply_chat_template --data.chosen_key chosen --data.rejected_key rejected --ckpt.load_enable "
          "--ds.packing_samples --model.gradient_checkpointing_enable ")
_DPO = "--ckpt.output_dir {out} " + _OFFLINE + _PAIRS + "--adam.lr 5e-7 --model.beta 0.1"
_SFT = ("--data.max_len 2048 --data.input_key question --data.output_key response --data.max_samples 500000 "
        "--ckpt.output_dir {out} " + _OFFLINE)

SCRIPTS: dict[str, Script] = {
    "serve_remote_rm.sh": Script("serve-rm", (
        "--reward.model_name_or_path {model} --port 5000 --ds.param_dtype bf16 --ds.attn_implementation "
        "flash_attention_2 --reward.normalize_enable --data.max_len 8192 --batch_size 16"),
        ((None, "reward server token"),)),
    "train_dapo_ray_hybrid_engine.sh": Script("ppo-ray", _RAY_GPUS.format(n=8) + (
        "--vllm.num_engines 4 --vllm.tensor_parallel_size 2 --train.colocate_all --vllm.gpu_memory_utilization 0.6 "
        "--algo.kl.init_coef 1e-3 --algo.advantage.gamma 1.0 --algo.kl.use_loss --algo.kl.estimator k3 "
        "--algo.advantage.estimator group_norm --algo.dynamic_filtering_enable --algo.dynamic_filtering_range 0 1 "
        "--actor.eps_clip_low_high 0.2 0.27 --actor.model_name_or_path {model} --reward.remote_url {reward} "
        "--ckpt.output_dir {out} --ckpt.path {out}/ckpt --ckpt.save_steps 20 --ckpt.save_hf "
        "--train.micro_batch_size 8 --train.batch_size 128 --rollout.micro_batch_size 16 --rollout.batch_size 128 "
        "--rollout.n_samples_per_prompt 8 --train.max_epochs 1 --data.max_len 2048 --data.max_samples 20000 "
        "--ds.zero_stage 3 --ds.param_dtype bf16 --actor.adam.lr 5e-7 --data.prompt_dataset {data} "
        "--data.input_key context_messages --data.apply_chat_template --actor.gradient_checkpointing_enable "
        "--ds.packing_samples --vllm.sync_backend nccl --vllm.enforce_eager --vllm.enable_sleep --ds.enable_sleep "
        "--algo.advantage.is_correction_enable")),
    "train_dpo_llama.sh": Script("dpo", _DPO + " --local_rank=0"),
    "train_nonrl_slurm.sh": Script("dpo", _DPO),  # train_dpo_llama.sh's command under torchrun
    "train_ppo_ray_hybrid_engine.sh": Script("ppo-ray", _RAY_GPUS.format(n=8) + (
        "--reward.num_nodes 1 --reward.num_gpus_per_node 8 --critic.num_nodes 1 --critic.num_gpus_per_node 8 "
        "--vllm.num_engines 4 --vllm.tensor_parallel_size 2 --train.colocate_all --vllm.gpu_memory_utilization 0.5 "
        "--actor.model_name_or_path {model} --reward.model_name_or_path {model} --ckpt.output_dir {out} "
        "--ckpt.path {out}/ckpt --ckpt.save_hf --train.batch_size 128 --rollout.batch_size 1024 "
        "--rollout.n_samples_per_prompt 1 --train.max_epochs 1 --data.max_len 2048 --data.max_samples 100000 "
        "--ds.zero_stage 3 --ds.param_dtype bf16 --actor.adam.lr 5e-7 --critic.adam.lr 9e-6 --algo.kl.init_coef 0.01 "
        "--data.prompt_dataset {data} --data.input_key context_messages --data.apply_chat_template "
        "--reward.normalize_enable --actor.gradient_checkpointing_enable --ds.packing_samples --vllm.sync_backend "
        "nccl --vllm.enforce_eager --vllm.enable_sleep --ds.enable_sleep --train.dynamic_batch_enable "
        "--train.max_tokens_per_gpu 16384 --algo.advantage.is_correction_enable")),
    "train_ppo_ray_slurm.sh": Script("ppo-ray", _RAY_GPUS.format(n=4) + (
        "--reward.num_nodes 1 --reward.num_gpus_per_node 4 --critic.num_nodes 1 --critic.num_gpus_per_node 4 "
        "--vllm.num_engines 4 --vllm.tensor_parallel_size 2 --train.colocate_critic_reward --train.colocate_actor_ref "
        "--actor.model_name_or_path {model} --reward.model_name_or_path {model} --ckpt.output_dir {out} "
        + _PPO_COMMON + "--ds.adam_offload --ds.packing_samples --vllm.sync_backend nccl "
        "--actor.gradient_checkpointing_enable --logger.wandb.key KEY")),
    "train_ppo_with_reward_fn.sh": Script("ppo-ray", (
        "--ref.num_nodes 1 --ref.num_gpus_per_node 2 --critic.num_nodes 1 --critic.num_gpus_per_node 2 "
        "--actor.num_nodes 1 --actor.num_gpus_per_node 2 --vllm.num_engines 2 --vllm.tensor_parallel_size 2 "
        "--train.colocate_actor_ref --actor.model_name_or_path {model} --reward.remote_url {reward} "
        "--ckpt.output_dir {out} " + _PPO_COMMON + "--ds.packing_samples --ds.adam_offload "
        "--ds.attn_implementation flash_attention_2 --actor.gradient_checkpointing_enable --logger.wandb.key KEY")),
    "train_prorlv2_math_hybrid_engine.sh": Script("ppo-ray", _RAY_GPUS.format(n=8) + (
        "--vllm.num_engines 8 --vllm.tensor_parallel_size 1 --train.colocate_all --vllm.gpu_memory_utilization 0.75 "
        "--algo.kl.init_coef 1e-4 --algo.advantage.gamma 1.0 --algo.kl.use_loss --algo.kl.estimator k2 "
        "--algo.advantage.estimator reinforce_baseline --algo.dynamic_filtering_enable "
        "--algo.dynamic_filtering_range 0 1 --actor.eps_clip_low_high 0.2 0.27 --actor.model_name_or_path {model} "
        "--reward.remote_url {reward} --ckpt.output_dir {out} --ckpt.path {out}/ckpt --ckpt.save_steps 5 "
        "--ckpt.save_hf --train.batch_size 1024 --rollout.batch_size 512 --rollout.n_samples_per_prompt 16 "
        "--train.dynamic_batch_enable --train.num_episodes 100 --data.max_len 9216 --rollout.max_new_tokens 8192 "
        "--ds.zero_stage 3 --ds.param_dtype bf16 --actor.adam.lr 1e-6 --data.prompt_dataset {data} "
        "--data.input_key prompt --data.label_key label --eval.dataset {data} --eval.steps 5 --eval.temperature 1.0 "
        "--eval.n_samples_per_prompt 4 --data.apply_chat_template --actor.gradient_checkpointing_enable "
        "--ds.packing_samples --vllm.sync_backend nccl --vllm.enforce_eager --vllm.enable_sleep --ds.enable_sleep "
        "--algo.advantage.is_correction_enable --algo.advantage.is_correction_threshold 0.5 5.0 "
        "--algo.advantage.is_correction_type icepop --train.max_tokens_per_gpu 32768 "
        "--reward.stop_properly_penalty_coef 0.0")),
    "train_reinforce_baseline_hybrid_engine.sh": Script(
        "ppo-ray", _REINFORCE_BASELINE.replace("{extra}", "").replace("{gmu}", "0.7")),
    "train_reinforce_baseline_ray_agent_async.sh": Script("ppo-ray", _REINFORCE_BASELINE.replace(
        "{extra}", "--train.async_enable --train.partial_rollout_enable ").replace("{gmu}", "0.95")),
    "train_rm.sh": Script("rm", "--ckpt.output_dir {out} " + _OFFLINE + _PAIRS + "--adam.lr 9e-6 --local_rank=0"),
    "train_sft.sh": Script("sft", _SFT + (
        "--train.batch_size 256 --train.micro_batch_size 2 --ds.zero_stage 2 --adam.lr 5e-6 --ckpt.load_enable "
        "--ds.packing_samples --model.gradient_checkpointing_enable --local_rank=0")),
    "train_sft_mixtral_lora.sh": Script("sft", _SFT + (
        "--train.batch_size 128 --train.micro_batch_size 4 --ds.zero_stage 3 --model.gradient_checkpointing_enable "
        "--adam.lr 5e-6 --ds.lora.rank 64 --ds.lora.alpha 64 --ds.packing_samples --model.aux_loss_coef 0.001 "
        "--local_rank=0")),
    "train_vlm_math_hybrid_engine.sh": Script("ppo-ray", _RAY_GPUS.format(n=4) + (
        "--vllm.num_engines 4 --vllm.tensor_parallel_size 1 --train.colocate_all --vllm.gpu_memory_utilization 0.7 "
        "--algo.kl.init_coef 0 --algo.advantage.gamma 1.0 --algo.kl.use_loss --algo.kl.estimator k2 "
        "--algo.advantage.estimator reinforce_baseline --actor.model_name_or_path {model} --reward.remote_url {reward} "
        "--ckpt.output_dir {out} --ckpt.path {out}/ckpt --ckpt.save_hf --ckpt.save_steps 5 --eval.steps -1 "
        "--train.micro_batch_size 1 --rollout.micro_batch_size 1 --train.batch_size 1024 --rollout.batch_size 128 "
        "--rollout.n_samples_per_prompt 8 --train.num_episodes 100 --data.max_len 4096 --rollout.max_new_tokens 2048 "
        "--ds.zero_stage 3 --ds.param_dtype bf16 --actor.adam.lr 2e-6 --data.prompt_dataset {data} "
        "--data.input_key prompt --data.label_key label --data.image_key images --data.max_images_per_prompt 1 "
        "--actor.freeze_visual_encoder --data.apply_chat_template --actor.gradient_checkpointing_enable "
        "--ds.attn_implementation eager --vllm.sync_backend nccl --vllm.enforce_eager --vllm.enable_sleep "
        "--ds.enable_sleep")),
}
# the rest of examples/scripts/: no command of OpenRLHF's to run (README lists them)
NOT_COMMANDS = ("ckpt_ds_zero_to_universal.sh", "docker_run.sh", "nvidia_docker_install.sh")


@pytest.fixture(scope="module")
def fixtures(tmp_path_factory) -> dict[str, str]:
    from rl_rollout.testing import make_tiny_model

    root = tmp_path_factory.mktemp("openrlhf_scripts")
    make_tiny_model(root / "tiny")
    (root / "data.jsonl").write_text(json.dumps({"prompt": "1+1=", "label": "2"}) + "\n")
    (root / "reward_func.py").write_text("import torch\n\ndef reward_func(queries, prompts, labels, **kw):\n"
                                         "    return torch.zeros(len(queries))\n")
    (root / "agent_func.py").write_text("async def step(observation, action, label, **kw):\n    return {}\n")
    return {"model": str(root / "tiny"), "data": str(root / "data.jsonl"), "reward": str(root / "reward_func.py"),
            "agent": str(root / "agent_func.py"), "out": str(root / "out")}


def _parser(command: str):
    if command == "serve-rm":
        return build_parser("rl serve-rm", "", serve_rm._groups())[0]
    return openrlhf.parser_of(command)


def _drop(argv: list[str], flag: str) -> list[str]:
    i = argv.index(flag)
    j = i + 1
    while j < len(argv) and not argv[j].startswith("--"):
        j += 1
    return argv[:i] + argv[j:]


def _dry_run(command: str, argv: list[str], capsys) -> tuple[int, str, str]:
    try:
        code = main([command, *argv, "--print_config"])
    except SystemExit as e:
        code = e.code
    out, err = capsys.readouterr()
    return code, out, (err.strip().splitlines() or [""])[-1]


@pytest.mark.parametrize("name", SCRIPTS)
def test_every_flag_of_the_script_is_known(name, fixtures):
    s = SCRIPTS[name]
    known = _parser(s.command)._option_string_actions
    unknown = [a.split("=")[0] for a in s.args(fixtures) if a.startswith("--") and a.split("=")[0] not in known]
    assert not unknown, f"{name}: flags neither mapped nor refused (rl_cli/openrlhf_tables.py): {unknown}"


@pytest.mark.parametrize("name", SCRIPTS)
def test_the_script_prints_its_config_or_is_refused_in_one_line(name, fixtures, capsys, monkeypatch):
    s = SCRIPTS[name]
    monkeypatch.delenv("RL_REWARD_TOKEN", raising=False)
    argv = s.args(fixtures)
    for flag, feature in s.blockers:
        code, _, line = _dry_run(s.command, argv, capsys)
        assert (code, line) == (2, f"rl {s.command}: error: " + FEATURES[feature].format(flag=flag))
        if flag is None:  # not a flag: the server's token, from the environment
            monkeypatch.setenv("RL_REWARD_TOKEN", "secret")
        else:
            argv = _drop(argv, flag)
    code, out, line = _dry_run(s.command, argv, capsys)
    assert code == 0, f"{name} (blockers dropped): {line}"
    assert "nothing loaded" in out or s.command == "serve-rm"


def test_openrlhf_checkpoint_flags_bring_its_default_folder(fixtures, capsys):
    """train_sft.sh resumes with --ckpt.load_enable and no --ckpt.path: OpenRLHF's ./ckpt/checkpoints_sft."""
    argv = SCRIPTS["train_sft.sh"].args(fixtures)
    code, out, _ = _dry_run("sft", argv, capsys)
    assert code == 0 and 'ckpt_path: ./ckpt/checkpoints_sft' in out and 'load_checkpoint: true' in out
    code, out, _ = _dry_run("sft", ["--ckpt.path", "/mine", *argv], capsys)  # given before or after: it wins
    assert code == 0 and 'ckpt_path: /mine' in out
    code, out, _ = _dry_run("ppo-ray", [*SCRIPTS["train_ppo_ray_slurm.sh"].args(fixtures), "--ckpt.save_steps", "5"],
                            capsys)
    assert code == 0 and 'ckpt_path: ./ckpt/checkpoints_ppo_ray' in out and 'save_steps: 5' in out
    code, out, _ = _dry_run("ppo-ray", [*SCRIPTS["train_ppo_ray_slurm.sh"].args(fixtures), "--ckpt.save_steps", "-1"],
                            capsys)
    assert code == 0 and 'ckpt_path: null' in out  # no checkpoints: no folder


def test_save_hf_without_save_steps_saves_the_final_model_only_as_openrlhf_does(fixtures, capsys):
    """train_ppo_ray_hybrid_engine.sh gives --ckpt.save_hf and no --ckpt.save_steps: OpenRLHF then writes no
    checkpoint (so no HF export into one) and saves the final model to --ckpt.output_dir. Ours too, saying so."""
    code, out, _ = _dry_run("ppo-ray", SCRIPTS["train_ppo_ray_hybrid_engine.sh"].args(fixtures), capsys)
    assert code == 0 and 'save_hf_ckpt: true' in out and 'save_steps: -1' in out
    assert ("[rl ppo-ray] --ckpt.save_hf: no checkpoints are written without --ckpt.save_steps; the final model goes "
            f"to --save_path ({fixtures['out']})") in out
    code, out, _ = _dry_run("ppo-ray", SCRIPTS["train_dapo_ray_hybrid_engine.sh"].args(fixtures), capsys)
    assert code == 0 and 'save_hf_ckpt: true' in out and "no checkpoints are written" not in out  # save_steps 20


def test_deepspeed_sleep_is_taken_under_zero_and_refused_without_a_zero_optimizer(fixtures, capsys):
    """--ds.enable_sleep (train_dapo_ray_hybrid_engine.sh, ZeRO-3) sets rl-core's DeepSpeed sleep; ZeRO-0 and
    --adam_offload are refused in one line before anything loads."""
    argv = SCRIPTS["train_dapo_ray_hybrid_engine.sh"].args(fixtures)
    code, out, _ = _dry_run("ppo-ray", argv, capsys)
    assert code == 0 and 'deepspeed_enable_sleep: true' in out
    code, _, line = _dry_run("ppo-ray", [*argv, "--ds.zero_stage", "0"], capsys)
    assert (code, line) == (2, "rl ppo-ray: error: --deepspeed_enable_sleep needs --zero_stage 1, 2 or 3 (DeepSpeed "
                               "offloads the states of a ZeRO optimizer), got --zero_stage 0")
    code, _, line = _dry_run("ppo-ray", [*argv, "--ds.adam_offload"], capsys)
    assert code == 2 and line.endswith("--adam_offload keeps them there already: drop one of them")


def test_openrlhf_checkpoint_folder_stays_below_yaml(fixtures, capsys, tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("train:\n  ckpt_path: /from/yaml\n")
    code, out, _ = _dry_run("sft", [*SCRIPTS["train_sft.sh"].args(fixtures), "--config", str(cfg)], capsys)
    assert code == 0 and 'ckpt_path: /from/yaml' in out


def test_readme_lists_each_script_with_its_status():
    text = README.read_text()
    for name, s in SCRIPTS.items():
        status = "runs as is" if not s.blockers else "refused: " + ", ".join(dict.fromkeys(f for _, f in s.blockers))
        assert f"| `{name}` | `rl {s.command}` | {status} |" in text, name
    for name in NOT_COMMANDS:
        assert f"| `{name}` |" in text, name
