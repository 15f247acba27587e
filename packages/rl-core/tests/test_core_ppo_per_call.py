"""Every call of a per-call agent episode trains (:mod:`rl_core.trainers.ppo_per_call`): one item per call with
mask 1 exactly on its sampled ids and the episode's advantage (GRPO's group baseline counting the episode once);
the layout over data-parallel ranks; and on a tiny model with real DeepSpeed, one optimizer step on the calls as
separate items equals the step on the same episode merged into one sequence (token-mean loss, same weights)."""

from __future__ import annotations

import pytest
import torch

from rl_core.rl import PolicyObjective, PolicyWorker
from rl_core.rl.experience import dp_order, make_item
from rl_core.strategy import StrategyConfig
from rl_core.trainers.ppo import PPOConfig
from rl_core.trainers.ppo_experience import ExperienceMaker, GapAlarm
from rl_core.trainers.ppo_per_call import EARLIER_CALLS, EpisodeItems, train_layout
from rl_rollout.types import RolloutSample

pytestmark = [pytest.mark.timeout(300)]


def sample(prompt, response, earlier=()):
    s = RolloutSample(list(prompt), list(response), [-0.5] * len(response), [1] * len(response), "stop", 0)
    if earlier:
        s.info[EARLIER_CALLS] = [
            {"prompt_ids": p, "response_ids": r, "loss_mask": [1] * len(r), "rollout_logprobs": [-0.5] * len(r)}
            for p, r in earlier
        ]
    return s


def items_of(samples):
    return [make_item(s.prompt_ids, s.response_ids, s.loss_mask, s.rollout_logprobs) for s in samples]


def test_per_call_items_carry_the_episodes_group_normalised_advantage():
    # 2 prompts x 2 episodes; slot 1 is per-call: 3 calls whose prompts do not extend each other (history rewritten)
    samples = [
        sample([1, 2], [3, 4, 5]),
        sample([9, 8, 7], [6], earlier=[([1, 2], [10, 11]), ([4, 4, 4, 4], [12, 13, 14])]),
        sample([1, 3], [5, 5]),
        sample([1, 3], [6, 6, 6]),
    ]
    scores = torch.tensor([1.0, 0.0, 0.5, 0.25])
    calls = EpisodeItems.of(samples, items_of(samples))
    assert calls.added == 2 and calls.slot_of == [0, 1, 1, 1, 2, 3]
    c = PPOConfig.from_flat(advantage_estimator="group_norm", n_samples_per_prompt=2, init_kl_coef=0.0)
    maker = ExperienceMaker(c, policy=None, ref=None, critic=None, sharded=lambda *a: [], parallel=False,
                            on_policy=True, pad_id=0, kl=None, gap_alarm=GapAlarm(0.0))
    rows = calls.episode_rows()
    assert len(rows) == 4 and rows[1].loss_mask_T == [0, 0] + [1] * 6  # the calls' sampled ids end to end
    maker.advantages(rows, scores)
    calls.split(rows)
    # GRPO over episodes: (r - mean) / (std + eps) within each prompt's 2 episodes, each episode once
    std = torch.tensor([1.0, 0.0]).std().item()
    want = [(1.0 - 0.5) / (std + 1e-6), (0.0 - 0.5) / (std + 1e-6)]
    want_calls = [want[0], want[1], want[1], want[1]]
    for item, a in zip(calls.items[:4], want_calls, strict=True):
        m = torch.tensor(item.loss_mask_T, dtype=torch.float32)
        assert item.loss_mask_T == [0] * item.prompt_len + [1] * (item.T - item.prompt_len)
        assert torch.allclose(item.advantages_T, m * a, atol=1e-5), (item.advantages_T, a)
    assert [x.input_ids_T for x in calls.items[1:4]] == [[1, 2, 10, 11], [4, 4, 4, 4, 12, 13, 14], [9, 8, 7, 6]]
    # counted per call, slot 1's three calls would have pulled the group's mean and std: not so
    assert abs(calls.items[1].advantages_T[-1].item() + 0.7071) < 1e-3


def test_train_layout_is_dp_order_without_calls_and_pads_each_ranks_slice():
    assert train_layout(list(range(8)), 8, 4, 2) == (dp_order(8, 4, 2), 2)
    # slots 0..3, global batch 4 over 2 ranks: slot 1 has 3 calls (items 1, 2, 3)
    order, L = train_layout([0, 1, 1, 1, 2, 3], 4, 4, 2)
    assert L == 4  # rank 0: slots 0, 1 -> items 0, 1, 2, 3; rank 1: slots 2, 3 -> items 4, 5 + 2 pads
    assert order == [0, 1, 2, 3, 4, 5, None, None]


def test_one_step_on_the_calls_equals_the_step_on_the_merged_episode(tmp_path):
    """Real DeepSpeed, tiny model: the same episode (call 2's prompt = call 1's prompt + sampled ids + 2 program
    tokens) trained as 2 per-call items or as 1 merged sequence gives the same token-mean loss and weights."""
    from rl_rollout.testing import make_tiny_model

    model = make_tiny_model(tmp_path / "tiny")
    p1, r1, env, r2 = [11, 12, 13, 14, 15], [21, 22, 23], [31, 32], [41, 42, 43, 44]
    other = make_item([11, 12], [51, 52])
    a = {0: 0.7, 1: -0.3}  # the episodes' advantages

    def worker():
        s = StrategyConfig(zero_stage=0, bf16=False, micro_train_batch_size=1, train_batch_size=2, learning_rate=1.0,
                           lr_warmup_ratio=0.0, lr_scheduler="constant", seed=3, adam_eps=1.0)
        c = PPOConfig.from_flat(advantage_estimator="group_norm", n_samples_per_prompt=2, init_kl_coef=0.0)
        return PolicyWorker(s, str(model), PolicyObjective.of(c), 1, load_kw={"dtype": "fp32"}, pad_id=0)

    def step(items, local=None):
        w = worker()
        w0 = torch.cat([p.detach().flatten() for p in w.engine.parameters()])
        for it in items:
            it.old_logprobs_T = w.logprobs([it])[0]
        loss = w.train(items, local_batch=local)[0]["policy_loss"]
        return w0, loss, torch.cat([p.detach().flatten() for p in w.engine.parameters()])

    merged = make_item(p1, r1 + env + r2, [1] * 3 + [0] * 2 + [1] * 4)
    samples = [sample(p1 + r1 + env, r2, earlier=[(p1, r1)]), sample([11, 12], [51, 52])]
    calls = EpisodeItems.of(samples, items_of(samples))
    rows = calls.episode_rows()
    for b, row in enumerate(rows):
        row.advantages_T = torch.tensor(row.loss_mask_T, dtype=torch.float32) * a[b]
    calls.split(rows)
    for it, b in ((merged, 0), (other, 1)):
        it.advantages_T = torch.tensor(it.loss_mask_T, dtype=torch.float32) * a[b]
    ordered, local = calls.train_order(2, 1, pad_id=0)
    assert local == 3 and [len(x.input_ids_T) for x in ordered] == [8, 14, 4]
    w0, loss_m, w_m = step([merged, other])
    _, loss_c, w_c = step(ordered, local)
    assert loss_c == pytest.approx(loss_m, rel=1e-5, abs=1e-7) and loss_m != 0.0
    assert (w_m - w0).abs().max().item() > 1e-4  # the step moved the weights
    # adam_eps 1: the update is about lr x the gradient, so equal weights mean equal gradients
    assert torch.allclose(w_c, w_m, atol=1e-6, rtol=0), (w_c - w_m).abs().max()
