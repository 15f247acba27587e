"""Rewards: spec loading, built-in verifiers, the process-pool runner, the HTTP client and server.

All real: reward functions live in temp files loaded by spec, the pool runs
real worker processes (one hangs for 60 s and must be killed after 1 s), and
the client talks to a real RewardServer on localhost.
"""

from __future__ import annotations

import json
import logging
import re
import socket
import threading
import time
import urllib.error
import urllib.request

import pytest

from rl_rollout.rewards import (
    ExactMatch,
    FormatCheck,
    MathAnswer,
    RemoteRewardClient,
    RemoteRewardError,
    RewardError,
    RewardLoadError,
    RewardRunner,
    RewardServer,
    RewardTimeoutError,
    load_reward_fn,
)
from rl_rollout.rewards.verifiers import extract_math_answer, parse_number

REWARD_FILE = """
import os, time

def reward(prompt, response, label, **info):
    if response == "raise":
        raise ValueError("boom from the reward file")
    if response == "hang":
        time.sleep(60)
    if response == "exit":
        os._exit(3)
    if response == "text":
        return "not a number"
    return float(response == label) + info.get("bonus", 0.0)

def no_info(prompt, response, label):
    return 1.0

NOT_A_FUNCTION = 42
"""
TOKEN = "s3cret-token"


@pytest.fixture(scope="module")
def reward_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("rewards") / "my_rewards.py"
    path.write_text(REWARD_FILE)
    return path


@pytest.fixture(scope="module")
def pool(reward_file):
    with RewardRunner(f"{reward_file}:reward", workers=2, timeout_s=1.0, fallback=-1.0) as runner:
        yield runner


# -- loading --------------------------------------------------------------------------------------


def test_load_callable_file_module_and_builtin(reward_file, monkeypatch):
    def mine(prompt, response, label, **info):
        return 0.5

    assert load_reward_fn(mine) is mine
    fn = load_reward_fn(f"{reward_file}:reward")
    assert fn("p", "a", "a") == 1.0 and fn("p", "a", "b", bonus=0.25) == 0.25
    monkeypatch.chdir(reward_file.parent)  # a relative path resolves against the working directory
    assert load_reward_fn("my_rewards.py:reward")("p", "x", "x") == 1.0
    monkeypatch.syspath_prepend(str(reward_file.parent))
    assert load_reward_fn("my_rewards:reward")("p", "x", "y") == 0.0
    assert isinstance(load_reward_fn("builtin:exact_match"), ExactMatch)
    assert load_reward_fn("builtin:exact_match:strict") == ExactMatch(normalize=False)
    assert load_reward_fn("builtin:math:1e-3") == MathAnswer(rel_tol=1e-3)
    assert load_reward_fn("builtin:format:^a:b$")("p", "a:b", None) == 1.0  # a ':' inside the regex is kept


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        ("/nonexistent/dir/r.py:reward", ["does not exist", "/nonexistent/dir/r.py"]),
        ("{file}:missing", ["defines no 'missing'", "['no_info', 'reward']", "Fix the name"]),
        ("{file}:NOT_A_FUNCTION", ["is a int, not a callable"]),
        ("{file}:no_info", ["without **info", "fn(prompt, response, label, **info)"]),
        ("no_such_module_xyz:reward", ["cannot import module 'no_such_module_xyz'"]),
        ("just_a_name", ["has no ':'", "path/to/file.py:func"]),
        ("builtin:nope", ["unknown builtin reward 'nope'", "builtin:math"]),
        ("builtin:format:(", ["not a valid regex"]),
        ("builtin:format:", ["needs a regex"]),
        ("builtin:math:tight", ["needs a float"]),
    ],
)
def test_load_errors_name_the_spec_and_the_fix(spec, expected, reward_file):
    spec = spec.format(file=reward_file)
    with pytest.raises(RewardLoadError) as e:
        load_reward_fn(spec)
    for text in expected:
        assert text in str(e.value)
    if not spec.startswith("builtin:"):
        assert repr(spec) in str(e.value)


