"""LeRobot datasets (v3.0, and v2.1 for reading/converting) without importing lerobot.

Layout of a v3.0 dataset (what LeRobot 0.4 writes; see ../shared/research/data_layer.md)::

    meta/info.json                       fps, features, path templates, totals
    meta/tasks.parquet                   task_index + the task string as pandas index
    meta/episodes/chunk-XXX/file-YYY.parquet   one row per episode: length, row range, data and
                                         video file of the episode, from/to timestamps, stats
    data/chunk-XXX/file-YYY.parquet      one row per frame, many episodes per file
    videos/<camera>/chunk-XXX/file-YYY.mp4     many episodes per file, episode e at
                                         [from_timestamp, to_timestamp)

v2.1 keeps one parquet and one mp4 per episode and jsonl metadata; `DatasetMeta.load` maps both
onto the same `Episodes` table, so everything downstream is version-agnostic.

`LeRobotDataset(root, delta_timestamps)` is a drop-in for LeRobot's class: `ds[i]` returns the same
keys and values. `ds.get_batch(positions)` is the fast path the loaders use: numeric columns live in
numpy (one fancy-index per column for a whole batch), video frames are decoded per file in one
forward pass and stay uint8 HWC until the end.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from kilovla.data import windows
from kilovla.data.frame_cache import resolve_frame_cache
from kilovla.errors import DatasetError, KilovlaError

SUPPORTED_VERSIONS = ("v2.0", "v2.1", "v3.0")
DEFAULT_COLUMNS = ("timestamp", "frame_index", "episode_index", "index", "task_index")
DEFAULT_DATA_PATH = "data/chunk-{chunk_index:03d}/file-{file_index:03d}.parquet"
DEFAULT_VIDEO_PATH = "videos/{video_key}/chunk-{chunk_index:03d}/file-{file_index:03d}.mp4"
EPISODES_PATH = "meta/episodes/chunk-{chunk_index:03d}/file-{file_index:03d}.parquet"


class DatasetFiles:
    """Reads files under a dataset root: a local path, or an fsspec URL (``s3://``, ``memory://``...)."""

    def __init__(self, root: str | Path):
        text = str(root)
        self.is_url = "://" in text and not text.startswith("file://")
        if self.is_url:
            import fsspec

            self.fs, self.base = fsspec.core.url_to_fs(text)
            self.root = text.rstrip("/")
        else:
            self.fs = None
            self.root = text.removeprefix("file://")
            self.base = self.root

    def path(self, rel: str) -> str:
        return f"{self.root}/{rel}"

    def exists(self, rel: str) -> bool:
        return self.fs.exists(f"{self.base}/{rel}") if self.is_url else os.path.exists(self.path(rel))

    def open(self, rel: str, mode: str = "rb"):
        return self.fs.open(f"{self.base}/{rel}", mode) if self.is_url else open(self.path(rel), mode)

    def glob(self, pattern: str) -> list[str]:
        if self.is_url:
            prefix = f"{self.base}/"
            return sorted(p.removeprefix(prefix) for p in self.fs.glob(f"{self.base}/{pattern}"))
        return sorted(str(p.relative_to(self.root)) for p in Path(self.root).glob(pattern))

    def read_json(self, rel: str) -> Any:
        if not self.exists(rel):
            raise DatasetError(self.path(rel), "missing")
        try:
            with self.open(rel, "r") as f:
                return json.load(f)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise DatasetError(self.path(rel), f"not valid JSON: {e}") from None

    def read_jsonl(self, rel: str) -> list[dict]:
        if not self.exists(rel):
            raise DatasetError(self.path(rel), "missing")
        rows = []
        with self.open(rel, "r") as f:
            for n, line in enumerate(f, 1):
                if line.strip():
                    try:
                        rows.append(json.loads(line))
                    except json.JSONDecodeError as e:
                        raise DatasetError(self.path(rel), f"line {n}: not valid JSON: {e}") from None
        return rows

    def read_parquet(self, rel: str, columns: list[str] | None = None) -> pa.Table:
        if not self.exists(rel):
            raise DatasetError(self.path(rel), "missing")
        try:
            if self.is_url:
                with self.open(rel) as f:
                    return pq.read_table(f, columns=columns)
            return pq.read_table(self.path(rel), columns=columns)
        except (pa.ArrowException, OSError) as e:
            raise DatasetError(self.path(rel), f"cannot read parquet: {e}") from None

    def read_parquet_schema(self, rel: str) -> pa.Schema:
        """The schema alone (the footer): a truncated or corrupt file fails here with its name."""
        if not self.exists(rel):
            raise DatasetError(self.path(rel), "missing")
        try:
            if self.is_url:
                with self.open(rel) as f:
                    return pq.read_schema(f)
            return pq.read_schema(self.path(rel))
        except (pa.ArrowException, OSError) as e:
            raise DatasetError(self.path(rel), f"cannot read parquet: {e}") from None

    def size_bytes(self) -> int:
        if self.is_url:
            return int(self.fs.du(self.base))
        return sum(p.stat().st_size for p in Path(self.root).rglob("*") if p.is_file())


@dataclass(frozen=True)
class Feature:
    """One entry of info.json's `features`."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    names: Any = None
    info: dict | None = None

    @property
    def is_video(self) -> bool:
        return self.dtype == "video"

    def to_json(self) -> dict:
        out = {"dtype": self.dtype, "shape": list(self.shape), "names": self.names}
        if self.info is not None:
            out["info"] = self.info
        return out


@dataclass
class Episodes:
    """One entry per episode, as flat arrays; file paths relative to the dataset root."""

    index: np.ndarray  # (E,) episode_index, 0..E-1
    length: np.ndarray  # (E,)
    row_from: np.ndarray  # (E,) dataset_from_index
    row_to: np.ndarray  # (E,) dataset_to_index (exclusive)
    tasks: list[list[str]]
    data_file: list[str]
    video_file: dict[str, list[str]] = field(default_factory=dict)
    video_from_s: dict[str, np.ndarray] = field(default_factory=dict)
    video_to_s: dict[str, np.ndarray] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.index)


def _format_path(template: str, **kw) -> str:
    try:
        return template.format(**kw)
    except (KeyError, IndexError, ValueError) as e:
        raise KilovlaError(f"path template {template!r} cannot be filled: {e}") from None


class DatasetMeta:
    """Everything under meta/, loaded and checked for consistency (no frame data, no video)."""

    def __init__(self, root: str | Path):
        self.files = DatasetFiles(root)
        self.root = self.files.root
        info_rel = "meta/info.json"
        self.info = self.files.read_json(info_rel)
        info_path = self.files.path(info_rel)
        if not isinstance(self.info, dict):
            raise DatasetError(info_path, f"must hold a JSON object, got a {type(self.info).__name__}")
        for key in ("codebase_version", "fps", "features"):
            if key not in self.info:
                raise DatasetError(info_path, f"missing key {key!r}")
        self.version = str(self.info["codebase_version"])
        if self.version not in SUPPORTED_VERSIONS:
            raise DatasetError(info_path, f"codebase_version {self.version!r} is not one of {SUPPORTED_VERSIONS}")
        self.fps = self.info["fps"]
        if not isinstance(self.fps, (int, float)) or self.fps <= 0:
            raise DatasetError(info_path, f"fps must be a positive number, got {self.fps!r}")
        self.features = _parse_features(self.info["features"], info_path)
        for name in ("episode_index", "index", "timestamp", "frame_index"):
            if name not in self.features:
                raise DatasetError(info_path, f"feature {name!r} is missing from 'features'")
        self.video_keys = [k for k, f in self.features.items() if f.is_video]
        self.image_keys = [k for k, f in self.features.items() if f.dtype == "image"]
        if self.image_keys:
            raise DatasetError(info_path, f"features {self.image_keys} are PNG images stored in parquet; "
                               "kilovla reads video features only (re-encode them as video)")
        if self.video_keys and "video_path" not in self.info:
            raise DatasetError(info_path, "has video features but no 'video_path'")
        if self.version == "v3.0":
            self.tasks = self._load_tasks_v3()
            self.episodes = self._load_episodes_v3()
        else:
            self.tasks = self._load_tasks_v2()
            self.episodes = self._load_episodes_v2()
        self._check_episodes()

    @property
    def camera_keys(self) -> list[str]:
        return self.video_keys

    @property
    def total_frames(self) -> int:
        return int(self.episodes.length.sum())

    # -- v3.0 -----------------------------------------------------------------------------------
    def _load_tasks_v3(self) -> list[str]:
        rel = "meta/tasks.parquet"
        table = self.files.read_parquet(rel)
        names = table.column_names
        text_col = "task" if "task" in names else "__index_level_0__" if "__index_level_0__" in names else None
        if "task_index" not in names or text_col is None:
            raise DatasetError(self.files.path(rel), f"needs columns task_index and the task string, has {names}")
        index = table.column("task_index").to_numpy()
        text = table.column(text_col).to_pylist()
        tasks = [""] * len(index)
        for i, t in zip(index, text):
            if not 0 <= i < len(index):
                raise DatasetError(self.files.path(rel), f"task_index {i} out of range 0..{len(index) - 1}")
            tasks[i] = t
        return tasks

    def _load_episodes_v3(self) -> Episodes:
        rels = self.files.glob("meta/episodes/chunk-*/file-*.parquet")
        if not rels:
            raise DatasetError(self.files.path("meta/episodes"), "no episode metadata files (chunk-*/file-*.parquet)")
        wanted = ["episode_index", "tasks", "length", "dataset_from_index", "dataset_to_index",
                  "data/chunk_index", "data/file_index"]
        for key in self.video_keys:
            wanted += [f"videos/{key}/{c}" for c in ("chunk_index", "file_index", "from_timestamp", "to_timestamp")]
        parts = []
        for rel in rels:
            schema_names = set(self.files.read_parquet_schema(rel).names)
            missing = [c for c in wanted if c not in schema_names]
            if missing:
                raise DatasetError(self.files.path(rel), f"missing columns {missing}")
            parts.append(self.files.read_parquet(rel, columns=wanted))
        table = pa.concat_tables(parts)
        col = {c: table.column(c).to_numpy(zero_copy_only=False) for c in wanted if c != "tasks"}
        order = np.argsort(col["episode_index"], kind="stable")
        col = {k: v[order] for k, v in col.items()}
        tasks_list = table.column("tasks").to_pylist()
        tasks = [list(tasks_list[i] or []) for i in order]
        data_tpl = self.info.get("data_path", DEFAULT_DATA_PATH)
        data_file = [_format_path(data_tpl, chunk_index=int(c), file_index=int(f))
                     for c, f in zip(col["data/chunk_index"], col["data/file_index"])]
        eps = Episodes(
            index=col["episode_index"].astype(np.int64), length=col["length"].astype(np.int64),
            row_from=col["dataset_from_index"].astype(np.int64), row_to=col["dataset_to_index"].astype(np.int64),
            tasks=tasks, data_file=data_file,
        )
        video_tpl = self.info.get("video_path", DEFAULT_VIDEO_PATH)
        for key in self.video_keys:
            c, f = col[f"videos/{key}/chunk_index"], col[f"videos/{key}/file_index"]
            eps.video_file[key] = [_format_path(video_tpl, video_key=key, chunk_index=int(a), file_index=int(b))
                                   for a, b in zip(c, f)]
            eps.video_from_s[key] = col[f"videos/{key}/from_timestamp"].astype(np.float64)
            eps.video_to_s[key] = col[f"videos/{key}/to_timestamp"].astype(np.float64)
        return eps

    # -- v2.x -----------------------------------------------------------------------------------
    def _load_tasks_v2(self) -> list[str]:
        rows = self.files.read_jsonl("meta/tasks.jsonl")
        tasks = [""] * len(rows)
        for r in rows:
            tasks[int(r["task_index"])] = r["task"]
        return tasks

    def _load_episodes_v2(self) -> Episodes:
        rows = sorted(self.files.read_jsonl("meta/episodes.jsonl"), key=lambda r: r["episode_index"])
        index = np.array([r["episode_index"] for r in rows], dtype=np.int64)
        length = np.array([r["length"] for r in rows], dtype=np.int64)
        row_to = np.cumsum(length)
        chunks = int(self.info.get("chunks_size", 1000))
        data_tpl = self.info.get("data_path", "data/chunk-{episode_chunk:03d}/episode_{episode_index:06d}.parquet")
        eps = Episodes(
            index=index, length=length, row_from=row_to - length, row_to=row_to,
            tasks=[list(r.get("tasks", [])) for r in rows],
            data_file=[_format_path(data_tpl, episode_chunk=int(e) // chunks, episode_index=int(e)) for e in index],
        )
        video_tpl = self.info.get("video_path")
        for key in self.video_keys:
            eps.video_file[key] = [_format_path(video_tpl, episode_chunk=int(e) // chunks, video_key=key,
                                                episode_index=int(e)) for e in index]
            eps.video_from_s[key] = np.zeros(len(index))
            eps.video_to_s[key] = length / float(self.fps)
        return eps

    def _check_episodes(self) -> None:
        eps = self.episodes
        where = self.files.path("meta/episodes" if self.version == "v3.0" else "meta/episodes.jsonl")
        if len(eps) == 0:
            raise DatasetError(where, "the dataset has no episodes")
        expected = np.arange(len(eps))
        if not np.array_equal(eps.index, expected):
            gap = int(expected[np.argmax(eps.index != expected)])
            raise DatasetError(where, f"episode_index is not contiguous: episode {gap} is missing "
                               f"(have {eps.index[:10].tolist()}{'...' if len(eps) > 10 else ''})")
        if np.any(eps.length <= 0):
            bad = int(eps.index[np.argmax(eps.length <= 0)])
            raise DatasetError(where, f"episode {bad} has length <= 0")
        if not (np.array_equal(eps.row_to - eps.row_from, eps.length) and eps.row_from[0] == 0
                and np.array_equal(eps.row_from[1:], eps.row_to[:-1])):
            raise DatasetError(where, "dataset_from_index/dataset_to_index do not tile 0..total_frames by length")
        total = self.info.get("total_frames")
        if total is not None and int(total) != self.total_frames:
            raise DatasetError(self.files.path("meta/info.json"),
                               f"total_frames is {total} but the episodes add up to {self.total_frames}")

    # -- frame data ------------------------------------------------------------------------------
    def table_features(self) -> list[Feature]:
        return [f for f in self.features.values() if not f.is_video]

    def load_columns(self, keys: list[str] | None = None) -> dict[str, np.ndarray]:
        """Non-video columns of every data file, concatenated, checked against info.json."""
        feats = [f for f in self.table_features() if keys is None or f.name in keys]
        parts: dict[str, list[np.ndarray]] = {f.name: [] for f in feats}
        for rel in dict.fromkeys(self.episodes.data_file):
            table = self.files.read_parquet(rel)
            for feat in feats:
                if feat.name not in table.column_names:
                    raise DatasetError(self.files.path(rel), f"column {feat.name!r} (in info.json features) is missing")
                parts[feat.name].append(column_to_numpy(table.column(feat.name), feat, self.files.path(rel)))
        columns = {k: np.concatenate(v) if len(v) > 1 else v[0] for k, v in parts.items()}
        n = self.total_frames
        for k, v in columns.items():
            if len(v) != n:
                raise DatasetError(self.files.path("data"), f"column {k!r} has {len(v)} rows, episodes need {n}")
        if "index" in columns and not np.array_equal(columns["index"], np.arange(n)):
            raise DatasetError(self.files.path("data"), "column 'index' is not 0..total_frames-1 in file order")
        if "episode_index" in columns:
            expected = np.repeat(self.episodes.index, self.episodes.length)
            if not np.array_equal(columns["episode_index"], expected):
                row = int(np.argmax(columns["episode_index"] != expected))
                raise DatasetError(self.files.path(self.episodes.data_file[int(expected[row])]),
                                   f"episode_index at row {row} is {columns['episode_index'][row]}, "
                                   f"meta/episodes says {expected[row]}")
        return columns

    def summary(self) -> dict:
        """What `kilovla data info` shows."""
        codecs = sorted({str((f.info or {}).get("video.codec")) for f in self.features.values() if f.is_video})
        return {
            "root": self.root,
            "codebase_version": self.version,
            "robot_type": self.info.get("robot_type"),
            "episodes": len(self.episodes),
            "frames": self.total_frames,
            "fps": self.fps,
            "tasks": self.tasks,
            "cameras": self.video_keys,
            "video_codec": codecs,
            "features": {k: {"dtype": f.dtype, "shape": list(f.shape)} for k, f in self.features.items()},
            "size_bytes": self.files.size_bytes(),
        }


def _parse_features(features: Any, info_path: str) -> dict[str, Feature]:
    """info.json's `features`: a mapping name -> {dtype, shape (list of ints), names, info}."""
    if not isinstance(features, dict):
        raise DatasetError(info_path, f"'features' must be a mapping of name -> spec, got a {type(features).__name__}")
    out: dict[str, Feature] = {}
    for name, spec in features.items():
        if not isinstance(spec, dict) or "dtype" not in spec or "shape" not in spec:
            raise DatasetError(info_path, f"feature {name!r} needs 'dtype' and 'shape'")
        shape = spec["shape"]
        if not isinstance(shape, (list, tuple)) or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0
                                                            for d in shape):
            raise DatasetError(info_path, f"feature {name!r}: 'shape' must be a list of non-negative integers, "
                               f"got {shape!r}")
        if not isinstance(spec["dtype"], str):
            raise DatasetError(info_path, f"feature {name!r}: 'dtype' must be a string, got {spec['dtype']!r}")
        info = spec.get("info")
        if info is not None and not isinstance(info, dict):
            raise DatasetError(info_path, f"feature {name!r}: 'info' must be a mapping, got {info!r}")
        if spec["dtype"] == "video" and len(shape) != 3:
            raise DatasetError(info_path, f"video feature {name!r}: 'shape' must be [height, width, channels], "
                               f"got {shape!r}")
        out[name] = Feature(name, spec["dtype"], tuple(shape), spec.get("names"), info)
    return out


