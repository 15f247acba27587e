"""A weight sync into vLLM must leave the engine computing exactly what the trainer holds (issue 16).

The trainer sends ``model.named_parameters()``: for a model with tied word embeddings that has
``model.embed_tokens.weight`` and no ``lm_head.weight``. Before the fix, vLLM's layerwise reload
(CPU build) refilled the embedding but never re-packed the LM head's kernel weights, so logits
came from the head of the first load ("ParallelLMHead: Failed to load weights" on every sync) and
the rollout logprobs drifted from the trainer's, more with every step.

Here, for a tied and an untied tiny Llama: perturb every parameter of a transformers copy, push
``named_parameters()`` with ``VLLMEngine.update_weights`` (several buckets, one reload session),
then vLLM's rollout logprobs at temperature 1 and its greedy tokens must equal transformers' on
the same tokens (fp32, ``LOGPROB_ATOL``), with no "Failed to load weights" from vLLM.

Then the check that makes a stale sync loud (``VLLMEngine.verify_weights``): it passes after every
sync, names the LM head when the old (unfixed) session leaves it stale, names a tensor that was not
sent, and a layer that got part of its weights fails the session. Also: the dtype names VLLMEngine
takes (fp32/bf16 ...), a bf16 engine checked against fp32 tensors, and the check's cost on a ~10M
parameter model.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time

import pytest
import torch

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

from rl_rollout.testing import missing_modules

if why := missing_modules("vllm"):
    pytest.skip(why, allow_module_level=True)

from rl_rollout import RolloutRequest, SamplingParams  # noqa: E402
from rl_rollout.testing import VLLM_CPU_TESTS_ON_CUDA, greedy_reference, make_tiny_model  # noqa: E402
from rl_rollout.transport import WeightSyncError  # noqa: E402
from rl_rollout.vllm_engine import VLLMEngine, vllm_dtype  # noqa: E402
from rl_rollout.weights import (  # noqa: E402
    TensorStats,
    compare_weight_stats,
    iter_buckets,
    tensor_stats,
    weight_stats,
)

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(300),
              pytest.mark.skipif(torch.cuda.is_available(), reason=VLLM_CPU_TESTS_ON_CUDA)]

LOGPROB_ATOL = 1e-4  # fp32 on both sides; kernel rounding (vLLM CPU attention vs sdpa) is about 1e-5
PROMPTS = [[5, 60, 70], [5, 61, 62, 63, 64, 65, 66], [7], [40, 41, 42, 43], list(range(5, 45))]
ENGINE_ARGS = dict(enforce_eager=True, max_model_len=256, seed=0, in_process=True, engine_kwargs={"block_size": 32})
BUCKET_BYTES = 64 * 1024  # several buckets: layers split across them


class ReloadWarnings(logging.Handler):
    """Collects vLLM's layerwise-reload warnings (the engine runs in this process)."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record):
        self.messages.append(record.getMessage())

    def __enter__(self):
        logging.getLogger("vllm.model_executor.model_loader.reload.layerwise").addHandler(self)
        return self

    def __exit__(self, *exc):
        logging.getLogger("vllm.model_executor.model_loader.reload.layerwise").removeHandler(self)


def hf_model(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def perturb_(model, generator, scale=0.05):
    """Add noise to every parameter (the embedding too), as a training step would."""
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=generator) * scale)


