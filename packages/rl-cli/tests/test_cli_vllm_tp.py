"""vLLM with tensor parallel 2, started as ``rl ppo-ray`` starts it (run in .venv-vllm: vLLM's CPU build,
Ray with logical GPUs).

One Ray actor on the engine's first bundle runs vLLM's multiprocessing executor, its two TP workers
on the GPU ids of the engine's two bundles (read from Ray before any actor, set as
CUDA_VISIBLE_DEVICES). This process then broadcasts new weights over gloo to both TP workers (a weight
group of 3 ranks, as ``BroadcastWeightSync(engine_workers=[2])`` builds it); vLLM's greedy outputs must
equal, token for token, those of a transformers model holding the sent weights (float32, peaked
weights), and differ from before the sync.
"""

from __future__ import annotations

import os
import socket
import threading

import pytest
import torch

from rl_rollout.testing import missing_modules

if why := missing_modules("ray", "vllm"):
    pytest.skip(why, allow_module_level=True)

import ray  # noqa: E402 (after the check that it imports)

from rl_cli.ray_engines import engine_gpus, start_engines  # noqa: E402
from rl_placement import PlacementPlan, create_placement_groups  # noqa: E402
from rl_rollout import RolloutRequest, SamplingParams  # noqa: E402
from rl_rollout.testing import VLLM_CPU_TESTS_ON_CUDA, greedy_reference, make_tiny_model, peaked_weights  # noqa: E402
from rl_rollout.transport import CollectiveSender  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600),
              pytest.mark.skipif(torch.cuda.is_available(), reason=VLLM_CPU_TESTS_ON_CUDA)]
PROMPTS = [[5, 60, 70], [5, 61, 62, 63, 64, 65, 66], [7], list(range(5, 45))]
CORES = sorted(os.sched_getaffinity(0))


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    # head_dim 64 (the CPU attention's smallest), 2 KV heads: one per TP rank
    return make_tiny_model(tmp_path_factory.mktemp("tp") / "m", hidden_size=128, num_heads=2, num_kv_heads=2,
                           peaked=True, seed=1)


def greedy(engine, n_tokens=12):
    params = SamplingParams(temperature=0.0, max_new_tokens=n_tokens)
    groups = engine.call_rank(0, "generate", [RolloutRequest(p, params) for p in PROMPTS])
    return [g[0].response_ids for g in groups]


@pytest.mark.skipif(len(CORES) < 2, reason=f"vLLM's CPU workers each bind a core; TP 2 needs 2, this has {CORES}")
def test_tp2_engine_on_its_bundles_gpus_takes_a_broadcast_into_both_workers(model_path):
    os.environ.setdefault("RAY_memory_monitor_refresh_ms", "0")
    ray.init(address="local", num_cpus=2, num_gpus=3, include_dashboard=False, log_to_driver=True)  # never a cluster another test left
    placed, engines = None, []
    try:
        plan = PlacementPlan.from_flags(actor_num_nodes=1, actor_num_gpus_per_node=1, vllm_num_engines=1,
                                        vllm_tensor_parallel_size=2)
        placed = create_placement_groups(plan)
        gpus = engine_gpus(placed)
        assert list(gpus) == [0] and len(set(gpus[0])) == 2, gpus
        env = {"VLLM_CPU_OMP_THREADS_BIND": f"{CORES[0]}|{CORES[1]}", "VLLM_CPU_KVCACHE_SPACE": "1"}
        with pytest.raises(ValueError, match=r"tensor parallel size 2: the hf engine runs on one GPU"):
            start_engines(placed, "hf", str(model_path), gpus=gpus)
        engines = start_engines(placed, "vllm", str(model_path), gpus=gpus, env=env, extra={
            "dtype": "float32", "enforce_eager": True, "max_model_len": 256})
        (engine,) = engines
        d = engine.call_rank(0, "describe")
        assert (d["kind"], d["tensor_parallel_size"], d["visible_devices"]) == ("VLLMEngine", 2, gpus[0])
        before = greedy(engine)

        from transformers import AutoModelForCausalLM

        hf = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
        state = peaked_weights(hf, seed=99)
        want = greedy_reference(hf, PROMPTS, 12, state=state)
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        box: dict = {}

        def trainer():  # rank 0, as PolicyWorker.init_weight_sender / broadcast_weights are
            try:
                sender = CollectiveSender("127.0.0.1", port, 3, backend="gloo", timeout_s=120)
                box["stats"] = sender.send(state.items(), 5, bucket_bytes=64 * 1024, checksum=True)
                sender.close()
            except BaseException as e:  # noqa: BLE001 - re-raised in the test thread
                box["error"] = e

        t = threading.Thread(target=trainer)
        t.start()
        ranks = engine.call_rank(0, "init_weight_group", "127.0.0.1", port, 3, rank_offset=1, backend="gloo",
                                 timeout_s=120)
        assert ranks == [1, 2]  # both TP workers joined
        stats = engine.call_rank(0, "receive_weights", verify=True)
        t.join(120)
        assert "error" not in box, box.get("error")
        assert stats["version"] == 5 and stats["bytes"] == box["stats"].bytes > 0
        after = greedy(engine)
        assert after == want
        assert after != before
    finally:
        for g in engines:
            g.shutdown()
        if placed is not None:
            placed.remove()
        ray.shutdown()
