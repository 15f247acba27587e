"""``agent_func_path``: multi-turn episodes in the RL loop (tiny model, CPU, real DeepSpeed and HFEngine).

The environment is a two-turn letter game written in OpenRLHF's agent form (its file imports
``openrlhf.utils.agent``, which is not installed here) and again in our ``Environment`` protocol.
Checked on the tensors the policy trains on: the environment's tokens have loss mask 0 and advantage 0,
every policy token carries the episode's group-normalised reward; the reward rises; async works too. With
``agent_turn_rewards`` each step reward sits on its own turn's last token (the turns' advantages differ by it).
"""

from __future__ import annotations

import json

import pytest
import torch

from rl_core.data import DataConfig, PromptDataset, load_rows
from rl_core.rl.build import LocalFactory, RLModelConfig, RunConfig, build_run
from rl_core.strategy import StrategyConfig
from rl_core.trainers.ppo import PPOConfig
from rl_rollout import EngineConfig, WeightSyncConfig

pytestmark = [pytest.mark.timeout(900), pytest.mark.slow]
FEEDBACK = " again: "

OPENRLHF_AGENT = f'''
import torch
from openrlhf.utils.agent import AgentExecutorBase, AgentInstanceBase


class AgentInstance(AgentInstanceBase):
    def __init__(self, *args, **kwargs):
        self.turn = 0

    async def reset(self, states: dict, **kwargs):
        return {{"observation": states["observation"]}}

    async def step(self, states: dict, **kwargs):
        self.turn += 1
        hits = min(states["action_text"].count(states["label"]), 4) / 4
        done = self.turn >= 2
        return {{"rewards": torch.tensor([hits / 2]), "scores": torch.tensor([hits / 2]),
                "environment_feedback": "" if done else {FEEDBACK!r}, "done": done,
                "sampling_params": states.get("sampling_params"), "extra_logs": {{"hits": torch.tensor(hits)}}}}
'''

OUR_ENV = f'''
from rl_rollout.agents import StepResult


class LetterGame:
    async def reset(self, prompt, label, **info):
        self.label, self.turn = label, 0
        return None

    async def step(self, action_text):
        self.turn += 1
        hits = min(action_text.count(self.label), 4) / 4
        return StepResult({FEEDBACK!r}, reward=hits / 2, done=self.turn >= 2)


def make_env():
    return LetterGame()
'''


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from transformers import AutoTokenizer

    from rl_rollout.testing import make_tiny_model

    root = tmp_path_factory.mktemp("ppo-agent")
    model = make_tiny_model(root / "tiny")
    (root / "prompts.jsonl").write_text(
        "".join(json.dumps({"p": f"Repeat the letter {c}: ", "y": c}) + "\n" for c in "abcd"))
    (root / "agent_openrlhf.py").write_text(OPENRLHF_AGENT)
    (root / "agent_ours.py").write_text(OUR_ENV)
    tok = AutoTokenizer.from_pretrained(model)
    prompts = PromptDataset(load_rows(str(root / "prompts.jsonl")), tok, DataConfig(input_key="p", label_key="y"))
    return root, model, tok, prompts


def build(setup, tmp_path, agent, **cfg):
    root, model, tok, prompts = setup
    kw = dict(advantage_estimator="group_norm", n_samples_per_prompt=8, rollout_batch_size=4, generate_max_len=4,
              max_iterations=2, init_kl_coef=0.0, max_epochs=2, agent_func_path=str(root / agent), agent_max_turns=3,
              agent_max_len=64, run_dir=str(tmp_path / "run"))
    kw.update(cfg)
    s = StrategyConfig(zero_stage=0, bf16=False, micro_train_batch_size=16, train_batch_size=32, learning_rate=3e-3,
                       lr_warmup_ratio=0.0, lr_scheduler="constant", seed=0)
    return build_run(RunConfig(RLModelConfig(pretrain=str(model)), s, PPOConfig.from_flat(**kw), engine=EngineConfig(),
                               sync=WeightSyncConfig(verify=True)),
                     LocalFactory(engine_kind="hf"), prompts=prompts, tokenizer=tok)


