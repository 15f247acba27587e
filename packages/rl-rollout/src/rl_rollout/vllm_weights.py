"""``VLLMEngine``'s weight loading: in-process tensors, byte buckets, collective broadcast, CUDA IPC, checks.

A mixin of :class:`rl_rollout.vllm_engine.VLLMEngine` (it uses the engine's ``_rpc``,
``_lock``, ``_check_usable`` and state); the worker-side half is
:mod:`rl_rollout.vllm_worker`. One update is one vLLM layerwise-reload session:
``begin_weight_update`` -> loads -> ``finish_weight_update`` (which moves the prompts' prefix-cache
salt to the new weights and sets ``policy_version``). The paths into a session:

- ``update_weights(named_tensors)``: an in-process engine (``hands_over_tensors``) takes
  the tensors as they are (a GPU trainer's stay on the GPU); otherwise they travel as
  byte buckets (:mod:`rl_rollout.weights`) over vLLM's message channel;
- ``receive_weights``: the trainer's collective broadcast (:mod:`rl_rollout.transport`);
- ``update_weights_ipc``: CUDA IPC buckets of a trainer on the same GPU (:mod:`rl_rollout.ipc`).

``verify_weights(expected)`` checks the engine holds what was sent: per HF tensor the
count, float64 sum and sum of squares, read through the kernels (see the worker).
"""

from __future__ import annotations

import logging
import pickle
import threading
import time
from collections.abc import Coroutine, Iterable, Mapping
from typing import TYPE_CHECKING, Any, TypeVar

import torch

from rl_rollout.transport import BACKENDS, SyncStats, WeightSyncError
from rl_rollout.weights import (
    DEFAULT_STATS_RTOL,
    TensorStats,
    WeightBucket,
    as_torch_dtype,
    compare_weight_stats,
    iter_buckets,
    iter_groups,
    tensor_stats,
)

if TYPE_CHECKING:
    from rl_rollout.vllm_resident import KeptRequests

logger = logging.getLogger(__name__)

_T = TypeVar("_T")


DROPPED = "left out by vLLM's model"  # the reason's start for a name the engine holds nothing of, by design
ENCODER_CACHE_RESET_MISSING = (
    "this vLLM has no reset_encoder_cache (vLLM 0.26 and 0.32 have it): after a weight sync it would keep serving "
    "image embeddings computed with the old weights. Upgrade vLLM to use a vision-language model with weight syncs"
)


def check_encoder_cache_reset(mode: str) -> None:
    """A vision-language engine drops vLLM's encoder cache after every sync (``_reset_encoder_cache``): a vLLM whose
    engine class lacks the method is refused before the engine starts."""
    if mode == "async":
        from vllm.v1.engine.async_llm import AsyncLLM as engine_cls
    else:
        from vllm.v1.engine.llm_engine import LLMEngine as engine_cls
    if not hasattr(engine_cls, "reset_encoder_cache"):
        raise RuntimeError(ENCODER_CACHE_RESET_MISSING)


