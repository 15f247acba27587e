"""``VLLMEngine``: the RolloutEngine over vLLM (``LLM`` in ``mode="sync"``, ``AsyncLLM`` in ``mode="async"``).

Rollout logprobs come from vLLM with ``logprobs_mode="processed_logprobs"``:
the log probability of the sampled token under the distribution it was
sampled from (logits / temperature, then top-k/top-p), the quantity a trainer
recomputes as ``log_softmax(logits / T)`` when no top-k/top-p is set (the
default ``raw_logprobs`` would ignore the temperature). Weights arrive through
the worker extension :class:`rl_rollout.vllm_worker.WorkerExtension` in
buckets (:mod:`rl_rollout.weights`) over ``collective_rpc``. No KV computed with old
weights is reused: every prompt carries vLLM's ``cache_salt`` naming the weights it runs
with (a counter of update sessions), so a prefix cached before an update never matches
one sent after it. That replaces vLLM's ``reset_prefix_cache()`` after each update, a
Python walk over every KV block (13.6 ms per sync at 373,826 blocks on an H200), which
also fails while requests are in flight; old entries are evicted as blocks are needed.

Modes. ``sync`` holds an ``LLM``; ``agenerate`` calls queue up and run together
in one ``LLM.generate`` on a helper thread. ``async`` holds an ``AsyncLLM`` on
its own event-loop thread: requests join the running batch as they come.
``in_process=True`` (TP 1 only) runs vLLM's engine core and worker inside this
process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, executor ``uni``): on a 2-core CPU
an ``LLM`` then starts in 5-12 s instead of 35-50 s (each vLLM process pays a
~12 s ``import vllm``). ``AsyncLLM`` always keeps its engine core in a child
process; ``in_process`` then only keeps the worker in that child (start about
17 s). vLLM caches its environment once an engine runs, so the choice holds
for the whole process.

Images. A vision-language model's requests carry ``multi_modal_data={"image": [...]}`` (as for
:class:`~rl_rollout.hf_engine.HFEngine`); their ``prompt_token_ids`` hold each image's placeholder expanded
to its token count, which the engine collapses back to one placeholder per image for vLLM (vLLM expands a
token prompt's placeholders itself); the samples keep the expanded ids the trainer's forward takes. The
placeholder tokens are never sampled (a -100 logit bias, vLLM's floor). Images on a text model are
refused in one line. vLLM's multimodal models import torchvision, which vLLM's CPU build here cannot
have, so this path runs on the GPU only (tests/test_rollout_vllm_vision_gpu.py).

Sleep. vLLM's sleep mode (``enable_sleep_mode``) exists on CUDA, ROCm and XPU.
On CPU vLLM refuses ``enable_sleep_mode=True``; ``sleep``/``wake_up`` still
pause and resume scheduling but keep all memory (the CPU worker logs
"sleep mode is not supported on CPU, ignore it"), so weights survive even
``sleep(level=2)``. ``sleep_frees_memory`` says which case holds.

Chunked prefill is off on CPU (unless ``engine_kwargs`` sets it): vLLM's CPU worker fails with "CPU Generator
does not use offset" when a seeded request's prompt is split over two steps (it rewinds the request's
generator, which only CUDA generators can do), which any batch of prompts over ``max_num_batched_tokens``
triggers (``rl demo --rollout_engine vllm --n_samples_per_prompt 64``).

Collective broadcast (:mod:`rl_rollout.transport`): ``init_weight_group``
makes every worker join the trainer's gloo/NCCL group, ``receive_weights``
blocks in ``collective_rpc`` while the workers load the trainer's broadcast
into a layerwise-reload session (the trainer's ``CollectiveSender.send`` runs
meanwhile in its own process or thread); the workers verify the sha256 of the
bytes received, not the loaded weights (vLLM fuses and repacks them).

Checking a sync (issue 16: a tied LM head that stayed stale on CPU, silently). After a sync,
:meth:`VLLMEngine.verify_weights` compares what the engine holds with what the trainer sent:
per HF tensor the element count, float64 sum and sum of squares
(:class:`rl_rollout.weights.TensorStats`; the trainer computes them with
:func:`rl_rollout.weights.weight_stats` on the tensors it sent, or ``update_weights(...,
verify=True)`` does it on the way). The worker reads the values its kernels use, through the
packed CPU kernels too (:mod:`rl_rollout.vllm_worker`), splits fused layers back into HF names,
leaves the vocabulary's padding out and checks a tied LM head against the embedding sent; a
mismatch raises :class:`~rl_rollout.transport.WeightSyncError` naming each tensor. Sums are exact
here, so no probe of logprobs is needed (the fallback the issue considered): on CPU reading a
packed weight costs a matmul with identity rows, on GPU a pass over the parameters. Every session
also reports layers that got only part of their weights (vLLM fills the rest with undefined
values; e.g. q_proj in one ``update_weights`` call and k/v_proj in the next): that raises too.

CUDA IPC (a trainer colocated on the engine's GPU, :mod:`rl_rollout.ipc`):
:meth:`VLLMEngine.update_weights_ipc` hands the pickled sync to the worker, which
opens it (once per :class:`~rl_rollout.ipc.IpcSender` generation) into the same
layerwise-reload session. Run on one H200 with vLLM 0.26 (tests/test_rollout_vllm_ipc.py:
three syncs, greedy equal to transformers after each); the vLLM CPU build has no CUDA,
so CI skips it with the reason. Not here: vLLM 0.32's own
``vllm.distributed.weight_transfer`` engines.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import logging
import os
import threading
from collections.abc import Coroutine
from typing import Any, Literal, TypeVar

import torch

from rl_rollout.partial import generate_in_chunks
from rl_rollout.types import RolloutRequest, RolloutSample
from rl_rollout.vllm_memory import (  # noqa: F401 - re-exported: imported from here by tests
    VLLMSleepMixin,
    _device_free_total,
    _device_memory_note,
    _release_cached_device_memory,
    wake_oom_hint,
)
from rl_rollout.vllm_requests import _placeholder_ids, _to_samples, _to_vllm_params, _vllm_prompt, vllm_dtype
from rl_rollout.vllm_resident import KeepRequestsConfig, KeptRequests
from rl_rollout.vllm_weights import VLLMWeightsMixin, check_encoder_cache_reset
from rl_rollout.weights import DEFAULT_BUCKET_BYTES

_T = TypeVar("_T")

logger = logging.getLogger(__name__)

WORKER_EXTENSION = "rl_rollout.vllm_worker.WorkerExtension"
MODES = ("sync", "async")


class VLLMEngine(VLLMWeightsMixin, VLLMSleepMixin):
    """Generation with vLLM. ``engine_kwargs`` go to vLLM's engine arguments unchanged.

    ``pause_mode`` (async mode): what ``update_weights`` does with requests in
    flight: ``"wait"`` drains them first (each sample has one policy version),
    ``"keep"`` freezes them and resumes with the new weights (their samples get
    ``info["policy_version_end"]``), ``"abort"`` ends them with finish reason abort.

    ``dtype``: ``"auto"`` (the checkpoint's), a name vLLM takes (``"float32"``, ``"bfloat16"``,
    ``"float16"``), the short names ``"fp32"``/``"bf16"``/``"fp16"``, or a ``torch.dtype``.
    """

    def __init__(
        self,
        model: str | os.PathLike,
        *,
        mode: Literal["sync", "async"] = "sync",
        tensor_parallel_size: int = 1,
        dtype: str = "auto",
        seed: int = 0,
        max_model_len: int | None = None,
        enable_prefix_caching: bool = True,
        enable_sleep_mode: bool | None = None,
        enforce_eager: bool = False,
        in_process: bool = False,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        pause_mode: Literal["wait", "keep", "abort"] = "wait",
        engine_kwargs: dict[str, Any] | None = None,
    ) -> None:
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        if pause_mode not in ("wait", "keep", "abort"):
            raise ValueError(f"pause_mode must be 'wait', 'keep' or 'abort', got {pause_mode!r}")
        if in_process and tensor_parallel_size != 1:
            raise ValueError(
                f"in_process=True runs one worker in this process; tensor_parallel_size={tensor_parallel_size} "
                "needs worker processes: pass in_process=False"
            )
        if in_process:
            _set_in_process_env()
        from vllm.platforms import current_platform

        sleep_available = current_platform.is_sleep_mode_available()
        if enable_sleep_mode is None:
            enable_sleep_mode = sleep_available
        elif enable_sleep_mode and not sleep_available:
            raise ValueError(
                f"enable_sleep_mode=True, but vLLM has no sleep mode on platform {current_platform.device_type!r}; "
                "pass enable_sleep_mode=None or False (sleep()/wake_up() then only pause scheduling)"
            )
        self.sleep_frees_memory = bool(enable_sleep_mode)
        self.mode = mode
        self.bucket_bytes = bucket_bytes
        self.tensor_parallel_size = tensor_parallel_size
        self.pause_mode = pause_mode
        self.policy_version = 0
        # prefix caching: prompts are salted with the weights' epoch (one per update session, module docstring)
        self._prefix_caching = bool(enable_prefix_caching)
        self._weights_epoch = 0
        # partial rollouts (sync mode): responses sampled this many tokens at a time, updates landing in between
        self._partial_chunk_tokens: int | None = None
        self._kept: KeptRequests | None = None  # partial rollouts kept in vLLM across updates (keep_requests)
        self._updates_waiting = 0  # update sessions waiting for the lock (the chunk loop lets them in)
        self._dtype: torch.dtype | None = None
        args: dict[str, Any] = dict(  # vLLM's engine arguments
            model=str(model),
            tensor_parallel_size=tensor_parallel_size,
            dtype=vllm_dtype(dtype),
            seed=seed,
            max_model_len=max_model_len,
            enable_prefix_caching=enable_prefix_caching,
            enable_sleep_mode=enable_sleep_mode,
            enforce_eager=enforce_eager,
            logprobs_mode="processed_logprobs",
            worker_extension_cls=WORKER_EXTENSION,
        )
        if in_process:
            args["distributed_executor_backend"] = "uni"
        clash = sorted(set(args) & set(engine_kwargs or {}) - {"dtype", "max_model_len", "enforce_eager", "seed"})
        if clash:
            raise ValueError(f"engine_kwargs must not set {clash}: they are VLLMEngine arguments or fixed by it")
        if current_platform.device_type == "cpu" and "enable_chunked_prefill" not in (engine_kwargs or {}):
            # vLLM's CPU worker crashes ("CPU Generator does not use offset") when a seeded request's prefill is
            # split over steps: it rewinds the request's generator, which only CUDA generators can do. A batch of
            # prompts over max_num_batched_tokens (rl demo with 256 samples) is split; without chunked prefill no
            # prompt is. On GPU chunked prefill stays on (vLLM's default). vLLM then warns that the model "does not
            # officially support disabling chunked prefill": the CPU tests (logprobs against transformers, the RL
            # loop's gap) run this way
            logger.info(
                "vLLM on CPU: chunked prefill off (its CPU worker cannot split a seeded prompt's prefill; "
                "engine_kwargs={'enable_chunked_prefill': True} turns it back on)"
            )
            args["enable_chunked_prefill"] = False
        args.update(engine_kwargs or {})
        args["dtype"] = vllm_dtype(args["dtype"])
        self._memory_share: float | None = args.get("gpu_memory_utilization")  # None: vLLM's default
        # a vision-language model: requests may carry images; its placeholder tokens are never sampled
        self._placeholders = _placeholder_ids(model)
        if self._placeholders is not None:  # refused now, not at the first sync after the model loaded
            check_encoder_cache_reset(mode)
        # in one process (sync mode, in_process): collective_rpc reaches the worker with our objects as they are
        self.hands_over_tensors = in_process and mode == "sync"
        self._lock = threading.RLock()  # LLM is not thread-safe; generate, rpc and sleep take turns
        self._ids = itertools.count()
        self._asleep: set[str] = set()  # tags still asleep: "weights", "kv_cache"
        self._closed = False
        if mode == "sync":
            from vllm import LLM

            self._llm = LLM(**args)
            self._queue: list[tuple[RolloutRequest, concurrent.futures.Future]] = []
            self._queue_cv = threading.Condition()
            self._batcher: threading.Thread | None = None
        else:
            self._loop = asyncio.new_event_loop()
            self._loop_thread = threading.Thread(target=self._loop.run_forever, name="vllm-async-loop", daemon=True)
            self._loop_thread.start()
            self._llm = self._run(_build_async_llm(args))

    # ---- generation ----

    @property
    def partial_chunk_tokens(self) -> int | None:
        """Partial rollouts (sync mode): tokens sampled between two points where a weight update may land; None:
        whole responses. Async mode pauses vLLM's scheduler instead (``pause_mode="keep"``)."""
        return self._partial_chunk_tokens

    @partial_chunk_tokens.setter
    def partial_chunk_tokens(self, value: int | None) -> None:
        if value is not None and self.mode == "async":
            raise ValueError(
                "partial rollouts in chunks run in sync mode; an async-mode engine keeps requests in "
                "flight across an update with pause_mode='keep'"
            )
        if value is not None and value < 1:
            raise ValueError(f"partial_chunk_tokens must be >= 1 (tokens per chunk) or None, got {value}")
        if value is not None and self._kept is not None:
            raise ValueError(
                "partial rollouts either sample in chunks (partial_chunk_tokens) or keep the requests in vLLM "
                "(keep_requests): set keep_requests = None first"
            )
        self._partial_chunk_tokens = value

    def keep_requests_unsupported(self) -> str | None:
        """Why this engine cannot keep requests across an update (``keep_requests``), or None: it needs sync mode and
        vLLM's weight-version labels (``LLMEngine.set_weight_version``, vLLM 0.32; 0.26 has none)."""
        if self.mode == "async":
            return (
                "keep_requests drives vLLM's LLMEngine in sync mode; an async-mode engine keeps requests in "
                "flight across an update with pause_mode='keep'"
            )
        if not hasattr(getattr(self._llm, "llm_engine", None), "set_weight_version"):
            # lazy: vllm's version, read only to name it in this message
            from vllm import __version__ as vllm_version

            return (
                f"keeping requests in vLLM across a weight update needs LLMEngine.set_weight_version (vLLM 0.32), which "
                f"this vLLM {vllm_version} lacks: upgrade vLLM, or use --partial_rollout_mode chunks"
            )
        return None

    @property
    def keep_requests(self) -> KeepRequestsConfig | None:
        """Partial rollouts with the unfinished requests kept in vLLM across a weight update (sync mode,
        :mod:`rl_rollout.vllm_resident`); None: off."""
        return self._kept.cfg if self._kept is not None else None

    @keep_requests.setter
    def keep_requests(self, cfg: KeepRequestsConfig | None) -> None:
        if cfg is not None and (why := self.keep_requests_unsupported()):
            raise ValueError(why)
        if cfg is not None and self._partial_chunk_tokens is not None:
            raise ValueError(
                "partial rollouts either sample in chunks (partial_chunk_tokens) or keep the requests in vLLM "
                "(keep_requests): set partial_chunk_tokens = None first"
            )
        with self._lock:
            if self._kept is not None and self._kept.llm.has_unfinished_requests():
                raise RuntimeError("keep_requests changed while requests are in flight: wait for the generate calls")
            self._kept = KeptRequests(self, cfg) if cfg is not None else None

    @property
    def takes_images(self) -> bool:
        """Whether the model is a vision-language model (requests may carry ``multi_modal_data["image"]``)."""
        return self._placeholders is not None

    def generate(self, requests: list[RolloutRequest]) -> list[list[RolloutSample]]:
        self._check_usable()
        if self.mode == "async":
            futures = [asyncio.run_coroutine_threadsafe(self._agenerate_on_loop(r), self._loop) for r in requests]
            return [f.result() for f in futures]
        if self._kept is not None:
            return self._kept.generate(requests)
        chunk_tokens = self.partial_chunk_tokens
        if chunk_tokens is not None:
            return self._generate_partial(requests, chunk_tokens)
        return self._generate_locked(requests)[0]

    def _generate_locked(self, requests: list[RolloutRequest]) -> tuple[list[list[RolloutSample]], int]:
        with self._lock:
            self._check_usable()
            version = self.policy_version
            prompts = [self._prompt(r) for r in requests]
            outputs = self._llm.generate(prompts, [self._params(r) for r in requests], use_tqdm=False)
        return [_to_samples(r, o, version, version) for r, o in zip(requests, outputs, strict=True)], version

    def _generate_partial(self, requests: list[RolloutRequest], chunk_tokens: int) -> list[list[RolloutSample]]:
        """Partial rollouts (:mod:`rl_rollout.partial`): ``chunk_tokens`` (``partial_chunk_tokens``) tokens per chunk, the lock
        released in between so that an update lands mid-response; ``info["token_versions"]`` per token."""
        results: dict[int, list[RolloutSample]] = {}
        groups: dict = {}
        for i, r in enumerate(requests):
            groups.setdefault(r.params, []).append(i)
        for params, idx in groups.items():
            samples = generate_in_chunks(
                [requests[i] for i in idx],
                params,
                chunk_tokens,
                lambda reqs, _p: self._generate_locked(reqs),
                lambda: self._updates_waiting,
                seed_per_row=True,
            )
            results.update(zip(idx, samples, strict=True))
        return [results[i] for i in range(len(requests))]

    async def agenerate(self, request: RolloutRequest) -> list[RolloutSample]:
        self._check_usable()
        if self.mode == "async":
            return await asyncio.wrap_future(
                asyncio.run_coroutine_threadsafe(self._agenerate_on_loop(request), self._loop)
            )
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._queue_cv:
            self._queue.append((request, future))
            if self._batcher is None:
                self._batcher = threading.Thread(target=self._serve_queue, name="vllm-batcher", daemon=True)
                self._batcher.start()
            self._queue_cv.notify()
        return await asyncio.wrap_future(future)

    def _serve_queue(self) -> None:
        """Sync mode: run whatever ``agenerate`` calls queued up as one batch, repeatedly."""
        while True:
            with self._queue_cv:
                while not self._queue and not self._closed:
                    self._queue_cv.wait()
                if self._closed and not self._queue:
                    return
                batch, self._queue = self._queue, []
            try:
                results = self.generate([r for r, _ in batch])
            except BaseException as e:  # hand the failure to every waiter, keep serving
                for _, f in batch:
                    f.set_exception(e)
                continue
            for (_, f), samples in zip(batch, results, strict=True):
                f.set_result(samples)

    async def _agenerate_on_loop(self, request: RolloutRequest) -> list[RolloutSample]:
        version = self.policy_version
        final = None
        prompt = self._prompt(request)
        # vLLM needs ids unique among requests in flight; callers may reuse theirs.
        vllm_id = f"{request.request_id}-{next(self._ids)}"
        async for out in self._llm.generate(prompt, self._params(request), request_id=vllm_id):
            final = out
        if final is None:
            raise RuntimeError(f"vLLM returned no output for request {request.request_id!r}")
        return _to_samples(request, final, version, self.policy_version)

    def _prompt(self, request: RolloutRequest) -> dict:
        prompt = _vllm_prompt(request, self._placeholders)
        if self._prefix_caching:  # cached KV is shared only among prompts run with the same weights
            prompt["cache_salt"] = f"rl-weights-{self._weights_epoch}"
        return prompt

    def _params(self, request: RolloutRequest):
        return _to_vllm_params(request.params, banned=self._placeholders or ())

    def _rpc(self, method: str, *args: Any) -> list[Any]:
        if self.mode == "async":
            return self._run(self._llm.collective_rpc(method, args=args))
        with self._lock:
            return self._llm.collective_rpc(method, args=args)

    # ---- lifetime (sleep and wake_up: VLLMSleepMixin, rl_rollout.vllm_memory) ----

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self.mode == "async":
            self._llm.shutdown()
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._loop_thread.join(timeout=10)
        else:
            with self._queue_cv:
                self._queue_cv.notify_all()
            self._llm.llm_engine.engine_core.shutdown()

    def _check_usable(self, need: str | None = None) -> None:
        if self._closed:
            raise RuntimeError("VLLMEngine was shut down; build a new engine")
        blocking = self._asleep if need is None else self._asleep & {need}
        if blocking:
            raise RuntimeError(f"VLLMEngine is asleep (tags {sorted(blocking)}): call wake_up() before this call")

    def _run(self, coro: Coroutine[Any, Any, _T]) -> _T:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()


async def _build_async_llm(args: dict[str, Any]):
    # Built on the engine's loop: AsyncLLM binds its output handler to the running loop.
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    return AsyncLLM.from_engine_args(AsyncEngineArgs(**args))


def _set_in_process_env() -> None:
    import vllm.envs as envs

    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    if envs.VLLM_ENABLE_V1_MULTIPROCESSING:  # cached by an engine started earlier in this process
        raise RuntimeError(
            "in_process=True, but an engine with multiprocessing already ran in this process and vLLM "
            "cached VLLM_ENABLE_V1_MULTIPROCESSING=1; build every engine of a process with the same in_process"
        )
