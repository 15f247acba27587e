"""Real DeepSpeed on CPU (gloo, one process) with the tiny Llama: ZeRO-2 and ZeRO-3.

SFT loss falls; micro-batch 1 x accumulation 4 trains the same as 4 x 1; the HF
export (gathered under ZeRO-3) reloads in transformers with the same logits;
stopping and resuming from a checkpoint gives the losses of an uninterrupted run,
and a half-written checkpoint folder is skipped with a warning. On CUDA (skipped elsewhere): the
AdamW is torch's fused kernel and steps as a plain AdamW does.
"""

from __future__ import annotations

import logging
import re
import math

import pytest
import torch

from rl_algos import sft_loss
from rl_core.checkpoint import CheckpointManager
from rl_core.hf_export import export_hf
from rl_core.models import Actor
from rl_core.strategy import DeepSpeedStrategy, StrategyConfig
from rl_rollout.testing import make_tiny_model

pytestmark = [pytest.mark.timeout(600), pytest.mark.slow]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("m") / "tiny")


def batches(n_steps, batch=4, T=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n_steps):
        ids = torch.randint(5, 100, (batch, T), generator=g)
        mask = torch.ones_like(ids)
        mask[:, :4] = 0  # a "prompt" of 4 tokens carries no loss
        mask[1, 10:] = 0  # unequal lengths: a per-micro-batch mean would differ from the global one
        out.append((ids, mask))
    return out


def setup(tiny, stage, micro, steps=8, lr=2e-3):
    s = DeepSpeedStrategy(StrategyConfig(zero_stage=stage, bf16=False, micro_train_batch_size=micro,
                                         train_batch_size=4, learning_rate=lr, lr_warmup_ratio=0.0))
    torch.manual_seed(0)
    return s, s.prepare(Actor.from_pretrained(tiny, dtype="fp32"), total_steps=steps)


def train(s, engine, data, manual_boundary=False):
    """One optimizer step per (ids, mask); returns the global loss of each step. ``manual_boundary``: mark each
    step's last micro-batch by hand, as the RL workers do, instead of DeepSpeed counting them."""
    plan = s.batch_plan()
    losses = []
    for ids, mask in data:
        total = s.all_reduce(mask.sum().float(), "sum")
        step_loss = 0.0
        for i in range(plan.accumulation_steps):
            if manual_boundary:
                s.accumulation_boundary(engine, i == plan.accumulation_steps - 1)
            sl = slice(i * plan.micro_batch, (i + 1) * plan.micro_batch)
            loss = sft_loss(engine(ids[sl]).logprobs, mask[sl], global_tokens=total, dp_size=plan.dp_size)
            s.backward(loss, engine)
            stepped = s.optimizer_step(engine)
            assert stepped == (i == plan.accumulation_steps - 1)
            step_loss += loss.item()
        losses.append(step_loss)
    return losses


@pytest.mark.parametrize("stage", [2, 3])
def test_sft_loss_falls(tiny, stage):
    s, engine = setup(tiny, stage, micro=2)
    data = batches(1) * 8  # the same batch 8 times: a memorisation check
    losses = train(s, engine, data)
    assert losses[-1] < 0.7 * losses[0], losses
    assert s.batch_plan().describe() == "global batch 4 = micro batch 2 x accumulation 2 x data parallel 1"


def test_micro_batch_1x4_matches_4x1(tiny):
    data = batches(3)
    s1, e1 = setup(tiny, 2, micro=1)
    l1 = train(s1, e1, data)
    s4, e4 = setup(tiny, 2, micro=4)
    l4 = train(s4, e4, data)
    torch.testing.assert_close(torch.tensor(l1), torch.tensor(l4), atol=2e-5, rtol=0)
    p1, p4 = s1.full_state_dict(e1.module), s4.full_state_dict(e4.module)
    assert p1.keys() == p4.keys()
    for k in p1:
        torch.testing.assert_close(p1[k], p4[k], atol=2e-5, rtol=0, msg=k)


