"""Step 6 of the PPO-family loop, the weight push: wake the sleeping engines (the model roles' CUDA caches emptied
first), sync the policy's weights of this version into them, and time both (``wake_s``, ``sync_s``, the
transport's own figures). :class:`~rl_core.trainers.ppo.PPOTrainer` calls :func:`sync_engines` after each train
step and on resume; the transports themselves are :mod:`rl_core.rl.weight_syncs`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

from rl_core.rl.groups import concurrently


def release_device_caches(groups: Sequence[Any], parallel: bool) -> dict[str, float]:
    """Every model role's ranks empty torch's CUDA cache before the sleeping engines wake into that memory
    (part of ``wake_s``); on CUDA ``device_cache_freed_gb``, what they gave back (all ranks). ``parallel``: the
    groups are called at the same time (Ray actors), else one after the other."""
    calls = [lambda g=g: g.call("release_device_cache") for g in groups]
    ranks = [r for rs in (concurrently(*calls) if parallel else [f() for f in calls]) for r in rs]
    if ranks and all("freed_bytes" in r for r in ranks):
        return {"device_cache_freed_gb": sum(r["freed_bytes"] for r in ranks) / 1e9}
    return {}


def sync_engines(
    rollout: Any,
    weight_sync: Callable[[int], dict | None],
    version: int,
    *,
    sleep_engines: bool,
    sleep_level: int,
    release: Callable[[], dict[str, float]],
) -> dict[str, float]:
    """Wake the engines (timed apart: ``wake_s``), then push this version's weights (``sync_s``).

    With ``sleep_engines`` the model roles' caches are released first (``release``); at sleep level 2 only the
    weights' memory wakes before the sync, which refills every tensor, and the KV cache after it."""
    t0 = time.perf_counter()
    level2 = sleep_engines and sleep_level == 2
    released = {}
    if sleep_engines:  # level 2: only the weights' memory first; the sync refills every tensor
        released = release()
        rollout.wake_up(["weights"] if level2 else None)
    t1 = time.perf_counter()
    stats = weight_sync(version) or {}
    t2 = time.perf_counter()
    if level2:
        rollout.wake_up(["kv_cache"])
    out = {
        "wake_s": t1 - t0 + time.perf_counter() - t2,
        "sync_s": t2 - t1,
        "sync_gb_per_s": float(stats.get("gb_per_s", 0.0)),
        **released,
    }
    if "verify_s" in stats:  # the engines checked they hold what was sent (part of sync_s)
        out["sync_verify_s"] = float(stats["verify_s"])
    if "in_place" in stats:  # CUDA IPC: 1 when the engines read the policy's own memory, 0 from buckets
        out["sync_in_place"] = float(stats["in_place"])
    # CUDA IPC: the policy's call (packing, handles), the engines' load, and the time inside each (the rest Ray's)
    for part in ("share_s", "load_s", "share_work_s", "load_work_s"):
        if part in stats:
            out[f"sync_{part}"] = float(stats[part])
    return out
