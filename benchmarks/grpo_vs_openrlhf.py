"""GRPO side by side on one GPU: OpenRLHF 0.11.2's ``train_ppo_ray`` (hybrid engine) and ``rl ppo --rollout_engine vllm``.

    python3 benchmarks/grpo_vs_openrlhf.py --dry_run                  # both command lines, the files; no GPU needed
    python3 benchmarks/grpo_vs_openrlhf.py --openrlhf_pythonpath /tmp/site-orlhf          # on the GPU: both sides
    python3 benchmarks/grpo_vs_openrlhf.py --sides openrlhf --out a.json; ... --sides ours --load a.json

FINDINGS (2026-12-07, from OpenRLHF 0.11.2's wheel read here, its import run here on CPU; not yet run on a GPU):
- ``python -m openrlhf.cli.train_ppo_ray`` imports, at the top: ray, vllm (vllm_engine.py: AsyncEngineArgs,
  AsyncLLMEngine, TokensPrompt, random_uuid), deepspeed, peft (models/actor.py), torchdata (StatefulDataLoader),
  datasets, pylatexenc (openrlhf.utils.math_utils, imported by openrlhf.utils), aiohttp (utils/agent.py) and
  flash_attn: models/ring_attn_utils.py imports flash_attn.bert_padding and flash_attn.utils.distributed at module
  level and models/actor.py imports it, so without flash-attn nothing starts. flash-attn (pinned 2.8.3) has no wheel
  (source only, a long nvcc build); its functions are called only with --ds.packing_samples or --ds.ring_attn_size > 1,
  so scripts/device/openrlhf-on-device.sh installs a stub package whose functions raise, and this benchmark passes
  --ds.attn_implementation sdpa without packing (train_ppo_ray.py resets attn_implementation to flash_attention_2
  whenever --ds.packing_samples is on). wandb is imported only with --logger.wandb.key.
- Pins (METADATA): vllm==0.29.0 (extra), ray[default]==2.55.0, deepspeed==0.19.6, transformers==5.15.0,
  flash-attn==2.8.3. vLLM 0.29.0 pins torch==2.13.0; the GPU machine has torch 2.11.0 (and one call carries 64 MiB),
  so OpenRLHF runs on the vLLM we carry, 0.26.0 (the newest pinning torch 2.11.0), whose API has every call OpenRLHF
  makes (AsyncLLM sleep / wake_up(tags) / pause_generation(mode=) / collective_rpc / reset_prefix_cache,
  worker_extension_cls, logprobs_mode, StatelessProcessGroup, PyNcclCommunicator), checked in the 0.26.0 wheel's
  sources. Ray 2.60.0, DeepSpeed 0.19.8, transformers 5.17 (the device's) stand for the pinned 2.55.0 / 0.19.6 / 5.15.0.
- Hybrid engine on one GPU (0.11's dotted flags; the flat ones of 0.10 are gone): --train.colocate_all
  --vllm.num_engines 1 --vllm.tensor_parallel_size 1 --vllm.gpu_memory_utilization G --vllm.enable_sleep
  --ds.enable_sleep and every role's --X.num_nodes 1 --X.num_gpus_per_node 1 (defaults are 8): one placement-group
  bundle {GPU: 1}, the policy actor and the vLLM engine actor at 0.2 GPU each in it, weights synced by CUDA IPC
  (--vllm.sync_backend nccl + colocate_all). GRPO: --algo.advantage.estimator group_norm, --algo.kl.init_coef 0 (no
  reference model is built then), --rollout.n_samples_per_prompt 8; no critic for group_norm.
- Reward: --reward.remote_url FILE.py loads FILE's ``reward_func(queries, prompts, labels)`` inside the vLLM engine
  actor (SingleTurnAgentExecutor), one call per sample, returning {"rewards", "scores", "extra_logs"}.
- Per-step time: the trainer logs ``✨ Global step N: {...}`` with timing/generation, timing/make_experience,
  timing/ppo_train, timing/broadcast and timing/step_total (their sum: one step without the logging); this benchmark
  parses that line from the driver's output (Ray forwards the PPOTrainer actor's log) and takes timing/step_total.
- Blockers found: none left on paper (flash-attn: the stub; vLLM 0.29: 0.26.0 instead). Not yet seen run: OpenRLHF on
  vLLM 0.26.0 / Ray 2.60 / DeepSpeed 0.19.8 on the GPU. Checked here on CPU: its import with the carried packages and
  the stub, its own parser and checks on this command line (--dry_run), its Actor's sdpa forward and backward on a tiny
  model (transformers 5.19), and the reward file's forced lengths and records through its SingleTurnAgentExecutor.
- The GPU machine, 6 calls back to back (details: scripts/device/openrlhf-on-device.sh's header). Here first:
  ``DS_BUILD_PY=/work/main/.venv/bin/python bash scripts/device/vllm-loop-on-device.sh prepare`` and
  ``bash scripts/device/openrlhf-on-device.sh prepare``. Then (N = vllm-loop's last folder, 3 as of 2026-12-07):
    1. carry [".vcarry1"]: mkdir -p /tmp/vparts && cp .vcarry1/* /tmp/vparts/
    2. carry [".vcarry2"]: mkdir -p /tmp/vparts && cp .vcarry2/* /tmp/vparts/
    3. carry [".vcarry-ray", ".vcarry-orlhf"]: mkdir -p /tmp/vparts-ray /tmp/vparts-orlhf &&
       cp .vcarry-ray/* /tmp/vparts-ray/ && cp .vcarry-orlhf/* /tmp/vparts-orlhf/
    4. carry [".vcarry3"]: source .vcarry3/vllm-loop-on-device.sh install &&
       source /tmp/vparts-orlhf/openrlhf-on-device.sh install && python3 benchmarks/grpo_vs_openrlhf.py --dry_run
       --openrlhf_pythonpath /tmp/site-orlhf --workdir /tmp/orlhf-work
    5. no carry: source /tmp/vllm-loop-on-device.sh env && python3 benchmarks/grpo_vs_openrlhf.py --sides openrlhf
       --openrlhf_pythonpath /tmp/site-orlhf --workdir /tmp/orlhf-work --out /tmp/orlhf.json 2>&1 | tail -150
    6. no carry: source /tmp/vllm-loop-on-device.sh env && python3 benchmarks/grpo_vs_openrlhf.py --sides ours
       --load /tmp/orlhf.json --workdir /tmp/orlhf-work --out /tmp/both.json 2>&1 | tail -150

The run (defaults): a random Llama of Qwen2.5-0.5B's real shape (vocabulary 151,936, tied embeddings; grpo_vs_trl.py's
``--shape qwen2.5-0.5b``, written once under --workdir), bf16, 16 prompts (varied lengths: a filler of 8-256 characters)
x 8 samples, generated lengths drawn per request (log-normal, median max_new_tokens / 4, 64..max_new_tokens) and forced
on both sides (ignore_eos, max_tokens = the draw: both train on the same tokens), GRPO (group_norm), no KL, one
optimizer step per batch (micro-batches of 16 rows on OpenRLHF's side, gradient accumulation up to 128), AdamW lr 1e-6
constant, betas (0.9, 0.95), clip 1.0, temperature 1.0. The helpers (prompts, lengths, reward, our side's process) are
grpo_vs_trl.py's, imported.

- ours: grpo_vs_trl.py's ours side as is (``rl ppo``'s build_run with LocalFactory: DeepSpeed policy and VLLMEngine in
  one process, at rl ppo's defaults: ZeRO auto, packing, token-budget micro-batches, liger and the fused LM head where
  rl ppo turns them on, vLLM at EngineConfig's gpu_memory_utilization 0.5, no sleep), in a spawned process alone on the
  GPU. Seconds per step: the trainer's iteration_s.
- OpenRLHF: a subprocess running ``openrlhf.cli.train_ppo_ray`` under a launcher (written to --workdir) that first calls
  ``ray.init(num_gpus=1, include_dashboard=False)`` (a local head on the one GPU; train_ppo_ray skips its own ray.init
  then), with the hybrid-engine flags above, --ds.attn_implementation sdpa, --ds.zero_stage 2 (its default), sleep on
  (its hybrid-engine setting; --no-openrlhf_sleep turns it off), the same --vllm.gpu_memory_utilization as ours. The
  reward file (written to --workdir) holds the letter reward and, loaded in the engine actor, wraps
  SingleTurnAgentExecutor.execute to force each request's length and log its prompt / response token counts and the
  engine's vLLM settings (the same keys as ours) to a JSONL file the report reads.

The sides run one after the other (ours, then OpenRLHF), each alone on the GPU; the first --warmup steps of each are
left out. A side that fails prints its last lines and the other is still reported. Prints per-step seconds, the ratio
ours / OpenRLHF, each side's breakdown, the tokens per step (checked against the draws) and every setting that differs.
"""

