"""A decoded-frame cache: every camera frame of a LeRobot dataset decoded once, read back by row.

For datasets read for many epochs, decoding AV1 again every epoch is the loader's whole cost. The
cache trades disk for it: `build_frame_cache` decodes every video once, in parallel over episodes
with Ray Data (locally, or on a cluster whose nodes share the dataset and the output folder), into
one uint8 array per (camera, episode), stored as a `.npy` file that readers memory-map::

    <cache>/manifest.json                          what was decoded from what (written last)
    <cache>/<camera>/episode_000042.npy           (length, H, W, 3) uint8, row order of the episode

Frame i of a part is exactly what the video decoder returns for row `row_from + i` of the data
table (the part is filled by the same decoder call a random read makes), so a loader reading the
cache returns bit-identical frames, for any delta_timestamps: windows are clamped to their episode,
and every frame of every episode is there.

Why raw uint8 and not a compressed store: it is the only lossless one that is faster than the
videos by a wide margin. Measured on 224 px frames (../shared/research/video_loading.md, section 5):
raw memmap ~86,000 frames/s per core, PNG (lossless) 650-1,000, the AV1 source 520-660; JPEG and
all-intra H.264 are 2-3x faster than AV1 but lossy, so not the same values. The price is disk:
H*W*3 bytes per frame, 150 kB at 224 px, 20-50x the AV1 videos; `cache_bytes` in `kilovla bench
data` reports the ratio for the bench's dataset.

The manifest keys every part by its source video's size and SHA-256 (plus its mtime, so a reader
re-hashes only files that were touched; after a hash matches, the new mtime is written back so the
next open does not hash again), by the episode's place in the data table and by a hash of its
timestamps, and records a BLAKE2b checksum of each part's whole file.

What is detected, and when:
- at open (`open_frame_cache`), before anything is read: a stale source (rows, timestamps, video
  size or content), a missing, truncated or grown part, and a part whose .npy header does not
  describe the manifest's (length, H, W, 3) uint8 array (one small read per part). Same-size
  corruption of the frame bytes themselves is NOT detected at open: hashing every part would read
  the whole cache (20-50x the videos) before the first step.
- at a rebuild (`build_frame_cache` on an existing cache): every part it would keep is hashed in
  full and compared with its recorded checksum, so same-size corruption is decoded again. BLAKE2b of
  the full file, not sampled blocks: a rebuild already hashes every source video, the part is read
  at memory/disk speed (~1 GB/s per core), and a sampled hash would miss a flipped byte between
  samples.
Re-running the build re-decodes only the parts that are stale, corrupt or missing.

The build writes only into an empty folder or a folder that holds a frame cache (its manifest, or
the marker of an interrupted build), and only ever removes files that an earlier manifest or marker
lists, or its own temporary files (`.episode_NNNNNN.npy.XXXXXXXX.tmp`): a folder of the user's own
files is refused.

Where a loader finds a cache: `LeRobotDataset(root, frame_cache=...)` takes a folder, None (never),
or "auto" (the default): `default_cache_dir(root)`, which is where `kilovla data cache SRC` writes
unless told `--output_dir`. With "auto" a cache that cannot serve the request (partial: other cameras;
interrupted: no manifest; stale; decoded with another backend than an explicit `video_backend`) is
passed over with one warning line and frames are decoded from the videos; a folder named explicitly
is refused instead, with the reason.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import re
import uuid
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from kilovla.data.columns import dataset_cache_dir
from kilovla.data.meta import DatasetMeta
from kilovla.errors import DatasetError, KilovlaError

log = logging.getLogger(__name__)

MANIFEST = "manifest.json"
# Written at the start of a build and removed once the manifest is in place: marks the folder as a
# frame cache being built (so a rerun after a crash may continue there) and lists every file the
# build may leave behind (so that only those are ever removed).
BUILDING = ".kilovla-frame-cache-building.json"
_TMP_PART = re.compile(r"^\.episode_\d{6}\.npy\.[0-9a-f]{8}\.tmp$")
FORMAT = "kilovla-frame-cache"
VERSION = 1
# Frames decoded per chunk while building a part, which bounds the builder's memory whatever the
# episode length (300 frames at 224 px: 45 MB).
BUILD_CHUNK_FRAMES = 300


def default_cache_dir(root: str | Path) -> Path:
    """Where `kilovla data cache` writes and `frame_cache="auto"` looks: one folder per dataset path.

    $KILOVLA_CACHE_DIR (else $XDG_CACHE_HOME/kilovla, else ~/.cache/kilovla) / frames / <name>-<hash>.
    """
    return dataset_cache_dir("frames", root)


def sha256_file(path: str | Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def blake2b_file(path: str | Path, chunk: int = 1 << 22) -> str:
    h = hashlib.blake2b(digest_size=16)
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def file_stamp(path: str | Path) -> dict:
    st = os.stat(path)
    return {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "sha256": sha256_file(path)}


def _timestamps_digest(timestamps: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(timestamps, dtype=np.float32).tobytes()).hexdigest()[:16]


def _part_name(camera: str, episode: int) -> str:
    return f"{camera}/episode_{episode:06d}.npy"


def _npy_bytes(shape: tuple[int, ...]) -> int:
    """Size of the .npy file of a uint8 array of `shape`, as np.lib.format writes it."""
    header = io.BytesIO()
    np.lib.format.write_array_header_1_0(header, {"descr": "|u1", "fortran_order": False, "shape": tuple(shape)})
    return header.tell() + int(np.prod(shape))


@dataclass(frozen=True)
class EpisodePart:
    """One (camera, episode) array of the cache and what it was decoded from."""

    camera: str
    episode: int
    file: str  # relative to the cache folder
    video: str  # relative to the dataset root
    row_from: int
    length: int
    from_timestamp: float
    timestamps: str  # digest of the episode's timestamp column
    bytes: int

    def to_json(self) -> dict:
        return dict(self.__dict__)


# -- building --------------------------------------------------------------------------------------
def _episode_request(meta, columns: dict, camera: str, episode: int) -> tuple[str, np.ndarray, EpisodePart]:
    eps = meta.episodes
    r0, r1 = int(eps.row_from[episode]), int(eps.row_to[episode])
    ts = columns["timestamp"][r0:r1]
    # LeRobot's video time of a row: from_timestamp (float64) + the float32 timestamp of the row.
    video_ts = eps.video_from_s[camera][episode] + ts.astype(np.float64)
    shape = (r1 - r0, *meta.features[camera].shape)
    part = EpisodePart(camera=camera, episode=episode, file=_part_name(camera, episode),
                       video=eps.video_file[camera][episode], row_from=r0, length=r1 - r0,
                       from_timestamp=float(eps.video_from_s[camera][episode]),
                       timestamps=_timestamps_digest(ts), bytes=_npy_bytes(shape))
    return meta.files.path(part.video), video_ts, part


def decode_episode_parts(root: str, out: str, episode: int, cameras: list[str], backend: str,
                         tolerance_s: float = 1e-4) -> list[dict]:
    """Decode one episode's frames of `cameras` into `out`; returns the parts' manifest entries.

    Runs where Ray puts it: opens the dataset itself (paths travel, decoders do not), writes each
    part to a temporary name and renames it, so a killed task leaves no half-written part behind.
    """
    from kilovla.data.video import VideoDecoderPool

    meta = DatasetMeta(root)
    columns = meta.load_columns(["timestamp"])
    pool = VideoDecoderPool(backend, max_open=len(cameras), threads=1)
    parts = []
    try:
        for camera in cameras:
            video_path, video_ts, part = _episode_request(meta, columns, camera, episode)
            target = Path(out) / part.file
            target.parent.mkdir(parents=True, exist_ok=True)
            tmp = target.with_name(f".{target.name}.{uuid.uuid4().hex[:8]}.tmp")
            try:
                array = np.lib.format.open_memmap(tmp, mode="w+", dtype=np.uint8,
                                                  shape=(part.length, *meta.features[camera].shape))
                for start in range(0, part.length, BUILD_CHUNK_FRAMES):
                    stop = min(start + BUILD_CHUNK_FRAMES, part.length)
                    frames = pool.read(video_path, video_ts[start:stop], tolerance_s)
                    if frames.shape[1:] != array.shape[1:]:
                        raise DatasetError(video_path, f"frames are {frames.shape[1]}x{frames.shape[2]}, info.json "
                                           f"says {array.shape[1]}x{array.shape[2]} for {camera}")
                    array[start:stop] = frames
                array.flush()
                del array
                checksum = blake2b_file(tmp)  # just written: read back from the page cache
                os.replace(tmp, target)
            finally:
                tmp.unlink(missing_ok=True)
            parts.append(part.to_json() | {"blake2b": checksum})
    finally:
        pool.close()
    return parts


@dataclass(frozen=True)
class CacheBuild:
    """What `build_frame_cache` did."""

    path: Path
    parts: int
    decoded: int  # parts decoded now (the rest were still valid)
    frames: int
    cache_bytes: int
    video_bytes: int
    engine: str


def build_frame_cache(root: str | Path, out: str | Path | None = None, *, cameras: list[str] | None = None,
                      backend: str = "auto", engine: str = "auto", ray_address: str | None = None,
                      progress: Callable[[int, int], None] | None = None) -> CacheBuild:
    """Decode every frame of `root`'s cameras into a frame cache at `out` (default: default_cache_dir).

    engine: "ray" (Ray Data over episodes: `ray_address`, RAY_ADDRESS or a local Ray), "local" (this
    process, one episode after the other) or "auto" (Ray when it is installed, else local, with a
    warning). Parts that are still valid are kept; stale ones are decoded again.
    `progress(done, total)` is called as episodes finish.
    """
    from kilovla.data.video import resolve_backend

    meta = DatasetMeta(root)
    if meta.files.is_url:
        raise KilovlaError(f"{meta.root}: the frame cache needs a dataset on a local (or mounted) file system")
    root = Path(meta.root).resolve()
    out = Path(out) if out is not None else default_cache_dir(root)
    if out.resolve() == root or root in out.resolve().parents:
        raise KilovlaError(f"{out}: the cache must not be written inside the dataset {root}")
    cameras = list(cameras or meta.video_keys)
    if not cameras:
        raise KilovlaError(f"{root}: the dataset has no video features, so there is nothing to cache")
    unknown = [c for c in cameras if c not in meta.video_keys]
    if unknown:
        raise KilovlaError(f"{root}: cameras {unknown} are not video features of the dataset ({meta.video_keys})")
    backend = resolve_backend(backend)
    columns = meta.load_columns(["timestamp"])
    videos = sorted({meta.episodes.video_file[c][e] for c in cameras for e in range(len(meta.episodes))})
    stamps = {}
    for rel in videos:
        path = meta.files.path(rel)
        if not os.path.exists(path):
            raise DatasetError(path, "video file is missing")
        stamps[rel] = file_stamp(path)
    wanted = {(c, e): _episode_request(meta, columns, c, e)[2] for c in cameras for e in range(len(meta.episodes))}
    old_manifest, known_files = _claim_folder(out)
    keep = _reusable_parts(out, old_manifest, wanted, stamps, backend)
    todo: dict[int, list[str]] = {}  # episode -> its cameras whose part must be decoded
    for c, e in sorted(wanted, key=lambda k: (k[1], cameras.index(k[0]))):
        if (c, e) not in keep:
            todo.setdefault(e, []).append(c)
    total = len(meta.episodes)
    done = total - len(todo)
    if progress is not None:
        progress(done, total)
    out.mkdir(parents=True, exist_ok=True)
    # A manifest describes a complete cache: take it away while parts change, so that a build that
    # dies half-way leaves a cache that readers refuse rather than one they half-use. The marker
    # keeps what the old manifest said, so a rerun can still reuse and clean up.
    _write_json(out / BUILDING, {"format": FORMAT, "manifest": old_manifest,
                                 "files": sorted(known_files | {p.file for p in wanted.values()})})
    (out / MANIFEST).unlink(missing_ok=True)
    built: list[dict] = []
    used = "none"
    if todo:
        used = _pick_engine(engine)
        runner = _build_with_ray if used == "ray" else _build_locally
        for parts in runner(str(root), str(out), todo, backend, ray_address):
            built += parts
            done += 1
            if progress is not None:
                progress(done, total)
    by_key = {(p["camera"], p["episode"]): p for p in built}
    parts = [by_key.get(k) or keep[k] for k in sorted(wanted)]
    for p in parts:
        if os.path.getsize(out / p["file"]) != p["bytes"]:
            raise DatasetError(out / p["file"], f"has {os.path.getsize(out / p['file'])} bytes, expected {p['bytes']}")
    manifest = {
        "format": FORMAT, "version": VERSION, "dataset": str(root), "backend": backend, "fps": meta.fps,
        "total_frames": meta.total_frames,
        "cameras": {c: {"shape": list(meta.features[c].shape)} for c in cameras},
        "videos": {rel: stamps[rel] for rel in videos},
        "parts": parts,
    }
    _write_json(out / MANIFEST, manifest)
    _remove_orphans(out, known_files | {p.file for p in wanted.values()}, {p["file"] for p in parts}, cameras)
    (out / BUILDING).unlink(missing_ok=True)
    return CacheBuild(path=out, parts=len(parts), decoded=len(by_key), frames=meta.total_frames * len(cameras),
                      cache_bytes=sum(p["bytes"] for p in parts), video_bytes=sum(s["size"] for s in stamps.values()),
                      engine=used)


def _pick_engine(engine: str) -> str:
    if engine not in ("auto", "ray", "local"):
        raise KilovlaError(f"cache build engine must be auto, ray or local, not {engine!r}")
    if engine != "auto":
        return engine
    try:
        import ray  # noqa: F401
    except ImportError:
        log.warning("Ray is not installed (pip install 'kilovla[rl]'): decoding episodes one by one in this process")
        return "local"
    return "ray"


def _build_locally(root, out, todo, backend, ray_address):
    for e, cameras in todo.items():
        yield decode_episode_parts(root, out, e, cameras, backend)


def _build_with_ray(root, out, todo, backend, ray_address):
    """Ray Data over episodes: each task decodes one episode and writes its parts itself; only the
    manifest entries travel back (frames never enter the object store)."""
    from kilovla.data.ray_cluster import connect_ray

    ray = connect_ray(ray_address, what="kilovla data cache")
    import ray.data

    ctx = ray.data.DataContext.get_current()
    ctx.enable_progress_bars = False  # the caller shows one rich progress bar instead
    ctx.print_on_execution_start = False
    # Ray Data narrates every execution on stderr, failures included (with tracebacks); the progress
    # bar says what matters and a failure is re-raised below as one line.
    logging.getLogger("ray.data").setLevel(logging.CRITICAL)

    def decode(item: dict) -> dict:
        parts = decode_episode_parts(root, out, int(item["episode"]), json.loads(item["cameras"]), backend)
        return {"parts": json.dumps(parts)}

    items = [{"episode": int(e), "cameras": json.dumps(cams)} for e, cams in todo.items()]
    ds = ray.data.from_items(items).map(decode, num_cpus=1)
    try:
        for row in ds.iter_rows():
            yield json.loads(row["parts"])
    except Exception as e:
        failure = ray_task_failure(e)
        if failure is not None:
            raise failure from None
        raise


def ray_task_failure(e: BaseException) -> KilovlaError | None:
    """The one-line error behind a Ray task failure, when it is the user's to fix: a DatasetError
    raised in the task (Ray wraps it), or workers that cannot import kilovla (a cluster whose nodes
    run another environment)."""
    seen = set()
    err = e
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        if isinstance(err, KilovlaError):
            return err
        err = getattr(err, "cause", None) or err.__cause__ or err.__context__
    missing = re.search(r"No module named '(kilovla[\w.]*)'", str(e))
    if missing:
        return KilovlaError(f"the Ray cluster's workers cannot import {missing.group(1)}: install this kilovla "
                            "(same version) on every node of the cluster")
    return None


def _write_json(path: Path, obj: dict) -> None:
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}.json-tmp")
    try:
        tmp.write_text(json.dumps(obj, indent=1))
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def _read_json(path: Path) -> dict | None:
    try:
        obj = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError, UnicodeDecodeError):
        return None
    return obj if isinstance(obj, dict) else None


def _claim_folder(out: Path) -> tuple[dict | None, set[str]]:
    """The earlier manifest in `out` (None if none) and every file an earlier build accounts for.

    Refuses a folder that is neither empty nor a frame cache (no manifest, no build marker): the
    build would mix its files with the user's, and its clean-up must never touch those.
    """
    if not out.exists():
        return None, set()
    if not out.is_dir():
        raise KilovlaError(f"{out}: --output_dir must be a folder, this is a file")
    manifest = _read_json(out / MANIFEST)
    marker = _read_json(out / BUILDING)
    if manifest is not None and manifest.get("format") != FORMAT:
        manifest = None
    if marker is not None and marker.get("format") != FORMAT:
        marker = None
    if manifest is None and marker is None:
        if any(out.iterdir()):
            raise KilovlaError(f"{out}: the folder is not empty and holds no frame cache ({MANIFEST}); "
                               "pick an empty or new folder for --output_dir")
        return None, set()
    if manifest is None:
        manifest = marker.get("manifest") if isinstance(marker.get("manifest"), dict) else None
    known: set[str] = set()
    for source in (manifest, marker):
        if source is None:
            continue
        known |= {p["file"] for p in source.get("parts", []) if isinstance(p, dict) and isinstance(p.get("file"), str)}
        known |= {f for f in source.get("files", []) if isinstance(f, str)}
    # Only paths of the shape this build writes (<camera>/episode_NNNNNN.npy): a hand-edited list
    # must not make the clean-up reach outside the cache folder.
    known = {f for f in known if re.fullmatch(r"[^/\\]+/episode_\d{6}\.npy", f) and ".." not in f.split("/")}
    return manifest, known


def _reusable_parts(out: Path, old: dict | None, wanted: dict, stamps: dict, backend: str) -> dict:
    """Manifest entries of an earlier build that still match their source, of the same backend, and
    whose file still hashes to its recorded checksum (a part without one is decoded again)."""
    if old is None or old.get("version") != VERSION or old.get("backend") != backend:
        return {}
    old_videos = old.get("videos", {})
    fields = set(EpisodePart.__dataclass_fields__)
    keep = {}
    for p in old.get("parts", []):
        key = (p.get("camera"), p.get("episode"))
        want = wanted.get(key)
        try:
            if want is None or EpisodePart(**{k: v for k, v in p.items() if k in fields}) != want:
                continue
        except TypeError:
            continue
        src = old_videos.get(p["video"], {})
        if src.get("sha256") != stamps[p["video"]]["sha256"] or src.get("size") != stamps[p["video"]]["size"]:
            continue
        f = out / p["file"]
        if not (f.exists() and f.stat().st_size == p["bytes"]):
            continue
        if p.get("blake2b") is None or blake2b_file(f) != p["blake2b"]:
            log.warning("%s: does not match its recorded checksum; decoding it again", f)
            continue
        keep[key] = want.to_json() | {"blake2b": p["blake2b"]}
    return keep


def _remove_orphans(out: Path, known: set[str], used: set[str], cameras: list[str]) -> None:
    """Remove what an earlier build left and this one no longer uses: files it listed, its own
    temporary files, and camera folders left empty. Nothing else in `out` is touched."""
    for rel in known - used:
        (out / rel).unlink(missing_ok=True)
    folders = {rel.split("/")[0] for rel in known} | set(cameras)
    for name in folders:
        d = out / name
        if not d.is_dir():
            continue
        for path in d.iterdir():
            if _TMP_PART.match(path.name):
                path.unlink(missing_ok=True)
        if not any(d.iterdir()):
            d.rmdir()
    for path in out.iterdir():
        if re.fullmatch(r"\.(manifest\.json|" + re.escape(BUILDING[1:]) + r")\.[0-9a-f]{8}\.json-tmp", path.name):
            path.unlink(missing_ok=True)


# -- reading ---------------------------------------------------------------------------------------
class FrameCache:
    """A validated cache, read by dataset row. Open parts are memory maps held in a small LRU. Row ->
    episode is a search over the episodes' first rows (`row_from`, ascending): nothing per frame is held.

    >>> cache = open_frame_cache("~/.cache/kilovla/frames/ds-1a2b3c", meta, columns)  # doctest: +SKIP
    >>> cache.read("observation.images.front", np.array([10, 11, 500])).shape  # doctest: +SKIP
    (3, 224, 224, 3)
    """

    def __init__(self, path: Path, manifest: dict, row_from: np.ndarray, max_open: int = 256):
        self.path = path
        self.manifest = manifest
        self.cameras = list(manifest["cameras"])
        self.shapes = {c: tuple(v["shape"]) for c, v in manifest["cameras"].items()}
        self._parts = {(p["camera"], p["episode"]): p for p in manifest["parts"]}
        self._row_from = np.asarray(row_from, dtype=np.int64)
        self.max_open = max_open
        self._open: OrderedDict[tuple[str, int], np.ndarray] = OrderedDict()
        self.frames_read = 0

    def __getstate__(self):
        state = self.__dict__.copy()
        state["_open"] = OrderedDict()  # memory maps are per process; reopened where they are read
        return state

    @property
    def bytes(self) -> int:
        return sum(p["bytes"] for p in self.manifest["parts"])

    def _part(self, camera: str, episode: int) -> np.ndarray:
        key = (camera, episode)
        array = self._open.get(key)
        if array is not None:
            self._open.move_to_end(key)
            return array
        part = self._parts[key]
        path = self.path / part["file"]
        try:
            array = np.load(path, mmap_mode="r")
        except (OSError, ValueError) as e:
            raise DatasetError(path, f"cannot read frame cache part: {e}") from None
        self._open[key] = array
        while len(self._open) > self.max_open:
            self._open.popitem(last=False)
        return array

    def read(self, camera: str, rows: np.ndarray) -> np.ndarray:
        """Frames of dataset `rows` (any shape, any order) as (*rows.shape, H, W, 3) uint8."""
        rows = np.asarray(rows, dtype=np.int64)
        flat = rows.ravel()
        out = np.empty((len(flat), *self.shapes[camera]), dtype=np.uint8)
        episodes = np.searchsorted(self._row_from, flat, side="right") - 1
        order = np.argsort(episodes, kind="stable")
        bounds = np.flatnonzero(np.diff(episodes[order])) + 1
        for idx in np.split(order, bounds):
            if not len(idx):
                continue
            e = int(episodes[idx[0]])
            part = self._part(camera, e)
            local = flat[idx] - self._parts[(camera, e)]["row_from"]
            sort = np.argsort(local, kind="stable")  # ascending offsets walk the map forward
            out[idx[sort]] = part[local[sort]]
        self.frames_read += len(flat)
        return out.reshape(*rows.shape, *self.shapes[camera])


def open_frame_cache(path: str | Path, meta, columns: dict, cameras: list[str],
                     video_backend: str = "auto") -> FrameCache:
    """Check a cache against the dataset (`meta`, its loaded `columns`) and open it, or refuse.

    Refused, with a DatasetError naming the file: no manifest (never finished, or being rebuilt), a
    manifest of another format or dataset shape, frames decoded with another backend than an
    explicit `video_backend` ("auto" takes the cache's), a camera of `cameras` missing or of another
    resolution, an episode whose rows or timestamps moved, a source video that changed (size, or
    content when its mtime moved), a part missing, of the wrong size, or whose .npy header is not
    the manifest's array. Nothing is read before all of that passed. Same-size corruption of frame
    bytes is not detected here (see the module docstring); a rebuild detects it.
    When a touched video (new mtime) still has its recorded hash, the manifest is rewritten with the
    new mtime so the next open does not hash it again.
    """
    path = Path(path).expanduser()
    mpath = path / MANIFEST
    if not mpath.exists():
        what = "is not a frame cache" if not path.exists() or not any(path.iterdir()) else "is incomplete"
        raise DatasetError(mpath, f"missing: {path} {what} (an interrupted `kilovla data cache`?); "
                           f"rebuild it with `kilovla data cache {meta.root} --output_dir={path}`")
    try:
        manifest = json.loads(mpath.read_text())
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as e:
        raise DatasetError(mpath, f"not a valid frame cache manifest: {e}") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise DatasetError(mpath, "not a kilovla frame cache manifest")
    if manifest.get("version") != VERSION:
        raise DatasetError(mpath, f"frame cache version {manifest.get('version')!r}, this kilovla reads {VERSION}; "
                           "rebuild it with `kilovla data cache`")
    rebuild = f"rebuild it with `kilovla data cache {meta.root} --output_dir={path}`"
    if manifest.get("fps") != meta.fps or manifest.get("total_frames") != meta.total_frames:
        raise DatasetError(mpath, f"built for a dataset of {manifest.get('total_frames')} frames at "
                           f"{manifest.get('fps')} fps; {meta.root} has {meta.total_frames} at {meta.fps}: {rebuild}")
    for camera in cameras:
        held = manifest.get("cameras", {}).get(camera)
        if held is None:
            raise DatasetError(mpath, f"holds no frames of {camera} (it has {sorted(manifest.get('cameras', {}))}); "
                               f"{rebuild}")
        want = list(meta.features[camera].shape)
        if list(held.get("shape", [])) != want:
            h = held.get("shape", ["?", "?"])
            raise DatasetError(mpath, f"holds {h[0]}x{h[1]} frames of {camera}, the dataset's info.json says "
                               f"{want[0]}x{want[1]}: {rebuild}")
    if video_backend != "auto" and manifest.get("backend") != video_backend:
        raise DatasetError(mpath, f"frames were decoded with {manifest.get('backend')}, this dataset asks for "
                           f"video_backend={video_backend!r}; use 'auto' or rebuild it with "
                           f"`kilovla data cache {meta.root} --output_dir={path} --backend={video_backend}`")
    timestamps = columns["timestamp"]
    parts = {(p["camera"], p["episode"]): p for p in manifest.get("parts", [])}
    videos = manifest.get("videos", {})
    checked_videos: set[str] = set()
    touched: dict[str, int] = {}
    for camera in cameras:
        for e in range(len(meta.episodes)):
            part = parts.get((camera, e))
            if part is None:
                raise DatasetError(mpath, f"has no part for episode {e} of {camera}: {rebuild}")
            r0, r1 = int(meta.episodes.row_from[e]), int(meta.episodes.row_to[e])
            if (part["row_from"], part["length"]) != (r0, r1 - r0) or part["video"] != meta.episodes.video_file[camera][e] \
                    or part["from_timestamp"] != float(meta.episodes.video_from_s[camera][e]) \
                    or part["timestamps"] != _timestamps_digest(timestamps[r0:r1]):
                raise DatasetError(path / part["file"], f"was decoded for other rows or timestamps of episode {e} "
                                   f"(the dataset changed since the cache was built): {rebuild}")
            if part["video"] not in checked_videos:
                mtime = _check_video(meta.files.path(part["video"]), videos.get(part["video"]), rebuild)
                if mtime is not None:
                    touched[part["video"]] = mtime
                checked_videos.add(part["video"])
            f = path / part["file"]
            try:
                size = f.stat().st_size
            except FileNotFoundError:
                raise DatasetError(f, f"missing from the frame cache: {rebuild}") from None
            if size != part["bytes"]:
                raise DatasetError(f, f"truncated or overwritten: {size} bytes, the manifest says {part['bytes']}; "
                                   f"{rebuild}")
            _check_part_header(f, (part["length"], *meta.features[camera].shape), rebuild)
    if touched:
        _refresh_video_stamps(mpath, manifest, touched)
    return FrameCache(path, manifest, meta.episodes.row_from)


def _check_part_header(f: Path, shape: tuple[int, ...], rebuild: str) -> None:
    try:
        with open(f, "rb") as fh:
            version = np.lib.format.read_magic(fh)
            read = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
            got_shape, fortran, dtype = read(fh)
    except (OSError, ValueError) as e:
        raise DatasetError(f, f"not a readable .npy frame cache part ({e}): {rebuild}") from None
    if tuple(got_shape) != tuple(shape) or fortran or dtype != np.uint8:
        raise DatasetError(f, f"header says a {dtype} array of shape {tuple(got_shape)}, the manifest a uint8 "
                           f"array of shape {tuple(shape)} (corrupt part): {rebuild}")


def _refresh_video_stamps(mpath: Path, manifest: dict, touched: dict[str, int]) -> None:
    """Write the new mtimes of touched-but-unchanged videos into the manifest (atomically), so the
    next open does not hash them again; on a read-only cache, say once that every open will."""
    for rel, mtime in touched.items():
        manifest["videos"][rel]["mtime_ns"] = mtime
    try:
        _write_json(mpath, manifest)
    except OSError as e:
        log.warning("%s: %d video(s) were touched but are unchanged; cannot record that (%s), so every open "
                    "hashes them again", mpath, len(touched), e)


def _check_video(video_path: str, stamp: dict | None, rebuild: str) -> int | None:
    """Refuse a changed source video; the new mtime of a touched but unchanged one, else None."""
    if stamp is None:
        raise DatasetError(video_path, f"is not in the frame cache's manifest: {rebuild}")
    try:
        st = os.stat(video_path)
    except FileNotFoundError:
        raise DatasetError(video_path, "video file is missing") from None
    if st.st_size != stamp["size"]:
        raise DatasetError(video_path, f"changed since the frame cache was built ({st.st_size} bytes, "
                           f"{stamp['size']} then): {rebuild}")
    if st.st_mtime_ns == stamp["mtime_ns"]:
        return None
    if sha256_file(video_path) != stamp["sha256"]:
        raise DatasetError(video_path, f"changed since the frame cache was built (same size, other content): {rebuild}")
    return st.st_mtime_ns


def resolve_frame_cache(setting, meta, columns: dict, cameras: list[str],
                        video_backend: str = "auto") -> FrameCache | None:
    """`LeRobotDataset`'s frame_cache argument: None (off), "auto" or a folder -> an open cache or None.

    With "auto" a default-location cache that cannot serve the request (`open_frame_cache`'s reasons,
    another decoder than `video_backend` among them) is passed over with one warning; a named folder
    is refused with the DatasetError."""
    if setting is None or setting is False or setting == "off" or not cameras:
        return None
    if setting == "auto":
        if meta.files.is_url:
            return None
        path = default_cache_dir(meta.root)
        if not (path / MANIFEST).exists() and not path.exists():
            return None
        try:
            return open_frame_cache(path, meta, columns, cameras, video_backend)
        except DatasetError as e:
            # "auto" is a speed-up the user did not ask for by name: a cache that cannot serve this
            # request must not make the dataset unloadable.
            log.warning("not using the frame cache (decoding the videos instead): %s", e)
            return None
    return open_frame_cache(setting, meta, columns, cameras, video_backend)
