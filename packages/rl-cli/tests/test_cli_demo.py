"""``rl demo``: the README's main command trains a tiny model with GRPO and the reward rises."""

from __future__ import annotations

import json

import pytest

from rl_cli.main import main

pytestmark = [pytest.mark.timeout(900), pytest.mark.slow]


def test_demo_reward_rises_and_the_run_is_written(tmp_path, capsys):
    # 3e-3 (the default is 1e-3, for the last iterations' reward): the rise shows within 10 iterations
    assert main(["demo", "--workdir", str(tmp_path), "--iterations", "10", "--learning_rate", "3e-3"]) == 0
    out = capsys.readouterr().out
    assert "[rl demo] reward" in out and "curves:" in out
    summary = json.loads((tmp_path / "summary.json").read_text())
    r = summary["rewards"]
    assert len(r) == 10
    first, last = sum(r[:3]) / 3, sum(r[-3:]) / 3
    assert last > first + 0.04, r  # measured: 0.071 -> 0.157
    assert (tmp_path / "run" / "curves.png").stat().st_size > 1000
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in rows] == list(range(1, 11))
    assert (tmp_path / "final" / "config.json").is_file()


def test_demo_refuses_enforce_eager_without_vllm(tmp_path, capsys):
    """A flag is used or refused: the HF engine compiles nothing, so --enforce_eager with it is an error."""
    with pytest.raises(SystemExit) as e:
        main(["demo", "--workdir", str(tmp_path), "--enforce_eager"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "--enforce_eager" in err and "--rollout_engine vllm" in err, err
    assert not (tmp_path / "run").exists()
