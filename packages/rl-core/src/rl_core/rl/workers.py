"""The RL roles' workers: one object per rank of the policy, critic, reference and reward model.

Each worker owns a :class:`~rl_core.strategy.DeepSpeedStrategy` and one model, and
has plain methods that take and return picklable values (lists of experience items,
floats, dicts), so the same class runs in-process (:class:`rl_core.rl.groups.LocalGroup`,
``rl ppo``) and as a Ray actor per rank (rl-placement's ``RayActorGroup``,
``rl ppo-ray``). A group of several ranks is one data-parallel DeepSpeed world:
every rank gets the same call with its shard (``call_sharded``) and they step
together, so under ZeRO-3 each shard must hold the same number of items.

- :class:`PolicyWorker`: old logprobs, the clipped policy loss (+ KL loss, + the MoE load-balancing loss
  with ``aux_loss_coef``), weight broadcast to the rollout engines (rank 0 sends, every rank gathers under
  ZeRO-3), checkpoints and HF export (of the EMA weights with ``enable_ema``: :mod:`rl_core.rl.ema`). With
  LoRA (``load_kw["lora"]``, peft) only the adapter trains and every sync path sends the merged weights
  ``W + scale * B @ A`` under the base model's HF names (:func:`rl_core.hf_export.merge_lora_stream`): the
  engines never see peft names.
- :class:`CriticWorker`: values and the (clipped) value loss (a LoRA body too, as OpenRLHF's critic).
- Both: ``ds_offload`` / ``ds_reload``, DeepSpeed sleep (:mod:`rl_core.rl.ds_sleep`).
- The frozen roles, :class:`ReferenceWorker` (log-probs) and :class:`RewardModelWorker` (one score per
  sample), are in :mod:`rl_core.rl.frozen_workers`, on the same base class.

Every forward goes through :mod:`rl_core.rl.batching`: micro-batches of ``micro_train_batch_size`` items (the
no-grad ones ``forward_micro_batch_size``), or token-budget bins (``max_tokens_per_gpu``; a longer item alone),
padded rows or one packed row per micro-batch (``packing``); the per-token results come back as padded rows, so
the losses are the same either way. The accumulation boundary is set by hand at each global batch's last
micro-batch, since a token budget makes the count vary (the same on every rank:
:func:`~rl_core.rl.batching.equalise`).
"""

from __future__ import annotations

import logging
import os
import socket
import time
from dataclasses import replace

import torch

from rl_core.rl.batching import MicroBatchConfig, ModelInputs, equalise, memory_budget, plan_micro_batches, to_device
from rl_core.rl.ds_sleep import DeepSpeedSleep
from rl_core.rl.experience import Experience, TokenField, collate, rows, sequence
from rl_core.rl.objectives import CriticObjective, PolicyObjective

logger = logging.getLogger(__name__)


def read_once(sums: dict, device: torch.device) -> dict[str, float]:
    """A step's metrics, accumulated as device tensors (or floats) so that no micro-batch waits on the device,
    read to floats in one transfer."""
    keys = list(sums)
    flat = torch.stack([torch.as_tensor(sums[k], device=device).detach().double().reshape(()) for k in keys])
    return dict(zip(keys, flat.tolist(), strict=True))


def hf_names(named_params):
    """Actor parameter names (``model.<hf name>``) -> the engine's HF names."""
    for name, t in named_params:
        yield (name[len("model."):] if name.startswith("model.") else name), t


