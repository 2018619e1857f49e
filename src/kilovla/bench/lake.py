"""`kilovla bench lake`: the data lake from 10^6 to 10^8 frames, and the plan at 10^9 samples.

It writes numeric-only LeRobot v3.0 datasets (state 8 + action 7 float32 a frame, 500-frame episodes,
10^5 frames a dataset: 1000 datasets at 10^8 frames, ~6 GB of parquet) into a scratch folder, once,
and measures, each in fresh processes:

- open: from nothing to the first global batch computed (1024 ranks) and one rank's samples fetched,
  with 4 processes opening the same lake at once; and their private memory then (USS, psutil: pages no
  other process shares), the median process reported. Warm: every file of the lake read once just
  before. Cold: every file of the lake (column caches, the index, the datasets) evicted from the page
  cache first (posix_fadvise DONTNEED, no root needed; mincore checks what stays resident), with the
  columns' prefetch (ours) and without it (baseline: a page fault at a time, each read around by the
  kernel), interleaved, COLD_REPEATS of each;
- the lake index of 1000 datasets built serially (baseline) and by a local process pool (ours), from no
  column caches;
- a batch of 256 random samples fetched (with a 10-step action window; random over the lake, so at
  10^8 frames a batch spans ~230 of the 1000 datasets, one gather call each);
- the plan at 10^9 samples (2x10^6 episodes, lengths alone): first batch at 1024 ranks, and its peak
  traced allocation (tracemalloc).

Baseline of the open and memory rows: the lake as it was before the lake index (each dataset's meta/
read, every numeric column read into process memory, per-frame row, episode and length arrays and a
full permutation per epoch), emulated by `column_cache=None`, no index and `_old_plan_memory`; it holds
~300 bytes a frame per process, so it is measured up to 10^7 frames (3 GB a process x 4) and
extrapolated linearly to 10^8, as each row's note says. The plan baseline (a numpy permutation of every
sample plus a per-sample length array) is measured at 10^8 and extrapolated to 10^9.
"""

from __future__ import annotations

import ctypes
import json
import mmap
import os
import shutil
import statistics
import subprocess
import sys
import time
import tracemalloc
from pathlib import Path

import numpy as np

from kilovla.bench.common import DEFAULT_OUT, Row, write_suite

FRAMES_PER_DATASET = 100_000
EPISODE_FRAMES = 500
FPS = 10
STATE_DIM, ACTION_DIM = 8, 7
TASKS = ("pick up the red block", "open the drawer", "push the button to the left", "stack the cups")
PROCESSES = 4
RANKS = 1024
GLOBAL_BATCH = 8192  # 8 samples a rank
FETCH = 256
SIZES = (10**6, 10**7, 10**8)
BASELINE_SIZES = (10**6, 10**7)  # the in-memory lake: ~3 GB a process at 10^7
QUICK_SIZES = (2 * 10**5, 10**6)
PLAN_SAMPLES, PLAN_EPISODES = 10**9, 2 * 10**6
COLD_REPEATS = 2


