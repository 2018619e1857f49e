"""`kilovla bench serve`: its rows, on a tiny policy, real server and client processes, short runs."""

import json

import numpy as np
import pytest

from kilovla.bench import serve as serve_bench

pytest.importorskip("openpi_client")
pytestmark = pytest.mark.filterwarnings("ignore:connect\\(\\) must be used as a context manager:DeprecationWarning")

ROWS = ["serve_requests_per_s_1", "serve_requests_per_s_4", "serve_requests_per_s_16", "serve_p50_ms_16",
        "serve_p99_ms_16", "serve_rss_growth_mb"]
TINY = serve_bench.ServeBenchSize(duration_s=1.0, repeats=1, warmup=1, load_requests=32, load_connections=8)


@pytest.fixture(scope="module")
def result(reach_policy, tmp_path_factory):
    """The suite's quick path on a tiny pi0.5 (reach-v3, 2 episodes at 32 px, 2 training steps)."""
    root = tmp_path_factory.mktemp("bench-serve")
    path = serve_bench.run(quick=True, out_dir=root / "out", policy=reach_policy(), size=TINY)
    return json.loads(path.read_text())


def test_requests_use_the_policys_keys_at_its_resolution():
    meta = {"cameras": ["observation.images.scene", "observation.images.wrist"], "image_size": [24, 40],
            "state_keys": ["observation.state", "observation.environment_state"], "state_dim": 43}
    widths = {"observation.state": 4, "observation.environment_state": 39}
    [obs] = serve_bench.observations(meta, widths, np.random.default_rng(0), 1)
    assert list(obs) == [*meta["cameras"], *meta["state_keys"], "task"]
    assert obs["observation.images.scene"].shape == (24, 40, 3) and obs["observation.images.scene"].dtype == np.uint8
    assert obs["observation.state"].shape == (4,) and obs["observation.environment_state"].shape == (39,)


def test_state_widths_come_from_the_folders_stats(tmp_path):
    (tmp_path / "policy.json").write_text(json.dumps({
        "preset": "pi05-tiny", "state_keys": ["observation.state", "observation.environment_state"],
        "stats": {"observation.state": {"mean": [0.0] * 4}, "observation.environment_state": {"q01": [0.0] * 39}}}))
    assert serve_bench.state_widths(tmp_path) == {"observation.state": 4, "observation.environment_state": 39}


@pytest.mark.slow
def test_rows_have_their_names_and_numbers(result):
    rows = {r["name"]: r for r in result["rows"]}
    assert list(rows) == ROWS
    for name in ROWS[:-1]:
        assert rows[name]["baseline"] > 0 and rows[name]["ours"] > 0, rows[name]
    assert rows["serve_rss_growth_mb"]["baseline"] is None and np.isfinite(rows["serve_rss_growth_mb"]["ours"])
    assert all("cores" in r["note"] and "client processes" in r["note"] for r in result["rows"])


@pytest.mark.slow
def test_every_request_is_answered_exactly_once(result):
    assert result["exactly_once"] is True
    assert all(m["server_replies"] == m["sent"] for m in result["measurements"])
    load = result["measurements"][-1]
    assert load["clients"] == 8 and load["replies"] == 32 and load["sent"] == 32 + 8  # one warm-up each
    assert "exactly once: yes" in result["rows"][-1]["note"]


@pytest.mark.slow
def test_batching_off_runs_one_request_per_forward_and_on_batches_16_clients(result):
    by = {(m["clients"], m["max_batch"]): m for m in result["measurements"][:-1]}
    assert all(by[(n, 1)]["mean_batch"] == 1.0 for n in serve_bench.CLIENT_COUNTS)
    assert by[(1, 16)]["mean_batch"] == 1.0  # one client in a closed loop: nobody to batch with
    assert by[(16, 16)]["mean_batch"] > 1.5


@pytest.mark.slow
def test_batching_serves_more_requests_per_second_with_16_clients(result):
    row = next(r for r in result["rows"] if r["name"] == "serve_requests_per_s_16")
    assert row["ours"] > row["baseline"], row
