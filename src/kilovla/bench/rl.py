"""`kilovla bench rl`: RL-VLA3 against the synchronous baseline, same workers, same policy, same algorithm.

Throughput rows `env_steps_per_s_sigma_{0,0.5,1.0,1.5}` and `env_steps_per_s_straggler`: Meta-World
envs (2 env workers x 12 envs, reach-v3 and push-v3, 32 px, two cameras rendered every step) behind
`LatencyWrapper` (lognormal step latency with the given sigma around a 50 ms mean; straggler: 5 %
of steps take 10x), the policy acting through the inference server and training on every global
batch. Baseline: `--mode sync` (all envs in lock step, then training); ours: `--mode async`
(max_staleness 1). Env steps per second over the run after its first policy version.

Batcher grid (async, sigma 1.0): B_max x T_max -> env steps/s and p99 queue wait (table, JSON, PNG).

Learning (not in --quick; `FINETUNE` is the recipe): from the same supervised checkpoint, sync and
async RL on the weak tasks (3 seeds each, `minutes / 6` each, success rate of training episodes
against env steps, PNG), and row
`rl_success_gain_points`: closed-loop success on 50 fixed-seed episodes per task after an async RL
run of at most `minutes` minutes, minus before (baseline: the supervised checkpoint).
"""

from __future__ import annotations

import json
import logging
import statistics
import tempfile
import time
from pathlib import Path

from kilovla.bench.common import DEFAULT_OUT, Row, write_suite
from kilovla.errors import KilovlaError

log = logging.getLogger(__name__)
LATENCY_MEAN_S = 0.05
SETTINGS = {  # row suffix -> LatencyModel fields
    "sigma_0": {"distribution": "constant", "mean_s": LATENCY_MEAN_S},
    "sigma_0.5": {"distribution": "lognormal", "mean_s": LATENCY_MEAN_S, "sigma": 0.5},
    "sigma_1.0": {"distribution": "lognormal", "mean_s": LATENCY_MEAN_S, "sigma": 1.0},
    "sigma_1.5": {"distribution": "lognormal", "mean_s": LATENCY_MEAN_S, "sigma": 1.5},
    "straggler": {"distribution": "straggler", "mean_s": LATENCY_MEAN_S, "p": 0.05, "k": 10},
}
WEAK_TASKS = ("reach-v3", "push-v3")
# The fine-tuning recipe of the learning runs: 12 envs in 2 workers at the demo's 64 px, episodes of
# 200 steps, 4-step SDE chains while acting, one version of staleness, a small learning rate with
# per-micro-batch advantage normalisation (1e-4 without it oscillated in a 30-minute trial).
FINETUNE = ("--env.workers=2", "--env.envs_per_worker=6", "--env.resolution=64", "--env.max_steps=200",
            "--rollout.segment_steps=8", "--rollout.sde_steps=4", "--learner.batch_segments=12",
            "--learner.max_staleness=1", "--learner.algo.micro_batch=48", "--learner.algo.optim.lr=3e-5",
            "--checkpoint.every=20")


def throughput_config(policy: str, run_dir: Path, mode: str, latency: dict, steps: int, **rollout):
    from kilovla.rl import runner

    overrides = [f"--run_dir={run_dir}", f"--policy={policy}", f"--mode={mode}", f"--steps={steps}",
                 f"--env.tasks=[{','.join(WEAK_TASKS)}]", "--env.workers=2", "--env.envs_per_worker=12",
                 "--env.resolution=32", "--rollout.segment_steps=4", "--learner.batch_segments=24",
                 "--learner.max_staleness=1", "--eval.episodes=0", "--progress=false",
                 f"--checkpoint.every={steps + 1}", "--env.latency=" + json.dumps(latency)]
    overrides += [f"--rollout.{k}={v}" for k, v in rollout.items()]
    return runner.load(None, overrides)


def _env_steps_per_s(summary: dict, run_dir: Path) -> float:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    after_first = records[1:] or records
    steps = records[-1]["env_steps"] - (records[0]["env_steps"] if len(records) > 1 else 0)
    wall = records[-1]["wall_s"] - (records[0]["wall_s"] if len(records) > 1 else 0)
    return steps / wall if wall > 0 else statistics.median(r["env_steps_per_s"] for r in after_first)