_NUMPY_DTYPES = {"float32", "float64", "float16", "int64", "int32", "int16", "int8", "uint8", "bool"}


def column_to_numpy(column: pa.ChunkedArray, feature: Feature, where: str) -> np.ndarray:
    """An Arrow column (scalars or nested fixed/variable lists) as an (N, *shape) array.

    Features of shape (1,) come back as (N,), as LeRobot returns them (0-d per item).
    """
    arr = column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
    n = len(arr)
    while pa.types.is_list(arr.type) or pa.types.is_large_list(arr.type) or pa.types.is_fixed_size_list(arr.type):
        arr = arr.flatten()
    if pa.types.is_string(arr.type) or pa.types.is_large_string(arr.type):
        values = np.array(arr.to_pylist(), dtype=object)
    else:
        values = arr.to_numpy(zero_copy_only=False)
    if feature.dtype in _NUMPY_DTYPES and values.dtype != np.dtype(feature.dtype):
        raise DatasetError(where, f"feature {feature.name!r} is stored as {values.dtype}, info.json says {feature.dtype}")
    shape = feature.shape
    if shape in ((1,), ()):
        if values.size != n:
            raise DatasetError(where, f"feature {feature.name!r} has {values.size // max(n, 1)} values per row, "
                               f"info.json says shape {list(shape)}")
        return values
    per_row = int(np.prod(shape))
    if values.size != n * per_row:
        raise DatasetError(where, f"feature {feature.name!r} has {values.size / max(n, 1):g} values per row, "
                           f"info.json says shape {list(shape)}")
    return values.reshape(n, *shape)


