"""Agent programs per episode (rl_rollout.agents.cmd) against the real OpenAI endpoint over the HF engine on a
tiny model, and their recorded calls as training samples (rl_rollout.agents.transcript): a shell program and a
Python entry point each make two calls and print / return their reward; a crashing, a hanging (killed with its
process group) and a late-calling program are counted, not fatal; merged episodes mask exactly the tokens the
program added; chat calls that continue their episode are spliced onto its recorded ids (so they merge);
re-tokenisation drift is detected and falls back to per-call samples."""

from __future__ import annotations

import json
import os
import sys
import textwrap
import time

import httpx
import pytest
from transformers import AutoTokenizer

from rl_rollout.agents.cmd import AgentCmdRunner, is_entry_point, last_line_reward
from rl_rollout.agents.cmd_config import AgentCmdConfig
from rl_rollout.agents.transcript import episode_samples
from rl_rollout.hf_engine import HFEngine
from rl_rollout.openai_api import OpenAIServer, OpenAIServerConfig, RecordedCall, RecordedChoice
from rl_rollout.testing import make_tiny_model

pytestmark = pytest.mark.timeout(120)

TWO_CALLS = textwrap.dedent(
    """
    import json, os, sys
    from openai import OpenAI
    row = json.loads(sys.stdin.read())
    client = OpenAI()
    msgs = [{"role": "user", "content": row["prompt"]}]
    for _ in range(2):
        r = client.chat.completions.create(model=os.environ["OPENAI_MODEL"], messages=msgs, max_tokens=4)
        msgs += [{"role": "assistant", "content": r.choices[0].message.content}, {"role": "user", "content": "again"}]
    print("some log line")
    print(json.dumps({"reward": float(len(row["label"])) + row["extra"]}))
    """
)


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("agent-cmd") / "m", seed=5)


@pytest.fixture(scope="module")
def tok(model_path):
    return AutoTokenizer.from_pretrained(model_path)


@pytest.fixture(scope="module")
def server(model_path, tok):
    with OpenAIServer(HFEngine(model_path), tok, OpenAIServerConfig(default_max_tokens=4)) as srv:
        yield srv


def test_entry_point_forms_are_told_from_shell_commands():
    assert is_entry_point("pkg.mod:run") and is_entry_point("agents/a.py:run")
    assert not is_entry_point("python agent.py") and not is_entry_point("echo hi") and not is_entry_point("a:b c")
    assert last_line_reward('log\n{"reward": 0.5}\n\n') == 0.5 and last_line_reward("no json") is None
    with pytest.raises(ValueError, match="finite"):
        last_line_reward('{"reward": "high"}')


def test_shell_program_two_calls_reward_and_failures_counted(server, tmp_path):
    (tmp_path / "agent.py").write_text(TWO_CALLS)
    cfg = AgentCmdConfig(cmd=f"{sys.executable} {tmp_path / 'agent.py'}", concurrency=3, timeout_s=60)
    rows = [{"prompt": "2+2?", "label": "four", "extra": 0.25}, {"prompt": "1+1?", "label": "to", "extra": 0.0}]
    ok = AgentCmdRunner(cfg, server).run(rows)
    assert [r.status for r in ok] == ["ok", "ok"] and [r.reward for r in ok] == [4.25, 2.0]
    for r in ok:
        assert len(r.calls) == 2 and [c.index for c in r.calls] == [0, 1]
        # the second call's prompt holds the first exchange: spliced onto the first call's prompt + sampled ids
        first = r.calls[0].prompt_ids + r.calls[0].choices[0].response_ids
        assert r.calls[1].prompt_ids[: len(first)] == first and len(r.calls[1].prompt_ids) > len(first)
        assert [c.prompt_source for c in r.calls] == ["rendered", "spliced"] and not r.calls[1].splice_refused
        assert episode_samples(r.calls, server.tokenizer).mode == "merged"

    crash = AgentCmdConfig(cmd=f"{sys.executable} -c 'import sys; sys.exit(3)'", timeout_s=30)
    (r,) = AgentCmdRunner(crash, server).run(rows[:1])
    assert r.status == "failed" and "exit status 3" in r.error and r.calls == []

    # a hang: the shell and its child (same group) are ended at the timeout; the child's pid file proves it
    pid_file = tmp_path / "child.pid"
    hang = AgentCmdConfig(
        cmd=f"sleep 300 & echo $! > {pid_file}; wait", timeout_s=1.0, kill_grace_s=0.5
    )
    t0 = time.perf_counter()
    (r,) = AgentCmdRunner(hang, server).run(rows[:1])
    assert r.status == "timeout" and time.perf_counter() - t0 < 5
    child = int(pid_file.read_text())
    time.sleep(0.1)
    assert not _alive(child), "the program's child survived its episode's end"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie waiting for its reaper is dead
        return f.read().split(")")[-1].split()[0] != "Z"


