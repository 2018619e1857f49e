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


def test_videos_are_av1_with_a_keyframe_every_two_frames_of_each_episode(tiny_root):
    """Each episode is its own stretch of stream: it starts on a keyframe (a seek never decodes the
    episode before), then one every 2 frames."""
    lengths = LeRobotDataset(tiny_root).meta.episodes.length
    with av.open(str(tiny_root / "videos/observation.images.front/chunk-000/file-000.mp4")) as c:
        stream = c.streams.video[0]
        assert stream.codec_context.name in ("libdav1d", "av1")
        keys = [p.is_keyframe for p in c.demux(stream) if p.size]
    assert len(keys) == sum(lengths)
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    for start, n in zip(starts, lengths):
        assert keys[start:start + n] == [i % 2 == 0 for i in range(n)]


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


def test_one_encoder_is_alive_at_a_time_and_segments_join_in_order(tmp_path, monkeypatch):
    """SVT-AV1 instances share global state: a process holding several can hang in the encoder. Two
    cameras, four episodes, a file roll: never two encoders open, and each episode decodes from where
    meta/episodes says it is."""
    import kilovla.data.writer as writer_mod

    live, most = [0], [0]

    class Counted(writer_mod.VideoEncoder):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            live[0] += 1
            most[0] = max(most[0], live[0])

        def close(self):
            super().close()
            live[0] -= 1

    monkeypatch.setattr(writer_mod, "VideoEncoder", Counted)
    features = {**FEATURES, "observation.images.wrist": {"dtype": "video", "shape": [32, 32, 3]}}
    rng = np.random.default_rng(0)
    w = DatasetWriter(tmp_path / "ds", fps=10, features=features, video_files_size_in_mb=0)
    shades = []
    for ep in range(4):
        shade = 40 + 50 * ep  # one flat grey per episode, so a frame tells which episode it came from
        shades.append(shade)
        for _ in range(3 + ep):
            frame = _frame(rng)
            frame["observation.images.front"] = np.full((64, 96, 3), shade, np.uint8)
            frame["observation.images.wrist"] = np.full((32, 32, 3), shade, np.uint8)
            w.add_frame(frame)
        w.save_episode()
    root = w.finalize()
    assert most[0] == 1 and live[0] == 0
    assert not (root / "segments").exists()
    ds = LeRobotDataset(root, video_backend="pyav")
    eps = ds.meta.episodes
    for key in ("observation.images.front", "observation.images.wrist"):
        assert len(set(eps.video_file[key])) == 4  # a 0 MB limit: a file per episode
    w = DatasetWriter(tmp_path / "one", fps=10, features=features)
    for ep in range(3):
        for _ in range(5):
            frame = _frame(rng)
            frame["observation.images.wrist"] = np.full((32, 32, 3), shades[ep], np.uint8)
            w.add_frame(frame)
        w.save_episode()
    ds = LeRobotDataset(w.finalize(), video_backend="pyav")
    assert len(set(ds.meta.episodes.video_file["observation.images.wrist"])) == 1
    for index in range(len(ds)):
        image = ds[index]["observation.images.wrist"]  # float CHW in [0, 1]
        assert abs(float(image.mean()) * 255 - shades[ds[index]["episode_index"].item()]) < 4, index
