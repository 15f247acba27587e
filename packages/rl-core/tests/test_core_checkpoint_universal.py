"""--use_ds_universal_ckpt: a ZeRO-2 state saved by two ranks (gloo, CPU) resumes on one through DeepSpeed's
universal checkpoint (rl_core.checkpoint.to_universal + load_universal) with the same weights, optimizer step
and Adam moments. A small MLP, not a language model: the conversion only sees named parameters."""

from __future__ import annotations

import os

import pytest
import torch

pytestmark = pytest.mark.multiprocess


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))


def _strategy(world: int, universal: bool):
    from rl_core.strategy import DeepSpeedStrategy, StrategyConfig

    return DeepSpeedStrategy(StrategyConfig(zero_stage=2, bf16=False, train_batch_size=4,
                                            micro_train_batch_size=4 // world, use_ds_universal_ckpt=universal))


def _adam(engine) -> dict:
    """This rank's flat fp32 partition of the one parameter group: step and moments."""
    state = engine.optimizer.optimizer.state_dict()["state"]
    first = next(v for v in state.values() if "exp_avg" in v)
    return {"step": float(first["step"]), "exp_avg": first["exp_avg"].clone(),
            "exp_avg_sq": first["exp_avg_sq"].clone()}


def _save(rank: int, port: int, folder: str) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    torch.set_num_threads(1)
    from rl_core.checkpoint import save_engine_state

    s = _strategy(2, False)
    engine = s.prepare(_model(), total_steps=10)
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
    for _ in range(2):
        engine.backward(engine(x[2 * rank:2 * rank + 2]).pow(2).mean())
        engine.step()
    save_engine_state(s, engine, folder)
    torch.save({"weights": {k: v.clone() for k, v in engine.module.state_dict().items()}, **_adam(engine),
                "global_steps": engine.global_steps}, os.path.join(folder, f"ref{rank}.pt"))


def _load(rank: int, port: int, folder: str) -> None:
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    from rl_core.checkpoint import load_engine_state

    engine = _strategy(1, True).prepare(_model(), total_steps=10)
    load_engine_state(engine, folder)
    refs = [torch.load(os.path.join(folder, f"ref{r}.pt")) for r in (0, 1)]
    for k, v in engine.module.state_dict().items():
        assert torch.equal(v, refs[0]["weights"][k]), k
    mine = _adam(engine)
    assert engine.global_steps == refs[0]["global_steps"] == 2 and mine["step"] == refs[0]["step"] == 2
    n = sum(p.numel() for p in engine.module.parameters())
    for name in ("exp_avg", "exp_avg_sq"):
        two = torch.cat([refs[0][name], refs[1][name]])[:n]  # ZeRO-2: rank 0's half then rank 1's (+ padding)
        assert mine[name][:n].abs().sum() > 0 and torch.equal(mine[name][:n], two), name


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A ZeRO-2 state saved by two ranks (made once; each test works on its own copy)."""
    from rl_rollout.testing import run_ranks

    folder = tmp_path_factory.mktemp("universal") / "step"
    run_ranks(__file__, "_save", 2, str(folder))
    return folder


def test_a_two_rank_zero2_checkpoint_resumes_on_one_rank_through_the_universal_format(saved, tmp_path):
    import shutil

    from rl_rollout.testing import run_ranks

    folder = tmp_path / "step"
    shutil.copytree(saved, folder)
    run_ranks(__file__, "_load", 1, str(folder))
    assert (folder / "ds_universal" / "zero").is_dir()  # converted once, kept beside ds/


def _load_broken(rank: int, port: int, folder: str) -> None:
    """Two ranks resume a checkpoint rank 0 cannot convert: both raise its reason (rank 1 does not wait for it)."""
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    torch.set_num_threads(1)
    from rl_core.checkpoint import load_engine_state

    engine = _strategy(2, True).prepare(_model(), total_steps=10)
    try:
        load_engine_state(engine, folder)
    except RuntimeError as e:
        assert "ds_to_universal could not convert" in str(e), e
        assert str(e).startswith("rank 0: ") == (rank == 1), e
        print(f"rank {rank} raised: {e}")
    else:
        raise AssertionError("resumed from a checkpoint that could not be converted")


def test_a_conversion_that_fails_on_rank_0_fails_every_rank_with_its_reason(saved, tmp_path):
    import shutil

    from rl_rollout.testing import run_ranks

    folder = tmp_path / "step"
    shutil.copytree(saved, folder)
    for f in (folder / "ds").rglob("zero_pp_rank_1_*optim_states.pt"):
        f.unlink()  # a rank's optimizer part lost
    logs = run_ranks(__file__, "_load_broken", 2, str(folder), timeout=300)
    assert all("raised:" in log for log in logs), logs
    assert not (folder / "ds_universal").exists()


def test_universal_checkpoints_need_a_zero_optimizer():
    from rl_core.strategy import StrategyConfig

    with pytest.raises(ValueError, match=r"use_ds_universal_ckpt .*--zero_stage 1, 2 or 3"):
        StrategyConfig(zero_stage=0, use_ds_universal_ckpt=True)


def _slow_conversion(rank: int, port: int, folder: str) -> None:
    """Two gloo ranks whose collectives time out after 2 s; rank 0's conversion takes 5 s."""
    import datetime
    import time
    from pathlib import Path

    import torch.distributed as dist

    import rl_core.ds_universal as ckpt

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=2))

    def convert(path: Path, final: Path) -> None:
        time.sleep(5)
        final.mkdir()

    ckpt._convert_to_universal = convert
    assert ckpt.to_universal(Path(folder)) == Path(folder)
    assert (Path(folder) / ckpt.UNIVERSAL_TAG).is_dir()
    dist.barrier()  # the run's own group still works afterwards
    dist.destroy_process_group()
    print(f"rank {rank} waited through the conversion")


def test_ranks_wait_for_a_conversion_longer_than_the_collective_timeout(tmp_path):
    """A large model's conversion outlasts the run's collective timeout: the other ranks wait for rank 0 in a
    group of their own (before: rank 1's broadcast timed out after 2 s while rank 0 was still converting)."""
    from rl_rollout.testing import run_ranks

    logs = run_ranks(__file__, "_slow_conversion", 2, str(tmp_path), timeout=120)
    assert all("waited through the conversion" in log for log in logs)
