"""Partial rollouts: a response sampled a chunk of tokens at a time, so a weight update can land between two chunks.

The RL loop's ``--partial_rollout`` (asynchronous training): an update that arrives while a long response is
being sampled does not wait for the whole batch to finish, and the rest of the response is sampled with the
new weights instead of being thrown away. Each chunk re-reads the response so far as its prompt (no KV cache
of the old weights survives: vLLM drops its prefix cache at every update), and every token records the
weight version that sampled it (``info["token_versions"]``; ``policy_version`` is the oldest), which the
loss's off-policy correction reads.

:func:`generate_in_chunks` is the loop both engines run (:class:`~rl_rollout.hf_engine.HFEngine`,
:class:`~rl_rollout.vllm_engine.VLLMEngine` in sync mode); the engine supplies one chunk's sampling under its
lock and a count of updates waiting for that lock (a lock is not fair: without the count a loop of chunks
could starve the update it exists to let in).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable

from rl_rollout.types import FinishReason, RolloutRequest, RolloutSample, SamplingParams

ChunkFn = Callable[[list[RolloutRequest], SamplingParams], tuple[list[list[RolloutSample]], int]]


def generate_in_chunks(
    requests: list[RolloutRequest],
    params: SamplingParams,
    chunk_tokens: int,
    sample_chunk: ChunkFn,
    updates_waiting: Callable[[], int],
    *,
    seed_per_row: bool = False,
) -> list[list[RolloutSample]]:
    """``params.n`` samples per request, ``chunk_tokens`` new tokens at a time.

    ``sample_chunk(requests, params)`` samples one chunk (each request ``n=1``) under the engine's lock and
    returns the samples with the weight version that produced them. Between chunks the loop yields to
    ``updates_waiting()`` pending updates. Seeds (when ``params.seed`` is set): chunk ``k`` is seeded
    ``params.seed + k`` for the whole batch (an engine that draws one stream per batch, as HFEngine does), or
    with ``seed_per_row`` each row gets its own seed, distinct over rows and chunks (an engine that seeds each
    request alone, as vLLM does: a shared seed would make the n samples of a prompt identical).
    """
    if chunk_tokens < 1:
        raise ValueError(f"partial rollouts sample at least 1 token per chunk, got {chunk_tokens}")
    n = params.n
    prompts = [list(r.prompt_token_ids) for r in requests for _ in range(n)]
    images = [r.multi_modal_data for r in requests for _ in range(n)]  # a VLM's images go with every chunk
    tokens: list[list[int]] = [[] for _ in prompts]
    logprobs: list[list[float]] = [[] for _ in prompts]
    versions: list[list[int]] = [[] for _ in prompts]
    finish: list[FinishReason | None] = [None] * len(prompts)
    last_version = 0
    k = 0
    while active := [b for b in range(len(prompts)) if finish[b] is None]:
        step = min(chunk_tokens, params.max_new_tokens - len(tokens[active[0]]))  # active rows: same length
        p = dataclasses.replace(params, n=1, max_new_tokens=step, seed=None if params.seed is None else params.seed + k)
        while updates_waiting():  # let a waiting update in before the next chunk
            time.sleep(0.001)
        if seed_per_row and params.seed is not None:
            rows = [
                RolloutRequest(
                    prompts[b] + tokens[b],
                    dataclasses.replace(p, seed=params.seed + k * len(prompts) + b),
                    multi_modal_data=images[b],
                )
                for b in active
            ]
        else:
            rows = [RolloutRequest(prompts[b] + tokens[b], p, multi_modal_data=images[b]) for b in active]
        out, last_version = sample_chunk(rows, p)
        for b, (s,) in zip(active, out, strict=True):
            tokens[b] += s.response_ids
            logprobs[b] += s.rollout_logprobs
            versions[b] += [last_version] * len(s.response_ids)
            if s.finish_reason != "length" or len(tokens[b]) >= params.max_new_tokens:
                finish[b] = s.finish_reason
        k += 1
    ended: list[FinishReason] = []
    for reason in finish:
        if reason is None:  # not reached: the loop above runs until every row has its finish reason
            raise RuntimeError("generate_in_chunks: a row ended without a finish reason")
        ended.append(reason)
    return [
        [
            RolloutSample(
                prompt_ids=prompts[i * n + j],
                response_ids=tokens[i * n + j],
                rollout_logprobs=logprobs[i * n + j],
                loss_mask=[1] * len(tokens[i * n + j]),
                finish_reason=ended[i * n + j],
                policy_version=min(versions[i * n + j], default=last_version),
                info={"request_id": r.request_id, "sample_index": j, "token_versions": versions[i * n + j]},
            )
            for j in range(n)
        ]
        for i, r in enumerate(requests)
    ]
