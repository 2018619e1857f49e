"""Meta-World (MuJoCo, 50 tasks) with LeRobot feature names and two cameras.

Each task is a Sawyer arm with a 4-D action (xyz delta of the hand, gripper effort) and a 39-D state
(hand, gripper, objects, previous frame, goal). We expose:

- ``observation.state``: hand position + gripper opening (4,), the proprioception a VLA sees;
- ``observation.environment_state``: the full 39-D vector (objects and goal), for the scripted
  experts and for state-based policies;
- ``observation.images.scene`` (the "corner" camera, turned upright) and
  ``observation.images.wrist`` (the "gripperPOV" camera), uint8 HWC at the chosen resolution;
- ``task``: the instruction, e.g. "push the puck to the goal".

`reset(seed=s)` draws the object and goal positions from `s`, so the same seed gives the same
episode. Rendering goes through one `mujoco.Renderer` per env with shadows and reflections off,
4-6x faster in software GL at the same resolution (see ../shared/research/simlab.md).
"""

from __future__ import annotations

import functools
import re
import warnings

import gymnasium as gym
import numpy as np

from kilovla.envs.base import EnvSpec, EnvType, check_tasks
from kilovla.errors import KilovlaError

# Meta-World's experts warn on every call that their gains exceed the action range (which it clips).
warnings.filterwarnings("ignore", message="Constant\\(s\\) may be too high", category=UserWarning)

CAMERAS = {"scene": "corner", "wrist": "gripperPOV", "side": "corner2", "behind": "behindGripper", "top": "topview"}
# The corner cameras of Meta-World's scene look at the table upside down.
ROTATED_180 = {"corner", "corner2", "corner3", "corner4"}
DEFAULT_CAMERAS = ("scene", "wrist")
MAX_STEPS = 200  # Meta-World allows 500; its scripted experts finish the default tasks in < 150
FPS = 80  # 1 / (frame_skip 5 * timestep 0.0025 s)
STATE_DIM = 4
ACTION_DIM = 4

# The default demo/eval set: graded difficulty, each solved >= 90 % by its scripted expert.
DEFAULT_TASKS = ("reach-v3", "drawer-close-v3", "button-press-topdown-v3", "push-v3", "drawer-open-v3")

INSTRUCTIONS = {
    "reach-v3": "reach the red goal",
    "push-v3": "push the puck to the goal",
    "pick-place-v3": "pick up the puck and place it at the goal",
    "door-open-v3": "open the door",
    "door-close-v3": "close the door",
    "drawer-open-v3": "open the drawer",
    "drawer-close-v3": "close the drawer",
    "button-press-topdown-v3": "press the button from the top",
    "button-press-v3": "press the button",
    "peg-insert-side-v3": "insert the peg into the hole from the side",
    "window-open-v3": "slide the window open",
    "window-close-v3": "slide the window closed",
    "plate-slide-v3": "slide the plate into the goal",
    "faucet-open-v3": "turn the faucet on",
    "faucet-close-v3": "turn the faucet off",
    "coffee-button-v3": "press the button of the coffee machine",
    "handle-press-v3": "press the handle down",
    "lever-pull-v3": "pull the lever up",
    "sweep-into-v3": "sweep the puck into the hole",
    "basketball-v3": "put the ball into the basket",
}


def task_names() -> list[str]:
    from metaworld.env_dict import ALL_V3_ENVIRONMENTS

    return list(ALL_V3_ENVIRONMENTS)


def instruction(task: str) -> str:
    """The natural-language instruction of a task ('stick-pull-v3' -> 'stick pull' when unnamed)."""
    return INSTRUCTIONS.get(task, re.sub(r"-v\d+$", "", task).replace("-", " "))


TASK_SETS = ("mt10", "mt50", "default")


def task_set(name: str) -> list[str]:
    """'MT10', 'MT50' or 'default' -> task names."""
    from metaworld.env_dict import ALL_V3_ENVIRONMENTS, MT10_V3

    sets = {"mt10": list(MT10_V3), "mt50": list(ALL_V3_ENVIRONMENTS), "default": list(DEFAULT_TASKS)}
    if name.lower() not in sets:
        raise KilovlaError(f"unknown Meta-World task set {name!r}; use MT10, MT50 or default")
    return sets[name.lower()]


@functools.cache
def _expert_classes() -> dict[str, type]:
    import metaworld.policies as policies

    by_key = {}
    for attr in dir(policies):
        if attr.startswith("Sawyer") and attr.endswith("Policy"):
            by_key[attr.removeprefix("Sawyer").removesuffix("Policy").lower()] = getattr(policies, attr)
    out = {}
    for task in task_names():
        key = task.replace("-", "").replace("insert", "insertion")
        cls = by_key.get(key) or by_key.get(task.replace("-", ""))
        if cls is not None:
            out[task] = cls
    return out


