"""``TickBatcher``: the calls of one event-loop tick form one batch, later calls the next; a failing batch
fails each of its callers; a batch function that answers the wrong number of requests is an error."""

from __future__ import annotations

import asyncio

import pytest

from rl_rollout import RolloutRequest, SamplingParams
from rl_rollout.tick_batch import TickBatcher


def request(i):
    return RolloutRequest([i], SamplingParams(max_new_tokens=1))


def test_one_batch_per_tick_and_failures_reach_every_caller():
    batches = []

    async def run_batch(reqs):
        batches.append([r.prompt_token_ids[0] for r in reqs])
        await asyncio.sleep(0)
        if any(r.prompt_token_ids[0] < 0 for r in reqs):
            raise RuntimeError("engine down")
        return [[r.prompt_token_ids[0] * 10] for r in reqs]

    ticks = TickBatcher(run_batch)

    async def main():
        first = await asyncio.gather(*(ticks.submit(request(i)) for i in range(3)))
        second = await ticks.submit(request(7))
        failed = await asyncio.gather(ticks.submit(request(-1)), ticks.submit(request(2)), return_exceptions=True)
        return first, second, failed

    first, second, failed = asyncio.run(main())
    assert batches == [[0, 1, 2], [7], [-1, 2]]
    assert first == [[0], [10], [20]] and second == [70]
    assert all(isinstance(e, RuntimeError) and "engine down" in str(e) for e in failed)


def test_a_short_answer_is_an_error():
    async def run_batch(reqs):
        return [[0]]

    async def main():
        ticks = TickBatcher(run_batch)
        return await asyncio.gather(ticks.submit(request(1)), ticks.submit(request(2)))

    with pytest.raises(RuntimeError, match="a batch of 2 requests returned 1 results"):
        asyncio.run(main())
