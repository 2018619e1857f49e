"""`kilovla bench elastic`: what a checkpoint stalls and what a lost node costs.

Row `checkpoint_stall_s`: the extra wall time of a window of 20 steps that holds one checkpoint,
against the same window without. Baseline: the synchronous save (`checkpoint.save`: model.safetensors
and optimizer.pt, every file fsync'ed before `latest` names it); ours: `checkpoint.save_async` (DCP
from a staged copy whose buffers are kept from the run's first save, as the trainer keeps them;
fsync'ed by DCP's writer), the window waiting at its end for the write to finish, so a write that
outlives the window counts. The state is a model of large fp32 parameters with AdamW's two moments
(12 bytes a parameter), as large as fits twice in the memory free here (at most 8 GB; quick: 96 MB);
a step is fixed CPU work (matmuls) plus an in-place update of one parameter, so the background write
competes for the cores and the staged copy must be a copy. The step is sized so that the window lasts
twice a synchronous save (timed first): a write longer than the window cannot be hidden by any
background save (at 0.1 s steps and 1.9 GB both stalled the whole write, async 1.27x sync's). The note
gives the stall per GB.

Row `recovery_s`: two torchrun agents on this machine (c10d rendezvous on localhost, one gloo rank
each, pi05-tiny); the second agent and its worker are SIGKILLed mid-run (after its rank stops
answering at a step, so the kill lands at a known step). The time from the SIGKILL to the survivor's
next optimizer step, with its parts: detection (the survivor's agent reports its worker failed),
rendezvous, start and load (to the restarted rank 0 recording its start in elastic.json, which it
does once the checkpoint is loaded) and the first step (to its metrics row). No baseline: without elastic the job ends until a person
relaunches it.
"""

from __future__ import annotations

import itertools
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch
from torch import nn

from kilovla.bench.common import DEFAULT_OUT, Row, write_suite

WINDOW_STEPS = 20
MATMULS_PER_STEP = 60  # of 512 x 512: about 0.3 s a step on one core
PARAMETER_ELEMENTS = 2**24  # 64 MB a parameter tensor


def _state(total_bytes: int) -> tuple[nn.Module, torch.optim.Optimizer, object]:
    """A model of `total_bytes` / 12 fp32 parameters, its AdamW state filled (one step on zero gradients)."""
    count = max(1, total_bytes // (12 * PARAMETER_ELEMENTS))
    model = nn.Module()
    for i in range(count):
        model.register_parameter(f"w{i}", nn.Parameter(torch.randn(PARAMETER_ELEMENTS) * 0.02))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return model, optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)


