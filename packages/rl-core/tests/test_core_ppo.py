"""PPOTrainer end to end on CPU over in-process worker groups: real DeepSpeed, a real HFEngine
receiving the weights, a RewardRunner; PPO with a critic (GAE), GRPO, dynamic filtering, resume."""

from __future__ import annotations

import json
import math
import re

import pytest
import torch

from rl_core.data import DataConfig, PromptDataset, load_rows
from rl_core.preflight import InputError
from rl_core.rl import (
    CriticObjective,
    CriticWorker,
    Experience,
    LocalGroup,
    PolicyObjective,
    PolicyWorker,
    collate,
    dp_order,
    make_item,
    rows,
)
from rl_core.rl.batching import MicroBatchConfig
from rl_core.rl.build import LocalFactory, RLModelConfig, RunConfig, build_run
from rl_core.strategy import StrategyConfig
from rl_core.trainers.ppo import PPOConfig, PPOTrainer
from rl_rollout import WeightSyncConfig

pytestmark = [pytest.mark.timeout(900), pytest.mark.slow]
LETTERS = "abcd"


def letter_reward(prompt, response, label, **info):
    if response.startswith("!"):
        raise RuntimeError("a reward function bug")  # the runner turns this into the fallback, counted
    return min(response.count(label), 8) / 8


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from transformers import AutoTokenizer

    from rl_rollout.testing import make_tiny_model

    root = tmp_path_factory.mktemp("ppo")
    model = make_tiny_model(root / "tiny")
    (root / "prompts.jsonl").write_text(
        "".join(json.dumps({"p": f"Repeat the letter {c}: ", "y": c}) + "\n" for c in LETTERS))
    tok = AutoTokenizer.from_pretrained(model)
    prompts = PromptDataset(load_rows(str(root / "prompts.jsonl")), tok, DataConfig(input_key="p", label_key="y"))
    return model, tok, prompts


def make(setup, tmp_path, *, reward=letter_reward, lr=2e-3, zero_stage=0, batching=None, seed=42, **cfg):
    """A run from rl-core's one builder over in-process groups: policy (+ critic for gae, + reference when
    init_kl_coef > 0), an HFEngine in this process."""
    from rl_rollout import RewardRunner

    model, tok, prompts = setup
    kw = dict(n_samples_per_prompt=4, rollout_batch_size=4, generate_max_len=8, max_iterations=2,
              run_dir=str(tmp_path / "run"))
    kw.update(cfg)
    c = PPOConfig.from_flat(**kw)
    G = c.rollout_batch_size * c.sampling.n_samples_per_prompt
    s = StrategyConfig(zero_stage=zero_stage, bf16=False, micro_train_batch_size=G // 2, train_batch_size=G,
                       learning_rate=lr, lr_warmup_ratio=0.0, lr_scheduler="constant", seed=seed)
    runner = RewardRunner(reward, workers=0, fallback=0.0)
    run = build_run(RunConfig(RLModelConfig(pretrain=str(model)), s, c, sync=WeightSyncConfig(verify=True),
                              batching=batching or MicroBatchConfig()),
                    LocalFactory(engine_kind="hf"),
                    prompts=prompts, tokenizer=tok, reward_fn=runner)
    return run.trainer, run.rollout, runner


def test_dp_order_gives_every_rank_its_slice_of_each_global_batch():
    order = dp_order(8, 4, 2)  # two global batches [0..3] [4..7], two ranks
    assert order == [0, 1, 4, 5, 2, 3, 6, 7]
    shards = [order[:4], order[4:]]
    for g in range(2):  # global batch g is the union of each rank's g-th local batch
        assert sorted(shards[0][2 * g:2 * g + 2] + shards[1][2 * g:2 * g + 2]) == list(range(4 * g, 4 * g + 4))
    assert dp_order(8, 4, 1) == list(range(8))
    with pytest.raises(ValueError, match="multiple of the global batch 3"):
        dp_order(8, 3, 1)


