"""`kilovla data validate` finds each kind of problem and names the file."""

import json
import re

import numpy as np
import pytest

from conftest import rewrite_parquet, set_column
from kilovla.cli import main
from kilovla.data.validate import validate_dataset

DATA = "data/chunk-000/file-000.parquet"


def _messages(root, deep=False):
    return [str(p) for p in validate_dataset(str(root), deep=deep)]


def test_a_good_dataset_has_no_problems(tiny_root):
    assert _messages(tiny_root, deep=True) == []


def test_timestamps_not_stepping_by_one_over_fps(tiny_copy):
    rewrite_parquet(tiny_copy / DATA, lambda t: set_column(
        t, "timestamp", (np.asarray(t.column("frame_index")) / 15.0).astype(np.float32)))
    [msg] = _messages(tiny_copy)
    assert DATA in msg and "info.json fps=10" in msg


def test_video_fps_differing_from_the_table(tiny_copy):
    info = json.loads((tiny_copy / "meta/info.json").read_text())
    info["fps"] = 20
    (tiny_copy / "meta/info.json").write_text(json.dumps(info))
    rewrite_parquet(tiny_copy / DATA, lambda t: set_column(
        t, "timestamp", (np.asarray(t.column("frame_index")) / 20.0).astype(np.float32)))
    msgs = _messages(tiny_copy)
    assert any("video fps is 10 but the table's fps is 20" in m and m.split(":")[0].endswith(".mp4") for m in msgs)


def test_missing_video(tiny_copy):
    (tiny_copy / "videos/observation.images.front/chunk-000/file-000.mp4").unlink()
    assert any("observation.images.front/chunk-000/file-000.mp4: video file" in m for m in _messages(tiny_copy))


def test_task_index_out_of_range(tiny_copy):
    rewrite_parquet(tiny_copy / DATA, lambda t: set_column(t, "task_index", np.full(len(t), 9)))
    assert any("task_index 9 at row 0 is not in meta/tasks" in m for m in _messages(tiny_copy))


def test_missing_stats(tiny_copy):
    (tiny_copy / "meta/stats.json").unlink()
    assert any("stats.json: missing" in m for m in _messages(tiny_copy))


def _drop_feature(root, name):
    info = json.loads((root / "meta/info.json").read_text())
    del info["features"][name]
    (root / "meta/info.json").write_text(json.dumps(info))


def test_a_column_not_declared_in_info_json(tiny_copy):
    _drop_feature(tiny_copy, "action")  # the column is still in the parquet
    [msg] = _messages(tiny_copy)
    assert DATA in msg and "column 'action' not declared in meta/info.json features" in msg


def test_a_camera_s_videos_not_declared_in_info_json(tiny_copy):
    _drop_feature(tiny_copy, "observation.images.wrist")  # its videos are still on disk
    [msg] = _messages(tiny_copy)
    assert "videos/observation.images.wrist/chunk-000/file-000.mp4: videos of camera 'observation.images.wrist'" in msg


@pytest.mark.parametrize("breakage", ["column", "camera", "fps", "nan"])
def test_train_and_stats_refuse_what_validate_calls_an_error(tiny_copy, tmp_path, capsys, breakage):
    if breakage == "column":
        _drop_feature(tiny_copy, "action")
    elif breakage == "nan":
        rewrite_parquet(tiny_copy / DATA, _with_value("action", 3, 0, np.nan))
    elif breakage == "camera":
        _drop_feature(tiny_copy, "observation.images.wrist")
    else:  # info.json says 30 fps, the data steps at 10 Hz
        info = json.loads((tiny_copy / "meta/info.json").read_text())
        info["fps"] = 30
        (tiny_copy / "meta/info.json").write_text(json.dumps(info))
    stats_before = (tiny_copy / "meta/stats.json").read_bytes()
    run = tmp_path / "run"
    assert main(["train", f"--run_dir={run}", "--steps=1", f"--dataset.roots=[{tiny_copy}]", "--progress=false"]) == 2
    err = capsys.readouterr().err
    assert f"{tiny_copy}: not a valid dataset" in err and len(err.strip().splitlines()) == 1
    assert not run.exists()  # refused before config.yaml or anything else
    assert main(["data", "stats", str(tiny_copy)]) == 2
    assert "not a valid dataset" in capsys.readouterr().err
    assert (tiny_copy / "meta/stats.json").read_bytes() == stats_before


