"""RM, DPO and KTO trainers end to end on CPU (real DeepSpeed, tiny local model).

Synthetic preferences a tiny random model can learn in a few steps: for a prompt word,
the preferred answer is the word reversed, the other one the word as is.
"""

from __future__ import annotations

import json

import pytest
import torch

from rl_core.data import DataConfig, KTODataset, PreferenceDataset, load_rows
from rl_core.models import Actor, RewardModel, frozen
from rl_core.strategy import DeepSpeedStrategy, StrategyConfig
from rl_core.trainers import DPOConfig, DPOTrainer, KTOConfig, KTOTrainer, RewardModelTrainer, RMConfig

pytestmark = pytest.mark.timeout(600)
WORDS = ["abc", "hello", "xyz", "rl", "ppo", "grpo", "data", "kto", "model", "token", "reward", "value"]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from transformers import AutoTokenizer

    from rl_rollout.testing import make_tiny_model

    root = tmp_path_factory.mktemp("pref")
    model = make_tiny_model(root / "tiny")
    pairs = [{"prompt": f"reverse {w}", "chosen": w[::-1] + ".", "rejected": w + "?", "margin": 1.0} for w in WORDS]
    (root / "pairs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in pairs))
    kto = [{"input": p["prompt"], "output": p[side], "label": side == "chosen"}
           for p in pairs for side in ("chosen", "rejected")]
    (root / "kto.jsonl").write_text("".join(json.dumps(r) + "\n" for r in kto))
    return root, model, AutoTokenizer.from_pretrained(model)


def strategy(**kw):
    base = dict(zero_stage=2, bf16=False, micro_train_batch_size=2, train_batch_size=4, learning_rate=2e-3,
                lr_warmup_ratio=0.0)
    return DeepSpeedStrategy(StrategyConfig(**{**base, **kw}))


def pref_data(setup, **kw):
    root, _, tok = setup
    return PreferenceDataset(load_rows(str(root / "pairs.jsonl")), tok,
                             DataConfig(prompt_key="prompt", apply_chat_template=False, max_len=64, **kw))


def test_reward_model_learns_the_preference_and_stores_its_statistics(setup, tmp_path):
    root, model, tok = setup
    ds = pref_data(setup)
    trainer = RewardModelTrainer(strategy(), RewardModel.from_pretrained(model, dtype="fp32"), tok, ds,
                                 RMConfig(max_epochs=4, run_dir=str(tmp_path / "run"), save_path=str(tmp_path / "rm")))
    losses = trainer.fit()
    assert len(losses) == 12
    assert sum(losses[-3:]) < 0.5 * sum(losses[:3]), losses
    acc = [m[1] for m in trainer.metrics.history["train/acc"]]
    assert sum(acc[-3:]) / 3 >= 0.99, acc
    rm = RewardModel.from_pretrained(tmp_path / "rm", dtype="fp32").eval()
    meta = json.loads((tmp_path / "rm" / "rl_head.json").read_text())
    assert meta["kind"] == "score" and meta["std"] > 0 and meta["mean"] == pytest.approx(rm.mean)
    from rl_core.data import preference_collate

    b = preference_collate([ds[i] for i in range(len(ds))], tok.pad_token_id)
    with torch.no_grad():
        raw = rm(b["input_ids"], b["attention_mask"])
        norm = rm(b["input_ids"], b["attention_mask"], normalize=True)
    n = len(ds)
    assert (raw[:n] > raw[n:]).all(), "the exported model ranks every chosen response above its rejected one"
    assert norm.mean().item() == pytest.approx(0.0, abs=1e-3)
    assert norm.std(unbiased=False).item() == pytest.approx(1.0, abs=1e-3)


def run_dpo(setup, tmp_path, **cfg):
    _, model, tok = setup
    trainer = DPOTrainer(strategy(), Actor.from_pretrained(model, dtype="fp32"),
                         frozen(Actor.from_pretrained(model, dtype="fp32")), tok, pref_data(setup),
                         DPOConfig(max_epochs=3, run_dir=str(tmp_path), **cfg))
    losses = trainer.fit()
    return losses, {k[len("train/"):]: [v for _, v in h] for k, h in trainer.metrics.history.items()}


def test_dpo_widens_the_margin_and_precomputed_reference_matches(setup, tmp_path):
    losses, m = run_dpo(setup, tmp_path / "a", beta=0.1)
    assert abs(m["reward_margin"][0]) < 1e-4  # the policy starts as the reference
    assert losses[0] == pytest.approx(torch.nn.functional.softplus(torch.tensor(0.0)).item(), abs=1e-4)  # log 2
    assert min(m["reward_margin"][-3:]) > 0.5, m["reward_margin"]
    assert m["acc"][-1] == 1.0
    assert losses[-1] < 0.5 * losses[0], losses
    pre, m2 = run_dpo(setup, tmp_path / "b", beta=0.1, precompute_ref=True)
    torch.testing.assert_close(torch.tensor(pre), torch.tensor(losses), atol=1e-5, rtol=0)


def test_ipo_and_nll_term_train(setup, tmp_path):
    losses, m = run_dpo(setup, tmp_path / "ipo", beta=0.1, ipo=True)
    # IPO regresses h = (pi_c - pi_r) - (ref_c - ref_r) onto 1 / (2 beta): the margin beta * h goes to 0.5
    assert losses[0] == pytest.approx(25.0, abs=1e-3) and losses[-1] < 0.05 * losses[0], losses
    assert m["reward_margin"][-1] == pytest.approx(0.5, abs=0.1), m["reward_margin"]
    losses, m = run_dpo(setup, tmp_path / "nll", beta=0.1, nll_loss_coef=1.0)
    assert m["nll"][-1] < m["nll"][0] and m["reward_margin"][-1] > 0.5, (m["nll"], m["reward_margin"])


def test_kto_separates_desirable_from_undesirable(setup, tmp_path):
    root, model, tok = setup
    ds = KTODataset(load_rows(str(root / "kto.jsonl")), tok,
                    DataConfig(input_key="input", output_key="output", desirable_key="label", max_len=64))
    trainer = KTOTrainer(strategy(train_batch_size=8, micro_train_batch_size=4),
                         Actor.from_pretrained(model, dtype="fp32"), frozen(Actor.from_pretrained(model, dtype="fp32")),
                         tok, ds, KTOConfig(max_epochs=4, beta=0.1, run_dir=str(tmp_path)))
    losses = trainer.fit()
    m = {k[len("train/"):]: [v for _, v in h] for k, h in trainer.metrics.history.items()}
    assert len(losses) == 12
    assert abs(m["reward_margin"][0]) < 1e-4 and m["kl"][0] == pytest.approx(0.0, abs=1e-5)
    assert min(m["reward_margin"][-3:]) > 0.5, m["reward_margin"]
    assert losses[-1] < losses[0], losses


def test_configs_reject_bad_values():
    with pytest.raises(ValueError, match="--ipo and --label_smoothing"):
        DPOConfig(ipo=True, label_smoothing=0.1)
    with pytest.raises(ValueError, match=r"beta \(--beta\) must be > 0"):
        KTOConfig(beta=0)
    with pytest.raises(ValueError, match="sigmoid or logexp"):
        RMConfig(loss="hinge")
    with pytest.raises(ValueError, match="save_steps=5 needs ckpt_path"):
        RMConfig(save_steps=5)
