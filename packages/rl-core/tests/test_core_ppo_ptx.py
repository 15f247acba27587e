"""PPO-ptx (OpenRLHF's --pretrain_data / --ptx_coef): one policy step on a tiny Llama (real DeepSpeed ZeRO-2 on
CPU) moves the weights by the gradient of the policy loss plus ``coef x`` the token-mean NLL of one pretraining
micro-batch per policy micro-batch, recomputed here from transformers forwards; ``ptx_loss`` is logged; the
pretraining rows load through rl_core.data (text as is, every token but the first a target, cut at max_len)."""

from __future__ import annotations

import pytest
import torch

from rl_rollout.testing import make_tiny_model

pytestmark = pytest.mark.timeout(600)
COEF = 0.5


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("m") / "tiny", hidden_size=32, intermediate_size=64)


def test_pretraining_rows_are_text_with_every_token_but_the_first_a_target():
    from rl_core.data import DataConfig, PretrainDataset
    from rl_rollout.testing import make_tokenizer

    tok = make_tokenizer()
    ds = PretrainDataset([{"input": "abc"}, {"input": "0123456789"}], tok, DataConfig(max_len=6))
    assert [it["input_ids"].tolist() for it in ds] == [tok("abc")["input_ids"], tok("012345")["input_ids"]]
    assert [it["loss_mask"].tolist() for it in ds] == [[0, 1, 1], [0, 1, 1, 1, 1, 1]]
    assert ds.report.truncated == 1


def _logprobs(hf, ids: list[int]) -> torch.Tensor:
    """``[T]``: log p(token t | tokens before t), 0 at t = 0 (the trainer's layout)."""
    logits = hf(input_ids=torch.tensor([ids])).logits[0, :-1].float()
    lp = logits.log_softmax(-1).gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]
    return torch.cat([torch.zeros(1), lp])


def test_a_policy_step_adds_coef_times_the_nll_of_a_pretraining_micro_batch(tiny):
    """Advantages random, old log-probs the policy's own (ratio 1, nothing clipped): the token-mean policy loss
    over the global batch of 4 (2 micro-batches of 2) plus COEF x the mean over those micro-batches of the
    pretraining NLL (items 0, 1 then 2, 0: the 3 pretraining items cycle). AdamW with eps 1 moves each weight
    by lr x g / (|g| + 1), so the step gives the gradient back."""
    from transformers import AutoModelForCausalLM

    from rl_core.rl import PolicyObjective, PolicyWorker, make_item
    from rl_core.strategy import StrategyConfig

    lr = 1e-2
    s = StrategyConfig(zero_stage=2, bf16=False, micro_train_batch_size=2, train_batch_size=4, learning_rate=lr,
                       lr_warmup_ratio=0.0, lr_scheduler="constant", max_norm=0.0, adam_eps=1.0)
    g = torch.Generator().manual_seed(0)
    rand = lambda n: torch.randint(10, 100, (n,), generator=g).tolist()  # noqa: E731
    ptx = [{"input_ids": torch.tensor(ids), "loss_mask": torch.tensor([0] + [1] * (len(ids) - 1))}
           for ids in (rand(7), rand(4), rand(9))]
    w = PolicyWorker(s, tiny, PolicyObjective(ptx_coef=COEF), 1, load_kw={"dtype": "fp32"}, ptx=ptx)
    items = [make_item(rand(p), rand(r)) for p, r in ((3, 4), (5, 2), (2, 6), (4, 4))]
    for it, old in zip(items, w.logprobs(items), strict=True):
        it.old_logprobs_T, it.advantages_T = old, torch.randn(len(old), generator=g)
    assert [len(x) for x in w._micro_batches(items, train=True)] == [2, 2]

    hf = AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32)
    total = sum(sum(it.loss_mask_T) for it in items)
    loss = 0.0
    for it in items:
        lp, m = _logprobs(hf, it.input_ids_T), torch.tensor(it.loss_mask_T)
        loss = loss - (it.advantages_T * (lp - it.old_logprobs_T).exp() * m).sum() / total
    nlls = []
    for batch in ((0, 1), (2, 0)):
        lps = [_logprobs(hf, ptx[i]["input_ids"].tolist()) * ptx[i]["loss_mask"] for i in batch]
        nlls.append(-sum(x.sum() for x in lps) / sum(ptx[i]["loss_mask"].sum() for i in batch))
    (loss + COEF * sum(nlls) / 2).backward()

    before = {n: p.detach().clone() for n, p in w.engine.module.named_parameters()}
    metrics = w.train(items)[0]
    assert metrics["ptx_loss"] == pytest.approx(sum(x.item() for x in nlls) / 2, rel=1e-5)
    grads = {f"model.{n}": p.grad for n, p in hf.named_parameters()}
    for n, p in w.engine.module.named_parameters():
        gr = grads[n] if grads[n] is not None else torch.zeros_like(p)
        torch.testing.assert_close(p.detach() - before[n], -lr * gr / (gr.abs() + 1), rtol=1e-3, atol=1e-7)


def test_a_resumed_policy_continues_the_pretraining_rows_where_the_checkpoint_left_them(tiny, tmp_path):
    """3 pretraining rows, 2 per step: step 1 takes rows 0, 1; the checkpoint keeps the cursor (row 2), so a
    policy resumed from it trains step 2 on rows 2, 0 exactly as the uninterrupted one does (same ptx loss, same
    weights); before the cursor was kept a resume restarted at row 0."""
    from rl_core.rl import PolicyObjective, PolicyWorker, make_item
    from rl_core.strategy import StrategyConfig

    s = StrategyConfig(zero_stage=2, bf16=False, micro_train_batch_size=2, train_batch_size=2, learning_rate=1e-2,
                       lr_warmup_ratio=0.0, lr_scheduler="constant")
    g = torch.Generator().manual_seed(1)
    rand = lambda n: torch.randint(10, 100, (n,), generator=g).tolist()  # noqa: E731
    ptx = [{"input_ids": torch.tensor(ids), "loss_mask": torch.tensor([0] + [1] * (len(ids) - 1))}
           for ids in (rand(7), rand(4), rand(9))]
    make = lambda: PolicyWorker(s, tiny, PolicyObjective(ptx_coef=COEF), 4, load_kw={"dtype": "fp32"}, ptx=ptx)  # noqa: E731
    items = [make_item(rand(3), rand(4)), make_item(rand(5), rand(2))]
    ran = make()
    for it, old in zip(items, ran.logprobs(items), strict=True):
        it.old_logprobs_T, it.advantages_T = old, torch.randn(len(old), generator=g)
    ran.train(items)
    ran.save_checkpoint(str(tmp_path / "policy"))
    resumed = make()
    resumed.load_checkpoint(str(tmp_path / "policy"))
    assert resumed._ptx_next == ran._ptx_next == 2
    m_ran, m_resumed = ran.train(items)[0], resumed.train(items)[0]
    assert m_resumed["ptx_loss"] == pytest.approx(m_ran["ptx_loss"], rel=1e-6)
    for (n, a), (_, b) in zip(ran.engine.module.named_parameters(), resumed.engine.module.named_parameters(),
                              strict=True):
        torch.testing.assert_close(b, a, rtol=0, atol=1e-6, msg=n)