def test_a_missing_video_stops_train_before_config_yaml(tiny_copy, tmp_path):
    (tiny_copy / "videos/observation.images.front/chunk-000/file-000.mp4").unlink()
    assert main(["train", f"--run_dir={tmp_path / 'run'}", "--steps=1", f"--dataset.roots=[{tiny_copy}]"]) == 2
    assert not (tmp_path / "run").exists()


def test_validate_reads_the_frames_through_the_column_cache(tiny_copy, monkeypatch):
    from kilovla.data.columns import dataset_cache_dir
    from kilovla.data.meta import DatasetMeta

    def no_copy(*a, **k):
        raise AssertionError("read the numeric columns into memory")

    monkeypatch.setattr(DatasetMeta, "load_columns", no_copy)
    assert _messages(tiny_copy) == []
    assert (dataset_cache_dir("columns", tiny_copy) / "manifest.json").is_file()


def test_frame_data_the_cache_refuses_is_named_as_the_reader_names_it(tiny_copy):
    from kilovla.data.columns import dataset_cache_dir

    rewrite_parquet(tiny_copy / DATA, lambda t: t.slice(0, len(t) - 3))
    [msg] = _messages(tiny_copy)
    assert msg.endswith("data: column 'observation.state' has 84 rows, episodes need 87"), msg
    cache = dataset_cache_dir("columns", tiny_copy)
    assert not cache.exists() and not list(cache.parent.glob(f".{cache.name}*.tmp"))  # nothing half-written


@pytest.mark.parametrize("column", ["frame_index", "timestamp", "task_index"])
def test_each_check_names_its_first_bad_row_whatever_the_block_size(tiny_copy, monkeypatch, column):
    from kilovla.data import validate

    row = 41  # in the third block of 16 rows, episode 1 or 2
    def bad(t):
        values = np.asarray(t.column(column)).copy()
        values[row:] = {"frame_index": 0, "timestamp": 99.0, "task_index": 7}[column]
        return set_column(t, column, values)

    rewrite_parquet(tiny_copy / DATA, bad)
    whole = _messages(tiny_copy)
    monkeypatch.setattr(validate, "CHECK_ROWS", 16)
    assert _messages(tiny_copy) == whole and len(whole) == 1 and f"at row {row}" in whole[0]


def _with_value(column, row, dim, value):
    def fn(t):
        values = np.array(t.column(column).to_pylist(), dtype=np.float32)
        values[row, dim] = value
        return set_column(t, column, list(values))
    return fn


@pytest.mark.parametrize("column,value,shown", [("action", np.nan, "nan"), ("observation.state", np.inf, "inf")])
def test_a_non_finite_value_is_named_by_file_column_row_and_dimension(tiny_copy, monkeypatch, column, value, shown):
    from kilovla.data import validate

    rewrite_parquet(tiny_copy / DATA, _with_value(column, 41, 2, value))
    whole = _messages(tiny_copy)
    monkeypatch.setattr(validate, "CHECK_ROWS", 16)  # found the same in blocks
    assert _messages(tiny_copy) == whole and len(whole) == 1
    assert whole[0].startswith(f"{tiny_copy / DATA}: {column}[2] is {shown} at row 41 of the file (index 41, episode")


def test_a_nan_timestamp_is_not_taken_for_a_good_one(tiny_copy):
    def fn(t):
        values = np.asarray(t.column("timestamp")).copy()
        values[7] = np.nan  # |nan - expected| > tolerance is False: the step check alone lets it through
        return set_column(t, "timestamp", values)

    rewrite_parquet(tiny_copy / DATA, fn)
    [msg] = _messages(tiny_copy)
    assert "timestamp is nan at row 7 of the file" in msg


def test_stats_json_with_nan_is_invalid(tiny_copy):
    stats = json.loads((tiny_copy / "meta/stats.json").read_text())
    stats["action"]["mean"][0] = float("nan")
    (tiny_copy / "meta/stats.json").write_text(json.dumps(stats))  # Python writes NaN, and reads it back
    [msg] = _messages(tiny_copy)
    assert msg.endswith("stats.json: stats of 'action' are not finite numbers (mean): "
                        "`kilovla data stats PATH` recomputes them")


