"""`kilovla rl`'s config: one section per part of a run (YAML keys and dotted flags, e.g.
`--learner.algo.sac.utd=2`). `learner.algo.name` picks the algorithm (rl/algorithms.py); PPO's settings
sit in `learner.algo` itself, residual SAC's in `learner.algo.sac`, filtered BC's in
`learner.algo.filtered_bc`; the checks of each live with its algorithm, the run's in rl/checks.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kilovla import config as config_mod
from kilovla.eval.settings import EvalSettings
from kilovla.rl.compute import ComputeSection
from kilovla.rl.filtered_bc import FilteredBCConfig
from kilovla.rl.sac import SACConfig
from kilovla.train.optim import OptimConfig


@dataclass
class AlgoConfig:
    # "ppo": the on-policy family below (decoupled PPO, or AWR with policy_loss awr), which trains the VLA
    # itself; "residual_sac": off-policy SAC of a bounded residual over the frozen VLA (rl/sac.py);
    # "filtered_bc": the VLA's flow-matching loss on a replay of its own successful episodes
    # (rl/filtered_bc.py; it trains with `optim` and the freeze flags below). residual_sac is the default:
    # it gained +23 points on reach + push (docs/rl_finetune.md); the others did not.
    name: str = "residual_sac"  # the one that gained here (docs/rl_finetune.md, kilovla bench rl's gain rows)
    sac: SACConfig = field(default_factory=SACConfig)
    filtered_bc: FilteredBCConfig = field(default_factory=FilteredBCConfig)
    gamma: float = 0.99
    lam: float = 0.95
    clip: float = 0.2
    behav_cap: float = 2.0  # decoupled PPO: samples whose behaviour weight exceeds this are masked
    value_coef: float = 0.5
    value_clip: float = 10.0
    value_lr: float = 1e-3
    # A penalty on the KL of the stochastic transitions from the policy the run began with (Flow-GRPO's
    # ||mean - mean_ref||^2 / (2 std^2)), per sample: it pulls back what the noise of small batches moves
    # without a consistent advantage. 0 (RLinf's default): no reference model is kept.
    kl_coef: float = 0.0
    # "ppo": decoupled PPO on the chains' log-probs. "awr": advantage-weighted regression on the executed
    # chunks' flow-matching error: the supervised loss tilted toward better-than-expected actions, no
    # score-function noise (the drift of docs/rl_finetune.md).
    policy_loss: str = "ppo"
    awr_temperature: float = 1.0
    awr_max_weight: float = 20.0
    normalize_advantages: bool = True  # divide by the running RMS of past global batches' advantages
    advantage_rms_momentum: float = 0.9  # EMA of the per-batch mean square (bias-corrected)
    micro_batch: int = 32  # samples per forward/backward on a learner rank
    freeze_vision: bool = True
    freeze_vlm: bool = True  # piRL trains the action expert (and projections) only
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-4, warmup_steps=0, min_lr_ratio=1.0,
                                                                     weight_decay=0.0))


@dataclass
class EnvSection:
    env: str = "metaworld"
    tasks: list[str] = field(default_factory=lambda: ["reach-v3", "push-v3"])
    workers: int = 2
    envs_per_worker: int = 8
    resolution: int | None = None  # None: the policy's training resolution (policy.json image_size)
    cameras: list[str] = field(default_factory=lambda: ["scene", "wrist"])
    max_steps: int = 150
    latency: dict = field(default_factory=dict)  # LatencyModel fields, e.g. {distribution: lognormal, mean_s: 0.02}
    # RL reward per action: reward_scale x the shaped part (summed over a chunk's actions) plus success_bonus
    # on success. `shaping` "progress" (the default; the gain recipe's): the change of the simulator's shaped
    # reward since the previous action (a difference, undiscounted: an episode's shaping sums to reward_scale
    # x (last reward - first), at most 1.0 here, so getting closer pays and hovering near the goal pays
    # nothing more). "reward": the simulator's shaped reward itself; then keep max_steps x the env's largest
    # reward (EnvType.max_reward; Meta-World's 10) x reward_scale below success_bonus (e.g. 150 x 10 x 2e-4 =
    # 0.3 < 1.0), or a near miss that hovers by the goal until the time limit outscores a success (`kilovla rl` warns).
    shaping: str = "progress"
    reward_scale: float = 0.1
    success_bonus: float = 1.0
    timeout_s: float = 60.0  # an env step (or a worker) that takes longer is a hang: the worker is replaced


@dataclass
class RolloutSection:
    segment_steps: int = 8  # policy steps per segment
    n_action_steps: int | None = None  # actions executed per chunk (default: the policy's)
    max_batch_size: int = 16  # dynamic batcher: B_max
    max_wait_s: float = 0.0  # and T_max (0: run as soon as the model is free, with whatever is queued)
    sde_steps: int | None = None  # denoising steps while acting (default: the model's)
    noise_level: float = 0.5
    stochastic: str = "one"


@dataclass
class LearnerSection:
    batch_segments: int = 16  # segments per optimizer step (a global batch)
    max_staleness: int = 0
    ranks: int = 1  # learner processes (DDP)
    algo: AlgoConfig = field(default_factory=AlgoConfig)


@dataclass
class CheckpointSection:
    every: int = 10
    keep: int = 3


@dataclass
class EvalSection:
    episodes: int = 10  # per task; 0: no final evaluation
    tasks: list[str] = field(default_factory=list)  # default: the training tasks
    batch_size: int = 10

    def settings(self, env: EnvSection, seed: int) -> EvalSettings:
        """The final evaluation: these episodes on the run's env, its cameras, step limit and resolution
        (None: the policy's), with the run's seed."""
        return EvalSettings(env=env.env, tasks=self.tasks or env.tasks, episodes=self.episodes, seed=seed,
                            batch_size=self.batch_size, cameras=env.cameras, resolution=env.resolution,
                            max_steps=env.max_steps)


@dataclass
class RLConfig:
    run_dir: str = "runs/rl"
    policy: str = ""  # a policy folder: a supervised checkpoint (or an RL one)
    mode: str = "async"
    seed: int = 0
    steps: int = 50  # optimizer steps (policy versions)
    max_env_steps: int = 0  # > 0: also end at the first policy version past this many env steps
    env: EnvSection = field(default_factory=EnvSection)
    rollout: RolloutSection = field(default_factory=RolloutSection)
    learner: LearnerSection = field(default_factory=LearnerSection)
    checkpoint: CheckpointSection = field(default_factory=CheckpointSection)
    eval: EvalSection = field(default_factory=EvalSection)
    compute: ComputeSection = field(default_factory=ComputeSection)  # real, or calibrated sleeps (calibrated.py)
    weight_sync: str = "auto"  # object_store, collective (NCCL on GPUs, gloo on CPU), auto: collective on CUDA
    weight_sync_timeout_s: float = 120.0
    inference_threads: int = 1
    learner_threads: int = 1
    progress: bool = True


def load(path: str | None, overrides: list[str]) -> RLConfig:
    return config_mod.load_config(RLConfig, path, overrides)
