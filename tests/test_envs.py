"""Simulators: Meta-World observations, seeding, experts, latency, the env pool."""

import numpy as np
import pytest

from kilovla.envs import make_env
from kilovla.envs.latency import LatencyModel, LatencyWrapper
from kilovla.envs.metaworld import DEFAULT_TASKS, MetaWorldExpertPolicy, instruction, task_set
from kilovla.envs.rollout import run_episodes
from kilovla.envs.seeds import eval_seed
from kilovla.envs.vector import EnvConfig, EnvCrashed, EnvPool
from kilovla.errors import KilovlaError

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


@pytest.fixture(scope="module")
def push():
    env = make_env("metaworld", task="push-v3", resolution=32)
    yield env
    env.close()


def test_observations_use_lerobot_keys(push):
    obs, info = push.reset(seed=0)
    assert obs["observation.images.scene"].shape == (32, 32, 3)
    assert obs["observation.images.wrist"].dtype == np.uint8
    assert obs["observation.state"].shape == (4,) and obs["observation.state"].dtype == np.float32
    assert obs["observation.environment_state"].shape == (39,)
    assert obs["task"] == "push the puck to the goal"
    assert info["is_success"] is False


def test_the_same_seed_gives_the_same_episode(push):
    a, _ = push.reset(seed=5)
    b, _ = push.reset(seed=5)
    c, _ = push.reset(seed=6)
    np.testing.assert_array_equal(a["observation.environment_state"], b["observation.environment_state"])
    np.testing.assert_array_equal(a["observation.images.scene"], b["observation.images.scene"])
    assert not np.array_equal(a["observation.environment_state"], c["observation.environment_state"])


def test_unknown_tasks_list_the_valid_ones():
    with pytest.raises(KilovlaError, match=r"unknown metaworld task\(s\) \['push-v9'\]; valid tasks: .*reach-v3"):
        make_env("metaworld", task="push-v9")


def test_unknown_envs_are_refused():
    with pytest.raises(KilovlaError, match="unknown env 'habitat'; available: metaworld, libero"):
        make_env("habitat")


def test_task_sets_and_instructions():
    assert len(task_set("MT10")) == 10 and len(task_set("mt50")) == 50
    assert instruction("stick-pull-v3") == "stick pull"


@pytest.mark.slow
@pytest.mark.shares_cpu  # whole episodes, nothing timed
@pytest.mark.parametrize("task", DEFAULT_TASKS)
def test_scripted_expert_solves_every_default_task(task):
    with EnvPool([EnvConfig("metaworld", {"task": task, "render": False})] * 3) as pool:
        episodes = run_episodes(pool, MetaWorldExpertPolicy(), [0, 1, 2, 3, 4, 5])
    assert [e.success for e in episodes] == [True] * 6
    assert all(e.steps < 500 for e in episodes)


@pytest.mark.parametrize("task", ["reach-v3", "reach-wall-v3"])
def test_the_reach_experts_bring_the_tcp_onto_the_goal(task):
    """Success is measured at the TCP, 4.5 cm below the hand the state reports: Meta-World's own reach
    experts settle 4.6 cm from the goal (inside the 5 cm radius by 4 mm); ours end within 1.5 cm."""
    from kilovla.envs.metaworld import MetaWorldEnv, scripted_expert

    env, expert = MetaWorldEnv(task, render=False, terminate_on_success=False), scripted_expert(task)
    for seed in range(3):
        obs, _ = env.reset(seed=seed)
        for _ in range(100):
            obs, *_ = env.step(expert.get_action(obs["observation.environment_state"]))
        assert np.linalg.norm(env._env.tcp_center - env._env._target_pos) < 0.015, seed
    env.close()


def test_success_hold_runs_an_episode_on_past_its_first_success():
    """Collection's success_hold: the same seed's episode ends at its first success with 0, and that many steps
    later with 4 (the expert still acting, its success counted)."""
    runs = {}
    for hold in (0, 4):
        with EnvPool([EnvConfig("metaworld", {"task": "reach-v3", "render": False, "success_hold": hold})]) as pool:
            runs[hold] = run_episodes(pool, MetaWorldExpertPolicy(), [0])[0]
    assert runs[0].success and runs[4].success
    assert runs[4].steps == runs[0].steps + 4


