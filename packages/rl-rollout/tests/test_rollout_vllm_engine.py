"""VLLMEngine on the vLLM CPU build (run in .venv-vllm: scripts/vllm-cpu-env.sh test).

One in-process sync engine and one async engine for the module (engine start
is the dominant cost: about 5 s in-process, 18 s for AsyncLLM's engine process
on 2 cores). A transformers copy of the model (``ref.hf``) mirrors the engine's
weights, so every comparison is against the same numbers.

Logprob tolerance: vLLM's rollout logprobs (``processed_logprobs``) must match
``log_softmax(logits / T)`` recomputed by transformers on the same tokens within
``LOGPROB_ATOL = 1e-4`` absolute, float32 on both sides (measured max difference
on CPU: 8e-6; the gap is kernel rounding, vLLM's CPU attention vs sdpa).
"""

from __future__ import annotations

import asyncio
import os
import time

import pytest
import torch

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

from rl_rollout.testing import missing_modules

if why := missing_modules("vllm"):
    pytest.skip(why, allow_module_level=True)

from rl_rollout import EnginePool, RolloutRequest, SamplingParams  # noqa: E402
from rl_rollout.hf_engine import HFEngine  # noqa: E402
from rl_rollout.testing import VLLM_CPU_TESTS_ON_CUDA, make_tiny_model, peaked_weights  # noqa: E402
from rl_rollout.vllm_engine import VLLMEngine  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(300),
              pytest.mark.skipif(torch.cuda.is_available(), reason=VLLM_CPU_TESTS_ON_CUDA)]

LOGPROB_ATOL = 1e-4
# The last prompt spans two KV blocks of 32: its first block lands in the prefix cache, so a
# weight update that kept the prompts' prefix-cache salt would reuse stale KV and fail the greedy test.
PROMPTS = [[5, 60, 70], [5, 61, 62, 63, 64, 65, 66], [7], [40, 41, 42, 43], list(range(5, 45))]
ENGINE_ARGS = dict(
    dtype="float32", enforce_eager=True, max_model_len=256, seed=0, in_process=True,
    engine_kwargs={"block_size": 32},
)


class Ref:
    """A transformers model holding the same weights as the engines under test."""

    def __init__(self, path):
        from transformers import AutoModelForCausalLM

        self.hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()

    def set_weights(self, state):
        self.hf.load_state_dict(state)

    @torch.no_grad()
    def greedy(self, prompt, n_tokens):
        """Argmax decoding by full forward passes: no generate() defaults, no EOS handling."""
        ids = list(prompt)
        for _ in range(n_tokens):
            ids.append(int(self.hf(torch.tensor([ids])).logits[0, -1].argmax()))
        return ids[len(prompt) :]

    def logprobs(self, prompt, response, temperature):
        with torch.no_grad():
            logits_TV = self.hf(torch.tensor([prompt + response])).logits[0, len(prompt) - 1 : -1].float()
        if temperature > 0:
            logits_TV = logits_TV / temperature
        return torch.log_softmax(logits_TV, -1).gather(-1, torch.tensor(response)[:, None])[:, 0]


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "m", peaked=True, seed=1)


@pytest.fixture(scope="module")
def ref(model_path):
    return Ref(model_path)


@pytest.fixture(scope="module")
def engine(model_path):
    t0 = time.perf_counter()
    eng = VLLMEngine(model_path, **ENGINE_ARGS)
    print(f"\nVLLMEngine(sync, in_process) start: {time.perf_counter() - t0:.1f} s")
    yield eng
    eng.shutdown()


def greedy(n_tokens=12, **kw):
    return SamplingParams(temperature=0.0, max_new_tokens=n_tokens, ignore_eos=True, **kw)


