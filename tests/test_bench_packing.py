"""`kilovla bench packing --quick`: padded vs packed throughput rows, GR00T N1.7's among them."""

import json

from kilovla.bench.models import BENCH_GROOT_N17, libero_batch, token_counts
from kilovla.cli import main


def test_the_packing_suite_compares_padded_and_packed_steps_of_each_family(tmp_path):
    assert main(["bench", "packing", "--quick", "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "packing.json").read_text())
    rows = {r["name"]: r for r in data["rows"]}
    for name in ("train_samples_per_s", "train_samples_per_s_smolvla", "train_samples_per_s_groot_n17"):
        assert rows[name]["baseline"] > 0 and rows[name]["ours"] > 0 and rows[name]["limit"] >= 1
    n17 = data["groot_n17"]
    assert n17["padded_tokens"] > n17["real_tokens"] > 0
    assert rows["train_samples_per_s_groot_n17"]["limit"] == round(n17["padded_tokens"] / n17["real_tokens"], 3)


def test_groot_n17_counts_every_sample_s_whole_action_horizon_as_real():
    """2 cameras x 49 tokens + language padded to 200 + state and 40 actions; only language padding is saved."""
    cfg = BENCH_GROOT_N17
    batch = libero_batch(cfg, 4, seed=0, min_horizon=cfg.action_horizon)
    assert bool(batch.horizon_mask.all()) and batch.images.shape[1] == 2
    padded, real = token_counts(cfg, batch)
    assert padded == 4 * (2 * 49 + 200 + 1 + 40)
    assert real == 4 * (2 * 49 + 1 + 40) + int(batch.token_mask.sum())
