"""`kilovla bench elastic --quick`: both rows measured, with the parts the issue asks for."""

import json

import pytest

from kilovla.bench import elastic


@pytest.mark.slow  # ~40 s: a two-agent elastic run and four step windows
def test_quick_elastic_bench_measures_the_stall_and_the_recovery(tmp_path):
    path = elastic.run(quick=True, out_dir=tmp_path)
    result = json.loads(path.read_text())
    rows = {r["name"]: r for r in result["rows"]}
    stall, recovery = rows["checkpoint_stall_s"], rows["recovery_s"]
    assert stall["baseline"] is not None and stall["ours"] is not None and "stall per GB" in stall["note"]
    assert 0.05 < result["state_gb"] < 0.2
    assert set(result["window_s"]) == {"none", "sync", "async"}
    parts = result["recovery_parts_s"]
    assert set(parts) == {"detection_s", "rendezvous_start_load_s", "first_step_s"}
    assert all(v >= 0 for v in parts.values())
    assert recovery["ours"] == pytest.approx(sum(parts.values()), abs=0.01)
    restart = result["recovery_restart"]
    assert (restart["world_size_before"], restart["world_size_after"]) == (2, 1)
