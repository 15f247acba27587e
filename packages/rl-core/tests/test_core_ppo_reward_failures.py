"""Failed reward calls in the RL loop: counted per iteration in metrics.jsonl, and a run where more of them fail
than ``reward_max_failure_rate`` tolerates stops before training, with the first failure's message.

Real runs on CPU (tiny model, DeepSpeed, an HFEngine in this process); the reward function is a plain
``fn(prompt, response, label)``, which the trainer runs through a ``RewardRunner`` (bounded, counted).
"""

from __future__ import annotations

import json

import pytest

from rl_core.data import DataConfig, PromptDataset, load_rows
from rl_core.rl.build import LocalFactory, RLModelConfig, RunConfig, build_run
from rl_core.strategy import StrategyConfig
from rl_core.trainers.ppo import PPOConfig
from rl_rollout import RewardRunner, WeightSyncConfig
from rl_rollout.rewards import RewardError

pytestmark = [pytest.mark.timeout(900), pytest.mark.slow]


def flaky(prompt, response, label):
    """Fails on two of the four prompts: an exception for 'a', an infinite reward for 'b'."""
    if label == "a":
        raise KeyError("no score for a")
    if label == "b":
        return float("inf")
    return min(response.count(label), 8) / 8


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from transformers import AutoTokenizer

    from rl_rollout.testing import make_tiny_model

    root = tmp_path_factory.mktemp("ppo-rewards")
    model = make_tiny_model(root / "tiny")
    (root / "prompts.jsonl").write_text(
        "".join(json.dumps({"p": f"Repeat the letter {c}: ", "y": c}) + "\n" for c in "abcd"))
    tok = AutoTokenizer.from_pretrained(model)
    prompts = PromptDataset(load_rows(str(root / "prompts.jsonl")), tok, DataConfig(input_key="p", label_key="y"))
    return model, tok, prompts


def run(setup, run_dir, **cfg):
    model, tok, prompts = setup
    c = PPOConfig.from_flat(advantage_estimator="group_norm", n_samples_per_prompt=4, rollout_batch_size=4, generate_max_len=8,
                  max_iterations=2, init_kl_coef=0, run_dir=str(run_dir), **cfg)
    s = StrategyConfig(zero_stage=0, bf16=False, micro_train_batch_size=8, train_batch_size=16, learning_rate=1e-3,
                       lr_warmup_ratio=0.0, lr_scheduler="constant")
    return build_run(RunConfig(RLModelConfig(pretrain=str(model)), s, c, sync=WeightSyncConfig()),
                     LocalFactory(engine_kind="hf"), prompts=prompts, tokenizer=tok, reward_fn=flaky).trainer


def rows(run_dir):
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_failed_calls_are_counted_per_iteration_and_half_is_tolerated_by_default(setup, tmp_path, caplog):
    trainer = run(setup, tmp_path / "run")
    assert isinstance(trainer.reward_fn, RewardRunner)  # a plain function is run bounded and counted
    with caplog.at_level("WARNING"):
        history = trainer.fit()
    assert len(history) == 2  # 8 of 16 calls failed each iteration: not more than half
    for row in rows(tmp_path / "run"):  # every iteration covers the four prompts once, four samples each
        assert (row["rl/reward/ok"], row["rl/reward/failures"], row["rl/reward/errors"], row["rl/reward/nonfinite"],
                row["rl/reward/timeouts"]) == (8, 8, 4, 4, 0), row
        assert "rl/policy_loss" in row
    assert "iteration 1: 8 of 16 reward calls failed (errors 4, timeouts 0, non-finite 4)" in caplog.text


def test_more_failures_than_tolerated_stop_the_run_before_it_trains(setup, tmp_path):
    trainer = run(setup, tmp_path / "run", reward_max_failure_rate=0.25)
    before = {k: v.clone() for k, v in trainer.policy.worker.engine.module.named_parameters()}
    with pytest.raises(RewardError) as e:
        trainer.fit()
    message = str(e.value)
    assert message.startswith("iteration 1: 8 of 16 reward calls failed (errors 4, timeouts 0, non-finite 4), more "
                              "than --reward_max_failure_rate 0.25 allows; first: reward function ")
    assert "flaky failed on sample " in message
    assert "KeyError: 'no score for a'" in message or "returned inf; a reward must be a finite float" in message
    assert trainer.history == []
    (row,) = rows(tmp_path / "run")  # the iteration that stopped the run is on record
    assert row["step"] == 1 and row["rl/reward/failures"] == 8 and "rl/policy_loss" not in row
    after = dict(trainer.policy.worker.engine.module.named_parameters())
    assert all((after[k] == v).all() for k, v in before.items())  # nothing trained on the fallbacks
