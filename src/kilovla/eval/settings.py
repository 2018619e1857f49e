"""`EvalSettings`: what a closed-loop evaluation runs, in one object every caller builds and `evaluate` takes.

    settings = EvalSettings(env="metaworld", tasks=["reach-v3"], episodes=10, seed=0)
    evaluate(policy, settings, out_dir="eval-output/x")

`kilovla eval` and `kilovla quantize` build it from their flags, the trainer's in-training evaluation
is a subclass (train/config.py `InTrainingEval`: the `eval:` section of a training config, its keys
these fields plus `every` and `timeout_s`), the demo from its recipe (`DemoRecipe.evaluation`), the
benches from their constants. None in `cameras`, `resolution`, `max_steps` and `n_action_steps`
means: the env's cameras and step limit, the policy's training resolution (`EnvType.render_resolution`),
the policy's actions per chunk.
"""

from __future__ import annotations

from dataclasses import dataclass

from kilovla.envs.base import EnvSpec, EnvType, env_type


@dataclass(frozen=True, kw_only=True)
class EvalSettings:
    env: str = "metaworld"  # a registered env (envs/base.py ENV_NAMES)
    tasks: tuple[str, ...]  # task names, as the env's `tasks` expands a --tasks value
    episodes: int  # per task
    seed: int = 0  # the eval stream's user seed (envs/seeds.py): the same seeds for every policy
    batch_size: int = 8  # envs per task stepped together, one policy batch
    workers: int = 0  # env processes (0: in the calling process)
    cameras: tuple[str, ...] | None = None  # None: the env's
    resolution: int | None = None  # None: the policy's training resolution (policy.json image_size)
    max_steps: int | None = None  # None: the env's (LIBERO: per suite)
    n_action_steps: int | None = None  # actions executed per predicted chunk; None: the policy's
    videos: int = 0  # mp4s of the first K episodes per task (with an output folder)
    allow_seen_seeds: bool = False  # evaluate even on seeds the policy's demonstrations started from

    def __post_init__(self):
        object.__setattr__(self, "tasks", tuple(self.tasks))
        if self.cameras is not None:
            object.__setattr__(self, "cameras", tuple(self.cameras))

    @property
    def env_type(self) -> EnvType:
        return env_type(self.env)

    def spec(self) -> EnvSpec:
        """The env's spec for the first task, with these cameras and step limit."""
        return self.env_type.spec(self.tasks[0] if self.tasks else "", cameras=self.cameras, max_steps=self.max_steps)

    def check_fits(self, policy) -> EnvSpec:
        """The tasks exist and `policy` (loaded, or a folder's `Interface`) fits the env's action, state and
        cameras; before any env is built. Returns the env's spec."""
        return self.env_type.check_fits(policy, self.tasks, cameras=self.cameras, max_steps=self.max_steps)
