"""The registries state each variant's needs; typed policy-loss configs equal the function they wrap."""

import pytest
import torch

from rl_algos import (
    ESTIMATORS,
    POLICY_LOSSES,
    GSPOLossConfig,
    ISCorrectionConfig,
    PPOLossConfig,
    estimator_names,
    get_estimator,
    policy_loss,
    policy_loss_config,
)


def test_estimator_entries_state_what_they_need():
    facts = {n: (s.needs_critic, s.min_group_size, s.whiten_by_default) for n, s in ESTIMATORS.items()}
    assert facts == {
        "gae": (True, 1, True),
        "reinforce": (False, 1, True),
        "reinforce_baseline": (False, 2, True),
        "rloo": (False, 2, False),
        "group_norm": (False, 2, False),
        "dr_grpo": (False, 2, False),
    }
    assert estimator_names(critic_free=False) == ["gae"]
    assert "gae" not in estimator_names(critic_free=True)


def test_estimator_entry_is_callable_as_the_function():
    scores = torch.tensor([1.0, 0.0, 0.5, 0.5])
    mask = torch.ones(4, 3)
    spec = get_estimator("rloo")
    a = spec(scores, mask, n_samples=2)
    b = spec.fn(scores, mask, n_samples=2)
    torch.testing.assert_close(a.advantages, b.advantages)


def test_estimator_inputs_name_real_keyword_arguments():
    import inspect

    for name, spec in ESTIMATORS.items():
        params = inspect.signature(spec.fn).parameters
        assert set(spec.inputs) <= set(params), name


def _batch(seed=0, B=4, T=6):
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(B, T, generator=g, dtype=torch.float64) * 2
    logp = old + 0.3 * torch.randn(B, T, generator=g, dtype=torch.float64)
    rollout = old + 0.2 * torch.randn(B, T, generator=g, dtype=torch.float64)
    adv = torch.randn(B, T, generator=g, dtype=torch.float64)
    mask = torch.ones(B, T, dtype=torch.float64)
    mask[0, 4:] = 0
    return logp, old, rollout, adv, mask


@pytest.mark.parametrize("kind", ["tis", "icepop", "seq-mask-tis"])
def test_gspo_config_equals_the_sequence_ratio_loss_with_correction(kind):
    logp, old, rollout, adv, mask = _batch()
    cfg = policy_loss_config("gspo", clip_eps_low=0.1, clip_eps_high=0.2, aggregation="seq-mean-token-mean",
                             is_correction=ISCorrectionConfig(kind, 0.8, 1.5))
    assert isinstance(cfg, GSPOLossConfig) and cfg.needs_rollout_logprobs
    got = cfg.loss(logp, old, adv, mask, rollout_logprobs_BT=rollout)
    want = policy_loss(logp, old, adv, mask, clip_eps_low=0.1, clip_eps_high=0.2, ratio_type="sequence",
                       rollout_logprobs_BT=rollout, correction=kind, correction_low=0.8, correction_high=1.5,
                       aggregation="seq-mean-token-mean")
    assert got.loss.item() == pytest.approx(want.loss.item(), rel=1e-12)
    token = PPOLossConfig(clip_eps_low=0.1, clip_eps_high=0.2, aggregation="seq-mean-token-mean",
                          is_correction=ISCorrectionConfig(kind, 0.8, 1.5))
    assert token.loss(logp, old, adv, mask, rollout_logprobs_BT=rollout).loss.item() != pytest.approx(
        got.loss.item(), rel=1e-6)  # the sequence ratio is really used


def test_thresholds_change_the_loss():
    logp, old, rollout, adv, mask = _batch(1)
    wide = policy_loss_config("ppo", is_correction=ISCorrectionConfig("tis", 0.0, 100.0))
    narrow = policy_loss_config("ppo", is_correction=ISCorrectionConfig("tis", 0.95, 1.05))
    a = wide.loss(logp, old, adv, mask, rollout_logprobs_BT=rollout).loss.item()
    b = narrow.loss(logp, old, adv, mask, rollout_logprobs_BT=rollout).loss.item()
    assert a != pytest.approx(b, rel=1e-6)


def test_registry_refuses_bad_names_fields_and_values():
    assert set(POLICY_LOSSES) == {"ppo", "gspo"}
    with pytest.raises(ValueError, match="valid: gspo, ppo"):
        policy_loss_config("grpo")
    with pytest.raises(ValueError, match="no field.*ratio.*its fields"):
        policy_loss_config("ppo", ratio=2)
    with pytest.raises(ValueError, match="already registered"):
        POLICY_LOSSES.register(PPOLossConfig)
    with pytest.raises(ValueError, match="dual_clip must be > 1"):
        PPOLossConfig(dual_clip=0.5)
    with pytest.raises(ValueError, match="valid: tis, icepop, seq-mask-tis"):
        ISCorrectionConfig("clip")
    with pytest.raises(ValueError, match="low <= high"):
        ISCorrectionConfig("tis", 2.0, 1.0)
    with pytest.raises(ValueError, match="aggregation"):
        PPOLossConfig(aggregation="mean")
