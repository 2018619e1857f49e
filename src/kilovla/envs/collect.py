"""`kilovla collect`: scripted demonstrations -> a LeRobot v3.0 dataset.

Runs the simulator's scripted experts (optionally with action noise), keeps the successful episodes
and writes them through the data layer's `DatasetWriter`: one video per camera, `observation.state`,
`observation.environment_state`, `action`, `next.success`, `task`.

With noise, `labels` says which action a frame records: `executed` (the noisy action the robot took,
as a teleoperation log would) or `expert` (the noise-free expert action for the state the noise led
to: DART's recipe, which shows a learner how to recover from drift without teaching it the noise).

Episode seeds come from the collect stream of `envs/seeds.py` (disjoint from evaluation's); each kept
episode's seed is its row's `seed` in meta/episodes, and meta/info.json names the rule
(`kilovla_seed_rule`), so training can record which initial states the policy saw.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from kilovla.data.writer import DatasetWriter, check_dataset_destination
from kilovla.envs.base import env_type
from kilovla.envs.rollout import run_episodes, stack_observations
from kilovla.envs.seeds import SEED_RULE, collect_seed
from kilovla.envs.vector import EnvConfig, WarmPool
from kilovla.errors import KilovlaError


@dataclass
class CollectReport:
    root: str
    kept: dict[str, int] = field(default_factory=dict)
    dropped: dict[str, int] = field(default_factory=dict)
    seeds: dict[str, list[int]] = field(default_factory=dict)  # per task, the seeds of the kept episodes
    frames: int = 0


def check_collect(out: str | Path, *, env: str, tasks: list[str], episodes_per_task: int,
                  cameras: tuple[str, ...], seed: int, max_steps: int | None, labels: str, overwrite: bool):
    """Everything `collect` refuses before it steps an env (the CLI calls it before its progress lines):
    the episode count, tasks, cameras, labels, seed and the output folder. Returns (env type, spec)."""
    if episodes_per_task < 1:  # else the seed check below names episode -1
        raise KilovlaError(f"--collect.n_episodes must be at least 1, got {episodes_per_task}")
    sim = env_type(env)
    sim.check_tasks(tasks)
    spec = sim.spec(tasks[0], cameras=cameras, max_steps=max_steps)
    if labels not in ("executed", "expert"):
        raise KilovlaError(f"labels must be 'executed' or 'expert', not {labels!r}")
    collect_seed(seed, len(tasks) - 1, 3 * episodes_per_task - 1)  # the last seed it may use fits the rule: check now
    check_dataset_destination(out, overwrite, flag="--collect.overwrite")
    return sim, spec


def collect(out: str | Path, *, env: str = "metaworld", tasks: list[str], episodes_per_task: int,
            cameras: tuple[str, ...] = ("scene", "wrist"), resolution: int = 96, noise_std: float = 0.0,
            seed: int = 0, max_steps: int | None = None, batch_size: int = 4, num_workers: int = 0,
            codec: str = "libsvtav1", labels: str = "executed", overwrite: bool = False,
            success_hold: int = 0, progress=None) -> CollectReport:
    """Write `episodes_per_task` successful episodes per task (attempts continue until reached,
    up to 3x the target). `success_hold`: steps each episode runs past its first success (Meta-World).
    `progress(task, kept, target)` is called as episodes finish."""
    sim, spec = check_collect(out, env=env, tasks=tasks, episodes_per_task=episodes_per_task, cameras=cameras,
                              seed=seed, max_steps=max_steps, labels=labels, overwrite=overwrite)
    features = spec.features(resolution)
    features.update({key: {"dtype": "float32", "shape": [width]} for key, width in spec.extra_state})
    features["next.success"] = {"dtype": "bool", "shape": [1]}
    policy = sim.expert(noise_std, seed)
    clean = sim.expert(0.0, seed) if labels == "expert" and noise_std > 0 else None
    report = CollectReport(root=str(out))
    writer = DatasetWriter(out, fps=spec.fps, features=features, robot_type=f"{env}-{sim.robot}", video_codec=codec,
                           overwrite=overwrite, info={"kilovla_seed_rule": SEED_RULE})
    if success_hold and env != "metaworld":
        raise KilovlaError(f"success_hold runs Meta-World episodes past their success; {env} has no such option")
    kwargs = {"cameras": tuple(cameras), "resolution": resolution, **({"max_steps": max_steps} if max_steps else {}),
              **({"success_hold": success_hold} if success_hold else {})}
    with WarmPool(num_workers) as pools:  # one set of env workers for every task
        try:
            for t, task in enumerate(tasks):
                pool = pools.with_envs([EnvConfig(env, {"task": task, **kwargs})] * min(batch_size, episodes_per_task))
                buffers: dict[int, list] = {}
                kept = dropped = 0

                def on_step(ep, obs, action, reward, info):
                    frame = {k: v for k, v in obs.items() if k.startswith("observation.")}
                    if clean is not None:
                        action = clean.select_action(stack_observations([obs], [task]))[0, 0]
                    frame.update(action=np.asarray(action, np.float32), task=obs["task"],
                                 **{"next.success": np.array([bool(info.get("is_success"))])})
                    buffers.setdefault(ep.index, []).append(frame)

                def on_end(ep, last_obs):
                    nonlocal kept, dropped
                    frames = buffers.pop(ep.index)
                    if ep.success and kept < episodes_per_task:
                        for frame in frames:
                            writer.add_frame(frame)
                        writer.save_episode(seed=ep.seed)  # meta/episodes' `seed`: training records it in policy.json
                        report.seeds.setdefault(task, []).append(ep.seed)
                        kept += 1
                        report.frames += len(frames)
                    else:
                        dropped += not ep.success
                    if progress is not None:
                        progress(task, kept, episodes_per_task)

                attempts = 0
                while kept < episodes_per_task and attempts < 3 * episodes_per_task:
                    n = episodes_per_task - kept
                    seeds = [collect_seed(seed, t, attempts + i) for i in range(n)]
                    attempts += n
                    run_episodes(pool, policy, seeds, on_step=on_step, on_end=on_end)
                report.kept[task], report.dropped[task] = kept, dropped
                if kept < episodes_per_task:
                    raise KilovlaError(f"{task}: only {kept} of {episodes_per_task} expert episodes succeeded in "
                                       f"{attempts} attempts (noise_std={noise_std}); lower the noise")
            writer.finalize()
        except BaseException:
            writer.abort()
            raise
    return report
