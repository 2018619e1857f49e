"""`kilovla bench data` / `kilovla data bench PATH`: the data layer against what LeRobot users run.

Every throughput row runs baseline and ours in the same process, interleaved, several repeats,
median; DataLoader workers start by forkserver on both sides (a decoder opened in a parent must
never reach a forked child). Rows (names are an interface, see DESIGN.md):

- loader_samples_per_s: steady samples/s with the machine's cores as DataLoader workers.
  Baseline: LeRobot 0.4's default video path (`LeRobotVideoPath`: torchcodec with its per-process
  decoder cache where torchcodec loads, else PyAV opened per call; float32 frames) through a torch
  DataLoader, batch 32, shuffle; ours: the plan's packed rows through `TorchLoader` with the same
  workers. limit: the decode limit, i.e. the same files decoded once in order (RGB, one thread)
  in frames/s per core x cores / camera frames per sample.
- getitem_samples_per_s: `ds[i]` in random order in one process. Baseline: the naive per-sample
  reader (open the mp4, seek, decode forward converting every frame); ours: `LeRobotDataset`
  (same values as LeRobot's items).
- cache_samples_per_s: the plan's rows read from the decoded-frame cache (`kilovla data cache`)
  instead of the videos, in process (a read is a memory copy; DataLoader workers would only add
  inter-process copies, their rate is in the JSON as cache_workers_samples_per_s); baseline as for
  loader_samples_per_s. Frames are checked bit-identical to the decoded ones first.
- cache_bytes: the cache on disk against the videos it was decoded from.
- first_batch_s: from nothing to the first row of the first step (dataset index, plan, decoders).
- decode_frames_per_s, peak_rss_mb, rss_growth_mb: decoded frames per second of loading; resident
  memory over a long in-process run (20 000 samples); growth is the median of the last quarter
  minus that of the second.
- padding_fraction: on a LIBERO-like pi0.5 token layout (2-3 cameras x 256 tokens, language 8-48
  tokens, horizon 10-50) over a lake of several datasets; baseline pads every sample to the fixed
  shape (3 camera slots, 200 language tokens, horizon 50); ours packs the global batch into rows.
- rank_imbalance_tokens / rank_imbalance_attention: max/mean over simulated ranks (default 1024) of
  tokens and of sum(len^2); baseline hands each rank an equal count of samples in plan order.
"""

from __future__ import annotations

import os
import statistics
import time
from pathlib import Path

import numpy as np
import psutil

from kilovla.bench.common import DEFAULT_OUT, Row, write_suite
from kilovla.data import windows
from kilovla.data.frame_cache import build_frame_cache, open_frame_cache
from kilovla.data.lake import DataLake, LakeSource, TokenLayout
from kilovla.data.lerobot import LeRobotDataset
from kilovla.data.meta import DatasetMeta
from kilovla.data.loader import InProcessLoader, TorchLoader
from kilovla.data.packing import imbalance
from kilovla.data.plan import GlobalBatchPlan, PlanConfig, padding_fraction
from kilovla.data.synthetic import make_synthetic_dataset
from kilovla.data.video import resolve_backend
from kilovla.errors import DatasetError

CACHE_VERSION = "v2"
LIBERO_LAYOUT = TokenLayout(tokens_per_camera=256, max_language_tokens=200, state_tokens=8, action_horizon=50)
LIBERO_TASKS = (
    "open the drawer",
    "turn on the stove",
    "put the bowl on the plate",
    "pick up the black bowl and place it on the plate",
    "pick up the alphabet soup and the tomato sauce and place them both in the basket now",
    "put the cream cheese in the bowl and close the top drawer",
)
TOLERANCE_S = 1e-4
START_METHOD = "forkserver"


def loader_request(meta_fps: float, cameras: list[str], has_action: bool) -> dict[str, list[float]]:
    """16-step action window, the first camera at t-1 and t, the other cameras at t."""
    request = {}
    if has_action:
        request["action"] = [i / meta_fps for i in range(16)]
    if cameras:
        request[cameras[0]] = [-1 / meta_fps, 0.0]
    return request


