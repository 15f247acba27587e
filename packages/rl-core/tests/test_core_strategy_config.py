"""StrategyConfig and the DeepSpeed config it builds, checked without starting DeepSpeed: OpenRLHF's DeepSpeed
passthroughs (--overlap_comm, --zpg, --grad_accum_dtype, --adam.eps) land on the keys its get_train_ds_config
sets, only in the training config, and bad values stop with the value and the fix. The real engine taking each
one on CPU: test_core_strategy.py::test_deepspeed_passthroughs_reach_the_engine_and_train."""

from __future__ import annotations

import pytest
import torch

from rl_core.strategy import DeepSpeedStrategy, StrategyConfig


def ds(train: bool = True, **kw) -> dict:
    return DeepSpeedStrategy(StrategyConfig(micro_train_batch_size=1, train_batch_size=1, **kw)).ds_config(train=train)


def test_defaults_add_none_of_the_passthrough_keys():
    cfg = ds(zero_stage=3)
    assert "data_types" not in cfg
    assert not {"overlap_comm", "zero_hpz_partition_size"} & cfg["zero_optimization"].keys()


def test_passthroughs_set_openrlhfs_keys_in_the_training_config_only():
    kw = dict(zero_stage=3, overlap_comm=True, zpg=8, grad_accum_dtype="fp32")
    zero = ds(**kw)["zero_optimization"]
    assert (zero["overlap_comm"], zero["contiguous_gradients"], zero["zero_hpz_partition_size"]) == (True, True, 8)
    assert ds(**kw)["data_types"] == {"grad_accum_dtype": "fp32"}
    frozen = ds(train=False, **kw)  # OpenRLHF's get_eval_ds_config has none of them
    assert "data_types" not in frozen
    assert not {"overlap_comm", "zero_hpz_partition_size"} & frozen["zero_optimization"].keys()
    assert ds(zero_stage=2, overlap_comm=True)["zero_optimization"]["contiguous_gradients"] is True


def test_adam_eps_reaches_adamw():
    s = DeepSpeedStrategy(StrategyConfig(adam_eps=1e-6))
    opt = s.make_optimizer(torch.nn.Linear(2, 2))
    assert {g["eps"] for g in opt.param_groups} == {1e-6}


@pytest.mark.parametrize(("kw", "message"), [
    (dict(zero_stage=2, zpg=2), r"zpg=2 \(--zpg\).*add --zero_stage 3 or drop --zpg"),
    (dict(zero_stage=3, zpg=0), r"zpg .*>= 1"),
    (dict(grad_accum_dtype="fp16"), r"grad_accum_dtype='fp16'.*valid: fp32, bf16"),
    (dict(zero_stage=0, grad_accum_dtype="fp32"), r"with bf16 params needs a ZeRO optimizer.*--zero_stage 1, 2 or 3"),
    (dict(adam_eps=0.0), r"adam_eps .*> 0"),
])
def test_bad_passthrough_values_name_the_value_and_the_fix(kw, message):
    with pytest.raises(ValueError, match=message):
        StrategyConfig(**kw)


@pytest.fixture
def restore_determinism(monkeypatch):
    for var in ("CUDA_LAUNCH_BLOCKING", "CUBLAS_WORKSPACE_CONFIG", "FLASH_ATTENTION_DETERMINISTIC",
                "ASCEND_LAUNCH_BLOCKING", "HCCL_DETERMINISTIC"):
        monkeypatch.delenv(var, raising=False)  # restored after the test, as were they
    before = torch.are_deterministic_algorithms_enabled(), torch.backends.cudnn.deterministic
    yield
    torch.use_deterministic_algorithms(before[0])
    torch.backends.cudnn.deterministic = before[1]


def test_full_determinism_turns_on_what_openrlhfs_does_and_seeds(restore_determinism):
    import os

    from rl_core.strategy import seed_everything

    seed_everything(7)
    assert not torch.are_deterministic_algorithms_enabled() and "CUBLAS_WORKSPACE_CONFIG" not in os.environ
    plain = torch.rand(3)
    seed_everything(7, full_determinism=True)
    assert torch.are_deterministic_algorithms_enabled() and torch.backends.cudnn.deterministic
    assert (os.environ["CUBLAS_WORKSPACE_CONFIG"], os.environ["FLASH_ATTENTION_DETERMINISTIC"]) == (":16:8", "1")
    assert torch.equal(torch.rand(3), plain)  # the same seed either way


def test_deepspeed_sleep_refuses_what_deepspeed_cannot_offload_in_one_line():
    """ZeRO-1 with bf16 and fp32 gradient accumulation trains through DeepSpeed's BF16 optimizer, which has no state
    offload (it failed mid-run with an AttributeError); the other stages and dtypes pass."""
    from rl_core.rl.ds_sleep import check_ds_sleep

    with pytest.raises(ValueError, match=r"--zero_stage 1, bf16 and --grad_accum_dtype fp32.*use --zero_stage 2"):
        check_ds_sleep(True, StrategyConfig(zero_stage=1, bf16=True, grad_accum_dtype="fp32"))
    with pytest.raises(ValueError, match=r"needs --zero_stage 1, 2 or 3"):
        check_ds_sleep(True, StrategyConfig(zero_stage=0))
    for cfg in (StrategyConfig(zero_stage=2, bf16=True, grad_accum_dtype="fp32"), StrategyConfig(zero_stage=1),
                StrategyConfig(zero_stage=1, bf16=True, grad_accum_dtype="fp32", adam_offload=False)):
        if cfg.zero_stage == 1 and cfg.grad_accum_dtype == "fp32":
            check_ds_sleep(False, cfg)  # off: nothing to refuse
        else:
            check_ds_sleep(True, cfg)
