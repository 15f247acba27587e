"""OpenRLHF's flags (both dialects, every command): each one accepted onto the right field, or refused in one line.

The list is OpenRLHF's own (rl_cli/openrlhf_flags.json, extracted from its argparse code);
docs/openrlhf.md is generated from the parsers, so it cannot drift from them.
"""

from __future__ import annotations

import ast
import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from rl_cli import openrlhf, ppo, train
from rl_cli.config import build_parser
from rl_cli.loading import resolve

ROOT = Path(__file__).resolve().parents[3]


def parse(command: str, argv: list[str]) -> dict:
    groups = ppo._groups(command == "ppo-ray") if command.startswith("ppo") else train._groups(
        train.COMMANDS[command])
    parser, flags = build_parser(f"rl {command}", "", groups)
    return resolve(groups, parser.parse_args(argv), flags)


def refused(command: str, argv: list[str], capsys) -> str:
    with pytest.raises(SystemExit) as e:
        parse(command, argv)
    assert e.value.code == 2
    return capsys.readouterr().err.strip().splitlines()[-1]


@pytest.mark.parametrize("command", openrlhf.COMMANDS)
def test_every_openrlhf_flag_is_accepted_or_refused(command):
    rows = openrlhf.rows(command)
    missing = [r.flag for r in rows if r.status == "MISSING"]
    assert not missing, (f"rl {command}: OpenRLHF flags neither accepted nor refused; add each to ALIAS, CONVERT or "
                         f"REFUSED in rl_cli/openrlhf_tables.py: {missing}")
    assert len(rows) == sum(len(d) for d in openrlhf.flags_of(command).values())
    assert all(r.why for r in rows if r.status == "refused")


def test_the_list_covers_both_dialects_and_the_flags_users_reported():
    flat, grouped = openrlhf.flags_of("ppo-ray")["flat"], openrlhf.flags_of("ppo-ray")["grouped"]
    for name in ("actor_learning_rate", "micro_rollout_batch_size", "packing_samples", "use_tensorboard",
                 "eps_clip_low_high", "policy_loss_type", "entropy_loss_coef", "overlong_buffer_len",
                 "agent_func_path", "async_train", "lora_rank", "logging_steps", "save_hf_ckpt",
                 "deepspeed_enable_sleep", "enable_prefix_caching", "ref_reward_offload"):
        assert name in flat, name
    for name in ("actor.model_name_or_path", "actor.num_gpus_per_node", "reward.remote_url", "vllm.num_engines",
                 "vllm.sync_backend", "vllm.enable_sleep", "ds.zero_stage", "ds.packing_samples", "ds.enable_sleep",
                 "train.batch_size", "train.colocate_all", "train.async_enable", "train.agent_func_path",
                 "train.dynamic_batch_enable", "train.max_tokens_per_gpu", "algo.advantage.estimator",
                 "algo.kl.init_coef", "algo.dynamic_filtering_enable", "actor.adam.lr", "ckpt.output_dir"):
        assert name in grouped, name
    for name in ("multiturn", "pretrain_mode", "target_modules"):
        assert name in openrlhf.flags_of("sft")["flat"]
    assert "value_head_prefix" in openrlhf.flags_of("rm")["flat"]
    assert openrlhf.flags_of("sft")["flat"]["target_modules"]["nargs"] == "*"
    assert len(openrlhf.openrlhf_flags()["releases"]["v0.11.0"]) == 40


def test_docs_table_is_generated_from_the_parsers():
    doc = (ROOT / "docs" / "openrlhf.md").read_text()
    assert doc == openrlhf.markdown(), "docs/openrlhf.md is stale: python -m rl_cli.openrlhf > docs/openrlhf.md"


