"""Closed-loop evaluation: a policy acts in the simulator; we count successes per task.

`evaluate(policy, EvalSettings(tasks=..., episodes=N))` plays N episodes per task with fixed seeds (the same
seeds for every policy, so success rates compare; `envs/seeds.py`'s eval stream, which never meets
the seeds `collect` records demonstrations on), batching the policy over vectorised envs and
executing `n_action_steps` of each predicted action chunk. It returns the report and, with
`out_dir`, writes `report.json`, `report.md` and mp4 videos of the first `videos` episodes per task.
Every setting is a field of `EvalSettings` (eval/settings.py); the env's own rules (tasks, spec, render
resolution, scripted expert) come from its `EnvType` (envs/base.py).
Every success rate comes with its 95 % Wilson interval (`eval/intervals.py`). The trainer calls the same
function for in-training evaluation.

An `out_dir` that holds an earlier evaluation is replaced whole (its report and videos), never mixed
with the new one; `replace=False` refuses it instead (`kilovla eval --output_dir`, where the user named it).
`kilovla eval` without --output_dir writes a fresh `eval-output/<UTC date>_<time>_<env>_<policy>/`
(`new_output_dir`). Progress goes to stdout as it runs (a line at least every 10 s off a terminal,
the count of finished episodes per task), then one line with the success rate.

A crashed env process does not end the evaluation: its task is reported with the error and the
seeds that were running, its unfinished episodes count as failures (`crashed_episodes`, so a crash
never inflates a success rate), and the other tasks still run.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import logging
import os
import re
import time
import traceback
import uuid
from collections.abc import Callable
from pathlib import Path

import numpy as np

from kilovla.envs.base import env_type
from kilovla.envs.rollout import run_episodes
from kilovla.envs.seeds import eval_seeds
from kilovla.envs.vector import EnvConfig, EnvCrashed, WarmPool
from kilovla.errors import KilovlaError
from kilovla.eval.intervals import wilson_interval
from kilovla.eval.settings import EvalSettings
from kilovla.folders import EVALUATION, check_new_evaluation, clear, policy_folder
from kilovla.progress import TaskProgress, result

log = logging.getLogger(__name__)


def episode_seeds(seed: int, task_index: int, episodes: int) -> list[int]:
    """The seeds of a task's evaluation episodes (`envs/seeds.py`'s eval stream)."""
    return eval_seeds(seed, task_index, episodes)


def check_unseen_seeds(demonstration_seeds: dict[str, list[int]] | None, tasks: list[str], seed: int, episodes: int,
                       *, env: str = "metaworld", allow_seen_seeds: bool = False, who: str = "the policy",
                       remedy: str = "evaluate with another --eval.seed, or pass --eval.allow_seen_seeds to measure them anyway"
                       ) -> int | None:
    """How many of the evaluation's (task, seed) pairs are among `demonstration_seeds` (policy.json's:
    per dataset task, i.e. instruction, the seeds its demonstrations started from); refused when not 0
    unless `allow_seen_seeds`, since an episode the policy was shown measures memory, not skill. None:
    the policy records no demonstration seeds (a scripted, random or served policy, or one trained on
    datasets without a `seed` column).

    >>> check_unseen_seeds({"reach the red goal": [2000000000000000000]}, ["reach-v3"], 0, 20)  # a collect seed
    0
    >>> check_unseen_seeds({"reach the red goal": episode_seeds(0, 0, 2)}, ["reach-v3"], 0, 20, allow_seen_seeds=True)
    2
    """
    planned = {task: episode_seeds(seed, t, episodes) for t, task in enumerate(tasks)}  # checks seed's range too
    if demonstration_seeds is None:
        return None
    if not isinstance(demonstration_seeds, dict) or not all(isinstance(v, list) for v in demonstration_seeds.values()):
        raise KilovlaError(f"{who}: policy.json's demonstration_seeds must map each task to a list of seeds, got "
                           f"{str(demonstration_seeds)[:80]}")
    shared = {task: sorted(set(seeds) & {s for key in env_type(env).dataset_task_names(task)
                                         for s in demonstration_seeds.get(key, ())})
              for task, seeds in planned.items()}
    count = sum(len(s) for s in shared.values())
    if count and not allow_seen_seeds:
        where = "; ".join(f"{task}: {s[:3]}{'...' if len(s) > 3 else ''}" for task, s in shared.items() if s)
        raise KilovlaError(f"{who}: {count} of its {len(tasks) * episodes} evaluation episodes (seed {seed}) start "
                           f"from a demonstration's seed ({where}); {remedy}")
    return count


def task_progress(label: str):
    """Progress with one row per task (a bar on a terminal, plain lines elsewhere), for `evaluate`'s
    and `collect`'s ``progress`` callback; returns (context manager, callback)."""
    progress = TaskProgress(label)
    return progress, progress.callback


