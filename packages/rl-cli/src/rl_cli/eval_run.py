"""``rl eval``'s runner: models in turn, each over every dataset, sampled by one rl-rollout engine in this process
(or, with ``--ray``, by engine actors on Ray: :mod:`rl_cli.eval_ray`) and scored by the run's reward scorer; every sample a JSON line, every (model, dataset) a metrics dict
(:class:`rl_rollout.evaluation.EvalTally`, :func:`~rl_rollout.evaluation.sample_record`: the code the RL loop's eval
pass tallies and writes its samples with).

Where a model comes from (:func:`resolve_model`): an HF folder (config.json and weights, checked by
:func:`rl_core.preflight.check_model`); a run's checkpoint ``iter_N/`` (or ``best_iter_N/``) holding the HF export
``hf/`` that ``--save_hf_ckpt`` writes; a ``--ckpt_path`` folder, whose newest complete checkpoint with ``hf/`` is
taken; a hub id in the local HF cache. A checkpoint without ``hf/`` holds only DeepSpeed state, which no engine
loads: refused, with the fix.

Seeds: every request carries its own seed (``seed + 1000003 x dataset index + prompt index``), so a prompt's n
samples do not depend on how prompts are batched, and every model is sampled with the same seeds.
"""

from __future__ import annotations

import importlib.util
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rl_cli.errors import UserError
from rl_cli.eval_config import EvalRunConfig
from rl_core.data import DataConfig, DataError, PromptDataset, load_rows
from rl_core.preflight import check_model, load_tokenizer
from rl_core.rl.checkpoint import RLCheckpoints
from rl_rollout.config import EngineConfig
from rl_rollout.evaluation import EvalTally, answer_key, sample_record
from rl_rollout.types import RolloutRequest

DATASET_SEED_STRIDE = 1_000_003


@dataclass(frozen=True)
class ModelRef:
    """One model of the run: ``given`` (as typed), ``folder`` (what the engine loads), ``label`` (its column)."""

    given: str
    folder: str
    label: str


@dataclass(frozen=True)
class DataSet:
    """One ``--dataset`` file: ``name`` (its stem, the key of its metrics) and its rows."""

    name: str
    path: str
    rows: list


def resolve_model(given: str) -> str:
    """The HF folder an engine loads for ``given`` (see the module doc); UserError naming the value and the fix."""
    p = Path(given).expanduser()
    if p.is_dir() and not (p / "config.json").is_file():
        if (p / "hf" / "config.json").is_file():  # a checkpoint iter_N/ with its HF export
            p = p / "hf"
        elif any(p.glob("iter_*")) or any(p.glob("best_iter_*")):  # a --ckpt_path: its newest checkpoint's export
            with_hf = [d for d in RLCheckpoints(p).complete() if (d / "hf" / "config.json").is_file()]
            if not with_hf:
                raise UserError(
                    f"--model {given}: a checkpoint folder, but none of its checkpoints holds an HF export (hf/); "
                    f"DeepSpeed state alone is not loadable by an engine: train with --save_hf_ckpt, or pass the "
                    f"run's --save_path"
                )
            p = with_hf[-1] / "hf"
    elif not p.exists() and (given.startswith((".", "/", "~")) or given.count("/") != 1):
        raise UserError(f"--model {given}: no such folder; pass an HF model folder or a run's checkpoint folder")
    try:
        return check_model(str(p) if p.exists() else given, flag="--model")
    except (ValueError, FileNotFoundError) as e:
        raise UserError(str(e)) from None


def model_refs(models: list[str]) -> list[ModelRef]:
    """Every ``--model`` resolved, each with a unique column label (its folder name; ``#2`` ... on repeats)."""
    refs, seen = [], {}  # type: ignore[var-annotated]
    for m in models:
        folder = resolve_model(m)
        base = Path(m.rstrip("/")).name or m
        seen[base] = seen.get(base, 0) + 1
        refs.append(ModelRef(m, folder, base if seen[base] == 1 else f"{base}#{seen[base]}"))
    return refs


def load_sets(d: DataConfig) -> list[DataSet]:
    """Each comma-separated ``--dataset`` file as its own set, named by its stem; UserError on a missing or bad one."""
    paths = [p.strip() for p in (d.dataset or "").split(",") if p.strip()]
    if not paths:
        raise UserError("--dataset is required: one or more prompt files, e.g. --dataset a.jsonl,b.jsonl")
    out, seen = [], {}  # type: ignore[var-annotated]
    for path in paths:
        if not Path(path).expanduser().exists():
            raise UserError(f"--dataset {path}: no such file or folder; pass a .jsonl/.json/.parquet file that exists")
        try:
            rows = load_rows(str(Path(path).expanduser()), d.split, d.max_samples, skip_bad=d.skip_bad_rows)
        except DataError as e:
            raise UserError(f"--dataset {path}: {e}") from None
        if not rows:
            raise UserError(f"--dataset {path}: no rows; fix the file or drop it from --dataset")
        stem = Path(path.rstrip("/")).stem
        seen[stem] = seen.get(stem, 0) + 1
        out.append(DataSet(stem if seen[stem] == 1 else f"{stem}#{seen[stem]}", path, rows))
    return out


