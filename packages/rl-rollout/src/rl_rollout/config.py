"""Typed settings of what rl-rollout implements: the rollout engine and the weight sync.

- :class:`EngineConfig`: which backend (``auto``, ``vllm``, ``hf`` or a registered
  plug-in: :mod:`rl_rollout.engine`) and its knobs; :meth:`EngineConfig.make` builds
  the engine through the backend's registry entry (the dtype and seed come from the
  trainer's settings, so the engine samples from the weights the trainer holds).
- :class:`RewardConfig`: reward functions and remote reward models, built into one
  scorer (:meth:`RewardConfig.build`); defined in :mod:`rl_rollout.reward_config`,
  re-exported here.
- :class:`WeightSyncConfig`: how weights move trainer -> engines (``auto`` |
  ``direct`` | ``gloo`` | ``nccl`` | ``ipc``); :meth:`WeightSyncConfig.resolve` turns
  ``auto`` into a backend from the placement facts it is given and refuses a
  backend the placement cannot use, with the reason and the fix. This is the one
  place those rules live.

Field metadata carries the help text and the command-line names (``flags``: our
flat names; ``openrlhf``: OpenRLHF's), which rl-cli reads to build its parser
(:func:`meta` and :func:`check_numbers`: :mod:`rl_rollout.config_fields`, re-exported here).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from rl_rollout.config_fields import check_numbers, meta
from rl_rollout.engine import AUTO, EngineContext, EngineSpec, RolloutEngine, engine_names, resolve_engine
from rl_rollout.reward_config import RewardConfig, SummedRewards

# Re-exported: defined in rl_rollout.config_fields and rl_rollout.reward_config, imported from here by rl-core and rl-cli.
__all__ = [
    "EngineConfig",
    "RewardConfig",
    "SummedRewards",
    "SyncBackend",
    "WeightSyncConfig",
    "canonical_dtype",
    "check_numbers",
    "merge_options",
    "meta",
]


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
