"""`kilovla data validate` finds each kind of problem and names the file."""

import json

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


@pytest.mark.parametrize("breakage", ["column", "camera", "fps"])
def test_train_and_stats_refuse_what_validate_calls_an_error(tiny_copy, tmp_path, capsys, breakage):
    if breakage == "column":
        _drop_feature(tiny_copy, "action")
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
