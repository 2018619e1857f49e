"""The lake at scale: the Feistel epoch order, run-length token lengths, memory-mapped columns."""

import mmap
import pickle
import tracemalloc

import numpy as np
import pytest

from kilovla.data.columns import ColumnStore, dataset_cache_dir, open_columns, prefetch_pages
from kilovla.data.lake import DataLake, LakeSource, TokenLayout
from kilovla.data.lengths import RunLengths
from kilovla.data.lerobot import LeRobotDataset
from kilovla.data.meta import DatasetMeta
from kilovla.data.plan import ORDER_VERSION, GlobalBatchPlan, PlanConfig, feistel_permute
from kilovla.errors import DatasetError, KilovlaError


def _is_mapped(array) -> bool:
    while array is not None and not isinstance(array, mmap.mmap):
        array = array.obj if isinstance(array, memoryview) else getattr(array, "base", None)
    return array is not None


def _keys(seed):
    return np.random.SeedSequence([seed]).generate_state(6, dtype=np.uint64)


@pytest.mark.parametrize("n", [1, 2, 3, 17, 256, 1000, 4097])
def test_feistel_is_a_bijection_of_any_size(n):
    out = feistel_permute(np.arange(n), n, _keys(n))
    assert sorted(out.tolist()) == list(range(n))
    if n > 16:
        assert not np.array_equal(out, np.arange(n))
        assert not np.array_equal(out, feistel_permute(np.arange(n), n, _keys(n + 1)))


def test_feistel_order_is_a_uniform_shuffle():
    # where sample 0..9 land over 4000 keys: each of the 10 positions ~400 times (a shuffle of samples,
    # not a rotation or a block order); and neighbours do not stay neighbours
    n, trials = 10, 4000
    counts = np.zeros((n, n))
    adjacent = 0
    for t in range(trials):
        out = feistel_permute(np.arange(n), n, _keys(10_000 + t))
        counts[np.arange(n), out] += 1
        adjacent += abs(int(out[0]) - int(out[1])) == 1
    chi2 = ((counts - trials / n) ** 2 / (trials / n)).sum()
    assert chi2 < 160  # 81 degrees of freedom: p ~ 1e-6 above this
    assert abs(adjacent / trials - 2 / n) < 0.05  # as often as in a uniform permutation (2/n)


def test_run_lengths_equal_the_per_sample_array():
    lengths = np.repeat([5, 5, 7, 3, 9], [4, 2, 1, 6, 3])
    runs = RunLengths.from_array(lengths)
    assert len(runs.starts) == 4 and runs.max() == 9 and runs.sum() == lengths.sum()
    ids = np.array([0, 5, 6, 7, 15, 3])
    np.testing.assert_array_equal(runs[ids], lengths[ids])
    both = RunLengths.concat([runs, RunLengths.from_array([9, 9, 1])])
    np.testing.assert_array_equal(both.to_array(), np.concatenate([lengths, [9, 9, 1]]))
    assert RunLengths(np.array([0, 2]), np.array([4, 4]), 3).tobytes() == RunLengths.from_array([4, 4, 4]).tobytes()
    with pytest.raises(IndexError):
        runs[np.array([16])]


def _episode_lengths(episodes, seed=0):
    rng = np.random.default_rng(seed)
    per_episode = rng.choice([590, 591, 596, 626], episodes)
    frames = rng.integers(300, 700, episodes)
    return RunLengths(np.concatenate([[0], np.cumsum(frames)[:-1]]), per_episode, int(frames.sum()))


def test_a_plan_over_1e9_samples_costs_its_batch_not_the_lake():
    lengths = _episode_lengths(2_000_000)  # ~10^9 samples in 2x10^6 episodes
    assert len(lengths) > 9 * 10**8
    tracemalloc.start()
    plan = GlobalBatchPlan(lengths, PlanConfig(seed=0, global_batch_size=4096, token_budget=8192))
    rows = plan.all_rank_rows(123_456, 1024)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert peak < 64 * 2**20  # the runs are 32 MB; a permutation of the lake would be 8 GB
    ids = np.concatenate([np.concatenate(r) for r in rows])
    assert len(ids) == 4096 and len(np.unique(ids)) == 4096 and ids.max() < len(lengths)


