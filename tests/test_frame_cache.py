"""The decoded-frame cache: bit-identical frames, Ray Data build, refusal of stale / partial caches."""

import json
import shutil
import subprocess
import sys

import numpy as np
import pytest

from kilovla.data import DataLake, GlobalBatchPlan, InProcessLoader, LakeSource, PlanConfig, TokenLayout
from kilovla.data.frame_cache import MANIFEST, build_frame_cache, default_cache_dir, ray_task_failure
from kilovla.data.lerobot import LeRobotDataset
from kilovla.data.video import VideoEncoder, torchcodec_available
from kilovla.errors import DatasetError, KilovlaError

REQUEST = {"action": [0.0, 0.1, 0.2], "observation.images.front": [-0.2, -0.1, 0.0], "observation.images.wrist": [0.0]}
FRONT_VIDEO = "videos/observation.images.front/chunk-000/file-000.mp4"


@pytest.fixture
def cached(tiny_copy, tmp_path):
    """A writable dataset and its frame cache, built in this process."""
    out = tmp_path / "cache"
    build_frame_cache(tiny_copy, out, backend="pyav", engine="local")
    return tiny_copy, out


def _every_position(ds):
    return np.arange(len(ds))


def test_cached_frames_are_bit_identical_to_decoded_ones(cached):
    root, out = cached
    video = LeRobotDataset(root, delta_timestamps=REQUEST, video_backend="pyav", frame_cache=None)
    cache = LeRobotDataset(root, delta_timestamps=REQUEST, frame_cache=out)
    assert cache.frame_cache is not None and video.frame_cache is None
    positions = np.random.default_rng(0).permutation(_every_position(video))  # every row, shuffled
    a, b = video.get_batch(positions), cache.get_batch(positions)
    assert set(a) == set(b)
    for key in a:
        if a[key].dtype == object:
            assert a[key].tolist() == b[key].tolist()
        else:
            np.testing.assert_array_equal(a[key], b[key], err_msg=key)
    assert a["observation.images.front"].shape[1] == 3  # a time window, padded at episode starts
    assert cache.frame_cache.frames_read == len(positions) * 4 and video.decoder_pool.frames_decoded > 0
    assert cache._pool is None  # nothing was decoded


def test_the_open_cache_holds_nothing_per_frame(cached):
    root, out = cached
    ds = LeRobotDataset(root, frame_cache=out)
    held = [v for v in vars(ds.frame_cache).values() if isinstance(v, np.ndarray)]
    assert sum(a.size for a in held) <= ds.meta.episodes.length.size  # row -> episode by search, not a table
    assert len(ds) > 2 * ds.num_episodes


def test_cached_items_equal_decoded_items_for_other_delta_settings(cached):
    root, out = cached
    other = {"observation.images.front": [0.0, 0.3], "observation.images.wrist": [-0.5, 0.0]}
    video = LeRobotDataset(root, delta_timestamps=other, video_backend="pyav", frame_cache=None)
    cache = LeRobotDataset(root, delta_timestamps=other, frame_cache=out)
    for i in (0, 5, len(video) - 1):
        for key, value in video[i].items():
            if key != "task":
                assert cache[i][key].equal(value), (i, key)


@pytest.mark.skipif(not torchcodec_available(), reason="torchcodec does not load with this torch")
def test_a_torchcodec_cache_matches_torchcodec_decoding(tiny_copy, tmp_path):
    build_frame_cache(tiny_copy, tmp_path / "tc", backend="torchcodec", engine="local")
    video = LeRobotDataset(tiny_copy, delta_timestamps=REQUEST, video_backend="torchcodec", frame_cache=None)
    cache = LeRobotDataset(tiny_copy, delta_timestamps=REQUEST, video_backend="torchcodec", frame_cache=tmp_path / "tc")
    positions = _every_position(video)
    for key in ("observation.images.front", "observation.images.wrist"):
        np.testing.assert_array_equal(video.get_batch(positions)[key], cache.get_batch(positions)[key])


