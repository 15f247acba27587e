"""The MoE load-balancing loss (``aux_loss_coef``, OpenRLHF's ``--aux_loss_coef``) on a tiny random Mixtral
(2 layers, hidden 32, 4 experts, 2 per token; built here, nothing downloaded): the Actor's ``aux_loss`` is the
Switch-Transformer loss recomputed here from the router logits, its gradient reaches the routers, a model
without experts is refused in one line, and one SFT / DPO step's loss is the step without the coefficient plus
``coef x`` the aux loss of the same batch (real DeepSpeed ZeRO-2 on CPU)."""

from __future__ import annotations

import json

import pytest
import torch

from rl_core.models import Actor
from rl_rollout.testing import make_tiny_model

pytestmark = pytest.mark.timeout(600)
EXPERTS, TOP_K, COEF = 4, 2, 0.5


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("moe") / "tiny-moe", hidden_size=32, num_heads=2,
                           intermediate_size=64, num_experts=EXPERTS)


def switch_loss(router_logits: tuple[torch.Tensor, ...], attention_mask: torch.Tensor) -> torch.Tensor:
    """Fedus et al.'s load-balancing loss over every layer's router logits ``[B*T, E]``, real tokens only:
    E x sum over experts of (share of top-k picks) x (mean router probability)."""
    probs = torch.cat(router_logits).float().softmax(-1)  # [L*B*T, E], layer after layer
    picks = torch.nn.functional.one_hot(probs.topk(TOP_K, dim=-1).indices, EXPERTS).float()  # [N, k, E]
    w = attention_mask.reshape(-1).float().repeat(len(router_logits))
    share = (picks * w[:, None, None]).sum(0) / w.sum()  # [k, E]
    prob = (probs * w[:, None]).sum(0) / w.sum()  # [E]
    return EXPERTS * (share * prob).sum()


def batch():
    ids = torch.randint(10, 100, (3, 9), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[0, -3:] = 0  # right padding: not counted in the loss
    return ids, mask


def test_actor_returns_the_routers_load_balancing_loss_and_its_gradient_reaches_the_routers(moe):
    from transformers import AutoModelForCausalLM

    ids, mask = batch()
    actor = Actor.from_pretrained(moe, dtype="fp32")
    assert actor(ids, attention_mask=mask).aux_loss is None  # off unless asked
    actor.enable_moe_aux_loss()
    out = actor(ids, attention_mask=mask)
    hf = AutoModelForCausalLM.from_pretrained(moe, dtype=torch.float32)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    logits = hf(input_ids=ids, attention_mask=mask, position_ids=positions, output_router_logits=True,
                use_cache=False).router_logits
    expected = switch_loss(logits, mask)
    torch.testing.assert_close(out.aux_loss, expected, atol=1e-6, rtol=1e-6)
    assert expected.item() > 1.0  # E x sum(share x prob) is 1 only when perfectly balanced: something to minimise
    out.aux_loss.backward()
    routers = {n: p.grad for n, p in actor.named_parameters() if n.endswith("mlp.gate.weight")}
    assert len(routers) == 2 and all(g is not None and g.abs().sum() > 0 for g in routers.values())
    assert not json.loads((moe / "config.json").read_text())["output_router_logits"]  # the saved config is as it was


@pytest.mark.parametrize("impl", ["eager", "batched_mm", "grouped_mm"])
def test_experts_implementation_reaches_the_model_and_computes_the_same(moe, impl):
    """OpenRLHF's --ds.experts_implementation, passed to from_pretrained: the policy and a reward/critic body load
    with the kernel asked for, and every kernel gives eager's logits (fp32, CPU)."""
    from rl_core.models import Critic

    ids, mask = batch()
    eager = Actor.from_pretrained(moe, dtype="fp32", experts_implementation="eager").model
    actor = Actor.from_pretrained(moe, dtype="fp32", experts_implementation=impl).model
    assert actor.config._experts_implementation == impl
    torch.testing.assert_close(actor(input_ids=ids, attention_mask=mask).logits,
                               eager(input_ids=ids, attention_mask=mask).logits, atol=1e-5, rtol=0)
    assert Critic.from_pretrained(moe, dtype="fp32", experts_implementation=impl).config._experts_implementation == impl


def test_an_unknown_experts_implementation_names_the_flag_and_the_valid_ones(moe):
    from rl_core.preflight import InputError

    with pytest.raises(InputError, match=r"--experts_implementation bogus: .*experts_implementation=\"eager\""):
        Actor.from_pretrained(moe, dtype="fp32", experts_implementation="bogus")


def test_a_model_without_experts_is_refused_in_one_line(tmp_path):
    actor = Actor.from_pretrained(make_tiny_model(tmp_path / "llama", hidden_size=32, num_heads=2,
                                                  intermediate_size=64), dtype="fp32")
    with pytest.raises(ValueError, match=r"^--aux_loss_coef is the MoE load-balancing loss, but the model \(llama\) "
                                         r"is not a mixture of experts .*; drop --aux_loss_coef or give 0$"):
        actor.enable_moe_aux_loss()


def test_a_negative_coefficient_is_refused():
    from rl_core.trainers import SFTConfig

    with pytest.raises(ValueError, match="aux_loss_coef"):
        SFTConfig(aux_loss_coef=-0.1)


def _strategy(lr=1e-2):
    from rl_core.strategy import DeepSpeedStrategy, StrategyConfig

    return DeepSpeedStrategy(StrategyConfig(zero_stage=2, bf16=False, micro_train_batch_size=4, train_batch_size=4,
                                            learning_rate=lr, lr_warmup_ratio=0.0))


def _router(trainer) -> torch.Tensor:
    return next(p for n, p in trainer.engine.module.named_parameters() if n.endswith("0.mlp.gate.weight")).detach()


def _aux_of_first_step(trainer, moe) -> torch.Tensor:
    """The aux loss of the first step's micro-batch (one per step here) under the initial weights, from a plain
    transformers forward of the trainer's own collated rows."""
    from transformers import AutoModelForCausalLM

    b = trainer.collate(trainer.micro_batches(trainer.global_batch(0, 0))[0])
    hf = AutoModelForCausalLM.from_pretrained(moe, dtype=torch.float32)
    with torch.no_grad():
        if "attention_mask" in b:
            mask = b["attention_mask"]
            logits = hf(input_ids=b["input_ids"], attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0),
                        output_router_logits=True, use_cache=False).router_logits
        else:  # packed: every token is real (no cache: transformers then keeps attention within each sequence)
            mask = torch.ones_like(b["input_ids"])
            logits = hf(input_ids=b["input_ids"], position_ids=b["position_ids"], output_router_logits=True,
                        use_cache=False).router_logits
    return switch_loss(logits, mask)


