"""The `Policy` protocol every policy implements: scripted experts, random, learned checkpoints.

A policy gets a batch of observations (LeRobot keys, stacked over envs: images (B, H, W, 3) uint8,
``observation.state`` (B, D), ``task`` list of instructions, ``env_task`` list of simulator task ids)
and returns an action chunk (B, T, action_dim); the caller executes the first `n_action_steps` of
each chunk before asking again. `reset()` is called before an evaluation starts.

Policies may declare `action_dim`, `state_dim` and `cameras`; evaluation refuses an env whose spec
disagrees, with one message, instead of failing mid-rollout. `cameras = ()` says the policy reads no
camera: rollouts then render images only where a video or dataset needs them.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import numpy as np


@runtime_checkable
class Policy(Protocol):
    name: str

    def reset(self) -> None: ...

    def select_action(self, batch: dict) -> np.ndarray: ...


class RandomPolicy:
    """Uniform actions in [-1, 1]: the floor any learned policy must beat."""

    name = "random"
    cameras = ()  # looks at nothing

    def __init__(self, action_dim: int, seed: int = 0, chunk: int = 1):
        self.action_dim, self.seed, self.chunk = action_dim, seed, chunk
        self.reset()

    def reset(self) -> None:
        self._rng = np.random.default_rng(self.seed)

    def select_action(self, batch: dict) -> np.ndarray:
        n = len(batch["task"])
        return self._rng.uniform(-1, 1, (n, self.chunk, self.action_dim)).astype(np.float32)
