"""A user's mistake stops a command before any model loads, in one line naming the value and the fix (exit code
2, no traceback; ``--debug`` shows it); a failure names the party that failed (an engine killed before a weight
sync is named as the engine); ``rl ppo-ray`` starts its own Ray even when a stale cluster address is on disk.

The subprocess runs bound their time generously: most of it is importing torch and DeepSpeed on a shared
2-core machine; the point is that no model loads (no "Loading weights" line, no run folder)."""

from __future__ import annotations

import http.server
import json
import os
import re
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

from rl_cli.main import main

pytestmark = [pytest.mark.timeout(900), pytest.mark.slow]
REWARD = "def letter(prompt, response, label, **info):\n    return min(response.count(label), 8) / 8\n"
BOUND_S = 90  # generous: a model load plus a first iteration takes longer, and the import alone ~5-25 s here


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    from rl_rollout.testing import make_tiny_model

    root = tmp_path_factory.mktemp("preflight")
    model = make_tiny_model(root / "tiny")
    (root / "prompts.jsonl").write_text(
        "".join(json.dumps({"prompt": f"Repeat the letter {c}: ", "label": c}) + "\n" for c in "abcd"))
    (root / "sft.jsonl").write_text("".join(json.dumps({"input": f"q{c}", "output": f"a{c}"}) + "\n" for c in "abcd"))
    (root / "reward.py").write_text(REWARD)
    (root / "no_info.py").write_text("def score(prompt, response, label):\n    return 1.0\n")
    (root / "notmodel").mkdir()
    (root / "notmodel" / "notes.txt").write_text("not a model")
    (root / "noweights").mkdir()
    (root / "notok").mkdir()
    for f in model.iterdir():
        if f.name == "config.json" or f.name.startswith("tokenizer"):
            (root / "noweights" / f.name).write_bytes(f.read_bytes())
        if f.name in ("config.json", "model.safetensors"):
            (root / "notok" / f.name).write_bytes(f.read_bytes())
    return root, model


def ppo_argv(root, model, *extra, run="run"):
    return ["--pretrain", str(model), "--prompt_data", str(root / "prompts.jsonl"), "--input_key", "prompt",
            "--label_key", "label", "--reward_fn", f"{root / 'reward.py'}:letter", "--advantage_estimator",
            "group_norm", "--init_kl_coef", "0", "--n_samples_per_prompt", "4", "--rollout_batch_size", "4",
            "--train_batch_size", "16", "--generate_max_len", "8", "--max_iterations", "1", "--bf16", "false",
            "--run_dir", str(root / run), *extra]


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # nothing listens once the socket closes


def own_env() -> dict:
    """This process's environment less torch.distributed's settings: a run in a subprocess starts its own group
    (an earlier in-process test's MASTER_PORT is still held by this process's store)."""
    dist = {"RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"}
    return {k: v for k, v in os.environ.items() if k not in dist}


def rl(*argv, env=None, timeout=300):
    t0 = time.monotonic()
    out = subprocess.run([sys.executable, "-m", "rl_cli.main", *argv], capture_output=True, text=True,
                         timeout=timeout, env=own_env() if env is None else env)
    return out, time.monotonic() - t0


@pytest.mark.parametrize("case", ["pretrain_missing", "not_a_model", "learning_rate", "dead_reward_server",
                                  "batch_arithmetic"])
def test_a_bad_input_stops_rl_ppo_in_one_line_before_any_model_loads(task, case):
    root, model = task
    port = closed_port()
    argv, expected = {
        "pretrain_missing": (["--pretrain", "/nonexistent"], r"--pretrain /nonexistent: no such folder"),
        "not_a_model": (["--pretrain", str(root / "notmodel")], r"notmodel is not a transformers model folder: "
                                                                  r"no config.json \(it holds notes.txt\)"),
        "learning_rate": (["--learning_rate", "-0.001"], r"learning_rate \(--learning_rate\) must be >= 0, got -0.001"),
        "dead_reward_server": (["--reward_fn", "", "--remote_rm_url", f"http://127.0.0.1:{port}/score"],
                               rf"reward server http://127.0.0.1:{port}/score does not answer .*start it"),
        "batch_arithmetic": (["--train_batch_size", "7"], r"= 16 samples per iteration is not a multiple of "
                                                           r"--train_batch_size 7; use --train_batch_size 4"),
    }[case]
    out, seconds = rl("ppo", *ppo_argv(root, model, *argv, run=case))
    assert out.returncode == 2, out.stdout[-2000:] + out.stderr[-2000:]
    assert re.search(expected, out.stderr), out.stderr[-3000:]
    assert "Traceback" not in out.stderr, out.stderr[-3000:]
    assert "Loading weights" not in out.stderr and not (root / case).exists()  # no model loaded, nothing ran
    assert seconds < BOUND_S, seconds
    last = [line for line in out.stderr.splitlines() if line.strip()][-1]
    assert last.startswith("rl ppo: ") and re.search(expected, last), last  # the message is the one last line


