"""`kilovla demo`: the closed loop on an embedded default, no network, no flags.

    collect scripted demonstrations (Meta-World, the default task set, two cameras)
      -> train a tiny pi0.5 with packing, dynamic padding and the unused camera pruned
      -> evaluate it closed-loop, and the scripted expert on the same seeds
      -> one table, and DIR/report.json, report.md, learning_curve.png, videos/

`--quick` is the minute-scale smoke run the tests use.
"""

from __future__ import annotations

import json
import os
import shutil
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console
from rich.table import Table

from kilovla.config import load_config
from kilovla.data.lerobot import DatasetMeta
from kilovla.envs.collect import collect
from kilovla.envs.metaworld import DEFAULT_TASKS


@dataclass(frozen=True)
class DemoSize:
    tasks: tuple[str, ...]
    episodes_per_task: int
    resolution: int
    train_steps: int
    eval_episodes: int
    workers: int


FULL = DemoSize(DEFAULT_TASKS, 20, 64, 2500, 10, 2)
QUICK = DemoSize(("reach-v3", "drawer-close-v3"), 3, 32, 30, 2, 0)

# A CPU-sized pi0.5: 64 px images (64 tokens per camera), 10-step action chunks, the full
# Meta-World state (hand + objects + goal) as state input.
POLICY_OVERRIDES = ("{chunk_size: 10, max_state_dim: 48, packing: true, language_padding: longest, "
                    "disabled_cameras: [right_wrist_0_rgb], vision: {image_size: %d}}")
N_ACTION_STEPS = 5


def run_demo(out_dir: str | Path = "demo-output", quick: bool = False) -> dict:
    from kilovla.eval.closed_loop import evaluate, load_policy
    from kilovla.train.trainer import TrainConfig, train

    t0 = time.perf_counter()
    size = QUICK if quick else FULL
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    console = Console(width=max(Console().width, 100))
    tasks = list(size.tasks)

    console.rule("1/4 collect scripted demonstrations")
    data = out / "dataset"
    collected = collect(data, tasks=tasks, episodes_per_task=size.episodes_per_task, resolution=size.resolution,
                        noise_std=0.1, batch_size=5, num_workers=size.workers, overwrite=True)
    info = DatasetMeta(data).summary()

    console.rule("2/4 train pi0.5 (tiny) with packing")
    run = out / "run"
    shutil.rmtree(run, ignore_errors=True)
    cfg = load_config(TrainConfig, None, [
        f"--run_dir={run}", f"--steps={size.train_steps}", f"--dataset.roots=[{data}]",
        # Steps fixed in tokens (~64 samples, a bit under 3 rows) so that packed rows come out full.
        "--batch.global_batch_tokens=12000", "--batch.token_budget=4096", f"--checkpoint.every={size.train_steps}",
        f"--policy.overrides={POLICY_OVERRIDES % size.resolution}",
        "--policy.state_keys=[observation.state, observation.environment_state]",
        f"--policy.n_action_steps={N_ACTION_STEPS}", "--optim.lr=1e-3", "--optim.warmup_steps=50",
        f"--progress={'false' if quick else 'true'}",
    ])
    summary = train(cfg)

    console.rule("3/4 closed-loop evaluation")
    common = dict(tasks=tasks, episodes=size.eval_episodes, batch_size=5, resolution=size.resolution,
                  num_workers=size.workers)
    learned = evaluate(load_policy(summary["checkpoint"]), out_dir=out / "eval-policy", videos=1, **common)
    expert = evaluate(load_policy("scripted"), out_dir=out / "eval-expert", videos=0, **common)

    console.rule("4/4 report")
    if Path(summary.get("plot") or "").is_file():
        shutil.copy(summary["plot"], out / "learning_curve.png")
    report = {
        "tasks": tasks,
        "policy_success_rate": learned["overall_success_rate"],
        "expert_success_rate": expert["overall_success_rate"],
        "per_task": {t: {"policy": learned["per_task"][t]["success_rate"], "expert": expert["per_task"][t]["success_rate"]}
                     for t in tasks},
        "dataset": {"root": str(data), "episodes": info["episodes"], "frames": info["frames"],
                    "size_bytes": info["size_bytes"], "dropped_episodes": sum(collected.dropped.values())},
        "train": {"steps": summary["steps"], "samples_per_s": summary["samples_per_s"],
                  "padding_fraction": summary["padding_fraction"], "final_loss": summary["final_loss"],
                  "checkpoint": summary["checkpoint"]},
        "env_backend": learned["env_backend"],
        "quick": quick,
        "wall_s": time.perf_counter() - t0,
    }
    _write_report(out, report)
    _print_table(console, report)
    return report


def _print_table(console: Console, report: dict) -> None:
    table = Table(title="kilovla demo: collect -> train -> evaluate (Meta-World)")
    table.add_column("what")
    table.add_column("value", justify="right")
    d, tr = report["dataset"], report["train"]
    table.add_row("dataset", f"{d['episodes']} episodes, {d['frames']} frames, {d['size_bytes'] / 2**20:.1f} MiB")
    table.add_row("training", f"{tr['steps']} steps, {tr['samples_per_s']:.0f} samples/s, final loss {tr['final_loss']:.3f}")
    table.add_row("padding (packed rows)", f"{tr['padding_fraction']:.1%}")
    for task, r in report["per_task"].items():
        table.add_row(f"success {task}", f"policy {_pct(r['policy'])} | expert {_pct(r['expert'])}")
    table.add_row("success overall", f"policy {_pct(report['policy_success_rate'])} | "
                                     f"expert {_pct(report['expert_success_rate'])}")
    table.add_row("wall time", f"{report['wall_s'] / 60:.1f} min")
    console.print(table)


def _pct(x) -> str:
    return "-" if x is None else f"{x:.0%}"


def _write_report(out: Path, report: dict) -> None:
    d, tr = report["dataset"], report["train"]
    lines = ["# kilovla demo", "", f"{report['env_backend']}", "",
             "| task | learned policy | scripted expert |", "|---|---|---|"]
    lines += [f"| {t} | {_pct(r['policy'])} | {_pct(r['expert'])} |" for t, r in report["per_task"].items()]
    lines += [f"| **overall** | **{_pct(report['policy_success_rate'])}** | **{_pct(report['expert_success_rate'])}** |", "",
              f"Dataset: {d['episodes']} episodes, {d['frames']} frames. Training: {tr['steps']} steps at "
              f"{tr['samples_per_s']:.0f} samples/s, padding {tr['padding_fraction']:.1%}, final loss {tr['final_loss']:.3f}.",
              f"Wall time {report['wall_s'] / 60:.1f} min.", "", "![learning curve](learning_curve.png)", ""]
    for name, text in (("report.json", json.dumps(report, indent=2)), ("report.md", "\n".join(lines))):
        tmp = out / f".{name}.{uuid.uuid4().hex[:8]}"
        tmp.write_text(text)
        os.replace(tmp, out / name)
