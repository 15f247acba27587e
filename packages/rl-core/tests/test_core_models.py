"""Actor, Critic and RewardModel on the tiny Llama: alignment, padding, packing, save/load."""

from __future__ import annotations

import pytest
import torch

from rl_algos import logprobs_from_logits
from rl_core.models import Actor, Critic, RewardModel, frozen
from rl_rollout.testing import make_tiny_model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("m") / "tiny", peaked=True)


@pytest.fixture(scope="module")
def actor(tiny):
    return Actor.from_pretrained(tiny, dtype="fp32").eval()


SEQS = [[5, 60, 70, 71, 9], [7, 8, 30], [40, 41, 42, 43, 44, 45]]


def test_logprobs_are_aligned_with_input_ids(actor):
    ids = torch.tensor([SEQS[0]])
    with torch.no_grad():
        lp = actor(ids).logprobs
        logits = actor.model(input_ids=ids).logits
    assert lp.shape == ids.shape and lp[0, 0] == 0
    expected = logprobs_from_logits(logits[:, :-1], ids[:, 1:])
    torch.testing.assert_close(lp[:, 1:], expected, atol=1e-6, rtol=0)


def test_logprobs_entropy_and_gradients_equal_the_naive_ones(tiny):
    """Actor computes the log-probs over every position and drops the last (so the logits' gradient needs no
    zero-padded copy); values, entropy and the weights' gradients are those of a naive log_softmax over
    ``logits[:, :-1]``, also with padding (the wrapped-around label of the last position never counts)."""
    actor = Actor.from_pretrained(tiny, dtype="fp32")
    ids = torch.tensor([[5, 60, 70, 71, 9, 33], [0, 0, 7, 8, 30, 31]])
    att = torch.tensor([[1] * 6, [0, 0, 1, 1, 1, 1]])
    out = actor(ids, attention_mask=att, return_entropy=True)
    mask = att[:, 1:].float() * att[:, :-1].float()
    (out.logprobs[:, 1:] * mask + out.entropy[:, 1:] * mask * 0.1).sum().backward()
    mine = {n: p.grad.clone() for n, p in actor.named_parameters()}
    actor.zero_grad()
    logits = actor.model(input_ids=ids, attention_mask=att, position_ids=(att.cumsum(-1) - 1).clamp(min=0)).logits
    logp = torch.log_softmax(logits[:, :-1].double(), -1)
    lp = logp.gather(-1, ids[:, 1:, None]).squeeze(-1)
    ent = -(logp.exp() * logp).sum(-1)
    torch.testing.assert_close(out.logprobs[:, 1:].double(), lp, atol=1e-5, rtol=0)
    torch.testing.assert_close(out.entropy[:, 1:].double(), ent, atol=1e-5, rtol=0)
    assert (out.logprobs[:, 0] == 0).all() and (out.entropy[:, 0] == 0).all()
    (lp * mask + ent * mask * 0.1).sum().backward()
    for n, p in actor.named_parameters():
        torch.testing.assert_close(mine[n], p.grad.to(mine[n].dtype), atol=1e-5, rtol=1e-4, msg=n)


def test_left_padding_gives_the_unpadded_logprobs(actor):
    pad = actor.config.pad_token_id
    T = max(map(len, SEQS))
    ids = torch.tensor([[pad] * (T - len(s)) + s for s in SEQS])
    mask = (torch.arange(T) >= torch.tensor([T - len(s) for s in SEQS])[:, None]).long()
    with torch.no_grad():
        lp = actor(ids, attention_mask=mask).logprobs
        for i, s in enumerate(SEQS):
            alone = actor(torch.tensor([s])).logprobs[0]
            torch.testing.assert_close(lp[i, T - len(s) + 1:], alone[1:], atol=1e-5, rtol=0)


