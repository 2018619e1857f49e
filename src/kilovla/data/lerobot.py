"""LeRobot datasets (v3.0, and v2.1 for reading/converting) without importing lerobot.

The metadata (meta/, both versions) is read by `kilovla.data.meta`, the numeric columns are memory
maps of a column cache (`kilovla.data.columns`), the camera frames come from the videos or a frame
cache (`kilovla.data.frame_cache`).

`LeRobotDataset(root, delta_timestamps=...)` is a drop-in for LeRobot's class: it takes LeRobot's
signature (`LeRobotDataset(repo_id, root=..., episodes=..., delta_timestamps=..., video_backend=...)`)
and `ds[i]` returns the same keys and values. Nothing is downloaded: see `dataset_root` for where a
repo id is looked for. `ds.get_batch(positions)` is the fast path the loaders use: numeric columns are
gathered from their maps (one fancy-index per column for a whole batch), video frames are decoded
per file in one forward pass and stay uint8 HWC until the end. Position -> row -> episode is a search
over the episodes' offsets: nothing per frame is held in private memory.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from kilovla.data import windows
from kilovla.data.columns import ColumnStore, open_columns, prefetch_pages
from kilovla.data.frame_cache import resolve_frame_cache
from kilovla.data.meta import DatasetMeta, Feature
from kilovla.errors import KilovlaError


_REPO_ID = re.compile(r"[\w.-]+/[\w.-]+")


def lerobot_home() -> Path:
    """Where LeRobot keeps downloaded datasets: $HF_LEROBOT_HOME, else $HF_HOME/lerobot, else
    ~/.cache/huggingface/lerobot (LeRobot's own rule, so datasets it downloaded are found)."""
    if os.environ.get("HF_LEROBOT_HOME"):
        return Path(os.environ["HF_LEROBOT_HOME"]).expanduser()
    hf_home = os.environ.get("HF_HOME") or os.path.join(os.environ.get("XDG_CACHE_HOME") or "~/.cache", "huggingface")
    return Path(hf_home).expanduser() / "lerobot"


def dataset_root(repo_id: str | Path | None, root: str | Path | None = None) -> str | Path:
    """The folder (or fsspec URL) a `LeRobotDataset(repo_id, root=...)` reads.

    - `root` given: that folder; `repo_id` is only a name, as in LeRobot.
    - else `repo_id` is a path that exists, a URL, or not of the form "user/name": read as the folder
      itself (kilovla's own `LeRobotDataset("path/to/ds")`).
    - else (a repo id like "lerobot/pusht" that is no folder here): `lerobot_home() / repo_id`, where
      LeRobot downloads it; not there is a KilovlaError (nothing is downloaded).

    >>> dataset_root("lerobot/pusht", root="/data/pusht")
    '/data/pusht'
    """
    if root is not None:
        if not isinstance(root, (str, os.PathLike)):  # kilovla's old order had delta_timestamps second
            raise TypeError(f"root= must be a folder, got a {type(root).__name__}; LeRobot's order is (repo_id, "
                            "root, episodes, image_transforms, delta_timestamps, ...): pass delta_timestamps=")
        return root
    if repo_id is None:
        raise KilovlaError("LeRobotDataset needs a dataset: a folder, or a repo id with root=the folder")
    text = str(repo_id)
    if isinstance(repo_id, Path) or "://" in text or os.path.exists(text) or not _REPO_ID.fullmatch(text):
        return repo_id
    home = lerobot_home() / text
    if not home.exists():
        raise KilovlaError(f"{text}: no such folder, and no dataset of that repo id at {home} (kilovla does not "
                           f"download: pass root= the dataset's folder, or fetch it with `huggingface-cli download "
                           f"--repo-type dataset {text} --local-dir {home}`)")
    return home


@dataclass(frozen=True, slots=True)
class BatchRows:
    """Where a batch's samples lie in one dataset (`LeRobotDataset.locate`): their rows and episodes, and
    per windowed key the (B, K) rows of the window and which of them are padding."""

    rows: np.ndarray
    episodes: np.ndarray
    query_rows: dict[str, np.ndarray]
    is_pad: dict[str, np.ndarray]
    video_keys: list[str]


class LeRobotDataset:
    """A LeRobot dataset, read the way LeRobot reads it, fast.

    >>> ds = LeRobotDataset("path/to/ds", delta_timestamps={"action": [0.0, 0.1]})  # doctest: +SKIP
    >>> item = ds[0]  # doctest: +SKIP
    >>> item["action"].shape, item["action_is_pad"]  # doctest: +SKIP
    (torch.Size([2, 6]), tensor([False, False]))

    Args (LeRobot's, in LeRobot's order, then kilovla's, keyword-only):
        repo_id: the dataset folder (or fsspec URL), or with `root` a name; a repo id ("user/name")
            that is no folder here is read from LeRobot's download folder (`dataset_root`).
        root: the dataset folder, as in LeRobot.
        episodes: load only these episodes; positions then run over their frames only.
        image_transforms: callable applied to each float CHW camera tensor in `__getitem__`.
        delta_timestamps: per key, time offsets in seconds of the frames to return (LeRobot's meaning).
        tolerance_s: how far a decoded frame's time may be from the requested one.
        revision, force_cache_sync, download_videos, batch_encoding_size: LeRobot's download and
            recording settings, accepted so LeRobot's calls run; a revision or a cache sync, which
            would need a download, is refused.
        video_backend: "auto" (or None: torchcodec if it loads, else PyAV), "pyav" or "torchcodec".
        frame_cache: camera frames from a decoded-frame cache (`kilovla data cache`, see
            `kilovla.data.frame_cache`) instead of the videos: a cache folder, "auto" (the default:
            the cache at `default_cache_dir(root)` when there is one) or None (always decode). A
            named cache that does not match the dataset is refused with a DatasetError, never
            half-used; with "auto" such a cache is passed over with one warning and frames decoded.
        column_cache: where the numeric columns are mapped from (`kilovla.data.columns`): "auto"
            (the default column cache, written on first open), a folder, or None (read into memory).
        meta, columns: the dataset's metadata and columns as a lake index holds them (`lake_index`):
            nothing under meta/ is read then.
        prefetch: ask for every page of the mapped columns a batch reads before reading it
            (`columns.prefetch_pages`); False: a page fault at a time, each read around by the kernel.
    """

    def __init__(self, repo_id: str | Path | None = None, root: str | Path | None = None,
                 episodes: list[int] | None = None, image_transforms=None,
                 delta_timestamps: dict[str, list[float]] | None = None, tolerance_s: float = 1e-4,
                 revision: str | None = None, force_cache_sync: bool = False, download_videos: bool = True,
                 video_backend: str | None = "auto", batch_encoding_size: int = 1, *, decode_threads: int = 2,
                 frame_cache: str | Path | None = "auto", column_cache: str | Path | None = "auto",
                 meta: DatasetMeta | None = None, columns: ColumnStore | None = None, prefetch: bool = True):
        if revision is not None or force_cache_sync:
            raise KilovlaError(f"{repo_id}: revision= and force_cache_sync= need a download from the Hub; kilovla "
                               "reads local datasets only (download it with LeRobot or huggingface-cli first)")
        video_backend = video_backend or "auto"
        root = dataset_root(repo_id, root) if meta is None else root
        self.meta = meta if meta is not None else DatasetMeta(root)
        self.repo_id = str(repo_id) if repo_id is not None else Path(self.meta.root).name
        self.prefetch = prefetch
        self.root = self.meta.root
        self.fps = self.meta.fps
        self.tolerance_s = tolerance_s
        self.video_backend = video_backend
        self.image_transforms = image_transforms
        self.decode_threads = decode_threads
        self.delta_timestamps = delta_timestamps
        self.delta_indices = None
        if delta_timestamps:
            unknown = sorted(set(delta_timestamps) - set(self.meta.features))
            if unknown:
                raise KilovlaError(f"delta_timestamps keys {unknown} are not features of {self.root} "
                                   f"(features: {sorted(self.meta.features)})")
            self.delta_indices = windows.delta_indices(delta_timestamps, self.fps)
        self.columns = columns if columns is not None else open_columns(self.meta, column_cache, prefetch)
        eps = self.meta.episodes
        self.episode_ids = np.arange(len(eps)) if episodes is None else np.asarray(sorted(set(episodes)), dtype=np.int64)
        if np.any((self.episode_ids < 0) | (self.episode_ids >= len(eps))):
            raise KilovlaError(f"episodes {self.episode_ids.tolist()} out of range 0..{len(eps) - 1} for {self.root}")
        # position p lies in the k-th loaded episode when pos_from[k] <= p < pos_from[k + 1]
        self._pos_from = np.concatenate([[0], np.cumsum(eps.length[self.episode_ids])])
        self._pool = None
        self.frame_cache = resolve_frame_cache(frame_cache, self.meta, self.columns, self.meta.video_keys,
                                               video_backend)

    def __getstate__(self):
        state = self.__dict__.copy()
        state["_pool"] = None  # decoders are per process, created where they are used
        return state

    def __len__(self) -> int:
        return int(self._pos_from[-1])

    @property
    def num_frames(self) -> int:
        return len(self)

    @property
    def num_episodes(self) -> int:
        return len(self.episode_ids)

    @property
    def camera_keys(self) -> list[str]:
        return self.meta.video_keys

    @property
    def features(self) -> dict[str, Feature]:
        return self.meta.features

    @property
    def decoder_pool(self):
        from kilovla.data.video import VideoDecoderPool

        if self._pool is None:
            self._pool = VideoDecoderPool(self.video_backend, threads=self.decode_threads)
        return self._pool

    def positions_to_rows(self, positions: np.ndarray) -> np.ndarray:
        positions = np.asarray(positions, dtype=np.int64)
        if positions.size and (positions.min() < 0 or positions.max() >= len(self)):
            raise IndexError(f"positions outside 0..{len(self) - 1} of {self.root}")
        k = np.searchsorted(self._pos_from, positions, side="right") - 1
        return self.meta.episodes.row_from[self.episode_ids[k]] + positions - self._pos_from[k]

    def episode_of_rows(self, rows: np.ndarray) -> np.ndarray:
        return np.searchsorted(self.meta.episodes.row_from, rows, side="right") - 1

    def task_of(self, positions: np.ndarray) -> np.ndarray:
        """task_index of each position, without decoding anything (used for token-length estimates)."""
        return self.columns["task_index"][self.positions_to_rows(positions)]

    def task_runs(self) -> tuple[np.ndarray, np.ndarray]:
        """(first position, task_index) of each run of equal task over the loaded episodes' positions."""
        starts, values = self.columns.runs
        eps = self.meta.episodes
        episode = self.episode_of_rows(starts)
        keep = np.isin(episode, self.episode_ids)
        k = np.searchsorted(self.episode_ids, episode[keep])
        return self._pos_from[k] + starts[keep] - eps.row_from[episode[keep]], values[keep]

    def get_batch(self, positions, video_keys: list[str] | None = None) -> dict[str, np.ndarray]:
        """The samples at `positions`, stacked: numpy arrays, camera frames uint8 (B, [K,] H, W, 3).

        Same values as LeRobot's items (camera frames before the /255 float conversion); keys with a
        time window have a K axis (cameras drop it when K == 1, as LeRobot does), plus `<key>_is_pad`.
        """
        where = self.locate(positions, video_keys)
        if self.prefetch:
            prefetch_pages(self.column_reads(where))
        return self.read(where)

    def locate(self, positions, video_keys: list[str] | None = None) -> BatchRows:
        """Where the samples at `positions` lie: rows, episodes and each windowed key's rows."""
        rows = self.positions_to_rows(positions)
        ep = self.episode_of_rows(rows)
        eps = self.meta.episodes
        query_rows, is_pad = {}, {}
        for key, offsets in (self.delta_indices or {}).items():
            query_rows[key], is_pad[key] = windows.window_rows(rows, eps.row_from[ep], eps.row_to[ep], offsets)
        return BatchRows(rows, ep, query_rows, is_pad, video_keys or self.meta.video_keys)

    def column_reads(self, where: BatchRows) -> list[tuple[ColumnStore, str, np.ndarray]]:
        """(store, column, rows) of every column read `read(where)` makes (what `prefetch_pages` takes)."""
        reads = [(self.columns, key, where.query_rows.get(key, where.rows)) for key in self.columns]
        if self.meta.video_keys and self.frame_cache is None:  # decoding: the timestamps of every frame asked for
            reads += [(self.columns, "timestamp", where.query_rows.get(key, where.rows)) for key in where.video_keys]
        return reads

    def read(self, where: BatchRows) -> dict[str, np.ndarray]:
        """The samples `where` locates (see `get_batch`)."""
        rows = where.rows
        out: dict[str, np.ndarray] = {f"{key}_is_pad": pad for key, pad in where.is_pad.items()}
        for key, col in self.columns.items():
            out[key] = col[where.query_rows[key]] if key in where.query_rows else col[rows]
        if self.meta.video_keys:
            out.update(self._decode(rows, where.episodes, where.query_rows, where.video_keys))
        out["task"] = np.array([self.meta.tasks[t] for t in self.columns["task_index"][rows]], dtype=object)
        return out

    def _decode(self, rows, ep, query_rows, video_keys) -> dict[str, np.ndarray]:
        if self.frame_cache is not None:
            out = {key: self.frame_cache.read(key, query_rows.get(key, rows[:, None])) for key in video_keys}
            return {key: v[:, 0] if v.shape[1] == 1 else v for key, v in out.items()}
        eps = self.meta.episodes
        timestamps = self.columns["timestamp"]
        requests: list[tuple[str, np.ndarray]] = []
        plan = []  # (key, mask of (B, K) entries served by this request, shape (B, K))
        for key in video_keys:
            qrows = query_rows.get(key, rows[:, None])
            # LeRobot: from_timestamp (float64) + the float32 timestamp of the queried row.
            ts = eps.video_from_s[key][ep][:, None] + timestamps[qrows].astype(np.float64)
            files = np.array(eps.video_file[key], dtype=object)[ep]
            for f in dict.fromkeys(files):
                mask = files == f
                requests.append((self.meta.files.path(f), ts[mask].ravel()))
                plan.append((key, mask, qrows.shape))
        frames = self.decoder_pool.read_many(requests, self.tolerance_s)
        out: dict[str, np.ndarray] = {}
        for (key, mask, shape), got in zip(plan, frames):
            if mask.all():  # one file holds every sample's frames of this camera: no scatter copy
                out[key] = got.reshape(*shape, *got.shape[1:])
                continue
            if key not in out:
                out[key] = np.empty((*shape, *got.shape[1:]), dtype=np.uint8)
            out[key][mask] = got.reshape(-1, shape[1], *got.shape[1:])
        for key in list(out):
            if out[key].shape[1] == 1:
                out[key] = out[key][:, 0]
        return out

    def __getitem__(self, position: int) -> dict:
        return self.__getitems__([position])[0]

    def __getitems__(self, positions) -> list[dict]:
        """Items at `positions`, decoded together (torch's DataLoader calls this with a whole batch
        of indices when it exists, so a batch costs one decoding pass per video file)."""
        import torch

        n = len(self)
        for position in positions:
            if not -n <= position < n:
                raise IndexError(f"position {position} out of range for a dataset of {n} frames")
        batch = self.get_batch(np.array([p % n for p in positions], dtype=np.int64))
        items: list[dict] = [{} for _ in positions]
        for key, values in batch.items():
            if key in self.meta.video_keys:
                images = to_float_chw(values)
                for item, image in zip(items, images):
                    item[key] = image if self.image_transforms is None else self.image_transforms(image)
            elif key == "task":
                for item, value in zip(items, values):
                    item[key] = value
            else:
                for item, value in zip(items, values):
                    item[key] = torch.from_numpy(np.asarray(value))
        return items


def to_float_chw(frames_u8_hwc):
    """uint8 (..., H, W, C) -> float32 (..., C, H, W) in [0, 1], LeRobot's camera tensor.

    Bit-identical to LeRobot's `(frames / 255.0).type(torch.float32)` (one float32 division per
    value), computed in numpy: torch would hand a few hundred kB to its intra-op thread pool, which
    on a busy machine costs 10-50x the division itself.
    """
    import torch

    frames = frames_u8_hwc.numpy() if isinstance(frames_u8_hwc, torch.Tensor) else np.asarray(frames_u8_hwc)
    out = np.empty((*frames.shape[:-3], frames.shape[-1], *frames.shape[-3:-1]), dtype=np.float32)
    np.divide(np.moveaxis(frames, -1, -3), np.float32(255.0), out=out)
    return torch.from_numpy(out)
