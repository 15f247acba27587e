"""SFT trainer: next-token NLL on response tokens, DeepSpeed, exact resume, metrics.

Each optimizer step takes ``train_batch_size`` items of a per-epoch seeded
permutation (the incomplete last batch is dropped), each data-parallel rank its
contiguous share split into micro-batches. The loss is the token mean over the
whole global batch (rl_algos.sft_loss with the all-reduced token count), so
micro-batching and data parallelism do not change it. Checkpoints store the
data position (epoch, batch in epoch), so resuming continues with the same
batches. Leaves out: evaluation sets, packing (rows are right-padded).
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass

import torch
from tqdm import tqdm

from rl_algos import sft_loss
from rl_core.checkpoint import CheckpointManager, export_hf
from rl_core.data import pad_collate
from rl_core.metrics import MetricsLogger

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class SFTConfig:
    max_epochs: int = 1  # --max_epochs
    save_path: str | None = None  # --save_path: final HF export
    ckpt_path: str | None = None  # --ckpt_path: DeepSpeed checkpoints for resume
    save_steps: int = -1  # --save_steps: checkpoint every N optimizer steps (-1: only at the end)
    max_ckpt_num: int = 3  # --max_ckpt_num
    load_checkpoint: bool = False  # --load_checkpoint: resume from the latest complete checkpoint
    logging_steps: int = 1  # --logging_steps
    run_dir: str | None = None  # metrics.jsonl, tensorboard/, curves.png
    max_steps: int | None = None  # stop after this many optimizer steps (e.g. to test resume)

    def __post_init__(self) -> None:
        if self.max_epochs < 1:
            raise ValueError(f"max_epochs must be >= 1, got {self.max_epochs}")
        if self.load_checkpoint and not self.ckpt_path:
            raise ValueError("load_checkpoint needs ckpt_path (--ckpt_path DIR) to find checkpoints in")


class SFTTrainer:
    def __init__(self, strategy, actor, tokenizer, dataset, cfg: SFTConfig):
        self.s, self.tokenizer, self.dataset, self.cfg = strategy, tokenizer, dataset, cfg
        self.s.setup_distributed()
        self.plan = strategy.batch_plan(len(dataset), cfg.max_epochs)
        self.steps_per_epoch = len(dataset) // self.plan.global_batch
        if self.steps_per_epoch < 1:
            raise ValueError(f"the dataset has {len(dataset)} rows, fewer than one global batch "
                             f"({self.plan.global_batch}); lower --train_batch_size or add data")
        self.engine = strategy.prepare(actor, total_steps=self.plan.total_steps)
        self.ckpt = CheckpointManager(cfg.ckpt_path, strategy, cfg.max_ckpt_num) if cfg.ckpt_path else None
        self.metrics = MetricsLogger(cfg.run_dir, enabled=strategy.is_rank_0())
        self.pad_id = tokenizer.pad_token_id

    @functools.lru_cache(maxsize=1)  # one permutation per epoch, not per step
    def _permutation(self, epoch: int) -> list[int]:
        g = torch.Generator().manual_seed(self.s.cfg.seed + epoch)
        return torch.randperm(len(self.dataset), generator=g).tolist()

    def _global_batch(self, epoch: int, index: int) -> list[int]:
        perm = self._permutation(epoch)
        G = self.plan.global_batch
        mine = perm[index * G:(index + 1) * G]
        per_rank = G // self.plan.dp_size
        return mine[self.s.rank * per_rank:(self.s.rank + 1) * per_rank]

    def train_step(self, indices: list[int]) -> dict[str, float]:
        batch = pad_collate([self.dataset[i] for i in indices], self.pad_id)
        total = self.s.all_reduce(batch["loss_mask"].sum().float(), "sum")
        mb = self.plan.micro_batch
        loss_sum = 0.0
        for i in range(self.plan.accumulation_steps):
            sl = slice(i * mb, (i + 1) * mb)
            dev = self.s.device
            out = self.engine(batch["input_ids"][sl].to(dev), attention_mask=batch["attention_mask"][sl].to(dev))
            loss = sft_loss(out.logprobs, batch["loss_mask"][sl].to(dev), global_tokens=total,
                            dp_size=self.plan.dp_size)
            self.s.backward(loss, self.engine)
            self.s.optimizer_step(self.engine)
            loss_sum += loss.item()
        return {"loss": self.s.all_reduce(loss_sum, "mean"), "lr": self.engine.get_lr()[0],
                "tokens": float(total)}

    def fit(self) -> list[float]:
        """Train; returns the loss of every optimizer step this call ran."""
        start_epoch, start_index, step = 0, 0, 0
        if self.cfg.load_checkpoint:
            meta = self.ckpt.load(self.engine)
            if meta is not None:
                step, start_epoch, start_index = meta["step"], meta["epoch"], meta["batch_in_epoch"]
        if self.s.is_rank_0():
            logger.info("SFT: %d rows, %s", len(self.dataset), self.plan.describe())
        losses: list[float] = []
        bar = tqdm(total=self.plan.total_steps, initial=step, desc="sft", disable=not self.s.is_rank_0())
        for epoch in range(start_epoch, self.cfg.max_epochs):
            for index in range(start_index if epoch == start_epoch else 0, self.steps_per_epoch):
                if self.cfg.max_steps is not None and step >= self.cfg.max_steps:
                    break
                m = self.train_step(self._global_batch(epoch, index))
                step += 1
                losses.append(m["loss"])
                bar.update(1)
                bar.set_postfix(loss=f"{m['loss']:.4f}")
                if step % self.cfg.logging_steps == 0:
                    self.metrics.log(step, {"train/" + k: v for k, v in m.items()})
                if self.ckpt and self.cfg.save_steps > 0 and step % self.cfg.save_steps == 0:
                    nxt_epoch, nxt_index = (epoch, index + 1) if index + 1 < self.steps_per_epoch else (epoch + 1, 0)
                    self.ckpt.save(self.engine, step, {"epoch": nxt_epoch, "batch_in_epoch": nxt_index})
        bar.close()
        self.metrics.close()
        if self.cfg.save_path:
            export_hf(self.s, self.engine, self.cfg.save_path, tokenizer=self.tokenizer)
        return losses
