"""The settings the hardware decides (rl_core.rl.auto): what each resolves to on CPU and on a (described) GPU,
that a value the user set always wins, the reasons given, and the auto token budget's arithmetic.

The GPU cases describe the hardware (``Hardware(cuda=True, ...)``) instead of needing one: the resolution is
pure Python; the budget itself reads the device's free memory, so its arithmetic is checked with that one
number given (the real read runs in benchmarks/grpo_vs_trl.py on the GPU machine, docs/performance.md)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from rl_core.rl.auto import Hardware, resolve
from rl_core.rl.batching import AUTO_MAX_TOKENS, AUTO_MIN_TOKENS, AUTO_SHARE, MicroBatchConfig, memory_budget
from rl_core.rl.build import RLModelConfig, RunConfig
from rl_core.strategy import StrategyConfig
from rl_core.trainers.ppo_config import PPOConfig

GPU = Hardware(cuda=True, trained_ranks=1, varlen=None, liger=None)
CPU = Hardware(cuda=False, varlen="no CUDA device", liger="no CUDA device")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from rl_rollout.testing import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("auto") / "m", num_layers=2, hidden_size=64, num_heads=4,
                           num_kv_heads=2, intermediate_size=96, vocab_size=128)


def run_cfg(path, **kw) -> RunConfig:
    parts = {"model": RLModelConfig(pretrain=str(path)), "strategy": StrategyConfig(), "ppo": PPOConfig(),
             "batching": MicroBatchConfig()}
    for name, value in kw.items():
        group, field = name.split("__")
        if group == "run":
            parts[field] = value
        else:
            parts[group] = dataclasses.replace(parts[group], **{field: value})
    return RunConfig(**parts)


def chosen(choices) -> dict:
    return {c.setting: c.value for c in choices}


def test_defaults_are_auto_and_cpu_keeps_what_it_had(tiny):
    cfg = run_cfg(tiny)
    assert (cfg.strategy.zero_stage, cfg.packing, cfg.model.use_liger_kernel, cfg.model.fused_lm_head,
            cfg.batching.max_tokens_per_gpu) == (None, None, None, None, "auto")
    out, choices = resolve(cfg, CPU)
    assert chosen(choices) == {"strategy.zero_stage": 2, "data.packing": False, "model.use_liger_kernel": False,
                               "model.fused_lm_head": False, "batching.max_tokens_per_gpu": None}
    assert (out.strategy.zero_stage, out.packing, out.model.use_liger_kernel, out.batching.max_tokens_per_gpu) == (
        2, False, False, None)
    assert all(c.why for c in choices)
    assert "no CUDA device" in str(next(c for c in choices if c.setting == "data.packing"))


def test_one_gpu_gets_the_fast_configuration(tiny):
    out, choices = resolve(run_cfg(tiny), dataclasses.replace(GPU, liger="liger-kernel is not installed"))
    c = chosen(choices)
    assert c["strategy.zero_stage"] == 0 and c["data.packing"] is True
    assert c["batching.max_tokens_per_gpu"] == "memory" and out.batching.from_memory
    assert c["model.use_liger_kernel"] is False  # not installed: said, not failed
    assert "not installed" in next(x.why for x in choices if x.setting == "model.use_liger_kernel")
    assert "one GPU" in next(x.why for x in choices if x.setting == "strategy.zero_stage")


@pytest.mark.parametrize("change, stage, why", [
    ({"strategy__adam_offload": True}, 2, "--adam_offload"),
    ({"ppo__deepspeed_enable_sleep": True}, 2, "--deepspeed_enable_sleep"),
    ({"strategy__grad_accum_dtype": "fp32"}, 2, "--grad_accum_dtype fp32"),
])
def test_zero_stage_auto_keeps_a_zero_optimizer_where_a_flag_needs_one(tiny, change, stage, why):
    _, choices = resolve(run_cfg(tiny, **change), GPU)
    c = next(x for x in choices if x.setting == "strategy.zero_stage")
    assert c.value == stage and why in c.why


def test_several_ranks_partition(tiny):
    _, choices = resolve(run_cfg(tiny), dataclasses.replace(GPU, trained_ranks=4))
    c = next(x for x in choices if x.setting == "strategy.zero_stage")
    assert c.value == 2 and "4 data-parallel ranks" in c.why


@pytest.mark.parametrize("change, images, why", [
    ({"strategy__bf16": False}, False, "bf16/fp16 only"),
    ({"model__attn_implementation": "sdpa"}, False, "dense block-diagonal mask"),
    ({}, True, "images"),
])
def test_packing_auto_stays_off_where_packed_rows_would_be_slow(tiny, change, images, why):
    out, choices = resolve(run_cfg(tiny, **change), GPU, images=images)
    c = next(x for x in choices if x.setting == "data.packing")
    assert c.value is False and out.packing is False and why in c.why
    assert out.batching.max_tokens_per_gpu is None  # padded rows: rows of --micro_train_batch_size


def test_packing_auto_off_where_torch_has_no_varlen_kernel(tiny):
    _, choices = resolve(run_cfg(tiny), dataclasses.replace(GPU, varlen="torch 2.9 has no varlen"))
    assert "torch 2.9 has no varlen" in next(x.why for x in choices if x.setting == "data.packing")


def test_what_the_user_set_wins(tiny):
    cfg = run_cfg(tiny, strategy__zero_stage=2, run__packing=False, model__use_liger_kernel=False,
                  model__fused_lm_head=False, batching__max_tokens_per_gpu=4096)
    out, choices = resolve(cfg, GPU)
    assert choices == () and out == cfg
    # rows asked for: --micro_train_batch_size given (the CLI's given set), or another value than 1 in Python
    for cfg, given in ((run_cfg(tiny), frozenset({"strategy.micro_train_batch_size"})),
                       (run_cfg(tiny, strategy__micro_train_batch_size=4), None)):
        out, choices = resolve(cfg, GPU, given=given)
        assert out.packing is True and out.batching.max_tokens_per_gpu is None
        assert "--micro_train_batch_size" in next(x.why for x in choices if x.setting == "batching.max_tokens_per_gpu")


def test_resolving_twice_changes_nothing(tiny):
    for given in (None, frozenset(), frozenset({"strategy.micro_train_batch_size"})):
        once, first = resolve(run_cfg(tiny, strategy__micro_train_batch_size=4), GPU, given=given)
        twice, choices = resolve(once, GPU)
        assert twice == once and choices == () and len(first) == 5


def test_liger_auto_checks_the_model_type(tiny):
    # liger-kernel said usable, but its table does not import here (CPU image): off, with the reason
    _, choices = resolve(run_cfg(tiny), GPU)
    c = next(x for x in choices if x.setting == "model.use_liger_kernel")
    assert c.value is False and "llama" in c.why


def test_fused_head_auto_stays_off_and_says_why(tiny):
    """Measured on one H100 (docs/performance.md): the chunked head buys memory, not time, so auto leaves it off;
    the reason names the measurement on a GPU and the device on CPU; a value given by hand wins."""
    for hw, why in ((GPU, "slower"), (CPU, "no CUDA device")):
        out, choices = resolve(run_cfg(tiny), hw)
        c = next(x for x in choices if x.setting == "model.fused_lm_head")
        assert c.value is False and out.model.fused_lm_head is False and why in c.why
    out, choices = resolve(run_cfg(tiny, model__fused_lm_head=True), GPU)
    assert out.model.fused_lm_head is True and "model.fused_lm_head" not in chosen(choices)


@pytest.mark.parametrize("text, value", [("auto", "auto"), ("none", None), ("20480", 20480), (" AUTO ", "auto"),
                                         (512, 512), (None, None), ("memory", "memory")])
def test_token_budget_values(text, value):
    assert MicroBatchConfig(max_tokens_per_gpu=text).max_tokens_per_gpu == value


@pytest.mark.parametrize("bad", ["lots", "-5", 0])
def test_token_budget_bad_values_say_what_fits(bad):
    with pytest.raises(ValueError, match="max_tokens_per_gpu"):
        MicroBatchConfig(max_tokens_per_gpu=bad)


def test_memory_budget_arithmetic(tiny, monkeypatch):
    """tokens = AUTO_SHARE x free / bytes per token (the activation estimate), clamped; training holds every layer,
    a no-grad forward one at a time, so it gets the larger budget."""
    import rl_core.activation_checkpointing as ac
    from rl_core.models import Actor

    actor = Actor.from_pretrained(tiny, dtype="fp32", attn_implementation="sdpa").train()
    est = ac.ActivationEstimate.of(actor, 2)
    free = 2**30
    monkeypatch.setattr(ac, "free_bytes", lambda module, device, optimizer=None: free)
    train, how = memory_budget(actor, torch.device("cpu"), train=True)
    assert train == min(max(int(AUTO_SHARE * free / est.bytes(0, 1)), AUTO_MIN_TOKENS), AUTO_MAX_TOKENS)
    forward, _ = memory_budget(actor, torch.device("cpu"), train=False)
    assert forward >= train and "GiB free" in how
    free = 1  # nothing free: the floor, and the report says it was clamped
    tokens, how = memory_budget(actor, torch.device("cpu"), train=True)
    assert tokens == AUTO_MIN_TOKENS and "clamped" in how
    free = 2**40
    assert memory_budget(actor, torch.device("cpu"), train=True)[0] == AUTO_MAX_TOKENS


def test_memory_budget_counts_the_logits_and_their_gradient_in_bf16(tiny, monkeypatch):
    """In bf16 the head costs 2 e V per token (logits and their gradient; rl_algos' log-probs keep no fp32 copy),
    not the checkpointing estimate's (e + 4) V."""
    import rl_core.activation_checkpointing as ac
    from rl_core.models import Actor

    actor = Actor.from_pretrained(tiny, dtype="bf16", attn_implementation="sdpa").train()
    est = ac.ActivationEstimate.of(actor, 2)
    vocab = 128
    assert est.head == vocab * (2 + 4)
    monkeypatch.setattr(ac, "free_bytes", lambda module, device, optimizer=None: 2**27)
    tokens, _ = memory_budget(actor, torch.device("cpu"), train=True)
    per_token = est.bytes(0, 1) - est.head + 2 * 2 * vocab
    assert tokens == min(max(int(AUTO_SHARE * 2**27 / per_token), AUTO_MIN_TOKENS), AUTO_MAX_TOKENS)


def test_memory_budget_refuses_an_optimizer_step_that_cannot_fit(tiny, monkeypatch):
    """ZeRO-0 over bf16 weights: DeepSpeed's unfused optimizer casts every gradient to fp32 at once in its step (4
    bytes a parameter, counted from the real optimizer); where that exceeds what is left after the gradients and
    Adam moments, the budget refuses in one line naming the fixes, instead of CUDA's out-of-memory error in
    DeepSpeed's step (Qwen2.5-1.5B's shape under a half-GPU cap, docs/performance.md). fp32 weights: torch's AdamW,
    no copies, no refusal."""
    import rl_core.activation_checkpointing as ac
    from rl_core.models import Actor
    from rl_core.strategy import DeepSpeedStrategy

    def engine(bf16: bool):
        s = DeepSpeedStrategy(StrategyConfig(zero_stage=0, bf16=bf16, micro_train_batch_size=2, train_batch_size=2))
        actor = Actor.from_pretrained(tiny, dtype="bf16" if bf16 else "fp32", attn_implementation="sdpa")
        return s.prepare(actor, total_steps=1)

    bf16 = engine(True)
    params = sum(p.numel() for p in bf16.module.parameters() if p.requires_grad)
    assert ac.pending_step_grads(bf16.optimizer) == 4 * params
    assert ac.pending_step_grads(engine(False).optimizer) == 0
    free = {"bytes": 4 * params - 1}
    monkeypatch.setattr(ac, "free_bytes", lambda module, device, optimizer=None: free["bytes"])
    from rl_core.preflight import InputError
    from rl_core.rl.batching import OptimizerStepDoesNotFit

    assert issubclass(OptimizerStepDoesNotFit, InputError) and issubclass(OptimizerStepDoesNotFit, MemoryError)
    with pytest.raises(OptimizerStepDoesNotFit, match=r"first optimizer step cannot fit.*--vllm_gpu_memory_utilization.*"
                                          r"--adam_offload.*--zero_stage 3.*--lora_rank"):
        memory_budget(bf16, torch.device("cpu"), train=True)
    memory_budget(bf16, torch.device("cpu"), train=False)  # a no-grad forward takes no optimizer step
    free["bytes"] = 4 * params + 2**26
    assert memory_budget(bf16, torch.device("cpu"), train=True)[0] >= AUTO_MIN_TOKENS
