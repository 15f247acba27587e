"""Partial rollouts kept in vLLM across a weight update (:mod:`rl_rollout.vllm_resident`, ``keep_requests``), on
vLLM's CPU build: with the engine core in this process and in its own process (vLLM's default, the Ray engine
actors' too).

An update sent while a response is being sampled lands between two engine steps; the request stays in vLLM (no
prefill again) and every token carries the version vLLM labelled it with. With the same weights sent (only the
version moves) the greedy response equals transformers' whole: pausing and resuming loses or repeats nothing. With
new weights the tokens before the update have the old weights' log-probs exactly, and the ones after differ.
"""

from __future__ import annotations

import os
import threading
import time

import pytest
import torch

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

from rl_rollout.testing import missing_modules

if why := missing_modules("vllm"):
    pytest.skip(why, allow_module_level=True)

from rl_rollout import RolloutRequest, SamplingParams  # noqa: E402
from rl_rollout.testing import VLLM_CPU_TESTS_ON_CUDA, make_tiny_model, peaked_weights  # noqa: E402
from rl_rollout.vllm_engine import VLLMEngine  # noqa: E402
from rl_rollout.vllm_resident import KeepRequestsConfig  # noqa: E402

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.timeout(400),
    pytest.mark.skipif(torch.cuda.is_available(), reason=VLLM_CPU_TESTS_ON_CUDA),
]
PROMPT = [5, 61, 62, 63, 64, 65, 66]
N_TOKENS = 40


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "m", peaked=True, seed=1)