# -- the baselines ----------------------------------------------------------------------------------
def _sample_windows(ds: LeRobotDataset, position: int) -> tuple[dict, dict, np.ndarray]:
    """LeRobot's item minus the frames: table values, their padding masks, and per camera the video
    times of its window (from_timestamp + the timestamps of the clamped rows)."""
    row = int(ds.positions_to_rows([position])[0])
    eps = ds.meta.episodes
    ep = int(ds.episode_of_rows([row])[0])
    bounds = eps.row_from[[ep]], eps.row_to[[ep]]
    item, times = {}, {}
    deltas = ds.delta_indices or {}
    for key, col in ds.columns.items():
        if key in deltas:
            rows, pad = windows.window_rows(np.array([row]), *bounds, deltas[key])
            item[key], item[f"{key}_is_pad"] = col[rows[0]], pad[0]
        else:
            item[key] = col[row]
    for key in ds.camera_keys:
        rows, pad = windows.window_rows(np.array([row]), *bounds, deltas.get(key, np.array([0])))
        times[key] = eps.video_from_s[key][ep] + ds.columns["timestamp"][rows[0]].astype(np.float64)
        if key in deltas:
            item[f"{key}_is_pad"] = pad[0]
    return item, times, ep


def decode_per_call_pyav(path: str, wanted: np.ndarray) -> tuple[np.ndarray, int]:
    """Open the video, seek to the keyframe before the first wanted time, decode forward to the last
    converting every frame, keep the nearest: LeRobot's PyAV path, and the naive reader's.
    Returns the frames (n, H, W, 3) uint8 and how many frames were decoded."""
    import av

    with av.open(path) as container:
        stream = container.streams.video[0]
        tb = float(stream.time_base)
        container.seek(int(wanted[0] / tb), stream=stream, backward=True)
        decoded, times = [], []
        for frame in container.decode(stream):
            decoded.append(frame.to_ndarray(format="rgb24"))
            times.append(frame.pts * tb)
            if times[-1] >= wanted[-1] - TOLERANCE_S:
                break
    times = np.array(times)
    nearest = [int(np.argmin(np.abs(times - t))) for t in wanted]
    if any(abs(times[i] - t) >= TOLERANCE_S for i, t in zip(nearest, wanted)):
        raise DatasetError(path, f"no frame within {TOLERANCE_S}s of {wanted.tolist()}")
    return np.stack([decoded[i] for i in nearest]), len(decoded)


class PerSampleReader:
    """The naive reader: each sample opens its videos, seeks and decodes (`decode_per_call_pyav`)."""

    def __init__(self, dataset: LeRobotDataset):
        self.ds = dataset
        self.frames_decoded = 0

    def item(self, position: int) -> dict:
        out, times, ep = _sample_windows(self.ds, position)
        for key, wanted in times.items():
            path = self.ds.meta.files.path(self.ds.meta.episodes.video_file[key][ep])
            out[key], n = decode_per_call_pyav(path, wanted)
            self.frames_decoded += n
        return out


_LEROBOT_DECODERS: dict[str, tuple] = {}  # LeRobot 0.4's module-global decoder cache (one per process)


def _lerobot_torchcodec_frames(path: str, timestamps: list[float]):
    """LeRobot 0.4.4's `decode_video_frames_torchcodec`: cached approximate-seek decoder over an
    fsspec handle, `get_frames_at` of round(ts * fps), nearest by cdist, float32 / 255."""
    import fsspec
    import torch
    from torchcodec.decoders import VideoDecoder

    if path not in _LEROBOT_DECODERS:
        handle = fsspec.open(path).__enter__()
        _LEROBOT_DECODERS[path] = (VideoDecoder(handle, seek_mode="approximate"), handle)
    decoder = _LEROBOT_DECODERS[path][0]
    fps = decoder.metadata.average_fps
    batch = decoder.get_frames_at(indices=[round(ts * fps) for ts in timestamps])
    loaded = list(batch.data)
    dist = torch.cdist(torch.tensor(timestamps)[:, None], batch.pts_seconds[:, None].float(), p=1)
    min_, argmin = dist.min(1)
    if not bool((min_ < TOLERANCE_S).all()):
        raise DatasetError(path, f"no frame within {TOLERANCE_S}s of {timestamps}")
    return (torch.stack([loaded[i] for i in argmin]) / 255.0).type(torch.float32)


