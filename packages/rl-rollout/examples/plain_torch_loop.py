"""rl-rollout inside a plain PyTorch training loop: generate, score, step, ``update_weights``.

    uv run python packages/rl-rollout/examples/plain_torch_loop.py --steps 30

The trainer here is nothing but transformers and ``torch.optim.AdamW``; rl-rollout
supplies the generation engine (:class:`~rl_rollout.hf_engine.HFEngine`, a separate
copy of the weights, as a vLLM engine would be) and the reward runner. Nothing
else from this stack is imported (no rl-core, rl-algos, DeepSpeed or Ray);
``--report-modules`` prints the top-level modules loaded as a last JSON line, which
the test checks. (Writing the tiny model the first time does import DeepSpeed when it
is installed: transformers' ``save_pretrained`` unwraps the model through accelerate,
which imports it. The test therefore writes the model in another process first.)

The task is one the tiny random model can learn in a few dozen steps on a CPU:
the reward is the fraction of response characters that are ``LETTER``. The
update is REINFORCE with a group baseline (GRPO without the std normalisation
or clipping)::

    A_pg    = r_pg - mean_g(r_pg)                         advantage of sample g of prompt p
    ratio_t = exp(logp_t - rollout_logp_t)                == 1 on-policy; carries the gradient
    loss    = -sum_{p,g,t} A_pg * ratio_t * mask_t / sum mask

Left out on purpose: clipping, KL to a reference, std normalisation, micro-batching,
checkpoints, logging. Swap ``make_engine("hf", ...)`` for ``make_engine("vllm", ...)``
and the loop stays the same.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from rl_rollout import RewardRunner, RolloutRequest, SamplingParams, make_engine
from rl_rollout.testing import make_tiny_model

LETTER = "a"
PROMPTS = ["Say something:", "Write a word.", "Hello!", "Tell me a story", "Q: 2+2?", "Go"]


def letter_fraction(prompt: str, response: str, label: str | None, **info) -> float:
    """Reward: the fraction of ``response``'s characters that are ``LETTER`` (0 for an empty response)."""
    return response.count(LETTER) / len(response) if response else 0.0


def policy_logprobs(policy, samples) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Token logprobs of each sample's response under ``policy``, right-padded to the longest response T.

    Returns ``(logprobs_BT, rollout_logprobs_BT, mask_BT)``; padded positions are 0 in all three.
    """
    T = max(len(s.response_ids) for s in samples)
    width = max(len(s.prompt_ids) for s in samples) + T  # room for every prompt + T: slices below fit
    ids_BL = torch.zeros(len(samples), width, dtype=torch.long)
    attn_BL = torch.zeros_like(ids_BL)
    targets_BT = torch.zeros(len(samples), T, dtype=torch.long)
    rollout_BT = torch.zeros(len(samples), T)
    mask_BT = torch.zeros(len(samples), T)
    for b, s in enumerate(samples):
        seq, n = s.prompt_ids + s.response_ids, len(s.response_ids)
        ids_BL[b, : len(seq)] = torch.tensor(seq)
        attn_BL[b, : len(seq)] = 1
        targets_BT[b, :n] = torch.tensor(s.response_ids)
        rollout_BT[b, :n] = torch.tensor(s.rollout_logprobs)
        mask_BT[b, :n] = torch.tensor(s.loss_mask, dtype=torch.float)
    logits_BLV = policy(input_ids=ids_BL, attention_mask=attn_BL).logits.float()
    # the logits that predict response token t sit at position len(prompt) - 1 + t
    logits_BTV = torch.stack([logits_BLV[b, len(s.prompt_ids) - 1 :][:T] for b, s in enumerate(samples)])
    logprobs_BT = torch.log_softmax(logits_BTV, -1).gather(-1, targets_BT.unsqueeze(-1)).squeeze(-1)
    return logprobs_BT * mask_BT, rollout_BT, mask_BT


def main(steps: int = 30, workdir: str | Path | None = None, *, n: int = 8, max_new_tokens: int = 16,
         lr: float = 3e-3, seed: int = 0, report_modules: bool = False) -> list[float]:
    """Train for ``steps`` iterations; returns the mean reward of each iteration's samples."""
    torch.manual_seed(seed)
    workdir = Path(workdir or tempfile.mkdtemp(prefix="plain_torch_loop_"))
    path = make_tiny_model(workdir / "tiny", seed=seed)
    tok = AutoTokenizer.from_pretrained(path)

    policy = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)  # the trainable copy
    opt = torch.optim.AdamW(policy.parameters(), lr=lr, weight_decay=0.0)
    engine = make_engine("hf", path)  # the rollout copy: gets the weights through update_weights
    rewards = RewardRunner(letter_fraction)  # in-process; workers=N, timeout_s=... for untrusted code
    params = SamplingParams(temperature=1.0, n=n, max_new_tokens=max_new_tokens)
    prompt_ids = [tok(p).input_ids for p in PROMPTS]

    mean_rewards = []
    for step in range(steps):
        t0 = time.perf_counter()
        # 1. generate: n samples per prompt, each with its rollout logprobs and policy version
        groups = engine.generate([RolloutRequest(ids, params) for ids in prompt_ids])
        samples = [s for group in groups for s in group]
        # 2. score
        texts = [tok.decode(s.response_ids, skip_special_tokens=True) for s in samples]
        prompts = [p for p, group in zip(PROMPTS, groups, strict=True) for _ in group]
        reward_PG = torch.tensor(rewards.score(prompts, texts)).view(len(groups), n)
        advantage_B = (reward_PG - reward_PG.mean(dim=1, keepdim=True)).flatten()
        # 3. step
        logprobs_BT, rollout_BT, mask_BT = policy_logprobs(policy, samples)
        ratio_BT = torch.exp(logprobs_BT - rollout_BT) * mask_BT
        loss = -(advantage_B[:, None] * ratio_BT).sum() / mask_BT.sum().clamp(min=1)
        opt.zero_grad()
        loss.backward()
        opt.step()
        # 4. send the new weights to the engine; its next samples carry version step + 1
        engine.update_weights(policy.named_parameters(), version=step + 1)

        mean_rewards.append(reward_PG.mean().item())
        (version,) = {s.policy_version for s in samples}  # one batch, one weight version
        # trainer vs engine on the same weights: float rounding only
        logprob_diff = ((logprobs_BT - rollout_BT).abs() * mask_BT).max().item()
        print(f"iter {step:3d}  mean_reward {mean_rewards[-1]:.4f}  policy_version {version}  "
              f"logprob_diff {logprob_diff:.1e}  {time.perf_counter() - t0:.2f}s", flush=True)
    engine.shutdown()
    if report_modules:
        print(json.dumps({"modules": sorted({m.split(".")[0] for m in sys.modules})}), flush=True)
    return mean_rewards


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--workdir", default=None, help="where the tiny model is written (default: a temp folder)")
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--report-modules", action="store_true", help="print the loaded top-level modules as JSON")
    args = ap.parse_args()
    main(steps=args.steps, workdir=args.workdir, lr=args.lr, seed=args.seed, report_modules=args.report_modules)
