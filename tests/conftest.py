"""Shared test data: LeRobot's own fixture (copied from ../shared/fixtures) and small datasets we write."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from kilovla.data.lerobot import LeRobotDataset
from kilovla.data.synthetic import make_synthetic_dataset
from kilovla.data.video import VideoEncoder

FIXTURES = Path(__file__).parent / "fixtures"


@pytest.fixture(scope="session", autouse=True)
def _private_cache_dir(tmp_path_factory):
    """Column and frame caches of the tests' datasets go to a folder of this session, not ~/.cache
    (subprocesses, e.g. torchrun's ranks, inherit it)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("KILOVLA_CACHE_DIR", str(tmp_path_factory.mktemp("kilovla-cache")))
        yield


@pytest.fixture(scope="session")
def lerobot_fixture() -> Path:
    return FIXTURES / "lerobot_v3_tiny"


@pytest.fixture(scope="session")
def lerobot_expected() -> dict:
    z = np.load(FIXTURES / "lerobot_v3_tiny_expected.npz")
    return {k: z[k] for k in z.files}


@pytest.fixture(scope="session")
def tiny_root(tmp_path_factory) -> Path:
    """4 episodes, 2 AV1 cameras at 64x96, 10 fps."""
    return make_synthetic_dataset(tmp_path_factory.mktemp("ds") / "tiny", episodes=4, frames=(12, 30), seed=3)


@pytest.fixture()
def tiny_copy(tiny_root, tmp_path) -> Path:
    """A writable copy of the tiny dataset, for tests that break it."""
    dst = tmp_path / "copy"
    shutil.copytree(tiny_root, dst)
    return dst


def write_v21(src_v3: Path, dst: Path) -> Path:
    """Rewrite a v3.0 dataset in LeRobot v2.1's layout: one parquet and one mp4 per episode, jsonl meta."""
    ds = LeRobotDataset(src_v3, video_backend="pyav")
    meta = ds.meta
    eps = meta.episodes
    (dst / "meta").mkdir(parents=True)
    table = pq.read_table(src_v3 / meta.episodes.data_file[0])
    for e in range(len(eps)):
        chunk = f"chunk-{e // 1000:03d}"
        path = dst / "data" / chunk / f"episode_{e:06d}.parquet"
        path.parent.mkdir(parents=True, exist_ok=True)
        pq.write_table(table.slice(int(eps.row_from[e]), int(eps.length[e])), path)
        positions = np.arange(eps.row_from[e], eps.row_to[e])
        batch = ds.get_batch(positions)
        for key in meta.video_keys:
            vpath = dst / "videos" / chunk / key / f"episode_{e:06d}.mp4"
            vpath.parent.mkdir(parents=True, exist_ok=True)
            h, w, _ = meta.features[key].shape
            enc = VideoEncoder(vpath, w, h, int(meta.fps), codec="libx264")
            for frame in batch[key]:
                enc.add(frame)
            enc.close()
    info = dict(meta.info)
    info.update(codebase_version="v2.1", total_chunks=1, total_videos=len(eps) * len(meta.video_keys),
                data_path="data/chunk-{episode_chunk:03d}/episode_{episode_index:06d}.parquet",
                video_path="videos/chunk-{episode_chunk:03d}/{video_key}/episode_{episode_index:06d}.mp4")
    for key in meta.video_keys:
        info["features"][key]["info"]["video.codec"] = "h264"
    for k in ("data_files_size_in_mb", "video_files_size_in_mb"):
        info.pop(k, None)
    (dst / "meta" / "info.json").write_text(json.dumps(info, indent=4))
    (dst / "meta" / "tasks.jsonl").write_text("".join(json.dumps({"task_index": i, "task": t}) + "\n"
                                                      for i, t in enumerate(meta.tasks)))
    (dst / "meta" / "episodes.jsonl").write_text("".join(
        json.dumps({"episode_index": e, "tasks": eps.tasks[e], "length": int(eps.length[e])}) + "\n"
        for e in range(len(eps))))
    return dst


@pytest.fixture(scope="session")
def v21_root(tiny_root, tmp_path_factory) -> Path:
    return write_v21(tiny_root, tmp_path_factory.mktemp("v21") / "ds")


def rewrite_parquet(path: Path, fn) -> None:
    """Apply fn(table) -> table to a parquet file in place."""
    table = pq.read_table(path)
    pq.write_table(fn(table), path)


def set_column(table: pa.Table, name: str, values) -> pa.Table:
    i = table.column_names.index(name)
    return table.set_column(i, name, pa.array(values, type=table.schema.field(name).type))


def assert_training_reduces_loss(model, batch, steps: int = 30) -> None:
    """Fixed noise and time, AdamW: the flow-matching loss on one batch must at least halve."""
    import torch

    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    g = torch.Generator().manual_seed(3)
    noise, t = torch.randn(batch.actions.shape, generator=g), torch.rand(batch.actions.shape[0], generator=g)
    losses = []
    for _ in range(steps):
        loss = model(batch, noise=noise, time=t)["loss"]
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0], losses


def tiny_reach_policy(root: Path, *overrides: str) -> str:
    """A tiny pi0.5 trained for 2 steps on 2 scripted reach-v3 demonstrations at 32 px (cameras scene and
    wrist, 4-D state, chunks of 4): a policy folder for the tests that serve, evaluate or fine-tune one.
    `overrides` (dotted flags) come after the defaults and win."""
    from kilovla.config import load_config
    from kilovla.envs.collect import collect
    from kilovla.train.trainer import TrainConfig, train

    collect(root / "mw", tasks=["reach-v3"], episodes_per_task=2, resolution=32, batch_size=2)
    cfg = load_config(TrainConfig, None, [
        f"--run_dir={root / 'run'}", "--steps=2", f"--dataset.roots=[{root / 'mw'}]", "--batch.global_batch_size=8",
        "--batch.token_budget=512", "--progress=false", "--policy.n_action_steps=4",
        "--policy.overrides={chunk_size: 4}", *overrides])
    return train(cfg)["checkpoint"]