def write_numeric_dataset(root: Path, frames: int, seed: int) -> Path:
    """A LeRobot v3.0 dataset of `frames` frames in EPISODE_FRAMES-frame episodes, state + action only,
    meta/stats.json included (what `kilovla data validate` asks of a training dataset)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from kilovla.data.stats import feature_stats
    from kilovla.data.writer import DEFAULT_FEATURES, write_meta

    rng = np.random.default_rng(seed)
    episodes = frames // EPISODE_FRAMES
    n = episodes * EPISODE_FRAMES
    tmp = root.with_name(f".{root.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    state = rng.standard_normal((n, STATE_DIM), dtype=np.float32)
    action = rng.standard_normal((n, ACTION_DIM), dtype=np.float32)
    episode_index = np.repeat(np.arange(episodes), EPISODE_FRAMES)
    frame_index = np.tile(np.arange(EPISODE_FRAMES), episodes)
    timestamp = (frame_index / FPS).astype(np.float32)
    task_of_episode = rng.integers(0, len(TASKS), episodes)
    table = pa.table({
        "observation.state": pa.FixedSizeListArray.from_arrays(state.ravel(), STATE_DIM),
        "action": pa.FixedSizeListArray.from_arrays(action.ravel(), ACTION_DIM),
        "timestamp": timestamp, "frame_index": frame_index,
        "episode_index": episode_index, "index": np.arange(n), "task_index": np.repeat(task_of_episode, EPISODE_FRAMES)})
    (tmp / "data" / "chunk-000").mkdir(parents=True)
    pq.write_table(table, tmp / "data" / "chunk-000" / "file-000.parquet")
    features = {"observation.state": {"dtype": "float32", "shape": [STATE_DIM], "names": None},
                "action": {"dtype": "float32", "shape": [ACTION_DIM], "names": None}, **DEFAULT_FEATURES}
    rows, stats = [], []
    for e in range(episodes):
        lo, hi = e * EPISODE_FRAMES, (e + 1) * EPISODE_FRAMES
        rows.append({"episode_index": e, "tasks": [TASKS[task_of_episode[e]]], "length": EPISODE_FRAMES,
                     "dataset_from_index": lo, "dataset_to_index": hi, "data/chunk_index": 0, "data/file_index": 0})
        stats.append({"observation.state": feature_stats(state[lo:hi]), "action": feature_stats(action[lo:hi]),
                      "timestamp": feature_stats(timestamp[lo:hi])})
    write_meta(tmp, fps=FPS, robot_type="bench", features=features, tasks=list(TASKS), episodes=rows,
               episode_stats=stats, chunks_size=1000, data_mb=100, video_mb=200)
    shutil.rmtree(root, ignore_errors=True)
    os.replace(tmp, root)
    return root


def lake_roots(scratch: Path, frames: int, progress=None) -> list[Path]:
    """The first frames / FRAMES_PER_DATASET datasets under scratch/datasets, written where missing."""
    count = max(1, frames // FRAMES_PER_DATASET)
    size = min(frames, FRAMES_PER_DATASET)
    roots = []
    for i in range(count):
        root = scratch / "datasets" / f"ds{i:04d}-{size}"
        if not (root / "meta" / "stats.json").is_file():
            write_numeric_dataset(root, size, seed=i)
        roots.append(root)
        if progress and (i + 1) % 50 == 0:
            progress(f"lake: {i + 1}/{count} datasets written")
    return roots


def _sources(roots: list[str], mode: str):
    from kilovla.data.lake import LakeSource

    window = {"action": [i / FPS for i in range(10)]}
    return [LakeSource(root=r, delta_timestamps=window, column_cache=None if mode == "baseline" else "auto")
            for r in roots]


def _old_plan_memory(lake) -> list[np.ndarray]:
    """What the lake and plan held per frame before the lake index (kept alive by the caller): each
    dataset's row and row -> episode arrays, the per-sample lengths, one epoch's permutation."""
    n = len(lake)
    held = [lake.lengths.to_array(), np.random.default_rng(0).permutation(n)]
    for ds in lake.datasets:
        held += [np.arange(len(ds)), np.repeat(np.arange(ds.num_episodes), ds.meta.episodes.length)]
    return held


def child(mode: str, roots_file: str, index: str | None, rank: int, prefetch: bool = True) -> dict:
    """One process opening the lake (the measurements of `run`); prints its JSON."""
    import psutil

    from kilovla.data.lake import DataLake, TokenLayout
    from kilovla.data.lake_index import LakeIndex
    from kilovla.data.plan import GlobalBatchPlan, PlanConfig

    roots = json.loads(Path(roots_file).read_text())
    t0 = time.perf_counter()
    lake_index = LakeIndex.open(roots, index) if index else None
    lake = DataLake(_sources(roots, mode), TokenLayout(tokens_per_camera=0, max_language_tokens=48), index=lake_index,
                    prefetch=prefetch)
    held = _old_plan_memory(lake) if mode == "baseline" else []
    plan = GlobalBatchPlan.from_lake(lake, PlanConfig(seed=0, global_batch_size=min(GLOBAL_BATCH, len(lake)),
                                                      token_budget=8192))
    rows = plan.rank_rows(0, rank, RANKS)
    lake.get_batch(np.concatenate(rows))
    open_s = time.perf_counter() - t0
    # private memory once open: before the fetches below, whose random pages of the maps (file pages this
    # process alone touched: reclaimable page cache, not copies) USS would count as private too
    uss = psutil.Process().memory_full_info().uss / 2**20
    rng = np.random.default_rng(rank)
    times = []
    for _ in range(7):
        ids = rng.integers(0, len(lake), FETCH)
        t = time.perf_counter()
        lake.get_batch(ids)
        times.append(time.perf_counter() - t)
    del held
    return {"open_s": open_s, "uss_mb": uss, "fetch_ms": statistics.median(times) * 1e3,
            "first_fetch_ms": times[0] * 1e3, "frames": len(lake)}


def _processes(mode: str, roots: list[Path], scratch: Path, index: Path | None, n: int = PROCESSES,
               prefetch: bool = True) -> dict:
    roots_file = scratch / f"roots-{mode}-{len(roots)}.json"
    roots_file.write_text(json.dumps([str(r) for r in roots]))
    cmd = [sys.executable, "-m", "kilovla.bench.lake", mode, str(roots_file), str(index) if index else "-"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    load = os.getloadavg()[0]
    procs = [subprocess.Popen([*cmd, str(rank), "prefetch" if prefetch else "no-prefetch"], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=env)
             for rank in range(n)]
    results = []
    for p in procs:
        out, err = p.communicate(timeout=3600)
        if p.returncode != 0:
            raise RuntimeError(f"bench lake: a {mode} process failed:\n{err[-2000:]}")
        results.append(json.loads(out.strip().splitlines()[-1]))
    keys = ("open_s", "uss_mb", "fetch_ms", "first_fetch_ms", "frames")
    return {**{k: statistics.median(r[k] for r in results) for k in keys}, "load_before": round(load, 2)}


def lake_files(roots: list[Path], index: Path | None) -> list[Path]:
    """Every file an open of the lake may read: each dataset's column cache and folder, the index's files."""
    from kilovla.data.columns import dataset_cache_dir

    folders = [dataset_cache_dir("columns", r) for r in roots] + [Path(r) for r in roots]
    files = [f for d in folders if d.is_dir() for f in d.rglob("*") if f.is_file()]
    if index is not None:
        files += [f for f in index.parent.glob(f"{index.name}.*") if f.is_file()]
    return files


def evict_page_cache(files: list[Path]) -> None:
    """Drop the files' pages from the page cache (pages some process has mapped and touched stay)."""
    for f in files:
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fdatasync(fd)  # dirty pages (a file just written) are not dropped
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def memory_backed(path: Path) -> bool:
    """Whether `path` lies on a file system whose pages are its storage (tmpfs, ramfs): nothing to evict."""
    path, best, fstype = os.path.realpath(path), "", ""
    try:
        with open("/proc/mounts") as f:
            for line in f:
                mount, kind = line.split()[1:3]
                if (path == mount or path.startswith(mount.rstrip("/") + "/")) and len(mount) >= len(best):
                    best, fstype = mount, kind
    except OSError:
        return False
    return fstype in ("tmpfs", "ramfs")