from __future__ import annotations

import argparse
import ast
import collections
import json
import multiprocessing as mp
import os
import queue
import re
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import grpo_vs_trl as gt

SIDES = ("ours", "openrlhf")
BENCH_DIR = Path(__file__).resolve().parent
STEP_MARK = "Global step "
OPENRLHF_TIMINGS = ("generation", "make_experience", "ppo_train", "broadcast")
# what --load checks against the file's run: the settings both sides share
AFTER_LAST_STEP_S = 90.0  # OpenRLHF saves the model after its last step, then Ray shuts down: then it is stopped
RUN_KEYS = (
    "shape",
    "model",
    "steps",
    "warmup",
    "prompts",
    "samples",
    "max_new_tokens",
    "lengths",
    "prompt_lengths",
    "micro_batch",
    "learning_rate",
    "seed",
    "vllm_gpu_memory_utilization",
)

# Loaded by OpenRLHF's SingleTurnAgentExecutor inside the vLLM engine actor (--reward.remote_url FILE.py).
REWARD_FILE = '''"""Written by benchmarks/grpo_vs_openrlhf.py: the letter reward and, for the benchmark, forced generation lengths."""
import copy
import json
import sys
import threading
import time
import types

sys.path.insert(0, {bench_dir!r})
import grpo_vs_trl as gt  # noqa: E402
from openrlhf.utils import agent as _agent  # noqa: E402

SEED, SAMPLES, MAX_NEW_TOKENS, LENGTHS, LOG = {seed!r}, {samples!r}, {max_new_tokens!r}, {lengths!r}, {log!r}
_lock, _count, _engine_logged = threading.Lock(), {{}}, []
_execute = _agent.SingleTurnAgentExecutor.execute


def _log(record):
    with _lock, open(LOG, "a") as f:
        f.write(json.dumps(record) + "\\n")


async def _forced_execute(self, prompt, label, sampling_params, max_length, hf_tokenizer, llm_engine, images=None):
    p = gt.prompt_index(prompt)
    with _lock:  # the k-th request of prompt p overall: sample k % SAMPLES of step k // SAMPLES
        k = _count.get(p, 0)
        _count[p] = k + 1
    step, sample = divmod(k, SAMPLES)
    params = copy.deepcopy(sampling_params)
    params.ignore_eos, params.stop_token_ids = True, []
    params.max_tokens = (gt.response_length(SEED, p, sample, step, MAX_NEW_TOKENS) if LENGTHS == "varied"
                         else MAX_NEW_TOKENS)
    t0 = time.time()
    out = await _execute(self, prompt, label, params, max_length, hf_tokenizer, llm_engine, images)
    start, end = out["action_ranges"][0]
    _log({{"step": step, "prompt": p, "sample": sample, "asked": params.max_tokens, "prompt_tokens": start,
          "response_tokens": end - start, "t0": t0, "t1": time.time()}})
    if not _engine_logged:
        _engine_logged.append(True)
        try:
            _log({{"engine": gt.vllm_settings(types.SimpleNamespace(llm_engine=llm_engine.llm))}})
        except Exception as e:  # noqa: BLE001 - the settings are for the report only
            _log({{"engine": {{"error": repr(e)}}}})
    return out


_agent.SingleTurnAgentExecutor.execute = _forced_execute


def reward_func(queries, prompts, labels):
    """OpenRLHF's reward_func: queries are prompt + response; the benchmark's letter reward on the response."""
    out = []
    for q, p, y in zip(queries, prompts, labels):
        out.append(gt.letter_reward(p, q[len(p):] if q.startswith(p) else q, y))
    r = sum(out) / max(len(out), 1)
    return {{"rewards": r, "scores": r, "extra_logs": {{}}}}
'''

