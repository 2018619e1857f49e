"""`kilovla rl`: RL fine-tuning of a VLA policy folder, synchronous or fully asynchronous (RL-VLA3).

    kilovla rl --config rl.yaml --mode async --policy demo-output/run/checkpoints/step_001000
    kilovla rl --config rl.yaml --mode sync --resume auto
    ray start --head; kilovla rl --config rl.yaml --ray-address auto   # on a cluster

Both modes use the same workers, policy and algorithm (PPO with a value head and GAE, decoupled
when rollouts may be stale), and one optimizer step per global batch of `batch_segments` segments:

- ``sync`` (the honest baseline, RLinf's synchronous mode): every env steps in lock step (one
  batched inference over all envs, then every env executes its chunk, in parallel); after
  `segment_steps` steps the learner trains on the batch while the envs wait; then the weights go to
  the inference server.
- ``async`` (RL-VLA3): every env runs its own loop, the inference server batches whatever requests
  arrive (`DynamicBatcher`), the learner trains each segment as it arrives and steps once the batch
  is complete; rollout, inference and training overlap. `max_staleness` bounds how many versions a
  rollout may run ahead (0: one version per batch, RL-VLA3's per-step weight sync).

Env workers that crash or hang are replaced (their running segments are dropped and counted); a
weight sync that does not finish within `weight_sync_timeout_s` ends the run with one line; a
killed driver continues from its last checkpoint with `--resume`. Metrics per policy version go to
run_dir/metrics.jsonl; the final policy is evaluated closed loop with the trainer's `evaluate`.
run_dir/summary.json times the RL loop (`rl_wall_s`) and the whole call (`total_wall_s`: Ray's start, the
actors' creation and the final evaluation too); an off-policy learner that cannot reach its replay warm-up
is warned about before Ray starts, and one that ended with 0 updates in the run's last line.
`compute.model: calibrated` replaces the model's arithmetic with sleeps timed from the real policy
(calibrated.py): for throughput benchmarks of the schedule where the env CPUs would otherwise also
run the model.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import shutil
import time
from pathlib import Path

import numpy as np
import torch

from kilovla import config as config_mod
from kilovla.data.ray_cluster import connect_ray
from kilovla.envs.seeds import rl_train_seed
from kilovla.errors import KilovlaError
from kilovla.folders import RUN, claim_run_dir, clear, policy_folder
from kilovla.policy_folder import POLICY_JSON, Interface, PolicyFolder, write_rl_policy_files
from kilovla.progress import StepProgress
from kilovla.rl.algorithms import LearnerRun, algorithm
from kilovla.rl.compute import ComputeSection
from kilovla.rl.config import RLConfig, load  # noqa: F401  load: the CLI's `runner.load`
from kilovla.rl.core.flow import FlowSDE
from kilovla.train import checkpoint as ckpt
from kilovla.train.metrics import MetricsLogger

log = logging.getLogger(__name__)
# Training episodes use envs/seeds.py's rl stream, disjoint from the evaluation and demonstration seeds and
# per run seed, worker and env slot: 3e18 + seed * 1e9 + worker * 1e6 + env slot * 1e4 + episode counter
# (the counter, i.e. each slot's next seed, is saved in every checkpoint; a replaced worker skips
# REPLACEMENT_SEED_SKIP seeds).
REPLACEMENT_SEED_SKIP = 1000
MAX_BUILD_FAILURES = 3  # a worker that dies this many times in a row before answering ends the run
METAWORLD_MAX_REWARD = 10.0  # Meta-World v3's shaped reward per step lies in [0, 10]
STARTUP_S = 120.0  # a new env worker's grace period to start before it counts as hung


# -- the run ---------------------------------------------------------------------------------------------
def run(cfg: RLConfig, resume: str | None = None, ray_address: str | None = None, faults: dict | None = None,
        time_budget_s: float | None = None) -> dict:
    """Train; returns the summary (also run_dir/summary.json). `time_budget_s` ends the run (with its
    final checkpoint) at the first policy version past that wall time; `faults` injects failures (tests)."""
    import ray

    started = time.monotonic()  # summary.json's total_wall_s: the whole call, Ray's start and the final eval included
    _check_config(cfg)
    run_dir = Path(cfg.run_dir)
    folder = ckpt.resolve(resume, run_dir, "rl_state.json") if resume else None
    use = claim_run_dir(run_dir, resume, folder)  # a run_dir holding a run continues only with --resume
    policy_dir = str(folder) if folder is not None else cfg.policy and str(policy_folder(cfg.policy))
    if not policy_dir or not (Path(policy_dir) / POLICY_JSON).is_file():
        raise KilovlaError(f"--policy {policy_dir or '(none)'}: not a policy folder (no policy.json)")
    source = PolicyFolder.open(policy_dir)
    source.refuse_quantized("RL trains float weights: start from the folder it was quantized from")
    declared = source.interface(name=policy_dir)
    _check_policy_fits_env(cfg, declared)
    if cfg.eval.episodes:  # the final evaluation's seeds: refused now if demonstrations started there, not after the run
        from kilovla.eval.closed_loop import check_unseen_seeds

        check_unseen_seeds(source.meta.demonstration_seeds, list(cfg.eval.tasks or cfg.env.tasks), cfg.seed,
                           cfg.eval.episodes, env=cfg.env.env, who=f"--policy {policy_dir}",
                           remedy="set another --seed (it also picks the final evaluation's), or --eval.episodes=0")
    cfg = _with_policy_resolution(cfg, declared)
    sde, n_action_steps = _sde(cfg, source), cfg.rollout.n_action_steps or declared.n_action_steps or 1
    state = source.rl_state() if folder is not None else {}  # resuming: `source` is the checkpoint
    state.setdefault("started_from", str(Path(policy_dir).resolve()))  # the KL's reference, whatever the cwd later
    cfg = _fit_algorithm(cfg, source, n_action_steps, folder, state)
    version = state.get("version", 0)
    if folder is not None and state.get("compute_model", "real") != cfg.compute.model:
        raise KilovlaError(f"{folder}: this run's model compute was {state.get('compute_model', 'real')!r} (its weights "
                           f"{'never trained' if state.get('compute_model') == 'calibrated' else 'trained'}); resuming "
                           f"it with compute.model={cfg.compute.model!r} would mix the two: start a new run_dir")
    if cfg.compute.calibrated and not cfg.compute.fitted:
        cfg = dataclasses.replace(cfg, compute=calibrate(dataclasses.replace(cfg, policy=policy_dir)))

    # read before Ray starts: a learner.pt that would unpickle anything but plain data is refused in one line
    learner_state = _learner_state(folder) if folder is not None else None
    if learner_state is not None:
        _check_resume_fits(cfg, folder, learner_state)
    warn_if_warmup_unreachable(cfg, n_action_steps, version, state.get("env_steps", 0), replay_rows(learner_state))
    if folder is not None:  # checked: resuming an earlier checkpoint moves the later ones aside (one warning),
        ckpt.branch_at(run_dir / "checkpoints", folder)  # instead of rewriting them in place as this run goes on
    connect_ray(ray_address, num_cpus=max(2, os.cpu_count() or 2), what="kilovla rl")
    if use == "replace":
        clear(run_dir, RUN)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(config_mod.dump_yaml(cfg))
    logger = MetricsLogger(run_dir, resume_step=version if folder is not None else None)
    roles = _Roles(cfg, source, sde, n_action_steps, version, state, faults or {})
    try:
        if folder is not None:
            ray.get([lw.load_state.remote(ray.put(learner_state)) for lw in roles.learners])
        roles.sync_weights(version)
        loop = (_AsyncLoop if cfg.mode == "async" else _SyncLoop)(cfg, roles, logger, time_budget_s)
        loop.run(version, state)
        final = roles.checkpoint(loop.version, loop.counters(), keep=cfg.checkpoint.keep)
        summary = {"mode": cfg.mode, "steps": loop.version, "checkpoint": str(final), **loop.summary()}
        if cfg.compute.calibrated:
            summary["compute"] = dict(vars(cfg.compute))
    finally:
        roles.shutdown()
        logger.close()
    if cfg.eval.episodes > 0:
        summary["eval"] = _evaluate(final, cfg)
    return _finish(run_dir, summary, started, cfg)


def _finish(run_dir: Path, summary: dict, started: float, cfg: RLConfig) -> dict:
    """summary.json with the whole call's wall time; then, as the run's last line, a warning when an
    off-policy learner never updated: its replay stayed below the warm-up, or the run ended (max_env_steps,
    the time budget) before its first policy version."""
    summary["total_wall_s"] = time.monotonic() - started
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    held = summary.get("replay_usable", summary.get("replay_transitions"))
    if summary.get("learner_updates") != 0 or held is None:
        return summary
    if held < summary["warmup_transitions"]:
        log.warning("0 learner updates: the replay held %d transitions%s, below the warm-up of %d "
                    "(%s); the policy did not change. Lower the warm-up or run more --steps",
                    summary["replay_transitions"],
                    f" ({summary['replay_usable']} usable)" if "replay_usable" in summary else "",
                    summary["warmup_transitions"], algorithm(cfg.learner.algo.name).warmup(cfg.learner.algo)[0])
    else:
        limit = f"--max_env_steps={cfg.max_env_steps}" if cfg.max_env_steps > 0 else "the time budget"
        log.warning("0 learner updates: the run ended at %d env steps (%s), before its first policy version; the "
                    "policy did not change. Raise %s", summary.get("env_steps", 0), limit,
                    "--max_env_steps" if cfg.max_env_steps > 0 else "the time budget")
    return summary


def replay_rows(learner_state: dict | None) -> int:
    """Rows in a checkpoint's saved replay (0 without one). Residual SAC's and filtered BC's rings hold
    different columns (`reward`, `chunk`, ...), each with one row per stored transition."""
    return max((len(v) for v in (learner_state or {}).get("replay", {}).values()), default=0)


def _learner_state(folder: Path) -> dict:
    """learner.pt (weights-only), with the replay buffer of residual SAC or filtered BC from replay.safetensors."""
    from kilovla.models.checkpoints import read_safetensors
    from kilovla.safe_load import load_torch

    state = load_torch(folder / "learner.pt")
    if (folder / "replay.safetensors").is_file():
        state["replay"] = read_safetensors(folder / "replay.safetensors")
    return state


def _check_resume_fits(cfg: RLConfig, folder: Path, state: dict) -> None:
    """A checkpoint resumes with the algorithm it was written with and what that algorithm needs of it (one
    line, before Ray): another learner would find other state."""
    written = state.get("algorithm") or ("residual_sac" if "log_alpha" in state else "ppo")
    if written != cfg.learner.algo.name:
        raise KilovlaError(f"{folder}/learner.pt: written by learner.algo.name={written}; resume it with that, or "
                           f"start a new run_dir from the folder with --policy")
    algorithm(written).check_resume(cfg, folder, state)


def first_train_seed(run_seed: int, worker: int, env_slot: int) -> int:
    """The first episode seed of an env slot; its episodes count up from here (10_000 seeds per slot)."""
    return rl_train_seed(run_seed, worker, env_slot)


def _check_config(cfg: RLConfig) -> None:
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
    if cfg.env.env == "metaworld" and cfg.env.shaping == "reward" and cfg.env.max_steps * METAWORLD_MAX_REWARD * cfg.env.reward_scale >= cfg.env.success_bonus:
        log.warning("env.reward_scale %g: a full episode's shaped reward (up to %g) can exceed the success bonus %g, "
                    "so a near miss may pay more than a success", cfg.env.reward_scale,
                    cfg.env.max_steps * METAWORLD_MAX_REWARD * cfg.env.reward_scale, cfg.env.success_bonus)


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


def _privileged(cfg: RLConfig) -> tuple:
    """(key, width) of the env's privileged observation entries (Meta-World's 39-d state), for critics only."""
    from kilovla.envs.base import env_spec

    spec = env_spec(cfg.env.env, cfg.env.tasks[0], cameras=tuple(cfg.env.cameras), max_steps=cfg.env.max_steps)
    return tuple(tuple(e) for e in spec.extra_state)


def _fit_algorithm(cfg: RLConfig, source: PolicyFolder, n_action_steps: int, folder: Path | None,
                   state: dict) -> RLConfig:
    """The start (or resumed) folder fits the run's algorithm: a residual folder trains on only with an
    algorithm that trains residuals (one that trains the VLA would drop it); the rest is the algorithm's."""
    chosen = algorithm(cfg.learner.algo.name)
    if source.meta.residual and not chosen.trains_residual:
        raise KilovlaError(f"{source.path}: holds a residual actor (residual SAC); learner.algo.name={chosen.name} "
                           f"trains the VLA itself and would drop it: continue with residual_sac, or start from the "
                           f"supervised folder it began with")
    return chosen.fit_start(cfg, source, n_action_steps, folder, state)


