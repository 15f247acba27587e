"""The OpenAI-compatible endpoint (rl_rollout.openai_api) over the real HF engine on a tiny model, called over
real HTTP (httpx; the ``openai`` client where installed): replies in OpenAI's shapes, every call recorded
token-exact per episode (prompt ids as the chat template renders them, sampled ids that decode to the text,
the engine's log-probs as returned), and the refusals (401, 410, 400, 413, 503)."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest
from transformers import AutoTokenizer

from rl_rollout.hf_engine import HFEngine
from rl_rollout.openai_api import IGNORED_FIELDS, OpenAIServer, OpenAIServerConfig
from rl_rollout.testing import make_tiny_model

MESSAGES = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "2+2?"}]


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("oai") / "m", seed=3)


@pytest.fixture(scope="module")
def tok(model_path):
    return AutoTokenizer.from_pretrained(model_path)


@pytest.fixture(scope="module")
def server(model_path, tok):
    cfg = OpenAIServerConfig(max_request_bytes=4096, default_max_tokens=12, batch_window_ms=20)
    with OpenAIServer(HFEngine(model_path), tok, cfg) as srv:
        yield srv


def post(base, key, path, body, **kw):
    headers = {} if key is None else {"Authorization": f"Bearer {key}"}
    return httpx.post(base + path, json=body, headers=headers, timeout=30, **kw)


def test_chat_recorded_token_exact(server, tok):
    key, base = server.open_episode("row-0")
    r = post(
        base,
        key,
        "/chat/completions",
        {"model": "x", "messages": MESSAGES, "max_tokens": 10, "logprobs": True, "seed": 1, "user": "u"},
    )
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["object"] == "chat.completion" and out["model"] == "policy"
    (choice,) = out["choices"]
    (call,) = server.close_episode(key)
    (rec,) = call.choices
    assert call.prompt_ids == tok.apply_chat_template(
        MESSAGES, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    assert tok.decode(rec.response_ids, skip_special_tokens=True) == choice["message"]["content"] == rec.text
    assert [e["logprob"] for e in choice["logprobs"]["content"]] == rec.logprobs
    assert len(rec.logprobs) == len(rec.response_ids) >= 1 and all(lp <= 0 for lp in rec.logprobs)
    assert choice["finish_reason"] == rec.finish_reason and rec.policy_version == server.engine.policy_version
    assert out["usage"] == {
        "prompt_tokens": len(call.prompt_ids),
        "completion_tokens": len(rec.response_ids),
        "total_tokens": len(call.prompt_ids) + len(rec.response_ids),
    }
    (sample,) = call.samples()
    assert sample.prompt_ids == call.prompt_ids and sample.response_ids == rec.response_ids


def test_weight_version_recorded(server):
    key, base = server.open_episode(1)
    engine = server.engine
    engine.update_weights([(k, v.clone()) for k, v in engine.model.state_dict().items()], version=7)
    assert (
        post(base, key, "/chat/completions", {"model": "x", "messages": MESSAGES, "max_tokens": 3}).status_code == 200
    )
    (call,) = server.close_episode(key)
    assert engine.policy_version == 7 and call.choices[0].policy_version == 7


def test_stream_chat_and_completion(server, tok):
    key, base = server.open_episode("s")
    body = {
        "model": "x",
        "messages": MESSAGES,
        "max_tokens": 8,
        "stream": True,
        "logprobs": True,
        "n": 2,
        "temperature": 0.9,
        "stream_options": {"include_usage": True},
    }
    with httpx.stream("POST", base + "/chat/completions", json=body, headers={"Authorization": f"Bearer {key}"}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        lines = [ln for ln in r.iter_lines() if ln]
    assert lines[-1] == "data: [DONE]" and all(ln.startswith("data: ") for ln in lines)
    chunks = [json.loads(ln[6:]) for ln in lines[:-1]]
    texts, lps, finish = {0: "", 1: ""}, {0: [], 1: []}, {}
    for c in chunks[:-1]:
        (ch,) = c["choices"]
        texts[ch["index"]] += ch["delta"].get("content", "")
        lps[ch["index"]] += [e["logprob"] for e in (ch["logprobs"] or {}).get("content", [])]
        if ch["finish_reason"]:
            finish[ch["index"]] = ch["finish_reason"]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] >= 2
    r = post(base, key, "/completions", {"model": "x", "prompt": "abc", "max_tokens": 6, "stream": True, "logprobs": 0})
    events = [json.loads(ln[6:]) for ln in r.text.split("\n\n") if ln.startswith("data: {")]
    assert r.text.rstrip().endswith("data: [DONE]")
    completion_text = "".join(e["choices"][0]["text"] for e in events)
    chat, comp = server.close_episode(key)
    for i, rec in enumerate(chat.choices):
        assert texts[i] == rec.text == tok.decode(rec.response_ids, skip_special_tokens=True)
        assert lps[i] == rec.logprobs and finish[i] == rec.finish_reason
    assert comp.prompt_ids == tok.encode("abc", add_special_tokens=False)
    assert completion_text == comp.choices[0].text


def test_completions_n_and_token_prompt(server, tok):
    key, base = server.open_episode("c")
    r = post(
        base,
        key,
        "/completions",
        {"model": "x", "prompt": [5, 60, 70], "n": 3, "max_tokens": 5, "logprobs": 0, "temperature": 1.0},
    )
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["object"] == "text_completion" and [c["index"] for c in out["choices"]] == [0, 1, 2]
    (call,) = server.close_episode(key)
    assert call.prompt_ids == [5, 60, 70] and len(call.choices) == 3
    for c, rec in zip(out["choices"], call.choices, strict=True):
        assert c["text"] == rec.text == tok.decode(rec.response_ids, skip_special_tokens=True)
        assert c["logprobs"]["token_logprobs"] == rec.logprobs
    assert out["usage"]["completion_tokens"] == sum(len(c.response_ids) for c in call.choices)


def test_stop_string_cuts_text_and_record(server, tok):
    key, base = server.open_episode("stop")
    free = post(
        base, key, "/completions", {"model": "x", "prompt": "hello", "max_tokens": 12, "temperature": 0, "logprobs": 0}
    )
    text = free.json()["choices"][0]["text"]
    assert len(text) >= 4, text
    stop = text[2:4]  # greedy: the same continuation, cut where this first appears
    r = post(
        base,
        key,
        "/completions",
        {"model": "x", "prompt": "hello", "max_tokens": 12, "temperature": 0, "stop": [stop], "logprobs": 0},
    )
    cut = r.json()["choices"][0]
    _, call = server.close_episode(key)
    (rec,) = call.choices
    assert cut["text"] == text[: text.find(stop)] and cut["finish_reason"] == "stop" == rec.finish_reason
    assert tok.decode(rec.response_ids, skip_special_tokens=True).startswith(cut["text"] + stop)
    assert cut["logprobs"]["token_logprobs"] == rec.logprobs and len(rec.logprobs) == len(rec.response_ids)
    assert stop not in tok.decode(rec.response_ids[:-1], skip_special_tokens=True)  # cut right after the stop


def test_keys_and_refusals(server):
    key, base = server.open_episode("auth")
    body = {"model": "x", "messages": MESSAGES, "max_tokens": 2}
    assert post(base, None, "/chat/completions", body).status_code == 401
    assert post(base, "ep-wrong", "/chat/completions", body).status_code == 401
    models = httpx.get(base + "/models", headers={"Authorization": f"Bearer {key}"})
    assert models.json()["data"][0]["id"] == "policy"
    for field, value in (
        ("frequency_penalty", 0.5),
        ("top_logprobs", 2),
        ("tools", [{"type": "function"}]),
        ("tools", [{"type": "function", "function": {"name": "f"}}]),  # a template that never reads tools
        ("guided_json", {}),
    ):
        r = post(base, key, "/chat/completions", {**body, "logprobs": True, field: value})
        assert r.status_code == 400 and field in r.json()["error"]["message"], (field, r.text)
    r = post(base, key, "/completions", {"model": "x", "prompt": "a", "logprobs": 3})
    assert r.status_code == 400 and "logprobs" in r.json()["error"]["message"]
    r = post(base, key, "/completions", {"model": "x", "prompt": "abc", "max_tokens": 1024})  # the model's length
    assert r.status_code == 400 and "max_tokens=1024" in r.json()["error"]["message"]
    r = post(base, key, "/chat/completions", {**body, "messages": [{"role": "user", "content": "x" * 5000}]})
    assert r.status_code == 413
    before = server.stats().get("gone", 0)
    assert server.close_episode(key) == []  # refused calls are not recorded
    assert post(base, key, "/chat/completions", body).status_code == 410
    assert server.stats()["gone"] == before + 1 and server.stats()["status_413"] >= 1
    assert set(IGNORED_FIELDS) >= {"user", "metadata"}


def test_two_episodes_concurrently_batched(server, tok):
    """Two episodes' requests that wait while the engine is busy go to it as one call, each recorded in its own
    episode (the engine is held by a third request until both are queued: no timing luck)."""
    (ka, base), (kb, _), (kc, _) = server.open_episode("a"), server.open_episode("b"), server.open_episode("c")
    msgs = {k: [{"role": "user", "content": f"episode {k[-4:]}"}] for k in (ka, kb, kc)}
    engine, started, gate = server.engine, threading.Event(), threading.Event()
    generate = engine.generate

    def gated(reqs):
        started.set()
        gate.wait(20)
        return generate(reqs)

    replies: dict[str, dict] = {}

    def call(key):
        body = {"model": "x", "messages": msgs[key], "max_tokens": 4}
        replies[key] = post(base, key, "/chat/completions", body).json()

    engine.generate = gated
    try:
        batches0 = server.stats()["batches"]
        blocker = threading.Thread(target=call, args=(kc,))
        blocker.start()
        assert started.wait(20)
        threads = [threading.Thread(target=call, args=(k,)) for k in (ka, kb)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 20
        while server.stats()["queued"] < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert server.stats()["queued"] == 2
        gate.set()
        for t in (blocker, *threads):
            t.join()
    finally:
        gate.set()
        del engine.generate  # the class's method again
    for key in (ka, kb, kc):
        (call_,) = server.close_episode(key)
        rendered = tok.apply_chat_template(msgs[key], add_generation_prompt=True, tokenize=True, return_dict=False)
        assert call_.prompt_ids == rendered
        assert call_.choices[0].text == replies[key]["choices"][0]["message"]["content"]
    stats = server.stats()
    assert stats["batches"] - batches0 == 2 and stats["max_batch"] == 2  # the blocker's call, then a and b together


def test_closed_while_generating_is_410_not_recorded(server):
    key, base = server.open_episode("late")
    engine, started, gate = server.engine, threading.Event(), threading.Event()
    generate = engine.generate

    def gated(reqs):
        started.set()
        gate.wait(20)
        return generate(reqs)

    reply: list[httpx.Response] = []
    engine.generate = gated
    try:
        gone0 = server.stats().get("gone", 0)
        t = threading.Thread(
            target=lambda: reply.append(post(base, key, "/completions", {"model": "x", "prompt": "a"}))
        )
        t.start()
        assert started.wait(20)
        assert server.close_episode(key) == []
        gate.set()
        t.join()
    finally:
        gate.set()
        del engine.generate
    assert reply[0].status_code == 410 and server.stats()["gone"] == gone0 + 1


def test_busy_503_and_timeout_504(model_path, tok):
    engine = HFEngine(model_path)
    started, gate = threading.Event(), threading.Event()
    generate = engine.generate

    def gated(reqs):  # the real engine, held until the test lets it go
        started.set()
        gate.wait(10)
        return generate(reqs)

    engine.generate = gated
    cfg = OpenAIServerConfig(max_concurrent_requests=1, default_max_tokens=2, request_timeout_s=1.0)
    with OpenAIServer(engine, tok, cfg) as srv:
        key, base = srv.open_episode()
        body = {"model": "x", "prompt": "a"}
        first: list[httpx.Response] = []
        t = threading.Thread(target=lambda: first.append(post(base, key, "/completions", body)))
        t.start()
        assert started.wait(10)
        busy = post(base, key, "/completions", body)
        t.join()  # the held request runs past request_timeout_s
        gate.set()
        assert busy.status_code == 503 and busy.headers["retry-after"] == "1"
        assert first[0].status_code == 504 and "request_timeout_s" in first[0].json()["error"]["message"]
        ok = post(base, key, "/completions", body)
        assert ok.status_code == 200, ok.text
        calls = srv.close_episode(key)
        assert (
            len(calls) == 1 and calls[0].choices[0].text == ok.json()["choices"][0]["text"]
        )  # the 504 was not recorded
        stats = srv.stats()
        assert stats["timeouts"] == 1 and stats["status_503"] == 1 and stats["status_504"] == 1


def test_openai_client(server, tok):
    openai = pytest.importorskip("openai", reason="the openai package is not installed; httpx covers the wire")
    key, base = server.open_episode("client")
    client = openai.OpenAI(api_key=key, base_url=base, max_retries=0)
    out = client.chat.completions.create(model="policy", messages=MESSAGES, max_tokens=5, logprobs=True)
    stream = client.chat.completions.create(model="policy", messages=MESSAGES, max_tokens=5, stream=True)
    streamed = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    comp = client.completions.create(model="policy", prompt="abc", max_tokens=4, n=2)
    assert [m.id for m in client.models.list()] == ["policy"]
    chat, chat_stream, completion = server.close_episode(key)
    assert out.choices[0].message.content == chat.choices[0].text
    assert [e.logprob for e in out.choices[0].logprobs.content] == chat.choices[0].logprobs
    assert streamed == chat_stream.choices[0].text and out.usage.prompt_tokens == len(chat.prompt_ids)
    assert [c.text for c in comp.choices] == [c.text for c in completion.choices]
    with pytest.raises(openai.APIStatusError) as gone:
        client.chat.completions.create(model="policy", messages=MESSAGES, max_tokens=5)
    assert gone.value.status_code == 410
    with pytest.raises(openai.BadRequestError, match="presence_penalty"):
        openai.OpenAI(api_key=server.open_episode()[0], base_url=base).chat.completions.create(
            model="policy", messages=MESSAGES, presence_penalty=1.0
        )