@pytest.mark.parametrize("manual_boundary", [False, True])
def test_zero2_alone_reduces_once_per_step_and_trains_as_stage_0(tiny, manual_boundary, caplog):
    """One rank: ZeRO-2's per-micro-batch reduction is coalesced into one per optimizer step (DeepSpeed's
    coalesce_grad_reduction, said in the log), with the weights of a stage-0 run."""
    data = batches(3)
    s0, e0 = setup(tiny, 0, micro=1)
    l0 = train(s0, e0, data, manual_boundary)
    with caplog.at_level(logging.INFO, logger="rl_core.strategy"):
        s2, e2 = setup(tiny, 2, micro=1)
    assert "ZeRO-2 on one rank: gradients reduced once per optimizer step" in caplog.text
    reductions = []
    reduce = e2.optimizer.reduce_ipg_grads
    e2.optimizer.reduce_ipg_grads = lambda *a, **kw: (reductions.append(e2.micro_steps), reduce(*a, **kw))[1]
    l2 = train(s2, e2, data, manual_boundary)
    assert reductions == [3, 7, 11], reductions  # once per step, at its last micro-batch (not 12 times)
    assert (e2.global_steps, e2.micro_steps) == (e0.global_steps, e0.micro_steps) == (3, 12)
    torch.testing.assert_close(torch.tensor(l2), torch.tensor(l0), atol=1e-6, rtol=0)
    p0, p2 = s0.full_state_dict(e0.module), s2.full_state_dict(e2.module)
    for k in p0:
        torch.testing.assert_close(p2[k], p0[k], atol=1e-6, rtol=0, msg=k)


def test_zero3_export_reloads_with_same_logits(tiny, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    s, engine = setup(tiny, 3, micro=2)
    train(s, engine, batches(2))
    # Under ZeRO-3 the live parameters are partitioned (empty locally) until gathered.
    assert any(p.numel() == 0 for p in engine.module.parameters())
    out = export_hf(s, engine, tmp_path / "export", tokenizer=AutoTokenizer.from_pretrained(tiny))
    assert not (tmp_path / ".tmp-export").exists()
    reloaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    ids = batches(1, seed=7)[0][0]
    with torch.no_grad():
        ours = engine(ids).logprobs
        theirs = Actor(reloaded)(ids).logprobs
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=0)
    with torch.no_grad():
        fresh = Actor(AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32))(ids).logprobs
    assert (fresh - theirs).abs().max() > 1e-3  # the export holds the trained weights, not the initial ones


def test_resume_gives_the_uninterrupted_losses(tiny, tmp_path, caplog):
    data = batches(4, seed=3)
    s, engine = setup(tiny, 2, micro=2, steps=4)
    full = train(s, engine, data)

    s, engine = setup(tiny, 2, micro=2, steps=4)
    ckpt = CheckpointManager(tmp_path / "ckpt", s, keep_last=1)
    first = train(s, engine, data[:2])
    ckpt.save(engine, step=2, client_state={"consumed_batches": 2})
    (tmp_path / "ckpt" / "step_00000003").mkdir()  # a crash mid-save: no marker
    (tmp_path / "ckpt" / "step_00000003" / "junk").write_text("half")

    s2, engine2 = setup(tiny, 2, micro=2, steps=4)
    torch.manual_seed(1234)  # resuming must restore the RNG, not keep this one
    with caplog.at_level(logging.WARNING, logger="rl_core.checkpoint"):
        meta = CheckpointManager(tmp_path / "ckpt", s2, keep_last=1).load(engine2)
    assert "ignoring" in caplog.text and "step_00000003" in caplog.text
    assert meta == {"step": 2, "consumed_batches": 2}
    rest = train(s2, engine2, data[meta["consumed_batches"]:])
    torch.testing.assert_close(torch.tensor(first + rest), torch.tensor(full), atol=1e-6, rtol=0)


def test_batch_arithmetic_errors():
    s = DeepSpeedStrategy(StrategyConfig(micro_train_batch_size=3, train_batch_size=8))
    with pytest.raises(ValueError, match=r"train_batch_size 8 is not divisible by micro_train_batch_size 3 x "
                                         r"data-parallel size 1 = 3; use train_batch_size 9"):
        s.batch_plan()
    with pytest.raises(ValueError, match=r"zero_stage must be 0, 1, 2 or 3 \(or unset: auto\), got 4"):
        StrategyConfig(zero_stage=4)
    with pytest.raises(ValueError, match=r"unknown lr_scheduler 'linear'; valid: cosine_with_min_lr"):
        StrategyConfig(lr_scheduler="linear")