# Runs OpenRLHF's CLI after starting a local Ray head on the one GPU (train_ppo_ray then skips its own ray.init).
# --parse_only: OpenRLHF's own parser and checks on the command line, printed, then exit (no Ray, no GPU).
LAUNCH_FILE = '''"""Written by benchmarks/grpo_vs_openrlhf.py: python -m openrlhf.cli.train_ppo_ray with a local Ray head first."""
import json
import os
import runpy
import sys


def _plain(obj):
    return {{k: _plain(v) for k, v in vars(obj).items()}} if hasattr(obj, "__dict__") else obj


def main():
    parse_only = sys.argv[1:2] == ["--parse_only"]
    argv = sys.argv[2:] if parse_only else sys.argv[1:]
    import ray

    if parse_only:
        import openrlhf.utils

        def show(args):
            print("OPENRLHF_PARSED " + json.dumps(_plain(args), default=str), flush=True)
            raise SystemExit(0)

        openrlhf.utils.get_strategy = show  # train() calls it first, after ray.is_initialized()
        ray.is_initialized = lambda: True
    else:
        ray.init(num_gpus={num_gpus}, include_dashboard=False)
    sys.argv = ["openrlhf.cli.train_ppo_ray", *argv]
    runpy.run_module("openrlhf.cli.train_ppo_ray", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
'''


def arg_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--sides",
        default="both",
        choices=("both", "ours", "openrlhf"),
        help="which sides run now (both: ours, then OpenRLHF); --load adds the others from a file",
    )
    ap.add_argument(
        "--load",
        action="append",
        default=[],
        help="an earlier --out file: the sides it holds that do not run now are reported from it (a 600 s "
        "device call may not hold both sides); its run settings must match these",
    )
    ap.add_argument(
        "--shape",
        default="qwen2.5-0.5b",
        choices=list(gt.SHAPES),
        help="the random model's shape (grpo_vs_trl.py's; default Qwen2.5-0.5B's with its vocabulary)",
    )
    ap.add_argument(
        "--model",
        default=None,
        help="a local HF model folder (default: build the random one of --shape under --workdir, once)",
    )
    ap.add_argument("--steps", type=int, default=5, help="measured steps per side (after the warm-up)")
    ap.add_argument("--warmup", type=int, default=1, help="first steps of each side left out")
    ap.add_argument("--prompts", type=int, default=16, help="prompts per step (OpenRLHF --rollout.batch_size)")
    ap.add_argument("--samples", type=int, default=8, help="samples per prompt (--rollout.n_samples_per_prompt)")
    ap.add_argument("--max_new_tokens", type=int, default=128, help="the longest generated length")
    ap.add_argument(
        "--lengths",
        default="varied",
        choices=("full", "varied"),
        help="full: every sample max_new_tokens long; varied: grpo_vs_trl.py's per-request draws",
    )
    ap.add_argument(
        "--prompt_lengths",
        default="varied",
        choices=("fixed", "varied"),
        help="varied: grpo_vs_trl.py's 8-256 character filler before each prompt's instruction",
    )
    ap.add_argument(
        "--micro_batch",
        type=int,
        default=16,
        help="rows per forward: OpenRLHF's --train.micro_batch_size and --rollout.micro_batch_size (ours "
        "sizes its micro-batches itself, as rl ppo does)",
    )
    ap.add_argument("--learning_rate", type=float, default=1e-6)
    ap.add_argument("--seed", type=int, default=42)
    ap.add_argument(
        "--vllm_gpu_memory_utilization",
        type=float,
        default=None,
        help="both sides' vLLM share of the GPU (default: rl ppo's, EngineConfig's 0.5)",
    )
    ap.add_argument(
        "--openrlhf_sleep",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="OpenRLHF: --vllm.enable_sleep --ds.enable_sleep (its hybrid engine's setting: vLLM sleeps "
        "while DeepSpeed trains, DeepSpeed offloads its states while vLLM generates)",
    )
    ap.add_argument("--openrlhf_zero_stage", type=int, default=2, help="OpenRLHF: --ds.zero_stage (its default 2)")
    ap.add_argument(
        "--openrlhf_attn",
        default="sdpa",
        help="OpenRLHF: --ds.attn_implementation (its default flash_attention_2 needs flash-attn, which "
        "the GPU machine lacks)",
    )
    ap.add_argument(
        "--openrlhf_extra",
        default="",
        help="more OpenRLHF flags, appended as given (shell-quoted string), e.g. '--vllm.enforce_eager'",
    )
    ap.add_argument(
        "--openrlhf_pythonpath",
        default="",
        help="prepended to PYTHONPATH for OpenRLHF's process only (the device: /tmp/site-orlhf, where "
        "scripts/device/openrlhf-on-device.sh installs OpenRLHF and its flash_attn stub)",
    )
    ap.add_argument(
        "--side_timeout",
        type=float,
        default=540.0,
        help="seconds OpenRLHF's run (start, steps, save) may take before it is stopped; ours: seconds "
        "per step or start-up",
    )
    ap.add_argument(
        "--workdir",
        default=None,
        help="model, prompts, the OpenRLHF files and logs (default: a temp folder, removed at the end)",
    )
    ap.add_argument(
        "--dry_run",
        action="store_true",
        help="write the model, prompts and OpenRLHF's files, print both command lines and, where OpenRLHF "
        "imports (--openrlhf_pythonpath), its own parse of its command line; run nothing",
    )
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    return ap