def test_load_file_that_raises_on_import(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("raise ImportError('needs a package that is not here')\n")
    with pytest.raises(RewardLoadError, match="executing .*bad.py' raised ImportError: needs a package"):
        load_reward_fn(f"{bad}:f")


def test_load_rejects_non_callables_and_wrong_arity():
    with pytest.raises(RewardLoadError, match="must be a callable or a string"):
        load_reward_fn(3)
    with pytest.raises(RewardLoadError, match="cannot be called as fn\\(prompt, response, label\\)"):
        load_reward_fn(lambda prompt, **info: 1.0)


# -- verifiers ------------------------------------------------------------------------------------


def test_exact_match():
    normalized, strict = ExactMatch(), ExactMatch(normalize=False)
    assert normalized("p", "  Paris \n", "paris") == 1.0
    assert normalized("p", "New   York", "new york") == 1.0
    assert normalized("p", "Paris.", "Paris") == 0.0
    assert strict("p", "Paris", "Paris") == 1.0
    assert strict("p", "paris", "Paris") == 0.0 and strict("p", "Paris ", "Paris") == 0.0
    with pytest.raises(ValueError, match="label is None"):
        normalized("p", "x", None)


@pytest.mark.parametrize(
    ("response", "label"),
    [
        ("so the answer is \\boxed{42}.", "42"),
        ("\\boxed{\\frac{1}{2}}", "0.5"),
        ("\\boxed{\\dfrac12}", "1/2"),
        ("first \\boxed{3} then \\boxed{-\\frac{3}{4}}", "-0.75"),
        ("\\boxed{\\frac{\\sqrt{4}}{2}} or \\boxed{x = 1000}", "1000"),  # last box, braces nested
        ("The total is 1,234,567 dollars.", "1234567"),
        ("half: 1/2", "\\frac{1}{2}"),
        ("We get 3-4 = -1, so x = 7", "7"),
        ("x = 3-4 gives 4", "4"),
        ("It is 2.50", "#### 2.5"),
        ("\\boxed{50\\%}", "50"),
        ("\\boxed{90^\\circ}", "90"),
        ("\\boxed{$1,000$}", "1000.0"),
        ("\\boxed{x+1}", "\\boxed{x + 1}"),  # not a number: compared as text
        ("\\boxed{\\left(1,2\\right)}", "(1, 2)"),
        # ("1e3 grams", "1000") left: math-verify reads 1e3 as 1*e*3 (test_rollout_math_verify.py)
    ],
)
def test_math_answer_positive(response, label):
    assert MathAnswer()("p", response, label) == 1.0


@pytest.mark.parametrize(
    ("response", "label"),
    [
        ("\\boxed{41}", "42"),
        ("\\boxed{42} and later 41", "41"),  # the box wins over a later number
        ("no number at all", "1"),
        ("0.333", "1/3"),  # outside the default tolerance
        ("\\boxed{1/0}", "0"),
        ("\\boxed{x+2}", "x+1"),
        ("1,000", "1"),  # a thousands comma, not a list
        ("\\boxed{12", "2"),  # cut off inside the box: falls back to the last number, 12
    ],
)
def test_math_answer_negative(response, label):
    assert MathAnswer()("p", response, label) == 0.0


def test_math_helpers_and_tolerance():
    assert parse_number("1,234.5") == 1234.5 and parse_number("-\\frac{3}{4}") == -0.75
    assert parse_number("\\frac{-1}{2}") == -0.5 and parse_number("+7") == 7.0
    assert parse_number("1,23") is None and parse_number("abc") is None and parse_number("inf") is None
    assert extract_math_answer("a 1 b 2.5 c") == "2.5" and extract_math_answer("none") is None
    assert MathAnswer(rel_tol=1e-2)("p", "3.14", "3.1416") == 1.0
    assert MathAnswer()("p", "3.14", "3.1416") == 0.0
    with pytest.raises(ValueError, match="label is None"):
        MathAnswer()("p", "\\boxed{1}", None)


def test_format_check():
    check = FormatCheck(r"^<think>.*</think>\s*<answer>.*</answer>$")
    assert check("p", "<think>a\nb</think>\n<answer>4</answer>", None) == 1.0  # DOTALL: '.' crosses lines
    assert check("p", "<answer>4</answer>", None) == 0.0
    assert check("p", "<think>a</think><answer>4</answer> trailing", None) == 0.0
    assert FormatCheck(r"\\boxed\{")("p", "x \\boxed{1}", "ignored") == 1.0


# -- runner: in-process ---------------------------------------------------------------------------


def test_inprocess_fallback_counts_and_warning(reward_file, caplog):
    runner = RewardRunner(f"{reward_file}:reward", fallback=-1.0)
    with caplog.at_level(logging.WARNING, logger="rl_rollout.rewards.runner"):
        results = runner.run(["p"] * 4, ["a", "raise", "text", "b"], ["a", "a", "a", "a"], [{"bonus": 0.5}, {}, {}, {}])
    assert [r.reward for r in results] == [1.5, -1.0, -1.0, 0.0]
    assert [r.status for r in results] == ["ok", "error", "error", "ok"]
    assert "ValueError: boom from the reward file" in results[1].error
    assert "returned str 'not a number'" in results[2].error
    assert runner.metrics() == {"reward/ok": 2, "reward/failures": 2, "reward/errors": 2, "reward/timeouts": 0,
                                "reward/nonfinite": 0}
    assert f"{reward_file}:reward failed on sample 1: ValueError: boom" in caplog.text
    assert runner("p", "z", "z") == 1.0


def test_inprocess_accepts_scalar_tensors_and_rejects_nan():
    import torch

    def tensor_reward(prompt, response, label, **info):
        return torch.tensor(0.25) if response == "t" else float("nan")

    runner = RewardRunner(tensor_reward, fallback=0.0)
    results = runner.run(["p", "p"], ["t", "n"])
    assert results[0].reward == 0.25 and results[1].status == "nonfinite" and "returned nan" in results[1].error


def test_inprocess_refuses_no_timeout_and_raise_mode(reward_file):
    with pytest.raises(ValueError, match="must be a finite number of seconds > 0, got None: every reward call"):
        RewardRunner(f"{reward_file}:reward", timeout_s=None)
    runner = RewardRunner(f"{reward_file}:reward", on_error="raise")
    with pytest.raises(RewardError, match=f"reward function {reward_file}:reward failed on sample 0: ValueError"):
        runner.score(["p"], ["raise"], ["a"])
    with pytest.raises(ValueError, match="on_error must be one of"):
        RewardRunner(f"{reward_file}:reward", on_error="ignore")
    with pytest.raises(ValueError, match="2 responses for 1 prompts"):
        runner.score(["p"], ["a", "b"])


# -- runner: process pool -------------------------------------------------------------------------


def test_pool_scores_in_order(pool):
    responses = ["a", "b", "c", "a", "d", "a"]
    assert pool.score(["p"] * 6, responses, ["a"] * 6) == [1.0, 0.0, 0.0, 1.0, 0.0, 1.0]
    assert pool.score(["p"], ["a"], ["a"], [{"bonus": 2.0}]) == [3.0]
    assert pool.score([], []) == []


def test_pool_error_and_timeout_fall_back_and_the_pool_recovers(pool, caplog):
    before = pool.counts
    start = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="rl_rollout.rewards.runner"):
        results = pool.run(["p"] * 4, ["raise", "hang", "a", "b"], ["a"] * 4)
    elapsed = time.monotonic() - start
    assert elapsed < 4.0, f"a 60 s hang with timeout_s=1 took {elapsed:.1f}s"
    assert [r.status for r in results] == ["error", "timeout", "ok", "ok"]
    assert [r.reward for r in results] == [-1.0, -1.0, 1.0, 0.0]
    after = pool.counts
    assert (after.errors - before.errors, after.timeouts - before.timeouts) == (1, 1)
    assert after.ok - before.ok == 2
    assert "timed out on sample 1" in caplog.text and "boom from the reward file" in caplog.text
    # Both workers are usable again: a batch wider than the pool, then a worker that dies mid-call.
    assert pool.score(["p"] * 5, ["a"] * 5, ["a"] * 5) == [1.0] * 5
    died = pool.run(["p", "p"], ["exit", "a"], ["a", "a"])
    assert died[0].status == "error" and "died (exit code 3)" in died[0].error and died[1].reward == 1.0
    assert pool.score(["p"] * 3, ["a", "x", "a"], ["a"] * 3) == [1.0, 0.0, 1.0]