def test_an_epoch_over_episodes_shuffles_samples_not_episodes():
    lengths = _episode_lengths(50, seed=1)
    plan = GlobalBatchPlan(lengths, PlanConfig(seed=3, global_batch_size=64, token_budget=8192))
    order = plan.epoch_order(0)
    assert sorted(order.tolist()) == list(range(len(lengths)))
    episode = np.searchsorted(lengths.starts, plan.global_batch(0), side="right") - 1
    # 64 uniform draws over 50 episodes touch ~36 of them; an order of episode blocks would touch 1-2
    assert len(np.unique(episode)) > 25


@pytest.mark.parametrize("weights", [[2.0, 0.5], [1.5, 0.25], [0.0, 1.0]])
def test_fractional_weights_draw_a_fresh_subset_each_epoch(weights):
    lengths = np.full(300, 600)
    plan = GlobalBatchPlan(lengths, PlanConfig(seed=0, global_batch_size=10, drop_last=False),
                           offsets=np.array([0, 100, 300]), weights=np.array(weights))
    sizes = np.array([100, 200])
    first, second = plan.epoch_order(0), plan.epoch_order(1)
    for order in (first, second):
        counts = np.bincount(order, minlength=300)
        for d, (lo, hi) in enumerate([(0, 100), (100, 300)]):
            assert counts[lo:hi].sum() == round(weights[d] * sizes[d])
            whole = int(np.floor(weights[d]))
            assert counts[lo:hi].min() >= whole and counts[lo:hi].max() <= whole + 1
    fractional = [d for d, w in enumerate(weights) if 0 < w % 1]
    for d in fractional:
        lo, hi = [(0, 100), (100, 300)][d]
        extra = lambda order: set(np.flatnonzero(np.bincount(order, minlength=300)[lo:hi] > np.floor(weights[d])))
        assert extra(first) != extra(second)


def test_token_steps_resume_from_the_state_without_walking_the_epoch():
    lengths = _episode_lengths(400, seed=2)
    cfg = PlanConfig(seed=1, global_batch_tokens=200_000, token_budget=8192)
    plan = GlobalBatchPlan(lengths, cfg)
    steps = plan.steps_in_epoch(0)
    along = [plan.global_batch(s) for s in range(steps + 5)]
    assert all(lengths[b].sum() <= 200_000 for b in along)
    assert sorted(np.concatenate(along[:steps]).tolist()) == sorted(plan.epoch_order(0)[:sum(map(len, along[:steps]))].tolist())
    plan.step = steps + 2
    state = plan.state_dict()
    assert state["order"] == ORDER_VERSION and state["epoch"] == 1 and state["epoch_start"] == steps
    fresh = GlobalBatchPlan(lengths, cfg)
    fresh.load_state_dict(state)
    np.testing.assert_array_equal(fresh.global_batch(steps + 2), along[steps + 2])
    assert fresh._cuts[1].first == 2  # resumed at the recorded boundary: epoch 1's first steps not walked
    np.testing.assert_array_equal(fresh.global_batch(steps + 3), along[steps + 3])
    np.testing.assert_array_equal(fresh.global_batch(1), along[1])  # an earlier step walks from its epoch's start


def test_a_state_from_the_old_order_is_refused_in_one_line():
    plan = GlobalBatchPlan(np.full(100, 600), PlanConfig(seed=0, global_batch_size=10))
    old = {k: v for k, v in plan.state_dict().items() if k != "order"}
    with pytest.raises(KilovlaError, match="order version 1") as err:
        plan.load_state_dict(old)
    assert "\n" not in str(err.value)


# -- columns ---------------------------------------------------------------------------------------
def test_columns_are_mapped_from_the_cache_and_equal_the_parquet(lerobot_fixture):
    meta = DatasetMeta(lerobot_fixture)
    store = open_columns(meta)
    assert store.path == dataset_cache_dir("columns", lerobot_fixture) and store.private_bytes() < 10_000
    in_memory = meta.load_columns()
    for key, values in in_memory.items():
        assert key in store.mapped and _is_mapped(store[key]), key
        np.testing.assert_array_equal(np.asarray(store[key]), values)
    assert open_columns(meta).path == store.path  # the second open maps what the first wrote


def test_a_dataset_pickles_without_its_columns(tiny_root):
    ds = LeRobotDataset(tiny_root, delta_timestamps={"action": [0.0, 0.1, 0.2]})
    blob = pickle.dumps(ds)
    assert len(blob) < 20_000  # the columns travel as a path, not as ~frames x 300 bytes
    again = pickle.loads(blob)
    assert _is_mapped(again.columns["action"])
    a, b = ds.get_batch(np.arange(len(ds))), again.get_batch(np.arange(len(ds)))
    for key in ("action", "observation.state", "action_is_pad"):
        np.testing.assert_array_equal(a[key], b[key])