def record(trainer):
    """What each iteration trains on: the samples and the items after advantages (wrapping the real methods)."""
    seen = []
    generate, advantages = trainer.sampler.generate, trainer.experience.advantages

    def _generate(prompts, seed):
        samples = generate(prompts, seed)
        seen.append({"samples": samples})
        return samples

    def _advantages(items, scores, fresh=None):  # batch k's (async: the producer may have generated k+1 already)
        out = advantages(items, scores, fresh)
        next(x for x in seen if "items" not in x).update(items=items, scores=scores.clone())
        return out

    trainer.sampler.generate, trainer.experience.advantages = _generate, _advantages
    return seen


def check_tensors(seen, tok, n=8):
    for it in (x for x in seen if "items" in x):
        samples, items, scores = it["samples"], it["items"], it["scores"]
        assert torch.equal(scores, torch.tensor([s.reward for s in samples]))  # the episode reward is the score
        expected_PG = (scores.view(-1, n) - scores.view(-1, n).mean(1, keepdim=True)) / (
            scores.view(-1, n).std(1, keepdim=True) + 1e-9)
        feedback_ids = tok.encode(FEEDBACK, add_special_tokens=False)
        multi_turn = 0
        for s, item, adv in zip(samples, items, expected_PG.flatten().tolist(), strict=True):
            P = len(s.prompt_ids)
            mask = torch.tensor(item.loss_mask_T[P:])
            a = item.advantages_T[P:]
            actions = torch.zeros(len(s.response_ids), dtype=torch.long)
            for start, end in s.info["action_spans"]:
                actions[start:end] = 1
            assert torch.equal(mask, actions), (mask, s.info["action_spans"])  # env tokens: mask 0
            assert torch.all(a[mask == 0] == 0)  # no advantage on the environment's tokens
            assert torch.allclose(a[mask == 1], torch.full_like(a[mask == 1], adv), atol=1e-5)
            if s.info["turns"] == 2:  # the feedback sits between the two policy turns, masked
                multi_turn += 1
                (_, e1), (s2, _) = s.info["action_spans"]
                assert s.response_ids[e1:s2] == feedback_ids and mask[e1:s2].sum() == 0
        assert multi_turn > len(samples) // 2


def test_openrlhf_agent_file_trains_with_env_tokens_masked_and_the_episode_reward_in_the_advantages(setup, tmp_path):
    root, model, tok, prompts = setup
    run = build(setup, tmp_path, "agent_openrlhf.py", max_iterations=14)
    seen = record(run.trainer)
    try:
        history = run.trainer.fit()
    finally:
        run.close()
    check_tensors(seen, tok)
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert all(1 <= r["rl/agent/turns"] <= 2 and r["rl/agent/env_tokens"] > 0 for r in rows)
    assert all("rl/agent_extra/hits" in r for r in rows)
    rewards = [m["reward_mean"] for m in history]
    assert sum(rewards[-4:]) / 4 > sum(rewards[:4]) / 4 + 0.04, rewards


def test_our_environment_protocol_and_async_train(setup, tmp_path):
    root, model, tok, prompts = setup
    run = build(setup, tmp_path, "agent_ours.py", max_iterations=3, async_train=True)
    seen = record(run.trainer)
    try:
        history = run.trainer.fit()
    finally:
        run.close()
    check_tensors(seen, tok)
    assert all(m["staleness_violations"] == 0 and m["staleness_max"] <= 1 for m in history)