@pytest.mark.parametrize("dist,check", [
    ("constant", lambda d: np.allclose(d, 0.01)),
    ("lognormal", lambda d: abs(np.mean(d) - 0.01) < 0.001 and np.std(d) > 0.002),
    ("straggler", lambda d: 0.15 < np.mean(np.isclose(d, 0.1)) < 0.25 and np.all(np.isclose(d, 0.01) | np.isclose(d, 0.1))),
])
def test_latency_distributions(push, dist, check):
    slept = []
    env = LatencyWrapper(push, LatencyModel(dist, mean_s=0.01, sigma=0.5, p=0.2, k=10, seed=1), sleep=slept.append)
    model = LatencyModel(dist, mean_s=0.01, sigma=0.5, p=0.2, k=10, seed=1)
    draws = np.array([model.sample() for _ in range(4000)])
    assert check(draws)
    env.reset(seed=0)
    for _ in range(3):
        env.step(np.zeros(4))
    assert len(slept) == 3 and env.total_delay_s == pytest.approx(sum(slept))


def test_latency_is_seeded():
    def draws(seed):
        model = LatencyModel("lognormal", mean_s=1, sigma=0.5, seed=seed)
        return [model.sample() for _ in range(5)]

    assert draws(3) == draws(3)
    assert draws(3) != draws(4)
    assert len(set(draws(3))) == 5


def test_worker_processes_reproduce_in_process_rollouts():
    """States and images are the same in this process, in 2 workers (2 envs and 1) and in one worker per env
    (the demo's)."""
    config = EnvConfig("metaworld", {"task": "push-v3", "resolution": 16})
    actions = np.random.default_rng(0).uniform(-1, 1, (10, 3, 4)).astype(np.float32)

    def roll(workers):
        with EnvPool([config] * 3, num_workers=workers) as pool:
            pool.reset([7, 8, 9])
            steps = [[r[0] for r in pool.step(list(a))] for a in actions]
        return {key: np.array([[obs[key] for obs in step] for step in steps]) for key in steps[0][0]}

    here = roll(0)
    assert {"observation.environment_state", "observation.images.scene", "observation.images.wrist"} <= here.keys()
    for workers in (2, 3):
        got = roll(workers)
        assert got.keys() == here.keys()
        for key in here:
            np.testing.assert_array_equal(got[key], here[key], err_msg=f"{key}, {workers} workers")


def test_a_killed_worker_is_reported_with_its_envs():
    import os
    import signal

    with EnvPool([EnvConfig("metaworld", {"task": "reach-v3", "render": False})] * 2, num_workers=2) as pool:
        pool.reset([0, 1])
        os.kill(pool._procs[1].pid, signal.SIGKILL)
        pool._procs[1].join(10)
        with pytest.raises(EnvCrashed, match=r"envs \[1\]"):
            pool.step([np.zeros(4)] * 2)


def test_rebuild_plays_the_next_task_in_the_same_workers_as_a_new_pool_would():
    import os
    import signal

    def config(task):
        return EnvConfig("metaworld", {"task": task, "resolution": 16})

    actions = np.random.default_rng(0).uniform(-1, 1, (5, 3, 4)).astype(np.float32)

    def roll(pool):
        first = pool.reset([7, 8, 9])
        return [[o[0]["observation.images.scene"] for o in first]] + [
            [r[0]["observation.images.scene"] for r in pool.step(list(a))] for a in actions]

    with EnvPool([config("drawer-close-v3")] * 3, num_workers=2) as fresh:
        expected = roll(fresh)
    with EnvPool([config("reach-v3")] * 2, num_workers=2) as pool:
        workers = [p.pid for p in pool._procs]
        roll_reach = pool.reset([1, 2])
        pool.rebuild([config("drawer-close-v3")] * 3)  # another task, another count of envs
        assert [p.pid for p in pool._procs] == workers
        assert pool.num_envs == 3 and pool.configs[0].kwargs["task"] == "drawer-close-v3"
        np.testing.assert_array_equal(np.array(roll(pool)), np.array(expected))
        # A crash leaves the workers' replies out of step: the next rebuild starts new ones.
        os.kill(pool._procs[0].pid, signal.SIGKILL)
        pool._procs[0].join(10)
        with pytest.raises(EnvCrashed):
            pool.step([np.zeros(4)] * 3)
        pool.rebuild([config("drawer-close-v3")] * 3)
        assert not set(p.pid for p in pool._procs) & set(workers)
        np.testing.assert_array_equal(np.array(roll(pool)), np.array(expected))
        # A worker that died between tasks: the next task starts on new workers too.
        workers = [p.pid for p in pool._procs]
        os.kill(workers[1], signal.SIGKILL)
        pool._procs[1].join(10)
        pool.rebuild([config("drawer-close-v3")] * 3)
        assert not set(p.pid for p in pool._procs) & set(workers)
        np.testing.assert_array_equal(np.array(roll(pool)), np.array(expected))
        # Envs that cannot be built end their workers: the next rebuild starts new ones.
        with pytest.raises(KilovlaError, match="cannot build envs"):
            pool.rebuild([EnvConfig("metaworld", {"task": "reach-v3", "cameras": ("nope",)})] * 2)
        pool.rebuild([config("drawer-close-v3")] * 3)
        np.testing.assert_array_equal(np.array(roll(pool)), np.array(expected))
    assert roll_reach[0][0]["task"] == "reach the red goal"


