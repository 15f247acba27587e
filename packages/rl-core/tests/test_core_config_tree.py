"""PPOConfig as a tree: each node validates its own fields, optional features are present-or-None, the rules
across nodes live in PPOConfig, and ``from_flat`` maps rl-core 0.15's flat names onto the tree."""

from __future__ import annotations

import dataclasses
import typing

import pytest

from rl_algos import AdvantageConfig, FixedKLController, KLConfig, KLEstimator, PolicyLossConfig
from rl_core.configs import (
    AgentConfig,
    AsyncConfig,
    CheckpointConfig,
    CriticOptimizerConfig,
    DistillConfig,
    EvalConfig,
    flat_table,
)
from rl_core.configs.flat import node_type
from rl_core.trainers.ppo_config import PPOConfig
from rl_rollout import SamplingConfig


def test_no_config_node_is_a_flat_grab_bag():
    for cls in (KLConfig, AsyncConfig, AgentConfig, CheckpointConfig, CriticOptimizerConfig, EvalConfig,
                AdvantageConfig, PolicyLossConfig, DistillConfig):
        assert len(dataclasses.fields(cls)) <= 12, cls
    # a feature lands as a node of its own (distill, ema, ptx...); the root's own flat settings may not grow
    hints = typing.get_type_hints(PPOConfig)
    leaves = [f.name for f in dataclasses.fields(PPOConfig) if node_type(hints[f.name]) is None]
    assert len(leaves) <= 12, leaves  # 80 flat fields in rl-core 0.15
    assert len(dataclasses.fields(PPOConfig)) <= 28  # 14 nodes now


def test_optional_features_are_present_or_none_and_carry_their_own_settings():
    c = PPOConfig(advantage=AdvantageConfig("group_norm"), sampling=SamplingConfig(4),
                  async_rl=AsyncConfig(max_staleness=2, generate_batch_size=16), kl=KLConfig(init_coef=0.0))
    assert c.async_rl.max_staleness == 2 and c.staleness_bound == 2 + (16 + 8 - 2) // 8
    assert c.is_correction_type == "tis"  # async samples from older policies: corrected unless told otherwise
    assert not c.needs_reference and c.kl.controller() is None
    off = PPOConfig()
    assert off.async_rl is None and off.staleness_bound == 0 and off.is_correction_type is None
    assert isinstance(off.kl.controller(), FixedKLController) and off.needs_reference


def test_each_node_checks_its_own_fields_and_the_run_checks_across_them():
    with pytest.raises(ValueError, match=r"max_staleness \(--max_staleness\) must be >= 0"):
        AsyncConfig(max_staleness=-1)
    with pytest.raises(ValueError, match=r"save_steps=5 needs ckpt_path"):
        CheckpointConfig(save_steps=5)
    with pytest.raises(ValueError, match=r"kl_estimator \(--kl_estimator\) must be k1, k2 or k3, got 'k4'"):
        KLConfig(estimator="k4")
    assert KLConfig(estimator="k3").estimator is KLEstimator.K3
    with pytest.raises(ValueError, match=r"--best_metric_key 'pass@8'"):
        EvalConfig(best_metric_key="pass@8", n_samples_per_prompt=4)
    with pytest.raises(ValueError, match=r"critic_learning_rate \(--critic_learning_rate\) must be > 0"):
        CriticOptimizerConfig(learning_rate=-1.0)
    # across nodes: the rollout batch (PPOConfig) against the generation round (AsyncConfig)
    with pytest.raises(ValueError, match="--generate_batch_size 4 is below --rollout_batch_size 8"):
        PPOConfig(async_rl=AsyncConfig(generate_batch_size=4))
    with pytest.raises(ValueError, match="--agent_turn_rewards gives token-level rewards"):
        PPOConfig(advantage=AdvantageConfig("rloo"), sampling=SamplingConfig(2),
                  agent=AgentConfig(func_path="env.py", turn_rewards=True))


def test_from_flat_builds_the_tree_from_the_old_flat_names():
    c = PPOConfig.from_flat(init_kl_coef=0.0, async_train=True, max_staleness=2, save_steps=3, ckpt_path="ck",
                            eval_steps=2, enable_ema=True, ema_beta=0.9, critic_learning_rate=1e-5,
                            agent_func_path="builtin:calculator", agent_max_turns=2, n_samples_per_prompt=2,
                            dynamic_filtering=True, dynamic_filtering_max_rounds=3)
    assert c == PPOConfig(kl=KLConfig(init_coef=0.0), async_rl=AsyncConfig(max_staleness=2),
                          ckpt=CheckpointConfig(save_steps=3, ckpt_path="ck"), eval=EvalConfig(steps=2),
                          ema=c.ema, critic_optimizer=CriticOptimizerConfig(learning_rate=1e-5),
                          agent=AgentConfig(func_path="builtin:calculator", max_turns=2), sampling=SamplingConfig(2),
                          dynamic_filtering=c.dynamic_filtering)
    assert c.ema.beta == 0.9 and c.dynamic_filtering.max_rounds == 3
    assert PPOConfig.from_flat(async_train=False).async_rl is None
    # the estimator, the policy loss (rl-algos) and the sampling (rl-rollout) from rl-core 0.17's flat names
    c = PPOConfig.from_flat(advantage_estimator="rloo", gamma=0.9, n_samples_per_prompt=4, generate_max_len=16,
                            temperature=0.7, eps_clip=0.1, loss_agg_mode="seq-mean-token-mean", is_correction="icepop",
                            entropy_loss_coef=0.01, aux_loss_coef=0.001)
    assert c.advantage == AdvantageConfig("rloo", gamma=0.9)
    assert c.sampling == SamplingConfig(4, max_new_tokens=16, temperature=0.7)
    assert c.policy_loss == PolicyLossConfig(eps_clip=0.1, agg_mode="seq-mean-token-mean", is_correction="icepop",
                                             entropy_coef=0.01, aux_loss_coef=0.001)
    assert c.policy_loss_variant().is_correction.kind == "icepop" and c.loss_norm_len == 16.0
    assert PPOConfig.from_flat(max_new_tokens=32).sampling.max_new_tokens == 32  # OpenRLHF's newer name too
    with pytest.raises(ValueError, match="max_staleness set async_train's settings: add async_train=True"):
        PPOConfig.from_flat(max_staleness=2)
    with pytest.raises(TypeError, match="unknown setting 'max_stalenes'; did you mean max_staleness"):
        PPOConfig.from_flat(max_stalenes=2)
    table = flat_table(PPOConfig)  # every flat name of 0.15 that moved has one place in the tree
    assert table["init_kl_coef"] == (("kl", "init_coef"), False) and table["async_train"] == (("async_rl",), True)
    assert table["eval_n_samples_per_prompt"] == (("eval", "n_samples_per_prompt"), False)
    assert table["n_samples_per_prompt"] == (("sampling", "n_samples_per_prompt"), False)
