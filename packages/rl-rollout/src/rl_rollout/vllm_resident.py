"""Partial rollouts that stay in vLLM: unfinished requests are kept in the engine across a weight update.

The other partial-rollout path (:mod:`rl_rollout.partial`, ``VLLMEngine.partial_chunk_tokens``) ends every request
after a chunk of tokens and sends the response so far back as the next chunk's prompt, so each chunk prefills the
whole sequence again. Here a sync-mode :class:`~rl_rollout.vllm_engine.VLLMEngine` drives vLLM's ``LLMEngine``
itself (``add_request``, then ``step`` under the engine lock, released between steps); a weight update waiting for
the lock goes first, pauses vLLM's scheduler with the requests kept (``LLMEngine.sleep(level=0, mode="keep")``),
loads, labels the weights with vLLM's ``set_weight_version`` and resumes (``wake_up(["scheduling"])``). vLLM records
which label sampled each output token (``CompletionOutput.weight_versions``, spans of token indexes), which becomes
``info["token_versions"]``; ``policy_version`` is the oldest.

What differs from the chunked path: the KV cache of a kept request (its prompt and the tokens before the update) was
computed with the old weights and is not recomputed, so a token sampled after the update comes from the new weights
attending to old keys and values (as vLLM's own ``pause_generation(mode="keep")`` behaves, and PipelineRL's
in-flight updates). Its rollout log-prob is that distribution's, which the loss's per-token importance correction
reads; no prefill is repeated. Sync mode only (async mode already keeps requests: ``pause_mode="keep"``).
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import Any

from rl_rollout.types import RolloutRequest, RolloutSample
from rl_rollout.vllm_requests import _to_samples


@dataclass(frozen=True)
class KeepRequestsConfig:
    """Partial rollouts with the requests kept in vLLM across a weight update (``VLLMEngine.keep_requests``)."""

    # LLMEngine.step calls between two points where a waiting update may land: engine steps when the engine core
    # runs in this process; with its own process it steps by itself, and the update's pause lands between two of them
    steps_per_turn: int = 1

    def __post_init__(self) -> None:
        if self.steps_per_turn < 1:
            raise ValueError(f"steps_per_turn must be >= 1 (engine steps between updates), got {self.steps_per_turn}")


class KeptRequests:
    """The requests a sync-mode ``VLLMEngine`` runs on this path: every generate call adds its requests, then
    steps the engine (any thread's step serves every call's requests: finished outputs wait in :attr:`finished`
    for their caller). :meth:`pause` / :meth:`resume` bracket a weight update, with the engine lock held."""

    def __init__(self, engine: Any, cfg: KeepRequestsConfig):
        self.engine, self.cfg = engine, cfg
        self.llm = engine._llm.llm_engine
        self.finished: dict[str, Any] = {}  # vLLM request id -> its final RequestOutput, until its caller takes it
        self.steps = 0  # engine steps run on this path (tests wait on it)
        self.llm.set_weight_version(str(engine.policy_version))

    def generate(self, requests: list[RolloutRequest]) -> list[list[RolloutSample]]:
        e = self.engine
        with e._lock:
            e._check_usable()
            ids = [f"{r.request_id}-{next(e._ids)}" for r in requests]  # outputs carry these (vLLM's external ids)
            for i, r in zip(ids, requests, strict=True):
                self.llm.add_request(i, e._prompt(r), e._params(r))
            started = e.policy_version
        while True:
            while e._updates_waiting:  # a waiting update goes first (the lock is not fair)
                time.sleep(0.001)
            with e._lock:
                e._check_usable()
                if all(i in self.finished for i in ids):
                    outputs = [self.finished.pop(i) for i in ids]
                    break
                for _ in range(self.cfg.steps_per_turn):
                    if not self.llm.has_unfinished_requests():
                        missing = [i for i in ids if i not in self.finished]
                        raise RuntimeError(f"vLLM holds no unfinished request, and {missing} returned no output")
                    for out in self.llm.step():
                        if out.finished:
                            self.finished[out.request_id] = out
                    self.steps += 1
        return [_with_versions(r, o, started) for r, o in zip(requests, outputs, strict=True)]

    def pause(self) -> None:
        """Freeze the requests in flight (their KV stays); call with the engine lock held, before a weight load."""
        self.llm.sleep(level=0, mode="keep")

    def resume(self) -> None:
        """Label the weights now held with the engine's ``policy_version`` and let the kept requests go on."""
        self.llm.set_weight_version(str(self.engine.policy_version))
        self.llm.wake_up(["scheduling"])


def _with_versions(request: RolloutRequest, output: Any, started: int) -> list[RolloutSample]:
    """``_to_samples`` with each token's weight version from vLLM's spans (``policy_version``: the oldest)."""
    completions = sorted(output.outputs, key=lambda c: c.index)
    samples = _to_samples(request, output, started, started)
    if len(completions) == 1 and len(samples) > 1:  # greedy: one completion repeated n times
        completions = completions * len(samples)
    out = []
    for s, c in zip(samples, completions, strict=True):
        versions = [int(span.version) for span in c.weight_versions or [] for _ in range(span.start, span.end)]
        if len(versions) != len(s.response_ids):
            raise RuntimeError(
                f"vLLM labelled {len(versions)} of the {len(s.response_ids)} tokens of request {request.request_id!r} "
                f"with a weight version (spans {c.weight_versions}); this path needs vLLM's weight_versions (0.32+)"
            )
        info = {k: v for k, v in s.info.items() if k != "policy_version_end"}
        info["token_versions"] = versions
        out.append(dataclasses.replace(s, policy_version=min(versions, default=started), info=info))
    return out