def test_pool_raise_mode_names_the_function_and_recovers(reward_file):
    spec = f"{reward_file}:reward"
    with RewardRunner(spec, workers=1, timeout_s=1.0, on_error="raise") as runner:
        with pytest.raises(RewardError, match=f"reward function {spec} failed on sample 1: ValueError: boom"):
            runner.score(["p", "p"], ["a", "raise"], ["a", "a"])
        with pytest.raises(RewardTimeoutError, match=f"reward function {spec} timed out on sample 0"):
            runner.score(["p"], ["hang"], ["a"])
        assert runner.score(["p", "p"], ["a", "b"], ["a", "a"]) == [1.0, 0.0]
        assert runner.metrics() == {"reward/ok": 3, "reward/failures": 2, "reward/errors": 1, "reward/timeouts": 1,
                                    "reward/nonfinite": 0}


def test_pool_builtin_spec_and_setup_errors(reward_file):
    with RewardRunner("builtin:math", workers=1, timeout_s=5.0) as runner:
        assert runner.score(["p", "p"], ["\\boxed{\\frac{1}{2}}", "2"], ["0.5", "3"]) == [1.0, 0.0]
    with pytest.raises(RewardLoadError, match="does not exist"):  # reported by the worker, at construction
        RewardRunner("/nonexistent/r.py:f", workers=1, timeout_s=1.0)
    with pytest.raises(RewardLoadError, match="cannot send reward function .*pass a 'path/to/file.py:func'"):
        RewardRunner(lambda prompt, response, label, **info: 1.0, workers=1, timeout_s=1.0)
    with pytest.raises(ValueError, match="timeout_s must be a finite number of seconds > 0, got inf"):
        RewardRunner(f"{reward_file}:reward", workers=1, timeout_s=float("inf"))
    closed = RewardRunner("builtin:exact_match", workers=1, timeout_s=1.0)
    closed.close()
    with pytest.raises(RuntimeError, match="is closed"):
        closed.score(["p"], ["a"], ["a"])


