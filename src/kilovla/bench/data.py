"""`kilovla bench data` / `kilovla data bench PATH`: the data layer against the way LeRobot loads.

Rows (names are an interface, see DESIGN.md):

- loader_samples_per_s: samples/s in one process. Baseline: per-sample decoding that opens each
  video and seeks, converting every decoded frame (LeRobot's PyAV path); ours: the plan's packed rows
  through `InProcessLoader` (cached decoders, one forward pass per file per row, uint8). Same
  samples, interleaved repeats, median.
- first_batch_s: from nothing to the first row of the first step (dataset index, plan, decoders).
- decode_frames_per_s, peak_rss_mb, rss_growth_mb: decoded frames per second; resident memory over a
  long run (20 000 samples); growth is the median of the last quarter minus that of the second.
- padding_fraction: on a LIBERO-like pi0.5 token layout (2-3 cameras x 256 tokens, language 8-48
  tokens, horizon 10-50) over a lake of several datasets; baseline pads every sample to the fixed
  shape (3 camera slots, 200 language tokens, horizon 50); ours packs the global batch into rows.
- rank_imbalance_tokens / rank_imbalance_attention: max/mean over simulated ranks (default 1024) of
  tokens and of sum(len^2); baseline hands each rank an equal count of samples in plan order.
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import psutil

from kilovla.bench.common import DEFAULT_OUT, Row, write_suite
from kilovla.data import windows
from kilovla.data.lake import DataLake, LakeSource, TokenLayout
from kilovla.data.lerobot import DatasetMeta, LeRobotDataset
from kilovla.data.loader import InProcessLoader, fetch_row
from kilovla.data.packing import imbalance
from kilovla.data.plan import GlobalBatchPlan, PlanConfig, padding_fraction
from kilovla.data.synthetic import make_synthetic_dataset

CACHE_VERSION = "v1"
LIBERO_LAYOUT = TokenLayout(tokens_per_camera=256, max_language_tokens=200, state_tokens=8, action_horizon=50)
LIBERO_TASKS = (
    "open the drawer",
    "turn on the stove",
    "put the bowl on the plate",
    "pick up the black bowl and place it on the plate",
    "put the cream cheese in the bowl and close the top drawer",
    "pick up the alphabet soup and the tomato sauce and place them both in the basket now",
)


def loader_request(meta_fps: float, cameras: list[str], has_action: bool) -> dict[str, list[float]]:
    """16-step action window, the first camera at t-1 and t, the other cameras at t."""
    request = {}
    if has_action:
        request["action"] = [i / meta_fps for i in range(16)]
    if cameras:
        request[cameras[0]] = [-1 / meta_fps, 0.0]
    return request


class PerSampleReader:
    """The baseline: each sample opens its videos, seeks to the keyframe before the first wanted frame
    and decodes forward to the last, converting every decoded frame, as LeRobot's PyAV path does."""

    def __init__(self, dataset: LeRobotDataset):
        self.ds = dataset
        self.frames_decoded = 0

    def item(self, position: int) -> dict:
        import av

        ds = self.ds
        row = int(ds.positions_to_rows([position])[0])
        eps = ds.meta.episodes
        ep = int(ds._row_episode[row])
        out = {}
        for key, offsets in (ds.delta_indices or {}).items():
            rows, pad = windows.window_rows(np.array([row]), eps.row_from[[ep]], eps.row_to[[ep]], offsets)
            if key not in ds.camera_keys:
                out[key], out[f"{key}_is_pad"] = ds.columns[key][rows[0]], pad[0]
        for key in ds.camera_keys:
            offsets = (ds.delta_indices or {}).get(key, np.array([0]))
            rows, _ = windows.window_rows(np.array([row]), eps.row_from[[ep]], eps.row_to[[ep]], offsets)
            wanted = eps.video_from_s[key][ep] + ds.columns["timestamp"][rows[0]].astype(np.float64)
            with av.open(ds.meta.files.path(eps.video_file[key][ep])) as container:
                stream = container.streams.video[0]
                tb = float(stream.time_base)
                container.seek(int(wanted[0] / tb), stream=stream, backward=True)
                decoded, times = [], []
                for frame in container.decode(stream):
                    decoded.append(frame.to_ndarray(format="rgb24"))
                    times.append(frame.pts * tb)
                    if times[-1] >= wanted[-1] - 1e-4:
                        break
            self.frames_decoded += len(decoded)
            times = np.array(times)
            out[key] = np.stack([decoded[int(np.argmin(np.abs(times - t)))] for t in wanted])
        return out


