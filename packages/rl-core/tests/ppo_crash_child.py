"""One PPO run (gae: policy, critic, reference; an HFEngine; tiny model, CPU) that may SIGKILL itself mid-save.

Run by test_core_ppo_crash.py as ``python ppo_crash_child.py SPEC.json``. SPEC holds the model and
prompt paths, ``ckpt_path`` (a checkpoint every iteration; null: none), ``run_dir``, ``save_path``, ``max_iterations``, ``max_ckpt_num``,
``load_checkpoint`` and ``kill`` (``null``, or ``"STEP@ITERATION"``). STEP is a step of
:class:`rl_core.rl.checkpoint.RLCheckpoints`' save (``after:policy``: between the policy and the
critic, ``before:commit``: every part written but the marker, ``after:commit``: the marker written,
older iterations not yet pruned), or ``inside:policy``: in the middle of the policy's DeepSpeed save
(its model states written, its optimizer states half-written when the process dies).

The kill goes through the save's test-only ``crash_hook`` and, for ``inside:``, a wrapped DeepSpeed
``TorchCheckpointEngine.save``; nothing else differs from a normal run.
"""

from __future__ import annotations

import io
import json
import os
import signal
import sys


def letter_reward(prompt, response, label, **info):
    return min(response.count(label), 8) / 8


def die() -> None:
    sys.stdout.flush()
    os.kill(os.getpid(), signal.SIGKILL)


def kill_inside_next_engine_save(nth: int = 2) -> None:
    """The ``nth`` DeepSpeed file written from now on gets half its bytes, then the process dies."""
    import torch
    from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine

    calls = 0
    original = TorchCheckpointEngine.save

    def save(self, state_dict, path):
        nonlocal calls
        calls += 1
        if calls == nth:
            buf = io.BytesIO()
            torch.save(state_dict, buf)
            with open(path, "wb") as f:
                f.write(buf.getvalue()[:buf.tell() // 2])
            die()
        return original(self, state_dict, path)

    TorchCheckpointEngine.save = save


def main(spec_path: str) -> None:
    import logging

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    spec = json.loads(open(spec_path).read())
    from transformers import AutoTokenizer

    from rl_core.data import DataConfig, PromptDataset, load_rows
    from rl_core.rl.build import LocalFactory, RLModelConfig, RunConfig, build_run
    from rl_core.strategy import StrategyConfig
    from rl_core.trainers.ppo import PPOConfig
    from rl_rollout import EngineConfig, RewardRunner

    tok = AutoTokenizer.from_pretrained(spec["model"])
    prompts = PromptDataset(load_rows(spec["prompts"]), tok, DataConfig(input_key="p", label_key="y"))
    ppo = PPOConfig.from_flat(advantage_estimator="gae", n_samples_per_prompt=4, rollout_batch_size=4, generate_max_len=8,
                    init_kl_coef=0.01, kl_target=0.1, max_iterations=spec["max_iterations"],
                    save_steps=1 if spec["ckpt_path"] else -1, ckpt_path=spec["ckpt_path"],
                    max_ckpt_num=spec["max_ckpt_num"],
                    load_checkpoint=spec["load_checkpoint"], run_dir=spec["run_dir"], save_path=spec["save_path"],
                    save_value_network=True)
    strategy = StrategyConfig(zero_stage=2, bf16=False, micro_train_batch_size=8, train_batch_size=16,
                              learning_rate=2e-3, lr_warmup_ratio=0.0, lr_scheduler="constant", seed=11)
    run = build_run(RunConfig(RLModelConfig(pretrain=spec["model"]), strategy, ppo, EngineConfig(kind="hf")),
                    LocalFactory(), prompts=prompts, tokenizer=tok,
                    reward_fn=RewardRunner(letter_reward, workers=0, fallback=0.0))
    if spec["kill"]:
        step, at = spec["kill"].split("@")
        at = int(at)
        where, role = step.split(":")

        def hook(point: str, iteration: int) -> None:
            if iteration != at:
                return
            if where == "inside" and point == f"before:{role}":
                kill_inside_next_engine_save()
            elif point == step:
                die()

        run.trainer.ckpt.store.crash_hook = hook  # RLCheckpoints, under the loop's LoopCheckpoints
    try:
        run.trainer.fit()
    finally:
        run.close()
    print("finished", flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
