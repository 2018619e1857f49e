"""Small synthetic LeRobot v3.0 datasets for tests, the demo and benchmarks (no downloads).

Frames look like simple rendered scenes (a smooth background, a moving object), so codecs compress and
decode them the way they do real robot video; random noise would be 5-10x slower to decode and
would make every decode benchmark meaningless.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from kilovla.data.writer import DatasetWriter
from kilovla.errors import KilovlaError

DEFAULT_TASKS = ("pick up the red cube", "open the top drawer", "push the puck to the goal",
                 "put the bowl on the plate and close the microwave door")


def render_frame(height: int, width: int, t: int, xy: np.ndarray, hue: int) -> np.ndarray:
    """A gradient background with a disc at `xy` (in [-1, 1]^2): uint8 (H, W, 3)."""
    yy, xx = np.mgrid[0:height, 0:width]
    img = np.empty((height, width, 3), dtype=np.uint8)
    img[..., 0] = (xx * 255 // max(width - 1, 1) + t) % 256
    img[..., 1] = (yy * 255 // max(height - 1, 1) + hue) % 256
    img[..., 2] = hue % 256
    cx, cy = (xy[0] + 1) / 2 * (width - 1), (xy[1] + 1) / 2 * (height - 1)
    r = max(2, min(height, width) // 8)
    img[(xx - cx) ** 2 + (yy - cy) ** 2 < r * r] = (250, 40, 40)
    return img


def check_synthetic_args(*, episodes: int, frames: tuple[int, int], fps: int, cameras: tuple[str, ...],
                         resolution: tuple[int, int], codec: str, shown=None) -> None:
    """KilovlaError naming the flag when no dataset can be made of these (`data synth` checks them first);
    `shown(key, value)`: the flag as the user typed it (default `--key=value`).

    >>> check_synthetic_args(episodes=2, frames=(50, 10), fps=10, cameras=("front",), resolution=(96, 96),
    ...                      codec="libsvtav1")
    Traceback (most recent call last):
    kilovla.errors.KilovlaError: --min_frames=50 is above --max_frames=10
    """
    shown = shown or (lambda key, value: f"--{key}={value}")
    lo, hi = frames
    if episodes < 1:
        raise KilovlaError(f"{shown('episodes', episodes)}: must be at least 1")
    if lo < 1:
        raise KilovlaError(f"{shown('min_frames', lo)}: an episode needs at least 1 frame")
    if lo > hi:
        raise KilovlaError(f"{shown('min_frames', lo)} is above {shown('max_frames', hi)}")
    if fps < 1:
        raise KilovlaError(f"{shown('fps', fps)}: must be at least 1")
    # The encoders refuse smaller frames (SVT-AV1 below 4 pixels; H.264's yuv420p needs even sizes).
    if min(resolution) < 4:
        raise KilovlaError(f"{shown('resolution', min(resolution))}: frames must be at least 4 pixels a side")
    if codec == "libx264" and any(n % 2 for n in resolution):
        raise KilovlaError(f"{shown('resolution', max(n for n in resolution if n % 2))}: libx264 (yuv420p) needs "
                           "an even number of pixels a side")
    if not all(cameras) or len(set(cameras)) != len(cameras):
        raise KilovlaError(f"{shown('cameras', ','.join(cameras))}: camera names must be non-empty and distinct")


def make_synthetic_dataset(root: str | Path, *, episodes: int = 4, frames: int | tuple[int, int] = (20, 40),
                           fps: int = 10, cameras: tuple[str, ...] = ("front", "wrist"),
                           resolution: tuple[int, int] = (64, 96), state_dim: int = 6, action_dim: int = 6,
                           tasks: tuple[str, ...] = DEFAULT_TASKS, codec: str = "libsvtav1", seed: int = 0,
                           overwrite: bool = False, progress=None) -> Path:
    """Write a dataset of `episodes` episodes with a random length in `frames` (inclusive range).

    `progress(i, n)` is called after each episode when given. Arguments no dataset can be made of
    raise KilovlaError naming the `kilovla data synth` flag, before anything is written.
    """
    lo, hi = (frames, frames) if isinstance(frames, int) else frames
    check_synthetic_args(episodes=episodes, frames=(lo, hi), fps=fps, cameras=cameras, resolution=resolution,
                         codec=codec)
    rng = np.random.default_rng(seed)
    h, w = resolution
    features = {
        "observation.state": {"dtype": "float32", "shape": [state_dim], "names": [f"s{i}" for i in range(state_dim)]},
        "action": {"dtype": "float32", "shape": [action_dim], "names": [f"a{i}" for i in range(action_dim)]},
    }
    for cam in cameras:
        features[f"observation.images.{cam}"] = {"dtype": "video", "shape": [h, w, 3]}
    writer = DatasetWriter(root, fps=fps, features=features, robot_type="synthetic", video_codec=codec,
                           overwrite=overwrite)
    try:
        for ep in range(episodes):
            n = int(rng.integers(lo, hi + 1))
            task = tasks[ep % len(tasks)]
            state = rng.uniform(-0.5, 0.5, state_dim).astype(np.float32)
            for t in range(n):
                action = (0.1 * np.sin(np.arange(action_dim) + 0.2 * t + ep)).astype(np.float32)
                frame = {"observation.state": state.copy(), "action": action, "task": task}
                for c, cam in enumerate(cameras):
                    frame[f"observation.images.{cam}"] = render_frame(h, w, t + 7 * c, state[:2], 60 * c + 20 * ep)
                writer.add_frame(frame)
                state = np.clip(state + action[:state_dim] if action_dim >= state_dim else state, -1, 1)
            writer.save_episode()
            if progress is not None:
                progress(ep + 1, episodes)
        return writer.finalize()
    except BaseException:
        writer.abort()
        raise