class _ArrowRows:
    """HF datasets' access to rows as LeRobot 0.4.4 sets it up (`set_transform(hf_transform_to_torch)`):
    Arrow rows converted to Python values, then each value to a tensor. (The `datasets` package itself
    is not a kilovla dependency: its pins would replace the fsspec the rest of the stack uses.)"""

    def __init__(self, table):
        self.table = table

    def row(self, i: int) -> dict:
        return {k: _to_torch(v[0]) for k, v in self.table.slice(i, 1).to_pydict().items()}

    def rows(self, indices: list[int]) -> dict:
        return {k: [_to_torch(x) for x in v] for k, v in self.table.take(indices).to_pydict().items()}

    def column(self, key: str, indices: list[int]) -> list:
        return [_to_torch(x) for x in self.table.column(key).take(indices).to_pylist()]


def _to_torch(value):
    import torch

    return value if isinstance(value, str) else torch.tensor(value)


class LeRobotVideoPath:
    """A map-style dataset that loads an item step by step as LeRobot 0.4.4's
    `LeRobotDataset.__getitem__` does: the row, the episode's metadata row, the window rows per key
    (column first), the window timestamps, then the cameras one after the other through LeRobot's
    default decoder (torchcodec with the process-wide decoder cache, else PyAV per call), frames
    float32 (K, C, H, W) in [0, 1], K dropped when 1.
    """

    def __init__(self, dataset: LeRobotDataset, backend: str):
        import pyarrow as pa

        meta = dataset.meta
        self.ds = dataset
        self.backend = backend
        self.rows = _ArrowRows(pa.concat_tables([meta.files.read_parquet(f) for f in dict.fromkeys(
            meta.episodes.data_file)]))
        self.episodes = _ArrowRows(pa.concat_tables([meta.files.read_parquet(f) for f in meta.files.glob(
            "meta/episodes/chunk-*/file-*.parquet")]))
        self.deltas = {k: v.tolist() for k, v in (dataset.delta_indices or {}).items()}

    def __len__(self) -> int:
        return len(self.ds)

    def _episode(self, ep_idx: int) -> dict:
        return self.episodes.table.slice(ep_idx, 1).to_pylist()[0]

    def __getitem__(self, idx: int) -> dict:
        import torch

        idx = int(self.ds.positions_to_rows([idx])[0])
        item = self.rows.row(idx)
        ep_idx, abs_idx = item["episode_index"].item(), item["index"].item()
        query = None
        if self.deltas:
            ep = self._episode(ep_idx)
            start, end = ep["dataset_from_index"], ep["dataset_to_index"]
            query = {k: [max(start, min(end - 1, abs_idx + d)) for d in ds] for k, ds in self.deltas.items()}
            for key, ds in self.deltas.items():
                item[f"{key}_is_pad"] = torch.BoolTensor([(abs_idx + d < start) | (abs_idx + d >= end) for d in ds])
            for key, q in query.items():
                if key not in self.ds.camera_keys:
                    item[key] = torch.stack(self.rows.column(key, q))
        if self.ds.camera_keys:
            current = item["timestamp"].item()
            times = {key: torch.stack(self.rows.rows(query[key])["timestamp"]).tolist()
                     if query is not None and key in query else [current] for key in self.ds.camera_keys}
            ep = self._episode(ep_idx)
            for key, ts in times.items():
                path = self.ds.meta.files.path(self.ds.meta.episodes.video_file[key][ep_idx])
                shifted = [ep[f"videos/{key}/from_timestamp"] + t for t in ts]
                if self.backend == "torchcodec":
                    frames = _lerobot_torchcodec_frames(path, shifted)
                else:
                    frames = torch.from_numpy(decode_per_call_pyav(path, np.array(shifted))[0])
                    frames = frames.permute(0, 3, 1, 2).type(torch.float32) / 255
                item[key] = frames.squeeze(0)
        item["task"] = self.ds.meta.tasks[item["task_index"].item()]
        return item


# -- measurements -----------------------------------------------------------------------------------
def sequential_decode(paths: list[str], backend: str, max_frames: int) -> tuple[int, float]:
    """One thread decoding the first `max_frames` frames of each of `paths` in order, RGB out:
    (frames decoded, seconds)."""
    frames, seconds = 0, 0.0
    for path in paths:
        t0 = time.perf_counter()
        if backend == "torchcodec":
            from torchcodec.decoders import VideoDecoder

            decoder = VideoDecoder(path, seek_mode="approximate", dimension_order="NHWC", num_ffmpeg_threads=1)
            n = 0
            for start in range(0, min(max_frames, decoder.metadata.num_frames or max_frames), 100):
                n += len(decoder.get_frames_in_range(start, min(start + 100, max_frames,
                                                                decoder.metadata.num_frames or max_frames)).data)
        else:
            import av
            from av.video.reformatter import VideoReformatter

            n, rgb = 0, VideoReformatter()
            with av.open(path) as container:
                stream = container.streams.video[0]
                stream.codec_context.thread_count = 1
                for frame in container.decode(stream):
                    rgb.reformat(frame, format="rgb24").to_ndarray()
                    n += 1
                    if n >= max_frames:
                        break
        seconds += time.perf_counter() - t0
        frames += n
    return frames, seconds


