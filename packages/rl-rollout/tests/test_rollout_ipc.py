"""CUDA IPC weight transport: a trainer process shares weights on the GPU, an HFEngine in another
process loads them in place. Needs CUDA (run on the GPU machine: ``python tests/test_rollout_ipc.py``
from packages/rl-rollout, or pytest); on CPU the GPU tests skip with the reason and the CPU check runs."""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import pytest
import torch

from rl_rollout.ipc import share_buckets

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="CUDA IPC needs a GPU; this machine has none (run on the GPU machine)")


def test_cpu_tensors_are_refused_with_the_alternative():
    with pytest.raises(ValueError, match="CUDA IPC shares CUDA memory; got device cpu.*gloo transport"):
        next(share_buckets([("w", torch.zeros(2))], device="cpu"))


def run_ipc(tmp: Path, corrupt: bool = False, pack: bool = True):
    import torch.multiprocessing as mp

    from rl_rollout.hf_engine import HFEngine
    from rl_rollout.testing import ipc_trainer_process, make_tiny_model, peaked_weights

    path = make_tiny_model(tmp / "tiny", peaked=True)
    engine = HFEngine(path, device="cuda")
    ctx = mp.get_context("spawn")
    queue, done = ctx.Queue(), ctx.Event()
    proc = ctx.Process(target=ipc_trainer_process, args=(str(path), queue, done, corrupt, 1, pack))
    proc.start()
    try:
        buckets = None
        for _ in range(300):  # fail fast if the trainer process dies instead of waiting out a timeout
            try:
                buckets = queue.get(timeout=1)
                break
            except Exception:  # queue.Empty
                assert proc.is_alive() or not queue.empty(), f"the trainer process died (exit {proc.exitcode})"
        assert buckets is not None, "no buckets from the trainer process in 300 s"
        assert len(buckets) > 1 and all(b.sha256 for b in buckets)
        if corrupt:
            with pytest.raises(ValueError, match="IPC bucket checksum mismatch"):
                engine.update_weights_ipc(buckets, version=1)
            assert engine.policy_version == 0
            return None
        n = engine.update_weights_ipc(buckets, version=1)
    finally:
        done.set()
        proc.join(60)
    assert proc.exitcode == 0 and engine.policy_version == 1
    from transformers import AutoModelForCausalLM

    from rl_rollout import RolloutRequest, SamplingParams

    ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).cuda()
    ref.load_state_dict(peaked_weights(ref, seed=1), strict=False)
    for name, p in ref.state_dict().items():
        torch.testing.assert_close(engine.model.state_dict()[name], p, rtol=0, atol=0)
    prompt = [5, 60, 70]
    got = engine.generate([RolloutRequest(prompt, SamplingParams(temperature=0, max_new_tokens=16))])[0][0]
    want = ref.generate(torch.tensor([prompt], device="cuda"), max_new_tokens=16, do_sample=False)[0, 3:].tolist()
    assert got.response_ids == want[:len(got.response_ids)]
    return n


@needs_cuda
@pytest.mark.parametrize("pack", [True, False])
def test_ipc_loads_the_trainers_weights_exactly(tmp_path, pack):
    assert run_ipc(tmp_path, pack=pack) > 0


@needs_cuda
def test_memory_changed_after_sharing_fails_loudly(tmp_path):
    run_ipc(tmp_path, corrupt=True)


if __name__ == "__main__":  # the GPU machine has no pytest
    with tempfile.TemporaryDirectory() as d:
        print("tensors loaded over CUDA IPC:", run_ipc(Path(d) / "a"), run_ipc(Path(d) / "c", pack=False))
        run_ipc(Path(d) / "b", corrupt=True)
        print("corrupted bucket refused: ok")
    sys.exit(0)
