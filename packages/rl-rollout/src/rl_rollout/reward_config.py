"""Typed settings of the rewards: :class:`RewardConfig` (reward functions and remote reward models, built into
one scorer by :meth:`RewardConfig.build`) and :class:`SummedRewards`, several scorers as one.

Re-exported by :mod:`rl_rollout.config`, where they were defined first (``from rl_rollout.config import
RewardConfig`` still works).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from rl_rollout.config_fields import check_numbers, meta
from rl_rollout.rewards import RewardRecord, RewardRunner, load_reward_fn, scorer_for_remote_rm_url
from rl_rollout.rewards.loading import load_openrlhf_reward_func
from rl_rollout.rewards.remote import RemoteRewardClient
from rl_rollout.rewards.runner import RewardCounts
from rl_rollout.rewards.verifiers import needs_label


@dataclass(frozen=True)
class RewardConfig:
    """Reward functions and remote reward models (a reward-model *role* is the trainer's business)."""

    reward_fn: str | None = field(
        default=None,
        metadata=meta("file.py:func | module:func | builtin:exact_match | builtin:math | builtin:format:REGEX"),
    )
    remote_rm_url: str | None = field(
        default=None,
        metadata=meta(
            "a reward server URL (ours, rl serve-rm, or OpenRLHF's .../get_reward; several: comma-separated) or, "
            "as in OpenRLHF, a .py file defining reward_func(queries, prompts, labels, **kwargs) (one call per batch, "
            "bounded by --reward_timeout)",
            openrlhf=("reward.remote_url",),
        ),
    )
    remote_rm_token: str | None = field(
        default=None, metadata=meta("bearer token for --remote_rm_url (default: env RL_REWARD_TOKEN)")
    )
    reward_workers: int = field(
        default=0,
        metadata=meta(
            "processes scoring --reward_fn; a call past --reward_timeout is killed with its process (0: threads of "
            "this process, where such a call is abandoned but runs on until it returns)"
        ),
    )
    reward_timeout: float = field(
        default=30.0,
        metadata=meta(
            "seconds a --reward_fn call may take, with or without --reward_workers; a call past it gets "
            "--reward_fallback and counts as a timeout (a call still running after a quarter of it lets the next "
            "sample start, up to 4 x max(--reward_workers, 1) calls at once: H hanging samples of a batch cost about "
            "ceil(H / that) timeouts, not H). Also bounds each "
            "batch call of a --remote_rm_url .py file"
        ),
    )
    reward_fallback: float = field(
        default=0.0,
        metadata=meta(
            "reward of a call that failed (raised, timed out, returned a non-number, NaN or inf); failures are "
            "counted per iteration (rl/reward/failures in metrics.jsonl) and stop the run above "
            "--reward_max_failure_rate"
        ),
    )

    def __post_init__(self) -> None:
        if self.reward_workers < 0:
            raise ValueError(f"reward_workers must be >= 0, got {self.reward_workers}")
        check_numbers(self)  # a NaN or inf --reward_fallback would reach the advantages
        if not 0 < self.reward_timeout < float("inf"):
            raise ValueError(
                f"reward_timeout must be a finite number of seconds > 0, got {self.reward_timeout}: "
                "every reward call is bounded; pass a large one (e.g. 3600) for slow functions"
            )

    @property
    def given(self) -> bool:
        return bool(self.reward_fn or self.remote_rm_url)

    def check(self, *, label_key: str | None) -> None:
        """What can be refused before anything loads, given the dataset's ``label_key``; ValueError with the fix."""
        if self.reward_fn and not label_key and needs_label(self.reward_fn):
            raise ValueError(
                f"--reward_fn {self.reward_fn} compares each response with the dataset's reference "
                "answer, but no --label_key is set: pass --label_key FIELD (the field of each row "
                "that holds the answer)"
            )

    def check_sources(self, *, probe_timeout_s: float = 5.0) -> None:
        """What the run would find out at its first reward call, found before any model loads: the
        ``--reward_fn`` spec imports and has a reward function's signature, an OpenRLHF ``.py`` file given
        as ``--remote_rm_url`` defines ``reward_func(queries, prompts, labels)``, every reward server URL
        is well formed and answers (any HTTP status: OpenRLHF's servers answer a GET with 404).
        Raises RewardLoadError / ValueError / RemoteRewardError naming the value and the fix."""
        if self.reward_fn:
            load_reward_fn(self.reward_fn)
        if self.remote_rm_url:
            first = str(self.remote_rm_url).split(",")[0].strip()
            if first.endswith(".py"):
                load_openrlhf_reward_func(first)
            else:
                try:
                    client = RemoteRewardClient(self.remote_rm_url)
                except ValueError as e:
                    raise ValueError(f"--remote_rm_url {self.remote_rm_url}: {e}") from None
                client.probe(timeout_s=probe_timeout_s)

    def build(self):
        """One scorer with ``score(prompts, responses, labels)`` (summed when several), or None."""
        fns = []
        if self.reward_fn:
            fns.append(
                RewardRunner(
                    self.reward_fn,
                    workers=self.reward_workers,
                    timeout_s=self.reward_timeout,
                    fallback=self.reward_fallback,
                )
            )
        if self.remote_rm_url:
            fns.append(
                scorer_for_remote_rm_url(
                    self.remote_rm_url,
                    timeout_s=self.reward_timeout,
                    token=self.remote_rm_token or os.environ.get("RL_REWARD_TOKEN"),
                )
            )
        if not fns:
            return None
        return fns[0] if len(fns) == 1 else SummedRewards(fns)


class SummedRewards:
    """Several scorers as one: the per-sample sum; ``close`` closes each. ``counts`` and ``last_counts`` sum
    those of the parts that count their failures (``rl_rollout.rewards.RewardCounts``); ``last_record``
    combines the parts' latest records (OpenRLHF reward files and servers send scores and extra logs)."""

    def __init__(self, fns):
        self.fns = list(fns)
        self._last = None

    def score(self, prompts, responses, labels):
        parts = [f.score(prompts, responses, labels) for f in self.fns]
        self._last = parts
        return [sum(x) for x in zip(*parts, strict=True)]

    def last_record(self) -> RewardRecord | None:
        """The latest batch as one :class:`~rl_rollout.rewards.RewardRecord`: rewards and scores summed per sample
        (a part without scores adds its rewards), every part's extra logs (a name two parts log gets the part's
        index appended the second time). None before the first :meth:`score`."""
        if self._last is None:
            return None
        records = []
        for f, rewards in zip(self.fns, self._last, strict=True):
            rec = f.last_record() if callable(getattr(f, "last_record", None)) else None
            records.append(rec if rec is not None else RewardRecord(list(rewards)))
        scored = any(r.scores is not None for r in records)
        scores = [sum(x) for x in zip(*((r.rewards if r.scores is None else r.scores) for r in records), strict=True)]
        logs: dict[str, list[float]] = {}
        for i, r in enumerate(records):
            for k, v in r.extra_logs.items():
                logs[k if k not in logs else f"{k}_{i}"] = v
        return RewardRecord([sum(x) for x in zip(*self._last, strict=True)], scores if scored else None, logs)

    def _sum(self, attr: str):
        total = RewardCounts()
        for f in self.fns:
            part = getattr(f, attr, None)
            if isinstance(part, RewardCounts):
                total = total + part
        return total

    @property
    def counts(self):
        """Every counting part's calls so far, summed."""
        return self._sum("counts")

    @property
    def last_counts(self):
        """Every counting part's latest batch, summed (each sample counts once per part)."""
        return self._sum("last_counts")

    def metrics(self, prefix: str = "reward/") -> dict[str, int]:
        return self.counts.metrics(prefix)

    def close(self) -> None:
        for f in self.fns:
            close = getattr(f, "close", None)
            if callable(close):
                close()