def resolve(a: argparse.Namespace) -> argparse.Namespace:
    if a.samples < 2:
        sys.exit(f"--samples {a.samples}: must be >= 2 (GRPO's group baseline)")
    if not 1 <= a.prompts <= len(gt.LETTERS):
        sys.exit(f"--prompts {a.prompts}: must be 1 to {len(gt.LETTERS)} (one prompt per letter)")
    if a.micro_batch < 1 or (a.prompts * a.samples) % a.micro_batch:
        sys.exit(f"--micro_batch {a.micro_batch} must divide prompts x samples = {a.prompts * a.samples}")
    if a.vllm_gpu_memory_utilization is None:
        from rl_rollout import EngineConfig  # lazy: rl ppo's default, read where it is defined

        a.vllm_gpu_memory_utilization = EngineConfig().gpu_memory_utilization
    if not 0 < a.vllm_gpu_memory_utilization <= 1:
        sys.exit(f"--vllm_gpu_memory_utilization {a.vllm_gpu_memory_utilization}: must be in (0, 1]")
    bad = {"--ds.packing_samples": "packing resets --ds.attn_implementation to flash_attention_2 (no flash-attn here)"}
    for flag, why in bad.items():
        if flag in shlex.split(a.openrlhf_extra) and a.openrlhf_attn != "flash_attention_2":
            sys.exit(
                f"--openrlhf_extra {flag}: {why}; drop it, or pass --openrlhf_attn flash_attention_2 where "
                "flash-attn is installed"
            )
    return a


# ----- the files both sides read ----------------------------------------------------------------------------------


def write_inputs(a: argparse.Namespace, work: Path) -> dict[str, str]:
    """The model (grpo_vs_trl.py's random one, once), the prompts, OpenRLHF's reward and launcher files."""
    s = gt.SHAPES[a.shape]
    model = a.model
    if model is None:
        from rl_rollout.testing import make_tiny_model  # lazy: torch + transformers, only once the flags are good

        name = (
            f"llama_h{s['hidden_size']}_l{s['num_layers']}_a{s['num_heads']}_kv{s['num_kv_heads']}_i"
            f"{s['intermediate_size']}_p{s['max_position_embeddings']}_v{s['vocab_size']}_bf16"
        )
        model = str(
            make_tiny_model(
                work / name,
                hidden_size=s["hidden_size"],
                num_layers=s["num_layers"],
                vocab_size=s["vocab_size"],
                num_heads=s["num_heads"],
                num_kv_heads=s["num_kv_heads"],
                intermediate_size=s["intermediate_size"],
                seed=a.seed,
                max_position_embeddings=s["max_position_embeddings"],
                dtype="bfloat16",
            )
        )
    prompts = work / "prompts.jsonl"
    prompts.write_text(
        "".join(
            json.dumps({"prompt": gt.prompt_text(i, a.prompt_lengths == "varied", a.seed), "label": x}) + "\n"
            for i, x in enumerate(gt.LETTERS[: a.prompts])
        )
    )
    requests = work / "openrlhf_requests.jsonl"
    reward = work / "openrlhf_reward.py"
    reward.write_text(
        REWARD_FILE.format(
            bench_dir=str(BENCH_DIR),
            seed=a.seed,
            samples=a.samples,
            max_new_tokens=a.max_new_tokens,
            lengths=a.lengths,
            log=str(requests),
        )
    )
    launch = work / "openrlhf_launch.py"
    launch.write_text(LAUNCH_FILE.format(num_gpus=1))
    return {
        "model": model,
        "prompts": str(prompts),
        "reward": str(reward),
        "launch": str(launch),
        "requests": str(requests),
        "log": str(work / "openrlhf.log"),
        "out_dir": str(work / "openrlhf_out"),
    }


def ours_config(a: argparse.Namespace, files: dict[str, str]) -> dict:
    """grpo_vs_trl.py's config of its ours side (its parser and checks), alone on the GPU: no memory cap."""
    argv = [
        "--device",
        "cuda",
        "--rollout_engine",
        "vllm",
        "--shape",
        a.shape,
        "--model",
        files["model"],
        "--steps",
        str(a.steps),
        "--warmup",
        str(a.warmup),
        "--prompts",
        str(a.prompts),
        "--samples",
        str(a.samples),
        "--max_new_tokens",
        str(a.max_new_tokens),
        "--lengths",
        a.lengths,
        "--prompt_lengths",
        a.prompt_lengths,
        "--micro_batch",
        str(a.micro_batch),
        "--learning_rate",
        str(a.learning_rate),
        "--seed",
        str(a.seed),
        "--vllm_gpu_memory_utilization",
        str(a.vllm_gpu_memory_utilization),
        "--memory_share",
        "1.0",
        "--step_timeout",
        str(a.side_timeout),
    ]
    ga = gt.resolve_args(gt.arg_parser().parse_args(argv))
    return {**vars(ga), "prompt_file": files["prompts"], "argv": argv}


