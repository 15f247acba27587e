"""Collective (gloo) weight transport into VLLMEngine on the vLLM CPU build (run in .venv-vllm).

A separate trainer process (``transport_trainer.py``, rank 0) broadcasts to the
in-process engine's worker (rank 1). After a sync, vLLM's greedy outputs must
equal, token for token, those of a transformers model holding the sent weights
(float32, peaked weights). The workers verify the bytes received; a corrupted
bucket fails on both ends and a resend recovers.
"""

from __future__ import annotations

import importlib.util
import os
import time
from pathlib import Path

import pytest
import torch

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

from rl_rollout.testing import missing_modules

if why := missing_modules("vllm"):
    pytest.skip(why, allow_module_level=True)

from rl_rollout import RolloutRequest, SamplingParams  # noqa: E402
from rl_rollout.testing import VLLM_CPU_TESTS_ON_CUDA, greedy_reference, make_tiny_model, peaked_weights  # noqa: E402
from rl_rollout.transport import WeightSyncError  # noqa: E402
from rl_rollout.vllm_engine import VLLMEngine  # noqa: E402
from rl_rollout.weights import weight_stats  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(300),
              pytest.mark.skipif(torch.cuda.is_available(), reason=VLLM_CPU_TESTS_ON_CUDA)]

# The last prompt spans two KV blocks of 32: a sync whose prompts kept their prefix-cache
# salt would reuse stale KV.
PROMPTS = [[5, 60, 70], [5, 61, 62, 63, 64, 65, 66], [7], [40, 41, 42, 43], list(range(5, 45))]
ENGINE_ARGS = dict(
    dtype="float32", enforce_eager=True, max_model_len=256, seed=0, in_process=True,
    engine_kwargs={"block_size": 32},
)
BUCKET_BYTES = 64 * 1024


def load_trainer_helper():
    path = Path(__file__).with_name("transport_trainer.py")
    spec = importlib.util.spec_from_file_location("transport_trainer", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "m", peaked=True, seed=1)


@pytest.fixture(scope="module")
def hf(model_path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def linked(model_path):
    """(trainer process, VLLMEngine) joined in one gloo weight group."""
    trainer = load_trainer_helper().TrainerProcess(model_path)
    t0 = time.perf_counter()
    engine = VLLMEngine(model_path, **ENGINE_ARGS)
    print(f"\nVLLMEngine(sync, in_process) start: {time.perf_counter() - t0:.1f} s")
    try:
        assert engine.init_weight_group("127.0.0.1", trainer.port, world_size=2, timeout_s=120) == [1]
        yield trainer, engine
    finally:
        trainer.close()
        engine.shutdown()


def reference_greedy(hf, state, n_tokens=12):
    return greedy_reference(hf, PROMPTS, n_tokens, state=state)


def greedy_outputs(engine, n_tokens=12):
    params = SamplingParams(temperature=0.0, max_new_tokens=n_tokens)
    return [o[0].response_ids for o in engine.generate([RolloutRequest(p, params) for p in PROMPTS])]


def test_broadcast_then_vllm_greedy_matches_transformers(linked, hf):
    trainer, engine = linked
    before_digest = engine.weights_digest()
    before = greedy_outputs(engine)  # prefixes now sit in the prefix cache
    state = peaked_weights(hf, seed=99)
    trainer.send(seed=99, version=3, bucket_bytes=BUCKET_BYTES)
    stats = engine.receive_weights(expected=weight_stats(state.items()))  # the sender's tensors: what vLLM must hold
    reply = trainer.reply()
    assert reply["ok"], reply
    assert stats.bytes == reply["stats"]["bytes"] == sum(t.numel() * t.element_size() for t in state.values())
    assert stats.buckets == reply["stats"]["buckets"] > 2 and stats.version == 3
    print(f"\ngloo sync into vLLM, {stats.bytes / 1e6:.2f} MB in {stats.buckets} buckets: "
          f"sender {reply['stats']['seconds']:.3f} s ({reply['stats']['gb_per_s']:.3f} GB/s), worker {stats.seconds:.3f} s")
    assert engine.policy_version == 3
    assert engine.weights_digest() != before_digest
    after = greedy_outputs(engine)
    assert after == reference_greedy(hf, state)
    assert after != before


def test_corrupted_bucket_fails_on_both_ends_then_resend_works(linked, hf):
    trainer, engine = linked
    version = engine.policy_version
    trainer.send(seed=7, version=version + 1, bucket_bytes=BUCKET_BYTES, corrupt=2)
    with pytest.raises(Exception, match=rf"weight bucket 2 of version {version + 1} .*arrived corrupted"):
        engine.receive_weights()
    reply = trainer.reply()
    assert not reply["ok"] and "1 of 1 engine workers failed" in reply["error"], reply
    assert engine.policy_version == version
    trainer.send(seed=7, version=version + 1, bucket_bytes=BUCKET_BYTES)
    engine.receive_weights()
    assert trainer.reply()["ok"]
    assert engine.policy_version == version + 1
    assert greedy_outputs(engine) == reference_greedy(hf, peaked_weights(hf, seed=7))
    assert issubclass(WeightSyncError, RuntimeError)