def test_corrupt_checkpoint_marker_fails_with_the_fix(tmp_path):
    d = tmp_path / "step_00000001"
    d.mkdir()
    (d / "rl_state.json").write_text("{not json")
    mgr = CheckpointManager(tmp_path, DeepSpeedStrategy())
    with pytest.raises(ValueError, match=r"no checkpoint under .* can be resumed \(step_00000001: its rl_state.json "
                                         r"does not read \(JSONDecodeError.*point --ckpt_path at a new folder"):
        mgr.load(engine=None)


def test_a_damaged_newest_checkpoint_is_skipped_for_the_one_before(tiny, tmp_path, caplog):
    """issue 40: each file's size and sha256 go into the marker; a truncated model file in the newest checkpoint
    sends resume to the previous complete one, with one warning naming the file."""
    s, engine = setup(tiny, 2, micro=2, steps=4)
    ckpt = CheckpointManager(tmp_path / "ckpt", s, keep_last=2)
    train(s, engine, batches(1, seed=3))
    ckpt.save(engine, step=1, client_state={"consumed_batches": 1})
    train(s, engine, batches(1, seed=4))
    ckpt.save(engine, step=2, client_state={"consumed_batches": 2})
    model_file = next((tmp_path / "ckpt" / "step_00000002").rglob("*model_states.pt"))
    size = model_file.stat().st_size
    with model_file.open("r+b") as f:
        f.truncate(size - 1)
    s2, engine2 = setup(tiny, 2, micro=2, steps=4)
    with caplog.at_level(logging.WARNING, logger="rl_core.checkpoint"):
        meta = CheckpointManager(tmp_path / "ckpt", s2, keep_last=2).load(engine2)
    assert meta == {"step": 1, "consumed_batches": 1}
    assert re.search(rf"step_00000002 cannot be resumed: ds/.*model_states.pt is {size - 1:,} bytes, {size:,} when "
                     rf"saved; falling back", caplog.text), caplog.text


def test_a_second_world_in_one_process_prepares(tiny):
    """A run whose process group was destroyed (vLLM's in-process engine does so at close on CUDA) does not
    leave DeepSpeed's cached world clone behind: the next strategy's prepare() works (it raised "Group ... is
    not registered" on the H200 before the fix)."""
    import torch.distributed as dist

    s, engine = setup(tiny, 2, 4)
    train(s, engine, batches(1))
    dist.destroy_process_group()
    s2, engine2 = setup(tiny, 2, 4)  # a new world of one, as the next run in a sweep or notebook builds it
    assert dist.is_initialized()
    assert len(train(s2, engine2, batches(1))) == 1


@pytest.mark.parametrize(("kw", "engine_says"), [
    (dict(zero_stage=2, bf16=False, overlap_comm=True, adam_eps=1e-6),
     {"overlap": True, "optimizer": "DeepSpeedZeroOptimizer", "eps": 1e-6}),
    (dict(zero_stage=1, bf16=True, grad_accum_dtype="fp32"), {"grad_dtype": torch.float32, "optimizer": "BF16_Optimizer"}),
    (dict(zero_stage=3, bf16=False, zpg=2), {"hpz": 2, "optimizer": "DeepSpeedZeroOptimizer_Stage3"}),
])
def test_deepspeed_passthroughs_reach_the_engine_and_train(tiny, kw, engine_says):
    """OpenRLHF's --overlap_comm, --grad_accum_dtype, --zpg and --adam.eps: DeepSpeed's CPU build takes each (zpg 2
    on a world of one, too) and two steps change the loss."""
    s = DeepSpeedStrategy(StrategyConfig(micro_train_batch_size=2, train_batch_size=2, learning_rate=2e-3,
                                         lr_warmup_ratio=0.0, **kw))
    torch.manual_seed(0)
    engine = s.prepare(Actor.from_pretrained(tiny, dtype="fp32"), total_steps=2)
    got = {"overlap": engine.zero_overlap_comm(), "grad_dtype": engine.get_data_types()[1],
           "hpz": engine.zero_hpz_partition_size(), "optimizer": type(engine.optimizer).__name__,
           "eps": engine.optimizer.optimizer.param_groups[0]["eps"]}
    assert {k: got[k] for k in engine_says} == engine_says
    losses = train(s, engine, batches(1, batch=2) * 2)
    assert all(math.isfinite(v) for v in losses) and losses[1] < losses[0], losses


