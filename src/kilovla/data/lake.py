"""One catalog over many LeRobot datasets: mixture weights, a global sample index, token lengths.

Global sample id g belongs to source d when offsets[d] <= g < offsets[d + 1]; its position in that
dataset is g - offsets[d]. Every sample's token length comes from metadata alone (no decoding, no
pass over the frames: each dataset's task runs, see `columns`), from the model's token layout, and is
kept run-length encoded (`lengths.RunLengths`, one run per episode or task change)::

    tokens = tokens_per_camera * enabled cameras + language tokens + state tokens + action horizon

e.g. pi0.5 on LIBERO: 256 * 2 + len("pick up the black bowl ...") + 8 + 10.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from kilovla.data.columns import prefetch_pages
from kilovla.data.lake_index import LakeIndex
from kilovla.data.lengths import RunLengths
from kilovla.data.lerobot import LeRobotDataset
from kilovla.errors import KilovlaError


def byte_token_count(text: str) -> int:
    """Tokens of a byte-level tokenizer: one per UTF-8 byte, plus BOS."""
    return len(text.encode("utf-8")) + 1


@dataclass(frozen=True, kw_only=True, slots=True)
class TokenLayout:
    """How many tokens a model spends on one sample.

    cameras: the enabled camera keys (None: every camera of the dataset). A dataset lacking an
    enabled camera simply contributes fewer tokens.
    """

    tokens_per_camera: int = 256
    cameras: tuple[str, ...] | None = None
    max_language_tokens: int = 200
    state_tokens: int = 1
    action_horizon: int = 50

    def sample_tokens(self, n_cameras: np.ndarray | int, language_tokens: np.ndarray | int,
                      action_horizon: int | None = None) -> np.ndarray:
        horizon = self.action_horizon if action_horizon is None else action_horizon
        lang = np.minimum(language_tokens, self.max_language_tokens)
        return np.asarray(self.tokens_per_camera * n_cameras + lang + self.state_tokens + horizon, dtype=np.int64)

    def fixed_tokens(self, n_camera_slots: int) -> int:
        """Tokens of one sample under fixed padding: every camera slot, full language length."""
        return int(self.sample_tokens(n_camera_slots, self.max_language_tokens))


@dataclass(frozen=True, kw_only=True, slots=True)
class LakeSource:
    """One dataset of the lake. weight 2.0 shows each sample twice per epoch, 0.5 half of them."""

    root: str
    weight: float = 1.0
    delta_timestamps: dict | None = None
    action_horizon: int | None = None  # overrides the layout's for this dataset
    episodes: tuple[int, ...] | None = None
    frame_cache: str | None = "auto"  # a decoded-frame cache folder, "auto" or None (see LeRobotDataset)
    # where the numeric columns are mapped from; None: in memory (see columns). A lake opened from an index
    # maps the cache the index recorded, whatever this says
    column_cache: str | None = "auto"


class DataLake:
    """Datasets behind one global index.

    >>> lake = DataLake([LakeSource(root="ds_a"), LakeSource(root="ds_b", weight=0.5)])  # doctest: +SKIP
    >>> lake.lengths[np.arange(3)], len(lake)  # doctest: +SKIP
    (array([541, 541, 559]), 1200)
    """

    def __init__(self, sources: Sequence[LakeSource | str | Path], layout: TokenLayout | None = None,
                 count_tokens: Callable[[str], int] = byte_token_count, video_backend: str = "auto",
                 index: str | Path | LakeIndex | None = None, prefetch: bool = True):
        """index: open the datasets from a lake index (`lake_index`: one file instead of each dataset's
        meta/; "auto" at its default place, built or brought up to date first) or None (read each).
        prefetch: the pages of the mapped columns a batch reads, in every dataset it spans, asked for all
        at once before any is read (and so the maps' headers at open; `columns.prefetch_pages`); False:
        one page fault at a time, each read around by the kernel."""
        if not sources:
            raise KilovlaError("a data lake needs at least one dataset")
        self.sources = [s if isinstance(s, LakeSource) else LakeSource(root=str(s)) for s in sources]
        for s in self.sources:
            if s.weight < 0:
                raise KilovlaError(f"{s.root}: mixture weight must be >= 0, got {s.weight}")
        self.layout = layout or TokenLayout()
        if index is not None and not isinstance(index, LakeIndex):
            index = LakeIndex.open([s.root for s in self.sources], None if index == "auto" else index)
        self.index = index
        self.prefetch = prefetch
        indexed = index.datasets(prefetch) if index is not None else [None] * len(self.sources)
        for entry in indexed:
            if entry is not None and entry.meta is None:
                raise KilovlaError(f"{entry.root}: cannot be read ({entry.problems[0]})")
        self.datasets = [LeRobotDataset(s.root, delta_timestamps=s.delta_timestamps, episodes=s.episodes,
                                        video_backend=video_backend, frame_cache=s.frame_cache,
                                        column_cache=s.column_cache, meta=e and e.meta, columns=e and e.columns,
                                        prefetch=prefetch)
                         for s, e in zip(self.sources, indexed)]
        sizes = np.array([len(d) for d in self.datasets], dtype=np.int64)
        self.offsets = np.concatenate([[0], np.cumsum(sizes)])
        self.weights = np.array([s.weight for s in self.sources], dtype=np.float64)
        self.lengths = RunLengths.concat([self._lengths(d, s, count_tokens) for d, s in zip(self.datasets, self.sources)])

    def _lengths(self, ds: LeRobotDataset, source: LakeSource, count_tokens) -> RunLengths:
        cams = ds.camera_keys if self.layout.cameras is None else [c for c in ds.camera_keys if c in self.layout.cameras]
        per_task = np.array([count_tokens(t) for t in ds.meta.tasks], dtype=np.int64)
        starts, task_index = ds.task_runs()
        return RunLengths(starts, self.layout.sample_tokens(len(cams), per_task[task_index], source.action_horizon), len(ds))

    def __len__(self) -> int:
        return int(self.offsets[-1])

    def dataset_of(self, ids: np.ndarray) -> np.ndarray:
        return np.searchsorted(self.offsets, np.asarray(ids), side="right") - 1

    def fingerprint(self) -> str:
        """Changes when the samples or their lengths change; stored with a plan's state."""
        h = hashlib.sha256()
        for s, d in zip(self.sources, self.datasets):
            h.update(f"{s.root}|{s.weight}|{len(d)}|".encode())
        h.update(self.lengths.tobytes())
        return h.hexdigest()[:16]

    def get_batch(self, ids: np.ndarray) -> dict[str, np.ndarray]:
        """Samples by global id, in the order given; every dataset in the call must share feature shapes."""
        ids = np.asarray(ids, dtype=np.int64)
        which = self.dataset_of(ids)
        groups = [(d, np.flatnonzero(which == d)) for d in np.unique(which)]
        located = [(self.datasets[d], self.datasets[d].locate(ids[pos] - self.offsets[d])) for d, pos in groups]
        if self.prefetch:  # every dataset's pages in one queue, before the first read waits on any
            prefetch_pages([r for ds, where in located for r in ds.column_reads(where)])
        parts = [(pos, ds.read(where)) for (_, pos), (ds, where) in zip(groups, located)]
        if len(parts) == 1:
            out = parts[0][1]
        else:
            out = {}
            order = np.argsort(np.concatenate([pos for pos, _ in parts]), kind="stable")
            for key in parts[0][1]:
                values = [b.get(key) for _, b in parts]
                shapes = {None if v is None else v.shape[1:] for v in values}
                if len(shapes) != 1 or None in shapes:
                    names = [self.sources[d].root for d, _ in groups]
                    raise KilovlaError(f"datasets {names} disagree on feature {key!r} ({shapes}); "
                                       "they cannot share one batch")
                out[key] = np.concatenate(values)[order]
        out["sample_index"] = ids
        out["dataset_index"] = which
        return out