def test_each_env_worker_renders_with_its_share_of_the_cores(monkeypatch):
    from kilovla.envs.vector import gl_threads

    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(16)))
    assert [gl_threads(w) for w in (1, 2, 8, 16, 32)] == [16, 8, 2, 0, 0]  # 0: in the worker's own thread
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1})
    assert gl_threads(2) == 0


def test_bad_env_configs_fail_before_any_step():
    with pytest.raises(KilovlaError, match="cannot build envs"):
        EnvPool([EnvConfig("metaworld", {"task": "reach-v3", "cameras": ("nope",)})], num_workers=1)


def test_action_chunks_are_executed_n_steps_at_a_time():
    calls = []

    class Constant:
        name = "constant"

        def reset(self):
            pass

        def select_action(self, batch):
            calls.append(len(batch["task"]))
            return np.zeros((len(batch["task"]), 10, 4), np.float32)

    config = EnvConfig("metaworld", {"task": "reach-v3", "render": False, "max_steps": 12})
    with EnvPool([config] * 2) as pool:
        episodes = run_episodes(pool, Constant(), [0, 1], n_action_steps=4)
    assert [e.steps for e in episodes] == [12, 12]
    assert calls == [2, 2, 2]  # steps 0, 4, 8: both envs in one batch each time


@pytest.mark.slow
@pytest.mark.shares_cpu  # a reset and a step, nothing timed
def test_libero_suite_task_resets_and_steps():
    pytest.importorskip("libero.libero")
    env = make_env("libero", task="libero_goal/0", resolution=32)
    try:
        obs, info = env.reset(seed=3)
        assert info["init_state"] == 3
        assert obs["observation.images.agentview"].shape == (32, 32, 3)
        assert obs["observation.state"].shape == (8,)
        obs, _, terminated, truncated, info = env.step(np.zeros(7))
        assert not terminated and not truncated and "is_success" in info
        # an evaluation's seeds (envs/seeds.py, ~1e18) are past the 32 bits LIBERO's NumPy seeding takes
        _, info = env.reset(seed=eval_seed(0, 0, 3))
        assert info["init_state"] == 3
    finally:
        env.close()


@pytest.mark.slow
@pytest.mark.shares_cpu  # file comparisons
def test_bundled_libero_matches_the_official_release():
    import os

    pytest.importorskip("libero.libero")
    official = os.environ.get("KILOVLA_LIBERO_OFFICIAL")
    if not official:
        pytest.skip("set KILOVLA_LIBERO_OFFICIAL to an unpacked official libero source (pip download libero)")
    from kilovla.envs.libero import compare_with_official

    assert compare_with_official(official) == []


def test_rendering_can_be_skipped_between_the_observations_a_policy_looks_at(push):
    push.reset(seed=0)
    push.unwrapped.set_rendering(False)
    obs = push.step(np.zeros(4))[0]
    assert not any(k.startswith("observation.images.") for k in obs)  # no camera work for this step
    push.unwrapped.set_rendering(True)
    obs = push.step(np.zeros(4))[0]
    assert obs["observation.images.scene"].shape == (32, 32, 3) and obs["observation.images.wrist"].any()


def test_a_policy_that_reads_no_camera_gets_no_rendered_frame_not_even_at_reset():
    # A new renderer costs ~0.4 s (its GL context and the meshes' upload): the scripted expert's evaluation made one
    # per env and task only to render the reset frames nobody read.
    seen = []

    class StateOnly(MetaWorldExpertPolicy):  # cameras = (): it acts on the state alone
        def select_action(self, batch):
            seen.append(sorted(k for k in batch if k.startswith("observation.images.")))
            return super().select_action(batch)

    with EnvPool([EnvConfig("metaworld", {"task": "reach-v3", "resolution": 16, "max_steps": 5})] * 2) as pool:
        run_episodes(pool, StateOnly(), [0, 1, 2])
        assert all(env.unwrapped._renderer is None for env in pool._envs)
    assert seen and seen == [[]] * len(seen)