def test_a_rewritten_data_file_rebuilds_the_cache(tiny_copy):
    import pyarrow.parquet as pq

    meta = DatasetMeta(tiny_copy)
    first = open_columns(meta)
    rel = meta.episodes.data_file[0]
    table = pq.read_table(tiny_copy / rel)
    import pyarrow as pa

    state = table.column("observation.state").to_pylist()
    state[0] = [9.0] * len(state[0])
    column = pa.array(state, type=table.schema.field("observation.state").type)
    pq.write_table(table.set_column(table.column_names.index("observation.state"), "observation.state", column),
                   tiny_copy / rel)
    again = open_columns(DatasetMeta(tiny_copy))
    assert again["observation.state"][0].tolist() == [9.0] * len(state[0])
    assert first["observation.state"][0].tolist() != [9.0] * len(state[0])  # the old map stays valid


def test_an_unwritable_cache_falls_back_to_memory_with_a_warning(tiny_root, tmp_path, monkeypatch, caplog):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    monkeypatch.setenv("KILOVLA_CACHE_DIR", str(blocker))
    store = open_columns(DatasetMeta(tiny_root))
    assert store.path is None and not store.mapped and not _is_mapped(store["action"])
    assert "reading the columns into memory" in caplog.text


def test_a_corrupt_data_file_is_named_before_any_cache_is_used(tiny_copy):
    meta = DatasetMeta(tiny_copy)
    (tiny_copy / meta.episodes.data_file[0]).write_bytes(b"PAR1 not parquet")
    with pytest.raises(DatasetError, match=meta.episodes.data_file[0]):
        LeRobotDataset(tiny_copy)
    assert not any(dataset_cache_dir("columns", tiny_copy).parent.glob(f".{tiny_copy.name}*.tmp"))


def test_episode_subsets_map_positions_by_episode_offsets(tiny_root):
    full = LeRobotDataset(tiny_root)
    eps = full.meta.episodes
    part = LeRobotDataset(tiny_root, episodes=[3, 1])
    expected = np.concatenate([np.arange(eps.row_from[e], eps.row_to[e]) for e in (1, 3)])
    np.testing.assert_array_equal(part.positions_to_rows(np.arange(len(part))), expected)
    starts, tasks = part.task_runs()
    per_position = np.repeat(tasks, np.diff(np.append(starts, len(part))))
    np.testing.assert_array_equal(per_position, part.task_of(np.arange(len(part))))
    lake = DataLake([LakeSource(root=str(tiny_root), episodes=(1, 3))], TokenLayout(tokens_per_camera=4))
    assert len(lake.lengths) == len(part) and len(lake.lengths.starts) <= 2 * 2


# -- reading from a cold page cache ----------------------------------------------------------------
@pytest.fixture(scope="module")
def numeric_lake(tmp_path_factory):
    """Two datasets shaped like the lake bench's (100k frames: column files of 98-782 pages) and their index."""
    from kilovla.bench import lake as bench_lake
    from kilovla.data.lake_index import LakeIndex

    base = tmp_path_factory.mktemp("numeric-lake")
    roots = [bench_lake.write_numeric_dataset(base / f"ds{i}", 100_000, seed=i) for i in range(2)]
    LakeIndex.open(roots, base / "index")
    return roots, base / "index"


def _column_files(roots):
    return sorted(f for r in roots for f in dataset_cache_dir("columns", r).glob("*.npy"))


def _evict_or_skip(files):
    from kilovla.bench.lake import evict_page_cache, memory_backed, resident_pages

    if memory_backed(files[0]):
        pytest.skip("tmpfs: the files' pages are their storage, a cold read cannot be made here")
    evict_page_cache(files)
    assert not any(resident_pages(f).any() for f in files)


def _resident(path, want: set, timeout_s: float = 10.0) -> set:
    """The file's resident pages, once `want` are all in (MADV_WILLNEED returns before its reads finish)."""
    import time

    from kilovla.bench.lake import resident_pages

    deadline = time.monotonic() + timeout_s
    while True:
        got = set(np.flatnonzero(resident_pages(path)).tolist())
        if want <= got or time.monotonic() > deadline:
            return got
        time.sleep(0.01)


