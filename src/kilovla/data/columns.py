"""A dataset's numeric columns as memory maps, shared by every process on a node.

The first open of a dataset writes each numeric column of its parquet files, once, as one .npy file
into a column cache (beside the frame cache: $KILOVLA_CACHE_DIR/columns/<name>-<hash>), checked as
`DatasetMeta.load_columns` checks them; every later open, in any rank or loader worker, maps those
files read-only. The pages then live in the page cache, once per node, instead of in each process's
private memory (~300 bytes a frame for a state-8 + action-7 dataset), and an open reads nothing but
the manifest. The cache is keyed by the data files' sizes and modification times: a rewritten file
rebuilds it (as rsync's quick check: a file rewritten in place with its size and mtime restored is not
seen; remove the cache folder then). A truncated cache file is rebuilt. Where no cache can be written
(a read-only home, an fsspec URL) the columns are read into memory as before, with one warning.

With the columns comes the dataset's task runs (row where a run of equal task_index starts, that
task_index; a run never crosses an episode), from which the lake's token lengths are made without a
pass over the frames.

Reading from a cold page cache (`prefetch_pages`): a page fault is one synchronous disk read, and the kernel
reads around it (read_ahead_kb; 8 MB on some boxes, which is a whole column file here). Mapping a lake
of 1000 datasets touches 7000 header pages, and a random batch a few thousand data pages, so both are
asked for first, all at once (MADV_WILLNEED: queued, the call does not wait, exactly the pages named),
and read after: the disk sees one deep queue, and nothing is read around.

    >>> stores = map_column_caches([(path, mapped, frames, runs)])  # doctest: +SKIP
    >>> prefetch_pages([(stores[0], "action", rows)])  # doctest: +SKIP
    3  # page ranges asked for; stores[0]["action"][rows] then waits on them, not on one fault at a time
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import mmap
import os
import shutil
import uuid
from collections.abc import Mapping
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq

from kilovla.data.meta import DatasetMeta, Feature, column_to_numpy
from kilovla.errors import DatasetError

log = logging.getLogger(__name__)

COLUMNS_VERSION = 2
MANIFEST = "manifest.json"
READ_ROWS = 1 << 18  # rows per parquet batch while building: memory stays flat however large the file


def cache_base() -> Path:
    """$KILOVLA_CACHE_DIR, else $XDG_CACHE_HOME/kilovla, else ~/.cache/kilovla."""
    base = os.environ.get("KILOVLA_CACHE_DIR")
    if not base:
        base = str(Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "kilovla")
    return Path(base)


def dataset_cache_dir(kind: str, root: str | Path) -> Path:
    """cache_base() / kind / <dataset folder name>-<hash of its absolute path>."""
    root = Path(root).resolve()
    return cache_base() / kind / f"{root.name}-{hashlib.sha256(str(root).encode()).hexdigest()[:12]}"


def task_runs(task_index: np.ndarray, row_from: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(start rows, task_index) of the runs of equal task_index, cut at every episode start too."""
    task_index = np.asarray(task_index)
    change = np.zeros(len(task_index), dtype=bool)
    if len(task_index):
        change[0] = True
        change[1:] = task_index[1:] != task_index[:-1]
        change[np.asarray(row_from, dtype=np.int64)] = True
    starts = np.flatnonzero(change)
    return starts, np.asarray(task_index[starts], dtype=np.int64)