def test_full_determinism_trains_the_same_twice_under_deterministic_algorithms(tiny, monkeypatch):
    """OpenRLHF's --full_determinism: prepare turns torch's deterministic algorithms on (an op without one would
    raise) and two runs from the same seed give the same losses, bit for bit."""
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    runs = []
    try:
        for _ in range(2):  # each strategy seeds in its setup_distributed
            s = DeepSpeedStrategy(StrategyConfig(zero_stage=2, bf16=False, micro_train_batch_size=2,
                                                 train_batch_size=4, learning_rate=2e-3, full_determinism=True))
            engine = s.prepare(Actor.from_pretrained(tiny, dtype="fp32"), total_steps=2)
            assert torch.are_deterministic_algorithms_enabled()
            runs.append(train(s, engine, batches(2)))
    finally:
        torch.use_deterministic_algorithms(False)
    assert runs[0] == runs[1], runs


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the fused AdamW is the CUDA path; torch sees no GPU here")
@pytest.mark.parametrize("zero_stage", [0, 1])
def test_cuda_adamw_is_fused_and_steps_as_plain_adamw(tiny, zero_stage):
    """On CUDA the strategy's AdamW is torch's fused kernel (one pass over the weights instead of foreach's
    dozen); under DeepSpeed it moves the weights as a plain foreach AdamW with clipping does."""
    s = DeepSpeedStrategy(StrategyConfig(zero_stage=zero_stage, bf16=False, micro_train_batch_size=2,
                                         train_batch_size=2, learning_rate=1e-3, lr_warmup_ratio=0.0,
                                         lr_scheduler="constant"))
    engine = s.prepare(Actor.from_pretrained(tiny, dtype="fp32"), total_steps=3)
    inner = getattr(engine.optimizer, "optimizer", engine.optimizer)  # ZeRO-1 wraps the torch optimizer
    assert all(g["fused"] for g in inner.param_groups), [g["fused"] for g in inner.param_groups]
    ref = Actor.from_pretrained(tiny, dtype="fp32").to(s.device)
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.0, foreach=True)
    ids = torch.randint(5, 128, (2, 16), generator=torch.Generator().manual_seed(0)).to(s.device)
    for _ in range(3):
        s.backward(-engine(ids).logprobs.mean(), engine)
        s.optimizer_step(engine)
        (-ref(ids).logprobs.mean()).backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
    mine = dict(engine.module.named_parameters())
    worst = max((mine[n].detach() - p.detach()).abs().max().item() for n, p in ref.named_parameters())
    assert 0 < max((p.detach().cpu() - q).abs().max().item() for p, q in
                   zip(ref.parameters(), Actor.from_pretrained(tiny, dtype="fp32").parameters()))  # it moved
    assert worst < 1e-5, worst


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the fused AdamW is the CUDA path; torch sees no GPU here")
@pytest.mark.parametrize("zero_stage", [0, 1, 3])
def test_cuda_fused_adamw_trains_bf16(tiny, zero_stage):
    """bf16 weights with DeepSpeed's fp32 master copy (the SFT benchmark's setting) step through the fused
    AdamW: the loss on a repeated batch falls."""
    s = DeepSpeedStrategy(StrategyConfig(zero_stage=zero_stage, bf16=True, micro_train_batch_size=2,
                                         train_batch_size=2, learning_rate=1e-3, lr_warmup_ratio=0.0,
                                         lr_scheduler="constant"))
    engine = s.prepare(Actor.from_pretrained(tiny, dtype="bf16"), total_steps=5)
    ids = torch.randint(5, 128, (2, 16), generator=torch.Generator().manual_seed(0)).to(s.device)
    losses = []
    for _ in range(5):
        loss = -engine(ids).logprobs[:, 1:].mean()
        s.backward(loss, engine)
        s.optimizer_step(engine)
        losses.append(loss.item())
    assert all(map(math.isfinite, losses)) and losses[-1] < losses[0] - 0.1, losses