def test_items_pad_and_cut_back_to_their_lengths():
    a = make_item([5, 6], [7, 8, 9], [1, 1, 0], rollout_logprobs=[-0.1, -0.2, -0.3])
    b = make_item([5], [7])
    batch = collate([a, b], pad_id=0, fields=("rollout_logprobs",))
    assert batch.input_ids_BT.tolist() == [[5, 6, 7, 8, 9], [5, 7, 0, 0, 0]]
    assert batch.loss_mask_BT.tolist() == [[0, 0, 1, 1, 0], [0, 1, 0, 0, 0]]
    assert batch.attention_mask_BT.sum(1).tolist() == [5, 2]
    torch.testing.assert_close(batch.token("rollout_logprobs")[0, 2:], torch.tensor([-0.1, -0.2, -0.3]))
    assert batch.token("rollout_logprobs")[1].abs().sum() == 0  # b has none: zeros
    assert [len(r) for r in rows(batch.input_ids_BT.float(), [a, b])] == [5, 2]
    with pytest.raises(ValueError, match="3 rollout logprobs for 2 response tokens"):
        make_item([1], [2, 3], rollout_logprobs=[0.0, 0.0, 0.0])


def test_experience_record_is_typed_checked_and_picklable():
    """Items are typed records (shape-suffixed fields): a misspelt field, a wrong length or a field the batch
    was not collated with fail loudly, and a record survives pickling as it does on its way to a Ray actor."""
    import pickle

    it = make_item([5, 6], [7, 8, 9])
    assert (it.T, it.prompt_len, it.loss_mask_T) == (5, 2, [0, 0, 1, 1, 1])
    with pytest.raises(TypeError, match="not subscriptable"):
        it["advantages"]  # the dict items of rl-core <= 0.19
    with pytest.raises(AttributeError):
        it.advantage_T = torch.zeros(5)  # slots: a misspelt field is an error, not a new key
    with pytest.raises(ValueError, match="advantages_T has 4 values for a 5-token item"):
        it.set_token("advantages", torch.zeros(4))
    with pytest.raises(ValueError, match="3 loss-mask entries for 2 tokens"):
        Experience(input_ids_T=[1, 2], prompt_len=1, loss_mask_T=[0, 1, 1])
    it.set_token("advantages", torch.arange(5.0))
    back = pickle.loads(pickle.dumps(it))
    assert back.input_ids_T == it.input_ids_T and torch.equal(back.advantages_T, it.advantages_T)
    batch = collate([it, back], pad_id=0, fields=("advantages",))
    with pytest.raises(KeyError, match="collated without 'values'"):
        batch.token("values")
    with pytest.raises(ValueError, match="no per-token field 'value'"):
        collate([it], pad_id=0, fields=("value",))  # type: ignore[arg-type]
    moved = batch.to(lambda t: t * 2)
    assert moved.values_BT is None and moved.advantages_BT.tolist()[0] == [0, 2, 4, 6, 8]


def test_ppo_with_a_critic_trains_syncs_bit_exact_weights_and_logs(setup, tmp_path):
    trainer, engine, runner = make(setup, tmp_path, advantage_estimator="gae", max_iterations=4, init_kl_coef=0.01)
    history = trainer.fit()
    assert len(history) == 4 and engine.policy_version == 4
    trained = dict(trainer.policy.worker.engine.module.model.named_parameters())
    served = dict(engine.model.named_parameters())
    assert set(trained) == set(served)
    for name, p in trained.items():
        torch.testing.assert_close(served[name], p.detach(), rtol=0, atol=0)
    for m in history:  # the engine sampled with the weights the policy then recomputed: same logprobs
        assert m["rollout_logprob_gap"] < 1e-4, m
    assert history[0]["kl"] < 1e-6 < history[-1]["kl"]  # starts at the reference, then moves away
    for k in ("value_mean", "return_mean", "policy_loss", "clip_fraction", "generate_s", "sync_s", "kl_coef"):
        assert all(k in m for m in history), k
    lines = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == [1, 2, 3, 4] and "rl/critic_loss" in lines[0]
    assert runner.metrics()["reward/ok"] + runner.metrics()["reward/errors"] == 4 * 16


