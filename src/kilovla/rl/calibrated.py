"""Calibrated model compute of an RL run (`compute.model: calibrated`, the section in `compute.py`).

On a cluster the policy's inference and training run on accelerators, not on the CPUs that step the
envs. On a CPU-only box they share the cores with the envs, and both sync and async runs become
compute-bound at the same rate, so the schedule (what RL-VLA3 changes) cannot show. With
`compute.model: calibrated` the inference server and the learner keep everything but the model's
arithmetic: the server sleeps t(B) = infer_base_s + infer_per_sample_s x B per batch and answers
with stand-in actions of the right shapes; the learner sleeps, per micro-batch of n samples,
learn_base_s + learn_per_sample_s x n (forward + backward), per segment `learn_bootstrap_s` (the
critic's bootstrap value) and per global batch `learn_step_s` (the optimizer step), while its
batching, version bump and weight publication stay real. `time.sleep` releases the GIL and the core,
as compute on another device would.

- `real` (default): the model runs. What `kilovla rl` trains with; the full `kilovla bench rl`.
- `calibrated`: throughput measurements of the schedule only (`kilovla bench rl --quick`); the policy
  does not learn (its weights never change). The numbers come from `calibrate`, which times the real
  policy once, in-process, on real env observations; a config with `calibrated` and no numbers is
  calibrated by `kilovla rl` before the run starts.
"""

from __future__ import annotations

import logging
import statistics
import time
import timeit

import numpy as np
import torch

from kilovla.rl.compute import ComputeSection, sleep_until
from kilovla.rl.core import trajectory
from kilovla.rl.ppo import Learner
from kilovla.rl.policy import frozen_policy, load_actor_critic

log = logging.getLogger(__name__)


def stand_in_act(model, batch: int, generator: torch.Generator) -> dict[str, np.ndarray]:
    """What `ActorCritic.act` returns, of the same shapes, without running the model: a chain of Gaussian
    noise (its last step, unnormalized, is the executed chunk: random exploration), seeded stochastic
    steps, log-prob and value 0."""
    horizon, width = model.horizon, model.vla.config.max_action_dim
    chain = torch.randn(batch, model.sde.steps + 1, horizon, width, generator=generator)
    stochastic = model.sde.stochastic_steps(batch, generator, "cpu")
    actions = model.processor.unnormalize_actions(chain[:, -1, : model.n_action_steps].clamp(-1, 1).numpy())
    return {"actions": actions, "chain": chain.numpy(), "stochastic": stochastic.numpy(),
            "logp": np.zeros(batch, np.float32), "value": np.zeros(batch, np.float32)}


def act(model, compute: ComputeSection | None, observations: list[dict], generator: torch.Generator) -> dict:
    """A batch of acting, as the inference server runs it: the model's `act` on the stacked observations,
    or, with calibrated compute, `stand_in_act` taking t(B) of wall time in all (a sleep: the core is free)."""
    if compute is None or not compute.calibrated:
        return model.act(trajectory.stack(observations), generator)
    t0 = time.monotonic()
    out = stand_in_act(model, len(observations), generator)
    sleep_until(t0, compute.inference_s(len(observations)))
    return out


def _median_time(fn, repeats: int) -> float:
    return statistics.median(timeit.repeat(fn, number=1, repeat=repeats))


def _fit_line(xs: list[int], ys: list[float]) -> tuple[float, float]:
    """Least-squares intercept and slope, each at least 0 (more work never takes less time)."""
    slope, intercept = np.polyfit(np.asarray(xs, float), np.asarray(ys, float), 1)
    return max(0.0, float(intercept)), max(0.0, float(slope))


def calibrate(policy_dir: str, sde, n_action_steps: int, obs: dict, algo, *, batch_sizes=(1, 8, 24),
              micro_batches=(4, 32), threads: int = 1, repeats: int = 3) -> ComputeSection:
    """Time the real policy in this process (torch on `threads` threads, as the roles run it) on copies of
    the env observation `obs`: `act` at each of `batch_sizes`, the learner's forward + backward at each of
    `micro_batches`, one bootstrap value and one optimizer step; fit the lines of `ComputeSection`."""

    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        torch.manual_seed(0)
        model = load_actor_critic(policy_dir, sde, n_action_steps).eval()
        generator = torch.Generator().manual_seed(0)
        infer = []
        for b in batch_sizes:
            batch = trajectory.stack([obs] * b)
            model.act(batch, generator)  # warm-up: first calls allocate
            infer.append(_median_time(lambda: model.act(batch, generator), repeats))
        most = max(micro_batches)
        acted = model.act(trajectory.stack([obs] * most), generator)
        data = {"obs": trajectory.stack([obs] * most), "chain": acted["chain"], "stochastic": acted["stochastic"],
                "logp": acted["logp"], "value": acted["value"], "adv": np.ones(most, np.float32),
                "ret": np.ones(most, np.float32), "seed": np.arange(most)}
        # a KL penalty costs the learner one more (gradient-free) forward per micro-batch
        reference = frozen_policy(policy_dir) if algo.kl_coef > 0 else None
        learner = Learner(model, algo, segments_per_step=1, segment_steps=1 << 20, total_steps=1 << 20,
                          reference=reference)
        learn = []
        for n in micro_batches:
            rows = np.arange(n)

            def forward_backward():
                loss, _ = learner._loss(data, rows, 1.0)
                loss.backward()

            forward_backward()
            learn.append(_median_time(forward_backward, repeats))
        learner.optimizer.step()  # warm-up: creates the optimizer's state
        step = _median_time(lambda: (learner.optimizer.step(), learner.scheduler.step()), repeats)
        learner.optimizer.zero_grad(set_to_none=True)
        one = trajectory.stack([obs])
        model.value(one)
        bootstrap = _median_time(lambda: model.value(one), repeats)
    finally:
        torch.set_num_threads(previous)
    infer_base, infer_slope = _fit_line(list(batch_sizes), infer)
    learn_base, learn_slope = _fit_line(list(micro_batches), learn)
    fitted = ComputeSection("calibrated", infer_base, infer_slope, learn_base, learn_slope, bootstrap, step)
    log.info("model compute: %s (measured: inference %s, learner %s)", fitted.describe(),
             {b: round(t, 4) for b, t in zip(batch_sizes, infer)}, {n: round(t, 4) for n, t in zip(micro_batches, learn)})
    return fitted


def env_observation(env_section, seed: int = 0) -> dict:
    """One real observation of the run's first task (for `calibrate`): what the policy sees when acting."""
    from kilovla.envs.vector import EnvConfig

    env = EnvConfig(env_section.env, {"task": env_section.tasks[0], "resolution": env_section.resolution,
                                      "cameras": tuple(env_section.cameras), "max_steps": env_section.max_steps}).build()
    try:
        return env.reset(seed=seed)[0]
    finally:
        env.close()