def warm_page_cache(files: list[Path]) -> None:
    """Read the files once, so the page cache holds them (as it does after a first epoch)."""
    for f in files:
        with open(f, "rb", buffering=0) as fh:
            while fh.read(1 << 22):
                pass


def resident_pages(path: Path) -> np.ndarray:
    """Which pages of the file are in the page cache (mincore), a bool per page; reads none of them."""
    size = os.path.getsize(path)
    if size == 0:
        return np.zeros(0, dtype=bool)
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    pages = -(-size // mmap.PAGESIZE)
    vec = (ctypes.c_ubyte * pages)()
    fd = os.open(path, os.O_RDONLY)
    try:
        addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        if addr in (None, ctypes.c_void_p(-1).value):
            raise OSError(ctypes.get_errno(), f"mmap of {path} failed")
        try:
            if libc.mincore(addr, size, vec) != 0:
                raise OSError(ctypes.get_errno(), f"mincore of {path} failed")
        finally:
            libc.munmap(addr, size)
    finally:
        os.close(fd)
    return (np.frombuffer(vec, dtype=np.uint8) & 1).astype(bool)


def resident_fraction(files: list[Path]) -> float:
    total = sum(os.path.getsize(f) for f in files)
    held = sum(int(resident_pages(f).sum()) * mmap.PAGESIZE for f in files)
    return min(1.0, held / total) if total else 0.0


def _cold_opens(roots: list[Path], scratch: Path, index: Path, files: list[Path]) -> dict:
    """COLD_REPEATS cold opens without the prefetch (baseline) and with it (ours), interleaved, each from an
    evicted page cache; medians, and how much of the lake was still resident after each eviction."""
    runs: dict[str, list[dict]] = {"no_prefetch": [], "prefetch": []}
    for _ in range(COLD_REPEATS):
        for name in runs:
            evict_page_cache(files)
            left = resident_fraction(files)
            got = _processes("ours", roots, scratch, index, prefetch=name == "prefetch")
            runs[name].append({**got, "resident_after_eviction": round(left, 4)})
    return {name: {k: statistics.median(r[k] for r in rs) if k != "load_before" else [r[k] for r in rs]
                   for k in rs[0]} for name, rs in runs.items()}


def _clear_caches(roots: list[Path]) -> None:
    from kilovla.data.columns import dataset_cache_dir

    for r in roots:
        shutil.rmtree(dataset_cache_dir("columns", r), ignore_errors=True)


def _index_build(roots: list[Path], path: Path, engine: str) -> float:
    from kilovla.data.lake_index import LakeIndex, entry_path

    _clear_caches(roots)
    for r in roots:  # each dataset's entry kept on its own too: the build must not reuse them
        for old in entry_path(str(r)).parent.glob(f"{entry_path(str(r)).name}.*"):
            old.unlink()
    for old in path.parent.glob(f"{path.name}*"):
        old.unlink()
    t = time.perf_counter()
    index = LakeIndex.open(roots, path, engine=engine)
    assert index.rebuilt == len(roots)
    return time.perf_counter() - t


def _timed_and_traced(fn) -> dict:
    """fn's wall time (untraced: tracemalloc slows Python several-fold) and, in a second call, its peak
    traced allocation."""
    t = time.perf_counter()
    fn()
    seconds = time.perf_counter() - t
    tracemalloc.start()
    fn()
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    return {"s": seconds, "mb": peak / 2**20}


def plan_costs(samples: int, episodes: int) -> dict:
    """Ours: the plan over run-length lengths (episodes of equal frames), first batch at RANKS ranks; the
    lengths' runs (the input, held by the lake) added to the memory."""
    from kilovla.data.lengths import RunLengths
    from kilovla.data.plan import GlobalBatchPlan, PlanConfig

    per = samples // episodes
    lengths = RunLengths(np.arange(episodes) * per, np.random.default_rng(0).choice([70, 71, 74, 78], episodes),
                         episodes * per)

    def first_batch():
        GlobalBatchPlan(lengths, PlanConfig(seed=0, global_batch_size=GLOBAL_BATCH, token_budget=8192)).all_rank_rows(0, RANKS)

    out = _timed_and_traced(first_batch)
    return {**out, "mb": out["mb"] + lengths.nbytes() / 2**20}


def old_plan_costs(samples: int) -> dict:
    """Baseline: a per-sample length array and a numpy permutation of every sample, then the first batch."""
    from kilovla.data.packing import plan_rank_rows

    def first_batch():
        lengths = np.random.default_rng(0).choice([70, 71, 74, 78], samples)
        order = np.random.default_rng(1).permutation(samples)
        plan_rank_rows(lengths[order[:GLOBAL_BATCH]], RANKS, 8192)

    return _timed_and_traced(first_batch)


def _loglog(path: Path, curves: dict[str, tuple[list, list]], ylabel: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 3.5))
    for label, (x, y) in curves.items():
        ax.loglog(x, y, "o-" if "extrap" not in label else "o--", label=label)
    ax.set_xlabel("frames in the lake")
    ax.set_ylabel(ylabel)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _sizes_that_fit(sizes: tuple[int, ...], scratch: Path, note) -> tuple[int, ...]:
    """`sizes` less the largest ones the scratch folder's disk has no room for (one size always stays)."""
    free = shutil.disk_usage(scratch.parent if not scratch.exists() else scratch).free
    while len(sizes) > 1 and sizes[-1] * 160 > free:  # parquet + column cache, ~160 bytes a frame
        note(f"lake: {sizes[-1]:.0e} frames need ~{sizes[-1] * 160 / 1e9:.0f} GB; {free / 1e9:.0f} GB free: skipped")
        sizes = sizes[:-1]
    return sizes


