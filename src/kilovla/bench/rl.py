"""`kilovla bench rl`: RL-VLA3 against the synchronous baseline, same workers, same policy, same algorithm.

`--rl.only=throughput` runs the throughput rows and the batcher grid (PPO, as always measured),
`--rl.only=gain` the closed-loop gain rows; neither: both (`--quick`: throughput only).

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

Gain rows (not in --quick): from a start checkpoint (`--policy.path`, or the weak one `start_policy` builds
under OUT/rl-start with `START_RECIPE`), closed-loop success on reach-v3 + push-v3 (100 fixed-seed
episodes per task, `EVAL_SEED`, disjoint from the demonstrations' and RL's seeds), then an RL run of
residual SAC (the `GAIN` recipe) for `env_steps` (120 k; `minutes` caps it),
async, evaluated again: `rl_success_gain_points`; the same budget in sync mode:
`rl_success_gain_points_sync`. Each row's note has the per-task rates, both Wilson intervals, env
steps, versions and minutes; OUT/rl_learning_curve.png plots training-episode success against env
steps for both runs.
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
from kilovla.demo import DENSE_MODEL
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
# The start checkpoint of the gain rows when no --policy.path is given: the demo's recipe cut down to the two
# tasks, few demonstrations and few steps, no EMA (the folder's weights are what is evaluated and fine-
# tuned). Measured on 2 cores: see docs/rl_finetune.md (closed loop between 25 % and 65 %). 250 steps since the
# reach expert aims its TCP at the goal (stop 54): 500 steps then scored 75 % (reach 91 %), 250 steps 49.5 %.
# The model and its packed rows are pinned (the demo's dense pi0-tiny, 4096-token rows; the demo's steps are one row
# since stop 56) so that a change of the demo's own recipe leaves the start as it is.
START_RECIPE = {"tasks": WEAK_TASKS, "episodes_per_task": 10, "train_steps": 250, "warmup_steps": 50, "ema_decay": None,
                "model": DENSE_MODEL, "token_budget": 4096}
# The gain rows' RL recipe (residual SAC): 12 envs in 2 workers at the policy's resolution, Meta-World's
# 200-step evaluation horizon, 8-chunk segments, a policy version (an actor sync) every 12 segments;
# off-policy, so rollouts may run ahead of the learner by several versions. Reward: progress shaping
# (the change of Meta-World's shaped reward, x 0.1: an episode's shaping sums to at most 1.0, and
# hovering near the goal earns nothing) plus 1.0 on success; the penalty anchoring the correction at
# 0.2 (docs/rl_finetune.md, trial g6: the first to rise).
GAIN = ("--learner.algo.name=residual_sac", "--env.workers=2", "--env.envs_per_worker=6", "--env.max_steps=200", "--rollout.segment_steps=8",
        "--learner.batch_segments=12", "--learner.max_staleness=4", "--checkpoint.every=50",
        "--env.shaping=progress", "--env.reward_scale=0.1", "--env.success_bonus=1.0", "--learner.algo.sac.penalty=0.2")
# 120 k env steps per mode: the gain rows measured +23 (async) and +19.5 (sync) points there, the
# learning curves flat from ~80 k (docs/rl_finetune.md); the 250 k per mode would take the whole
# `--rl.only=gain` run to ~110 minutes on 2 cores (~100 env-steps/s in either mode), past its 90-minute target.
GAIN_ENV_STEPS = 120_000
GAIN_EPISODES = 100  # per task, before and after
EVAL_SEED = 1  # closed_loop.episode_seeds: envs/seeds.py's eval stream, disjoint from the demonstrations' and RL's


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
                 "--progress=false", f"--checkpoint.every={steps + 1}", "--learner.algo.name=ppo",
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


def start_policy(out: Path) -> str:
    """The gain rows' weak start checkpoint (START_RECIPE), built under OUT/rl-start unless one built with the
    same recipe is there."""
    from kilovla.demo import FULL, build_demo_cache, collect_demonstrations, train_policy
    from kilovla.train.checkpoint import latest

    root = out / "rl-start"
    recipe_file = root / "recipe.json"
    found = latest(root / "run" / "checkpoints") if recipe_file.is_file() else None
    if found is not None and json.loads(recipe_file.read_text()) == json.loads(json.dumps(START_RECIPE)):
        return str(found)
    recipe = FULL.replace(**START_RECIPE)
    root.mkdir(parents=True, exist_ok=True)
    log.info("bench rl: building the weak start checkpoint (%d demonstrations per task, %d steps)",
             recipe.episodes_per_task, recipe.train_steps)
    collect_demonstrations(recipe, root / "data")
    build_demo_cache(root / "data")
    checkpoint = train_policy(recipe, root / "data", root / "run", progress=False)["checkpoint"]
    recipe_file.write_text(json.dumps(START_RECIPE))
    return str(checkpoint)


def closed_loop(policy: str, episodes: int, tasks=WEAK_TASKS) -> dict:
    """Closed-loop success per task on fixed seeds (EVAL_SEED), with 95 % Wilson intervals: the base's Euler
    steps from seeded noise, a residual's mean (deterministic given the seed)."""
    import torch

    from kilovla.eval.closed_loop import evaluate, load_policy
    from kilovla.eval.intervals import wilson_interval
    from kilovla.eval.settings import EvalSettings

    torch.manual_seed(EVAL_SEED)  # the base's initial noise: the same draws before and after
    report = evaluate(load_policy(policy), EvalSettings(tasks=tasks, episodes=episodes, batch_size=10, seed=EVAL_SEED,
                                                        resolution=_resolution(policy), workers=2))
    per_task = {}
    for t, r in report["per_task"].items():
        won = round(r["success_rate"] * episodes)
        per_task[t] = {"success": won / episodes, "successes": won, "ci95": list(wilson_interval(won, episodes))}
    won = sum(r["successes"] for r in per_task.values())
    n = episodes * len(tasks)
    return {"success": won / n, "successes": won, "episodes": n, "ci95": list(wilson_interval(won, n)), "per_task": per_task}


