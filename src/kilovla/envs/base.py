"""Env registry: one `EnvType` per simulator owns everything a caller needs to know about that env.

    env = env_type("metaworld")
    env.tasks("MT10")                 -> the MT10 task names ('a,b' lists names; LIBERO expands suites)
    env.check_tasks(["push-v9"])      -> KilovlaError naming the valid tasks
    env.spec("push-v3")               -> EnvSpec: action/state dims, cameras, episode length, fps
    env.check_fits(policy, tasks)     -> the tasks exist and the policy fits the spec (KilovlaError if not)
    env.expert(noise_std=0.1, seed=0) -> its scripted expert, a batched Policy (what `collect` records)
    env.make(task="push-v3", resolution=96)         -> a gymnasium env
    env.render_resolution(policy, asked=None)       -> the pixels a policy's cameras render at

Each simulator module `envs/<name>.py` defines its `EnvType` subclass and one instance, `ENV`;
`ENV_NAMES` lists the modules. A module is imported by name on first use (`env_type`), so the
simulators import this module (EnvSpec, EnvType), never the other way round, and a heavy simulator
loads only when it is asked for. `make_env` and `env_spec` are the by-name shortcuts.
"""

from __future__ import annotations

import importlib
import logging
from dataclasses import dataclass

from kilovla.errors import KilovlaError

log = logging.getLogger(__name__)

ENV_NAMES = ("metaworld", "libero")


@dataclass(frozen=True)
class EnvSpec:
    """What a policy must agree with: dims, cameras, episode length. Compared against checkpoints."""

    name: str
    action_dim: int
    state_dim: int
    cameras: tuple[str, ...]
    max_steps: int
    fps: int
    extra_state: tuple[tuple[str, int], ...] = ()  # other state-like observations, e.g. object/goal positions

    def state_dims(self) -> dict[str, int]:
        return {"observation.state": self.state_dim, **dict(self.extra_state)}

    def features(self, resolution: int) -> dict:
        """LeRobot `features` for a dataset recorded from this env."""
        feats = {
            "observation.state": {"dtype": "float32", "shape": [self.state_dim]},
            "action": {"dtype": "float32", "shape": [self.action_dim]},
        }
        for cam in self.cameras:
            feats[f"observation.images.{cam}"] = {"dtype": "video", "shape": [resolution, resolution, 3]}
        return feats

    def check_fits(self, policy) -> None:
        """Refuse a policy (loaded, or a folder's `Interface`) whose declared dims or cameras differ from
        this env's, before any rollout."""
        problems = []
        want = getattr(policy, "action_dim", None)
        if want is not None and want != self.action_dim:
            problems.append(f"action_dim {want} (policy) vs {self.action_dim} ({self.name})")
        dims = self.state_dims()
        keys = getattr(policy, "state_keys", ["observation.state"])
        missing = [k for k in keys if k not in dims]
        if missing:
            problems.append(f"state inputs {missing} (policy) that {self.name} does not provide")
        elif getattr(policy, "state_dim", None) is not None and policy.state_dim != sum(dims[k] for k in keys):
            problems.append(f"state_dim {policy.state_dim} (policy) vs {sum(dims[k] for k in keys)} ({self.name})")
        cams = getattr(policy, "cameras", None)
        if cams is not None and not set(cams) <= set(self.cameras):
            problems.append(f"cameras {sorted(cams)} (policy) vs {sorted(self.cameras)} ({self.name})")
        if problems:
            raise KilovlaError(f"policy {getattr(policy, 'name', policy)} does not fit env {self.name}: "
                               + "; ".join(problems))


