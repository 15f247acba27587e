"""QLoRA (``--load_in_4bit``, rl_core.qlora) on CPU with the real bitsandbytes, peft and DeepSpeed: the base weights
load packed in 4 bits, what the weight sync reads is exactly what the layers compute with (dequantized base plus the
merged adapter), the RL loop pushes version 0 before its first generation (the engine sampled from the unquantized
checkpoint otherwise), the reference shares the 4-bit base, resume continues the run and the export is a plain model."""

from __future__ import annotations

import json

import pytest
import torch

from rl_core.qlora import Load4bitConfig
from rl_core.rl.model_config import RLModelConfig

bnb = pytest.importorskip("bitsandbytes", reason="QLoRA needs bitsandbytes (rl-core[qlora], in the dev group)")
pytestmark = [pytest.mark.timeout(900)]


def test_bad_qlora_settings_fail_naming_the_flag():
    with pytest.raises(ValueError, match=r"--load_in_4bit trains LoRA adapters over a frozen 4-bit base: add --lora_rank"):
        RLModelConfig(pretrain="m", load_in_4bit=Load4bitConfig())
    with pytest.raises(ValueError, match=r"--bnb_4bit_quant_type 'int4' is not a 4-bit type; give nf4 or fp4"):
        Load4bitConfig(bnb_4bit_quant_type="int4")
    with pytest.raises(ValueError, match=r"--load_in_4bit with --zero_stage 3: ZeRO-3 cannot partition"):
        Load4bitConfig().check(lora_rank=4, zero_stage=3)
    Load4bitConfig().check(lora_rank=4, zero_stage=2)  # what it takes


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from rl_rollout.testing import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("qlora") / "tiny", peaked=True)


@pytest.mark.parametrize("quant_type", ["nf4", "fp4"])
def test_the_weights_read_out_are_what_the_4bit_layers_compute_with(tiny, quant_type):
    """The full weights (rl_core.ds_internals' bucket copies: the sync's, verify's and the export's source),
    merged with a non-zero adapter, loaded into the plain transformers model, give the 4-bit model's logits; the
    packed model holds its linear weights in a quarter of the bytes."""
    from transformers import AutoModelForCausalLM

    from rl_core.ds_internals import _gather_bucket
    from rl_core.hf_export import merge_lora_stream
    from rl_core.models import Actor, LoraSpec

    spec = LoraSpec.of(4, 8, 0.0, "all-linear")
    actor = Actor.from_pretrained(tiny, dtype="fp32", lora=spec, load_in_4bit=Load4bitConfig(quant_type))
    packed = {n: p for n, p in actor.named_parameters() if hasattr(p, "quant_state")}
    assert len(packed) == 2 * 7, sorted(packed)[:3]  # q k v o gate up down of both layers; not the LM head
    torch.manual_seed(0)
    for n, p in actor.named_parameters():
        if ".lora_B." in n:
            torch.nn.init.normal_(p, std=0.05)
    full = dict(merge_lora_stream(_gather_bucket(list(actor.model.named_parameters()), None), actor.model.peft_config))
    plain = AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32)
    missing, unexpected = plain.load_state_dict(full, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)  # tied to the embeddings
    ids = torch.randint(0, 100, (2, 12))
    actor.eval()
    with torch.no_grad():
        want = plain(input_ids=ids).logits
        got = actor.model(input_ids=ids).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)  # W + BA merged vs Wx + B(Ax): fp32 rounding
    # and after the forward in eval mode, which on an AVX512-BF16 CPU would have repacked the weights in place
    again = dict(merge_lora_stream(_gather_bucket(list(actor.model.named_parameters()), None), actor.model.peft_config))
    for name, t in full.items():
        torch.testing.assert_close(again[name], t, rtol=0, atol=0, msg=name)
    orig = dict(AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32).named_parameters())
    for name in (n for n in full if "proj" in n):  # quantization moved every packed weight, by ~1e-2 at most here
        assert 0 < (full[name] - orig[name]).abs().max() < 0.25 * orig[name].abs().max() + 1e-3, name
    packed_bytes = sum(p.numel() * p.element_size() for p in packed.values())
    full_bytes = sum(p.quant_state.shape.numel() * 4 for p in packed.values())  # fp32 linear weights
    assert packed_bytes * 8 == full_bytes  # 4 bits a weight against 32