def openrlhf_args(a: argparse.Namespace, files: dict[str, str]) -> list[str]:
    """train_ppo_ray's flags (0.11 dotted names) for the same run, hybrid engine on one GPU."""
    n = a.prompts * a.samples
    roles = [f"--{r}.{k}" for r in ("actor", "ref", "critic", "reward") for k in ("num_nodes", "num_gpus_per_node")]
    args = [x for flag in roles for x in (flag, "1")]
    args += [
        "--actor.model_name_or_path",
        files["model"],
        "--data.prompt_dataset",
        files["prompts"],
        "--data.input_key",
        "prompt",
        "--data.label_key",
        "label",
        "--data.max_samples",
        str(a.prompts),
        "--data.max_len",
        str(1024 + a.max_new_tokens),
        "--reward.remote_url",
        files["reward"],
        "--train.colocate_all",
        "--vllm.num_engines",
        "1",
        "--vllm.tensor_parallel_size",
        "1",
        "--vllm.gpu_memory_utilization",
        str(a.vllm_gpu_memory_utilization),
        *(["--vllm.enable_sleep", "--ds.enable_sleep"] if a.openrlhf_sleep else []),
        "--algo.advantage.estimator",
        "group_norm",
        "--algo.kl.init_coef",
        "0",
        "--rollout.batch_size",
        str(a.prompts),
        "--rollout.n_samples_per_prompt",
        str(a.samples),
        "--rollout.max_new_tokens",
        str(a.max_new_tokens),
        "--rollout.temperature",
        "1.0",
        "--rollout.top_p",
        "1.0",
        "--rollout.micro_batch_size",
        str(a.micro_batch),
        "--train.batch_size",
        str(n),
        "--train.micro_batch_size",
        str(a.micro_batch),
        "--train.max_epochs",
        "1",
        "--train.num_episodes",
        str(a.warmup + a.steps),
        "--train.seed",
        str(a.seed),
        "--actor.adam.lr",
        str(a.learning_rate),
        "--actor.adam.betas",
        "0.9",
        "0.95",
        "--actor.adam.weight_decay",
        "0",
        "--actor.lr_scheduler",
        "constant",
        "--actor.lr_warmup_ratio",
        "0",
        "--actor.max_norm",
        "1.0",
        "--ds.zero_stage",
        str(a.openrlhf_zero_stage),
        "--ds.param_dtype",
        "bf16",
        "--ds.attn_implementation",
        a.openrlhf_attn,
        "--ckpt.output_dir",
        files["out_dir"],
        "--ckpt.path",
        files["out_dir"] + "/ckpt",
        "--ckpt.save_steps",
        "-1",
        "--logger.logging_steps",
        "1",
        "--eval.steps",
        "-1",
    ]
    return args + shlex.split(a.openrlhf_extra)


def openrlhf_env(a: argparse.Namespace) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    }
    if a.openrlhf_pythonpath:
        env["PYTHONPATH"] = a.openrlhf_pythonpath + (":" + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    # what train_ppo_ray's own ray.init puts in its runtime_env (the workers inherit the driver's environment)
    env.setdefault("TOKENIZERS_PARALLELISM", "true")
    env.setdefault("NCCL_DEBUG", "WARN")
    env.setdefault("RAY_ENABLE_ZERO_COPY_TORCH_TENSORS", "1")
    env.setdefault("PYTHONUNBUFFERED", "1")
    env.setdefault("RAY_DEDUP_LOGS", "0")  # the step lines are parsed: Ray must not fold look-alike lines
    # OpenRLHF's DeepSpeed Adam is FusedAdam, JIT-built at the first step; DeepSpeed 0.19.8's op builder parses
    # TORCH_CUDA_ARCH_LIST as numbers and fails on Hopper's "9.0a" (set by the vLLM carry): "invalid literal for
    # int() with base 10: '0a'" (seen on the H100, 2026-12-07). The plain architecture builds the same kernel.
    if arch := env.get("TORCH_CUDA_ARCH_LIST"):
        env["TORCH_CUDA_ARCH_LIST"] = re.sub(r"(\d+\.\d+)a\b", r"\1", arch)
    return env


# ----- the two sides ------------------------------------------------------------------------------------------------


def run_ours(cfg: dict) -> dict:
    """grpo_vs_trl.py's ours side in a spawned process, its steps back to back."""
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=gt._child, args=("ours", child, cfg), name="grpo-ours")
    records: list[dict] = []
    t0 = time.perf_counter()
    proc.start()
    child.close()
    try:
        _, ready = gt._recv("ours", proc, parent, cfg["step_timeout"])
        print(f"[grpo_vs_openrlhf] ours ready in {time.perf_counter() - t0:.1f} s: {ready}", flush=True)
        for i in range(cfg["warmup"] + cfg["steps"]):
            parent.send("go")
            kind, rec = gt._recv("ours", proc, parent, cfg["step_timeout"])
            if kind != "step":
                raise RuntimeError(f"ours: ended after {len(records)} steps, expected {cfg['warmup'] + cfg['steps']}")
            records.append(rec)
            print(
                f"[grpo_vs_openrlhf] ours step {i + 1}{' (warm-up)' if i < cfg['warmup'] else ''}: "
                f"{rec['step_s']:.3f} s, {rec['generated_tokens']} tokens",
                flush=True,
            )
        parent.send("stop")
        gt._recv("ours", proc, parent, cfg["step_timeout"])
        proc.join(60)
        return {"ok": True, "records": records, "ready": ready}
    except (RuntimeError, TimeoutError) as e:
        return {"ok": False, "records": records, "error": str(e)}
    finally:
        if proc.is_alive():
            proc.terminate()
            proc.join(10)