def _timed(batches, warm: int, count: int, size=len) -> float:
    """Samples/s over `count` batches after `warm` ones (worker start-up and first decodes)."""
    it = iter(batches)
    for _ in range(warm):
        next(it)
    t0 = time.perf_counter()
    n = 0
    for _ in range(count):
        n += size(next(it))
    rate = n / (time.perf_counter() - t0)
    close = getattr(it, "close", None) or getattr(it, "_shutdown_workers", None)
    if close is not None:
        close()
    return rate


def _baseline_batches(dataset: LeRobotVideoPath, workers: int, seed: int):
    """Batches of a LeRobot user's DataLoader, epoch after epoch (small datasets end quickly)."""
    import torch

    loader = torch.utils.data.DataLoader(dataset, batch_size=32, shuffle=True, num_workers=workers,
                                         generator=torch.Generator().manual_seed(seed),
                                         persistent_workers=workers > 0,
                                         multiprocessing_context=START_METHOD if workers else None)
    while True:
        yield from loader


def _rows_rate(lake: DataLake, plan: GlobalBatchPlan, start: int, steps: int, workers: int) -> float:
    plan.step = start
    rows_per_step = len(plan.rank_rows(start, 0, 1))
    loader = TorchLoader(lake, plan, steps=steps + 1, num_workers=workers, multiprocessing_context=START_METHOD)
    return _timed(loader, rows_per_step, sum(len(plan.rank_rows(s, 0, 1)) for s in range(start + 1, start + steps + 1)),
                  size=lambda row: len(row["sample_index"]))


def build_video_dataset(cache: Path, quick: bool) -> Path:
    """The loader benchmark's dataset, shaped like a LeRobot-written one: 16 episodes, 2 cameras
    224x224 AV1 with a keyframe every 2 frames, 30 fps."""
    name = f"video-224-{'quick' if quick else 'full'}-{CACHE_VERSION}"
    root = cache / name
    if (root / "meta" / "info.json").exists():
        return root
    episodes, frames = (4, (40, 60)) if quick else (16, (240, 360))
    return make_synthetic_dataset(root, episodes=episodes, frames=frames, fps=30, resolution=(224, 224),
                                  state_dim=14, action_dim=14, overwrite=True)


def build_libero_like_lake(cache: Path) -> DataLake:
    """Six small datasets with 2 or 3 cameras, instructions of 8-48 byte tokens and horizons 10-50,
    weighted so that an epoch holds ~18k samples (enough for 16 per rank at 1024 ranks)."""
    specs = [(2, 10, 4.0), (3, 50, 4.0), (2, 25, 3.0), (3, 10, 4.0), (2, 50, 4.0), (3, 25, 4.0)]
    sources = []
    for i, (cams, horizon, weight) in enumerate(specs):
        root = cache / f"libero-like-{i}-v1"
        if not (root / "meta" / "info.json").exists():
            make_synthetic_dataset(root, episodes=8, frames=(90, 110), fps=10, resolution=(32, 32),
                                   cameras=("agentview", "wrist", "third")[:cams], state_dim=8, action_dim=7,
                                   tasks=LIBERO_TASKS[i % 3:] + LIBERO_TASKS[:i % 3], codec="libx264",
                                   seed=i, overwrite=True)
        sources.append(LakeSource(root=str(root), weight=weight, action_horizon=horizon, frame_cache=None))
    return DataLake(sources, LIBERO_LAYOUT)


def _rss_mb() -> float:
    return psutil.Process().memory_info().rss / 2**20


def _check_identical(video: DataLake, cached: DataLake, ids: np.ndarray) -> None:
    a, b = video.get_batch(ids), cached.get_batch(ids)
    for key in video.datasets[0].camera_keys:
        if not np.array_equal(a[key], b[key]):
            raise AssertionError(f"frames of {key} from the cache differ from the decoded ones")


