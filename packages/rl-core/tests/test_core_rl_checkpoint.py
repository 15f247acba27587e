"""RLCheckpoints' commit protocol with fake role groups (no models): what is read, kept and removed when."""

from __future__ import annotations

import json
import logging
import random
import re
import shutil
from pathlib import Path

import pytest
import torch

from rl_core.checkpoint import rng_state, rng_state_from_json, rng_state_json, set_rng_state
from rl_core.preflight import InputError
from rl_core.rl.checkpoint import LOOP_STATE, MARKER, RLCheckpoints, iter_dir


class FakeRole:
    """A worker group whose state is one number, saved to and loaded from its folder."""

    def __init__(self, value: int = 0):
        self.value, self.calls = value, []

    def call(self, method: str, path: str):
        self.calls.append((method, path))
        if method == "save_checkpoint":
            Path(path).mkdir(parents=True)
            (Path(path) / "state").write_text(str(self.value))
        else:
            self.value = int((Path(path) / "state").read_text())
        return [path]


def names(ck):
    return sorted(p.name for p in ck.iterdir())


def test_resume_reads_every_role_from_the_newest_committed_iteration(tmp_path, caplog):
    ck = tmp_path / "ck"
    roles = {"policy": FakeRole(1), "critic": FakeRole(1)}
    store = RLCheckpoints(ck, keep_last=2)
    store.save(1, roles, {"iteration": 1})
    roles["policy"].value = roles["critic"].value = 2

    def crash_between_roles(step, it):
        if step == "after:policy":
            raise KeyboardInterrupt

    store.crash_hook = crash_between_roles
    with pytest.raises(KeyboardInterrupt):  # a crash between the roles of iteration 2
        store.save(2, roles, {"iteration": 2})
    assert names(ck) == ["iter_00000001", "iter_00000002"] and not (ck / "iter_00000002" / MARKER).exists()

    fresh = {"policy": FakeRole(), "critic": FakeRole()}
    with caplog.at_level(logging.WARNING, logger="rl_core.rl.checkpoint"):
        state = RLCheckpoints(ck, keep_last=2).load(fresh)
    assert state == {"iteration": 1} and fresh["policy"].value == fresh["critic"].value == 1  # never a mix
    assert "removing" in caplog.text and "iter_00000002" in caplog.text
    assert names(ck) == ["iter_00000001"]


def test_old_iterations_go_only_after_the_new_marker_and_lose_their_marker_first(tmp_path, monkeypatch):
    ck = tmp_path / "ck"
    roles = {"policy": FakeRole()}
    store = RLCheckpoints(ck, keep_last=1)
    seen = []

    def hook(step, it):
        seen.append((step, it, names(ck)))

    store.crash_hook = hook
    store.save(1, roles, {})
    store.save(2, roles, {})
    assert names(ck) == ["iter_00000002"]
    # iteration 1 is still there, committed, when iteration 2's marker is written
    assert seen[-1] == ("after:commit", 2, ["iter_00000001", "iter_00000002"])
    assert [s for s, it, _ in seen if it == 2] == ["before:policy", "after:policy", "before:commit", "after:commit"]

    removed = []
    real = shutil.rmtree

    def rmtree(p, **kw):
        removed.append((p.name, (p / MARKER).exists()))
        real(p, **kw)

    monkeypatch.setattr(shutil, "rmtree", rmtree)
    store.save(3, roles, {})
    assert removed == [("iter_00000002", False)]  # unmarked before its files go


def test_errors_name_the_folder_and_the_fix(tmp_path):
    ck = tmp_path / "ck"
    RLCheckpoints(ck).save(3, {"policy": FakeRole(), "critic": FakeRole()}, {})
    with pytest.raises(ValueError, match=r"iter_00000003 holds the roles \['critic', 'policy'\], this run has "
                                         r"\['policy'\].*--ckpt_path at a new folder"):
        RLCheckpoints(ck).load({"policy": FakeRole()})
    (ck / "iter_00000003" / MARKER).write_text("{half")
    with pytest.raises(InputError, match=r"no checkpoint under .* can be resumed \(iter_00000003: its COMPLETE marker "
                                         r"does not read \(JSONDecodeError.*--ckpt_path at a new folder"):
        RLCheckpoints(ck).load({"policy": FakeRole(), "critic": FakeRole()})
    legacy = tmp_path / "old"
    (legacy / "policy" / "step_00000004").mkdir(parents=True)
    with pytest.raises(ValueError, match=r"per-role layout of rl-core 0.7 .*policy/step_\*.*--ckpt_path at a new"):
        RLCheckpoints(legacy).load({"policy": FakeRole()})
    with pytest.raises(ValueError, match=r"keep_last \(--max_ckpt_num\) must be >= 1, got 0"):
        RLCheckpoints(ck, keep_last=0)
    assert RLCheckpoints(tmp_path / "none").load({"policy": FakeRole()}) is None


