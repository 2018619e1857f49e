"""Engines that execute a `GlobalBatchPlan`: they decide where decoding runs, never what is loaded.

- `InProcessLoader`: decodes in the training process (tests, 2-core boxes, debugging).
- `TorchLoader`: a torch DataLoader whose workers fetch whole packed rows; the sampler walks the plan
  in the main process and `in_order` delivery keeps the output identical to the in-process one
  for any number of workers. Pinned memory on CUDA.
- `RayLoader`: a pool of Ray actors, each holding the lake, fetches rows on any node of a Ray
  cluster (the elastic data lake); results come back in plan order.

All three yield the same thing: one packed row at a time, a dict of numpy arrays (camera frames
uint8 HWC) plus the packing metadata the model needs::

    {"step": 12, "row": 0, "rows_in_step": 3,        # optimizer step after the last row of a step
     "sample_index": (n,), "dataset_index": (n,),    # global sample ids of the row
     "lengths": (n,), "cu_seqlens": (n+1,) int32,     # token lengths and their prefix sums
     "position_ids": (T,) int64,                      # restart at 0 for every sample
     "action": (n, H, D), "action_is_pad": (n, H), "observation.images.front": (n, K, h, w, 3), ...}

From `TorchLoader` without pinned memory (CPU hosts) the large arrays are views of a shared-memory
slot, which is reused only once the row's arrays are all garbage: keep a row as long as needed, or
copy what outlives it (a kept slice holds its whole slot). With pinned memory (the default where
CUDA is available) every row is copied into pinned tensors and its slot is free at once.

`plan.step` advances when the last row of a step has been yielded, so `plan.state_dict()` taken
between steps resumes exactly there.
"""

from __future__ import annotations

import collections
import logging
import queue
import threading
import weakref
from collections.abc import Iterator

import numpy as np

from kilovla.data.lake import DataLake
from kilovla.data.plan import GlobalBatchPlan
from kilovla.data.ray_cluster import connect_ray, import_ray
from kilovla.errors import KilovlaError

log = logging.getLogger(__name__)


def packing_fields(lengths: np.ndarray) -> dict[str, np.ndarray]:
    """cu_seqlens and position_ids for samples of `lengths` laid end to end.

    >>> f = packing_fields(np.array([3, 2]))
    >>> f["cu_seqlens"].tolist(), f["position_ids"].tolist()
    ([0, 3, 5], [0, 1, 2, 0, 1])
    """
    lengths = np.asarray(lengths, dtype=np.int64)
    cu = np.concatenate([[0], np.cumsum(lengths)])
    position_ids = np.arange(cu[-1]) - np.repeat(cu[:-1], lengths)
    return {"lengths": lengths, "cu_seqlens": cu.astype(np.int32), "position_ids": position_ids}


def fetch_row(lake: DataLake, ids: np.ndarray) -> dict:
    """Decode and collate one packed row of global sample ids."""
    batch = lake.get_batch(ids)
    batch.update(packing_fields(lake.lengths[ids]))
    return batch


def _plan_rows(plan: GlobalBatchPlan, rank: int, world_size: int, start: int, stop: int | None):
    step = start
    while stop is None or step < stop:
        rows = plan.rank_rows(step, rank, world_size)
        for j, ids in enumerate(rows):
            yield step, j, len(rows), ids
        step += 1


def _stamp(batch: dict, step: int, j: int, n: int) -> dict:
    batch["step"], batch["row"], batch["rows_in_step"] = step, j, n
    return batch


class _Loader:
    def __init__(self, lake: DataLake, plan: GlobalBatchPlan, rank: int = 0, world_size: int = 1,
                 steps: int | None = None):
        if not 0 <= rank < world_size:
            raise KilovlaError(f"rank {rank} is outside world size {world_size}")
        self.lake, self.plan, self.rank, self.world_size, self.steps = lake, plan, rank, world_size, steps

    def _stop(self) -> int | None:
        return None if self.steps is None else self.plan.step + self.steps

    def _advance(self, batch: dict) -> dict:
        if batch["row"] == batch["rows_in_step"] - 1:
            self.plan.step = batch["step"] + 1
        return batch

    def frames_decoded(self) -> int:
        return sum(d.decoder_pool.frames_decoded for d in self.lake.datasets if d._pool is not None)


