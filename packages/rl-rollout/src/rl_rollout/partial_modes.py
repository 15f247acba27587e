"""Which partial-rollout path an engine runs (the RL loop's ``--partial_rollout_mode``), and turning it on.

Two paths let a weight update land inside the responses being generated, each token tagged with the version that
sampled it (``info["token_versions"]``):

- ``chunks`` (:mod:`rl_rollout.partial`): every request ends after a chunk of tokens and the response so far is the
  next chunk's prompt (HF and vLLM engines). ``tokens``: the chunk's new tokens (default :data:`CHUNK_TOKENS`).
- ``keep`` (:mod:`rl_rollout.vllm_resident`): a sync-mode vLLM engine keeps its unfinished requests across the
  update (paused, then resumed with the new weights; no prefill repeated). ``tokens``: vLLM engine steps between two
  points where an update may land, each step sampling one token of every running request (default
  :data:`KEEP_STEPS`).

``auto`` picks ``keep`` where the engine can (a sync-mode vLLM engine on vLLM 0.32+: its weight-version labels) and
``chunks`` elsewhere (HF, an older vLLM). No torch here: rl-core's
config reads :class:`PartialRolloutMode` while ``rl --help`` is built.
"""

from __future__ import annotations

import enum
from typing import Any

CHUNK_TOKENS = 16  # chunks: tokens per chunk unless told otherwise
KEEP_STEPS = 1  # keep: engine steps between two points where an update may land unless told otherwise


class PartialRolloutMode(str, enum.Enum):
    AUTO = "auto"
    CHUNKS = "chunks"
    KEEP = "keep"


def set_partial_rollout(engine: Any, mode: PartialRolloutMode | str, tokens: int | None = None) -> PartialRolloutMode:
    """Turn partial rollouts on for ``engine`` (an HFEngine or VLLMEngine, or any engine with
    ``partial_chunk_tokens`` / ``keep_requests``); returns the mode it runs (``auto`` resolved). ``tokens``: the
    chunk (chunks) or the engine steps per turn (keep); None: the mode's default. ValueError, naming the fix, when
    the engine has no such path."""
    mode = PartialRolloutMode(mode)
    if tokens is not None and tokens < 1:
        raise ValueError(
            f"partial rollouts need tokens >= 1 between two update points (--partial_rollout_tokens), got {tokens}"
        )
    keeps, chunks = hasattr(engine, "keep_requests"), hasattr(engine, "partial_chunk_tokens")
    unsupported = getattr(engine, "keep_requests_unsupported", None)
    if mode is PartialRolloutMode.AUTO:  # keep where this engine can (a vLLM before 0.32, or async mode: chunks)
        can_keep = keeps and not (callable(unsupported) and unsupported())
        mode = PartialRolloutMode.KEEP if can_keep else PartialRolloutMode.CHUNKS
    name = type(engine).__name__
    if mode is PartialRolloutMode.KEEP:
        if not keeps:
            raise ValueError(
                f"--partial_rollout_mode keep keeps unfinished requests in vLLM across a weight update, which the "
                f"{name} engine cannot: use --rollout_engine vllm, or --partial_rollout_mode chunks (or auto)"
            )
        # lazy: vllm_resident imports torch (rl_rollout.vllm_requests); this module stays light for rl --help
        from rl_rollout.vllm_resident import KeepRequestsConfig

        engine.keep_requests = KeepRequestsConfig(steps_per_turn=tokens or KEEP_STEPS)
        return mode
    if not chunks:
        raise ValueError(
            f"--partial_rollout needs an engine that samples in chunks or keeps requests across an update; the "
            f"{name} engine does neither: use --rollout_engine hf or vllm, or drop --partial_rollout"
        )
    engine.partial_chunk_tokens = tokens or CHUNK_TOKENS
    return mode
