"""SFTTrainer end to end on CPU (real DeepSpeed ZeRO-2, gloo): data file -> loss falls -> metrics,
checkpoints, resume with the same batches, HF export."""

from __future__ import annotations

import json

import pytest
import torch

from rl_core.data import DataConfig, SFTDataset, load_rows
from rl_core.models import Actor
from rl_core.strategy import DeepSpeedStrategy, StrategyConfig
from rl_core.trainers import SFTConfig, SFTTrainer
from rl_rollout.testing import make_tiny_model

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("sft")
    model = make_tiny_model(root / "tiny")
    rows = [{"q": f"reverse {w}", "a": w[::-1]} for w in ["abc", "hello", "xyz", "rl", "ppo", "grpo", "data", "kto"]]
    (root / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return root, model


def run(setup, tmp, **cfg):
    from transformers import AutoTokenizer

    root, model = setup
    tok = AutoTokenizer.from_pretrained(model)
    ds = SFTDataset(load_rows(str(root / "train.jsonl")), tok,
                    DataConfig(input_key="q", output_key="a", apply_chat_template=True, max_len=64))
    s = DeepSpeedStrategy(StrategyConfig(zero_stage=2, bf16=False, micro_train_batch_size=2, train_batch_size=4,
                                         learning_rate=3e-3, lr_warmup_ratio=0.0))
    trainer = SFTTrainer(s, Actor.from_pretrained(model, dtype="fp32"), tok, ds, SFTConfig(max_epochs=5, **cfg))
    return trainer, trainer.fit()


def test_sft_trains_logs_and_exports(setup, tmp_path):
    trainer, losses = run(setup, tmp_path, run_dir=str(tmp_path / "run"), save_path=str(tmp_path / "out"))
    assert len(losses) == 10  # 8 rows / global batch 4 = 2 steps per epoch x 5 epochs
    assert sum(losses[-2:]) < 0.8 * sum(losses[:2]), losses
    lines = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == list(range(1, 11))
    assert [x["train/loss"] for x in lines] == pytest.approx(losses)
    assert (tmp_path / "run" / "curves.png").stat().st_size > 1000
    assert list((tmp_path / "run" / "tensorboard").iterdir())
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(tmp_path / "out")  # the export loads


def test_resume_continues_with_the_same_batches(setup, tmp_path):
    _, full = run(setup, tmp_path)
    ck = str(tmp_path / "ck")
    _, first = run(setup, tmp_path, ckpt_path=ck, save_steps=3, max_steps=5)  # checkpoint at 3, "crash" after 5
    _, rest = run(setup, tmp_path, ckpt_path=ck, load_checkpoint=True)
    assert len(first) == 5 and len(rest) == 7
    torch.testing.assert_close(torch.tensor(first[:3] + rest), torch.tensor(full), atol=1e-6, rtol=0)


def test_resume_without_a_checkpoint_folder_fails_early():
    with pytest.raises(ValueError, match=r"load_checkpoint needs ckpt_path"):
        SFTConfig(load_checkpoint=True)


def test_lora_trains_the_adapter_only_and_exports_merged(setup, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rl_core.models import LoraSpec

    root, model = setup
    tok = AutoTokenizer.from_pretrained(model)
    ds = SFTDataset(load_rows(str(root / "train.jsonl")), tok,
                    DataConfig(input_key="q", output_key="a", apply_chat_template=True, max_len=64))
    actor = Actor.from_pretrained(model, dtype="fp32", lora=LoraSpec(rank=4, alpha=8))
    base_before = {k: v.clone() for k, v in actor.named_parameters() if "lora_" not in k}
    assert all(not p.requires_grad for k, p in actor.named_parameters() if "lora_" not in k)
    s = DeepSpeedStrategy(StrategyConfig(zero_stage=2, bf16=False, micro_train_batch_size=2, train_batch_size=4,
                                         learning_rate=1e-2, lr_warmup_ratio=0.0))
    trainer = SFTTrainer(s, actor, tok, ds, SFTConfig(max_epochs=2, save_path=str(tmp_path / "out")))
    losses = trainer.fit()
    assert losses[-1] < losses[0], losses
    trained = trainer.engine.module
    for k, p in trained.named_parameters():
        if "lora_" not in k:
            torch.testing.assert_close(p, base_before[k], rtol=0, atol=0)  # the base stays frozen
    assert (tmp_path / "out" / "adapter" / "adapter_config.json").is_file()
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32).eval()
    ids = ds[0]["input_ids"].unsqueeze(0)
    with torch.no_grad():
        want = trained.model(input_ids=ids).logits
        got = merged(input_ids=ids).logits
        base = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)(input_ids=ids).logits
    assert (want - base).abs().max() > 1e-3, "the adapter changed the model"
    torch.testing.assert_close(got, want, atol=1e-4, rtol=0)


