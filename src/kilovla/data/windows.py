"""delta_timestamps -> frame windows and `<key>_is_pad` masks, exactly as LeRobot defines them.

A request like ``{"action": [0.0, 0.1, 0.2]}`` at fps 10 asks, for the frame at global row i, for the
rows i, i+1, i+2 of its episode. LeRobot's rules, which we follow to the letter:

- a delta d becomes the offset ``round(d * fps)``; d must be a multiple of 1/fps (within 1e-4 s);
- rows outside the episode are clamped to its first / last frame;
- ``<key>_is_pad`` is True where the offset fell outside the episode.

Example (episode covers rows [10, 15), anchor row 13, offsets [-1, 0, 1, 2, 3])::

    rows   = [12, 13, 14, 14, 14]
    is_pad = [F,  F,  F,  T,  T]

Everything here is vectorised over a batch of anchors: gathering 16-step windows for a batch costs
one fancy-index per column, not one Python loop per sample.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from kilovla.errors import KilovlaError

DELTA_TOLERANCE_S = 1e-4


def delta_indices(delta_timestamps: Mapping[str, Sequence[float]], fps: float,
                  tolerance_s: float = DELTA_TOLERANCE_S) -> dict[str, np.ndarray]:
    """Offsets in frames for each key; rejects deltas that are not multiples of 1/fps.

    >>> delta_indices({"action": [0.0, 0.1, 0.2]}, fps=10)
    {'action': array([0, 1, 2])}
    """
    out = {}
    for key, deltas in delta_timestamps.items():
        deltas = [float(d) for d in deltas]
        if not deltas:
            raise KilovlaError(f"delta_timestamps[{key!r}] is empty")
        bad = [d for d in deltas if abs(round(d * fps) / fps - d) > tolerance_s]
        if bad:
            raise KilovlaError(
                f"delta_timestamps[{key!r}]: {bad} are not multiples of 1/fps = {1 / fps:.6g} s "
                f"(tolerance {tolerance_s} s)"
            )
        out[key] = np.array([round(d * fps) for d in deltas], dtype=np.int64)
    return out


def window_rows(anchors: np.ndarray, episode_from: np.ndarray, episode_to: np.ndarray,
                offsets: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Rows of each anchor's window, clamped to its episode, and the padding mask.

    anchors, episode_from, episode_to: (B,) global rows; episode_to is exclusive.
    offsets: (K,). Returns rows (B, K) int64 and is_pad (B, K) bool.

    >>> window_rows(np.array([13]), np.array([10]), np.array([15]), np.array([-1, 0, 1, 2, 3]))
    (array([[12, 13, 14, 14, 14]]), array([[False, False, False,  True,  True]]))
    """
    wanted = anchors[:, None] + offsets[None, :]
    lo = episode_from[:, None]
    hi = episode_to[:, None] - 1
    is_pad = (wanted < lo) | (wanted > hi)
    return np.clip(wanted, lo, hi), is_pad