def test_packed_sequences_match_separate_forwards(actor):
    ids = torch.tensor([sum(SEQS, [])])
    pos = torch.tensor([sum([list(range(len(s))) for s in SEQS], [])])
    with torch.no_grad():
        lp = actor(ids, position_ids=pos).logprobs[0]
        ent = actor(ids, position_ids=pos, return_entropy=True).entropy[0]
        start = 0
        for s in SEQS:
            out = actor(torch.tensor([s]), return_entropy=True)
            torch.testing.assert_close(lp[start:start + len(s)], out.logprobs[0], atol=1e-5, rtol=0)
            torch.testing.assert_close(ent[start:start + len(s)], out.entropy[0], atol=1e-5, rtol=0)
            assert lp[start] == 0  # nothing is predicted across a sequence boundary
            start += len(s)


def test_frozen_reference_has_no_trainable_parameters(tiny):
    ref = frozen(Actor.from_pretrained(tiny, dtype="fp32"))
    assert not ref.training and not any(p.requires_grad for p in ref.parameters())


def test_reward_model_scores_at_last_token_and_round_trips(tiny, tmp_path):
    rm = RewardModel.from_pretrained(tiny, dtype="fp32").eval()
    pad = rm.config.pad_token_id
    T = max(map(len, SEQS))
    right = torch.tensor([s + [pad] * (T - len(s)) for s in SEQS])
    left = torch.tensor([[pad] * (T - len(s)) + s for s in SEQS])
    rmask = (right != pad).long()
    lmask = (left != pad).long()
    with torch.no_grad():
        r, l_ = rm(right, rmask), rm(left, lmask)
        alone = torch.cat([rm(torch.tensor([s]), torch.ones(1, len(s), dtype=torch.long)) for s in SEQS])
    torch.testing.assert_close(r, alone, atol=1e-5, rtol=0)
    torch.testing.assert_close(l_, alone, atol=1e-5, rtol=0)
    rm.mean, rm.std = 0.5, 2.0
    rm.save_pretrained(tmp_path / "rm")
    back = RewardModel.from_pretrained(tmp_path / "rm", dtype="fp32").eval()
    with torch.no_grad():
        torch.testing.assert_close(back(right, rmask, normalize=True), (alone - 0.5) / 2.0, atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match=r"rows with no real token .*rows \[1\]"):
        rm(right, torch.stack([rmask[0], torch.zeros(T, dtype=torch.long), rmask[2]]))


def test_reward_model_scores_each_packed_sequence_at_its_last_token(tiny):
    rm = RewardModel.from_pretrained(tiny, dtype="fp32").eval()
    ids = torch.tensor([sum(SEQS, [])])
    pos = torch.tensor([sum([list(range(len(s))) for s in SEQS], [])])
    with torch.no_grad():
        packed = rm(ids, position_ids=pos)
        alone = torch.cat([rm(torch.tensor([s]), torch.ones(1, len(s), dtype=torch.long)) for s in SEQS])
        rm.mean, rm.std = 0.5, 2.0
        normalized = rm(ids, position_ids=pos, normalize=True)
    assert packed.shape == (len(SEQS),)
    torch.testing.assert_close(packed, alone, atol=1e-5, rtol=0)
    torch.testing.assert_close(normalized, (alone - 0.5) / 2.0, atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match=r"needs an attention_mask \(padded rows\) or position_ids \(packed rows\)"):
        rm(ids)


def test_critic_values_are_shifted_like_logprobs(tiny):
    critic = Critic.from_pretrained(tiny, dtype="fp32").eval()
    ids = torch.tensor([SEQS[2]])
    with torch.no_grad():
        v = critic(ids)
        raw = critic.head(critic.hidden(ids)).squeeze(-1)
    assert v.shape == ids.shape and v[0, 0] == 0
    torch.testing.assert_close(v[:, 1:], raw[:, :-1], atol=1e-6, rtol=0)


def test_missing_model_folder_names_the_path(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"nothere is not a transformers model folder .*--pretrain"):
        Actor.from_pretrained(tmp_path / "nothere")