@pytest.mark.parametrize(("command", "argv", "want"), [
    ("ppo-ray", ["--actor_learning_rate", "3e-6"], {"strategy.learning_rate": 3e-6}),
    ("ppo-ray", ["--actor.adam.lr", "2e-6", "--actor.adam.betas", "0.9", "0.99"],
     {"strategy.learning_rate": 2e-6, "strategy.adam_betas": (0.9, 0.99)}),
    ("ppo-ray", ["--eps_clip_low_high", "0.2", "0.28"], {"ppo.eps_clip": 0.2, "ppo.eps_clip_high": 0.28}),
    ("ppo-ray", ["--actor.eps_clip_low_high", "0.1", "0.3"], {"ppo.eps_clip": 0.1, "ppo.eps_clip_high": 0.3}),
    ("ppo-ray", ["--train.batch_size", "16", "--train.micro_batch_size", "2", "--rollout.batch_size", "4",
                 "--rollout.n_samples_per_prompt", "4"],
     {"strategy.train_batch_size": 16, "strategy.micro_train_batch_size": 2, "ppo.rollout_batch_size": 4,
      "ppo.n_samples_per_prompt": 4}),
    ("ppo-ray", ["--vllm.num_engines", "2", "--actor.num_gpus_per_node", "4", "--train.colocate_all"],
     {"ray.vllm_num_engines": 2, "ray.actor_num_gpus_per_node": 4, "ray.colocate_all_models": True}),
    ("ppo-ray", ["--algo.kl.init_coef", "0.05", "--algo.kl.use_loss", "--ds.zero_stage", "3"],
     {"ppo.init_kl_coef": 0.05, "ppo.use_kl_loss": True, "strategy.zero_stage": 3}),
    ("ppo-ray", ["--ds.param_dtype", "bf16", "--ds.attn_implementation", "sdpa"],
     {"strategy.bf16": True, "model.attn_implementation": "sdpa"}),
    ("sft", ["--attn_implementation", "torch_varlen"], {"model.attn_implementation": "torch_varlen"}),
    ("ppo", ["--attn_implementation", "flex_attention"], {"model.attn_implementation": "flex_attention"}),
    ("ppo-ray", ["--freezing_actor_steps", "-1"], {"ppo.freezing_actor_steps": 0}),
    ("ppo-ray", ["--critic.freezing_steps", "3"], {"ppo.freezing_actor_steps": 3}),
    ("ppo-ray", ["--ckpt.output_dir", "out", "--ckpt.save_steps", "5", "--ckpt.path", "c"],
     {"ppo.save_path": "out", "ppo.save_steps": 5, "ppo.ckpt_path": "c"}),
    ("ppo", ["--vllm_is_correction_type", "icepop"], {"ppo.is_correction": None}),  # inert without the enable flag
    ("ppo", ["--vllm_is_correction_type", "icepop", "--enable_vllm_is_correction"], {"ppo.is_correction": "icepop"}),
    ("ppo", ["--enable_vllm_is_correction", "--vllm_is_correction_type", "icepop"], {"ppo.is_correction": "icepop"}),
    ("ppo", ["--algo.advantage.is_correction_enable"], {"ppo.is_correction": "tis"}),
    ("ppo", ["--ring_attn_size", "1", "--zpg", "1", "--dataloader_num_workers", "0"], {}),  # "off" values: no-ops
    ("ppo-ray", ["--packing_samples", "--micro_rollout_batch_size", "4"],
     {"data.packing": True, "batching.forward_micro_batch_size": 4, "batching.max_tokens_per_gpu": "auto"}),
    ("ppo", ["--ds.packing_samples", "--rollout.micro_batch_size", "2"],
     {"data.packing": True, "batching.forward_micro_batch_size": 2}),
    # OpenRLHF's budgets act only with its dynamic-batch switch, which also packs (either order)
    ("ppo", ["--train_max_tokens_per_gpu", "8000"], {"batching.max_tokens_per_gpu": "auto", "data.packing": None}),
    ("ppo", ["--use_dynamic_batch"], {"batching.max_tokens_per_gpu": 16192, "data.packing": True,
                                      "batching.forward_max_tokens_per_gpu": None}),
    ("ppo-ray", ["--train_max_tokens_per_gpu", "8000", "--rollout_max_tokens_per_gpu", "20000", "--use_dynamic_batch"],
     {"batching.max_tokens_per_gpu": 8000, "batching.forward_max_tokens_per_gpu": 20000, "data.packing": True}),
    ("ppo-ray", ["--train.dynamic_batch_enable", "--train.max_tokens_per_gpu", "4096",
                 "--rollout.max_tokens_per_gpu", "9000"],
     {"batching.max_tokens_per_gpu": 4096, "batching.forward_max_tokens_per_gpu": 9000, "data.packing": True}),
    ("ppo", ["--max_tokens_per_gpu", "3000", "--use_dynamic_batch"], {"batching.max_tokens_per_gpu": 3000}),
    ("sft", ["--target_modules", "q_proj", "v_proj"], {"model.target_modules": "q_proj,v_proj"}),
    ("sft", ["--ds.lora.target_modules", "q_proj", "--ds.lora.rank", "8"],
     {"model.target_modules": "q_proj", "model.lora_rank": 8}),
    ("sft", ["--multiturn", "--packing_samples"], {"data.apply_chat_template": True, "data.packing": True}),
    ("sft", ["--model.pretrain_mode_enable"], {"train.pretrain_mode": True}),
    ("dpo", ["--ckpt.save_hf", "--ckpt.save_steps", "5"], {"train.save_hf_ckpt": True, "train.save_steps": 5}),
    ("ppo-ray", ["--ds.lora.rank", "8", "--ds.lora.alpha", "32", "--ds.lora.target_modules", "q_proj", "v_proj"],
     {"model.lora_rank": 8, "model.lora_alpha": 32, "model.target_modules": "q_proj,v_proj"}),
    ("ppo", ["--lora_rank", "4", "--lora_dropout", "0.05"], {"model.lora_rank": 4, "model.lora_dropout": 0.05}),
    ("rm", ["--packing_samples"], {"data.packing": True}),
    ("dpo", ["--ds.packing_samples"], {"data.packing": True}),
    ("kto", ["--packing"], {"data.packing": True}),  # OpenRLHF's train_kto (v0.9.5) had no packing flag
    ("sft", ["--adam.lr", "1e-5", "--train.seed", "7", "--model.model_name_or_path", "m"],
     {"strategy.learning_rate": 1e-5, "strategy.seed": 7, "model.pretrain": "m"}),
    ("sft", ["--disable_fast_tokenizer"], {"data.disable_fast_tokenizer": True}),
    ("ppo-ray", ["--data.disable_fast_tokenizer"], {"data.disable_fast_tokenizer": True}),
    ("sft", ["--gradient_checkpointing", "--gradient_checkpointing_use_reentrant"],
     {"strategy.gradient_checkpointing": True, "strategy.gradient_checkpointing_use_reentrant": True}),
    ("ppo-ray", ["--actor.gradient_checkpointing_enable", "--actor.gradient_checkpointing_reentrant"],
     {"strategy.gradient_checkpointing": True, "strategy.gradient_checkpointing_use_reentrant": True}),
    ("dpo", ["--zero_stage", "3", "--overlap_comm", "--zpg", "8", "--grad_accum_dtype", "fp32"],
     {"strategy.overlap_comm": True, "strategy.zpg": 8, "strategy.grad_accum_dtype": "fp32"}),
    ("ppo-ray", ["--ds.zero_stage", "3", "--ds.overlap_comm", "--ds.zpg", "2", "--ds.grad_accum_dtype", "bf16",
                 "--actor.adam.eps", "1e-6"],
     {"strategy.overlap_comm": True, "strategy.zpg": 2, "strategy.grad_accum_dtype": "bf16",
      "strategy.adam_eps": 1e-6}),
    ("sft", ["--adam.eps", "1e-7"], {"strategy.adam_eps": 1e-7}),
    ("rm", ["--full_determinism"], {"strategy.full_determinism": True}),
    ("ppo-ray", ["--train.full_determinism_enable"], {"strategy.full_determinism": True}),
    ("sft", ["--dataset", "a.jsonl,b.jsonl", "--dataset_probs", "0.7,0.3"],
     {"data.dataset": "a.jsonl,b.jsonl", "data.dataset_probs": "0.7,0.3"}),
    ("dpo", ["--data.dataset", "a.jsonl,b.jsonl", "--data.dataset_probs", "0.5,0.5"], {"data.dataset_probs": "0.5,0.5"}),
    ("ppo-ray", ["--prompt_data", "a.jsonl,b.jsonl", "--prompt_data_probs", "0.2,0.8"],
     {"data.dataset": "a.jsonl,b.jsonl", "data.dataset_probs": "0.2,0.8"}),
    ("ppo", ["--data.prompt_dataset", "a.jsonl,b.jsonl", "--data.prompt_probs", "0.2,0.8"],
     {"data.dataset": "a.jsonl,b.jsonl", "data.dataset_probs": "0.2,0.8"}),
    ("sft", ["--optim", "adam"], {"strategy.optim": "adam"}),
    ("sft", ["--optim", "muon", "--muon.lr", "0.05", "--muon.momentum", "0.9", "--muon.ns_steps", "5",
             "--muon.nesterov"], {"strategy.optim": "muon", "strategy.muon_lr": 0.05, "strategy.muon_momentum": 0.9}),
    ("rm", ["--optim", "muon", "--muon.lr", "0.01"], {"strategy.optim": "muon", "strategy.muon_lr": 0.01}),
    ("dpo", ["--optim", "muon"], {"strategy.optim": "muon"}),
    ("kto", ["--strategy.optim", "muon", "--muon_momentum", "0.8"],
     {"strategy.optim": "muon", "strategy.muon_momentum": 0.8}),
    ("ppo-ray", ["--actor.optim", "muon", "--actor.muon.lr", "0.01", "--actor.muon.momentum", "0.9",
                 "--actor.muon.ns_steps", "5", "--critic.optim", "muon", "--critic.muon.lr", "0.03",
                 "--critic.muon.momentum", "0.8", "--critic.muon.nesterov"],
     {"strategy.optim": "muon", "strategy.muon_lr": 0.01, "strategy.muon_momentum": 0.9, "ppo.critic_optim": "muon",
      "ppo.critic_muon_lr": 0.03, "ppo.critic_muon_momentum": 0.8}),
    ("ppo", ["--actor.optim", "muon"], {"strategy.optim": "muon", "ppo.critic_optim": "adam"}),  # as OpenRLHF's
    ("sft", ["--use_liger_kernel"], {"model.use_liger_kernel": True}),
    ("dpo", ["--ds.use_liger_kernel"], {"model.use_liger_kernel": True}),
    ("ppo-ray", ["--ds.use_liger_kernel"], {"model.use_liger_kernel": True}),
    ("rm", ["--value_head_prefix", "score", "--model.loss_type", "logexp"], {"train.loss": "logexp"}),
    ("dpo", ["--model.beta", "0.2", "--ref.model_name_or_path", "r", "--model.ipo_enable"],
     {"train.beta": 0.2, "model.ref_pretrain": "r", "train.ipo": True}),
    ("dpo", ["--eval.dataset", "e.jsonl", "--eval.steps", "10"], {"data.eval_dataset": "e.jsonl",
                                                                  "train.eval_steps": 10}),
    ("ppo-ray", ["--actor.entropy_coef", "0.0"], {"ppo.entropy_loss_coef": 0.0}),
    ("ppo", ["--entropy_loss_coef", "0.01"], {"ppo.entropy_loss_coef": 0.01}),
    ("ppo-ray", ["--ds.value_head_prefix", "value_head"], {"model.value_head_prefix": "value_head"}),
    ("ppo", ["--value_head_prefix", "score"], {"model.value_head_prefix": "score"}),
    ("ppo-ray", ["--critic.adam.betas", "0.8", "0.9", "--critic.adam.eps", "1e-6", "--critic.adam.weight_decay", "0.1",
                 "--critic.lr_scheduler", "constant", "--critic.lr_warmup_ratio", "0.1", "--critic.min_lr_ratio",
                 "0.2", "--critic.max_norm", "0.5", "--critic.adam.lr", "2e-6"],
     {"ppo.critic_adam_betas": (0.8, 0.9), "ppo.critic_adam_eps": 1e-6, "ppo.critic_weight_decay": 0.1,
      "ppo.critic_lr_scheduler": "constant", "ppo.critic_lr_warmup_ratio": 0.1, "ppo.critic_min_lr_ratio": 0.2,
      "ppo.critic_max_norm": 0.5, "ppo.critic_learning_rate": 2e-6}),
    ("ppo", ["--adam_betas", "0.8", "0.99"], {"ppo.critic_adam_betas": None}),  # unset: the actor's (flat dialect)
    ("ppo-ray", ["--actor.aux_loss_coef", "0.01", "--train.enable_ema", "--train.ema_beta", "0.99"],
     {"ppo.aux_loss_coef": 0.01, "ppo.enable_ema": True, "ppo.ema_beta": 0.99}),
    ("ppo", ["--aux_loss_coef", "0.001", "--enable_ema", "--ema_beta", "0.9"],
     {"ppo.aux_loss_coef": 0.001, "ppo.enable_ema": True, "ppo.ema_beta": 0.9}),
    ("sft", ["--apply_chat_template", "--tokenizer_chat_template", "{{ x }}"],
     {"data.tokenizer_chat_template": "{{ x }}"}),
    ("dpo", ["--data.apply_chat_template", "--data.tokenizer_chat_template", "{{ x }}"],
     {"data.tokenizer_chat_template": "{{ x }}"}),
    ("dpo", ["--ref.offload", "--ds.zero_stage", "3"], {"train.ref_offload": True}),
    ("kto", ["--ref_offload", "--zero_stage", "3"], {"train.ref_offload": True}),
    ("ppo", ["--ref_reward_offload", "--zero_stage", "3"], {"model.ref_offload": True, "model.reward_offload": True}),
    ("ppo-ray", ["--reward.offload", "--ds.zero_stage", "3"], {"model.ref_offload": False,
                                                              "model.reward_offload": True}),
    ("ppo", ["--pretrain_data", "a.jsonl,b.jsonl", "--pretrain_data_probs", "0.3,0.7", "--pretrain_split", "dev",
             "--ptx_coef", "0.1"], {"ppo.pretrain_data": "a.jsonl,b.jsonl", "ppo.pretrain_data_probs": "0.3,0.7",
                                    "ppo.pretrain_split": "dev", "ppo.ptx_coef": 0.1}),
    ("ppo-ray", ["--pretrain_data", "a.jsonl", "--ptx_coef", "0.2"], {"ppo.ptx_coef": 0.2}),
])
def test_openrlhf_flags_land_in_the_right_field(command, argv, want):
    cfgs = parse(command, argv)
    got = {k: setting(cfgs, k) for k in want}
    assert got == want