# -- remote reward model --------------------------------------------------------------------------


def match_score(prompts, responses, labels):
    return [float(r == label) for r, label in zip(responses, labels, strict=True)]


@pytest.fixture(scope="module")
def server():
    with RewardServer(match_score, token=TOKEN, max_request_bytes=2048, max_batch=8) as s:
        yield s


def raw_post(url, body: bytes, token: str | None = TOKEN) -> tuple[int, dict]:
    headers = {"Content-Type": "application/json"} | ({"Authorization": f"Bearer {token}"} if token else {})
    try:
        with urllib.request.urlopen(urllib.request.Request(url, data=body, headers=headers), timeout=5) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_remote_scores_and_health(server):
    client = RemoteRewardClient(server.url, token=TOKEN, timeout_s=5)
    assert client.score(["p1", "p2", "p3"], ["a", "b", "c"], ["a", "x", "c"]) == [1.0, 0.0, 1.0]
    assert RemoteRewardClient(server.url + "/score", token=TOKEN).score(["p"], ["a"], ["a"]) == [1.0]
    assert client.health() and client.attempts == 1
    assert TOKEN not in repr(client)


def test_remote_auth_size_and_batch_errors_are_not_retried(server):
    for token in (None, "wrong"):
        client = RemoteRewardClient(server.url, token=token, retries=3, backoff_s=0.01)
        with pytest.raises(RemoteRewardError, match="HTTP 401: missing or wrong token"):
            client.score(["p"], ["a"], ["a"])
        assert client.attempts == 1
    client = RemoteRewardClient(server.url, token=TOKEN, retries=3, backoff_s=0.01)
    with pytest.raises(RemoteRewardError, match="HTTP 413: request body of \\d+ bytes exceeds max_request_bytes=2048"):
        client.score(["p"], ["x" * 4000], ["a"])
    with pytest.raises(RemoteRewardError, match="HTTP 413: batch of 9 samples exceeds the server's max_batch=8"):
        client.score(["p"] * 9, ["a"] * 9, ["a"] * 9)
    assert client.attempts == 2
    assert client.score(["p"], ["a"], ["a"]) == [1.0]  # the server is fine afterwards


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (b"{not json", "request body is not valid JSON"),
        (b"[1, 2]", "must be a JSON object"),
        (json.dumps({"prompts": ["p", "q"], "responses": ["a"]}).encode(), "2 prompts, 1 responses, 2 labels"),
        (json.dumps({"prompts": ["p"], "responses": ["a"], "labels": ["a", "b"]}).encode(), "1 prompts, 1 responses, 2"),
        (json.dumps({"prompts": ["p"], "responses": [1]}).encode(), "'responses' must be a list of strings"),
        (json.dumps({"responses": ["a"]}).encode(), "'prompts' must be a list of strings"),
    ],
)
def test_server_rejects_malformed_batches(server, body, message):
    status, reply = raw_post(server.url, body)
    assert status == 400 and message in reply["error"]


