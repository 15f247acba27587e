"""Single-controller RL loop for the group-baseline family (GRPO, RLOO, REINFORCE++-baseline).

One iteration: take ``rollout_batch_size`` prompts, sample ``n_samples_per_prompt``
responses each from a rollout engine (any :class:`rl_rollout.RolloutEngine`: HF or
vLLM), score them with a reward function (``fn(prompt, response, label) -> float``,
e.g. an :class:`rl_rollout.RewardRunner` so a raising or hanging function becomes a
counted fallback), compute advantages with the chosen ``rl_algos`` estimator, the
old logprobs with the policy itself (and the reference's when ``kl_coef > 0``), then
train on the samples in ``train_batch_size`` global batches with the clipped policy
loss (token mean over each global batch, + ``kl_coef`` x k3 KL as a loss, GRPO-style),
and push the new weights to the engine (``update_weights``, version = iteration).

Every iteration logs reward mean/std, response length, loss, clip fraction, KL, the
fraction of samples the engine truncated, and seconds spent generating, scoring,
training and syncing (metrics.jsonl, TensorBoard, curves.png, console bar).

Leaves out (for now): the critic (PPO with GAE), dynamic sampling refill, async
rollouts, checkpoint/resume of the RL state, several engines (an EnginePool plugs in
at ``engine``), Ray (the CLI's ppo-ray will hand the same loop remote groups).
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass

import torch
from tqdm import tqdm

from rl_algos import approx_kl, compute_advantages, masked_mean, policy_loss
from rl_core.checkpoint import export_hf
from rl_core.metrics import MetricsLogger

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class GRPOConfig:
    """RL loop settings (OpenRLHF flag names in comments)."""

    advantage_estimator: str = "group_norm"  # --advantage_estimator: group_norm | rloo | reinforce_baseline ...
    n_samples_per_prompt: int = 4  # --n_samples_per_prompt
    rollout_batch_size: int = 8  # --rollout_batch_size: prompts per iteration
    max_new_tokens: int = 64  # --generate_max_len
    temperature: float = 1.0  # --temperature
    top_p: float = 1.0  # --top_p
    num_iterations: int = 20  # iterations (rollout + train + sync) to run
    max_epochs: int = 1  # --max_epochs: passes over each iteration's samples
    clip_eps_low: float = 0.2  # --eps_clip
    clip_eps_high: float | None = None  # --eps_clip_high (DAPO clip-higher); default: clip_eps_low
    kl_coef: float = 0.0  # --init_kl_coef: k3 KL to the reference as a loss (0: no reference model)
    save_path: str | None = None  # --save_path: final HF export
    run_dir: str | None = None  # metrics.jsonl, tensorboard/, curves.png
    seed: int = 42  # sampling seed (per iteration: seed + iteration)

    def __post_init__(self) -> None:
        for name in ("n_samples_per_prompt", "rollout_batch_size", "max_new_tokens", "num_iterations", "max_epochs"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} (--{name}) must be >= 1, got {getattr(self, name)}")
        if self.advantage_estimator in ("group_norm", "rloo", "reinforce_baseline") and self.n_samples_per_prompt < 2:
            raise ValueError(f"--advantage_estimator {self.advantage_estimator} compares samples of one prompt: "
                             f"set --n_samples_per_prompt >= 2 (got {self.n_samples_per_prompt})")
        if self.kl_coef < 0:
            raise ValueError(f"kl_coef (--init_kl_coef) must be >= 0, got {self.kl_coef}")


def hf_names(named_params):
    """Actor parameter names (``model.<hf name>``) -> the engine's HF names."""
    for name, t in named_params:
        yield (name[len("model."):] if name.startswith("model.") else name), t


