"""Token lengths of a lake's samples, run-length encoded: one run per stretch of equal lengths.

A sample's token length depends on its dataset, its task and the model's layout, all constant within
an episode, so a lake of 10^9 frames in 2x10^6 episodes is held as ~2x10^6 runs (32 MB), not 10^9
int64s (8 GB). Lookups search the run starts: O(log runs) per sample.
"""

from __future__ import annotations

import numpy as np


class RunLengths:
    """lengths[i] = values[k] for starts[k] <= i < starts[k + 1]; `starts[0] == 0`, `total` samples."""

    __slots__ = ("starts", "values", "total")

    def __init__(self, starts: np.ndarray, values: np.ndarray, total: int):
        self.starts = np.asarray(starts, dtype=np.int64)
        self.values = np.asarray(values, dtype=np.int64)
        self.total = int(total)
        if len(self.starts) != len(self.values) or (self.total and (len(self.starts) == 0 or self.starts[0] != 0)):
            raise ValueError("runs need one value per start and a first run at 0")

    @classmethod
    def from_array(cls, lengths: np.ndarray) -> RunLengths:
        lengths = np.asarray(lengths, dtype=np.int64)
        if len(lengths) == 0:
            return cls(np.zeros(0), np.zeros(0), 0)
        starts = np.flatnonzero(np.concatenate([[True], lengths[1:] != lengths[:-1]]))
        return cls(starts, lengths[starts], len(lengths))

    @classmethod
    def concat(cls, parts: list[RunLengths]) -> RunLengths:
        offsets = np.cumsum([0] + [p.total for p in parts])
        kept = [(p, o) for p, o in zip(parts, offsets[:-1]) if p.total]
        if not kept:
            return cls(np.zeros(0), np.zeros(0), 0)
        return cls(np.concatenate([p.starts + o for p, o in kept]), np.concatenate([p.values for p, _ in kept]),
                   int(offsets[-1]))

    def __len__(self) -> int:
        return self.total

    def __getitem__(self, ids) -> np.ndarray:
        if isinstance(ids, slice):
            ids = np.arange(*ids.indices(self.total))
        ids = np.asarray(ids, dtype=np.int64)
        if ids.size and (ids.min() < 0 or ids.max() >= self.total):
            raise IndexError(f"sample ids outside 0..{self.total - 1}")
        return self.values[np.searchsorted(self.starts, ids, side="right") - 1]

    def max(self) -> int:
        return int(self.values.max()) if len(self.values) else 0

    def sum(self) -> int:
        return int((np.diff(np.append(self.starts, self.total)) * self.values).sum())

    def to_array(self) -> np.ndarray:
        return np.repeat(self.values, np.diff(np.append(self.starts, self.total)))

    def nbytes(self) -> int:
        return self.starts.nbytes + self.values.nbytes

    def tobytes(self) -> bytes:
        """What a fingerprint hashes: equal for equal lengths, however they were run-length encoded."""
        if not len(self.values):
            return np.int64(self.total).tobytes()
        keep = np.concatenate([[True], self.values[1:] != self.values[:-1]])  # adjacent equal runs merged
        return np.int64(self.total).tobytes() + self.starts[keep].tobytes() + self.values[keep].tobytes()