class ColumnStore(Mapping):
    """Column name -> (frames, *shape) array: read-only maps of the cache at `path` (`mapped`: their
    {name: [dtype, row shape]}; every one mapped at open, so a cache rebuilt later never mixes into an
    open store), and in-memory arrays (all of them when `path` is None). Pickles by path, so a loader
    worker or a Ray actor maps the files again instead of receiving a copy."""

    def __init__(self, arrays: dict[str, np.ndarray], runs: tuple[np.ndarray, np.ndarray], path: Path | None = None,
                 mapped: dict | None = None, maps: dict[str, tuple[mmap.mmap, int, int]] | None = None):
        self._arrays, self.runs, self.path, self.mapped = dict(arrays), runs, path, dict(mapped or {})
        # name -> (the mmap under its array, the offset of its data, bytes a row): what `prefetch_pages` advises
        self._maps = dict(maps or {})

    def __getitem__(self, key: str) -> np.ndarray:
        return self._arrays[key]

    def __iter__(self):
        return iter(self._arrays)

    def __len__(self) -> int:
        return len(self._arrays)

    def add(self, arrays: dict[str, np.ndarray]) -> None:
        """In-memory columns beside the maps (string columns, which have no .npy form)."""
        self._arrays.update(arrays)

    def held(self) -> dict[str, np.ndarray]:
        return {k: v for k, v in self._arrays.items() if k not in self.mapped}

    def __reduce__(self):
        if self.path is None:
            return ColumnStore, (self._arrays, self.runs, None)
        return _reopen, (str(self.path), self.mapped, len(next(iter(self._arrays.values()))), self.held())

    def private_bytes(self) -> int:
        """Bytes this store holds in process memory (the maps' pages are shared: not counted)."""
        return sum(a.nbytes for a in self.held().values()) + sum(r.nbytes for r in self.runs)


def _reopen(path: str, mapped: dict, frames: int, held: dict) -> ColumnStore:
    store = map_columns(path, mapped, frames)
    store.add(held)
    return store


def _open_map(path: Path) -> mmap.mmap:
    """A read-only mmap of the whole file; nothing of it is read yet."""
    try:
        fd = os.open(path, os.O_RDONLY)
        try:
            return mmap.mmap(fd, 0, access=mmap.ACCESS_READ)
        finally:
            os.close(fd)
    except (OSError, ValueError) as e:
        raise _unmappable(path, e) from None


def _npy_array(path: Path, mm: mmap.mmap, dtype: str, shape: tuple) -> tuple[np.ndarray, int]:
    """The array of a .npy file (written by `_build`) over its mmap, and its data's offset: no header parse
    beyond its length, and a plain ndarray (np.memmap's __getitem__ costs ~0.1 ms a call)."""
    try:
        if mm[:6] != b"\x93NUMPY":
            raise ValueError("not a .npy file")
        offset = 10 + int.from_bytes(mm[8:10], "little") if mm[6] == 1 else 12 + int.from_bytes(mm[8:12], "little")
        array = np.frombuffer(mm, dtype=np.dtype(dtype), count=int(np.prod(shape)), offset=offset).reshape(shape)
        return array, offset
    except (OSError, ValueError) as e:
        raise _unmappable(path, e) from None


def _unmappable(path: Path, e: Exception) -> DatasetError:
    return DatasetError(path, f"column cache file cannot be mapped ({e}); remove {path.parent} to rebuild it")


def map_columns(path: str | Path, mapped: dict, frames: int, runs: tuple[np.ndarray, np.ndarray] | None = None,
                prefetch: bool = True) -> ColumnStore:
    """The column cache at `path`: `mapped` {name: [dtype, row shape]} of `frames` rows each; `runs` as
    stored elsewhere (else read from the cache)."""
    return map_column_caches([(path, mapped, frames, runs)], prefetch)[0]


def map_column_caches(caches: list[tuple], prefetch: bool = True) -> list[ColumnStore]:
    """`map_columns` of many caches at once, each (path, mapped, frames, runs): every file is mapped, then
    (`prefetch`) every header page asked for before any header is read (see the module docstring), then
    the headers are read. Without `prefetch` each header is one page fault, read around, in turn."""
    maps = []
    for path, mapped, _, _ in caches:
        maps.append({k: _open_map(Path(path) / f"{k}.npy") for k in mapped})
    if prefetch:
        for files in maps:
            for mm in files.values():
                mm.madvise(mmap.MADV_WILLNEED, 0, mmap.PAGESIZE)
    stores = []
    for (path, mapped, frames, runs), files in zip(caches, maps):
        path = Path(path)
        if runs is None:
            try:
                stacked = np.load(path / "task_runs.npy")
            except (OSError, ValueError) as e:
                raise DatasetError(path / "task_runs.npy", f"column cache file cannot be read ({e}); remove {path} "
                                   "to rebuild it") from None
            runs = (stacked[0], stacked[1])
        arrays = {k: _npy_array(path / f"{k}.npy", files[k], dtype, (frames, *_row_shape(shape)))
                  for k, (dtype, shape) in mapped.items()}
        stores.append(ColumnStore({k: a for k, (a, _) in arrays.items()}, runs, path, mapped,
                                  {k: (files[k], offset, a.strides[0]) for k, (a, offset) in arrays.items()}))
    return stores