def test_saving_an_iteration_again_replaces_it(tmp_path):
    ck = tmp_path / "ck"
    role = FakeRole(1)
    RLCheckpoints(ck).save(1, {"policy": role}, {"v": 1})
    role.value = 5
    RLCheckpoints(ck).save(1, {"policy": role}, {"v": 5})
    fresh = FakeRole()
    assert RLCheckpoints(ck).load({"policy": fresh}) == {"v": 5} and fresh.value == 5
    marker = json.loads((ck / "iter_00000001" / MARKER).read_text())
    assert {k: marker[k] for k in ("iteration", "roles")} == {"iteration": 1, "roles": ["policy"]}
    assert sorted(marker["files"]) == ["loop_state.json", "policy/state"]  # the marker is not in its own manifest
    assert marker["files"]["policy/state"][0] == 1 and len(marker["files"]["policy/state"][1]) == 64


def test_hf_exports_are_written_and_synced_before_the_marker_and_a_failed_one_commits_nothing(tmp_path):
    """--save_hf_ckpt: the exports go in after the roles' states; the marker only once every export returned."""
    ck = tmp_path / "ck"
    store, seen = RLCheckpoints(ck), []
    store.crash_hook = lambda step, it: seen.append((step, (iter_dir(ck, it) / MARKER).exists()))

    def export(path):
        Path(path).mkdir(parents=True)
        (Path(path) / "config.json").write_text("{}")

    store.save(1, {"policy": FakeRole()}, {}, {"hf": export, "hf/critic": export})
    assert [s for s, _ in seen] == ["before:policy", "after:policy", "before:export:hf", "after:export:hf",
                                    "before:export:hf/critic", "after:export:hf/critic", "before:commit",
                                    "after:commit"]
    assert not any(marked for s, marked in seen if s != "after:commit")
    assert (iter_dir(ck, 1) / "hf" / "critic" / "config.json").is_file()

    def broken(path):
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        store.save(2, {"policy": FakeRole()}, {}, {"hf": broken})
    assert not (iter_dir(ck, 2) / MARKER).exists()
    assert RLCheckpoints(ck).latest() == iter_dir(ck, 1)  # resume never sees iteration 2


def test_rng_state_round_trips_through_json():
    random.seed(3)
    torch.manual_seed(3)
    saved = json.loads(json.dumps(rng_state_json()))
    expected = (random.random(), torch.rand(3))
    random.seed(99)
    torch.manual_seed(99)
    set_rng_state(rng_state_from_json(saved))
    assert random.random() == expected[0] and torch.equal(torch.rand(3), expected[1])
    assert rng_state_json(rng_state()).keys() >= {"python", "torch"}


GiB = 1024 ** 3


@pytest.mark.parametrize("sizes, other, keep, gb, gone", [
    ([1, 1, 1, 1], 0, 3, None, 1),            # count only: beyond the newest 3
    ([2 * GiB, 2 * GiB, 2 * GiB], 0, 9, 3, 1),  # the older ones hold 4 GiB > 3: the oldest goes, 2 GiB left
    ([2 * GiB, GiB, GiB, 5 * GiB], 0, 9, 2, 1),  # the newest (5 GiB) is not counted, as OpenRLHF's pre-save prune
    ([5 * GiB, 5 * GiB], 0, 9, 1, 1),         # over budget down to the newest alone, never the newest
    ([5 * GiB], 9 * GiB, 9, 1, 0),            # the only checkpoint stays whatever else the folder holds
    ([GiB, GiB, GiB], 2 * GiB, 9, 3, 1),      # a best checkpoint (other) counts but is not removed
    ([GiB, GiB, GiB, GiB], 0, 2, 0.5, 3),     # the count first, then the budget
])
def test_prune_count_keeps_the_newest_within_count_and_budget(sizes, other, keep, gb, gone):
    from rl_core.checkpoint import prune_count

    assert prune_count(sizes, other, keep, gb) == gone