def test_the_loader_reads_the_cache_and_yields_the_same_rows(cached):
    root, out = cached
    layout = TokenLayout(tokens_per_camera=32, action_horizon=3)
    rows = {}
    for name, setting in (("video", None), ("cache", str(out))):
        lake = DataLake([LakeSource(root=str(root), delta_timestamps=REQUEST, frame_cache=setting)], layout,
                        video_backend="pyav")
        plan = GlobalBatchPlan.from_lake(lake, PlanConfig(seed=2, global_batch_size=16, token_budget=512))
        rows[name] = list(InProcessLoader(lake, plan, steps=2))
    assert len(rows["video"]) == len(rows["cache"]) > 2
    for a, b in zip(rows["video"], rows["cache"]):
        np.testing.assert_array_equal(a["sample_index"], b["sample_index"])
        np.testing.assert_array_equal(a["observation.images.front"], b["observation.images.front"])


def test_auto_finds_the_cache_at_the_default_location(tiny_copy, tmp_path, monkeypatch):
    monkeypatch.setenv("KILOVLA_CACHE_DIR", str(tmp_path / "caches"))
    assert LeRobotDataset(tiny_copy).frame_cache is None  # nothing built yet: decode
    result = build_frame_cache(tiny_copy, engine="local")
    assert result.path == default_cache_dir(tiny_copy) and result.path.is_relative_to(tmp_path / "caches")
    assert LeRobotDataset(tiny_copy).frame_cache.path == result.path
    assert LeRobotDataset(tiny_copy, frame_cache=None).frame_cache is None


def test_a_rebuild_decodes_only_the_parts_of_a_changed_video(cached):
    root, out = cached
    again = build_frame_cache(root, out, backend="pyav", engine="local")
    assert again.decoded == 0 and again.parts == 8  # 2 cameras x 4 episodes, all still valid
    _reencode_front(root)
    rebuilt = build_frame_cache(root, out, backend="pyav", engine="local")
    assert rebuilt.decoded == 4  # the front camera's episodes only
    video = LeRobotDataset(root, video_backend="pyav", frame_cache=None)
    cache = LeRobotDataset(root, frame_cache=out)
    np.testing.assert_array_equal(video.get_batch(np.arange(len(video)))["observation.images.front"],
                                  cache.get_batch(np.arange(len(video)))["observation.images.front"])


def _reencode_front(root):
    """Re-encode the front camera's video (same frames, H.264 instead of AV1): other bytes, same times."""
    ds = LeRobotDataset(root, video_backend="pyav", frame_cache=None)
    frames = ds.get_batch(np.arange(len(ds)))["observation.images.front"]
    path = root / FRONT_VIDEO
    h, w, _ = frames.shape[1:]
    tmp = path.with_suffix(".tmp.mp4")
    enc = VideoEncoder(tmp, w, h, int(ds.fps), codec="libx264")
    for frame in 255 - frames:  # different pixels, so the cached frames are really stale
        enc.add(frame)
    enc.close()
    tmp.replace(path)


# -- bad input: one message naming the file, nothing read ---------------------------------------------
def test_a_changed_source_video_is_refused(cached):
    root, out = cached
    _reencode_front(root)
    with pytest.raises(DatasetError, match=r"file-000.mp4: changed since the frame cache was built "
                                           r"\(\d+ bytes, \d+ then\)"):
        LeRobotDataset(root, frame_cache=out)


def test_same_size_other_content_is_refused(cached):
    root, out = cached
    path = root / FRONT_VIDEO
    data = bytearray(path.read_bytes())
    data[-10] ^= 0xFF  # same size; the mtime moves, so the content is hashed again
    path.write_bytes(bytes(data))
    with pytest.raises(DatasetError, match=r"file-000.mp4: changed since the frame cache was built \(same size"):
        LeRobotDataset(root, frame_cache=out)


