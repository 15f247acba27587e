"""The policy's weights on their way to the rollout engines: one object per policy rank, owned by
:class:`rl_core.rl.workers.PolicyWorker` (whose Ray-callable methods hand over to it).

Four paths, one per placement (:mod:`rl_core.rl.groups` picks): a collective broadcast from rank 0 to engine
workers in other processes (:meth:`PolicyWeights.init_sender` / :meth:`broadcast`), an in-process hand-over
(:meth:`push`), CUDA IPC to an engine sharing this rank's GPU (:meth:`share_ipc`), and checks of what an engine
holds (:meth:`stats`, :meth:`digest`). Names are the engines' HF names (:func:`hf_names`); with LoRA every path
sends the merged weights ``W + scale * B @ A`` (:func:`rl_core.hf_export.merge_lora_stream`); under ZeRO-3
every rank takes part in each bucket's gather.
"""

from __future__ import annotations

import os
import socket
import time

import torch

from rl_core.hf_export import merge_lora_stream
from rl_rollout.ipc import IpcSender
from rl_rollout.transport import CollectiveSender
from rl_rollout.weights import tensor_stats


def hf_names(named_params):
    """Actor parameter names (``model.<hf name>``) -> the engine's HF names."""
    for name, t in named_params:
        yield (name[len("model.") :] if name.startswith("model.") else name), t


