"""Shared test data: LeRobot's own fixture (copied from ../shared/fixtures) and small datasets we write."""

from __future__ import annotations

import collections
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from kilovla.data.lerobot import LeRobotDataset
from kilovla.data.synthetic import make_synthetic_dataset
from kilovla.data.video import VideoEncoder

FIXTURES = Path(__file__).parent / "fixtures"


def pytest_configure(config):
    """Under pytest-xdist (`make test` runs two workers on two cores) each worker and what it starts compute
    on one thread: two processes of two OpenMP threads each on two cores spin against each other (the demo
    test ran 8x slower)."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        import torch

        os.environ["OMP_NUM_THREADS"] = "1"
        torch.set_num_threads(1)


def pytest_collection_modifyitems(config, items):
    """The long tests that may share the CPU (marker shares_cpu) first, those of the modules with the fewest
    tests before the others (the RL canary's one test, ~4 minutes, leads): under `make test`'s two workers one
    of them starts on it while the other takes the fast tests, rather than it running alone at the end.
    `make test` passes --no-loadscope-reorder: xdist's default sends the modules with the most tests first,
    which put the canary's module fourth from last."""
    module_size = collections.Counter(item.nodeid.split("::")[0] for item in items)

    def key(item):
        long = item.get_closest_marker("shares_cpu") is not None
        return (0, module_size[item.nodeid.split("::")[0]]) if long else (1, 0)

    items.sort(key=key)


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


# Qwen3-VL's chat template for user turns, system turns and text answers, written here in its shape (Isaac-GR00T
# reads the backbone's own from the checkpoint's processor assets; kilovla renders whichever the tokenizer's folder holds)
QWEN3VL_TEMPLATE = """{%- if messages[0].role == 'system' %}<|im_start|>system
{{ messages[0].content }}<|im_end|>
{% endif %}
{%- for message in messages %}{%- if message.role != 'system' %}<|im_start|>{{ message.role }}
{% if message.content is string %}{{ message.content }}{% else %}{% for part in message.content %}
{%- if part.type == 'image' or 'image' in part %}<|vision_start|><|image_pad|><|vision_end|>
{%- elif 'text' in part %}{{ part.text }}{% endif %}{% endfor %}{% endif %}<|im_end|>
{% endif %}{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""
QWEN3VL_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>"]


@pytest.fixture(scope="session")
def qwen3vl_dir(tmp_path_factory):
    """A tiny byte-level BPE with Qwen3-VL's added tokens and the chat template beside it (GR00T N1.7's prompt)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    # the alphabet of these texts only, so the vocabulary fits the byte-sized embedding of the tiny presets
    tok.train_from_iterator(["pick up the cube\n", "open the drawer\n", "user system assistant\n"] * 10,
                            trainers.BpeTrainer(vocab_size=120, show_progress=False))
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in QWEN3VL_SPECIALS])
    folder = tmp_path_factory.mktemp("qwen3vl")
    tok.save(str(folder / "tokenizer.json"))
    (folder / "chat_template.jinja").write_text(QWEN3VL_TEMPLATE)
    return folder


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


def _listing(root: Path) -> dict:
    """Every file and link under root with its size and modification time (links not followed)."""
    found = {}
    for folder, _, files in os.walk(root):
        for name in files:
            st = os.lstat(os.path.join(folder, name))
            found[os.path.relpath(os.path.join(folder, name), root)] = (st.st_size, st.st_mtime_ns)
    return found


@pytest.fixture(scope="session")
def reach_demos(tmp_path_factory) -> Path:
    """2 scripted reach-v3 demonstrations at 32 px (cameras scene and wrist, 4-D state), collected once a
    session and shared: read-only (copy it to change it; the session fails if a test changed it)."""
    from kilovla.envs.collect import collect

    root = tmp_path_factory.mktemp("reach") / "mw"
    collect(root, tasks=["reach-v3"], episodes_per_task=2, resolution=32, batch_size=2)
    before = _listing(root)
    yield root
    assert _listing(root) == before, f"a test changed the shared demonstrations {root}"


