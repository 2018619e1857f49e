"""Env registry: `make_env("metaworld", task="push-v3", ...)` and what every env declares."""

from __future__ import annotations

import importlib
from dataclasses import dataclass

from kilovla.errors import KilovlaError

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


def _module(name: str):
    """The simulator's module, imported by name on first use: each simulator module imports this one
    (EnvSpec), never the other way round, and a heavy simulator loads only when it is asked for."""
    return importlib.import_module(f"kilovla.envs.{name}")


def make_env(name: str, **kwargs):
    """A gymnasium env by simulator name; kwargs go to that simulator's env class."""
    if name not in ENV_NAMES:
        raise KilovlaError(f"unknown env {name!r}; available: {', '.join(ENV_NAMES)}")
    return _module(name).make(**kwargs)


def env_spec(name: str, task: str, **kwargs) -> EnvSpec:
    if name not in ENV_NAMES:
        raise KilovlaError(f"unknown env {name!r}; available: {', '.join(ENV_NAMES)}")
    return _module(name).spec(task, **kwargs)


def check_tasks(env: str, tasks: list[str], valid: list[str]) -> list[str]:
    unknown = [t for t in tasks if t not in valid]
    if unknown:
        raise KilovlaError(f"unknown {env} task(s) {unknown}; valid tasks: {', '.join(valid)}")
    if not tasks:
        raise KilovlaError(f"no {env} tasks given; valid tasks: {', '.join(valid)}")
    return tasks
