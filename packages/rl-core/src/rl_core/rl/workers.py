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
  ZeRO-3: :mod:`rl_core.rl.policy_weights`), checkpoints and HF export (of the EMA weights with
  ``enable_ema``: :mod:`rl_core.rl.ema`). With LoRA (``load_kw["lora"]``, peft) only the adapter trains and
  every sync path sends the merged weights ``W + scale * B @ A`` under the base model's HF names
  (:func:`rl_core.hf_export.merge_lora_stream`): the engines never see peft names.
- :class:`CriticWorker`: values and the (clipped) value loss (a LoRA body too, as OpenRLHF's critic).
- Both: ``ds_offload`` / ``ds_reload``, DeepSpeed sleep (:mod:`rl_core.rl.ds_sleep`); what every role's rank
  shares (micro-batches, forwards, checkpoints) is :class:`rl_core.rl.worker_base._Worker`.
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
from dataclasses import replace

import torch

from rl_algos import aggregate_loss, approx_kl, value_loss
from rl_core.hf_export import export_hf
from rl_core.model_rows import align_to_tokens
from rl_core.models import Actor, Critic
from rl_core.rl.batching import MicroBatchConfig, to_device
from rl_core.rl.distill_topk import predicting_layout
from rl_core.rl.ds_sleep import DeepSpeedSleep
from rl_core.rl.ema import EmaWeights
from rl_core.rl.experience import Experience, TokenField, collate, sequence
from rl_core.rl.objectives import CriticObjective, PolicyObjective
from rl_core.rl.policy_weights import PolicyWeights
from rl_core.rl.worker_base import _Worker, read_once

logger = logging.getLogger(__name__)


class PolicyWorker(DeepSpeedSleep, _Worker):
    """One rank of the policy (actor): ``logprobs``, ``train``, weight broadcast, checkpoints, export."""

    def __init__(
        self,
        strategy_cfg,
        pretrain: str,
        objective: PolicyObjective,
        total_steps: int,
        *,
        load_kw: dict | None = None,
        pad_id: int = 0,
        batching: MicroBatchConfig | None = None,
        packing: bool = False,
        ptx: list[dict] | None = None,
    ):
        super().__init__(strategy_cfg, pad_id=pad_id, batching=batching, packing=packing)

        self.objective = objective
        self.variant = objective.variant()  # built once (rl_algos.POLICY_LOSSES): clip, correction, aggregation
        # PPO-ptx: this rank's share of the pretraining items (input_ids, loss_mask), cycled in order
        self._ptx = [
            sequence(torch.as_tensor(row["input_ids"]).tolist(), torch.as_tensor(row["loss_mask"]).tolist())
            for row in (ptx or [])[self.s.dp_rank :: self.s.dp_size]
        ]
        self._ptx_next = 0
        if ptx and objective.ptx_coef is None:
            raise ValueError(
                "pretraining items (ptx=...) train with PPOConfig.ptx's coefficient: set "
                "PPOConfig(ptx=PtxConfig(data=...)) (--pretrain_data), or pass no items"
            )
        if ptx and not self._ptx:
            raise ValueError(
                f"--pretrain_data has {len(ptx)} usable rows, fewer than the {self.s.dp_size} "
                f"data-parallel ranks of the policy; add rows or drop --pretrain_data"
            )
        actor = Actor.from_pretrained(pretrain, **(load_kw or {}))
        self.images = actor.is_vlm
        if objective.loss.aux_loss_coef:
            actor.enable_moe_aux_loss()  # a model without experts is refused here, in one line
        # LoRA: the adapter's peft config; every sync sends merged weights (fresh tensors, never live ones)
        self._lora = getattr(actor.model, "peft_config", None)
        self.engine = self.s.prepare(actor, total_steps=total_steps)
        self._ema = None
        if objective.ema_beta is not None:
            self._ema = EmaWeights(self.engine.module, objective.ema_beta)
            logger.info(
                "policy EMA (beta %g): %.3f GB on %s, rank %d",
                objective.ema_beta,
                self._ema.nbytes / 1e9,
                self.s.device,
                self.rank,
            )
        self.weights = PolicyWeights(self.s, lambda: self.engine.module, self._lora)  # sync, IPC, checks

    def logprobs(self, items: list[Experience]) -> list[torch.Tensor]:
        """Log-probs at the sampling temperature (what the engine sampled from)."""
        t = self.objective.temperature
        self.engine.eval()
        try:
            return self._leader(self._forward_items(lambda **x: self.engine(**x, temperature=t).logprobs, items))
        finally:
            self.engine.train()

    def train(
        self, items: list[Experience], kl_coef: float = 0.0, on_policy: bool = False, local_batch: int | None = None
    ) -> list[dict[str, float]]:
        """Policy epochs over this rank's slices of every global batch (items in ``dp_order``).

        ``local_batch``: items per global batch on this rank (default ``train_batch_size / dp``); more when a
        global batch's episodes hold several calls each (:mod:`rl_core.trainers.ppo_per_call`).

        ``on_policy``: the items carry no old log-probs because this is the only optimizer step on them (one
        epoch, one global batch): the weights have not moved since the engine sampled, so the old log-probs
        are this forward's, detached (ratio 1), and the experience phase skips a whole forward (as TRL does).
        The rollout log-prob gap is then measured here (``rollout_logprob_gap``, ``rollout_gap_tokens``).

        Returns ``[metrics]`` (a list, as ``call_sharded`` wants), averaged over steps and ranks."""

        o, variant, dev, world = self.objective, self.variant, self.s.device, self.s.world_size
        entropy_coef, aux_coef = o.loss.entropy_coef, o.loss.aux_loss_coef
        has_rollout = all(it.rollout_logprobs_T is not None for it in items)
        use_rollout = variant.needs_rollout_logprobs or (on_policy and has_rollout)
        kl_loss = o.kl_loss is not None  # no reference (--init_kl_coef 0): no KL to measure, 0 logged
        div = o.distill_logits  # a divergence of the distributions: the logits of each forward, the teacher's top-k
        fields: list[TokenField] = ["advantages"]
        if not on_policy:
            fields.append("old_logprobs")
        if kl_loss:
            fields.append("ref_logprobs")
        if o.distill_loss is not None:
            fields.append("teacher_logprobs")
        if use_rollout:
            fields.append("rollout_logprobs")
        # device tensors as they accumulate (no host sync per micro-batch), floats once read_once reads them
        sums: dict[str, float | torch.Tensor] = {"policy_loss": 0.0, "clip_fraction": 0.0, "kl_loss": 0.0}
        entropy = entropy_coef is not None  # OpenRLHF: any coefficient, 0 too, computes and logs it
        if entropy:
            sums["entropy"] = 0.0
        gap_sum: float | torch.Tensor = 0.0
        gap_tokens: float | torch.Tensor = 0.0
        steps = 0
        self.engine.train()
        G = self._global_seqs()

        aux: list[torch.Tensor] = []  # the MoE router's load-balancing loss of the last forward
        if aux_coef:
            sums["aux_loss"] = 0.0
        if o.distill_loss is not None or div is not None:
            sums["distill_loss"] = 0.0
        if self._ptx:
            sums["ptx_loss"] = 0.0

        teacher: list[tuple[torch.Tensor, torch.Tensor]] = []  # this micro-batch's top-k, in the forward's layout

        def forward(**x):  # with the entropy: log-probs and entropy from one pass over the logits
            out = self.engine(**x, temperature=o.temperature, return_entropy=entropy, return_logits=div is not None)
            if aux_coef:
                aux[:] = [out.aux_loss]
            res = [out.logprobs] + ([out.entropy] if entropy else [])
            if div is not None:  # per raw position (about the next token), moved onto the token it scores
                ids, lps = teacher[0]
                res.append(align_to_tokens(div(out.logits, lps, ids, o.temperature), x))
            return tuple(res) if len(res) > 1 else res[0]

        for chunk in self._global_batches(items, o.epochs, local_batch):
            total = self._global_tokens(chunk)
            groups = self._micro_batches(chunk, train=True)
            for k, idx in enumerate(groups):
                sub = [chunk[i] for i in idx]
                b = collate(sub, self.pad_id, fields).to(lambda t: to_device(t, dev))
                m = b.loss_mask_BT
                self.s.accumulation_boundary(self.engine, k == len(groups) - 1)
                if div is not None:
                    teacher[:] = [predicting_layout(sub, self.packing, dev)]
                res = self._model(forward, sub)
                res = res if isinstance(res, tuple) else (res,)
                lp, ent = res[0], (res[1] if entropy else None)
                rollout = b.token("rollout_logprobs") if use_rollout else None
                old = lp.detach() if on_policy else b.token("old_logprobs")
                if on_policy and rollout is not None:  # device tensors: no host sync between the micro-batches
                    gap_sum = gap_sum + ((old - rollout).abs() * m).sum()
                    gap_tokens = gap_tokens + m.sum()
                out = variant.loss(
                    lp,
                    old,
                    b.token("advantages"),
                    m,
                    rollout_logprobs_BT=rollout if variant.needs_rollout_logprobs else None,
                    global_tokens=total,
                    global_seqs=G,
                    dp_size=world,
                    norm_len=o.norm_len,
                )
                loss = out.loss
                if o.kl_loss is not None:  # kl_loss
                    kl = approx_kl(lp, b.token("ref_logprobs"), o.kl_loss, mask=m)
                    kl_term = aggregate_loss(kl, m, "token-mean", global_tokens=total, dp_size=world)
                    loss = loss + kl_coef * kl_term
                    sums["kl_loss"] += kl_term.detach() / world
                if o.distill_loss is not None:  # on-policy distillation: KL(policy || teacher) on the sampled tokens
                    dkl = approx_kl(lp, b.token("teacher_logprobs"), o.distill_loss, mask=m)
                    d_term = aggregate_loss(dkl, m, "token-mean", global_tokens=total, dp_size=world)
                    loss = loss + o.distill_coef * d_term
                    sums["distill_loss"] += d_term.detach() / world
                if div is not None:  # on-policy distillation: the divergence of the distributions, per response token
                    d_term = aggregate_loss(res[-1], m, "token-mean", global_tokens=total, dp_size=world)
                    loss = loss + o.distill_coef * d_term
                    sums["distill_loss"] += d_term.detach() / world
                if entropy:
                    if ent is None:  # not reached: a forward asked for the entropy returns it
                        raise RuntimeError("the policy's forward returned no entropy")
                    ent_term = aggregate_loss(ent, m, "token-mean", global_tokens=total, dp_size=world)
                    if entropy_coef:
                        loss = loss - entropy_coef * ent_term
                    sums["entropy"] += ent_term.detach() / world
                if aux_coef:  # OpenRLHF: coef x aux per micro-batch, weighted by its share of the samples
                    share_n = len(sub) / len(chunk)
                    loss = loss + aux_coef * share_n * aux[0]
                    sums["aux_loss"] += aux[0].detach() * share_n / world
                if self._ptx:  # one backward for both: the policy micro-batch and a pretraining one
                    if o.ptx_coef is None:  # not reached: __init__ refuses pretraining rows without a coefficient
                        raise ValueError("pretraining rows need the objective's ptx_coef")
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
            logger.warning(
                "checkpoint %s holds no position in --pretrain_data: its rows cycle from the first again", path
            )
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

    # ----- weights to the rollout engines (rl_core.rl.policy_weights; these are the calls Ray actors take) ----

    def weight_sender_address(self) -> tuple[str, int]:
        return self.weights.address()

    def init_weight_sender(
        self, master_addr: str, master_port: int, world_size: int, backend: str = "gloo", timeout_s: float = 600.0
    ) -> None:
        self.weights.init_sender(master_addr, master_port, world_size, backend, timeout_s)

    def broadcast_weights(self, version: int, verify: bool = False) -> dict | None:
        return self.weights.broadcast(version, verify)

    def push_weights(self, engine, version: int, verify: bool = False) -> dict:
        return self.weights.push(engine, version, verify)

    def weight_stats(self) -> dict | None:
        return self.weights.stats()

    def share_weights_ipc(self, version: int, verify: bool = False) -> dict:
        return self.weights.share_ipc(version, verify)

    def weights_digest(self) -> dict[str, float]:
        return self.weights.digest()

    # ----- export ------------------------------------------------------------------------------

    def export(self, save_path: str, tokenizer_path: str | None = None) -> str:
        """The HF export of the policy, or of its EMA weights with ``enable_ema`` (as OpenRLHF's save_model)."""

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

    def __init__(
        self,
        strategy_cfg,
        pretrain: str,
        objective: CriticObjective,
        total_steps: int,
        *,
        load_kw: dict | None = None,
        pad_id: int = 0,
        batching: MicroBatchConfig | None = None,
        packing: bool = False,
    ):
        strategy_cfg = replace(strategy_cfg, **objective.optimizer.overrides())  # its own optimizer, schedule, clipping
        super().__init__(strategy_cfg, pad_id=pad_id, batching=batching, packing=packing)

        self.objective = objective
        self.engine = self.s.prepare(Critic.from_pretrained(pretrain, **(load_kw or {})), total_steps=total_steps)

    def values(self, items: list[Experience]) -> list[torch.Tensor]:
        self.engine.eval()
        try:
            return self._leader(self._forward_items(lambda **x: self.engine(**x), items))
        finally:
            self.engine.train()

    def train(self, items: list[Experience], local_batch: int | None = None) -> list[dict[str, float]]:
        """Critic epochs, like :meth:`PolicyWorker.train` (``local_batch`` too); returns ``[metrics]``."""

        o, dev, world = self.objective, self.s.device, self.s.world_size
        sums: dict = {"critic_loss": 0.0, "value_clip_fraction": 0.0}
        steps = 0
        self.engine.train()
        for chunk in self._global_batches(items, o.epochs, local_batch):
            total = self._global_tokens(chunk)
            groups = self._micro_batches(chunk, train=True)
            for k, idx in enumerate(groups):
                sub = [chunk[i] for i in idx]
                b = collate(sub, self.pad_id, ("values", "returns")).to(lambda t: to_device(t, dev))
                m = b.loss_mask_BT
                self.s.accumulation_boundary(self.engine, k == len(groups) - 1)
                v = self._model(lambda **x: self.engine(**x), sub)
                out = value_loss(
                    v,
                    b.token("values"),
                    b.token("returns"),
                    m,
                    clip_eps=o.value_clip,
                    global_tokens=total,
                    dp_size=world,
                )
                self.s.backward(out.loss, self.engine)
                self.s.optimizer_step(self.engine)
                sums["critic_loss"] += out.loss.detach() / world
                sums["value_clip_fraction"] += out.clip_fraction * (m.sum() / total)
            steps += 1
        sums = read_once({k: v / max(steps, 1) for k, v in sums.items()}, dev)
        return self._leader([self.s.all_reduce(sums, "sum")])

    def export(self, save_path: str, tokenizer_path: str | None = None) -> str:
        return str(export_hf(self.s, self.engine, save_path))


def __getattr__(name: str):  # the frozen roles live in rl_core.rl.frozen_workers; old imports keep working
    if name in ("ReferenceWorker", "RewardModelWorker"):
        # lazy: import cycle (rl_core.rl.workers -> rl_core.rl -> rl_core.rl.workers)
        from rl_core.rl import frozen_workers

        return getattr(frozen_workers, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