def chunk_length(policy) -> int | None:
    """Actions per predicted chunk: a learned policy's chunk_size (or GR00T's action_horizon); None
    where the policy does not say (scripted, served)."""
    from kilovla.models import family

    config = getattr(getattr(policy, "model", None), "config", None)
    return family.chunk_length(config) if config is not None else getattr(policy, "chunk", None)


def check_action_steps(policy, n_action_steps: int | None) -> None:
    """Refuse executing more actions per chunk than the policy predicts (or fewer than one)."""
    if n_action_steps is None:
        return
    if n_action_steps < 1:
        raise KilovlaError(f"n_action_steps {n_action_steps}: must be >= 1")
    chunk = chunk_length(policy)
    if chunk is not None and n_action_steps > chunk:
        raise KilovlaError(f"n_action_steps {n_action_steps}: the policy predicts chunks of {chunk} actions; "
                           f"execute {chunk} or fewer per chunk")


def new_output_dir(root: str | Path, env: str, policy_spec: str, now: datetime.datetime | None = None) -> Path:
    """A new, empty folder under `root`, created here: `<UTC date>_<time>_<env>_<policy>`, as LeRobot
    names its eval outputs; `policy_spec` is --policy.path (a checkpoint path gives run and step). The name is
    claimed by creating it (`_2`, `_3`, ... when taken), so two evaluations started in one second never
    share a folder; a caller that then refuses to run removes it again (it is still empty).

        >>> new_output_dir("eval-output", "metaworld", "runs/a/checkpoints/step_000120",
        ...                datetime.datetime(2026, 12, 3, 19, 30, 5))
        PosixPath('eval-output/2026-12-03_19-30-05_metaworld_a-step_000120')
    """
    now = now or datetime.datetime.now(datetime.timezone.utc)
    path = Path(policy_spec)
    if policy_spec.startswith(("ws://", "wss://")):
        label = policy_spec.split("://", 1)[1]
    elif path.parent.name == "checkpoints":
        label = f"{path.parent.parent.name}-{path.name}"
    else:
        label = path.name or policy_spec
    label = re.sub(r"[^A-Za-z0-9._-]+", "-", label).strip("-.") or "policy"
    base = Path(root) / f"{now:%Y-%m-%d_%H-%M-%S}_{env}_{label}"
    base.parent.mkdir(parents=True, exist_ok=True)
    folder, n = base, 1
    while True:
        try:
            folder.mkdir()  # atomic: of two evaluations in one second, only one gets each name
            return folder
        except FileExistsError:
            n += 1
            folder = base.with_name(f"{base.name}_{n}")


def check_evaluation(policy, settings: EvalSettings):
    """Everything `evaluate` refuses before it runs an episode: the tasks, cameras and fit of `policy` to
    the env, the episode count, the actions per chunk and the demonstrations' seeds. A CLI calls it before
    it announces an output folder. Returns (env spec, actions per chunk, seeds shared with demonstrations)."""
    s = settings
    spec = s.check_fits(policy)
    if s.episodes < 1:
        raise KilovlaError(f"episodes must be >= 1, got {s.episodes}")
    check_action_steps(policy, s.n_action_steps)
    n_action_steps = s.n_action_steps or getattr(policy, "n_action_steps", None)
    from kilovla.models.residual import ResidualPolicyModel

    model = getattr(policy, "model", None)
    if isinstance(model, ResidualPolicyModel) and n_action_steps:
        model.actor.spec.check_steps(n_action_steps, f"n_action_steps {n_action_steps}", training=False)
    shared = check_unseen_seeds(getattr(getattr(policy, "meta", None), "demonstration_seeds", None), list(s.tasks),
                                s.seed, s.episodes, env=s.env, allow_seen_seeds=s.allow_seen_seeds,
                                who=f"policy {getattr(policy, 'name', policy)}")
    return spec, n_action_steps, shared