def parse_step_line(line: str) -> dict | None:
    """OpenRLHF's ``✨ Global step N: {...}``: the step and its timing/* (and every other number) as floats."""
    at = line.find(STEP_MARK)
    if at < 0:
        return None
    m = re.match(r"(\d+): (\{.*\})\s*$", line[at + len(STEP_MARK) :])
    if m is None:
        return None
    try:
        status = ast.literal_eval(m.group(2))
    except (ValueError, SyntaxError):  # a value that is no literal (a tensor's repr): the numbers by pattern
        status = {k: float(v) for k, v in re.findall(r"'([^']+)': ([-+0-9.eE]+|nan|inf)", m.group(2))}
    return {"step": int(m.group(1)), **{k: float(v) for k, v in status.items() if isinstance(v, (int, float))}}


def run_openrlhf(a: argparse.Namespace, files: dict[str, str], cmd: list[str]) -> dict:
    """OpenRLHF's run as a subprocess: its log to files['log'], its step lines parsed as they come."""
    Path(files["requests"]).unlink(missing_ok=True)
    lines: queue.Queue = queue.Queue()
    tail: collections.deque = collections.deque(maxlen=60)
    steps: list[dict] = []
    t0 = time.perf_counter()
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        errors="replace",
        env=openrlhf_env(a),
        start_new_session=True,
        cwd=str(Path(files["log"]).parent),
    )

    def pump() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.put(line)
        lines.put(None)

    threading.Thread(target=pump, daemon=True).start()
    timed_out = False
    want = a.warmup + a.steps
    deadline = t0 + a.side_timeout
    with open(files["log"], "w") as log:
        while True:
            left = deadline - time.perf_counter()
            try:
                line = lines.get(timeout=max(left, 0.1))
            except queue.Empty:
                timed_out = True
                break
            if line is None:
                break
            log.write(line)
            tail.append(line.rstrip("\n"))
            rec = parse_step_line(line)
            if rec is not None:
                rec["arrived_s"] = time.perf_counter() - t0
                steps.append(rec)
                i = len(steps)
                print(
                    f"[grpo_vs_openrlhf] openrlhf step {rec['step']}{' (warm-up)' if i <= a.warmup else ''}: "
                    f"{rec.get('timing/step_total', float('nan')):.3f} s (timing/step_total), at "
                    f"{rec['arrived_s']:.1f} s",
                    flush=True,
                )
                if len(steps) == want:  # what is measured is in: its final save and shutdown get a grace period
                    deadline = min(deadline, time.perf_counter() + AFTER_LAST_STEP_S)
    if not timed_out:
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            pass
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(15)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        proc.wait()
    rc = proc.returncode
    requests, engine = read_requests(files["requests"])
    records = []
    for i, rec in enumerate(steps):
        mine = [r for r in requests if r["step"] == i]
        records.append(
            {
                "step_s": rec.get("timing/step_total", float("nan")),
                **{f"{k}_s": rec.get(f"timing/{k}", 0.0) for k in OPENRLHF_TIMINGS},
                "log_gap_s": rec["arrived_s"] - (steps[i - 1]["arrived_s"] if i else 0.0),
                "generated_tokens": sum(r["response_tokens"] for r in mine),
                "sequences": len(mine),
                "lengths": sorted(r["response_tokens"] for r in mine),
                "asked": sorted(r["asked"] for r in mine),
                "prompt_tokens": sorted({(r["prompt"], r["prompt_tokens"]) for r in mine}),
                "status": {k: v for k, v in rec.items() if k not in ("arrived_s",)},
            }
        )
    ok = len(records) >= want
    out = {
        "ok": ok,
        "records": records[:want],
        "rc": rc,
        "engine_config": engine,
        "wall_s": time.perf_counter() - t0,
        "log": files["log"],
    }
    if not ok:
        why = f"stopped after {a.side_timeout:.0f} s (--side_timeout)" if timed_out else f"exited with {rc}"
        out["error"] = (
            f"openrlhf: {why} after {len(records)} of {want} steps; its last lines ({files['log']}):\n"
            + "\n".join(tail)
        )
    return out


def read_requests(path: str) -> tuple[list[dict], dict]:
    requests, engine = [], {}
    if Path(path).exists():
        for line in Path(path).read_text().splitlines():
            rec = json.loads(line)
            if "engine" in rec:
                engine = rec["engine"]
            else:
                requests.append(rec)
    return requests, engine


# ----- the report ---------------------------------------------------------------------------------------------------


def summarize(side: dict, warmup: int, keys: tuple[str, ...]) -> dict:
    kept = side["records"][warmup:]
    steps = [r["step_s"] for r in kept]
    mean = statistics.fmean
    return {
        "step_s": steps,
        "warmup_step_s": [r["step_s"] for r in side["records"][:warmup]],
        "step_s_mean": mean(steps) if steps else None,
        "step_s_median": statistics.median(steps) if steps else None,
        "step_s_min": min(steps) if steps else None,
        "breakdown_mean": {k: mean([r.get(k, 0.0) for r in kept]) for k in keys} if kept else {},
        "generated_tokens_per_step": mean([r["generated_tokens"] for r in kept]) if kept else None,
    }


def check_tokens(sides: dict, a: argparse.Namespace) -> str:
    n = a.warmup + a.steps
    expected = [
        sum(gt.step_lengths(a.seed, a.prompts, a.samples, i, a.max_new_tokens))
        if a.lengths == "varied"
        else a.prompts * a.samples * a.max_new_tokens
        for i in range(n)
    ]
    got = {s: [r["generated_tokens"] for r in sides[s]["records"]] for s in SIDES if sides[s].get("ok")}
    lens = {s: [r.get("lengths") for r in sides[s]["records"]] for s in got}
    if all(v == expected for v in got.values()) and (len(lens) < 2 or lens["ours"] == lens["openrlhf"]):
        return (
            f"generated tokens per step as asked ({a.lengths} lengths) on {' and '.join(got) or 'no side'}: "
            f"{expected}" + (", the same per-request lengths on both" if len(lens) == 2 else "")
        )
    return f"WARNING: generated tokens differ from the draws ({a.lengths} lengths): asked {expected}, got {got}"