def _one_step(make, moe, coef):
    trainer = make(coef)
    aux = _aux_of_first_step(trainer, moe)
    before = _router(trainer).clone()
    m = trainer.train_step(trainer.global_batch(0, 0))
    return m, aux, _router(trainer) - before


@pytest.mark.slow
@pytest.mark.parametrize("packing", [False, True])
def test_sft_step_loss_is_the_loss_without_plus_coef_times_the_aux_loss(moe, packing):
    from transformers import AutoTokenizer

    from rl_core.data import DataConfig, SFTDataset
    from rl_core.trainers import SFTConfig, SFTTrainer

    tok = AutoTokenizer.from_pretrained(moe)
    rows = [{"q": f"reverse {w}", "a": w[::-1]} for w in ("abc", "hello", "xyz", "moe")]
    ds = SFTDataset(rows, tok, DataConfig(input_key="q", output_key="a", max_len=64, packing=packing))

    def make(coef):
        return SFTTrainer(_strategy(), Actor.from_pretrained(moe, dtype="fp32", packed=packing), tok, ds,
                          SFTConfig(aux_loss_coef=coef))

    plain, _, moved_plain = _one_step(make, moe, 0.0)
    m, aux, moved = _one_step(make, moe, COEF)
    assert "aux_loss" not in plain
    assert m["aux_loss"] == pytest.approx(aux.item(), rel=1e-5)
    assert m["loss"] == pytest.approx(plain["loss"] + COEF * aux.item(), rel=1e-5)
    assert (moved - moved_plain).abs().max() > 1e-6  # the aux term's gradient moved the router