def test_the_critic_fits_the_returns_it_is_trained_on(setup):
    model, tok, _ = setup
    c = PPOConfig(value_clip=None, max_epochs=1)
    s = StrategyConfig(zero_stage=2, bf16=False, micro_train_batch_size=2, train_batch_size=4, learning_rate=1e-3,
                       lr_warmup_ratio=0.0, lr_scheduler="constant")
    critic = CriticWorker(s, model, CriticObjective.of(c), 20, load_kw={"dtype": "fp32"}, pad_id=tok.pad_token_id)
    items = [make_item(tok.encode(f"Repeat the letter {x}: "), tok.encode(x * 4)) for x in LETTERS]
    for it, target in zip(items, (1.0, -1.0, 0.5, 0.0), strict=True):
        it.values_T = critic.values([it])[0]
        it.returns_T = torch.tensor(it.loss_mask_T, dtype=torch.float32) * target
    def error():
        v = critic.values(items)
        return sum(((v[i] - it.returns_T)[torch.tensor(it.loss_mask_T).bool()] ** 2).mean().item()
                   for i, it in enumerate(items)) / len(items)

    before = error()
    losses = [critic.train(items)[0]["critic_loss"] for _ in range(15)]
    assert losses[-1] < 0.3 * losses[0], losses
    assert error() < 0.5 * before, (before, error())  # measured: 0.56 -> 0.20


def test_the_critics_own_optimizer_settings_reach_its_engine_and_leave_the_actors(setup):
    """OpenRLHF's --critic.adam.* / --critic.lr_scheduler ...: read back from the DeepSpeed engines (AdamW's param
    groups, the schedule's multipliers, the clipping); the policy keeps the strategy's."""
    model, tok, _ = setup
    s = StrategyConfig(zero_stage=2, bf16=False, micro_train_batch_size=2, train_batch_size=4, learning_rate=1e-3,
                       lr_warmup_ratio=0.0, lr_scheduler="constant", weight_decay=0.0, max_norm=1.0)
    c = PPOConfig.from_flat(advantage_estimator="gae", critic_learning_rate=4e-3, critic_adam_betas=(0.8, 0.9),
                  critic_adam_eps=1e-6, critic_weight_decay=0.1, critic_lr_scheduler="cosine_with_min_lr",
                  critic_lr_warmup_ratio=0.5, critic_min_lr_ratio=0.2, critic_max_norm=0.5)
    kw = {"load_kw": {"dtype": "fp32"}, "pad_id": tok.pad_token_id}
    critic = CriticWorker(s, model, CriticObjective.of(c), 10, **kw)
    policy = PolicyWorker(s, model, PolicyObjective.of(c), 10, **kw)

    def read(engine):
        groups = engine.optimizer.optimizer.param_groups  # ZeRO-2's wrapper around our AdamW
        decays = sorted({g["weight_decay"] for g in groups})
        mult = [engine.lr_scheduler.lr_lambdas[0](k) for k in (0, 4, 5, 10)]
        return [*groups[0]["betas"], groups[0]["eps"], *decays, engine.lr_scheduler.base_lrs[0], *mult,
                engine.gradient_clipping()]  # flat, for pytest.approx

    # 10 steps, ceil(0.5 x 10) = 5 warming up: (k + 1) / 6, then cosine down to 0.2 at the last
    assert read(critic.engine) == pytest.approx([0.8, 0.9, 1e-6, 0.0, 0.1, 4e-3, 1 / 6, 5 / 6, 1.0, 0.2, 0.5])
    assert read(policy.engine) == pytest.approx([0.9, 0.95, 1e-8, 0.0, 1e-3, 1.0, 1.0, 1.0, 1.0, 1.0])
    for bad, match in (({"critic_lr_scheduler": "linear"}, r"critic_lr_scheduler .* 'linear' .* valid: cosine"),
                       ({"critic_adam_betas": (0.9, 1.0)}, r"critic_adam_betas .* \[0, 1\)"),
                       ({"critic_lr_warmup_ratio": 1.0}, r"critic_lr_warmup_ratio .* \[0, 1\)"),
                       ({"critic_max_norm": -1.0}, r"critic_max_norm .* >= 0")):
        with pytest.raises(ValueError, match=match):
            PPOConfig.from_flat(**bad)


