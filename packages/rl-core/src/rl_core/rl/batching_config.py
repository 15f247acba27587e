"""The RL workers' micro-batch settings (:class:`MicroBatchConfig`), apart from :mod:`rl_core.rl.batching` (which
plans the micro-batches with torch) so that ``rl ppo --help`` builds its flags without importing torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from rl_rollout.config_fields import check_numbers, meta


@dataclass(frozen=True)
class MicroBatchConfig:
    """How the RL workers group a rank's items into forwards (``--packing`` is the data group's). OpenRLHF's
    names (``--use_dynamic_batch``, ``--train_max_tokens_per_gpu``, ``--micro_rollout_batch_size`` ...) are
    mapped by rl-cli."""

    max_tokens_per_gpu: int | str | None = field(
        default="auto",
        metadata=meta(
            "token budget of a training micro-batch per rank (OpenRLHF dynamic batching): items are grouped first-fit "
            "decreasing under it instead of --micro_train_batch_size at a time; counts real tokens with --packing, "
            "rows x longest row without; with --ring_attn_size N a packed row holds up to N x this, 1/N per rank. "
            "memory: chosen from free device memory at each phase (rl_core.rl.batching.memory_budget); auto "
            "(default): memory on CUDA with packed rows unless --micro_train_batch_size is given, else none; none: "
            "--micro_train_batch_size rows"
        ),
    )
    forward_max_tokens_per_gpu: int | None = field(
        default=None,
        metadata=meta(
            "token budget of the no-grad experience forwards (old/reference log-probs, values, reward model); "
            "default: --max_tokens_per_gpu"
        ),
    )
    forward_micro_batch_size: int | None = field(
        default=None,
        metadata=meta(
            "sequences per no-grad experience forward when no budget applies; default: --micro_train_batch_size"
        ),
    )

    def __post_init__(self) -> None:
        value = self.max_tokens_per_gpu
        if isinstance(value, str):  # the command line's text: auto, none, or a number
            text = value.strip().lower()
            value = None if text in ("none", "null") else text
            if value is not None and value not in ("auto", "memory"):
                if not (value.isascii() and value.isdigit()):
                    raise ValueError(
                        f"max_tokens_per_gpu (--max_tokens_per_gpu) must be a number of tokens, auto, "
                        f"memory or none, got {self.max_tokens_per_gpu!r}"
                    )
                value = int(value)
            object.__setattr__(self, "max_tokens_per_gpu", value)
        if self.max_tokens_per_gpu not in ("auto", "memory"):
            check_numbers(self, at_least_1=("max_tokens_per_gpu",))
        check_numbers(self, at_least_1=("forward_max_tokens_per_gpu", "forward_micro_batch_size"))

    @property
    def from_memory(self) -> bool:
        """Each phase's budget is chosen from free device memory (:func:`memory_budget`)."""
        return self.max_tokens_per_gpu == "memory"

    def forward_budget(self) -> tuple[int | str | None, str]:
        """The no-grad forwards' budget and the flag that set it (for errors); ``"memory"``
        as :attr:`from_memory`."""
        if self.forward_max_tokens_per_gpu is not None:
            return self.forward_max_tokens_per_gpu, "--forward_max_tokens_per_gpu"
        return self.max_tokens_per_gpu, "--max_tokens_per_gpu"