# Meta-World's reach experts move the hand (the end-effector the state reports) onto the goal, but the
# task's success is measured at the fingertips' centre (the TCP), 4.5 cm below the hand with the gripper
# pointing down. So the expert settles with the TCP 4.6 cm from the goal, 4 mm inside the 5 cm success
# radius, and its demonstrations end (at the first success) while it is slowing down at the radius's
# edge: a policy that copies them stops there, and one 1-3 cm off misses (issue 46: reach-v3's failures
# all ended 5.1-7.1 cm from the goal). Aiming the hand 4.5 cm above the goal puts the TCP on it.
HAND_ABOVE_TCP = np.array([0.0, 0.0, 0.045])
TCP_ON_GOAL_TASKS = ("reach-v3", "reach-wall-v3")


class _TcpOnGoal:
    """A reach expert that sees the goal `HAND_ABOVE_TCP` higher, so it brings the TCP onto the real one."""

    def __init__(self, expert):
        self.expert = expert

    def get_action(self, obs: np.ndarray) -> np.ndarray:
        obs = np.array(obs, dtype=np.float64)
        obs[-3:] += HAND_ABOVE_TCP
        return self.expert.get_action(obs)


def scripted_expert(task: str):
    """Meta-World's hand-written policy for `task`: `get_action(env_state_39) -> action (4,)` (the reach
    tasks' aiming the TCP at the goal, `_TcpOnGoal`)."""
    experts = _expert_classes()
    if task not in experts:
        raise KilovlaError(f"Meta-World has no scripted expert for {task!r}")
    return _TcpOnGoal(experts[task]()) if task in TCP_ON_GOAL_TASKS else experts[task]()


def check_cameras(cameras) -> None:
    unknown = [c for c in cameras if c not in CAMERAS and c not in CAMERAS.values()]
    if unknown:
        raise KilovlaError(f"unknown Meta-World cameras {unknown}; use {sorted(CAMERAS)}")


def spec(task: str, cameras=DEFAULT_CAMERAS, max_steps: int = MAX_STEPS, **_) -> EnvSpec:
    check_cameras(cameras)  # before any env is built: a spec names only cameras the env can render
    return EnvSpec("metaworld", ACTION_DIM, STATE_DIM, tuple(cameras), max_steps, FPS,
                   extra_state=(("observation.environment_state", 39),))


class MetaWorldEnv(gym.Env):
    """One Meta-World task (see the module docstring)."""

    metadata = {"render_modes": ["rgb_array"]}

    def __init__(self, task: str = "push-v3", cameras=DEFAULT_CAMERAS, resolution: int = 96,
                 max_steps: int = MAX_STEPS, terminate_on_success: bool = True, render: bool = True,
                 success_hold: int = 0):
        from metaworld.env_dict import ALL_V3_ENVIRONMENTS_GOAL_OBSERVABLE

        check_tasks("metaworld", [task], task_names())
        check_cameras(cameras)
        if not 16 <= resolution <= 1024:
            raise KilovlaError(f"resolution must be within 16..1024 pixels, got {resolution}")
        self.task, self.instruction = task, instruction(task)
        self.cameras = tuple(cameras)
        self.resolution, self.max_steps = resolution, max_steps
        # steps an episode runs on past its first success before it terminates (collection: the expert's
        # approach into the goal, not only to the edge of its success radius)
        self.terminate_on_success, self.success_hold = terminate_on_success, success_hold
        self._success_at: int | None = None
        self._render_images = render
        self._env = ALL_V3_ENVIRONMENTS_GOAL_OBSERVABLE[f"{task}-goal-observable"](seed=0)
        self._env.max_path_length = max(max_steps, 1) + 1
        self._renderer = None
        self._steps = 0
        images = {f"observation.images.{c}": gym.spaces.Box(0, 255, (resolution, resolution, 3), np.uint8)
                  for c in self.cameras} if render else {}
        self.observation_space = gym.spaces.Dict({
            **images,
            "observation.state": gym.spaces.Box(-np.inf, np.inf, (STATE_DIM,), np.float32),
            "observation.environment_state": gym.spaces.Box(-np.inf, np.inf, (39,), np.float32),
        })
        self.action_space = gym.spaces.Box(-1.0, 1.0, (ACTION_DIM,), np.float32)
        self.spec_ = spec(task, cameras, max_steps)

    def _render(self) -> dict[str, np.ndarray]:
        import mujoco

        if not self._render_images:
            return {}
        if self._renderer is None:
            self._renderer = mujoco.Renderer(self._env.model, self.resolution, self.resolution)
            self._renderer.scene.flags[mujoco.mjtRndFlag.mjRND_SHADOW] = 0
            self._renderer.scene.flags[mujoco.mjtRndFlag.mjRND_REFLECTION] = 0
        out = {}
        for cam in self.cameras:
            name = CAMERAS.get(cam, cam)
            self._renderer.update_scene(self._env.data, camera=name)
            img = self._renderer.render()
            out[f"observation.images.{cam}"] = img[::-1, ::-1].copy() if name in ROTATED_180 else img.copy()
        return out

    def _obs(self, state39: np.ndarray) -> dict:
        return {**self._render(), "observation.state": state39[:STATE_DIM].astype(np.float32),
                "observation.environment_state": state39.astype(np.float32), "task": self.instruction}

    def reset(self, *, seed: int | None = None, options=None):
        super().reset(seed=seed)
        env = self._env
        env._freeze_rand_vec = False
        env.seeded_rand_vec = True
        env.seed(int(self.np_random.integers(2**31)) if seed is None else seed)
        state, _ = env.reset()
        self._steps, self._success_at = 0, None
        return self._obs(state), {"is_success": False, "task": self.task}

    def step(self, action):
        action = np.clip(np.asarray(action, dtype=np.float32), -1.0, 1.0)
        state, reward, _, _, info = self._env.step(action)
        self._steps += 1
        success = bool(info.get("success", 0.0))
        if success and self._success_at is None:
            self._success_at = self._steps
        terminated = (self.terminate_on_success and self._success_at is not None
                      and self._steps - self._success_at >= self.success_hold)
        truncated = self._steps >= self.max_steps and not terminated
        return self._obs(state), float(reward), terminated, truncated, {"is_success": success, "task": self.task}

    def set_rendering(self, on: bool) -> None:
        """Render camera images in the observations that follow (on), or not: a caller that executes a
        chunk of actions and only looks at the last observation skips rendering the ones between."""
        self._render_images = on and bool(self.cameras)

    def render(self):
        return next(iter(self._render().values()))

    def close(self):
        if self._renderer is not None:
            self._renderer.close()
            self._renderer = None
        self._env.close()


