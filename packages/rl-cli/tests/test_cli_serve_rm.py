"""``rl serve-rm`` and OpenRLHF's reward protocol both ways, with the real commands.

- OpenRLHF's reward file (its ``examples/python/reward_func.py``, unchanged) given to
  ``rl ppo --remote_rm_url FILE.py`` trains, and its ``extra_logs`` reach metrics.jsonl;
  a file's ``scores`` (not its rewards) drive dynamic filtering.
- ``rl serve-rm`` serves that file to OpenRLHF's client request (``POST /get_reward``,
  ``query``, no token) with ``--allow_no_token``, and refuses to start without a token
  otherwise; with ``RL_REWARD_TOKEN`` in both environments (no flag), ``rl ppo`` trains
  against it.
- ``rl ppo --remote_rm_url http://.../get_reward`` trains against a stand-in for
  OpenRLHF's ``serve_rm`` (a few lines of ``http.server`` that read only ``query``).
- ``rl serve-rm --reward_pretrain`` serves a reward model's scores.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import urllib.request
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path

import pytest

from rl_cli.main import main

pytestmark = [pytest.mark.timeout(900), pytest.mark.slow]
OPENRLHF_EXAMPLE = Path(__file__).resolve().parents[2] / "rl-rollout" / "tests" / "data" / "openrlhf_reward_func.py"
REWARD = "def letter(prompt, response, label, **info):\n    return min(response.count(label), 8) / 8\n"


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    from rl_rollout.testing import make_tiny_model

    root = tmp_path_factory.mktemp("serve-rm")
    model = make_tiny_model(root / "tiny")
    (root / "prompts.jsonl").write_text(
        "".join(json.dumps({"prompt": f"Repeat the letter {c}: ", "label": c}) + "\n" for c in "abcd"))
    (root / "reward.py").write_text(REWARD)
    (root / "reward_func.py").write_text(OPENRLHF_EXAMPLE.read_text())  # "adapted only in paths": copied as is
    return root, model


def ppo_args(root, model, run, *reward):
    return ["ppo", "--pretrain", str(model), "--prompt_data", str(root / "prompts.jsonl"), "--input_key", "prompt",
            "--label_key", "label", *reward, "--advantage_estimator", "group_norm", "--init_kl_coef", "0",
            "--n_samples_per_prompt", "4", "--rollout_batch_size", "2", "--train_batch_size", "8",
            "--generate_max_len", "6", "--max_iterations", "2", "--bf16", "false", "--learning_rate", "1e-3",
            "--seed", "7", "--run_dir", str(root / run)]


def metrics(path):
    return [json.loads(x) for x in (path / "metrics.jsonl").read_text().splitlines()]


class ServeRM:
    """``rl serve-rm ARGS`` in a subprocess; ``url`` once it says it is serving; SIGTERM on close."""

    def __init__(self, args, env=None):
        self.proc = subprocess.Popen([sys.executable, "-m", "rl_cli.serve_rm", *args, "--port", "0"],
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     env={**os.environ, **(env or {})})
        self.lines = []
        for line in self.proc.stdout:
            self.lines.append(line)
            m = re.search(r"\[rl serve-rm\] serving .* at (http://\S+)", line)
            if m:
                self.url = m.group(1)
                break
        else:
            raise AssertionError("rl serve-rm did not start:\n" + "".join(self.lines)[-3000:])
        self._reader = threading.Thread(target=lambda: self.lines.extend(self.proc.stdout), daemon=True)
        self._reader.start()

    def close(self) -> str:
        self.proc.send_signal(signal.SIGTERM)
        assert self.proc.wait(30) == 0
        self._reader.join(10)
        return "".join(self.lines)


def post(url, obj, headers=None):
    req = urllib.request.Request(url, data=json.dumps(obj).encode(), headers={"Content-Type": "application/json",
                                                                               **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_serve_rm_needs_a_token_unless_told_and_never_prints_it(task, capsys, monkeypatch):
    root, _ = task
    monkeypatch.delenv("RL_REWARD_TOKEN", raising=False)
    with pytest.raises(SystemExit):
        main(["serve-rm", "--reward_fn", f"{root / 'reward.py'}:letter"])
    err = capsys.readouterr().err
    assert "needs a token: export RL_REWARD_TOKEN=<secret>" in err and "--allow_no_token" in err
    with pytest.raises(SystemExit):
        main(["serve-rm", "--reward_fn", f"{root / 'reward.py'}:letter", "--token", "t", "--allow_no_token"])
    assert "--token and --allow_no_token contradict" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["serve-rm", "--allow_no_token"])
    assert "serve one thing: --reward_pretrain FOLDER" in capsys.readouterr().err
    monkeypatch.setenv("RL_REWARD_TOKEN", "from-env-secret")
    assert main(["serve-rm", "--reward_fn", f"{root / 'reward.py'}:letter", "--print_config"]) == 0
    out = capsys.readouterr().out
    assert "server.token = None" in out and "from-env-secret" not in out
    assert main(["serve-rm", "--reward_fn", "x.py:f", "--token", "flag-secret", "--print_config"]) == 0
    out = capsys.readouterr().out
    assert "server.token = ***" in out and "flag-secret" not in out


def test_openrlhfs_client_request_gets_rewards_from_serve_rm(task):
    root, _ = task
    server = ServeRM(["--remote_rm_url", str(root / "reward_func.py"), "--allow_no_token"])
    try:
        assert "token NOT required (--allow_no_token)" in "".join(server.lines)
        # exactly what OpenRLHF's client sends: the URL as given, no Authorization header
        status, reply = post(server.url + "/get_reward", {"query": ["Repeat a: a", "Repeat b: x"],
                                                          "prompts": ["Repeat a: ", "Repeat b: "],
                                                          "labels": ["a", "b"]})
    finally:
        log = server.close()
    assert status == 200, reply
    assert len(reply["rewards"]) == 2 and reply["scores"] == reply["rewards"]
    assert reply["extra_logs"] == {"dummy_scores": reply["rewards"]}
    assert "['Repeat a: a', 'Repeat b: x']" in log  # the example prints its queries
    assert "replies by status {200: 1}" in log


def test_rl_ppo_trains_on_openrlhfs_reward_file(task):
    root, model = task
    assert main(ppo_args(root, model, "file", "--remote_rm_url", str(root / "reward_func.py"))) == 0
    rows = metrics(root / "file")
    assert [r["step"] for r in rows] == [1, 2]
    assert all(0.0 <= r["rl/reward_extra/dummy_scores"] <= 1.0 for r in rows)
    assert all(r["rl/reward_extra/dummy_scores"] == r["rl/reward_mean"] for r in rows)


def test_a_reward_files_scores_drive_dynamic_filtering(task):
    """Rewards with signal in every group, scores without: filtering on the scores keeps no group."""
    root, model = task
    (root / "scored.py").write_text(
        "def reward_func(queries, prompts, labels, **kwargs):\n"
        "    rewards = [float(i % 2) for i in range(len(queries))]\n"
        "    return {'rewards': rewards, 'scores': [1.0] * len(queries), 'extra_logs': {'n': len(queries)}}\n")
    argv = ppo_args(root, model, "scored", "--remote_rm_url", str(root / "scored.py"), "--dynamic_filtering",
                    "--dynamic_filtering_max_rounds", "2")
    assert main(argv) == 0
    rows = metrics(root / "scored")
    assert all(r["rl/dynamic/kept_fraction"] == 0.0 and r["rl/dynamic/filled"] == 2 for r in rows)
    assert all(r["rl/reward_mean"] == 0.5 and r["rl/reward_extra/n"] == 8 for r in rows)


def test_rl_ppo_trains_against_serve_rm_with_the_token_from_the_environment(task, monkeypatch):
    root, model = task
    env = {"RL_REWARD_TOKEN": "env-secret-123"}
    server = ServeRM(["--reward_fn", f"{root / 'reward.py'}:letter"], env=env)
    try:
        assert post(server.url + "/get_reward", {"query": ["a"]})[0] == 401  # a token is required
        monkeypatch.setenv("RL_REWARD_TOKEN", "env-secret-123")  # the client reads it too; no flag in ps
        assert main(ppo_args(root, model, "served", "--remote_rm_url", server.url + "/get_reward")) == 0
    finally:
        log = server.close()
    assert [r["step"] for r in metrics(root / "served")] == [1, 2]
    assert "env-secret-123" not in log
    # 200: rl ppo's probe of /health before any model loads, then one batch per iteration
    assert re.search(r"replies by status \{200: 3, 401: 1\}", log), log[-2000:]


class OpenRLHFStyleServer:
    """OpenRLHF's serve_rm in a few lines: POST /get_reward, reads only "query", no token."""

    def __init__(self):
        seen = self.seen = []

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                data = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                seen.append((self.path, data))
                queries = data.get("query")
                rewards = [q.count("a") / 8 for q in queries]
                body = json.dumps({"rewards": rewards, "scores": rewards, "extra_logs": {"dummy_scores": rewards}})
                self.send_response(200 if self.path == "/get_reward" else 404)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body.encode())

            def log_message(self, *a):
                pass

        self.httpd = HTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/get_reward"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