def prefetch_pages(reads) -> int:
    """Ask the kernel for every page that `store[key][rows]` reads, for each (store, key, rows) of
    `reads`, all at once; returns the number of page ranges asked for. In-memory columns are passed
    over; a page already cached costs a lookup.

    >>> prefetch_pages([(store, "action", np.array([0, 1, 5000]))])  # doctest: +SKIP
    2  # rows 0-1 share a page; one range for each page run, per file
    """
    files, rows = [], []
    for store, key, r in reads:
        mapped = store._maps.get(key)
        if mapped is not None and r.size:
            files.append(mapped)
            rows.append(r.ravel())
    if not files:
        return 0
    counts = [len(r) for r in rows]
    size = np.repeat(np.array([f[2] for f in files], dtype=np.int64), counts)
    start = np.repeat(np.array([f[1] for f in files], dtype=np.int64), counts) + np.concatenate(rows) * size
    tag = np.repeat(np.arange(len(files), dtype=np.int64) << _MAP_SHIFT, counts)  # the files' pages never merge
    first, last = tag + start // mmap.PAGESIZE, tag + (start + size - 1) // mmap.PAGESIZE
    order = np.argsort(first, kind="stable")
    first, last = first[order], np.maximum.accumulate(last[order])
    begins = np.flatnonzero(np.r_[True, first[1:] > last[:-1] + 1])  # a run of pages starts where a gap is
    lo, hi = first[begins], last[np.r_[begins[1:] - 1, len(first) - 1]]
    which = (lo >> _MAP_SHIFT).tolist()
    offsets = ((lo & ((1 << _MAP_SHIFT) - 1)) * mmap.PAGESIZE).tolist()
    lengths = ((hi - lo + 1) * mmap.PAGESIZE).tolist()
    maps, willneed = [f[0] for f in files], mmap.MADV_WILLNEED
    for i, offset, length in zip(which, offsets, lengths):
        maps[i].madvise(willneed, offset, length)
    return len(lo)


_MAP_SHIFT = 40  # pages of one file < 2^40 (4 PB)


def _row_shape(shape) -> tuple:
    """A feature's shape as stored per row: (1,) and () are scalars (as LeRobot returns them)."""
    return () if tuple(shape) in ((1,), ()) else tuple(shape)


def _stamps(meta: DatasetMeta) -> dict[str, list[int]]:
    out = {}
    for rel in dict.fromkeys(meta.episodes.data_file):
        path = meta.files.path(rel)
        try:
            st = os.stat(path)
        except OSError:
            raise DatasetError(path, "data file is missing") from None
        out[rel] = [st.st_size, st.st_mtime_ns]
    return out


def _numeric(meta: DatasetMeta) -> list[Feature]:
    return [f for f in meta.table_features() if f.dtype != "string"]


def _expected(meta: DatasetMeta) -> dict:
    return {"version": COLUMNS_VERSION, "frames": meta.total_frames, "stamps": _stamps(meta),
            "columns": {f.name: [f.dtype, list(f.shape)] for f in _numeric(meta)}}


def _read_manifest(path: Path) -> dict | None:
    try:
        return json.loads((path / MANIFEST).read_text())
    except (OSError, ValueError):
        return None


def open_columns(meta: DatasetMeta, setting: str | Path | None = "auto", prefetch: bool = True) -> ColumnStore:
    """The dataset's numeric columns (see the module docstring); setting "auto" (the default cache
    folder), a folder, or None (read into memory, no cache). String columns are read into memory.
    `prefetch`: the maps' header pages asked for together (`map_column_caches`)."""
    strings = [f.name for f in meta.table_features() if f.dtype == "string"]
    if setting is None or meta.files.is_url:
        return _in_memory(meta)
    path = dataset_cache_dir("columns", meta.root) if setting == "auto" else Path(setting)
    try:
        store = _open_or_build(meta, path, _expected(meta), prefetch)
    except OSError as e:
        log.warning("%s: no column cache at %s (%s); reading the columns into memory", meta.root, path, e)
        return _in_memory(meta)
    if strings:
        store.add(meta.load_columns(strings))
    return store