def build_video_dataset(cache: Path, quick: bool) -> Path:
    """The loader benchmark's dataset: 2 cameras, 224x224, AV1 with a keyframe every 2 frames."""
    name = f"video-224-{'quick' if quick else 'full'}-{CACHE_VERSION}"
    root = cache / name
    if (root / "meta" / "info.json").exists():
        return root
    episodes, frames = (4, (40, 60)) if quick else (20, (120, 180))
    return make_synthetic_dataset(root, episodes=episodes, frames=frames, fps=30, resolution=(224, 224),
                                  state_dim=14, action_dim=14, overwrite=True)


def build_libero_like_lake(cache: Path) -> DataLake:
    """Six small datasets with 2 or 3 cameras, instructions of 8-48 byte tokens and horizons 10-50,
    weighted so that an epoch holds ~18k samples (enough for 16 per rank at 1024 ranks)."""
    specs = [(2, 10, 4.0), (3, 50, 4.0), (2, 25, 3.0), (3, 10, 4.0), (2, 50, 4.0), (3, 25, 4.0)]
    sources = []
    for i, (cams, horizon, weight) in enumerate(specs):
        root = cache / f"libero-like-{i}-{CACHE_VERSION}"
        if not (root / "meta" / "info.json").exists():
            make_synthetic_dataset(root, episodes=8, frames=(90, 110), fps=10, resolution=(32, 32),
                                   cameras=("agentview", "wrist", "third")[:cams], state_dim=8, action_dim=7,
                                   tasks=LIBERO_TASKS[i % 3:] + LIBERO_TASKS[:i % 3], codec="libx264",
                                   seed=i, overwrite=True)
        sources.append(LakeSource(root=str(root), weight=weight, action_horizon=horizon))
    return DataLake(sources, LIBERO_LAYOUT)


def _rss_mb() -> float:
    return psutil.Process().memory_info().rss / 2**20


