"""LoRA in the RL loop on CPU (real DeepSpeed, peft, an in-process HFEngine): the policy and the critic train
adapters only, every sync hands the engine the merged weights under HF names (checked by verify_weights),
the reward rises, resume continues the run, and the export is the merged model plus the adapter."""

from __future__ import annotations

import json

import pytest
import torch

from rl_core.data import DataConfig, PromptDataset, load_rows
from rl_core.rl.build import LocalFactory, RLModelConfig, RunConfig, build_run
from rl_core.strategy import StrategyConfig
from rl_core.trainers.ppo import PPOConfig
from rl_rollout import WeightSyncConfig

pytestmark = [pytest.mark.timeout(900), pytest.mark.slow]


def letter_reward(prompt, response, label, **info):
    return min(response.count(label), 8) / 8


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from transformers import AutoTokenizer

    from rl_rollout.testing import make_tiny_model

    root = tmp_path_factory.mktemp("ppo-lora")
    # peaked: decisive logits. From make_tiny_model's default init (embeddings of std 0.02, tied to the LM head,
    # norms frozen) an adapter cannot lift a token's log-prob far: measured, SFT on "aaaa" stalls at a loss of 2.46
    model = make_tiny_model(root / "tiny", peaked=True)
    (root / "prompts.jsonl").write_text(
        "".join(json.dumps({"p": f"Repeat the letter {c}: ", "y": c}) + "\n" for c in "abcd"))
    tok = AutoTokenizer.from_pretrained(model)
    prompts = PromptDataset(load_rows(str(root / "prompts.jsonl")), tok, DataConfig(input_key="p", label_key="y"))
    return model, tok, prompts


def make(setup, tmp_path, *, lr=1e-2, zero_stage=2, rank=4, target_modules="all-linear", **cfg):
    from rl_rollout import RewardRunner

    model, tok, prompts = setup
    kw = dict(n_samples_per_prompt=4, rollout_batch_size=4, generate_max_len=8, max_iterations=2,
              run_dir=str(tmp_path / "run"))
    kw.update(cfg)
    c = PPOConfig.from_flat(**kw)
    G = c.rollout_batch_size * c.sampling.n_samples_per_prompt
    s = StrategyConfig(zero_stage=zero_stage, bf16=False, micro_train_batch_size=G // 2, train_batch_size=G,
                       learning_rate=lr, lr_warmup_ratio=0.0, lr_scheduler="constant")
    m = RLModelConfig(pretrain=str(model), lora_rank=rank, lora_alpha=8, target_modules=target_modules)
    run = build_run(RunConfig(m, s, c, sync=WeightSyncConfig(verify=True)), LocalFactory(engine_kind="hf"),
                    prompts=prompts, tokenizer=tok, reward_fn=RewardRunner(letter_reward, workers=0, fallback=0.0))
    return run


def base_weights(model) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(model / "model.safetensors"))


def test_grpo_with_lora_trains_the_adapter_only_syncs_merged_weights_and_the_reward_rises(setup, tmp_path):
    """Every sync is checked by the engine (verify: count, sum, sum of squares per HF tensor); after the run the
    engine holds exactly the merged policy, the base weights never moved, and the engine sampled from the
    distribution the policy scores (log-prob gap)."""
    from rl_core.hf_export import merge_lora_stream

    run = make(setup, tmp_path, advantage_estimator="group_norm", n_samples_per_prompt=8, max_iterations=12,
               max_epochs=2, init_kl_coef=0.001, use_kl_loss=True)
    policy = run.policy.worker
    assert policy._lora is not None and run.ref is not None
    trainable = {n for n, p in policy.engine.module.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable), sorted(trainable)[:4]
    h = run.trainer.fit()
    first, last = sum(m["reward_mean"] for m in h[:3]) / 3, sum(m["reward_mean"] for m in h[-3:]) / 3
    assert last > first + 0.05, [round(m["reward_mean"], 3) for m in h]
    assert all(m["rollout_logprob_gap"] < 1e-4 for m in h), [m["rollout_logprob_gap"] for m in h]
    assert h[-1]["kl_loss"] > 0  # the reference (the frozen base) and the adapted policy differ

    named = ((n[len("model."):], p.detach()) for n, p in policy.engine.module.named_parameters())
    merged = dict(merge_lora_stream(named, policy._lora))
    served = dict(run.rollout.model.named_parameters())
    assert set(merged) == set(served)  # HF names: no base_model.model., base_layer or lora_ tensors
    for name, t in served.items():
        torch.testing.assert_close(t, merged[name], rtol=0, atol=0)
    base, moved = base_weights(setup[0]), 0
    for n, p in policy.engine.module.named_parameters():
        if not p.requires_grad:  # the frozen base: bit for bit the pretrained weights
            hf = n[len("model.base_model.model."):].replace(".base_layer.", ".")
            torch.testing.assert_close(p.detach(), base[hf], rtol=0, atol=0)
    for name, t in served.items():
        moved += not torch.equal(t, base[name])
    assert moved == 2 * 7  # each adapted linear (q k v o gate up down, two layers) moved, nothing else
    run.close()