class GRPOTrainer:
    def __init__(self, strategy, actor, tokenizer, prompts, engine, reward_fn, cfg: GRPOConfig, ref_actor=None):
        self.s, self.tokenizer, self.prompts, self.rollout, self.reward_fn, self.cfg = (
            strategy, tokenizer, prompts, engine, reward_fn, cfg)
        self.s.setup_distributed()
        if self.s.world_size != 1:
            raise NotImplementedError("GRPOTrainer is the single-controller loop of one process; "
                                      "several trainer ranks go through the Ray path (rl ppo-ray)")
        samples = cfg.rollout_batch_size * cfg.n_samples_per_prompt
        G = strategy.cfg.train_batch_size
        if samples % G:
            raise ValueError(f"rollout_batch_size x n_samples_per_prompt = {samples} samples per iteration is not a "
                             f"multiple of train_batch_size {G}; make it one (e.g. --train_batch_size {samples})")
        if len(prompts) < cfg.rollout_batch_size:
            raise ValueError(f"{len(prompts)} prompts, fewer than rollout_batch_size {cfg.rollout_batch_size}")
        self.steps_per_iteration = samples // G * cfg.max_epochs
        self.plan = strategy.batch_plan()
        self.plan.total_steps = self.steps_per_iteration * cfg.num_iterations
        self.engine = strategy.prepare(actor, total_steps=self.plan.total_steps)
        if cfg.kl_coef > 0 and ref_actor is None:
            raise ValueError(f"kl_coef={cfg.kl_coef} needs a reference model (ref_actor)")
        self.ref = strategy.prepare(ref_actor, train=False) if cfg.kl_coef > 0 else None
        self.metrics = MetricsLogger(cfg.run_dir, enabled=strategy.is_rank_0())
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self.eos = [t for t in {tokenizer.eos_token_id} if t is not None]

    # ----- one iteration's pieces -------------------------------------------------------------

    def generate(self, items: list[dict], iteration: int):
        from rl_rollout import RolloutRequest, SamplingParams

        c = self.cfg
        params = SamplingParams(temperature=c.temperature, top_p=c.top_p, max_new_tokens=c.max_new_tokens,
                                n=c.n_samples_per_prompt, stop_token_ids=self.eos, seed=c.seed + iteration)
        groups = self.rollout.generate([RolloutRequest(list(it["prompt_ids"]), params) for it in items])
        return [s for g in groups for s in g]

    def score(self, items: list[dict], samples) -> torch.Tensor:
        n = self.cfg.n_samples_per_prompt
        out = []
        for i, s in enumerate(samples):
            it = items[i // n]
            text = self.tokenizer.decode(s.response_ids, skip_special_tokens=True)
            out.append(float(self.reward_fn(it["prompt"], text, it.get("label"))))
        return torch.tensor(out, dtype=torch.float32)

    def to_batch(self, samples) -> dict[str, torch.Tensor]:
        """Right-padded ``prompt + response`` rows; ``loss_mask`` on policy-generated response tokens."""
        seqs = [s.prompt_ids + s.response_ids for s in samples]
        T = max(len(x) for x in seqs)
        B = len(seqs)
        ids = torch.full((B, T), self.pad_id, dtype=torch.long)
        attn = torch.zeros(B, T, dtype=torch.long)
        mask = torch.zeros(B, T, dtype=torch.long)
        for b, (s, x) in enumerate(zip(samples, seqs, strict=True)):
            ids[b, :len(x)] = torch.tensor(x)
            attn[b, :len(x)] = 1
            mask[b, len(s.prompt_ids):len(x)] = torch.tensor(s.loss_mask, dtype=torch.long)
        return {"input_ids": ids, "attention_mask": attn, "loss_mask": mask}

    @torch.no_grad()
    def logprobs(self, model, batch, mb: int) -> torch.Tensor:
        dev = self.s.device
        out = []
        for k in range(0, batch["input_ids"].shape[0], mb):
            out.append(model(batch["input_ids"][k:k + mb].to(dev),
                             attention_mask=batch["attention_mask"][k:k + mb].to(dev)).logprobs.float().cpu())
        return torch.cat(out)

    def train(self, batch, old, ref, adv) -> dict[str, float]:
        c, mb, G = self.cfg, self.plan.micro_batch, self.s.cfg.train_batch_size
        B = batch["input_ids"].shape[0]
        dev = self.s.device
        sums = {"loss": 0.0, "clip_fraction": 0.0, "kl": 0.0}
        n_steps = 0
        for _ in range(c.max_epochs):
            for g0 in range(0, B, G):
                total = batch["loss_mask"][g0:g0 + G].sum().clamp(min=1).float()
                for k in range(g0, g0 + G, mb):
                    sl = slice(k, k + mb)
                    m = batch["loss_mask"][sl].to(dev)
                    lp = self.engine(batch["input_ids"][sl].to(dev),
                                     attention_mask=batch["attention_mask"][sl].to(dev)).logprobs
                    out = policy_loss(lp, old[sl].to(dev), adv[sl].to(dev), m, clip_eps_low=c.clip_eps_low,
                                      clip_eps_high=c.clip_eps_high, global_tokens=total)
                    loss = out.loss
                    if ref is not None:
                        kl = approx_kl(lp, ref[sl].to(dev), "k3", mask=m).sum() / total
                        loss = loss + c.kl_coef * kl
                        sums["kl"] += kl.item()
                    self.s.backward(loss, self.engine)
                    self.s.optimizer_step(self.engine)
                    share = m.sum().item() / total.item()
                    sums["loss"] += loss.item()
                    sums["clip_fraction"] += out.clip_fraction.item() * share
                n_steps += 1
        return {k: v / n_steps for k, v in sums.items()}

    def sync(self, version: int) -> float:
        t0 = time.perf_counter()
        for bucket in self.s.named_parameter_buckets(self.engine.module):
            self.rollout.update_weights(hf_names(bucket), version=version)
        return time.perf_counter() - t0

    # ----- the loop --------------------------------------------------------------------------

    def fit(self) -> list[dict[str, float]]:
        c = self.cfg
        g = torch.Generator().manual_seed(c.seed)
        order = torch.randperm(len(self.prompts), generator=g).tolist()
        per_epoch = len(order) // c.rollout_batch_size
        history = []
        if self.s.is_rank_0():
            logger.info("grpo: %d prompts, %d x %d samples per iteration, %d optimizer steps per iteration; %s",
                        len(self.prompts), c.rollout_batch_size, c.n_samples_per_prompt, self.steps_per_iteration,
                        self.plan.describe())
        bar = tqdm(total=c.num_iterations, desc="grpo", disable=not self.s.is_rank_0())
        for it in range(1, c.num_iterations + 1):
            k = (it - 1) % per_epoch
            items = [self.prompts[i] for i in order[k * c.rollout_batch_size:(k + 1) * c.rollout_batch_size]]
            t0 = time.perf_counter()
            samples = self.generate(items, it)
            t1 = time.perf_counter()
            scores = self.score(items, samples)
            t2 = time.perf_counter()
            batch = self.to_batch(samples)
            adv = compute_advantages(c.advantage_estimator, scores, batch["loss_mask"].float(),
                                     n_samples=c.n_samples_per_prompt).advantages
            self.engine.eval()
            old = self.logprobs(self.engine, batch, self.plan.micro_batch)
            ref = self.logprobs(self.ref, batch, self.plan.micro_batch) if self.ref is not None else None
            self.engine.train()
            m = self.train(batch, old, ref, adv)
            t3 = time.perf_counter()
            sync_s = self.sync(it)
            lengths = torch.tensor([len(s.response_ids) for s in samples], dtype=torch.float32)
            m.update({
                "reward_mean": scores.mean().item(), "reward_std": scores.std().item() if len(scores) > 1 else 0.0,
                "response_length": lengths.mean().item(),
                "truncated": sum(s.finish_reason == "length" for s in samples) / len(samples),
                "rollout_logprob_gap": masked_mean(
                    (old[:, 1:] - self._rollout_lp(samples, batch)[:, 1:]).abs(), batch["loss_mask"][:, 1:]).item(),
                "lr": self.engine.get_lr()[0], "generate_s": t1 - t0, "reward_s": t2 - t1, "train_s": t3 - t2,
                "sync_s": sync_s,
            })
            if not all(math.isfinite(v) for v in m.values()):
                logger.warning("iteration %d: non-finite metrics %s", it, m)
            history.append(m)
            self.metrics.log(it, {"rl/" + k: v for k, v in m.items()})
            bar.update(1)
            bar.set_postfix(reward=f"{m['reward_mean']:.3f}", loss=f"{m['loss']:.3f}")
        bar.close()
        self.metrics.close()
        if c.save_path:
            export_hf(self.s, self.engine, c.save_path, tokenizer=self.tokenizer)
        return history

    def _rollout_lp(self, samples, batch) -> torch.Tensor:
        """The engine's logprobs of the sampled tokens, aligned like the policy's (0 elsewhere)."""
        out = torch.zeros(batch["input_ids"].shape, dtype=torch.float32)
        for b, s in enumerate(samples):
            if s.rollout_logprobs:
                p = len(s.prompt_ids)
                out[b, p:p + len(s.response_ids)] = torch.tensor(s.rollout_logprobs)
        return out