def test_data_stats_refuses_a_nan_in_one_line_and_keeps_stats_json(tiny_copy, capsys):
    rewrite_parquet(tiny_copy / DATA, _with_value("action", 5, 1, np.nan))
    before = (tiny_copy / "meta/stats.json").read_bytes()
    assert main(["data", "stats", str(tiny_copy)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"{tiny_copy / DATA}: action[1] is nan at row 5 of the file" in err
    assert (tiny_copy / "meta/stats.json").read_bytes() == before


def test_dataset_stats_refuse_a_nan_the_caller_did_not_validate(tiny_copy):
    from kilovla.data.lerobot import LeRobotDataset
    from kilovla.data.stats import compute_dataset_stats
    from kilovla.errors import DatasetError

    rewrite_parquet(tiny_copy / DATA, _with_value("observation.state", 30, 0, -np.inf))
    with pytest.raises(DatasetError, match=r"file-000.parquet: observation.state\[0\] is -inf at row 30 of the file"):
        compute_dataset_stats(LeRobotDataset(tiny_copy))


def _corrupt_frame(video, frame: int) -> None:
    """Scramble the bytes of one frame's packet in the middle of an mp4 (its first and last frames intact)."""
    import av

    with av.open(str(video)) as c:
        packets = [(p.pos, p.size) for p in c.demux(c.streams.video[0]) if p.size]
    pos, size = packets[frame]
    data = bytearray(video.read_bytes())
    data[pos:pos + size] = bytes(b ^ 0x5A for b in data[pos:pos + size])
    video.write_bytes(bytes(data))


def test_deep_decodes_every_frame_and_names_the_one_that_fails(tiny_copy):
    video = tiny_copy / "videos/observation.images.front/chunk-000/file-000.mp4"
    _corrupt_frame(video, 8)  # episode 0 has 12 or more frames: 8 is neither its first nor its last
    [msg] = _messages(tiny_copy, deep=True)
    assert msg.startswith(f"{video}: episode 0 of observation.images.front: frame 8 (t=0.8000 s in the file) "
                          "does not decode"), msg


def test_deep_reads_each_episode_in_blocks_and_finds_the_same_frame(tiny_copy, monkeypatch):
    from kilovla.data import validate

    _corrupt_frame(tiny_copy / "videos/observation.images.wrist/chunk-000/file-000.mp4", 8)
    whole = _messages(tiny_copy, deep=True)
    monkeypatch.setattr(validate, "DECODE_FRAMES", 3)
    assert _messages(tiny_copy, deep=True) == whole and "frame 8 (" in whole[0]


def test_data_stats_names_only_the_frames_that_fail_without_the_decoder_s_source(tiny_copy, capsys):
    from kilovla.data.video import torchcodec_available

    if not torchcodec_available():
        pytest.skip("torchcodec does not load here: data stats decodes with PyAV")
    video = tiny_copy / "videos/observation.images.front/chunk-000/file-000.mp4"
    for frame in range(20, 26):
        _corrupt_frame(video, frame)
    assert main(["data", "stats", "--dry_run", str(tiny_copy)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"error: {video}: cannot decode frame") and len(err.splitlines()) == 1
    assert ".cpp" not in err, err
    spans, asked = re.search(r"cannot decode frames? ([\d, -]+) \(of (\d+) asked\)", err).groups()
    named = sum(int(b) - int(a) + 1 for a, _, b in (s.partition("-") if "-" in s else (s, "", s)
                                                       for s in spans.split(", ")))
    assert 0 < named < int(asked), err  # the ones that fail, not every frame the call asked for


def test_frame_lists_are_runs():
    from kilovla.data.video import _decoder_words, _spans

    assert _spans([9, 3, 4, 5, 11, 12]) == "3-5, 9, 11-12"
    raised = RuntimeError("decodeAVFrame, /__w/torchcodec/src/torchcodec/_core/SingleStreamDecoder.cpp:1436, "
                          "Could not push packet to decoder: Invalid data")
    assert _decoder_words(raised) == "Could not push packet to decoder: Invalid data"