class EnvType:
    """One simulator: its name, tasks and task sets, spec (dims, cameras, fps), scripted expert and
    env factory. Subclasses set the class attributes and override what their simulator provides."""

    name: str
    fps: int
    cameras: tuple[str, ...]  # the cameras an evaluation renders unless told otherwise
    robot: str  # meta/info.json's robot_type of a recorded dataset: `<name>-<robot>`
    resolution = 96  # pixels for a policy that does not record its training resolution
    max_reward: float | None = None  # the largest shaped reward of one step; None: not bounded here

    def task_names(self) -> list[str] | None:
        """Every valid task; None where the names are not listed (only an empty list is refused)."""
        return None

    def tasks(self, text: str) -> list[str]:
        """A --tasks value -> task names: comma-separated names (a subclass adds its task sets)."""
        return [t.strip() for t in text.split(",") if t.strip()]

    def check_tasks(self, tasks: list[str]) -> list[str]:
        valid = self.task_names()
        if valid is None:
            if not tasks:
                raise KilovlaError(f"no {self.name} tasks given")
            return tasks
        return check_tasks(self.name, tasks, valid)

    def spec(self, task: str = "", cameras: tuple[str, ...] | None = None, max_steps: int | None = None) -> EnvSpec:
        """The env's declared dims for `task`; None keeps the env's own cameras and step limit."""
        raise NotImplementedError

    def check_fits(self, policy, tasks, cameras: tuple[str, ...] | None = None,
                   max_steps: int | None = None) -> EnvSpec:
        """The tasks exist and `policy` (loaded, or a folder's `Interface`) fits the env's action, state and
        cameras (the first task's spec, with these cameras and step limit); before any env is built."""
        tasks = self.check_tasks(list(tasks))
        spec = self.spec(tasks[0], cameras=cameras, max_steps=max_steps)
        spec.check_fits(policy)
        return spec

    def make(self, **kwargs):
        """A gymnasium env; kwargs go to the simulator's env class (task, cameras, resolution, ...)."""
        raise NotImplementedError

    def expert(self, noise_std: float = 0.0, seed: int = 0):
        with_experts = [n for n in ENV_NAMES if type(env_type(n)).expert is not EnvType.expert]
        raise KilovlaError(f"no scripted experts for env {self.name!r}; collect supports: {', '.join(with_experts)}")

    def dataset_task_names(self, task: str) -> tuple[str, ...]:
        """The names a dataset may give this env's task: its own (a subclass adds the instruction)."""
        return (task,)

    def backend(self) -> str:
        """The simulator and its version, as reports record them."""
        raise NotImplementedError

    def render_resolution(self, policy, asked: int | None, flag: str = "--env.resolution") -> int:
        """The camera resolution to evaluate or train `policy` (a loaded policy, or a folder's `Interface`) at:
        the size of its training frames (policy.json's image_size) unless `asked` (the `flag`) says otherwise,
        with a warning when the two differ, or when a learned policy does not record it (folders of earlier
        versions: `self.resolution`). Scripted, random and served policies render at `self.resolution`."""
        from kilovla.policy_folder import Interface

        declared = policy if isinstance(policy, Interface) else getattr(policy, "meta", None)
        size = getattr(declared, "image_size", None)
        trained = max(size) if size else None
        if asked is None:
            if trained is None and declared is not None:
                log.warning("%s: policy.json does not record its training resolution; rendering at %d px "
                            "(%s sets it)", policy.name, self.resolution, flag)
            return trained or self.resolution
        if trained is not None and asked != trained:
            log.warning("rendering at %d px, but %s was trained on %dx%d frames (policy.json image_size; %s asked)",
                        asked, policy.name, *size, flag)
        return asked


def env_type(name: str) -> EnvType:
    """The registered env called `name` (its module, `kilovla.envs.<name>`, imported on first use)."""
    if name not in ENV_NAMES:
        raise KilovlaError(f"unknown env {name!r}; available: {', '.join(ENV_NAMES)}")
    return importlib.import_module(f"kilovla.envs.{name}").ENV


def make_env(name: str, **kwargs):
    """A gymnasium env by simulator name; kwargs go to that simulator's env class."""
    return env_type(name).make(**kwargs)


def env_spec(name: str, task: str, **kwargs) -> EnvSpec:
    return env_type(name).spec(task, **kwargs)


def check_tasks(env: str, tasks: list[str], valid: list[str]) -> list[str]:
    unknown = [t for t in tasks if t not in valid]
    if unknown:
        raise KilovlaError(f"unknown {env} task(s) {unknown}; valid tasks: {', '.join(valid)}")
    if not tasks:
        raise KilovlaError(f"no {env} tasks given; valid tasks: {', '.join(valid)}")
    return tasks