class MetaWorldExpertPolicy:
    """Meta-World's scripted experts as a batched `Policy`, with optional Gaussian action noise."""

    name = "scripted"
    action_dim, state_dim = ACTION_DIM, STATE_DIM
    cameras = ()  # acts on the simulator's state alone

    def __init__(self, noise_std: float = 0.0, seed: int = 0):
        self.noise_std, self.seed = noise_std, seed
        self._experts: dict[str, object] = {}
        self.reset()

    def reset(self) -> None:
        self._rng = np.random.default_rng(self.seed)

    def select_action(self, batch: dict) -> np.ndarray:
        states = np.asarray(batch["observation.environment_state"], dtype=np.float64)
        actions = []
        for task, state in zip(batch["env_task"], states):
            if task not in self._experts:
                self._experts[task] = scripted_expert(task)
            actions.append(self._experts[task].get_action(state))
        actions = np.asarray(actions, dtype=np.float32)
        if self.noise_std > 0:
            actions = actions + self._rng.normal(0, self.noise_std, actions.shape).astype(np.float32)
        return np.clip(actions, -1, 1)[:, None, :]


class MetaWorld(EnvType):
    """Meta-World in the registry: 50 tasks, the MT10 / MT50 / default sets, scripted experts."""

    name, fps, cameras, robot = "metaworld", FPS, DEFAULT_CAMERAS, "sawyer"
    max_reward = 10.0  # Meta-World v3's shaped reward per step lies in [0, 10]

    def task_names(self) -> list[str]:
        return task_names()

    def tasks(self, text: str) -> list[str]:
        """'MT10' / 'MT50' / 'default' (one set name) or comma-separated task names (checked later)."""
        names = super().tasks(text)
        if len(names) == 1 and names[0].lower() in TASK_SETS:
            return task_set(names[0])
        return names

    def spec(self, task: str = "", cameras: tuple[str, ...] | None = None, max_steps: int | None = None) -> EnvSpec:
        return spec(task, DEFAULT_CAMERAS if cameras is None else cameras, max_steps or MAX_STEPS)

    def make(self, **kwargs) -> MetaWorldEnv:
        return MetaWorldEnv(**kwargs)

    def expert(self, noise_std: float = 0.0, seed: int = 0) -> MetaWorldExpertPolicy:
        return MetaWorldExpertPolicy(noise_std=noise_std, seed=seed)

    def dataset_task_names(self, task: str) -> tuple[str, ...]:
        """The task's name and the instruction `collect` records for it."""
        return task, instruction(task)

    def backend(self) -> str:
        import importlib.metadata
        import os

        return (f"metaworld {importlib.metadata.version('metaworld')}, "
                f"mujoco {importlib.metadata.version('mujoco')}, MUJOCO_GL={os.environ.get('MUJOCO_GL')}")


ENV = MetaWorld()