def test_python_entry_point_and_a_late_call_gets_410(server, tmp_path):
    (tmp_path / "agent_fn.py").write_text(
        textwrap.dedent(
            """
            import time
            from openai import OpenAI
            KEPT = []
            def run(row, endpoint):
                KEPT.append(endpoint)
                client = OpenAI(base_url=endpoint.base_url, api_key=endpoint.api_key)
                client.chat.completions.create(model=endpoint.model, messages=[{"role": "user", "content": "hi"}])
                if row.get("hang"):
                    time.sleep(3)
                    return None
                return {"reward": row["label"]}
            """
        )
    )
    cfg = AgentCmdConfig(cmd=f"{tmp_path / 'agent_fn.py'}:run", timeout_s=1.5)
    runner = AgentCmdRunner(cfg, server)
    results = runner.run([{"label": 1.5}, {"label": 0, "hang": True}])
    assert [r.status for r in results] == ["ok", "timeout"] and results[0].reward == 1.5
    assert len(results[0].calls) == 1 and len(results[1].calls) == 1  # the abandoned thread's call was recorded
    ended = runner.entry.__globals__["KEPT"][0]
    gone = server.stats().get("gone", 0)
    r = httpx.post(
        ended.base_url + "/chat/completions",
        json={"model": "x", "messages": [{"role": "user", "content": "late"}]},
        headers={"Authorization": f"Bearer {ended.api_key}"},
        timeout=30,
    )
    assert r.status_code == 410 and server.stats()["gone"] == gone + 1


def _call(i, prompt, resp, lps=None, version=0):
    lps = lps or [-0.5] * len(resp)
    return RecordedCall("chat", list(prompt), [RecordedChoice(list(resp), lps, "stop", version, "")], {}, i)


def test_merged_episode_masks_exactly_the_programs_tokens():
    calls = [_call(0, [1, 2, 3], [10, 11], [-0.1, -0.2]), _call(1, [1, 2, 3, 10, 11, 7, 8], [12], [-0.3], 1)]
    out = episode_samples(calls)
    assert out.mode == "merged" and not out.drift and len(out.samples) == 1
    (s,) = out.samples
    assert s.prompt_ids == [1, 2, 3] and s.response_ids == [10, 11, 7, 8, 12]
    assert s.loss_mask == [1, 1, 0, 0, 1] and s.rollout_logprobs == [-0.1, -0.2, 0.0, 0.0, -0.3]
    assert s.policy_version == 0 and s.info["action_spans"] == [[0, 2], [4, 5]]


def test_retokenisation_drift_falls_back_to_per_call(tok):
    text = "hello world"
    ids = tok.encode(text, add_special_tokens=False)
    # the same text sampled as other tokens (here a special token inside it, which the client's text drops) and
    # re-rendered by the template as the text's own tokens
    special = tok.all_special_ids[-1]
    pieces = ids[:3] + [special] + ids[3:]
    assert pieces != ids and tok.decode(pieces, skip_special_tokens=True) == text
    prompt = tok.encode("Q: ", add_special_tokens=False)
    calls = [_call(0, prompt, pieces), _call(1, prompt + ids + tok.encode(" more", add_special_tokens=False), [5])]
    out = episode_samples(calls, tok)
    assert out.mode == "per_call" and out.drift and out.break_at == 1 and len(out.samples) == 2
    assert [s.response_ids for s in out.samples] == [pieces, [5]] and all(all(s.loss_mask) for s in out.samples)
    # a program that rewrote its history is per-call too, but not drift
    other = [_call(0, prompt, pieces), _call(1, tok.encode("new task", add_special_tokens=False), [5])]
    assert episode_samples(other, tok).drift is False


def test_config_refuses_bad_values():
    with pytest.raises(ValueError, match="--agent_cmd"):
        AgentCmdConfig(concurrency=2)
    # named by the flags that set them, not by the config's field names
    with pytest.raises(ValueError, match=r"concurrency \(--agent_cmd_concurrency\) must be >= 1, got 0"):
        AgentCmdConfig(cmd="x", concurrency=0)
    with pytest.raises(ValueError, match=r"timeout_s \(--agent_cmd_timeout\) must be > 0, got -1"):
        AgentCmdConfig(cmd="x", timeout_s=-1)
    with pytest.raises(ValueError, match=r"kill_grace_s \(--agent_cmd_kill_grace\) must be a finite number"):
        AgentCmdConfig(cmd="x", kill_grace_s=float("inf"))
    json.dumps(AgentCmdConfig(cmd="x").__dict__)
