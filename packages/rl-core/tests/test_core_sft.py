"""SFTTrainer end to end on CPU (real DeepSpeed ZeRO-2, gloo): data file -> loss falls -> metrics,
checkpoints, resume with the same batches (also LoRA adapter-only checkpoints), eval sets, HF export."""

from __future__ import annotations

import json

import pytest
import torch

from rl_core.data import DataConfig, SFTDataset, load_rows
from rl_core.models import Actor
from rl_core.strategy import DeepSpeedStrategy, StrategyConfig
from rl_core.trainers import SFTConfig, SFTTrainer
from rl_rollout.testing import make_tiny_model

pytestmark = [pytest.mark.timeout(600), pytest.mark.slow]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("sft")
    model = make_tiny_model(root / "tiny")
    rows = [{"q": f"reverse {w}", "a": w[::-1]} for w in ["abc", "hello", "xyz", "rl", "ppo", "grpo", "data", "kto"]]
    (root / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    held_out = [{"q": f"reverse {w}", "a": w[::-1]} for w in ["cat", "sun", "map", "tree"]]  # same task, unseen words
    (root / "eval.jsonl").write_text("".join(json.dumps(r) + "\n" for r in held_out))
    return root, model


DATA = DataConfig(input_key="q", output_key="a", apply_chat_template=True, max_len=64)


def sft_data(setup, name="train.jsonl"):
    from transformers import AutoTokenizer

    root, model = setup
    return SFTDataset(load_rows(str(root / name)), AutoTokenizer.from_pretrained(model), DATA)


def run(setup, tmp, *, lora=None, zero_stage=2, lr=3e-3, eval_dataset=None, fit=True, **cfg):
    from transformers import AutoTokenizer

    root, model = setup
    tok = AutoTokenizer.from_pretrained(model)
    ds = SFTDataset(load_rows(str(root / "train.jsonl")), tok, DATA)
    s = DeepSpeedStrategy(StrategyConfig(zero_stage=zero_stage, bf16=False, micro_train_batch_size=2,
                                         train_batch_size=4, learning_rate=lr, lr_warmup_ratio=0.0))
    torch.manual_seed(0)  # peft draws the LoRA A init from the global RNG: the same adapter in every run
    trainer = SFTTrainer(s, Actor.from_pretrained(model, dtype="fp32", lora=lora), tok, ds,
                         SFTConfig.from_flat(max_epochs=5, **cfg), eval_dataset=eval_dataset)
    return trainer, (trainer.fit() if fit else None)


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
        SFTConfig.from_flat(load_checkpoint=True)


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
    trainer = SFTTrainer(s, actor, tok, ds, SFTConfig.from_flat(max_epochs=2, save_path=str(tmp_path / "out")))
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


def test_a_trainer_without_packing_refuses_the_flag(setup):
    """SFT, RM, DPO and KTO pack; a Trainer subclass that does not say it does stops before anything starts."""
    from transformers import AutoTokenizer

    from rl_core.data import PreferenceDataset
    from rl_core.trainers import Trainer, TrainerConfig

    _, model = setup
    tok = AutoTokenizer.from_pretrained(model)
    ds = PreferenceDataset([{"chosen": "ab", "rejected": "ba"}] * 4, tok, DataConfig(packing=True, max_len=16))
    s = DeepSpeedStrategy(StrategyConfig(zero_stage=0, bf16=False, micro_train_batch_size=2, train_batch_size=4))

    class Unpacked(Trainer):
        pass

    with pytest.raises(ValueError, match="Unpacked does not pack sequences.*drop --packing"):
        Unpacked(s, None, tok, ds, TrainerConfig())


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


@pytest.mark.parametrize("zero_stage", [2, 3])
def test_lora_checkpoints_hold_the_adapter_only_and_resume_exactly(setup, tmp_path, zero_stage):
    """A LoRA checkpoint skips the frozen base (DeepSpeed exclude_frozen_parameters) and still
    resumes onto the uninterrupted run's losses; a checkpoint of another LoRA layout fails loudly."""
    from rl_core.checkpoint import CheckpointManager
    from rl_core.models import LoraSpec

    lora = LoraSpec(rank=8, alpha=16)
    _, full = run(setup, tmp_path, lora=lora, lr=1e-2, zero_stage=zero_stage)
    ck = tmp_path / "ck"
    trainer, first = run(setup, tmp_path, lora=lora, lr=1e-2, zero_stage=zero_stage, ckpt_path=str(ck), save_steps=3,
                         max_steps=5)
    _, rest = run(setup, tmp_path, lora=lora, lr=1e-2, zero_stage=zero_stage, ckpt_path=str(ck), load_checkpoint=True)
    assert len(first) == 5 and len(rest) == 7
    torch.testing.assert_close(torch.tensor(first[:3] + rest), torch.tensor(full), atol=1e-6, rtol=0)
    lora_b = [p for n, p in trainer.engine.module.named_parameters() if "lora_B" in n]
    # B starts at 0, so the checkpoint held trained adapter weights (ZeRO-3: this rank's partition is all of it)
    assert lora_b and all(getattr(p, "ds_tensor", p).abs().max() > 0 for p in lora_b)
    if zero_stage == 3:  # ZeRO-3 model-states files hold partition placeholders whatever is excluded
        return

    states = ck / "step_00000003" / "ds" / "mp_rank_00_model_states.pt"
    saved = torch.load(states, map_location="cpu", weights_only=False)["module"]
    module = trainer.engine.module
    trainable = {n for n, p in module.named_parameters() if p.requires_grad}
    frozen_ = {n for n, p in module.named_parameters(remove_duplicate=False) if not p.requires_grad}
    assert trainable and trainable <= set(saved)  # every adapter weight is in the checkpoint
    tied = {"model.base_model.model.lm_head.weight"}  # DeepSpeed drops a tied weight under its first name only
    assert set(saved) & frozen_ <= tied, sorted(set(saved) & frozen_)
    trainer.engine.save_checkpoint(str(tmp_path / "whole"), tag="ds")  # what CheckpointManager wrote before
    ratio = states.stat().st_size / (tmp_path / "whole" / "ds" / "mp_rank_00_model_states.pt").stat().st_size
    base_bytes = sum(p.numel() * p.element_size() for p in module.parameters())
    print(f"LoRA model-states {states.stat().st_size} bytes, {ratio:.3f} of a full checkpoint's; "
          f"{states.stat().st_size / base_bytes:.3f} of the model's parameter bytes")
    assert ratio < 0.25 and states.stat().st_size < 0.5 * base_bytes, ratio

    other, _ = run(setup, tmp_path, lora=LoraSpec(rank=8, alpha=16, target_modules=("q_proj", "v_proj")), fit=False)
    with pytest.raises(ValueError, match=r"does not fit the model: missing trainable \[\] \(0\), unexpected .*lora"):
        CheckpointManager(ck, other.s).load(other.engine)  # adapters on every linear -> only q and v
    qv = tmp_path / "ck_qv"
    CheckpointManager(qv, other.s).save(other.engine, 1, {"epoch": 0, "batch_in_epoch": 1})
    with pytest.raises(ValueError, match=r"missing trainable \['[^']*k_proj\.lora_A[^]]*\] \(20\), unexpected \[\]"):
        CheckpointManager(qv, trainer.s).load(trainer.engine)  # q and v only -> every linear: 20 adapters missing


def test_eval_loss_falls_on_held_out_rows_and_is_logged(setup, tmp_path):
    trainer, _ = run(setup, tmp_path, eval_dataset=sft_data(setup, "eval.jsonl"), fit=False,
                     run_dir=str(tmp_path / "run"), eval_steps=4)
    before = trainer.evaluate()
    losses = trainer.fit()
    ev = trainer.eval_history
    print("SFT eval loss: before", before["loss"], "then", [(e["step"], e["loss"]) for e in ev])
    assert [e["step"] for e in ev] == [4, 8, 10]  # every 4 steps, and the final model
    assert ev[-1]["loss"] < 0.8 * before["loss"], (before, ev)
    assert before["tokens"] == ev[-1]["tokens"] > 0
    lines = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    logged = [(x["step"], x["eval/loss"]) for x in lines if "eval/loss" in x]
    assert logged == [(e["step"], pytest.approx(e["loss"])) for e in ev]
    assert trainer.metrics.history["eval/loss"] == [(e["step"], e["loss"]) for e in ev]
    assert all(not k.startswith("train/") for x in lines if "eval/loss" in x for k in x)
    _, plain = run(setup, tmp_path)  # evaluating does not touch the training trajectory
    assert losses == plain


def test_eval_before_training_equals_the_first_steps_loss(setup, tmp_path):
    """The eval loss is the train loss's definition: on the first global batch's rows, before any step,
    it equals the loss the first step reports; the mean of per-row means (a plausible wrong definition)
    differs from it on these rows of unequal length."""
    trainer, _ = run(setup, tmp_path, fit=False, max_steps=1)
    rows = [trainer.dataset[i] for i in trainer.global_batch(0, 0)]
    before = trainer.evaluate(rows)
    singles = [trainer.evaluate([r]) for r in rows]
    losses = trainer.fit()
    assert before["loss"] == pytest.approx(losses[0], abs=1e-6, rel=0)
    assert before["tokens"] == trainer.metrics.history["train/tokens"][0][1]
    weighted = sum(x["loss"] * x["tokens"] for x in singles) / sum(x["tokens"] for x in singles)
    assert weighted == pytest.approx(before["loss"], abs=1e-6, rel=0)
    assert abs(sum(x["loss"] for x in singles) / len(singles) - losses[0]) > 1e-3, singles


def test_bad_eval_settings_fail_with_the_fix(setup, tmp_path):
    from transformers import AutoTokenizer

    from rl_core.data import DataError

    root, model = setup
    with pytest.raises(ValueError, match=r"eval_steps \(--eval_steps\) must be >= 1, or -1.*got 0"):
        SFTConfig(eval_steps=0)
    (tmp_path / "long.jsonl").write_text(json.dumps({"q": "x" * 80, "a": "y"}) + "\n")
    with pytest.raises(DataError, match=r"kept 0/1 rows.* in .*long.jsonl: no usable rows"):
        SFTDataset(load_rows(str(tmp_path / "long.jsonl")), AutoTokenizer.from_pretrained(model),
                   DataConfig(input_key="q", output_key="a", max_len=16))
    tok, ds = AutoTokenizer.from_pretrained(model), sft_data(setup)
    s = DeepSpeedStrategy(StrategyConfig(zero_stage=0, bf16=False, micro_train_batch_size=2, train_batch_size=4))
    with pytest.raises(ValueError, match=r"--eval_steps 2 needs --eval_dataset PATH"):
        SFTTrainer(s, None, tok, ds, SFTConfig(eval_steps=2))
    with pytest.raises(ValueError, match="the eval set has no usable rows; fix the file or drop --eval_dataset"):
        SFTTrainer(s, None, tok, ds, SFTConfig(), eval_dataset=[])


def test_sft_steps_equal_a_plain_torch_loop(setup):
    """Four optimizer steps of SFTTrainer (DeepSpeed ZeRO-0, fp32, micro-batch 2 x accumulation 2, rows of
    unequal length) report the losses of a hand-written loop over the same batches (token-mean NLL over the
    global batch, clip 1.0, AdamW) and leave the same weights: the step's bookkeeping (losses summed on the
    device, one host sync per step instead of one per micro-batch; DeepSpeed's all-reduce skipped on one rank)
    changes neither."""
    from transformers import AutoTokenizer

    from rl_core.data import pad_collate

    root, model = setup
    tok = AutoTokenizer.from_pretrained(model)
    s = DeepSpeedStrategy(StrategyConfig(zero_stage=0, bf16=False, micro_train_batch_size=2, train_batch_size=4,
                                         learning_rate=1e-3, lr_warmup_ratio=0.0, lr_scheduler="constant"))
    trainer = SFTTrainer(s, Actor.from_pretrained(model, dtype="fp32"), tok, sft_data(setup), SFTConfig(max_epochs=2))
    assert not trainer.engine.enable_backward_allreduce  # one rank at ZeRO-0: no all-reduce copy of the gradients
    ref = Actor.from_pretrained(model, dtype="fp32")
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.0)
    losses = trainer.fit()
    expected = []
    for epoch in range(2):
        for index in range(trainer.steps_per_epoch):
            micro = [pad_collate(items, trainer.pad_id)
                     for items in trainer.micro_batches(trainer.global_batch(epoch, index))]
            total = sum(int(b["loss_mask"].sum()) for b in micro)
            step_loss = 0.0
            for b in micro:
                lp = ref(b["input_ids"], attention_mask=b["attention_mask"]).logprobs
                loss = -(lp * b["loss_mask"]).sum() / total
                loss.backward()
                step_loss += loss.item()
            torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
            opt.step()
            opt.zero_grad()
            expected.append(step_loss)
    assert len(losses) == 4 and expected[-1] < expected[0], expected
    assert losses == pytest.approx(expected, abs=1e-5, rel=0)
    mine = dict(trainer.engine.module.named_parameters())
    worst = max((mine[n].detach() - p.detach()).abs().max().item() for n, p in ref.named_parameters())
    assert worst < 1e-5, worst