def test_a_disk_budget_removes_the_oldest_but_never_the_newest(tmp_path):
    ck = tmp_path / "ck"
    store = RLCheckpoints(ck, keep_last=9, max_gb=2500 / GiB)  # 2500 bytes: two 1000-byte roles + one more
    for it in range(1, 5):
        store.save(it, {"policy": FakeRole()}, {"pad": "x" * 990})
    # each folder ~1000 bytes of loop state; without the newest at most 2500 bytes: two older ones stay
    assert names(ck) == ["iter_00000002", "iter_00000003", "iter_00000004"]
    RLCheckpoints(ck, keep_last=9, max_gb=1 / GiB).save(5, {"policy": FakeRole()}, {"pad": "x" * 990})
    assert names(ck) == ["iter_00000005"]
    with pytest.raises(ValueError, match=r"max_ckpt_mem \(--max_ckpt_mem\) .* > 0, got 0"):
        RLCheckpoints(ck, max_gb=0)


def test_the_best_checkpoint_replaces_the_previous_best_and_is_never_pruned_or_resumed(tmp_path):
    ck = tmp_path / "ck"
    store = RLCheckpoints(ck, keep_last=1)
    role = FakeRole(1)
    store.save(1, {"policy": role}, {"v": 1}, best=True)
    role.value = 2
    store.save(2, {"policy": role}, {"v": 2})
    store.save(3, {"policy": role}, {"v": 3}, best=True)
    store.save(4, {"policy": role}, {"v": 4})
    assert names(ck) == ["best_iter_00000003", "iter_00000004"]
    assert (ck / "best_iter_00000003" / MARKER).is_file()
    assert RLCheckpoints(ck).load({"policy": FakeRole()}) == {"v": 4}


def test_a_checkpoint_without_deepspeed_state_is_refused_at_resume_naming_its_export(tmp_path):
    ck = tmp_path / "ck"
    RLCheckpoints(ck).save(2, {}, {"v": 2}, {"hf": lambda p: Path(p).mkdir(parents=True)})
    with pytest.raises(ValueError, match=r"iter_00000002 was written with --disable_ds_ckpt: .* no DeepSpeed "
                                         r"state .*--pretrain .*iter_00000002/hf"):
        RLCheckpoints(ck).load({"policy": FakeRole()})


def test_best_metric_key_names_a_logged_eval_metric():
    from rl_core.trainers.ppo_eval import best_metric_name

    assert best_metric_name("", 4) == "eval/reward_mean"  # OpenRLHF's auto choice: its pass1
    assert best_metric_name("none", 4) is None
    assert best_metric_name("eval/pass@4", 4) == best_metric_name("pass@4", 4) == "eval/pass@4"
    assert best_metric_name("eval_default_pass1", 4) == "eval/reward_mean"
    assert best_metric_name("eval_math_pass4", 4) == "eval/pass@4"
    with pytest.raises(ValueError, match=r"--best_metric_key 'pass@8': the eval pass logs eval/reward_mean, "
                                         r"eval/pass@1, eval/pass@4, eval/maj@1, .*pick one of them, or none"):
        best_metric_name("pass@8", 4)
    # rl eval's metrics (rl_rollout.evaluation) for the k of --eval_pass_k: maj@k, the share correct, the version
    assert best_metric_name("maj@2", 4, (1, 2)) == "eval/maj@2" and best_metric_name("correct", 4) == "eval/correct"
    assert best_metric_name("eval_math_pass2", 4, (2,)) == "eval/pass@2"
    with pytest.raises(ValueError, match=r"--eval_pass_k 1,2\); pick"):
        best_metric_name("pass@4", 4, (1, 2))
    from rl_core.configs import EvalConfig

    assert EvalConfig(pass_k="2,1").ks == (1, 2) and EvalConfig(n_samples_per_prompt=1).ks == (1,)
    with pytest.raises(ValueError, match=r"--eval_pass_k 5: k must be in 1..4"):
        EvalConfig(pass_k="5")
    with pytest.raises(ValueError, match=r"eval_correct_threshold .* finite"):
        EvalConfig(correct_threshold=float("nan"))


