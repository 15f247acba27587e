"""``rl eval``'s own settings: :class:`EvalRunConfig` (the ``eval`` group of its flags): which models, how many
samples per prompt and how they are drawn (rl-rollout's :class:`~rl_rollout.SamplingConfig`, the same flags as
``rl ppo``), which k of pass@k / maj@k, when a sample counts as correct, where the results go. The prompts
(``--dataset``, keys, chat template), the rewards (``--reward_fn``, ``--remote_rm_url``) and the engine
(``--rollout_engine``) are the shared groups' (:class:`rl_core.data.DataConfig`, :class:`rl_rollout.RewardConfig`,
:class:`rl_rollout.EngineConfig`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from rl_rollout.config_fields import check_numbers, meta
from rl_rollout.evaluation import check_ks, parse_ks
from rl_rollout.sampling import SamplingConfig

DTYPES = ("auto", "float32", "bfloat16", "float16")


@dataclass(frozen=True)
class EvalRunConfig:
    """One ``rl eval`` run: models x datasets, n samples per prompt, scored and summarised."""

    model: str | None = field(
        default=None,
        metadata=meta(
            "the models to evaluate, comma-separated (a column each, in this order): HF folders (config.json and "
            "weights), a run's checkpoint with its HF export (iter_N/ holding hf/, from --save_hf_ckpt), a --ckpt_path "
            "folder (its newest such checkpoint), or hub ids in the local HF cache"
        ),
    )
    output_dir: str | None = field(
        default=None,
        metadata=meta("where samples.jsonl, summary.json and pass_at_k.png go (created; files there are replaced)"),
    )
    sampling: SamplingConfig = field(
        default_factory=SamplingConfig,
        metadata=meta("samples per prompt, new tokens, temperature, nucleus (rl-rollout; the flags of rl ppo)"),
    )
    pass_k: str = field(
        default="1",
        metadata=meta("the k of pass@k and maj@k, comma-separated (each <= --n_samples_per_prompt), e.g. 1,4"),
    )
    correct_threshold: float = field(
        default=1.0,
        metadata=meta(
            "a sample is correct when its reward is >= this (1.0: a verifier's full marks; 0.5 for partial rewards)"
        ),
    )
    seed: int = field(
        default=0,
        metadata=meta(
            "sampling seed: prompt i of dataset d is drawn with seed + 1000003 x d + i, the same for every model"
        ),
    )
    prompts_per_call: int = field(default=32, metadata=meta("prompts per generate call (n samples each)"))
    dtype: str = field(
        default="auto",
        metadata=meta(
            "the engine's weights: auto (bfloat16 on a CUDA GPU, float32 on CPU) | float32 | bfloat16 | float16"
        ),
    )

    def __post_init__(self) -> None:
        check_numbers(self, at_least_1=("prompts_per_call",))
        if self.dtype not in DTYPES:
            raise ValueError(f"--dtype {self.dtype!r} is not one of {', '.join(DTYPES)}")
        check_ks(self.ks, self.sampling.n_samples_per_prompt)

    @property
    def ks(self) -> tuple[int, ...]:
        return parse_ks(self.pass_k)

    @property
    def models(self) -> list[str]:
        return [m.strip() for m in (self.model or "").split(",") if m.strip()]