def test_server_without_labels_and_unknown_path(server):
    status, reply = raw_post(server.url, json.dumps({"prompts": ["p"], "responses": [""]}).encode())
    assert status == 200 and reply == {"rewards": [0.0], "scores": [0.0], "extra_logs": {}}  # labels: None
    assert raw_post(server.url + "/nope", b"{}")[0] == 404
    assert raw_post(server.url + "/nope", b"{}", token=None)[0] == 401  # the token is checked first


def test_server_needs_a_token_unless_allowed():
    with pytest.raises(ValueError, match="RewardServer needs a token=.*allow_no_token=True"):
        RewardServer(match_score)
    with RewardServer(match_score, allow_no_token=True) as open_server:
        assert RemoteRewardClient(open_server.url).score(["p"], ["a"], ["a"]) == [1.0]
    with pytest.raises(RuntimeError, match="call start\\(\\) first"):
        RewardServer(match_score, token=TOKEN).url


def test_client_retries_5xx_with_backoff_then_succeeds():
    calls = []

    def flaky(prompts, responses, labels):
        calls.append(time.monotonic())
        if len(calls) <= 2:
            raise RuntimeError(f"model not loaded yet (call {len(calls)})")
        return match_score(prompts, responses, labels)

    with RewardServer(flaky, token=TOKEN) as s:
        client = RemoteRewardClient(s.url, token=TOKEN, retries=3, backoff_s=0.05)
        assert client.score(["p", "q"], ["a", "b"], ["a", "a"]) == [1.0, 0.0]
        assert client.attempts == 3 and len(calls) == 3
        assert calls[1] - calls[0] >= 0.05 and calls[2] - calls[1] >= 0.1  # exponential backoff
        calls.clear()
        client = RemoteRewardClient(s.url, token=TOKEN, retries=1, backoff_s=0.01)
        with pytest.raises(RemoteRewardError, match="failed 2 attempt.*HTTP 500: score_fn failed: RuntimeError: model"):
            client.score(["p"], ["a"], ["a"])
        assert client.attempts == 2


def test_client_retries_connection_errors():
    with socket.socket() as sock:  # a port nobody listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    client = RemoteRewardClient(f"http://127.0.0.1:{port}", retries=2, backoff_s=0.01)
    with pytest.raises(RemoteRewardError, match="failed 3 attempt.*Connection.*Check that the server is up"):
        client.score(["p"], ["a"])
    assert client.attempts == 3
    assert not client.health()


def test_client_times_out_on_a_hanging_server():
    release = threading.Event()

    def hang(prompts, responses, labels):
        release.wait(30)
        return [0.0] * len(prompts)

    with RewardServer(hang, token=TOKEN) as s:
        client = RemoteRewardClient(s.url, token=TOKEN, timeout_s=0.5, retries=1, backoff_s=0.01)
        start = time.monotonic()
        try:
            with pytest.raises(RemoteRewardError, match="failed 2 attempt.*timeout_s=0.5.*timed out"):
                client.score(["p"], ["a"])
        finally:
            release.set()
        assert time.monotonic() - start < 3.0 and client.attempts == 2


def test_a_reward_function_calling_os_exit_on_a_thread_lane_fails_its_call_not_the_trainer(tmp_path):
    """issue 40 finding 3: a reward function calling os._exit(1) killed the trainer in the default (thread) mode
    with no message and an empty metrics file. Now the call fails, naming what it did and the fix; os._exit
    anywhere else in the process still exits. In a child process: a regression would end pytest itself."""
    import subprocess
    import sys

    script = tmp_path / "child.py"
    script.write_text(
        "import os\n"
        "from rl_rollout import RewardRunner\n"
        "from rl_rollout.rewards import RewardError\n"
        "def quits(prompt, response, label, **info):\n"
        "    if response == 'quit':\n"
        "        os._exit(1)\n"
        "    return 1.0\n"
        "results = RewardRunner(quits, fallback=-1.0).run(['p', 'p'], ['ok', 'quit'])\n"
        "print('fallback', [r.reward for r in results], results[1].error)\n"
        "try:\n"
        "    RewardRunner(quits, on_error='raise').score(['p'], ['quit'])\n"
        "except RewardError as e:\n"
        "    print('raised', e)\n"
        "os._exit(7)\n")
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 7, out.stdout + out.stderr  # the main thread's own os._exit still exits
    assert "fallback [1.0, -1.0] ProcessExitCalled: the reward function called os._exit(1)" in out.stdout, out.stdout
    assert re.search(r"raised reward function .*quits failed on sample 0: ProcessExitCalled: .*os._exit\(1\).*"
                     r"--reward_workers N", out.stdout), out.stdout
