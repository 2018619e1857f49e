"""One index file for a lake of many datasets: what every rank would otherwise read from each.

A lake of 1000 LeRobot datasets is ~5000 metadata files (info.json, tasks, episode tables) plus a
validation pass over every dataset's frames; read by each of 1024 ranks, that is millions of small
reads before the first step. The lake index holds, per dataset, what the readers and `kilovla data
validate` take from them: info.json, the tasks, the episode table, the task runs, the column cache's
place and what validate found wrong. It is built once, in parallel (Ray tasks over the datasets, or a
local process pool; `engine`), and re-built only for datasets whose files changed: each entry keeps a
stamp (path, size, modification time of every file under meta/, data/ and videos/), and opening the
index compares stamps with stat calls alone. Each entry is also kept on its own (`entry_path`), so an
index of another list of roots (a dataset added or dropped) indexes only what it has not seen. A rank
then reads one JSON file and one safetensors file.

Files (beside the column caches, or where `path` says):

    <path>.json          {"version", "arrays", "datasets": [{root, stamp, problems, info, tasks, ...}]}
    <path>.<tag>.safetensors  (named by "arrays") per dataset i: i/length, i/row_from, i/data_file, i/runs_start, i/runs_task,
                         i/episode_tasks, i/episode_tasks_from, i/video/<camera>/{file,from_s,to_s}
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from kilovla.data.columns import ColumnStore, cache_base, map_column_caches, open_columns
from kilovla.data.meta import DatasetMeta, Episodes
from kilovla.errors import DatasetError, KilovlaError

log = logging.getLogger(__name__)

LAKE_INDEX_VERSION = 3  # 3: validate refuses NaN / inf in float columns, so older findings are rebuilt


def default_index_path(roots: list[str]) -> Path:
    """cache_base()/lakes/<hash of the datasets' absolute paths, in order> (no suffix)."""
    key = "\n".join(os.path.realpath(r) for r in roots)
    return cache_base() / "lakes" / hashlib.sha256(key.encode()).hexdigest()[:16]


def entry_path(root: str) -> Path:
    """One dataset's entry, kept on its own too: an index of other roots reuses it instead of re-indexing."""
    return cache_base() / "lakes" / "datasets" / hashlib.sha256(os.path.realpath(root).encode()).hexdigest()[:16]


def dataset_stamp(root: str) -> list[list]:
    """(relative path, size, mtime_ns) of every file under meta/, data/ and videos/, sorted: what the entry
    (validate's findings included) was made from."""
    out = []

    def walk(folder: str, rel: str) -> None:
        with os.scandir(folder) as entries:
            for e in entries:
                if e.is_dir(follow_symlinks=False):
                    walk(e.path, f"{rel}{e.name}/")
                else:
                    st = e.stat()
                    out.append([f"{rel}{e.name}", st.st_size, st.st_mtime_ns])

    for top in ("meta", "data", "videos"):
        if os.path.isdir(os.path.join(root, top)):
            walk(os.path.join(root, top), f"{top}/")
    return sorted(out)


class EpisodeTasks(Sequence):
    """Episodes.tasks as the index stores them (task indices, offsets): a list of lists, built on access."""

    def __init__(self, names: list[str], flat: np.ndarray, start: np.ndarray):
        self.names, self.flat, self.start = names, flat, start

    def __len__(self) -> int:
        return len(self.start) - 1

    def __getitem__(self, e):
        if isinstance(e, slice):
            return [self[i] for i in range(*e.indices(len(self)))]
        return [self.names[t] for t in self.flat[self.start[e]:self.start[e + 1]]]


def index_dataset(root: str) -> tuple[dict, dict[str, np.ndarray]]:
    """One dataset's entry (JSON) and arrays; runs where the engine puts it. Builds the column cache."""
    from kilovla.data.validate import validate_dataset

    stamp = dataset_stamp(root)
    try:
        meta = DatasetMeta(root)
        store = open_columns(meta)
    except DatasetError as e:  # the entry keeps the problem only; the dataset is refused where it is used
        return {"root": root, "stamp": stamp, "problems": [str(e)]}, {}
    problems = [str(p) for p in validate_dataset(root, meta=meta, columns=store)]
    eps = meta.episodes
    files = list(dict.fromkeys(eps.data_file))
    names = list(meta.tasks)
    flat = [names.index(t) if t in names else names.append(t) or len(names) - 1 for ts in eps.tasks for t in ts]
    arrays = {"length": eps.length, "row_from": eps.row_from,
              "data_file": np.array([files.index(f) for f in eps.data_file], dtype=np.int64) if len(files) > 1
              else np.zeros(len(eps), dtype=np.int64),
              "runs_start": store.runs[0], "runs_task": store.runs[1],
              "episode_tasks": np.array(flat, dtype=np.int64),
              "episode_tasks_from": np.cumsum([0] + [len(ts) for ts in eps.tasks]).astype(np.int64)}
    videos = {}
    for cam in meta.video_keys:
        cam_files = list(dict.fromkeys(eps.video_file[cam]))
        lookup = {f: i for i, f in enumerate(cam_files)}
        videos[cam] = cam_files
        arrays[f"video/{cam}/file"] = np.array([lookup[f] for f in eps.video_file[cam]], dtype=np.int64)
        arrays[f"video/{cam}/from_s"] = eps.video_from_s[cam]
        arrays[f"video/{cam}/to_s"] = eps.video_to_s[cam]
    entry = {"root": root, "stamp": stamp, "problems": problems, "info": meta.info, "tasks": list(meta.tasks),
             "episode_task_names": names, "data_files": files, "video_files": videos,
             "columns": None if store.path is None else str(store.path), "mapped": store.mapped, "string_columns": list(store.held())}
    return entry, arrays