def setting(cfgs: dict, key: str):
    """``group.NAME``'s value, NAME a field of the group or a flat name of a field of its nodes (``ppo.ema_beta``
    is ``ppo.ema.beta``: rl_core.configs.flat_table)."""
    from rl_core.configs import flat_table

    group, name = key.split(".", 1)
    obj = cfgs[group]
    if not hasattr(obj, name):
        path, switch = flat_table(type(obj))[name]
        for part in path:
            obj = getattr(obj, part)
        return obj is not None if switch else obj
    return getattr(obj, name)


@pytest.mark.parametrize(("command", "argv", "says"), [
    ("ppo-ray", ["--ds.tensor_parallel_size", "2"], "tensor-parallel"),
    ("ppo-ray", ["--perf"], "metrics"),
    ("ppo-ray", ["--actor.muon.no_nesterov"], "Nesterov"),
    ("sft", ["--muon.ns_steps", "3"], "5 Newton-Schulz steps"),
    ("ppo", ["--critic.muon.ns_steps", "10"], "5 Newton-Schulz steps"),
    ("ppo-ray", ["--ds.param_dtype", "fp16"], "bf16"),
    ("ppo", ["--vllm_num_engines", "2"], "rl ppo-ray"),
    ("ppo", ["--actor.num_gpus_per_node", "2"], "rl ppo-ray"),
    ("rm", ["--value_head_prefix", "value_head2"], "rl_head"),
    ("sft", ["--ds_tensor_parallel_size", "2"], "tensor-parallel"),
    ("sft", ["--use_ms"], "ModelScope"),
    ("rm", ["--aux_loss_coef", "0.01"], "reward or value head"),
])
def test_refused_flags_stop_with_one_line_naming_the_flag(command, argv, says, capsys):
    line = refused(command, argv, capsys)
    assert argv[0] in line and says in line, line


