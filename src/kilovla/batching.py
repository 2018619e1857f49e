"""`DynamicBatcher`: RL-VLA3's inference batching (flush at `max_batch_size` requests or `max_wait`),
as a data structure with the time passed in, so a fake clock tests it. Both batching servers use it:
RL's inference server (envs asking for actions) and `kilovla serve` (robots asking for actions).

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

from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kilovla.errors import KilovlaError


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