def test_grpo_reward_rises_with_kl_as_a_loss(setup, tmp_path):
    trainer, engine, _ = make(setup, tmp_path, advantage_estimator="group_norm", n_samples_per_prompt=8,
                              max_iterations=12, max_epochs=2, init_kl_coef=0.001, use_kl_loss=True, lr=3e-3)
    assert trainer.critic is None and trainer.kl is None  # no critic; KL is a loss, not a reward penalty
    h = trainer.fit()
    first, last = sum(m["reward_mean"] for m in h[:3]) / 3, sum(m["reward_mean"] for m in h[-3:]) / 3
    assert last > first + 0.05, [round(m["reward_mean"], 3) for m in h]
    assert h[-1]["kl_loss"] > 0 and "kl_coef" not in h[-1]


def test_dynamic_filtering_drops_groups_without_signal_and_says_when_it_fills(setup, tmp_path, caplog):
    def constant_for_a(prompt, response, label, **info):
        return 1.0 if label == "a" else (sum(map(ord, response)) % 7) / 7  # varies between samples

    trainer, _, _ = make(setup, tmp_path, reward=constant_for_a, advantage_estimator="group_norm",
                         n_samples_per_prompt=4, rollout_batch_size=4, max_iterations=1, dynamic_filtering=True,
                         dynamic_filtering_reward_range=(0.0, 1.0), dynamic_filtering_max_rounds=3, init_kl_coef=0)
    with caplog.at_level("WARNING"):
        m = trainer.fit()[0]
    # the 'a' group (all 1.0) never passes; every other prompt's group passes only with reward variance
    assert m["dynamic/rounds"] >= 2 and 0 < m["dynamic/kept_fraction"] < 1
    assert m["dynamic/filled"] == 0 or "filtered-out groups fill the batch" in caplog.text

    def constant(prompt, response, label, **info):
        return 0.5

    trainer, _, _ = make(setup, tmp_path / "c", reward=constant, advantage_estimator="group_norm",
                         max_iterations=1, dynamic_filtering=True, dynamic_filtering_max_rounds=2, init_kl_coef=0)
    with caplog.at_level("WARNING"):
        m = trainer.fit()[0]
    assert (m["dynamic/rounds"], m["dynamic/filled"], m["dynamic/kept_fraction"]) == (2, 4, 0.0)
    assert "kept 0 of 4 groups in 2 rounds" in caplog.text


def test_dynamic_filtering_judges_the_raw_rewards_before_length_penalties(setup, tmp_path):
    """As OpenRLHF: a group whose every sample scored 1.0 carries no signal even when the overlong penalty
    makes the rewards differ by length; the penalties reach the rewards that train, not the filter."""
    from rl_rollout import RolloutSample

    trainer, _, _ = make(setup, tmp_path, reward=lambda p, r, label, **i: 1.0, advantage_estimator="group_norm",
                         dynamic_filtering=True, overlong_buffer_len=4, overlong_penalty_factor=1.0, init_kl_coef=0)
    samples = [RolloutSample([1, 2], [5] * k, [0.0] * k, [1] * k, "length", 0) for k in (3, 5, 7, 8)]
    scored = trainer.sampler.rewards([{"prompt": "Repeat the letter a: ", "label": "a"}], samples, [{}] * 4)
    assert len(set(scored.scores_B.tolist())) == 4 and scored.info["overlong_penalty_mean"] < 0  # penalised by length
    assert scored.filter_B.tolist() == [1.0] * 4  # what the filter judges