@dataclass
class IndexedDataset:
    """What the index holds of one dataset: its metadata (read from the index) and columns (mapped)."""

    root: str
    problems: list[str]
    meta: DatasetMeta | None
    columns: ColumnStore | None


def _meta_from(entry: dict, arrays: dict[str, np.ndarray]) -> DatasetMeta:
    files = entry["data_files"]
    names, flat, start = entry["episode_task_names"], arrays["episode_tasks"], arrays["episode_tasks_from"]
    length, row_from = arrays["length"], arrays["row_from"]
    eps = Episodes(index=np.arange(len(length)), length=length, row_from=row_from, row_to=row_from + length,
                   tasks=EpisodeTasks(names, flat, start),
                   data_file=[files[i] for i in arrays["data_file"]])
    for cam, cam_files in entry["video_files"].items():
        eps.video_file[cam] = [cam_files[i] for i in arrays[f"video/{cam}/file"]]
        eps.video_from_s[cam] = arrays[f"video/{cam}/from_s"]
        eps.video_to_s[cam] = arrays[f"video/{cam}/to_s"]
    return DatasetMeta(entry["root"], info=entry["info"], tasks=entry["tasks"], episodes=eps)


class LakeIndex:
    """The index of `roots` at `path`: built or brought up to date by `open`, read by ranks."""

    def __init__(self, entries: list[dict], arrays: list[dict[str, np.ndarray]], path: Path, rebuilt: int):
        self.entries, self.arrays, self.path, self.rebuilt = entries, arrays, path, rebuilt
        self._datasets: list[IndexedDataset] | None = None

    @classmethod
    def open(cls, roots: list[str], path: str | Path | None = None, engine: str = "auto", workers: int | None = None,
             progress: Callable[[int, int], None] | None = None) -> LakeIndex:
        """The index of `roots` (absolute paths), re-indexing only the datasets whose stamp changed."""
        roots = [os.path.realpath(r) for r in roots]
        for r in roots:
            if "://" in r:
                raise KilovlaError(f"{r}: the lake index needs datasets on a local (or mounted) file system")
        path = Path(path) if path is not None else default_index_path(roots)
        stamps = {}
        for r in roots:
            if not os.path.isdir(r):
                raise DatasetError(r, "no such dataset folder")
            stamps[r] = dataset_stamp(r)
        old = _read(path)
        if old and [e["root"] for e in old[0]] == roots and _fresh(old, stamps).keys() == set(roots):
            return cls(old[0], old[1], path, 0)
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path.with_name(f".{path.name}.lock"), "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # one process builds; the others wait, then read what it wrote
            fresh = _fresh(_read(path), stamps)
            for r in dict.fromkeys(roots):  # an entry an index of other roots made (a dataset added or dropped)
                alone = _read(entry_path(r)) if r not in fresh else None
                if alone and alone[0][0]["stamp"] == stamps[r]:
                    fresh[r] = (alone[0][0], alone[1][0])
            todo = [r for r in dict.fromkeys(roots) if r not in fresh]
            built = dict(zip(todo, _index_all(todo, engine, workers, progress)))
            for r, (entry, arrays) in built.items():
                entry_path(r).parent.mkdir(parents=True, exist_ok=True)
                _write(entry_path(r), [entry], [arrays])
            entries = [(fresh.get(r) or built[r]) for r in roots]
            _write(path, [e for e, _ in entries], [a for _, a in entries])
        return cls([e for e, _ in entries], [a for _, a in entries], path, len(todo))

    def datasets(self, prefetch: bool = True) -> list[IndexedDataset]:
        """Each dataset's metadata and mapped columns (made on the first call). `prefetch`: every column
        file's header page asked for at once before any is read (`columns.map_column_caches`)."""
        if self._datasets is None:
            self._datasets = self._make_datasets(prefetch)
        return self._datasets

    def _make_datasets(self, prefetch: bool) -> list[IndexedDataset]:
        metas = [_meta_from(e, a) if "info" in e else None for e, a in zip(self.entries, self.arrays)]
        mappable = [i for i, (e, m) in enumerate(zip(self.entries, metas))
                    if m is not None and e["columns"] is not None and os.path.isdir(e["columns"])]
        stores = dict(zip(mappable, map_column_caches(
            [(self.entries[i]["columns"], self.entries[i]["mapped"], metas[i].total_frames,
              (self.arrays[i]["runs_start"], self.arrays[i]["runs_task"])) for i in mappable], prefetch)))
        out = []
        for i, (entry, meta) in enumerate(zip(self.entries, metas)):
            columns = stores.get(i)
            if columns is not None and entry["string_columns"]:  # no .npy form: read from the parquet files
                columns.add(meta.load_columns(entry["string_columns"]))
            out.append(IndexedDataset(entry["root"], entry["problems"], meta, columns))
        return out


