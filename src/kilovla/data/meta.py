"""A LeRobot dataset's metadata (v3.0, and v2.x for reading/converting) and its numeric columns.

Layout of a v3.0 dataset (what LeRobot 0.4 writes; see ../shared/research/data_layer.md)::

    meta/info.json                       fps, features, path templates, totals
    meta/tasks.parquet                   task_index + the task string as pandas index
    meta/episodes/chunk-XXX/file-YYY.parquet   one row per episode: length, row range, data and
                                         video file of the episode, from/to timestamps, stats
    data/chunk-XXX/file-YYY.parquet      one row per frame, many episodes per file
    videos/<camera>/chunk-XXX/file-YYY.mp4     many episodes per file, episode e at
                                         [from_timestamp, to_timestamp)

v2.1 keeps one parquet and one mp4 per episode and jsonl metadata; `DatasetMeta.load` maps both
onto the same `Episodes` table, so everything downstream is version-agnostic. Nothing here decodes
video or reads a frame cache: the readers (lerobot.py, frame_cache.py) build on this module.
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

    def __init__(self, root: str | Path, *, info: dict | None = None, tasks: list[str] | None = None,
                 episodes: Episodes | None = None):
        """Reads meta/ under `root`; or, given `info`, `tasks` and `episodes` (what a lake index stored
        of this dataset, see `lake_index`), reads nothing and checks them as if read."""
        self.files = DatasetFiles(root)
        self.root = self.files.root
        info_rel = "meta/info.json"
        if info is None and not self.files.is_url and os.path.isfile(self.root):
            raise DatasetError(self.root, "not a LeRobot dataset folder (a file)")
        self.info = self.files.read_json(info_rel) if info is None else info
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
        if episodes is not None:
            self.tasks, self.episodes = list(tasks), episodes
        elif self.version == "v3.0":
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

    def episode_seeds(self) -> dict[str, list[int]] | None:
        """Per task, the env seeds its episodes started from (meta/episodes' `seed`, which `kilovla
        collect` writes), in episode order; None for a dataset without the column (LeRobot's own,
        v2.x). An episode of several tasks counts for each.

        >>> DatasetMeta("collected").episode_seeds()  # doctest: +SKIP
        {'reach the red goal': [2000000000000000000, 2000000000000000001]}
        """
        if self.version != "v3.0":
            return None
        rels = self.files.glob("meta/episodes/chunk-*/file-*.parquet")
        if not rels or not all("seed" in self.files.read_parquet_schema(rel).names for rel in rels):
            return None
        table = pa.concat_tables([self.files.read_parquet(rel, columns=["episode_index", "tasks", "seed"])
                                  for rel in rels])
        rows = sorted(zip(table.column("episode_index").to_pylist(), table.column("tasks").to_pylist(),
                          table.column("seed").to_pylist()))
        out: dict[str, list[int]] = {}
        for episode, tasks, seed in rows:
            if seed is None:
                raise DatasetError(self.files.path("meta/episodes"), f"episode {episode} has no seed (the column "
                                   "holds one for every episode or is absent)")
            for task in tasks or []:
                out.setdefault(task, []).append(int(seed))
        return out

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
