"""Calibrated model compute (rl/calibrated.py) without Ray: the inference batch and the learner sleep the
fitted times instead of running the model, and everything around the model still acts."""

import time
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from kilovla.errors import KilovlaError
from kilovla.rl import calibrated
from kilovla.rl.compute import ComputeSection
from kilovla.rl.core.flow import FlowSDE

COMPUTE = ComputeSection("calibrated", infer_base_s=0.03, infer_per_sample_s=0.004, learn_base_s=0.01,
                         learn_per_sample_s=0.002, learn_bootstrap_s=0.005, learn_step_s=0.02)


class _NoModel(torch.nn.Module):
    """An actor-critic whose every model call fails: calibrated compute must never make one."""

    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(3))
        self.value_head = torch.nn.Linear(3, 1)
        self.horizon, self.n_action_steps = 6, 4
        self.sde = FlowSDE(steps=3)
        self.vla = SimpleNamespace(config=SimpleNamespace(max_action_dim=8))
        self.processor = SimpleNamespace(unnormalize_actions=lambda a: (a[..., :2] * 10.0).astype(np.float32))

    def act(self, *a, **k):
        raise AssertionError("the model acted")

    def value(self, *a, **k):
        raise AssertionError("the critic ran")

    def forward(self, *a, **k):
        raise AssertionError("the learner ran the model")


def test_a_calibrated_batch_sleeps_t_of_b_and_answers_with_actions_of_the_right_shapes():
    model = _NoModel()
    t0 = time.monotonic()
    out = calibrated.act(model, COMPUTE, [{}] * 5, torch.Generator().manual_seed(0))
    took = time.monotonic() - t0
    assert took >= 0.03 + 5 * 0.004  # the fitted time of a batch of 5, at least
    assert out["actions"].shape == (5, 4, 2) and np.abs(out["actions"]).max() <= 10.0  # unnormalized, in range
    assert out["chain"].shape == (5, 4, 6, 8) and out["stochastic"].shape == (5, 3)
    assert out["stochastic"].sum(1).tolist() == [1] * 5  # one stochastic step per chain, as the flow SDE samples
    assert out["logp"].shape == out["value"].shape == (5,)
    again = calibrated.act(model, COMPUTE, [{}] * 5, torch.Generator().manual_seed(0))
    np.testing.assert_array_equal(out["chain"], again["chain"])  # seeded: a rerun acts the same
    with pytest.raises(AssertionError, match="the model acted"):  # the real mode does run the model
        calibrated.act(model, ComputeSection(), [{}], torch.Generator())


def _segments(n, t_len, seed):
    from kilovla.rl.core.trajectory import Segment

    rng = np.random.default_rng(seed)
    return [Segment(segment_id=(0, 0, i, seed), ticket=i, start_version=0,
                    obs={"x": rng.normal(size=(t_len, 3)).astype(np.float32)},
                    chain=rng.normal(size=(t_len, 4, 6, 8)).astype(np.float32), stochastic=np.ones((t_len, 3), bool),
                    logp=np.zeros(t_len, np.float32), value=rng.normal(size=t_len).astype(np.float32),
                    reward=rng.random(t_len).astype(np.float32), done=np.zeros(t_len, bool),
                    truncated=np.zeros(t_len, bool), version=np.zeros(t_len, int),
                    next_obs={"x": rng.normal(size=3).astype(np.float32)}) for i in range(n)]


@pytest.mark.filterwarnings(r"ignore:Seems like `optimizer.step\(\)` has been overridden")
def test_a_calibrated_learner_sleeps_the_fitted_times_and_still_steps_once_per_global_batch():
    from kilovla.rl.config import AlgoConfig
    from kilovla.rl.ppo import Learner

    model = _NoModel()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    learner = Learner(model, AlgoConfig(freeze_vision=False, freeze_vlm=False, micro_batch=3), segments_per_step=4,
                      segment_steps=5, total_steps=10, compute=COMPUTE)
    steps, results = [], []
    step = learner.optimizer.step
    learner.optimizer.step = lambda *a, **k: (steps.append(1), step(*a, **k))[1]
    t0 = time.monotonic()
    for batch in range(2):
        segments = _segments(4, 5, seed=batch)
        results += [learner.consume(segments[:1]), learner.consume(segments[1:])]  # 5 + 15 samples: 2 + 5 micro-batches
    took = time.monotonic() - t0
    assert [r is not None for r in results] == [False, True, False, True]
    assert [r["version"] for r in results if r] == [1, 2] and learner.version == 2 and len(steps) == 2
    per_batch = 4 * COMPUTE.learn_bootstrap_s + 6 * COMPUTE.learn_s(3) + COMPUTE.learn_s(2) + COMPUTE.learn_step_s
    assert took >= 2 * per_batch
    assert results[1]["compute_sleep_s"] == pytest.approx((per_batch - 4 * COMPUTE.learn_bootstrap_s) / 7)
    assert results[1]["advantage_scale"] != results[3]["advantage_scale"] != 1.0  # GAE and its running scale still act
    for k, v in model.state_dict().items():  # no gradient, no change: the weights the server gets are the start's
        torch.testing.assert_close(v, before[k], rtol=0, atol=0)


def test_the_fit_recovers_a_line_and_times_never_go_negative():
    a, b = calibrated._fit_line([1, 8, 24], [0.02 + 0.003 * x for x in (1, 8, 24)])
    assert a == pytest.approx(0.02) and b == pytest.approx(0.003)
    assert calibrated._fit_line([1, 2], [0.5, 0.1]) == (pytest.approx(0.9), 0.0)
    assert calibrated._fit_line([1, 2], [0.1, 0.5]) == (0.0, pytest.approx(0.4))


def test_compute_config_is_checked():
    with pytest.raises(KilovlaError, match="compute.model must be one of"):
        ComputeSection("gpu")
    for bad in (-1.0, float("nan"), float("inf")):
        with pytest.raises(KilovlaError, match="compute times must be finite numbers >= 0"):
            ComputeSection("calibrated", infer_base_s=bad, infer_per_sample_s=1.0, learn_base_s=1.0)
    with pytest.raises(KilovlaError, match="compute.model is real, so infer_base_s would be ignored"):
        ComputeSection("real", infer_base_s=0.5)
    with pytest.raises(KilovlaError, match="calibrated with only learn_base_s: give the inference and learner"):
        ComputeSection("calibrated", learn_base_s=0.5)
    assert not ComputeSection("calibrated").fitted and COMPUTE.fitted
    assert COMPUTE.inference_s(10) == pytest.approx(0.07)
    assert "calibrated sleeps from a measured step: inference 30.0 + 4.00*B ms" in COMPUTE.describe()
