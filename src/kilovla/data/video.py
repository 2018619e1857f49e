"""Video frames in and out of LeRobot mp4 files.

Reading: `VideoDecoderPool.read(path, timestamps)` returns the frames shown at the given timestamps
as uint8 HWC arrays, decoding each file once per call in one forward pass (seek only where the next
wanted frame is far ahead). Two backends:

- ``pyav`` (default): PyAV, whose wheel bundles FFmpeg with the AV1 (dav1d) and H.264 decoders.
- ``torchcodec``: used when it imports against the installed torch; approximate seek mode.

Open decoders live in a small per-process LRU. A pool notices when it is used in a forked child and
drops whatever it inherited, so a decoder opened in a parent never reaches a DataLoader worker (that
is the "Could not push packet to decoder" crash LeRobot users hit).

Writing: `VideoEncoder` appends frames to one mp4 (AV1 via SVT-AV1 or H.264 via x264, a keyframe
every `gop` frames, yuv420p), which is how several episodes share one file in LeRobot v3.0.
`concat_videos` joins mp4 files without re-encoding (used by the v2.1 -> v3.0 converter).
"""

from __future__ import annotations

import logging
import os
import re
import threading
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Protocol

import numpy as np

from kilovla.errors import DatasetError

log = logging.getLogger(__name__)

# SVT-AV1 prints its whole configuration to stderr for every encoder unless told not to.
os.environ.setdefault("SVT_LOG", "1")

# Decoding forward over a few frames is cheaper than a seek, which flushes the decoder.
MAX_FORWARD_FRAMES = 4

CODEC_NAMES = {"libsvtav1": "av1", "libaom-av1": "av1", "libx264": "h264", "h264": "h264"}


class FrameReader(Protocol):
    def read(self, timestamps: np.ndarray, tolerance_s: float) -> np.ndarray: ...

    def close(self) -> None: ...


def _no_frame(path: str, t: float, got: float | None, tolerance_s: float) -> DatasetError:
    if got is None:
        return DatasetError(path, f"no frame at t={t:.4f}s: past the end of the video")
    return DatasetError(
        path,
        f"no frame within {tolerance_s}s of t={t:.4f}s (nearest {got:.4f}s); "
        "the video's fps or timestamps disagree with the data table",
    )


def _open_url(url: str):
    """A file object for an fsspec URL (s3://, gs://, memory://...), which PyAV reads like a file."""
    import fsspec

    try:
        return fsspec.open(url, "rb").open()
    except FileNotFoundError:
        raise DatasetError(url, "video file is missing") from None


class PyAVReader:
    """One open mp4, read forward; seeks only backwards or far ahead."""

    def __init__(self, path: str):
        import av
        from av.video.reformatter import VideoReformatter

        self.path = path
        try:
            self._container = av.open(_open_url(path) if "://" in path else path)
            self._stream = self._container.streams.video[0]
        except (av.error.FFmpegError, IndexError, OSError) as e:
            raise DatasetError(path, f"cannot open video: {e}") from None
        # One thread per decoder: parallelism comes from decoding several files at once.
        self._stream.codec_context.thread_count = 1
        # One reformatter per reader keeps its swscale context; `to_ndarray(format=...)` builds a
        # new one for every frame, which costs as much as decoding the frame (same pixels either way).
        self._rgb = VideoReformatter()
        self._time_base = float(self._stream.time_base)
        rate = self._stream.average_rate or self._stream.guessed_rate
        self._frame_s = 1.0 / float(rate) if rate else 0.0
        self._frames = None  # decode generator, positioned after self._last
        self._last = None  # (time, frame) of the last decoded frame

    def read(self, timestamps: np.ndarray, tolerance_s: float) -> np.ndarray:
        """Frames shown at `timestamps` (sorted ascending, seconds) as (n, H, W, 3) uint8."""
        import av

        out = []
        try:
            for t in timestamps:
                out.append(self._rgb.reformat(self._frame_at(float(t), tolerance_s), format="rgb24").to_ndarray())
        except av.error.FFmpegError as e:
            self._frames = self._last = None
            raise DatasetError(self.path, f"corrupt video: {e}") from None
        return np.stack(out)

    def _frame_at(self, t: float, tolerance_s: float):
        last = self._last
        if last is not None and abs(last[0] - t) < tolerance_s:
            return last[1]
        if last is None or t < last[0] or t - last[0] > MAX_FORWARD_FRAMES * self._frame_s:
            self._container.seek(max(0, int((t - tolerance_s) / self._time_base)), stream=self._stream, backward=True)
            self._frames = self._container.decode(self._stream)
            self._last = None
        for frame in self._frames:
            ft = float(frame.pts * self._time_base)
            self._last = (ft, frame)
            if ft >= t - tolerance_s:
                if abs(ft - t) >= tolerance_s:
                    raise _no_frame(self.path, t, ft, tolerance_s)
                return frame
        self._last = None
        raise _no_frame(self.path, t, None, tolerance_s)

    def close(self) -> None:
        self._container.close()