class Progress:
    """tqdm's bar when tqdm is installed, else a line on stderr every ~5% of the samples."""

    def __init__(self, total: int, desc: str):
        self.total, self.desc, self.done, self._shown = total, desc, 0, -1
        self._bar = None
        if importlib.util.find_spec("tqdm") is not None:
            # lazy: tqdm is optional (not a dependency); without it a plain line is printed instead
            from tqdm import tqdm

            self._bar = tqdm(total=total, desc=desc, unit="sample", file=sys.stderr, leave=True)

    def update(self, k: int) -> None:
        self.done += k
        if self._bar is not None:
            self._bar.update(k)
            return
        pct = 100 * self.done // max(self.total, 1)
        if pct // 5 != self._shown // 5 or self.done == self.total:
            self._shown = pct
            print(f"{self.desc}: {self.done}/{self.total} samples ({pct}%)", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


def device_and_dtype(cfg: EvalRunConfig) -> tuple[str, str]:
    # lazy: torch is heavy, and rl eval --help never needs it
    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = cfg.dtype if cfg.dtype != "auto" else ("bfloat16" if device == "cuda" else "float32")
    return device, dtype


def evaluate_model(
    ref: ModelRef,
    sets: list[DataSet],
    cfgs: dict,
    scorer,
    write: Callable[[dict], None],
) -> dict[str, dict[str, float]]:
    """``ref`` on every set: ``{dataset name: metrics}``; each sample goes to ``write`` as it is scored."""
    cfg: EvalRunConfig = cfgs["eval"]
    d: DataConfig = cfgs["data"]
    engine_cfg: EngineConfig = cfgs["rollout"]
    device, dtype = device_and_dtype(cfg)
    tok = load_tokenizer(
        ref.folder, flag="--model", use_fast=not d.disable_fast_tokenizer, chat_template=d.tokenizer_chat_template
    )
    eos = [t for t in {tok.eos_token_id} if t is not None]
    key = answer_key(cfgs["reward"].reward_fn)
    t0 = time.perf_counter()
    ray_cfg = cfgs.get("ray")
    if ray_cfg is not None and ray_cfg.ray:
        # lazy: Ray is only for --ray
        from rl_cli.eval_ray import RayEngines

        engine: Any = RayEngines(engine_cfg, ref.folder, n=ray_cfg.vllm_num_engines, dtype=dtype, seed=cfg.seed)
        kinds = [d["kind"] for d in engine.describe()]
        print(
            f"[rl eval] {ref.label}: {len(kinds)} engine actors on Ray ({', '.join(kinds)}, {dtype}), "
            f"{time.perf_counter() - t0:.1f} s"
        )
    else:
        engine = engine_cfg.make(ref.folder, dtype=dtype, seed=cfg.seed, device=device)
        print(f"[rl eval] {ref.label}: {type(engine).__name__} on {device} ({dtype}), {time.perf_counter() - t0:.1f} s")
    out: dict[str, dict[str, float]] = {}
    try:
        for d_index, ds in enumerate(sets):
            prompts = PromptDataset(ds.rows, tok, d)
            out[ds.name] = _one_set(ref, ds.name, d_index, prompts, engine, tok, eos, key, cfg, scorer, write)
    finally:
        per_engine = getattr(engine, "requests_per_engine", None)
        engine.shutdown()
    if per_engine is not None:
        print(f"[rl eval] {ref.label}: prompts per engine actor {per_engine}", flush=True)
    return out


def _chunks(n: int, size: int) -> Iterator[range]:
    for start in range(0, n, size):
        yield range(start, min(start + size, n))


def _one_set(ref, name, d_index, prompts, engine, tok, eos, key, cfg: EvalRunConfig, scorer, write):
    n = cfg.sampling.n_samples_per_prompt
    tally = EvalTally(key)
    progress = Progress(len(prompts) * n, f"[rl eval] {ref.label} / {name}")
    t0 = time.perf_counter()
    try:
        for chunk in _chunks(len(prompts), cfg.prompts_per_call):
            items = [prompts[i] for i in chunk]
            seeds = [cfg.seed + DATASET_SEED_STRIDE * d_index + i for i in chunk]
            requests = [
                RolloutRequest(
                    list(p["prompt_ids"]), cfg.sampling.params(stop_token_ids=eos, seed=seed, logprobs=False)
                )
                for p, seed in zip(items, seeds, strict=True)
            ]
            groups = engine.generate(requests)
            texts = [[tok.decode(s.response_ids, skip_special_tokens=True) for s in g] for g in groups]
            flat_texts = [t for g in texts for t in g]
            scores = scorer.score(
                [p["prompt"] for p in items for _ in range(n)],
                flat_texts,
                [p.get("label") for p in items for _ in range(n)],
            )
            for j, (i, p, g, tx, seed) in enumerate(zip(chunk, items, groups, texts, seeds, strict=True)):
                row_r = [float(r) for r in scores[j * n : (j + 1) * n]]
                row_a = tally.add(row_r, tx, g)
                for s_index, (s, t, r, a) in enumerate(zip(g, tx, row_r, row_a, strict=True)):
                    write(
                        sample_record(
                            s,
                            prompt=p,
                            prompt_index=i,
                            sample_index=s_index,
                            response=t,
                            reward=r,
                            answer=a,
                            threshold=cfg.correct_threshold,
                            seed=seed,
                            model=ref.label,
                            dataset=name,
                        )
                    )
            progress.update(len(items) * n)
    finally:
        progress.close()
    metrics = tally.metrics(cfg.ks, cfg.correct_threshold)
    metrics["seconds"] = time.perf_counter() - t0
    return metrics