def _throughput_rows(policy: str, tmp: Path, steps: int, settings: dict) -> tuple[list[Row], dict]:
    from kilovla.rl import runner

    rows, raw = [], {}
    for name, latency in settings.items():
        speeds = {}
        for mode in ("sync", "async"):
            run_dir = tmp / f"{name}-{mode}"
            summary = runner.run(throughput_config(policy, run_dir, mode, latency, steps))
            speeds[mode] = _env_steps_per_s(summary, run_dir)
            raw[f"{name}/{mode}"] = {"env_steps_per_s": speeds[mode], "staleness": summary["staleness_histogram"]}
        rows.append(Row.compare(f"env_steps_per_s_{name}", "env-steps/s", speeds["sync"], speeds["async"],
                                higher_is_better=True,
                                note=f"metaworld reach+push, 24 envs in 2 workers, {latency['distribution']} latency "
                                     f"mean {LATENCY_MEAN_S * 1000:.0f} ms/step"
                                     f"{', sigma ' + str(latency['sigma']) if 'sigma' in latency else ''}; "
                                     "sync (lock step, then train) vs async (max_staleness 1)"))
    return rows, raw


def _batcher_grid(policy: str, tmp: Path, steps: int, sizes, waits) -> list[dict]:
    from kilovla.rl import runner

    grid = []
    for b in sizes:
        for t in waits:
            run_dir = tmp / f"grid-b{b}-t{t}"
            summary = runner.run(throughput_config(policy, run_dir, "async", SETTINGS["sigma_1.0"], steps,
                                                   max_batch_size=b, max_wait_s=t))
            last = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[-1])
            grid.append({"max_batch_size": b, "max_wait_s": t, "env_steps_per_s": _env_steps_per_s(summary, run_dir),
                         "queue_wait_p50_s": last["queue_wait_p50_s"], "queue_wait_p99_s": last["queue_wait_p99_s"],
                         "mean_batch_size": last["mean_batch_size"]})
    return grid


def success_gain(policy: str, run_dir: Path, *, minutes: float, episodes: int, seed: int = 0,
                 tasks=WEAK_TASKS, overrides: list[str] = ()) -> dict:
    """Closed-loop success of `policy` on `tasks`, an async RL run of at most `minutes`, success again."""
    from kilovla.eval.closed_loop import evaluate, load_policy
    from kilovla.rl import runner

    common = dict(tasks=list(tasks), episodes=episodes, batch_size=10, resolution=64, seed=seed)
    before = evaluate(load_policy(policy), **common)
    cfg = runner.load(None, [f"--run_dir={run_dir}", f"--policy={policy}", "--mode=async", f"--seed={seed}",
                             f"--env.tasks=[{','.join(tasks)}]", "--eval.episodes=0", "--progress=false", *FINETUNE,
                             "--steps=100000", *overrides])
    t0 = time.monotonic()
    summary = runner.run(cfg, time_budget_s=minutes * 60)
    after = evaluate(load_policy(summary["checkpoint"]), **common)
    return {"before": before["overall_success_rate"], "after": after["overall_success_rate"],
            "per_task": {t: {"before": before["per_task"][t]["success_rate"], "after": after["per_task"][t]["success_rate"]}
                         for t in tasks},
            "rl_minutes": (time.monotonic() - t0) / 60, "rl_steps": summary["steps"], "env_steps": summary["env_steps"],
            "checkpoint": summary["checkpoint"]}


def learning_curves(policy: str, tmp: Path, *, minutes: float, seeds=(0, 1, 2), overrides: list[str] = ()) -> dict:
    """Training-episode success against env steps for sync and async from the same start."""
    from kilovla.rl import runner

    curves = {}
    for mode in ("sync", "async"):
        for seed in seeds:
            run_dir = tmp / f"learn-{mode}-{seed}"
            cfg = runner.load(None, [f"--run_dir={run_dir}", f"--policy={policy}", f"--mode={mode}", f"--seed={seed}",
                                     f"--env.tasks=[{','.join(WEAK_TASKS)}]", "--eval.episodes=0", "--progress=false",
                                     *FINETUNE, "--steps=100000", *overrides])
            runner.run(cfg, time_budget_s=minutes * 60)
            records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
            curves[f"{mode}/{seed}"] = [(r["env_steps"], r["wall_s"], r["success_rate"]) for r in records]
    return curves