class PolicyWeights:
    """What the engines need of one policy rank's weights. ``strategy``: the rank's DeepSpeedStrategy;
    ``module``: a callable giving the trained module now (the DeepSpeed engine's ``module``); ``lora``: the
    adapter's peft config, or None."""

    def __init__(self, strategy, module, lora=None):
        self.s, self._module, self._lora = strategy, module, lora
        self._sender = None  # rl_rollout.transport.CollectiveSender on rank 0 after init_sender
        self._ipc = None  # an rl_rollout.ipc.IpcSender after the first share_ipc
        self._live_params = self._live = None  # the live parameter list (ZeRO-0/1/2: live_named)
        self._live_bytes = 0

    @property
    def rank(self) -> int:
        return self.s.rank

    @staticmethod
    def address() -> tuple[str, int]:
        """This node's address (MASTER_ADDR of the group, else this host) and a port free here now."""
        addr = os.environ.get("MASTER_ADDR") or socket.gethostbyname(socket.gethostname())
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind(("", 0))
            return addr, sock.getsockname()[1]

    def init_sender(
        self, master_addr: str, master_port: int, world_size: int, backend: str = "gloo", timeout_s: float = 600.0
    ) -> None:
        """Rank 0 joins the engines' weight group as its sender (blocks until every engine worker joined)."""
        if self.rank == 0:
            device = self.s.device if backend == "nccl" else "cpu"
            self._sender = CollectiveSender(
                master_addr, master_port, world_size, backend=backend, device=device, timeout_s=timeout_s
            )

    def named(self, merge: bool = True):
        """``(HF name, full tensor)`` of what the engines hold, bucket by bucket (a collective gather per bucket
        under ZeRO-3: every rank iterates it to the end). LoRA: the merged weights when ``merge`` (ranks that
        only take part in the gathers pass False)."""
        named = (nt for bucket in self.s.named_parameter_buckets(self._module()) for nt in hf_names(bucket))
        if self._lora is None or not merge:
            return named

        return merge_lora_stream(named, self._lora)

    def broadcast(self, version: int, verify: bool = False) -> dict | None:
        """Every rank gathers (ZeRO-3); rank 0 broadcasts each bucket to the engines. Rank 0 returns the stats."""
        if self.rank != 0:
            for _ in self.named(merge=False):  # take part in each bucket's gather
                pass
            return None
        if self._sender is None:
            raise RuntimeError("broadcast_weights before init_weight_sender: the weight group is not set up")
        stats = self._sender.send(self.named(), version, checksum=verify)
        return stats.as_dict()

    def push(self, engine, version: int, verify: bool = False) -> dict:
        """In-process sync: every bucket into ``engine.update_weights`` in one call (one vLLM reload session),
        tensors handed over where they are (a GPU policy's stay on the GPU). An engine that
        ``hands_over_tensors`` (in-process vLLM) gets the live parameters under ZeRO-0/1/2, no copy
        (``live=True``); ZeRO-3 gathers bucket by bucket. LoRA: the merged weights, fresh copies (never
        ``live``). ``verify``: the engine then checks it holds what was sent (count, sum and sum of squares
        per tensor; raises WeightSyncError)."""

        cuda = torch.device(self.s.device).type == "cuda"
        if cuda:  # the train step's kernels are done before the clock starts, the copies before it stops
            torch.cuda.synchronize(self.s.device)
        t0, nbytes, stats = time.perf_counter(), 0, {}
        dtype = getattr(engine, "dtype", None) if verify else None

        def named():
            nonlocal nbytes
            for name, t in self.named():
                nbytes += t.numel() * t.element_size()
                if verify:  # while the bucket is alive (gathered under ZeRO-3)
                    stats[name] = tensor_stats(t, dtype)
                yield name, t

        if self.s.cfg.zero_stage != 3 and self._lora is None and getattr(engine, "hands_over_tensors", False):
            # an in-process engine takes the live weights, no copy (its copy plan keeps its views of them)
            live = self.live_named()
            if verify:
                stats = {name: tensor_stats(t, dtype) for name, t in live}
            engine.update_weights(live, version=version, live=True)
            nbytes = self._live_bytes
        else:
            engine.update_weights(named(), version=version)
        if cuda:
            torch.cuda.synchronize(self.s.device)
        sec = time.perf_counter() - t0
        out = {"version": version, "bytes": nbytes, "seconds": sec, "gb_per_s": nbytes / max(sec, 1e-9) / 1e9}
        if verify:
            out["verify_s"] = engine.verify_weights(stats)["seconds"]
        return out

    def live_named(self) -> list[tuple[str, torch.Tensor]]:
        """``(hf name, detached parameter)`` of the whole (not partitioned: ZeRO-0/1/2) policy, built once and
        rebuilt when a parameter's storage changed (DeepSpeed re-pointing ``p.data``, a reload)."""
        params = self._live_params if self._live_params is not None else list(self._module().named_parameters())
        cached = self._live
        if cached is None or any(p.data_ptr() != t.data_ptr() for (_, p), (_, t) in zip(params, cached, strict=True)):
            self._live_params = params
            self._live = cached = list(hf_names((n, p.detach()) for n, p in params))
            self._live_bytes = sum(t.numel() * t.element_size() for _, t in cached)
        return cached

    def stats(self) -> dict | None:
        """Per-tensor count, sum and sum of squares (HF names) of the policy's weights, on rank 0 (None
        elsewhere): what an engine's ``verify_weights`` checks. Collective under ZeRO-3."""

        out = {n: tensor_stats(t) for n, t in self.named(merge=self.rank == 0)}
        return out if self.rank == 0 else None

    def share_ipc(self, version: int, verify: bool = False) -> dict:
        """Hybrid engine on this rank's GPU: returns ``{"sync": IpcSync, "bytes": n, "in_place": bool}`` for the
        engine it shares the GPU with (a few hundred bytes cross the process boundary after the first sync).

        ZeRO-0/1/2 without LoRA: the parameters' own memory is shared (rl-rollout's ``IpcSender(pack="auto")``):
        no copy here, the engine's load is the sync's one device copy, no second copy of the model on the GPU.
        If the weights moved since the last sync (DeepSpeed sleep offloads and reloads them), the sender packs
        from then on. ZeRO-3 (gathered copies) and LoRA (merged ones): every rank copies the full weights into
        persistent CUDA IPC buckets. Either way the trainer must not change what it shared until the engine
        loaded it: call again only after the engine's load returned (:class:`rl_core.rl.weight_syncs.IpcWeightSync`)."""

        t0 = time.perf_counter()
        gathered = self.s.cfg.zero_stage == 3 or self._lora is not None
        if self._ipc is None:
            self._ipc = IpcSender(device=self.s.device, pack=True if gathered else "auto", checksum=verify)
        named = list(self.named()) if gathered else self.live_named()
        sync = self._ipc.share(named)
        # work_s: this method's own time (the stream wait, the layout check; a pack's copy): the rest of the
        # trainer's call is Ray's
        return {
            "sync": sync,
            "bytes": self._ipc.nbytes,
            "in_place": not self._ipc.pack,
            "work_s": time.perf_counter() - t0,
        }

    def digest(self) -> dict[str, float]:
        """Per-parameter sums (HF names), to check an engine holds these weights. Collective under ZeRO-3."""
        return {n: t.double().sum().item() for n, t in self.named()}