def _pages(path, rows, row_bytes: int) -> set:
    """Pages of a .npy file that rows [r, r + 1) occupy, the data's offset read from its header."""
    with open(path, "rb") as f:
        version = np.lib.format.read_magic(f)
        np.lib.format.read_array_header_1_0(f) if version == (1, 0) else np.lib.format.read_array_header_2_0(f)
        offset = f.tell()
    start = offset + np.asarray(rows, dtype=np.int64).ravel() * row_bytes
    return set((start // mmap.PAGESIZE).tolist()) | set(((start + row_bytes - 1) // mmap.PAGESIZE).tolist())


def test_a_prefetch_asks_for_exactly_the_pages_of_the_rows(numeric_lake):
    roots, _ = numeric_lake
    files = _column_files(roots[:1])
    _evict_or_skip(files)
    store = open_columns(DatasetMeta(roots[0]))  # maps: each header page asked for, then read
    index_rows = np.array([5103, 5104, 60000])  # int64 after a 128-byte header: pages 9 | 10 ... 117
    action_rows = np.array([726])  # 28-byte rows: bytes 20456-20483, across pages 4 and 5
    assert prefetch_pages([(store, "index", index_rows), (store, "action", action_rows)]) == 3
    index_npy, action_npy = store.path / "index.npy", store.path / "action.npy"
    assert _resident(index_npy, {0, 9, 10, 117}) == {0, 9, 10, 117}
    assert _resident(action_npy, {0, 4, 5}) == {0, 4, 5}
    np.testing.assert_array_equal(store["index"][index_rows], index_rows)


def test_a_cold_open_reads_the_headers_and_the_batch_not_the_columns(numeric_lake):
    from kilovla.data.lake_index import LakeIndex

    roots, index = numeric_lake
    files = _column_files(roots)
    _evict_or_skip(files)
    sources = [LakeSource(root=str(r), delta_timestamps={"action": [i / 10 for i in range(10)]}) for r in roots]
    lake = DataLake(sources, TokenLayout(tokens_per_camera=0), index=LakeIndex.open(roots, index))
    plan = GlobalBatchPlan.from_lake(lake, PlanConfig(seed=0, global_batch_size=64, token_budget=1024))
    ids = np.concatenate(plan.rank_rows(0, 0, 4))
    batch = lake.get_batch(ids)
    which = lake.dataset_of(ids)
    for d, ds in enumerate(lake.datasets):
        where = ds.locate(ids[which == d] - lake.offsets[d])
        for key, column in ds.columns.items():
            path = ds.columns.path / f"{key}.npy"
            rows = where.query_rows.get(key, where.rows)
            want = {0} | _pages(path, rows, column.strides[0])  # the header, the rows read: nothing around them
            assert _resident(path, want) == want, (d, key)
    plain = DataLake(sources, TokenLayout(tokens_per_camera=0), index=LakeIndex.open(roots, index), prefetch=False)
    for key, values in plain.get_batch(ids).items():
        np.testing.assert_array_equal(batch[key], values, err_msg=key)


# -- the lake index --------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def three_datasets(tmp_path_factory):
    from kilovla.data.synthetic import make_synthetic_dataset

    base = tmp_path_factory.mktemp("lake3")
    return [make_synthetic_dataset(base / f"ds{i}", episodes=3, frames=(8, 14), seed=i, cameras=("front",),
                                   resolution=(16, 16)) for i in range(3)]


def test_the_index_is_built_in_parallel_and_rebuilt_only_for_a_changed_dataset(three_datasets, tmp_path):
    import shutil

    from kilovla.data.lake_index import LakeIndex

    roots = [tmp_path / d.name for d in three_datasets]
    for src, dst in zip(three_datasets, roots):
        shutil.copytree(src, dst)
    first = LakeIndex.open(roots, tmp_path / "index", engine="local", workers=2)
    assert first.rebuilt == 3 and all(d.problems == [] for d in first.datasets())
    assert LakeIndex.open(roots, tmp_path / "index").rebuilt == 0
    info = roots[1] / "meta" / "info.json"
    info.write_text(info.read_text().replace('"robot_type": "', '"robot_type": "x'))
    again = LakeIndex.open(roots, tmp_path / "index", engine="serial")
    assert again.rebuilt == 1 and again.datasets()[1].meta.info["robot_type"].startswith("x")
    assert len(list(tmp_path.glob("index.*.safetensors"))) == 1  # the replaced arrays are gone


def test_a_lake_opened_from_its_index_reads_no_metadata_and_returns_the_same_samples(three_datasets, tmp_path,
                                                                                     monkeypatch):
    from kilovla.data import meta as meta_module
    from kilovla.data.lake_index import LakeIndex

    sources = [LakeSource(root=str(d), weight=w, delta_timestamps={"action": [0.0, 0.1]}, episodes=e)
               for d, w, e in zip(three_datasets, (1.0, 0.5, 2.0), (None, (0, 2), None))]
    direct = DataLake(sources, TokenLayout(tokens_per_camera=4))
    index = LakeIndex.open([s.root for s in sources], tmp_path / "index")

    def no_reads(*a, **k):
        raise AssertionError("read a metadata file")

    monkeypatch.setattr(meta_module.DatasetFiles, "read_json", no_reads)
    monkeypatch.setattr(meta_module.DatasetFiles, "read_parquet", no_reads)
    indexed = DataLake(sources, TokenLayout(tokens_per_camera=4), index=index)
    assert indexed.fingerprint() == direct.fingerprint()
    ids = np.arange(len(direct))
    a, b = direct.get_batch(ids), indexed.get_batch(ids)
    for key in a:
        np.testing.assert_array_equal(a[key], b[key], err_msg=key)


def test_the_index_records_what_validate_finds(three_datasets, tmp_path):
    import shutil

    import pyarrow as pa
    import pyarrow.parquet as pq

    from kilovla.data.lake_index import LakeIndex

    root = tmp_path / "bad"
    shutil.copytree(three_datasets[0], root)
    rel = DatasetMeta(root).episodes.data_file[0]
    table = pq.read_table(root / rel)
    ts = (table.column("timestamp").to_numpy() * 2).astype(np.float32)
    pq.write_table(table.set_column(table.column_names.index("timestamp"), "timestamp", pa.array(ts)), root / rel)
    entry = LakeIndex.open([root], tmp_path / "index").datasets()[0]
    assert any("timestamp at row" in p for p in entry.problems)


def test_adding_a_dataset_indexes_it_alone_and_a_changed_video_is_seen(three_datasets, tmp_path):
    import shutil

    from kilovla.data.lake_index import LakeIndex

    roots = [tmp_path / d.name for d in three_datasets]
    for src, dst in zip(three_datasets, roots):
        shutil.copytree(src, dst)
    assert LakeIndex.open(roots[:2]).rebuilt == 2  # the default place, keyed by the roots list
    assert LakeIndex.open(roots).rebuilt == 1  # another list: the two known entries are reused
    assert LakeIndex.open(roots[1:]).rebuilt == 0
    next((roots[2] / "videos").rglob("*.mp4")).unlink()
    again = LakeIndex.open(roots[1:])
    assert again.rebuilt == 1 and any("missing" in p for p in again.datasets()[1].problems)


@pytest.mark.parametrize("damage", ["json_list", "arrays_truncated"])
def test_a_damaged_index_is_rebuilt(three_datasets, tmp_path, damage):
    from kilovla.data.lake_index import LakeIndex

    path = tmp_path / "index"
    LakeIndex.open(three_datasets[:1], path)
    if damage == "json_list":
        path.with_suffix(".json").write_text("[]")
    else:
        arrays = next(tmp_path.glob("index.*.safetensors"))
        arrays.write_bytes(arrays.read_bytes()[:100])
    again = LakeIndex.open(three_datasets[:1], path)
    assert again.datasets()[0].meta.total_frames == DatasetMeta(three_datasets[0]).total_frames


def test_a_truncated_column_cache_file_is_rebuilt(tiny_copy):
    meta = DatasetMeta(tiny_copy)
    store = open_columns(meta)
    (store.path / "task_runs.npy").write_bytes(b"\x93NUMPY")
    (store.path / "action.npy").write_bytes(b"\x93NUMPY\x01\x00")
    again = open_columns(DatasetMeta(tiny_copy))
    np.testing.assert_array_equal(np.asarray(again["action"]), meta.load_columns(["action"])["action"])


def test_a_script_without_a_main_guard_builds_the_index(three_datasets, tmp_path):
    import subprocess
    import sys

    import shutil

    script = tmp_path / "no_guard.py"
    roots = [str(shutil.copytree(d, tmp_path / d.name)) for d in three_datasets]  # never indexed before
    script.write_text("from kilovla.data.lake_index import LakeIndex\n"
                      f"print(LakeIndex.open({roots!r}, {str(tmp_path / 'index')!r}, engine='local', workers=2).rebuilt)\n")
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "3"