def _plot(out_dir: Path, rows: list[Row], grid: list[dict], curves: dict) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = 3 if curves else 2
    fig, axes = plt.subplots(1, panels, figsize=(5 * panels, 4))
    names = [r.name.removeprefix("env_steps_per_s_") for r in rows]
    axes[0].bar(names, [r.ratio or 0 for r in rows], color="tab:blue")
    axes[0].axhline(1.0, color="black", lw=0.8)
    axes[0].set_ylabel("async / sync env-steps/s")
    axes[0].set_title("throughput under env latency")
    for b in sorted({g["max_batch_size"] for g in grid}):
        pts = [g for g in grid if g["max_batch_size"] == b]
        axes[1].plot([g["queue_wait_p99_s"] * 1000 for g in pts], [g["env_steps_per_s"] for g in pts], "o-",
                     label=f"B_max {b}")
        for g in pts:
            axes[1].annotate(f"T {g['max_wait_s'] * 1000:g} ms", (g["queue_wait_p99_s"] * 1000, g["env_steps_per_s"]),
                             fontsize=7)
    axes[1].set_xlabel("p99 queue wait (ms)")
    axes[1].set_ylabel("env-steps/s")
    axes[1].set_title("dynamic batcher, sigma 1.0")
    axes[1].legend()
    if curves:
        for key, pts in curves.items():
            pts = [(s, r) for s, _, r in pts if r is not None]
            axes[2].plot([s for s, _ in pts], [r for _, r in pts], color="tab:orange" if key.startswith("async") else
                         "tab:gray", alpha=0.8, label=key)
        axes[2].set_xlabel("env steps")
        axes[2].set_ylabel("training success rate")
        axes[2].set_title("learning: sync vs async")
        axes[2].legend(fontsize=7)
    fig.tight_layout()
    path = out_dir / "rl.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def default_policy() -> str:
    """The demo's supervised checkpoint (`kilovla demo` writes it)."""
    from kilovla.train.checkpoint import latest

    found = latest(Path("demo-output") / "run" / "checkpoints")
    if found is None:
        raise KilovlaError("kilovla bench rl needs a policy folder: pass --policy PATH (e.g. the checkpoint "
                           "`kilovla demo` writes to demo-output/run/checkpoints/)")
    return str(found)


def run(*, quick: bool = False, out_dir: str | Path = DEFAULT_OUT, policy: str | None = None, minutes: float = 30.0,
        console=None) -> Path:
    policy = policy or default_policy()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="kilovla-bench-rl-") as tmp:
        tmp = Path(tmp)
        rows, raw = _throughput_rows(policy, tmp, 3 if quick else 8, SETTINGS)
        grid = _batcher_grid(policy, tmp, 3 if quick else 6, (4, 16) if quick else (4, 12, 24),
                             (0.0, 0.02) if quick else (0.0, 0.005, 0.02))
        extra = {"throughput": raw, "batcher_grid": grid, "policy": policy}
        curves = {}
        if not quick:
            curves = learning_curves(policy, tmp, minutes=minutes / 6)  # 6 runs: as long as the fine-tuning
            gain = success_gain(policy, out / "rl-finetune", minutes=minutes, episodes=50)
            extra.update(learning_curves=curves, success_gain=gain)
            rows.append(Row("rl_success_gain_points", "points", round(gain["before"] * 100, 1),
                            round((gain["after"] - gain["before"]) * 100, 1), None, None,
                            note=f"baseline: closed-loop success (%) of the supervised checkpoint on "
                                 f"{', '.join(WEAK_TASKS)}, 50 fixed-seed episodes per task; ours: after - before, "
                                 f"after {gain['rl_minutes']:.0f} min of async RL ({gain['env_steps']} env steps)"))
        extra["plot"] = str(_plot(out, rows, grid, curves))
    _print_grid(grid, console)
    return write_suite("rl", rows, quick=quick, out_dir=out, extra=extra, console=console)


def _print_grid(grid: list[dict], console=None) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="dynamic batcher (async, lognormal sigma 1.0)")
    for col in ("B_max", "T_max (ms)", "env-steps/s", "mean batch", "queue wait p50 (ms)", "p99 (ms)"):
        table.add_column(col)
    for g in grid:
        table.add_row(str(g["max_batch_size"]), f"{g['max_wait_s'] * 1000:g}", f"{g['env_steps_per_s']:.0f}",
                      f"{g['mean_batch_size']:.1f}", f"{g['queue_wait_p50_s'] * 1000:.1f}",
                      f"{g['queue_wait_p99_s'] * 1000:.1f}")
    (console or Console(width=150)).print(table)
