"""CUDA IPC weight transport: a trainer process shares weights on the GPU, an HFEngine in another
process loads them in place. Needs CUDA (run on the GPU machine: ``python tests/test_rollout_ipc.py``
from packages/rl-rollout, or pytest); on CPU the GPU tests skip with the reason and the CPU check runs."""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import pytest
import torch

from rl_rollout.ipc import IpcReceiver, IpcSender, IpcSync, share_buckets
from rl_rollout.weights import unpack_tensors

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="CUDA IPC needs a GPU; this machine has none (run on the GPU machine)")


def test_cpu_tensors_are_refused_with_the_alternative():
    with pytest.raises(ValueError, match="CUDA IPC shares CUDA memory; got device cpu.*gloo transport"):
        next(share_buckets([("w", torch.zeros(2))], device="cpu"))


def test_sender_refuses_cpu_and_receiver_names_the_fix_for_an_unknown_key():
    with pytest.raises(ValueError, match="CUDA IPC shares CUDA memory; got device cpu"):
        IpcSender(device="cpu")
    with pytest.raises(ValueError, match=r"abc/1 carries no handles and this engine never opened.*IpcSender.reset\(\)"):
        IpcReceiver().load(IpcSync("abc/1", count=3))


def _wait(queue, proc):
    for _ in range(300):  # fail fast if the trainer process dies instead of waiting out a timeout
        try:
            return queue.get(timeout=1)
        except Exception:  # queue.Empty
            assert proc.is_alive() or not queue.empty(), f"the trainer process died (exit {proc.exitcode})"
    raise AssertionError("nothing from the trainer process in 300 s")


def run_repeated(tmp: Path, pack: bool = True) -> list[int]:
    """Three syncs through one IpcSender: fresh handles, then keys only, then (after reset) fresh again."""
    import torch.multiprocessing as mp
    from transformers import AutoModelForCausalLM

    from rl_rollout import RolloutRequest, SamplingParams
    from rl_rollout.hf_engine import HFEngine
    from rl_rollout.testing import ipc_sender_process, make_tiny_model, peaked_weights

    path = make_tiny_model(tmp / "tiny", peaked=True)
    engine, restarted = HFEngine(path, device="cuda"), HFEngine(path, device="cuda")
    ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).cuda()
    ctx = mp.get_context("spawn")
    to_engine, from_engine = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=ipc_sender_process, args=(str(path), to_engine, from_engine, [1, 2, 3], pack))
    proc.start()
    handles, keys = [], []
    try:
        for version, seed in enumerate([1, 2, 3], start=1):
            sync = _wait(to_engine, proc)
            handles.append(0 if sync.buckets is None else len(sync.buckets))
            keys.append(sync.key)
            assert sync.count > 1 and len(sync.sha256) == sync.count
            if version == 2:  # the key only: an engine that never opened it is told the fix
                with pytest.raises(ValueError, match=r"IpcSender.reset\(\)"):
                    restarted.update_weights_ipc(sync, version=2)
            engine.update_weights_ipc(sync, version=version)
            ref.load_state_dict(peaked_weights(ref, seed=seed), strict=False)
            for name, p in ref.state_dict().items():
                torch.testing.assert_close(engine.model.state_dict()[name], p, rtol=0, atol=0)
            prompt = [5, 60, 70]
            got = engine.generate([RolloutRequest(prompt, SamplingParams(temperature=0, max_new_tokens=12))])[0][0]
            want = ref.generate(torch.tensor([prompt], device="cuda"), max_new_tokens=12, do_sample=False)[0, 3:]
            assert got.response_ids == want.tolist()[:len(got.response_ids)]
            from_engine.put("reset" if version == 2 else "ok")
        assert _wait(to_engine, proc) is None
    finally:
        proc.join(60)
    n = handles[0]
    assert proc.exitcode == 0 and engine.policy_version == 3 and n > 1
    assert handles == [n, 0, n], handles  # handles only with a generation's first sync
    assert keys[0] == keys[1] != keys[2], keys  # same buckets, then a new generation
    engine.shutdown()
    return handles


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
@pytest.mark.parametrize("pack", [True, False])
def test_repeated_syncs_reuse_opened_buckets(tmp_path, pack):
    run_repeated(tmp_path, pack=pack)


@needs_cuda
def test_memory_changed_after_sharing_fails_loudly(tmp_path):
    run_ipc(tmp_path, corrupt=True)


def test_sender_refuses_an_unknown_pack_mode():
    with pytest.raises(ValueError, match=r"IpcSender\(pack='yes'\): use True .*, False .* or 'auto'"):
        IpcSender(pack="yes")


@needs_cuda
def test_auto_sender_shares_in_place_until_the_weights_move():
    """pack="auto": the first syncs share the tensors' own memory (keys only after the first); a sync that finds
    them at other addresses (offloaded and reloaded) starts a packed generation, and a non-contiguous tensor,
    which cannot be shared in place, is packed from the start. The sender side only: a process cannot open its
    own IPC handles (the engine side in another process: rl-core's test_core_ppo_gpu.py with DeepSpeed sleep)."""
    w = {"a": torch.randn(64, 32, device="cuda"), "b": torch.randn(100, device="cuda")}
    sender = IpcSender(pack="auto")
    first = sender.share(list(w.items()))
    assert not sender.pack and len(first.buckets) == 2
    assert [b._payload.data_ptr() for b in first.buckets] == [w["a"].data_ptr(), w["b"].data_ptr()]  # no copy
    w["a"].mul_(2)  # updated in place: same generation, keys only
    second = sender.share(list(w.items()))
    assert second.buckets is None and second.key == first.key and not sender.pack
    w = {n: t.cpu().cuda() + 1 for n, t in w.items()}  # moved (DeepSpeed sleep's offload and reload)
    third = sender.share(list(w.items()))
    assert sender.pack and third.buckets is not None and third.key != first.key
    assert sender._buckets[0]._payload.data_ptr() != w["a"].data_ptr()  # a bucket's copy now
    views = dict(unpack_tensors(third.buckets[0].meta, sender._buckets[0]._payload))
    torch.testing.assert_close(views["b"], w["b"], rtol=0, atol=0)
    w["b"].add_(1)
    fourth = sender.share(list(w.items()))  # packed: refilled in place, keys only
    assert fourth.buckets is None and fourth.key == third.key
    torch.testing.assert_close(views["b"], w["b"], rtol=0, atol=0)
    strided = IpcSender(pack="auto")
    strided.share([("t", torch.randn(8, 4, device="cuda").t())])
    assert strided.pack
    with pytest.raises(ValueError, match="'t' is not contiguous .* use pack=True"):
        next(share_buckets([("t", torch.randn(8, 4, device="cuda").t())], pack=False))


if __name__ == "__main__":  # the GPU machine has no pytest
    with tempfile.TemporaryDirectory() as d:
        print("tensors loaded over CUDA IPC:", run_ipc(Path(d) / "a"), run_ipc(Path(d) / "c", pack=False))
        run_ipc(Path(d) / "b", corrupt=True)
        print("corrupted bucket refused: ok")
        print("handles per sync (IpcSender, packed):", run_repeated(Path(d) / "r"))
        print("handles per sync (IpcSender, in place):", run_repeated(Path(d) / "p", pack=False))
        test_sender_refuses_cpu_and_receiver_names_the_fix_for_an_unknown_key()
    sys.exit(0)
