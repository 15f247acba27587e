"""CUDA IPC weight sync into VLLMEngine: the hybrid engine's path (trainer and engine on one GPU).

A trainer process shares peaked weights through an :class:`~rl_rollout.ipc.IpcSender` three times
(fresh handles, then keys only, then fresh handles after a reset), packed into buckets or in place (the
trainer's own tensors); vLLM's worker opens each generation's handles once and loads the views. After every sync vLLM's
greedy outputs must equal, token for token, those of a transformers model holding the same weights.
Needs vLLM's GPU build and a GPU: on CPU it is skipped with the reason (vLLM's CPU build has no
CUDA), and runs on the GPU machine (shared/gpu/vllm-on-device.sh carries vLLM there).
"""

from __future__ import annotations


import pytest
import torch

from rl_rollout.testing import missing_modules

if why := missing_modules("vllm", where="run with vLLM's GPU build on a GPU"):
    pytest.skip(why, allow_module_level=True)

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600),
              pytest.mark.skipif(not torch.cuda.is_available(),
                                 reason="CUDA IPC needs a GPU; this machine has none (vLLM's CPU build has no CUDA)")]

PROMPTS = [[5, 60, 70], [5, 61, 62, 63, 64, 65, 66], [7], list(range(5, 45))]
N_TOKENS = 10


def greedy(engine) -> list[list[int]]:
    from rl_rollout import RolloutRequest, SamplingParams

    params = SamplingParams(temperature=0.0, max_new_tokens=N_TOKENS)
    return [g[0].response_ids for g in engine.generate([RolloutRequest(p, params) for p in PROMPTS])]


def reference_greedy(hf) -> list[list[int]]:
    from rl_rollout.testing import greedy_reference

    return greedy_reference(hf, PROMPTS, N_TOKENS)


@pytest.mark.parametrize("pack", [True, False], ids=["buckets", "in_place"])
def test_vllm_engine_takes_repeated_ipc_syncs_and_generates_from_them(tmp_path, pack):
    import torch.multiprocessing as mp
    from transformers import AutoModelForCausalLM

    from rl_rollout.testing import ipc_sender_process, make_tiny_model, peaked_weights
    from rl_rollout.vllm_engine import VLLMEngine

    path = make_tiny_model(tmp_path / "tiny", peaked=True)
    engine = VLLMEngine(path, dtype="float32", enforce_eager=True, max_model_len=256, seed=0,
                        engine_kwargs={"gpu_memory_utilization": 0.2})
    ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).cuda().eval()
    before = greedy(engine)
    assert before == reference_greedy(ref)  # the engine starts from the folder's weights
    ctx = mp.get_context("spawn")
    to_engine, from_engine = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=ipc_sender_process, args=(str(path), to_engine, from_engine, [1, 2, 3], pack))
    proc.start()
    outs, handles = [], []
    try:
        for version, seed in enumerate([1, 2, 3], start=1):
            sync = to_engine.get(timeout=300)
            handles.append(0 if sync.buckets is None else len(sync.buckets))
            n = engine.update_weights_ipc(sync, version=version)
            assert n > 0 and engine.policy_version == version
            ref.load_state_dict(peaked_weights(ref, seed=seed), strict=False)
            got = greedy(engine)
            assert got == reference_greedy(ref), (version, got)
            outs.append(got)
            from_engine.put("reset" if version == 2 else "ok")
        assert to_engine.get(timeout=60) is None
    finally:
        proc.join(60)
        engine.shutdown()
    assert proc.exitcode == 0
    assert handles[0] > 0 and handles[1] == 0 and handles[2] == handles[0], handles  # keys only in between
    assert before != outs[0] != outs[1] != outs[2]