def differing_settings(a: argparse.Namespace, sides: dict) -> list[tuple[str, str, str]]:
    """(setting, ours, OpenRLHF) for everything that is not the same on both sides."""
    ready = sides["ours"].get("ready", {})
    auto = "; ".join(ready.get("auto", [])) or "(rl ppo's auto choices: see its banner)"
    rows = [
        (
            "processes",
            "one (rl ppo: DeepSpeed policy + vLLM engine in-process, the reward in-process)",
            "Ray: driver + PPOTrainer + policy actor + vLLM engine actor (0.2 GPU each in one {GPU: 1} bundle)",
        ),
        (
            "ZeRO stage / packing / micro-batches / kernels",
            f"rl ppo's auto: {auto}",
            f"ZeRO-{a.openrlhf_zero_stage}, no packing (needs flash-attn), {a.micro_batch} rows per micro-batch, "
            f"attention {a.openrlhf_attn}, no liger, full logits",
        ),
        (
            "vLLM sleep while training",
            "off (rl ppo's default)",
            "on: vLLM sleep(level 1) + DeepSpeed offload_states / reload_states" if a.openrlhf_sleep else "off",
        ),
        (
            "weight sync",
            "in memory: each parameter to the engine's load_weights",
            "CUDA IPC handles per parameter (--vllm.sync_backend nccl + colocate_all), vLLM woken for weights first"
            if a.openrlhf_sleep
            else "CUDA IPC handles per parameter (--vllm.sync_backend nccl + colocate_all)",
        ),
        (
            "old log-probs forward",
            "?" if not ready else "skipped (on-policy)" if ready.get("on_policy") else "computed",
            "computed (make_experience runs the actor's forward)",
        ),
        ("reward", "in-process RewardRunner, per batch", "reward_func in the engine actor, one thread call per sample"),
        (
            "versions",
            "rl (this repo)",
            "OpenRLHF 0.11.2 on vLLM 0.26.0 (pins 0.29.0), Ray 2.60.0 (2.55.0), "
            "DeepSpeed 0.19.8 (0.19.6), transformers of the machine (5.15.0)",
        ),
    ]
    eo = ready.get("engine_config", {})
    er = sides["openrlhf"].get("engine_config", {})
    for k in sorted(set(eo) | set(er)):
        if k.startswith("vllm_") and eo.get(k) != er.get(k):
            rows.append((k, str(eo.get(k, "?")), str(er.get(k, "?"))))
    return rows


def report(a: argparse.Namespace, sides: dict) -> dict:
    keys = {
        "ours": ("generate_s", "reward_s", "experience_s", "policy_train_s", "sync_s"),
        "openrlhf": tuple(f"{k}_s" for k in OPENRLHF_TIMINGS),
    }
    summary = {s: summarize(sides[s], a.warmup, keys[s]) for s in SIDES if sides[s].get("records")}
    print(
        f"\n== GRPO on one GPU, {a.shape}, {a.prompts} prompts ({a.prompt_lengths} length) x {a.samples} samples x "
        f"{a.lengths} lengths up to {a.max_new_tokens} new tokens, bf16, vLLM at {a.vllm_gpu_memory_utilization} "
        f"of the GPU on both =="
    )
    for s in SIDES:
        if not sides[s].get("ok"):
            print(f"{s}: FAILED" if "error" in sides[s] else f"{s}: not run (--sides / --load)")
            if "error" in sides[s]:
                print("\n".join(sides[s]["error"].splitlines()[-40:]))
    print(f"{'':28s}{'ours':>10s}{'OpenRLHF':>10s}")
    for label, key in (
        ("seconds per step, mean", "step_s_mean"),
        ("seconds per step, median", "step_s_median"),
        ("seconds per step, min", "step_s_min"),
        ("generated tokens per step", "generated_tokens_per_step"),
    ):
        vals = [summary.get(s, {}).get(key) for s in SIDES]
        print(f"{label:28s}" + "".join(f"{v:10.3f}" if v is not None else f"{'-':>10s}" for v in vals))
    o, r = summary.get("ours", {}).get("step_s_mean"), summary.get("openrlhf", {}).get("step_s_mean")
    if o and r:
        om, rm = summary["ours"]["step_s_median"], summary["openrlhf"]["step_s_median"]
        print(
            f"ratio ours / OpenRLHF: mean {o / r:.3f}, median {om / rm:.3f} (OpenRLHF's seconds: its "
            "timing/step_total; ours: the trainer's iteration_s)"
        )
    for s in SIDES:
        if s in summary:
            print(f"{s} per step: " + ", ".join(f"{k} {v:.3f}" for k, v in summary[s]["breakdown_mean"].items()))
            print(
                f"{s} steps (s): "
                + " ".join(f"{x:.2f}" for x in summary[s]["step_s"])
                + f"  (warm-up left out: {[round(x, 2) for x in summary[s]['warmup_step_s']]})"
            )
    rc = sides["openrlhf"].get("rc")
    if sides["openrlhf"].get("ok") and rc not in (0, None):
        print(
            f"openrlhf: all steps in, then stopped with exit code {rc} (its final save / Ray shutdown ran over "
            f"{AFTER_LAST_STEP_S:.0f} s, or failed: {sides['openrlhf'].get('log')})"
        )
    if sides["openrlhf"].get("records"):
        print(
            "openrlhf log-line gaps (s, the driver's clock): "
            + " ".join(f"{x['log_gap_s']:.2f}" for x in sides["openrlhf"]["records"])
        )
    print(check_tokens(sides, a))
    pt = {s: sorted({n for r in sides[s].get("records", [])[:1] for _, n in r.get("prompt_tokens", [])}) for s in SIDES}
    ours_pt = sides["ours"].get("ready", {}).get("prompt_tokens")
    if ours_pt and pt["openrlhf"] and sorted(set(ours_pt)) != pt["openrlhf"]:
        print(f"WARNING: the prompts tokenize differently: ours {sorted(ours_pt)}, OpenRLHF {pt['openrlhf']}")
    print("settings that differ (setting: ours | OpenRLHF):")
    for name, ours, theirs in differing_settings(a, sides):
        print(f"  {name}: {ours} | {theirs}")
    return summary