def _measure_lakes(sizes: tuple[int, ...], base_sizes: tuple[int, ...], scratch: Path,
                   note) -> tuple[dict, dict, dict, dict]:
    """For each lake size: cold opens, then ours warm with and without the prefetch, and the baseline at
    `base_sizes`. Returns (ours, baseline, cold, ours without the prefetch), each by size."""
    from kilovla.data.lake_index import LakeIndex

    ours, base, cold, plain = {}, {}, {}, {}
    for frames in sizes:
        roots = lake_roots(scratch, frames, progress=note)
        index = scratch / f"index-{frames}"
        LakeIndex.open(roots, index)  # built once (and the column caches with it); the processes open it
        files = lake_files(roots, index)
        cold[frames] = _cold_opens(roots, scratch, index, files)
        note(f"lake {frames:.0e}: cold {cold[frames]}")
        # warm: the column caches and the index (and the parquet files the baseline reads) read just before
        warm_page_cache([f for f in files if frames in base_sizes or f.suffix != ".parquet"])
        ours[frames] = _processes("ours", roots, scratch, index)
        note(f"lake {frames:.0e}: ours {ours[frames]}")
        plain[frames] = _processes("ours", roots, scratch, index, prefetch=False)
        note(f"lake {frames:.0e}: ours without the prefetch {plain[frames]}")
        if frames in base_sizes:
            base[frames] = _processes("baseline", roots, scratch, None)
            note(f"lake {frames:.0e}: baseline {base[frames]}")
    return ours, base, cold, plain


