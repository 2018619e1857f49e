"""`DynamicBatcher`: RL-VLA3's inference batching (flush at `max_batch_size` requests or `max_wait`),
as a data structure with the time passed in, so a fake clock tests it. `BatchingLoop`: the asyncio
loop around it. Both batching servers run the two: RL's inference server (envs asking for actions)
and `kilovla serve` (robots asking for actions).

    batcher = DynamicBatcher(max_batch_size=8, max_wait=0.005)
    batcher.put(request, now)              # an env asks for an action
    if batcher.ready(now):                 # the model is free: is there a batch to run?
        batch = batcher.take(now)          # up to 8 requests, oldest first
    batcher.deadline()                     # when the oldest request's wait runs out (None if empty)

Two choices differ from RL-VLA3's `PerEnvDynamicBatchingEngine`:

- the wait clock starts when a request *arrives* (each request's own arrival), not when the engine
  starts waiting: there, after an idle gap longer than T_max, the first arrival is flushed alone;
- `take` drains greedily: whatever is queued when the model frees up goes into the batch (up to
  `max_batch_size`), so a backlog that built up during the last forward never waits again.

With max_wait = 0 the batcher is continuous batching: run as soon as the model is free, with
whatever has queued meanwhile.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter, deque
from collections.abc import Callable
from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kilovla.errors import KilovlaError

log = logging.getLogger(__name__)


@dataclass
class BatcherStats:
    """Achieved batch sizes and the time each request spent queued (arrival -> its batch taken)."""

    batch_sizes: Counter = field(default_factory=Counter)
    waits: list[float] = field(default_factory=list)

    def summary(self) -> dict:
        waits = np.asarray(self.waits) if self.waits else np.zeros(1)
        n = sum(self.batch_sizes.values())
        return {"batches": n, "requests": len(self.waits),
                "mean_batch_size": (sum(k * v for k, v in self.batch_sizes.items()) / n) if n else 0.0,
                "batch_size_histogram": {str(k): v for k, v in sorted(self.batch_sizes.items())},
                "queue_wait_p50_s": float(np.percentile(waits, 50)),
                "queue_wait_p99_s": float(np.percentile(waits, 99))}


class DynamicBatcher:
    def __init__(self, max_batch_size: int, max_wait: float):
        if max_batch_size < 1 or max_wait < 0:
            raise KilovlaError(f"batcher needs max_batch_size >= 1 and max_wait >= 0, got {max_batch_size}, {max_wait}")
        self.max_batch_size, self.max_wait = max_batch_size, max_wait
        self._queue: deque[tuple[float, Any]] = deque()
        self.stats = BatcherStats()

    def __len__(self) -> int:
        return len(self._queue)

    def put(self, request: Any, now: float) -> None:
        self._queue.append((now, request))

    def deadline(self) -> float | None:
        """When the oldest queued request has waited `max_wait`; None when nothing is queued."""
        return self._queue[0][0] + self.max_wait if self._queue else None

    def ready(self, now: float) -> bool:
        """A batch should run now: it is full, or the oldest request has waited long enough."""
        return bool(self._queue) and (len(self._queue) >= self.max_batch_size or now >= self.deadline())

    def take(self, now: float) -> list:
        """The oldest queued requests, at most `max_batch_size` of them (all that are queued, if fewer)."""
        n = min(len(self._queue), self.max_batch_size)
        batch = [self._queue.popleft() for _ in range(n)]
        if batch:
            self.stats.batch_sizes[n] += 1
            self.stats.waits.extend(now - arrived for arrived, _ in batch)
        return [request for _, request in batch]


class BatchingLoop:
    """Requests `submit`ted from any coroutine queue in `batcher`; `run()` (one task) waits until a
    batch is ready, runs `forward(requests) -> one result per request` on `executor`, so the event
    loop stays free meanwhile, and answers each request with its result, or every request of the
    batch with the batch's exception. The loop goes on after a failed batch.

        batching = BatchingLoop(DynamicBatcher(8, 0.005), forward, ThreadPoolExecutor(1))
        task = asyncio.create_task(batching.run())
        result = await batching.submit(request)    # from as many coroutines as ask

    `lock` is held while a batch runs (RL: weights never change inside a batch). `all_queued(n)`
    says n queued requests are all that can come (every open connection is waiting): the batch runs
    at once instead of waiting out `max_wait`. A request whose waiter went away (its future is done)
    is run and its result dropped.
    """

    def __init__(self, batcher: DynamicBatcher, forward: Callable[[list], list], executor: Executor,
                 lock: asyncio.Lock | None = None, all_queued: Callable[[int], bool] | None = None):
        self.batcher, self.forward, self.executor = batcher, forward, executor
        self.lock, self.all_queued = lock, all_queued
        self._wake = asyncio.Event()  # binds to the event loop that first waits on it

    async def submit(self, request: Any, now: float | None = None) -> Any:
        """`request`'s result once its batch has run (`now`: its arrival, default the current time)."""
        future = asyncio.get_running_loop().create_future()
        self.batcher.put((request, future), time.monotonic() if now is None else now)
        self._wake.set()
        return await future

    def _flush_now(self, now: float) -> bool:
        queued = len(self.batcher)
        everyone = bool(queued) and self.all_queued is not None and self.all_queued(queued)
        return everyone or self.batcher.ready(now)

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            now = time.monotonic()
            if not self._flush_now(now):
                deadline = self.batcher.deadline()
                self._wake.clear()
                try:
                    await asyncio.wait_for(self._wake.wait(), None if deadline is None else max(0.0, deadline - now))
                except TimeoutError:
                    pass
                continue
            batch = self.batcher.take(time.monotonic())
            async with self.lock or contextlib.nullcontext():
                try:
                    results = await loop.run_in_executor(self.executor, self.forward, [r for r, _ in batch])
                except Exception as e:  # noqa: BLE001  every request of the batch gets the failure, none hangs
                    log.error("inference failed on a batch of %d: %s", len(batch), e)
                    for _, future in batch:
                        if not future.done():
                            future.set_exception(e)
                    continue
            for (_, future), result in zip(batch, results):
                if not future.done():
                    future.set_result(result)
