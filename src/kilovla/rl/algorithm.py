"""What every RL algorithm answers (`Algorithm`) and what its learner is built from (`LearnerRun`); the
algorithms themselves (rl/ppo.py, rl/sac.py, rl/filtered_bc.py) subclass it and rl/algorithms.py lists them.
They see the run's config as a `RunConfig`: rl/config.py's `RLConfig` composes their own config dataclasses,
so they never import it (the dependency runs one way: config -> algorithm)."""


from __future__ import annotations

import abc
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, TypeVar


if TYPE_CHECKING:
    from torch import nn

    from kilovla.policy_folder import PolicyFolder
    from kilovla.rl.compute import ComputeSection
    from kilovla.rl.core.flow import FlowSDE
    from kilovla.train.distributed import World


class RunConfig(Protocol):
    """The run's config (rl/config.py's `RLConfig`) as an algorithm reads it. `learner.algo` is the
    `AlgoConfig`: PPO's fields, `sac` and `filtered_bc`; the algorithms also read `learner.ranks`,
    `env.workers`, `env.envs_per_worker` and `rollout.segment_steps`."""

    learner: Any
    env: Any
    rollout: Any
    compute: ComputeSection


Run = TypeVar("Run", bound=RunConfig)


@dataclass(frozen=True)
class LearnerRun:
    """What a learner is built with besides its model: the run's settings and where it began."""

    algo: Any  # the run's learner.algo (rl/config.py's AlgoConfig)
    segments_per_step: int  # learner.batch_segments: a policy version
    segment_steps: int
    total_steps: int  # the run's policy versions (the learning-rate schedule's length)
    compute: ComputeSection | None
    started_from: str  # the policy folder the run began with (PPO's KL reference)
    seed: int


class Algorithm(abc.ABC):
    """One RL algorithm: the checks before Ray, the model it acts with and the learner that trains it.
    The abstract hooks are what every algorithm must say; the others have defaults. `cfg` is the run's
    config, `algo` its `learner.algo`."""

    name: str
    trains_residual = False  # trains on from a folder that holds a residual actor (others would drop it)
    checkpoint_files: tuple[str, ...]  # the CHECKPOINT_FILES (policy_folder.py) its learner's weights go to

    @abc.abstractmethod
    def check_config(self, cfg: RunConfig) -> None:
        """Its settings, one line each, before Ray starts."""

    def fit_start(self, cfg: Run, source: PolicyFolder, n_action_steps: int, folder: Path | None,
                  state: dict) -> Run:
        """The folder the run starts from (`folder`: the checkpoint it resumes, with its rl_state.json
        `state`) fits this algorithm; returns the config with what the folder fixes. By default: as given."""
        return cfg

    def check_resume(self, cfg: RunConfig, folder: Path, learner_state: dict) -> None:
        """The checkpoint's learner.pt (and the files beside it) resumes this algorithm. By default: nothing to check."""

    def warmup(self, algo: Any) -> tuple[str, int] | None:
        """(its flag, transitions stored before the first update); None (the default): every version updates."""
        return None

    @abc.abstractmethod
    def load_agent(self, policy_dir: str, algo: Any, sde: FlowSDE, n_action_steps: int,
                   privileged: tuple) -> nn.Module:
        """The model the inference server acts with and the learner trains."""

    @abc.abstractmethod
    def learner(self, model: nn.Module, run: LearnerRun, world: World):
        """Its learner: `consume(segments) -> stats | None`, `weights()`, `state_dict()`, `load_state_dict()`."""