class LeRobotDataset:
    """A LeRobot dataset, read the way LeRobot reads it, fast.

    >>> ds = LeRobotDataset("path/to/ds", delta_timestamps={"action": [0.0, 0.1]})  # doctest: +SKIP
    >>> item = ds[0]  # doctest: +SKIP
    >>> item["action"].shape, item["action_is_pad"]  # doctest: +SKIP
    (torch.Size([2, 6]), tensor([False, False]))

    Args:
        root: dataset folder (or fsspec URL).
        delta_timestamps: per key, time offsets in seconds of the frames to return (LeRobot's meaning).
        episodes: load only these episodes; positions then run over their frames only.
        tolerance_s: how far a decoded frame's time may be from the requested one.
        video_backend: "auto" (torchcodec if it loads, else PyAV), "pyav" or "torchcodec".
        image_transforms: callable applied to each float CHW camera tensor in `__getitem__`.
        frame_cache: camera frames from a decoded-frame cache (`kilovla data cache`, see
            `kilovla.data.frame_cache`) instead of the videos: a cache folder, "auto" (the default:
            the cache at `default_cache_dir(root)` when there is one) or None (always decode). A
            named cache that does not match the dataset is refused with a DatasetError, never
            half-used; with "auto" such a cache is passed over with one warning and frames decoded.
    """

    def __init__(self, root: str | Path, delta_timestamps: dict[str, list[float]] | None = None,
                 episodes: list[int] | None = None, tolerance_s: float = 1e-4, video_backend: str = "auto",
                 image_transforms=None, decode_threads: int = 2, frame_cache: str | Path | None = "auto"):
        self.meta = DatasetMeta(root)
        self.root = self.meta.root
        self.fps = self.meta.fps
        self.tolerance_s = tolerance_s
        self.video_backend = video_backend
        self.image_transforms = image_transforms
        self.decode_threads = decode_threads
        self.delta_timestamps = delta_timestamps
        self.delta_indices = None
        if delta_timestamps:
            unknown = sorted(set(delta_timestamps) - set(self.meta.features))
            if unknown:
                raise KilovlaError(f"delta_timestamps keys {unknown} are not features of {self.root} "
                                   f"(features: {sorted(self.meta.features)})")
            self.delta_indices = windows.delta_indices(delta_timestamps, self.fps)
        self.columns = self.meta.load_columns()
        eps = self.meta.episodes
        self.episode_ids = np.arange(len(eps)) if episodes is None else np.asarray(sorted(set(episodes)), dtype=np.int64)
        if np.any((self.episode_ids < 0) | (self.episode_ids >= len(eps))):
            raise KilovlaError(f"episodes {self.episode_ids.tolist()} out of range 0..{len(eps) - 1} for {self.root}")
        self._rows = np.concatenate([np.arange(eps.row_from[e], eps.row_to[e]) for e in self.episode_ids])
        self._row_episode = np.repeat(np.arange(len(eps)), eps.length)
        self._pool = None
        self.frame_cache = resolve_frame_cache(frame_cache, self.meta, self.columns, self.meta.video_keys)
        if self.frame_cache is not None and video_backend != "auto" \
                and self.frame_cache.manifest["backend"] != video_backend:
            raise DatasetError(self.frame_cache.path / "manifest.json",
                               f"frames were decoded with {self.frame_cache.manifest['backend']}, this dataset asks "
                               f"for video_backend={video_backend!r}; use 'auto' or rebuild the cache")

    def __getstate__(self):
        state = self.__dict__.copy()
        state["_pool"] = None  # decoders are per process, created where they are used
        return state

    def __len__(self) -> int:
        return len(self._rows)

    @property
    def num_frames(self) -> int:
        return len(self._rows)

    @property
    def num_episodes(self) -> int:
        return len(self.episode_ids)

    @property
    def camera_keys(self) -> list[str]:
        return self.meta.video_keys

    @property
    def features(self) -> dict[str, Feature]:
        return self.meta.features

    @property
    def decoder_pool(self):
        from kilovla.data.video import VideoDecoderPool

        if self._pool is None:
            self._pool = VideoDecoderPool(self.video_backend, threads=self.decode_threads)
        return self._pool

    def positions_to_rows(self, positions: np.ndarray) -> np.ndarray:
        return self._rows[np.asarray(positions, dtype=np.int64)]

    def task_of(self, positions: np.ndarray) -> np.ndarray:
        """task_index of each position, without decoding anything (used for token-length estimates)."""
        return self.columns["task_index"][self.positions_to_rows(positions)]

    def get_batch(self, positions, video_keys: list[str] | None = None) -> dict[str, np.ndarray]:
        """The samples at `positions`, stacked: numpy arrays, camera frames uint8 (B, [K,] H, W, 3).

        Same values as LeRobot's items (camera frames before the /255 float conversion); keys with a
        time window have a K axis (cameras drop it when K == 1, as LeRobot does), plus `<key>_is_pad`.
        """
        rows = self.positions_to_rows(positions)
        ep = self._row_episode[rows]
        eps = self.meta.episodes
        ep_from, ep_to = eps.row_from[ep], eps.row_to[ep]
        deltas = self.delta_indices or {}
        out: dict[str, np.ndarray] = {}
        query_rows: dict[str, np.ndarray] = {}
        for key, offsets in deltas.items():
            qrows, is_pad = windows.window_rows(rows, ep_from, ep_to, offsets)
            query_rows[key] = qrows
            out[f"{key}_is_pad"] = is_pad
        for key, col in self.columns.items():
            out[key] = col[query_rows[key]] if key in query_rows else col[rows]
        if self.meta.video_keys:
            out.update(self._decode(rows, ep, query_rows, video_keys or self.meta.video_keys))
        out["task"] = np.array([self.meta.tasks[t] for t in self.columns["task_index"][rows]], dtype=object)
        return out

    def _decode(self, rows, ep, query_rows, video_keys) -> dict[str, np.ndarray]:
        if self.frame_cache is not None:
            out = {key: self.frame_cache.read(key, query_rows.get(key, rows[:, None])) for key in video_keys}
            return {key: v[:, 0] if v.shape[1] == 1 else v for key, v in out.items()}
        eps = self.meta.episodes
        timestamps = self.columns["timestamp"]
        requests: list[tuple[str, np.ndarray]] = []
        plan = []  # (key, mask of (B, K) entries served by this request, shape (B, K))
        for key in video_keys:
            qrows = query_rows.get(key, rows[:, None])
            # LeRobot: from_timestamp (float64) + the float32 timestamp of the queried row.
            ts = eps.video_from_s[key][ep][:, None] + timestamps[qrows].astype(np.float64)
            files = np.array(eps.video_file[key], dtype=object)[ep]
            for f in dict.fromkeys(files):
                mask = files == f
                requests.append((self.meta.files.path(f), ts[mask].ravel()))
                plan.append((key, mask, qrows.shape))
        frames = self.decoder_pool.read_many(requests, self.tolerance_s)
        out: dict[str, np.ndarray] = {}
        for (key, mask, shape), got in zip(plan, frames):
            if mask.all():  # one file holds every sample's frames of this camera: no scatter copy
                out[key] = got.reshape(*shape, *got.shape[1:])
                continue
            if key not in out:
                out[key] = np.empty((*shape, *got.shape[1:]), dtype=np.uint8)
            out[key][mask] = got.reshape(-1, shape[1], *got.shape[1:])
        for key in list(out):
            if out[key].shape[1] == 1:
                out[key] = out[key][:, 0]
        return out

    def __getitem__(self, position: int) -> dict:
        return self.__getitems__([position])[0]

    def __getitems__(self, positions) -> list[dict]:
        """Items at `positions`, decoded together (torch's DataLoader calls this with a whole batch
        of indices when it exists, so a batch costs one decoding pass per video file)."""
        import torch

        n = len(self)
        for position in positions:
            if not -n <= position < n:
                raise IndexError(f"position {position} out of range for a dataset of {n} frames")
        batch = self.get_batch(np.array([p % n for p in positions], dtype=np.int64))
        items: list[dict] = [{} for _ in positions]
        for key, values in batch.items():
            if key in self.meta.video_keys:
                images = to_float_chw(values)
                for item, image in zip(items, images):
                    item[key] = image if self.image_transforms is None else self.image_transforms(image)
            elif key == "task":
                for item, value in zip(items, values):
                    item[key] = value
            else:
                for item, value in zip(items, values):
                    item[key] = torch.from_numpy(np.asarray(value))
        return items


def to_float_chw(frames_u8_hwc):
    """uint8 (..., H, W, C) -> float32 (..., C, H, W) in [0, 1], LeRobot's camera tensor.

    Bit-identical to LeRobot's `(frames / 255.0).type(torch.float32)` (one float32 division per
    value), computed in numpy: torch would hand a few hundred kB to its intra-op thread pool, which
    on a busy machine costs 10-50x the division itself.
    """
    import torch

    frames = frames_u8_hwc.numpy() if isinstance(frames_u8_hwc, torch.Tensor) else np.asarray(frames_u8_hwc)
    out = np.empty((*frames.shape[:-3], frames.shape[-1], *frames.shape[-3:-1]), dtype=np.float32)
    np.divide(np.moveaxis(frames, -1, -3), np.float32(255.0), out=out)
    return torch.from_numpy(out)
