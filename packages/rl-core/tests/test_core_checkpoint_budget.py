"""The offline trainers' CheckpointManager under --max_ckpt_num and --max_ckpt_mem, with a fake engine (no
model): which step_N folders stay. The budget arithmetic itself: test_core_rl_checkpoint.py (prune_count)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from rl_core.checkpoint import MARKER, CheckpointManager


class OneRank:
    def is_rank_0(self):
        return True

    def barrier(self):
        pass


class FakeEngine:
    """Writes ``size`` bytes per save, as DeepSpeed's save_checkpoint would write its state files."""

    module = torch.nn.Linear(1, 1)

    def __init__(self, size: int):
        self.size = size

    def save_checkpoint(self, path, tag, client_state, exclude_frozen_parameters):
        (Path(path) / tag).mkdir(parents=True)
        (Path(path) / tag / "state.pt").write_bytes(b"x" * self.size)


def test_a_disk_budget_keeps_the_newest_steps_that_fit_and_always_the_newest(tmp_path):
    root = tmp_path / "ck"
    budget_gb = 2500 / 1024 ** 3  # two 1000-byte checkpoints (with their markers) besides the newest
    ck = CheckpointManager(root, OneRank(), keep_last=9, max_gb=budget_gb)
    for step in (1, 2, 3, 4):
        ck.save(FakeEngine(1000), step, {"epoch": 0})
    assert [d.name for d in ck.complete()] == ["step_00000002", "step_00000003", "step_00000004"]
    CheckpointManager(root, OneRank(), keep_last=2, max_gb=budget_gb).save(FakeEngine(5000), 5, {})
    assert [d.name for d in ck.complete()] == ["step_00000004", "step_00000005"]  # count 2; 4 fits the budget
    CheckpointManager(root, OneRank(), keep_last=9, max_gb=1e-9).save(FakeEngine(10), 6, {})
    assert sorted(p.name for p in root.iterdir()) == ["step_00000006"] and (root / "step_00000006" / MARKER).is_file()
    with pytest.raises(ValueError, match=r"max_ckpt_mem \(--max_ckpt_mem\) is a budget in GB and must be > 0"):
        CheckpointManager(root, OneRank(), max_gb=-1)


@pytest.mark.parametrize("config", ["TrainerConfig", "PPOConfig"])
def test_an_infinite_disk_budget_is_no_budget_and_other_non_positive_ones_fail(config):
    """OpenRLHF's train_ppo_ray defaults --ckpt.max_mem to inf: accepted as no budget, in every trainer's config
    (one CheckpointConfig node, shared)."""
    from rl_core.trainers.base import TrainerConfig
    from rl_core.trainers.ppo_config import PPOConfig

    cls = {"TrainerConfig": TrainerConfig, "PPOConfig": PPOConfig}[config]
    assert cls.from_flat(max_ckpt_mem=float("inf")).ckpt.max_ckpt_mem is None
    assert cls.from_flat(max_ckpt_mem=2.5).ckpt.max_ckpt_mem == 2.5
    for bad, says in ((0.0, "must be > 0"), (-1.0, "must be > 0"), (float("nan"), "finite")):
        with pytest.raises(ValueError, match=says):
            cls.from_flat(max_ckpt_mem=bad)