def test_an_offloaded_frozen_model_keeps_its_weights_on_the_cpu_and_gives_the_same_logprobs(tiny):
    """OpenRLHF's --ref.offload / --reward.offload: ZeRO-3's offload_param in the frozen model's config (the
    engine's parameters live on the CPU), and the reference's log-probs equal those of the plain ZeRO-3 one."""
    from rl_core.rl.experience import make_item
    from rl_core.rl.frozen_workers import ReferenceWorker

    cfg = StrategyConfig(zero_stage=3, bf16=False, micro_train_batch_size=2, train_batch_size=2)
    assert DeepSpeedStrategy(cfg).ds_config(train=False, offload=True)["zero_optimization"]["offload_param"][
        "device"] == "cpu"
    g = torch.Generator().manual_seed(0)
    ids = [torch.randint(5, 100, (n,), generator=g).tolist() for n in (9, 14, 6)]
    items = [make_item(x[:2], x[2:]) for x in ids]  # loss mask 0 on the two prompt tokens
    got = {}
    for offload in (False, True):
        ref = ReferenceWorker(cfg, tiny, load_kw={"dtype": "fp32"}, offload=offload)
        assert (ref.engine.zero_offload_param() is not None) == offload
        got[offload] = ref.logprobs(items)
    for a, b in zip(got[False], got[True], strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)


def test_offloading_a_frozen_model_outside_zero3_fails_naming_the_stage():
    with pytest.raises(ValueError, match=r"^--ref_offload: a frozen model's parameters go to the CPU through "
                                         r"DeepSpeed ZeRO-3 \(offload_param\), not at --zero_stage 2; add "
                                         r"--zero_stage 3 or drop the flag$"):
        StrategyConfig(zero_stage=2).check_param_offload("--ref_offload")
    with pytest.raises(ValueError, match="not at --zero_stage 0"):
        DeepSpeedStrategy(StrategyConfig(zero_stage=0)).ds_config(train=False, offload=True)


@pytest.mark.parametrize("stage", [0, 2])
def test_a_resume_with_another_learning_rate_applies_it_and_says_so(tiny, tmp_path, caplog, stage):
    """issue 40 finding 6: resuming with another --learning_rate was accepted and ignored (the saved schedule and
    optimizer groups won). Now the new peak applies at the restored step of the schedule, and a warning names it."""
    s, engine = setup(tiny, stage, micro=2, steps=8, lr=2e-3)
    train(s, engine, batches(2, seed=3))
    saved_lr = engine.get_lr()[0]
    CheckpointManager(tmp_path / "ckpt", s).save(engine, step=2, client_state={})

    s2, engine2 = setup(tiny, stage, micro=2, steps=8, lr=2e-3)  # the same settings: nothing said
    with caplog.at_level(logging.WARNING, logger="rl_core.checkpoint"):
        CheckpointManager(tmp_path / "ckpt", s2).load(engine2)
    assert engine2.get_lr()[0] == pytest.approx(saved_lr) and "other than the checkpoint's" not in caplog.text

    s3, engine3 = setup(tiny, stage, micro=2, steps=8, lr=1e-3)
    with caplog.at_level(logging.WARNING, logger="rl_core.checkpoint"):
        CheckpointManager(tmp_path / "ckpt", s3).load(engine3)
    assert engine3.get_lr()[0] == pytest.approx(saved_lr / 2)  # the new peak at the same point of the schedule
    assert re.search(r"optimizer settings other than the checkpoint's, applied from here on: learning rate \(peak\) "
                     r"0.002 -> 0.001", caplog.text), caplog.text
    before = [p.detach().clone() for p in engine3.module.parameters()]
    train(s3, engine3, batches(1, seed=5))  # and the optimizer steps with it
    assert engine3.lr_scheduler.base_lrs[0] == pytest.approx(1e-3)
    assert any((a != b).any() for a, b in zip(before, engine3.module.parameters(), strict=True))


@pytest.mark.parametrize("stage", [0, 2])
def test_training_steps_never_synchronise_the_device(tiny, monkeypatch, stage):
    """DeepSpeed's throughput timer, on by default, synchronised the whole device at every forward and every
    step() to time a figure nobody prints: on an H100 the host waited twice per micro-batch and the GPU idled
    while the next one launched (docs/performance.md). The engines are built with it off: no synchronize() in a
    training step (counted through DeepSpeed's accelerator, which every DeepSpeed sync goes through)."""
    from deepspeed.accelerator import get_accelerator

    s, engine = setup(tiny, stage, micro=2, steps=4)
    assert not engine.tput_timer.config.enabled
    calls = []
    accel = get_accelerator()
    real = accel.synchronize
    monkeypatch.setattr(accel, "synchronize", lambda *a, **k: (calls.append(a), real(*a, **k))[1])
    train(s, engine, batches(3, seed=1))  # steps 3 and later are past the timer's start_step
    assert calls == []
