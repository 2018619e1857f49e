"""Normalisation statistics in LeRobot's layout: min, max, mean, std, count, q01, q10, q50, q90, q99.

Numeric features get one value per dimension (shape (D,)); camera features get one per channel,
shaped (3, 1, 1) and scaled to [0, 1], as LeRobot stores them.

Two ways to get dataset-level stats:

- `aggregate_stats(per_episode)`: what LeRobot writes at `finalize()`; pooled mean/std, min of mins,
  max of maxes, and quantiles as the count-weighted mean of the episodes' quantiles (LeRobot's
  convention: cheap and streaming, but an approximation of the true quantiles).
- `compute_stats(arrays)`: exact statistics over all values, what `kilovla data stats` recomputes.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from kilovla.errors import DatasetError

QUANTILES = {"q01": 0.01, "q10": 0.10, "q50": 0.50, "q90": 0.90, "q99": 0.99}
STAT_NAMES = ("min", "max", "mean", "std", "count", *QUANTILES)

# Camera stats look at a sample of frames, not all of them (LeRobot does the same).
MAX_IMAGE_SAMPLES = 100


def feature_stats(values: np.ndarray) -> dict[str, np.ndarray]:
    """Stats over axis 0 of an (N, ...) array.

    >>> s = feature_stats(np.array([[0.0], [1.0], [2.0]]))
    >>> s["mean"], s["count"]
    (array([1.]), array([3]))
    """
    values = np.asarray(values)
    if values.ndim == 1:
        values = values[:, None]
    as_float = values.astype(np.float64)
    stats = {
        "min": values.min(axis=0),
        "max": values.max(axis=0),
        "mean": as_float.mean(axis=0),
        "std": as_float.std(axis=0),
        "count": np.array([len(values)], dtype=np.int64),
    }
    qs = np.quantile(as_float, list(QUANTILES.values()), axis=0)
    stats.update(dict(zip(QUANTILES, qs)))
    return stats


def image_stats(frames: np.ndarray, max_frames: int = MAX_IMAGE_SAMPLES) -> dict[str, np.ndarray]:
    """Per-channel stats of (N, H, W, 3) uint8 frames, in [0, 1], shaped (3, 1, 1)."""
    n = len(frames)
    if n > max_frames:
        frames = frames[np.linspace(0, n - 1, max_frames).round().astype(int)]
    pixels = frames.reshape(-1, frames.shape[-1]).astype(np.float32) / 255.0  # (N*H*W, 3)
    stats = feature_stats(pixels)
    stats["count"] = np.array([len(frames)], dtype=np.int64)
    return {k: (v if k == "count" else v.reshape(-1, 1, 1)) for k, v in stats.items()}


def aggregate_stats(per_episode: Sequence[Mapping[str, Mapping[str, np.ndarray]]]) -> dict[str, dict[str, np.ndarray]]:
    """Combine per-episode stats into dataset stats, LeRobot's way (see module docstring)."""
    keys = per_episode[0].keys()
    out = {}
    for key in keys:
        parts = [ep[key] for ep in per_episode]
        counts = np.array([float(p["count"][0]) for p in parts])
        w = counts / counts.sum()
        shape = np.asarray(parts[0]["mean"]).shape
        wb = w.reshape(-1, *([1] * len(shape)))
        means = np.stack([np.asarray(p["mean"], dtype=np.float64) for p in parts])
        stds = np.stack([np.asarray(p["std"], dtype=np.float64) for p in parts])
        mean = (wb * means).sum(axis=0)
        var = (wb * (stds**2 + (means - mean) ** 2)).sum(axis=0)
        agg = {
            "min": np.min(np.stack([p["min"] for p in parts]), axis=0),
            "max": np.max(np.stack([p["max"] for p in parts]), axis=0),
            "mean": mean,
            "std": np.sqrt(var),
            "count": np.array([int(counts.sum())], dtype=np.int64),
        }
        for q in QUANTILES:
            agg[q] = (wb * np.stack([np.asarray(p[q], dtype=np.float64) for p in parts])).sum(axis=0)
        out[key] = agg
    return out


def stats_to_json(stats: Mapping[str, Mapping[str, np.ndarray]]) -> dict:
    return {k: {s: np.asarray(v).tolist() for s, v in st.items()} for k, st in stats.items()}


def stats_from_json(data: Mapping) -> dict[str, dict[str, np.ndarray]]:
    return {k: {s: np.asarray(v) for s, v in st.items()} for k, st in data.items()}


def compute_dataset_stats(dataset, max_image_frames: int = 500) -> dict[str, dict[str, np.ndarray]]:
    """Exact stats over every frame of a `LeRobotDataset` (cameras: up to `max_image_frames` frames,
    evenly spaced, per camera). A NaN or inf in a float column is refused (DatasetError naming its
    file, row and column): its stats would be NaN, and so every normalised value of the column."""
    out = {}
    for key, column in dataset.columns.items():
        if column.dtype != object and column.dtype.kind in "fiub":
            if column.dtype.kind == "f" and not np.isfinite(column).all():
                _refuse_non_finite(dataset, key)
            out[key] = feature_stats(column)
    n = len(dataset)
    positions = np.unique(np.linspace(0, n - 1, min(n, max_image_frames)).round().astype(np.int64))
    for key in dataset.camera_keys:
        frames = dataset.get_batch(positions, video_keys=[key])[key]
        if frames.ndim == 5:  # a delta window on the camera: keep the current frame only
            frames = frames[:, -1]
        out[key] = image_stats(frames, max_frames=max_image_frames)
    return out


def _refuse_non_finite(dataset, key: str) -> None:
    column = dataset.columns[key]
    bad = ~np.isfinite(np.asarray(column).reshape(len(column), -1)).all(axis=1)
    raise DatasetError(*non_finite_location(dataset.meta, dataset.columns, key, int(np.argmax(bad))))


def non_finite_location(meta, columns, name: str, row: int) -> tuple[str, str]:
    """(file, message) for the first non-finite value of a float column: file, row of that file, column, dimension.

    e.g. `.../file-000.parquet: action[1] is nan at row 5 of the file (index 5, episode 0, frame 5): ...`"""
    eps = meta.episodes
    ep = episode_of(eps, row)
    rel = eps.data_file[ep]
    file_start = int(eps.row_from[list(eps.data_file).index(rel)])  # a file holds its episodes' rows in order
    values = np.asarray(columns[name][row]).reshape(-1)
    dim = int(np.argmax(~np.isfinite(values)))
    where = f"{name}[{dim}]" if np.asarray(columns[name][row]).ndim else name
    message = (f"{where} is {values[dim]} at row {row - file_start} of the file (index {row}, episode {ep}, "
               f"frame {row - int(eps.row_from[ep])}): every float value must be finite, a NaN or inf trains into "
               "a NaN loss (fix the value or drop the episode)")
    return meta.files.path(rel), message


def episode_of(eps, row: int) -> int:
    """The episode that holds global row `row`."""
    return int(np.searchsorted(eps.row_to, row, side="right"))
