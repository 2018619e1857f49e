"""DatasetWriter and the v2.1 -> v3.0 converter: LeRobot's layout, atomic writes."""

import json

import av
import numpy as np
import pyarrow.parquet as pq
import pytest

from kilovla.data.lerobot import LeRobotDataset
from kilovla.data.stats import QUANTILES
from kilovla.data.writer import DatasetWriter, convert_v21_to_v30
from kilovla.errors import KilovlaError

FEATURES = {
    "observation.state": {"dtype": "float32", "shape": [6]},
    "action": {"dtype": "float32", "shape": [6]},
    "observation.images.front": {"dtype": "video", "shape": [64, 96, 3]},
}


def _frame(rng, task="pick the cube"):
    return {"observation.state": rng.standard_normal(6).astype(np.float32),
            "action": rng.standard_normal(6).astype(np.float32),
            "observation.images.front": rng.integers(0, 255, (64, 96, 3), dtype=np.uint8), "task": task}


def test_layout_matches_what_lerobot_writes(tiny_root, lerobot_fixture):
    ours = json.loads((tiny_root / "meta/info.json").read_text())
    theirs = json.loads((lerobot_fixture / "meta/info.json").read_text())
    assert set(ours) == set(theirs)
    for key in ("data_path", "video_path", "chunks_size", "codebase_version"):
        assert ours[key] == theirs[key]
    assert ours["features"]["observation.images.front"]["info"].keys() == \
        theirs["features"]["observation.images.front"]["info"].keys()
    for rel in ("meta/episodes/chunk-000/file-000.parquet", "data/chunk-000/file-000.parquet", "meta/tasks.parquet"):
        a, b = pq.read_schema(tiny_root / rel), pq.read_schema(lerobot_fixture / rel)
        common = [n for n in b.names if n in a.names]
        assert [a.field(n).type for n in common] == [b.field(n).type for n in common], rel
        assert {n for n in b.names if not n.startswith("stats/")} <= set(a.names), rel


def test_videos_are_av1_with_a_keyframe_every_two_frames(tiny_root):
    with av.open(str(tiny_root / "videos/observation.images.front/chunk-000/file-000.mp4")) as c:
        stream = c.streams.video[0]
        assert stream.codec_context.name in ("libdav1d", "av1")
        keys = [p.is_keyframe for p in c.demux(stream) if p.size]
    assert keys[0::2] == [True] * len(keys[0::2])
    assert not any(keys[1::2])


def test_episodes_share_files_at_consecutive_timestamps(tiny_root):
    ds = LeRobotDataset(tiny_root)
    eps = ds.meta.episodes
    key = "observation.images.front"
    assert len(set(eps.video_file[key])) == 1
    np.testing.assert_allclose(eps.video_from_s[key][1:], eps.video_to_s[key][:-1])
    np.testing.assert_allclose(eps.video_to_s[key] - eps.video_from_s[key], eps.length / ds.fps)


def test_stats_have_lerobot_keys_and_shapes(tiny_root):
    stats = json.loads((tiny_root / "meta/stats.json").read_text())
    assert set(stats["action"]) == {"min", "max", "mean", "std", "count", *QUANTILES}
    assert np.asarray(stats["observation.images.front"]["mean"]).shape == (3, 1, 1)
    assert stats["action"]["count"] == [LeRobotDataset(tiny_root).num_frames]


def test_float_chw_frames_are_accepted_like_lerobot(tmp_path):
    rng = np.random.default_rng(0)
    w = DatasetWriter(tmp_path / "ds", fps=10, features=FEATURES)
    for _ in range(4):
        f = _frame(rng)
        f["observation.images.front"] = f["observation.images.front"].transpose(2, 0, 1) / 255.0
        w.add_frame(f)
    w.save_episode()
    assert LeRobotDataset(w.finalize())[0]["observation.images.front"].shape == (3, 64, 96)


def test_nothing_appears_at_root_until_finalize(tmp_path):
    rng = np.random.default_rng(0)
    w = DatasetWriter(tmp_path / "ds", fps=10, features=FEATURES)
    for _ in range(3):
        w.add_frame(_frame(rng))
    w.save_episode()
    assert not (tmp_path / "ds").exists()
    w.finalize()
    assert (tmp_path / "ds/meta/info.json").exists()
    assert [p.name for p in tmp_path.iterdir()] == ["ds"]


def test_an_error_leaves_nothing_behind(tmp_path):
    rng = np.random.default_rng(0)
    with pytest.raises(KilovlaError, match="shape"):
        with DatasetWriter(tmp_path / "ds", fps=10, features=FEATURES) as w:
            w.add_frame(_frame(rng))
            w.save_episode()
            bad = _frame(rng)
            bad["action"] = np.zeros(5, np.float32)
            w.add_frame(bad)
    assert list(tmp_path.iterdir()) == []


def test_existing_datasets_are_not_overwritten_by_default(tiny_root):
    with pytest.raises(KilovlaError, match="already exists"):
        DatasetWriter(tiny_root, fps=10, features=FEATURES)


def test_files_roll_over_at_the_size_limit(tmp_path):
    rng = np.random.default_rng(0)
    w = DatasetWriter(tmp_path / "ds", fps=10, features=FEATURES, video_files_size_in_mb=0, data_files_size_in_mb=0)
    for ep in range(3):
        for _ in range(4):
            w.add_frame(_frame(rng))
        w.save_episode()
    root = w.finalize()
    ds = LeRobotDataset(root)
    assert len(set(ds.meta.episodes.data_file)) == 3
    assert len(set(ds.meta.episodes.video_file["observation.images.front"])) == 3
    assert ds[9]["episode_index"].item() == 2 and ds[9]["frame_index"].item() == 1


def test_v21_converts_to_v30_without_changing_values(v21_root, tmp_path):
    out = convert_v21_to_v30(v21_root, tmp_path / "v3")
    old, new = LeRobotDataset(v21_root), LeRobotDataset(out)
    assert new.meta.version == "v3.0" and len(new) == len(old)
    assert len(set(new.meta.episodes.video_file["observation.images.front"])) == 1
    positions = np.arange(len(old))
    a, b = old.get_batch(positions), new.get_batch(positions)
    for key in ("action", "observation.state", "observation.images.front", "observation.images.wrist"):
        np.testing.assert_array_equal(a[key], b[key], err_msg=key)  # videos are remuxed, not re-encoded
    assert list(a["task"]) == list(b["task"])


def test_failed_conversion_writes_nothing(v21_root, tmp_path):
    import shutil

    broken = tmp_path / "broken"
    shutil.copytree(v21_root, broken)
    (broken / "videos/chunk-000/observation.images.wrist/episode_000002.mp4").unlink()
    with pytest.raises(KilovlaError, match="episode_000002.mp4: video file is missing"):
        convert_v21_to_v30(broken, tmp_path / "v3")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["broken"]
