"""`kilovla bench rl`: RL-VLA3 against the synchronous baseline, same workers, same policy, same algorithm.

Throughput rows `env_steps_per_s_sigma_{0,0.5,1.0,1.5}` and `env_steps_per_s_straggler`: Meta-World
envs (2 env workers x 12 envs, reach-v3 and push-v3, 32 px, two cameras rendered once per chunk)
behind `LatencyWrapper` (lognormal step latency with the given sigma around the workload's mean;
straggler: 5 % of steps take 10x), the policy acting through the inference server and training on
every global batch. Baseline: `--mode sync` (all envs in lock step, then training); ours: `--mode
async` (max_staleness 1). Env steps the workers executed per second, from the end of the first
policy version to the end of the last (the envs' own counters, so segments that async runs ahead
of the learner count when they are played, not when the learner takes them).

Two workloads (`Workload`), each the same for both modes:
- full: 50 ms/step mean latency, 4-step segments, 24 per global batch, the real model. On a
  CPU-only box the model's inference and training share the cores with the envs, so both modes
  are compute-bound and the schedule hardly shows.
- `--quick`: the model's compute as calibrated sleeps (`rl/calibrated.py`): the real policy is timed
  once, in this process, before the runs (inference at batch 1, 16, 24; a learner micro-batch of 4
  and 32; one bootstrap value; one optimizer step), the fitted lines go into every run, the suite
  JSON (`model_compute`) and every row's note. 200 ms/step mean latency (the envs' rendering then
  needs under one of the two cores), 1-step segments (one chunk), 96 per global batch (four per
  env), 3 policy versions per run. The policy does not learn in these runs; they measure the schedule.

Batcher grid (async, sigma 1.0): B_max x T_max -> env steps/s and p99 queue wait (table, JSON, PNG);
in --quick the throughput row's async run is the default batcher's (B_max 16, T_max 0) point.

Learning (not in --quick; `FINETUNE` is the recipe): from the same supervised checkpoint, sync and
async RL on the weak tasks (3 seeds each, `minutes / 6` each, success rate of training episodes
against env steps, PNG), and row
`rl_success_gain_points`: closed-loop success on 50 fixed-seed episodes per task after an async RL
run of at most `minutes` minutes, minus before (baseline: the supervised checkpoint).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import tempfile
import time
from dataclasses import dataclass
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
# 200 steps, 4-step SDE chains while acting, one version of staleness, 24 segments (192 samples) per
# step at lr 3e-5, and a KL penalty to the start policy: without it every learning rate tried drifted
# down (the narrow demo checkpoint, 14 min: 48 % -> 30 % at lr 3e-5, 40 % at 1e-5 with 48 segments;
# with kl_coef 1.0 -> 54 % in 14 min, 48 % in 30: it holds, it does not add; advantage-weighted regression
# instead of PPO lost more, 38 % at best; docs/rl_finetune.md).
FINETUNE = ("--env.workers=2", "--env.envs_per_worker=6", "--env.resolution=64", "--env.max_steps=200",
            "--rollout.segment_steps=8", "--rollout.sde_steps=4", "--learner.batch_segments=24",
            "--learner.max_staleness=1", "--learner.algo.micro_batch=48", "--learner.algo.optim.lr=3e-5",
            "--learner.algo.kl_coef=1.0", "--checkpoint.every=20")


@dataclass(frozen=True)
class Workload:
    """The throughput runs: the same for both modes; `compute` None runs the model, else its calibrated sleeps."""

    latency_mean_s: float
    segment_steps: int
    batch_segments: int
    steps: int  # policy versions per run; the first (start-up) is not measured
    grid_steps: int
    grid_sizes: tuple = (4, 16)
    grid_waits: tuple = (0.0, 0.02)
    compute: object = None

    def latency(self, setting: str) -> dict:
        return {**SETTINGS[setting], "mean_s": self.latency_mean_s}

    def describe(self) -> str:
        return (f"metaworld reach+push, 24 envs in 2 workers, 32 px, 2 cameras, {self.segment_steps}-step segments, "
                f"{self.batch_segments} per global batch")


FULL = Workload(LATENCY_MEAN_S, segment_steps=4, batch_segments=24, steps=8, grid_steps=6, grid_sizes=(4, 12, 24),
                grid_waits=(0.0, 0.005, 0.02))
# --quick: the model's compute as calibrated sleeps (a cluster runs it on accelerators). Rendering two
# cameras costs ~30 ms of CPU per chunk here (llvmpipe), so 24 envs at 50 ms/step would need ~2.5 of the
# 2 cores; at 200 ms/step they need ~0.8, which leaves the schedule, not this CPU, setting the pace.
# One-chunk segments, four per env per global batch (sync: four lock steps per version): a slow env holds
# back async's version barrier by one chunk, not a whole segment (2-step segments, 48 per batch: 1.8x at
# sigma 1.0 against 2.4x in a side-by-side trial).
QUICK = Workload(0.2, segment_steps=1, batch_segments=96, steps=3, grid_steps=3)


def workload_config(policy: str, run_dir: Path, mode: str, work: Workload, setting: str, steps: int, **rollout):
    """A throughput run of `work` under latency `setting`; `work.compute` (a `ComputeSection`) replaces the
    model's arithmetic with its sleeps."""
    from kilovla.rl import runner

    overrides = [f"--run_dir={run_dir}", f"--policy={policy}", f"--mode={mode}", f"--steps={steps}",
                 f"--env.tasks=[{','.join(WEAK_TASKS)}]", "--env.workers=2", "--env.envs_per_worker=12",
                 "--env.resolution=32", f"--rollout.segment_steps={work.segment_steps}",
                 f"--learner.batch_segments={work.batch_segments}", "--learner.max_staleness=1", "--eval.episodes=0",
                 "--progress=false", f"--checkpoint.every={steps + 1}",
                 "--env.latency=" + json.dumps(work.latency(setting))]
    overrides += [f"--rollout.{k}={v}" for k, v in rollout.items()]
    if work.compute is not None:
        overrides += [f"--compute.{k}={v}" for k, v in vars(work.compute).items()]
    return runner.load(None, overrides)


