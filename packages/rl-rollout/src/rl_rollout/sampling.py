"""How a run samples its rollouts: :class:`SamplingConfig` (samples per prompt, new tokens, temperature,
nucleus), the run-level settings an RL loop turns into each request's :class:`~rl_rollout.types.SamplingParams`
(:meth:`SamplingConfig.params`). The trainer's log-probs divide the logits by the same temperature."""

from __future__ import annotations

from dataclasses import dataclass, field

from rl_rollout.config_fields import check_numbers, meta
from rl_rollout.types import SamplingParams


@dataclass(frozen=True)
class SamplingConfig:
    """A rollout's sampling: ``n_samples_per_prompt`` responses (a group) of at most ``max_new_tokens``."""

    n_samples_per_prompt: int = field(
        default=1, metadata=meta("samples per prompt (a group)", openrlhf=("rollout.n_samples_per_prompt",))
    )
    max_new_tokens: int = field(
        default=64,
        metadata=meta(
            "new tokens per sample (also Dr. GRPO's constant normaliser)",
            flags=("generate_max_len", "max_new_tokens"),
            openrlhf=("rollout.max_new_tokens",),
        ),
    )
    temperature: float = field(
        default=1.0,
        metadata=meta(
            "sampling temperature; the trainer's log-probs use the same one", openrlhf=("rollout.temperature",)
        ),
    )
    top_p: float = field(default=1.0, metadata=meta("nucleus sampling", openrlhf=("rollout.top_p",)))

    def __post_init__(self) -> None:
        check_numbers(self, positive=("temperature", "top_p"), unit=("top_p",))
        if self.n_samples_per_prompt < 1:
            raise ValueError(
                f"n_samples_per_prompt (--n_samples_per_prompt) must be >= 1, got {self.n_samples_per_prompt}"
            )
        if self.max_new_tokens < 1:
            raise ValueError(f"generate_max_len (--generate_max_len) must be >= 1, got {self.max_new_tokens}")

    def params(self, **over) -> SamplingParams:
        """One request's :class:`SamplingParams` from these settings; ``over`` replaces any of its fields
        (``n``, ``temperature``, ``stop_token_ids``, ``seed``)."""
        kw = {
            "temperature": self.temperature,
            "top_p": self.top_p,
            "max_new_tokens": self.max_new_tokens,
            "n": self.n_samples_per_prompt,
            **over,
        }
        return SamplingParams(**kw)
