"""``rl eval``: evaluate models or checkpoints on prompt sets with a reward function, no training.

Models (``--model a,b``: HF folders, a run's checkpoints with their HF export, cached hub ids) are evaluated in
turn, each on every ``--dataset`` (comma-separated or repeated; each reported apart, named by its file stem),
``--n_samples_per_prompt`` samples per prompt drawn by one rl-rollout engine in this process
(``--rollout_engine``: transformers, or vLLM where it is installed), every prompt with the same seed for every
model, scored by ``--reward_fn`` / ``--remote_rm_url`` (the reward flags of ``rl ppo``). Per model and dataset:
pass@k (Chen et al. 2021's unbiased estimator) and maj@k for each k of ``--pass_k``, the mean reward, the mean
response length in tokens, the share of truncated responses (:mod:`rl_rollout.evaluation`, the code the loop's ``--eval_dataset`` pass reports with). Writes
``--output_dir``/samples.jsonl (one line per sample), summary.json and, with matplotlib, pass_at_k.png; prints
one table with a column per model. With ``--ray``, each generate call's prompts are spread over
``--vllm_num_engines`` engine actors on Ray, one GPU each (:mod:`rl_cli.eval_ray`); placement and tensor-parallel
flags of ``rl ppo-ray`` are refused.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from rl_cli import extensions
from rl_cli.config import build_parser
from rl_cli.dry_run import as_yaml
from rl_cli.errors import CliArgs, UserError, set_debug, user_errors
from rl_cli.eval_config import EvalRunConfig
from rl_cli.eval_ray import EvalRayConfig, start_ray, stop_ray
from rl_cli.eval_report import bar_chart, table, write_summary
from rl_cli.eval_run import evaluate_model, load_sets, model_refs
from rl_cli.loading import build, settings
from rl_core.data import DataConfig
from rl_rollout.config import EngineConfig, RewardConfig


def _groups() -> dict[str, type]:
    return {
        "eval": EvalRunConfig,
        "data": DataConfig,
        "reward": RewardConfig,
        "rollout": EngineConfig,
        "ray": EvalRayConfig,
        "cli": CliArgs,
    }


# Settings of the shared groups that an evaluation does not read: refused with the reason, never ignored.
UNUSED = {
    "output_key": "rl eval generates the responses: only --input_key (and --label_key) are read",
    "chosen_key": "preference keys are for rl dpo / rl rm / rl kto",
    "rejected_key": "preference keys are for rl dpo / rl rm / rl kto",
    "prompt_key": "preference keys are for rl dpo / rl rm / rl kto",
    "margin_key": "preference keys are for rl dpo / rl rm / rl kto",
    "desirable_key": "preference keys are for rl dpo / rl rm / rl kto",
    "eval_dataset": "every --dataset is evaluated: add the file to --dataset",
    "eval_split": "every --dataset is read at --split",
    "max_eval_samples": "use --max_samples (rows read from each --dataset)",
    "dataset_probs": "rl eval reports each --dataset apart and mixes none",
    "packing": "rl eval trains nothing",
    "image_key": "prompts with images are not built for rl eval; use rl ppo --eval_dataset",
    "enable_sleep": "rl eval's engine never sleeps (no training beside it)",
}
# Flags of rl ppo-ray (placement, tensor parallelism, the training roles) that rl eval does not build: refused,
# naming the fix. Its own Ray flags (--ray, --vllm_num_engines, --num_gpus: rl_cli.eval_ray) are taken.
RAY_OWN = ("ray", "ray.ray", "ray.vllm_num_engines", "ray.num_gpus")
RAY_FLAGS = (
    "actor_num_gpus_per_node",
    "colocate_all_models",
    "vllm_sync",
    "vllm_tensor_parallel_size",
    "placement_strategy",
)


def _refuse_ray(argv: list[str]) -> None:
    for a in argv:
        name = a[2:].split("=", 1)[0] if a.startswith("--") else ""
        if name in RAY_OWN:
            continue
        if name.startswith("ray") or name in RAY_FLAGS:
            raise UserError(
                f"--{name}: rl eval places one engine per GPU itself (--ray --vllm_num_engines N) and builds no "
                f"placement, tensor-parallel engines or training roles; drop the flag (for several GPUs per engine, "
                f"serve the model and score it with your own client)"
            )


def merge_datasets(argv: list[str]) -> list[str]:
    """Repeated ``--dataset`` (or ``--prompt_data``) flags as one comma-separated ``--dataset``."""
    out, found = [], []
    i = 0
    while i < len(argv):
        a = argv[i]
        name, eq, value = a.partition("=")
        if name in ("--dataset", "--prompt_data", "--data.dataset"):
            if eq:
                found.append(value)
            elif i + 1 < len(argv):
                found.append(argv[i + 1])
                i += 1
            else:
                out.append(a)  # argparse says what is missing
        else:
            out.append(a)
        i += 1
    return [*out, "--dataset", ",".join(found)] if found else out


def _refuse_unused(cfgs: dict, parser) -> None:
    for group, defaults in (("data", DataConfig()), ("rollout", EngineConfig())):
        for name, why in UNUSED.items():
            c = cfgs[group]
            if hasattr(c, name) and getattr(c, name) != getattr(defaults, name):
                shown = "vllm_enable_sleep" if name == "enable_sleep" else name
                parser.error(f"--{shown}: {why}; drop the flag")


@user_errors("rl eval")
def main(argv: list[str] | None = None) -> int:
    argv = merge_datasets(list(sys.argv[1:] if argv is None else argv))
    _refuse_ray(argv)
    groups = _groups()
    extensions.load(extensions.in_argv(argv))
    parser, flags = build_parser("rl eval", "rl eval: " + __doc__.splitlines()[0].split(": ", 1)[1], groups)
    args = parser.parse_args(argv)
    try:
        values = settings(groups, args, flags)
        extensions.load(values.get("cli.extension", ()))
        cfgs = build(groups, values, flags)
    except (ValueError, FileNotFoundError) as e:
        parser.error(str(e))
    _refuse_unused(cfgs, parser)
    set_debug(cfgs["cli"].debug)
    if getattr(args, "print_config", False):  # argument_default SUPPRESS: absent unless given
        print(as_yaml(cfgs), end="")
        return 0
    cfg: EvalRunConfig = cfgs["eval"]
    if not cfg.models:
        parser.error("--model is required: one or more HF model folders or checkpoints, comma-separated")
    if not cfg.output_dir:
        parser.error("--output_dir is required: where samples.jsonl and summary.json go")
    reward: RewardConfig = cfgs["reward"]
    if not reward.given:
        parser.error("a reward is required: --reward_fn (e.g. builtin:math, file.py:func) or --remote_rm_url URL")
    try:
        reward.check(label_key=cfgs["data"].label_key)
    except ValueError as e:
        raise UserError(str(e)) from None
    sets = load_sets(cfgs["data"])
    refs = model_refs(cfg.models)
    reward.check_sources()
    return run(cfgs, refs, sets)


def run(cfgs: dict, refs, sets) -> int:
    cfg: EvalRunConfig = cfgs["eval"]
    out = Path(cfg.output_dir or ".")
    out.mkdir(parents=True, exist_ok=True)
    n = cfg.sampling.n_samples_per_prompt
    print(
        f"[rl eval] {len(refs)} model(s) x {len(sets)} dataset(s) ({', '.join(f'{s.name}: {len(s.rows)} rows' for s in sets)}) "
        f"x {n} samples per prompt; pass@k/maj@k for k in {list(cfg.ks)}, correct at reward >= {cfg.correct_threshold}",
        flush=True,
    )
    scorer = cfgs["reward"].build()
    metrics: dict[str, dict[str, dict[str, float]]] = {}
    t0 = time.perf_counter()
    on_ray = cfgs["ray"].ray
    if on_ray:
        start_ray(cfgs["ray"])
    try:
        with (out / "samples.jsonl").open("w") as f:

            def write(row: dict) -> None:
                f.write(json.dumps(row) + "\n")

            for ref in refs:
                metrics[ref.label] = evaluate_model(ref, sets, cfgs, scorer, write)
                f.flush()
        failures = getattr(scorer, "counts", None)
    finally:
        close = getattr(scorer, "close", None)
        if callable(close):
            close()
        if on_ray:
            stop_ray()
    summary = {
        "models": {r.label: {"given": r.given, "folder": r.folder} for r in refs},
        "datasets": {s.name: s.path for s in sets},
        "n_samples_per_prompt": n,
        "pass_k": list(cfg.ks),
        "correct_threshold": cfg.correct_threshold,
        "seed": cfg.seed,
        "engine_actors": cfgs["ray"].vllm_num_engines if on_ray else None,
        "reward": {k: v for k, v in vars(cfgs["reward"]).items() if "token" not in k},
        "metrics": metrics,
        "reward_failures": getattr(failures, "failures", None),
        "seconds": time.perf_counter() - t0,
    }
    write_summary(out / "summary.json", summary)
    print(table(metrics), flush=True)
    why_not = bar_chart(metrics, cfg.ks, out / "pass_at_k.png")
    print(f"[rl eval] {why_not}" if why_not else f"[rl eval] chart: {out / 'pass_at_k.png'}", flush=True)
    print(f"[rl eval] samples: {out / 'samples.jsonl'}; summary: {out / 'summary.json'}", flush=True)
    return 0