class _Worker:
    """Strategy, distributed init and micro-batched no-grad forwards shared by every role."""

    def __init__(self, strategy_cfg, *, pad_id: int = 0, batching: MicroBatchConfig | None = None,
                 packing: bool = False):
        from rl_core.strategy import DeepSpeedStrategy

        self.s = DeepSpeedStrategy(strategy_cfg)
        self.s.setup_distributed()
        self.pad_id = pad_id
        self.batching = batching or MicroBatchConfig()
        self.packing = packing
        self.micro_batch = self.batching.forward_micro_batch_size or strategy_cfg.micro_train_batch_size
        self._budgets: dict[bool, int] = {}  # the last auto token budgets, train and forward (logged on change)
        self.images = False  # a vision-language policy/reference: forwards take the items' image_inputs

    @property
    def rank(self) -> int:
        return self.s.rank

    def release_device_cache(self) -> dict[str, float]:
        """Before engines on this GPU wake: hand the blocks torch's caching allocator keeps (a train step's freed
        activations) back to the device, where the engines map their memory (OpenRLHF empties the cache there
        too). ``{"freed_bytes"}`` on CUDA, ``{}`` elsewhere."""
        if self.s.device.type != "cuda":
            return {}
        before = torch.cuda.memory_reserved(self.s.device)
        torch.cuda.empty_cache()
        return {"freed_bytes": float(before - torch.cuda.memory_reserved(self.s.device))}

    def world(self) -> dict:
        """This rank's place: rank, world size, device (for the controller's log and checks)."""
        from rl_core import ring_attention

        ring = ring_attention.current()
        return {"rank": self.s.rank, "world_size": self.s.world_size, "device": str(self.s.device),
                "pid": os.getpid(), "ring_attn": ring and f"{ring.rank} of {ring.size} in ranks {ring.first}-"
                                                          f"{ring.first + ring.size - 1}"}

    def _micro_batches(self, items: list[Experience], *, train: bool) -> list[list[int]]:
        """Indices of ``items`` per micro-batch; with a token budget, as many on every rank (collective)."""
        lengths = [it.T for it in items]
        if train:
            budget, micro = self.batching.max_tokens_per_gpu, self.s.cfg.micro_train_batch_size
        else:
            (budget, _), micro = self.batching.forward_budget(), self.micro_batch
        if budget == "auto":  # a worker built without build_run: what rl_core.rl.auto would choose here
            budget = "memory" if self.s.device.type == "cuda" and self.packing else None
        if budget == "memory":  # from free device memory now (rl_core.rl.auto chooses it on CUDA)
            budget = self._memory_budget(train)
        if budget is not None:  # per rank: with ring attention a rank holds 1/ring of each row (as OpenRLHF counts)
            budget *= self.s.cfg.ring_attn_size
        groups = plan_micro_batches(lengths, micro_batch=micro, max_tokens=budget, packing=self.packing)
        return groups if budget is None else equalise(groups, lengths, self.s, self.packing)

    def _memory_budget(self, train: bool) -> int | None:
        """The token budget from free memory (:func:`rl_core.rl.batching.memory_budget`); logged when it moves by a
        tenth.
        Without a CUDA device (a config resolved elsewhere) there is no memory to read: rows, with a warning."""
        if self.s.device.type != "cuda":
            if not getattr(self, "_warned_no_cuda", False):
                self._warned_no_cuda = True
                logger.warning("max_tokens_per_gpu memory on %s: no device memory to read, so micro-batches of "
                               "--micro_train_batch_size sequences", self.s.device.type)
            return None
        tokens, how = memory_budget(self.engine, self.s.device, train=train)
        last = self._budgets.get(train)
        if last is None or abs(tokens - last) > last // 10:
            if self.s.is_rank_0():
                logger.info("max_tokens_per_gpu from memory (%s): %s", "train" if train else "forward", how)
            self._budgets[train] = tokens
        return tokens

    def _model(self, fn, items: list[Experience]):
        """``fn(**model inputs)`` on one micro-batch; per-token results (a tensor or a tuple) as padded ``[B, T]``
        rows."""
        x = ModelInputs.of(items, self.pad_id, self.packing, self.s.device, images=self.images)
        return x.rows(fn(**x.kwargs))

    @torch.no_grad()
    def _forward_items(self, fn, items: list[Experience]) -> list:
        out: list = [None] * len(items)
        for idx in self._micro_batches(items, train=False):
            chunk = [items[i] for i in idx]
            res = self._model(fn, chunk)
            for i, r in zip(idx, rows(res, chunk) if res.dim() == 2 else [r.item() for r in res.float().cpu()],
                            strict=True):
                out[i] = r
        return out

    def _global_batches(self, items: list[Experience], epochs: int):
        """Each epoch's local slices of the global batches (items come in :func:`dp_order`)."""
        local = self.s.cfg.train_batch_size // self.s.dp_size
        if len(items) % local:
            raise ValueError(f"rank {self.rank}: {len(items)} items are not whole local batches of {local} "
                             f"(train_batch_size {self.s.cfg.train_batch_size} / {self.s.dp_size} data-parallel "
                             f"ranks)")
        for _ in range(epochs):
            for g in range(0, len(items), local):
                yield items[g:g + local]

    def _leader(self, out: list) -> list:
        """``out`` on the first rank of a ring attention group, ``[]`` on the others: they computed the same
        (``call_sharded`` concatenates the ranks' lists; :func:`rl_core.rl.experience.ring_shards` sent each
        group's ranks the same shard)."""
        return out if self.s.ring_rank == 0 else []

    def _global_seqs(self) -> int:
        """Sequences of a global batch counted over every rank (the seq-mean losses' normaliser): a ring
        attention group's ranks each count their shared slice, as :func:`_global_tokens` does."""
        return self.s.cfg.train_batch_size * self.s.cfg.ring_attn_size

    def _global_tokens(self, items: list[Experience]) -> torch.Tensor:
        """Loss tokens of this global batch over every rank (the losses' normaliser; a ring attention group's
        ranks each count their shared slice: rl_core.ring_attention says why that is the right gradient)."""
        local = torch.full((), float(sum(sum(it.loss_mask_T) for it in items)), device=self.s.device)  # no copy
        return self.s.all_reduce(local, "sum").clamp(min=1)

    def barrier(self) -> None:
        self.s.barrier()

    def save_checkpoint(self, path: str) -> str:
        """Collective: this rank's part of the model, optimizer, scheduler and RNG into ``path`` (DeepSpeed
        state), on disk when every rank returns. The loop's :class:`~rl_core.rl.checkpoint.RLCheckpoints`
        commits it with the other roles' parts."""
        from rl_core.checkpoint import save_engine_state

        return str(save_engine_state(self.s, self.engine, path, self._client_state()))

    def load_checkpoint(self, path: str) -> None:
        """Collective: restore what :meth:`save_checkpoint` wrote into ``path`` (unpickles: trusted only)."""
        from rl_core.checkpoint import load_engine_state

        self._restore_client_state(load_engine_state(self.engine, path), path)

    def _client_state(self) -> dict:
        """What this rank's checkpoint keeps beside the DeepSpeed state (a role's own cursors)."""
        return {}

    def _restore_client_state(self, client: dict, path: str) -> None:
        pass