class InProcessLoader(_Loader):
    """Fetches rows in the calling process.

    With `prefetch` > 0 one background thread walks the plan (packing each step's rows) and fetches
    up to `prefetch` rows ahead, so both overlap the caller's work (video decoding and numpy release
    the GIL); 0 plans and fetches each row only when it is asked for. Rows come out in plan order
    either way, and an error while planning or fetching surfaces at the row it hit.
    """

    def __init__(self, lake, plan, rank=0, world_size=1, steps=None, prefetch: int = 2):
        super().__init__(lake, plan, rank, world_size, steps)
        if prefetch < 0:
            raise KilovlaError(f"prefetch must be >= 0, got {prefetch}")
        self.prefetch = prefetch

    def __iter__(self) -> Iterator[dict]:
        keys = _plan_rows(self.plan, self.rank, self.world_size, self.plan.step, self._stop())
        if self.prefetch == 0:
            for step, j, n, ids in keys:
                yield self._advance(_stamp(fetch_row(self.lake, ids), step, j, n))
            return
        ready: queue.Queue = queue.Queue(maxsize=self.prefetch)
        stop = threading.Event()

        def put(item) -> bool:
            while not stop.is_set():
                try:
                    ready.put(item, timeout=0.1)
                    return True
                except queue.Full:
                    continue
            return False

        def produce():
            try:
                for step, j, n, ids in keys:
                    if not put((_stamp(fetch_row(self.lake, ids), step, j, n), None)):
                        return
            except BaseException as e:  # noqa: BLE001  handed to the consumer at the row it hit
                put((None, e))
                return
            put((None, None))

        producer = threading.Thread(target=produce, name="kilovla-prefetch", daemon=True)
        producer.start()
        try:
            while True:
                batch, error = ready.get()
                if error is not None:
                    raise error
                if batch is None:
                    return
                yield self._advance(batch)
        finally:
            stop.set()
            producer.join()


# Arrays above this size leave a worker as tensors in shared memory; smaller ones are pickled
# through the pipe, which for a few kB is cheaper than handing over one more file descriptor.
SHARED_MEMORY_MIN_BYTES = 1 << 16


def _to_tensors(batch: dict) -> dict:
    """Large numpy arrays -> torch (no copy): a worker's tensors reach the main process through
    shared memory, where numpy arrays would be pickled through a pipe (a row of 30 samples of
    224 px frames is ~13 MB)."""
    import torch

    return {k: torch.from_numpy(v) if isinstance(v, np.ndarray) and v.dtype != object
            and v.nbytes >= SHARED_MEMORY_MIN_BYTES else v for k, v in batch.items()}