def test_debug_shows_the_traceback_of_a_user_mistake(task):
    root, model = task
    out, _ = rl("ppo", *ppo_argv(root, model, "--pretrain", str(root / "noweights"), "--debug", run="debug"))
    assert out.returncode != 0
    assert "Traceback" in out.stderr and "rl_core.preflight.InputError" in out.stderr, out.stderr[-3000:]
    assert "has a config.json but no weights" in out.stderr


@pytest.mark.parametrize("case", ["no_weights", "no_tokenizer", "reward_file_missing", "reward_fn_missing",
                                  "reward_signature", "too_few_prompts", "openrlhf_file_missing",
                                  "reward_model_without_head"])
def test_more_bad_inputs_fail_with_exit_code_2_naming_the_value(task, case, capsys):
    """In process (one import for all): the same guard as the subprocess runs above."""
    root, model = task
    argv, expected = {
        "no_weights": (["--pretrain", str(root / "noweights")], r"has a config.json but no weights"),
        "no_tokenizer": (["--pretrain", str(root / "notok")], r"notok has no tokenizer"),
        "reward_file_missing": (["--reward_fn", f"{root / 'missing.py'}:f"], r"missing.py' does not exist"),
        "reward_fn_missing": (["--reward_fn", f"{root / 'reward.py'}:nope"], r"defines no 'nope'.*\['letter'\]"),
        "reward_signature": (["--reward_fn", f"{root / 'no_info.py'}:score"], r"without \*\*info"),
        "too_few_prompts": (["--rollout_batch_size", "8", "--train_batch_size", "32"],
                            r"4 prompts, fewer than --rollout_batch_size 8"),
        "openrlhf_file_missing": (["--reward_fn", "", "--remote_rm_url", str(root / "reward.py")],
                                  r"defines no function reward_func"),
        "reward_model_without_head": (["--reward_fn", "", "--reward_pretrain", str(model)],
                                      r"--reward_pretrain .* holds no reward head: no rl_head.json .* and no "
                                      r"score.weight"),
    }[case]
    t0 = time.monotonic()
    with pytest.raises(SystemExit) as exit_:
        main(["ppo", *ppo_argv(root, model, *argv, run=case)])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert re.search(rf"^rl ppo: .*{expected}", err, re.M), err[-3000:]
    assert not (root / case).exists() and time.monotonic() - t0 < BOUND_S


def test_rl_sft_refuses_a_dataset_smaller_than_one_batch_before_the_model_loads(task):
    root, model = task
    out, seconds = rl("sft", "--pretrain", str(model), "--dataset", str(root / "sft.jsonl"), "--input_key", "input",
                      "--output_key", "output", "--train_batch_size", "8", "--bf16", "false", "--save_path",
                      str(root / "sft-out"))
    assert out.returncode == 2, out.stderr[-3000:]
    assert "rl sft: the dataset" in out.stderr and "has 4 usable rows, fewer than one global batch " \
           "(--train_batch_size 8); lower --train_batch_size to at most 4" in out.stderr, out.stderr[-3000:]
    assert "Traceback" not in out.stderr and "Loading weights" not in out.stderr
    assert seconds < BOUND_S


def test_the_probe_takes_any_http_answer_as_reachable_and_a_closed_port_as_dead():
    """OpenRLHF's reward server has no /health and answers a GET with 404/405: still a live server."""
    from rl_rollout.rewards import RemoteRewardClient, RemoteRewardError

    class NotFound(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - http.server's name
            self.send_error(404)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), NotFound)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        RemoteRewardClient(f"http://127.0.0.1:{server.server_port}/get_reward").probe(timeout_s=5)
    finally:
        server.shutdown()
        server.server_close()
    port = closed_port()
    with pytest.raises(RemoteRewardError, match=rf"http://127.0.0.1:{port}/x does not answer \(ConnectionRefused"):
        RemoteRewardClient(f"http://127.0.0.1:{port}/x").probe(timeout_s=5)


