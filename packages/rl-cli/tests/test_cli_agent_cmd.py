"""``rl ppo --agent_cmd``: agent programs (written only against the ``openai`` package) play the episodes against
the policy's OpenAI-compatible endpoint, HF engine and real DeepSpeed on a tiny model. The example calculator
agent (two chat calls per episode, its own loop and reward) trains for 2 iterations while, on the side, a
crashing and a hanging program in the same run are counted and cut without stopping it; the loop's samples
carry exactly the recorded tokens and log-probs, masks checked on the experience tensors; the refusals."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer

from rl_cli.main import main
from rl_core.rl.experience import collate, make_item
from rl_core.trainers.ppo_agent_cmd import AgentCmdEpisodes
from rl_rollout.agents.cmd_config import AgentCmdConfig
from rl_rollout.hf_engine import HFEngine

pytestmark = [pytest.mark.timeout(300)]
EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "calculator_agent.py"

# the example agent, unless its row says to crash
FLAKY = f"""
import json, subprocess, sys
row = json.loads(sys.stdin.read())
if row.get("mode") == "crash":
    raise SystemExit("boom")
sys.exit(subprocess.run([sys.executable, {str(EXAMPLE)!r}], input=json.dumps(row), text=True).returncode)
"""


@pytest.fixture(autouse=True)
def own_dist_env():
    keys = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    saved = {k: os.environ.get(k) for k in keys}
    yield
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    from rl_rollout.testing import make_tiny_model

    root = tmp_path_factory.mktemp("agent-cmd-cli")
    model = make_tiny_model(root / "tiny")
    rows = [{"prompt": f"What is {a}+{b}?", "label": str(a + b), "mode": m}
            for (a, b), m in zip([(1, 2), (3, 4)], ["ok", "crash"], strict=True)]
    (root / "prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (root / "flaky.py").write_text(FLAKY)
    return root, model


def argv(root, model, run, cmd, *extra):
    return ["ppo", "--pretrain", str(model), "--prompt_data", str(root / "prompts.jsonl"), "--input_key", "prompt",
            "--label_key", "label", "--agent_cmd", cmd, "--agent_cmd_concurrency", "4", "--agent_cmd_timeout", "20",
            "--advantage_estimator", "group_norm", "--n_samples_per_prompt", "2", "--rollout_batch_size", "2",
            "--train_batch_size", "4", "--max_iterations", "2", "--bf16", "false", "--init_kl_coef", "0",
            "--rollout_engine", "hf", "--seed", "1", "--run_dir", str(root / run), *extra]


def test_rl_ppo_trains_the_example_agent_and_counts_a_crashing_one(task, monkeypatch):
    root, model = task
    monkeypatch.setenv("AGENT_MAX_TOKENS", "4")
    assert main(argv(root, model, "run", f"{sys.executable} {root / 'flaky.py'}")) == 0
    rows = [json.loads(x) for x in (root / "run" / "metrics.jsonl").read_text().splitlines()]
    its = [r for r in rows if "rl/agent_cmd/episodes_ok" in r]
    assert len(its) == 2
    for r in its:
        # 2 prompts x 2 samples: the "crash" row's 2 episodes fail, the other 2 play two calls each
        assert r["rl/agent_cmd/episodes_ok"] == 2 and r["rl/agent_cmd/episodes_failed"] == 2
        assert r["rl/agent_cmd/episodes_timed_out"] == 0 and r["rl/agent_cmd/dropped"] == 2
        assert r["rl/agent_cmd/calls_per_episode"] == 1.0  # (2 + 2 + 0 + 0) / 4
        # the endpoint splices each second call onto the first's prompt + sampled ids: both ok episodes merge
        assert r["rl/agent_cmd/merged"] == r["rl/agent_cmd/episodes_ok"] == 2
        assert r["rl/agent_cmd/per_call"] == 0 and r["rl/agent_cmd/drift"] == 0
        assert r["rl/agent_cmd/calls_spliced"] == 2 and r["rl/agent_cmd/splice_refused"] == 0
        assert r["rl/agent_cmd/calls_untrained"] == 0
        assert r["rl/agent_cmd/tokens_per_episode"] > 0
        # the trainer's log-probs of the sampled tokens are the engine's: one distribution, the same weights
        assert r["rl/rollout_logprob_gap"] < 1e-3


# two chat calls, the second with its history rewritten (a new first user turn): no splice, a per-call episode
REWRITER = """
import json, os, sys
from openai import OpenAI
row = json.loads(sys.stdin.read())
c, m = OpenAI(), os.environ["OPENAI_MODEL"]
a = c.chat.completions.create(model=m, messages=[{"role": "user", "content": row["prompt"]}], max_tokens=4)
q = "Again, only the number: " + row["prompt"]
b = c.chat.completions.create(model=m, messages=[{"role": "user", "content": q}], max_tokens=4)
print(json.dumps({"reward": len(b.choices[0].message.content or "") % 3 / 2}))
"""


def test_rl_ppo_trains_every_call_of_a_per_call_episode(task):
    """A program that rewrites its history cannot be merged: each of its 2 calls becomes an item of its own
    (1 item added per episode), none is left untrained, and the trainer scores those items with the engine's
    log-probs (the gap)."""
    root, model = task
    (root / "rewriter.py").write_text(REWRITER)
    args = argv(root, model, "run-per-call", f"{sys.executable} {root / 'rewriter.py'}")
    assert main([*args[: args.index("--max_iterations") + 1], "1", *args[args.index("--max_iterations") + 2 :]]) == 0
    rows = [json.loads(x) for x in (root / "run-per-call" / "metrics.jsonl").read_text().splitlines()]
    (r,) = [r for r in rows if "rl/agent_cmd/episodes_ok" in r]
    assert r["rl/agent_cmd/episodes_ok"] == 4 and r["rl/agent_cmd/per_call"] == 4 and r["rl/agent_cmd/merged"] == 0
    assert r["rl/agent_cmd/calls_per_episode"] == 2.0 and r["rl/agent_cmd/calls_untrained"] == 0
    assert r["rl/agent_cmd/per_call_items_added"] == 4  # one earlier call per episode
    assert r["rl/rollout_logprob_gap"] < 1e-3


def test_episodes_tensors_hold_the_recorded_tokens_and_a_hang_is_cut(task, tmp_path):
    root, model = task
    tok = AutoTokenizer.from_pretrained(model)
    engine = HFEngine(model)
    agent = tmp_path / "agent.py"
    agent.write_text(
        "import json, sys, time\n"
        "from openai import OpenAI\n"
        "row = json.loads(sys.stdin.read())\n"
        "if row['mode'] == 'hang':\n"
        "    time.sleep(600)\n"
        "c = OpenAI()\n"
        "prompt = [5, 6, 7]\n"  # completions on token ids: the program extends the transcript token for token
        "r = c.completions.create(model='m', prompt=prompt, max_tokens=3, logprobs=0)\n"
        "print(json.dumps({'reward': 1.0}))\n"
    )
    cfg = AgentCmdConfig(cmd=f"{sys.executable} {agent}", concurrency=4, timeout_s=8.0, kill_grace_s=0.5)
    eps = AgentCmdEpisodes(cfg, engine, tok, reward_fn=False, eos=[tok.eos_token_id])
    recorded = {}
    try:
        server = eps.start().server
        close = server.close_episode
        server.close_episode = lambda key: recorded.setdefault(key, close(key))  # observe what was recorded
        prompts = [{"prompt_ids": [1, 2], "row": {"prompt": "p", "label": "l", "mode": m}} for m in ("ok", "hang")]
        groups = eps.groups(prompts, 2)
    finally:
        eps.close()
    m = eps.last_metrics
    assert m["agent_cmd/episodes_ok"] == 2 and m["agent_cmd/episodes_timed_out"] == 2 and m["agent_cmd/dropped"] == 2
    assert m["agent_cmd/merged"] == 2 and m["agent_cmd/drift"] == 0
    ok, hung = groups
    calls = [c for cs in recorded.values() for c in cs if c.prompt_ids == [5, 6, 7]]
    assert sorted(c.choices[0].response_ids for c in calls) == sorted(s.response_ids for s in ok)
    by_ids = {tuple(c.choices[0].response_ids): c.choices[0].logprobs for c in calls}
    for s in ok:
        assert s.rollout_logprobs == by_ids[tuple(s.response_ids)] and s.reward == 1.0
    # on the tensors the loop trains on: prompt 0, sampled tokens 1 with the engine's log-probs; dropped rows all 0
    samples = ok + hung
    b = collate([make_item(s.prompt_ids, s.response_ids, s.loss_mask, s.rollout_logprobs) for s in samples], 0,
                ["rollout_logprobs"])
    for i, s in enumerate(samples):
        P, R = len(s.prompt_ids), len(s.response_ids)
        assert b.input_ids_BT[i, : P + R].tolist() == s.prompt_ids + s.response_ids
        want = [0] * P + ([1] * R if i < 2 else [0] * R)
        assert b.loss_mask_BT[i, : P + R].tolist() == want and b.loss_mask_BT[i, P + R :].sum() == 0
        lp = b.token("rollout_logprobs")[i, P : P + R]
        assert torch.equal(lp, torch.tensor(s.rollout_logprobs, dtype=torch.float32))
    assert all(s.prompt_ids == [5, 6, 7] for s in ok) and all(s.info["dropped"] and s.reward == 0.0 for s in hung)


def test_example_agent_episodes_merge_with_masks_on_the_sampled_ids(task, monkeypatch):
    """The example agent keeps its transcript as text (two chat calls); the tiny model samples tokens whose text
    re-tokenises otherwise (``<extra_N>``, special tokens the client's text drops, no end-of-turn at max_tokens),
    so the plain rendering of call 2 would drift. Spliced by the endpoint, the episode is one sequence: mask 1
    exactly on the two calls' sampled ids with their recorded log-probs, 0 on the template / user tokens."""
    root, model = task
    monkeypatch.setenv("AGENT_MAX_TOKENS", "6")
    tok = AutoTokenizer.from_pretrained(model)
    cfg = AgentCmdConfig(cmd=f"{sys.executable} {EXAMPLE}", concurrency=4, timeout_s=60.0)
    eps = AgentCmdEpisodes(cfg, HFEngine(model), tok, reward_fn=False, eos=[tok.eos_token_id])
    recorded: dict = {}
    try:
        server = eps.start().server
        close = server.close_episode
        server.close_episode = lambda key: recorded.setdefault(key, close(key))
        prompts = [{"prompt_ids": [1, 2], "row": {"prompt": "What is 2+3?", "label": "5"}}]
        (group,) = eps.groups(prompts, 3)
    finally:
        eps.close()
    m = eps.last_metrics
    assert m["agent_cmd/episodes_ok"] == 3 and m["agent_cmd/merged"] == 3 and m["agent_cmd/drift"] == 0
    assert m["agent_cmd/calls_spliced"] == 3 and m["agent_cmd/splice_refused"] == 0
    b = collate([make_item(s.prompt_ids, s.response_ids, s.loss_mask, s.rollout_logprobs) for s in group], 0,
                ["rollout_logprobs"])
    for i, s in enumerate(group):
        # the episode this sample came from: its last call's prompt + sampled ids are the whole sequence
        c1, c2 = next(cs for cs in recorded.values()
                      if cs[1].prompt_ids + cs[1].choices[0].response_ids == s.prompt_ids + s.response_ids)
        assert [c.prompt_source for c in (c1, c2)] == ["rendered", "spliced"]
        a1, a2 = c1.choices[0], c2.choices[0]
        P, R = len(s.prompt_ids), len(s.response_ids)
        between = c2.prompt_ids[len(c1.prompt_ids) + len(a1.response_ids):]  # the template's and the user's
        assert s.prompt_ids == c1.prompt_ids and s.response_ids == a1.response_ids + between + a2.response_ids
        # the end of turn the engine did not sample (max_tokens), the program's user turn, the generation prompt
        end = "\n" if a1.response_ids[-1] == tok.eos_token_id else "<|im_end|>\n"
        user = "<|im_start|>user\nCheck it. Reply with the final number only.<|im_end|>\n<|im_start|>assistant\n"
        assert tok.decode(between, skip_special_tokens=False) == end + user
        want = [0] * P + [1] * len(a1.response_ids) + [0] * len(between) + [1] * len(a2.response_ids)
        assert b.loss_mask_BT[i, : P + R].tolist() == want and b.loss_mask_BT[i, P + R :].sum() == 0
        assert b.input_ids_BT[i, : P + R].tolist() == c2.prompt_ids + a2.response_ids
        lp = b.token("rollout_logprobs")[i, P : P + R]
        want_lp = a1.logprobs + [0.0] * len(between) + a2.logprobs
        assert torch.equal(lp, torch.tensor(want_lp, dtype=torch.float32))


def test_refusals(task, capsys):
    root, model = task
    with pytest.raises(SystemExit):
        main(argv(root, model, "x", "echo", "--agent_func_path", "builtin:calculator"))
    assert "one source of episodes" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(argv(root, model, "x", "echo", "--async_train"))
    assert "--async_train" in capsys.readouterr().err


TOOL_AGENT = """
import json
from openai import OpenAI
from rl_rollout.testing_tools import ANSWER, ASK, BAD_ASK, TOOLS

def agent(row, endpoint):
    c = OpenAI(base_url=endpoint.base_url, api_key=endpoint.api_key, max_retries=0)
    messages = list(ASK if row["mode"] == "ok" else BAD_ASK)
    for _ in range(2):
        msg = c.chat.completions.create(model=endpoint.model, messages=messages, tools=TOOLS, temperature=0)
        msg = msg.choices[0].message
        if not msg.tool_calls:
            return {"reward": float(msg.content == ANSWER)}
        messages.append(msg.model_dump(exclude_none=True))
        for tc in msg.tool_calls:
            a = json.loads(tc.function.arguments)
            messages.append({"role": "tool", "tool_call_id": tc.id, "content": str(a["a"] + a["b"])})
    return {"reward": 0.0}
"""


def test_tool_calls_and_parse_failures_per_episode(tmp_path):
    """A Python entry-point agent with a tool, on a tiny model taught one call (rl_rollout.testing_tools): the
    'ok' rows call add, get 5 back and answer (reward 1), the 'bad' rows get a malformed call back as content;
    the metrics count 1 call and 1 failure per such episode, and the tool round merges token for token."""
    from rl_rollout.testing_tools import make_tiny_tool_model

    model = make_tiny_tool_model(tmp_path / "m")
    tok = AutoTokenizer.from_pretrained(model)
    (tmp_path / "tool_agent.py").write_text(TOOL_AGENT)
    cfg = AgentCmdConfig(cmd=f"{tmp_path / 'tool_agent.py'}:agent", concurrency=4, tool_parser="hermes")
    eps = AgentCmdEpisodes(cfg, HFEngine(model), tok, reward_fn=False, eos=[tok.eos_token_id])
    prompts = [{"prompt_ids": [1, 2], "row": {"prompt": "p", "label": "5", "mode": m}} for m in ("ok", "bad")]
    try:
        ok, bad = eps.groups(prompts, 2)
    finally:
        eps.close()
    m = eps.last_metrics
    assert m["agent_cmd/episodes_ok"] == 4 and m["agent_cmd/calls_per_episode"] == 1.5  # (2 + 2 + 1 + 1) / 4
    assert m["agent_cmd/tool_calls_per_episode"] == 0.5 and m["agent_cmd/tool_parse_failures_per_episode"] == 0.5
    assert m["agent_cmd/tool_parse_failures"] == 2 and m["agent_cmd/drift"] == 0
    assert [s.reward for s in ok] == [1.0, 1.0] and [s.reward for s in bad] == [0.0, 0.0]
    assert all(s.info["mode"] == "merged" and s.info["tool_calls"] == 1 for s in ok)
    assert all(s.info["tool_parse_failures"] == 1 and s.info["tool_calls"] == 0 for s in bad)


@pytest.mark.multiprocess
@pytest.mark.timeout(900)
def test_rl_ppo_ray_trains_the_example_agent_over_engine_actors(task):
    """The same run over Ray: the endpoint in the driver, its engine calls spread over two HF engine actors (logical
    GPUs); every ok episode merges, and the trainer's log-probs of the recorded tokens are the engine actors'."""
    import subprocess

    root, model = task
    args = argv(root, model, "ray", f"{sys.executable} {root / 'flaky.py'}")[1:] + [
        "--num_gpus", "3", "--actor_num_gpus_per_node", "1", "--vllm_num_engines", "2", "--micro_train_batch_size", "4"]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR",
                                                             "MASTER_PORT")}
    out = subprocess.run([sys.executable, "-m", "rl_cli.train_ppo_ray", *args], capture_output=True, text=True,
                         timeout=800, env={**env, "RAY_DEDUP_LOGS": "0", "AGENT_MAX_TOKENS": "4"})
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-6000:]
    assert "2 engine(s) HFEngine" in out.stdout, out.stdout[-2000:]
    rows = [json.loads(x) for x in (root / "ray" / "metrics.jsonl").read_text().splitlines()]
    its = [r for r in rows if "rl/agent_cmd/episodes_ok" in r]
    assert len(its) == 2
    for r in its:
        assert r["rl/agent_cmd/episodes_ok"] == 2 and r["rl/agent_cmd/episodes_failed"] == 2, r
        assert r["rl/agent_cmd/merged"] == 2 and r["rl/agent_cmd/drift"] == 0, r
        assert r["rl/agent_cmd/calls_spliced"] == 2, r
        assert r["rl/rollout_logprob_gap"] < 1e-3, r  # the engine actors sampled with the synced weights

