"""Asynchronous training (``--async_train``): generation runs ahead of training by a bounded number of versions.

Present on :class:`~rl_core.trainers.ppo_config.PPOConfig` as ``async_rl`` when on; read by the loop's
producer thread (:mod:`rl_core.rl.pipeline`) and, for partial rollouts, by the engines (the mode and its tokens:
:func:`rl_rollout.partial_modes.set_partial_rollout`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from rl_rollout.config_fields import meta
from rl_rollout.partial_modes import CHUNK_TOKENS, KEEP_STEPS, PartialRolloutMode


@dataclass(frozen=True)
class AsyncConfig:
    """One-step-off-policy pipelining: a sample trains a policy at most ``max_staleness`` versions newer than the
    one that generated it; old log-probs are the trainer's and the engine's sampling is corrected by
    ``--is_correction`` (tis unless set)."""

    max_staleness: int = field(
        default=1,
        metadata=meta(
            "how many policy versions a sample may lag the policy it trains (generation waits for the weight sync "
            "otherwise; 0: the synchronous schedule)"
        ),
    )
    generate_batch_size: int | None = field(
        default=None,
        metadata=meta(
            "prompts per generation round (default: --rollout_batch_size). Larger over-samples, as OpenRLHF's "
            "--vllm_generate_batch_size: one round generates for several iterations and the groups past the first "
            "batch wait in a buffer, in prompt order, for the next ones; a buffered group trains up to "
            "floor((G + B - 2) / B) versions later than --max_staleness alone allows (B: --rollout_batch_size), which "
            "is the bound the staleness metrics check. Dynamic filtering's refill rounds generate only the shortfall; "
            "a round's own metrics (generate_s, reward and agent means) are logged by the iteration that ran it",
            openrlhf=("rollout.vllm_generate_batch_size",),
        ),
    )
    partial_rollout: bool = field(
        default=False,
        metadata=meta(
            "a weight update lands between chunks of the responses being generated instead of waiting for them; the "
            "rest is sampled with the new weights, each token tagged with its version (the importance correction then "
            "uses each token's own rollout log-prob). HF and vLLM engines, in rl ppo and rl ppo-ray; how: "
            "--partial_rollout_mode",
            openrlhf=("train.partial_rollout_enable",),
        ),
    )
    partial_rollout_mode: PartialRolloutMode = field(
        default=PartialRolloutMode.AUTO,
        metadata=meta(
            "with --partial_rollout: keep (a vLLM engine keeps its unfinished requests across a weight update, "
            "paused and resumed with the new weights, no prefill repeated), chunks (every request ends after "
            "--partial_rollout_tokens tokens and the response so far is the next chunk's prompt; HF and vLLM) or "
            "auto (keep on vLLM 0.32+, chunks on HF and older vLLM)"
        ),
    )
    partial_rollout_tokens: int | None = field(
        default=None,
        metadata=meta(
            "with --partial_rollout: tokens sampled per response between two points where a weight update may land: "
            f"the chunk (chunks mode, default {CHUNK_TOKENS}), or vLLM engine steps, each sampling one token of "
            f"every running request (keep mode, default {KEEP_STEPS})"
        ),
    )

    def __post_init__(self) -> None:
        if self.max_staleness < 0:
            raise ValueError(f"max_staleness (--max_staleness) must be >= 0, got {self.max_staleness}")
        if self.partial_rollout_tokens is not None and self.partial_rollout_tokens < 1:
            raise ValueError(
                f"partial_rollout_tokens (--partial_rollout_tokens) must be >= 1, got {self.partial_rollout_tokens}"
            )
        if self.partial_rollout and self.max_staleness == 0:
            raise ValueError(
                "--partial_rollout lets a weight sync land inside the responses being generated, and --max_staleness 0 "
                "starts every generation after the sync it waits for, so none ever lands: raise --max_staleness to 1, "
                "or drop --partial_rollout"
            )
        if not self.partial_rollout and self.partial_rollout_tokens is not None:
            raise ValueError(
                f"--partial_rollout_tokens {self.partial_rollout_tokens} sets the chunk of --partial_rollout, which is "
                f"off: add --partial_rollout, or drop --partial_rollout_tokens"
            )
        if not self.partial_rollout and self.partial_rollout_mode is not PartialRolloutMode.AUTO:
            raise ValueError(
                f"--partial_rollout_mode {self.partial_rollout_mode.value} sets how --partial_rollout runs, which is "
                f"off: add --partial_rollout, or drop --partial_rollout_mode"
            )
        if self.generate_batch_size is not None and self.generate_batch_size < 1:
            raise ValueError(
                f"generate_batch_size (--generate_batch_size) must be >= 1, got {self.generate_batch_size}"
            )

    def staleness_bound(self, rollout_batch_size: int) -> int:
        """The most versions a sample may lag the policy it trains: ``max_staleness``, plus what over-sampling's
        buffer adds (``generate_batch_size`` G over ``rollout_batch_size`` B: up to ``(G + B - 2) // B``)."""
        g, b = self.generate_batch_size or rollout_batch_size, rollout_batch_size
        return self.max_staleness + ((g + b - 2) // b if g > b else 0)

    def check_engine(self, kind: str) -> None:
        """Refuse ``--partial_rollout_mode keep`` with an engine known (``--rollout_engine``, before any model loads)
        to have no such path: the HF engine. ``auto`` and plug-in engines are checked when the engine is built."""
        if self.partial_rollout and self.partial_rollout_mode is PartialRolloutMode.KEEP and kind == "hf":
            raise ValueError(
                "--partial_rollout_mode keep keeps unfinished requests in vLLM across a weight update, and "
                "--rollout_engine hf samples with transformers: use --rollout_engine vllm, or --partial_rollout_mode "
                "chunks (or auto)"
            )
