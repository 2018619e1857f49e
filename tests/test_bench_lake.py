"""`kilovla bench lake`'s pieces on a small lake: its datasets are valid, both sides open and fetch."""

import json

import numpy as np
import pytest

from kilovla.bench import lake as bench_lake
from kilovla.data.lake_index import LakeIndex
from kilovla.data.validate import validate_dataset


def test_the_bench_datasets_are_valid_and_both_sides_open_the_same_lake(tmp_path, monkeypatch):
    monkeypatch.setattr(bench_lake, "FRAMES_PER_DATASET", 2000)
    roots = bench_lake.lake_roots(tmp_path, 6000)
    assert len(roots) == 3 and validate_dataset(str(roots[0])) == []
    assert bench_lake.lake_roots(tmp_path, 4000) == roots[:2]  # the smaller lake reuses the datasets written
    roots_file = tmp_path / "roots.json"
    roots_file.write_text(json.dumps([str(r) for r in roots]))
    LakeIndex.open(roots, tmp_path / "index")
    ours = bench_lake.child("ours", str(roots_file), str(tmp_path / "index"), rank=3)
    base = bench_lake.child("baseline", str(roots_file), None, rank=3)
    assert ours["frames"] == base["frames"] == 6000
    assert ours["uss_mb"] > 0 and ours["open_s"] > 0 and base["fetch_ms"] > 0


def test_the_cold_rows_open_an_evicted_lake_with_and_without_the_prefetch(tmp_path, monkeypatch):
    monkeypatch.setattr(bench_lake, "FRAMES_PER_DATASET", 20_000)
    roots = bench_lake.lake_roots(tmp_path, 40_000)
    index = tmp_path / "index"
    LakeIndex.open(roots, index)
    files = bench_lake.lake_files(roots, index)
    assert any(f.suffix == ".npy" for f in files) and any(f.name.startswith("index.") for f in files)
    if bench_lake.memory_backed(tmp_path):
        pytest.skip("tmpfs: the files' pages are their storage, nothing can be evicted")
    bench_lake.warm_page_cache(files)
    assert bench_lake.resident_fraction(files) > 0.99
    bench_lake.evict_page_cache(files)
    assert bench_lake.resident_fraction(files) == 0
    roots_file = tmp_path / "roots.json"
    roots_file.write_text(json.dumps([str(r) for r in roots]))
    cold = bench_lake.child("ours", str(roots_file), str(index), rank=0, prefetch=True)
    bench_lake.evict_page_cache(files)
    plain = bench_lake.child("ours", str(roots_file), str(index), rank=0, prefetch=False)
    assert cold["frames"] == plain["frames"] == 40_000 and cold["first_fetch_ms"] > 0


def test_the_plan_rows_cost_the_batch_and_the_baseline_the_lake():
    ours = bench_lake.plan_costs(10**7, 20_000)
    old = bench_lake.old_plan_costs(10**7)
    assert ours["mb"] < 10 < old["mb"]  # the permutation and per-sample lengths: 160 MB at 10^7
    assert np.isfinite(ours["s"]) and np.isfinite(old["s"])
