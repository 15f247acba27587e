"""Typed settings of what rl-rollout implements: the rollout engine and the weight sync.

- :class:`EngineConfig`: which backend (``auto``, ``vllm``, ``hf`` or a registered
  plug-in: :mod:`rl_rollout.engine`) and its knobs; :meth:`EngineConfig.make` builds
  the engine through the backend's registry entry (the dtype and seed come from the
  trainer's settings, so the engine samples from the weights the trainer holds).
- :class:`RewardConfig`: reward functions and remote reward models, built into one
  scorer (:meth:`RewardConfig.build`).
- :class:`WeightSyncConfig`: how weights move trainer -> engines (``auto`` |
  ``direct`` | ``gloo`` | ``nccl`` | ``ipc``); :meth:`WeightSyncConfig.resolve` turns
  ``auto`` into a backend from the placement facts it is given and refuses a
  backend the placement cannot use, with the reason and the fix. This is the one
  place those rules live.

Field metadata carries the help text and the command-line names (``flags``: our
flat names; ``openrlhf``: OpenRLHF's), which rl-cli reads to build its parser.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING, Any

from rl_rollout.engine import AUTO, EngineContext, EngineSpec, RolloutEngine, engine_names, resolve_engine

if TYPE_CHECKING:
    from rl_rollout.rewards import RewardRecord


def meta(help: str, *, flags: tuple[str, ...] = (), openrlhf: tuple[str, ...] = ()) -> dict:
    """Field metadata read by command-line builders: help text and the flag names that set the field."""
    return {"help": help, "flags": flags, "openrlhf": openrlhf}


def check_numbers(
    cfg,
    *,
    positive: tuple[str, ...] = (),
    non_negative: tuple[str, ...] = (),
    unit: tuple[str, ...] = (),
    at_least_1: tuple[str, ...] = (),
) -> None:
    """A config's numbers, checked before anything heavy runs: every float field (and each number of a
    tuple field) finite, then ``positive`` fields > 0, ``non_negative`` >= 0, ``unit`` in [0, 1],
    ``at_least_1`` >= 1 (an unset optional field is skipped). ValueError naming the flag, the value and
    the range, so a typo such as ``--learning_rate -1e-5`` stops at parse time, not inside the optimizer."""
    import dataclasses
    import math

    def values(name):
        v = getattr(cfg, name)
        return [] if v is None or isinstance(v, (bool, str)) else list(v) if isinstance(v, tuple) else [v]

    for f in dataclasses.fields(cfg):
        for v in values(f.name):
            if isinstance(v, float) and not math.isfinite(v):
                raise ValueError(f"{f.name} (--{f.name}) must be a finite number, got {getattr(cfg, f.name)}")
    rules = (
        (positive, lambda v: v > 0, "> 0"),
        (non_negative, lambda v: v >= 0, ">= 0"),
        (unit, lambda v: 0 <= v <= 1, "in [0, 1]"),
        (at_least_1, lambda v: v >= 1, ">= 1"),
    )
    for names, ok, text in rules:
        for name in names:
            if not all(ok(v) for v in values(name)):
                raise ValueError(f"{name} (--{name}) must be {text}, got {getattr(cfg, name)}")


_DTYPES = {
    "bf16": "bfloat16",
    "bfloat16": "bfloat16",
    "fp32": "float32",
    "float32": "float32",
    "fp16": "float16",
    "float16": "float16",
}


def canonical_dtype(name: str) -> str:
    """``bf16``/``bfloat16`` -> ``bfloat16``, ``fp32``/``float32`` -> ``float32`` ... (the names both backends take)."""
    if name not in _DTYPES:
        raise ValueError(f"unknown dtype {name!r}; valid: {', '.join(_DTYPES)}")
    return _DTYPES[name]


def merge_options(base: dict, extra: dict | None) -> dict:
    """``extra`` over ``base``, one level deep for dict values (``engine_kwargs`` keeps the keys it is not given)."""
    out = dict(base)
    for k, v in (extra or {}).items():
        out[k] = {**out[k], **v} if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


@dataclass(frozen=True)
class EngineConfig:
    """The rollout engine (one per engine replica)."""

    kind: str = field(
        default="auto",
        metadata=meta(
            "auto (vLLM when usable, else transformers) | vllm | hf | an installed plug-in's name (entry point "
            "group rl_rollout.engines)",
            flags=("rollout_engine",),
        ),
    )
    gpu_memory_utilization: float = field(
        default=0.5,
        metadata=meta(
            "vLLM: share of the GPU's memory for weights and KV cache",
            flags=("vllm_gpu_memory_utilization",),
            openrlhf=("vllm.gpu_memory_utilization",),
        ),
    )
    enforce_eager: bool = field(
        default=False,
        metadata=meta(
            "vLLM: no CUDA graphs / torch.compile (faster start, slower decode)", openrlhf=("vllm.enforce_eager",)
        ),
    )
    enable_sleep: bool = field(
        default=False,
        metadata=meta(
            "engines sleep (free their memory) while the models train, wake for the weight sync",
            flags=("vllm_enable_sleep",),
            openrlhf=("vllm.enable_sleep",),
        ),
    )
    sleep_level: int = field(
        default=1,
        metadata=meta(
            "with --vllm_enable_sleep: 1 keeps the weights in host memory while asleep; 2 drops them (the next "
            "sync refills every tensor, so nothing makes the host round trip)",
            flags=("vllm_sleep_level",),
        ),
    )
    enable_prefix_caching: bool = field(
        default=True,
        metadata=meta(
            "vLLM: reuse the KV cache of shared prompt prefixes (reset after every weight sync)",
            openrlhf=("vllm.enable_prefix_caching",),
        ),
    )
    max_batch_sequences: int = field(default=256, metadata=meta("HF engine: sequences per generate call"))

    def __post_init__(self) -> None:
        valid = [AUTO, *engine_names()]
        if self.kind not in valid:
            raise ValueError(
                f"rollout engine {self.kind!r} is not one of {', '.join(valid)} (--rollout_engine; "
                f"a plug-in adds its name through the entry point group rl_rollout.engines)"
            )
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"vllm_gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.max_batch_sequences < 1:
            raise ValueError(f"max_batch_sequences must be >= 1, got {self.max_batch_sequences}")
        if self.sleep_level not in (1, 2):
            raise ValueError(f"vllm_sleep_level must be 1 or 2, got {self.sleep_level}")

    def hf_options(self, *, dtype: str, device: str) -> dict:
        return {"dtype": canonical_dtype(dtype), "device": device, "max_batch_sequences": self.max_batch_sequences}

    def vllm_options(self, *, dtype: str, seed: int, in_process: bool = False, tensor_parallel_size: int = 1) -> dict:
        engine_kwargs: dict[str, Any] = {"gpu_memory_utilization": self.gpu_memory_utilization}
        opts: dict[str, Any] = {
            "dtype": canonical_dtype(dtype),
            "seed": seed,
            "enforce_eager": self.enforce_eager,
            "enable_prefix_caching": self.enable_prefix_caching,
            "tensor_parallel_size": tensor_parallel_size,
            "engine_kwargs": engine_kwargs,
        }
        if in_process:
            opts["in_process"] = True
        if tensor_parallel_size > 1:  # one engine over several GPUs: vLLM's multiprocessing executor
            engine_kwargs["distributed_executor_backend"] = "mp"
        # asked: vLLM's sleep mode where the platform has it (on CPU sleep only pauses scheduling); else off
        opts["enable_sleep_mode"] = None if self.enable_sleep else False
        return opts

    def spec(self, kind: str | None = None) -> EngineSpec:
        """The registry entry this config builds (``auto`` resolved here: may import vLLM to ask)."""
        return resolve_engine(kind or self.kind)

    def options(self, kind: str, context: EngineContext) -> dict:
        """The keyword arguments the engine ``kind`` (not ``auto``) is built with in ``context``."""
        return resolve_engine(kind).options(self, context)

    def make(
        self,
        model: str,
        *,
        dtype: str,
        seed: int,
        device: str = "cpu",
        in_process: bool = False,
        kind: str | None = None,
        tensor_parallel_size: int = 1,
        extra: dict | None = None,
    ) -> RolloutEngine:
        """Build the engine for ``model`` in this process (``kind`` overrides :attr:`kind`; ``extra``
        keyword arguments go to the engine class over the ones built from this config)."""
        spec = self.spec(kind)
        ctx = EngineContext(
            dtype=dtype, seed=seed, device=device, in_process=in_process, tensor_parallel_size=tensor_parallel_size
        )
        return spec.load()(model, **merge_options(spec.options(self, ctx), extra))


class SyncBackend(str, Enum):
    AUTO = "auto"
    DIRECT = "direct"  # an engine object in the trainer's process: tensors handed over in memory
    GLOO = "gloo"  # collective broadcast through host memory (any placement, CPU too)
    NCCL = "nccl"  # collective broadcast GPU to GPU (trainer and engines on different GPUs)
    IPC = "ipc"  # CUDA IPC: each trainer rank's engine reads its GPU memory in place (hybrid engine)


@dataclass(frozen=True)
class WeightSyncConfig:
    """How the trainer's weights reach the engines after every update."""

    backend: str = field(
        default="auto",
        metadata=meta(
            "auto | direct | gloo | nccl | ipc. auto: in one process direct; over Ray on GPUs nccl, or ipc for the "
            "hybrid engine (--colocate_all_models) with tensor parallel 1; gloo without GPUs",
            flags=("vllm_sync_backend",),
            openrlhf=("vllm.sync_backend",),
        ),
    )
    verify: bool = field(
        default=False,
        metadata=meta(
            "check every sync: sha256 of the bytes on both ends, and what the engine holds against what was sent",
            flags=("verify_weights",),
        ),
    )

    def __post_init__(self) -> None:
        valid = [b.value for b in SyncBackend]
        if self.backend not in valid:
            raise ValueError(
                f"weight-sync backend {self.backend!r} is not one of {', '.join(valid)} (--vllm_sync_backend)"
            )

    def check(self, *, in_process: bool, colocated: bool = False, tensor_parallel_size: int = 1) -> None:
        """The rules that need no device: callable before any process starts. Raises ValueError with the fix."""
        b = SyncBackend(self.backend)
        if in_process and b not in (SyncBackend.AUTO, SyncBackend.DIRECT):
            raise ValueError(
                f"--vllm_sync_backend {b.value}: in one process (rl ppo) the engine takes the "
                f"trainer's tensors in memory; drop the flag (auto) or use rl ppo-ray"
            )
        if not in_process and b is SyncBackend.DIRECT:
            raise ValueError(
                "--vllm_sync_backend direct hands tensors to an engine in the trainer's process; the "
                "engines here are separate processes: use auto, gloo, nccl or ipc"
            )
        if b is SyncBackend.IPC and (not colocated or tensor_parallel_size != 1):
            raise ValueError(
                "--vllm_sync_backend ipc reads the weights in place on the GPU an actor rank shares "
                "with its engine: it needs --colocate_all_models (the hybrid engine) with "
                "--vllm_tensor_parallel_size 1; use nccl or gloo otherwise"
            )

    def resolve(self, *, in_process: bool, on_gpu: bool, colocated: bool = False, tensor_parallel_size: int = 1) -> str:
        """The backend for this placement. ``in_process``: the engine lives in the trainer's process;
        ``on_gpu``: the trainer runs on CUDA; ``colocated``: each trainer rank shares its GPU with an engine
        (the hybrid engine). Raises ValueError naming the conflict and the fix."""
        self.check(in_process=in_process, colocated=colocated, tensor_parallel_size=tensor_parallel_size)
        b = SyncBackend(self.backend)
        if in_process:
            return SyncBackend.DIRECT.value
        if b in (SyncBackend.IPC, SyncBackend.NCCL) and not on_gpu:
            raise ValueError(
                f"--vllm_sync_backend {b.value} needs the policy on CUDA, but it runs on the CPU: "
                f"use gloo (or auto) on a machine without GPUs"
            )
        if b is SyncBackend.AUTO:
            if not on_gpu:
                return SyncBackend.GLOO.value
            if colocated:  # NCCL refuses two ranks on one GPU; IPC reads in place
                return (SyncBackend.IPC if tensor_parallel_size == 1 else SyncBackend.GLOO).value
            return SyncBackend.NCCL.value
        return b.value


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
        from rl_rollout.rewards.verifiers import needs_label

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
        from rl_rollout.rewards import load_reward_fn
        from rl_rollout.rewards.remote import RemoteRewardClient

        if self.reward_fn:
            load_reward_fn(self.reward_fn)
        if self.remote_rm_url:
            first = str(self.remote_rm_url).split(",")[0].strip()
            if first.endswith(".py"):
                from rl_rollout.rewards.loading import load_openrlhf_reward_func

                load_openrlhf_reward_func(first)
            else:
                try:
                    client = RemoteRewardClient(self.remote_rm_url)
                except ValueError as e:
                    raise ValueError(f"--remote_rm_url {self.remote_rm_url}: {e}") from None
                client.probe(timeout_s=probe_timeout_s)

    def build(self):
        """One scorer with ``score(prompts, responses, labels)`` (summed when several), or None."""
        import os

        from rl_rollout.rewards import RewardRunner, scorer_for_remote_rm_url

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
        from rl_rollout.rewards import RewardRecord

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
        from rl_rollout.rewards.runner import RewardCounts

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
