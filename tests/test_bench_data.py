"""The data suite's baselines load what LeRobot loads, and its rows are measured as named."""

import json
import os

import numpy as np
import pytest
import torch

from kilovla.bench.data import LeRobotVideoPath, PerSampleReader, sequential_decode
from kilovla.data.lerobot import LeRobotDataset
from kilovla.data.video import torchcodec_available

BACKENDS = ["pyav", pytest.param("torchcodec", marks=pytest.mark.skipif(
    not torchcodec_available() and os.environ.get("KILOVLA_REQUIRE_TORCHCODEC") != "1",
    reason="torchcodec does not load with this torch"))]


@pytest.fixture(autouse=True)
def one_torch_thread():
    """As in a DataLoader worker, where the baseline runs in the benchmark: LeRobot's many tiny torch
    ops crawl through torch's thread pool on a busy 2-core machine."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def fixture_ds(lerobot_fixture, lerobot_expected):
    request = json.loads(str(lerobot_expected["delta_timestamps"]))
    return LeRobotDataset(lerobot_fixture, delta_timestamps=request, video_backend="pyav", frame_cache=None)


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_lerobot_baseline_returns_lerobots_items(fixture_ds, lerobot_expected, backend):
    baseline = LeRobotVideoPath(fixture_ds, backend)
    for i in lerobot_expected["indices"]:
        item = baseline[int(i)]
        for key, value in item.items():
            want = lerobot_expected[f"{i}|{key}"]
            if key == "task":
                assert value == str(want)
            elif "images" in key and not key.endswith("_is_pad"):
                assert value.dtype == torch.float32 and tuple(value.shape) == want.shape, key
                np.testing.assert_array_equal(np.round(value.numpy() * 255).astype(np.uint8), want)
            else:
                assert value.numpy().dtype == want.dtype, key
                np.testing.assert_array_equal(value.numpy(), want, err_msg=f"item {i} {key}")


def test_the_naive_reader_returns_the_datasets_frames(fixture_ds, lerobot_expected):
    naive = PerSampleReader(fixture_ds)
    for i in lerobot_expected["indices"]:
        item, batch = naive.item(int(i)), fixture_ds.get_batch(np.array([int(i)]))
        for key in fixture_ds.camera_keys:
            np.testing.assert_array_equal(item[key].reshape(batch[key][0].shape), batch[key][0])
    assert naive.frames_decoded >= len(lerobot_expected["indices"]) * 2  # it decodes, and more than it keeps


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_decode_limit_decodes_every_frame_in_order(lerobot_fixture, backend):
    paths = [str(lerobot_fixture / f"videos/observation.images.{cam}/chunk-000/file-000.mp4") for cam in ("front", "wrist")]
    total = LeRobotDataset(lerobot_fixture, frame_cache=None).meta.total_frames  # one frame per row per camera
    frames, seconds = sequential_decode(paths, backend, max_frames=50)
    assert frames == 2 * min(50, total) and seconds > 0
    frames, _ = sequential_decode(paths[:1], backend, max_frames=10_000)
    assert frames == total


def test_decodes_per_sample_counts_each_gop_from_its_keyframe(tmp_path):
    from kilovla.bench.data import _keyframe_of, decodes_per_sample
    from kilovla.data.lake import DataLake, LakeSource, TokenLayout
    from kilovla.data.plan import GlobalBatchPlan, PlanConfig
    from kilovla.data.synthetic import make_synthetic_dataset

    root = make_synthetic_dataset(tmp_path / "ds", episodes=2, frames=(11, 13), fps=10, resolution=(32, 32),
                                  cameras=("front",))
    request = {"observation.images.front": [-0.1, 0.0]}  # frames t-1 and t
    lake = DataLake([LakeSource(root=str(root), delta_timestamps=request, frame_cache=None)],
                    TokenLayout(tokens_per_camera=16, action_horizon=1))
    path = str(next(root.glob("videos/*/*/*.mp4")))
    key = _keyframe_of(path)
    ds = lake.datasets[0]
    starts = np.repeat(ds.meta.episodes.row_from, ds.meta.episodes.length)  # each episode's first frame in the file
    within = np.arange(len(key)) - starts
    keyframe = starts + within - within % 2  # the writer's gop=2, restarted at every episode
    assert key.tolist() == keyframe.tolist()
    plan = GlobalBatchPlan.from_lake(lake, PlanConfig(seed=0, global_batch_size=len(lake), token_budget=4096))
    assert len(plan.rank_rows(0, 0, 1)) == 1  # one row asks for every frame in order: each decoded once
    assert decodes_per_sample(lake, plan.rank_rows(0, 0, 1)) == pytest.approx(1.0)
    rows = [np.array([g]) for g in range(len(lake))]  # one sample a request: random access
    # expected: each row's distinct frames in order, a frame continuing its GOP after the previous one costs
    # the gap, else it decodes from its keyframe
    expected = 0
    for row in rows:
        frames = set()
        for g in row:
            rec = ds.positions_to_rows(np.array([g]))[0]
            ep = ds.episode_of_rows(np.array([rec]))[0]
            first = ds.meta.episodes.row_from[ep]
            t = rec - first + round(ds.meta.episodes.video_from_s["observation.images.front"][ep] * 10)
            frames |= {max(t - 1, t - (rec - first)), t}  # t-1 clamps to the episode's first frame
        at = None
        for f in sorted(frames):
            expected += f - at if at is not None and keyframe[f] == keyframe[at] else f - keyframe[f] + 1
            at = f
    assert decodes_per_sample(lake, rows) == pytest.approx(expected / len(lake))
    assert 2 < decodes_per_sample(lake, rows) < 3
