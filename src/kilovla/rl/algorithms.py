"""The RL algorithms `learner.algo.name` picks from; each module owns one, as a subclass of `Algorithm`:

    name          module             trains                                 checkpoint weights (+ replay)
    ppo           rl/ppo.py          the VLA and a value head (PPO or AWR)  model, value_head
    residual_sac  rl/sac.py          a residual actor and twin critics      residual, critic, replay
                                     over the frozen VLA
    filtered_bc   rl/filtered_bc.py  the VLA, on its own successes          model, value_head, replay

The runner asks the algorithm of a run (`algorithm(cfg.learner.algo.name)`) to check its settings and the
folder it starts or resumes from, for its warm-up, its agent (what the inference server acts with) and its
learner; env workers, the batcher, the buffer, weight sync and checkpoints are the same for all. A fourth
algorithm: a module with its config dataclass (nested in rl/config.py's `AlgoConfig`), its learner and an
`Algorithm` subclass, and one line in `registry` below.
"""

from __future__ import annotations

import abc
import functools
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from kilovla.errors import KilovlaError

if TYPE_CHECKING:
    from torch import nn

    from kilovla.policy_folder import PolicyFolder
    from kilovla.rl.compute import ComputeSection
    from kilovla.rl.config import AlgoConfig, RLConfig
    from kilovla.rl.core.flow import FlowSDE
    from kilovla.train.distributed import World


@dataclass(frozen=True)
class LearnerRun:
    """What a learner is built with besides its model: the run's settings and where it began."""

    algo: AlgoConfig
    segments_per_step: int  # learner.batch_segments: a policy version
    segment_steps: int
    total_steps: int  # the run's policy versions (the learning-rate schedule's length)
    compute: ComputeSection | None
    started_from: str  # the policy folder the run began with (PPO's KL reference)
    seed: int


class Algorithm(abc.ABC):
    """One RL algorithm: the checks before Ray, the model it acts with and the learner that trains it.
    The abstract hooks are what every algorithm must say; the others have defaults."""

    name: str
    trains_residual = False  # trains on from a folder that holds a residual actor (others would drop it)
    checkpoint_files: tuple[str, ...]  # the CHECKPOINT_FILES (policy_folder.py) its learner's weights go to

    @abc.abstractmethod
    def check_config(self, cfg: RLConfig) -> None:
        """Its settings, one line each, before Ray starts."""

    def fit_start(self, cfg: RLConfig, source: PolicyFolder, n_action_steps: int, folder: Path | None,
                  state: dict) -> RLConfig:
        """The folder the run starts from (`folder`: the checkpoint it resumes, with its rl_state.json
        `state`) fits this algorithm; returns the config with what the folder fixes. By default: as given."""
        return cfg

    def check_resume(self, cfg: RLConfig, folder: Path, learner_state: dict) -> None:
        """The checkpoint's learner.pt (and the files beside it) resumes this algorithm. By default: nothing to check."""

    def warmup(self, algo: AlgoConfig) -> tuple[str, int] | None:
        """(its flag, transitions stored before the first update); None (the default): every version updates."""
        return None

    @abc.abstractmethod
    def load_agent(self, policy_dir: str, algo: AlgoConfig, sde: FlowSDE, n_action_steps: int,
                   privileged: tuple) -> nn.Module:
        """The model the inference server acts with and the learner trains."""

    @abc.abstractmethod
    def learner(self, model: nn.Module, run: LearnerRun, world: World):
        """Its learner: `consume(segments) -> stats | None`, `weights()`, `state_dict()`, `load_state_dict()`."""


@functools.cache
def registry() -> dict[str, Algorithm]:
    from kilovla.rl.filtered_bc import FilteredBC
    from kilovla.rl.ppo import PPO
    from kilovla.rl.sac import ResidualSAC

    return {a.name: a for a in (PPO(), ResidualSAC(), FilteredBC())}


def algorithm(name: str) -> Algorithm:
    """The algorithm of `learner.algo.name`; an unknown name in one line."""
    known = registry()
    if name not in known:
        raise KilovlaError(f"learner.algo.name must be one of {', '.join(known)}, not {name!r}")
    return known[name]
