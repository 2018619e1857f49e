"""Episode seeds: which initial state an env episode starts from, for every command that resets an env.

`env.reset(seed=s)` fixes an episode's start (Meta-World draws its object and goal positions from `s`),
so an evaluation is only a test of generalisation when its seeds are not the seeds the demonstrations
(or the RL episodes) were recorded on. Each use draws from its own *stream*, a decimal digit above the
rest of the seed; within a stream the user's seed, the task's index and the episode's number take
fixed decimal fields:

    stream * 10**18 + seed * 10**9 + task_index * 10**6 + episode        (eval 1, collect 2)
    3 * 10**18 + seed * 10**9 + worker * 10**6 + env_slot * 10**4 (+ k)  (rl training, episode k of a slot)

Every field is checked against its width (seed < 10**9, task_index < 1000, episode < 10**6; worker <
1000, env_slot < 100), so two streams cannot share a seed for ANY user seeds, and every seed fits
LeRobot's int64 `seed` column. Because every field but the episode is a multiple of 100, a seed mod 50
(LIBERO's init-state index) is still the episode's number mod 50, as before.

>>> eval_seed(0, 0, 3), collect_seed(0, 0, 3)
(1000000000000000003, 2000000000000000003)
>>> eval_seed(7, 2, 5)   # user seed 7, third task, sixth episode
1000000007002000005
>>> stream_of(collect_seed(123, 4, 0))
'collect'
"""

from __future__ import annotations

from kilovla.errors import KilovlaError

SEED_RULE = "kilovla-seeds-v1"  # meta/info.json's `kilovla_seed_rule`: the layout above
STREAM, SEED, TASK, SLOT = 10**18, 10**9, 10**6, 10**4
STREAMS = {"eval": 1, "collect": 2, "rl": 3}
MAX_SEED, MAX_TASKS, MAX_EPISODES = SEED, 1000, TASK  # exclusive bounds of each field
MAX_WORKERS, MAX_SLOTS = 1000, 100


def _check(name: str, value: int, bound: int, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < bound:
        raise KilovlaError(f"{name} must be an integer in [0, {bound}) ({what}), got {value!r}")
    return value


def _episode_seed(stream: str, seed: int, task_index: int, episode: int) -> int:
    _check("seed", seed, MAX_SEED, "the seed rule gives it 9 decimal digits")
    _check("task index", task_index, MAX_TASKS, "at most 1000 tasks per run")
    _check("episode", episode, MAX_EPISODES, "at most 10**6 episodes per task")
    return STREAMS[stream] * STREAM + seed * SEED + task_index * TASK + episode


def eval_seed(seed: int, task_index: int, episode: int) -> int:
    """The seed of evaluation episode `episode` of the `task_index`-th task under user seed `seed`."""
    return _episode_seed("eval", seed, task_index, episode)


def collect_seed(seed: int, task_index: int, attempt: int) -> int:
    """The seed of `collect`'s `attempt`-th try (kept or dropped) at the `task_index`-th task."""
    return _episode_seed("collect", seed, task_index, attempt)


def eval_seeds(seed: int, task_index: int, episodes: int) -> list[int]:
    """The first `episodes` evaluation seeds of a task: `[eval_seed(seed, task_index, i) for i < episodes]`."""
    if episodes > MAX_EPISODES:
        raise KilovlaError(f"episodes must be at most {MAX_EPISODES} per task (the seed rule's episode field), "
                           f"got {episodes}")
    return [eval_seed(seed, task_index, i) for i in range(episodes)]


def rl_train_seed(run_seed: int, worker: int, env_slot: int) -> int:
    """The first seed of an RL env slot; its episodes count up from here (10_000 seeds per slot)."""
    _check("seed", run_seed, MAX_SEED, "the seed rule gives it 9 decimal digits")
    _check("worker", worker, MAX_WORKERS, "at most 1000 env workers")
    _check("env slot", env_slot, MAX_SLOTS, "at most 100 envs per worker")
    return STREAMS["rl"] * STREAM + run_seed * SEED + worker * TASK + env_slot * SLOT


def stream_of(seed: int) -> str | None:
    """Which stream a seed came from, or None for a seed outside the rule (a pre-rule dataset's)."""
    return next((name for name, tag in STREAMS.items() if seed // STREAM == tag), None)