@pytest.mark.parametrize(("command", "argv", "says"), [
    ("sft", ["--attn_implementation", "flash"], r"--attn_implementation 'flash' is not built; use one of "
                                                r"flash_attention_2, sdpa, eager, torch_varlen, flex_attention"),
    ("ppo-ray", ["--ds.attn_implementation", "sdpa", "--flash_attn"], r"--flash_attn and --attn_implementation sdpa "
                                                                       r"disagree; pass one of them"),
])
def test_a_bad_attention_choice_fails_naming_it(command, argv, says):
    with pytest.raises(ValueError, match=says):
        parse(command, argv)


def test_prompt_data_probs_that_do_not_fit_the_files_fail_naming_them():
    with pytest.raises(ValueError, match=r"dataset_probs '1.0' \(--dataset_probs\) gives 1 probabilities for 2 "
                                         r"--dataset files \('a.jsonl,b.jsonl'\); give one per file"):
        parse("ppo-ray", ["--prompt_data", "a.jsonl,b.jsonl", "--prompt_data_probs", "1.0"])


def test_accepted_flags_take_openrlhf_values_in_openrlhf_shape():
    """A switch of OpenRLHF's parses with no value, a multi-value flag with its values, a typed one with its default."""
    bad = []
    for command in openrlhf.COMMANDS:
        parser = openrlhf.parser_of(command)
        for dialect in ("flat", "grouped"):
            for name, shape in openrlhf.flags_of(command)[dialect].items():
                act = parser._option_string_actions[f"--{name}"]
                if isinstance(act, openrlhf._Refused):
                    continue
                default = shape.get("default")
                if shape.get("action") in ("store_true", "store_false"):
                    argv = [f"--{name}"]
                elif isinstance(default, list) and default:
                    argv = [f"--{name}", *map(str, default)]
                elif isinstance(default, (int, float, str)) and not isinstance(default, bool) and not (
                        isinstance(default, str) and "(" in default):
                    argv = [f"--{name}", str(default)]
                else:
                    continue
                try:
                    parser.parse_args(argv)
                except SystemExit:
                    bad.append(f"rl {command} {' '.join(argv)}")
    assert not bad, "OpenRLHF values our parser rejects:\n" + "\n".join(bad)


