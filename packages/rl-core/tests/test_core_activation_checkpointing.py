"""Gradient checkpointing by decoder layer (rl_core.activation_checkpointing): which layers recompute, that the
gradients do not change, the activation estimate against what autograd really saves, ``auto``, bad values."""

from __future__ import annotations

import logging

import pytest
import torch

from rl_core.activation_checkpointing import (ActivationEstimate, AutoCheckpointing, decoder_layers,
                                              layer_activation_bytes, select_checkpointed_layers)
from rl_core.models import Actor
from rl_core.preflight import InputError
from rl_core.strategy import StrategyConfig

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from rl_rollout.testing import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("ckpt") / "m", num_layers=4, hidden_size=64, num_heads=4,
                           num_kv_heads=2, intermediate_size=96, vocab_size=128)


def actor(path, ckpt: bool):
    torch.manual_seed(0)
    return Actor.from_pretrained(path, dtype="fp32", attn_implementation="sdpa", gradient_checkpointing=ckpt).train()


def calls_in_backward(model, ids):
    """Per decoder layer: how often it ran during the backward (a checkpointed layer's recompute), and the grads."""
    layers = decoder_layers(model)
    counts = [0] * len(layers)
    # pre-hooks: torch's non-reentrant recompute stops once it has the saved tensors, before forward hooks would run
    hooks = [layer.register_forward_pre_hook(lambda *_, k=k: counts.__setitem__(k, counts[k] + 1))
             for k, layer in enumerate(layers)]
    model.zero_grad(set_to_none=True)
    out = model(ids, attention_mask=torch.ones_like(ids)).logprobs
    assert counts == [1] * len(layers)
    (out * torch.linspace(-1, 1, out.shape[-1])).sum().backward()
    for h in hooks:
        h.remove()
    return [c - 1 for c in counts], {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("n", [0, 1, 3, 4])
def test_the_first_n_layers_recompute_in_backward_and_gradients_are_unchanged(tiny, n):
    ids = torch.randint(3, 128, (2, 24), generator=torch.Generator().manual_seed(1))
    plain = actor(tiny, ckpt=False)
    none, ref = calls_in_backward(plain, ids)
    assert none == [0, 0, 0, 0]
    model = actor(tiny, ckpt=True)
    assert select_checkpointed_layers(model, str(n), device=CPU) == f"the first {n} of 4 decoder layers recompute"
    recomputed, grads = calls_in_backward(model, ids)
    assert recomputed == [1] * n + [0] * (4 - n)
    assert grads.keys() == ref.keys()
    worst = max((grads[k] - ref[k]).abs().max().item() for k in ref)
    assert worst <= 1e-6, worst


def test_all_keeps_every_layer_recomputing(tiny):
    model = actor(tiny, ckpt=True)
    assert select_checkpointed_layers(model, "all", device=CPU) == "every decoder layer recomputes"
    ids = torch.randint(3, 128, (1, 16), generator=torch.Generator().manual_seed(2))
    assert calls_in_backward(model, ids)[0] == [1, 1, 1, 1]


def test_bad_values_name_the_value_and_the_fix(tiny):
    for bad in ("-1", "two", "1.5", True):
        with pytest.raises(InputError, match=r"--gradient_checkpointing_layers\) must be all, auto or a number of "
                                             r"decoder layers >= 0 .*got " + repr(bad).replace(".", r"\.")):
            StrategyConfig(gradient_checkpointing=True, gradient_checkpointing_layers=bad)
    with pytest.raises(ValueError, match=r"gradient_checkpointing_layers=3 .*add --gradient_checkpointing"):
        StrategyConfig(gradient_checkpointing_layers="3")
    for given, canonical in ((" 07", "7"), ("AUTO", "auto"), (4, "4"), ("all", "all")):
        cfg = StrategyConfig(gradient_checkpointing=True, gradient_checkpointing_layers=given)
        assert cfg.gradient_checkpointing_layers == canonical
    with pytest.raises(InputError, match=r"gradient_checkpointing_layers\)=5 is more than the model's 4 decoder "
                                         r"layers; pass 0\.\.4, all or auto"):
        select_checkpointed_layers(actor(tiny, ckpt=True), "5", device=CPU)


def test_auto_on_cpu_checkpoints_every_layer_and_says_why(tiny, caplog):
    model = actor(tiny, ckpt=True)
    with caplog.at_level(logging.WARNING, logger="rl_core.activation_checkpointing"):
        what = select_checkpointed_layers(model, "auto", device=CPU)
    assert what == "every decoder layer recomputes (auto on cpu: no device memory to read)"
    assert "no device memory to read on cpu, so every decoder layer recomputes" in caplog.text
    assert all(layer.gradient_checkpointing for layer in decoder_layers(model))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_layer_estimate_matches_what_autograd_saves(dtype):
    """The per-layer formula against the bytes a real Llama decoder layer saves for its backward (storages counted
    once, weights left out), at a Qwen2.5-0.5B-like width."""
    from transformers import LlamaConfig, LlamaForCausalLM

    h, heads, kv_heads, inter, B, T = 448, 7, 1, 2432, 2, 48
    cfg = LlamaConfig(hidden_size=h, num_hidden_layers=1, num_attention_heads=heads, num_key_value_heads=kv_heads,
                      intermediate_size=inter, vocab_size=64, max_position_embeddings=T)
    cfg._attn_implementation = "sdpa"
    model = LlamaForCausalLM(cfg).to(dtype).train()
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    x = torch.randn(B, T, h, dtype=dtype, requires_grad=True)
    pos = torch.arange(T)[None].expand(B, T)
    saved: dict[int, int] = {}

    def pack(t):
        if t.untyped_storage().data_ptr() not in weights:
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model.model.layers[0](x, attention_mask=None, position_ids=pos,
                              position_embeddings=model.model.rotary_emb(x, pos))
    e = torch.finfo(dtype).bits // 8
    formula = B * T * layer_activation_bytes(h, kv_heads * h // heads, inter, e)
    assert formula <= sum(saved.values()) <= 1.03 * formula, (sum(saved.values()), formula)


def test_estimate_peak_and_the_smallest_fit():
    est = ActivationEstimate(layers=4, per_layer=10, per_input=1, head=2)
    # n kept: 0 -> 4 x 10; 1 -> 1 + 3 x 10; 2 -> 2 + 20; 3 -> 3 + 10; 4 -> 4 + one recompute of 10; head 2 each
    assert [est.bytes(n, tokens=1) for n in range(5)] == [42, 33, 24, 15, 16]
    assert est.bytes(2, tokens=3) == 72
    assert est.smallest_fit(tokens=1, budget=42) == (0, True)
    assert est.smallest_fit(tokens=1, budget=30) == (2, True)
    assert est.smallest_fit(tokens=1, budget=5) == (3, False)  # nothing fits: the smallest estimate


def test_auto_chooses_per_forward_from_its_tokens(tiny):
    """The pre-hook's choice, with the budget fixed (the device's free memory is what CPU lacks)."""
    model = actor(tiny, ckpt=True)
    layers = decoder_layers(model)
    est = ActivationEstimate.of(model, len(layers))
    assert (est.per_layer, est.per_input, est.head) == (layer_activation_bytes(64, 32, 96, 4), 4 * 64, 128 * 8)

    class Fixed(AutoCheckpointing):
        def budget(self):
            return est.bytes(2, tokens=64)  # 64 tokens fit with 2 layers checkpointed

    hook = Fixed(model, layers, est, CPU)
    model.register_forward_pre_hook(hook, with_kwargs=True)
    for rows, n in ((1, 0), (4, 2), (8, 3)):  # 16, 64, 128 tokens
        ids = torch.randint(3, 128, (rows, 16), generator=torch.Generator().manual_seed(rows))
        assert calls_in_backward(model, ids)[0] == [1] * n + [0] * (4 - n), rows
        assert hook.choices[-1][::2] == (rows * 16, n)
    with torch.no_grad():  # evaluation forwards leave the layers as they are
        model(torch.ones(1, 4, dtype=torch.long))
    assert hook.choices[-1][0] == 128


@pytest.mark.parametrize("kind", ["critic", "reward", "lora-actor"])
def test_strategy_prepare_selects_the_layers_of_every_trained_model(tiny, kind):
    """What RM, the RL critic and LoRA training hand DeepSpeedStrategy.prepare: the first layer recomputes, the
    rest keep their activations, and the estimate finds the config through the wrapper (no LM head: head 0)."""
    from rl_core.models import Critic, LoraSpec, RewardModel
    from rl_core.strategy import DeepSpeedStrategy

    load = dict(dtype="fp32", attn_implementation="sdpa", gradient_checkpointing=True)
    model = {"critic": lambda: Critic.from_pretrained(tiny, **load),
             "reward": lambda: RewardModel.from_pretrained(tiny, **load),
             "lora-actor": lambda: Actor.from_pretrained(tiny, **load, lora=LoraSpec(rank=4))}[kind]()
    s = DeepSpeedStrategy(StrategyConfig(zero_stage=0, bf16=False, micro_train_batch_size=2, train_batch_size=2,
                                         gradient_checkpointing=True, gradient_checkpointing_layers="1"))
    engine = s.prepare(model, total_steps=1)
    layers = decoder_layers(engine.module)
    assert [layer.gradient_checkpointing for layer in layers] == [True, False, False, False]
    assert ActivationEstimate.of(engine.module, 4).head == (128 * 8 if kind == "lora-actor" else 0)
    engine.train()
    counts = [0] * 4
    for k, layer in enumerate(layers):
        layer.register_forward_pre_hook(lambda *_, k=k: counts.__setitem__(k, counts[k] + 1))
    ids = torch.randint(3, 128, (2, 12), generator=torch.Generator().manual_seed(3))
    out = engine(ids, attention_mask=torch.ones_like(ids))
    s.backward((out.logprobs if kind == "lora-actor" else out).float().sum(), engine)
    assert counts == [2, 1, 1, 1]


def test_reentrant_checkpointing_of_the_first_n_layers_keeps_the_gradients(tiny):
    """OpenRLHF's --gradient_checkpointing_use_reentrant with --gradient_checkpointing_layers 2: prepare installs
    torch's reentrant checkpoint, the first two layers recompute, and the gradients equal a plain backward's."""
    from rl_core.strategy import DeepSpeedStrategy

    ids = torch.randint(3, 128, (2, 24), generator=torch.Generator().manual_seed(4))
    _, ref = calls_in_backward(actor(tiny, ckpt=False), ids)
    s = DeepSpeedStrategy(StrategyConfig(zero_stage=0, bf16=False, micro_train_batch_size=2, train_batch_size=2,
                                         gradient_checkpointing=True, gradient_checkpointing_layers="2",
                                         gradient_checkpointing_use_reentrant=True))
    engine = s.prepare(actor(tiny, ckpt=True), total_steps=1)
    layers = decoder_layers(engine.module)
    assert all(layer._gradient_checkpointing_func.keywords == {"use_reentrant": True} for layer in layers)
    recomputed, grads = calls_in_backward(engine.module.train(), ids)
    assert recomputed == [1, 1, 0, 0]
    worst = max((grads[k] - ref[k]).abs().max().item() for k in ref)
    assert worst <= 1e-6, worst


def test_reentrant_without_gradient_checkpointing_says_to_add_it():
    with pytest.raises(ValueError, match="add --gradient_checkpointing"):
        StrategyConfig(gradient_checkpointing_use_reentrant=True)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="auto reads the free CUDA memory; torch sees no CUDA device")
def test_auto_on_cuda_recomputes_more_layers_when_less_memory_is_free(tiny):
    cuda = torch.device("cuda", torch.cuda.current_device())
    model = actor(tiny, ckpt=True).to(cuda)
    assert select_checkpointed_layers(model, "auto", device=cuda).startswith("auto: ")
    hook = next(h for h in model._forward_pre_hooks.values() if isinstance(h, AutoCheckpointing))
    ids = torch.randint(3, 128, (8, 1024), device=cuda)

    def step():
        model.zero_grad(set_to_none=True)
        model(ids, attention_mask=torch.ones_like(ids)).logprobs.sum().backward()
        return hook.choices[-1]

    tokens, budget, n = step()
    assert (tokens, n) == (8192, 0) and budget > hook.estimate.bytes(0, tokens)
    # leave only what fits with 2 of the 4 layers recomputing: half-way between the estimates at 1 and 2 layers
    target = (hook.estimate.bytes(1, tokens) + hook.estimate.bytes(2, tokens)) // 2
    model.zero_grad(set_to_none=True)
    torch.cuda.empty_cache()
    spare = torch.empty(hook.budget() - target, dtype=torch.uint8, device=cuda)
    tokens, budget, n = step()
    del spare
    assert n == 2, (budget, target, hook.estimate.bytes(1, tokens), hook.estimate.bytes(2, tokens))


def test_reentrant_checkpointing_with_ring_attention_is_refused():
    """The reentrant recompute runs in the backward outside the ring's shard (the default mode gets it back:
    test_core_ring_attention.py, checkpointed)."""
    with pytest.raises(ValueError) as e:
        StrategyConfig(gradient_checkpointing=True, gradient_checkpointing_use_reentrant=True, ring_attn_size=2)
    assert str(e.value) == (
        "--gradient_checkpointing_use_reentrant with --ring_attn_size 2: the reentrant recompute runs without the "
        "ring's shard of the row; drop --gradient_checkpointing_use_reentrant (the default, non-reentrant mode "
        "recomputes the same ring attention)")
    StrategyConfig(gradient_checkpointing=True, ring_attn_size=2)  # non-reentrant: taken