def test_turn_rewards_land_on_each_policy_turns_last_token_in_a_run(setup, tmp_path):
    """--agent_turn_rewards with reinforce (gamma 1, advantages centred, not scaled): a 2-turn episode's first
    turn carries the return r1 + r2, its second r2, so their advantages differ by exactly r1; the sum-at-the-end
    variant would give both turns the same advantage. The score keeps the last turn's reward."""
    root, model, tok, prompts = setup
    run = build(setup, tmp_path, "agent_ours.py", max_iterations=1, advantage_estimator="reinforce",
                agent_turn_rewards=True, no_advantage_std_norm=True)
    seen = record(run.trainer)
    try:
        run.trainer.fit()
    finally:
        run.close()
    (it,) = seen
    differs = 0
    for s, item, score in zip(it["samples"], it["items"], it["scores"].tolist(), strict=True):
        assert item.turn_rewards_T is None  # a loop-side tensor, not sent to the workers to train on
        P = len(s.prompt_ids)
        a = item.advantages_T[P:]
        r = s.info["turn_rewards"]
        assert s.info["turns"] == 2 and len(r) == 2
        assert score == pytest.approx(r[1])
        (s1, e1), (s2, e2) = s.info["action_spans"]
        first, second = a[s1:e1], a[s2:e2]
        for turn in (first, second):  # gamma 1: one return per turn
            assert torch.allclose(turn, turn[:1].expand_as(turn))
        assert first[0].item() - second[0].item() == pytest.approx(r[0], abs=1e-5)
        assert torch.all(a[e1:s2] == 0)  # the environment's tokens
        differs += r[0] != 0
    assert differs > 0  # some first turns earned a reward of their own


def test_distillation_teacher_signal_stays_off_the_environments_tokens(setup, tmp_path):
    """On-policy distillation with an agent (``teacher_pretrain``, advantage mode): every policy token's advantage
    is the episode's group-normalised reward plus the token's teacher gap (teacher - student log-prob) whitened
    over the batch's policy tokens only; the environment's tokens carry no advantage, and their teacher gap
    enters neither the whitening nor the logged reverse KL."""
    from rl_algos import masked_mean, masked_whiten
    from rl_rollout.testing import make_tiny_model

    root, model, tok, prompts = setup
    teacher = make_tiny_model(tmp_path / "teacher", seed=1)
    run = build(setup, tmp_path, "agent_ours.py", max_iterations=2, teacher_pretrain=str(teacher), distill_coef=0.5)
    seen = record(run.trainer)
    try:
        history = run.trainer.fit()
    finally:
        run.close()
    n = 8
    for it, m in zip((x for x in seen if "items" in x), history, strict=True):
        samples, items, scores = it["samples"], it["items"], it["scores"]
        episode = ((scores.view(-1, n) - scores.view(-1, n).mean(1, keepdim=True)) / (
            scores.view(-1, n).std(1, keepdim=True) + 1e-9)).flatten()
        resp = [(len(s.prompt_ids), torch.tensor(item.loss_mask_T[len(s.prompt_ids):]).float())
                for s, item in zip(samples, items, strict=True)]
        T = max(len(mk) for _, mk in resp)

        def pad(rows):
            return torch.stack([torch.nn.functional.pad(r, (0, T - len(r))) for r in rows])

        mask = pad([mk for _, mk in resp])
        gap = pad([(item.teacher_logprobs_T[P:] - item.old_logprobs_T[P:]).float()
                   for (P, _), item in zip(resp, items, strict=True)])
        assert (gap.abs() * (1 - mask)).sum() > 0  # the teacher did score the environment's tokens...
        whitened = masked_whiten(gap, mask) * mask  # ...but they are outside the whitening's statistics
        expected = (episode.unsqueeze(1) + 0.5 * whitened) * mask
        got = pad([item.advantages_T[P:].float() for (P, _), item in zip(resp, items, strict=True)])
        assert torch.allclose(got, expected, atol=1e-4), (got - expected).abs().max()
        assert torch.all(got[mask == 0] == 0)  # no advantage on the environment's tokens
        assert m["distill/reverse_kl"] == pytest.approx(masked_mean(-gap, mask).item(), abs=1e-5)
