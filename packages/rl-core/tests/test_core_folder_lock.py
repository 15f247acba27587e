"""A run owns its folders (rl_core.folder_lock): a second process given a folder a live run holds is refused at
once naming the holder; a holder that died leaves a lock the next run takes over with a warning; one process
may take a folder's lock more than once (rl-cli, then the trainer); an ended run leaves no holder behind."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from rl_core.folder_lock import LOCK_NAME, FolderInsideReplaced, FolderInUse, hold

HOLDER = textwrap.dedent("""
    import sys, time
    from rl_core.folder_lock import hold
    locks = hold({"--ckpt_path": sys.argv[1]})
    print("held", flush=True)
    time.sleep(600)
""")


def start_holder(folder):
    p = subprocess.Popen([sys.executable, "-c", HOLDER, str(folder)], stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "held"
    return p


def test_a_live_holder_refuses_a_second_run_at_once_naming_it(tmp_path):
    p = start_holder(tmp_path / "ck")
    try:
        t0 = time.monotonic()
        with pytest.raises(FolderInUse, match=rf"--ckpt_path .*ck is in use by another run \(host .*, pid {p.pid}, "
                                              r"since .*\): wait for it to end, stop it, or give this run another"):
            hold({"--run_dir": str(tmp_path / "run"), "--ckpt_path": str(tmp_path / "ck")})
        assert time.monotonic() - t0 < 1.0
        hold({"--run_dir": str(tmp_path / "run")}).release()  # the refusal gave back the lock it had taken
    finally:
        p.kill()
        p.wait()


def test_a_dead_holders_lock_is_taken_over_with_a_warning(tmp_path, caplog):
    p = start_holder(tmp_path / "ck")
    p.send_signal(signal.SIGKILL)  # kill -9: nothing released, the holder's line stays in the file
    p.wait()
    assert f"pid {p.pid}" in (tmp_path / "ck" / LOCK_NAME).read_text()
    with caplog.at_level(logging.WARNING, logger="rl_core.folder_lock"):
        locks = hold({"--ckpt_path": str(tmp_path / "ck")})
    assert f"taking over the lock of a run whose process is gone (host" in caplog.text
    assert f"pid {p.pid}" in caplog.text
    assert f"pid {os.getpid()}" in (tmp_path / "ck" / LOCK_NAME).read_text()
    locks.release()
    assert (tmp_path / "ck" / LOCK_NAME).read_text() == ""  # an ended run leaves no holder behind


def test_one_process_shares_its_own_locks_and_releases_on_the_last(tmp_path):
    first = hold({"--run_dir": str(tmp_path / "x"), "--ckpt_path": str(tmp_path / "x")})  # one folder, one lock
    second = hold({"--ckpt_path": str(tmp_path / "x")})
    first.release()
    probe = [sys.executable, "-c", "import sys; from rl_core.folder_lock import hold; hold({'--x': sys.argv[1]})",
             str(tmp_path / "x")]
    still = subprocess.run(probe, capture_output=True, text=True)
    assert still.returncode != 0 and "FolderInUse" in still.stderr  # the second holder still has it
    second.release()
    assert subprocess.run(probe, capture_output=True, text=True).returncode == 0


def test_a_run_that_wrote_nothing_leaves_no_folder_and_one_that_wrote_keeps_its_files(tmp_path):
    hold({"--run_dir": str(tmp_path / "empty")}).release()
    assert not (tmp_path / "empty").exists()  # stopped before it wrote anything: as if it never started
    locks = hold({"--run_dir": str(tmp_path / "used")})
    (tmp_path / "used" / "metrics.jsonl").write_text("{}\n")
    locks.release()
    assert sorted(p.name for p in (tmp_path / "used").iterdir()) == [LOCK_NAME, "metrics.jsonl"]


def test_a_folder_the_run_replaces_whole_is_locked_beside_it_and_survives_the_rename(tmp_path):
    """--save_path: the HF export writes a temp folder and renames it over save_path, which would take a lock
    file inside it away; its lock sits beside it (PARENT/.NAME.rl.lock), so a second run is refused across the
    rename, and the folder itself holds no lock file."""
    out = tmp_path / "out"
    locks = hold({}, {"--save_path": str(out)})
    tmp = tmp_path / ".tmp-out"
    tmp.mkdir()
    (tmp / "config.json").write_text("{}")
    tmp.rename(out)  # what rl_core.hf_export does
    code = ("import sys\nfrom rl_core.folder_lock import hold, FolderInUse\n"
            "try:\n    hold({}, {'--save_path': sys.argv[1]})\nexcept FolderInUse as e:\n    print(e)")
    said = subprocess.run([sys.executable, "-c", code, str(out)], capture_output=True, text=True).stdout
    assert f"--save_path {out} is in use by another run" in said and f"pid {os.getpid()}" in said, said
    assert sorted(p.name for p in out.iterdir()) == ["config.json"]
    assert (tmp_path / f".out{LOCK_NAME}").is_file()
    locks.release()
    said = subprocess.run([sys.executable, "-c", code, str(out)], capture_output=True, text=True).stdout
    assert said == "", said  # released: the next run takes it


def test_a_folder_inside_the_one_the_export_replaces_is_refused_before_any_lock(tmp_path):
    """The export renames its temp folder over --save_path, deleting what was in it: a --run_dir or --ckpt_path
    there (or the same folder) would lose the run's metrics and checkpoints, and its lock's folder with them."""
    out = tmp_path / "out"
    for folder in (out / "run", out):
        with pytest.raises(FolderInsideReplaced) as e:
            hold({"--ckpt_path": str(tmp_path / "ck"), "--run_dir": str(folder)}, {"--save_path": str(out)})
        assert str(e.value) == (f"--run_dir {folder} lies inside --save_path {out}, which the final export replaces "
                                "whole (deleting what is in it): give --run_dir a folder outside it, e.g. beside it")
        assert not (tmp_path / "ck").exists() and not out.exists()  # refused before the first lock
    with hold({"--run_dir": str(tmp_path / "run"), "--ckpt_path": str(tmp_path / "out-ck")}, {"--save_path": str(out)}):
        assert (tmp_path / "run" / LOCK_NAME).is_file()  # beside it, and a name that only starts alike: taken


def test_a_lock_whose_folder_was_removed_under_it_releases_quietly(tmp_path):
    locks = hold({"--run_dir": str(tmp_path / "gone")})
    (tmp_path / "gone" / LOCK_NAME).unlink()
    (tmp_path / "gone").rmdir()
    locks.release()  # raised FileNotFoundError before (listing the removed folder)
    assert not (tmp_path / "gone").exists()


def test_a_save_path_holding_other_files_is_refused_before_any_lock_and_nothing_is_deleted(tmp_path):
    """The export replaces --save_path whole: a folder holding a user's other files (not an earlier export, which
    has a config.json) is refused before the run starts, naming a few of them; new, empty and export folders pass."""
    mine = tmp_path / "mine"
    mine.mkdir()
    for name in ("data.jsonl", "notes.txt", "a", "b", "c"):
        (mine / name).write_text("keep me")
    with pytest.raises(FolderInsideReplaced) as e:
        hold({"--run_dir": str(tmp_path / "run")}, {"--save_path": str(mine)})
    assert str(e.value) == (f"--save_path {mine} holds files that are not a model export (a, b, c, data.jsonl and 1 "
                            "more); the final export replaces the folder whole, deleting them: give --save_path a new "
                            "or empty folder, or an earlier export's")
    assert sorted(p.name for p in mine.iterdir()) == ["a", "b", "c", "data.jsonl", "notes.txt"]
    assert not (tmp_path / "run").exists()  # refused before the first lock
    (tmp_path / "file").write_text("x")
    with pytest.raises(FolderInsideReplaced, match="is a file"):
        hold({}, {"--save_path": str(tmp_path / "file")})
    export = tmp_path / "export"
    export.mkdir()
    (export / "config.json").write_text("{}")
    (tmp_path / "empty").mkdir()
    for ok in (export, tmp_path / "empty", tmp_path / "new"):
        hold({}, {"--save_path": str(ok)}).release()
