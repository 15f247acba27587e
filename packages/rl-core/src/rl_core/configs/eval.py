"""The RL loop's eval pass (``--eval_dataset``, :mod:`rl_core.trainers.ppo_eval`; its metrics are ``rl eval``'s,
:mod:`rl_rollout.evaluation`) and the best checkpoint it picks: the :class:`EvalConfig` node of :class:`~rl_core.trainers.ppo_config.PPOConfig` (``eval``). The eval set
itself is data (``--eval_dataset``); the run refuses eval settings without one."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from rl_rollout.config_fields import meta
from rl_rollout.evaluation import check_ks, metric_names, parse_ks

_OPENRLHF_PASS = re.compile(r"^eval_.+_pass(\d+)$")  # OpenRLHF's eval_{datasource}_pass{k}


def eval_ks(pass_k: str, n: int) -> tuple[int, ...]:
    """The k of the eval pass's pass@k / maj@k: ``--eval_pass_k`` (``1,4``), or when empty 1 and ``n``."""
    if not str(pass_k).strip():
        return tuple(sorted({1, n}))
    ks = parse_ks(pass_k, flag="--eval_pass_k")
    check_ks(ks, n, flag="--eval_pass_k", n_flag="--eval_n_samples_per_prompt")
    return ks


def eval_metric_names(n: int, ks: tuple[int, ...] | None = None) -> list[str]:
    """The ``eval/`` metrics of a pass with ``n`` samples per prompt and pass@k / maj@k for ``ks`` (default: 1
    and n), without the prefix: rl eval's per-dataset metrics (:func:`rl_rollout.evaluation.metric_names`) and the
    loop's own (failed reward calls, seconds, the weight version evaluated)."""
    shared = [m for m in metric_names(ks or eval_ks("", n)) if m != "reward_mean"]
    return ["reward_mean", *shared, "reward_failures", "seconds", "weight_version"]


def best_metric_name(key: str, n: int, ks: tuple[int, ...] | None = None) -> str | None:
    """``--best_metric_key`` as the logged ``eval/NAME`` (None: off). Empty: ``eval/reward_mean``, what
    OpenRLHF's auto choice (its first ``*_pass1``) is here; ``none``: off; OpenRLHF's ``eval_X_pass1`` /
    ``eval_X_passN`` name ``reward_mean`` (OpenRLHF's pass1 is the mean reward) / ``pass@N`` (one data source
    here). A name the pass never logs
    is a ValueError listing those it does."""
    if key == "none":
        return None
    name = key.removeprefix("eval/") or "reward_mean"
    if m := _OPENRLHF_PASS.match(name):
        name = "reward_mean" if m.group(1) == "1" else f"pass@{m.group(1)}"
    names = eval_metric_names(n, ks)
    if name not in names:
        raise ValueError(
            f"--best_metric_key {key!r}: the eval pass logs {', '.join('eval/' + x for x in names)} "
            f"(with --eval_n_samples_per_prompt {n}, --eval_pass_k {','.join(map(str, ks or eval_ks('', n)))}); pick one of them, or none to keep no best "
            f"checkpoint"
        )
    return "eval/" + name


def check_eval_set(steps: int, has_eval_set: bool) -> None:
    """Evaluating every ``steps`` steps needs an eval set (the one check of it, for every trainer)."""
    if steps > 0 and not has_eval_set:
        raise ValueError(
            f"--eval_steps {steps} needs --eval_dataset PATH (the rows to evaluate on), or drop --eval_steps"
        )


def check_eval_rows(rows: int, source: str | None = None) -> None:
    """An eval set that is given has rows (the one check of it: every trainer, the RL loop and rl-cli, which
    names the file as ``source``)."""
    if rows == 0:
        where = f" (--eval_dataset {source})" if source else ""
        raise ValueError(f"the eval set{where} has no usable rows; fix the file or drop --eval_dataset")


@dataclass(frozen=True)
class EvalConfig:
    """When the eval pass runs, how it samples, and which of its metrics picks the best checkpoint."""

    steps: int = field(
        default=-1,
        metadata=meta(
            "with --eval_dataset: evaluate every N iterations and after the last one (-1: only after the last one)",
            flags=("eval_steps",),
            openrlhf=("eval.steps",),
        ),
    )
    n_samples_per_prompt: int = field(
        default=4,
        metadata=meta(
            "samples per eval prompt (the n of eval/pass@k's unbiased estimator)",
            flags=("eval_n_samples_per_prompt",),
            openrlhf=("eval.n_samples_per_prompt",),
        ),
    )
    temperature: float = field(
        default=0.6,
        metadata=meta(
            "sampling temperature of the eval pass (0: greedy)",
            flags=("eval_temperature",),
            openrlhf=("eval.temperature",),
        ),
    )
    pass_k: str = field(
        default="",
        metadata=meta(
            "the k of eval/pass@k and eval/maj@k, comma-separated, each <= --eval_n_samples_per_prompt (as rl eval's "
            "--pass_k); empty: 1 and --eval_n_samples_per_prompt",
            flags=("eval_pass_k",),
        ),
    )
    correct_threshold: float = field(
        default=1.0,
        metadata=meta(
            "an eval sample is correct (for eval/pass@k, eval/maj@k, eval/correct) when its reward is >= this (as rl "
            "eval's --correct_threshold)",
            flags=("eval_correct_threshold",),
        ),
    )
    best_metric_key: str = field(
        default="",
        metadata=meta(
            "with --ckpt_path and --eval_dataset: keep the checkpoint of the best eval so far (higher is better) in "
            "best_iter_N/ beside the iter_N/ ones, replacing the previous best, never pruned; the key is an eval "
            "metric (reward_mean, pass@N, ...; eval/ prefix optional). Empty: eval/reward_mean (OpenRLHF's auto "
            "choice, its pass1); none: off",
            flags=("best_metric_key",),
            openrlhf=("ckpt.best_metric_key",),
        ),
    )

    def __post_init__(self) -> None:
        if self.steps == 0 or self.steps < -1:
            raise ValueError(
                f"eval_steps (--eval_steps) must be >= 1, or -1 to evaluate only after the last "
                f"iteration, got {self.steps}"
            )
        if self.n_samples_per_prompt < 1:
            raise ValueError(
                f"eval_n_samples_per_prompt (--eval_n_samples_per_prompt) must be >= 1, got {self.n_samples_per_prompt}"
            )
        if not self.temperature >= 0 or self.temperature == float("inf"):
            raise ValueError(
                f"eval_temperature (--eval_temperature) must be >= 0 (0: greedy) and finite, got {self.temperature}"
            )
        if self.correct_threshold != self.correct_threshold or abs(self.correct_threshold) == float("inf"):
            raise ValueError(
                f"eval_correct_threshold (--eval_correct_threshold) must be a finite number, got {self.correct_threshold}"
            )
        best_metric_name(self.best_metric_key, self.n_samples_per_prompt, self.ks)  # a metric never logged fails

    @property
    def ks(self) -> tuple[int, ...]:
        """The k of pass@k / maj@k (:func:`eval_ks`)."""
        return eval_ks(self.pass_k, self.n_samples_per_prompt)

    @property
    def best_metric(self) -> str | None:
        """The logged ``eval/NAME`` the best checkpoint follows (None: off)."""
        return best_metric_name(self.best_metric_key, self.n_samples_per_prompt, self.ks)
