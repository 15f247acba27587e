"""AgentExecutor bookkeeping on the real HFEngine (tiny Llama), CalculatorEnv, and an end-to-end calculator episode.

A random tiny model never writes ``<calc>`` tags, so the executor is checked
with a scripted environment against the real engine: the response must be the
engine's sampled ids (compared with a separate ``generate`` call with the same
seed, and logprobs with a full forward pass, 1e-4 as in
test_rollout_hf_engine.py) interleaved with the observation ids. The calculator
path is driven by ``ScriptedPolicy``, a RolloutEngine that emits predetermined
tokens: a stand-in for the policy's choices, not for the engine.
"""

from __future__ import annotations

import asyncio
import dataclasses

import pytest
import torch

from rl_rollout import RolloutEngine, RolloutRequest, RolloutSample, SamplingParams
from rl_rollout.agents import (
    AgentExecutor,
    AgentRequest,
    CalcError,
    CalculatorEnv,
    ChatTurnFormat,
    EnvStepError,
    StepResult,
    safe_eval,
)
from rl_rollout.agents.executor import _turn_seed
from rl_rollout.hf_engine import HFEngine
from rl_rollout.testing import make_tiny_model, make_tokenizer

LOGPROB_ATOL = 1e-4


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "m", peaked=True, seed=1)


@pytest.fixture(scope="module")
def engine(model_path):
    return HFEngine(model_path)


@pytest.fixture(scope="module")
def tok():
    return make_tokenizer()