def logprob_gap(engine, hf, temperature=1.0):
    """Max |vLLM rollout logprob - transformers log_softmax(logits / T)| over sampled tokens."""
    params = SamplingParams(temperature=temperature, n=2, max_new_tokens=16, seed=11, ignore_eos=True)
    worst = 0.0
    for samples in engine.generate([RolloutRequest(p, params) for p in PROMPTS]):
        for s in samples:
            with torch.no_grad():
                ids = torch.tensor([s.prompt_ids + s.response_ids])
                logits_TV = hf(ids).logits[0, len(s.prompt_ids) - 1 : -1] / temperature
            ref = torch.log_softmax(logits_TV, -1).gather(-1, torch.tensor(s.response_ids)[:, None])[:, 0]
            worst = max(worst, (torch.tensor(s.rollout_logprobs) - ref).abs().max().item())
    return worst


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_sync_of_named_parameters_matches_transformers(tmp_path, tied):
    path = make_tiny_model(tmp_path / "m", peaked=True, seed=1, tie_word_embeddings=tied)
    hf = hf_model(path)
    assert hf.config.tie_word_embeddings is tied
    names = [n for n, _ in hf.named_parameters()]
    assert ("lm_head.weight" in names) is not tied  # what a trainer sends for a tied model: no lm_head
    engine = VLLMEngine(path, dtype="float32", bucket_bytes=BUCKET_BYTES, **ENGINE_ARGS)
    try:
        gaps = [logprob_gap(engine, hf)]
        g = torch.Generator().manual_seed(0)
        with ReloadWarnings() as warnings:
            for version in (1, 2, 3):
                perturb_(hf, g)
                t0 = time.perf_counter()
                engine.update_weights(hf.named_parameters(), version=version)
                sec = time.perf_counter() - t0
                gaps.append(logprob_gap(engine, hf))
                check = engine.verify_weights(weight_stats(hf.named_parameters()))
                assert check["tensors"] == len(names) + tied  # + the tied head, checked against the embedding
        print(f"\n{'tied' if tied else 'untied'}: logprob gap before/after syncs {['%.1e' % x for x in gaps]}, "
              f"last sync {sec * 1e3:.1f} ms, verify_weights {check['seconds'] * 1e3:.1f} ms")
        assert max(gaps) < LOGPROB_ATOL, gaps
        assert engine.policy_version == 3
        greedy = SamplingParams(temperature=0.0, max_new_tokens=12, ignore_eos=True)
        out = [o[0].response_ids for o in engine.generate([RolloutRequest(p, greedy) for p in PROMPTS])]
        ref = greedy_reference(hf, PROMPTS, 12)  # stops after EOS; the engine ignores EOS
        assert [o[: len(r)] for o, r in zip(out, ref, strict=True)] == ref
        assert not [m for m in warnings.messages if "Failed to load weights" in m], warnings.messages
    finally:
        engine.shutdown()


# ---- the check: VLLMEngine.verify_weights ----


@pytest.fixture(scope="module")
def tied_path(tmp_path_factory):
    # vocab 200: vLLM pads the embedding and head to 256 rows, which the check must leave out
    return make_tiny_model(tmp_path_factory.mktemp("tied") / "m", peaked=True, seed=1, vocab_size=200)


@pytest.fixture(scope="module")
def tied_engine(tied_path):
    eng = VLLMEngine(tied_path, dtype="fp32", bucket_bytes=BUCKET_BYTES, **ENGINE_ARGS)
    yield eng
    eng.shutdown()


def in_process_worker(engine):
    return engine._llm.llm_engine.model_executor.driver_worker.worker


def test_dtype_names_reach_vllm(tied_engine):
    for names, want in ((("float32", "fp32", torch.float32), "float32"), (("bfloat16", "bf16", torch.bfloat16), "bfloat16"),
                        (("float16", "fp16"), "float16"), (("auto",), "auto")):
        assert [vllm_dtype(n) for n in names] == [want] * len(names)
    with pytest.raises(ValueError, match="unknown dtype 'fp8x'"):
        vllm_dtype("fp8x")
    assert tied_engine.dtype == torch.float32  # built with dtype="fp32"


def test_verify_catches_the_stale_tied_head_of_issue_16(tied_engine, tied_path):
    """Replays the session as it was before the fix (no tie handling): vLLM skips the head, the check says so."""
    hf = hf_model(tied_path)
    perturb_(hf, torch.Generator().manual_seed(5))
    engine, worker = tied_engine, in_process_worker(tied_engine)
    with ReloadWarnings() as warnings:
        engine.begin_weight_update()
        try:
            worker._rl_ties = {}  # the unfixed worker: lm_head gets nothing
            for bucket in iter_buckets(hf.named_parameters(), BUCKET_BYTES):
                engine.load_bucket(bucket)
        finally:
            engine.finish_weight_update(version=7)
    assert "ParallelLMHead: Failed to load weights" in warnings.messages
    assert logprob_gap(engine, hf) > 1e-2  # the drift of issue 16
    with pytest.raises(WeightSyncError) as err:
        engine.verify_weights(weight_stats(hf.named_parameters()))
    problems = str(err.value).splitlines()[1:]
    assert len(problems) == 1 and problems[0].strip().startswith(
        "lm_head.weight (tied to model.embed_tokens.weight, which was sent)"), str(err.value)
    engine.update_weights(hf.named_parameters(), version=8, verify=True)  # the fixed session repairs it
    assert logprob_gap(engine, hf) < LOGPROB_ATOL


