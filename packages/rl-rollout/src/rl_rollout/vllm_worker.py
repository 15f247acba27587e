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
weights on load, so they cannot be compared with the bytes sent). Imported inside vLLM workers only: vLLM imports stay inside methods.
"""

from __future__ import annotations

import hashlib

from rl_rollout.weights import unpack_bucket


class WorkerExtension:
    """Methods added to vLLM's worker (``self`` is the worker; ``self.model_runner`` exists)."""

    def rl_begin_weight_update(self) -> None:
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        with set_current_vllm_config(self.vllm_config):
            initialize_layerwise_reload(self.model_runner.get_model())
        self._rl_loaded = 0

    def load_weights(self, meta: bytes, payload: bytes) -> int:
        """Load one weight bucket (HF parameter names); returns the number of tensors in it."""
        from vllm.config import set_current_vllm_config

        if not hasattr(self, "_rl_loaded"):
            raise RuntimeError("load_weights called outside a weight update: call rl_begin_weight_update first")
        weights = unpack_bucket(meta, payload)
        with set_current_vllm_config(self.vllm_config):
            self.model_runner.get_model().load_weights(weights=weights)
        self._rl_loaded += len(weights)
        return len(weights)

    def rl_load_ipc(self, sync: bytes, verify: bool) -> int:
        """Load weights shared over CUDA IPC by a trainer on this GPU (:mod:`rl_rollout.ipc`).

        ``sync`` is a pickled :class:`~rl_rollout.ipc.IpcSync` (opened once per generation and
        kept) or a pickled list of one-shot :class:`~rl_rollout.ipc.IpcBucket`. Pickle, because a
        handle is a pickled rebuild call anyway: only from a trainer you trust. For the colocated
        (hybrid) placement on GPU (ran on an H200 under vLLM 0.26; the vLLM CPU build has no CUDA).
        """
        import pickle

        from vllm.config import set_current_vllm_config

        from rl_rollout.ipc import IpcReceiver, IpcSync, open_bucket

        if not hasattr(self, "_rl_loaded"):
            raise RuntimeError("rl_load_ipc called outside a weight update: call rl_begin_weight_update first")
        shared = pickle.loads(sync)
        if isinstance(shared, IpcSync):
            if getattr(self, "_rl_ipc", None) is None:
                self._rl_ipc = IpcReceiver()  # keeps an IpcSender's buckets open across syncs
            groups = self._rl_ipc.load(shared, verify=verify)
        else:
            groups = (open_bucket(bucket, verify=verify) for bucket in shared)
        n = 0
        for weights in groups:
            with set_current_vllm_config(self.vllm_config):
                self.model_runner.get_model().load_weights(weights=weights)
            n += len(weights)
        self._rl_loaded += n
        return n

    def rl_finish_weight_update(self) -> int:
        """Re-process the layers into kernel layout; returns the tensors loaded in this session."""
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        if not hasattr(self, "_rl_loaded"):
            raise RuntimeError("rl_finish_weight_update called without rl_begin_weight_update")
        with set_current_vllm_config(self.vllm_config):
            finalize_layerwise_reload(self.model_runner.get_model(), self.vllm_config.model_config)
        n = self._rl_loaded
        del self._rl_loaded
        return n

    def rl_init_weight_group(
        self, master_addr: str, master_port: int, rank_offset: int, world_size: int, backend: str, timeout_s: float
    ) -> int:
        """Join the trainer's weight broadcast group; returns this worker's rank in it."""
        from rl_rollout.transport import CollectiveReceiver

        rank = rank_offset + self.rank
        device = "cpu" if backend == "gloo" else self.device
        self._rl_receiver = CollectiveReceiver(
            master_addr, master_port, rank, world_size, backend=backend, device=device, timeout_s=timeout_s
        )
        return rank

    def rl_receive_weights(self, verify: bool) -> dict:
        """Receive one broadcast sync into the open session; returns ``SyncStats.as_dict()``."""
        from vllm.config import set_current_vllm_config

        if not hasattr(self, "_rl_loaded"):
            raise RuntimeError("rl_receive_weights called outside a weight update: call rl_begin_weight_update first")
        receiver = getattr(self, "_rl_receiver", None)
        if receiver is None:
            raise RuntimeError("rl_receive_weights needs a weight group: call rl_init_weight_group first")

        def load(weights) -> None:
            with set_current_vllm_config(self.vllm_config):
                self.model_runner.get_model().load_weights(weights=weights)
            self._rl_loaded += len(weights)

        # layerwise reload keeps a layer's tensors until the layer is complete: no buffer reuse
        return receiver.receive(load, verify=verify, reuse_buffer=False).as_dict()

    def rl_weights_digest(self) -> str:
        """sha256 over the worker's parameters in name order: changes iff a weight changed."""
        h = hashlib.sha256()
        for name, p in sorted(self.model_runner.get_model().named_parameters()):
            h.update(name.encode())
            h.update(p.detach().float().cpu().contiguous().numpy().tobytes())
        return h.hexdigest()
