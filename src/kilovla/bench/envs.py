"""`kilovla bench envs`: environment steps per second with rendering, one env vs the vectorised runner.

Rows env_steps_per_s_{64,128,224}: Meta-World push-v3 with two cameras rendered every step at that
resolution, random actions. Baseline: one env stepped in this process; ours: an `EnvPool` of
`envs` envs over `workers` processes (all cores), counting every env's steps. Interleaved repeats,
median.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import numpy as np

from kilovla.bench.common import DEFAULT_OUT, Row, write_suite
from kilovla.envs.vector import EnvConfig, EnvPool

RESOLUTIONS = (64, 128, 224)
TASK = "push-v3"


def _steps_per_s(pool: EnvPool, steps: int, seed: int) -> float:
    rng = np.random.default_rng(seed)
    pool.reset([seed + i for i in range(pool.num_envs)])
    t0 = time.perf_counter()
    for _ in range(steps):
        results = pool.step([rng.uniform(-1, 1, 4).astype(np.float32) for _ in range(pool.num_envs)])
        ended = [i for i, r in enumerate(results) if r[2] or r[3]]
        if ended:
            pool.reset([seed + i if i in ended else None for i in range(pool.num_envs)])
    return steps * pool.num_envs / (time.perf_counter() - t0)


def run(*, quick: bool = False, out_dir: str | Path = DEFAULT_OUT, console=None) -> Path:
    workers = max(1, min(os.cpu_count() or 1, 8))
    envs = 2 * workers
    steps = 15 if quick else 60
    repeats = 1 if quick else 3
    rows = []
    for res in RESOLUTIONS:
        config = EnvConfig("metaworld", {"task": TASK, "resolution": res, "cameras": ("scene", "wrist")})
        with EnvPool([config], num_workers=0) as single, EnvPool([config] * envs, num_workers=workers) as pool:
            _steps_per_s(pool, 2, 0)  # warm the workers' renderers
            _steps_per_s(single, 2, 0)
            base, ours = [], []
            for r in range(repeats):
                base.append(_steps_per_s(single, steps * 2, r))
                ours.append(_steps_per_s(pool, steps, r))
        rows.append(Row.compare(f"env_steps_per_s_{res}", "steps/s", float(np.median(base)), float(np.median(ours)),
                                higher_is_better=True, limit=None,
                                note=f"metaworld {TASK}, 2 cams {res}px; 1 env vs {envs} envs in {workers} processes"))
    return write_suite("envs", rows, quick=quick, out_dir=out_dir, console=console,
                       extra={"workers": workers, "envs": envs, "gl": os.environ.get("MUJOCO_GL")})