def _run(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *argv], capture_output=True, text=True, timeout=300, cwd=ROOT)


SHEET = ["--pretrain", "/nonexistent/Qwen2.5-7B-Instruct", "--reward_pretrain", "/nonexistent/rm",
         "--advantage_estimator", "group_norm", "--n_samples_per_prompt", "8", "--vllm_num_engines", "2",
         "--vllm_tensor_parallel_size", "1", "--actor_num_gpus_per_node", "4", "--colocate_actor_ref",
         "--prompt_data", "/nonexistent/prompts", "--input_key", "prompt", "--save_path", "./ckpt"]
GROUPED = ["--actor.model_name_or_path", "/nonexistent/Qwen2.5-7B-Instruct", "--reward.model_name_or_path",
           "/nonexistent/rm", "--algo.advantage.estimator", "group_norm", "--rollout.n_samples_per_prompt", "8",
           "--vllm.num_engines", "2", "--vllm.tensor_parallel_size", "1", "--actor.num_gpus_per_node", "4",
           "--train.colocate_actor_ref", "--data.prompt_dataset", "/nonexistent/prompts", "--data.input_key",
           "prompt", "--ckpt.output_dir", "./ckpt"]


@pytest.mark.parametrize("argv", [SHEET, GROUPED], ids=["flat", "grouped"])
def test_the_reference_sheet_command_prints_its_config_in_both_dialects(argv):
    """(OpenRLHF itself asserts n_samples_per_prompt > 1 for group_norm, as we do: the sheet omits it.)"""
    t0 = time.monotonic()
    r = _run("-m", "rl_cli.train_ppo_ray", *argv, "--print_config")
    assert r.returncode == 0, r.stderr[-2000:]
    assert time.monotonic() - t0 < 120
    out = r.stdout
    assert 'pretrain: /nonexistent/Qwen2.5-7B-Instruct' in out and 'estimator: group_norm' in out
    assert 'colocate_actor_ref: true' in out and 'vllm_num_engines: 2' in out and 'input_key: prompt' in out
    assert "8 prompts x 8 samples = 64 samples" in out
    assert "micro batch 1 x accumulation 2 x data parallel 4" in out
    assert "node0: gpu3 [policy r3, ref r3]" in out and "[vllm e1/tp0]" in out
    assert "nothing loaded" in out
    assert "torch.distributed" not in r.stderr and "Started a local Ray" not in r.stderr + out