def _with_policy_resolution(cfg: RLConfig, declared: Interface) -> RLConfig:
    """Rollouts and the final evaluation render at the policy's training resolution unless env.resolution
    says otherwise (eval's rule, `render_resolution`)."""
    from kilovla.eval.closed_loop import render_resolution

    resolution = render_resolution(declared, cfg.env.resolution, "--env.resolution")
    if resolution == cfg.env.resolution:
        return cfg
    return dataclasses.replace(cfg, env=dataclasses.replace(cfg.env, resolution=resolution))


def _check_policy_fits_env(cfg: RLConfig, declared: Interface) -> None:
    """The training tasks exist and the policy's action, state and cameras fit the env (from policy.json)."""
    from kilovla.envs.base import check_tasks, env_spec
    from kilovla.eval.closed_loop import check_compatible

    if cfg.env.env == "metaworld":
        from kilovla.envs import metaworld

        check_tasks(cfg.env.env, list(cfg.env.tasks), metaworld.task_names())
    elif not cfg.env.tasks:
        raise KilovlaError("env.tasks is empty: name the tasks to train on")
    spec = env_spec(cfg.env.env, cfg.env.tasks[0], cameras=tuple(cfg.env.cameras), max_steps=cfg.env.max_steps)
    check_compatible(declared, spec)