def evaluate(policy, settings: EvalSettings, *, out_dir: str | Path | None = None, replace: bool = True,
             progress: Callable[[str, int, int], None] | None = None, label: str = "eval") -> dict:
    """Play `settings` with `policy`.
    `progress(task, finished, total)` hears of every finished episode (and of each task's start, with 0);
    without one, the evaluation shows its own (`task_progress(label)`). `replace`: whether an earlier
    evaluation in `out_dir` is replaced (else refused, before anything runs). Episodes on seeds the
    policy's demonstrations started from are refused unless `settings.allow_seen_seeds`
    (`check_unseen_seeds`); the report's `demonstration_seeds_shared` counts them either way."""
    if progress is None:
        own, update = task_progress(label)
        with own:
            return evaluate(policy, settings, out_dir=out_dir, replace=replace, progress=update, label=label)
    s = settings
    spec, n_action_steps, shared = check_evaluation(policy, s)
    out = Path(out_dir) if out_dir is not None else None
    if out is not None:
        if not replace:
            check_new_evaluation(out)
        elif out.exists() and not out.is_dir():
            raise KilovlaError(f"{out}: exists and is not a folder; an evaluation writes a folder")
        clear(out, EVALUATION)  # an earlier evaluation's report and videos go; other files stay
    resolution = s.env_type.render_resolution(policy, s.resolution)
    kwargs = {"cameras": spec.cameras, "resolution": resolution, **({"max_steps": s.max_steps} if s.max_steps else {})}
    per_task: dict[str, dict] = {}
    policy.reset()
    # env workers take cores, the policy keeps the rest; one set of workers plays every task
    with policy_threads(s.workers), WarmPool(s.workers) as pools:
        for t, task in enumerate(s.tasks):
            configs = [EnvConfig(s.env, {"task": task, **kwargs})] * min(s.batch_size, s.episodes)
            videos = out / "videos" / task if out and s.videos else None
            per_task[task] = _evaluate_task(policy, pools, configs, episode_seeds(s.seed, t, s.episodes), s,
                                            n_action_steps, _VideoRecorder(videos, s.videos, spec.fps),
                                            lambda done, task=task: progress(task, done, s.episodes))
    report = _report(policy, s, per_task, shared, n_action_steps, resolution, spec.cameras)
    if out is not None:
        write_report(out, report)
    result(summary_line(report, label, out))
    return report


def summary_line(report: dict, label: str, out: Path | None) -> str:
    """The one line an evaluation ends with: its success rate, episodes, interval, crashes and folder."""
    per_task = report["per_task"]
    wins, played = sum(r["successes"] for r in per_task.values()), sum(r["episodes"] for r in per_task.values())
    low, high = report["overall_success_ci95"]
    return (f"{label}: success rate {report['overall_success_rate']:.1%} ({wins}/{played} episodes, "
            f"{len(per_task)} task(s); 95 % Wilson {low:.1%} - {high:.1%})"
            + (f"; {report['crashed_episodes']} crashed, counted as failures" if report["crashed_episodes"] else "")
            + (f"; wrote {out}" if out is not None else ""))