def _state_bytes(quick: bool) -> int:
    """The largest state that fits twice in the memory available now (with room to spare), at most 8 GB."""
    if quick:
        return 96 * 2**20
    available = 8 * 2**30
    try:
        info = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines())
        available = int(info["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        pass
    return int(min(8 * 2**30, available / 2.5))


def _window(model, steps: int, checkpoint=None, matmuls: int = MATMULS_PER_STEP) -> float:
    """Wall seconds of `steps` steps, `checkpoint()` (which may return a PendingSave) after the middle one."""
    a, b = torch.randn(512, 512), torch.randn(512, 512)
    params = list(model.parameters())
    pending = None
    t0 = time.perf_counter()
    for step in range(steps):
        for _ in range(matmuls):
            a = torch.tanh(a @ b * 0.01)
        with torch.no_grad():
            params[step % len(params)].add_(1e-3)
        if checkpoint is not None and step == steps // 2:
            pending = checkpoint()
    if pending is not None:
        pending.finish()
    return time.perf_counter() - t0


def checkpoint_stall(root: Path, quick: bool) -> tuple[Row, dict]:
    from kilovla.train import checkpoint as ckpt
    from kilovla.train.distributed import World

    steps = 4 if quick else WINDOW_STEPS
    model, optimizer, scheduler = _state(_state_bytes(quick))
    gigabytes = sum(p.numel() for p in model.parameters()) * 12 / 2**30
    world = World()
    parts = dict(model=model, optimizer=optimizer, scheduler=scheduler, world=world,
                 trainer_state={"step": 0}, policy_meta={"preset": "pi05-tiny"}, config_yaml="", stats={}, keep=0)

    saves = itertools.count(1)  # each save its own folder, so none replaces another

    def sync():
        ckpt.save(root / "sync" / f"step_{next(saves):06d}", ema=None, **parts)

    stager = ckpt.staging_buffers()  # as the trainer keeps it: the staged copy's pages reused from save to save

    def background():
        return ckpt.save_async(root / "async" / f"step_{next(saves):06d}", ema=None, stager=stager, **parts)

    # The window must outlast the write for any background save to hide it: the step is sized so that the
    # window lasts twice a synchronous save, timed first.
    t0 = time.perf_counter()
    sync()
    save_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    first = background()  # a run's first async save allocates the staging buffers
    first_stage_s = time.perf_counter() - t0
    first.finish()
    matmuls = MATMULS_PER_STEP
    if not quick:
        step_s = _window(model, 3) / 3
        matmuls = max(MATMULS_PER_STEP, round(MATMULS_PER_STEP * 2 * save_s / (steps * step_s)))
    bare, with_sync, with_async = [_window(model, steps, matmuls=matmuls)], [], []
    for _ in range(1 if quick else 2):  # interleaved: the disk's and the page cache's drift falls on both alike
        with_sync.append(_window(model, steps, sync, matmuls))
        with_async.append(_window(model, steps, background, matmuls))
        bare.append(_window(model, steps, matmuls=matmuls))
    without = statistics.mean(bare)
    stall_sync = max(0.0, statistics.mean(with_sync) - without)
    stall_async = max(0.0, statistics.mean(with_async) - without)
    row = Row.compare("checkpoint_stall_s", "s", stall_sync, stall_async, higher_is_better=False,
                      note=f"{gigabytes:.2f} GB of fp32 weights + AdamW moments, a {steps}-step window of "
                           f"{without / steps:.2f} s steps (twice a sync save of {save_s:.1f} s); stall per GB: "
                           f"sync {stall_sync / gigabytes:.2f} s, async {stall_async / gigabytes:.2f} s (staging "
                           f"buffers reused; a run's first async save stages in {first_stage_s:.1f} s); both "
                           f"fsync'ed; target: async <= 10% of sync")
    return row, {"state_gb": gigabytes, "sync_save_s": save_s, "first_async_staging_s": first_stage_s,
                 "window_s": {"none": bare, "sync": with_sync, "async": with_async}}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _agent(args: list[str], port: int, *, host: bool, env: dict) -> subprocess.Popen:
    conf = f"is_host={str(host).lower()},last_call_timeout=3,keep_alive_interval=1,keep_alive_max_attempt=2"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=1:2", "--nproc-per-node=1", "--max-restarts=2",
           "--rdzv-backend=c10d", f"--rdzv-endpoint=localhost:{port}", "--rdzv-id=bench-recovery",
           f"--rdzv-conf={conf}", "--monitor-interval=0.5", "-m", "kilovla", "train", *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", **env}
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)


def _timestamped_lines(proc: subprocess.Popen) -> list[tuple[float, str]]:
    """The process's output lines with the time each arrived, collected on a thread as they come."""
    lines: list[tuple[float, str]] = []

    def read():
        for line in proc.stdout:
            lines.append((time.time(), line))

    threading.Thread(target=read, daemon=True).start()
    return lines


def _kill_node(agent: subprocess.Popen) -> None:
    """SIGKILL an agent's process group and each of its workers' (torchrun gives them their own sessions)."""
    workers = []
    for p in Path("/proc").iterdir():
        try:
            if p.name.isdigit() and int((p / "stat").read_text().rsplit(")", 1)[1].split()[1]) == agent.pid:
                workers.append(int(p.name))
        except OSError:
            continue
    os.killpg(agent.pid, signal.SIGKILL)
    for pid in workers:
        try:
            os.killpg(os.getpgid(pid), signal.SIGKILL)
        except ProcessLookupError:
            pass
    agent.wait()


def _train_records(run: Path) -> list[dict]:
    path = run / "metrics.jsonl"
    if not path.is_file():
        return []
    complete = path.read_text().split("\n")[:-1]  # a row being appended has no newline yet
    return [r for r in map(json.loads, complete) if r.get("kind") == "train"]


def _poll(condition, timeout: float, what: str, agent: subprocess.Popen, lines: list) -> float:
    """The time `condition()` first holds; a RuntimeError if the agent ends or `timeout` passes first."""
    t0 = time.monotonic()
    while not condition():
        if agent.poll() is not None or time.monotonic() - t0 > timeout:
            tail = "".join(line for _, line in lines[-30:])
            raise RuntimeError(f"recovery bench: no {what} (agent exit code {agent.poll()}):\n{tail}")
        time.sleep(0.02)
    return time.time()


def recovery(root: Path) -> tuple[Row, dict]:
    from kilovla.data.synthetic import make_synthetic_dataset

    dataset = make_synthetic_dataset(root / "ds", episodes=6, frames=(16, 24), resolution=(32, 32), seed=4)
    run, port, lost_at = root / "run", _free_port(), 4
    args = [f"--run_dir={run}", "--steps=6", f"--dataset.roots=[{dataset}]", "--batch.global_batch_size=16",
            "--batch.token_budget=150", "--checkpoint.every=2", "--progress=false", "--policy.overrides.chunk_size=4"]
    survivor = _agent(args, port, host=True, env={})
    lost = _agent(args, port, host=False, env={"KILOVLA_FAULT_HANG": f"*:{lost_at}"})
    lines = _timestamped_lines(survivor)
    try:
        _poll(lambda: len(_train_records(run)) >= lost_at - 1, 600, f"step {lost_at - 1}", survivor, lines)
        t_kill = time.time()
        _kill_node(lost)
        t_step = _poll(lambda: any(r["world_size"] == 1 for r in _train_records(run)), 600, "step on the survivor",
                       survivor, lines)
        survivor.wait(timeout=600)
    finally:
        for agent in (survivor, lost):
            if agent.poll() is None:
                _kill_node(agent)
    # the restarted rank 0 records its start once the checkpoint is loaded (train/elastic.py), before its first step
    t_start = json.loads((run / "elastic.json").read_text())["started_at"]
    t_detect = min(t_start, next((t for t, line in lines if t >= t_kill and "failed (exitcode" in line), t_kill))
    parts = {"detection_s": t_detect - t_kill, "rendezvous_start_load_s": t_start - t_detect,
             "first_step_s": t_step - t_start}
    total = t_step - t_kill
    row = Row.compare("recovery_s", "s", None, total, higher_is_better=False,
                      note="SIGKILL of 1 of 2 agents (pi05-tiny, gloo; --rdzv-conf last_call_timeout=3, where "
                           "torch's default of 30 s adds ~30 s) to the survivor's next optimizer step: "
                           + ", ".join(f"{k.removesuffix('_s').replace('_', ' ')} {v:.1f} s" for k, v in parts.items()))
    return row, {"recovery_parts_s": parts, "recovery_restart": next(
        (r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if r["kind"] == "restart"), None)}


def run(*, quick: bool = False, out_dir: str | Path = DEFAULT_OUT, console=None) -> Path:
    with tempfile.TemporaryDirectory(prefix="kilovla-elastic-") as tmp:
        stall, stall_extra = checkpoint_stall(Path(tmp) / "stall", quick)
        recovered, recovery_extra = recovery(Path(tmp) / "recovery")
    return write_suite("elastic", [stall, recovered], quick=quick, out_dir=out_dir,
                       extra={**stall_extra, **recovery_extra}, console=console)