def test_verify_names_a_tensor_that_was_not_sent(tied_engine, tied_path):
    hf = hf_model(tied_path)
    perturb_(hf, torch.Generator().manual_seed(6))
    skipped = "model.layers.1.mlp.down_proj.weight"
    # update_weights(verify=True) checks what it sent; the layer that got nothing keeps its old weights
    tied_engine.update_weights(((n, p) for n, p in hf.named_parameters() if n != skipped), version=9, verify=True)
    with pytest.raises(WeightSyncError, match=r"1 of \d+ tensors checked differ") as err:
        tied_engine.verify_weights(weight_stats(hf.named_parameters()))  # what the trainer holds
    assert str(err.value).splitlines()[1].strip().startswith(f"{skipped}: sum "), str(err.value)
    # stats computed in another dtype than the engine's, or of other tensors, do not pass either
    expected = weight_stats(hf.named_parameters())
    expected["model.norm.weight"] = tensor_stats(hf.model.norm.weight + 1e-6)
    expected["model.extra.weight"] = TensorStats(1, 0.0, 0.0)
    with pytest.raises(WeightSyncError) as err:
        tied_engine.verify_weights(expected)
    text = str(err.value)
    assert "model.norm.weight: sum" in text and "model.extra.weight: the engine has no module 'model.extra'" in text
    tied_engine.update_weights(hf.named_parameters(), version=9, verify=True)
    assert tied_engine.policy_version == 9


def test_a_layer_split_across_sessions_fails_loudly(tied_engine, tied_path):
    """q_proj in one session and k/v_proj in the next: vLLM would process qkv_proj with undefined k/v."""
    hf = hf_model(tied_path)
    perturb_(hf, torch.Generator().manual_seed(7))
    version = tied_engine.policy_version
    first = [(n, p) for n, p in hf.named_parameters() if not n.startswith("model.layers.0.self_attn.") or "q_proj" in n]
    with pytest.raises(WeightSyncError, match=r"layers \['model.layers.0.self_attn.qkv_proj'\] got only part"):
        tied_engine.update_weights(first, version=version + 1)
    assert tied_engine.policy_version == version
    tied_engine.update_weights(hf.named_parameters(), version=version + 1, verify=True)
    assert logprob_gap(tied_engine, hf) < LOGPROB_ATOL


def test_state_dict_with_the_tied_head_loads_it_once(tied_engine, tied_path):
    """A trainer that sends state_dict() (lm_head.weight too) gets the same result and the same check."""
    hf = hf_model(tied_path)
    perturb_(hf, torch.Generator().manual_seed(8))
    state = hf.state_dict()
    assert "lm_head.weight" in state
    with ReloadWarnings() as warnings:
        expected = tied_engine.update_weights(state.items(), version=20, verify=True)
    assert "lm_head.weight" in expected and not warnings.messages
    assert logprob_gap(tied_engine, hf) < LOGPROB_ATOL


