"""Seconds per phase of one RL iteration (rl-core's PPOTrainer, PPO with a critic), against plain baselines.

    uv run python benchmarks/rl_phases.py --small          # CPU, tiny model, a minute
    python benchmarks/rl_phases.py --device cuda            # GPU: a Qwen2.5-0.5B-shaped random Llama, bf16

Runs ``--iterations`` iterations of the real loop in one process, built as ``rl ppo``
builds it (rl-core's ``build_run`` with the local factory: policy, critic and reference
over DeepSpeed ZeRO-0 / --zero_stage, rl-rollout's HFEngine or, with ``--rollout_engine
vllm``, VLLMEngine receiving the weights in memory, a reward function) and prints the mean seconds of
each phase (generate, reward, experience, critic train, policy train, sync) over the
iterations after the first. Baselines measured in the same run on the same batch:

- generate: plain transformers ``model.generate`` of the same prompts x n samples
  (sampling, same length), vs the loop's generate phase;
- policy train: a plain PyTorch loop (AdamW, the same micro-batches, forward +
  clipped policy loss + backward + step, the same number of optimizer steps), vs the
  loop's policy-train phase; its padded tokens/s is printed, to set beside
  ``sft_throughput.py``'s rate (issue 18 item 4); ``--use_liger_kernel`` runs both with liger's kernels;
- sync: a device-to-device copy of the bytes one sync moves (every policy parameter),
  vs the loop's sync rate (GB/s); the engine's wake-up is timed apart (``wake_s``).

Ratios > 1 are the framework's overhead over the plain code.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


class DeviceMemoryPeak:
    """The most device memory in use (all processes: total - free, so an engine's own pool counts too)
    while the block runs, polled every 5 ms on a thread; None on CPU."""

    def __init__(self, dev):
        self.dev, self.gib = dev, None

    def __enter__(self):
        import threading

        if self.dev.type != "cuda":
            return self
        self._stop, self._peak = threading.Event(), 0

        def poll():
            while not self._stop.is_set():
                free, total = torch.cuda.mem_get_info(self.dev)
                self._peak = max(self._peak, total - free)
                self._stop.wait(0.005)

        self._thread = threading.Thread(target=poll, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc):
        if self.dev.type == "cuda":
            self._stop.set()
            self._thread.join()
            self.gib = self._peak / 2**30


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--small", action="store_true", help="tiny model for a CPU run")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--iterations", type=int, default=4)
    ap.add_argument("--rollout_batch_size", type=int, default=16)
    ap.add_argument("--n_samples_per_prompt", type=int, default=4)
    ap.add_argument("--generate_max_len", type=int, default=128)
    ap.add_argument("--micro_train_batch_size", type=int, default=8)
    ap.add_argument("--zero_stage", type=int, default=0)
    ap.add_argument("--rollout_engine", default="hf", choices=("hf", "vllm"), help="the loop's engine")
    ap.add_argument("--enable_sleep", action="store_true",
                    help="the engine sleeps while the models train (rl ppo's --vllm_enable_sleep)")
    ap.add_argument("--sleep_level", type=int, default=1, choices=(1, 2), help="rl ppo's --vllm_sleep_level")
    ap.add_argument("--gpu_memory_utilization", type=float, default=None,
                    help="vLLM's share of the GPU (rl ppo's --vllm_gpu_memory_utilization; default: EngineConfig's)")
    ap.add_argument("--no_baselines", action="store_true", help="only the loop (benchmarks/sleep_headroom.py)")
    ap.add_argument("--use_liger_kernel", action="store_true", help="rl ppo's --use_liger_kernel (CUDA, liger-kernel); "
                    "the plain policy baseline, loaded after, gets liger's RMSNorm/SwiGLU/RoPE too (liger patches "
                    "transformers' modeling module for the process)")
    ap.add_argument("--out", default=None, help="write the numbers as JSON here")
    args = ap.parse_args()
    dev = torch.device(args.device)
    bf16 = dev.type == "cuda"

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rl_core.data import DataConfig, PromptDataset
    from rl_core.rl import collate, make_item
    from rl_core.rl.build import LocalFactory, RLModelConfig, RunConfig, build_run
    from rl_core.strategy import StrategyConfig
    from rl_core.trainers.ppo import PPOConfig
    from rl_rollout import EngineConfig
    from rl_rollout.testing import make_tiny_model

    work = Path(tempfile.mkdtemp(prefix="rl-phases-"))
    shape = (dict(hidden_size=128, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=256) if args.small else
             dict(hidden_size=896, num_layers=24, num_heads=14, num_kv_heads=2, intermediate_size=4864))
    if args.small:
        args.generate_max_len = min(args.generate_max_len, 32)
    model = make_tiny_model(work / "model", **shape, max_position_embeddings=2048)
    tok = AutoTokenizer.from_pretrained(model)
    rows = [{"prompt": f"Question {i}: repeat the letter {c} as often as you can. Answer: ", "label": c}
            for i, c in enumerate("abcdefghijklmnopqrstuvwxyz" * 2)]
    prompts = PromptDataset(rows, tok, DataConfig(input_key="prompt", label_key="label", max_len=256))
    n, P = args.n_samples_per_prompt, args.rollout_batch_size
    G = P * n
    cfg = PPOConfig.from_flat(advantage_estimator="gae", n_samples_per_prompt=n, rollout_batch_size=P,
                    generate_max_len=args.generate_max_len, max_iterations=args.iterations, init_kl_coef=0.01)
    s = StrategyConfig(zero_stage=args.zero_stage, bf16=bf16, micro_train_batch_size=args.micro_train_batch_size,
                       train_batch_size=G, learning_rate=1e-6, lr_warmup_ratio=0.0, lr_scheduler="constant")
    pad = tok.pad_token_id

    def reward(prompt, response, label):
        return response.count(label) / max(len(response), 1)

    run = build_run(RunConfig(RLModelConfig(pretrain=str(model), use_liger_kernel=args.use_liger_kernel), s, cfg,
                              EngineConfig(kind=args.rollout_engine, max_batch_sequences=G,
                                           enable_sleep=args.enable_sleep, sleep_level=args.sleep_level,
                                           **({} if args.gpu_memory_utilization is None else
                                              {"gpu_memory_utilization": args.gpu_memory_utilization}))),
                    LocalFactory(), prompts=prompts, tokenizer=tok, reward_fn=reward)
    trainer = run.trainer
    peak = DeviceMemoryPeak(dev)
    t0 = time.perf_counter()
    try:
        with peak:
            hist = trainer.fit()
    except torch.OutOfMemoryError as e:  # benchmarks/sleep_headroom.py reads this line and the exit status
        print(f"rl_phases: out of device memory at --micro_train_batch_size {args.micro_train_batch_size} "
              f"(engine sleep {'level ' + str(args.sleep_level) if args.enable_sleep else 'off'}): {str(e)[:200]}")
        if args.out:
            Path(args.out).write_text(json.dumps({"oom": True, "peak_device_gib": peak.gib}))
        raise SystemExit(3) from None
    total = time.perf_counter() - t0
    freed_gib = None
    if args.enable_sleep and dev.type == "cuda":  # what one sleep gives back to the trainer, measured on the device
        torch.cuda.synchronize()
        before = torch.cuda.mem_get_info(dev)[0]
        run.rollout.sleep(args.sleep_level)
        torch.cuda.synchronize()
        freed_gib = (torch.cuda.mem_get_info(dev)[0] - before) / 2**30
        run.rollout.wake_up()
    run.close()  # frees the engine (vLLM holds a share of the GPU) before the baselines
    phases = ["generate_s", "reward_s", "experience_s", "critic_train_s", "policy_train_s", "wake_s", "sync_s",
              "iteration_s"]
    later = hist[1:] or hist
    mean = {k: statistics.mean(m[k] for m in later) for k in phases}
    tokens = statistics.mean(m["response_length"] for m in later) * G
    if args.no_baselines:
        print(f"rl_phases (no baselines): {args.iterations} iterations in {total:.1f} s; " +
              ", ".join(f"{k[:-2]} {mean[k]:.3f} s" for k in phases))
        if peak.gib is not None:
            print(f"device memory in use at peak during the loop: {peak.gib:.2f} GiB")
        if args.out:
            Path(args.out).write_text(json.dumps({"oom": False, "phases": mean, "tokens": tokens,
                                                  "peak_device_gib": peak.gib, "freed_gib": freed_gib,
                                                  "history": hist}, indent=1))
        return

    # baseline 1: plain transformers generate of the same prompts x n
    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.bfloat16 if bf16 else torch.float32).to(dev).eval()
    ids = [prompts[i]["prompt_ids"] for i in range(P)]
    T = max(map(len, ids))
    inp = torch.full((P, T), pad, dtype=torch.long)
    att = torch.zeros(P, T, dtype=torch.long)
    for i, x in enumerate(ids):  # left padding
        inp[i, T - len(x):] = torch.tensor(x)
        att[i, T - len(x):] = 1
    gen_times = []
    for _ in range(max(len(later), 1)):
        sync(dev)
        g0 = time.perf_counter()
        with torch.no_grad():
            hf.generate(input_ids=inp.to(dev), attention_mask=att.to(dev), do_sample=True, max_new_tokens=args.generate_max_len,
                        min_new_tokens=args.generate_max_len, num_return_sequences=n, pad_token_id=pad)
        sync(dev)
        gen_times.append(time.perf_counter() - g0)
    del hf

    # baseline 2: a plain PyTorch policy loop over the same micro-batches and optimizer steps
    from rl_algos import logprobs_from_logits, policy_loss

    plain = AutoModelForCausalLM.from_pretrained(model, dtype=torch.bfloat16 if bf16 else torch.float32).to(dev).train()
    opt = torch.optim.AdamW(plain.parameters(), lr=1e-6)
    L = args.generate_max_len
    items = [make_item(ids[i % P], [5] * L) for i in range(G)]
    b = collate(items, pad)
    train_times = []
    for _ in range(max(len(later), 1)):
        sync(dev)
        g0 = time.perf_counter()
        for k in range(0, G, args.micro_train_batch_size):
            x, a = b.input_ids_BT[k:k + args.micro_train_batch_size].to(dev), b.attention_mask_BT[k:k + args.micro_train_batch_size].to(dev)
            m = b.loss_mask_BT[k:k + args.micro_train_batch_size].to(dev)
            logits = plain(input_ids=x, attention_mask=a, use_cache=False).logits[:, :-1]
            lp = torch.nn.functional.pad(logprobs_from_logits(logits, x[:, 1:]), (1, 0))
            out = policy_loss(lp, lp.detach(), torch.ones_like(lp), m, global_tokens=b.loss_mask_BT.sum())
            out.loss.backward()
        torch.nn.utils.clip_grad_norm_(plain.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        sync(dev)
        train_times.append(time.perf_counter() - g0)

    # baseline 3: a device-to-device copy of the bytes one sync moves (every policy parameter, the same dtype)
    params = [p.detach() for p in plain.parameters()]
    sync_bytes = sum(p.numel() * p.element_size() for p in params)
    dst = [torch.empty_like(p) for p in params]
    copy_times = []
    for _ in range(5):
        sync(dev)
        g0 = time.perf_counter()
        torch._foreach_copy_(dst, params)
        sync(dev)
        copy_times.append(time.perf_counter() - g0)
    copy_gbps = sync_bytes / min(copy_times) / 1e9
    sync_gbps = statistics.mean(m["sync_gb_per_s"] for m in later)
    del plain, opt, dst

    gen_base, train_base = statistics.mean(gen_times), statistics.mean(train_times)
    name = torch.cuda.get_device_name() if dev.type == "cuda" else "cpu"
    print(f"rl_phases: {name}; model {shape}; {P} prompts x {n} samples x {L} new tokens; "
          f"ZeRO-{args.zero_stage} {'bf16' if bf16 else 'fp32'}; {args.iterations} iterations in {total:.1f} s "
          f"(means over iterations 2..)")
    print(f"{'phase':<16}{'seconds':>10}{'share':>8}")
    for k in phases:
        print(f"{k[:-2]:<16}{mean[k]:>10.3f}{mean[k] / mean['iteration_s']:>8.1%}")
    print(f"generate: {tokens / mean['generate_s']:.0f} tok/s; plain model.generate {gen_base:.3f} s "
          f"-> ratio {mean['generate_s'] / gen_base:.3f}")
    train_tokens = b.input_ids_BT.numel()  # the plain loop's rows: G x (longest prompt + L), padded
    print(f"policy train: plain PyTorch loop {train_base:.3f} s ({train_tokens / train_base:.0f} padded tokens/s) "
          f"-> ratio {mean['policy_train_s'] / train_base:.3f}{'; liger kernels on both' * args.use_liger_kernel}")
    print(f"sync: {sync_bytes / 1e9:.3f} GB in {mean['sync_s']:.4f} s = {sync_gbps:.2f} GB/s; a device copy of the "
          f"same bytes {copy_gbps:.1f} GB/s -> ratio {sync_gbps / copy_gbps:.3f}; sync {mean['sync_s'] / mean['iteration_s']:.1%} "
          f"of an iteration (engine wake-up {mean['wake_s']:.3f} s apart); rollout {args.rollout_engine}")
    if peak.gib is not None:
        print(f"device memory in use at peak during the loop: {peak.gib:.2f} GiB (engine sleep "
              f"{'level ' + str(args.sleep_level) if args.enable_sleep else 'off'})")
    if freed_gib is not None:
        print(f"engine sleep level {args.sleep_level} frees {freed_gib:.2f} GiB of device memory for the trainer")
    if args.out:
        Path(args.out).write_text(json.dumps({"device": name, "shape": shape, "phases": mean, "tokens": tokens,
                                              "generate_baseline_s": gen_base, "train_baseline_s": train_base,
                                              "train_baseline_tokens": train_tokens,
                                              "use_liger_kernel": args.use_liger_kernel,
                                              "sync_bytes": sync_bytes, "sync_gb_per_s": sync_gbps,
                                              "device_copy_gb_per_s": copy_gbps, "peak_device_gib": peak.gib, "sleep_freed_gib": freed_gib,
                                              "history": hist}, indent=1))


if __name__ == "__main__":
    main()