def calibrate(cfg: RLConfig) -> ComputeSection:
    """The calibrated compute of this run's policy: times measured here, in this process, on an observation
    of the run's env (`calibrated.calibrate`), at batch sizes up to every env at once."""
    from kilovla.rl.calibrated import calibrate as measure, env_observation

    source = PolicyFolder.open(cfg.policy)
    declared = source.interface(name=cfg.policy)
    cfg = _with_policy_resolution(cfg, declared)
    n_action_steps = cfg.rollout.n_action_steps or declared.n_action_steps or 1
    n_envs = cfg.env.workers * cfg.env.envs_per_worker
    fitted = measure(cfg.policy, _sde(cfg, source), n_action_steps, env_observation(cfg.env, cfg.seed), cfg.learner.algo,
                     batch_sizes=sorted({1, min(cfg.rollout.max_batch_size, n_envs), n_envs}),
                     micro_batches=sorted({min(4, cfg.learner.algo.micro_batch), cfg.learner.algo.micro_batch}),
                     threads=cfg.inference_threads)
    log.warning("compute.model calibrated: the model does not run; %s", fitted.describe())
    return fitted


def _sde(cfg: RLConfig, source: PolicyFolder) -> FlowSDE:
    steps = cfg.rollout.sde_steps or source.model_config().num_inference_steps
    return FlowSDE(steps=steps, noise_level=cfg.rollout.noise_level, stochastic=cfg.rollout.stochastic)