def test_rl_ppo_trains_against_an_openrlhf_style_server(task, monkeypatch):
    root, model = task
    monkeypatch.delenv("RL_REWARD_TOKEN", raising=False)
    srv = OpenRLHFStyleServer()
    try:
        assert main(ppo_args(root, model, "openrlhf-server", "--remote_rm_url", srv.url)) == 0
    finally:
        srv.close()
    assert len(srv.seen) == 2 and all(path == "/get_reward" for path, _ in srv.seen)
    path, data = srv.seen[0]
    assert len(data["query"]) == 8 and all(q.startswith(p) for q, p in zip(data["query"], data["prompts"]))
    assert data["labels"][:4] == [data["labels"][0]] * 4  # one label per sample, n samples per prompt
    assert all("rl/reward_extra/dummy_scores" in r for r in metrics(root / "openrlhf-server"))


def test_serve_rm_serves_a_reward_models_scores(task, tmp_path):
    import torch
    from transformers import AutoTokenizer

    from rl_core.models import RewardModel

    root, model = task
    rm = RewardModel.from_pretrained(model, dtype="fp32")
    rm.save_pretrained(tmp_path / "rm")
    AutoTokenizer.from_pretrained(model).save_pretrained(tmp_path / "rm")
    server = ServeRM(["--reward_pretrain", str(tmp_path / "rm"), "--bf16", "false", "--batch_size", "2",
                      "--allow_no_token"])
    texts = ["Repeat the letter a: a a", "b", "Repeat the letter c: cc"]
    try:
        status, reply = post(server.url + "/get_reward", {"query": texts})
    finally:
        server.close()
    assert status == 200, reply
    tok = AutoTokenizer.from_pretrained(tmp_path / "rm")
    with torch.no_grad():
        want = [rm(**{k: v for k, v in tok([t], return_tensors="pt", add_special_tokens=False).items()
                      if k in ("input_ids", "attention_mask")}).item() for t in texts]
    assert reply["rewards"] == pytest.approx(want, abs=1e-4)
    with pytest.raises(SystemExit):
        main(["serve-rm", "--reward_pretrain", str(model), "--allow_no_token"])  # no score head: refused
