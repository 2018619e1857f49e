"""The global batch plan: the single source of truth for which samples train when, and where.

`GlobalBatchPlan` is a pure function of (seed, epoch, step) and the sample lengths; it does no I/O
and keeps no hidden RNG state, so any engine (in-process, DataLoader workers, Ray actors) can
execute any part of it and every run sees the same batches::

    (seed, epoch)  -> epoch order: a keyed bijection of [0, samples per epoch) (mixture weights applied),
                      evaluated only at the positions a step needs
    step           -> global batch: the next `global_batch_size` samples of that order
                      (or as many as fit `global_batch_tokens`)
    world size R   -> per rank, packed rows: samples balanced over ranks by compute, then packed
                      best-fit-decreasing into rows of at most `token_budget` tokens

What follows from it, each tested:

- every sample appears once per epoch (with unit weights);
- resuming at step s gives the same batches as never stopping (the state is a handful of integers);
- the global batch of a step does not depend on R: a run can resume on another world size and see
  the same samples per step; only their split over ranks changes.

Cost. The epoch order is a Feistel network over the smallest even-bit domain holding the epoch's
samples, with cycle walking back into range (a permutation of [0, n) for any n; six rounds keyed from
(seed, epoch) by SeedSequence): position -> sample costs O(1), so a step with a fixed sample count
costs O(global batch) and no memory beyond the lengths' runs (`lengths.RunLengths`), at 10^3 samples
or 10^9. With `global_batch_tokens` a step ends where the running token total would pass the budget,
so step i's first position depends on every step before it in the epoch: the boundaries are found
walking the order forward in blocks and kept for the current and the previous epoch (a Python int per
step: ~36 MB for an epoch of 10^6 steps), so stepping forward costs O(global batch) amortised, and a
state resumes at its recorded
boundary without walking; asking for a step before the kept ones (or an epoch's step count,
`steps_in_epoch`) walks that epoch from its start, O(samples in the epoch) once.

Example::

    plan = GlobalBatchPlan(lengths, PlanConfig(seed=0, global_batch_size=256, token_budget=8192))
    ids = plan.global_batch(step=10)                       # 256 sample ids
    rows = plan.rank_rows(step=10, rank=3, world_size=8)   # rank 3's rows, each <= 8192 tokens
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from functools import lru_cache

import numpy as np

from kilovla.data.lengths import RunLengths
from kilovla.data.packing import plan_rank_rows
from kilovla.errors import KilovlaError

# The epoch order's version, recorded in the plan's state. 1: a numpy permutation of every sample per
# epoch (kilovla before the lake at scale); 2: the keyed Feistel bijection below. A state of another
# version is refused: its batches cannot be reproduced.
ORDER_VERSION = 2
FEISTEL_ROUNDS = 6
_M1, _M2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)


def _mix(x: np.ndarray, key: np.uint64) -> np.ndarray:
    """splitmix64's finaliser of x ^ key: a well-mixed 64-bit hash, vectorised."""
    with np.errstate(over="ignore"):
        z = x ^ key
        z = (z ^ (z >> np.uint64(30))) * _M1
        z = (z ^ (z >> np.uint64(27))) * _M2
        return z ^ (z >> np.uint64(31))


