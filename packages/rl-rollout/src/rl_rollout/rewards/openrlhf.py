"""OpenRLHF's reward files, run as a batch scorer: ``reward_func(queries, prompts, labels, **kwargs)``.

OpenRLHF takes a ``.py`` path given as ``--remote_rm_url`` (``--reward.remote_url``) to
mean a local reward function: it executes the file and calls its ``reward_func`` with
``queries`` (each prompt followed by its response), ``prompts`` and ``labels`` (``""``
where the dataset has no label key), and reads back a tensor of rewards or the dict
``{"rewards", "scores", "extra_logs"}``: rewards drive the advantages, scores drive
dynamic filtering, extra logs go to the metrics. :class:`OpenRLHFRewardFunc` does the
same: :meth:`~OpenRLHFRewardFunc.score` returns the rewards as floats (what the loop's
scorer interface asks) and :meth:`~OpenRLHFRewardFunc.last_record` the whole
:class:`~rl_rollout.rewards.loading.RewardRecord` of that call, which the loop reads for
scores and extra logs.

One call per batch, in a daemon thread bounded by ``timeout_s``: a call past it raises
:class:`~rl_rollout.rewards.runner.RewardTimeoutError` and is abandoned (a running Python
call cannot be cancelled; the thread finishes or dies with the process). Calls do not
overlap: a call still running from an earlier timeout makes the next one wait for it
within its own ``timeout_s``. A function that raises or returns something unreadable
raises :class:`~rl_rollout.rewards.runner.RewardError` naming the file: like a reward
server that fails, a batch reward function gives no per-sample fallback.

Left out: OpenRLHF passes no keyword arguments today and neither does this; the
``queries`` are decoded text, so special tokens the response ended with (EOS) are not in
them (OpenRLHF decodes with them).
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Sequence
from typing import Any

from rl_rollout.rewards.loading import RewardRecord, load_openrlhf_reward_func, query_texts, record_from
from rl_rollout.rewards.runner import RewardError, RewardTimeoutError


class OpenRLHFRewardFunc:
    """Score batches with the ``reward_func`` of an OpenRLHF reward file (see the module docstring)."""

    def __init__(self, path: str | os.PathLike, *, timeout_s: float | None = None) -> None:
        if timeout_s is not None and not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0 seconds per batch (or None: no bound), got {timeout_s!r}")
        self.path = str(path)
        self.timeout_s = timeout_s
        self.fn = load_openrlhf_reward_func(path)
        self._last: RewardRecord | None = None
        self._busy = threading.Lock()  # held by the call in flight, abandoned ones included

    def __repr__(self) -> str:
        return f"OpenRLHFRewardFunc({self.path!r}, timeout_s={self.timeout_s})"

    def score(
        self, prompts: Sequence[str], responses: Sequence[str], labels: Sequence[Any] | None = None
    ) -> list[float]:
        """One reward per sample; :meth:`last_record` then holds this batch's scores and extra logs."""
        return self.score_record(prompts, responses, labels).rewards

    def last_record(self) -> RewardRecord | None:
        """The :class:`RewardRecord` of the latest :meth:`score` call (None before the first)."""
        return self._last

    def score_record(
        self,
        prompts: Sequence[str],
        responses: Sequence[str],
        labels: Sequence[Any] | None = None,
        queries: Sequence[str] | None = None,
    ) -> RewardRecord:
        """Call ``reward_func(queries, prompts, labels)`` once; ``queries`` default to prompt + response."""
        n = len(prompts)
        if len(responses) != n or (labels is not None and len(labels) != n):
            raise ValueError(
                f"{n} prompts, {len(responses)} responses, {'no' if labels is None else len(labels)} "
                "labels; pass one of each per sample"
            )
        queries = query_texts(prompts, responses) if queries is None else list(queries)
        labels = ["" if y is None else y for y in (labels or [None] * n)]  # OpenRLHF's label without a label_key
        value = self._call(list(queries), list(prompts), labels)
        try:
            record = record_from(value, n, f"reward_func in {self.path}")
        except ValueError as e:
            raise RewardError(f"{e}; fix the file's return value") from None
        self._last = record
        return record

    def _call(self, queries: list[str], prompts: list[str], labels: list[Any]) -> Any:
        out: dict[str, Any] = {}
        deadline = None if self.timeout_s is None else time.monotonic() + self.timeout_s

        def run() -> None:
            try:
                out["value"] = self.fn(queries, prompts, labels)
            except BaseException as e:  # noqa: BLE001 - handed to the caller's thread
                out["error"] = e
            finally:
                self._busy.release()

        if not self._busy.acquire(timeout=-1 if self.timeout_s is None else self.timeout_s):
            raise RewardTimeoutError(
                f"reward_func in {self.path}: an earlier call that timed out is still running after "
                f"timeout_s={self.timeout_s}; it may hang: fix the function or raise the timeout"
            )
        worker = threading.Thread(target=run, name="rl-openrlhf-reward-func", daemon=True)
        worker.start()
        worker.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
        if worker.is_alive():
            raise RewardTimeoutError(
                f"reward_func in {self.path} did not return within timeout_s={self.timeout_s} for a batch of "
                f"{len(queries)} (abandoned); raise --reward_timeout or make the function faster"
            )
        if "error" in out:
            e = out["error"]
            raise RewardError(f"reward_func in {self.path} raised {type(e).__name__}: {e}") from e
        return out["value"]
