"""Our reader against what LeRobot 0.4.4's own LeRobotDataset returned for the shared fixture.

Every test runs on both decoders. `make test` installs torchcodec and sets
KILOVLA_REQUIRE_TORCHCODEC=1, so there a torchcodec that fails to load is a failure, not a skip.
"""

import json
import os

import numpy as np
import pytest
import torch

from kilovla.data.lerobot import LeRobotDataset
from kilovla.data.video import torchcodec_available


@pytest.fixture(params=["pyav", "torchcodec"])
def backend(request):
    if request.param == "torchcodec" and not torchcodec_available():
        if os.environ.get("KILOVLA_REQUIRE_TORCHCODEC") == "1":
            pytest.fail("torchcodec does not load (KILOVLA_REQUIRE_TORCHCODEC=1): see `make system` / `make venv`")
        pytest.skip("torchcodec does not load with this torch")
    return request.param


@pytest.fixture
def _load(backend):
    def load(lerobot_fixture, lerobot_expected):
        request = json.loads(str(lerobot_expected["delta_timestamps"]))
        ds = LeRobotDataset(lerobot_fixture, delta_timestamps=request, video_backend=backend, frame_cache=None)
        assert ds.decoder_pool.backend == backend
        return ds

    return load


def test_items_have_the_keys_lerobot_returns(_load, lerobot_fixture, lerobot_expected):
    ds = _load(lerobot_fixture, lerobot_expected)
    for i in lerobot_expected["indices"]:
        expected = {k.split("|", 1)[1] for k in lerobot_expected if k.startswith(f"{i}|")}
        assert set(ds[int(i)]) == expected


def test_numbers_equal_lerobot_exactly(_load, lerobot_fixture, lerobot_expected):
    ds = _load(lerobot_fixture, lerobot_expected)
    checked = 0
    for i in lerobot_expected["indices"]:
        item = ds[int(i)]
        for key, value in item.items():
            if "images" in key and not key.endswith("_is_pad"):
                continue
            want = lerobot_expected[f"{i}|{key}"]
            if key == "task":
                assert value == str(want)
                continue
            got = value.numpy()
            assert got.dtype == want.dtype, key
            assert got.shape == want.shape, key
            np.testing.assert_array_equal(got, want, err_msg=f"item {i} {key}")
            checked += 1
    assert checked == len(lerobot_expected["indices"]) * 11


def test_camera_frames_within_one_level_of_lerobot(_load, lerobot_fixture, lerobot_expected):
    ds = _load(lerobot_fixture, lerobot_expected)
    for i in lerobot_expected["indices"]:
        item = ds[int(i)]
        for key in ("observation.images.front", "observation.images.wrist"):
            got = item[key]
            assert got.dtype == torch.float32 and 0.0 <= got.min() and got.max() <= 1.0
            want = lerobot_expected[f"{i}|{key}"]
            assert tuple(got.shape) == want.shape, key  # one requested delta: no time axis
            diff = np.abs(np.round(got.numpy() * 255).astype(int) - want.astype(int))
            assert diff.max() <= 1, f"item {i} {key}: max diff {diff.max()}/255"


def test_camera_frames_equal_lerobots_exactly(_load, lerobot_fixture, lerobot_expected):
    ds = _load(lerobot_fixture, lerobot_expected)
    for i in lerobot_expected["indices"]:
        item = ds[int(i)]
        for key in ("observation.images.front", "observation.images.wrist"):
            got = np.round(item[key].numpy() * 255).astype(np.uint8)
            np.testing.assert_array_equal(got, lerobot_expected[f"{i}|{key}"], err_msg=f"item {i} {key}")
            assert torch.equal(item[key], torch.from_numpy(got) / 255.0)  # LeRobot's float32 division, bit for bit


def test_padding_masks_mark_frames_outside_the_episode(_load, lerobot_fixture, lerobot_expected):
    ds = _load(lerobot_fixture, lerobot_expected)
    first = ds[0]  # episode start: the past is padding
    assert first["observation.state_is_pad"].tolist() == [True, True, False]
    last = ds[39]  # last frame of episode 0 (40 frames): the future is padding
    assert last["action_is_pad"].tolist() == [False] + [True] * 7
    torch.testing.assert_close(last["action"][1:], last["action"][:1].expand(7, -1))  # clamped to the last frame


def test_without_delta_timestamps_items_are_single_frames(backend, lerobot_fixture):
    ds = LeRobotDataset(lerobot_fixture, video_backend=backend, frame_cache=None)
    item = ds[41]
    assert item["observation.state"].shape == (6,)
    assert item["observation.images.front"].shape == (3, 64, 96)
    assert item["episode_index"].item() == 1 and item["frame_index"].item() == 1
    assert item["task"] == "open the drawer"
