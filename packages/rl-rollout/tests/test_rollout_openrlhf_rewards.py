"""OpenRLHF's reward files: ``reward_func(queries, prompts, labels, **kwargs)`` returning a tensor or
``{"rewards", "scores", "extra_logs"}``, loaded from a ``.py`` path as OpenRLHF does, run as a batch scorer.

``data/openrlhf_reward_func.py`` is OpenRLHF's own example, unchanged.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from rl_rollout.rewards import (
    OpenRLHFRewardFunc,
    RemoteRewardClient,
    RewardError,
    RewardLoadError,
    RewardRecord,
    RewardTimeoutError,
    load_reward_fn,
    record_from,
    scorer_for_remote_rm_url,
)

pytestmark = pytest.mark.timeout(120)
EXAMPLE = Path(__file__).with_name("data") / "openrlhf_reward_func.py"


def test_record_from_reads_tensors_lists_and_openrlhf_dicts():
    assert record_from(torch.tensor([1.0, 0.0]), 2, "f") == RewardRecord([1.0, 0.0])
    assert record_from([[1], [2]], 2, "f") == RewardRecord([1.0, 2.0])  # shape [n, 1]
    assert record_from(torch.tensor(0.5), 1, "f") == RewardRecord([0.5])  # one sample: a scalar is fine
    rec = record_from({"rewards": torch.tensor([1.0, 0.0]), "scores": [1, 0],
                       "extra_logs": {"acc": torch.tensor(0.5), "len": [3, 5]}}, 2, "f")
    assert rec == RewardRecord([1.0, 0.0], [1.0, 0.0], {"acc": [0.5, 0.5], "len": [3.0, 5.0]})
    assert rec.log_means() == {"acc": 0.5, "len": 4.0}
    assert rec.as_json() == {"rewards": [1.0, 0.0], "scores": [1.0, 0.0], "extra_logs": {"acc": [0.5, 0.5],
                                                                                        "len": [3.0, 5.0]}}
    assert RewardRecord([2.0]).as_json()["scores"] == [2.0]  # scores default to the rewards on the wire


@pytest.mark.parametrize(("value", "message"), [
    ([1.0], "the rewards must hold 2 numbers"),
    ({"scores": [1, 2]}, "needs a 'rewards' key"),
    ({"rewards": [1.0, float("nan")]}, "non-finite value nan"),
    ({"rewards": [1.0, float("inf")]}, "non-finite value inf"),
    ({"rewards": [1.0, "x"]}, "must be numbers, got str"),
    ({"rewards": [1, 2], "scores": [1]}, "'scores' must hold 2 numbers"),
    ({"rewards": [1, 2], "extra_logs": [1, 2]}, "'extra_logs' must be a dict"),
    ("1.0", "the rewards must hold 2 numbers"),
])
def test_record_from_names_what_is_wrong(value, message):
    with pytest.raises(ValueError, match=message):
        record_from(value, 2, "reward_func in f.py")


def test_openrlhfs_own_example_file_runs_unchanged():
    fn = scorer_for_remote_rm_url(str(EXAMPLE), timeout_s=30)
    assert isinstance(fn, OpenRLHFRewardFunc) and fn.last_record() is None
    rewards = fn.score(["Q1 ", "Q2 ", "Q3 "], ["a", "b", "c"], ["x", None, "z"])
    assert len(rewards) == 3 and set(rewards) <= {0.0, 1.0}
    rec = fn.last_record()
    assert rec.rewards == rewards and rec.scores == rewards and rec.extra_logs == {"dummy_scores": rewards}


def test_queries_prompts_and_labels_are_openrlhfs(tmp_path):
    seen = []
    f = tmp_path / "rf.py"
    f.write_text("import torch\nSEEN = []\n"
                 "def reward_func(queries, prompts, labels):\n"  # OpenRLHF's older examples: no **kwargs
                 "    SEEN.append((queries, prompts, labels))\n"
                 "    return torch.tensor([float(q.endswith(y)) for q, y in zip(queries, labels)])\n")
    fn = OpenRLHFRewardFunc(f)
    assert fn.score(["say a: ", "say b: "], ["a", "c"], ["a", None]) == [1.0, 1.0]  # "" ends every string
    seen = fn.fn.__globals__["SEEN"]
    assert seen == [(["say a: a", "say b: c"], ["say a: ", "say b: "], ["a", ""])]  # no label: "", as OpenRLHF
    assert fn.last_record() == RewardRecord([1.0, 1.0])


def test_a_failing_or_hanging_reward_func_is_an_error_naming_the_file(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("import time\nMODE = ['raise']\n"
                   "def reward_func(queries, prompts, labels, **kw):\n"
                   "    if MODE[0] == 'raise':\n        raise KeyError('label field')\n"
                   "    if MODE[0] == 'hang':\n        time.sleep(2.0)\n"
                   "    return {'rewards': [1.0] * len(queries), 'scores': 'oops'}\n")
    fn = OpenRLHFRewardFunc(bad, timeout_s=0.5)
    with pytest.raises(RewardError, match=r"reward_func in .*bad.py raised KeyError: 'label field'"):
        fn.score(["p"], ["r"])
    fn.fn.__globals__["MODE"][0] = "hang"
    t0 = time.monotonic()
    with pytest.raises(RewardTimeoutError, match=r"did not return within timeout_s=0.5 .*--reward_timeout"):
        fn.score(["p"], ["r"])
    assert time.monotonic() - t0 < 1.5
    fresh = OpenRLHFRewardFunc(bad, timeout_s=5)  # the file runs again: a module of its own
    fresh.fn.__globals__["MODE"][0] = "bad value"
    with pytest.raises(RewardError, match="'scores' must hold 1 numbers.*fix the file's return value"):
        fresh.score(["p"], ["r"])


def test_a_call_after_a_timeout_waits_for_the_abandoned_one(tmp_path):
    f = tmp_path / "slow.py"
    f.write_text("import time\nDELAY = [1.5]\ndef reward_func(queries, prompts, labels, **kw):\n"
                 "    time.sleep(DELAY[0])\n    return [0.5] * len(queries)\n")
    fn = OpenRLHFRewardFunc(f, timeout_s=0.4)
    with pytest.raises(RewardTimeoutError, match="did not return within"):
        fn.score(["p"], ["r"])
    with pytest.raises(RewardTimeoutError, match="an earlier call that timed out is still running"):
        fn.score(["p"], ["r"])  # the abandoned call holds the function until ~1.5 s: calls never overlap
    fn.fn.__globals__["DELAY"][0] = 0.0
    time.sleep(1.0)  # the abandoned call returns; the function is free again
    assert fn.score(["p"], ["r"]) == [0.5]


def test_loading_errors_point_openrlhf_users_to_remote_rm_url(tmp_path):
    f = tmp_path / "rf.py"
    f.write_text("def reward_func(queries, prompts, labels, **kwargs):\n    return [0.0] * len(queries)\n"
                 "def other(x):\n    return x\n")
    with pytest.raises(RewardLoadError, match="takes \\(queries, ...\\): OpenRLHF's batch form.*--remote_rm_url"):
        load_reward_fn(f"{f}:reward_func")
    with pytest.raises(RewardLoadError, match="names a file but no function.*--remote_rm_url FILE.py"):
        load_reward_fn(str(f))
    g = tmp_path / "nofunc.py"
    g.write_text("def score(prompt, response, label, **info):\n    return 1.0\n")
    with pytest.raises(RewardLoadError, match="defines no function reward_func.*\\['score'\\]"):
        OpenRLHFRewardFunc(g)
    h = tmp_path / "arity.py"
    h.write_text("def reward_func(queries):\n    return [0.0]\n")
    with pytest.raises(RewardLoadError, match="cannot be called as reward_func\\(queries, prompts, labels\\)"):
        OpenRLHFRewardFunc(h)
    assert isinstance(scorer_for_remote_rm_url("http://127.0.0.1:1/get_reward"), RemoteRewardClient)
    with pytest.raises(ValueError, match="a local OpenRLHF reward file is a path ending in .py"):
        scorer_for_remote_rm_url("reward_func.txt")