def test_numbers_out_of_range_are_refused_by_the_configs():
    from rl_core.strategy import StrategyConfig
    from rl_core.trainers import DPOConfig
    from rl_core.trainers.ppo import PPOConfig

    for bad, match in (({"learning_rate": -1e-3}, r"learning_rate \(--learning_rate\) must be >= 0"),
                       ({"learning_rate": float("nan")}, r"learning_rate .* must be a finite number"),
                       ({"max_norm": -1.0}, r"max_norm .* must be >= 0"),
                       ({"adam_betas": (0.9, 1.5)}, r"adam_betas .* in \[0, 1\)")):
        with pytest.raises(ValueError, match=match):
            StrategyConfig(**bad)
    for bad, match in (({"gamma": 1.5}, r"gamma .* in \[0, 1\]"), ({"top_p": 0.0}, r"top_p .* > 0"),
                       ({"critic_learning_rate": -1.0}, r"critic_learning_rate .* > 0"),
                       ({"init_kl_coef": float("inf")}, r"init_kl_coef .* finite")):
        with pytest.raises(ValueError, match=match):
            PPOConfig.from_flat(**bad)
    with pytest.raises(ValueError, match=r"beta .* finite"):
        DPOConfig(beta=float("nan"))


def test_rl_ppo_ray_starts_its_own_cluster_despite_a_stale_cluster_address(task):
    """A cluster not shut down leaves its address in <RAY_TMPDIR>/ray/ray_current_cluster; a bare ray.init()
    would join it and refuse --num_gpus ("When connecting to an existing cluster, num_cpus and num_gpus must
    not be provided"). The run must start its own Ray: it gets as far as placing the plan on it (2 GPUs asked,
    1 declared: the cheap way to stop right after the cluster started)."""
    root, model = task
    tmp = tempfile.mkdtemp(prefix="rt", dir="/tmp")  # short: Ray's socket paths live under it
    (Path(tmp) / "ray").mkdir()
    (Path(tmp) / "ray" / "ray_current_cluster").write_text(f"127.0.0.1:{closed_port()}")
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"} | {"RAY_TMPDIR": tmp}
    out, _ = rl("ppo-ray", *ppo_argv(root, model, "--num_gpus", "1", "--actor_num_gpus_per_node", "2",
                                     run="stale"), env=env)
    assert "num_cpus and num_gpus must not be provided" not in out.stderr, out.stderr[-3000:]
    assert out.returncode != 0 and "does not fit this cluster" in out.stderr, out.stderr[-3000:]
    assert re.search(r"the plan needs 3 GPUs but the cluster has 1", out.stderr), out.stderr[-3000:]


KILLER = '''import os, signal, threading
from pathlib import Path

_lock = threading.Lock()
_calls = []


def _parent(pid):
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def _ours(pid):  # a descendant of this driver: never another run's engine on a shared machine
    me = os.getpid()
    while pid > 1:
        if pid == me:
            return True
        pid = _parent(pid)
    return False


def letter(prompt, response, label, **info):
    with _lock:  # iteration 2's first call (16 samples each) kills this run's engine: its next call is the sync
        _calls.append(1)
        if len(_calls) == 17:
            for p in Path("/proc").iterdir():
                try:
                    cmd = (p / "cmdline").read_bytes().split(b"\\0")[0].decode()
                    if p.name.isdigit() and cmd.startswith("ray::RolloutEngineActor") and _ours(int(p.name)):
                        os.kill(int(p.name), signal.SIGKILL)
                        Path(os.environ["KILLED_PID_FILE"]).write_text(p.name)
                except (OSError, ValueError, IndexError):
                    pass
    return min(response.count(label or ""), 8) / 8
'''


@pytest.mark.multiprocess
def test_an_engine_killed_before_a_weight_sync_is_named_as_the_engine(task):
    """The engine actor is SIGKILLed after it generated iteration 2's samples (from the reward function, in the
    driver); the sync's sender then fails with "Connection reset by peer" (or would wait for the dead peer until
    the weight group's timeout), but the error names the engine, its rank, pid and call, at once."""
    root, model = task
    (root / "killer.py").write_text(KILLER)
    pid_file = root / "killed.pid"
    env = {**os.environ, "KILLED_PID_FILE": str(pid_file), "RAY_DEDUP_LOGS": "0"}
    argv = ppo_argv(root, model, "--reward_fn", f"{root / 'killer.py'}:letter", "--num_gpus", "2",
                    "--vllm_num_engines", "1", "--max_iterations", "2", run="killed")
    out, seconds = rl("ppo-ray", *argv, env=env, timeout=800)
    assert pid_file.is_file(), out.stderr[-3000:]  # the engine was found and killed
    assert out.returncode != 0
    pid = pid_file.read_text()
    assert re.search(rf"rollout engine 0 \(engine0 rank 0, pid {pid}\) died during 'receive_weights' \(weight "
                     rf"sync to version 2\)", out.stderr), out.stderr[-4000:]
    assert seconds < 300, seconds  # not the weight group's 600 s wait for a dead peer