def _resolution(policy: str) -> int:
    from kilovla.policy_folder import PolicyFolder

    size = PolicyFolder.open(policy).meta.image_size
    return max(size) if size else 64


def success_gain(policy: str, run_dir: Path, *, mode: str, env_steps: int, minutes: float, before: dict,
                 episodes: int = GAIN_EPISODES, seed: int = 0, recipe=GAIN, overrides: list[str] = ()) -> dict:
    """An RL run of `recipe` + `overrides` in `mode` from `policy` for `env_steps` (0: no cap; at most
    `minutes`), then its closed loop against `before`. A run of an earlier invocation in `run_dir` is replaced."""
    from kilovla.folders import RUN, clear
    from kilovla.rl import runner

    if run_dir.exists():
        clear(run_dir, RUN)  # refuses a folder holding anything but a run

    cfg = runner.load(None, [f"--run_dir={run_dir}", f"--policy={policy}", f"--mode={mode}", f"--seed={seed}",
                             f"--env.tasks=[{','.join(WEAK_TASKS)}]", "--eval.episodes=0", "--progress=false", *recipe,
                             "--steps=1000000", f"--max_env_steps={env_steps}", *overrides])
    t0 = time.monotonic()
    summary = runner.run(cfg, time_budget_s=minutes * 60)
    rl_minutes = (time.monotonic() - t0) / 60
    after = closed_loop(summary["checkpoint"], episodes)
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {"mode": mode, "algorithm": cfg.learner.algo.name, "before": before, "after": after,
            "gain_points": round(100 * (after["success"] - before["success"]), 1),
            "rl_minutes": rl_minutes, "versions": summary["steps"], "env_steps": summary["env_steps"],
            "checkpoint": summary["checkpoint"],
            "curve": [(r["env_steps"], r["wall_s"], r["episodes"], r["successes"]) for r in records]}


def gain_row(name: str, gain: dict) -> Row:
    b, a = gain["before"], gain["after"]
    tasks = ", ".join(f"{t} {100 * b['per_task'][t]['success']:.0f} -> {100 * a['per_task'][t]['success']:.0f} %"
                      for t in b["per_task"])
    ci = lambda r: f"[{100 * r['ci95'][0]:.0f}, {100 * r['ci95'][1]:.0f}]"  # noqa: E731
    return Row(name, "points", round(100 * b["success"], 1), gain["gain_points"], None, None,
               note=f"baseline: closed-loop success (%) of the start checkpoint, ours: after - before; {tasks}; "
                    f"{b['episodes'] // len(b['per_task'])} fixed-seed deterministic episodes per task; before "
                    f"{ci(b)}, after {ci(a)} (95 % Wilson); {gain['mode']} {gain['algorithm']}, {gain['env_steps']} env "
                    f"steps, {gain['versions']} versions, {gain['rl_minutes']:.1f} min")


