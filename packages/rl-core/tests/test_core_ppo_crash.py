"""kill -9 at every step of an RL checkpoint, then resume: the run lands on the uninterrupted one.

Each run is a subprocess (``ppo_crash_child.py``: PPO with a critic and a reference, adaptive KL,
an HFEngine, ZeRO-2 on CPU, a checkpoint every iteration) that SIGKILLs itself at one step of
a save. A chain of such runs, each resuming the last, goes through every kill point, one per
iteration; the final run finishes. Its metrics (the last row of each iteration in
metrics.jsonl: a resumed run logs again the iterations it replays) and its exported policy
and critic weights must equal those of a run that was never interrupted (and never saved).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.timeout(900), pytest.mark.slow]

CHILD = Path(__file__).with_name("ppo_crash_child.py")
ITERATIONS = 6
TIMINGS = ("_s", "sync_gb_per_s")  # wall-clock metrics: the only ones that may differ


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    from rl_rollout.testing import make_tiny_model

    root = tmp_path_factory.mktemp("ppo-crash")
    model = make_tiny_model(root / "tiny")
    (root / "prompts.jsonl").write_text(
        "".join(json.dumps({"p": f"Repeat the letter {c}: ", "y": c}) + "\n" for c in "abcd"))
    return root, model


def child(task, name: str, *, ck: str | None, keep: int = 2, load: bool = False, kill: str | None = None):
    root, model = task
    spec = {"model": str(model), "prompts": str(root / "prompts.jsonl"), "ckpt_path": ck and str(root / ck),
            "run_dir": str(root / name / "run"), "save_path": str(root / name / "out"), "max_iterations": ITERATIONS,
            "max_ckpt_num": keep, "load_checkpoint": load, "kill": kill}
    path = root / f"{name}-{kill or 'end'}.json"
    path.write_text(json.dumps(spec))
    dist = {"RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
            "PYTHONDONTWRITEBYTECODE"}  # a fresh process's settings; bytecode cached across the chain's runs
    env = {k: v for k, v in os.environ.items() if k not in dist}
    env["TQDM_DISABLE"] = "1"  # bytecode: the run's prefix (.ci/run sets one), else one of our own
    env.setdefault("PYTHONPYCACHEPREFIX", os.path.join(tempfile.gettempdir(), "rl-test-pycache"))
    out = subprocess.run([sys.executable, str(CHILD), str(path)], capture_output=True, text=True, timeout=600, env=env)
    log = out.stdout[-4000:] + out.stderr[-8000:]
    if kill:
        assert out.returncode == -9, f"expected a SIGKILL at {kill}, got exit {out.returncode}:\n{log}"
    else:
        assert out.returncode == 0 and "finished" in out.stdout, log
    return out


def on_disk(ck: Path) -> tuple[list[int], list[int]]:
    """(committed iterations, folders without the marker)."""
    done, partial = [], []
    for d in sorted(ck.glob("iter_*")):
        (done if (d / "COMPLETE").is_file() else partial).append(int(d.name[5:]))
    return done, partial


def last_rows(run: Path) -> dict[int, dict]:
    rows = {}
    for line in (run / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        rows[row["step"]] = {k: v for k, v in row.items() if not k.endswith(TIMINGS)}
    return rows


def weights(out: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    found = {}
    for f in sorted(out.rglob("*.safetensors")):
        found.update({f"{f.relative_to(out)}:{k}": v for k, v in load_file(f).items()})
    return found


def same_run(task, name: str, reference: str) -> None:
    root, _ = task
    ours, ref = last_rows(root / name / "run"), last_rows(root / reference / "run")
    assert sorted(ours) == list(range(1, ITERATIONS + 1))
    for it in ref:
        assert ours[it] == ref[it], (it, {k: (ours[it].get(k), v) for k, v in ref[it].items() if ours[it].get(k) != v})
    w, w_ref = weights(root / name / "out"), weights(root / reference / "out")
    assert sorted(w) == sorted(w_ref) and any(k.startswith("critic/") for k in w)
    for k, v in w_ref.items():
        assert torch.equal(w[k], v), (k, (w[k] - v).abs().max().item())


@pytest.fixture(scope="module")
def reference(task):
    child(task, "uninterrupted", ck=None)
    return "uninterrupted"


def test_kills_inside_between_and_after_role_saves_resume_onto_the_uninterrupted_run(task, reference):
    root, _ = task
    ck = root / "ck-keep2"
    run = dict(ck="ck-keep2", keep=2)

    child(task, "chain", **run, kill="inside:policy@2")  # the policy's optimizer states half-written
    assert on_disk(ck) == ([1], [2])
    assert not (ck / "iter_00000002" / "critic").exists()

    out = child(task, "chain", **run, load=True, kill="after:policy@3")  # between the roles
    assert "iter_00000002: it has no COMPLETE marker" in out.stderr  # the half save: removed, said, never read
    assert "resumed from " + str(ck / "iter_00000001") in out.stderr
    assert on_disk(ck) == ([1, 2], [3])

    out = child(task, "chain", **run, load=True, kill="before:commit@4")  # every part written but the marker
    assert "resumed from " + str(ck / "iter_00000002") in out.stderr
    assert on_disk(ck) == ([2, 3], [4])
    assert sorted(p.name for p in (ck / "iter_00000004").iterdir()) == ["critic", "loop_state.json", "policy"]

    out = child(task, "chain", **run, load=True, kill="after:commit@5")  # committed, the old ones not yet pruned
    assert "resumed from " + str(ck / "iter_00000003") in out.stderr
    assert on_disk(ck) == ([3, 4, 5], [])

    out = child(task, "chain", **run, load=True)
    assert "resumed from " + str(ck / "iter_00000005") in out.stderr
    assert on_disk(ck) == ([5, 6], [])
    same_run(task, "chain", reference)


def test_with_max_ckpt_num_1_a_kill_between_roles_keeps_the_last_committed_iteration(task, reference):
    """The case that lost four iterations and mixed the critic's state before: one checkpoint kept."""
    root, _ = task
    ck = root / "ck-keep1"
    run = dict(ck="ck-keep1", keep=1)

    child(task, "keep1", **run, kill="after:policy@2")
    assert on_disk(ck) == ([1], [2])  # iteration 1 stays until 2 is committed

    out = child(task, "keep1", **run, load=True)  # (a kill after a commit: the keep-2 chain above)
    assert "resumed from " + str(ck / "iter_00000001") in out.stderr
    assert on_disk(ck) == ([6], [])
    same_run(task, "keep1", reference)