def _fresh(index: tuple[list[dict], list[dict]] | None, stamps: dict) -> dict:
    """root -> (entry, arrays) of the index's entries whose stamp is the dataset's now."""
    if not index:
        return {}
    return {e["root"]: (e, a) for e, a in zip(*index) if stamps.get(e["root"]) == e["stamp"]}


def _index_all(roots: list[str], engine: str, workers: int | None, progress) -> list[tuple[dict, dict]]:
    """index_dataset over `roots`: Ray tasks ("ray"), a process pool ("local"), this process ("serial"), or
    "auto" (Ray when a cluster is already connected, else the pool; one dataset: this process)."""
    if not roots:
        return []
    if engine == "auto":
        try:
            import ray

            engine = "ray" if ray.is_initialized() else "local"
        except ImportError:
            engine = "local"
        if len(roots) == 1:
            engine = "serial"
    if engine not in ("ray", "local", "serial"):
        raise KilovlaError(f"lake index engine must be auto, ray, local or serial, not {engine!r}")
    log.info("lake index: indexing %d dataset(s) (%s)", len(roots), engine)
    results: list = [None] * len(roots)
    if engine == "serial":
        for i, r in enumerate(roots):
            results[i] = index_dataset(r)
            if progress:
                progress(i + 1, len(roots))
        return results
    if engine == "ray":
        import ray

        from kilovla.data.ray_cluster import connect_ray

        connect_ray(None)
        task = ray.remote(num_cpus=1)(index_dataset)
        pending = {task.remote(r): i for i, r in enumerate(roots)}
        done = 0
        while pending:
            ready, _ = ray.wait(list(pending), num_returns=1)
            for ref in ready:
                results[pending.pop(ref)] = ray.get(ref)
                done += 1
                if progress:
                    progress(done, len(roots))
        return results
    import multiprocessing

    # fork: forkserver/spawn workers re-run a user's script without a __main__ guard, and the pool then waits
    # forever; the build runs before models and process groups exist (numpy and pyarrow only in the workers)
    context = multiprocessing.get_context("fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn")
    with ProcessPoolExecutor(max_workers=workers or os.cpu_count(), mp_context=context) as pool:
        for i, result in enumerate(pool.map(index_dataset, roots, chunksize=max(1, len(roots) // 64))):
            results[i] = result
            if progress:
                progress(i + 1, len(roots))
    return results


def _read(path: Path) -> tuple[list[dict], list[dict]] | None:
    from safetensors.numpy import load_file

    try:
        head = json.loads(path.with_suffix(".json").read_text())
        if not isinstance(head, dict) or head.get("version") != LAKE_INDEX_VERSION:
            return None
        flat = load_file(str(path.parent / head["arrays"]))
        arrays = [{} for _ in head["datasets"]]
        for key, value in flat.items():
            i, name = key.split("/", 1)
            arrays[int(i)][name] = value
        if not all(isinstance(e, dict) and "root" in e and "stamp" in e for e in head["datasets"]):
            return None
    except Exception as e:  # absent, half-replaced, truncated or foreign (safetensors has its own errors): rebuild
        if path.with_suffix(".json").exists():
            log.warning("lake index %s cannot be read (%s: %s); rebuilding it", path, type(e).__name__, e)
        return None
    return head["datasets"], arrays


def _write(path: Path, entries: list[dict], arrays: list[dict]) -> None:
    """The arrays under a fresh name, then the JSON naming them (one atomic rename), then old arrays gone."""
    from safetensors.numpy import save_file

    name = f"{path.name}.{uuid.uuid4().hex[:8]}.safetensors"
    tmp_json = path.with_name(f".{name}.json.tmp")
    try:
        flat = {f"{i}/{k}": np.ascontiguousarray(v) for i, a in enumerate(arrays) for k, v in a.items()}
        save_file(flat, str(path.parent / name))
        tmp_json.write_text(json.dumps({"version": LAKE_INDEX_VERSION, "arrays": name, "datasets": entries}))
        os.replace(tmp_json, path.with_suffix(".json"))
    except BaseException:
        (path.parent / name).unlink(missing_ok=True)
        raise
    finally:
        tmp_json.unlink(missing_ok=True)
    for old in path.parent.glob(f"{path.name}.*.safetensors"):
        if old.name != name:
            old.unlink(missing_ok=True)
