"""``optim="muon"``: DeepSpeed's Muon (MuonWithAuxAdam) on CPU with the tiny Llama, against a hand-written step.

The 2-D weight matrices (not the embedding) land in the Muon group, norms and the embedding in the AdamW
group, with --l2 on the decayed ones only; one DeepSpeed step moves every weight by what an independent
reference computes: Muon's Nesterov blend orthogonalised by the quintic Newton-Schulz iteration in float64
(5 steps, Keller Jordan's coefficients), scaled by sqrt(max(1, rows / cols)), and torch's AdamW for the
rest, at ZeRO-0, 2 and 3 (with --adam_offload too, checked by hand: DeepSpeedCPUAdam's build is slow). Bad
settings fail in one line naming the flag. The bf16 runs: rl-cli's ``rl sft --optim muon`` test.
"""

from __future__ import annotations

import math

import pytest
import torch

from rl_core.models import Actor
from rl_core.rl.objectives import CriticObjective, PolicyObjective
from rl_core.rl.workers import CriticWorker, PolicyWorker
from rl_core.strategy import DeepSpeedStrategy, StrategyConfig
from rl_core.configs import CriticOptimizerConfig
from rl_core.trainers.ppo_config import PPOConfig
from rl_rollout.testing import make_tiny_model

pytestmark = [pytest.mark.timeout(600), pytest.mark.slow]

MUON_LR, ADAM_LR, MOMENTUM, L2 = 0.02, 1e-3, 0.9, 0.1


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("m") / "tiny")


@pytest.fixture(autouse=True)
def eager():
    """DeepSpeed torch.compile's its Newton-Schulz; on CPU inductor takes ~40 s to build it, eager is the same math."""
    with torch._dynamo.config.patch(disable=True):
        yield


@pytest.fixture(autouse=True)
def fp32_newton_schulz(monkeypatch):
    """DeepSpeed runs Newton-Schulz in fp16 or bf16 wherever its accelerator says they are supported
    (``ns_compute_dtype``), on CPU too: a CPU with avx512_fp16 gets fp16, 6% off the float64 reference, one without
    gets fp32. These tests check our wiring (groups, learning rates, momentum, decay, scaling) against float64, so
    they pin the iteration to fp32 on every machine; DeepSpeed's half-precision iteration is DeepSpeed's to test."""
    from deepspeed.runtime.zero.muon import original_muon

    monkeypatch.setattr(original_muon, "ns_compute_dtype", lambda method: torch.float32)


def newton_schulz64(g: torch.Tensor, steps: int = 5) -> torch.Tensor:
    """Muon's orthogonalisation (github.com/KellerJordan/Muon), in float64."""
    a, b, c = 3.4445, -4.7750, 2.0315
    x = g.double()
    tall = x.size(0) > x.size(1)
    x = x.T if tall else x
    x = x / (x.norm() + 1e-7)
    for _ in range(steps):
        s = x @ x.T
        x = a * x + (b * s + c * s @ s) @ x
    return x.T if tall else x


def is_muon(name: str, p: torch.Tensor) -> bool:
    return p.ndim >= 2 and "embed" not in name and "lm_head" not in name


def is_decayed(name: str, p: torch.Tensor) -> bool:
    return not (p.ndim < 2 or "norm" in name or name.endswith(".bias"))


def loss_of(model, ids):
    return -model(ids).logprobs.mean()


@pytest.mark.parametrize("stage", [0, 2, 3])
def test_one_step_matches_a_hand_written_muon_and_adamw(tiny, stage):
    cfg = StrategyConfig(zero_stage=stage, bf16=False, train_batch_size=1, optim="muon", muon_lr=MUON_LR,
                         muon_momentum=MOMENTUM, learning_rate=ADAM_LR, weight_decay=L2, lr_warmup_ratio=0.0,
                         lr_scheduler="constant", max_norm=0.0)
    s = DeepSpeedStrategy(cfg)
    ids = torch.randint(5, 100, (1, 12), generator=torch.Generator().manual_seed(0))
    ref = Actor.from_pretrained(tiny, dtype="fp32")
    engine = s.prepare(Actor.from_pretrained(tiny, dtype="fp32"), total_steps=4)

    names = dict(ref.named_parameters())
    tagged = {n: p.use_muon for n, p in engine.module.named_parameters()}
    assert tagged == {n: is_muon(n, p) for n, p in names.items()}
    assert sum(tagged.values()) == 14 and not tagged["model.model.embed_tokens.weight"]  # 7 matrices a layer
    if stage == 0:  # one group per (decayed or not) x (Muon or AdamW) half, with its own settings
        groups = {g["name"]: g for g in engine.optimizer.param_groups}
        assert sorted(groups) == ["group0-adam-params", "group0-muon-params", "group1-adam-params"]
        assert groups["group0-muon-params"]["lr"] == MUON_LR and groups["group0-adam-params"]["lr"] == ADAM_LR
        assert groups["group0-muon-params"]["momentum"] == MOMENTUM
        assert groups["group1-adam-params"]["weight_decay"] == 0.0

    before = {n: p.detach().clone() for n, p in names.items()}
    loss_of(ref, ids).backward()
    expected = {}
    for n, p in names.items():
        decay = L2 if is_decayed(n, p) else 0.0
        if is_muon(n, p):  # first step: momentum = (1 - mu) g; Nesterov: g + mu (momentum - g)
            blend = p.grad.double() * (1 - MOMENTUM) * (1 + MOMENTUM)
            update = newton_schulz64(blend) * math.sqrt(max(1.0, p.size(0) / p.size(1)))
            expected[n] = before[n].double() * (1 - MUON_LR * decay) - MUON_LR * update
    adam = {n: p for n, p in names.items() if not is_muon(n, p)}  # the embedding (tied: the head too), norms
    torch.optim.AdamW([{"params": [p for n, p in adam.items() if is_decayed(n, p)], "weight_decay": L2},
                       {"params": [p for n, p in adam.items() if not is_decayed(n, p)], "weight_decay": 0.0}],
                      lr=ADAM_LR, betas=cfg.adam_betas, eps=cfg.adam_eps).step()

    s.backward(loss_of(engine, ids), engine)
    assert s.optimizer_step(engine)
    after = {n: t for bucket in s.named_parameter_buckets(engine.module) for n, t in bucket}
    for n, p in names.items():
        want = expected[n] if n in expected else p.detach().double()
        moved = (want - before[n].double()).norm()
        assert moved > 0, n
        err = (after[n].double() - want).norm() / moved
        assert err < 1e-3, (n, err.item())


