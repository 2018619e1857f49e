"""`kilovla bench elastic --quick`: the checkpoint-stall row measured, with the parts the issue asks for. The
recovery row is read from test_elastic's lost-node run, the same two-agent run, so it runs once."""

from kilovla.bench import elastic


def test_quick_elastic_bench_measures_the_stall(tmp_path):  # ~8 s: four step windows
    stall, extra = elastic.checkpoint_stall(tmp_path, quick=True)
    assert stall.name == "checkpoint_stall_s"
    assert stall.baseline is not None and stall.ours is not None and "stall per GB" in stall.note
    assert 0.05 < extra["state_gb"] < 0.2
    assert set(extra["window_s"]) == {"none", "sync", "async"}
