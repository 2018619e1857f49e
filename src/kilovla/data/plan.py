"""The global batch plan: the single source of truth for which samples train when, and where.

`GlobalBatchPlan` is a pure function of (seed, epoch, step) and the sample lengths; it does no I/O
and keeps no hidden RNG state, so any engine (in-process, DataLoader workers, Ray actors) can
execute any part of it and every run sees the same batches::

    (seed, epoch)  -> epoch order: a permutation of the epoch's samples (mixture weights applied)
    step           -> global batch: the next `global_batch_size` samples of that order
                      (or as many as fit `global_batch_tokens`)
    world size R   -> per rank, packed rows: samples balanced over ranks by compute, then packed
                      best-fit-decreasing into rows of at most `token_budget` tokens

What follows from it, each tested:

- every sample appears once per epoch (with unit weights);
- resuming at step s gives the same batches as never stopping (the state is a handful of integers);
- the global batch of a step does not depend on R: a run can resume on another world size and see
  the same samples per step; only their split over ranks changes.

Example::

    plan = GlobalBatchPlan(lengths, PlanConfig(seed=0, global_batch_size=256, token_budget=8192))
    ids = plan.global_batch(step=10)                       # 256 sample ids
    rows = plan.rank_rows(step=10, rank=3, world_size=8)   # rank 3's rows, each <= 8192 tokens
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from functools import lru_cache

import numpy as np

from kilovla.data.packing import plan_rank_rows
from kilovla.errors import KilovlaError


@dataclass(frozen=True, kw_only=True, slots=True)
class PlanConfig:
    seed: int = 0
    global_batch_size: int = 256  # samples per optimizer step (ignored when global_batch_tokens is set)
    global_batch_tokens: int | None = None  # or: tokens per optimizer step
    token_budget: int = 8192  # most tokens in one packed row, i.e. one forward pass
    shuffle: bool = True
    drop_last: bool = True  # drop the epoch's last, incomplete global batch


class GlobalBatchPlan:
    """See the module docstring. `step` is the global step, counted across epochs."""

    def __init__(self, lengths: np.ndarray, config: PlanConfig = PlanConfig(), *,
                 dataset_of_sample: np.ndarray | None = None, weights: np.ndarray | None = None,
                 fingerprint: str = ""):
        self.lengths = np.asarray(lengths, dtype=np.int64)
        self.config = config
        self.fingerprint = fingerprint
        n = len(self.lengths)
        if n == 0:
            raise KilovlaError("the plan has no samples")
        if config.global_batch_tokens is None and config.global_batch_size < 1:
            raise KilovlaError(f"global_batch_size must be >= 1, not {config.global_batch_size}")
        if self.lengths.max() > config.token_budget:
            raise KilovlaError(f"samples of up to {int(self.lengths.max())} tokens do not fit the token budget "
                               f"of {config.token_budget}")
        self._dataset_of = np.zeros(n, dtype=np.int64) if dataset_of_sample is None else np.asarray(dataset_of_sample)
        self._weights = np.ones(int(self._dataset_of.max()) + 1) if weights is None else np.asarray(weights, float)
        self._members = [np.flatnonzero(self._dataset_of == d) for d in range(len(self._weights))]
        self.step = 0  # the next step a loader will produce; the only mutable state
        self._epoch_cache = lru_cache(maxsize=4)(self._epoch)
        first = self.steps_in_epoch(0)
        if first == 0:
            raise KilovlaError(f"an epoch of {self.samples_per_epoch()} samples makes no full global batch "
                               f"of {config.global_batch_size}; lower the batch size or set drop_last=False")

    @classmethod
    def from_lake(cls, lake, config: PlanConfig = PlanConfig()) -> GlobalBatchPlan:
        return cls(lake.lengths, config, dataset_of_sample=lake.dataset_of(np.arange(len(lake))),
                   weights=lake.weights, fingerprint=lake.fingerprint())

    # -- epochs -------------------------------------------------------------------------------------
    def samples_per_epoch(self) -> int:
        return int(sum(round(w * len(m)) for w, m in zip(self._weights, self._members)))

    def _rng(self, *key: int) -> np.random.Generator:
        return np.random.default_rng(np.random.SeedSequence([self.config.seed, *key]))

    def _epoch(self, epoch: int) -> tuple[np.ndarray, np.ndarray]:
        """(order, cuts): the epoch's sample ids and where each global batch starts."""
        rng = self._rng(epoch)
        parts = []
        for w, members in zip(self._weights, self._members):
            whole, frac = divmod(w, 1.0)
            parts += [members] * int(whole)
            extra = round(w * len(members)) - int(whole) * len(members)
            if extra > 0:
                parts.append(np.sort(rng.choice(members, size=extra, replace=False)))
        order = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
        if self.config.shuffle:
            order = order[rng.permutation(len(order))]
        cfg = self.config
        if cfg.global_batch_tokens is None:
            full = len(order) // cfg.global_batch_size
            cuts = np.arange(full + 1) * cfg.global_batch_size
            if not cfg.drop_last and len(order) % cfg.global_batch_size:
                cuts = np.append(cuts, len(order))
        else:
            # Greedy cut: a step takes samples while its token total stays within global_batch_tokens.
            csum = np.concatenate([[0], np.cumsum(self.lengths[order])])
            cuts = [0]
            while True:
                end = int(np.searchsorted(csum, csum[cuts[-1]] + cfg.global_batch_tokens, side="right")) - 1
                if end <= cuts[-1]:
                    raise KilovlaError(f"global_batch_tokens={cfg.global_batch_tokens} is smaller than one sample")
                if end >= len(order):
                    if not cfg.drop_last and cuts[-1] < len(order):
                        cuts.append(len(order))
                    break
                cuts.append(end)
            cuts = np.array(cuts)
        return order, cuts

    def epoch_order(self, epoch: int) -> np.ndarray:
        return self._epoch_cache(epoch)[0]

    def steps_in_epoch(self, epoch: int) -> int:
        return len(self._epoch_cache(epoch)[1]) - 1

    def locate(self, step: int) -> tuple[int, int]:
        """Global step -> (epoch, step within the epoch)."""
        if step < 0:
            raise KilovlaError(f"step must be >= 0, got {step}")
        if self.config.global_batch_tokens is None:
            per = self.steps_in_epoch(0)
            return divmod(step, per)
        epoch = 0
        while step >= (n := self.steps_in_epoch(epoch)):
            step -= n
            epoch += 1
        return epoch, step

    # -- steps -------------------------------------------------------------------------------------
    def global_batch(self, step: int) -> np.ndarray:
        """Sample ids of a global step; independent of the world size."""
        epoch, i = self.locate(step)
        order, cuts = self._epoch_cache(epoch)
        return order[cuts[i]:cuts[i + 1]]

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
        return {"step": self.step, "seed": cfg["seed"], "global_batch_size": cfg["global_batch_size"],
                "global_batch_tokens": cfg["global_batch_tokens"], "token_budget": cfg["token_budget"],
                "num_samples": len(self.lengths), "fingerprint": self.fingerprint}

    def load_state_dict(self, state: dict) -> None:
        """Resume at state['step']; refuses a state from a plan with other samples or batches.

        The world size is deliberately not part of the state: resuming on another one is allowed.
        """
        mine = self.state_dict()
        for key in ("seed", "global_batch_size", "global_batch_tokens", "num_samples", "fingerprint"):
            if key in state and state[key] != mine[key]:
                raise KilovlaError(f"cannot resume: the saved plan has {key}={state[key]!r}, this one {mine[key]!r}")
        self.step = int(state["step"])


def padding_fraction(row_lengths: list[int] | np.ndarray, budget: int) -> float:
    """Share of row capacity not holding real tokens: 1 - sum(lengths) / (rows * budget)."""
    total = float(np.sum(row_lengths))
    return 1.0 - total / (len(row_lengths) * budget) if len(row_lengths) else 0.0
