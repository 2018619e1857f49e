"""Run many episodes of a policy over an `EnvPool`, batching the policy over envs.

Each env slot plays one episode at a time; when it ends, the slot starts the next pending seed.
The policy is asked only for slots whose action queue is empty (action chunking: a chunk's first
`n_action_steps` actions are executed before asking again), all such slots in one batch.
Callbacks see every transition, which is how `collect` records datasets and `eval` records videos.
Camera images are rendered only for observations someone looks at: the one a policy that takes
images acts on (the last of a chunk) and every frame of the episodes `frames(episode)` names (a
video, a dataset); rendering is most of a simulated step's cost on CPU.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from kilovla.envs.vector import EnvCrashed, EnvPool
from kilovla.errors import KilovlaError


@dataclass
class Episode:
    index: int  # position in the seeds list
    seed: int
    task: str
    steps: int = 0
    reward: float = 0.0
    success: bool = False


def stack_observations(observations: Sequence[dict], env_tasks: Sequence[str]) -> dict:
    """Env observation dicts -> one batch: arrays stacked on axis 0, strings as lists; keys that not every
    observation has (images an env did not render) are left out."""
    batch = {}
    common = set.intersection(*(set(o) for o in observations))
    for key, value in observations[0].items():
        if key not in common:
            continue
        if isinstance(value, str):
            batch[key] = [o[key] for o in observations]
        else:
            batch[key] = np.stack([o[key] for o in observations])
    batch["env_task"] = list(env_tasks)
    return batch


def run_episodes(pool: EnvPool, policy, seeds: Sequence[int], *, n_action_steps: int | None = None,
                 on_step: Callable[[Episode, dict, np.ndarray, float, dict], None] | None = None,
                 on_end: Callable[[Episode, dict], None] | None = None,
                 on_progress: Callable[[int], None] | None = None,
                 frames: Callable[[Episode], bool] | None = None) -> list[Episode]:
    """Play one episode per seed; returns them in seed order.

    on_step(episode, obs, action, reward, info): obs is what the policy saw before `action`.
    on_end(episode, last_obs) after the last step of each episode.
    frames(episode): whether the callbacks need that episode's camera images at every step (default:
    all of them when on_step is given); others get images only where the policy acts.
    """
    if frames is None:
        frames = (lambda ep: True) if on_step is not None else (lambda ep: False)
    policy_sees_images = getattr(policy, "cameras", None) != ()  # a policy that reads no camera declares cameras = ()
    tasks = [c.kwargs.get("task", "") for c in pool.configs]
    pending = deque(enumerate(seeds))
    done: list[Episode] = []
    slots: dict[int, Episode] = {}
    obs: dict[int, dict] = {}
    queues = [deque() for _ in range(pool.num_envs)]

    def start(free: list[int]) -> None:
        wanted = [None] * pool.num_envs
        for slot in free:
            if pending:
                i, seed = pending.popleft()
                slots[slot] = Episode(i, seed, tasks[slot])
                wanted[slot] = seed
                queues[slot].clear()
        pool.set_rendering([None if wanted[s] is None else policy_sees_images or frames(slots[s])
                            for s in range(pool.num_envs)])
        for slot, out in enumerate(pool.reset(wanted)):
            if out is not None:
                obs[slot] = out[0]

    try:
        start(list(range(pool.num_envs)))
        _loop(pool, policy, slots, obs, queues, tasks, done, pending, start, n_action_steps, on_step, on_end,
              on_progress, lambda s: frames(slots[s]) or (policy_sees_images and not queues[s]))
    except EnvCrashed as e:
        e.seeds = sorted(ep.seed for ep in slots.values())  # the episodes that were running
        raise
    return sorted(done, key=lambda e: e.index)


def _loop(pool, policy, slots, obs, queues, tasks, done, pending, start, n_action_steps, on_step, on_end,
          on_progress, render) -> None:
    while slots:
        need = [s for s in slots if not queues[s]]
        if need:
            chunk = np.asarray(policy.select_action(stack_observations([obs[s] for s in need], [tasks[s] for s in need])))
            if chunk.ndim != 3 or chunk.shape[0] != len(need):
                raise KilovlaError(f"policy {getattr(policy, 'name', policy)} returned actions of shape {chunk.shape}; "
                                   f"expected ({len(need)}, chunk, action_dim)")
            for s, actions in zip(need, chunk):
                queues[s].extend(actions[: n_action_steps or len(actions)])
        actions = [queues[s].popleft() if s in slots else None for s in range(pool.num_envs)]
        pool.set_rendering([render(s) if s in slots else None for s in range(pool.num_envs)])
        results = pool.step(actions)
        finished = []
        for s, ep in list(slots.items()):
            new_obs, reward, terminated, truncated, info = results[s]
            if on_step is not None:
                on_step(ep, obs[s], actions[s], reward, info)
            ep.steps += 1
            ep.reward += float(reward)
            ep.success = ep.success or bool(info.get("is_success", False))
            obs[s] = new_obs
            if terminated or truncated:
                if on_end is not None:
                    on_end(ep, new_obs)
                done.append(slots.pop(s))
                finished.append(s)
                if on_progress is not None:
                    on_progress(len(done))
        if finished and pending:
            start(finished)
