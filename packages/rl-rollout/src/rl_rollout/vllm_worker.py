"""Worker-side half of weight loading into vLLM: a worker extension class.

vLLM mixes this class into each of its workers when the engine is built with
``worker_extension_cls="rl_rollout.vllm_worker.WorkerExtension"``; the engine
then calls its methods by name through ``collective_rpc``. Arguments are bytes
(see :mod:`rl_rollout.weights`), which vLLM's msgpack channel carries without
pickle, so ``VLLM_ALLOW_INSECURE_SERIALIZATION`` stays off.

One update is a session: ``rl_begin_weight_update`` -> ``load_weights`` per bucket
-> ``rl_finish_weight_update``. The session is vLLM's layerwise reload (the same
calls its own IPC/NCCL weight-transfer engines make): the model's parameters
go back to checkpoint layout, ``model.load_weights`` (HF names, fuses q/k/v and
gate/up) fills them bucket by bucket, and each layer is re-processed into kernel
layout once all its weights arrived. Calling ``model.load_weights`` outside a
session works on GPU but fails on CPU, where linear weights are repacked after
loading and lose their ``weight_loader`` ("'Parameter' object has no attribute
'weight_loader'"). A layer that received no weights in a session keeps its old
values. Names other than ``load_weights`` carry an ``rl_`` prefix: vLLM refuses an
extension method that shadows a worker method (its worker has its own
``finish_weight_update``). The collective transport (:mod:`rl_rollout.transport`)
runs inside the same session: ``rl_init_weight_group`` joins the trainer's group
as rank ``rank_offset + worker rank``, ``rl_receive_weights`` loads bucket after
bucket as they arrive and verifies the received bytes (vLLM fuses and repacks
weights on load, so they cannot be compared with the bytes sent).

Tied parameters (issue 16). A model with ``tie_word_embeddings`` has one tensor for the
embedding and the LM head, and a trainer sends it once, as ``model.embed_tokens.weight``
(``named_parameters()`` lists a shared parameter once). vLLM's reload treats the two modules as
layers of their own: ``initialize_layerwise_reload`` gives each its own meta tensor
(``restore_layer_on_meta``), the embedding's fills and is copied into the shared kernel tensor,
but the head, given no weights, is skipped ("ParallelLMHead: Failed to load weights",
``finalize_layerwise_processing``) and never re-processed. On GPU that is harmless (the head
reads the shared tensor); on CPU the head computes logits with a copy of its weight packed for
oneDNN when it was last processed (``UnquantizedEmbeddingMethod.process_weights_after_loading``
-> ``dispatch_cpu_unquantized_gemm``, ``layer.cpu_linear``), so it kept the first checkpoint's
head forever. Fix: the session records which parameters are shared before the reload splits
them (:func:`_tied_parameters`) and, when the source arrives, loads the same tensor into the
alias's own loader, so both layers are re-processed; an alias that is sent itself is loaded once.

Session report. ``rl_finish_weight_update`` returns ``{"tensors", "kept_old", "partial"}``:
layers that got no tensor (they keep their old weights; vLLM logs "Failed to load weights") and
layers that got only part of theirs (q but not k/v of a ``qkv_proj``: vLLM then processes the
layer with undefined values for the rest, so the engine raises). Layers with nothing to load from
a checkpoint (a rotary embedding's ``cos_sin_cache``, a non-persistent buffer) are neither, and
are not reported as failed.

What the engine holds (``rl_weight_stats``): :mod:`rl_rollout.vllm_inspect`.
Direct load (CUDA, unquantized models; by default for :data:`DIRECT_LOAD_ARCHITECTURES`, forced on or off
with ``RL_VLLM_DIRECT_LOAD=1``/``0``): no reload session, ``model.load_weights`` straight into the live
parameters (tied ones stay one tensor). On an H200 it cut a 0.5B in-process sync from 0.102 s to 0.029 s
with the same log-probs (docs/performance.md); on CPU it is never used (packed weights).
In direct mode the first sync also records a copy plan (:mod:`rl_rollout.copy_plan`: which slice of which
parameter each tensor's load writes) and later syncs replay it as one ``torch._foreach_copy_``; tensors
whose load is not a plain copy still go through ``load_weights`` (``RL_VLLM_COPY_PLAN=0``: no plan).
Imported inside vLLM workers only: vLLM imports stay inside methods. What the extension reads off vLLM's
model (tied parameters, vision-tower names, the session report, the direct-load choice) is
:mod:`rl_rollout.vllm_worker_model`, re-exported here.
"""

from __future__ import annotations

import hashlib
import logging
import os
import pickle
import time
from typing import Any

