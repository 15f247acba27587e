"""Collective (gloo) weight transport: a separate trainer process broadcasts to an HFEngine (main venv).

The trainer is ``transport_trainer.py`` run as a script (rank 0); the engine in
this process is rank 1. Greedy outputs after a sync are compared token for
token with a transformers model holding the sent weights (full forward passes,
float32, peaked weights: no near-ties). The same trainer script feeds the vLLM
test (test_rollout_vllm_transport.py).
"""

from __future__ import annotations

import importlib.util
import logging
from pathlib import Path

import pytest
import torch

from rl_rollout import RolloutRequest, SamplingParams
from rl_rollout.hf_engine import HFEngine
from rl_rollout.testing import greedy_reference, make_tiny_model, peaked_weights
from rl_rollout.transport import WeightSyncError

pytestmark = pytest.mark.timeout(300)

PROMPTS = [[5, 60, 70], [5, 61, 62, 63, 64, 65, 66], [7], [40, 41, 42, 43]]
BUCKET_BYTES = 64 * 1024  # several buckets per sync on the tiny model


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
def linked(model_path):
    """(trainer process, HFEngine) joined in one gloo weight group."""
    trainer = load_trainer_helper().TrainerProcess(model_path)
    engine = HFEngine(model_path)
    try:
        engine.init_weight_group("127.0.0.1", trainer.port, world_size=2, rank=1, timeout_s=120)
        yield trainer, engine
    finally:
        trainer.close()


def reference_greedy(model_path, state, n_tokens=12):
    """Argmax decoding of PROMPTS by full forward passes of a transformers model with ``state``; stops after EOS."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    return greedy_reference(hf, PROMPTS, n_tokens, state=state)


def greedy_outputs(engine, n_tokens=12):
    params = SamplingParams(temperature=0.0, max_new_tokens=n_tokens)
    return [o[0].response_ids for o in engine.generate([RolloutRequest(p, params) for p in PROMPTS])]


def test_broadcast_then_greedy_matches_transformers(linked, model_path, caplog):
    trainer, engine = linked
    before = greedy_outputs(engine)
    state = peaked_weights(engine.model, seed=99)
    trainer.send(seed=99, version=3, bucket_bytes=BUCKET_BYTES)
    with caplog.at_level(logging.INFO, logger="rl_rollout.transport"):
        stats = engine.receive_weights()
    reply = trainer.reply()
    assert reply["ok"], reply
    sent = reply["stats"]
    expected_bytes = sum(t.numel() * t.element_size() for t in state.values())
    assert stats.bytes == sent["bytes"] == expected_bytes
    assert stats.tensors == sent["tensors"] == len(state)
    assert stats.buckets == sent["buckets"] > 2
    assert sent["gb_per_s"] == pytest.approx(sent["bytes"] / sent["seconds"] / 1e9)
    assert stats.gb_per_s > 0 and stats.version == 3
    assert any("GB/s" in r.getMessage() and "v3" in r.getMessage() for r in caplog.records)
    print(f"\ngloo sync of {stats.bytes / 1e6:.2f} MB in {stats.buckets} buckets: sender {sent['seconds']:.3f} s "
          f"({sent['gb_per_s']:.3f} GB/s), receiver {stats.seconds:.3f} s")

    assert engine.policy_version == 3
    for name, t in engine.model.state_dict().items():
        assert torch.equal(t, state[name]), name
    after = greedy_outputs(engine)
    assert after == reference_greedy(model_path, state)
    assert after != before


def test_corrupted_bucket_fails_loudly_on_both_ends_then_resend_works(linked, model_path):
    trainer, engine = linked
    version = engine.policy_version
    trainer.send(seed=7, version=version + 1, bucket_bytes=BUCKET_BYTES, corrupt=1)
    with pytest.raises(WeightSyncError, match=rf"weight bucket 1 of version {version + 1} .*arrived corrupted"):
        engine.receive_weights()
    reply = trainer.reply()
    assert not reply["ok"] and "1 of 1 engine workers failed" in reply["error"], reply
    assert engine.policy_version == version
    # the group is still in step: a clean resend loads and serves the new weights
    trainer.send(seed=7, version=version + 1, bucket_bytes=BUCKET_BYTES)
    engine.receive_weights()
    assert trainer.reply()["ok"]
    assert engine.policy_version == version + 1
    state = peaked_weights(engine.model, seed=7)
    assert greedy_outputs(engine) == reference_greedy(model_path, state)


def test_after_load_check_catches_a_loader_that_drops_a_tensor(linked, monkeypatch):
    trainer, engine = linked
    version = engine.policy_version
    copy = engine._copy_weights
    # a faulty loader: the wire bytes are intact, the model misses one tensor
    monkeypatch.setattr(engine, "_copy_weights", lambda named: copy([kv for kv in named if "o_proj" not in kv[0]]))
    monkeypatch.setattr(engine, "receive_in_place", False)  # every tensor through the (faulty) loader
    trainer.send(seed=5, version=version + 1, bucket_bytes=BUCKET_BYTES)
    with pytest.raises(WeightSyncError, match=rf"of version {version + 1} .*after the load the engine's weights"):
        engine.receive_weights()
    assert not trainer.reply()["ok"]
    assert engine.policy_version == version


def test_receive_without_group_and_bad_rank_are_clear_errors(model_path):
    from rl_rollout.transport import CollectiveReceiver

    with pytest.raises(RuntimeError, match="init_weight_group"):
        HFEngine(model_path).receive_weights()
    with pytest.raises(ValueError, match="rank 0 is the trainer"):
        CollectiveReceiver("127.0.0.1", 1, 0, 2)
    with pytest.raises(ValueError, match="backend must be one of"):
        CollectiveReceiver("127.0.0.1", 1, 1, 2, backend="mpi")
