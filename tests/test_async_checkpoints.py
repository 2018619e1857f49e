"""Asynchronous checkpoints (DCP async_save) and checkpoints by wall time: resume as exactly as sync ones,
and a crash inside a checkpoint's write leaves the previous one the newest complete."""

import json
from pathlib import Path

import pytest
import torch

from conftest import train_args as _args, train_process as _run, unless_given
from kilovla.folders import latest_checkpoint
from kilovla.policy_folder import load_policy_folder


def _metrics(run_dir):
    return [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


def _weights(run_dir, step):
    from safetensors.torch import load_file

    return load_file(str(Path(run_dir) / "checkpoints" / f"step_{step:06d}" / "model.safetensors"))


def _same_end(run, reference):
    """The same losses at every step and the same last weights, bit for bit."""
    assert [r["loss"] for r in _metrics(run) if r["kind"] == "train"] == [r["loss"] for r in _metrics(reference)]
    wa, wb = _weights(reference, 4), _weights(run, 4)
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


def test_a_run_with_async_checkpoints_resumes_exactly_like_sync(train_dataset, reference, tmp_path):
    run = tmp_path / "async"
    killed = _run([*_args(train_dataset, run), "--checkpoint.async_save=true"], env={"KILOVLA_FAULT_AFTER_STEP": "3"})
    assert killed.returncode == -9  # SIGKILL after step 3; the last checkpoint, written in the background, is step 2
    step2 = run / "checkpoints" / "step_000002"
    assert latest_checkpoint(run / "checkpoints") == step2
    assert (step2 / "state" / ".metadata").is_file() and not (step2 / "model.safetensors").exists()
    assert load_policy_folder(step2).action_dim == 6  # still a policy folder
    resumed = _run([*_args(train_dataset, run), "--checkpoint.async_save=true", "--resume", "auto"])
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "from step 2" in resumed.stdout
    assert [r["step"] for r in _metrics(run)] == [1, 2, 3, 4]
    assert (run / "checkpoints" / "step_000004" / "model.safetensors").is_file()  # the last one is written whole
    _same_end(run, reference)


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_worker_killed_inside_a_checkpoint_write_leaves_the_previous_one_newest(train_dataset, reference,
                                                                                   tmp_path, mode):
    run = tmp_path / mode
    args = [*unless_given(_args(train_dataset, run), ["--checkpoint.every"]), "--checkpoint.every=1",
            f"--checkpoint.async_save={mode == 'async'}"]
    killed = _run(args, env={"KILOVLA_FAULT_IN_CHECKPOINT": "3"})
    assert killed.returncode == -9
    checkpoints = run / "checkpoints"
    assert latest_checkpoint(checkpoints) == checkpoints / "step_000002"
    assert not (checkpoints / "step_000003").exists()
    assert (checkpoints / ".step_000003.tmp" / "trainer_state.json").is_file()  # written, never made visible
    resumed = _run([*args, "--resume", "auto"])
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "from step 2" in resumed.stdout
    assert sorted(p.name for p in checkpoints.iterdir()) == ["latest", "step_000002", "step_000003", "step_000004"]
    _same_end(run, reference)


def test_checkpoints_by_wall_time_beside_every_steps(train_dataset, tmp_path):
    run = tmp_path / "minutes"
    proc = _run([*unless_given(_args(train_dataset, run), ["--checkpoint.every"]), "--checkpoint.every=1000", "--checkpoint.every_minutes=1e-9",
                 "--checkpoint.keep=0", "--checkpoint.async_save=true"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert sorted(p.name for p in (run / "checkpoints").glob("step_*")) == [f"step_00000{i}" for i in (1, 2, 3, 4)]


def test_an_ema_resumes_from_an_async_checkpoint_exactly(train_dataset, tmp_path):
    ema = ["--ema_decay=0.9"]
    whole = _run([*_args(train_dataset, tmp_path / "whole"), *ema])
    assert whole.returncode == 0, whole.stderr[-3000:]
    run = tmp_path / "async"
    args = [*_args(train_dataset, run), *ema, "--checkpoint.async_save=true"]
    assert _run(args, env={"KILOVLA_FAULT_AFTER_STEP": "3"}).returncode == -9
    resumed = _run([*args, "--resume", "auto"])
    assert resumed.returncode == 0 and "from step 2" in resumed.stdout, resumed.stderr[-3000:]
    from safetensors.torch import load_file

    wa, wb = (load_file(str(r / "checkpoints" / "step_000004" / "ema.safetensors")) for r in (tmp_path / "whole", run))
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


def test_async_save_with_lora_is_refused_in_one_line(train_dataset, tmp_path):
    proc = _run([*_args(train_dataset, tmp_path / "lora"), "--checkpoint.async_save=true", "--policy.lora.rank=4"])
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "error: checkpoint.async_save with policy.lora is not supported yet: save synchronously "
        "(checkpoint.async_save=false)"]


@pytest.mark.parametrize("layout", ["--parallel.strategy=ddp", "--parallel.strategy=fsdp", "--parallel.tp=2",
                                    "--parallel.pp=2"])
def test_async_checkpoints_of_two_ranks_resume_on_one(train_dataset, reference, tmp_path, layout):
    run = tmp_path / "run"
    args = [*_args(train_dataset, run), "--checkpoint.async_save=true", layout]
    killed = _run(args, nproc=2, env={"KILOVLA_FAULT_AFTER_STEP": "2"})
    assert killed.returncode != 0
    assert latest_checkpoint(run / "checkpoints") == run / "checkpoints" / "step_000002"
    resumed = _run([*args[:-1], "--resume", "auto"])  # 2 ranks -> 1 (no mesh): DCP reshards
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert [r["sample_ids"] for r in _metrics(run)] == [r["sample_ids"] for r in _metrics(reference)]
    wa, wb = _weights(reference, 4), _weights(run, 4)
    assert max((wa[k] - wb[k]).abs().max().item() for k in wa) < 1e-5


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_every_file_of_a_checkpoint_is_on_disk_before_latest_names_it(tmp_path, monkeypatch, mode):
    """A node lost (or a power cut) after `latest` moved must not leave it naming bytes that never reached
    the disk: every file and folder is fsync'ed first, and the run folder after the renames."""
    from torch import nn

    from kilovla.train import checkpoint as ckpt
    from kilovla.train.distributed import World

    synced, events = [], []
    real_fsync, real_latest = ckpt._fsync, ckpt.point_latest
    monkeypatch.setattr(ckpt, "_fsync", lambda path: (synced.append(Path(path).name), real_fsync(path)))
    monkeypatch.setattr(ckpt, "point_latest", lambda root, folder: (events.append(set(synced)),
                                                                    real_latest(root, folder)))
    model = nn.Linear(4, 4)
    optimizer = torch.optim.AdamW(model.parameters())
    parts = dict(model=model, optimizer=optimizer, scheduler=torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0),
                 ema=None, world=World(), trainer_state={"step": 1}, policy_meta={"preset": "pi05-tiny"},
                 config_yaml="", stats={})
    folder = tmp_path / "checkpoints" / "step_000001"
    if mode == "sync":
        ckpt.save(folder, **parts)
    else:
        ckpt.save_async(folder, **parts).finish()
    written = {p.name for p in folder.rglob("*")}
    assert written and written <= events[0]  # all of them before latest
    assert synced[-1] == "checkpoints"  # the renames


def test_reused_staging_buffers_hold_each_save_as_it_was_when_it_began(tmp_path):
    """The trainer keeps one stager for the run: a save's files hold the weights of the moment it began,
    though the step goes on changing them while the files are written, and the next save into the same
    buffers holds the new weights."""
    from torch import nn

    from kilovla.train import checkpoint as ckpt
    from kilovla.train.distributed import World

    model = nn.Linear(64, 64)
    optimizer = torch.optim.AdamW(model.parameters())
    parts = dict(model=model, optimizer=optimizer, scheduler=torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0),
                 ema=None, world=World(), policy_meta={"preset": "pi05-tiny"}, config_yaml="", stats={})
    stager, seen = ckpt.staging_buffers(), []
    for step in (1, 2):
        seen.append(model.weight.detach().clone())
        pending = ckpt.save_async(tmp_path / f"step_{step:06d}", trainer_state={"step": step}, stager=stager, **parts)
        with torch.no_grad():
            model.weight.add_(1.0)  # the next step, while the files are written
        pending.finish()
    for step, weight in zip((1, 2), seen):
        saved = ckpt.gathered_from_shards(tmp_path / f"step_{step:06d}" / ckpt.STATE_DIR)
        assert torch.equal(saved["weight"], weight)
