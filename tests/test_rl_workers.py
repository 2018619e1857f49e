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