def test_generate_n_samples(engine):
    params = SamplingParams(temperature=1.0, n=3, max_new_tokens=10, seed=7, ignore_eos=True)
    out = engine.generate([RolloutRequest(p, params) for p in PROMPTS])
    assert [len(s) for s in out] == [3] * len(PROMPTS)
    for prompt, samples in zip(PROMPTS, out, strict=True):
        assert [s.info["sample_index"] for s in samples] == [0, 1, 2]
        for s in samples:
            assert s.prompt_ids == prompt and s.finish_reason == "length"
            assert len(s.response_ids) == len(s.rollout_logprobs) == len(s.loss_mask) == 10
            assert all(lp <= 0 for lp in s.rollout_logprobs)
    assert len({tuple(s.response_ids) for s in out[1]}) > 1, "3 samples at temperature 1 were all identical"
    again = engine.generate([RolloutRequest(p, params) for p in PROMPTS])
    assert [[s.response_ids for s in g] for g in again] == [[s.response_ids for s in g] for g in out]


def test_seeded_prompts_over_one_steps_token_budget(engine):
    """More prompt tokens than one engine step takes (max_num_batched_tokens), every request seeded: with chunked
    prefill a prompt is split over two steps and vLLM's CPU worker crashed rewinding its generator ("CPU Generator
    does not use offset", seen with rl demo --n_samples_per_prompt 64); the engine turns chunked prefill off on CPU."""
    sched = engine._llm.llm_engine.vllm_config.scheduler_config
    assert sched.enable_chunked_prefill is False
    g = torch.Generator().manual_seed(0)
    n = sched.max_num_batched_tokens // 200 + 2  # distinct 200-token prompts: more than one step's budget
    prompts = [torch.randint(5, 120, (200,), generator=g).tolist() for _ in range(n)]
    params = SamplingParams(temperature=1.0, max_new_tokens=2, seed=3, ignore_eos=True)
    groups = engine.generate([RolloutRequest(p, params) for p in prompts])
    assert [len(gr[0].response_ids) for gr in groups] == [2] * n

@pytest.mark.parametrize("temperature", [0.0, 0.7, 1.0, 1.5])
def test_logprobs_match_transformers(engine, ref, temperature):
    params = SamplingParams(temperature=temperature, n=2, max_new_tokens=16, seed=11, ignore_eos=True)
    out = engine.generate([RolloutRequest(p, params) for p in PROMPTS])
    worst = 0.0
    for samples in out:
        for s in samples:
            expect = ref.logprobs(s.prompt_ids, s.response_ids, temperature)
            worst = max(worst, (torch.tensor(s.rollout_logprobs) - expect).abs().max().item())
    print(f"\nT={temperature}: max |vllm - transformers| logprob = {worst:.2e}")
    assert worst <= LOGPROB_ATOL


def test_update_weights_then_greedy_matches_transformers(engine, ref):
    before_digest = engine.weights_digest()
    # prompts run once with the old weights so their prefixes sit in the prefix cache
    old = engine.generate([RolloutRequest(p, greedy()) for p in PROMPTS])
    state = peaked_weights(ref.hf, seed=99)
    engine.bucket_bytes = 64 * 1024  # several buckets, layers split across them
    t0 = time.perf_counter()
    engine.update_weights(iter(state.items()), version=3, verify=True)  # checks what the engine holds
    print(f"\nupdate_weights ({sum(t.numel() * 4 for t in state.values()) / 1e6:.2f} MB): {time.perf_counter() - t0:.3f} s")
    ref.set_weights(state)
    assert engine.weights_digest() != before_digest
    new = engine.generate([RolloutRequest(p, greedy()) for p in PROMPTS])
    assert [n[0].response_ids for n in new] == [ref.greedy(p, 12) for p in PROMPTS]
    assert [n[0].response_ids for n in new] != [o[0].response_ids for o in old]
    assert all(n[0].policy_version == 3 for n in new)
    # a failed update leaves the old weights serving and the version unchanged
    with pytest.raises(Exception, match="nope"):
        engine.update_weights([("model.nope.weight", torch.zeros(2))], version=9)
    assert engine.policy_version == 3
    assert engine.generate([RolloutRequest(PROMPTS[4], greedy())])[0][0].response_ids == ref.greedy(PROMPTS[4], 12)