def main(argv: list[str] | None = None) -> int:
    a = resolve(arg_parser().parse_args(argv))
    tmp = None
    if a.workdir is None:
        tmp = tempfile.TemporaryDirectory(prefix="grpo_vs_openrlhf_")
        a.workdir = tmp.name
    work = Path(a.workdir)
    work.mkdir(parents=True, exist_ok=True)
    try:
        files = write_inputs(a, work)
        cfg = ours_config(a, files)
        cmd = [sys.executable, files["launch"], *openrlhf_args(a, files)]
        print("[grpo_vs_openrlhf] ours: grpo_vs_trl.py's ours side with: " + shlex.join(cfg["argv"]))
        print(
            "[grpo_vs_openrlhf] openrlhf: "
            + (f"PYTHONPATH={a.openrlhf_pythonpath}:$PYTHONPATH " if a.openrlhf_pythonpath else "")
            + shlex.join(cmd),
            flush=True,
        )
        if a.dry_run:
            return dry_run(a, files, cmd)
        sides: dict[str, dict] = {s: {} for s in SIDES}
        for path in a.load:
            loaded = json.loads(Path(path).read_text())
            differ = {
                k: (loaded["config"].get(k), getattr(a, k))
                for k in RUN_KEYS
                if loaded["config"].get(k) != getattr(a, k)
            }
            if differ:
                sys.exit(
                    f"--load {path}: its run differs from this one in {differ} (its value, this one's): pass the "
                    "same flags, or run both sides here"
                )
            for s in SIDES:
                if s in loaded.get("sides", {}) and a.sides not in ("both", s):
                    sides[s] = loaded["sides"][s]
                    print(f"[grpo_vs_openrlhf] {s}: {len(sides[s].get('records', []))} steps loaded from {path}")
        if a.sides in ("both", "ours"):
            sides["ours"] = run_ours(cfg)
        if a.sides in ("both", "openrlhf"):
            sides["openrlhf"] = run_openrlhf(a, files, cmd)
        summary = report(a, sides)
        if a.out:
            Path(a.out).parent.mkdir(parents=True, exist_ok=True)
            Path(a.out).write_text(
                json.dumps(
                    {
                        "config": {k: v for k, v in vars(a).items() if k != "workdir"},
                        "sides": sides,
                        "summary": summary,
                    },
                    indent=2,
                    default=str,
                )
                + "\n"
            )
            print(f"[grpo_vs_openrlhf] wrote {a.out}")
        ran = SIDES if a.sides == "both" else (a.sides,)
        return 0 if all(sides[s].get("ok") for s in ran) else 1
    finally:
        if tmp is not None:
            tmp.cleanup()


def dry_run(a: argparse.Namespace, files: dict[str, str], cmd: list[str]) -> int:
    """The files and command lines; OpenRLHF's own parser on its command line where it imports."""
    for k in ("model", "prompts", "reward", "launch"):
        print(f"[grpo_vs_openrlhf] {k}: {files[k]}")
    env = openrlhf_env(a)
    probe = subprocess.run(
        [sys.executable, "-c", "import importlib.util as u; print(u.find_spec('openrlhf') is not None)"],
        env=env,
        capture_output=True,
        text=True,
    )
    if probe.stdout.strip() != "True":
        print("[grpo_vs_openrlhf] openrlhf does not import here (--openrlhf_pythonpath): its parse is skipped")
        return 0
    t0 = time.perf_counter()
    p = subprocess.run([cmd[0], cmd[1], "--parse_only", *cmd[2:]], env=env, capture_output=True, text=True, timeout=600)
    parsed = next((line for line in p.stdout.splitlines() if line.startswith("OPENRLHF_PARSED ")), None)
    if p.returncode != 0 or parsed is None:
        print(
            f"[grpo_vs_openrlhf] OpenRLHF's parser refused the command line (exit {p.returncode}):\n"
            + "\n".join((p.stdout + p.stderr).splitlines()[-30:])
        )
        return 1
    args = json.loads(parsed.removeprefix("OPENRLHF_PARSED "))
    picks = {
        "train.colocate_all": args["train"]["colocate_all"],
        "vllm.enable_sleep": args["vllm"]["enable_sleep"],
        "ds.enable_sleep": args["ds"]["enable_sleep"],
        "ds.attn_implementation": args["ds"]["attn_implementation"],
        "ds.packing_samples": args["ds"]["packing_samples"],
        "ds.zero_stage": args["ds"]["zero_stage"],
        "algo.advantage.estimator": args["algo"]["advantage"]["estimator"],
        "critic.model_name_or_path": args["critic"]["model_name_or_path"],
        "reward.remote_url": args["reward"]["remote_url"],
        "rollout.vllm_generate_batch_size": args["rollout"]["vllm_generate_batch_size"],
        "actor.lr_scheduler": args["actor"]["lr_scheduler"],
    }
    print(
        f"[grpo_vs_openrlhf] OpenRLHF's parser accepts it ({time.perf_counter() - t0:.0f} s): "
        + ", ".join(f"{k} {v}" for k, v in picks.items())
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
