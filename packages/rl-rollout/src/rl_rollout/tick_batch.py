"""``TickBatcher``: the ``agenerate`` calls made in one event-loop tick, run as one batch.

An agent executor's episodes each await their next turn; the calls they make in the
same tick (all episodes at turn one, then every episode whose environment answered)
are queued and handed together to ``run_batch(requests) -> [samples per request]``:
the HF engine turns them into one ``generate``, rl-core's ``GroupRollout`` into one
call per engine actor. Queues are kept per event loop (a batch never mixes two loops'
futures). A failing batch fails each of its callers with the same exception.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

from rl_rollout.types import RolloutRequest, RolloutSample

BatchFn = Callable[[list[RolloutRequest]], Awaitable[list[list[RolloutSample]]]]


class TickBatcher:
    def __init__(self, run_batch: BatchFn):
        self.run_batch = run_batch
        self._pending: dict[asyncio.AbstractEventLoop, list] = {}

    async def submit(self, request: RolloutRequest) -> list[RolloutSample]:
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        pending = self._pending.setdefault(loop, [])
        pending.append((request, future))
        if len(pending) == 1:  # runs after the coroutines already scheduled in this tick have queued theirs
            loop.call_soon(lambda: loop.create_task(self._flush(loop)))
        return await future

    async def _flush(self, loop: asyncio.AbstractEventLoop) -> None:
        batch = self._pending.pop(loop)
        try:
            results = await self.run_batch([r for r, _ in batch])
            if len(results) != len(batch):
                raise RuntimeError(f"a batch of {len(batch)} requests returned {len(results)} results")
        except BaseException as e:
            for _, f in batch:
                if not f.done():
                    f.set_exception(e)
            return
        for (_, f), samples in zip(batch, results, strict=True):
            if not f.done():
                f.set_result(samples)