def _env_steps_per_s(run_dir: Path) -> float:
    """Env steps the workers executed per second between the first policy version and the last (the envs'
    own counters: segments run ahead of the learner count when they are stepped, not when consumed)."""
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    first, last = (records[0], records[-1]) if len(records) > 1 else ({"env_steps_executed": 0, "wall_s": 0.0}, records[-1])
    return (last["env_steps_executed"] - first["env_steps_executed"]) / (last["wall_s"] - first["wall_s"])


def _throughput_rows(policy: str, tmp: Path, work: Workload, settings=tuple(SETTINGS)) -> tuple[list[Row], dict]:
    from kilovla.rl import runner

    compute = "real" if work.compute is None else work.compute.describe()
    rows, raw = [], {}
    for name in settings:
        latency, speeds = work.latency(name), {}
        for mode in ("sync", "async"):
            run_dir = tmp / f"{name}-{mode}"
            summary = runner.run(workload_config(policy, run_dir, mode, work, name, work.steps))
            speeds[mode] = _env_steps_per_s(run_dir)
            raw[f"{name}/{mode}"] = {"env_steps_per_s": speeds[mode], "staleness": summary["staleness_histogram"],
                                     "run_dir": str(run_dir)}
        rows.append(Row.compare(f"env_steps_per_s_{name}", "env-steps/s", speeds["sync"], speeds["async"],
                                higher_is_better=True,
                                note=f"{work.describe()}, {latency['distribution']} latency "
                                     f"mean {latency['mean_s'] * 1000:.0f} ms/step"
                                     f"{', sigma ' + str(latency['sigma']) if 'sigma' in latency else ''}; "
                                     f"sync (lock step, then train) vs async (max_staleness 1); model compute: {compute}"))
    return rows, raw


def _batcher_grid(policy: str, tmp: Path, work: Workload, done: dict | None = None) -> list[dict]:
    """Async at sigma 1.0 over B_max x T_max; `done` maps (B_max, T_max) to a run directory already measured
    with the same workload (the throughput row's async run is the default batcher's point)."""
    from kilovla.rl import runner

    grid = []
    for b in work.grid_sizes:
        for t in work.grid_waits:
            run_dir = (done or {}).get((b, t))
            if run_dir is None:
                run_dir = tmp / f"grid-b{b}-t{t}"
                runner.run(workload_config(policy, run_dir, "async", work, "sigma_1.0", work.grid_steps,
                                           max_batch_size=b, max_wait_s=t))
            last = json.loads((Path(run_dir) / "metrics.jsonl").read_text().splitlines()[-1])
            grid.append({"max_batch_size": b, "max_wait_s": t, "env_steps_per_s": _env_steps_per_s(Path(run_dir)),
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
        work = FULL
        if quick:  # the model's compute as sleeps timed from the real policy, here, once for every run
            from kilovla.rl import runner
            from kilovla.rl.compute import ComputeSection

            calibrating = workload_config(policy, tmp / "calibrate", "async", QUICK, "sigma_1.0", 1)
            work = dataclasses.replace(QUICK, compute=runner.calibrate(
                dataclasses.replace(calibrating, compute=ComputeSection("calibrated"))))
        from kilovla.rl.runner import RolloutSection

        rows, raw = _throughput_rows(policy, tmp, work)
        default, run_dirs = RolloutSection(), {k: v.pop("run_dir") for k, v in raw.items()}
        same = {(default.max_batch_size, default.max_wait_s): run_dirs["sigma_1.0/async"]} \
            if work.grid_steps == work.steps else {}
        grid = _batcher_grid(policy, tmp, work, same)
        extra = {"throughput": raw, "batcher_grid": grid, "policy": policy,
                 "workload": {k: v for k, v in vars(work).items() if k != "compute"},
                 "model_compute": "real" if work.compute is None else vars(work.compute)}
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