@pytest.fixture(scope="module")
def hf(model_path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()


@pytest.fixture(scope="module", params=[True, False], ids=["in-process", "engine-core-process"])
def engine(request, model_path):
    eng = VLLMEngine(
        model_path, dtype="float32", enforce_eager=True, max_model_len=256, seed=0, in_process=request.param
    )
    eng.keep_requests = KeepRequestsConfig()
    yield eng
    eng.shutdown()


@torch.no_grad()
def greedy(hf, prompt, n):
    ids = list(prompt)
    for _ in range(n):
        ids.append(int(hf(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt) :]


@torch.no_grad()
def logprobs(hf, prompt, response):
    logits = hf(torch.tensor([prompt + response])).logits[0, len(prompt) - 1 : -1].float()
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(response)[:, None])[:, 0]


def update_mid_response(engine, params, state, version):
    """Generate on a thread; once 3 engine steps ran, send ``state`` as ``version``; the samples and the steps
    the generate had run when the update landed."""
    out, steps0 = {}, engine._kept.steps
    t = threading.Thread(target=lambda: out.update(s=engine.generate([RolloutRequest(PROMPT, params)])))
    t.start()
    deadline = time.monotonic() + 60
    while engine._kept.steps < steps0 + 3 and time.monotonic() < deadline:
        time.sleep(0.001)
    engine.update_weights(state.items(), version=version)
    landed = engine._kept.steps - steps0
    t.join(120)
    assert not t.is_alive()
    return out["s"][0], landed


def test_an_update_of_the_same_weights_mid_response_keeps_the_greedy_response_whole(engine, hf):
    v = engine.policy_version
    engine.update_weights(hf.state_dict().items(), version=v + 1)  # engine and transformers hold the same weights
    params = SamplingParams(temperature=0.0, max_new_tokens=N_TOKENS, ignore_eos=True)
    (s,), landed = update_mid_response(engine, params, hf.state_dict(), v + 2)
    assert 3 <= landed < N_TOKENS, f"the update waited for {landed} of {N_TOKENS} steps"
    assert s.response_ids == greedy(hf, PROMPT, N_TOKENS)  # paused, kept and resumed: nothing lost or repeated
    versions = s.info["token_versions"]
    cut = versions.index(v + 2)
    assert 0 < cut < N_TOKENS and versions == [v + 1] * cut + [v + 2] * (N_TOKENS - cut), versions
    assert s.policy_version == v + 1


def test_new_weights_mid_response_sample_the_rest_of_the_kept_request(engine, hf):
    v = engine.policy_version
    old = {k: t.clone() for k, t in hf.state_dict().items()}
    engine.update_weights(old.items(), version=v + 1)
    new = peaked_weights(hf, seed=321)
    params = SamplingParams(temperature=1.0, n=2, max_new_tokens=N_TOKENS, seed=3, ignore_eos=True)
    samples, landed = update_mid_response(engine, params, new, v + 2)
    assert landed < N_TOKENS
    a, b = samples
    assert a.response_ids != b.response_ids
    for s in samples:
        versions = s.info["token_versions"]
        assert len(versions) == len(s.response_ids) == N_TOKENS and versions == sorted(versions), versions
        assert versions[0] == v + 1 and versions[-1] == v + 2 and s.policy_version == v + 1, versions
        cut = versions.index(v + 2)
        got = torch.tensor(s.rollout_logprobs)
        before = logprobs(hf, s.prompt_ids, s.response_ids)
        assert (got[:cut] - before[:cut]).abs().max().item() <= 1e-4  # the old weights' own, exactly
        # after it the new weights sample (over the old weights' KV of the tokens before, kept): not the old ones
        assert (got[cut:] - before[cut:]).abs().max().item() > 1e-2
    hf.load_state_dict(old)


def test_keep_requests_and_chunks_are_one_or_the_other(engine):
    with pytest.raises(ValueError, match="set keep_requests = None first"):
        engine.partial_chunk_tokens = 2
    cfg = engine.keep_requests
    engine.keep_requests = None
    engine.partial_chunk_tokens = 2
    with pytest.raises(ValueError, match="set partial_chunk_tokens = None first"):
        engine.keep_requests = cfg
    engine.partial_chunk_tokens = None
    engine.keep_requests = cfg
    with pytest.raises(ValueError, match="steps_per_turn must be >= 1"):
        KeepRequestsConfig(steps_per_turn=0)


def test_a_vllm_without_weight_version_labels_runs_partial_rollouts_in_chunks(engine, monkeypatch):
    """vLLM before 0.32 (the GPU machine's 0.26) has no LLMEngine.set_weight_version: auto picks chunks there, and
    keep is refused naming the fix, instead of failing at the first generate."""
    from rl_rollout.partial_modes import PartialRolloutMode, set_partial_rollout

    cfg = engine.keep_requests
    engine.keep_requests = None
    try:
        monkeypatch.delattr(type(engine._llm.llm_engine), "set_weight_version")
        assert "needs LLMEngine.set_weight_version" in engine.keep_requests_unsupported()
        assert set_partial_rollout(engine, "auto") is PartialRolloutMode.CHUNKS and engine.partial_chunk_tokens == 16
        engine.partial_chunk_tokens = None
        with pytest.raises(ValueError, match="or use --partial_rollout_mode chunks"):
            set_partial_rollout(engine, "keep")
        monkeypatch.undo()
        assert engine.keep_requests_unsupported() is None
        assert set_partial_rollout(engine, "auto") is PartialRolloutMode.KEEP
    finally:
        engine.partial_chunk_tokens = None
        engine.keep_requests = cfg


def test_concurrent_generate_calls_share_the_steps_and_each_gets_its_own(engine, hf):
    """Two callers (a threaded Ray engine actor, the loop's producer beside an eval pass) step one engine: each
    step serves both calls' requests, and each call returns its own samples, versions included."""
    v = engine.policy_version
    engine.update_weights(hf.state_dict().items(), version=v + 1)
    out: dict[int, list] = {}

    def call(i, n_tokens):
        params = SamplingParams(temperature=0.0, max_new_tokens=n_tokens, ignore_eos=True)
        out[i] = engine.generate([RolloutRequest(PROMPT[i:], params)])

    threads = [threading.Thread(target=call, args=(i, 12 + 8 * i)) for i in range(2)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 60
    while engine._kept.steps < 3 and time.monotonic() < deadline:
        time.sleep(0.001)
    engine.update_weights(hf.state_dict().items(), version=v + 2)
    for t in threads:
        t.join(120)
    for i in range(2):
        (s,) = out[i][0]
        assert s.response_ids == greedy(hf, PROMPT[i:], 12 + 8 * i)
        assert len(s.info["token_versions"]) == 12 + 8 * i and set(s.info["token_versions"]) <= {v + 1, v + 2}
    assert not engine._kept.finished  # nothing left behind for a caller that is gone