def test_a_critic_starts_from_a_reward_models_score_head(tiny, tmp_path):
    """The critic's default init is --reward_pretrain (OpenRLHF's too): its score head becomes the value head."""
    rm = RewardModel.from_pretrained(tiny, dtype="fp32")
    rm.save_pretrained(tmp_path / "rm")
    critic = Critic.from_pretrained(tmp_path / "rm", dtype="fp32")
    assert torch.equal(critic.head.weight, rm.head.weight)
    with pytest.raises(ValueError, match="holds a 'value' head, but RewardModel needs a 'score' head"):
        Critic.from_pretrained(tiny, dtype="fp32").save_pretrained(tmp_path / "critic")
        RewardModel.from_pretrained(tmp_path / "critic", dtype="fp32")


def test_an_openrlhf_reward_model_folder_gives_its_own_scores(tiny, tmp_path):
    """OpenRLHF saves a reward model as the base model plus `<value_head_prefix>.weight` (default score) in one
    state dict, its mean/std in config.json: transformers' LlamaForSequenceClassification has that layout. Its
    head and statistics load (scores equal its own last-token logits); a folder with no head is refused when a
    head is required, naming the folder and the flag; --value_head_prefix finds a head saved under another name."""
    from safetensors.torch import load_file, save_file
    from transformers import LlamaForSequenceClassification

    seq = LlamaForSequenceClassification.from_pretrained(tiny, num_labels=1, dtype=torch.float32).eval()
    torch.nn.init.normal_(seq.score.weight, std=0.3)
    seq.config.update({"mean": 0.5, "std": 2.0, "normalize_reward": True})
    seq.save_pretrained(tmp_path / "orlhf")
    rm = RewardModel.from_pretrained(tmp_path / "orlhf", dtype="fp32", require_head=True).eval()
    ids = torch.randint(3, 128, (1, 9))
    with torch.no_grad():
        want = seq(input_ids=ids).logits[0, 0]
        got = rm(ids, attention_mask=torch.ones_like(ids))
        torch.testing.assert_close(got[0], want, atol=1e-5, rtol=0)
        torch.testing.assert_close(rm(ids, attention_mask=torch.ones_like(ids), normalize=True)[0], (want - 0.5) / 2)
    with pytest.raises(ValueError, match=r"holds no score head.*--value_head_prefix"):
        RewardModel.from_pretrained(tiny, dtype="fp32", require_head=True)
    weights = load_file(tmp_path / "orlhf" / "model.safetensors")
    weights["value_head.weight"] = weights.pop("score.weight")
    save_file(weights, tmp_path / "orlhf" / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match="holds no score head"):
        RewardModel.from_pretrained(tmp_path / "orlhf", dtype="fp32", require_head=True)
    renamed = RewardModel.from_pretrained(tmp_path / "orlhf", dtype="fp32", value_head_prefix="value_head")
    assert torch.equal(renamed.head.weight, rm.head.weight)


def _rows(layout: str) -> tuple[torch.Tensor, dict]:
    """Input ids and the forward's layout arguments: two left-padded rows, or SEQS packed into one row."""
    if layout == "padded":
        return (torch.tensor([[5, 60, 70, 71, 9, 33], [0, 0, 7, 8, 30, 31]]),
                {"attention_mask": torch.tensor([[1] * 6, [0, 0, 1, 1, 1, 1]])})
    return (torch.tensor([sum(SEQS, [])]),
            {"position_ids": torch.tensor([sum([list(range(len(s))) for s in SEQS], [])])})


