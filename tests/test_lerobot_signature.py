"""`LeRobotDataset` takes LeRobot's signature: a repo id with `root=` the folder, LeRobot's argument order,
LeRobot's download folder for a bare repo id; kilovla's `LeRobotDataset(path)` keeps working."""

import shutil

import numpy as np
import pytest

from kilovla.data.lerobot import LeRobotDataset, lerobot_home
from kilovla.errors import KilovlaError

REQUEST = {"action": [0.0, 0.1], "observation.images.front": [0.0]}


def _same_samples(a, b, positions=(0, 5, 11)):
    got, want = a.get_batch(np.array(positions)), b.get_batch(np.array(positions))
    assert got.keys() == want.keys()
    for key in want:
        np.testing.assert_array_equal(got[key], want[key], err_msg=key)


def test_a_repo_id_with_root_reads_the_root_folder(tiny_root):
    ds = LeRobotDataset("someone/tiny", root=tiny_root, episodes=[1, 2], delta_timestamps=REQUEST,
                        video_backend="pyav", frame_cache=None)
    assert ds.repo_id == "someone/tiny" and ds.root == str(tiny_root) and ds.num_episodes == 2
    _same_samples(ds, LeRobotDataset(tiny_root, episodes=[1, 2], delta_timestamps=REQUEST, video_backend="pyav",
                                     frame_cache=None))


def test_lerobots_positional_order_repo_id_root_episodes_transforms_delta_timestamps(tiny_root):
    ds = LeRobotDataset("someone/tiny", tiny_root, [3], None, REQUEST, frame_cache=None)
    assert ds.num_episodes == 1 and ds.delta_timestamps == REQUEST


def test_a_bare_repo_id_is_read_from_lerobots_download_folder(tiny_root, tmp_path, monkeypatch):
    monkeypatch.delenv("HF_LEROBOT_HOME", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    assert lerobot_home() == tmp_path / "hf" / "lerobot"
    shutil.copytree(tiny_root, tmp_path / "hf/lerobot/someone/tiny")
    monkeypatch.chdir(tmp_path)  # no ./someone/tiny here
    ds = LeRobotDataset("someone/tiny", frame_cache=None)
    assert ds.root == str(tmp_path / "hf/lerobot/someone/tiny") and ds.num_frames > 0
    monkeypatch.setenv("HF_LEROBOT_HOME", str(tmp_path / "elsewhere"))  # LeRobot's override wins over HF_HOME
    assert lerobot_home() == tmp_path / "elsewhere"


def test_a_folder_that_exists_is_read_as_the_dataset_even_when_it_looks_like_a_repo_id(tiny_root, tmp_path,
                                                                                      monkeypatch):
    monkeypatch.setenv("HF_LEROBOT_HOME", str(tmp_path / "hub"))  # holds nothing
    shutil.copytree(tiny_root, tmp_path / "someone/tiny")
    monkeypatch.chdir(tmp_path)
    assert LeRobotDataset("someone/tiny", frame_cache=None).root == "someone/tiny"


def test_a_repo_id_that_is_nowhere_is_one_line_saying_nothing_is_downloaded(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_LEROBOT_HOME", str(tmp_path / "hub"))
    monkeypatch.chdir(tmp_path)
    with pytest.raises(KilovlaError) as e:
        LeRobotDataset("lerobot/pusht")
    assert str(e.value).startswith(f"lerobot/pusht: no such folder, and no dataset of that repo id at "
                                   f"{tmp_path}/hub/lerobot/pusht (kilovla does not download: pass root=")


def test_a_revision_or_cache_sync_which_need_a_download_are_refused(tiny_root):
    with pytest.raises(KilovlaError, match="revision= and force_cache_sync= need a download"):
        LeRobotDataset("someone/tiny", root=tiny_root, revision="v3.0")
    with pytest.raises(KilovlaError, match="reads local datasets only"):
        LeRobotDataset("someone/tiny", root=tiny_root, force_cache_sync=True)


def test_kilovlas_old_positional_delta_timestamps_is_a_clear_type_error(tiny_root):
    with pytest.raises(TypeError, match="root= must be a folder, got a dict; LeRobot's order is"):
        LeRobotDataset(tiny_root, REQUEST)