def test_a_vision_engine_on_a_vllm_without_the_encoder_cache_reset_is_refused_at_start(tmp_path, monkeypatch):
    """Without vLLM's reset_encoder_cache a vision engine would serve stale image embeddings after a sync: refused
    before vLLM starts (it used to be refused at the first sync, after the model had loaded)."""
    from vllm.v1.engine.llm_engine import LLMEngine

    from rl_rollout.testing import make_tiny_vlm

    vlm = make_tiny_vlm(tmp_path / "vlm")
    monkeypatch.delattr(LLMEngine, "reset_encoder_cache")
    with pytest.raises(RuntimeError, match="this vLLM has no reset_encoder_cache .* Upgrade vLLM"):
        VLLMEngine(vlm, **ENGINE_ARGS)


def test_a_sync_drops_the_image_embeddings_vllm_cached(engine, ref, monkeypatch):
    """vLLM keeps a vision model's image embeddings by image hash; after a sync they were computed with old weights
    (seen on an H100: a LLaVA synced with a new projector kept generating from the old embeddings of a repeated
    image). Every session of an engine that takes images ends in vLLM's own reset_encoder_cache, a failed one too.
    vLLM's CPU build runs no vision model (torchvision), so this text engine is made to say it takes images and
    the real reset runs; the GPU test (test_rollout_vllm_vision_gpu.py) checks the generations."""
    from rl_rollout.vllm_engine import VLLMEngine

    calls = []
    real = engine._llm.llm_engine.reset_encoder_cache
    monkeypatch.setattr(engine._llm.llm_engine, "reset_encoder_cache", lambda: (calls.append(1), real())[1])
    monkeypatch.setattr(VLLMEngine, "takes_images", property(lambda self: True))
    state = {n: t.clone() for n, t in ref.hf.state_dict().items()}
    engine.update_weights(state.items(), version=engine.policy_version)
    assert calls == [1]
    with pytest.raises(Exception, match="nope"):
        engine.update_weights([("model.nope.weight", torch.zeros(2))], version=engine.policy_version + 1)
    assert calls == [1, 1]
    monkeypatch.undo()
    engine.update_weights(state.items(), version=engine.policy_version)  # a text model: nothing to drop
    assert calls == [1, 1]
    assert engine.generate([RolloutRequest(PROMPTS[0], greedy(8))])[0][0].response_ids == ref.greedy(PROMPTS[0], 8)


def test_agenerate_batches_concurrent_calls(engine, ref):
    async def many():
        return await asyncio.gather(*(engine.agenerate(RolloutRequest(p, greedy())) for p in PROMPTS * 2))

    out = asyncio.run(many())
    assert [o[0].response_ids for o in out] == [ref.greedy(p, 12) for p in PROMPTS * 2]


def test_sleep_wake_keeps_working(engine, ref):
    expected = [ref.greedy(p, 8) for p in PROMPTS]
    assert engine.sleep_frees_memory is False  # vLLM has no sleep mode on CPU
    engine.sleep(level=1)
    with pytest.raises(RuntimeError, match="wake_up"):
        engine.generate([RolloutRequest(PROMPTS[0], greedy(8))])
    engine.wake_up()
    assert [o[0].response_ids for o in engine.generate([RolloutRequest(p, greedy(8)) for p in PROMPTS])] == expected
    # the RL pattern: drop everything, bring weights back, load new ones, then the KV cache
    engine.sleep(level=2)
    engine.wake_up(tags=["weights"])
    state = peaked_weights(ref.hf, seed=123)
    engine.update_weights(state.items(), version=4)
    engine.wake_up(tags=["kv_cache"])
    ref.set_weights(state)
    out = engine.generate([RolloutRequest(p, greedy(8)) for p in PROMPTS])
    assert [o[0].response_ids for o in out] == [ref.greedy(p, 8) for p in PROMPTS]