def make(tiny, tmp_path, *, zero_stage=2, **cfg):
    from transformers import AutoTokenizer

    from rl_core.data import DataConfig, PromptDataset, load_rows
    from rl_core.rl.build import LocalFactory, RunConfig, build_run
    from rl_core.strategy import StrategyConfig
    from rl_core.trainers.ppo import PPOConfig
    from rl_rollout import RewardRunner, WeightSyncConfig

    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "prompts.jsonl").write_text(
        "".join(json.dumps({"p": f"Repeat the letter {c}: ", "y": c}) + "\n" for c in "abcd"))
    tok = AutoTokenizer.from_pretrained(tiny)
    prompts = PromptDataset(load_rows(str(tmp_path / "prompts.jsonl")), tok, DataConfig(input_key="p", label_key="y"))
    kw = dict(n_samples_per_prompt=4, rollout_batch_size=4, generate_max_len=8, max_iterations=2,
              run_dir=str(tmp_path / "run"))
    kw.update(cfg)
    c = PPOConfig.from_flat(**kw)
    G = c.rollout_batch_size * c.sampling.n_samples_per_prompt
    s = StrategyConfig(zero_stage=zero_stage, bf16=False, micro_train_batch_size=G // 2, train_batch_size=G,
                       learning_rate=1e-2, lr_warmup_ratio=0.0, lr_scheduler="constant")
    m = RLModelConfig(pretrain=str(tiny), lora_rank=4, lora_alpha=8, load_in_4bit=Load4bitConfig())

    def letter_reward(prompt, response, label, **info):
        return min(response.count(label), 8) / 8

    return build_run(RunConfig(m, s, c, sync=WeightSyncConfig(verify=True)), LocalFactory(engine_kind="hf"),
                     prompts=prompts, tokenizer=tok, reward_fn=RewardRunner(letter_reward, workers=0, fallback=0.0))


@pytest.mark.slow
def test_grpo_with_qlora_syncs_the_dequantized_merged_policy_from_version_0_and_exports_a_plain_model(tiny, tmp_path):
    """Every sync checked by the engine (verify); the engine sampled from the distribution the 4-bit policy scores
    from the first iteration on (the gap would be the quantization error had version 0 not been pushed); the
    reference is the same 4-bit base (KL 0 before the first update); the base never moves; the export loads in
    transformers unquantized and equals what the engine holds."""
    from transformers import AutoModelForCausalLM

    run = make(tiny, tmp_path, advantage_estimator="group_norm", max_iterations=4, init_kl_coef=0.001,
               use_kl_loss=True, save_path=str(tmp_path / "final"))
    policy = run.policy.worker
    before = {n: p.detach().clone() for n, p in policy.engine.module.named_parameters() if hasattr(p, "quant_state")}
    assert before and run.ref is not None
    assert any(hasattr(p, "quant_state") for p in run.ref.worker.engine.module.parameters())
    h = run.trainer.fit()
    assert len(h) == 4
    assert all(m["rollout_logprob_gap"] < 1e-4 for m in h), [m["rollout_logprob_gap"] for m in h]
    assert abs(h[0]["kl_loss"]) < 1e-6 < h[-1]["kl_loss"], (h[0]["kl_loss"], h[-1]["kl_loss"])
    for n, p in policy.engine.module.named_parameters():
        if n in before:
            assert torch.equal(p.detach(), before[n]), n  # the packed base: never trained
    served = {n: t.detach() for n, t in run.rollout.model.named_parameters()}
    final = AutoModelForCausalLM.from_pretrained(tmp_path / "final", dtype=torch.float32)
    assert getattr(final.config, "quantization_config", None) is None
    assert not any("lora" in n or "absmax" in n for n in final.state_dict())
    for n, p in final.named_parameters():
        torch.testing.assert_close(p.detach(), served[n], rtol=0, atol=0, msg=n)
    assert (tmp_path / "final" / "adapter" / "adapter_config.json").is_file()
    run.close()


@pytest.mark.slow
def test_qlora_resume_continues_onto_the_uninterrupted_run(tiny, tmp_path):
    """The checkpoint of a 4-bit run (DeepSpeed's, the packed base inside the module's state) loads back into a
    4-bit policy: iteration 3 after a resume at 2 equals the uninterrupted run's."""
    kw = dict(advantage_estimator="group_norm", max_iterations=3, init_kl_coef=0.01)
    full = make(tiny, tmp_path / "full", **kw).trainer.fit()
    make(tiny, tmp_path / "a", **{**kw, "max_iterations": 2}, ckpt_path=str(tmp_path / "ck"), save_steps=2).trainer.fit()
    h = make(tiny, tmp_path / "b", **kw, ckpt_path=str(tmp_path / "ck"), load_checkpoint=True).trainer.fit()
    assert len(h) == 3
    for k in ("reward_mean", "kl", "policy_loss"):
        assert h[2][k] == pytest.approx(full[2][k], abs=1e-5), (k, h[2][k], full[2][k])