def plot_curves(out_dir: Path, gains: list[dict]) -> Path:
    """Training-episode success against env steps, one line per run (success over windows of ~10k env steps)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for gain in gains:
        xs, ys, window = [], [], [0, 0, 0]
        for env_steps, _, episodes, successes in gain["curve"]:
            window[1] += episodes
            window[2] += successes
            if env_steps - window[0] >= 10_000 and window[1]:
                xs.append(env_steps)
                ys.append(100 * window[2] / window[1])
                window = [env_steps, 0, 0]
        ax.plot(xs, ys, "-o", ms=3, label=f"{gain['mode']} (closed loop {100 * gain['before']['success']:.0f} -> "
                                          f"{100 * gain['after']['success']:.0f} %)",
                color="tab:orange" if gain["mode"] == "async" else "tab:gray")
    if gains:
        ax.axhline(100 * gains[0]["before"]["success"], color="black", lw=0.8, ls="--", label="start, closed loop")
    ax.set_xlabel("env steps")
    ax.set_ylabel("training-episode success (%)")
    ax.set_title("residual SAC on reach-v3 + push-v3, 2 CPU cores")
    ax.legend(fontsize=7)
    fig.tight_layout()
    path = out_dir / "rl_learning_curve.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _plot(out_dir: Path, rows: list[Row], grid: list[dict]) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
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
    fig.tight_layout()
    path = out_dir / "rl.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def default_policy() -> str:
    """The demo's supervised checkpoint (`kilovla demo` writes it): what `bench fp8` and `bench serve` take."""
    from kilovla.train.checkpoint import latest

    found = latest(Path("demo-output") / "run" / "checkpoints")
    if found is None:
        raise KilovlaError("this benchmark needs a policy folder: pass --policy.path=PATH (e.g. the checkpoint "
                           "`kilovla demo` writes to demo-output/run/checkpoints/)")
    return str(found)


def run(*, quick: bool = False, out_dir: str | Path = DEFAULT_OUT, policy: str | None = None, minutes: float = 60.0,
        env_steps: int = GAIN_ENV_STEPS, only: str | None = None, console=None) -> Path:
    """`only`: "throughput" (the sync/async rows and the batcher grid) or "gain" (the closed-loop gain rows);
    None: both (--quick: throughput only). Without `policy` the start checkpoint is built (`start_policy`)."""
    if only not in (None, "gain", "throughput"):
        raise KilovlaError(f"bench rl: --rl.only must be gain or throughput, not {only!r}")
    if quick and only == "gain":
        raise KilovlaError("bench rl --rl.only=gain has no --quick form: the gain rows need real RL runs")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    policy = policy or start_policy(out)
    rows, extra, grid = [], {"policy": policy}, []
    if only != "gain":
        grid = _throughput(policy, quick, rows, extra)
        extra["plot"] = str(_plot(out, rows, grid))
    if not quick and only != "throughput":
        before = closed_loop(policy, GAIN_EPISODES)
        gains = [success_gain(policy, out / f"rl-gain-{mode}", mode=mode, env_steps=env_steps, minutes=minutes,
                              before=before) for mode in ("async", "sync")]
        rows += [gain_row("rl_success_gain_points", gains[0]), gain_row("rl_success_gain_points_sync", gains[1])]
        extra.update(success_gain={g["mode"]: g for g in gains}, learning_curve=str(plot_curves(out, gains)))
    if grid:
        _print_grid(grid, console)
    return write_suite("rl", rows, quick=quick, out_dir=out, extra=extra, console=console, merge=only is not None)


def _throughput(policy: str, quick: bool, rows: list, extra: dict) -> list[dict]:
    """The throughput rows (appended to `rows`) and the batcher grid; PPO, as they have always been measured."""
    with tempfile.TemporaryDirectory(prefix="kilovla-bench-rl-") as tmp:
        tmp = Path(tmp)
        work = FULL
        if quick:  # the model's compute as sleeps timed from the real policy, here, once for every run
            from kilovla.rl import runner
            from kilovla.rl.compute import ComputeSection

            calibrating = workload_config(policy, tmp / "calibrate", "async", QUICK, "sigma_1.0", 1)
            work = dataclasses.replace(QUICK, compute=runner.calibrate(
                dataclasses.replace(calibrating, compute=ComputeSection("calibrated"))))
        from kilovla.rl.config import RolloutSection

        measured, raw = _throughput_rows(policy, tmp, work)
        rows += measured
        default, run_dirs = RolloutSection(), {k: v.pop("run_dir") for k, v in raw.items()}
        same = {(default.max_batch_size, default.max_wait_s): run_dirs["sigma_1.0/async"]} \
            if work.grid_steps == work.steps else {}
        grid = _batcher_grid(policy, tmp, work, same)
    extra.update(throughput=raw, batcher_grid=grid, workload={k: v for k, v in vars(work).items() if k != "compute"},
                 model_compute="real" if work.compute is None else vars(work.compute))
    return grid


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