def test_compare_weight_stats_unit():
    t = torch.randn(64, 32)
    want = {"a": tensor_stats(t), "embed": tensor_stats(t)}
    # any layout of the same values matches: vLLM repacks and transposes
    same = {"a": tensor_stats(t.flip(0)), "embed": tensor_stats(t.t().contiguous()), "head": tensor_stats(t)}
    assert compare_weight_stats(want, same, ties={"head": "embed"}) == []
    moved = t.clone()
    moved[3, 4] += 1e-5  # one value, by 1e-5
    problems = compare_weight_stats(want, {**same, "head": tensor_stats(moved)}, ties={"head": "embed"})
    assert len(problems) == 1 and problems[0].startswith("head (tied to embed, which was sent): sum"), problems
    assert compare_weight_stats(want, {"a": tensor_stats(t[:-1])}, missing={"embed": "why"}) == [
        "a: 2016 elements, expected 2048", "embed: why"]
    # parts add up: q and k stats sum to those of the fused tensor
    q, k = torch.randn(8, 4), torch.randn(2, 4)
    assert compare_weight_stats({"x": tensor_stats(torch.cat([q, k]))}, {"x": tensor_stats(q) + tensor_stats(k)}) == []
    # the engine's dtype: fp32 values rounded to bf16 on load differ from the fp32 stats
    x = torch.randn(100)
    assert compare_weight_stats({"x": tensor_stats(x)}, {"x": tensor_stats(x.bfloat16())})
    assert compare_weight_stats({"x": tensor_stats(x, "bf16")}, {"x": tensor_stats(x.bfloat16())}) == []


def test_bf16_engine_checked_against_fp32_tensors(tied_engine, tied_path):
    tied_engine.shutdown()  # one engine at a time on 2 cores (the tests below build their own)
    hf = hf_model(tied_path)
    perturb_(hf, torch.Generator().manual_seed(9))
    engine = VLLMEngine(tied_path, dtype="bf16", **ENGINE_ARGS)
    try:
        assert engine.dtype == torch.bfloat16
        expected = engine.update_weights(hf.named_parameters(), version=1, verify=True)  # stats in bf16
        with pytest.raises(WeightSyncError, match="differ"):
            engine.verify_weights(weight_stats(hf.named_parameters()))  # fp32 stats: not what a bf16 engine holds
        assert engine.verify_weights(expected)["tensors"] == len(expected) + 1
    finally:
        engine.shutdown()


def test_verify_cost_10m_params(tmp_path):
    """The check after every sync: cost on a ~10M-parameter tied Llama (vocab 1000, padded to 1024 by vLLM)."""
    path = make_tiny_model(tmp_path / "m10", hidden_size=256, num_layers=10, num_heads=4, num_kv_heads=2,
                           intermediate_size=1024, vocab_size=1000, seed=3)
    hf = hf_model(path)
    n_params = sum(p.numel() for p in hf.parameters())
    assert 9e6 < n_params < 11e6, n_params
    perturb_(hf, torch.Generator().manual_seed(1), scale=0.01)
    engine = VLLMEngine(path, dtype="float32", **ENGINE_ARGS)
    try:
        t0 = time.perf_counter()
        engine.update_weights(hf.named_parameters(), version=1)
        t_sync = time.perf_counter() - t0
        t0 = time.perf_counter()
        expected = weight_stats(hf.named_parameters())
        t_expected = time.perf_counter() - t0
        checks = [engine.verify_weights(expected)["seconds"] for _ in range(3)]
        print(f"\n{n_params / 1e6:.1f}M params: sync {t_sync * 1e3:.0f} ms, weight_stats (trainer side) "
              f"{t_expected * 1e3:.0f} ms, verify_weights {min(checks) * 1e3:.0f} ms (best of 3)")
        assert min(checks) < 5.0
        assert logprob_gap(engine, hf) < LOGPROB_ATOL
    finally:
        engine.shutdown()


CORES = sorted(os.sched_getaffinity(0))