def test_openrlhf_async_queue_and_oversampling_flags_land_on_ours():
    """--train.async_queue_size q is our --max_staleness q (OpenRLHF's q slot tokens let batch k+q start once batch
    k is taken, with the weights of version k-1); --rollout.vllm_generate_batch_size over-samples."""
    r = _run("-m", "rl_cli.train_ppo_ray", *GROUPED, "--train.async_enable", "--train.async_queue_size", "2",
             "--rollout.vllm_generate_batch_size", "16", "--rollout.batch_size", "8", "--print_config")
    assert r.returncode == 0, r.stderr[-2000:]
    shown = yaml.safe_load(r.stdout)["ppo"]["async_rl"]  # the printed config is YAML (comments after it)
    assert shown["max_staleness"] == 2 and shown["generate_batch_size"] == 16


@pytest.mark.parametrize("command", ["sft", "rm", "dpo", "kto", "ppo"])
def test_print_config_is_a_dry_run_on_every_command(command):
    data = "--prompt_data" if command == "ppo" else "--dataset"
    extra = ["--reward_fn", "builtin:math", "--label_key", "answer"] if command == "ppo" else []
    r = _run("-m", "rl_cli.main", command, "--pretrain", "/nonexistent/model", data, "/nonexistent/data.jsonl",
             "--train_batch_size", "4", "--micro_train_batch_size", "2", *extra, "--print_config")
    assert r.returncode == 0, r.stderr[-2000:]
    assert 'pretrain: /nonexistent/model' in r.stdout
    assert "global batch 4 = micro batch 2 x accumulation 2 x data parallel 1" in r.stdout
    assert "nothing loaded" in r.stdout


