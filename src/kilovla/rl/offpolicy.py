"""What the two off-policy learners (residual SAC, filtered BC) share: the update clock, the stitching of an
env slot's segments, and the resume checks of a saved replay buffer.

- `OffPolicySchedule`: gradient steps owed for delivered data, paid once the buffer is ready, and a policy
  version every `segments_per_step` segments (async: updates run while the envs keep playing).
- `state_key` / `forget_replaced`: a segment continues its env slot's last one only where it starts at the
  state that one ended in, and never across a replaced worker's incarnations.
- `check_one_learner`, `check_saved_replay`, `check_replay_capacity`: the settings and checkpoints a replay
  learner needs.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from kilovla.errors import KilovlaError

if TYPE_CHECKING:
    from kilovla.rl.algorithm import RunConfig


class OffPolicySchedule:
    """What the off-policy learners share: gradient steps owed for delivered data, paid as soon as the
    buffer is ready (async: while the envs keep playing), and a policy version every `segments_per_step`
    segments. Subclasses keep `owed`, `in_step`, `version`, `segments_per_step` and `_stats`."""

    def _pay(self, owed: float, ready: bool, update) -> None:
        if ready:
            self.owed += owed
            while self.owed >= 1.0:
                self.owed -= 1.0
                self._stats.append(update())

    def _version_due(self, segments: int) -> bool:
        self.in_step += segments
        if self.in_step < self.segments_per_step:
            return False
        self.in_step -= self.segments_per_step
        self.version += 1
        return True


def forget_replaced(pending: dict, slot: tuple, *others: dict) -> None:
    """Drop what waits for env slot (worker, incarnation, env) under an earlier incarnation of that worker: a
    replaced worker's episodes never continue."""
    worker, incarnation, env = slot
    for key in [k for k in pending if k[0] == worker and k[2] == env and k[1] < incarnation]:
        for d in (pending, *others):
            d.pop(key, None)


def state_key(obs: dict, single: bool = False) -> np.ndarray:
    """The state vectors of one observation, concatenated: what identifies the step a segment starts at."""
    keys = [k for k in sorted(obs) if k.startswith("observation.") and "images" not in k]
    return np.concatenate([np.asarray(obs[k] if single else obs[k][0], np.float32).ravel() for k in keys])


def check_one_learner(cfg: RunConfig) -> None:
    """The off-policy learners sample one replay buffer on one rank, with the real model."""
    name = cfg.learner.algo.name
    if cfg.learner.ranks != 1:
        raise KilovlaError(f"learner.algo.name {name} samples one replay buffer on one learner: learner.ranks must be 1, "
                           f"got {cfg.learner.ranks}")
    if cfg.compute.calibrated:
        raise KilovlaError("compute.model calibrated times PPO's learner (a throughput benchmark); use it with "
                           "--learner.algo.name=ppo")


def check_saved_replay(folder: Path, state: dict, name: str) -> None:
    """learner.pt (`state`) of the off-policy learner `name` resumes only with its replay buffer."""
    if state.get("replay_rest") is None or "replay" not in state:
        raise KilovlaError(f"{folder}: no replay buffer (replay.safetensors and learner.pt's replay_rest) to resume "
                           f"{name} with")


def check_replay_capacity(folder: Path, state: dict, flag: str, capacity: int) -> None:
    """A saved ring resumes into a ring of the size it was written with (`flag` = `capacity` now): one of
    another size would misplace its rows. Rings written before the capacity was recorded pass."""
    saved = state["replay_rest"].get("capacity")
    if saved is not None and saved != capacity:
        raise KilovlaError(f"{folder}: its replay buffer holds up to {saved} entries; resume with "
                           f"--{flag}={saved} (got {capacity})")