class _RequestRecorder:
    """Stands in for a dataset's decoder pool: records each (video, timestamps) request, returns black
    frames of the right shape (nothing decoded)."""

    def __init__(self, height: int, width: int):
        self.shape, self.requests = (height, width, 3), []

    def read_many(self, requests, tolerance_s=None):
        self.requests += requests
        return [np.zeros((len(t), *self.shape), np.uint8) for _, t in requests]


def _keyframe_of(path: str) -> np.ndarray:
    """Per frame of a video (presentation order), the index of the keyframe at or before it (demuxed only)."""
    import av

    with av.open(path) as container:
        stream = container.streams.video[0]
        packets = sorted((p.pts, p.is_keyframe) for p in container.demux(stream) if p.pts is not None)
    key = np.array([k for _, k in packets], bool)
    return np.maximum.accumulate(np.where(key, np.arange(len(key)), 0))


def decodes_per_sample(lake: DataLake, rows: list[np.ndarray]) -> float:
    """Frames a decoder must decode (a delta frame needs its GOP from the keyframe; frames of one request
    further on in the same GOP continue without a seek) per sample, for the plan's `rows` as the loader
    requests them: what bounds random-access loading, whichever loader runs it."""
    ds = lake.datasets[0]
    feat = ds.meta.features[ds.meta.video_keys[0]]
    recorder = _RequestRecorder(feat.shape[0], feat.shape[1])
    pool, ds._pool = ds._pool, recorder
    try:
        for row in rows:
            lake.get_batch(row)
    finally:
        ds._pool = pool
    keys: dict[str, np.ndarray] = {}
    decodes = 0
    for path, timestamps in recorder.requests:
        key = keys.setdefault(path, _keyframe_of(path))
        at = None
        for f in np.unique(np.round(np.asarray(timestamps) * ds.meta.fps).astype(np.int64)):
            decodes += f - at if at is not None and key[f] == key[at] else f - key[f] + 1
            at = f
    return decodes / sum(len(r) for r in rows)


def _soak_rows(lake: DataLake, plan: GlobalBatchPlan, soak: int, console) -> tuple[list[Row], int]:
    """Memory over a long run, before the frame cache maps its files: RSS after every row of `soak`
    samples. Returns the peak_rss_mb and rss_growth_mb rows and the samples run."""
    from rich.progress import Progress

    rss, done = [], 0
    plan.step = 10_000  # steps of their own, far from the measured ones
    with Progress(console=console, transient=True) as progress:
        task = progress.add_task(f"soak: {soak} samples", total=soak)
        for row in InProcessLoader(lake, plan):
            done += len(row["sample_index"])
            rss.append(_rss_mb())
            progress.update(task, completed=min(done, soak))
            if done >= soak:
                break
    mem = np.array(rss)
    q = len(mem) // 4
    # Single RSS readings swing by tens of MiB (allocator); compare medians of whole quarters.
    growth = float(np.median(mem[3 * q:]) - np.median(mem[q:2 * q]))
    return [
        Row.compare("peak_rss_mb", "MiB", None, float(mem.max()), higher_is_better=False,
                    note=f"whole process over {done} samples"),
        Row.compare("rss_growth_mb", "MiB", None, growth, higher_is_better=False,
                    note="median RSS of the run's last quarter minus its second quarter"),
    ], done


def _cache_bytes_row(cached: DataLake, codec: str) -> Row:
    """The frame cache's size on disk against the videos it was decoded from."""
    manifest = cached.datasets[0].frame_cache.manifest
    cache_bytes = sum(p["bytes"] for p in manifest["parts"])
    video_bytes = sum(v["size"] for v in manifest["videos"].values())
    frames = sum(p["length"] for p in manifest["parts"])
    return Row.compare("cache_bytes", "bytes", float(video_bytes), float(cache_bytes), higher_is_better=False,
                       note=f"raw uint8 frames ({frames} frames, {cache_bytes / frames / 1e3:.1f} kB "
                            f"each, {manifest['backend']}) vs the {codec} videos")