class VLLMWeightsMixin:
    """Weight loading and checks for :class:`~rl_rollout.vllm_engine.VLLMEngine`."""

    # The engine's state this mixin uses, set by VLLMEngine.__init__ (annotations only: no class attributes).
    mode: str  # "sync" | "async"
    pause_mode: str
    bucket_bytes: int
    tensor_parallel_size: int
    hands_over_tensors: bool
    policy_version: int
    last_sync_reports: list[dict[str, Any]]
    _llm: Any  # vllm.LLM (sync mode) or vllm's AsyncLLM (async mode): vLLM's own objects
    _lock: threading.RLock
    _updates_waiting: int
    _kept: KeptRequests | None
    _weights_epoch: int
    _dtype: torch.dtype | None

    if TYPE_CHECKING:  # the engine's methods this mixin calls (defined by VLLMEngine)

        def _rpc(self, method: str, *args: Any) -> list[Any]: ...

        def _check_usable(self, need: str | None = None) -> None: ...

        def _run(self, coro: Coroutine[Any, Any, _T]) -> _T: ...

        @property
        def takes_images(self) -> bool: ...

    def update_weights(
        self,
        named_tensors: Iterable[tuple[str, torch.Tensor]],
        version: int,
        *,
        verify: bool = False,
        live: bool = False,
    ) -> dict[str, TensorStats] | None:
        """Stream ``(hf_name, tensor)`` pairs to every worker in buckets of ``bucket_bytes``: one reload
        session for the whole iterable, so pass every tensor of a sync in one call (a generator is fine).
        An in-process engine (``in_process=True``, sync mode) takes the tensors themselves, on their device
        (:attr:`hands_over_tensors`); otherwise they are packed into byte buckets.

        ``live=True`` (an in-process engine): the tensors are the trainer's live parameters, the same storage
        at every sync (ZeRO-0/1/2, no cast); they go to the worker in one group and its copy plan keeps its
        views of them, so a steady sync is one fused copy. Never for copies made for the sync (a ZeRO-3 gather).

        ``verify=True``: computes :func:`~rl_rollout.weights.weight_stats` of the tensors as they are sent
        (in the engine's dtype), checks them with :meth:`verify_weights` after the load, and returns them.
        On failure the layers are still finalised (those that got no new weights keep their old ones),
        ``policy_version`` stays, and the error propagates (:class:`~rl_rollout.transport.WeightSyncError`
        for a failed check or a layer that got only part of its weights).
        """
        expected: dict[str, TensorStats] | None = {} if verify else None
        dtype = self.dtype if verify else None

        def tap(pairs):
            for name, tensor in pairs:
                if expected is not None:
                    expected[name] = tensor_stats(tensor, dtype)
                yield name, tensor

        self.begin_weight_update()
        try:
            if self.hands_over_tensors and live:  # live parameters: nothing to bound, one group
                self._rpc("rl_load_tensors", list(tap(named_tensors)), True)
            elif self.hands_over_tensors:  # the worker is in this process: tensors as they are (GPU stays GPU)
                for group in iter_groups(tap(named_tensors), self.bucket_bytes):
                    self._rpc("rl_load_tensors", group)
            else:  # packed buckets (bytes) over vLLM's message channel
                for bucket in iter_buckets(tap(named_tensors), self.bucket_bytes):
                    self.load_bucket(bucket)
        except BaseException:
            self.finish_weight_update(version=None)
            raise
        self.finish_weight_update(version, expected=expected)
        return expected

    def begin_weight_update(self) -> None:
        """Open a weight update session: ``load_bucket`` calls follow, then ``finish_weight_update``.

        Generation waits until the session ends: sync mode holds the engine lock
        from here to ``finish_weight_update`` (same thread), async mode pauses
        vLLM's scheduler (see ``pause_mode``). Allowed while only the KV cache
        sleeps (``sleep(2)`` -> ``wake_up(["weights"])`` -> update ->
        ``wake_up(["kv_cache"])``).
        """
        self._hold_generation()
        try:
            self._rpc("rl_begin_weight_update")
        except BaseException:
            self._end_session()
            raise

    def _hold_generation(self) -> None:
        """Generation waits from here to :meth:`_end_session`: the engine lock (sync mode), vLLM's pause (async)."""
        self._check_usable(need="weights")
        if self.mode == "async":
            self._run(self._llm.pause_generation(mode=self.pause_mode, clear_cache=False))
        else:
            self._updates_waiting += 1  # a partial rollout's chunk loop lets this in before its next chunk
            try:
                self._lock.acquire()
            finally:
                self._updates_waiting -= 1
            if self._kept is not None:  # requests kept in vLLM across the update: frozen (rl_rollout.vllm_resident)
                try:
                    self._kept.pause()
                except BaseException:
                    self._lock.release()
                    raise

    def load_bucket(self, bucket: WeightBucket) -> None:
        self._rpc("load_weights", bucket.meta, bucket.payload)

    def finish_weight_update(self, version: int | None, *, expected: Mapping[str, TensorStats] | None = None) -> None:
        """Close the session, set ``policy_version``; prompts sent from now on carry a new prefix-cache salt, so
        no KV computed with the old weights is reused, and a vision-language model's image embeddings cached by
        vLLM are dropped (a failed session too: part of the weights may be new).

        ``version=None`` closes a failed session and keeps the old version. Raises
        :class:`~rl_rollout.transport.WeightSyncError` (``policy_version`` unchanged) when a layer got
        only part of its weights in the session, or when ``expected`` is given and
        :meth:`verify_weights` fails. Layers that got nothing keep their old weights (logged).
        """
        try:
            reports = self._rpc("rl_finish_weight_update")
        except BaseException:
            self._close_session(None, None, None)
            raise
        self._close_session(version, reports, expected)

    def _close_session(
        self, version: int | None, reports: list | None, expected: Mapping[str, TensorStats] | None
    ) -> None:
        """After the workers closed their sessions (``reports``; None when that failed): check, set the version,
        then let generation go on (the rest of :meth:`finish_weight_update`)."""
        try:
            if reports is not None:
                self.last_sync_reports = reports  # one per worker: tensors, kept_old, partial (and copy_plan)
            if version is not None:
                if reports is None:
                    raise ValueError("_close_session: setting a version needs the workers' session reports")
                _check_session(reports)
                if expected is not None:
                    self.verify_weights(expected)
                self.policy_version = version
        finally:
            self._weights_epoch += 1  # before generation resumes: the module docstring of vllm_engine
            try:
                if self.takes_images:
                    self._reset_encoder_cache()
            finally:
                self._end_session()

    def _reset_encoder_cache(self) -> None:
        """Drop vLLM's encoder cache: the image embeddings it keeps by image hash (not by weights), which a new
        vision tower or projector would otherwise never recompute for an image seen before the sync (the prompts'
        prefix-cache salt does not reach that cache). Seen on an H100: a LLaVA synced with its projector scaled
        8x kept generating from the old embeddings of a repeated image."""
        engine = self._llm if self.mode == "async" else self._llm.llm_engine
        reset = getattr(engine, "reset_encoder_cache", None)
        if reset is None:  # the engine's start checks the class already (check_encoder_cache_reset)
            raise RuntimeError(ENCODER_CACHE_RESET_MISSING)
        if self.mode == "async":
            self._run(reset())
        else:
            reset()

    def _end_session(self) -> None:
        if self.mode == "async":
            self._run(self._llm.resume_generation())
        else:
            try:
                if self._kept is not None:
                    self._kept.resume()
            finally:
                self._lock.release()

    def update_weights_ipc(
        self, sync, version: int, *, verify: bool = True, expected: Mapping[str, TensorStats] | None = None
    ) -> int:
        """Load weights a trainer on this engine's GPU shares over CUDA IPC (:mod:`rl_rollout.ipc`):
        an :class:`~rl_rollout.ipc.IpcSync` or a list of :class:`~rl_rollout.ipc.IpcBucket`.

        Tensor parallel 1 only (each TP worker sits on its own GPU and would need that GPU's
        buckets). For the hybrid placement; needs CUDA (tests/test_rollout_vllm_ipc.py, on a GPU).
        ``verify``: the buckets' sha256; ``expected``: :meth:`verify_weights` after the load.
        """
        if self.tensor_parallel_size != 1:
            raise NotImplementedError(
                f"update_weights_ipc with tensor_parallel_size={self.tensor_parallel_size}: "
                "each TP worker needs the buckets of its own GPU; use the broadcast transport"
            )
        # the worker opens, loads and closes its session in one RPC (rl_sync_ipc); generation waits meanwhile
        self._hold_generation()
        try:
            reports = self._rpc("rl_sync_ipc", pickle.dumps(sync), verify)
        except BaseException:
            self._close_session(None, None, None)
            raise
        self._close_session(version, reports, expected)
        return reports[0]["tensors"]

    def init_weight_group(
        self,
        master_addr: str,
        master_port: int,
        world_size: int,
        *,
        rank_offset: int = 1,
        backend: str = "gloo",
        timeout_s: float = 600.0,
    ) -> list[int]:
        """Make every worker join the trainer's broadcast group as rank ``rank_offset + worker rank``.

        Blocks until all ``world_size`` ranks joined; returns the workers' ranks. Several engines
        take consecutive offsets (1, 1 + TP, ...).
        """
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
        return self._rpc("rl_init_weight_group", master_addr, master_port, rank_offset, world_size, backend, timeout_s)

    def receive_weights(self, *, verify: bool = True, expected: Mapping[str, TensorStats] | None = None):
        """Take one broadcast sync into all workers (blocks until the sender's end frame); returns ``SyncStats``.

        ``policy_version`` becomes the version sent. On failure (e.g. a corrupted bucket:
        :class:`~rl_rollout.transport.WeightSyncError`) the session is closed with mixed
        weights, ``policy_version`` stays and the error propagates. ``verify``: the sha256 of
        the bytes received; ``expected`` (the sender's :func:`~rl_rollout.weights.weight_stats`):
        :meth:`verify_weights` after the load.
        """
        self.begin_weight_update()
        try:
            results = self._rpc("rl_receive_weights", verify)
        except BaseException:
            self.finish_weight_update(version=None)
            raise
        stats = [SyncStats(**r) for r in results]
        self.finish_weight_update(stats[0].version, expected=expected)
        return stats[0]

    def weights_digest(self) -> list[str]:
        """sha256 of the parameters, one per worker (see ``WorkerExtension.rl_weights_digest``; on CPU it
        does not see the linear layers' packed weights: :meth:`verify_weights` does)."""
        return self._rpc("rl_weights_digest")

    @property
    def dtype(self) -> torch.dtype:
        """The dtype the engine holds its weights in (pass it to :func:`~rl_rollout.weights.weight_stats`)."""
        if self._dtype is None:
            self._dtype = as_torch_dtype(self._rpc("rl_model_dtype")[0])
        return self._dtype

    def weight_stats(self, names: Iterable[str]) -> tuple[dict[str, TensorStats], dict[str, str], dict[str, str]]:
        """What the engine holds for the HF tensor ``names``, summed over tensor-parallel workers:
        ``(stats, ties, missing)``; ``stats`` also has the tied aliases (``lm_head.weight``) of ``ties``
        (``{alias: source}``), ``missing`` the reason for each name the engine could not report (a name vLLM's
        model leaves out by design: a reason starting with :data:`DROPPED`)."""
        self._check_usable(need="weights")
        results = self._rpc("rl_weight_stats", list(names))
        stats: dict[str, TensorStats] = {}
        missing: dict[str, str] = {}
        for r in results:
            missing.update(r["missing"])
            missing.update({n: f"{DROPPED}: {why}" for n, why in r.get("dropped", {}).items()})
        for name in results[0]["stats"]:
            parts = [r["stats"].get(name) for r in results]
            if any(p is None for p in parts):
                missing[name] = "not reported by every tensor-parallel worker"
                continue
            if parts[0][3] == "replica":
                parts = parts[:1]
            stats[name] = TensorStats(
                round(sum(p[0] for p in parts)), sum(p[1] for p in parts), sum(p[2] for p in parts)
            )
        return stats, results[0]["ties"], missing

    def verify_weights(self, expected: Mapping[str, TensorStats], *, rtol: float = DEFAULT_STATS_RTOL) -> dict:
        """Check that the engine holds ``expected`` (:func:`~rl_rollout.weights.weight_stats` of what was sent,
        in the engine's :attr:`dtype`): each name's element count, sum and sum of squares, and a tied LM
        head against the embedding when only the embedding was sent. Raises
        :class:`~rl_rollout.transport.WeightSyncError` naming every tensor that differs or is missing;
        returns ``{"tensors": n checked, "seconds": s}``."""
        t0 = time.perf_counter()
        actual, ties, missing = self.weight_stats(expected)
        # what vLLM's model leaves out by design (its loader skips them too: a CLIP tower's post_layernorm)
        dropped = {n for n, why in missing.items() if why.startswith(DROPPED)}
        expected = {n: s for n, s in expected.items() if n not in dropped}
        problems = compare_weight_stats(expected, actual, ties=ties, missing=missing, rtol=rtol)
        checked = len(expected) + sum(1 for a, src in ties.items() if a not in expected and src in expected)
        if problems:
            raise WeightSyncError(
                f"the engine does not hold the weights sent: {len(problems)} of {checked} tensors checked differ "
                "or are missing:\n  " + "\n  ".join(problems)
            )
        return {"tensors": checked, "seconds": time.perf_counter() - t0}


def _check_session(reports: list[dict]) -> None:
    """Raise for layers that got part of their weights in a session; log those that got none."""
    partial = sorted({name for r in reports for name in r.get("partial", ())})
    if partial:
        raise WeightSyncError(
            f"layers {partial} got only part of their weights in this update session; vLLM re-processed them "
            "with the rest undefined. Send every tensor of a sync in one session (one update_weights call "
            "with all buckets, or begin_weight_update / load_bucket ... / finish_weight_update)"
        )
    kept = sorted({name for r in reports for name in r.get("kept_old", ())})
    if kept:
        logger.warning("weight update: %d layers got no tensors and keep their old weights: %s", len(kept), kept)
