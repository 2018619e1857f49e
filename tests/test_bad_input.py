"""Broken datasets: one DatasetError naming the file and the problem."""

import json

import numpy as np
import pytest

from conftest import rewrite_parquet, set_column
from kilovla.data.lerobot import LeRobotDataset
from kilovla.errors import DatasetError

DATA = "data/chunk-000/file-000.parquet"
EPISODES = "meta/episodes/chunk-000/file-000.parquet"


def _edit_info(root, fn):
    path = root / "meta/info.json"
    info = json.loads(path.read_text())
    fn(info)
    path.write_text(json.dumps(info))


def test_missing_info_json(tiny_copy):
    (tiny_copy / "meta/info.json").unlink()
    with pytest.raises(DatasetError, match=r"meta/info.json: missing"):
        LeRobotDataset(tiny_copy)


def test_corrupt_info_json(tiny_copy):
    (tiny_copy / "meta/info.json").write_text("{not json")
    with pytest.raises(DatasetError, match=r"meta/info.json: not valid JSON"):
        LeRobotDataset(tiny_copy)


def test_corrupt_parquet(tiny_copy):
    (tiny_copy / DATA).write_bytes(b"PAR1 garbage")
    with pytest.raises(DatasetError, match=r"file-000.parquet: cannot read parquet"):
        LeRobotDataset(tiny_copy)


def test_shape_disagreeing_with_info(tiny_copy):
    _edit_info(tiny_copy, lambda i: i["features"]["action"].update(shape=[7]))
    with pytest.raises(DatasetError, match=r"file-000.parquet: feature 'action' has 6 values per row, info.json says shape \[7\]"):
        LeRobotDataset(tiny_copy)


def test_dtype_disagreeing_with_info(tiny_copy):
    _edit_info(tiny_copy, lambda i: i["features"]["observation.state"].update(dtype="float64"))
    with pytest.raises(DatasetError, match=r"'observation.state' is stored as float32, info.json says float64"):
        LeRobotDataset(tiny_copy)


def test_missing_column(tiny_copy):
    rewrite_parquet(tiny_copy / DATA, lambda t: t.drop_columns(["action"]))
    with pytest.raises(DatasetError, match=r"file-000.parquet: column 'action' .* is missing"):
        LeRobotDataset(tiny_copy)


def test_episode_index_gap(tiny_copy):
    rewrite_parquet(tiny_copy / EPISODES,
                    lambda t: set_column(t, "episode_index", [0, 1, 3, 4]))
    with pytest.raises(DatasetError, match=r"meta/episodes: episode_index is not contiguous: episode 2 is missing"):
        LeRobotDataset(tiny_copy)


def test_missing_video_file_is_named_when_decoding(tiny_copy):
    (tiny_copy / "videos/observation.images.wrist/chunk-000/file-000.mp4").unlink()
    ds = LeRobotDataset(tiny_copy)
    with pytest.raises(DatasetError, match=r"observation.images.wrist/chunk-000/file-000.mp4: video file is missing"):
        ds[0]


def test_corrupt_video_file(tiny_copy):
    (tiny_copy / "videos/observation.images.front/chunk-000/file-000.mp4").write_bytes(b"\x00" * 1000)
    ds = LeRobotDataset(tiny_copy)
    with pytest.raises(DatasetError, match=r"file-000.mp4: cannot open video"):
        ds[0]


def test_video_fps_not_matching_the_table(tiny_copy):
    # Claim 20 fps: timestamps of the table now fall between the video's frames.
    _edit_info(tiny_copy, lambda i: i.update(fps=20))
    rewrite_parquet(tiny_copy / DATA, lambda t: set_column(
        t, "timestamp", (np.asarray(t.column("frame_index")) / 20.0).astype(np.float32)))
    ds = LeRobotDataset(tiny_copy)
    with pytest.raises(DatasetError, match=r"fps or timestamps disagree"):
        ds[1]
