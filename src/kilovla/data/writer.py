"""Write LeRobot v3.0 datasets, and convert v2.1 datasets to v3.0.

`DatasetWriter` follows LeRobot's recording API (`add_frame` / `save_episode` / `finalize`) and
writes the same files LeRobot writes: same keys, path templates and parquet schema, mp4 files that
hold many episodes (AV1 or H.264, a keyframe every 2 frames), per-episode stats in
meta/episodes and aggregated stats with q01..q99 in meta/stats.json.

Each camera's episode is encoded alone into a staged segment, and a camera's segments are joined into
its file without re-encoding when the file is full or at `finalize()`, as LeRobot does. So at most one
encoder is alive in the process at any time: a process holding several SVT-AV1 encoders (one per
camera, as this writer once did) hung inside the encoder in a test run, and SVT-AV1 has fixed such
hangs between instances that share its global state.

Everything goes to a hidden temporary folder beside `root`; `finalize()` renames it into place, so
a crash or an error never leaves a half-written dataset at `root`::

    writer = DatasetWriter("out/ds", fps=10, features={
        "observation.state": {"dtype": "float32", "shape": [6]},
        "action": {"dtype": "float32", "shape": [6]},
        "observation.images.front": {"dtype": "video", "shape": [96, 96, 3]},
    })
    for episode in episodes:
        for frame in episode:
            writer.add_frame({**frame, "task": "pick the cube"})
        writer.save_episode()
    writer.finalize()
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from kilovla.data import stats as stats_mod
from kilovla.data.lerobot import LeRobotDataset
from kilovla.data.meta import DEFAULT_DATA_PATH, DEFAULT_VIDEO_PATH, EPISODES_PATH, DatasetMeta, column_to_numpy
from kilovla.data.video import CODEC_NAMES, VideoEncoder, concat_videos, probe_video
from kilovla.errors import DatasetError, KilovlaError
from kilovla.folders import DATASET, check_replaceable
from kilovla.folders import check_parent as _check_parent
from kilovla.staging import remove_stale_staging, staging_path

CODEBASE_VERSION = "v3.0"
CONVERT_STAT_FRAMES = 10  # frames decoded per episode and camera when a v2.1 dataset lacks camera stats
DEFAULT_FEATURES = {
    "timestamp": {"dtype": "float32", "shape": [1], "names": None},
    "frame_index": {"dtype": "int64", "shape": [1], "names": None},
    "episode_index": {"dtype": "int64", "shape": [1], "names": None},
    "index": {"dtype": "int64", "shape": [1], "names": None},
    "task_index": {"dtype": "int64", "shape": [1], "names": None},
}
_ARROW_TYPES = {"float32": pa.float32(), "float64": pa.float64(), "int64": pa.int64(), "int32": pa.int32(),
                "int16": pa.int16(), "int8": pa.int8(), "uint8": pa.uint8(), "bool": pa.bool_(), "string": pa.string()}


def check_dataset_destination(root: str | Path, overwrite: bool = False, flag: str = "--overwrite") -> None:
    """KilovlaError unless a dataset can be written at `root`: absent (or, with `overwrite`, a dataset to
    replace) and not under a file. `DatasetWriter` checks this first; a CLI calls it before its progress,
    with `flag`, its spelling of `overwrite`."""
    root = Path(root)
    if root.exists() and not overwrite:
        raise KilovlaError(f"{root}: already exists ({flag} replaces it)")
    check_replaceable(root, DATASET)  # --overwrite replaces a dataset, never a folder of other files
    _check_parent(root)


def _staging_folder(dst: Path) -> Path:
    """Make the hidden folder beside `dst` that a dataset is written into before its rename.

    A `dst` that cannot be made (a file on its path, no permission) is a KilovlaError naming it."""
    _check_parent(dst)
    where = dst.absolute()  # "." has no name to put a sibling beside
    remove_stale_staging(where)  # what a killed writer of this destination left
    tmp = staging_path(where)
    try:
        tmp.mkdir(parents=True)
    except OSError as e:
        raise KilovlaError(f"{dst}: cannot create it: {e.strerror or e}") from None
    return tmp


def _atomic_write_text(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def _arrow_type(dtype: str, shape: tuple[int, ...]) -> pa.DataType:
    if dtype not in _ARROW_TYPES:
        raise KilovlaError(f"unsupported feature dtype {dtype!r} (use one of {sorted(_ARROW_TYPES)} or 'video')")
    t = _ARROW_TYPES[dtype]
    if shape in ((1,), ()):
        return t
    for dim in reversed(shape):
        t = pa.list_(t, dim)
    return t


def _hf_feature(dtype: str, shape: tuple[int, ...]) -> dict:
    """The `huggingface` schema metadata entry LeRobot writes for a column."""
    value = {"dtype": dtype, "_type": "Value"}
    if shape in ((1,), ()):
        return value
    if len(shape) == 1:
        return {"feature": value, "length": shape[0], "_type": "List"}
    return {"shape": list(shape), "dtype": dtype, "_type": f"Array{len(shape)}D"}


def _stats_columns(ep_stats: dict[str, dict[str, np.ndarray]]) -> dict[str, list]:
    return {f"stats/{key}/{name}": np.asarray(v).tolist() for key, st in ep_stats.items() for name, v in st.items()}


def _tasks_table(tasks: list[str]) -> pa.Table:
    """meta/tasks.parquet as pandas writes it: task_index column, task string as the index."""
    table = pa.table({"task_index": pa.array(range(len(tasks)), pa.int64()),
                      "__index_level_0__": pa.array(tasks, pa.large_string())})
    pandas_meta = {
        "index_columns": ["__index_level_0__"],
        "column_indexes": [{"name": None, "field_name": None, "pandas_type": "unicode", "numpy_type": "str",
                            "metadata": {"encoding": "UTF-8"}}],
        "columns": [{"name": "task_index", "field_name": "task_index", "pandas_type": "int64",
                     "numpy_type": "int64", "metadata": None},
                    {"name": None, "field_name": "__index_level_0__", "pandas_type": "object",
                     "numpy_type": "str", "metadata": None}],
        "attributes": {}, "creator": {"library": "pyarrow", "version": pa.__version__}, "pandas_version": "2.2.3",
    }
    return table.replace_schema_metadata({"pandas": json.dumps(pandas_meta)})


class DatasetWriter:
    """Records episodes into a LeRobot v3.0 dataset (see the module docstring)."""

    def __init__(self, root: str | Path, fps: int, features: dict[str, dict], robot_type: str = "unknown",
                 video_codec: str = "libsvtav1", crf: int = 30, gop: int = 2, chunks_size: int = 1000,
                 data_files_size_in_mb: int = 100, video_files_size_in_mb: int = 200, overwrite: bool = False,
                 info: dict | None = None):
        """`info`: extra meta/info.json keys (e.g. collect's `kilovla_seed_rule`); LeRobot ignores keys it
        does not know."""
        self.root = Path(root)
        check_dataset_destination(self.root, overwrite)
        if video_codec not in CODEC_NAMES:
            raise KilovlaError(f"video codec must be one of {sorted(CODEC_NAMES)}, not {video_codec!r}")
        self.fps, self.robot_type, self.overwrite = int(fps), robot_type, overwrite
        self.extra_info = dict(info or {})
        self.video_codec, self.crf, self.gop = video_codec, crf, gop
        self.chunks_size = chunks_size
        self.data_limit = data_files_size_in_mb * 1024 * 1024
        self.video_limit = video_files_size_in_mb * 1024 * 1024
        self.features: dict[str, dict] = {}
        for name, spec in features.items():
            if name in DEFAULT_FEATURES or name == "task":
                continue
            shape = tuple(int(s) for s in spec["shape"])
            if spec["dtype"] == "video":
                if len(shape) != 3 or shape[2] != 3:
                    raise KilovlaError(f"feature {name!r}: video shape must be [height, width, 3], got {list(shape)}")
                h, w, _ = shape
                info = {"video.height": h, "video.width": w, "video.codec": CODEC_NAMES[video_codec],
                        "video.pix_fmt": "yuv420p", "video.is_depth_map": False, "video.fps": self.fps,
                        "video.channels": 3, "has_audio": False}
                self.features[name] = {"dtype": "video", "shape": list(shape),
                                       "names": spec.get("names", ["height", "width", "channels"]), "info": info}
            else:
                _arrow_type(spec["dtype"], shape)
                self.features[name] = {"dtype": spec["dtype"], "shape": list(shape), "names": spec.get("names")}
        self.features.update(DEFAULT_FEATURES)
        self.video_keys = [k for k, f in self.features.items() if f["dtype"] == "video"]
        self.table_keys = [k for k, f in self.features.items() if f["dtype"] != "video"]
        self._tmp = _staging_folder(self.root)
        self.tasks: dict[str, int] = {}
        self.episodes: list[dict[str, Any]] = []
        self.episode_stats: list[dict] = []
        self.total_frames = 0
        self._frames: list[dict] = []
        # Current data file: pending episode tables and their size; current video file per camera.
        self._data_file = (0, 0)
        self._data_parts: list[pa.Table] = []
        self._data_bytes = 0
        # Per camera: its current file, the segments staged for it, their bytes and frames.
        self._video: dict[str, dict] = {k: {"file": (0, 0), "segments": [], "bytes": 0, "frames": 0}
                                        for k in self.video_keys}
        self._finalized = False

    # -- recording --------------------------------------------------------------------------------
    def add_frame(self, frame: dict[str, Any]) -> None:
        """One time step: every feature, plus 'task' (str); 'timestamp' defaults to frame_index / fps."""
        if "task" not in frame:
            raise KilovlaError("add_frame: the frame has no 'task' string")
        missing = [k for k in self.features if k not in DEFAULT_FEATURES and k not in frame]
        if missing:
            raise KilovlaError(f"add_frame: missing features {missing}")
        clean = {"task": str(frame["task"])}
        for key, spec in self.features.items():
            if key in DEFAULT_FEATURES:
                continue
            value = np.asarray(frame[key])
            if spec["dtype"] == "video":
                value = _as_hwc_uint8(value, key)
            if tuple(value.shape) != tuple(spec["shape"]) and not (spec["shape"] == [1] and value.shape == ()):
                raise KilovlaError(f"add_frame: feature {key!r} has shape {list(value.shape)}, "
                                   f"expected {spec['shape']}")
            clean[key] = value
        if "timestamp" in frame:
            clean["timestamp"] = float(frame["timestamp"])
        self._frames.append(clean)

    def clear_episode_buffer(self) -> None:
        self._frames = []

    def save_episode(self, seed: int | None = None) -> int:
        """Write the buffered frames as the next episode; returns its episode_index. `seed`: the env seed
        the episode started from (meta/episodes' int64 `seed` column); give it for every episode or none."""
        if not self._frames:
            raise KilovlaError("save_episode: no frames were added")
        if self.episodes and (seed is None) != ("seed" not in self.episodes[0]):
            raise KilovlaError("save_episode: give a seed for every episode or for none (meta/episodes' seed column)")
        frames, self._frames = self._frames, []
        ep_index, n = len(self.episodes), len(frames)
        task_ids = [self.tasks.setdefault(f["task"], len(self.tasks)) for f in frames]
        columns: dict[str, np.ndarray] = {}
        for key in self.table_keys:
            if key in DEFAULT_FEATURES:
                continue
            columns[key] = np.stack([f[key] for f in frames]).astype(self.features[key]["dtype"])
        frame_index = np.arange(n, dtype=np.int64)
        columns["timestamp"] = np.array([f.get("timestamp", i / self.fps) for i, f in enumerate(frames)],
                                        dtype=np.float32)
        columns["frame_index"] = frame_index
        columns["episode_index"] = np.full(n, ep_index, dtype=np.int64)
        columns["index"] = frame_index + self.total_frames
        columns["task_index"] = np.array(task_ids, dtype=np.int64)

        ep_stats = {k: stats_mod.feature_stats(v) for k, v in columns.items()}
        entry: dict[str, Any] = {
            "episode_index": ep_index,
            "tasks": list(dict.fromkeys(f["task"] for f in frames)),
            "length": n,
            **({} if seed is None else {"seed": int(seed)}),
        }
        table = self._episode_table(columns)
        if self._data_parts and self._data_bytes + table.nbytes > self.data_limit:
            self._flush_data()
            self._data_file = self._next_file(*self._data_file)
        entry["data/chunk_index"], entry["data/file_index"] = self._data_file
        entry["dataset_from_index"], entry["dataset_to_index"] = self.total_frames, self.total_frames + n
        self._data_parts.append(table)
        self._data_bytes += table.nbytes
        for key in self.video_keys:
            video = np.stack([f[key] for f in frames])
            ep_stats[key] = stats_mod.image_stats(video)
            entry.update(self._encode_episode(key, video))
        self.episode_stats.append(ep_stats)
        self.episodes.append(entry)
        self.total_frames += n
        return ep_index

    def _next_file(self, chunk: int, file: int) -> tuple[int, int]:
        file += 1
        return (chunk + 1, 0) if file >= self.chunks_size else (chunk, file)

    def _episode_table(self, columns: dict[str, np.ndarray]) -> pa.Table:
        arrays, fields = [], []
        for key in self.table_keys:
            spec = self.features[key]
            shape = tuple(spec["shape"])
            values = columns[key]
            arrow_type = _arrow_type(spec["dtype"], shape)
            flat = pa.array(values.reshape(-1), type=_ARROW_TYPES[spec["dtype"]])
            for dim in reversed(shape if shape not in ((1,), ()) else ()):
                flat = pa.FixedSizeListArray.from_arrays(flat, dim)
            arrays.append(flat)
            fields.append(pa.field(key, arrow_type))
        hf = {"info": {"features": {k: _hf_feature(self.features[k]["dtype"], tuple(self.features[k]["shape"]))
                                    for k in self.table_keys}}}
        return pa.Table.from_arrays(arrays, schema=pa.schema(fields, metadata={"huggingface": json.dumps(hf)}))

    def _flush_data(self) -> None:
        if not self._data_parts:
            return
        chunk, file = self._data_file
        path = self._tmp / DEFAULT_DATA_PATH.format(chunk_index=chunk, file_index=file)
        path.parent.mkdir(parents=True, exist_ok=True)
        pq.write_table(pa.concat_tables(self._data_parts), path, compression="snappy")
        self._data_parts, self._data_bytes = [], 0

    def _encode_episode(self, key: str, video: np.ndarray) -> dict[str, Any]:
        state = self._video[key]
        if state["segments"] and state["bytes"] >= self.video_limit:
            self._join_segments(key)
            state["file"] = self._next_file(*state["file"])
        path = self._tmp / "segments" / f"{key}-{len(self.episodes):09d}.mp4"
        path.parent.mkdir(parents=True, exist_ok=True)
        h, w, _ = self.features[key]["shape"]
        with VideoEncoder(path, w, h, self.fps, self.video_codec, self.crf, self.gop) as enc:
            for frame in video:
                enc.add(frame)
        start = state["frames"] / self.fps
        state["segments"].append(path)
        state["bytes"] += enc.bytes_written
        state["frames"] += len(video)
        chunk, file = state["file"]
        return {f"videos/{key}/chunk_index": chunk, f"videos/{key}/file_index": file,
                f"videos/{key}/from_timestamp": start, f"videos/{key}/to_timestamp": state["frames"] / self.fps}

    def _join_segments(self, key: str) -> None:
        """Remux camera `key`'s staged segments into its current file."""
        state = self._video[key]
        chunk, file = state["file"]
        out = self._tmp / DEFAULT_VIDEO_PATH.format(video_key=key, chunk_index=chunk, file_index=file)
        out.parent.mkdir(parents=True, exist_ok=True)
        if len(state["segments"]) == 1:
            os.replace(state["segments"][0], out)
        else:
            concat_videos(state["segments"], out)
            for segment in state["segments"]:
                segment.unlink()
        state.update(segments=[], bytes=0, frames=0)

    # -- finishing --------------------------------------------------------------------------------
    def finalize(self) -> Path:
        """Close files, write meta/, and move the dataset into place at `root`."""
        if self._finalized:
            return self.root
        if self._frames:
            raise KilovlaError("finalize: frames were added after the last save_episode()")
        if not self.episodes:
            self.abort()
            raise KilovlaError(f"{self.root}: no episodes were saved; nothing written")
        try:
            self._flush_data()
            for key in self.video_keys:
                if self._video[key]["segments"]:
                    self._join_segments(key)
            shutil.rmtree(self._tmp / "segments", ignore_errors=True)
            write_meta(self._tmp, fps=self.fps, robot_type=self.robot_type, features=self.features,
                       tasks=list(self.tasks), episodes=self.episodes, episode_stats=self.episode_stats,
                       chunks_size=self.chunks_size, data_mb=self.data_limit // 2**20,
                       video_mb=self.video_limit // 2**20, extra_info=self.extra_info)
            _move_into_place(self._tmp, self.root, self.overwrite)
        except BaseException:
            self.abort()
            raise
        self._finalized = True
        return self.root

    def abort(self) -> None:
        """Drop everything written so far; `root` is left untouched."""
        shutil.rmtree(self._tmp, ignore_errors=True)

    def __enter__(self) -> DatasetWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.finalize()
        else:
            self.abort()


def _as_hwc_uint8(value: np.ndarray, key: str) -> np.ndarray:
    """Accept uint8 HWC, or float CHW/HWC in [0, 1] (what LeRobot's own add_frame accepts)."""
    if value.ndim == 3 and value.shape[0] == 3 and value.shape[2] != 3:
        value = value.transpose(1, 2, 0)
    if value.dtype != np.uint8:
        if not np.issubdtype(value.dtype, np.floating):
            raise KilovlaError(f"add_frame: camera {key!r} must be uint8 or float in [0, 1], got {value.dtype}")
        value = np.clip(np.round(value * 255.0), 0, 255).astype(np.uint8)
    return value


def _move_into_place(tmp: Path, root: Path, overwrite: bool) -> None:
    root = root.absolute()
    if root.exists():
        if not overwrite:
            raise KilovlaError(f"{root}: appeared while writing; not replacing it")
        check_replaceable(root, DATASET)  # again: files may have been put there while we wrote
        old = root.parent / f".{root.name}.old-{uuid.uuid4().hex[:8]}"
        os.replace(root, old)
        os.replace(tmp, root)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, root)


def write_meta(root: Path, *, fps: int, robot_type: str, features: dict, tasks: list[str], episodes: list[dict],
               episode_stats: list[dict], chunks_size: int, data_mb: int, video_mb: int,
               extra_info: dict | None = None) -> None:
    """meta/info.json, meta/tasks.parquet, meta/episodes/..., meta/stats.json for a v3.0 dataset."""
    meta = root / "meta"
    (meta / "episodes" / "chunk-000").mkdir(parents=True, exist_ok=True)
    rows = [{**ep, **_stats_columns(st), "meta/episodes/chunk_index": 0, "meta/episodes/file_index": 0}
            for ep, st in zip(episodes, episode_stats)]
    pq.write_table(pa.Table.from_pylist(rows), root / EPISODES_PATH.format(chunk_index=0, file_index=0))
    pq.write_table(_tasks_table(tasks), meta / "tasks.parquet")
    total_frames = int(sum(ep["length"] for ep in episodes))
    info = {
        "codebase_version": CODEBASE_VERSION,
        "robot_type": robot_type,
        "total_episodes": len(episodes),
        "total_frames": total_frames,
        "total_tasks": len(tasks),
        "chunks_size": chunks_size,
        "data_files_size_in_mb": data_mb,
        "video_files_size_in_mb": video_mb,
        "fps": fps,
        "splits": {"train": f"0:{len(episodes)}"},
        "data_path": DEFAULT_DATA_PATH,
        "video_path": DEFAULT_VIDEO_PATH if any(f["dtype"] == "video" for f in features.values()) else None,
        "features": features,
        **(extra_info or {}),
    }
    _atomic_write_text(meta / "info.json", json.dumps(info, indent=4))
    stats = stats_mod.aggregate_stats(episode_stats)
    _atomic_write_text(meta / "stats.json", json.dumps(stats_mod.stats_to_json(stats), indent=4))


def convert_v21_to_v30(src: str | Path, dst: str | Path, overwrite: bool = False,
                       data_files_size_in_mb: int = 100, video_files_size_in_mb: int = 200) -> Path:
    """Convert a LeRobot v2.1 dataset (one parquet/mp4 per episode) to v3.0 (concatenated files).

    Videos are joined without re-encoding; frame data is concatenated into ~100 MB parquet files.
    Writes to a temporary folder and renames it to `dst` at the end.
    """
    src_meta = DatasetMeta(src)
    if src_meta.version == "v3.0":
        raise KilovlaError(f"{src}: is already a v3.0 dataset")
    dst = Path(dst)
    if dst.exists() and not overwrite:
        raise KilovlaError(f"{dst}: already exists (pass --overwrite to replace it)")
    check_replaceable(dst, DATASET)
    tmp = _staging_folder(dst)
    try:
        _convert(src_meta, tmp, data_files_size_in_mb * 2**20, video_files_size_in_mb * 2**20)
        _move_into_place(tmp, dst, overwrite)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return dst


def _convert(meta: DatasetMeta, tmp: Path, data_limit: int, video_limit: int) -> None:
    eps = meta.episodes
    features = {k: f.to_json() for k, f in meta.features.items()}
    for f in features.values():
        if f["dtype"] == "video":
            f.setdefault("info", {})
    episodes = [{"episode_index": int(e), "tasks": eps.tasks[e], "length": int(eps.length[e]),
                 "dataset_from_index": int(eps.row_from[e]), "dataset_to_index": int(eps.row_to[e])}
                for e in eps.index]
    episode_stats = _convert_frames(meta, tmp, episodes, data_limit)
    for key in meta.video_keys:
        _convert_videos(meta, key, tmp, episodes, features[key]["info"], video_limit)
    _add_camera_stats(meta, episode_stats)
    write_meta(tmp, fps=int(meta.fps), robot_type=meta.info.get("robot_type", "unknown"), features=features,
               tasks=meta.tasks, episodes=episodes, episode_stats=episode_stats,
               chunks_size=int(meta.info.get("chunks_size", 1000)), data_mb=data_limit // 2**20,
               video_mb=video_limit // 2**20)


def _convert_frames(meta: DatasetMeta, tmp: Path, episodes: list[dict], data_limit: int) -> list[dict]:
    """Frame data: concatenate per-episode parquet files into files of at most data_limit bytes; records
    each episode's file in `episodes`. Returns the per-episode stats of the non-video columns."""
    eps, files = meta.episodes, meta.files
    file_id, parts, size = (0, 0), [], 0

    def flush():
        path = tmp / DEFAULT_DATA_PATH.format(chunk_index=file_id[0], file_index=file_id[1])
        path.parent.mkdir(parents=True, exist_ok=True)
        pq.write_table(pa.concat_tables(parts, promote_options="default"), path, compression="snappy")

    episode_stats = []
    for e in eps.index:
        table = files.read_parquet(eps.data_file[e])
        if parts and size + table.nbytes > data_limit:
            flush()
            file_id, parts, size = (file_id[0], file_id[1] + 1), [], 0
        parts.append(table)
        size += table.nbytes
        episodes[e]["data/chunk_index"], episodes[e]["data/file_index"] = file_id
        episode_stats.append({f.name: stats_mod.feature_stats(column_to_numpy(table.column(f.name), f,
                                                                              files.path(eps.data_file[e])))
                              for f in meta.table_features() if f.dtype in _ARROW_TYPES and f.dtype != "string"})
    flush()
    return episode_stats


def _convert_videos(meta: DatasetMeta, key: str, tmp: Path, episodes: list[dict], info: dict,
                    video_limit: int) -> None:
    """Videos of camera `key`: group consecutive episodes into files of at most video_limit bytes, remux each
    group; records each episode's file and timestamps in `episodes` and fills the camera's `info`."""
    eps = meta.episodes
    sources = [meta.files.path(p) for p in eps.video_file[key]]
    groups, current, size = [], [], 0
    for e, path in enumerate(sources):
        if not os.path.exists(path):
            raise DatasetError(path, "video file is missing")
        nbytes = os.path.getsize(path)
        if current and size + nbytes > video_limit:
            groups.append(current)
            current, size = [], 0
        current.append(e)
        size += nbytes
    groups.append(current)
    for file_index, group in enumerate(groups):
        out = tmp / DEFAULT_VIDEO_PATH.format(video_key=key, chunk_index=0, file_index=file_index)
        out.parent.mkdir(parents=True, exist_ok=True)
        starts = concat_videos([sources[e] for e in group], out)
        for e, start in zip(group, starts):
            episodes[e].update({f"videos/{key}/chunk_index": 0, f"videos/{key}/file_index": file_index,
                                f"videos/{key}/from_timestamp": start,
                                f"videos/{key}/to_timestamp": start + float(eps.length[e]) / meta.fps})
    probe = probe_video(sources[0])
    info.setdefault("video.height", probe["height"])
    info.setdefault("video.width", probe["width"])
    info.setdefault("video.codec", probe["codec"])
    info.setdefault("video.pix_fmt", probe["pix_fmt"])
    info.setdefault("video.fps", meta.fps)


def _add_camera_stats(meta: DatasetMeta, episode_stats: list[dict]) -> None:
    """Camera stats: v2.1 keeps them per episode in episodes_stats.jsonl; carry them over, and
    compute them from a few decoded frames per episode where they are missing."""
    eps, files = meta.episodes, meta.files
    by_ep = {}
    if meta.video_keys and files.exists("meta/episodes_stats.jsonl"):
        by_ep = {r["episode_index"]: r["stats"] for r in files.read_jsonl("meta/episodes_stats.jsonl")}
    source = None
    for e, st in enumerate(episode_stats):
        for key in meta.video_keys:
            if key in by_ep.get(e, {}):
                st[key] = {k: np.asarray(v) for k, v in by_ep[e][key].items()}
                continue
            if source is None:
                source = LeRobotDataset(meta.root, video_backend="pyav")
            positions = np.unique(np.linspace(eps.row_from[e], eps.row_to[e] - 1, CONVERT_STAT_FRAMES).round())
            frames = source.get_batch(positions.astype(np.int64), video_keys=[key])[key]
            st[key] = stats_mod.image_stats(frames)