@pytest.mark.parametrize("raised", [RuntimeError, Exception])
def test_wake_up_out_of_memory_names_the_fix(engine, ref, monkeypatch, raised):
    """A GPU engine that cannot map its memory back on wake-up (the trainer in this process holds it: seen on the
    H200 with --vllm_gpu_memory_utilization 0.8 and a large micro-batch) fails in one message naming the flags.
    The out-of-memory itself cannot happen on CPU, so vLLM's wake_up is made to raise what vLLM raises: cumem's
    RuntimeError in this process, a plain Exception from an engine core in its own process (seen on an H100 in
    `rl ppo-ray`'s hybrid engine at the 1.5B shape, 2026-12-06)."""
    engine.sleep(level=1)

    def oom(tags=None):
        prefix = "" if raised is RuntimeError else "Call to wake_up method failed: "
        raise raised(prefix + "CUDA Error: out of memory at /workspace/csrc/cumem_allocator.cpp:163")

    monkeypatch.setattr(engine._llm, "wake_up", oom)
    with pytest.raises(RuntimeError, match=r"--vllm_gpu_memory_utilization.*--deepspeed_enable_sleep"):
        engine.wake_up(["kv_cache"])
    with pytest.raises(RuntimeError, match="wake_up"):  # still asleep: nothing pretends it woke
        engine.generate([RolloutRequest(PROMPTS[0], greedy(8))])
    monkeypatch.undo()
    engine.wake_up()
    assert engine.generate([RolloutRequest(PROMPTS[0], greedy(8))])[0][0].response_ids == ref.greedy(PROMPTS[0], 8)


def test_auto_picks_vllm_here():
    from rl_rollout import vllm_usable

    ok, why = vllm_usable()
    assert ok, why
    assert "cpu" in why


def test_sleep_mode_refused_on_cpu_with_clear_error(model_path):
    with pytest.raises(ValueError, match="enable_sleep_mode=None or False"):
        VLLMEngine(model_path, enable_sleep_mode=True, **ENGINE_ARGS)


def test_pool_of_vllm_and_hf_engine(engine, ref):
    hf = HFEngine(ref.hf)  # shares ref's weights: the same policy as the vLLM engine
    pool = EnginePool([engine, hf])
    reqs = [RolloutRequest(PROMPTS[i % len(PROMPTS)], greedy(8)) for i in range(8)]
    out = pool.generate(reqs)
    assert [o[0].response_ids for o in out] == [ref.greedy(r.prompt_token_ids, 8) for r in reqs]
    assert pool.assigned[0] > 0 and pool.assigned[1] > 0, pool.assigned
    assert pool.outstanding == [0, 0]


def test_async_mode(model_path, ref, engine):
    t0 = time.perf_counter()
    aeng = VLLMEngine(model_path, mode="async", **ENGINE_ARGS)
    print(f"\nVLLMEngine(async) start: {time.perf_counter() - t0:.1f} s")
    try:
        aeng.update_weights(ref.hf.state_dict().items(), version=4)  # same weights as ref now
        params = SamplingParams(temperature=1.0, n=3, max_new_tokens=10, seed=5, ignore_eos=True)
        out = aeng.generate([RolloutRequest(p, params) for p in PROMPTS])
        assert [len(s) for s in out] == [3] * len(PROMPTS)
        for samples in out:
            for s in samples:
                expect = ref.logprobs(s.prompt_ids, s.response_ids, 1.0)
                assert (torch.tensor(s.rollout_logprobs) - expect).abs().max().item() <= LOGPROB_ATOL

        async def concurrent():
            return await asyncio.gather(*(aeng.agenerate(RolloutRequest(p, greedy(8))) for p in PROMPTS))

        greedy_out = asyncio.run(concurrent())
        assert [g[0].response_ids for g in greedy_out] == [ref.greedy(p, 8) for p in PROMPTS]
        assert all(g[0].policy_version == 4 for g in greedy_out)
        aeng.sleep(1)
        aeng.wake_up()
        assert aeng.generate([RolloutRequest(PROMPTS[0], greedy(8))])[0][0].response_ids == ref.greedy(PROMPTS[0], 8)
    finally:
        aeng.shutdown()