def test_resume_continues_onto_the_uninterrupted_run(setup, tmp_path, caplog):
    kw = dict(advantage_estimator="gae", init_kl_coef=0.01, max_iterations=4)
    full = make(setup, tmp_path / "full", **kw)[0].fit()
    make(setup, tmp_path / "a", **{**kw, "max_iterations": 2}, ckpt_path=str(tmp_path / "ck"), save_steps=2)[0].fit()
    assert sorted(p.name for p in (tmp_path / "ck" / "iter_00000002").iterdir()) == [
        "COMPLETE", "critic", "loop_state.json", "policy"]  # one folder, one marker
    resumed = make(setup, tmp_path / "b", **kw, ckpt_path=str(tmp_path / "ck"), load_checkpoint=True)[0]
    h = resumed.fit()
    assert len(h) == 4  # two restored from the checkpoint, two run
    for k in ("reward_mean", "kl", "critic_loss", "policy_loss"):
        for it in (2, 3):
            assert h[it][k] == pytest.approx(full[it][k], abs=1e-5), (k, it, h[it][k], full[it][k])
    done = make(setup, tmp_path / "d", **{**kw, "max_iterations": 2}, ckpt_path=str(tmp_path / "ck"),
                load_checkpoint=True)[0]  # issue 40: it printed "resumed at iteration 2 of 2" and trained nothing
    with pytest.raises(InputError, match=r"newest checkpoint under --ckpt_path .*ck is iteration 2, at or past this "
                                         r"run's last \(2\): nothing would train; raise --max_iterations"):
        done.fit()
    with pytest.raises(ValueError, match=r"already holds checkpoints of a run \(iter_00000002\).*--load_checkpoint"):
        make(setup, tmp_path / "c", **kw, ckpt_path=str(tmp_path / "ck"), save_steps=1)  # would mix two runs
    # issue 40 finding 6: other settings were accepted silently. The prompt order cannot change under a saved
    # cursor (refused before any role loads); a batch shape can, and is stated
    with pytest.raises(InputError, match=r"--seed is 7, the checkpoint's run had 42: the prompts are taken in an "
                                         r"order drawn from the seed"):
        make(setup, tmp_path / "e", **kw, ckpt_path=str(tmp_path / "ck"), load_checkpoint=True, seed=7)[0].fit()
    other = make(setup, tmp_path / "f", **{**kw, "max_iterations": 3, "rollout_batch_size": 2},
                 ckpt_path=str(tmp_path / "ck"), load_checkpoint=True, save_steps=100)[0]
    with caplog.at_level("WARNING", logger="rl_core.trainers.ppo"):
        assert len(other.fit()) == 3
    assert re.search(r"resumed with settings other than the checkpoint's, applied from iteration 3 on: "
                     r"rollout_batch_size 4 -> 2, train_batch_size 16 -> 8", caplog.text), caplog.text


def test_bad_settings_fail_before_training_with_the_fix(setup, tmp_path):
    with pytest.raises(ValueError, match=r"--n_samples_per_prompt >= 2"):
        PPOConfig.from_flat(advantage_estimator="rloo", n_samples_per_prompt=1)
    with pytest.raises(ValueError, match=r"needs ckpt_path"):
        PPOConfig.from_flat(load_checkpoint=True)
    with pytest.raises(ValueError, match=r"kl_estimator .* k1, k2 or k3"):
        PPOConfig.from_flat(kl_estimator="k4")
    model, tok, prompts = setup
    c = PPOConfig.from_flat(advantage_estimator="gae", init_kl_coef=0, rollout_batch_size=4, n_samples_per_prompt=2)
    s = StrategyConfig(zero_stage=0, bf16=False, micro_train_batch_size=3, train_batch_size=3)
    policy = LocalGroup(PolicyWorker(s, model, PolicyObjective.of(c), 1, load_kw={"dtype": "fp32"}), "policy")
    base = dict(policy=policy, rollout=None, weight_sync=None, prompts=prompts, tokenizer=tok, reward_fn=letter_reward)
    with pytest.raises(ValueError, match=r"--advantage_estimator gae needs a critic \(--critic_pretrain\)"):
        PPOTrainer(c, train_batch_size=8, **base)
    with pytest.raises(ValueError, match=r"8 samples per iteration is not a multiple of --train_batch_size 3"):
        PPOTrainer(PPOConfig.from_flat(advantage_estimator="rloo", init_kl_coef=0, rollout_batch_size=4, n_samples_per_prompt=2),
                   train_batch_size=3, **base)
    with pytest.raises(ValueError, match=r"init_kl_coef=0.1 needs a reference model"):
        PPOTrainer(PPOConfig.from_flat(advantage_estimator="rloo", init_kl_coef=0.1, rollout_batch_size=4,
                             n_samples_per_prompt=2), train_batch_size=8, **base)
    with pytest.raises(ValueError, match=r"no reward"):
        PPOTrainer(PPOConfig.from_flat(advantage_estimator="rloo", init_kl_coef=0, rollout_batch_size=4, n_samples_per_prompt=2),
                   train_batch_size=8, **{**base, "reward_fn": None})


