"""`kilovla data validate`: every check a dataset must pass before training reads it.

Structure (meta/info.json, tasks, episodes tiling the frames), frame data against info.json (every
column present with its dtype and shape, none undeclared; no camera's videos on disk undeclared, `index` 0..N-1, `episode_index` matching meta/episodes,
`frame_index` restarting per episode, `timestamp` stepping by 1/fps, valid `task_index`, every float
value finite), videos (present, readable, codec and size as declared, fps equal to the table's, long
enough for every episode; with `deep=True` every frame of every episode decoded, at its timestamp)
and stats.json (every feature's stats present and finite).

Returns a list of problems, each naming the file and what is wrong; empty means valid.
`check_dataset` raises them instead: train and `data stats` refuse what validate calls an error.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np

from kilovla.data.columns import open_columns
from kilovla.data.meta import DEFAULT_VIDEO_PATH, DatasetMeta
from kilovla.data.stats import STAT_NAMES, episode_of, non_finite_location
from kilovla.data.video import VideoDecoderPool, probe_video
from kilovla.errors import DatasetError, KilovlaError

TIMESTAMP_TOLERANCE_S = 1e-4
CHECK_ROWS = 1 << 20  # rows checked at a time: memory stays flat however long the dataset
DECODE_FRAMES = 64  # frames `deep` decodes at a time: memory stays flat however long the episode


@dataclass(frozen=True)
class Problem:
    path: str
    message: str

    def __str__(self) -> str:
        return f"{self.path}: {self.message}"


def validate_dataset(root: str, deep: bool = False, stats: bool = True, meta: DatasetMeta | None = None,
                     columns=None, progress=None) -> list[Problem]:
    """`stats=False` leaves meta/stats.json out (what `kilovla data stats` is about to rewrite).
    `progress(done, total)`: called as `deep` decodes each episode of each camera. `meta` and
    `columns` (e.g. a column cache's maps) when the caller has them already; else the columns are mapped
    from the column cache (`columns.open_columns`: written on first use, as training does; in memory,
    with one warning, where no cache can be written). Frame data the cache refuses is read into memory
    instead, so the finding is the reader's (the cache stops at its first problem, in its own words)."""
    try:
        meta = meta or DatasetMeta(root)
        if columns is None:
            try:
                columns = open_columns(meta)
            except DatasetError:
                columns = meta.load_columns()
    except DatasetError as e:
        return [Problem(e.path, e.problem)]
    problems: list[Problem] = []
    problems += _check_declared(meta)
    problems += _check_frames(meta, columns)
    problems += _check_videos(meta, columns, deep, progress)
    if stats:
        problems += _check_stats(meta)
    return problems


def check_dataset(root: str, stats: bool = True, problems: list | None = None) -> None:
    """Raise KilovlaError naming the dataset's problems when `validate_dataset` finds any (or `problems`,
    e.g. as a lake index recorded them): what validate calls an error is refused by every command that
    reads the dataset (train, data stats)."""
    problems = validate_dataset(root, stats=stats) if problems is None else problems
    if problems:
        shown = "; ".join(str(p) for p in problems[:3])
        more = f"; and {len(problems) - 3} more" if len(problems) > 3 else ""
        raise KilovlaError(f"{root}: not a valid dataset ({len(problems)} problem{'s' if len(problems) > 1 else ''}, "
                           f"`kilovla data validate {root}` lists them): {shown}{more}")


def _template_regex(template: str) -> re.Pattern:
    """info.json's video_path as a regex: {video_key} captured, the numeric fields matched."""
    pattern, last = "", 0
    for m in re.finditer(r"\{(\w+)(?::[^}]*)?\}", template):
        pattern += re.escape(template[last:m.start()])
        pattern += r"(?P<video_key>[^/]+)" if m.group(1) == "video_key" else r"\d+"
        last = m.end()
    return re.compile(pattern + re.escape(template[last:]))


def _check_declared(meta: DatasetMeta) -> list[Problem]:
    """What the files hold that info.json does not declare: a frame-data column, a camera's videos.
    Readers go by info.json, so such data would be dropped without a word."""
    problems = []
    declared = set(meta.features)
    for rel in dict.fromkeys(meta.episodes.data_file):
        names = meta.files.read_parquet_schema(rel).names if meta.files.exists(rel) else []
        extra = [c for c in names if c not in declared and not c.startswith("__index_level_")]
        if extra:
            problems.append(Problem(meta.files.path(rel), f"column{'s' if len(extra) > 1 else ''} "
                                    f"{', '.join(map(repr, extra))} not declared in meta/info.json features "
                                    "(declare or drop it)"))
    pattern = _template_regex(meta.info.get("video_path") or DEFAULT_VIDEO_PATH)
    undeclared: dict[str, str] = {}
    for rel in meta.files.glob("videos/**/*.mp4"):
        m = pattern.fullmatch(rel)
        if m is not None and m["video_key"] not in meta.video_keys:
            undeclared.setdefault(m["video_key"], rel)
    for key, rel in undeclared.items():
        problems.append(Problem(meta.files.path(rel), f"videos of camera {key!r} are on disk but {key!r} is not "
                                "declared in meta/info.json features (declare it, or remove its videos)"))
    return problems


def _float_columns(meta: DatasetMeta, columns) -> list[str]:
    """The frame-data columns that hold floats (observation.state, action, timestamp, any float feature)."""
    return [f.name for f in meta.table_features()
            if f.name in columns and np.asarray(columns[f.name][:0]).dtype.kind == "f"]


def _check_frames(meta: DatasetMeta, columns: dict[str, np.ndarray]) -> list[Problem]:
    """frame_index, timestamp and task_index, and every float column finite (a NaN or inf trains into a
    NaN loss), CHECK_ROWS rows at a time; each check names its first bad row."""
    eps = meta.episodes
    floats = _float_columns(meta, columns)
    first: dict[str, int] = {}  # check -> its first bad row
    for lo in range(0, meta.total_frames, CHECK_ROWS):
        hi = min(lo + CHECK_ROWS, meta.total_frames)
        rows = np.arange(lo, hi)
        expected_frame = rows - eps.row_from[np.searchsorted(eps.row_from, rows, side="right") - 1]
        bad = {}
        if "frame_index" in columns:
            bad["frame_index"] = np.asarray(columns["frame_index"][lo:hi]) != expected_frame
        ts = np.asarray(columns["timestamp"][lo:hi], dtype=np.float64)
        bad["timestamp"] = np.abs(ts - expected_frame / meta.fps) > TIMESTAMP_TOLERANCE_S
        if "task_index" in columns:
            task = np.asarray(columns["task_index"][lo:hi])
            bad["task_index"] = (task < 0) | (task >= len(meta.tasks))
        for name in floats:
            block = np.asarray(columns[name][lo:hi])
            bad[f"finite {name}"] = ~np.isfinite(block.reshape(len(block), -1)).all(axis=1)
        for check, mask in bad.items():
            if check not in first and mask.any():
                first[check] = lo + int(np.argmax(mask))
        if len(first) == len(bad):
            break
    problems = []
    if "frame_index" in first:
        row = first["frame_index"]
        ep = episode_of(eps, row)
        problems.append(Problem(meta.files.path(eps.data_file[ep]),
                                f"frame_index at row {row} is {columns['frame_index'][row]}, expected "
                                f"{row - eps.row_from[ep]} (must restart at 0 in every episode)"))
    if "timestamp" in first:
        row = first["timestamp"]
        ep = episode_of(eps, row)
        ts = np.asarray(columns["timestamp"][eps.row_from[ep]:eps.row_to[ep]], dtype=np.float64)
        steps = np.diff(ts)
        step = f"{np.median(steps):.6g} s" if len(steps) else "n/a"
        problems.append(Problem(meta.files.path(eps.data_file[ep]),
                                f"timestamp at row {row} (episode {ep}) is {float(columns['timestamp'][row]):.6g}, "
                                f"expected {(row - eps.row_from[ep]) / meta.fps:.6g}: the table steps by {step} but "
                                f"info.json fps={meta.fps} means {1 / meta.fps:.6g} s"))
    if "task_index" in first:
        row = first["task_index"]
        problems.append(Problem(meta.files.path(eps.data_file[episode_of(eps, row)]),
                                f"task_index {columns['task_index'][row]} at row {row} is not in "
                                f"meta/tasks (0..{len(meta.tasks) - 1})"))
    for name in floats:
        if f"finite {name}" in first:
            problems.append(Problem(*non_finite_location(meta, columns, name, first[f"finite {name}"])))
    return problems


def _check_videos(meta: DatasetMeta, columns, deep: bool, progress=None) -> list[Problem]:
    problems = []
    eps = meta.episodes
    done, total = 0, len(eps) * len(meta.video_keys)
    pool = VideoDecoderPool("pyav", max_open=4, threads=1) if deep else None
    for key in meta.video_keys:
        feature = meta.features[key]
        declared = feature.info or {}
        files = dict.fromkeys(eps.video_file[key])
        probes = {}
        for rel in files:
            path = meta.files.path(rel)
            if not meta.files.exists(rel):
                problems.append(Problem(path, f"video file of {key} is missing"))
                continue
            try:
                probes[rel] = probe_video(path)
            except DatasetError as e:
                problems.append(Problem(e.path, e.problem))
                continue
            p = probes[rel]
            h, w = feature.shape[0], feature.shape[1]
            if (p["height"], p["width"]) != (h, w):
                problems.append(Problem(path, f"frames are {p['height']}x{p['width']}, info.json says {h}x{w} for {key}"))
            codec = declared.get("video.codec")
            if codec and p["codec"] != codec:
                problems.append(Problem(path, f"codec is {p['codec']}, info.json says {codec}"))
            if p["fps"] and abs(p["fps"] - meta.fps) > 1e-3:
                problems.append(Problem(path, f"video fps is {p['fps']:g} but the table's fps is {meta.fps} "
                                        f"(meta/info.json): frames would not line up with timestamps"))
        for e in range(len(eps)):
            rel = eps.video_file[key][e]
            p = probes.get(rel)
            if p is None:
                continue
            end = eps.video_to_s[key][e]
            if p["duration_s"] is not None and end > p["duration_s"] + 1.0 / meta.fps + TIMESTAMP_TOLERANCE_S:
                problems.append(Problem(meta.files.path(rel), f"episode {e} of {key} ends at {end:.3f} s but the "
                                        f"video is {p['duration_s']:.3f} s long"))
            if deep:
                problems += _decode_episode(meta, columns, pool, key, e)
                if progress is not None:
                    progress(done := done + 1, total)
    if pool is not None:
        pool.close()
    return problems


def _decode_episode(meta: DatasetMeta, columns, pool: VideoDecoderPool, key: str, e: int) -> list[Problem]:
    """Every frame of episode `e` of camera `key` decoded, DECODE_FRAMES at a time in one forward pass
    (the reader goes on where the last block ended). A block that fails is read again frame by frame,
    so the problem names the first frame that does not decode, not the block."""
    eps = meta.episodes
    path = meta.files.path(eps.video_file[key][e])
    row_from, row_to = int(eps.row_from[e]), int(eps.row_to[e])
    times = eps.video_from_s[key][e] + np.asarray(columns["timestamp"][row_from:row_to], dtype=np.float64)
    for lo in range(0, len(times), DECODE_FRAMES):
        hi = min(lo + DECODE_FRAMES, len(times))
        try:
            pool.read(path, times[lo:hi])
            continue
        except DatasetError as block_err:
            failed = block_err
        for i in range(lo, hi):
            try:
                pool.read(path, times[i:i + 1])
            except DatasetError as err:
                return [Problem(err.path, f"episode {e} of {key}: frame {i} (t={times[i]:.4f} s in the file) does "
                                          f"not decode: {err.problem}")]
        # Each frame decodes alone (after a seek) but not in one pass, as training reads them.
        return [Problem(failed.path, f"episode {e} of {key}: frames {lo}..{hi - 1} do not decode in one pass: "
                                     f"{failed.problem}")]
    return []


def _check_stats(meta: DatasetMeta) -> list[Problem]:
    rel = "meta/stats.json"
    path = meta.files.path(rel)
    if not meta.files.exists(rel):
        return [Problem(path, "missing: normalisation stats are needed for training "
                        "(`kilovla data stats PATH` recomputes them)")]
    try:
        stats = meta.files.read_json(rel)
    except DatasetError as e:
        return [Problem(e.path, e.problem)]
    problems = []
    for name, feat in meta.features.items():
        if feat.dtype not in ("float32", "float64", "video"):
            continue
        if name not in stats:
            problems.append(Problem(path, f"no stats for feature {name!r}"))
            continue
        missing = [s for s in STAT_NAMES if s not in stats[name]]
        if missing:
            problems.append(Problem(path, f"stats of {name!r} lack {missing}"))
            continue
        bad = [s for s in STAT_NAMES if not _finite_numbers(stats[name][s])]
        if bad:  # NaN, Infinity: Python's json reads them, and every normalised value would be NaN
            problems.append(Problem(path, f"stats of {name!r} are not finite numbers ({', '.join(bad)}): "
                                    "`kilovla data stats PATH` recomputes them"))
    return problems


def _finite_numbers(value) -> bool:
    try:
        return bool(np.isfinite(np.asarray(value, dtype=np.float64)).all())
    except (TypeError, ValueError):  # a string, a ragged list
        return False