def _spread(w: int, avoid: set[str]) -> str:
    """The node for env worker `w`: the w-th alive node, round robin, leaving out `avoid` (nodes a
    worker could not be placed on) unless that leaves none. The affinity is hard: Ray's "SPREAD", and a
    soft affinity on a loaded machine, were both seen to put two CPU-less workers on one node of two.
    A worker whose node is gone by the time it is scheduled, or dies later, fails; the health check
    then re-creates it on a node alive at that time."""
    import ray

    alive = sorted(n["NodeID"] for n in ray.nodes() if n["Alive"])
    nodes = [n for n in alive if n not in avoid] or alive
    return nodes[w % len(nodes)]


def _here():
    """The driver's node, hard: the inference server, buffer and learners hold the run's state, so they
    live and die with the driver (which then resumes) while env nodes may come and go."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    return NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)


class _Roles:
    """The actors of a run, their creation, replacement and weight sync."""

    def __init__(self, cfg: RLConfig, source: PolicyFolder, sde: FlowSDE, n_action_steps: int, version: int,
                 state: dict, faults: dict):
        import ray

        from kilovla.rl import workers

        policy_dir = str(source.path)
        self.cfg, self.policy_dir, self.faults = cfg, policy_dir, faults
        self.started_from = state["started_from"]  # the policy the run began with (the KL's reference)
        self.meta = source.meta
        self.privileged = _privileged(cfg)
        here = _here()
        self.server = workers.InferenceServer.options(scheduling_strategy=here).remote(
            policy_dir, sde, n_action_steps, cfg.rollout.max_batch_size, cfg.rollout.max_wait_s, cfg.seed,
            cfg.inference_threads, cfg.compute, cfg.learner.algo, self.privileged)
        if faults.get("server"):
            ray.get(self.server.inject.remote(faults["server"]))
        ray.get(self.server.stats.remote())  # started: weight syncs are timed from here
        self.collective = cfg.weight_sync == "collective" or (cfg.weight_sync == "auto" and torch.cuda.is_available())
        self.buffer = workers.TrajectoryBuffer.options(scheduling_strategy=here).remote(
            cfg.learner.max_staleness, cfg.learner.batch_segments, version)
        ranks = cfg.learner.ranks
        run = LearnerRun(cfg.learner.algo, cfg.learner.batch_segments, cfg.rollout.segment_steps, cfg.steps,
                         cfg.compute, self.started_from, cfg.seed)
        self.learners = [workers.LearnerWorker.options(scheduling_strategy=here).remote(
            policy_dir, sde, n_action_steps, run, cfg.learner_threads, self.privileged) for _ in range(ranks)]
        store = ray.get(self.learners[0].address.remote()) if ranks > 1 else None
        ray.get([lw.start.remote(rank, ranks, store) for rank, lw in enumerate(self.learners)])
        seeds = state.get("next_seeds") or {}
        self.envs, self.next_seed, self._seen, self._checked, self.incarnation = [], {}, {}, 0.0, {}
        self._beats: dict[tuple[int, int], dict] = {}  # (worker, incarnation) -> its last heartbeat
        self._answered: dict[int, bool] = {}  # has this incarnation answered a heartbeat (built its envs)?
        self._build_failures: dict[int, int] = {}  # consecutive incarnations that died before answering
        self._placed: dict[int, str] = {}  # worker -> the node its current incarnation was sent to
        self._unplaceable: set[str] = set()  # nodes a worker could not be scheduled on
        for w in range(cfg.env.workers):
            self.next_seed[w] = list(seeds.get(str(w), [first_train_seed(cfg.seed, w, e) for e in range(cfg.env.envs_per_worker)]))
            self.envs.append(self._env_worker(w))
        self.replaced = state.get("replaced_workers", 0)
        self.held = {"updates": 0, "replay": 0}  # the learner's totals as of the newest checkpoint written
        if self.collective:  # learner rank 0 and the server meet in a process group of their own
            host, port = ray.get(self.learners[0].address.remote())
            ray.get([self.learners[0].join_weight_channel.remote(host, port, cfg.weight_sync_timeout_s),
                     self.server.join_weight_channel.remote(host, port, cfg.weight_sync_timeout_s)])

    def _env_worker(self, w: int):
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        from kilovla.envs.vector import EnvConfig
        from kilovla.rl import workers

        env = self.cfg.env
        configs = []
        for e in range(env.envs_per_worker):
            task = env.tasks[(w * env.envs_per_worker + e) % len(env.tasks)]
            latency = {**env.latency, "seed": self.cfg.seed * 1000 + w * 100 + e} if env.latency else None
            configs.append((EnvConfig(env.env, {"task": task, "resolution": env.resolution, "cameras": tuple(env.cameras),
                                                "max_steps": env.max_steps}, latency), self.next_seed[w][e]))
        fault = self.faults.get("env_workers", {}).get(w) if not self.faults.get("used", {}).get(w) else None
        self._seen[w] = time.monotonic() + STARTUP_S  # building envs (imports, renderers) takes a while
        self._answered[w] = False
        self.incarnation[w] = self.incarnation.get(w, -1) + 1
        self._placed[w] = _spread(w, self._unplaceable)
        strategy = NodeAffinitySchedulingStrategy(self._placed[w], soft=False)
        return workers.EnvWorker.options(scheduling_strategy=strategy).remote(
            w, self.incarnation[w], configs, self.cfg.rollout.segment_steps, env.reward_scale, env.success_bonus, fault,
            env.shaping)

    def check_envs(self, force: bool = False) -> list[int]:
        """Replace env workers that died or hang; returns the replaced worker ids. A worker hangs when one of
        its env steps has run longer than `env.timeout_s`, or when it has not answered for that long
        (a new worker gets `STARTUP_S` to build its envs first). Checks at most every 2 s unless forced."""
        import ray

        now = time.monotonic()
        if not force and now - self._checked < 2.0:
            return []
        self._checked = now
        refs = [w.heartbeat.remote() for w in self.envs]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=0.5)
        replaced = []
        for w, ref in enumerate(refs):
            why = None
            if ref in ready:
                try:
                    beat = self._beats[(w, self.incarnation[w])] = ray.get(ref)
                    self._seen[w] = now
                    self._answered[w], self._build_failures[w] = True, 0
                    self.next_seed[w] = list(beat["next_seed"])
                    if beat["stuck_s"] > self.cfg.env.timeout_s:
                        why = f"an env step has taken {beat['stuck_s']:.0f} s"
                except ray.exceptions.ActorUnschedulableError:
                    # not a failure to build its envs; Ray may list the node as alive a while longer,
                    # so no worker is sent there again in this run
                    why = "its node is gone"
                    self._unplaceable.add(self._placed[w])
                except ray.exceptions.RayActorError as e:
                    why = "its process died"
                    if not self._answered[w]:
                        self._build_failures[w] = self._build_failures.get(w, 0) + 1
                        if self._build_failures[w] >= MAX_BUILD_FAILURES:
                            detail = [line for line in str(e).splitlines() if line.strip()]
                            raise KilovlaError(f"env worker {w} died {self._build_failures[w]} times in a row before its "
                                               f"envs were built; ending the run: {detail[-1] if detail else e}") from None
            elif now - self._seen[w] > self.cfg.env.timeout_s:
                why = f"no answer for {now - self._seen[w]:.0f} s"
            if why is None:
                continue
            log.warning("env worker %d is replaced (%s); its running segments are dropped", w, why)
            ray.kill(self.envs[w], no_restart=True)
            ray.get(self.buffer.drop_worker.remote(w, self.incarnation[w]))
            self.faults.setdefault("used", {})[w] = True  # an injected fault happens once
            for e in range(self.cfg.env.envs_per_worker):  # fresh episodes: it may have played past its last heartbeat
                self.next_seed[w][e] += REPLACEMENT_SEED_SKIP
            self.envs[w] = self._env_worker(w)
            replaced.append(w)
        self.replaced += len(replaced)
        return replaced

    def sync_weights(self, version: int) -> None:
        """Send the learner's weights to the inference server; a sync that does not finish in time ends the run."""
        import ray

        if self.collective:
            refs = [self.learners[0].send_weights.remote(), self.server.receive_weights.remote(version)]
        else:
            weights = self.learners[0].weights.remote()  # passed by reference: the driver never copies them
            # the learner's copy-out gets a deadline of its own, so the transfer's deadline starts after it
            ready, _ = ray.wait([weights], timeout=self.cfg.weight_sync_timeout_s)
            if not ready:
                self._sync_timed_out(version)
            refs = [self.server.set_weights.remote(weights, version)]
        try:
            ray.get(refs, timeout=self.cfg.weight_sync_timeout_s)
        except ray.exceptions.GetTimeoutError:
            self._sync_timed_out(version)

    def _sync_timed_out(self, version: int):
        raise KilovlaError(f"weight sync of policy version {version} to the inference server did not complete "
                           f"within {self.cfg.weight_sync_timeout_s:g} s; ending the run") from None

    def checkpoint(self, version: int, counters: dict, keep: int) -> Path:
        """A policy folder (model.safetensors, policy.json, value_head.safetensors) plus what resumes the run."""
        import ray

        learner_state = ray.get(self.learners[0].state.remote())
        self.held = {"updates": int(learner_state.get("updates", 0)), "replay": replay_rows(learner_state)}
        self.refresh_seeds()
        root = Path(self.cfg.run_dir) / "checkpoints"
        folder = root / f"step_{version:06d}"
        tmp = root / f".{folder.name}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        write_rl_policy_files(tmp, learner_state, self.meta)
        state = {"version": version, "started_from": self.started_from, "compute_model": self.cfg.compute.model,
                 "next_seeds": {str(w): s for w, s in self.next_seed.items()},
                 "replaced_workers": self.replaced, **counters}
        (tmp / "rl_state.json").write_text(json.dumps(state, indent=2))
        (tmp / "config.yaml").write_text(config_mod.dump_yaml(self.cfg))
        ckpt.put_in_place(tmp, folder)
        ckpt.point_latest(root, folder)
        ckpt.prune(root, keep)
        return folder

    def refresh_seeds(self) -> None:
        """Each env slot's next seed from its worker (a worker that does not answer keeps its last known seeds)."""
        import ray

        for w, worker in enumerate(self.envs):
            try:
                self.next_seed[w] = list(ray.get(worker.heartbeat.remote(), timeout=5)["next_seed"])
            except Exception:  # noqa: BLE001  dying or hung: the health check replaces it and skips seeds
                continue

    def stats(self) -> dict:
        import ray

        out = {"inference": ray.get(self.server.stats.remote()), "buffer": ray.get(self.buffer.stats.remote()),
               "learner_busy_fraction": ray.get(self.learners[0].busy_fraction.remote())}
        beats = []
        for w, worker in enumerate(self.envs):
            try:
                beats.append(ray.get(worker.heartbeat.remote(), timeout=5))
            except Exception:  # noqa: BLE001  a dying worker reports nothing; the health check replaces it
                continue
            self._beats[(w, self.incarnation[w])] = beats[-1]
        out["env_busy_fraction"] = float(np.mean([b["busy_fraction"] for b in beats])) if beats else 0.0
        # over every incarnation's last heartbeat: a replaced (or silent) worker's steps stay counted
        out["env_steps_executed"] = sum(b["env_steps"] for b in self._beats.values())
        out["env_nodes"] = sorted({b["node"] for b in self._beats.values()})  # every node a worker reported from
        return out

    def shutdown(self) -> None:
        import ray

        try:
            ray.get(self.buffer.close.remote(), timeout=10)
            for w in self.envs:
                w.stop.remote()
        except Exception:  # noqa: BLE001  shutting down after a failure: kill whatever is left
            pass
        for actor in [*self.envs, self.server, self.buffer, *self.learners]:
            ray.kill(actor, no_restart=True)