class TorchCodecReader:
    """torchcodec's decoder in approximate seek mode, frames picked as LeRobot picks them."""

    def __init__(self, path: str):
        from torchcodec.decoders import VideoDecoder

        self.path = path
        try:
            self._decoder = VideoDecoder(path, seek_mode="approximate", dimension_order="NHWC", num_ffmpeg_threads=1)
        except Exception as e:  # torchcodec raises RuntimeError/ValueError for unreadable files
            raise DatasetError(path, f"cannot open video: {e}") from None
        self._fps = float(self._decoder.metadata.average_fps)

    def read(self, timestamps: np.ndarray, tolerance_s: float) -> np.ndarray:
        indices = [round(float(t) * self._fps) for t in timestamps]
        try:
            batch = self._decoder.get_frames_at(indices=indices)
        except (IndexError, RuntimeError) as e:
            failed = self._failing(indices) or indices  # none fails alone: name the call's
            raise DatasetError(self.path, f"cannot decode frame{'s' if len(failed) > 1 else ''} {_spans(failed)} "
                                          f"(of {len(indices)} asked): {_decoder_words(e)}") from None
        got = batch.pts_seconds.numpy()
        for t, g in zip(timestamps, got):
            if abs(float(g) - float(t)) >= tolerance_s:
                raise _no_frame(self.path, float(t), float(g), tolerance_s)
        return batch.data.numpy()

    def _failing(self, indices: list[int]) -> list[int]:
        """The frames of a failed call that fail alone: what the error names, not every frame asked."""
        failed = []
        for i in indices:
            try:
                self._decoder.get_frames_at(indices=[i])
            except (IndexError, RuntimeError):
                failed.append(i)
        return failed

    def close(self) -> None:
        pass


def _spans(indices: list[int]) -> str:
    """Frame indices as runs: [3, 4, 5, 9] -> '3-5, 9'."""
    runs: list[list[int]] = []
    for i in sorted(set(indices)):
        if runs and i == runs[-1][1] + 1:
            runs[-1][1] = i
        else:
            runs.append([i, i])
    return ", ".join(f"{a}-{b}" if b > a else f"{a}" for a, b in runs)


def _decoder_words(e: Exception) -> str:
    """torchcodec's message without its C++ function and source location ('decodeAVFrame,
    /__w/.../SingleStreamDecoder.cpp:1436, Could not push packet...' -> 'Could not push packet...')."""
    return re.sub(r"^(?:\w+, )?\S+\.(?:cpp|cc|c|h|hpp):\d+,\s*", "", str(e)).strip()


def torchcodec_available() -> bool:
    """True when torchcodec imports and its native library loads against this torch."""
    try:
        import torchcodec.decoders  # noqa: F401  (loads the C++ ops; fails on a torch mismatch)
    except Exception as e:  # ImportError, OSError, RuntimeError depending on what is missing
        log.debug("torchcodec unavailable: %s", e)
        return False
    return True


def resolve_backend(backend: str) -> str:
    """'auto' -> torchcodec when usable else pyav; an explicit torchcodec falls back loudly."""
    if backend not in ("auto", "pyav", "torchcodec"):
        raise ValueError(f"video backend must be auto, pyav or torchcodec, not {backend!r}")
    if backend == "pyav":
        return "pyav"
    if torchcodec_available():
        return "torchcodec"
    if backend == "torchcodec":
        log.warning("video backend 'torchcodec' requested but it does not load with this torch; using PyAV")
    return "pyav"