def test_a_run_dir_another_run_holds_is_refused_before_any_model_loads(task):
    """issue 40: two runs on one --run_dir interleaved their metrics; now the second stops in one line naming
    the first (rl_core.folder_lock), before any model loads, and leaves the folder's files alone."""
    root, model = task
    run = root / "held"
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time\nfrom rl_core.folder_lock import hold\n"
                               "locks = hold({'--run_dir': sys.argv[1]})\nprint('held', flush=True)\ntime.sleep(600)",
                               str(run)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        (run / "metrics.jsonl").write_text('{"step": 1}\n')
        out, seconds = rl("ppo", *ppo_argv(root, model, run="held"))
        assert out.returncode == 2, out.stderr[-3000:]
        last = [line for line in out.stderr.splitlines() if line.strip()][-1]
        assert re.search(rf"^rl ppo: --run_dir .*held is in use by another run \(host .*, pid {holder.pid}, ", last), last
        assert "Traceback" not in out.stderr and "Loading weights" not in out.stderr
        assert (run / "metrics.jsonl").read_text() == '{"step": 1}\n' and seconds < BOUND_S
    finally:
        holder.kill()
        holder.wait()


def test_a_save_path_another_run_holds_is_refused_by_rl_sft_before_the_model_loads(task):
    """issue 40: --save_path was not locked (the export renames a folder over it, so a lock file inside it would
    go); now it is locked beside it, and the train commands take their locks before the model loads (the
    trainer took them after). The holder's export is left as it was."""
    root, model = task
    out_dir = root / "sft-held"
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time\nfrom rl_core.folder_lock import hold\n"
                               "locks = hold({}, {'--save_path': sys.argv[1]})\nprint('held', flush=True)\n"
                               "time.sleep(600)", str(out_dir)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        out_dir.mkdir()
        (out_dir / "config.json").write_text("{}")
        out, seconds = rl("sft", "--pretrain", str(model), "--dataset", str(root / "sft.jsonl"), "--input_key",
                          "input", "--output_key", "output", "--train_batch_size", "4", "--micro_train_batch_size",
                          "2", "--bf16", "false", "--save_path", str(out_dir))
        assert out.returncode == 2, out.stderr[-3000:]
        last = [line for line in out.stderr.splitlines() if line.strip()][-1]
        assert re.search(rf"^rl sft: --save_path .*sft-held is in use by another run \(host .*, pid {holder.pid}, ",
                         last), last
        assert "Traceback" not in out.stderr and "Loading weights" not in out.stderr
        assert sorted(p.name for p in out_dir.iterdir()) == ["config.json"] and seconds < BOUND_S
    finally:
        holder.kill()
        holder.wait()


def test_a_run_dir_inside_the_save_path_is_refused_by_rl_sft_before_the_model_loads(task):
    """The final export renames its folder over --save_path: a --run_dir inside it was deleted at the end of the
    run (its lock's folder with it: the run crashed there). Now refused in one line before anything loads."""
    root, model = task
    out, seconds = rl("sft", "--pretrain", str(model), "--dataset", str(root / "sft.jsonl"), "--input_key", "input",
                      "--output_key", "output", "--train_batch_size", "4", "--micro_train_batch_size", "2", "--bf16",
                      "false", "--save_path", str(root / "nest"),
                      "--run_dir", str(root / "nest" / "run"))
    assert out.returncode == 2, out.stderr[-3000:]
    last = [line for line in out.stderr.splitlines() if line.strip()][-1]
    assert last == (f"rl sft: --run_dir {root}/nest/run lies inside --save_path {root}/nest, which the final export "
                    "replaces whole (deleting what is in it): give --run_dir a folder outside it, e.g. beside it"), last
    assert "Loading weights" not in out.stderr and not (root / "nest").exists() and seconds < BOUND_S