def test_the_policy_and_the_critic_take_their_own_optimizer(tiny):
    """OpenRLHF's --actor.optim / --critic.optim: the policy follows the strategy, the critic --critic_optim (adam
    unless given, whatever the actor's), read back from their DeepSpeed engines (ZeRO-2 wraps the optimizer)."""
    from deepspeed.runtime.zero.muon.muon_optimizer import MuonWithAuxAdam

    def lrs(worker):
        opt = worker.engine.optimizer.optimizer
        return type(opt), sorted({(g.get("use_muon", False), g["initial_lr"]) for g in opt.param_groups})  # peak lrs

    kw = {"load_kw": {"dtype": "fp32"}, "pad_id": 0}
    s = StrategyConfig(zero_stage=2, bf16=False, train_batch_size=1, learning_rate=1e-3, optim="muon", muon_lr=0.01)
    assert lrs(PolicyWorker(s, tiny, PolicyObjective(), 4, **kw)) == (MuonWithAuxAdam, [(False, 1e-3), (True, 0.01)])
    assert lrs(CriticWorker(s, tiny, CriticObjective(), 4, **kw)) == (torch.optim.AdamW, [(False, 1e-3)])
    adam = StrategyConfig(zero_stage=2, bf16=False, train_batch_size=1, learning_rate=1e-3)
    own = CriticObjective(optimizer=CriticOptimizerConfig(optim="muon", muon_lr=0.03, learning_rate=2e-3))
    critic = CriticWorker(adam, tiny, own, 4, **kw)
    assert lrs(critic) == (MuonWithAuxAdam, [(False, 2e-3), (True, 0.03)])
    head = [p for n, p in critic.engine.module.named_parameters() if n.startswith("head.")]
    assert len(head) == 1 and head[0].use_muon  # the value head, 1 x hidden, trains in Muon as in OpenRLHF
    with pytest.raises(ValueError, match=r"critic_muon_lr=0.01 \(--critic_muon_lr\) is a setting of the Muon "
                                         r"optimizer, not of --critic_optim adam; add --critic_optim muon or drop "
                                         r"--critic_muon_lr"):
        PPOConfig.from_flat(critic_muon_lr=0.01)


@pytest.mark.parametrize(("kw", "message"), [
    ({"optim": "sgd"}, "unknown optim 'sgd' (--optim); valid: adam, muon"),
    ({"muon_lr": 0.01}, "muon_lr=0.01 (--muon_lr) is a setting of the Muon optimizer, not of --optim adam; add "
                        "--optim muon or drop --muon_lr"),
    ({"optim": "muon", "muon_momentum": 1.0}, "muon_momentum (--muon_momentum) must be in [0, 1), got 1.0"),
    ({"optim": "muon", "muon_lr": -1.0}, "muon_lr (--muon_lr) must be >= 0, got -1.0"),
])
def test_bad_muon_settings_name_the_flag(kw, message):
    with pytest.raises(ValueError) as e:
        StrategyConfig(**kw)
    assert str(e.value) == message


def test_muon_config_is_openrlhfs_optimizer_section():
    c = DeepSpeedStrategy(StrategyConfig(optim="muon", learning_rate=5e-6, weight_decay=0.01))
    assert c.ds_config()["optimizer"] == {"type": "Muon", "params": {
        "lr": 0.02, "muon_lr": 0.02, "adam_lr": 5e-6, "momentum": 0.95, "betas": [0.9, 0.95], "eps": 1e-8,
        "weight_decay": 0.01, "torch_adam": True}}
    assert "optimizer" not in c.ds_config(train=False)
    z3 = DeepSpeedStrategy(StrategyConfig(optim="muon", zero_stage=3, adam_offload=True)).ds_config()
    assert z3["zero_optimization"]["reduce_scatter"] is False and "torch_adam" not in z3["optimizer"]["params"]
    assert "optimizer" not in DeepSpeedStrategy(StrategyConfig()).ds_config()