def _in_memory(meta: DatasetMeta) -> ColumnStore:
    columns = meta.load_columns()
    return ColumnStore(columns, task_runs(columns["task_index"], meta.episodes.row_from))


def _try_map(path: Path, want: dict, prefetch: bool = True) -> ColumnStore | None:
    """The cache at `path` mapped when its manifest is `want` and its files map; else None (to build)."""
    if _read_manifest(path) != want:
        return None
    try:
        return map_columns(path, want["columns"], want["frames"], prefetch=prefetch)
    except DatasetError as e:  # a truncated or removed cache file
        log.warning("%s; rebuilding the column cache", e)
        return None


def _open_or_build(meta: DatasetMeta, path: Path, want: dict, prefetch: bool) -> ColumnStore:
    store = _try_map(path, want, prefetch)
    if store is not None:
        return store
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.parent / f".{path.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one process on the node builds; the others wait, then map
        store = _try_map(path, want, prefetch)
        if store is None:
            _build(meta, path, want)
            store = map_columns(path, want["columns"], want["frames"], prefetch=prefetch)
    return store


def _build(meta: DatasetMeta, path: Path, want: dict) -> None:
    """Write every numeric column into `path` (a fresh temporary folder, renamed into place last)."""
    feats, n = _numeric(meta), meta.total_frames
    if "task_index" not in {f.name for f in feats}:
        raise DatasetError(meta.files.path("meta/info.json"), "feature 'task_index' is missing from 'features'")
    log.info("%s: writing its columns (%d frames) into the column cache %s", meta.root, n, path)
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}.tmp")
    tmp.mkdir()
    try:
        out = {f.name: np.lib.format.open_memmap(tmp / f"{f.name}.npy", mode="w+", dtype=np.dtype(f.dtype),
                                                 shape=(n, *_row_shape(f.shape)))
               for f in feats}
        row = 0
        expected_episode = np.repeat(meta.episodes.index, meta.episodes.length)
        for rel in dict.fromkeys(meta.episodes.data_file):
            where = meta.files.path(rel)
            for batch in _batches(where, feats):
                k = batch.num_rows
                if row + k > n:
                    raise DatasetError(where, f"the data files hold more rows than the episodes' {n}")
                for f in feats:
                    out[f.name][row:row + k] = column_to_numpy(batch.column(f.name), f, where)
                _check_rows(meta, where, out, row, k, expected_episode)
                row += k
        if row != n:
            raise DatasetError(meta.files.path("data"), f"the data files hold {row} rows, episodes need {n}")
        starts, values = task_runs(out["task_index"], meta.episodes.row_from)
        for array in out.values():
            array.flush()
        del out
        np.save(tmp / "task_runs.npy", np.stack([starts, values]))
        (tmp / MANIFEST).write_text(json.dumps(want))
        if path.exists():
            shutil.rmtree(path)
        os.replace(tmp, path)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _batches(where: str, feats: list[Feature]):
    """A parquet file's rows in batches of READ_ROWS; an unreadable file or a missing column names the file."""
    try:
        parquet = pq.ParquetFile(where)
        names = set(parquet.schema_arrow.names)
    except (OSError, ValueError) as e:
        raise DatasetError(where, f"cannot read parquet: {e}") from None
    for f in feats:
        if f.name not in names:
            raise DatasetError(where, f"column {f.name!r} (in info.json features) is missing")
    batches = parquet.iter_batches(batch_size=READ_ROWS, columns=[f.name for f in feats])
    while True:
        try:
            batch = next(batches)
        except StopIteration:
            return
        except (OSError, ValueError) as e:
            raise DatasetError(where, f"cannot read parquet: {e}") from None
        yield batch


def _check_rows(meta, where: str, out: dict, row: int, k: int, expected_episode: np.ndarray) -> None:
    if "index" in out and not np.array_equal(out["index"][row:row + k], np.arange(row, row + k)):
        raise DatasetError(meta.files.path("data"), "column 'index' is not 0..total_frames-1 in file order")
    if "episode_index" in out:
        got, want = out["episode_index"][row:row + k], expected_episode[row:row + k]
        if not np.array_equal(got, want):
            bad = int(np.argmax(got != want))
            raise DatasetError(where, f"episode_index at row {row + bad} is {got[bad]}, meta/episodes says {want[bad]}")