def test_partial_rollout_lets_an_update_land_mid_response(engine, ref):
    """``partial_chunk_tokens`` (the RL loop's ``--partial_rollout``): a weight update sent while a response is
    being sampled lands between two chunks instead of waiting for the batch; every token is tagged with the
    weights that sampled it, and its rollout log-prob is that version's (transformers with those weights)."""
    import threading

    engine.update_weights(ref.hf.state_dict().items(), version=10)  # engine and ref hold the same weights
    old = {k: v.clone() for k, v in ref.hf.state_dict().items()}
    new = peaked_weights(ref.hf, seed=321)
    chunks, started, out = [], threading.Event(), {}
    locked = engine._generate_locked

    def counting(requests):
        chunks.append(len(requests))
        if len(chunks) == 3:
            started.set()
        return locked(requests)

    params = SamplingParams(temperature=1.0, n=2, max_new_tokens=40, seed=3, ignore_eos=True)
    engine._generate_locked, engine.partial_chunk_tokens = counting, 2
    try:
        t = threading.Thread(target=lambda: out.update(samples=engine.generate([RolloutRequest(PROMPTS[1], params)])))
        t.start()
        assert started.wait(60)
        engine.update_weights(new.items(), version=11)
        updated_after = len(chunks)
        t.join(120)
    finally:
        engine._generate_locked, engine.partial_chunk_tokens = locked, None
    assert updated_after < 20, f"the update waited for {updated_after} of 20 chunks"
    a, b = out["samples"][0]
    assert a.response_ids != b.response_ids  # a prompt's n samples are drawn apart (one seed per row and chunk)
    for s in out["samples"][0]:
        v = s.info["token_versions"]
        assert len(v) == len(s.response_ids) == 40 and v == sorted(v) and v[0] == 10 and v[-1] == 11, v
        assert s.policy_version == 10
        cut = v.index(11)
        ref.set_weights(old)
        before = ref.logprobs(s.prompt_ids, s.response_ids, 1.0)
        ref.set_weights(new)
        after = ref.logprobs(s.prompt_ids, s.response_ids, 1.0)
        got = torch.tensor(s.rollout_logprobs)
        assert (got[:cut] - before[:cut]).abs().max().item() <= LOGPROB_ATOL
        assert (got[cut:] - after[cut:]).abs().max().item() <= LOGPROB_ATOL
        assert (before[cut:] - after[cut:]).abs().max().item() > 1e-2  # the two versions really differ
    with pytest.raises(ValueError, match="at least 1|>= 1"):
        engine.partial_chunk_tokens = 0


def test_a_layer_vllms_model_is_built_without_is_left_out_of_the_check_not_missing():
    """vLLM builds LLaVA's CLIP tower without its post_layernorm (the features are taken before it; the attribute is
    None) and its loader skips those tensors: the weight check reports them as left out by design (``Dropped``),
    which verify_weights does not count, while a module the engine lacks stays a problem. (Found on an H100: the
    VLM loop's verify failed on ``vision_tower.post_layernorm``.)"""
    from rl_rollout.vllm_inspect import Dropped, Unsupported, param_stats

    model = torch.nn.Module()
    model.vision_tower = torch.nn.Module()
    model.vision_tower.vision_model = torch.nn.Module()
    model.vision_tower.vision_model.post_layernorm = None
    with pytest.raises(Dropped, match="leaves 'vision_tower.vision_model.post_layernorm' out"):
        param_stats(model, "vision_tower.vision_model.post_layernorm.weight", None, {}, torch.float32, {})
    with pytest.raises(Unsupported, match="the engine has no module 'vision_tower.other'") as e:
        param_stats(model, "vision_tower.other.weight", None, {}, torch.float32, {})
    assert not isinstance(e.value, Dropped)
