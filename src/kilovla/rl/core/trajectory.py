"""Versioned trajectories: what an env sends the learner.

A `Segment` is T consecutive policy steps of one env, admitted once by the staleness gate. Each
step carries the policy version whose weights chose its action (its *behaviour version*), the
stored denoising chain and its log-probability, the value estimate, the reward summed over the
actions executed in the env, whether an episode ended there (the env resets and the segment
goes on) and whether that end was a truncation at `max_steps` (the learner bootstraps through a
truncation, not through a termination). The observation after the last step (`next_obs`) lets the learner bootstrap the value.

Rewards (`step_reward`): reward_scale x the simulator's reward plus success_bonus on a success
step. With terminate_on_success the bonus comes once, so success dominates only while the largest
shaped return of a whole episode, max_steps x max env reward x reward_scale, stays below the bonus
(Meta-World's reward is at most 10: reward_scale 2e-4 x 150 steps x 10 = 0.3 < 1.0); otherwise a
policy that hovers near the goal without finishing earns more than one that succeeds.

Segments have a fixed length, so a global batch of B segments is B * T samples, known before any
arrives: the streaming learner can scale every micro-batch's loss right away.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


def stack(observations: list[dict]) -> dict:
    """Per-step observation dicts -> one dict of arrays stacked on axis 0 (strings as lists)."""
    out = {}
    for key, value in observations[0].items():
        out[key] = [o[key] for o in observations] if isinstance(value, str) else np.stack([o[key] for o in observations])
    return out


def index(obs: dict, rows) -> dict:
    """Rows of a stacked observation dict."""
    rows = np.asarray(rows)
    return {k: [v[i] for i in rows] if isinstance(v, list) else v[rows] for k, v in obs.items()}


def concat(observations: list[dict]) -> dict:
    out = {}
    for key, value in observations[0].items():
        out[key] = [x for o in observations for x in o[key]] if isinstance(value, list) else \
            np.concatenate([o[key] for o in observations])
    return out


def step_reward(env_reward: float, success: bool, reward_scale: float, success_bonus: float) -> float:
    """The RL reward of one executed action: the shaped env reward, scaled, plus the bonus on success."""
    return reward_scale * env_reward + (success_bonus if success else 0.0)


@dataclass
class Episode:
    """An episode that ended inside a segment."""

    task: str
    seed: int
    success: bool
    steps: int  # env steps (actions executed)
    return_: float


@dataclass
class Segment:
    segment_id: tuple[int, int, int, int]  # (env worker, its incarnation, env slot, sequence): never consumed twice
    ticket: int  # the staleness gate's admission ticket: global batch ticket // B consumes it (-1: sync mode)
    start_version: int  # policy version when the staleness gate admitted it
    obs: dict  # stacked over the T steps
    chain: np.ndarray | None  # (T, K + 1, H, A); None: the algorithm keeps no chains (residual SAC)
    stochastic: np.ndarray | None  # (T, K) bool
    logp: np.ndarray | None  # (T,)
    value: np.ndarray | None  # (T,)
    reward: np.ndarray  # (T,)
    done: np.ndarray  # (T,) bool: an episode ended at this step (terminated or truncated)
    version: np.ndarray  # (T,) behaviour version of each step
    next_obs: dict  # the observation after the last step (one env, unstacked)
    truncated: np.ndarray | None = None  # (T,) bool: that end was the time limit, not a termination
    env_steps: int = 0  # actions executed in the env
    episodes: list[Episode] = field(default_factory=list)
    extras: dict = field(default_factory=dict)  # what else the acting policy returned per step, stacked (T, ...)

    def __len__(self) -> int:
        return len(self.reward)
