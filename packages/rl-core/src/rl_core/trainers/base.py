"""The loop every offline trainer shares: epochs of seeded global batches, evaluation, resume, metrics, export.

:class:`Trainer` owns what SFT, RM, DPO and KTO have in common. Each optimizer
step takes ``train_batch_size`` items of a per-epoch seeded permutation (the
incomplete last batch is dropped); each data-parallel rank takes its contiguous
share and splits it into micro-batches (:meth:`Trainer.micro_batches`). A subclass
says how one global batch becomes losses (:meth:`Trainer.train_step`) and returns
its metrics; the loop logs them (console bar, metrics.jsonl, TensorBoard,
curves.png, wandb when asked), writes checkpoints that carry the data position
(epoch, batch in epoch) so a resumed run continues with the same batches, and
exports the final model as an HF folder.

Evaluation: with an eval set (``eval_dataset=``, the CLI's ``--eval_dataset``) the loop
calls :meth:`Trainer.evaluate` every ``eval_steps`` optimizer steps and once after the
last step; a subclass says what it measures (:meth:`Trainer.eval_metrics`) over rows
that :meth:`Trainer.per_row` spreads over the data-parallel ranks. Results are logged
as ``eval/NAME`` and kept in :attr:`Trainer.eval_history`.

MoE models (SFT, DPO, KTO: :class:`LMTrainerConfig`): ``aux_loss_coef > 0`` adds ``coef x`` the router's
load-balancing loss of each policy forward to its micro-batch's loss, averaged over the step's micro-batches
(OpenRLHF's ``loss + aux_loss * aux_loss_coef`` per micro-batch, under its 1/accumulation scaling). The
step's ``loss`` includes the term; ``aux_loss`` is logged beside it. Evaluation measures the task loss only.

Leaves out: early stopping and best-checkpoint selection on eval metrics.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os

import torch
from tqdm import tqdm

from rl_core.checkpoint import CheckpointManager
from rl_core.configs import check_eval_rows, check_eval_set
from rl_core.data import pack_collate, pad_collate
from rl_core.data.images import with_images
from rl_core.folder_lock import hold
from rl_core.hf_export import export_hf
from rl_core.metrics import LoggerConfig, MetricsLogger
from rl_core.trainers.configs import LMTrainerConfig, TrainerConfig  # noqa: F401 - re-exported: the settings live beside, torch-free

logger = logging.getLogger(__name__)


class Trainer:
    """Subclasses set ``name`` and implement :meth:`train_step` and :meth:`eval_metrics`; may
    override :meth:`before_fit` and :meth:`before_export`."""

    name = "train"
    supports_packing = False  # True where train_step and eval_metrics take packed batches (collate, model_inputs)
    supports_images = False  # True where every forward takes its batch's image_inputs (collate, model_inputs)

    def __init__(
        self,
        strategy,
        model,
        tokenizer,
        dataset,
        cfg: TrainerConfig,
        *,
        eval_dataset=None,
        logger: LoggerConfig | None = None,
    ):
        self.s, self.tokenizer, self.dataset, self.cfg = strategy, tokenizer, dataset, cfg
        self.eval_dataset = eval_dataset
        if eval_dataset is not None:
            check_eval_rows(len(eval_dataset))
        check_eval_set(cfg.eval_steps, eval_dataset is not None)
        self.eval_history: list[dict[str, float]] = []  # {"step": N, NAME: value, ...} per evaluation of fit()
        self.packing = bool(getattr(getattr(dataset, "cfg", None), "packing", False))
        # a vision-language dataset's image processor (rl_core.data.images): collate loads each micro-batch's pixels
        self.image_processor = getattr(dataset, "image_processor", None)
        if self.image_processor is not None and not self.supports_images:
            raise ValueError(f"{type(self).__name__} does not train on images (SFT and DPO do); drop --image_key")
        if self.packing and not self.supports_packing:
            raise ValueError(f"{type(self).__name__} does not pack sequences (SFT, RM, DPO and KTO do); drop --packing")
        self.aux_loss_coef = getattr(cfg, "aux_loss_coef", 0.0)  # LMTrainerConfig's
        self._aux_losses: list[torch.Tensor] = []  # this step's, for the aux_loss metric
        if self.aux_loss_coef:
            model.enable_moe_aux_loss()  # raises for a model without experts
            logging.getLogger(__name__).info(
                "%s: MoE load-balancing loss on, coefficient %g", self.name, self.aux_loss_coef
            )  # (``logger`` is the argument here)
        self.s.setup_distributed()
        self.plan = strategy.batch_plan(len(dataset), cfg.max_epochs)
        self.steps_per_epoch = len(dataset) // self.plan.global_batch
        if self.steps_per_epoch < 1:
            raise ValueError(
                f"the dataset has {len(dataset)} rows, fewer than one global batch "
                f"({self.plan.global_batch}); lower --train_batch_size or add data"
            )
        self.engine = strategy.prepare(model, total_steps=self.plan.total_steps)
        ck = cfg.ckpt
        self.ckpt = (
            CheckpointManager(ck.ckpt_path, strategy, ck.max_ckpt_num, ck.max_ckpt_mem) if ck.ckpt_path else None
        )
        self.metrics = MetricsLogger.from_config(
            cfg.run_dir, logger or LoggerConfig(), enabled=strategy.is_rank_0(), run_config=dataclasses.asdict(cfg)
        )  # ``logger``: wandb, TensorBoard
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        if self.pad_id is None:
            raise ValueError("the tokenizer has neither a pad nor an eos token; set tokenizer.pad_token")
        # last, once every check passed: the folders the run writes are its own until fit ends; rank 0 locks them
        # for all (rl_core.folder_lock)
        self._locks = (
            hold({"--run_dir": cfg.run_dir, "--ckpt_path": ck.ckpt_path}, {"--save_path": ck.save_path})
            if strategy.is_rank_0()
            else hold({})
        )

    # ----- batches ---------------------------------------------------------------------------

    @functools.lru_cache(maxsize=1)  # noqa: B019 - one permutation per epoch, not per step; one trainer per run
    def _permutation(self, epoch: int) -> list[int]:
        g = torch.Generator().manual_seed(self.s.cfg.seed + epoch)
        return torch.randperm(len(self.dataset), generator=g).tolist()

    def global_batch(self, epoch: int, index: int) -> list[int]:
        """This rank's dataset indices for batch ``index`` of ``epoch``."""
        perm = self._permutation(epoch)
        G = self.plan.global_batch
        mine = perm[index * G : (index + 1) * G]
        per_rank = G // self.plan.dp_size
        r = self.s.dp_rank  # with ring attention a group's ranks take the same share (rl_core.ring_attention)
        return mine[r * per_rank : (r + 1) * per_rank]

    def micro_batches(self, indices: list[int]) -> list[list[dict]]:
        """This rank's items split into ``accumulation_steps`` micro-batches of ``micro_batch`` items."""
        mb = self.plan.micro_batch
        return [[self.dataset[i] for i in indices[k * mb : (k + 1) * mb]] for k in range(self.plan.accumulation_steps)]

    @torch.no_grad()
    def per_row(self, fn, width: int, dataset=None) -> torch.Tensor:
        """``[len(dataset), width]`` float64: ``fn(items) -> [len(items), width]`` over every row
        of ``dataset`` (default: the training set; any sequence of items works).

        Each rank computes a contiguous share in micro-batches and the shares are summed
        over ranks. Every rank runs the same number of forwards (a short last share
        repeats row 0 and discards it), since ZeRO-3 forwards are collective.
        """
        dataset = self.dataset if dataset is None else dataset
        n, dp, mb = len(dataset), self.plan.dp_size, self.plan.micro_batch
        share = -(-n // dp)
        start = self.s.dp_rank * share
        out = torch.zeros(n, width, dtype=torch.float64)
        for k in range(0, share, mb):
            idx = list(range(start + k, min(n, start + k + mb, start + share)))
            vals = fn([dataset[i] for i in (idx or [0])]).detach().double().cpu().reshape(-1, width)
            if idx:
                out[idx] = vals[: len(idx)]
        return self.s.dp_sum(out)

    def to_device(self, batch: dict) -> dict:
        def move(v):
            if isinstance(v, dict):  # image_inputs
                return {k: move(x) for k, x in v.items()}
            return v.to(self.s.device) if isinstance(v, torch.Tensor) else v

        return {k: move(v) for k, v in batch.items()}

    def collate(self, items: list[dict]) -> dict:
        """One micro-batch of SFT / KTO items: one packed row with the dataset's ``packing``, else padded rows
        (:func:`rl_core.data.model_inputs` gives the model's arguments for either), with the rows' image
        tensors for a vision-language dataset (:func:`rl_core.data.images.with_images`)."""
        batch = pack_collate(items) if self.packing else pad_collate(items, self.pad_id)
        return with_images(batch, items, self.image_processor)

    def _saved_tokenizer(self):
        """What an export saves beside the weights: a vision-language dataset's processor (its tokenizer, image
        processor and chat template, so the folder loads with AutoProcessor), else the tokenizer."""
        return getattr(self.dataset, "processor", None) or self.tokenizer

    def moe_aux_loss(self, out) -> torch.Tensor | float:
        """The term to add to a micro-batch's loss for its policy forward ``out`` (an ActorOutput):
        ``aux_loss_coef x`` the router's load-balancing loss / the step's micro-batch count; 0 when off."""
        if not self.aux_loss_coef:
            return 0.0
        self._aux_losses.append(out.aux_loss.detach())
        return self.aux_loss_coef * out.aux_loss / self.plan.accumulation_steps

    def aux_loss_metrics(self) -> dict[str, float]:
        """``{"aux_loss": mean over this step's micro-batches and ranks}`` (empty when off); starts the next step."""
        if not self._aux_losses:
            return {}
        value = torch.stack(self._aux_losses).float().mean().item()
        self._aux_losses.clear()
        return {"aux_loss": self.s.all_reduce(value, "mean")}

    # ----- what a subclass provides -------------------------------------------------------------

    def train_step(self, indices: list[int]) -> dict[str, float]:
        """One optimizer step over this rank's ``indices``; returns metrics (reduced over ranks),
        including ``loss``."""
        raise NotImplementedError

    def eval_metrics(self, dataset) -> dict[str, float]:
        """Metrics of the current model over every row of ``dataset`` (reduced over ranks), including
        ``loss`` with the training loss's definition. Runs under ``torch.no_grad()`` in eval mode;
        forwards go through :meth:`per_row` so every rank runs the same number."""
        raise NotImplementedError(f"{type(self).__name__} does not define eval_metrics; it cannot evaluate")

    def before_fit(self) -> None:
        """Called once before the first step (e.g. precompute reference logprobs)."""

    def before_export(self) -> None:
        """Called once after the last step, before the HF export (e.g. reward statistics)."""

    # ----- evaluation ----------------------------------------------------------------------------------

    def evaluate(self, dataset=None) -> dict[str, float]:
        """:meth:`eval_metrics` over ``dataset`` (default: the eval set), without gradients, in eval mode.

        Collective: every rank calls it. Returns the metrics (no ``eval/`` prefix) and logs nothing;
        the loop's evaluations are logged and kept in :attr:`eval_history`.
        """
        dataset = self.eval_dataset if dataset is None else dataset
        if dataset is None:
            raise ValueError(
                f"{type(self).__name__}.evaluate() has no eval set: pass eval_dataset= to the trainer "
                "(--eval_dataset PATH) or a dataset to evaluate()"
            )
        if len(dataset) == 0:
            raise ValueError(f"{type(self).__name__}.evaluate() got a dataset with no rows; pass rows to measure")
        was_training = self.engine.module.training  # DeepSpeedEngine.train() sets the module's flag only
        self.engine.eval()
        try:
            with torch.no_grad():
                return self.eval_metrics(dataset)
        finally:
            self.engine.train(was_training)

    def _evaluate_and_log(self, step: int) -> None:
        m = self.evaluate()
        self.eval_history.append({"step": step, **m})
        self.metrics.log(step, {"eval/" + k: v for k, v in m.items()})
        if self.s.is_rank_0():
            logger.info("%s eval at step %d: %s", self.name, step, ", ".join(f"{k} {v:.4g}" for k, v in m.items()))

    # ----- the loop ------------------------------------------------------------------------------------

    def fit(self) -> list[float]:
        """Train; returns the loss of every optimizer step this call ran. The run's folders are released after."""
        try:
            return self._fit()
        finally:
            self._locks.release()

    def _fit(self) -> list[float]:
        start_epoch, start_index, step = 0, 0, 0
        self.step = 0
        ck = self.cfg.ckpt
        if ck.load_checkpoint:
            if self.ckpt is None:  # not reached: CheckpointConfig refuses load_checkpoint without ckpt_path
                raise ValueError("load_checkpoint needs ckpt_path (--ckpt_path DIR) to find checkpoints in")
            meta = self.ckpt.load(self.engine)
            if meta is not None:
                step, start_epoch, start_index = meta["step"], meta["epoch"], meta["batch_in_epoch"]
                self.step = step
        if self.s.is_rank_0():
            logger.info(
                "%s: %d rows, %s%s",
                self.name,
                len(self.dataset),
                self.plan.describe(),
                "" if self.eval_dataset is None else f"; eval set {len(self.eval_dataset)} rows",
            )
        if ck.disable_ds_ckpt and ck.save_steps > 0 and self.s.is_rank_0():
            logger.warning(
                "%s: --disable_ds_ckpt: --save_steps %d writes no checkpoint (nothing to resume from)%s; "
                "the final model goes to --save_path",
                self.name,
                ck.save_steps,
                ", only the HF exports" if ck.save_hf_ckpt else "",
            )
        self.before_fit()
        losses: list[float] = []
        bar = tqdm(
            total=self.plan.total_steps,
            initial=step,
            desc=self.name,
            disable=not self.s.is_rank_0() or os.environ.get("TQDM_DISABLE") == "1",
        )
        for epoch in range(start_epoch, self.cfg.max_epochs):
            for index in range(start_index if epoch == start_epoch else 0, self.steps_per_epoch):
                if self.cfg.max_steps is not None and step >= self.cfg.max_steps:
                    break
                self.engine.train()
                m = self.train_step(self.global_batch(epoch, index))
                m["lr"] = self.engine.get_lr()[0]
                step += 1
                self.step = step
                losses.append(m["loss"])
                bar.update(1)
                bar.set_postfix({k: f"{v:.4g}" for k, v in m.items() if k in self.progress_keys})
                if step % self.cfg.logging_steps == 0:
                    self.metrics.log(step, {"train/" + k: v for k, v in m.items()})
                if self.ckpt and ck.save_steps > 0 and not ck.disable_ds_ckpt and step % ck.save_steps == 0:
                    nxt_epoch, nxt_index = (epoch, index + 1) if index + 1 < self.steps_per_epoch else (epoch + 1, 0)
                    self.ckpt.save(self.engine, step, {"epoch": nxt_epoch, "batch_in_epoch": nxt_index})
                if ck.save_hf_ckpt and step % ck.save_steps == 0:  # collective (ZeRO-3 gathers)
                    if ck.ckpt_path is None:  # not reached: CheckpointConfig refuses save_steps without ckpt_path
                        raise ValueError("save_hf_ckpt needs ckpt_path (--ckpt_path DIR) to write the exports to")
                    export_hf(
                        self.s,
                        self.engine,
                        os.path.join(ck.ckpt_path, f"step_{step:08d}_hf"),
                        tokenizer=self._saved_tokenizer(),
                    )
                if self.eval_dataset is not None and self.cfg.eval_steps > 0 and step % self.cfg.eval_steps == 0:
                    self._evaluate_and_log(step)
        bar.close()
        if self.eval_dataset is not None and (not self.eval_history or self.eval_history[-1]["step"] != step):
            self._evaluate_and_log(step)  # the final model's metrics, unless the last step just measured them
        self.before_export()
        self.metrics.close()
        if ck.save_path:
            export_hf(self.s, self.engine, ck.save_path, tokenizer=self._saved_tokenizer())
        return losses

    progress_keys: tuple[str, ...] = ("loss",)
