"""The RL canary: a short sync residual-SAC run must lift a deliberately weak checkpoint on reach-v3 by a
margin its interval excludes, and must leave it exactly as it was with the actor's learning rate at 0.

The weak checkpoint is a good one miscalibrated: the demo's recipe on reach-v3 (20 demonstrations, 500
steps: ~76 % at a 60-step horizon here) whose action calibration is shifted by half the z range's
half-width, as a robot with a biased arm would be (~32 %). Its failures are what a bounded residual can
correct, so a working update lifts it within minutes (measured: 16/50 -> 45/50 after the 12 k env steps
run here, 91 s of RL on 2 cores; 50/50 after 20 k, docs/rl_finetune.md), and a broken one does not.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

pytestmark = [pytest.mark.ray, pytest.mark.slow, pytest.mark.shares_cpu, pytest.mark.filterwarnings("ignore::UserWarning"),
              pytest.mark.filterwarnings("ignore::DeprecationWarning")]

HORIZON, EPISODES = 60, 50
CANARY = ("--mode=sync", "--env.tasks=[reach-v3]", "--env.workers=2", "--env.envs_per_worker=4",
          f"--env.max_steps={HORIZON}", "--rollout.segment_steps=4", "--learner.batch_segments=8",
          "--env.success_bonus=1.0", "--learner.algo.gamma=0.9", "--learner.algo.sac.res_scale=0.6",
          "--learner.algo.sac.penalty=0.05", "--learner.algo.sac.warmup_transitions=300",
          "--learner.algo.sac.critic_warmup_updates=300", "--learner.algo.sac.utd=2",
          "--learner.algo.sac.actor_lr=3e-4", "--eval.episodes=0", "--checkpoint.every=100000", "--progress=false",
          "--steps=100000")


def miscalibrated(folder: str, out: Path, dim: int = 2, fraction: float = 0.5) -> Path:
    """A copy of a policy folder whose actions come out shifted by `fraction` of dimension `dim`'s quantile
    half-range (the policy un-normalises with policy.json's q01/q99): a constant bias of the executed
    actions, which a residual of bound > `fraction` can cancel."""
    shutil.copytree(folder, out)
    meta = json.loads((out / "policy.json").read_text())
    assert meta["normalization"] == "quantile", meta["normalization"]
    action = meta["stats"]["action"]
    shift = fraction * (action["q99"][dim] - action["q01"][dim]) / 2
    for q in ("q01", "q99"):
        action[q][dim] += shift
    (out / "policy.json").write_text(json.dumps(meta))
    return out


@pytest.fixture(scope="module")
def weak_start(tmp_path_factory):
    from kilovla.demo import DENSE_MODEL, FULL, build_demo_cache, collect_demonstrations, train_policy

    root = tmp_path_factory.mktemp("canary")
    # the dense action expert the canary was calibrated on (the demo's is MoE since stop 54)
    recipe = FULL.replace(tasks=("reach-v3",), episodes_per_task=20, train_steps=500, ema_decay=None, model=DENSE_MODEL,
                          token_budget=4096)  # and the rows it was calibrated on (the demo's: one per step since stop 56)
    collect_demonstrations(recipe, root / "data")
    build_demo_cache(root / "data")
    good = train_policy(recipe, root / "data", root / "run", progress=False)["checkpoint"]
    return miscalibrated(good, root / "weak")


@pytest.fixture(scope="module")
def local_ray():
    import ray

    ray.init(address="local", num_cpus=2, include_dashboard=False, logging_level="ERROR")  # never another test's
    yield
    ray.shutdown()


def _success(folder) -> tuple[int, tuple[float, float]]:
    from kilovla.eval.closed_loop import evaluate, load_policy
    from kilovla.eval.intervals import wilson_interval
    from kilovla.eval.settings import EvalSettings

    torch.manual_seed(0)  # the base's noise: the same draws for every policy evaluated
    report = evaluate(load_policy(str(folder)), EvalSettings(tasks=["reach-v3"], episodes=EPISODES, batch_size=10, seed=1,
                                                             resolution=32, max_steps=HORIZON, workers=2))
    won = round(report["overall_success_rate"] * EPISODES)
    return won, wilson_interval(won, EPISODES)


def _actions_on_evaluation_starts(folder) -> list:
    """The folder's action chunks for the evaluation's first 10 initial observations, in batches of 1 to 10, with
    the same flow noise (torch seeded) for every folder."""
    from kilovla.envs.base import make_env
    from kilovla.envs.rollout import stack_observations
    from kilovla.eval.closed_loop import episode_seeds, load_policy

    policy = load_policy(str(folder))
    env = make_env("metaworld", task="reach-v3", cameras=("scene", "wrist"), resolution=32, max_steps=HORIZON)
    try:
        starts = [env.reset(seed=s)[0] for s in episode_seeds(1, 0, 10)]
    finally:
        env.close()
    torch.manual_seed(0)
    return [policy.select_action(stack_observations(starts[:n], ["reach-v3"] * n)) for n in range(1, 11)]


def _rl(policy, run_dir, env_steps, *extra) -> dict:
    from kilovla.rl import runner

    return runner.run(runner.load(None, [f"--run_dir={run_dir}", f"--policy={policy}", *CANARY,
                                         f"--max_env_steps={env_steps}", *extra]))


@pytest.mark.timeout(1800)  # ~5 minutes here; CI machines may be 2x slower
def test_canary_residual_sac_lifts_a_miscalibrated_reach_policy_and_not_at_lr_0(weak_start, local_ray, tmp_path):
    before, before_ci = _success(weak_start)
    assert before < 0.6 * EPISODES, f"the miscalibrated start is not weak: {before}/{EPISODES}"
    learned = _rl(weak_start, tmp_path / "lr", 12_000)
    after, after_ci = _success(learned["checkpoint"])
    assert after_ci[0] > before_ci[1], f"{before}/{EPISODES} {before_ci} -> {after}/{EPISODES} {after_ci}"
    assert after >= 0.8 * EPISODES, f"{before} -> {after}: a learner without the reward still gains ~20 points"
    # lr 0: the residual stays the identity through training, saving and loading: the loaded folder acts as
    # the start, exactly. Closed loop, the same folder has scored 13 and 14 of 50 against the start's 13, and 13
    # against 15 under pytest-xdist (one thread), while every action below was equal (an open finding), so the
    # exact check is on the actions and the closed loop is held to the start's 95 % interval.
    frozen = _rl(weak_start, tmp_path / "lr0", 3_000, "--learner.algo.sac.actor_lr=0")
    for start, kept in zip(_actions_on_evaluation_starts(weak_start), _actions_on_evaluation_starts(frozen["checkpoint"])):
        assert np.array_equal(start, kept), float(np.abs(start - kept).max())
    frozen_won = _success(frozen["checkpoint"])[0]
    assert before_ci[0] <= frozen_won / EPISODES <= before_ci[1], (frozen_won, before, before_ci)
