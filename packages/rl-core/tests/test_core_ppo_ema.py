"""EMA weights of the policy (``enable_ema`` / ``ema_beta``, OpenRLHF's --enable_ema / --ema_beta) on CPU with real
DeepSpeed: after each optimizer step the shadow is ``beta x shadow + (1 - beta) x weights``, recomputed here from
the policy's weights step by step; the HF export holds the EMA, not the policy; a checkpoint keeps the shadow, so a
worker resumed from it goes on with the same average (ZeRO-2: a full copy; ZeRO-3: the rank's partitions)."""

from __future__ import annotations

import pytest
import torch

from rl_core.rl import PolicyObjective, PolicyWorker, make_item
from rl_core.strategy import StrategyConfig
from rl_core.trainers.ppo_config import PPOConfig

pytestmark = [pytest.mark.timeout(600), pytest.mark.slow]
BETA = 0.7


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from rl_rollout.testing import make_tiny_model

    return str(make_tiny_model(tmp_path_factory.mktemp("ema") / "tiny"))


def batch(step: int) -> list[dict]:
    g = torch.Generator().manual_seed(step)
    out = []
    for p, r in ((3, 4), (5, 2), (2, 6), (4, 4)):
        it = make_item(*(torch.randint(3, 128, (n,), generator=g).tolist() for n in (p, r)))
        it.advantages_T = torch.tensor(it.loss_mask_T, dtype=torch.float32) * torch.randn(p + r, generator=g)
        out.append(it)
    return out


@pytest.mark.parametrize("zero_stage", [2, 3])
def test_ema_is_the_step_by_step_average_it_is_exported_and_a_resume_goes_on_with_it(tiny, tmp_path, zero_stage):
    from safetensors.torch import load_file

    s = StrategyConfig(zero_stage=zero_stage, bf16=False, micro_train_batch_size=2, train_batch_size=4,
                       learning_rate=1e-2, lr_warmup_ratio=0.0, lr_scheduler="constant")
    c = PPOConfig.from_flat(enable_ema=True, ema_beta=BETA)

    def worker():
        return PolicyWorker(s, tiny, PolicyObjective.of(c), 3, load_kw={"dtype": "fp32"})

    w = worker()
    trained = {n for n, p in w.engine.module.named_parameters() if p.requires_grad}
    numel = sum(p.ds_numel if hasattr(p, "ds_numel") else p.numel() for p in w.engine.module.parameters())
    assert w._ema.nbytes == 4 * numel  # fp32, one rank: a whole copy (ZeRO-3: this rank's partitions = all)
    weights = lambda x: x.s.full_state_dict(x.engine.module)  # noqa: E731
    ema = weights(w)  # the EMA starts from the initial weights
    resumed = None
    for step in range(3):
        if step == 2:  # a worker resumed from this checkpoint goes on with the same average
            w.save_checkpoint(str(tmp_path / "ckpt"))
            resumed = worker()
            resumed.load_checkpoint(str(tmp_path / "ckpt"))
            resumed.train(batch(step), on_policy=True)
        w.train(batch(step), on_policy=True)  # one optimizer step (2 micro-batches)
        now = weights(w)
        ema = {n: BETA * ema[n] + (1 - BETA) * now[n] if n in trained else ema[n] for n in ema}

    got = dict(w._ema.full_state())
    assert set(got) == trained
    for n in trained:
        torch.testing.assert_close(got[n], ema[n], rtol=1e-6, atol=1e-7)
    assert max((ema[n] - now[n]).abs().max().item() for n in trained) > 1e-3  # the EMA is not the policy
    again = dict(resumed._ema.full_state())
    for n in trained:
        torch.testing.assert_close(again[n], got[n], rtol=1e-6, atol=1e-7)

    w.export(str(tmp_path / "hf"))
    exported = load_file(str(tmp_path / "hf" / "model.safetensors"))
    assert len(exported) >= len(trained) - 1  # (a tied lm_head is saved once)
    for name, t in exported.items():
        torch.testing.assert_close(t, ema[f"model.{name}"], rtol=1e-6, atol=1e-7)


def test_ema_beta_without_enable_ema_is_refused():
    with pytest.raises(ValueError, match=r"ema_beta set enable_ema's settings: add enable_ema=True, or drop them"):
        PPOConfig.from_flat(ema_beta=0.9)
    with pytest.raises(ValueError, match=r"ema_beta .* in \[0, 1\]"):
        PPOConfig.from_flat(enable_ema=True, ema_beta=1.5)