@pytest.mark.parametrize("layout", ["padded", "packed"])
@pytest.mark.parametrize("lora", [False, True])
def test_a_fused_lm_head_gives_the_logprobs_entropy_and_gradients_of_the_full_logits(tiny, layout, lora):
    """--fused_lm_head: the same log-probs, entropy and parameter gradients as the head's full logits (fp32,
    tied embeddings: the head's gradient reaches the embedding), padded or packed, with or without LoRA."""
    from rl_core.models import LoraSpec

    spec = LoraSpec.of(4, 8, 0.0, "all-linear") if lora else None
    torch.manual_seed(0)
    plain = Actor.from_pretrained(tiny, dtype="fp32", lora=spec)
    torch.manual_seed(0)  # the same LoRA initialisation
    fused = Actor.from_pretrained(tiny, dtype="fp32", lora=spec, fused_lm_head=True)
    assert fused.fused_lm_head and not plain.fused_lm_head
    ids, kw = _rows(layout)
    weights = torch.rand(ids.shape, generator=torch.Generator().manual_seed(1))
    grads = []
    for model in (plain, fused):
        out = model(ids, temperature=0.9, return_entropy=True, **kw)
        (out.logprobs * weights + 0.1 * out.entropy).sum().backward()
        grads.append({n: p.grad for n, p in model.named_parameters() if p.grad is not None})
        if model is plain:
            want = out
    torch.testing.assert_close(out.logprobs, want.logprobs, atol=1e-5, rtol=0)
    torch.testing.assert_close(out.entropy, want.entropy, atol=1e-5, rtol=0)
    assert grads[0].keys() == grads[1].keys() and len(grads[0]) > 0
    for n in grads[0]:
        torch.testing.assert_close(grads[1][n], grads[0][n], atol=1e-5, rtol=1e-4, msg=n)


@pytest.mark.parametrize("layout", ["padded", "packed"])
def test_lp_weights_give_the_weighted_sum_of_the_logprobs_with_its_gradients(tiny, layout):
    """``lp_weights`` (a loss linear in the log-probs, SFT's): ``weighted`` equals sum(w * logprobs) of the full
    logits, with the same gradients, though the fused head made them in forward (its log-probs are values only);
    the weights of the positions whose log-prob is 0 by convention (each sequence's first) count for nothing."""
    plain = Actor.from_pretrained(tiny, dtype="fp32")
    fused = Actor.from_pretrained(tiny, dtype="fp32", fused_lm_head=True)
    ids, kw = _rows(layout)
    w = torch.rand(ids.shape, generator=torch.Generator().manual_seed(2))
    want = plain(ids, temperature=0.9, **kw)
    ref = (want.logprobs * w).sum()
    for model in (plain, fused):
        out = model(ids, temperature=0.9, lp_weights=w, **kw)
        torch.testing.assert_close(out.weighted, ref, atol=1e-5, rtol=1e-6)
        torch.testing.assert_close(out.logprobs.detach(), want.logprobs.detach(), atol=1e-5, rtol=0)
        grads = torch.autograd.grad(out.weighted, list(model.parameters()))
        for (n, _), x, y in zip(plain.named_parameters(), grads, torch.autograd.grad(ref, list(plain.parameters()),
                                                                                      retain_graph=True)):
            torch.testing.assert_close(x, y, atol=1e-5, rtol=1e-4, msg=n)
    assert not fused(ids, lp_weights=w, **kw).logprobs.requires_grad  # made in forward: the sum carries them


def test_a_fused_lm_head_is_refused_where_the_logits_are_not_lm_head_of_hidden(tiny, tmp_path):
    actor = Actor.from_pretrained(tiny, dtype="fp32")
    actor.config.final_logit_softcapping = 30.0
    with pytest.raises(ValueError, match=r"--fused_lm_head: the model scales its logits \(final_logit_softcapping"):
        actor.enable_fused_lm_head()
    moe = make_tiny_model(tmp_path / "moe", num_experts=4)
    fused = Actor.from_pretrained(moe, dtype="fp32", fused_lm_head=True)
    with pytest.raises(ValueError, match="--aux_loss_coef with --fused_lm_head"):
        fused.enable_moe_aux_loss()
    aux = Actor.from_pretrained(moe, dtype="fp32")
    aux.enable_moe_aux_loss()
    with pytest.raises(ValueError, match="load-balancing loss"):
        aux.enable_fused_lm_head()
    from rl_core.models import check_fused_lm_head
    from rl_core.strategy import StrategyConfig

    with pytest.raises(ValueError, match="--fused_lm_head with --zero_stage 3 is not built"):
        check_fused_lm_head(True, StrategyConfig(zero_stage=3))
    check_fused_lm_head(True, StrategyConfig(zero_stage=2))