class PolicyWorker(DeepSpeedSleep, _Worker):
    """One rank of the policy (actor): ``logprobs``, ``train``, weight broadcast, checkpoints, export."""

    def __init__(self, strategy_cfg, pretrain: str, objective: PolicyObjective, total_steps: int, *,
                 load_kw: dict | None = None, pad_id: int = 0, batching: MicroBatchConfig | None = None,
                 packing: bool = False, ptx: list[dict] | None = None):
        super().__init__(strategy_cfg, pad_id=pad_id, batching=batching, packing=packing)
        from rl_core.models import Actor

        self.objective = objective
        self.variant = objective.variant()  # built once (rl_algos.POLICY_LOSSES): clip, correction, aggregation
        # PPO-ptx: this rank's share of the pretraining items (input_ids, loss_mask), cycled in order
        self._ptx = [sequence(torch.as_tensor(row["input_ids"]).tolist(), torch.as_tensor(row["loss_mask"]).tolist())
                     for row in (ptx or [])[self.s.dp_rank::self.s.dp_size]]
        self._ptx_next = 0
        if ptx and objective.ptx_coef is None:
            raise ValueError("pretraining items (ptx=...) train with PPOConfig.ptx's coefficient: set "
                             "PPOConfig(ptx=PtxConfig(data=...)) (--pretrain_data), or pass no items")
        if ptx and not self._ptx:
            raise ValueError(f"--pretrain_data has {len(ptx)} usable rows, fewer than the {self.s.dp_size} "
                             f"data-parallel ranks of the policy; add rows or drop --pretrain_data")
        actor = Actor.from_pretrained(pretrain, **(load_kw or {}))
        self.images = actor.is_vlm
        if objective.loss.aux_loss_coef:
            actor.enable_moe_aux_loss()  # a model without experts is refused here, in one line
        # LoRA: the adapter's peft config; every sync sends merged weights (fresh tensors, never live ones)
        self._lora = getattr(actor.model, "peft_config", None)
        self.engine = self.s.prepare(actor, total_steps=total_steps)
        self._ema = None
        if objective.ema_beta is not None:
            from rl_core.rl.ema import EmaWeights

            self._ema = EmaWeights(self.engine.module, objective.ema_beta)
            logger.info("policy EMA (beta %g): %.3f GB on %s, rank %d", objective.ema_beta, self._ema.nbytes / 1e9,
                        self.s.device, self.rank)
        self._sender = None
        self._ipc = None  # an rl_rollout.ipc.IpcSender after the first share_weights_ipc
        self._live_params = self._live = None  # push_weights' live parameter list (ZeRO-0/1/2: _live_named)
        self._live_bytes = 0

    def logprobs(self, items: list[Experience]) -> list[torch.Tensor]:
        """Log-probs at the sampling temperature (what the engine sampled from)."""
        t = self.objective.temperature
        self.engine.eval()
        try:
            return self._leader(self._forward_items(lambda **x: self.engine(**x, temperature=t).logprobs, items))
        finally:
            self.engine.train()

    def train(self, items: list[Experience], kl_coef: float = 0.0, on_policy: bool = False) -> list[dict[str, float]]:
        """Policy epochs over this rank's slices of every global batch (items in ``dp_order``).

        ``on_policy``: the items carry no old log-probs because this is the only optimizer step on them (one
        epoch, one global batch): the weights have not moved since the engine sampled, so the old log-probs
        are this forward's, detached (ratio 1), and the experience phase skips a whole forward (as TRL does).
        The rollout log-prob gap is then measured here (``rollout_logprob_gap``, ``rollout_gap_tokens``).

        Returns ``[metrics]`` (a list, as ``call_sharded`` wants), averaged over steps and ranks."""
        from rl_algos import aggregate_loss, approx_kl

        o, variant, dev, world = self.objective, self.variant, self.s.device, self.s.world_size
        entropy_coef, aux_coef = o.loss.entropy_coef, o.loss.aux_loss_coef
        has_rollout = all(it.rollout_logprobs_T is not None for it in items)
        use_rollout = variant.needs_rollout_logprobs or (on_policy and has_rollout)
        kl_loss = o.kl_loss is not None  # no reference (--init_kl_coef 0): no KL to measure, 0 logged
        fields: list[TokenField] = ["advantages"]
        fields += ([] if on_policy else ["old_logprobs"]) + (["ref_logprobs"] if kl_loss else []) \
            + (["rollout_logprobs"] if use_rollout else [])
        sums = {"policy_loss": 0.0, "clip_fraction": 0.0, "kl_loss": 0.0}
        entropy = entropy_coef is not None  # OpenRLHF: any coefficient, 0 too, computes and logs it
        if entropy:
            sums["entropy"] = 0.0
        gap_sum = gap_tokens = 0.0
        steps = 0
        self.engine.train()
        G = self._global_seqs()

        aux: list[torch.Tensor] = []  # the MoE router's load-balancing loss of the last forward
        if aux_coef:
            sums["aux_loss"] = 0.0
        if self._ptx:
            sums["ptx_loss"] = 0.0

        def forward(**x):  # with the entropy: log-probs and entropy from one pass over the logits
            out = self.engine(**x, temperature=o.temperature, return_entropy=entropy)
            if aux_coef:
                aux[:] = [out.aux_loss]
            return (out.logprobs, out.entropy) if entropy else out.logprobs

        for chunk in self._global_batches(items, o.epochs):
            total = self._global_tokens(chunk)
            groups = self._micro_batches(chunk, train=True)
            for k, idx in enumerate(groups):
                sub = [chunk[i] for i in idx]
                b = collate(sub, self.pad_id, fields).to(lambda t: to_device(t, dev))
                m = b.loss_mask_BT
                self.s.accumulation_boundary(self.engine, k == len(groups) - 1)
                lp, ent = self._model(forward, sub) if entropy else (self._model(forward, sub), None)
                rollout = b.token("rollout_logprobs") if use_rollout else None
                old = lp.detach() if on_policy else b.token("old_logprobs")
                if on_policy and rollout is not None:  # device tensors: no host sync between the micro-batches
                    gap_sum = gap_sum + ((old - rollout).abs() * m).sum()
                    gap_tokens = gap_tokens + m.sum()
                out = variant.loss(lp, old, b.token("advantages"), m,
                                   rollout_logprobs_BT=rollout if variant.needs_rollout_logprobs else None,
                                   global_tokens=total, global_seqs=G, dp_size=world, norm_len=o.norm_len)
                loss = out.loss
                if kl_loss:
                    kl = approx_kl(lp, b.token("ref_logprobs"), o.kl_loss, mask=m)
                    kl_term = aggregate_loss(kl, m, "token-mean", global_tokens=total, dp_size=world)
                    loss = loss + kl_coef * kl_term
                    sums["kl_loss"] += kl_term.detach() / world
                if entropy:
                    ent_term = aggregate_loss(ent, m, "token-mean", global_tokens=total, dp_size=world)
                    if entropy_coef:
                        loss = loss - entropy_coef * ent_term
                    sums["entropy"] += ent_term.detach() / world
                if aux_coef:  # OpenRLHF: coef x aux per micro-batch, weighted by its share of the samples
                    share_n = len(sub) / len(chunk)
                    loss = loss + aux_coef * share_n * aux[0]
                    sums["aux_loss"] += aux[0].detach() * share_n / world
                if self._ptx:  # one backward for both: the policy micro-batch and a pretraining one
                    nll = self._ptx_nll()
                    loss = loss + o.ptx_coef * nll / len(groups)
                    sums["ptx_loss"] += nll.detach() / len(groups) / world
                self.s.backward(loss, self.engine)
                if self.s.optimizer_step(self.engine) and self._ema is not None:
                    self._ema.update()
                sums["policy_loss"] += out.loss.detach() / world
                sums["clip_fraction"] += out.clip_fraction * (m.sum() / total)
            steps += 1
        sums = {k: v / max(steps, 1) for k, v in sums.items()}
        if on_policy and has_rollout:
            sums.update(rollout_gap_sum=gap_sum, rollout_gap_tokens=gap_tokens)
        sums = self.s.all_reduce(read_once(sums, dev), "sum")  # per-rank shares -> global step means
        if "rollout_gap_tokens" in sums:
            sums["rollout_logprob_gap"] = sums.pop("rollout_gap_sum") / max(sums.pop("rollout_gap_tokens"), 1.0)
        sums["lr"] = self.engine.get_lr()[0]
        if True in self._budgets:  # the token budget free memory gave (rank 0's)
            sums["max_tokens_per_gpu"] = float(self._budgets[True])
        return self._leader([sums])

    def _client_state(self) -> dict:
        return {"ptx_next": self._ptx_next} if self._ptx else {}

    def _restore_client_state(self, client: dict, path: str) -> None:
        if not self._ptx:
            return
        if "ptx_next" not in client:  # saved before the cursor was kept, or without --pretrain_data
            logger.warning("checkpoint %s holds no position in --pretrain_data: its rows cycle from the first again",
                           path)
            return
        self._ptx_next = int(client["ptx_next"]) % len(self._ptx)  # a resume on other ranks reshards the rows

    def _ptx_nll(self) -> torch.Tensor:
        """PPO-ptx (OpenRLHF's ptx loss, Ouyang et al. 2022 arXiv:2203.02155 eq. 2): the token-mean NLL, at
        temperature 1, of the next ``micro_train_batch_size`` pretraining items of this rank (cycled)."""
        n = self.s.cfg.micro_train_batch_size
        sub = [self._ptx[(self._ptx_next + i) % len(self._ptx)] for i in range(n)]
        self._ptx_next = (self._ptx_next + n) % len(self._ptx)
        lp = self._model(lambda **x: self.engine(**x).logprobs, sub)
        m = collate(sub, self.pad_id).loss_mask_BT.to(lp.device)
        return -(lp * m).sum() / m.sum().clamp(min=1)

    # ----- weights to the rollout engines --------------------------------------------------

    def weight_sender_address(self) -> tuple[str, int]:
        """This node's address (MASTER_ADDR of the group, else this host) and a port free here now."""
        addr = os.environ.get("MASTER_ADDR") or socket.gethostbyname(socket.gethostname())
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind(("", 0))
            return addr, sock.getsockname()[1]

    def init_weight_sender(self, master_addr: str, master_port: int, world_size: int, backend: str = "gloo",
                           timeout_s: float = 600.0) -> None:
        """Rank 0 joins the engines' weight group as its sender (blocks until every engine worker joined)."""
        if self.rank == 0:
            from rl_rollout.transport import CollectiveSender

            device = self.s.device if backend == "nccl" else "cpu"
            self._sender = CollectiveSender(master_addr, master_port, world_size, backend=backend, device=device,
                                            timeout_s=timeout_s)

    def _sync_named(self, merge: bool = True):
        """``(HF name, full tensor)`` of what the engines hold, bucket by bucket (a collective gather per bucket
        under ZeRO-3: every rank iterates it to the end). LoRA: the merged weights when ``merge`` (ranks that
        only take part in the gathers pass False)."""
        named = (nt for bucket in self.s.named_parameter_buckets(self.engine.module) for nt in hf_names(bucket))
        if self._lora is None or not merge:
            return named
        from rl_core.hf_export import merge_lora_stream

        return merge_lora_stream(named, self._lora)

    def broadcast_weights(self, version: int, verify: bool = False) -> dict | None:
        """Every rank gathers (ZeRO-3); rank 0 broadcasts each bucket to the engines. Rank 0 returns the stats."""
        if self.rank != 0:
            for _ in self._sync_named(merge=False):  # take part in each bucket's gather
                pass
            return None
        if self._sender is None:
            raise RuntimeError("broadcast_weights before init_weight_sender: the weight group is not set up")
        stats = self._sender.send(self._sync_named(), version, checksum=verify)
        return stats.as_dict()

    def push_weights(self, engine, version: int, verify: bool = False) -> dict:
        """In-process sync: every bucket into ``engine.update_weights`` in one call (one vLLM reload session),
        tensors handed over where they are (a GPU policy's stay on the GPU). An engine that
        ``hands_over_tensors`` (in-process vLLM) gets the live parameters under ZeRO-0/1/2, no copy
        (``live=True``); ZeRO-3 gathers bucket by bucket. LoRA: the merged weights, fresh copies (never
        ``live``). ``verify``: the engine then checks it holds what was sent (count, sum and sum of squares
        per tensor; raises WeightSyncError)."""
        from rl_rollout.weights import tensor_stats

        cuda = torch.device(self.s.device).type == "cuda"
        if cuda:  # the train step's kernels are done before the clock starts, the copies before it stops
            torch.cuda.synchronize(self.s.device)
        t0, nbytes, stats = time.perf_counter(), 0, {}
        dtype = getattr(engine, "dtype", None) if verify else None

        def named():
            nonlocal nbytes
            for name, t in self._sync_named():
                nbytes += t.numel() * t.element_size()
                if verify:  # while the bucket is alive (gathered under ZeRO-3)
                    stats[name] = tensor_stats(t, dtype)
                yield name, t

        if self.s.cfg.zero_stage != 3 and self._lora is None and getattr(engine, "hands_over_tensors", False):
            # an in-process engine takes the live weights, no copy (its copy plan keeps its views of them)
            live = self._live_named()
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

    def _live_named(self) -> list[tuple[str, torch.Tensor]]:
        """``(hf name, detached parameter)`` of the whole (not partitioned: ZeRO-0/1/2) policy, built once and
        rebuilt when a parameter's storage changed (DeepSpeed re-pointing ``p.data``, a reload)."""
        params = self._live_params if self._live_params is not None else list(self.engine.module.named_parameters())
        cached = self._live
        if cached is None or any(p.data_ptr() != t.data_ptr() for (_, p), (_, t) in zip(params, cached, strict=True)):
            self._live_params = params
            self._live = cached = list(hf_names((n, p.detach()) for n, p in params))
            self._live_bytes = sum(t.numel() * t.element_size() for _, t in cached)
        return cached

    def weight_stats(self) -> dict | None:
        """Per-tensor count, sum and sum of squares (HF names) of the policy's weights, on rank 0 (None
        elsewhere): what an engine's ``verify_weights`` checks. Collective under ZeRO-3."""
        from rl_rollout.weights import tensor_stats

        out = {n: tensor_stats(t) for n, t in self._sync_named(merge=self.rank == 0)}
        return out if self.rank == 0 else None

    def share_weights_ipc(self, version: int, verify: bool = False) -> dict:
        """Hybrid engine on this rank's GPU: returns ``{"sync": IpcSync, "bytes": n, "in_place": bool}`` for the
        engine it shares the GPU with (a few hundred bytes cross the process boundary after the first sync).

        ZeRO-0/1/2 without LoRA: the parameters' own memory is shared (rl-rollout's ``IpcSender(pack="auto")``):
        no copy here, the engine's load is the sync's one device copy, no second copy of the model on the GPU.
        If the weights moved since the last sync (DeepSpeed sleep offloads and reloads them), the sender packs
        from then on. ZeRO-3 (gathered copies) and LoRA (merged ones): every rank copies the full weights into
        persistent CUDA IPC buckets. Either way the trainer must not change what it shared until the engine
        loaded it: call again only after the engine's load returned (:class:`rl_core.rl.groups.IpcWeightSync`)."""
        from rl_rollout.ipc import IpcSender

        t0 = time.perf_counter()
        gathered = self.s.cfg.zero_stage == 3 or self._lora is not None
        if self._ipc is None:
            self._ipc = IpcSender(device=self.s.device, pack=True if gathered else "auto", checksum=verify)
        named = list(self._sync_named()) if gathered else self._live_named()
        sync = self._ipc.share(named)
        # work_s: this method's own time (the stream wait, the layout check; a pack's copy): the rest of the
        # trainer's call is Ray's
        return {"sync": sync, "bytes": self._ipc.nbytes, "in_place": not self._ipc.pack,
                "work_s": time.perf_counter() - t0}

    def weights_digest(self) -> dict[str, float]:
        """Per-parameter sums (HF names), to check an engine holds these weights. Collective under ZeRO-3."""
        return {n: t.double().sum().item() for n, t in self._sync_named()}

    # ----- export ------------------------------------------------------------------------------

    def export(self, save_path: str, tokenizer_path: str | None = None) -> str:
        """The HF export of the policy, or of its EMA weights with ``enable_ema`` (as OpenRLHF's save_model)."""
        from rl_core.hf_export import export_hf

        tok = None
        if tokenizer_path:
            from transformers import AutoProcessor, AutoTokenizer

            # a VLM's processor (tokenizer, image processor, chat template) goes with it, so the export loads whole
            tok = (AutoProcessor if self.images else AutoTokenizer).from_pretrained(tokenizer_path)
        state = None
        if self._ema is not None:  # the frozen weights are the policy's; the trained ones the EMA's
            state = self.s.full_state_dict(self.engine.module)
            state.update(self._ema.full_state())
        return str(export_hf(self.s, self.engine, save_path, tokenizer=tok, state=state))

    def save_checkpoint(self, path: str) -> str:
        """The DeepSpeed state, and with ``enable_ema`` this rank's EMA weights beside it (collective)."""
        out = super().save_checkpoint(path)
        if self._ema is not None:
            self._ema.save(path, self.rank)
            self.s.barrier()
        return out

    def load_checkpoint(self, path: str) -> None:
        super().load_checkpoint(path)
        if self._ema is not None:
            self._ema.load(path, self.rank)

    def ds_offload(self, optimizer_only: bool = False) -> dict[str, float]:
        if self._ema is not None:  # not needed while the engines generate
            self._ema.to("cpu")
        return super().ds_offload(optimizer_only)

    def ds_reload(self) -> dict[str, float]:
        if self._ema is not None:
            self._ema.to(self.s.device)
        return super().ds_reload()