def loader_rows(root: Path, *, quick: bool, console=None) -> tuple[list[Row], dict]:
    from rich.progress import Progress

    probe = DatasetMeta(root)  # meta/ only: the loaders below load the columns themselves
    request = loader_request(probe.fps, probe.video_keys, "action" in probe.features)
    layout = TokenLayout(tokens_per_camera=256, action_horizon=16)
    batch = min(64 if quick else 256, probe.total_frames)  # a small user dataset still makes one full batch
    repeats = 3 if quick else 5
    soak = 2_000 if quick else 20_000

    t0 = time.perf_counter()
    lake = DataLake([LakeSource(root=str(root), delta_timestamps=request)], layout)
    plan = GlobalBatchPlan.from_lake(lake, PlanConfig(seed=0, global_batch_size=batch, token_budget=16384))
    next(iter(InProcessLoader(lake, plan, steps=1)))
    ours_first = time.perf_counter() - t0

    t0 = time.perf_counter()
    base_ds = LeRobotDataset(root, delta_timestamps=request)
    baseline = PerSampleReader(base_ds)
    first_row = plan.rank_rows(0, 0, 1)[0]
    for g in first_row:
        baseline.item(int(g))
    base_first = time.perf_counter() - t0

    base_times, ours_times, n_samples = [], [], []
    ours_frames = base_frames = 0
    pool = lake.datasets[0].decoder_pool
    for rep in range(repeats):
        step = rep + 1
        ids = plan.global_batch(step)
        before = baseline.frames_decoded
        t0 = time.perf_counter()
        for g in ids:
            baseline.item(int(g))
        base_times.append(time.perf_counter() - t0)
        base_frames += baseline.frames_decoded - before
        before = pool.frames_decoded
        t0 = time.perf_counter()
        for row in plan.rank_rows(step, 0, 1):
            fetch_row(lake, row)
        ours_times.append(time.perf_counter() - t0)
        ours_frames += pool.frames_decoded - before
        n_samples.append(len(ids))
    base_sps = float(np.median(np.array(n_samples) / np.array(base_times)))
    ours_sps = float(np.median(np.array(n_samples) / np.array(ours_times)))

    # Memory over a long run: RSS after every row.
    rss, done = [], 0
    plan.step = repeats + 1
    loader = InProcessLoader(lake, plan)
    with Progress(console=console, transient=True) as progress:
        task = progress.add_task(f"soak: {soak} samples", total=soak)
        for row in loader:
            done += len(row["sample_index"])
            rss.append((done, _rss_mb()))
            progress.update(task, completed=min(done, soak))
            if done >= soak:
                break
    mem = np.array([m for _, m in rss])
    q = len(mem) // 4
    # Single RSS readings swing by tens of MiB (allocator); compare medians of whole quarters.
    growth = float(np.median(mem[3 * q:]) - np.median(mem[q:2 * q]))

    cams = ", ".join(c.split(".")[-1] for c in probe.video_keys)
    feat = probe.features[probe.video_keys[0]] if probe.video_keys else None
    shape = f"{feat.shape[0]}x{feat.shape[1]}" if feat else "no video"
    codec = (feat.info or {}).get("video.codec", "?") if feat else "-"
    what = f"{len(probe.video_keys)} cams ({cams}) {shape} {codec}, 16-step actions, 2 frames of cam 0"
    rows = [
        Row.compare("loader_samples_per_s", "samples/s", base_sps, ours_sps, higher_is_better=True,
                    note=f"1 process; {what}; per-sample open+seek vs plan rows; median of {repeats}x{batch}"),
        Row.compare("first_batch_s", "s", base_first, ours_first, higher_is_better=False,
                    note=f"index + plan + first row of {len(first_row)} samples"),
        Row.compare("decode_frames_per_s", "frames/s", base_frames / sum(base_times),
                    ours_frames / sum(ours_times), higher_is_better=True,
                    note="camera frames out of the decoder per second of loading"),
        Row.compare("peak_rss_mb", "MiB", None, float(mem.max()), higher_is_better=False,
                    note=f"whole process over {done} samples"),
        Row.compare("rss_growth_mb", "MiB", None, growth, higher_is_better=False,
                    note="median RSS of the run's last quarter minus its second quarter"),
    ]
    extra = {"dataset": str(root), "delta_timestamps": request, "global_batch_size": batch, "soak_samples": done}
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
                    note=f"pi0.5 LIBERO-like lake; fixed {fixed_len} tokens/sample vs rows of {budget}; "
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
        world_size: int = 1024, console=None) -> Path:
    """Run the suite; with `dataset`, on the user's dataset instead of the generated ones."""
    cache = Path(out_dir) / "cache"
    cache.mkdir(parents=True, exist_ok=True)
    root = Path(dataset) if dataset is not None else build_video_dataset(cache, quick)
    rows, extra = loader_rows(root, quick=quick, console=console)
    if dataset is None:
        lake = build_libero_like_lake(cache)
    else:
        lake = DataLake([LakeSource(root=str(dataset))], LIBERO_LAYOUT)
    more, extra2 = packing_rows(lake, world_size=world_size, quick=quick)
    return write_suite("data", rows + more, quick=quick, out_dir=out_dir, extra={**extra, **extra2}, console=console)