def _lake_rows(scratch: Path, top: int, btop: int, ours: dict, base: dict, cold: dict, plain: dict) -> list[Row]:
    """The open, memory and fetch rows at the largest lake `top`; the baseline measured at `btop` frames."""
    scale = top / btop
    tag = f"{top:.0e}".replace("+0", "").replace("+", "")  # 1e8
    extrap = f"baseline measured at {btop:.0e} frames ({base[btop]['open_s']:.2f} s, {base[btop]['uss_mb']:.0f} MiB) " \
             f"and extrapolated x{scale:g} (it holds every column per process)" if scale > 1 else "both measured"
    return [
        Row.compare(f"lake_open_s_{tag}", "s", base[btop]["open_s"] * scale, ours[top]["open_s"], higher_is_better=False,
                    limit=10.0, note=f"{len(lake_roots(scratch, top))} datasets, {PROCESSES} processes at once, median; "
                    f"open -> first global batch at {RANKS} ranks + one rank's samples; {extrap}"),
        Row.compare(f"lake_open_s_{tag}_cold", "s", cold[top]["no_prefetch"]["open_s"], cold[top]["prefetch"]["open_s"],
                    higher_is_better=False, limit=10.0,
                    note=f"as lake_open_s_{tag}, from a page cache the lake was evicted from (resident after: "
                         f"{100 * cold[top]['prefetch']['resident_after_eviction']:.2f} %); baseline: the same code "
                         f"without the columns' prefetch (DataLake(prefetch=False)); median of {COLD_REPEATS}, "
                         f"interleaved; read_ahead_kb {_read_ahead_kb(scratch)}; first fetch after the open: "
                         f"{cold[top]['prefetch']['first_fetch_ms']:.0f} ms (baseline "
                         f"{cold[top]['no_prefetch']['first_fetch_ms']:.0f} ms)"),
        Row.compare(f"lake_uss_mb_{tag}", "MiB", base[btop]["uss_mb"] * scale, ours[top]["uss_mb"],
                    higher_is_better=False, limit=300.0,
                    note=f"private memory (USS) per process, {PROCESSES} processes, median; {extrap}"),
        Row.compare(f"sample_fetch_ms_{tag}", "ms", base[btop]["fetch_ms"], ours[top]["fetch_ms"], higher_is_better=False,
                    note=f"{FETCH} random samples with a 10-step action window, page cache warm; baseline "
                         f"(in-memory columns) at {btop:.0e} frames; ours without the prefetch: "
                         f"{plain[top]['fetch_ms']:.1f} ms; from a cold page cache: {cold[top]['prefetch']['fetch_ms']:.0f} "
                         f"ms (without the prefetch {cold[top]['no_prefetch']['fetch_ms']:.0f} ms, its open having read "
                         f"the columns around every header)"),
    ]


def _index_build_row(scratch: Path, top: int) -> Row:
    """Building the index of the largest lake from no column caches: serial vs a process pool."""
    roots = lake_roots(scratch, top)
    serial = _index_build(roots, scratch / "index-build", "serial")
    pooled = _index_build(roots, scratch / "index-build", "local")
    return Row.compare(f"lake_index_build_s_{len(roots)}_datasets", "s", serial, pooled, higher_is_better=False,
                       note=f"{top:.0e} frames, from no column caches: serial vs a process pool of "
                            f"{os.cpu_count()} (engine=local; Ray tasks with engine=ray)")