def test_lora_ppo_with_a_critic_resumes_onto_the_uninterrupted_run_and_exports_merged_plus_adapter(setup, tmp_path):
    """Policy and critic with adapters (OpenRLHF's critic takes the LoRA flags too): the checkpoint holds the
    adapters (and the value head), resume reproduces the run, and --save_path is the merged model that
    transformers loads without peft, with the adapter in adapter/ (peft loads it onto the base)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    kw = dict(advantage_estimator="gae", init_kl_coef=0.01, max_iterations=3, target_modules="q_proj,v_proj")
    full_run = make(setup, tmp_path / "full", **kw, save_path=str(tmp_path / "final"), save_value_network=True)
    full = full_run.trainer.fit()
    full_run.close()
    make(setup, tmp_path / "a", **{**kw, "max_iterations": 2}, ckpt_path=str(tmp_path / "ck"),
         save_steps=2).trainer.fit()
    policy_ck = tmp_path / "ck" / "iter_00000002" / "policy"
    size = sum(f.stat().st_size for f in policy_ck.rglob("*model_states.pt"))
    assert 0 < size < 200_000, size  # the adapter, not the ~1.2 MB of base weights
    h = make(setup, tmp_path / "b", **kw, ckpt_path=str(tmp_path / "ck"), load_checkpoint=True).trainer.fit()
    assert len(h) == 3
    for k in ("reward_mean", "kl", "critic_loss", "policy_loss"):
        assert h[2][k] == pytest.approx(full[2][k], abs=1e-5), (k, h[2][k], full[2][k])

    final = tmp_path / "final"
    assert (final / "adapter" / "adapter_config.json").is_file() and (final / "tokenizer.json").is_file()
    merged = AutoModelForCausalLM.from_pretrained(final, dtype=torch.float32)
    assert not any("lora" in n for n, _ in merged.named_parameters())
    base = AutoModelForCausalLM.from_pretrained(setup[0], dtype=torch.float32)
    again = PeftModel.from_pretrained(base, final / "adapter").merge_and_unload()
    for (n, p), (_, q) in zip(merged.named_parameters(), again.named_parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-6, msg=n)
    critic = final / "critic"
    assert (critic / "config.json").is_file() and (critic / "rl_head.safetensors").is_file()
    assert (critic / "adapter" / "adapter_config.json").is_file()


def test_bad_lora_settings_fail_naming_the_flag():
    with pytest.raises(ValueError, match=r"lora_rank \(--lora_rank\) must be >= 0, got -1"):
        RLModelConfig(pretrain="m", lora_rank=-1)
    with pytest.raises(ValueError, match=r"--target_modules ' , ' names no module"):
        RLModelConfig(pretrain="m", lora_rank=4, target_modules=" , ")
    with pytest.raises(ValueError, match=r"lora_alpha \(--lora_alpha\) must be >= 1, got 0"):
        RLModelConfig(pretrain="m", lora_rank=4, lora_alpha=0)
