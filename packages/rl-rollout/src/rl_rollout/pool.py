"""``EnginePool``: spread rollout requests over several engines by least outstanding work.

Anything with ``async agenerate(request) -> list[RolloutSample]`` can be a
member: a local :class:`~rl_rollout.engine.RolloutEngine`, or a handle to a
remote one (a Ray actor wrapper whose ``agenerate`` awaits the actor call).
Outstanding work is counted in sequences (``params.n`` per request) still
being generated on each engine; each request goes to the engine with the least
(ties: the lowest index), so a slow engine receives fewer requests over time.
Weight updates, sleep and shutdown fan out to every member. Left out: retries
and health checks (the placement layer owns those).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterable, Sequence
from typing import Any, Protocol

import torch

from rl_rollout.types import RolloutRequest, RolloutSample


class AsyncGenerator(Protocol):
    async def agenerate(self, request: RolloutRequest) -> list[RolloutSample]: ...


class EnginePool:
    def __init__(self, engines: Sequence[AsyncGenerator]) -> None:
        if not engines:
            raise ValueError("EnginePool needs at least one engine, got an empty sequence")
        for i, e in enumerate(engines):
            if not callable(getattr(e, "agenerate", None)):
                raise TypeError(f"engine {i} ({type(e).__name__}) has no agenerate(request); it cannot join a pool")
        self.engines = list(engines)
        self.outstanding = [0] * len(self.engines)  # sequences in flight per engine
        self.assigned = [0] * len(self.engines)  # requests ever sent, for metrics and tests
        self._lock = threading.Lock()

    @property
    def policy_version(self) -> int:
        """The lowest version among members that report one (the oldest weights still serving)."""
        versions = [v for e in self.engines if isinstance(v := getattr(e, "policy_version", None), int)]
        return min(versions) if versions else 0

    def _pick(self, cost: int) -> int:
        with self._lock:
            i = min(range(len(self.engines)), key=lambda k: (self.outstanding[k], k))
            self.outstanding[i] += cost
            self.assigned[i] += 1
            return i

    async def agenerate(self, request: RolloutRequest) -> list[RolloutSample]:
        cost = request.params.n
        i = self._pick(cost)
        try:
            samples = await self.engines[i].agenerate(request)
        finally:
            with self._lock:
                self.outstanding[i] -= cost
        for s in samples:
            s.info.setdefault("engine_index", i)
        return samples

    async def agenerate_many(self, requests: Iterable[RolloutRequest]) -> list[list[RolloutSample]]:
        return list(await asyncio.gather(*(self.agenerate(r) for r in requests)))

    def generate(self, requests: list[RolloutRequest]) -> list[list[RolloutSample]]:
        """Blocking form of :meth:`agenerate_many`; call it from code without a running event loop."""
        return asyncio.run(self.agenerate_many(requests))

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Send the same weights to every member (materialised once: each member consumes them)."""
        self._each("update_weights", list(named_tensors), version)

    def sleep(self, level: int = 1) -> None:
        self._each("sleep", level)

    def wake_up(self, tags: list[str] | None = None) -> None:
        self._each("wake_up", tags)

    def shutdown(self) -> None:
        self._each("shutdown")

    def _each(self, method: str, *args: Any) -> None:
        for e in self.engines:
            getattr(e, method)(*args)