class VideoDecoderPool:
    """Per-process LRU of open readers, keyed by file path.

    >>> pool = VideoDecoderPool(max_open=8)
    >>> frames = pool.read("videos/cam/chunk-000/file-000.mp4", np.array([0.0, 0.1]))  # doctest: +SKIP
    >>> frames.shape, frames.dtype  # doctest: +SKIP
    ((2, 224, 224, 3), dtype('uint8'))
    """

    def __init__(self, backend: str = "auto", max_open: int = 32, threads: int = 2):
        self.backend = resolve_backend(backend)
        self.max_open = max_open
        self.threads = threads
        self._pid = os.getpid()
        self._readers: OrderedDict[str, FrameReader] = OrderedDict()
        self._locks: dict[str, threading.Lock] = {}
        self._lock = threading.Lock()
        self._executor: ThreadPoolExecutor | None = None
        self.frames_decoded = 0

    def _check_fork(self) -> None:
        if os.getpid() != self._pid:
            # Inherited through fork: the parent's decoders are not ours to use (nor to close).
            self._readers = OrderedDict()
            self._locks = {}
            self._lock = threading.Lock()
            self._executor = None
            self._pid = os.getpid()

    def _reader(self, path: str) -> tuple[FrameReader, threading.Lock]:
        with self._lock:
            reader = self._readers.get(path)
            if reader is not None:
                self._readers.move_to_end(path)
                return reader, self._locks[path]
        reader = TorchCodecReader(path) if self.backend == "torchcodec" else PyAVReader(path)
        with self._lock:
            self._readers[path] = reader
            self._locks[path] = threading.Lock()
            while len(self._readers) > self.max_open:
                old_path, old = self._readers.popitem(last=False)
                self._locks.pop(old_path)
                old.close()
            return reader, self._locks[path]

    @property
    def open_files(self) -> int:
        return len(self._readers)

    def read(self, path: str, timestamps: np.ndarray, tolerance_s: float = 1e-4) -> np.ndarray:
        """Frames at `timestamps` (any order, repeats allowed) as (n, H, W, 3) uint8."""
        self._check_fork()
        timestamps = np.asarray(timestamps, dtype=np.float64)
        unique, inverse = np.unique(timestamps, return_inverse=True)
        if "://" not in path and not os.path.exists(path):
            raise DatasetError(path, "video file is missing")
        reader, lock = self._reader(path)
        with lock:
            frames = reader.read(unique, tolerance_s)
        self.frames_decoded += len(unique)
        if len(unique) == len(timestamps) and np.all(timestamps[1:] > timestamps[:-1]):
            return frames  # already sorted and distinct: no gather copy
        return frames[inverse]

    def read_many(self, requests: list[tuple[str, np.ndarray]], tolerance_s: float = 1e-4) -> list[np.ndarray]:
        """`read` for several files at once, in parallel threads (decoding releases the GIL)."""
        self._check_fork()
        if len(requests) <= 1 or self.threads <= 1:
            return [self.read(p, t, tolerance_s) for p, t in requests]
        if self._executor is None:
            self._executor = ThreadPoolExecutor(self.threads, thread_name_prefix="kilovla-decode")
        futures = [self._executor.submit(self.read, p, t, tolerance_s) for p, t in requests]
        return [f.result() for f in futures]

    def close(self) -> None:
        with self._lock:
            for reader in self._readers.values():
                reader.close()
            self._readers.clear()
            self._locks.clear()


