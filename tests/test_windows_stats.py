"""delta_timestamps windows (LeRobot's rules) and normalisation stats."""

import numpy as np
import pytest

from kilovla.data import windows
from kilovla.data.stats import aggregate_stats, feature_stats
from kilovla.errors import KilovlaError


def test_offsets_are_rounded_deltas_times_fps():
    got = windows.delta_indices({"a": [-0.2, 0.0, 0.1]}, fps=10)
    assert got["a"].tolist() == [-2, 0, 1]


@pytest.mark.parametrize("delta", [0.05, 0.101])
def test_deltas_off_the_frame_grid_are_refused(delta):
    with pytest.raises(KilovlaError, match="not multiples of 1/fps"):
        windows.delta_indices({"a": [0.0, delta]}, fps=10)


def test_windows_clamp_to_the_episode_and_flag_padding():
    rows, pad = windows.window_rows(np.array([10, 14]), np.array([10, 10]), np.array([15, 15]), np.array([-1, 0, 1]))
    assert rows.tolist() == [[10, 10, 11], [13, 14, 14]]
    assert pad.tolist() == [[True, False, False], [False, False, True]]


def test_feature_stats_match_numpy():
    x = np.random.default_rng(0).standard_normal((1000, 3))
    s = feature_stats(x)
    np.testing.assert_allclose(s["mean"], x.mean(0))
    np.testing.assert_allclose(s["std"], x.std(0))
    np.testing.assert_allclose(s["q99"], np.quantile(x, 0.99, axis=0))
    assert s["count"].tolist() == [1000]


def test_aggregated_mean_and_std_equal_the_pooled_ones():
    rng = np.random.default_rng(1)
    parts = [rng.normal(i, 1 + i, (n, 2)) for i, n in enumerate((50, 120, 7))]
    agg = aggregate_stats([{"x": feature_stats(p)} for p in parts])["x"]
    pooled = np.concatenate(parts)
    np.testing.assert_allclose(agg["mean"], pooled.mean(0))
    np.testing.assert_allclose(agg["std"], pooled.std(0))
    np.testing.assert_allclose(agg["min"], pooled.min(0))
    assert agg["count"].tolist() == [177]


def test_aggregated_quantiles_follow_lerobot_count_weighted_mean(lerobot_fixture):
    # LeRobot's stats.json for the fixture: episode_index q50 equals the count-weighted mean of
    # per-episode medians (0, 1, 2 weighted 40, 25, 33), not the true median 1.
    import json

    stats = json.loads((lerobot_fixture / "meta/stats.json").read_text())
    ours = aggregate_stats([{"e": feature_stats(np.full(n, i))} for i, n in enumerate((40, 25, 33))])["e"]
    np.testing.assert_allclose(ours["q50"], stats["episode_index"]["q50"], rtol=1e-9)