def test_a_truncated_part_is_refused(cached):
    root, out = cached
    part = out / "observation.images.wrist/episode_000002.npy"
    part.write_bytes(part.read_bytes()[:1000])
    with pytest.raises(DatasetError, match=r"episode_000002.npy: truncated or overwritten: 1000 bytes"):
        LeRobotDataset(root, frame_cache=out)


def test_a_missing_part_is_refused(cached):
    root, out = cached
    (out / "observation.images.front/episode_000001.npy").unlink()
    with pytest.raises(DatasetError, match=r"episode_000001.npy: missing from the frame cache"):
        LeRobotDataset(root, frame_cache=out)


def test_a_partial_cache_without_manifest_is_refused(cached):
    root, out = cached
    (out / MANIFEST).unlink()  # what an interrupted build leaves
    with pytest.raises(DatasetError, match=r"manifest.json: missing: .* is incomplete"):
        LeRobotDataset(root, frame_cache=out)


def test_a_cache_of_another_resolution_is_refused(cached, tmp_path):
    root, out = cached
    manifest = json.loads((out / MANIFEST).read_text())
    manifest["cameras"]["observation.images.front"]["shape"] = [32, 48, 3]
    (out / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(DatasetError, match=r"manifest.json: holds 32x48 frames of observation.images.front, "
                                           r"the dataset's info.json says 64x96"):
        LeRobotDataset(root, frame_cache=out)


def test_a_cache_of_other_cameras_is_refused(tiny_copy, tmp_path):
    build_frame_cache(tiny_copy, tmp_path / "front", cameras=["observation.images.front"], engine="local")
    with pytest.raises(DatasetError, match=r"holds no frames of observation.images.wrist"):
        LeRobotDataset(tiny_copy, frame_cache=tmp_path / "front")


def test_a_cache_of_another_dataset_is_refused(cached, tmp_path):
    root, out = cached
    other = tmp_path / "other"
    shutil.copytree(root, other)
    table_path = other / "data/chunk-000/file-000.parquet"
    import pyarrow.parquet as pq

    from conftest import set_column

    table = pq.read_table(table_path)
    ts = table.column("timestamp").to_numpy().copy()
    ts[3] += 1e-5  # within tolerance for decoding, but not the timestamps the cache was built from
    pq.write_table(set_column(table, "timestamp", ts), table_path)
    with pytest.raises(DatasetError, match=r"episode_000000.npy: was decoded for other rows or timestamps of episode 0"):
        LeRobotDataset(other, frame_cache=out)


def test_an_explicit_other_backend_is_refused(cached):
    root, out = cached
    with pytest.raises(DatasetError, match=r"frames were decoded with pyav, this dataset asks for "
                                           r"video_backend='torchcodec'"):
        LeRobotDataset(root, frame_cache=out, video_backend="torchcodec")


def test_a_default_location_cache_of_another_backend_is_passed_over_with_one_warning(tiny_copy, tmp_path,
                                                                                    monkeypatch, caplog):
    monkeypatch.setenv("KILOVLA_CACHE_DIR", str(tmp_path / "caches"))
    build_frame_cache(tiny_copy, backend="pyav", engine="local")  # where "auto" looks
    with caplog.at_level("WARNING", logger="kilovla.data.frame_cache"):
        ds = LeRobotDataset(tiny_copy, delta_timestamps=REQUEST, video_backend="torchcodec")
    assert ds.frame_cache is None and ds.video_backend == "torchcodec"
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1 and "frames were decoded with pyav, this dataset asks for video_backend='torchcodec'" \
        in warnings[0]
    assert LeRobotDataset(tiny_copy, video_backend="pyav").frame_cache is not None  # its own backend: used


def test_cli_stale_cache_exits_2_with_one_line(cached):
    root, out = cached
    _reencode_front(root)
    proc = subprocess.run([sys.executable, "-m", "kilovla", "data", "bench", str(root), "--quick",
                           f"--output_dir={out.parent / 'bench'}", f"--frame_cache={out}"], capture_output=True, text=True)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines() == [
        f"error: {root / FRONT_VIDEO}: changed since the frame cache was built "
        f"({(root / FRONT_VIDEO).stat().st_size} bytes, {_manifest_size(out)} then): rebuild it with "
        f"`kilovla data cache {root} --output_dir={out}`"]


def _manifest_size(out):
    return json.loads((out / MANIFEST).read_text())["videos"][FRONT_VIDEO]["size"]


@pytest.mark.ray
@pytest.mark.shares_cpu  # the cache's bytes, nothing timed
def test_cli_builds_the_cache_with_ray_data(tiny_copy, tmp_path):
    out = tmp_path / "ray-cache"
    proc = subprocess.run([sys.executable, "-m", "kilovla", "data", "cache", str(tiny_copy), f"--output_dir={out}",
                           "--backend=pyav", "--json"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    summary = json.loads(proc.stdout)
    assert summary["engine"] == "ray" and summary["parts"] == 8 and summary["decoded_now"] == 8
    assert "starting a local Ray" in proc.stderr  # no cluster given: said so in one line
    assert summary["cache_bytes"] == sum(p.stat().st_size for p in out.rglob("*.npy"))
    local = tmp_path / "local-cache"
    build_frame_cache(tiny_copy, local, backend="pyav", engine="local")
    for part in local.rglob("*.npy"):
        np.testing.assert_array_equal(np.load(part), np.load(out / part.relative_to(local)))


class _RayTaskError(Exception):
    """Shaped like Ray's: the task's exception as `.cause`, everything in one long str()."""

    def __init__(self, text, cause=None):
        super().__init__(text)
        self.cause = cause


def test_a_failed_ray_task_becomes_its_one_line_error():
    inner = DatasetError("/data/videos/front.mp4", "corrupt video")
    assert ray_task_failure(_RayTaskError("ray::Map(decode)() ... long traceback", inner)) is inner
    wrapped = _RayTaskError("ray::Map(decode)()\nSystem error: No module named 'kilovla.data.frame_cache'\ntraceback")
    err = ray_task_failure(wrapped)
    assert isinstance(err, KilovlaError) and str(err) == (
        "the Ray cluster's workers cannot import kilovla.data.frame_cache: install this kilovla (same version) "
        "on every node of the cluster")
    assert ray_task_failure(_RayTaskError("out of memory")) is None  # not the user's input: keep Ray's error


# -- the review's defects: the user's files, "auto" fallback, corrupt parts, touched videos -----------
def test_cli_refuses_a_non_empty_folder_that_is_not_a_cache_and_touches_nothing(tiny_copy, tmp_path):
    mine = tmp_path / "mine"
    (mine / "sub").mkdir(parents=True)
    np.save(mine / "weights.npy", np.arange(3))
    (mine / ".notes.tmp").write_text("keep")
    (mine / "empty").mkdir()
    before = sorted(str(p.relative_to(mine)) for p in mine.rglob("*"))
    proc = subprocess.run([sys.executable, "-m", "kilovla", "data", "cache", str(tiny_copy), f"--output_dir={mine}",
                           "--local"], capture_output=True, text=True)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines() == [
        f"error: {mine}: the folder is not empty and holds no frame cache (manifest.json); "
        "pick an empty or new folder for --output_dir"]
    assert sorted(str(p.relative_to(mine)) for p in mine.rglob("*")) == before


def test_a_rebuild_removes_only_files_the_cache_accounts_for(cached):
    root, out = cached
    stranger = out / "observation.images.front" / "episode_000099.npy"  # put there by hand, not listed
    np.save(stranger, np.zeros(2, np.uint8))
    (out / "README.txt").write_text("mine")
    (out / "observation.images.front" / ".episode_000001.npy.0123abcd.tmp").write_bytes(b"half")  # a killed task's
    build_frame_cache(root, out, cameras=["observation.images.front"], backend="pyav", engine="local")
    assert stranger.exists() and (out / "README.txt").exists()
    assert not (out / "observation.images.front" / ".episode_000001.npy.0123abcd.tmp").exists()
    assert not (out / "observation.images.wrist").exists()  # listed by the old manifest, no longer used
    assert not (out / ".kilovla-frame-cache-building.json").exists()


def test_an_interrupted_build_can_be_resumed_in_its_folder(cached, monkeypatch):
    root, out = cached
    import kilovla.data.frame_cache as fc

    def dies(*a, **k):
        raise RuntimeError("killed")

    _reencode_front(root)
    monkeypatch.setattr(fc, "decode_episode_parts", dies)
    with pytest.raises(RuntimeError):
        build_frame_cache(root, out, backend="pyav", engine="local")
    assert not (out / MANIFEST).exists()
    monkeypatch.undo()
    again = build_frame_cache(root, out, backend="pyav", engine="local")
    assert again.decoded == 4  # the wrist parts are still reused from the marker's manifest


def test_auto_falls_back_to_decoding_with_one_warning(tiny_copy, tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("KILOVLA_CACHE_DIR", str(tmp_path / "caches"))
    build_frame_cache(tiny_copy, cameras=["observation.images.front"], engine="local")  # a partial cache
    with caplog.at_level("WARNING", logger="kilovla.data.frame_cache"):
        ds = LeRobotDataset(tiny_copy, delta_timestamps=REQUEST, video_backend="pyav")
    assert ds.frame_cache is None
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1 and "holds no frames of observation.images.wrist" in warnings[0]
    reference = LeRobotDataset(tiny_copy, delta_timestamps=REQUEST, video_backend="pyav", frame_cache=None)
    np.testing.assert_array_equal(ds[3]["observation.images.wrist"], reference[3]["observation.images.wrist"])
    (default_cache_dir(tiny_copy) / MANIFEST).unlink()  # an interrupted build
    assert LeRobotDataset(tiny_copy, video_backend="pyav").frame_cache is None
    with pytest.raises(DatasetError, match="missing"):  # named explicitly: refused
        LeRobotDataset(tiny_copy, frame_cache=default_cache_dir(tiny_copy))


def test_a_rebuild_decodes_a_part_corrupted_in_place_again(cached):
    root, out = cached
    part = out / "observation.images.wrist/episode_000002.npy"
    good = part.read_bytes()
    data = bytearray(good)
    data[-5] ^= 0xFF  # same size, one frame byte
    part.write_bytes(bytes(data))
    again = build_frame_cache(root, out, backend="pyav", engine="local")
    assert again.decoded == 1 and part.read_bytes() == good


def test_a_corrupt_part_header_is_refused_at_open(cached):
    root, out = cached
    part = out / "observation.images.wrist/episode_000002.npy"
    data = bytearray(part.read_bytes())
    header = bytes(data[:128]).replace(b"'shape': (", b"'shape': (9")  # same size, another shape
    data[:128] = header[:128]  # the padding absorbs the extra digit
    part.write_bytes(bytes(data))
    with pytest.raises(DatasetError, match=r"episode_000002.npy: header says a uint8 array of shape \(9"):
        LeRobotDataset(root, frame_cache=out)


def test_a_touched_video_is_hashed_once_then_its_new_mtime_is_recorded(cached, monkeypatch):
    root, out = cached
    import os

    import kilovla.data.frame_cache as fc

    path = root / FRONT_VIDEO
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    hashed = []
    real = fc.sha256_file
    monkeypatch.setattr(fc, "sha256_file", lambda p, *a: hashed.append(str(p)) or real(p, *a))
    LeRobotDataset(root, frame_cache=out)
    assert hashed == [str(path)]
    assert json.loads((out / MANIFEST).read_text())["videos"][FRONT_VIDEO]["mtime_ns"] == st.st_mtime_ns + 10**9
    LeRobotDataset(root, frame_cache=out)
    assert hashed == [str(path)]  # not again
