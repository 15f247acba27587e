"""RM, DPO and KTO trainers end to end on CPU (real DeepSpeed, tiny local model).

Synthetic preferences a tiny random model can learn in a few steps: for a prompt word,
the preferred answer is the word reversed, the other one the word as is.
"""

from __future__ import annotations

import json
import math

import pytest
import torch

from rl_core.data import DataConfig, KTODataset, PreferenceDataset, load_rows
from rl_core.models import Actor, RewardModel, frozen
from rl_core.strategy import DeepSpeedStrategy, StrategyConfig
from rl_core.trainers import DPOConfig, DPOTrainer, KTOConfig, KTOTrainer, RewardModelTrainer, RMConfig

pytestmark = [pytest.mark.timeout(600), pytest.mark.slow]
WORDS = ["abc", "hello", "xyz", "rl", "ppo", "grpo", "data", "kto", "model", "token", "reward", "value"]
EVAL_WORDS = ["cat", "sun", "map", "tree", "bird", "lamp"]  # held out: the same preference on unseen words


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
    held_out = [{"prompt": f"reverse {w}", "chosen": w[::-1] + ".", "rejected": w + "?", "margin": 1.0}
                for w in EVAL_WORDS]
    (root / "eval_pairs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in held_out))
    (root / "eval_kto.jsonl").write_text("".join(
        json.dumps({"input": p["prompt"], "output": p[side], "label": side == "chosen"}) + "\n"
        for p in held_out for side in ("chosen", "rejected")))
    # responses of 2 to 50 characters: packed rows that padding would fill mostly with pad tokens
    varied = [{"prompt": f"reverse {w}", "chosen": " ".join([w[::-1]] * (1 + 4 * (i % 3))) + ".", "rejected": w + "?",
               "margin": 1.0} for i, w in enumerate(WORDS[:8])]
    (root / "varied_pairs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in varied))
    (root / "varied_kto.jsonl").write_text("".join(
        json.dumps({"input": p["prompt"], "output": p[side], "label": side == "chosen"}) + "\n"
        for p in varied for side in ("chosen", "rejected")))
    return root, model, AutoTokenizer.from_pretrained(model)


def strategy(**kw):
    base = dict(zero_stage=2, bf16=False, micro_train_batch_size=2, train_batch_size=4, learning_rate=2e-3,
                lr_warmup_ratio=0.0)
    return DeepSpeedStrategy(StrategyConfig(**{**base, **kw}))


def pref_data(setup, name="pairs.jsonl", **kw):
    root, _, tok = setup
    return PreferenceDataset(load_rows(str(root / name)), tok,
                             DataConfig(prompt_key="prompt", apply_chat_template=False, max_len=64, **kw))


def test_reward_model_learns_the_preference_and_stores_its_statistics(setup, tmp_path):
    root, model, tok = setup
    ds = pref_data(setup)
    trainer = RewardModelTrainer(strategy(), RewardModel.from_pretrained(model, dtype="fp32"), tok, ds,
                                 RMConfig.from_flat(max_epochs=4, run_dir=str(tmp_path / "run"), save_path=str(tmp_path / "rm")))
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


def run_dpo(setup, tmp_path, eval_dataset=None, **cfg):
    _, model, tok = setup
    trainer = DPOTrainer(strategy(), Actor.from_pretrained(model, dtype="fp32"),
                         frozen(Actor.from_pretrained(model, dtype="fp32")), tok, pref_data(setup),
                         DPOConfig.from_flat(**{"max_epochs": 3, "run_dir": str(tmp_path), **cfg}), eval_dataset=eval_dataset)
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


def test_reward_model_eval_metrics_improve_and_equal_a_direct_computation(setup, tmp_path):
    from rl_core.data import preference_collate

    _, model, tok = setup
    ev = pref_data(setup, "eval_pairs.jsonl")
    trainer = RewardModelTrainer(strategy(), RewardModel.from_pretrained(model, dtype="fp32"), tok, pref_data(setup),
                                 RMConfig(max_epochs=2, run_dir=str(tmp_path), normalize_reward=False), eval_dataset=ev)
    before = trainer.evaluate()
    trainer.fit()
    after = trainer.eval_history
    print("RM eval: before", before, "after", after)
    assert [e["step"] for e in after] == [6]  # eval_steps -1: once, after the last step
    # the random head happens to rank these pairs right by a hair (gap ~0.006): the gap and loss show the learning
    assert 0 <= before["acc"] <= 1 and after[-1]["acc"] == 1.0, (before, after)
    assert after[-1]["reward_gap"] > 1.0 > 100 * before["reward_gap"] and after[-1]["loss"] < 0.5 * before["loss"]
    b = preference_collate([ev[i] for i in range(len(ev))], tok.pad_token_id)  # one [2N, T] forward by hand
    with torch.no_grad():
        scores = trainer.engine.module.eval()(b["input_ids"], b["attention_mask"]).double()
    c, r = scores[:len(ev)], scores[len(ev):]
    assert after[-1]["acc"] == (c > r).double().mean().item()
    assert after[-1]["loss"] == pytest.approx(torch.nn.functional.softplus(r - c).mean().item(), abs=1e-5)
    assert after[-1]["reward_gap"] == pytest.approx((c - r).mean().item(), abs=1e-5)


def test_dpo_eval_starts_at_log2_widens_and_precomputes_the_eval_reference(setup, tmp_path):
    ev = pref_data(setup, "eval_pairs.jsonl")
    _, m = run_dpo(setup, tmp_path / "a", beta=0.1, max_epochs=2, eval_steps=3, eval_dataset=ev)
    lines = [json.loads(x) for x in (tmp_path / "a" / "metrics.jsonl").read_text().splitlines()]
    evals = [x for x in lines if "eval/loss" in x]
    print("DPO eval:", evals)
    assert [x["step"] for x in evals] == [3, 6]
    for x in evals:
        assert 0 <= x["eval/acc"] <= 1
    assert evals[-1]["eval/reward_margin"] > evals[0]["eval/reward_margin"] > 0
    assert evals[-1]["eval/acc"] == 1.0 and evals[-1]["eval/loss"] < evals[0]["eval/loss"] < math.log(2)
    _, model, tok = setup
    trainer = DPOTrainer(strategy(), Actor.from_pretrained(model, dtype="fp32"),
                         frozen(Actor.from_pretrained(model, dtype="fp32")), tok, pref_data(setup),
                         DPOConfig(max_epochs=2, beta=0.1, eval_steps=3, precompute_ref=True), eval_dataset=ev)
    start = trainer.evaluate()  # policy == reference: every implicit reward is 0
    assert start["loss"] == pytest.approx(math.log(2), abs=1e-6) and start["reward_margin"] == 0 == start["acc"]
    trainer.fit()
    assert trainer.ref is None and trainer.eval_ref_logps.shape == (len(ev), 2)  # released, eval rows precomputed
    for k in ("loss", "acc", "reward_margin", "chosen_reward", "rejected_reward"):
        got = [e[k] for e in trainer.eval_history]
        assert got == pytest.approx([x["eval/" + k] for x in evals], abs=1e-5), k
    with pytest.raises(ValueError, match="reference model was released after precompute_ref"):
        trainer.evaluate(pref_data(setup))


def test_kto_eval_starts_at_half_and_separates_held_out_rows(setup, tmp_path):
    root, model, tok = setup
    cfg = DataConfig(input_key="input", output_key="output", desirable_key="label", max_len=64)
    ds, ev = (KTODataset(load_rows(str(root / n)), tok, cfg) for n in ("kto.jsonl", "eval_kto.jsonl"))
    trainer = KTOTrainer(strategy(train_batch_size=8, micro_train_batch_size=4),
                         Actor.from_pretrained(model, dtype="fp32"), frozen(Actor.from_pretrained(model, dtype="fp32")),
                         tok, ds, KTOConfig(max_epochs=2, beta=0.1, run_dir=str(tmp_path)), eval_dataset=ev)
    start = trainer.evaluate()
    # z = logp - ref_logp = 0 and kl = 0: every row's loss is 1 - sigmoid(0)
    assert start["loss"] == pytest.approx(0.5, abs=1e-6) and start["kl"] == 0 and start["reward_margin"] == 0
    trainer.fit()
    end = trainer.eval_history[-1]
    print("KTO eval: start", start, "end", end)
    assert end["step"] == 6 and end["reward_margin"] > 0.1 and end["loss"] < 0.5, end
    assert trainer.metrics.history["eval/reward_margin"] == [(6, end["reward_margin"])]


# ---------------------------------------------------------------- packed pairs (OpenRLHF's --packing_samples)


def _packed_and_padded(make, fn) -> dict[bool, tuple]:
    """``fn(trainer, first micro-batch's items)`` of a padded and of a packed trainer (same start: the seed is
    reset before ``make(packing)`` builds each, so a fresh reward head starts the same too)."""
    out = {}
    for packing in (False, True):
        torch.manual_seed(0)
        trainer = make(packing)
        assert trainer.packing is packing
        items = trainer.micro_batches(trainer.global_batch(0, 0))[0]
        out[packing] = fn(trainer, items)
    return out


def _flat(x) -> list[float]:
    if isinstance(x, dict):
        return [v for k in sorted(x) for v in [len(k), *_flat(x[k])]]  # the key's length: keys must match too
    if isinstance(x, (list, tuple)):
        return [v for e in x for v in _flat(e)]
    return [float(x)]


def _assert_same(got: dict[bool, tuple]) -> None:
    """Everything ``fn`` returned, packed against padded, within 1e-5."""
    for padded, packed in zip(got[False], got[True], strict=True):
        torch.testing.assert_close(torch.tensor(_flat(packed), dtype=torch.float64),
                                   torch.tensor(_flat(padded), dtype=torch.float64), atol=1e-5, rtol=0)


def _history(trainer) -> dict[str, list[float]]:
    return {k: [v for _, v in h] for k, h in trainer.metrics.history.items()}


def test_packed_pairs_give_the_padded_reward_scores_losses_and_eval(setup):
    _, model, tok = setup

    def make(packing):
        ds = pref_data(setup, "varied_pairs.jsonl", packing=packing)
        return RewardModelTrainer(strategy(), RewardModel.from_pretrained(model, dtype="fp32"), tok, ds,
                                  RMConfig(max_epochs=1), eval_dataset=ds)

    def run(trainer, items):
        with torch.no_grad():
            chosen, rejected, _ = trainer._scores(items)
        assert chosen.shape == rejected.shape == (len(items),)  # one score per sequence, read at its last token
        losses = trainer.fit()
        return (torch.cat([chosen, rejected]).tolist(), losses, _history(trainer), trainer.eval_history[-1],
                [trainer.engine.module.mean, trainer.engine.module.std])

    _assert_same(_packed_and_padded(make, run))


def test_packed_pairs_give_the_padded_dpo_logps_losses_and_eval(setup):
    from rl_core.trainers.dpo import sequence_logps

    _, model, tok = setup

    def make(packing):
        ds = pref_data(setup, "varied_pairs.jsonl", packing=packing)
        return DPOTrainer(strategy(), Actor.from_pretrained(model, dtype="fp32"),
                          frozen(Actor.from_pretrained(model, dtype="fp32")), tok, ds,
                          DPOConfig(max_epochs=1, beta=0.1, nll_loss_coef=1.0), eval_dataset=ds)

    def run(trainer, items):
        b = trainer.to_device(trainer.collate(items))
        assert ("position_ids" in b) is trainer.packing and b["input_ids"].shape[0] == (1 if trainer.packing else 4)
        with torch.no_grad():
            logps = sequence_logps(trainer.engine, b)
        losses = trainer.fit()
        return logps.tolist(), losses, _history(trainer), trainer.eval_history[-1]

    got = _packed_and_padded(make, run)
    _assert_same(got)
    assert got[True][2]["train/reward_margin"][-1] != 0  # a trained step, not two copies of the reference


def test_packed_rows_give_the_padded_kto_logps_kl_losses_and_eval(setup):
    root, model, tok = setup

    def make(packing):
        ds = KTODataset(load_rows(str(root / "varied_kto.jsonl")), tok,
                        DataConfig(input_key="input", output_key="output", desirable_key="label", max_len=64,
                                   packing=packing))
        return KTOTrainer(strategy(train_batch_size=8, micro_train_batch_size=4),
                          Actor.from_pretrained(model, dtype="fp32"), frozen(Actor.from_pretrained(model, dtype="fp32")),
                          tok, ds, KTOConfig(max_epochs=1, beta=0.1), eval_dataset=ds)

    def run(trainer, items):
        from rl_core.trainers.dpo import sequence_logps

        with torch.no_grad():
            logps = sequence_logps(trainer.engine, trainer.to_device(trainer.collate(items)))
        losses = trainer.fit()
        return logps.tolist(), losses, _history(trainer), trainer.eval_history[-1]

    got = _packed_and_padded(make, run)
    _assert_same(got)
    assert got[True][2]["train/kl"][-1] > 0  # the mismatched pairs' KL after a step: it was measured


def test_configs_reject_bad_values():
    with pytest.raises(ValueError, match="--ipo and --label_smoothing"):
        DPOConfig(ipo=True, label_smoothing=0.1)
    with pytest.raises(ValueError, match=r"beta \(--beta\) must be > 0"):
        KTOConfig(beta=0)
    with pytest.raises(ValueError, match="sigmoid or logexp"):
        RMConfig(loss="hinge")
    with pytest.raises(ValueError, match="save_steps=5 needs ckpt_path"):
        RMConfig.from_flat(save_steps=5)