def _inprocess_rate(lake: DataLake, plan: GlobalBatchPlan, start: int, steps: int) -> float:
    """Samples per second of `steps` global steps from `start`, rows loaded in this process."""
    plan.step = start
    return _timed(InProcessLoader(lake, plan, steps=steps), 0, sum(
        len(plan.rank_rows(s, 0, 1)) for s in range(start, start + steps)), size=lambda r: len(r["sample_index"]))


def _throughput_runs(*, lake: DataLake, plan: GlobalBatchPlan, cached: DataLake, cached_plan: GlobalBatchPlan,
                     lerobot: LeRobotVideoPath, naive: PerSampleReader, base_ds: LeRobotDataset, videos: list[str],
                     positions: np.ndarray, backend: str, workers: int, quick: bool, repeats: int, steps: int,
                     batch: int) -> tuple[dict[str, list[float]], float, float]:
    """Every loader's samples per second (and the in-order decode limit, frames per second), each run once
    per repeat in turn; repeat r runs global steps of its own. Returns those runs by loader and the decoded
    frames per second of loading of the naive reader and of our in-process rows."""
    base_batches = max(2, steps * batch // 32)
    chunks = np.array_split(positions, repeats)
    pool = lake.datasets[0].decoder_pool
    m: dict[str, list[float]] = {k: [] for k in ("base", "ours", "cache", "cache_workers", "limit", "naive",
                                                 "getitem", "inproc")}
    base_frames = ours_frames = 0
    base_time = ours_time = 0.0
    for rep in range(repeats):
        frames, seconds = sequential_decode(videos, backend, 300 if quick else 900)
        m["limit"].append(frames / seconds)
        m["base"].append(_timed(_baseline_batches(lerobot, workers, rep), 2, base_batches,
                                size=lambda b: len(b["index"])))
        start = 1 + rep * (steps + 1)
        m["ours"].append(_rows_rate(lake, plan, start, steps, workers))
        m["cache_workers"].append(_rows_rate(cached, cached_plan, start, steps, workers))
        m["cache"].append(_inprocess_rate(cached, cached_plan, start, steps))
        before, t0 = pool.frames_decoded, time.perf_counter()
        m["inproc"].append(_inprocess_rate(lake, plan, start, steps))
        ours_time += time.perf_counter() - t0
        ours_frames += pool.frames_decoded - before
        chunk = chunks[rep]
        before, t0 = naive.frames_decoded, time.perf_counter()
        for g in chunk:
            naive.item(int(g))
        base_time += time.perf_counter() - t0
        base_frames += naive.frames_decoded - before
        m["naive"].append(len(chunk) / (time.perf_counter() - t0))
        t0 = time.perf_counter()
        for g in chunk:
            base_ds[int(g)]
        m["getitem"].append(len(chunk) / (time.perf_counter() - t0))
    return m, base_frames / base_time, ours_frames / ours_time


def _dataset_what(probe: DatasetMeta) -> tuple[str, str]:
    """(what one sample holds, the video codec), for the rows' notes."""
    cams = ", ".join(c.split(".")[-1] for c in probe.video_keys)
    feat = probe.features[probe.video_keys[0]] if probe.video_keys else None
    shape = f"{feat.shape[0]}x{feat.shape[1]}" if feat else "no video"
    codec = (feat.info or {}).get("video.codec", "?") if feat else "-"
    return f"{len(probe.video_keys)} cams ({cams}) {shape} {codec}, 16-step actions, 2 frames of cam 0", codec


def loader_rows(root: Path, *, quick: bool, cache_dir: Path, build_cache: bool = True,
                console=None) -> tuple[list[Row], dict]:
    probe = DatasetMeta(root)  # meta/ only: the loaders below load the columns themselves
    request = loader_request(probe.fps, probe.video_keys, "action" in probe.features)
    layout = TokenLayout(tokens_per_camera=256, action_horizon=16)
    batch = min(64 if quick else 256, probe.total_frames)  # a small user dataset still makes one full batch
    repeats = 2 if quick else 3
    workers = len(os.sched_getaffinity(0))
    backend = resolve_backend("auto")
    frames_per_sample = sum(len(request.get(k, [0.0])) for k in probe.video_keys)

    t0 = time.perf_counter()
    lake = DataLake([LakeSource(root=str(root), delta_timestamps=request, frame_cache=None)], layout)
    config = PlanConfig(seed=0, global_batch_size=batch, token_budget=16384)
    plan = GlobalBatchPlan.from_lake(lake, config)
    next(iter(InProcessLoader(lake, plan, steps=1, prefetch=0)))
    ours_first = time.perf_counter() - t0
    t0 = time.perf_counter()
    base_ds = LeRobotDataset(root, delta_timestamps=request, frame_cache=None)
    naive = PerSampleReader(base_ds)
    first_row = plan.rank_rows(0, 0, 1)[0]
    for g in first_row:
        naive.item(int(g))
    base_first = time.perf_counter() - t0

    soak_rows, done = _soak_rows(lake, plan, 2_000 if quick else 20_000, console)
    if build_cache:
        build_frame_cache(root, cache_dir, backend=backend, engine="local")
    cached = DataLake([LakeSource(root=str(root), delta_timestamps=request, frame_cache=str(cache_dir))], layout)
    cached_plan = GlobalBatchPlan.from_lake(cached, config)
    _check_identical(lake, cached, plan.global_batch(0))

    lerobot = LeRobotVideoPath(LeRobotDataset(root, delta_timestamps=request, frame_cache=None), backend)
    videos = sorted({probe.files.path(f) for k in probe.video_keys for f in probe.episodes.video_file[k]})
    steps = 2 if quick else 4  # global steps run on into later epochs on a small dataset
    positions = np.random.default_rng(0).integers(0, len(base_ds), 60 if quick else 200)
    m, base_decode, ours_decode = _throughput_runs(
        lake=lake, plan=plan, cached=cached, cached_plan=cached_plan, lerobot=lerobot, naive=naive, base_ds=base_ds,
        videos=videos, positions=positions, backend=backend, workers=workers, quick=quick, repeats=repeats,
        steps=steps, batch=batch)
    med = {k: statistics.median(v) for k, v in m.items()}
    limit = med["limit"] * workers / frames_per_sample
    measured_rows = [r for s in range(1, 1 + repeats * (steps + 1)) for r in plan.rank_rows(s, 0, 1)]
    decodes = decodes_per_sample(lake, measured_rows) if probe.video_keys else 0.0
    random_limit = med["limit"] * workers / decodes if decodes else None

    what, codec = _dataset_what(probe)
    base_what = f"LeRobot 0.4 {backend} path, DataLoader batch 32 shuffle"
    rows = [
        Row.compare("loader_samples_per_s", "samples/s", med["base"], med["ours"], higher_is_better=True,
                    limit=round(limit, 1),
                    note=f"{workers} workers each; {base_what} vs plan rows ({backend}); {what}; limit: "
                         f"{med['limit']:.0f} frames/s/core in order x {workers} cores / {frames_per_sample} "
                         f"frames per sample; random access decodes {decodes:.2f} frames per sample (keyframes, "
                         f"GOP starts): bound {random_limit or 0:.0f} samples/s, ours at "
                         f"{med['ours'] / (random_limit or float('inf')):.0%} of it; median of {repeats}"),
        Row.compare("getitem_samples_per_s", "samples/s", med["naive"], med["getitem"], higher_is_better=True,
                    note=f"items in random order, 1 process; naive per-sample open+seek+decode (PyAV) vs "
                         f"LeRobotDataset.__getitem__ ({backend}); {len(positions)} samples"),
        Row.compare("cache_samples_per_s", "samples/s", med["base"], med["cache"], higher_is_better=True,
                    note=f"{base_what}, {workers} workers vs plan rows from the frame cache in 1 process "
                         "(bit-identical frames, checked)"),
        _cache_bytes_row(cached, codec),
        Row.compare("first_batch_s", "s", base_first, ours_first, higher_is_better=False,
                    note=f"index + plan + first row of {len(first_row)} samples"),
        Row.compare("decode_frames_per_s", "frames/s", base_decode, ours_decode,
                    higher_is_better=True, note="camera frames out of the decoder per second of loading, 1 process"),
        *soak_rows,
    ]
    extra = {"dataset": str(root), "delta_timestamps": request, "global_batch_size": batch, "soak_samples": done,
             "decode_backend": backend, "workers": workers, "frame_cache": str(cache_dir),
             "inprocess_samples_per_s": round(med["inproc"], 1),
             "decodes_per_sample": round(decodes, 3),
             "random_access_limit_samples_per_s": None if random_limit is None else round(random_limit, 1),
             "cache_workers_samples_per_s": round(med["cache_workers"], 1),
             "samples_per_s_runs": {k: [round(x, 1) for x in v] for k, v in m.items()}}
    return rows, extra


def packing_rows(lake: DataLake, *, world_size: int, quick: bool) -> tuple[list[Row], dict]:
    layout = lake.layout
    budget = 16384
    batch = min(512 if quick else 2048, len(lake))
    plan = GlobalBatchPlan.from_lake(lake, PlanConfig(seed=0, global_batch_size=batch, token_budget=budget))
    steps = 4
    real = fixed = 0
    row_lengths = []
    max_h = max([s.action_horizon or layout.action_horizon for s in lake.sources])
    fixed_len = int(layout.sample_tokens(3, layout.max_language_tokens, max_h))
    for step in range(steps):
        ids = plan.global_batch(step)
        real += int(lake.lengths[ids].sum())
        fixed += fixed_len * len(ids)
        row_lengths += [int(lake.lengths[r].sum()) for r in plan.rank_rows(step, 0, 1)]
    base_pad = 1.0 - real / fixed
    ours_pad = padding_fraction(row_lengths, budget)

    per_rank = 16
    rows = [
        Row.compare("padding_fraction", "fraction", base_pad, ours_pad, higher_is_better=False,
                    note=f"pi0.5 LIBERO-like layout; fixed {fixed_len} tokens/sample vs rows of {budget}; "
                         f"{steps} steps x {batch} samples"),
    ]
    extra = {"token_budget": budget, "fixed_tokens_per_sample": fixed_len}
    need = world_size * per_rank
    if len(lake.lengths) and plan.samples_per_epoch() >= need:
        big = GlobalBatchPlan.from_lake(lake, PlanConfig(seed=0, global_batch_size=need, token_budget=budget))
        ids = big.global_batch(0)
        lengths = lake.lengths[ids].astype(np.float64)
        naive = lengths.reshape(world_size, per_rank)
        ranks = big.all_rank_rows(0, world_size)
        ours_tok = [sum(lake.lengths[r].sum() for r in rr) for rr in ranks]
        ours_att = [sum((lake.lengths[r].astype(np.float64) ** 2).sum() for r in rr) for rr in ranks]
        note = f"{world_size} simulated ranks, {per_rank} samples/rank; equal sample counts vs plan"
        rows += [
            Row.compare("rank_imbalance_tokens", "max/mean", imbalance(naive.sum(1)), imbalance(ours_tok),
                        higher_is_better=False, limit=1.0, note=note),
            Row.compare("rank_imbalance_attention", "max/mean", imbalance((naive**2).sum(1)), imbalance(ours_att),
                        higher_is_better=False, limit=1.0, note=note),
        ]
        extra["rows_per_rank"] = len(ranks[0])
    else:
        extra["rank_imbalance_skipped"] = f"fewer than {need} samples per epoch for {world_size} ranks"
    return rows, extra


def run(*, quick: bool = False, out_dir: str | Path = DEFAULT_OUT, dataset: str | Path | None = None,
        world_size: int = 1024, frame_cache: str | Path | None = None, console=None) -> Path:
    """Run the suite; with `dataset`, on the user's dataset instead of the generated ones.

    frame_cache: an existing frame cache of the dataset for the cache rows (refused if stale);
    default: one built (or refreshed) at `<out_dir>/cache/frames-<dataset name>`.
    """
    cache = Path(out_dir) / "cache"
    if frame_cache is not None and dataset is not None:  # refused before anything is measured or written
        meta = DatasetMeta(dataset)
        open_frame_cache(frame_cache, meta, meta.load_columns(), meta.video_keys)
    if dataset is None or frame_cache is None:
        cache.mkdir(parents=True, exist_ok=True)
    root = Path(dataset) if dataset is not None else build_video_dataset(cache, quick)
    cache_dir = Path(frame_cache) if frame_cache is not None else cache / f"frames-{root.name}"
    rows, extra = loader_rows(root, quick=quick, cache_dir=cache_dir, build_cache=frame_cache is None,
                              console=console)
    if dataset is None:
        lake = build_libero_like_lake(cache)
    else:
        lake = DataLake([LakeSource(root=str(dataset), frame_cache=None)], LIBERO_LAYOUT)
    more, extra2 = packing_rows(lake, world_size=world_size, quick=quick)
    return write_suite("data", rows + more, quick=quick, out_dir=out_dir, extra={**extra, **extra2}, console=console)