class VideoEncoder:
    """Appends RGB frames to one mp4: yuv420p, a keyframe every `gop` frames.

    Defaults follow LeRobot's: AV1 through SVT-AV1, crf 30, preset 12, g=2.

    Packets are held and written in decode (dts) order at `close`: SVT-AV1's threads can hand back its
    last packets out of order when the flush races a busy CPU (seen: frame 32 before 8..31, 7 after 31),
    which the mp4 muxer refuses as "non monotonically increasing dts". An episode's packets are a few
    KB a frame, so holding them costs little.
    """

    def __init__(self, path: str | Path, width: int, height: int, fps: int, codec: str = "libsvtav1",
                 crf: int = 30, gop: int = 2, preset: int = 12):
        import av

        if codec not in CODEC_NAMES:
            raise ValueError(f"video codec must be one of {sorted(CODEC_NAMES)}, not {codec!r}")
        self.path = str(path)
        options = {"g": str(gop), "crf": str(crf)}
        if codec == "libsvtav1":
            options["preset"] = str(preset)
        elif codec == "libx264":
            options["preset"] = "veryfast"
        self._container = av.open(self.path, "w")
        self._stream = self._container.add_stream(codec, rate=fps, options=options)
        self._stream.width, self._stream.height = width, height
        self._stream.pix_fmt = "yuv420p"
        self.frames = 0
        self.bytes_written = 0
        self._packets = []

    def add(self, frame: np.ndarray) -> None:
        import av

        video_frame = av.VideoFrame.from_ndarray(np.ascontiguousarray(frame), format="rgb24")
        self._hold(self._stream.encode(video_frame))
        self.frames += 1

    def _hold(self, packets) -> None:
        for packet in packets:
            self.bytes_written += packet.size
            self._packets.append(packet)

    def close(self) -> None:
        self._hold(self._stream.encode())
        self._packets.sort(key=lambda p: p.dts)
        dts = [p.dts for p in self._packets]
        if any(a >= b for a, b in zip(dts, dts[1:])):
            raise RuntimeError(f"{self.path}: the {self._stream.codec_context.name} encoder gave two packets "
                               "the same decode timestamp")
        for packet in self._packets:
            self._container.mux(packet)
        self._packets = []
        self._container.close()

    def __enter__(self) -> VideoEncoder:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
            return
        try:  # closing a broken encoder must not hide the original error
            self._container.close()
        except Exception:
            pass


def probe_video(path: str | Path) -> dict:
    """Codec, size, fps, frame count and duration of an mp4's first video stream."""
    import av

    try:
        with av.open(str(path)) as container:
            stream = container.streams.video[0]
            rate = stream.average_rate or stream.guessed_rate
            frames = stream.frames
            duration = float(stream.duration * stream.time_base) if stream.duration else None
            return {
                "codec": stream.codec_context.name.replace("libdav1d", "av1").replace("libaom-av1", "av1"),
                "width": stream.codec_context.width,
                "height": stream.codec_context.height,
                "pix_fmt": stream.codec_context.pix_fmt,
                "fps": float(rate) if rate else None,
                "frames": frames,
                "duration_s": duration,
            }
    except (av.error.FFmpegError, IndexError) as e:
        raise DatasetError(path, f"cannot read video: {e}") from None


def concat_videos(inputs: list[str | Path], output: str | Path) -> list[float]:
    """Join mp4 files that share codec and size into `output` without re-encoding.

    Returns each input's start time in the output (seconds), the `from_timestamp` LeRobot v3.0
    stores per episode.
    """
    import av

    starts: list[float] = []
    with av.open(str(inputs[0])) as first:
        template = first.streams.video[0]
        out = av.open(str(output), "w")
        out_stream = out.add_stream_from_template(template, opaque=True)
    offset_s = 0.0
    try:
        for path in inputs:
            with av.open(str(path)) as container:
                stream = container.streams.video[0]
                tb = stream.time_base
                rate = stream.average_rate or stream.guessed_rate
                starts.append(offset_s)
                shift = round(offset_s / tb)
                last_end = 0
                for packet in container.demux(stream):
                    if packet.dts is None:
                        continue
                    end = packet.pts + (packet.duration or round(1 / (rate * tb)))
                    last_end = max(last_end, end)
                    packet.pts += shift
                    packet.dts += shift
                    packet.stream = out_stream
                    out.mux(packet)
                offset_s += float(last_end * tb)
    except av.error.FFmpegError as e:
        out.close()
        raise DatasetError(path, f"cannot remux video: {e}") from None
    out.close()
    return starts
