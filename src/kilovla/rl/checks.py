"""What `kilovla rl` checks before Ray starts, each a one-line KilovlaError (or one warning): the run's
config (`check_config`; each algorithm's own settings are its `check_config`, rl/algorithms.py), the policy
against the env (`check_policy_fits_env`) and the algorithm (`fit_algorithm`), a checkpoint against the
run resuming it (`check_resume_fits`), and an off-policy warm-up the run cannot reach
(`warn_if_warmup_unreachable`, from `transition_budget`).
"""

from __future__ import annotations

import logging
import math
from pathlib import Path

from kilovla.envs.base import env_type
from kilovla.envs.seeds import rl_train_seed
from kilovla.errors import KilovlaError
from kilovla.policy_folder import Interface, PolicyFolder
from kilovla.rl.algorithms import algorithm
from kilovla.rl.config import RLConfig

log = logging.getLogger(__name__)


def check_config(cfg: RLConfig) -> None:
    """Everything about the config that can be wrong, before Ray starts: one line each."""
    if cfg.mode not in ("sync", "async"):
        raise KilovlaError(f"mode must be sync or async, not {cfg.mode!r}")
    if cfg.weight_sync not in ("auto", "object_store", "collective"):
        raise KilovlaError(f"weight_sync must be auto, object_store or collective, not {cfg.weight_sync!r}")
    for name, value, least in (("env.workers", cfg.env.workers, 1), ("env.envs_per_worker", cfg.env.envs_per_worker, 1),
                               ("learner.batch_segments", cfg.learner.batch_segments, 1),
                               ("rollout.segment_steps", cfg.rollout.segment_steps, 1),
                               ("learner.max_staleness", cfg.learner.max_staleness, 0), ("learner.ranks", cfg.learner.ranks, 1),
                               ("learner.algo.kl_coef", cfg.learner.algo.kl_coef, 0)):
        if value < least:
            raise KilovlaError(f"{name} must be >= {least}, got {value}")
    algo = cfg.learner.algo
    algorithm(algo.name).check_config(cfg)
    if algo.policy_loss not in ("ppo", "awr"):
        raise KilovlaError(f"learner.algo.policy_loss must be ppo or awr, not {algo.policy_loss!r}")
    if not (math.isfinite(algo.kl_coef) and math.isfinite(algo.awr_temperature) and math.isfinite(algo.awr_max_weight)):
        raise KilovlaError(f"learner.algo.kl_coef, awr_temperature and awr_max_weight must be finite, got "
                           f"{algo.kl_coef}, {algo.awr_temperature} and {algo.awr_max_weight}")
    if algo.awr_temperature <= 0 or algo.awr_max_weight < 1:
        raise KilovlaError(f"learner.algo.awr_temperature must be > 0 and awr_max_weight >= 1, got "
                           f"{algo.awr_temperature} and {algo.awr_max_weight}")
    if cfg.env.envs_per_worker > 100:  # the seed scheme gives each env slot 10_000 seeds inside a worker's 1_000_000
        raise KilovlaError(f"env.envs_per_worker must be <= 100, got {cfg.env.envs_per_worker}")
    rl_train_seed(cfg.seed, cfg.env.workers - 1, cfg.env.envs_per_worker - 1)  # seed and workers fit the seed rule
    n_envs = cfg.env.workers * cfg.env.envs_per_worker
    if cfg.mode == "sync" and cfg.learner.batch_segments % n_envs:
        raise KilovlaError(f"sync mode steps every env together: learner.batch_segments ({cfg.learner.batch_segments}) "
                           f"must be a multiple of the number of envs ({n_envs})")
    if cfg.learner.batch_segments % cfg.learner.ranks:
        raise KilovlaError(f"learner.batch_segments ({cfg.learner.batch_segments}) must split evenly over "
                           f"{cfg.learner.ranks} learner ranks")
    if cfg.env.shaping not in ("reward", "progress"):
        raise KilovlaError(f"env.shaping must be reward or progress, not {cfg.env.shaping!r}")
    if cfg.env.shaping == "reward":
        _warn_if_a_miss_outscores_a_success(cfg)


def _warn_if_a_miss_outscores_a_success(cfg: RLConfig) -> None:
    """env.shaping=reward: one warning when a full episode of the env's largest shaped reward
    (`EnvType.max_reward`; an env without one is not checked) reaches the success bonus."""
    top = env_type(cfg.env.env).max_reward
    if top is not None and cfg.env.max_steps * top * cfg.env.reward_scale >= cfg.env.success_bonus:
        log.warning("env.reward_scale %g: a full episode's shaped reward (up to %g) can exceed the success bonus %g, "
                    "so a near miss may pay more than a success", cfg.env.reward_scale,
                    cfg.env.max_steps * top * cfg.env.reward_scale, cfg.env.success_bonus)