def test_print_config_reports_batch_arithmetic_that_cannot_work():
    r = _run("-m", "rl_cli.main", "ppo-ray", "--pretrain", "m", "--prompt_data", "p", "--rollout_batch_size", "3",
             "--train_batch_size", "4", "--print_config")
    assert r.returncode == 2
    assert "3 x --n_samples_per_prompt 1 = 3 samples per iteration is not a multiple of --train_batch_size 4" \
        in r.stdout


def test_extractor_reads_loops_and_fstrings():
    spec = importlib.util.spec_from_file_location("extract", ROOT / "packages/rl-cli/scripts/extract_openrlhf_flags.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    src = '''
import argparse
p = argparse.ArgumentParser()
p.add_argument("--a.b", type=int, default=3)
p.add_argument("--flag", action="store_true", default=False)
for prefix in ("actor", "critic"):
    p.add_argument(f"--{prefix}.adam.betas", type=float, nargs=2, default=(0.9, 0.95))
'''
    ast.parse(src)
    assert mod.flags_of(src) == {"a.b": {"type": "int", "default": 3},
                                 "flag": {"action": "store_true", "default": False},
                                 "actor.adam.betas": {"type": "float", "nargs": 2, "default": [0.9, 0.95]},
                                 "critic.adam.betas": {"type": "float", "nargs": 2, "default": [0.9, 0.95]}}


@pytest.mark.skipif(not os.environ.get("OPENRLHF_GIT"), reason="set OPENRLHF_GIT to a clone of OpenRLHF (its .git)")
def test_the_committed_list_is_what_the_extractor_reads_from_openrlhf():
    r = _run(str(ROOT / "packages/rl-cli/scripts/extract_openrlhf_flags.py"), os.environ["OPENRLHF_GIT"])
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout) == openrlhf.openrlhf_flags(), "re-run the extractor into rl_cli/openrlhf_flags.json"


def test_ring_attention_in_rl_ppo_stops_the_run_in_one_line(capsys):
    """--ring_attn_size parses everywhere (a StrategyConfig field); rl ppo runs each role as one process, so a ring
    size above 1 stops it before anything loads, naming the flag (--print_config too: that config cannot run)."""
    from rl_cli.main import main

    with pytest.raises(SystemExit) as e:
        main(["ppo", "--pretrain", "/m", "--dataset", "d.jsonl", "--ds.ring_attn_size", "2", "--print_config"])
    assert e.value.code == 2
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert "--ring_attn_size 2" in line and "rl ppo-ray" in line, line


def test_pretrain_data_loads_through_the_prompt_loaders_capped_and_cut_as_openrlhf(tmp_path):
    """PPO-ptx's rows: --pretrain_data files blended by --pretrain_data_probs, the text in --input_key, at most
    max_epochs x prompts x n_samples_per_prompt rows (OpenRLHF's select), cut at --max_len + --generate_max_len."""
    from rl_cli.ppo import pretrain_items
    from rl_core.data import DataError
    from rl_rollout.testing import make_tokenizer

    for name in "ab":
        (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps({"text": name * (6 + i)}) + "\n" for i in range(4)))
    files = f"{tmp_path / 'a.jsonl'},{tmp_path / 'b.jsonl'}"
    argv = ["--input_key", "text", "--max_len", "2", "--generate_max_len", "3", "--n_samples_per_prompt", "2"]
    tok = make_tokenizer()
    assert pretrain_items(parse("ppo", argv), tok, 3) is None
    ds = pretrain_items(parse("ppo", [*argv, "--pretrain_data", files, "--pretrain_data_probs", "0.5,0.5"]), tok, 3)
    assert len(ds) == 6 and {len(it["input_ids"]) for it in ds} == {5} and ds.report.truncated == 6
    assert {tok.decode(it["input_ids"][:1]) for it in ds} == {"a", "b"}
    (tmp_path / "bad.jsonl").write_text(json.dumps({"prompt": "x"}) + "\n")
    with pytest.raises(DataError, match=r"^pretraining set \(--pretrain_data .*bad.jsonl\): .*'text'"):
        pretrain_items(parse("ppo", [*argv, "--pretrain_data", str(tmp_path / "bad.jsonl")]), tok, 3)