class _Loop:
    """What both modes share: counters, metrics per version, checkpoints, the progress bar."""

    def __init__(self, cfg: RLConfig, roles: _Roles, logger: MetricsLogger, time_budget_s: float | None = None):
        self.cfg, self.roles, self.logger = cfg, roles, logger
        self.deadline = None if time_budget_s is None else time.monotonic() + time_budget_s
        self.version = 0
        self.env_steps = self.episodes = self.successes = 0
        self._window = {"t": time.monotonic(), "env_steps": 0, "episodes": 0, "successes": 0}
        self.t_start = time.monotonic()
        self.records: list[dict] = []
        self.per_task: dict[str, tuple[int, int]] = {}  # task -> (episodes, successes) since the last record

    def rollout_stats(self, stats: dict) -> dict:
        """Staleness histogram and dropped segments, running totals since this process started."""
        return stats["buffer"]

    def going(self) -> bool:
        return self.version < self.cfg.steps and (self.deadline is None or time.monotonic() < self.deadline) \
            and not 0 < self.cfg.max_env_steps <= self.env_steps

    def counters(self) -> dict:
        return {"env_steps": self.env_steps, "episodes": self.episodes, "successes": self.successes}

    def _start(self, version: int, state: dict) -> None:
        self.version = version
        self.env_steps, self.episodes, self.successes = (state.get(k, 0) for k in ("env_steps", "episodes", "successes"))
        self._window = {"t": time.monotonic(), **self.counters()}

    def count(self, segments) -> None:
        for s in segments:
            self.env_steps += s.env_steps
            self.episodes += len(s.episodes)
            self.successes += sum(e.success for e in s.episodes)
            for e in s.episodes:
                done, won = self.per_task.get(e.task, (0, 0))
                self.per_task[e.task] = (done + 1, won + int(e.success))

    def stepped(self, learner_stats: dict, progress) -> None:
        self.version = learner_stats["version"]
        now = time.monotonic()
        w = self._window
        dt = now - w["t"]
        episodes = self.episodes - w["episodes"]
        stats = self.roles.stats()
        inference = stats["inference"]
        record = {"kind": "rl", "step": self.version, "mode": self.cfg.mode, "env_steps": self.env_steps,
                  "env_steps_per_s": (self.env_steps - w["env_steps"]) / dt, "wall_s": now - self.t_start,
                  "success_rate": (self.successes - w["successes"]) / episodes if episodes else None,
                  "episodes": episodes, "successes": self.successes - w["successes"],
                  **{f"learner/{k}": v for k, v in learner_stats.items() if k != "version"},
                  "env_steps_executed": stats["env_steps_executed"],
                  "busy/env": stats["env_busy_fraction"], "busy/inference": inference["busy_fraction"],
                  "busy/learner": stats["learner_busy_fraction"], "batch_size_histogram": inference["batch_size_histogram"],
                  "mean_batch_size": inference["mean_batch_size"], "queue_wait_p50_s": inference["queue_wait_p50_s"],
                  "queue_wait_p99_s": inference["queue_wait_p99_s"],
                  "staleness_histogram": self.rollout_stats(stats)["staleness_histogram"],
                  "dropped_segments": self.rollout_stats(stats)["dropped_segments"], "replaced_workers": self.roles.replaced,
                  **{f"success/{t}": won / done for t, (done, won) in sorted(self.per_task.items())}}
        self.per_task = {}
        self.logger.log(record)
        self.records.append(record)
        self._window = {"t": now, **self.counters()}
        sr = record["success_rate"]
        progress.update(self.version, f"{record['env_steps_per_s']:.0f} env-steps/s  success {'-' if sr is None else f'{sr:.0%}'}")
        if self.version % self.cfg.checkpoint.every == 0 and self.version < self.cfg.steps:
            self.roles.checkpoint(self.version, self.counters(), self.cfg.checkpoint.keep)

    def summary(self) -> dict:
        stats = self.roles.stats()
        tail = self.records[len(self.records) // 4:] or self.records
        return {"env_steps": self.env_steps, "episodes": self.episodes,
                "success_rate": self.successes / self.episodes if self.episodes else None,
                "env_steps_per_s": float(np.median([r["env_steps_per_s"] for r in tail])) if tail else None,
                # the RL loop alone; total_wall_s (run()) adds Ray's start, the actors' creation and the final eval
                "rl_wall_s": time.monotonic() - self.t_start, "replaced_workers": self.roles.replaced,
                "env_nodes": len(stats["env_nodes"]),
                **{k: v for k, v in self.rollout_stats(stats).items() if k in ("staleness_histogram", "dropped_segments")},
                **self.learner_totals()}

    def learner_totals(self) -> dict:
        """Off-policy learners: the updates made, the transitions in the replay (and how many of them could
        be sampled) and the warm-up they wait for, as of the last policy version; PPO: nothing. A run that
        made no version (max_env_steps came first) reports what its final checkpoint's learner held."""
        setting = algorithm(self.cfg.learner.algo.name).warmup(self.cfg.learner.algo)
        if setting is None:
            return {}
        if self.records:
            last = self.records[-1]
        else:
            last = {"learner/updates": self.roles.held["updates"], "learner/replay": self.roles.held["replay"]}
        out = {"learner_updates": last.get("learner/updates"), "replay_transitions": last.get("learner/replay"),
               "warmup_transitions": setting[1]}
        if "learner/replay_usable" in last:
            out["replay_usable"] = last["learner/replay_usable"]
        return out


class _AsyncLoop(_Loop):
    def run(self, version: int, state: dict) -> None:
        import ray

        self._start(version, state)
        roles, cfg = self.roles, self.cfg
        for w in roles.envs:
            w.start.remote(roles.server, roles.buffer)
        ranks, batch = len(roles.learners), cfg.learner.batch_segments
        in_batch, pending = 0, []  # segments consumed towards this version; taken, not yet trained
        with StepProgress("rl", cfg.steps, version, cfg.progress) as progress:
            while self.going():
                replaced = roles.check_envs()
                for w in replaced:
                    roles.envs[w].start.remote(roles.server, roles.buffer)
                pending += ray.get(roles.buffer.take.remote(batch - in_batch - len(pending), 1.0))
                n = len(pending) - len(pending) % ranks  # every rank trains the same number of segments
                if n == 0:
                    continue
                ready, pending = pending[:n], pending[n:]
                results = ray.get([lw.consume.remote(ready[r::ranks]) for r, lw in enumerate(roles.learners)])
                self.count(ready)
                in_batch += n
                if results[0] is not None:
                    roles.sync_weights(results[0]["version"])
                    ray.get(roles.buffer.set_version.remote(results[0]["version"]))
                    in_batch = 0
                    self.stepped(results[0], progress)


class _SyncLoop(_Loop):
    dropped = 0  # segments of rounds lost to a dying or hung worker
    consumed_samples = 0  # every one acted by the learner's current weights: lag 0

    def rollout_stats(self, stats: dict) -> dict:
        return {"staleness_histogram": {"0": self.consumed_samples} if self.consumed_samples else {},
                "dropped_segments": self.dropped}

    def run(self, version: int, state: dict) -> None:
        import ray

        self._start(version, state)
        roles, cfg = self.roles, self.cfg
        ranks, seq = len(roles.learners), 0
        with StepProgress("rl", cfg.steps, version, cfg.progress) as progress:
            while self.going():
                segments = []
                while len(segments) < cfg.learner.batch_segments:
                    try:
                        segments += self._round(seq)
                    except (ray.exceptions.RayActorError, ray.exceptions.ActorUnschedulableError,
                            ray.exceptions.GetTimeoutError):  # a worker died, its node is gone, or it hangs
                        self.dropped += len(roles.envs) * cfg.env.envs_per_worker  # every env's partial segment
                        for w in roles.check_envs(force=True):  # a worker died or hangs: the round's steps are dropped
                            log.warning("sync round restarted after env worker %d was replaced", w)
                        continue
                    seq += 1
                shares = [segments[r::ranks] for r in range(ranks)]
                results = ray.get([lw.consume.remote(share) for lw, share in zip(roles.learners, shares)])
                self.count(segments)
                self.consumed_samples += sum(len(s) for s in segments)
                roles.sync_weights(results[0]["version"])
                self.stepped(results[0], progress)

    def _round(self, seq: int) -> list:
        """`segment_steps` lock-step steps of every env."""
        import ray

        from kilovla.rl.workers import sync_segment

        roles = self.roles
        steps = [[[] for _ in range(self.cfg.env.envs_per_worker)] for _ in roles.envs]
        obs = ray.get([w.observe.remote() for w in roles.envs], timeout=self.cfg.env.timeout_s)
        for _ in range(self.cfg.rollout.segment_steps):
            flat = [o for per_worker in obs for o in per_worker]
            outs = ray.get(roles.server.act_batch.remote(flat))
            n = self.cfg.env.envs_per_worker
            per_worker = [outs[w * n:(w + 1) * n] for w in range(len(roles.envs))]
            results = ray.get([w.step_all.remote([o["actions"] for o in outs_w])
                               for w, outs_w in zip(roles.envs, per_worker)], timeout=self.cfg.env.timeout_s)
            for w in range(len(roles.envs)):
                for e in range(n):
                    steps[w][e].append((obs[w][e], per_worker[w][e], results[w][e]))
            obs = ray.get([w.observe.remote() for w in roles.envs], timeout=self.cfg.env.timeout_s)
        return [sync_segment((w, self.roles.incarnation[w], e, seq), self.version, steps[w][e], obs[w][e])
                for w in range(len(roles.envs)) for e in range(self.cfg.env.envs_per_worker)]


def _evaluate(folder: Path, cfg: RLConfig) -> dict:
    from kilovla.eval.closed_loop import evaluate, load_policy

    report = evaluate(load_policy(str(folder)), env=cfg.env.env, tasks=list(cfg.eval.tasks or cfg.env.tasks),
                      episodes=cfg.eval.episodes, batch_size=cfg.eval.batch_size, resolution=cfg.env.resolution,
                      cameras=tuple(cfg.env.cameras), max_steps=cfg.env.max_steps, seed=cfg.seed,
                      out_dir=Path(cfg.run_dir) / "eval", label="rl final eval")
    return {"success_rate": report["overall_success_rate"],
            "per_task": {t: r["success_rate"] for t, r in report["per_task"].items()}}
