"""`kilovla demo`: the main job on an embedded default, no network, no flags.

Today it runs the data half of the closed loop: write a small two-camera LeRobot v3.0 dataset,
check it, build the global batch plan for a pi0.5-style token layout, load packed rows, and report
what packing saves against fixed padding. Training, simulation and evaluation join as they land.
Writes DIR/report.json and DIR/report.md and prints one table.
"""

from __future__ import annotations

import json
import os
import time
import uuid
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from kilovla.data import DataLake, GlobalBatchPlan, InProcessLoader, LakeSource, PlanConfig, TokenLayout
from kilovla.data.plan import padding_fraction
from kilovla.data.synthetic import make_synthetic_dataset
from kilovla.data.validate import validate_dataset
from kilovla.errors import KilovlaError

# pi0.5's layout at a CPU-friendly size: 2 cameras x 64 tokens, byte-level language, 8 state tokens.
DEMO_LAYOUT = TokenLayout(tokens_per_camera=64, max_language_tokens=200, state_tokens=8, action_horizon=10)


def run_demo(out_dir: str | Path = "demo-output", quick: bool = False) -> dict:
    t_start = time.perf_counter()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    console = Console(width=max(Console().width, 100))
    episodes, frames = (6, (20, 40)) if quick else (24, (40, 80))
    root = out / "dataset"
    with Progress(console=console, transient=True) as progress:
        task = progress.add_task("writing demonstrations", total=episodes)
        make_synthetic_dataset(root, episodes=episodes, frames=frames, fps=10, resolution=(96, 96),
                               state_dim=8, action_dim=7, overwrite=True,
                               progress=lambda i, n: progress.update(task, completed=i))
    problems = validate_dataset(str(root))
    if problems:
        raise KilovlaError(f"the demo dataset failed validation: {problems[0]}")

    request = {"action": [i / 10 for i in range(DEMO_LAYOUT.action_horizon)],
               "observation.images.front": [-0.1, 0.0]}
    lake = DataLake([LakeSource(root=str(root), delta_timestamps=request)], DEMO_LAYOUT)
    config = PlanConfig(seed=0, global_batch_size=128 if quick else 512, token_budget=4096)
    plan = GlobalBatchPlan.from_lake(lake, config)
    steps = min(plan.steps_in_epoch(0), 4 if quick else 16)
    t0 = time.perf_counter()
    row_tokens, samples = [], 0
    for row in InProcessLoader(lake, plan, steps=steps):
        row_tokens.append(int(row["lengths"].sum()))
        samples += len(row["sample_index"])
    load_s = time.perf_counter() - t0
    fixed_tokens = DEMO_LAYOUT.fixed_tokens(3)  # openpi-style: 3 camera slots, 200 language tokens
    info = lake.datasets[0].meta.summary()
    report = {
        "tasks": info["tasks"],
        "dataset": {"episodes": info["episodes"], "frames": info["frames"], "cameras": info["cameras"],
                    "size_bytes": info["size_bytes"], "valid": True},
        "data": {
            "steps": steps,
            "samples": samples,
            "samples_per_s": samples / load_s,
            "rows": len(row_tokens),
            "padding_fraction": padding_fraction(row_tokens, config.token_budget),
            "fixed_padding_fraction": 1.0 - sum(row_tokens) / (samples * fixed_tokens),
        },
        "wall_s": time.perf_counter() - t_start,
    }
    _write_report(out, report)
    table = Table(title="kilovla demo (data stage)")
    table.add_column("what")
    table.add_column("value", justify="right")
    d = report["data"]
    table.add_row("dataset", f"{info['episodes']} episodes, {info['frames']} frames, {len(info['cameras'])} cameras, "
                             f"{info['size_bytes'] / 2**20:.1f} MiB")
    table.add_row("loaded", f"{d['samples']} samples in {d['rows']} packed rows, {d['samples_per_s']:.0f} samples/s")
    table.add_row("padding, fixed shape (openpi)", f"{d['fixed_padding_fraction']:.1%}")
    table.add_row("padding, packed rows (kilovla)", f"{d['padding_fraction']:.1%}")
    table.add_row("wall time", f"{report['wall_s']:.1f} s")
    console.print(table)
    console.print(f"report: {out / 'report.json'}, {out / 'report.md'}")
    return report


def _write_report(out: Path, report: dict) -> None:
    d = report["data"]
    md = "\n".join([
        "# kilovla demo", "",
        "| what | value |", "|---|---|",
        f"| dataset | {report['dataset']['episodes']} episodes, {report['dataset']['frames']} frames |",
        f"| loader | {d['samples_per_s']:.0f} samples/s ({d['samples']} samples, {d['rows']} rows) |",
        f"| padding, fixed shape | {d['fixed_padding_fraction']:.1%} |",
        f"| padding, packed | {d['padding_fraction']:.1%} |",
        f"| wall time | {report['wall_s']:.1f} s |", ""])
    for name, text in (("report.json", json.dumps(report, indent=2, default=_jsonable)), ("report.md", md)):
        tmp = out / f".{name}.{uuid.uuid4().hex[:8]}"
        tmp.write_text(text)
        os.replace(tmp, out / name)


def _jsonable(x):
    if isinstance(x, np.generic):
        return x.item()
    raise TypeError(f"not JSON serialisable: {type(x)}")
