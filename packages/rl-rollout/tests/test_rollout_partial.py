"""Partial rollouts on the HF engine: a weight update lands between two chunks of a response, the rest is
sampled with the new weights, and every token's version tag names the weights that produced it (its rollout
log-prob equals that version's forward, 1e-4)."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from rl_rollout import RolloutRequest, SamplingParams
from rl_rollout.hf_engine import HFEngine
from rl_rollout.testing import make_tiny_model


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    return HFEngine(make_tiny_model(tmp_path_factory.mktemp("tiny") / "m", seed=2))


def perturbed(engine, scale=0.5):
    g = torch.Generator().manual_seed(0)
    return {n: t + scale * torch.randn(t.shape, generator=g) for n, t in engine.model.state_dict().items()}


@torch.no_grad()
def token_logprobs(model, prompt, response):
    ids = torch.tensor([prompt + response])
    lp = torch.log_softmax(model(ids).logits[0].float(), -1)
    return [lp[len(prompt) - 1 + t, tok].item() for t, tok in enumerate(response)]


def test_an_update_between_chunks_tags_each_token_with_the_weights_that_sampled_it(engine):
    old = {n: t.clone() for n, t in engine.model.state_dict().items()}
    new = perturbed(engine)
    calls = []
    group = engine._generate_group

    def chunk_then_update(requests, params):  # the update lands after the first chunk, as a sync would
        if len(calls) == 1:
            engine._copy_weights(new.items())
            engine.policy_version = 1
        calls.append(len(requests))
        return group(requests, params)

    prompt = [5, 60, 70, 71]
    engine._generate_group, engine.partial_chunk_tokens = chunk_then_update, 3
    try:
        (samples,) = engine.generate([RolloutRequest(prompt, SamplingParams(max_new_tokens=8, n=2, seed=1,
                                                                            ignore_eos=True))])
    finally:
        engine._generate_group, engine.partial_chunk_tokens = group, None
    assert calls == [2, 2, 2]  # chunks of 3, 3, 2 tokens for both samples
    for s in samples:
        assert s.info["token_versions"] == [0, 0, 0, 1, 1, 1, 1, 1] and s.policy_version == 0
        after = token_logprobs(engine.model, prompt, s.response_ids)  # the new weights, on the whole response
        engine._copy_weights(old.items())
        before = token_logprobs(engine.model, prompt, s.response_ids)
        engine._copy_weights(new.items())
        expected = before[:3] + after[3:]
        assert s.rollout_logprobs == pytest.approx(expected, abs=1e-4)
        assert max(abs(a - b) for a, b in zip(before[3:], after[3:], strict=True)) > 1e-2  # versions differ
    engine._copy_weights(old.items())
    engine.policy_version = 0


def test_a_concurrent_update_lands_mid_response_instead_of_waiting_for_it(engine):
    new = perturbed(engine, scale=0.01)
    started, group, out = threading.Event(), engine._generate_group, {}

    def counting(requests, params):
        if len(out.setdefault("calls", [])) == 2:
            started.set()
        out["calls"].append(1)
        return group(requests, params)

    def generate():
        (out["samples"],) = engine.generate([RolloutRequest([5, 60, 70], SamplingParams(max_new_tokens=48,
                                                                                       ignore_eos=True))])
        out["generate_done"] = time.perf_counter()

    engine.partial_chunk_tokens, engine._generate_group = 1, counting
    try:
        t = threading.Thread(target=generate)
        t.start()
        assert started.wait(60)
        engine.update_weights(new.items(), version=7)  # a lock is not fair: the engine must let this in
        update_done = time.perf_counter()
        t.join(120)
    finally:
        engine.partial_chunk_tokens, engine._generate_group = None, group
    versions = out["samples"][0].info["token_versions"]
    assert update_done < out["generate_done"]
    assert versions == sorted(versions) and versions[0] == 0 and versions[-1] == 7, versions
    assert versions.count(0) < 10, versions  # it landed within a few chunks of being asked
