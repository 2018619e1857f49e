"""The compute model of an RL run: `compute.model: real | calibrated`, and the timing of its sleeps.

On a cluster the policy's inference and training run on accelerators, not on the CPUs that step the
envs. On a CPU-only box they share the cores with the envs, and both sync and async runs become
compute-bound at the same rate, so the schedule (what RL-VLA3 changes) cannot show. With
`compute.model: calibrated` the inference server and the learner keep everything but the model's
arithmetic: the server sleeps t(B) = infer_base_s + infer_per_sample_s x B per batch; the learner
sleeps, per micro-batch of n samples, learn_base_s + learn_per_sample_s x n (forward + backward),
per segment `learn_bootstrap_s` (the critic's bootstrap value) and per global batch `learn_step_s`
(the optimizer step). `time.sleep` releases the GIL and the core, as compute on another device would.

This module holds the section and the sleep; `calibrated.py` measures the numbers (it times the real
learner, so it sits above it) and stands in for the model's acting.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

from kilovla.errors import KilovlaError

MODELS = ("real", "calibrated")


@dataclass
class ComputeSection:
    model: str = "real"  # real | calibrated (sleeps fitted to a measured step; see the module docstring)
    infer_base_s: float = 0.0  # inference of a batch of B: infer_base_s + infer_per_sample_s * B
    infer_per_sample_s: float = 0.0
    learn_base_s: float = 0.0  # forward + backward of a micro-batch of n: learn_base_s + learn_per_sample_s * n
    learn_per_sample_s: float = 0.0
    learn_bootstrap_s: float = 0.0  # the critic's value after each segment (GAE's bootstrap)
    learn_step_s: float = 0.0  # clip + optimizer step, once per global batch

    def __post_init__(self):
        if self.model not in MODELS:
            raise KilovlaError(f"compute.model must be one of {MODELS}, not {self.model!r}")
        times = {k: v for k, v in vars(self).items() if k != "model"}
        if not all(isinstance(v, (int, float)) and math.isfinite(v) and v >= 0 for v in times.values()):
            raise KilovlaError(f"compute times must be finite numbers >= 0: {times}")
        given = [k for k, v in times.items() if v]
        if self.model == "real" and given:
            raise KilovlaError(f"compute.model is real, so {', '.join(given)} would be ignored: set compute.model="
                               "calibrated, or leave the times out")
        if self.calibrated and given and not self.fitted:
            raise KilovlaError(f"compute.model calibrated with only {', '.join(given)}: give the inference and learner "
                               "times together (infer_base_s / infer_per_sample_s and learn_base_s / learn_per_sample_s), "
                               "or none to measure them")

    @property
    def calibrated(self) -> bool:
        return self.model == "calibrated"

    @property
    def fitted(self) -> bool:
        return self.infer_base_s + self.infer_per_sample_s > 0 and self.learn_base_s + self.learn_per_sample_s > 0

    def inference_s(self, batch: int) -> float:
        return self.infer_base_s + self.infer_per_sample_s * batch

    def learn_s(self, samples: int) -> float:
        return self.learn_base_s + self.learn_per_sample_s * samples

    def describe(self) -> str:
        """One line for notes and logs."""
        return (f"calibrated sleeps from a measured step: inference {self.infer_base_s * 1e3:.1f} + "
                f"{self.infer_per_sample_s * 1e3:.2f}*B ms, learner {self.learn_base_s * 1e3:.1f} + "
                f"{self.learn_per_sample_s * 1e3:.2f}*n ms per micro-batch, {self.learn_bootstrap_s * 1e3:.1f} ms "
                f"per segment, {self.learn_step_s * 1e3:.1f} ms per optimizer step")


def sleep_until(t0: float, seconds: float) -> None:
    """Sleep so that `seconds` have passed since `t0` (what the stand-in itself took counts)."""
    left = t0 + seconds - time.monotonic()
    if left > 0:
        time.sleep(left)
