"""The top-k distillation path in the workers (``--distill_divergence forward_kl | jsd``; tiny Llamas, fp32, CPU, real
DeepSpeed): the teacher's top-k per response token from ``TeacherWorker.topk_logprobs``, laid out for the policy's
forward (padded rows or one packed row), against the divergences computed item by item from the two models' own
logits (a loop reference, 1e-5 in fp32). At k = V the path's forward KL and JSD are the full-vocabulary ones."""

from __future__ import annotations

import pytest
import torch

from rl_algos import forward_kl, generalized_jsd, topk_forward_kl
from rl_core.model_rows import align_to_tokens
from rl_core.models import Actor, frozen
from rl_core.rl import make_item
from rl_core.rl.batching import ModelInputs
from rl_core.rl.distill_topk import LogitDivergence, predicting_layout
from rl_core.rl.teacher import TeacherWorker
from rl_core.strategy import StrategyConfig

pytestmark = [pytest.mark.timeout(600), pytest.mark.slow]
LENGTHS = [(5, 3), (9, 12), (4, 1), (7, 6)]  # (prompt, response)
TEMP = 0.8


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    from rl_rollout.testing import make_tiny_model

    root = tmp_path_factory.mktemp("topk")
    return str(make_tiny_model(root / "student", seed=0)), str(make_tiny_model(root / "teacher", seed=1))


def items_of(seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for p, r in LENGTHS:
        ids = torch.randint(3, 100, (p + r,), generator=g).tolist()
        mask = [1] * r
        mask[r // 2] = 0 if r > 2 else 1  # an environment's token in the response: out of the loss
        out.append(make_item(ids[:p], ids[p:], mask))
    return out


def logits_of(path, ids):
    model = frozen(Actor.from_pretrained(path, dtype="fp32"))
    with torch.no_grad():
        return model.model(input_ids=torch.tensor([ids])).logits[0]  # [T, V]


@pytest.mark.parametrize("packing", [False, True])
def test_the_policy_side_divergence_matches_a_per_item_reference(models, packing):
    student_path, teacher_path = models
    items = items_of()
    teacher = TeacherWorker(StrategyConfig(bf16=False, zero_stage=0, seed=0), teacher_path,
                            load_kw={"dtype": "fp32", "packed": packing}, temperature=TEMP, packing=packing)
    V = logits_of(teacher_path, [1, 2]).shape[-1]
    student = frozen(Actor.from_pretrained(student_path, dtype="fp32", packed=packing))
    for k, full in ((5, False), (V + 7, True)):  # k above V: the vocabulary, exact
        scored = teacher.topk_logprobs(items, k)
        assert teacher.logprobs(items)[1].tolist() == pytest.approx(scored[1].logprobs_T.tolist(), abs=1e-6)
        for it, s in zip(items, scored, strict=True):
            it.teacher_topk_ids_RK, it.teacher_topk_logprobs_RK = s.ids_RK, s.logprobs_RK
            assert s.ids_RK.shape == (it.T - it.prompt_len, min(k, V))
        x = ModelInputs.of(items, 0, packing, "cpu")
        with torch.no_grad():
            logits = student(**x.kwargs, return_logits=True).logits
        ids, lps = predicting_layout(items, packing, "cpu")
        for div, ref in ((LogitDivergence("forward_kl", k), "forward_kl"), (LogitDivergence("jsd", k, 0.3), "jsd")):
            got_BT = x.rows(align_to_tokens(div(logits, lps, ids, TEMP), x.kwargs))
            for b, it in enumerate(items):
                P = it.prompt_len
                s_lg, t_lg = logits_of(student_path, it.input_ids_T), logits_of(teacher_path, it.input_ids_T)
                s_RV, t_RV = s_lg[P - 1 : it.T - 1], t_lg[P - 1 : it.T - 1]  # the logits of each response token
                if full:
                    want = (forward_kl(s_RV, t_RV, temperature=TEMP) if ref == "forward_kl"
                            else generalized_jsd(s_RV, t_RV, beta=0.3, temperature=TEMP))
                else:
                    top_lp, top_ids = torch.log_softmax(t_RV / TEMP, -1).topk(k, -1)
                    assert torch.equal(top_ids.int(), it.teacher_topk_ids_RK)
                    if ref == "forward_kl":
                        want = topk_forward_kl(s_RV, top_lp, top_ids, temperature=TEMP)
                    else:  # the truncated teacher over the whole vocabulary: the JSD of generalized_jsd
                        trunc = torch.full_like(t_RV, -torch.inf).scatter(-1, top_ids, top_lp * TEMP)
                        want = generalized_jsd(s_RV, trunc, beta=0.3, temperature=TEMP)
                assert torch.allclose(got_BT[b, P : it.T], want, atol=1e-5), (packing, k, ref, b)
            # off the response (prompt, padding) the layout holds zeros: a finite value the loss mask removes (a
            # NaN there would survive the mask's product)
            assert torch.isfinite(got_BT).all()