def chat_prompt(tok, text: str) -> list[int]:
    text = tok.apply_chat_template([{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True)
    return tok.encode(text, add_special_tokens=False)


class Tracker:
    """Shared by the environments of one test: every action seen, and how many episodes were live at once."""

    def __init__(self):
        self.actions: list[str] = []
        self.live = 0
        self.max_live = 0
        self.closed = 0


class ScriptedEnv:
    """Observation ``obs{turn}|`` (or ``obs * turn``), reward ``0.5 * turn``, done at turn ``done_at`` (None: never)."""

    def __init__(self, tracker: Tracker, done_at: int | None = None, obs: str | None = None, fail_at=None):
        self.tracker, self.done_at, self.obs, self.fail_at = tracker, done_at, obs, fail_at
        self.turn = 0

    async def reset(self, prompt, label, **info):
        self.tracker.live += 1
        self.tracker.max_live = max(self.tracker.max_live, self.tracker.live)
        return None

    async def step(self, action_text):
        await asyncio.sleep(0)
        self.turn += 1
        self.tracker.actions.append(action_text)
        if self.turn == self.fail_at:
            raise ZeroDivisionError("tool crashed")
        obs = self.obs if self.obs is not None else f"obs{self.turn}|"
        return StepResult(obs, reward=0.5 * self.turn, done=self.turn == self.done_at, info={"turn": self.turn})

    def close(self):
        self.tracker.live -= 1
        self.tracker.closed += 1


def split_turns(sample: RolloutSample) -> tuple[list[list[int]], list[list[int]]]:
    """(policy segments, observation segments between them) from ``info["action_spans"]``."""
    spans = sample.info["action_spans"]
    acts = [sample.response_ids[s:e] for s, e in spans]
    obs = [sample.response_ids[spans[i][1] : spans[i + 1][0]] for i in range(len(spans) - 1)]
    assert spans[0][0] == 0 and spans[-1][1] == len(sample.response_ids), "response must start and end on policy turns"
    return acts, obs


def check_masks(sample: RolloutSample) -> None:
    on_policy = {t for s, e in sample.info["action_spans"] for t in range(s, e)}
    assert sample.loss_mask == [int(t in on_policy) for t in range(len(sample.response_ids))]
    assert all(sample.rollout_logprobs[t] == 0.0 for t in range(len(sample.response_ids)) if t not in on_policy)
    assert all(sample.rollout_logprobs[t] < 0.0 for t in on_policy)


def recompute_logprobs(model, sample: RolloutSample, temperature: float) -> torch.Tensor:
    ids = torch.tensor([sample.prompt_ids + sample.response_ids])
    with torch.no_grad():
        logits_TV = model(ids).logits[0, len(sample.prompt_ids) - 1 : -1].float() / temperature
    return torch.log_softmax(logits_TV, -1).gather(-1, torch.tensor(sample.response_ids)[:, None])[:, 0]


def test_response_is_sampled_ids_and_observation_ids(engine, tok):
    tracker = Tracker()
    fmt = ChatTurnFormat.from_tokenizer(tok, role="tool")
    assert fmt.prefix == "\n<|im_start|>tool\n" and fmt.suffix == "<|im_end|>\n<|im_start|>assistant\n"
    params = SamplingParams(temperature=0.8, max_new_tokens=6, seed=11)
    ex = AgentExecutor(
        engine, tok, lambda: ScriptedEnv(tracker, done_at=3), max_turns=5, max_len=300, params=params,
        format_observation=fmt,
    )
    prompt = chat_prompt(tok, "add")
    [[s]] = ex.run([AgentRequest(prompt, prompt="add", label=None)])
    assert s.prompt_ids == prompt and s.finish_reason == "stop" and s.info["stop_cause"] == "done"
    assert s.info["turns"] == 3 and s.info["turn_rewards"] == [0.5, 1.0, 1.5] and s.reward == 3.0
    acts, obs = split_turns(s)
    assert obs == [tok.encode(fmt(f"obs{t}|"), add_special_tokens=False) for t in (1, 2)]
    assert obs[0][1] == tok.convert_tokens_to_ids("<|im_start|>"), "chat markup must become special tokens"
    assert tracker.actions == [tok.decode(a, skip_special_tokens=True) for a in acts]
    assert tracker.closed == 1 and s.policy_version == 0 and s.info["turn_policy_versions"] == [0, 0, 0]
    check_masks(s)
    # each turn is what the engine samples from that context with that turn's seed, token for token
    for turn, ((start, end), act) in enumerate(zip(s.info["action_spans"], acts, strict=True), start=1):
        turn_params = dataclasses.replace(params, seed=_turn_seed(11, 0, 0, turn))
        [[direct]] = engine.generate([RolloutRequest(prompt + s.response_ids[:start], turn_params)])
        assert direct.response_ids == act
        assert direct.rollout_logprobs == s.rollout_logprobs[start:end]
    # and the logprobs are those of the sampling distribution over the whole interleaved context
    ref = recompute_logprobs(engine.model, s, temperature=0.8)
    mask = torch.tensor(s.loss_mask, dtype=torch.bool)
    worst = (torch.tensor(s.rollout_logprobs)[mask] - ref[mask]).abs().max().item()
    assert worst <= LOGPROB_ATOL, f"max |rollout - recomputed| = {worst:.2e}"


def test_max_turns_drops_last_observation(engine, tok):
    tracker = Tracker()
    ex = AgentExecutor(
        engine, tok, lambda: ScriptedEnv(tracker), max_turns=3, max_len=300,
        params=SamplingParams(temperature=1.0, max_new_tokens=5, seed=2),
    )
    [[s]] = ex.run([[5, 60, 70]])
    assert s.finish_reason == "length" and s.info["stop_cause"] == "max_turns"
    assert s.info["turns"] == 3 and len(tracker.actions) == 3 and s.reward == 0.5 + 1.0 + 1.5
    acts, obs = split_turns(s)
    assert obs == [tok.encode(f"obs{t}|", add_special_tokens=False) for t in (1, 2)]
    assert s.info["observations"] == ["obs1|", "obs2|", "obs3|"]
    check_masks(s)


def test_max_len_caps_generation_and_drops_overflowing_observation(engine, tok):
    prompt = [5, 61, 62, 63]
    params = SamplingParams(temperature=1.0, max_new_tokens=16, seed=4, ignore_eos=True)
    # turn 1: 16 tokens, observation "ab|": 3, turn 2 capped to the 10 left
    tracker = Tracker()
    max_len = len(prompt) + 16 + 3 + 10
    ex = AgentExecutor(engine, tok, lambda: ScriptedEnv(tracker, obs="ab|"), max_turns=8,
                       max_len=max_len, params=params)
    [[s]] = ex.run([prompt])
    assert s.finish_reason == "length" and s.info["stop_cause"] == "max_len"
    assert len(s.prompt_ids) + len(s.response_ids) == max_len
    assert s.info["action_spans"] == [[0, 16], [19, 29]] and len(tracker.actions) == 1
    check_masks(s)
    # an observation that leaves no room for a policy token is dropped, not truncated
    tracker = Tracker()
    max_len = len(prompt) + 16 + 10
    ex = AgentExecutor(engine, tok, lambda: ScriptedEnv(tracker, obs="x" * 10), max_turns=8,
                       max_len=max_len, params=params)
    [[s]] = ex.run([prompt])
    assert s.finish_reason == "length" and s.info["stop_cause"] == "max_len"
    assert len(s.response_ids) == 16 and s.loss_mask == [1] * 16 and s.info["dropped_observation_tokens"] == 10
    with pytest.raises(ValueError, match="max_len is 4"):
        AgentExecutor(engine, tok, lambda: ScriptedEnv(tracker), max_turns=2, max_len=4).run([prompt])


def test_initial_observation_from_reset(engine, tok):
    class Greeter(ScriptedEnv):
        async def reset(self, prompt, label, **info):
            await super().reset(prompt, label, **info)
            self.seen = (prompt, label, info)
            return self.greeting

    envs = []

    def factory(greeting):
        envs.append(Greeter(Tracker(), done_at=1))
        envs[-1].greeting = greeting
        return envs[-1]

    params = SamplingParams(temperature=1.0, max_new_tokens=5, seed=3)
    ex = AgentExecutor(engine, tok, lambda: factory("start|"), max_turns=3, max_len=100, params=params)
    [[s]] = ex.run([AgentRequest([5, 60], prompt="p", label=7, metadata={"split": "train"})])
    assert envs[-1].seen == ("p", 7, {"split": "train"})
    start = tok.encode("start|", add_special_tokens=False)
    assert s.response_ids[: len(start)] == start and s.info["action_spans"] == [[len(start), len(s.response_ids)]]
    assert s.info["observations"] == ["start|", "obs1|"]
    check_masks(s)
    ex = AgentExecutor(engine, tok, lambda: factory("y" * 20), max_turns=3, max_len=22, params=params)
    with pytest.raises(ValueError, match="Greeter.reset returned an observation of 20 tokens"):
        ex.run([[5, 60]])


def test_concurrent_episodes_seeded_and_bounded(engine, tok):
    stops = tuple(tok.convert_tokens_to_ids(list("+%K")))  # tokens this model samples often
    params = SamplingParams(temperature=1.0, max_new_tokens=8, n=2, seed=5, stop_token_ids=stops)
    prompts = [[5, 60, 70], [7, 40, 41], [5, 61]]

    def play(max_concurrency):
        tracker = Tracker()
        ex = AgentExecutor(
            engine, tok, lambda: ScriptedEnv(tracker, done_at=2), max_turns=4, max_len=200, params=params,
            max_concurrency=max_concurrency,
        )
        return ex.run(prompts), tracker

    out, tracker = play(None)
    assert tracker.max_live == 6 and tracker.closed == 6 and tracker.live == 0
    assert [len(g) for g in out] == [2, 2, 2]
    for prompt, group in zip(prompts, out, strict=True):
        for k, s in enumerate(group):
            assert s.prompt_ids == prompt and s.info["sample_index"] == k and s.info["turns"] == 2
            acts, obs = split_turns(s)
            assert obs == [tok.encode("obs1|", add_special_tokens=False)]
            assert all(a[-1] in stops or len(a) == 8 for a in acts)
            check_masks(s)
        assert group[0].response_ids != group[1].response_ids, "two episodes of one prompt got the same seed"
    assert any(a[-1] in stops for g in out for s in g for a in split_turns(s)[0]), "no turn ended at a stop token"
    bounded, tracker = play(2)
    assert tracker.max_live == 2
    assert [[s.response_ids for s in g] for g in bounded] == [[s.response_ids for s in g] for g in out]


def test_engine_abort_is_propagated(engine, tok):
    class AbortSecondTurn:
        """The real engine's output, with the second call's finish reason rewritten to abort."""

        def __init__(self, inner):
            self.inner, self.calls, self.policy_version = inner, 0, 0

        async def agenerate(self, request):
            self.calls += 1
            (s,) = await self.inner.agenerate(request)
            return [dataclasses.replace(s, finish_reason="abort")] if self.calls == 2 else [s]

    tracker = Tracker()
    ex = AgentExecutor(
        AbortSecondTurn(engine), tok, lambda: ScriptedEnv(tracker), max_turns=5, max_len=200,
        params=SamplingParams(temperature=1.0, max_new_tokens=4, seed=1),
    )
    [[s]] = ex.run([[5, 60, 70]])
    assert s.finish_reason == "abort" and s.info["stop_cause"] == "abort" and s.info["turns"] == 2
    assert len(tracker.actions) == 1 and s.reward == 0.5 and tracker.closed == 1
    check_masks(s)


def test_partial_rollout_token_versions_reach_the_episode(engine, tok):
    """With partial rollouts the engine tags every token with the version that sampled it; an episode keeps them:
    ``info["token_versions"]`` has one per policy token (the ``action_spans`` tokens, in order), and
    ``policy_version`` is the oldest. Untagged turns (whole responses) add no such key."""

    class Tagging:
        """The real engine's samples, each turn's tokens labelled: turn k's first token k - 1, the rest k."""

        def __init__(self, inner):
            self.inner, self.calls, self.policy_version = inner, 0, 0

        async def agenerate(self, request):
            self.calls += 1
            (s,) = await self.inner.agenerate(request)
            versions = [self.calls - 1] + [self.calls] * (len(s.response_ids) - 1)
            return [dataclasses.replace(s, policy_version=self.calls - 1, info={**s.info, "token_versions": versions})]

    params = SamplingParams(temperature=1.0, max_new_tokens=4, seed=1)
    ex = AgentExecutor(Tagging(engine), tok, lambda: ScriptedEnv(Tracker(), done_at=3), max_turns=5, max_len=200,
                       params=params)
    [[s]] = ex.run([[5, 60, 70]])
    spans = s.info["action_spans"]
    expected = [t - 1 if i == 0 else t for t, (a, b) in enumerate(spans, start=1) for i in range(b - a)]
    assert s.info["token_versions"] == expected and len(expected) == sum(s.loss_mask)
    assert s.policy_version == 0 and s.info["turn_policy_versions"] == [0, 1, 2]
    plain = AgentExecutor(engine, tok, lambda: ScriptedEnv(Tracker(), done_at=2), max_turns=5, max_len=200,
                          params=params)
    [[u]] = plain.run([[5, 60, 70]])
    assert "token_versions" not in u.info


def test_environment_errors(engine, tok):
    params = SamplingParams(temperature=1.0, max_new_tokens=4, seed=1)
    tracker = Tracker()
    ex = AgentExecutor(engine, tok, lambda: ScriptedEnv(tracker, fail_at=2), max_turns=5, max_len=200, params=params)
    with pytest.raises(EnvStepError, match=r"ScriptedEnv\.step raised ZeroDivisionError: tool crashed at turn 2") as e:
        ex.run([[5, 60, 70]])
    assert isinstance(e.value.__cause__, ZeroDivisionError) and tracker.closed == 1
    ex = AgentExecutor(
        engine, tok, lambda: ScriptedEnv(tracker, fail_at=2), max_turns=5, max_len=200, params=params,
        env_error_reward=-1.0,
    )
    [[s]] = ex.run([[5, 60, 70]])
    assert s.finish_reason == "stop" and s.info["stop_cause"] == "env_error" and s.reward == 0.5 - 1.0
    assert s.info["env_error"] == "ZeroDivisionError: tool crashed (turn 2)" and s.info["turns"] == 2
    with pytest.raises(EnvStepError, match=r"CalculatorEnv\.reset raised ValueError: CalculatorEnv needs a label"):
        AgentExecutor(engine, tok, CalculatorEnv, max_turns=2, max_len=50, params=params).run([[5, 6]])

    class Sloppy(ScriptedEnv):
        async def step(self, action_text):
            return ("obs", 0.0, False)

    with pytest.raises(TypeError, match="Sloppy.step returned tuple at turn 1; return a StepResult"):
        AgentExecutor(engine, tok, lambda: Sloppy(tracker), max_turns=2, max_len=50, params=params).run([[5, 6]])


def test_executor_validates(engine, tok):
    with pytest.raises(TypeError, match="no agenerate"):
        AgentExecutor(object(), tok, CalculatorEnv, max_turns=1, max_len=10)
    with pytest.raises(ValueError, match="max_turns must be >= 1"):
        AgentExecutor(engine, tok, CalculatorEnv, max_turns=0, max_len=10)
    with pytest.raises(ValueError, match="prompt_ids is empty"):
        AgentRequest([])
    ex = AgentExecutor(engine, tok, CalculatorEnv, max_turns=1, max_len=10)

    async def inside_loop():
        ex.run([[5]])

    with pytest.raises(RuntimeError, match="await executor.arun"):
        asyncio.run(inside_loop())


@pytest.mark.parametrize(
    "expr,value",
    [("2+3*4", 14), ("(1+2)**3", 27), ("7/2", 3.5), ("-3+ +1", -2), ("2**-1", 0.5), (" 1.5e2 ", 150.0)]
    + [("10**99", 10**99)],
)
def test_safe_eval_values(expr, value):
    got = safe_eval(expr)
    assert got == value and type(got) is type(value)


@pytest.mark.parametrize(
    "expr,why",
    [
        ("__import__('os').system('true')", "Call is not allowed"),
        ("a+1", "Name is not allowed"),
        ("(1).__class__", "Attribute is not allowed"),
        ("[1, 2]", "List is not allowed"),
        ("1 if 1 else 2", "IfExp is not allowed"),
        ("True+1", "Constant is not allowed"),
        ("'a'*3", "Constant is not allowed"),
        ("7//2", "BinOp is not allowed"),
        ("1/0", "division by zero"),
        ("2**1000", "exponent 1000"),
        ("10**99*10**99", "larger than"),
        ("1e300*1e300", "larger than"),
        ("(-8)**0.5", "fractional power"),
        ("1+", "not an arithmetic expression"),
        ("1" * 201, "201 characters"),
    ],
)
def test_safe_eval_refuses(expr, why):
    with pytest.raises(CalcError, match=why):
        safe_eval(expr)


def test_calculator_env_steps():
    async def episode():
        env = CalculatorEnv()
        assert await env.reset("what is 2+3*4?", label=14) is None
        calc = await env.step("let me compute <calc>2+3*4</calc>")
        bad = await env.step("<calc>__import__('os')</calc>")
        none = await env.step("I think so")
        right = await env.step("<answer> 14.0 </answer>")
        await env.reset(None, label="14")
        wrong = await env.step("<calc>1</calc><answer>15</answer>")
        return calc, bad, none, right, wrong

    calc, bad, none, right, wrong = asyncio.run(episode())
    assert calc == StepResult("<result>14</result>", 0.0, False, {"calc": "2+3*4", "result": "14"})
    assert bad.observation.startswith("<error>Call is not allowed") and not bad.done and bad.reward == 0.0
    assert none.observation.startswith("<error>no <calc>") and not none.done
    assert (right.reward, right.done) == (1.0, True)
    assert (wrong.reward, wrong.done, wrong.info["answer"]) == (0.0, True, "15")


class ScriptedPolicy:
    """A RolloutEngine whose turns are fixed texts (EOS appended): the policy's choices, scripted."""

    def __init__(self, tok, actions: list[str]):
        self.tok, self.actions, self.policy_version = tok, actions, 3
        self.contexts: list[list[int]] = []

    async def agenerate(self, request):
        self.contexts.append(list(request.prompt_token_ids))
        text = self.actions[min(len(self.contexts), len(self.actions)) - 1]
        ids = self.tok.encode(text, add_special_tokens=False)[: request.params.max_new_tokens - 1]
        ids.append(self.tok.eos_token_id)
        return [RolloutSample(list(request.prompt_token_ids), ids, [-0.25] * len(ids), [1] * len(ids), "stop", 3)]

    def generate(self, requests):
        return [asyncio.run(self.agenerate(r)) for r in requests]

    def update_weights(self, named_tensors, version):
        self.policy_version = version

    def sleep(self, level=1): ...

    def wake_up(self, tags=None): ...

    def shutdown(self): ...


def calc_executor(tok, policy, max_turns=4):
    return AgentExecutor(
        policy, tok, CalculatorEnv, max_turns=max_turns, max_len=400,
        params=SamplingParams(max_new_tokens=64, stop_token_ids=[tok.eos_token_id]),
        format_observation=ChatTurnFormat.from_tokenizer(tok),
    )


def test_calculator_episode_end_to_end(tok):
    policy = ScriptedPolicy(tok, ["<calc>2+3*4</calc>", "<answer>14</answer>"])
    assert isinstance(policy, RolloutEngine)
    prompt = chat_prompt(tok, "What is 2+3*4?")
    [[s]] = calc_executor(tok, policy).run([AgentRequest(prompt, prompt="What is 2+3*4?", label=14)])
    assert s.reward == 1.0 and s.finish_reason == "stop" and s.info["turns"] == 2 and s.policy_version == 3
    eos = [tok.eos_token_id]
    a1, a2 = tok.encode("<calc>2+3*4</calc>") + eos, tok.encode("<answer>14</answer>") + eos
    obs = tok.encode("\n<|im_start|>tool\n<result>14</result><|im_end|>\n<|im_start|>assistant\n")
    assert s.response_ids == a1 + obs + a2
    assert s.loss_mask == [1] * len(a1) + [0] * len(obs) + [1] * len(a2)
    assert s.rollout_logprobs == [-0.25] * len(a1) + [0.0] * len(obs) + [-0.25] * len(a2)
    assert policy.contexts == [prompt, prompt + a1 + obs], "each turn must see the whole token context"
    assert s.info["env_info"][0] == {"calc": "2+3*4", "result": "14"}


def test_calculator_wrong_answer_and_max_turns_pay_nothing(tok):
    [[wrong]] = calc_executor(tok, ScriptedPolicy(tok, ["<answer>15</answer>"])).run([AgentRequest([5, 6], label=14)])
    assert (wrong.reward, wrong.finish_reason, wrong.info["turns"]) == (0.0, "stop", 1)
    policy = ScriptedPolicy(tok, ["<calc>1+1</calc>"])
    [[stuck]] = calc_executor(tok, policy, max_turns=3).run([AgentRequest([5, 6], label=2)])
    assert (stuck.reward, stuck.finish_reason, stuck.info["stop_cause"]) == (0.0, "length", "max_turns")
    assert stuck.info["turn_rewards"] == [0.0, 0.0, 0.0] and len(policy.contexts) == 3