def test_cuda_ipc_sync_refuses_what_it_cannot_pair_or_share(setup):
    """The hybrid engine's IPC sync pairs policy rank i with engine i on one GPU; on CPU there is no
    CUDA memory to share. Both fail with the fix (the GPU run is test_core_ppo_gpu.py)."""
    from rl_core.rl import GroupRollout, IpcWeightSync

    model, tok, _ = setup
    c = PPOConfig.from_flat(advantage_estimator="rloo", init_kl_coef=0, rollout_batch_size=4, n_samples_per_prompt=2)
    s = StrategyConfig(zero_stage=0, bf16=False, micro_train_batch_size=4, train_batch_size=8)
    policy = LocalGroup(PolicyWorker(s, model, PolicyObjective.of(c), 1, load_kw={"dtype": "fp32"}), "policy")
    two_engines = GroupRollout([LocalGroup(object(), "e0"), LocalGroup(object(), "e1")])
    with pytest.raises(ValueError, match=r"1 policy ranks but 2 engines; use --colocate_all_models"):
        IpcWeightSync(policy, two_engines)
    with pytest.raises(ValueError, match=r"CUDA IPC shares CUDA memory; got device cpu"):
        IpcWeightSync(policy, GroupRollout([LocalGroup(object(), "e0")]))(1)


def test_deepspeed_sleep_offloads_and_reloads_every_iteration_without_changing_the_run(setup, tmp_path):
    """--deepspeed_enable_sleep on DeepSpeed's CPU accelerator (ZeRO-2, policy + critic): offload_states /
    reload_states run every iteration and the run is the one without them, loss for loss and weight for weight;
    the same for a ZeRO-3 critic's steps, with everything asleep or all but the weights (its forwards then run)."""
    kw = dict(advantage_estimator="gae", init_kl_coef=0, max_iterations=3, zero_stage=2)
    runs = {on: make(setup, tmp_path / str(on), deepspeed_enable_sleep=on, **kw)[0] for on in (False, True)}
    plain, slept = (runs[on].fit() for on in (False, True))
    for k in ("policy_loss", "critic_loss", "reward_mean", "value_mean"):
        assert [m[k] for m in slept] == pytest.approx([m[k] for m in plain], abs=1e-6), k
    for role in ("policy", "critic"):
        a, b = (dict(getattr(runs[on], role).worker.engine.module.named_parameters()) for on in (False, True))
        for name, p in a.items():
            torch.testing.assert_close(b[name], p, rtol=0, atol=1e-6)
        assert not getattr(runs[True], role).worker.engine.optimizer.offloaded_states  # reloaded at the end
    n = sum(p.numel() for role in ("policy", "critic")
            for p in getattr(runs[True], role).worker.engine.module.parameters())
    # fp32 weights + their fp32 master copy, both roles; from the second iteration on also the two Adam moments
    assert [m["ds_sleep_gb"] for m in slept] == pytest.approx([8 * n / 1e9] + [16 * n / 1e9] * 2, abs=1e-6)
    for m in slept:  # every iteration offloaded and reloaded
        assert m["ds_sleep_s"] > 0 and m["ds_wake_s"] > 0 and "ds_sleep_freed_gb" not in m  # freed: CUDA only
    assert not any(k.startswith("ds_") for m in plain for k in m)
    # ZeRO-3: DeepSpeed moves the weights, rl-core the master weights and moments of torch's AdamW (DeepSpeed's
    # stage 3 moves those only for its FusedAdam); two critic steps are the same with a sleep before each
    model, tok, _ = setup
    s = StrategyConfig(zero_stage=3, bf16=False, micro_train_batch_size=2, train_batch_size=4, learning_rate=1e-2,
                       lr_warmup_ratio=0.0, lr_scheduler="constant")
    items = [make_item(tok.encode(f"Repeat the letter {x}: "), tok.encode(x * 4)) for x in LETTERS]
    for it in items:
        it.values_T, it.returns_T = torch.zeros(len(it.loss_mask_T)), torch.tensor(it.loss_mask_T).float()
    losses = {}
    for on in (False, True, "optimizer_only"):  # async training's sleep keeps the weights: forwards run meanwhile
        critic = CriticWorker(s, model, CriticObjective.of(PPOConfig()), 4, load_kw={"dtype": "fp32"},
                              pad_id=tok.pad_token_id)
        losses[on] = []
        for _ in range(2):
            awake = critic.values(items[:2]) if on == "optimizer_only" else []
            if on:
                assert critic.ds_offload(on == "optimizer_only")["bytes"] > 0
                for a, b in zip(awake, critic.values(items[:2]) if awake else [], strict=True):
                    torch.testing.assert_close(b, a, rtol=0, atol=0)
                assert critic.ds_reload()["seconds"] >= 0
            losses[on].append(critic.train(items)[0]["critic_loss"])
    assert losses[True] == losses[False] == losses["optimizer_only"] and losses[True][0] != losses[True][1]
    with pytest.raises(ValueError, match=r"^--deepspeed_enable_sleep needs --zero_stage 1, 2 or 3"):
        make(setup, tmp_path / "z0", deepspeed_enable_sleep=True, **{**kw, "zero_stage": 0})