def check_policy_fits_env(cfg: RLConfig, declared: Interface) -> None:
    """The training tasks exist and the policy's action, state and cameras fit the env (from policy.json):
    the env's own check (`EnvType.check_fits`), the one every evaluation makes."""
    if not cfg.env.tasks:
        raise KilovlaError("env.tasks is empty: name the tasks to train on")
    env_type(cfg.env.env).check_fits(declared, cfg.env.tasks, cameras=tuple(cfg.env.cameras),
                                     max_steps=cfg.env.max_steps)


def fit_algorithm(cfg: RLConfig, source: PolicyFolder, n_action_steps: int, folder: Path | None,
                   state: dict) -> RLConfig:
    """The start (or resumed) folder fits the run's algorithm: a residual folder trains on only with an
    algorithm that trains residuals (one that trains the VLA would drop it); the rest is the algorithm's."""
    chosen = algorithm(cfg.learner.algo.name)
    if source.meta.residual and not chosen.trains_residual:
        raise KilovlaError(f"{source.path}: holds a residual actor (residual SAC); learner.algo.name={chosen.name} "
                           f"trains the VLA itself and would drop it: continue with residual_sac, or start from the "
                           f"supervised folder it began with")
    return chosen.fit_start(cfg, source, n_action_steps, folder, state)


def check_resume_fits(cfg: RLConfig, folder: Path, state: dict) -> None:
    """A checkpoint resumes with the algorithm it was written with and what that algorithm needs of it (one
    line, before Ray): another learner would find other state."""
    written = state.get("algorithm") or ("residual_sac" if "log_alpha" in state else "ppo")
    if written != cfg.learner.algo.name:
        raise KilovlaError(f"{folder}/learner.pt: written by learner.algo.name={written}; resume it with that, or "
                           f"start a new run_dir from the folder with --policy.path")
    algorithm(written).check_resume(cfg, folder, state)


def transition_budget(cfg: RLConfig, n_action_steps: int, version: int = 0, env_steps: int = 0) -> int:
    """Chunk transitions this run stores from policy `version` on: each version is `batch_segments` segments
    of `segment_steps` transitions, up to `steps`, or fewer where `max_env_steps` ends the run first (at
    `n_action_steps` env steps per transition; an episode that ends inside a chunk stores a little more).

    e.g. --steps=4 --learner.batch_segments=4 --rollout.segment_steps=3: 4 x 4 x 3 = 48 transitions;
    with --max_env_steps=100 and 5 actions per chunk (60 env steps a version), 2 versions pass it: 24.
    """
    per_version = cfg.learner.batch_segments * cfg.rollout.segment_steps
    versions = max(0, cfg.steps - version)
    if cfg.max_env_steps > 0:
        left = max(0, cfg.max_env_steps - env_steps)
        versions = min(versions, math.ceil(left / (per_version * n_action_steps)))
    return versions * per_version


def warn_if_warmup_unreachable(cfg: RLConfig, n_action_steps: int, version: int = 0, env_steps: int = 0,
                               stored: int = 0) -> bool:
    """One warning, before Ray starts, when the off-policy learner cannot reach its warm-up in this run (the
    replay's `stored` transitions plus `transition_budget`): it would end with 0 updates. True if it warned."""
    setting = algorithm(cfg.learner.algo.name).warmup(cfg.learner.algo)
    if setting is None:
        return False
    flag, warmup = setting
    budget = transition_budget(cfg, n_action_steps, version, env_steps)
    if stored + budget >= warmup:
        return False
    how = (f"--steps={cfg.steps}" + (f" from version {version}" if version else "")
           + f" x learner.batch_segments={cfg.learner.batch_segments}"
           + f" x rollout.segment_steps={cfg.rollout.segment_steps}"
           + (f", max_env_steps={cfg.max_env_steps}" if cfg.max_env_steps > 0 else ""))
    log.warning("%s=%d cannot be reached: this run stores at most %d transitions (%s)%s, so the learner will make "
                "0 updates and the policy will not change; lower the warm-up or raise --steps", flag, warmup, budget,
                how, f" on top of the {stored} already stored" if stored else "")
    return True
