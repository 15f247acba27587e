"""Agent files (``load_agent``: OpenRLHF's ``AgentInstance`` form, our ``Environment``, ``builtin:calculator``) and
the HF engine's batched ``agenerate`` that runs all episodes' turns together (tiny model, CPU)."""

from __future__ import annotations

import asyncio
import sys

import pytest

from rl_rollout import RolloutRequest, SamplingParams
from rl_rollout.agents import AgentExecutor, AgentRequest, CalculatorEnv
from rl_rollout.agents.openrlhf import OpenRLHFAgentEnv, load_agent
from rl_rollout.hf_engine import HFEngine
from rl_rollout.testing import make_tiny_model, make_tokenizer

OPENRLHF_FILE = '''
from openrlhf.utils.agent import AgentInstanceBase


class AgentInstance(AgentInstanceBase):
    def __init__(self, *args, **kwargs):
        self.turn = 0

    async def reset(self, states, **kwargs):
        return {"observation": states["observation"]}

    async def step(self, states, **kwargs):
        self.turn += 1
        seen.append(dict(states))
        done = self.turn >= 2
        return {"rewards": 0.25 * self.turn, "scores": 1.0 if done else 0.0, "environment_feedback": "" if done else
                "|fb|", "done": done, "extra_logs": {"turn": self.turn}}


seen = []
'''


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    return HFEngine(make_tiny_model(tmp_path_factory.mktemp("tiny") / "m", seed=1))


def test_an_openrlhf_agent_file_loads_without_openrlhf_and_plays_its_form(tmp_path):
    (tmp_path / "agent.py").write_text(OPENRLHF_FILE)
    factory = load_agent(str(tmp_path / "agent.py"))
    assert "openrlhf" not in sys.modules  # served only while the file loaded
    env = factory()
    assert isinstance(env, OpenRLHFAgentEnv)

    async def play():
        assert await env.reset("Q: ", "7") is None  # the prompt itself: nothing appended
        first = await env.step("a1")
        second = await env.step("a2")
        return first, second

    first, second = asyncio.run(play())
    assert (first.observation, first.reward, first.done) == ("|fb|", 0.25, False)
    assert (second.reward, second.done, second.info) == (0.5, True, {"score": 1.0, "extra_logs": {"turn": 2.0}})
    log = env.instance.step.__globals__["seen"]  # the states the file's step got
    assert [s["observation_text"] for s in log] == ["Q: ", "Q: a1|fb|"]
    assert [s["action_text"] for s in log] == ["a1", "a2"] and log[0]["label"] == "7"


def test_other_forms_and_errors(tmp_path):
    (tmp_path / "ours.py").write_text("class Env:\n    async def reset(self, p, l, **i): return None\n"
                                      "    async def step(self, a): ...\n\ndef make_env():\n    return Env()\n")
    assert type(load_agent(str(tmp_path / "ours.py"))()).__name__ == "Env"
    assert type(load_agent(f"{tmp_path / 'ours.py'}:Env")()).__name__ == "Env"
    assert isinstance(load_agent("builtin:calculator")(), CalculatorEnv)
    (tmp_path / "none.py").write_text("x = 1\n")
    with pytest.raises(AttributeError, match="defines none of AgentInstance, make_env"):
        load_agent(str(tmp_path / "none.py"))
    with pytest.raises(FileNotFoundError, match="no such file"):
        load_agent(str(tmp_path / "missing.py"))
    (tmp_path / "bad.py").write_text(OPENRLHF_FILE.replace('return {"observation": states["observation"]}',
                                                           'return {"observation": "other text"}'))
    with pytest.raises(ValueError, match="does not start with the prompt"):
        asyncio.run(load_agent(str(tmp_path / "bad.py"))().reset("Q: ", "7"))


def test_batched_agenerate_runs_every_episode_turn_in_one_generate_and_is_reproducible(engine):
    tok = make_tokenizer()
    calls = []
    generate = engine.generate

    def counting(requests):
        calls.append(len(requests))
        return generate(requests)

    class Two:
        def __init__(self):
            self.turn = 0

        async def reset(self, prompt, label, **info):
            return None

        async def step(self, action):
            from rl_rollout.agents import StepResult

            self.turn += 1
            return StepResult("|obs|", done=self.turn >= 2)

    params = SamplingParams(max_new_tokens=4, n=4, seed=3, stop_token_ids=(10_000,))
    reqs = [AgentRequest(tok.encode(f"Repeat {c}: ", add_special_tokens=False)) for c in "ab"]
    engine.generate, engine.batch_agenerate = counting, True
    try:
        out1 = AgentExecutor(engine, tok, Two, max_turns=2, max_len=64, params=params).run(reqs)
        out2 = AgentExecutor(engine, tok, Two, max_turns=2, max_len=64, params=params).run(reqs)
        single = asyncio.run(engine.agenerate(RolloutRequest(reqs[0].prompt_ids, params)))
    finally:
        engine.generate, engine.batch_agenerate = generate, False
    assert calls == [8, 8, 8, 8, 1]  # two turns of 2 x 4 episodes, twice; then one request alone
    assert [[s.response_ids for s in g] for g in out1] == [[s.response_ids for s in g] for g in out2]
    assert len(single) == 4 and all(s.info["turns"] == 2 for g in out1 for s in g)
    assert len({tuple(s.response_ids) for g in out1 for s in g}) > 1
