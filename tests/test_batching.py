"""`BatchingLoop`: the asyncio loop both batching servers (RL inference, `kilovla serve`) run around
their `DynamicBatcher`, with a fake forward on a real one-thread executor. (The batcher itself is
tested with a fake clock in test_rl_core.py.)"""

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from kilovla.batching import BatchingLoop, DynamicBatcher

LONG = 60.0  # a max_wait no test waits out: a batch that runs, ran for another reason


class Forward:
    """Records each batch; answers request r with r * 10, or raises on the batches listed in `fail`."""

    def __init__(self, fail=()):
        self.batches, self.fail, self.threads = [], set(fail), set()

    def __call__(self, requests):
        self.threads.add(threading.current_thread().name)
        self.batches.append(list(requests))
        if len(self.batches) in self.fail:
            raise RuntimeError(f"batch {len(self.batches)} failed (injected)")
        return [r * 10 for r in requests]


def _serve(batching, body):
    """Run `body()` with `batching.run()` as a background task, in a fresh event loop."""
    async def main():
        task = asyncio.create_task(batching.run())
        try:
            return await asyncio.wait_for(body(), 10)
        finally:
            task.cancel()
    return asyncio.run(main())


def test_a_full_batch_runs_at_once_as_one_forward_and_each_request_gets_its_own_result():
    forward = Forward()
    with ThreadPoolExecutor(1, thread_name_prefix="infer") as pool:
        batching = BatchingLoop(DynamicBatcher(3, LONG), forward, pool)
        results = _serve(batching, lambda: asyncio.gather(*(batching.submit(r) for r in (1, 2, 3))))
    assert results == [10, 20, 30] and forward.batches == [[1, 2, 3]]
    assert forward.threads and all(name.startswith("infer") for name in forward.threads)  # off the event loop


def test_a_lone_request_runs_when_its_max_wait_runs_out():
    forward = Forward()
    with ThreadPoolExecutor(1) as pool:
        batching = BatchingLoop(DynamicBatcher(8, 0.02), forward, pool)
        assert _serve(batching, lambda: batching.submit(4)) == 40
    assert forward.batches == [[4]] and batching.batcher.stats.waits[0] >= 0.02


def test_all_queued_runs_the_batch_without_waiting_out_max_wait():
    forward = Forward()
    with ThreadPoolExecutor(1) as pool:
        batching = BatchingLoop(DynamicBatcher(8, LONG), forward, pool, all_queued=lambda n: n >= 2)
        assert _serve(batching, lambda: asyncio.gather(batching.submit(1), batching.submit(2))) == [10, 20]
    assert forward.batches == [[1, 2]]


def test_a_failed_batch_fails_every_request_of_it_and_the_loop_goes_on():
    forward = Forward(fail={1})
    with ThreadPoolExecutor(1) as pool:
        batching = BatchingLoop(DynamicBatcher(2, LONG), forward, pool)

        async def body():
            first = await asyncio.gather(batching.submit(1), batching.submit(2), return_exceptions=True)
            return first, await asyncio.gather(batching.submit(3), batching.submit(4))

        first, second = _serve(batching, body)
    assert [str(e) for e in first] == ["batch 1 failed (injected)"] * 2
    assert second == [30, 40] and forward.batches == [[1, 2], [3, 4]]


def test_a_request_whose_waiter_left_is_run_and_the_rest_of_its_batch_answered():
    forward = Forward()
    with ThreadPoolExecutor(1) as pool:
        batching = BatchingLoop(DynamicBatcher(3, LONG), forward, pool)

        async def body():
            leaving = asyncio.ensure_future(batching.submit(2))
            staying = [asyncio.ensure_future(batching.submit(r)) for r in (1, 3)]
            await asyncio.sleep(0)  # all three are queued
            leaving.cancel()
            return await asyncio.gather(*staying)

        assert _serve(batching, body) == [10, 30]
    assert forward.batches == [[2, 1, 3]]


def test_the_lock_keeps_a_batch_from_running_while_it_is_held():
    forward = Forward()
    with ThreadPoolExecutor(1) as pool:
        batching = BatchingLoop(DynamicBatcher(1, LONG), forward, pool, lock=asyncio.Lock())

        async def body():
            async with batching.lock:  # e.g. RL loading new weights
                request = asyncio.ensure_future(batching.submit(5))
                await asyncio.sleep(0.05)
                assert not request.done() and forward.batches == []
            return await request

        assert _serve(batching, body) == 50
    assert forward.batches == [[5]]


@pytest.mark.parametrize("max_wait", [0.0, LONG])
def test_max_batch_size_caps_a_batch_and_the_rest_runs_next(max_wait):
    forward = Forward()
    with ThreadPoolExecutor(1) as pool:
        batching = BatchingLoop(DynamicBatcher(2, max_wait), forward, pool, all_queued=lambda n: n >= 1)
        results = _serve(batching, lambda: asyncio.gather(*(batching.submit(r) for r in (1, 2, 3))))
    assert results == [10, 20, 30] and forward.batches == [[1, 2], [3]]