@pytest.mark.skipif(len(CORES) < 2, reason=f"vLLM's CPU workers each bind a core; TP 2 needs 2, this has {CORES}")
def test_verify_with_tensor_parallel_2(tmp_path):
    """Sums over two TP workers: q/o/gate/up/down and the vocabulary sharded, norms replicated, the one KV
    head on both ranks. Runs in a child process: this process's engines run vLLM in-process, a setting
    vLLM caches for the process."""
    path = make_tiny_model(tmp_path / "m", peaked=True, seed=1, vocab_size=200)  # 2 heads, 1 KV head
    env = {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": f"{CORES[0]}|{CORES[1]}", "VLLM_CPU_KVCACHE_SPACE": "1"}
    proc = subprocess.run([sys.executable, __file__, "tp2", str(path)], env=env, capture_output=True, text=True,
                          timeout=280)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    print("\n" + next(line for line in proc.stdout.splitlines() if line.startswith("TP 2:")))


def _tp2_child(path: str) -> None:
    hf = hf_model(path)
    engine = VLLMEngine(path, dtype="fp32", tensor_parallel_size=2, enforce_eager=True, max_model_len=256, seed=0)
    try:
        engine.verify_weights(weight_stats(hf.named_parameters()))  # the checkpoint as loaded
        perturb_(hf, torch.Generator().manual_seed(0))
        engine.update_weights(hf.named_parameters(), version=1, verify=True)
        assert logprob_gap(engine, hf) < LOGPROB_ATOL
        expected = weight_stats(hf.named_parameters())
        for name in ("model.layers.0.self_attn.k_proj.weight", "model.layers.1.mlp.up_proj.weight", "model.norm.weight"):
            wrong = dict(expected, **{name: tensor_stats(hf.get_parameter(name) * 1.001)})
            with pytest.raises(WeightSyncError) as err:
                engine.verify_weights(wrong)
            assert [line.split(":")[0].strip() for line in str(err.value).splitlines()[1:]] == [name]
        t0 = time.perf_counter()
        check = engine.verify_weights(expected)
        print(f"TP 2: verify_weights {check['tensors']} tensors over 2 workers in {(time.perf_counter() - t0) * 1e3:.0f} ms")
    finally:
        engine.shutdown()


if __name__ == "__main__":
    if sys.argv[1] == "tp2":
        _tp2_child(sys.argv[2])


def test_an_in_process_engine_takes_the_tensors_without_packing(tmp_path, monkeypatch):
    """in_process (sync mode): the tensors reach vLLM's worker as they are (on GPU they stay on the GPU);
    the byte-bucket path is not used, and the engine holds exactly what was sent."""
    import rl_rollout.vllm_weights as vw

    path = make_tiny_model(tmp_path / "m", peaked=True, seed=2)
    hf = hf_model(path)
    engine = VLLMEngine(path, dtype="float32", bucket_bytes=BUCKET_BYTES, **ENGINE_ARGS)
    try:
        assert engine.hands_over_tensors

        def no_packing(*a, **k):
            raise AssertionError("an in-process engine packed a byte bucket")

        monkeypatch.setattr(vw, "iter_buckets", no_packing)
        perturb_(hf, torch.Generator().manual_seed(3))
        engine.update_weights(hf.named_parameters(), version=1, verify=True)
        assert engine.policy_version == 1
        assert logprob_gap(engine, hf) < LOGPROB_ATOL

        # live=True: a trainer's own parameters, updated in place between syncs, sent in one group. No sync
        # walks vLLM's prefix cache to reset it: prompts are salted per weights, so the cache keeps serving
        # within one version and never serves KV of the old weights after a sync
        def no_reset(*a, **k):
            raise AssertionError("a weight sync reset vLLM's prefix cache")

        monkeypatch.setattr(engine._llm, "reset_prefix_cache", no_reset)
        long_prompt = RolloutRequest(PROMPTS[-1], SamplingParams(temperature=0.0, n=1, max_new_tokens=4))  # 40 tokens

        def cached_tokens():
            return engine.generate([long_prompt])[0][0].info["prompt_cached_tokens"]

        live = [(n, p.detach()) for n, p in hf.named_parameters()]
        for version in (2, 3):
            perturb_(hf, torch.Generator().manual_seed(version))
            engine.update_weights(live, version=version, verify=True, live=True)
            assert cached_tokens() == 0, version  # its KV of the old weights is not reused
            assert cached_tokens() == 32, version  # one full block of 32, cached under these weights
            assert logprob_gap(engine, hf) < LOGPROB_ATOL, version
        engine.update_weights(live, version=4, live=True)
        engine.update_weights(live, version=5, live=True)
        assert engine.policy_version == 5 and cached_tokens() == 0
    finally:
        engine.shutdown()