def test_samples_over_the_token_budget_train_alone_counted_every_iteration_and_warned_once(setup, tmp_path, caplog):
    """A --max_tokens_per_gpu below every sample (OpenRLHF's dynamic batching gives such a sample a micro-batch of
    its own): the run trains, budget/over_train counts them every iteration, and one warning names the count, the
    longest and the flag; the experience forwards' budget holds them all, so nothing is said of it."""
    kw = dict(advantage_estimator="rloo", init_kl_coef=0, max_iterations=2)
    trainer = make(setup, tmp_path, **kw,
                   batching=MicroBatchConfig(max_tokens_per_gpu=1, forward_max_tokens_per_gpu=999))[0]
    with caplog.at_level("WARNING", logger="rl_core.trainers.ppo"):
        h = trainer.fit()
    assert [(m["budget/over_train"], m["budget/over_forward"]) for m in h] == [(16, 0), (16, 0)]
    assert all(math.isfinite(m["policy_loss"]) and m["budget/longest"] > 1 for m in h)
    warned = [r.getMessage() for r in caplog.records if "longer than" in r.getMessage()]
    assert len(warned) == 1, warned
    assert warned[0].startswith(f"iteration 1: 16 of 16 samples are longer than --max_tokens_per_gpu 1 (the longest "
                                f"{int(h[0]['budget/longest'])} tokens")
    assert "micro-batch of its own" in warned[0] and "budget/over_train" in warned[0]


def test_entropy_coefficient_logs_at_zero_and_moves_the_policy_otherwise(setup, tmp_path):
    """``entropy_loss_coef`` (OpenRLHF's ``--actor.entropy_coef``): 0 logs the policy's token-mean entropy and
    trains exactly as without it; a positive coefficient subtracts it from the loss, so the weights differ."""
    kw = dict(advantage_estimator="rloo", init_kl_coef=0, max_iterations=1)
    plain = make(setup, tmp_path / "plain", **kw)[0]
    h0 = plain.fit()
    zero = make(setup, tmp_path / "zero", **kw, entropy_loss_coef=0.0)[0]
    h1 = zero.fit()
    bonus = make(setup, tmp_path / "bonus", **kw, entropy_loss_coef=0.5)[0]
    h2 = bonus.fit()
    assert "entropy" not in h0[0] and h1[0]["entropy"] > 0 and h2[0]["entropy"] > 0
    assert h1[0]["policy_loss"] == pytest.approx(h0[0]["policy_loss"], abs=1e-7)
    w0, w1, w2 = (t.policy.call_rank(0, "weights_digest") for t in (plain, zero, bonus))
    assert w0 == w1 and w2 != w0
    with pytest.raises(ValueError, match="entropy_loss_coef .* finite"):
        PPOConfig.from_flat(entropy_loss_coef=float("nan"))
