"""GRPOTrainer end to end on CPU: real DeepSpeed, a real HFEngine receiving the weights, a RewardRunner."""

from __future__ import annotations

import json
from functools import partial

import pytest
import torch

from rl_core.data import DataConfig, PromptDataset, load_rows
from rl_core.models import Actor
from rl_core.strategy import DeepSpeedStrategy, StrategyConfig
from rl_core.trainers.grpo import GRPOConfig, GRPOTrainer

pytestmark = pytest.mark.timeout(900)
LETTERS = "abcd"


def letter_reward(prompt, response, label, **info):
    if response.startswith("!"):
        raise RuntimeError("a reward function bug")  # the runner turns this into the fallback, counted
    return min(response.count(label), 8) / 8


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from transformers import AutoTokenizer

    from rl_rollout.testing import make_tiny_model

    root = tmp_path_factory.mktemp("grpo")
    model = make_tiny_model(root / "tiny")
    (root / "prompts.jsonl").write_text(
        "".join(json.dumps({"p": f"Repeat the letter {c}: ", "y": c}) + "\n" for c in LETTERS))
    tok = AutoTokenizer.from_pretrained(model)
    prompts = PromptDataset(load_rows(str(root / "prompts.jsonl")), tok, DataConfig(input_key="p", label_key="y"))
    return model, tok, prompts


def make(setup, tmp_path, iterations=2, lr=2e-3, **cfg):
    from rl_rollout import RewardRunner
    from rl_rollout.hf_engine import HFEngine

    model, tok, prompts = setup
    kw = dict(n_samples_per_prompt=8, rollout_batch_size=4, max_new_tokens=8, num_iterations=iterations,
              run_dir=str(tmp_path / "run"))
    kw.update(cfg)
    samples = kw["rollout_batch_size"] * kw["n_samples_per_prompt"]
    s = DeepSpeedStrategy(StrategyConfig(zero_stage=0, bf16=False, micro_train_batch_size=samples // 2,
                                         train_batch_size=samples, learning_rate=lr, lr_warmup_ratio=0.0,
                                         lr_scheduler="constant"))
    engine = HFEngine(model, dtype="float32")
    runner = RewardRunner(letter_reward, workers=0, fallback=0.0)
    return GRPOTrainer(s, Actor.from_pretrained(model, dtype="fp32"), tok, prompts, engine, runner,
                       GRPOConfig(**kw)), engine, runner


def test_each_iteration_pushes_the_trained_weights_to_the_engine(setup, tmp_path):
    trainer, engine, runner = make(setup, tmp_path, iterations=2)
    history = trainer.fit()
    assert len(history) == 2 and engine.policy_version == 2
    trained = dict(trainer.engine.module.model.named_parameters())
    served = dict(engine.model.named_parameters())
    assert set(trained) == set(served)
    for name, p in trained.items():
        torch.testing.assert_close(served[name], p.detach(), rtol=0, atol=0)
    m = history[-1]
    assert 0 <= m["reward_mean"] <= 1 and m["response_length"] > 0 and m["sync_s"] >= 0
    # the engine's sampling logprobs and the policy's recomputation agree (temperature 1, fp32)
    assert history[0]["rollout_logprob_gap"] < 1e-4, history[0]
    lines = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == [1, 2] and "rl/reward_mean" in lines[0]
    assert runner.metrics()["reward/ok"] + runner.metrics()["reward/errors"] == 2 * 32


def test_bad_loop_settings_fail_before_training(setup, tmp_path):
    with pytest.raises(ValueError, match=r"--n_samples_per_prompt >= 2"):
        GRPOConfig(n_samples_per_prompt=1)
    with pytest.raises(ValueError, match=r"not a multiple of train_batch_size"):
        model, tok, prompts = setup
        s = DeepSpeedStrategy(StrategyConfig(zero_stage=0, bf16=False, micro_train_batch_size=3, train_batch_size=3))
        GRPOTrainer(s, Actor.from_pretrained(model, dtype="fp32"), tok, prompts, None, None,
                    GRPOConfig(n_samples_per_prompt=2, rollout_batch_size=4))
