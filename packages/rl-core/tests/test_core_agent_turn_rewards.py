"""``--agent_turn_rewards`` on the tensors: each step reward lands on the last token of the policy turn it
answers (earlier turns as token rewards, the last turn's in the scalar score), the returns differ from the
sum-on-the-last-token variant as they should, and the estimators that compare one scalar per sample refuse it.
"""

from __future__ import annotations

import pytest
import torch
from rl_algos import compute_advantages

from rl_core.rl.experience import collate, make_item
from rl_core.trainers.ppo import PPOConfig
from rl_core.trainers.ppo_rollout import place_turn_rewards
from rl_rollout import RolloutSample


def episode(prompt_len, turns, rewards, env_len=2):
    """Policy turns of the given lengths with ``env_len`` observation tokens between them; one reward per step."""
    response, mask, spans = [], [], []
    for i, n in enumerate(turns):
        if i:
            response += [9] * env_len
            mask += [0] * env_len
        spans.append([len(response), len(response) + n])
        response += [5] * n
        mask += [1] * n
    s = RolloutSample(prompt_ids=[1] * prompt_len, response_ids=response, rollout_logprobs=[], loss_mask=mask,
                      finish_reason="stop", policy_version=0, reward=sum(rewards),
                      info={"action_spans": spans, "turn_rewards": list(rewards)})
    return s, make_item(s.prompt_ids, s.response_ids, s.loss_mask)


def test_step_rewards_land_on_each_turns_last_token_and_the_returns_follow():
    # a: three turns, three steps; b: the last turn cut by max_len (no step after it); c: one turn
    a, b, c = episode(3, [2, 3, 1], [0.5, -0.25, 1.0]), episode(2, [1, 2], [2.0]), episode(4, [3], [0.75])
    samples, items = [x[0] for x in (a, b, c)], [x[1] for x in (a, b, c)]
    totals = torch.tensor([s.reward for s in samples])
    placed = place_turn_rewards(samples, items)
    assert placed.tolist() == [0.25, 2.0, 0.0]
    scalar = totals - placed  # what stays in the score: the last turn's reward
    assert scalar.tolist() == [1.0, 0.0, 0.75]
    b_ = collate(items, 0, ("turn_rewards",))
    mask = b_.loss_mask_BT.float()
    tr = b_.token("turn_rewards")
    # a: prompt 3, turn 1 at response 0..2 -> last token at 3+1; turn 2 at 4..7 -> last token 3+6
    assert tr[0].nonzero().flatten().tolist() == [4, 9] and tr[0, [4, 9]].tolist() == [0.5, -0.25]
    assert tr[1].nonzero().flatten().tolist() == [2] and tr[1, 2].item() == 2.0  # b: turn 1's last token
    assert not tr[2].any()
    assert torch.all(tr * (1 - mask) == 0)  # never on an environment or prompt token

    per_turn = compute_advantages("reinforce", scalar, mask, token_rewards_BT=tr, gamma=1.0)
    at_end = compute_advantages("reinforce", totals, mask, gamma=1.0)
    R, E = per_turn.returns[0], at_end.returns[0]
    assert R[[3, 4]].tolist() == pytest.approx([1.25, 1.25])  # turn 1 sees every reward from its turn on
    assert R[[7, 8, 9]].tolist() == pytest.approx([0.75] * 3)  # turn 2: its own and the last turn's
    assert R[12].item() == pytest.approx(1.0)  # the last turn: its own
    assert torch.allclose(E[mask[0] == 1], torch.full_like(E[mask[0] == 1], 1.25))  # the sum, everywhere
    assert R[3].item() == pytest.approx(E[3].item())  # the first token sees the whole episode either way
    assert per_turn.returns[1, 2].item() == pytest.approx(2.0) and per_turn.returns[1, 5].item() == 0.0
    assert torch.allclose(per_turn.returns[2], at_end.returns[2])  # one turn: nothing changes

    # discounted: turn 1's last token gets r1 + gamma^k (later rewards), not gamma^k times the sum
    g = 0.9
    d_turn = compute_advantages("reinforce", scalar, mask, token_rewards_BT=tr, gamma=g).returns[0]
    d_end = compute_advantages("reinforce", totals, mask, gamma=g).returns[0]
    assert d_turn[4].item() != pytest.approx(d_end[4].item())
    assert d_turn[12].item() == pytest.approx(1.0) and d_end[12].item() == pytest.approx(1.25)


def test_the_flag_is_refused_by_group_estimators_and_without_an_agent():
    PPOConfig.from_flat(agent_func_path="a.py", agent_turn_rewards=True, advantage_estimator="reinforce")
    PPOConfig.from_flat(agent_func_path="a.py", agent_turn_rewards=True, advantage_estimator="reinforce_baseline",
              n_samples_per_prompt=2)
    for est in ("group_norm", "rloo", "dr_grpo"):
        with pytest.raises(ValueError, match=f"--advantage_estimator {est} .*use gae, reinforce, reinforce_baseline"):
            PPOConfig.from_flat(agent_func_path="a.py", agent_turn_rewards=True, advantage_estimator=est,
                      n_samples_per_prompt=2)
    with pytest.raises(ValueError, match="add --agent_func_path"):
        PPOConfig.from_flat(agent_turn_rewards=True, advantage_estimator="reinforce")