def feistel_permute(x: np.ndarray, n: int, keys: np.ndarray) -> np.ndarray:
    """A keyed bijection of [0, n), evaluated at the points x (all in [0, n)).

    A balanced Feistel network over 2^(2h) >= n values (so < 4n); a value that lands outside [0, n) is
    sent through again (cycle walking), which keeps the map a permutation of [0, n).
    """
    x = np.asarray(x, dtype=np.uint64)
    if n <= 1:
        return np.zeros(len(x), dtype=np.int64)
    h = max(1, ((n - 1).bit_length() + 1) // 2)
    mask, shift = np.uint64((1 << h) - 1), np.uint64(h)

    def once(v):
        left, right = v >> shift, v & mask
        for k in keys:
            left, right = right, left ^ (_mix(right, k) & mask)
        return (left << shift) | right

    y = once(x)
    out = y >= np.uint64(n)
    while out.any():
        idx = np.flatnonzero(out)
        y[idx] = once(y[idx])
        out[idx] = y[idx] >= np.uint64(n)
    return y.astype(np.int64)


@dataclass(frozen=True, kw_only=True, slots=True)
class PlanConfig:
    seed: int = 0
    global_batch_size: int = 256  # samples per optimizer step (ignored when global_batch_tokens is set)
    global_batch_tokens: int | None = None  # or: tokens per optimizer step
    token_budget: int = 8192  # most tokens in one packed row, i.e. one forward pass
    shuffle: bool = True
    drop_last: bool = True  # drop the epoch's last, incomplete global batch


class _TokenCuts:
    """An epoch's step boundaries under `global_batch_tokens`: positions[k] is where step first + k starts;
    `done` once the epoch's end was reached (then the last entry is the end)."""

    def __init__(self, first: int = 0, position: int = 0):
        self.first, self.positions, self.done = first, [position], False


class GlobalBatchPlan:
    """See the module docstring. `step` is the global step, counted across epochs.

    lengths: every sample's token length (an array or `RunLengths`); offsets: dataset d holds samples
    offsets[d] <= i < offsets[d + 1] (default: one dataset), each shown weights[d] times per epoch.
    """

    def __init__(self, lengths, config: PlanConfig = PlanConfig(), *, offsets: np.ndarray | None = None,
                 weights: np.ndarray | None = None, fingerprint: str = ""):
        self.lengths = lengths if isinstance(lengths, RunLengths) else RunLengths.from_array(lengths)
        self.config = config
        self.fingerprint = fingerprint
        n = len(self.lengths)
        if n == 0:
            raise KilovlaError("the plan has no samples")
        if config.global_batch_tokens is None and config.global_batch_size < 1:
            raise KilovlaError(f"global_batch_size must be >= 1, not {config.global_batch_size}")
        if self.lengths.max() > config.token_budget:
            raise KilovlaError(f"samples of up to {self.lengths.max()} tokens do not fit the token budget "
                               f"of {config.token_budget}")
        self.offsets = np.array([0, n], dtype=np.int64) if offsets is None else np.asarray(offsets, dtype=np.int64)
        if self.offsets[0] != 0 or self.offsets[-1] != n or np.any(np.diff(self.offsets) < 0):
            raise KilovlaError(f"dataset offsets must run from 0 to the {n} samples, got {self.offsets[:5].tolist()}...")
        sizes = np.diff(self.offsets)
        self._weights = np.ones(len(sizes)) if weights is None else np.asarray(weights, dtype=np.float64)
        if len(self._weights) != len(sizes):
            raise KilovlaError(f"{len(self._weights)} mixture weights for {len(sizes)} datasets")
        # Dataset d contributes round(w n) samples per epoch: floor(w) copies of each, then a keyed random
        # subset of the rest, drawn afresh every epoch.
        self._whole = np.floor(self._weights).astype(np.int64)
        counts = np.array([round(w * s) for w, s in zip(self._weights, sizes)], dtype=np.int64)
        self._counts = counts
        self._voffsets = np.concatenate([[0], np.cumsum(counts)])
        self.step = 0  # the next step a loader will produce; the only mutable state
        self._keys = lru_cache(maxsize=256)(self._make_keys)
        self._cuts: dict[int, _TokenCuts] = {}
        self._epoch_start = {0: 0}  # token mode: the first global step of each epoch walked so far
        if self.samples_per_epoch() == 0:
            raise KilovlaError("every dataset's mixture weight rounds to 0 samples: the epoch is empty")
        if self.steps_at_least(0, 1) == 0:
            size = (f"global_batch_tokens={config.global_batch_tokens}" if config.global_batch_tokens is not None
                    else f"global_batch_size={config.global_batch_size}")
            raise KilovlaError(f"an epoch of {self.samples_per_epoch()} samples makes no full global batch of "
                               f"{size}; lower it or set drop_last=False")

    @classmethod
    def from_lake(cls, lake, config: PlanConfig = PlanConfig()) -> GlobalBatchPlan:
        return cls(lake.lengths, config, offsets=lake.offsets, weights=lake.weights, fingerprint=lake.fingerprint())

    # -- epochs -------------------------------------------------------------------------------------
    def samples_per_epoch(self) -> int:
        return int(self._voffsets[-1])

    def _make_keys(self, *key: int) -> np.ndarray:
        return np.random.SeedSequence([self.config.seed, *key]).generate_state(FEISTEL_ROUNDS, dtype=np.uint64)

    def order_at(self, epoch: int, positions: np.ndarray) -> np.ndarray:
        """Sample ids at `positions` of the epoch's order."""
        v = np.asarray(positions, dtype=np.int64)
        if self.config.shuffle:
            v = feistel_permute(v, self.samples_per_epoch(), self._keys(epoch))
        d = np.searchsorted(self._voffsets, v, side="right") - 1
        j = v - self._voffsets[d]
        sizes = np.diff(self.offsets)[d]
        copied = self._whole[d] * sizes
        member = np.where(j < copied, j % np.maximum(sizes, 1), 0)
        for dataset in np.unique(d[j >= copied]):  # a dataset's fractional part: a keyed subset of its samples
            at = np.flatnonzero((d == dataset) & (j >= copied))
            member[at] = feistel_permute(j[at] - copied[at], int(sizes[at[0]]), self._keys(epoch, 1, int(dataset)))
        return self.offsets[d] + member

    def epoch_order(self, epoch: int) -> np.ndarray:
        """The whole epoch's order (O(samples per epoch): for tests and small lakes)."""
        return self.order_at(epoch, np.arange(self.samples_per_epoch()))

    def _walk(self, epoch: int, cuts: _TokenCuts, until: int) -> None:
        """Extend `cuts` until it holds step `until`'s end or the epoch's end."""
        cfg, total = self.config, self.samples_per_epoch()
        block = 4096
        while not cuts.done and cuts.first + len(cuts.positions) - 1 <= until:
            start = cuts.positions[-1]
            ids = self.order_at(epoch, np.arange(start, min(start + block, total)))
            csum = np.cumsum(self.lengths[ids])
            taken = 0
            while True:
                base = csum[taken - 1] if taken else 0
                end = int(np.searchsorted(csum, base + cfg.global_batch_tokens, side="right"))
                if end == taken:
                    raise KilovlaError(f"global_batch_tokens={cfg.global_batch_tokens} is smaller than one sample")
                if end == len(ids):  # the block ended inside this step
                    break
                taken = end
                cuts.positions.append(start + taken)
            if start + len(ids) == total:  # the epoch ends inside this step: a partial last batch
                if not cfg.drop_last and start + taken < total:
                    cuts.positions.append(total)
                cuts.done = True
            elif taken == 0:
                block *= 2  # one step holds more samples than the block

    def _token_cuts(self, epoch: int, i: int) -> _TokenCuts:
        cuts = self._cuts.get(epoch)
        if cuts is None or i < cuts.first:
            cuts = self._cuts[epoch] = _TokenCuts()
            for old in [e for e in self._cuts if e < epoch - 1]:  # bounded: the current and the previous epoch
                del self._cuts[old]
        self._walk(epoch, cuts, i)
        return cuts

    def steps_at_least(self, epoch: int, k: int) -> int:
        """min(k, steps in the epoch), walking no further than needed."""
        if self.config.global_batch_tokens is None:
            return min(k, self._fixed_steps())
        cuts = self._token_cuts(epoch, k - 1)
        return min(k, cuts.first + len(cuts.positions) - 1)

    def _fixed_steps(self) -> int:
        n, b = self.samples_per_epoch(), self.config.global_batch_size
        return n // b if self.config.drop_last else -(-n // b)

    def steps_in_epoch(self, epoch: int) -> int:
        if self.config.global_batch_tokens is None:
            return self._fixed_steps()
        cuts = self._token_cuts(epoch, 0)
        if cuts.first:  # known from a resumed boundary only: walk the epoch from its start
            cuts = self._cuts[epoch] = _TokenCuts()
        self._walk(epoch, cuts, np.iinfo(np.int64).max)
        return len(cuts.positions) - 1

    def locate(self, step: int) -> tuple[int, int]:
        """Global step -> (epoch, step within the epoch)."""
        if step < 0:
            raise KilovlaError(f"step must be >= 0, got {step}")
        if self.config.global_batch_tokens is None:
            return divmod(step, self._fixed_steps())
        epoch = max(e for e, first in self._epoch_start.items() if first <= step)
        while True:
            i = step - self._epoch_start[epoch]
            cuts = self._token_cuts(epoch, i)
            if cuts.first + len(cuts.positions) - 1 > i:
                return epoch, i
            self._epoch_start[epoch + 1] = self._epoch_start[epoch] + cuts.first + len(cuts.positions) - 1
            epoch += 1

    def _bounds(self, epoch: int, i: int) -> tuple[int, int]:
        if self.config.global_batch_tokens is None:
            b = self.config.global_batch_size
            return i * b, min((i + 1) * b, self.samples_per_epoch())
        cuts = self._token_cuts(epoch, i)
        k = i - cuts.first
        return cuts.positions[k], cuts.positions[k + 1]

    # -- steps -------------------------------------------------------------------------------------
    def global_batch(self, step: int) -> np.ndarray:
        """Sample ids of a global step; independent of the world size."""
        epoch, i = self.locate(step)
        lo, hi = self._bounds(epoch, i)
        return self.order_at(epoch, np.arange(lo, hi))

    def all_rank_rows(self, step: int, world_size: int) -> list[list[np.ndarray]]:
        """For every rank, its packed rows of sample ids; all ranks have the same number of rows."""
        ids = self.global_batch(step)
        per_rank = plan_rank_rows(self.lengths[ids], world_size, self.config.token_budget)
        return [[ids[row] for row in rows] for rows in per_rank]

    def rank_rows(self, step: int, rank: int, world_size: int) -> list[np.ndarray]:
        if not 0 <= rank < world_size:
            raise KilovlaError(f"rank {rank} is outside world size {world_size}")
        return self.all_rank_rows(step, world_size)[rank]

    # -- state -------------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        cfg = asdict(self.config)
        state = {"step": self.step, "seed": cfg["seed"], "global_batch_size": cfg["global_batch_size"],
                 "global_batch_tokens": cfg["global_batch_tokens"], "token_budget": cfg["token_budget"],
                 "num_samples": len(self.lengths), "fingerprint": self.fingerprint, "order": ORDER_VERSION,
                 "shuffle": cfg["shuffle"], "drop_last": cfg["drop_last"]}
        if cfg["global_batch_tokens"] is not None:  # where the next step starts: resuming walks nothing
            epoch, i = self.locate(self.step)
            state.update(epoch=epoch, epoch_start=self.step - i, position=self._bounds(epoch, i)[0])
        return state

    def load_state_dict(self, state: dict) -> None:
        """Resume at state['step']; refuses a state from a plan with other samples, batches or order.

        The world size is deliberately not part of the state: resuming on another one is allowed.
        """
        order = state.get("order", 1)
        if order != ORDER_VERSION:
            raise KilovlaError(f"cannot resume: the saved plan drew its epochs with order version {order} (a full "
                               f"permutation per epoch, kilovla before the lake at scale), this one with version "
                               f"{ORDER_VERSION}; finish that run with the kilovla that started it, or start a new run")
        mine = {**asdict(self.config), "num_samples": len(self.lengths), "fingerprint": self.fingerprint}
        for key in ("seed", "global_batch_size", "global_batch_tokens", "num_samples", "fingerprint", "shuffle",
                    "drop_last"):
            if key in state and state[key] != mine[key]:
                raise KilovlaError(f"cannot resume: the saved plan has {key}={state[key]!r}, this one {mine[key]!r}")
        self.step = int(state["step"])
        if self.config.global_batch_tokens is not None and "position" in state:
            epoch = int(state["epoch"])
            self._epoch_start = {0: 0, epoch: int(state["epoch_start"])}
            self._cuts = {epoch: _TokenCuts(self.step - int(state["epoch_start"]), int(state["position"]))}


def padding_fraction(row_lengths: list[int] | np.ndarray, budget: int) -> float:
    """Share of row capacity not holding real tokens: 1 - sum(lengths) / (rows * budget)."""
    total = float(np.sum(row_lengths))
    return 1.0 - total / (len(row_lengths) * budget) if len(row_lengths) else 0.0