def test_a_damaged_newest_checkpoint_is_skipped_before_any_model_loads_and_the_run_resumes_from_the_one_before(task):
    """issue 40 finding 2, with rl ppo's real DeepSpeed checkpoints: a truncated model file in the newest one was a
    traceback after the model loaded ('OSError: [Errno 22] Invalid argument', no file named). Now the manifest
    in its marker names the file before any model loads, resume takes the complete iteration before it, and when
    none verifies the run stops in one line."""
    root, model = task
    ck = root / "ck_damaged"
    out, _ = rl("ppo", *ppo_argv(root, model, "--max_iterations", "2", "--save_steps", "1", "--ckpt_path", str(ck),
                                 run="ck_first"))
    assert out.returncode == 0, out.stderr[-3000:]
    assert sorted(p.name for p in ck.iterdir() if p.name.startswith("iter_")) == ["iter_00000001", "iter_00000002"]
    states = sorted((ck / "iter_00000002" / "policy").rglob("*model_states.pt"))
    assert states, sorted(p.name for p in (ck / "iter_00000002").rglob("*"))
    full = states[0].stat().st_size
    with states[0].open("r+b") as f:
        f.truncate(full // 2)
    out, _ = rl("ppo", *ppo_argv(root, model, "--max_iterations", "3", "--save_steps", "1", "--ckpt_path", str(ck),
                                 "--load_checkpoint", run="ck_resumed"))
    assert out.returncode == 0, out.stderr[-3000:]
    rel = states[0].relative_to(ck / "iter_00000002").as_posix()
    skipped = re.search(rf"iter_00000002 cannot be resumed: {re.escape(rel)} is {full // 2:,} bytes, {full:,} when "
                        rf"saved; falling back to the previous one", out.stderr)
    assert skipped, out.stderr[-3000:]
    loads = out.stderr.find("Loading weights")
    assert loads == -1 or skipped.start() < loads  # decided before the model loaded
    assert re.search(r"resumed from .*iter_00000001 \(iteration 1", out.stderr), out.stderr[-3000:]
    rows = [json.loads(line) for line in (root / "ck_resumed" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "rl/reward_mean" in r][-2:] == [2, 3]  # iterations 2 and 3 trained again

    for d in ck.glob("iter_*"):  # now every checkpoint is damaged: one line, no model loaded
        (d / "loop_state.json").write_text("")
    out, seconds = rl("ppo", *ppo_argv(root, model, "--max_iterations", "5", "--ckpt_path", str(ck),
                                       "--load_checkpoint", run="ck_none"))
    assert out.returncode == 2, out.stderr[-3000:]
    last = [line for line in out.stderr.splitlines() if line.strip()][-1]
    assert re.search(r"^rl ppo: no checkpoint under .*ck_damaged can be resumed \(iter_00000003: loop_state.json "
                     r"is 0 bytes, .*; iter_00000002: .*; iter_00000001: .*\): move the damaged folders away", last), last
    assert "Traceback" not in out.stderr and "Loading weights" not in out.stderr and seconds < BOUND_S


@pytest.mark.parametrize("sig", ["SIGTERM", "SIGINT"])
def test_sigterm_and_ctrl_c_stop_rl_ppo_in_one_line_saying_where_the_run_stood(task, sig):
    """issue 40 finding 7: Ctrl-C and SIGTERM printed a traceback. Now one line with the iteration and the last
    checkpoint, exit code 128 + the signal, the run's folders released."""
    import signal as signals

    root, model = task
    ck = root / f"ck_{sig}"
    proc = subprocess.Popen([sys.executable, "-m", "rl_cli.main", "ppo",
                             *ppo_argv(root, model, "--max_iterations", "200", "--save_steps", "1", "--ckpt_path",
                                       str(ck), run=f"stop_{sig}")],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=own_env())
    try:
        deadline = time.monotonic() + 240
        while not (ck / "iter_00000001" / "COMPLETE").exists():
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[1][-3000:]
            time.sleep(0.2)
        proc.send_signal(getattr(signals, sig))
        _, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 128 + getattr(signals, sig), err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    last = [line for line in err.splitlines() if line.strip()][-1]
    how = "SIGTERM" if sig == "SIGTERM" else "Ctrl-C"
    assert re.search(rf"^rl ppo: stopped by {how} at iteration \d+ of 200, \d+ done; last checkpoint: .*{ck.name}/"
                     r"iter_\d{8}$", last), last
    assert not (ck / ".rl.lock").exists() or "in use" not in rl(
        "ppo", *ppo_argv(root, model, "--ckpt_path", str(ck), "--load_checkpoint", "--max_iterations", "1",
                         run=f"stop_{sig}_again"))[0].stderr  # the folder is free again