@pytest.mark.parametrize("damage, why", [
    (lambda d: (d / "policy" / "state").write_text(""), r"policy/state is 0 bytes, 1 when saved"),
    (lambda d: (d / "critic" / "state").unlink(), r"critic/state is missing"),
    (lambda d: (d / "policy" / "state").write_text("7"), r"policy/state has other contents than when saved"),
    (lambda d: (d / LOOP_STATE).write_text((d / LOOP_STATE).read_text()[:-1] + " "),
     r"loop_state.json has other contents"),
    (lambda d: (d / MARKER).write_text('{"iteration": 2'), r"its COMPLETE marker does not read"),
])
def test_resume_falls_back_past_a_damaged_newest_checkpoint_and_says_what_was_wrong(tmp_path, caplog, damage, why):
    """Issue 40 finding 2: a truncated model file, a deleted optimizer file, a damaged loop state, each a traceback
    after the model loaded with the complete iteration before it ignored. Now each is found from the files alone
    (the manifest in the marker), named in one warning, and resume takes the previous complete one."""
    ck = tmp_path / "ck"
    roles = {"policy": FakeRole(1), "critic": FakeRole(1)}
    store = RLCheckpoints(ck, keep_last=3)
    store.save(1, roles, {"iteration": 1})
    roles["policy"].value = roles["critic"].value = 2
    store.save(2, roles, {"iteration": 2})
    damage(iter_dir(ck, 2))
    fresh = {"policy": FakeRole(), "critic": FakeRole()}
    with caplog.at_level(logging.WARNING, logger="rl_core.rl.checkpoint"):
        state = RLCheckpoints(ck, keep_last=3).load(fresh)
    assert state == {"iteration": 1} and fresh["policy"].value == fresh["critic"].value == 1
    assert re.search(r"iter_00000002 cannot be resumed: " + why, caplog.text), caplog.text
    assert fresh["policy"].calls == [("load_checkpoint", str(iter_dir(ck, 1) / "policy"))]  # iteration 2 never read


def test_resume_refuses_in_one_line_when_no_checkpoint_verifies_and_old_markers_still_resume(tmp_path):
    ck = tmp_path / "ck"
    store = RLCheckpoints(ck, keep_last=3)
    for it in (1, 2):
        store.save(it, {"policy": FakeRole(it)}, {"iteration": it})
        (iter_dir(ck, it) / "policy" / "state").write_text("")
    with pytest.raises(InputError) as e:
        RLCheckpoints(ck).load({"policy": FakeRole()})
    assert "\n" not in str(e.value) and re.search(r"iter_00000002: policy/state is 0 bytes, 1 when saved; "
                                                  r"iter_00000001: policy/state is 0 bytes", str(e.value))
    # a marker written before manifests (rl-core < 0.19): checked for what it can be, then resumed
    old = tmp_path / "old"
    RLCheckpoints(old).save(4, {"policy": FakeRole(4)}, {"iteration": 4})
    marker = iter_dir(old, 4) / MARKER
    marker.write_text(json.dumps({"iteration": 4, "roles": ["policy"]}))
    fresh = FakeRole()
    assert RLCheckpoints(old).load({"policy": fresh}) == {"iteration": 4} and fresh.value == 4


@pytest.fixture
def small_disk(tmp_path):
    """A 1 MiB file system (tmpfs) to fill: a real full disk, where this machine lets the tests mount one."""
    import subprocess

    d = tmp_path / "small"
    d.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(d)], capture_output=True, text=True)
    if r.returncode:
        pytest.skip(f"a full disk needs a small tmpfs and this machine cannot mount one ({r.stderr.strip()})")
    yield d
    subprocess.run(["umount", "-l", str(d)], check=False)


class TorchSaveRole(FakeRole):
    """Saves through torch's zip writer, as DeepSpeed does: 2 MiB that a 1 MiB disk cannot take."""

    def call(self, method: str, path: str):
        Path(path).mkdir(parents=True)
        torch.save({"w": torch.zeros(512 * 1024)}, Path(path) / "model_states.pt")
        return [path]


def test_a_full_disk_during_a_checkpoint_is_one_line_naming_the_folder_and_the_bytes(small_disk):
    """issue 40 finding 4: a full disk ended in `RuntimeError: basic_ios::clear: iostream error` (no "no space
    left", no path). Now: one InputError naming the folder, the free bytes and the size of the last checkpoint;
    the half-written folder is removed (its space back), the checkpoints before it stay and resume from them."""
    store = RLCheckpoints(small_disk / "ck", keep_last=3)
    store.save(1, {"policy": FakeRole(1)}, {"iteration": 1})
    with pytest.raises(InputError) as e:
        store.save(2, {"policy": TorchSaveRole()}, {"iteration": 2})
    text = str(e.value)
    assert "\n" not in text and re.search(rf"the checkpoint of iteration 2 into {small_disk}/ck/iter_00000002 failed: "
                                         r"the disk is full \([\d,]+ bytes free, about [\d,]+ needed\); the half-written "
                                         r"folder was removed .*point --ckpt_path at another disk", text), text
    assert not iter_dir(small_disk / "ck", 2).exists()
    fresh = FakeRole()
    assert RLCheckpoints(small_disk / "ck").load({"policy": fresh}) == {"iteration": 1} and fresh.value == 1