def _plan_rows(quick: bool) -> list[Row]:
    """The plan's first batch, time and memory, against a full permutation measured at a tenth the samples."""
    plan_n, plan_e = (10**8, 2 * 10**5) if quick else (PLAN_SAMPLES, PLAN_EPISODES)
    mine = plan_costs(plan_n, plan_e)
    old_n = plan_n // 10
    old = old_plan_costs(old_n)
    ptag = f"{plan_n:.0e}".replace("+0", "").replace("+", "")
    return [
        Row.compare(f"plan_first_batch_s_{ptag}", "s", old["s"] * 10, mine["s"], higher_is_better=False, limit=0.5,
                    note=f"{plan_n:.0e} samples in {plan_e:.0e} episodes (lengths alone), {RANKS} ranks, "
                         f"{GLOBAL_BATCH} samples a step; baseline (a full permutation) measured at "
                         f"{old_n:.0e}: {old['s']:.2f} s, x10"),
        Row.compare(f"plan_mb_{ptag}", "MiB", old["mb"] * 10, mine["mb"], higher_is_better=False, limit=200.0,
                    note=f"peak traced allocation + the lengths' runs; baseline at {old_n:.0e}: "
                         f"{old['mb']:.0f} MiB, x10"),
    ]


def _plot_scaling(path: Path, ours: dict, base: dict, scale: float) -> None:
    """Open time and USS per process against lake size, the baseline extrapolated by `scale` to the top."""
    xs = sorted(ours)
    bx = sorted(base)
    _loglog(path, {
        "open s, ours": (xs, [ours[x]["open_s"] for x in xs]),
        "open s, baseline": (bx, [base[x]["open_s"] for x in bx]),
        "open s, baseline extrap.": ([bx[-1], xs[-1]], [base[bx[-1]]["open_s"], base[bx[-1]]["open_s"] * scale]),
        "USS GiB, ours": (xs, [ours[x]["uss_mb"] / 1024 for x in xs]),
        "USS GiB, baseline": (bx, [base[x]["uss_mb"] / 1024 for x in bx]),
        "USS GiB, baseline extrap.": ([bx[-1], xs[-1]], [base[bx[-1]]["uss_mb"] / 1024, base[bx[-1]]["uss_mb"] * scale / 1024]),
    }, "seconds / GiB per process")


def run(*, quick: bool = False, out_dir: str | Path = DEFAULT_OUT, scratch: str | Path | None = None) -> Path:
    from kilovla.progress import note

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    scratch = Path(scratch or os.environ.get("KILOVLA_BENCH_TMP") or out / "lake-scratch")
    sizes, base_sizes = (QUICK_SIZES, QUICK_SIZES[:1]) if quick else (SIZES, BASELINE_SIZES)
    sizes = _sizes_that_fit(sizes, scratch, note)
    scratch.mkdir(parents=True, exist_ok=True)
    load_at_start = round(os.getloadavg()[0], 2)
    ours, base, cold, plain = _measure_lakes(sizes, base_sizes, scratch, note)
    top, btop = sizes[-1], base_sizes[-1]
    rows = _lake_rows(scratch, top, btop, ours, base, cold, plain)
    rows.append(_index_build_row(scratch, top))
    rows += _plan_rows(quick)
    _plot_scaling(out / "lake_scaling.png", ours, base, top / btop)
    extra = {"lake_by_size": {str(k): v for k, v in ours.items()}, "baseline_by_size": {str(k): v for k, v in base.items()},
             "cold_by_size": {str(k): v for k, v in cold.items()},
             "warm_no_prefetch_by_size": {str(k): v for k, v in plain.items()}, "load_average_at_start": load_at_start,
             "read_ahead_kb": _read_ahead_kb(scratch), "plot": "lake_scaling.png"}
    return write_suite("lake", rows, quick=quick, out_dir=out, extra=extra)


def _read_ahead_kb(folder: Path) -> int | None:
    """The kernel's read-around of the disk holding `folder` (what one cold page fault reads), if known."""
    try:
        dev = os.stat(folder).st_dev
    except OSError:
        return None
    block = Path(f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}")
    for queue in (block / "queue", block / ".." / "queue"):  # a disk, or a partition of one
        try:
            return int((queue / "read_ahead_kb").read_text())
        except (OSError, ValueError):
            continue
    return None


if __name__ == "__main__":
    mode, roots_file, index, rank, prefetch = sys.argv[1:6]
    print(json.dumps(child(mode, roots_file, None if index == "-" else index, int(rank), prefetch == "prefetch")))
