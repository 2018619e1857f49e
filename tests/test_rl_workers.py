"""The env worker's methods without a Ray cluster (the actor's own class, called from threads)."""

from __future__ import annotations

import time

import numpy as np


class _SlowRenderedEnv:
    """An env whose step waits for `release`, and renders an image only when rendering is on."""

    def __init__(self, release):
        self.release, self.render, self.unwrapped = release, True, self

    def set_rendering(self, on: bool) -> None:
        self.render = on

    def _obs(self, t: int) -> dict:
        return {"t": t, **({"observation.images.scene": np.zeros((2, 2, 3), np.uint8)} if self.render else {})}

    def reset(self, seed=None):
        self.t = 0
        return self._obs(0), {}

    def step(self, action):
        self.release.wait(5)
        self.t += 1
        return self._obs(self.t), 0.0, False, False, {}


class _Config:
    kwargs: dict = {}

    def __init__(self, release):
        self.release = release

    def build(self):
        return _SlowRenderedEnv(self.release)


def test_observe_waits_for_a_chunk_still_running_in_the_env():
    """A sync round abandoned mid-chunk (another worker died) must not read an unrendered observation."""
    import threading

    import torch

    from kilovla.rl.workers import EnvWorker

    threads = torch.get_num_threads()
    release = threading.Event()
    try:
        worker = EnvWorker.__ray_actor_class__(0, 0, [(_Config(release), 0)], segment_steps=1, reward_scale=1.0,
                                               success_bonus=1.0)
        chunk = threading.Thread(target=worker.step_all, args=([np.zeros((3, 4))],))
        chunk.start()
        time.sleep(0.1)  # the chunk is inside its first step, rendering off
        seen = []
        reader = threading.Thread(target=lambda: seen.extend(worker.observe()))
        reader.start()
        time.sleep(0.1)
        assert not seen  # observe queues behind the chunk
        release.set()
        chunk.join(5)
        reader.join(5)
        assert seen[0]["t"] == 3 and "observation.images.scene" in seen[0]
    finally:
        release.set()
        torch.set_num_threads(threads)


class _RewardEnv:
    """Rewards 1, 3, 6, ... (the t-th step pays t(t+1)/2); terminates with success at step `end`."""

    def __init__(self, end):
        self.end, self.unwrapped = end, self

    def reset(self, seed=None):
        self.t = 0
        return {"t": 0}, {}

    def step(self, action):
        self.t += 1
        done = self.t == self.end
        return {"t": self.t}, self.t * (self.t + 1) / 2, done, False, {"is_success": done}


class _RewardConfig:
    kwargs: dict = {}

    def build(self):
        return _RewardEnv(end=5)


def test_progress_shaping_pays_the_change_of_the_env_reward_and_the_bonus_once():
    import torch

    from kilovla.rl.workers import EnvWorker

    threads = torch.get_num_threads()
    try:
        rewards = {}
        for shaping in ("reward", "progress"):
            worker = EnvWorker.__ray_actor_class__(0, 0, [(_RewardConfig(), 0)], segment_steps=1, reward_scale=0.5,
                                                   success_bonus=10.0, shaping=shaping)
            first = worker._execute(0, np.zeros((3, 4)))  # steps 1-3 of the episode
            second = worker._execute(0, np.zeros((3, 4)))  # steps 4-5: success ends it (and resets)
            third = worker._execute(0, np.zeros((1, 4)))  # step 1 of the next episode
            rewards[shaping] = (first[0], second[0], second[1], third[0])
        assert rewards["reward"] == (0.5 * (1 + 3 + 6), 0.5 * (10 + 15) + 10.0, True, 0.5)
        # the change since the episode's previous action: 0 for its first, (15 - 1) in all, none carried over
        assert rewards["progress"] == (0.5 * (6 - 1), 0.5 * (15 - 6) + 10.0, True, 0.0)
    finally:
        torch.set_num_threads(threads)