def _to_numpy(batch: dict) -> dict:
    import torch

    return {k: v.numpy() if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


class _RowDataset:
    """Map-style dataset whose keys are plan rows: (slot, step, row, rows_in_step, sample ids).

    With a slot, a worker writes a row's large arrays into that shared-memory slot and sends only
    where they lie; otherwise (or when they do not fit) they leave as tensors, which torch copies
    into a fresh shared-memory segment per row (~20 ms for a 13 MB row of 224 px frames, as long as
    decoding the row's frames)."""

    def __init__(self, lake: DataLake, slots: _SharedSlots | None = None):
        self.lake, self.slots = lake, slots

    def __getitem__(self, key):
        slot, step, j, n, ids = key
        batch = _stamp(fetch_row(self.lake, np.asarray(ids)), step, j, n)
        if slot is not None and self.slots.put(slot, batch):
            return batch
        return _to_tensors(batch)


class _SharedSlots:
    """Shared-memory buffers for the rows in flight, made before the workers start.

    The sampler (main process) gives each row a free slot when it hands the row to a worker; the
    worker writes the row's large arrays into it and sends only where they lie; the main process
    delivers views of the slot, no copy. A slot is free again when the last of its row's arrays is
    garbage (the consumer dropped the row, or copied what it keeps), never before: a consumer that
    holds many rows gets the later ones through torch's own per-row segments instead (`acquire`
    says None), slower but never overwritten.
    """

    def __init__(self, count: int, capacity: int):
        import torch

        self.buffers = [torch.empty(capacity, dtype=torch.uint8).share_memory_() for _ in range(count)]
        self.capacity = capacity
        self.free = collections.deque(range(count))  # this process's: the sampler pops, any thread's finalizer appends

    def acquire(self) -> int | None:
        return self.free.popleft() if self.free else None

    def put(self, slot: int, batch: dict) -> bool:
        """Move the row's large arrays into `slot` (in place in `batch`); False if they do not fit, and the
        slot comes back unused."""
        large = [key for key, v in batch.items() if isinstance(v, np.ndarray) and v.dtype != object
                 and v.nbytes >= SHARED_MEMORY_MIN_BYTES]
        placed = {}
        if sum(_aligned(batch[key].nbytes) for key in large) <= self.capacity:
            buffer, offset = self.buffers[slot].numpy(), 0
            for key in large:
                v = np.ascontiguousarray(batch.pop(key))
                buffer[offset:offset + v.nbytes] = v.reshape(-1).view(np.uint8)
                placed[key] = (offset, v.nbytes, v.shape, v.dtype.str)
                offset += _aligned(v.nbytes)
        batch["_slot"] = (slot, placed)  # nothing placed: `take` hands the slot straight back
        return bool(placed) or not large

    def take(self, batch: dict) -> dict:
        """The row with its arrays as views of its slot; the slot is freed when the last view is gone."""
        slot, placed = batch.pop("_slot")
        base = self.buffers[slot].numpy()  # a fresh array object: every view below keeps it alive
        weakref.finalize(base, self.free.append, slot)
        for key, (offset, nbytes, shape, dtype) in placed.items():
            batch[key] = base[offset:offset + nbytes].view(dtype).reshape(shape)
        return batch


def _aligned(nbytes: int) -> int:
    """`nbytes` rounded up to 64: each array of a slot starts on a cache line."""
    return -(-nbytes // 64) * 64


def _slot_capacity(lake: DataLake, rows: list[np.ndarray]) -> int:
    """Bytes a slot holds: the camera frames of the longest of `rows` (the plan's first step) plus a
    quarter, and 1 MiB for the other arrays (position ids of a 16k-token row: 128 kB)."""
    per_sample = 0
    for ds in lake.datasets:
        frames = 0
        for key in ds.meta.video_keys:
            shape = ds.meta.features[key].shape
            k = len((ds.delta_indices or {}).get(key, [0]))
            frames += k * int(np.prod(shape))
        per_sample = max(per_sample, frames)
    longest = max((len(r) for r in rows), default=0)
    return int(1.25 * longest * per_sample) + (1 << 20)


class _PlanSampler:
    """The plan's rows, each with the shared slot it goes to (None: no slot free, or no slots)."""

    def __init__(self, plan, rank, world_size, start, stop, slots: _SharedSlots | None):
        self.args, self.slots = (plan, rank, world_size, start, stop), slots

    def __iter__(self):
        for row in _plan_rows(*self.args):
            yield (None if self.slots is None else self.slots.acquire(), *row)


def _no_collate(batch):
    return batch


class TorchLoader(_Loader):
    """Rows fetched by torch DataLoader workers, delivered in plan order.

    Decoders are opened lazily inside each worker (the pool notices a fork and never reuses a
    parent's decoder). Workers start by fork, the fastest, unless this process has already decoded
    video: FFmpeg's threads may then hold locks that a forked child inherits locked (a hang), so
    "forkserver" is used instead.
    """

    def __init__(self, lake, plan, rank=0, world_size=1, steps=None, num_workers: int = 2, prefetch_factor: int = 2,
                 pin_memory: bool | None = None, multiprocessing_context: str | None = None):
        super().__init__(lake, plan, rank, world_size, steps)
        import torch

        self.num_workers = num_workers
        self.prefetch_factor = prefetch_factor if num_workers > 0 else None
        self.pin_memory = torch.cuda.is_available() if pin_memory is None else pin_memory
        self.multiprocessing_context = multiprocessing_context

    def __iter__(self) -> Iterator[dict]:
        import torch

        slots = self._slots()
        loader = torch.utils.data.DataLoader(
            _RowDataset(self.lake, slots), batch_size=None, collate_fn=_no_collate,
            sampler=_PlanSampler(self.plan, self.rank, self.world_size, self.plan.step, self._stop(), slots),
            num_workers=self.num_workers, prefetch_factor=self.prefetch_factor,
            multiprocessing_context=self._start_method() if self.num_workers else None,
            pin_memory=False, in_order=True,
        )
        for batch in loader:
            if "_slot" in batch:
                batch = slots.take(batch)
            if self.pin_memory:
                batch = {k: (v if isinstance(v, torch.Tensor) else torch.from_numpy(v)).pin_memory()
                         if isinstance(v, (np.ndarray, torch.Tensor)) and getattr(v, "dtype", None) != object else v
                         for k, v in batch.items()}
            else:
                batch = _to_numpy(batch)
            yield self._advance(batch)

    def _slots(self) -> _SharedSlots | None:
        """Shared slots for the rows in flight, where workers run and the lake has camera frames; None
        (rows leave as tensors) where shared memory cannot hold them, with one warning."""
        if not self.num_workers:
            return None
        capacity = _slot_capacity(self.lake, self.plan.rank_rows(self.plan.step, self.rank, self.world_size))
        if capacity <= 1 << 20:
            return None
        try:
            # rows in flight + the one just delivered + the one the consumer still holds + 1 spare
            return _SharedSlots(self.num_workers * self.prefetch_factor + 3, capacity)
        except (RuntimeError, OSError) as e:
            log.warning("TorchLoader: no shared-memory slots (%s); rows leave the workers as tensors", e)
            return None

    def _start_method(self) -> str:
        if self.multiprocessing_context is not None:
            return self.multiprocessing_context
        decoded_here = any(d._pool is not None and d._pool.open_files for d in self.lake.datasets)
        return "forkserver" if decoded_here else "fork"


class _RayFetcher:
    def __init__(self, lake):
        self.lake = lake

    def fetch(self, key):
        step, j, n, ids = key
        return _stamp(fetch_row(self.lake, np.asarray(ids)), step, j, n)


class RayLoader(_Loader):
    """Rows fetched by a pool of Ray actors (any node of the cluster), delivered in plan order.

    Ray is joined by `connect_ray`: a Ray already initialised here, else `address` or the
    RAY_ADDRESS environment variable, else a local instance (with one log line saying so).
    """

    def __init__(self, lake, plan, rank=0, world_size=1, steps=None, num_actors: int = 2,
                 num_cpus_per_actor: float = 1.0, max_in_flight: int | None = None, address: str | None = None):
        super().__init__(lake, plan, rank, world_size, steps)
        import_ray("the Ray loader")
        self.num_actors = num_actors
        self.num_cpus_per_actor = num_cpus_per_actor
        self.max_in_flight = max_in_flight or 2 * num_actors
        self.address = address

    def __iter__(self) -> Iterator[dict]:
        ray = connect_ray(self.address, num_cpus=max(2, self.num_actors), what="the Ray loader")
        lake_ref = ray.put(self.lake)
        actor_cls = ray.remote(num_cpus=self.num_cpus_per_actor)(_RayFetcher)
        actors = [actor_cls.remote(lake_ref) for _ in range(self.num_actors)]
        keys = _plan_rows(self.plan, self.rank, self.world_size, self.plan.step, self._stop())
        pending = []
        try:
            for n, key in enumerate(keys):
                pending.append(actors[n % len(actors)].fetch.remote(key))
                if len(pending) >= self.max_in_flight:
                    yield self._advance(ray.get(pending.pop(0)))
            while pending:
                yield self._advance(ray.get(pending.pop(0)))
        finally:
            for a in actors:
                ray.kill(a)


def build_loader(engine: str, lake: DataLake, plan: GlobalBatchPlan, **kwargs) -> _Loader:
    """engine: 'inprocess', 'torch' or 'ray'."""
    engines = {"inprocess": InProcessLoader, "torch": TorchLoader, "ray": RayLoader}
    if engine not in engines:
        raise KilovlaError(f"loader engine must be one of {sorted(engines)}, not {engine!r}")
    return engines[engine](lake, plan, **kwargs)