@pytest.fixture(scope="session")
def reach_policy(reach_demos, tmp_path_factory):
    """reach_policy(*overrides) -> the last checkpoint of a tiny pi0.5 trained for 2 steps on reach_demos
    (chunks of 4): a policy folder for the tests that serve, evaluate or fine-tune one. `overrides`
    (dotted flags) come after the defaults and win. Each set of overrides trains once a session; the
    run folder (the checkpoint's parents[1]) is shared and read-only, as reach_demos is."""
    from kilovla.config import load_config
    from kilovla.train.trainer import TrainConfig, train

    runs = {}

    def get(*overrides: str) -> str:
        if overrides not in runs:
            run = tmp_path_factory.mktemp("reach-policy") / "run"
            cfg = load_config(TrainConfig, None, [
                f"--run_dir={run}", "--steps=2", f"--dataset.roots=[{reach_demos}]", "--batch.global_batch_size=8",
                "--batch.token_budget=512", "--progress=false", "--policy.n_action_steps=4",
                "--policy.overrides={chunk_size: 4}", *overrides])
            checkpoint = train(cfg)["checkpoint"]
            runs[overrides] = (checkpoint, run, _listing(run))
        return runs[overrides][0]

    yield get
    for _, run, before in runs.values():
        assert _listing(run) == before, f"a test changed the shared policy run {run}"


# A global batch of 16 samples in rows of at most 150 tokens: 4-6 packed rows per rank on 2 ranks,
# so every step accumulates over several rows. Clipping off: gradients are compared as they are.
def train_args(dataset, run_dir, steps=4, family="pi05-tiny"):
    args = [f"--run_dir={run_dir}", f"--steps={steps}", f"--dataset.roots=[{dataset}]", "--batch.global_batch_size=16",
            "--batch.token_budget=150", "--checkpoint.every=2", f"--policy.preset={family}", "--progress=false",
            "--log_sample_ids=true", "--optim.warmup_steps=1", "--optim.clip_grad_norm=0"]
    return args + (["--policy.overrides.chunk_size=4"] if family.startswith("pi0") else [])


def unless_given(defaults: list[str], argv: list[str]) -> list[str]:
    """A test's default `--key=value`s less the keys its own argv sets (a key given twice is refused)."""
    keys = {a.split("=")[0] for a in argv}
    return [d for d in defaults if d.split("=")[0] not in keys]


def train_process(args, nproc=1, env=None, timeout=300):
    """`kilovla train` in a child process, under torchrun when nproc > 1."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    if nproc == 1:
        cmd = [sys.executable, "-m", "kilovla", "train", *args]
    else:
        # --standalone: a rendezvous on a free port per launch. torchrun's default, port 29500, is one for both
        # pytest workers: two launches at once meet in one store (an EP run failed so under -n 2).
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
               "-m", "kilovla", "train", *args]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)


def trained_with_gradients(dataset, run, family="pi05-tiny", nproc=1, extra=(), env=None):
    """A 4-step run that dumps the gradients of every step (before the optimizer step) into run/grads."""
    proc = train_process([*train_args(dataset, run, family=family), *extra], nproc=nproc,
                         env={"KILOVLA_DUMP_GRADS": str(run / "grads"), **(env or {})})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return run


@pytest.fixture(scope="session")
def train_dataset(tmp_path_factory) -> Path:
    """6 synthetic episodes at 32x32: the data of the trainer's equivalence tests (test_train, test_mesh,
    test_lora), made once a session; read-only."""
    root = make_synthetic_dataset(tmp_path_factory.mktemp("train") / "ds", episodes=6, frames=(16, 24),
                                  resolution=(32, 32), seed=4)
    before = _listing(root)
    yield root
    assert _listing(root) == before, f"a test changed the shared dataset {root}"


@pytest.fixture(scope="session")
def references(train_dataset, tmp_path_factory):
    """references(family, extra=()) -> a one-process trained_with_gradients run on train_dataset (`extra`:
    more flags), made on first use and shared by test_train, test_mesh and test_lora; read-only."""
    runs = {}

    def get(family, extra=()):
        key = (family, tuple(extra))
        if key not in runs:
            run = trained_with_gradients(train_dataset, tmp_path_factory.mktemp("ref") / "run", family, extra=extra)
            runs[key] = (run, _listing(run))
        return runs[key][0]

    yield get
    for run, before in runs.values():
        assert _listing(run) == before, f"a test changed the shared reference run {run}"


@pytest.fixture(scope="session")
def reference(references):
    return references("pi05-tiny")
