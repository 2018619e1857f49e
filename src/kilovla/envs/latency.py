"""`LatencyWrapper`: makes env steps take longer, the way real simulators and robots do.

Async RL only pays off when step times vary; benchmarks need that variation on demand, seeded:

- ``constant``: every step takes `mean_s` more;
- ``lognormal``: `mean_s * exp(sigma * z - sigma^2 / 2)`, z ~ N(0, 1), so the mean stays `mean_s`;
- ``straggler``: `mean_s`, but with probability `p` a step takes `k` times as long.

>>> LatencyModel("straggler", mean_s=0.01, p=0.5, k=10, seed=0).sample()  # doctest: +SKIP
0.1
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import gymnasium as gym
import numpy as np

from kilovla.errors import KilovlaError

DISTRIBUTIONS = ("constant", "lognormal", "straggler")


@dataclass
class LatencyModel:
    distribution: str = "constant"
    mean_s: float = 0.0
    sigma: float = 0.5
    p: float = 0.05
    k: float = 10.0
    seed: int = 0

    def __post_init__(self):
        if self.distribution not in DISTRIBUTIONS:
            raise KilovlaError(f"latency distribution must be one of {DISTRIBUTIONS}, not {self.distribution!r}")
        if self.mean_s < 0 or self.sigma < 0 or not 0 <= self.p <= 1 or self.k < 1:
            raise KilovlaError(f"bad latency parameters: mean_s={self.mean_s}, sigma={self.sigma}, p={self.p}, k={self.k}")
        self._rng = np.random.default_rng(self.seed)

    def sample(self) -> float:
        if self.distribution == "constant":
            return self.mean_s
        if self.distribution == "lognormal":
            return float(self.mean_s * np.exp(self.sigma * self._rng.standard_normal() - self.sigma**2 / 2))
        return self.mean_s * (self.k if self._rng.random() < self.p else 1.0)


class LatencyWrapper(gym.Wrapper):
    """Adds a sampled delay to every `step` (and optionally `reset`)."""

    def __init__(self, env: gym.Env, model: LatencyModel, sleep: Callable[[float], None] = time.sleep,
                 on_reset: bool = False):
        super().__init__(env)
        self.model, self._sleep, self._on_reset = model, sleep, on_reset
        self.total_delay_s = 0.0

    def _delay(self) -> None:
        d = self.model.sample()
        self.total_delay_s += d
        if d > 0:
            self._sleep(d)

    def step(self, action):
        out = self.env.step(action)
        self._delay()
        return out

    def reset(self, **kwargs):
        out = self.env.reset(**kwargs)
        if self._on_reset:
            self._delay()
        return out
