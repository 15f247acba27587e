"""The hybrid engine's CUDA IPC weight sync in the RL loop (needs a GPU; skipped with the reason otherwise).

The policy (DeepSpeed on cuda:0) runs in this process; the HFEngine runs in a child process on the same
GPU, reached through a one-rank pipe group with the worker-group calls, as a Ray actor would be. PPO
iterations then sync the weights with :class:`rl_core.rl.IpcWeightSync`: the engine reads them in place
from the policy's parameters (in place) or IPC buckets, and its sampling logprobs must equal the policy's
recomputation. With LoRA (``lora_rank`` 4) the buckets carry the merged weights under HF names; with DeepSpeed
sleep the weights move between syncs, so the sender switches from in place to buckets."""

from __future__ import annotations

import json
import multiprocessing as mp

import pytest
import torch

pytestmark = [pytest.mark.timeout(900),
              pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA IPC needs a GPU (none here)")]


def _serve(conn, model_path):
    from rl_rollout.hf_engine import HFEngine

    engine = HFEngine(model_path, dtype="float32", device="cuda")
    while True:
        method, args, kwargs = conn.recv()
        if method == "__stop__":
            conn.send(("ok", None))
            return
        try:
            if method == "weights_digest":
                out = {n: p.detach().double().sum().item() for n, p in engine.model.named_parameters()}
            else:
                out = getattr(engine, method)(*args, **kwargs)
            conn.send(("ok", out))
        except Exception as e:  # noqa: BLE001 - sent back to the caller, which raises it
            conn.send(("error", f"{type(e).__name__}: {e}"))


class ChildGroup:
    """A one-rank worker group over an HFEngine in a spawned process (what a Ray actor group does)."""

    world_size = 1

    def __init__(self, model_path):
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_serve, args=(child, str(model_path)), daemon=True)
        self.proc.start()

    def call_rank(self, rank, method, *args, **kwargs):
        self.conn.send((method, args, kwargs))
        status, out = self.conn.recv()
        if status != "ok":
            raise RuntimeError(f"engine process: {method}: {out}")
        return out

    def call(self, method, *args, **kwargs):
        return [self.call_rank(0, method, *args, **kwargs)]

    def shutdown(self):
        self.call_rank(0, "__stop__")
        self.proc.join(30)


class ChildEngineFactory:
    """rl-core's builder with the roles in this process and the engine in a child process on the same GPU,
    synced over CUDA IPC (what rl-cli's RayFactory does with Ray actors)."""

    def __init__(self):
        self.engine = None

    def role(self, name, worker_cls, *args, **kwargs):
        from rl_core.rl import LocalGroup

        return LocalGroup(worker_cls(*args, **kwargs), name)

    def rollout(self, engine_cfg, model, *, dtype, seed, device):
        from rl_core.rl import GroupRollout

        self.engine = ChildGroup(model)
        return GroupRollout([self.engine])

    def weight_sync(self, policy, rollout, sync_cfg):
        from rl_core.rl import IpcWeightSync

        assert sync_cfg.resolve(in_process=False, on_gpu=True, colocated=True) == "ipc"
        return IpcWeightSync(policy, rollout, verify=sync_cfg.verify)


@pytest.mark.parametrize("lora_rank,ds_sleep", [(0, False), (4, False), (0, True)])
def test_ppo_over_cuda_ipc_keeps_the_engine_on_the_policy_weights(tmp_path, lora_rank, ds_sleep):
    from transformers import AutoTokenizer

    from rl_core.data import DataConfig, PromptDataset, load_rows
    from rl_core.strategy import StrategyConfig
    from rl_core.trainers.ppo import PPOConfig
    from rl_rollout.testing import make_tiny_model

    model = make_tiny_model(tmp_path / "tiny", hidden_size=256, num_layers=4, num_heads=4, num_kv_heads=2,
                            intermediate_size=512)
    (tmp_path / "p.jsonl").write_text("".join(json.dumps({"p": f"Repeat the letter {c}: ", "y": c}) + "\n"
                                             for c in "abcd"))
    tok = AutoTokenizer.from_pretrained(model)
    prompts = PromptDataset(load_rows(str(tmp_path / "p.jsonl")), tok, DataConfig(input_key="p", label_key="y"))
    c = PPOConfig.from_flat(advantage_estimator="gae", init_kl_coef=0, n_samples_per_prompt=4, rollout_batch_size=4,
                  generate_max_len=8, max_iterations=3, deepspeed_enable_sleep=ds_sleep)
    s = StrategyConfig(zero_stage=2, bf16=False, micro_train_batch_size=8, train_batch_size=16, learning_rate=1e-3,
                       lr_warmup_ratio=0.0, lr_scheduler="constant")
    from rl_core.rl.build import RLModelConfig, RunConfig, build_run
    from rl_rollout import WeightSyncConfig

    factory = ChildEngineFactory()
    m = RLModelConfig(pretrain=str(model), lora_rank=lora_rank, lora_alpha=8)
    run = build_run(RunConfig(m, s, c, sync=WeightSyncConfig(verify=True)), factory,
                    prompts=prompts, tokenizer=tok, reward_fn=lambda p, r, y: min(r.count(y), 8) / 8)
    policy, engine, trainer = run.policy, factory.engine, run.trainer
    assert policy.worker.s.device.type == "cuda" and run.critic is not None
    try:
        h = trainer.fit()
        assert len(h) == 3
        for m in h:
            assert m["rollout_logprob_gap"] < 1e-4, m
            assert m["sync_gb_per_s"] > 0, m
            assert 0 < m["sync_share_work_s"] <= m["sync_share_s"], m  # the policy's own time within its call
        served = engine.call_rank(0, "weights_digest")
        trained = policy.worker.weights_digest()  # LoRA: of the merged weights, under HF names
        assert set(trained) <= set(served)
        for name, v in trained.items():
            assert served[name] == pytest.approx(v, rel=1e-9, abs=1e-9), name
        assert engine.call_rank(0, "__getattribute__", "policy_version") == 3
        sender = policy.worker.weights._ipc
        if ds_sleep:  # in place first; DeepSpeed's offload and reload moved the weights, so it packs from then on
            assert sender.pack and sender.generation == 2, (sender.pack, sender.generation)
            assert [m["sync_in_place"] for m in h] == [1.0, 0.0, 0.0], h
        else:  # the live weights in place (LoRA: the merged copies, packed); keys only after the first sync
            assert sender.pack is (lora_rank > 0) and sender.generation == 1, (sender.pack, sender.generation)
            assert all(m["sync_in_place"] == float(lora_rank == 0) for m in h), h
    finally:
        engine.shutdown()
