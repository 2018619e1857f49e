"""Frame decoding: exact frames, bounded decoder cache, fork safety."""

import multiprocessing as mp

import numpy as np
import pytest

from kilovla.data.lerobot import LeRobotDataset
from kilovla.data.video import VideoDecoderPool, torchcodec_available


def _sequential(path):
    import av

    with av.open(path) as c:
        return np.stack([f.to_ndarray(format="rgb24") for f in c.decode(video=0)])


def test_random_access_returns_the_same_frames_as_a_full_decode(tiny_root):
    path = str(tiny_root / "videos/observation.images.front/chunk-000/file-000.mp4")
    every = _sequential(path)
    rng = np.random.default_rng(0)
    wanted = rng.integers(0, len(every), 40)
    pool = VideoDecoderPool("pyav")
    got = pool.read(path, wanted / 10.0)
    np.testing.assert_array_equal(got, every[wanted])


def test_the_decoder_cache_is_bounded(tiny_root, tmp_path):
    import shutil

    paths = []
    for i in range(5):
        p = tmp_path / f"v{i}.mp4"
        shutil.copy(tiny_root / "videos/observation.images.front/chunk-000/file-000.mp4", p)
        paths.append(str(p))
    pool = VideoDecoderPool("pyav", max_open=2)
    for p in paths:
        pool.read(p, np.array([0.0]))
    assert pool.open_files == 2


def _child_read(ds, out):
    out.put(ds.get_batch(np.array([3]))["observation.images.front"].sum().item())


def test_a_forked_worker_never_uses_the_parents_decoders(tiny_root):
    ds = LeRobotDataset(tiny_root)
    want = ds.get_batch(np.array([3]))["observation.images.front"].sum().item()  # parent opens decoders
    parent_readers = dict(ds.decoder_pool._readers)
    q = mp.get_context("fork").Queue()
    child = mp.get_context("fork").Process(target=_child_read, args=(ds, q))
    child.start()
    got = q.get(timeout=60)
    child.join(60)
    assert child.exitcode == 0 and got == want
    assert ds.decoder_pool._readers == parent_readers  # the parent's cache is untouched


@pytest.mark.skipif(not torchcodec_available(), reason="torchcodec does not load with this torch")
def test_torchcodec_backend_agrees_with_pyav(tiny_root):
    a = LeRobotDataset(tiny_root, video_backend="pyav").get_batch(np.arange(10))
    b = LeRobotDataset(tiny_root, video_backend="torchcodec").get_batch(np.arange(10))
    assert np.abs(a["observation.images.front"].astype(int) - b["observation.images.front"]).max() <= 1


class _LateFlush:
    """A stream whose flush hands back its packets out of decode order, as SVT-AV1's threads can on a busy
    CPU (seen in CI: frame 32's packet before frames 8..31, frame 7's after 31)."""

    def __init__(self, stream):
        self._stream, self.codec_context = stream, stream.codec_context
        self._held = []

    def encode(self, frame=None):
        self._held += self._stream.encode(frame)
        if frame is not None:
            return []
        held, self._held = self._held, []
        return held[len(held) // 2:] + held[:len(held) // 2][::-1]


@pytest.mark.parametrize("codec", ["libsvtav1", "libx264"])
def test_packets_handed_back_out_of_order_are_written_in_decode_order(tmp_path, codec):
    import av

    from kilovla.data.video import VideoEncoder

    ramp = np.linspace(0, 60, 32)[None, :, None] + np.zeros((32, 32, 3))
    frames = [(ramp + 8 * i).astype(np.uint8) for i in range(24)]  # a ramp that brightens frame by frame
    with VideoEncoder(tmp_path / "v.mp4", 32, 32, 10, codec=codec) as enc:
        enc._stream = _LateFlush(enc._stream)
        for f in frames:
            enc.add(f)
    with av.open(str(tmp_path / "v.mp4")) as container:
        decoded = [f.to_ndarray(format="rgb24") for f in container.decode(video=0)]
    assert len(decoded) == len(frames)
    errors = [np.abs(d.astype(int) - f.astype(int)).mean() for d, f in zip(decoded, frames)]
    assert max(errors) < 3, errors  # each frame decodes to its own image, in its own place