import torch

from rl_rollout.copy_plan import CopyPlan, CopyPlanStale, ParamIndex
from rl_rollout.ipc import IpcReceiver, IpcSync, open_bucket
from rl_rollout.transport import CollectiveReceiver
from rl_rollout.vllm_inspect import Dropped, Unsupported, param_stats
from rl_rollout.vllm_worker_model import (  # noqa: F401 - re-exported: imported from here by tests and testing
    DIRECT_LOAD_ARCHITECTURES,
    TOWER_PREFIXES,
    _direct_load,
    _has_tower_level,
    _session_report,
    _tied_parameters,
    _vllm_name,
    tower_names_for_vllm,
    with_tower_level,
)
from rl_rollout.weights import unpack_bucket

logger = logging.getLogger(__name__)


class WorkerExtension:
    """Methods added to vLLM's worker (``self`` is the worker; ``self.model_runner`` exists)."""

    # vLLM's worker's attributes these methods use (annotations only). vLLM's own objects are Any: the model
    # runner's class depends on the platform, and vLLM is not installed where mypy runs.
    model_runner: Any  # vLLM's GPUModelRunner, CPUModelRunner, ...
    vllm_config: Any  # vllm.config.VllmConfig
    rank: int
    device: torch.device

    def rl_begin_weight_update(self) -> None:
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        model = self.model_runner.get_model()
        self._rl_filled: set[str] = set()  # vLLM names of the tied parameters filled in this session
        # Direct load (CUDA, unquantized): model.load_weights / the copy plan straight into the live
        # parameters, no layerwise reload (whose per-layer bookkeeping dominates a GPU sync); tied
        # parameters stay one tensor. On CPU the linear weights are packed after loading, so never there.
        self._rl_direct = _direct_load(self.vllm_config.model_config)
        self._rl_seen: set[str] = set()  # HF names received in this session
        # the model's parameters by name for this session (from self._rl_index)
        self._rl_session_params: dict[str, torch.Tensor] | None = None
        if self._rl_direct:
            self._rl_ties = {}
            self._rl_plan_stats = {"recorded": 0, "copies": 0, "loader": 0, "load_s": 0.0}
        else:
            self._rl_ties = _tied_parameters(model)  # before the reload gives each module its own tensor
            with set_current_vllm_config(self.vllm_config):
                initialize_layerwise_reload(model)
        self._rl_loaded = 0

    def load_weights(self, meta: bytes, payload: bytes) -> int:
        """Load one weight bucket (HF parameter names); returns the number of tensors in it."""
        if not hasattr(self, "_rl_loaded"):
            raise RuntimeError("load_weights called outside a weight update: call rl_begin_weight_update first")
        weights = unpack_bucket(meta, payload)
        self._rl_load(weights)
        return len(weights)

    def rl_load_tensors(self, weights: list, live: bool = False) -> int:
        """Load ``(hf_name, tensor)`` pairs handed over inside one process (an in-process engine: vLLM's
        in-process client and uni executor call this with the caller's objects, nothing serialised), so a
        GPU trainer's tensors go GPU to GPU and never through the host. ``live``: they are the trainer's
        live parameters, the same storage every sync (the copy plan keeps its views of them). Returns the
        number loaded."""
        if not hasattr(self, "_rl_loaded"):
            raise RuntimeError("rl_load_tensors called outside a weight update: call rl_begin_weight_update first")
        weights = list(weights)
        self._rl_load(weights, live=live)
        return len(weights)

    def _rl_load(self, weights: list, live: bool = False) -> None:
        """``model.load_weights`` in the open session, plus the tied aliases of what arrived (module docstring)."""
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader.weight_utils import default_weight_loader

        model = self.model_runner.get_model()
        weights = tower_names_for_vllm(model, weights)
        self._rl_seen.update(name for name, _ in weights)
        if self._rl_direct and os.environ.get("RL_VLLM_COPY_PLAN", "1") != "0":
            t0 = time.perf_counter()
            self._rl_load_planned(model, weights, live)
            self._rl_plan_stats["load_s"] += time.perf_counter() - t0
            return
        ties = self._rl_ties
        send, aliases = [], []
        if ties:
            mapper = getattr(model, "hf_to_vllm_mapper", None)
            for name, tensor in weights:
                vname = _vllm_name(mapper, name)
                if vname in ties:
                    if vname in self._rl_filled:
                        continue  # already filled from its source: loading it again would be ignored
                    self._rl_filled.add(vname)
                send.append((name, tensor))
                for alias, source in ties.items():
                    if source == vname and alias not in self._rl_filled:
                        self._rl_filled.add(alias)
                        aliases.append((alias, tensor))
        else:
            send = weights
        with set_current_vllm_config(self.vllm_config):
            model.load_weights(weights=send)
            for alias, tensor in aliases:
                param = model.get_parameter(alias)
                getattr(param, "weight_loader", default_weight_loader)(param, tensor)
        self._rl_loaded += len(weights)

    def _rl_load_planned(self, model, weights: list, live: bool = False) -> None:
        """Direct mode: the first sync records how ``load_weights`` copies each tensor (:mod:`rl_rollout.copy_plan`),
        later ones replay it as one fused copy; what the plan leaves out goes through ``load_weights``. The
        model's parameters are looked up once (:class:`~rl_rollout.copy_plan.ParamIndex`), checked for
        replacement once per session, and checked against the plan after every new lookup."""
        from vllm.config import set_current_vllm_config

        def load(ws):
            with set_current_vllm_config(self.vllm_config):
                model.load_weights(weights=ws)

        params = getattr(self, "_rl_session_params", None)
        fresh = False
        if params is None:
            index = getattr(self, "_rl_index", None)
            if index is None or not index.current():
                self._rl_index = index = ParamIndex(model)
                fresh = True
            self._rl_session_params = params = index.params
        plan = getattr(self, "_rl_plan", None)
        if plan is not None:
            try:
                if fresh:
                    plan.check_params(params)
                rest = plan.replay(weights, live=live)
                self._rl_plan_stats["copies"] += plan.last_copies
            except CopyPlanStale as e:
                logger.warning("weight copy plan is stale (%s): recording it again", e)
                plan = None
        if plan is None:
            self._rl_plan = plan = CopyPlan()
            rest = weights
        new = [(n, t) for n, t in rest if n not in plan.skipped]
        if new:  # not recorded yet (the first sync, or a group of it): recording loads them
            plan.add(load, new, params)
            self._rl_plan_stats["recorded"] += len(new)
        recorded = {n for n, _ in new}
        left = [(n, t) for n, t in rest if n in plan.skipped and n not in recorded]
        if left:
            load(left)
        self._rl_plan_stats["loader"] += len(rest)
        self._rl_loaded += len(weights)

    def rl_load_ipc(self, sync: bytes, verify: bool) -> int:
        """Load weights shared over CUDA IPC by a trainer on this GPU (:mod:`rl_rollout.ipc`).

        ``sync`` is a pickled :class:`~rl_rollout.ipc.IpcSync` (opened once per generation and
        kept) or a pickled list of one-shot :class:`~rl_rollout.ipc.IpcBucket`. Pickle, because a
        handle is a pickled rebuild call anyway: only from a trainer you trust. For the colocated
        (hybrid) placement on GPU (ran on an H200 under vLLM 0.26; the vLLM CPU build has no CUDA).
        """
        if not hasattr(self, "_rl_loaded"):
            raise RuntimeError("rl_load_ipc called outside a weight update: call rl_begin_weight_update first")
        shared = pickle.loads(sync)
        if isinstance(shared, IpcSync):
            if getattr(self, "_rl_ipc", None) is None:
                self._rl_ipc = IpcReceiver()  # keeps an IpcSender's buckets open across syncs
            # the receiver's views stay the same memory for the sender's whole generation: one load of all of them
            # as live tensors, so the copy plan keeps its source views and a steady sync is one fused copy
            weights = [pair for group in self._rl_ipc.load(shared, verify=verify) for pair in group]
            self._rl_load(weights, live=True)
            n = len(weights)
        else:
            n = 0
            for bucket in shared:  # one-shot buckets: each handle is opened, loaded and dropped
                weights = open_bucket(bucket, verify=verify)
                self._rl_load(weights)
                n += len(weights)
        # the copies out of the trainer's memory are done before it may write there again (its next step, or
        # its next sync's refill): this process's stream is not the trainer's
        torch.cuda.current_stream().synchronize()
        return n

    def rl_sync_ipc(self, sync: bytes, verify: bool) -> dict:
        """A whole CUDA IPC sync in one call: begin, :meth:`rl_load_ipc`, finish (the session closed on failure
        too); returns :meth:`rl_finish_weight_update`'s report. One RPC instead of three: with vLLM's engine core
        in a process of its own (an engine in a Ray actor) each RPC is a round trip through it."""
        self.rl_begin_weight_update()
        try:
            self.rl_load_ipc(sync, verify)
        except BaseException:
            self.rl_finish_weight_update()
            raise
        return self.rl_finish_weight_update()

    def rl_finish_weight_update(self) -> dict:
        """Re-process the remaining layers into kernel layout; returns ``{"tensors": n loaded in this
        session, "kept_old": [layers that got nothing], "partial": [layers that got part of their weights]}``."""
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        if not hasattr(self, "_rl_loaded"):
            raise RuntimeError("rl_finish_weight_update called without rl_begin_weight_update")
        model = self.model_runner.get_model()
        report: dict[str, Any]
        if self._rl_direct:  # nothing to re-process: the live parameters were filled in place
            plan = getattr(self, "_rl_plan", None)
            left = (
                {"left_out": len(plan.skipped), "left_out_examples": sorted(plan.skipped.items())[:6]} if plan else {}
            )
            # what an earlier sync sent and this one did not keeps its old values (the plan knows every name)
            missed = sorted((set(plan.entries) | set(plan.skipped)) - self._rl_seen) if plan and self._rl_seen else []
            report = {"kept_old": missed, "partial": [], "copy_plan": {**self._rl_plan_stats, **left}}
        else:
            report = _session_report(model)
            with set_current_vllm_config(self.vllm_config):
                finalize_layerwise_reload(model, self.vllm_config.model_config)
        report["tensors"] = self._rl_loaded
        del self._rl_loaded
        self._rl_session_params = None
        return report

    def rl_init_weight_group(
        self, master_addr: str, master_port: int, rank_offset: int, world_size: int, backend: str, timeout_s: float
    ) -> int:
        """Join the trainer's weight broadcast group; returns this worker's rank in it."""
        rank = rank_offset + self.rank
        device = "cpu" if backend == "gloo" else self.device
        self._rl_receiver = CollectiveReceiver(
            master_addr, master_port, rank, world_size, backend=backend, device=device, timeout_s=timeout_s
        )
        return rank

    def rl_receive_weights(self, verify: bool) -> dict:
        """Receive one broadcast sync into the open session; returns ``SyncStats.as_dict()``."""
        if not hasattr(self, "_rl_loaded"):
            raise RuntimeError("rl_receive_weights called outside a weight update: call rl_begin_weight_update first")
        receiver = getattr(self, "_rl_receiver", None)
        if receiver is None:
            raise RuntimeError("rl_receive_weights needs a weight group: call rl_init_weight_group first")

        # layerwise reload keeps a layer's tensors until the layer is complete: no buffer reuse
        return receiver.receive(self._rl_load, verify=verify, reuse_buffer=False).as_dict()

    def rl_weights_digest(self) -> str:
        """sha256 over the worker's parameters in name order. On CPU it misses the linear layers' weights
        (emptied once packed for the kernel) and the LM head's packed copy: use ``rl_weight_stats``."""
        h = hashlib.sha256()
        for name, p in sorted(self.model_runner.get_model().named_parameters()):
            h.update(name.encode())
            h.update(p.detach().float().cpu().contiguous().numpy().tobytes())
        return h.hexdigest()

    def rl_model_dtype(self) -> str:
        """The dtype the model's weights are held in (``"float32"``, ``"bfloat16"`` ...)."""
        return str(self.vllm_config.model_config.dtype).removeprefix("torch.")

    def rl_weight_stats(self, names: list[str]) -> dict:
        """What this worker holds for each HF name in ``names`` (module docstring), plus its tied aliases.

        Returns ``{"stats": {name: [numel, sum, sumsq, "shard" | "replica"]}, "ties": {alias: source},
        "missing": {name: reason}, "dropped": {name: reason}}`` (dropped: what vLLM's model leaves out by design
        and its loader skips, :class:`~rl_rollout.vllm_inspect.Dropped`); must not run inside a weight update
        session."""
        if hasattr(self, "_rl_loaded"):
            raise RuntimeError("rl_weight_stats during a weight update: call rl_finish_weight_update first")
        model = self.model_runner.get_model()
        mapper = getattr(model, "hf_to_vllm_mapper", None)
        packed = getattr(model, "packed_modules_mapping", {}) or {}
        ties = _tied_parameters(model)
        dtype = self.vllm_config.model_config.dtype
        rows_cache: dict[str, tuple] = {}
        stats, missing, dropped = {}, {}, {}
        with torch.no_grad():
            lookup = with_tower_level if _has_tower_level(model) else (lambda n: n)  # as _rl_load loaded them
            for name in list(names) + [a for a in ties if a not in names]:
                try:
                    stats[name] = param_stats(model, lookup(name), mapper, packed, dtype, rows_cache)
                except Dropped as e:
                    dropped[name] = str(e)
                except Unsupported as e:
                    missing[name] = str(e)
        return {"stats": stats, "ties": ties, "missing": missing, "dropped": dropped}