class CriticWorker(DeepSpeedSleep, _Worker):
    """One rank of the critic: ``values`` and ``train`` on returns with the (clipped) value loss."""

    def __init__(self, strategy_cfg, pretrain: str, objective: CriticObjective, total_steps: int, *,
                 load_kw: dict | None = None, pad_id: int = 0, batching: MicroBatchConfig | None = None,
                 packing: bool = False):
        strategy_cfg = replace(strategy_cfg, **objective.optimizer.overrides())  # its own optimizer, schedule, clipping
        super().__init__(strategy_cfg, pad_id=pad_id, batching=batching, packing=packing)
        from rl_core.models import Critic

        self.objective = objective
        self.engine = self.s.prepare(Critic.from_pretrained(pretrain, **(load_kw or {})), total_steps=total_steps)

    def values(self, items: list[Experience]) -> list[torch.Tensor]:
        self.engine.eval()
        try:
            return self._leader(self._forward_items(lambda **x: self.engine(**x), items))
        finally:
            self.engine.train()

    def train(self, items: list[Experience]) -> list[dict[str, float]]:
        """Critic epochs, like :meth:`PolicyWorker.train`; returns ``[metrics]``."""
        from rl_algos import value_loss

        o, dev, world = self.objective, self.s.device, self.s.world_size
        sums: dict = {"critic_loss": 0.0, "value_clip_fraction": 0.0}
        steps = 0
        self.engine.train()
        for chunk in self._global_batches(items, o.epochs):
            total = self._global_tokens(chunk)
            groups = self._micro_batches(chunk, train=True)
            for k, idx in enumerate(groups):
                sub = [chunk[i] for i in idx]
                b = collate(sub, self.pad_id, ("values", "returns")).to(lambda t: to_device(t, dev))
                m = b.loss_mask_BT
                self.s.accumulation_boundary(self.engine, k == len(groups) - 1)
                v = self._model(lambda **x: self.engine(**x), sub)
                out = value_loss(v, b.token("values"), b.token("returns"), m, clip_eps=o.value_clip,
                                 global_tokens=total, dp_size=world)
                self.s.backward(out.loss, self.engine)
                self.s.optimizer_step(self.engine)
                sums["critic_loss"] += out.loss.detach() / world
                sums["value_clip_fraction"] += out.clip_fraction * (m.sum() / total)
            steps += 1
        sums = read_once({k: v / max(steps, 1) for k, v in sums.items()}, dev)
        return self._leader([self.s.all_reduce(sums, "sum")])

    def export(self, save_path: str, tokenizer_path: str | None = None) -> str:
        from rl_core.hf_export import export_hf

        return str(export_hf(self.s, self.engine, save_path))


def __getattr__(name: str):  # the frozen roles live in rl_core.rl.frozen_workers; old imports keep working
    if name in ("ReferenceWorker", "RewardModelWorker"):
        from rl_core.rl import frozen_workers

        return getattr(frozen_workers, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