class Beside:
    """`evaluate(load_policy(spec), settings, out_dir=...)` in a process of its own, started at once, while
    this process does other work; `result()` waits for its report (a line every 10 s while it does) and says its
    result line. The demo plays the scripted expert (state only, ~10 s on one core) beside the learned policy,
    whose batched inference on one thread leaves a core idle between the env workers' steps. What `evaluate`
    refuses there is raised by `result()` here as that KilovlaError; a failure or the process's death as a
    RuntimeError, with the child's traceback. Leaving the `with` block ends a process still playing (its env
    workers close with it).

        with Beside("scripted", settings, out / "eval-expert", "eval expert") as expert:
            learned = evaluate(policy, settings, out_dir=out / "eval-policy")
            scripted = expert.result()
    """

    def __init__(self, spec: str, settings: EvalSettings, out_dir: str | Path, label: str):
        import multiprocessing as mp

        self.label, self.out = label, Path(out_dir)
        self._outcome: tuple[str, object] | None = None
        ctx = mp.get_context("forkserver")  # never a fork of a process that has rendered (envs/vector.py)
        self._conn, child = ctx.Pipe(duplex=False)
        self._process = ctx.Process(target=_evaluate_beside, args=(child, spec, settings, self.out, label),
                                    name=f"kilovla {label}")
        self._process.start()
        child.close()

    def result(self) -> dict:
        """The report (the same one on every call), or what the process raised or how it ended."""
        if self._outcome is None:
            self._outcome = self._wait()
            if self._outcome[0] == "ok":
                result(summary_line(self._outcome[1], self.label, self.out))
        status, value = self._outcome
        if status == "refused":
            raise KilovlaError(f"{self.label}: {value}")
        if status != "ok":
            raise RuntimeError(f"{self.label}: {value}")
        return value

    def _wait(self) -> tuple[str, object]:
        if self._conn.closed:
            return "failed", "closed before its report"
        t0 = time.monotonic()
        try:
            while not self._conn.poll(10):
                print(f"{self.label}: still playing in its own process after {time.monotonic() - t0:.0f}s", flush=True)
            outcome = self._conn.recv()
        except EOFError:  # it ended without a word
            outcome = None
        self._process.join()
        return outcome or ("failed", f"its process ended (exit code {self._process.exitcode}) before its report")

    def close(self) -> None:
        if self._process.is_alive():
            self._process.terminate()
        self._process.join()
        self._conn.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _evaluate_beside(conn, spec: str, settings: EvalSettings, out: Path, label: str) -> None:
    import signal
    import sys

    # terminate() (the parent left its `with` block) ends the evaluation as an exception would: its env workers close
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    sys.stdout = open(os.devnull, "w")  # the parent says the result line, not under its own progress bar
    try:
        report = evaluate(load_policy(spec), settings, out_dir=out, progress=lambda *a: None, label=label)
    except KilovlaError as e:  # bad input, as evaluate words it
        conn.send(("refused", str(e)))
    except Exception as e:  # a fault: its traceback goes with it
        conn.send(("failed", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
    else:
        conn.send(("ok", report))
    conn.close()


def _evaluate_task(policy, pools: WarmPool, configs: list[EnvConfig], seeds: list[int], s: EvalSettings,
                   n_action_steps: int | None, recorder: _VideoRecorder, progress: Callable[[int], None]) -> dict:
    """One task's episodes on its seeds -> its row of the report (a crashed env pool: the episodes that
    finished, the rest counted as failures; the next task starts new workers)."""
    episodes = len(seeds)

    def on_step(ep, obs, action, reward, info):
        recorder.add(ep.index, obs)

    finished = []

    def on_end(ep, last_obs):
        finished.append(ep)
        recorder.add(ep.index, last_obs)
        recorder.finish(ep.index, ep.success)
        progress(len(finished))  # how many have finished: episodes end out of order, so their index would count backwards

    progress(0)
    try:
        done = run_episodes(pools.with_envs(configs), policy, seeds, n_action_steps=n_action_steps, on_step=on_step,
                            on_end=on_end, frames=lambda ep: recorder.folder is not None and ep.index < s.videos)
    except EnvCrashed as e:
        wins = sum(ep.success for ep in finished)
        return {"success_rate": wins / episodes, "success_ci95": wilson_interval(wins, episodes),
                "successes": wins, "episodes": episodes,
                "mean_steps": float(np.mean([ep.steps for ep in finished])) if finished else None,
                "crashed_episodes": episodes - len(finished), "error": str(e),
                "seeds_running": e.seeds, "seeds": seeds}
    wins = sum(e.success for e in done)
    return {
        "success_rate": wins / len(done),
        "success_ci95": wilson_interval(wins, len(done)),
        "successes": wins,
        "episodes": len(done),
        "mean_steps": float(np.mean([e.steps for e in done])),
        "crashed_episodes": 0,
        "seeds": seeds,
    }


def _report(policy, s: EvalSettings, per_task: dict[str, dict], shared: int | None, n_action_steps: int | None,
            resolution: int, cameras: tuple[str, ...]) -> dict:
    # Every task plays the same number of episodes, so the mean of the task rates is the pooled rate.
    wins, played = sum(r["successes"] for r in per_task.values()), sum(r["episodes"] for r in per_task.values())
    return {
        "overall_success_rate": float(np.mean([r["success_rate"] for r in per_task.values()])),
        "overall_success_ci95": wilson_interval(wins, played),
        "crashed_episodes": sum(r["crashed_episodes"] for r in per_task.values()),
        "per_task": per_task,
        "env": s.env,
        "env_backend": s.env_type.backend(),
        "policy": getattr(policy, "name", type(policy).__name__),
        "policy_source": getattr(policy, "source", None),  # the folder or URL a learned policy came from
        "ema": getattr(policy, "ema", False),  # its EMA weights (eval --ema)
        "seed": s.seed,
        "demonstration_seeds_shared": shared,  # None: the policy records no demonstration seeds
        "episodes_per_task": s.episodes,
        "n_action_steps": n_action_steps,
        "resolution": resolution,
        "cameras": list(cameras),
    }


@contextlib.contextmanager
def policy_threads(env_workers: int):
    """Torch's intra-op threads for a policy whose env workers run on this machine's cores: one
    thread per core left. A small policy batched over a few envs is dominated by per-op overhead,
    which threads contending with the env processes multiply (an evaluation on 2 cores ran 1.5x
    faster with one policy thread beside 2 env workers)."""
    import torch

    before = torch.get_num_threads()
    if env_workers > 0:
        torch.set_num_threads(max(1, min(before, (os.cpu_count() or 1) - env_workers)))
    try:
        yield
    finally:
        torch.set_num_threads(before)


class _VideoRecorder:
    """Keeps the frames of the first `limit` episodes (all cameras side by side) and writes mp4s."""

    def __init__(self, folder: Path | None, limit: int, fps: int):
        self.folder, self.limit, self.fps = folder, limit, fps
        self.frames: dict[int, list[np.ndarray]] = {}

    def add(self, index: int, obs: dict) -> None:
        if self.folder is None or index >= self.limit:
            return
        images = [v for k, v in sorted(obs.items()) if k.startswith("observation.images.")]
        if images:
            self.frames.setdefault(index, []).append(np.concatenate(images, axis=1))

    def finish(self, index: int, success: bool) -> None:
        frames = self.frames.pop(index, None)
        if not frames:
            return
        from kilovla.data.video import VideoEncoder

        self.folder.mkdir(parents=True, exist_ok=True)
        final = self.folder / f"episode_{index:03d}_{'success' if success else 'failure'}.mp4"
        tmp = final.with_name(f".{final.name}.{uuid.uuid4().hex[:6]}.mp4")
        h, w, _ = frames[0].shape
        enc = VideoEncoder(tmp, w - w % 2, h - h % 2, min(self.fps, 30), codec="libx264", gop=30)
        for f in frames:
            enc.add(f[: h - h % 2, : w - w % 2])
        enc.close()
        os.replace(tmp, final)


def write_report(out: Path, report: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    lines = [f"# Closed-loop evaluation: {report['policy']} on {report['env']}", "",
             f"{report['env_backend']}; seed {report['seed']}; {report['episodes_per_task']} episodes per task.", "",
             "| task | success rate | 95 % Wilson interval | episodes | mean steps |", "|---|---|---|---|---|"]
    for task, r in report["per_task"].items():
        steps = "-" if r["mean_steps"] is None else f"{r['mean_steps']:.1f}"
        crash = f" ({r['crashed_episodes']} crashed, counted as failures: {r['error'].splitlines()[0]})" \
            if r["crashed_episodes"] else ""
        low, high = r["success_ci95"]
        lines.append(f"| {task} | {r['success_rate']:.1%}{crash} | {low:.1%} - {high:.1%} | {r['episodes']} | {steps} |")
    low, high = report["overall_success_ci95"]
    lines += ["", f"**Overall success rate: {report['overall_success_rate']:.1%}** (95 % Wilson {low:.1%} - {high:.1%})"
                  + (f" ({report['crashed_episodes']} crashed episodes counted as failures)"
                     if report["crashed_episodes"] else ""), ""]
    for name, text in (("report.json", json.dumps(report, indent=2)), ("report.md", "\n".join(lines))):
        tmp = out / f".{name}.{uuid.uuid4().hex[:8]}"
        tmp.write_text(text)
        os.replace(tmp, out / name)


def load_policy(spec: str, *, env: str = "metaworld", seed: int = 0, action_dim: int | None = None,
                ema: bool = False):
    """'scripted', 'random', a ws:// URL of `kilovla serve` or a checkpoint path -> a Policy; `ema`: the
    checkpoint's EMA weights. A run folder, or its checkpoints/latest (or LeRobot's `last`), means the
    run's newest complete checkpoint (`folders.policy_folder`)."""
    if ema and spec in ("scripted", "random"):
        raise KilovlaError(f"--policy.ema: the {spec} policy has no weights; EMA weights are a policy folder's")
    if spec == "scripted":
        return env_type(env).expert(0.0, seed)
    if spec == "random":
        from kilovla.policy import RandomPolicy

        return RandomPolicy(action_dim or env_type(env).spec().action_dim, seed=seed)
    if spec.startswith(("ws://", "wss://")):  # a policy `kilovla serve` serves; eval reaches serve lazily
        if ema:
            raise KilovlaError(f"--policy.ema: {spec} is a served policy; start `kilovla serve --policy.ema` instead")
        from kilovla.serve.client import ServedPolicy

        return ServedPolicy(spec, api_key=os.environ.get("KILOVLA_API_KEY"))
    path = policy_folder(spec)
    if not path.exists():
        raise KilovlaError(f"--policy.path {spec!r}: not 'scripted', 'random', a ws:// URL or an existing checkpoint path")
    from kilovla.policy_folder import PolicyFolder

    return PolicyFolder.open(policy_folder(path), flag="--policy.path").load(ema=ema)