@pytest.mark.slow
def test_dpo_step_loss_is_the_loss_without_plus_coef_times_the_aux_loss(moe):
    """DPO: one forward of the chosen and rejected rows together, as OpenRLHF's concatenated forward."""
    from transformers import AutoTokenizer

    from rl_core.data import DataConfig, PreferenceDataset
    from rl_core.models import frozen
    from rl_core.trainers import DPOConfig, DPOTrainer

    tok = AutoTokenizer.from_pretrained(moe)
    rows = [{"p": f"say {w}", "c": w, "r": w[::-1] + "!"} for w in ("abc", "hello", "xyz", "moe")]
    ds = PreferenceDataset(rows, tok, DataConfig(prompt_key="p", chosen_key="c", rejected_key="r", max_len=64))

    def make(coef):
        return DPOTrainer(_strategy(), Actor.from_pretrained(moe, dtype="fp32"),
                          frozen(Actor.from_pretrained(moe, dtype="fp32")), tok, ds, DPOConfig(aux_loss_coef=coef))

    plain, _, _ = _one_step(make, moe, 0.0)
    m, aux, _ = _one_step(make, moe, COEF)
    assert m["aux_loss"] == pytest.approx(aux.item(), rel=1e-5)
    assert m["loss"] == pytest.approx(plain["loss"] + COEF * aux.item(), rel=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("packing", [False, True])
def test_a_ppo_policy_step_adds_coef_times_the_router_loss_of_each_micro_batch(moe, packing):
    """rl ppo's PolicyWorker with ``aux_loss_coef`` (OpenRLHF's --actor.aux_loss_coef). Advantages 0, so the
    policy loss has no gradient, and AdamW with eps 1: its first step moves every weight by lr x g / (|g| + 1),
    g the gradient of coef x each micro-batch's router loss weighted by its share of the samples, recomputed here
    from transformers forwards (padded micro-batches of 2; packed rows under a 14-token budget: 2 + 1 + 1 items)."""
    from transformers import AutoModelForCausalLM

    from rl_algos import PolicyLossConfig
    from rl_core.rl import PolicyObjective, PolicyWorker, make_item
    from rl_core.rl.batching import MicroBatchConfig
    from rl_core.strategy import StrategyConfig

    lr = 1e-2
    s = StrategyConfig(zero_stage=2, bf16=False, micro_train_batch_size=2, train_batch_size=4, learning_rate=lr,
                       lr_warmup_ratio=0.0, lr_scheduler="constant", max_norm=0.0, adam_eps=1.0)
    objective = PolicyObjective(PolicyLossConfig(aux_loss_coef=COEF))
    w = PolicyWorker(s, str(moe), objective, 1, load_kw={"dtype": "fp32", "packed": packing},
                     batching=MicroBatchConfig(max_tokens_per_gpu=14 if packing else None), packing=packing)
    g = torch.Generator().manual_seed(0)
    items = []
    for p, r in ((3, 4), (5, 2), (2, 6), (4, 4)):
        it = make_item(*(torch.randint(10, 100, (n,), generator=g).tolist() for n in (p, r)))
        it.old_logprobs_T = it.advantages_T = torch.zeros(p + r)
        items.append(it)
    groups = w._micro_batches(items, train=True)
    assert sorted(len(x) for x in groups) == ([1, 1, 2] if packing else [2, 2])

    hf = AutoModelForCausalLM.from_pretrained(moe, dtype=torch.float32)
    expected_aux = 0.0
    for idx in groups:
        ids = [items[i].input_ids_T for i in idx]
        if packing:  # one row, positions restarting per sequence, every token real
            row = torch.tensor([t for x in ids for t in x])[None]
            pos = torch.cat([torch.arange(len(x)) for x in ids])[None]
            mask = torch.ones_like(row)
            logits = hf(input_ids=row, position_ids=pos, output_router_logits=True, use_cache=False).router_logits
        else:  # right padding
            T = max(map(len, ids))
            row = torch.tensor([x + [0] * (T - len(x)) for x in ids])
            mask = torch.tensor([[1] * len(x) + [0] * (T - len(x)) for x in ids])
            logits = hf(input_ids=row, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0),
                        output_router_logits=True, use_cache=False).router_logits
        aux = switch_loss(logits, mask) * len(idx) / len(items)
        (COEF * aux).backward()
        expected_aux += aux.item()
    before = {n: p.detach().clone() for n, p in w.engine.module.named_parameters()}
    m = w.train(items)[0]

    assert m["aux_loss"] == pytest.approx(expected_aux, rel=1e-5)
    grads = {f"model.{n}": p.grad for n, p in hf.named_parameters()}
    moved = 0
    for n, p in w.engine.module.named_parameters():
        gr = grads[n] if grads[n] is not None else torch.zeros_like(p)
        torch.testing.assert_close(p.detach() - before[n], -lr * gr / (gr.abs() + 1), rtol=1e-3, atol=1e-7)
        moved += int((gr.abs() > 0).any())
    assert moved > 10  # routers, attention, embeddings: the aux loss reaches every layer below the routers