def test_packing_gives_the_padded_losses(setup, tmp_path):
    from transformers import AutoTokenizer

    root, model = setup
    tok = AutoTokenizer.from_pretrained(model)
    losses = {}
    for packing in (False, True):
        ds = SFTDataset(load_rows(str(root / "train.jsonl")), tok,
                        DataConfig(input_key="q", output_key="a", apply_chat_template=True, max_len=64, packing=packing))
        s = DeepSpeedStrategy(StrategyConfig(zero_stage=2, bf16=False, micro_train_batch_size=2, train_batch_size=4,
                                             learning_rate=3e-3, lr_warmup_ratio=0.0))
        losses[packing] = SFTTrainer(s, Actor.from_pretrained(model, dtype="fp32"), tok, ds,
                                     SFTConfig(max_epochs=2)).fit()
    torch.testing.assert_close(torch.tensor(losses[True]), torch.tensor(losses[False]), atol=1e-5, rtol=0)


def test_trainers_without_packing_refuse_the_flag(setup):
    from transformers import AutoTokenizer

    from rl_core.data import PreferenceDataset
    from rl_core.models import RewardModel
    from rl_core.trainers import RewardModelTrainer, RMConfig

    _, model = setup
    tok = AutoTokenizer.from_pretrained(model)
    ds = PreferenceDataset([{"chosen": "ab", "rejected": "ba"}] * 4, tok, DataConfig(packing=True, max_len=16))
    s = DeepSpeedStrategy(StrategyConfig(zero_stage=0, bf16=False, micro_train_batch_size=2, train_batch_size=4))
    with pytest.raises(ValueError, match="RewardModelTrainer does not pack sequences.*drop --packing"):
        RewardModelTrainer(s, RewardModel.from_pretrained(model, dtype="fp32"), tok, ds, RMConfig())


def test_adam_offload_gives_the_same_losses(setup, tmp_path):
    """--adam_offload: ZeRO-2 with optimizer states on CPU (DeepSpeedCPUAdam, built by DeepSpeed on first
    use) follows the same AdamW trajectory as torch's AdamW."""
    from transformers import AutoTokenizer

    root, model = setup
    tok = AutoTokenizer.from_pretrained(model)
    ds = SFTDataset(load_rows(str(root / "train.jsonl")), tok,
                    DataConfig(input_key="q", output_key="a", apply_chat_template=True, max_len=64))
    losses = {}
    for offload in (False, True):
        s = DeepSpeedStrategy(StrategyConfig(zero_stage=2, bf16=False, micro_train_batch_size=2, train_batch_size=4,
                                             learning_rate=3e-3, lr_warmup_ratio=0.0, adam_offload=offload))
        trainer = SFTTrainer(s, Actor.from_pretrained(model, dtype="fp32"), tok, ds, SFTConfig(max_epochs=2))
        if offload:
            assert type(trainer.engine.optimizer.optimizer).__name__ == "DeepSpeedCPUAdam"
        losses[offload] = trainer.fit()
    torch.testing.assert_close(torch.tensor(losses[True]), torch.tensor(losses[False]), atol=1e-4, rtol=0)


def test_gradient_checkpointing_gives_the_same_losses(setup, tmp_path):
    from transformers import AutoTokenizer

    root, model = setup
    tok = AutoTokenizer.from_pretrained(model)
    ds = SFTDataset(load_rows(str(root / "train.jsonl")), tok,
                    DataConfig(input_key="q", output_key="a", apply_chat_template=True, max_len=64))
    losses = {}
    for ckpt in (False, True):
        s = DeepSpeedStrategy(StrategyConfig(zero_stage=2, bf16=False, micro_train_batch_size=2, train_batch_size=4,
                                             learning_rate=3e-3, lr_warmup_ratio=0.0, gradient_checkpointing=ckpt))
        actor = Actor.from_pretrained(model, dtype="fp32", gradient_checkpointing=ckpt)
        assert actor.model.is_gradient_checkpointing == ckpt
        losses[ckpt] = SFTTrainer(s, actor, tok, ds, SFTConfig(max_epochs=2)).fit()
    torch.testing.assert_close(torch.tensor(losses[True]), torch.tensor(losses[False]), atol=1e-5, rtol=0)
