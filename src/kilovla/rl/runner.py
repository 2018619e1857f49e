"""`kilovla rl`: RL fine-tuning of a VLA policy folder, synchronous or fully asynchronous (RL-VLA3).

    kilovla rl --config rl.yaml --mode=async --policy.path=demo-output/run/checkpoints/step_001000
    kilovla rl --config rl.yaml --mode=sync --resume auto
    ray start --head; kilovla rl --config rl.yaml --ray_address=auto   # on a cluster

Both modes use the same workers, policy and algorithm (`learner.algo.name`, rl/algorithms.py), and one
policy version per global batch of `batch_segments` segments:

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

`run` reads in order: the checks before Ray (rl/checks.py; the config schema is rl/config.py), Ray, the
actors (rl/roles.py), the loop of the mode (rl/loops.py), the final checkpoint (rl/checkpoints.py) and
evaluation.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import time
from pathlib import Path

from kilovla import config as config_mod
from kilovla.data.ray_cluster import connect_ray
from kilovla.envs.base import env_type
from kilovla.errors import KilovlaError
from kilovla.folders import RUN, claim_run_dir, clear, policy_folder
from kilovla.policy_folder import RL_STATE, Interface, PolicyFolder
from kilovla.rl.algorithms import algorithm
from kilovla.rl.checkpoints import read_learner_state, replay_rows
from kilovla.rl.checks import check_config, check_policy_fits_env, check_resume_fits, fit_algorithm, \
    warn_if_warmup_unreachable
from kilovla.rl.compute import ComputeSection
from kilovla.rl.config import RLConfig, load  # noqa: F401  load: the CLI's `runner.load`
from kilovla.rl.core.flow import FlowSDE
from kilovla.rl.loops import AsyncLoop, SyncLoop
from kilovla.rl.roles import Roles
from kilovla.train import checkpoint as ckpt
from kilovla.train.metrics import MetricsLogger

log = logging.getLogger(__name__)


def run(cfg: RLConfig, resume: str | None = None, ray_address: str | None = None, faults: dict | None = None,
        time_budget_s: float | None = None) -> dict:
    """Train; returns the summary (also run_dir/summary.json). `time_budget_s` ends the run (with its
    final checkpoint) at the first policy version past that wall time; `faults` injects failures (tests)."""
    import ray

    started = time.monotonic()  # summary.json's total_wall_s: the whole call, Ray's start and the final eval included
    check_config(cfg)
    run_dir = Path(cfg.run_dir)
    folder = ckpt.resolve(resume, run_dir, RL_STATE) if resume else None
    use = claim_run_dir(run_dir, resume, folder)  # a run_dir holding a run continues only with --resume
    policy_dir = str(folder) if folder is not None else cfg.policy and str(policy_folder(cfg.policy))
    if not policy_dir:
        raise KilovlaError("rl: give --policy.path=DIR, the policy folder to fine-tune")
    source = PolicyFolder.open(policy_dir, flag="--policy.path")
    source.check_weights("--policy.path")
    source.refuse_quantized("RL trains float weights: start from the folder it was quantized from")
    declared = source.interface(name=policy_dir)
    check_policy_fits_env(cfg, declared)
    if cfg.eval.episodes:  # the final evaluation's seeds: refused now if demonstrations started there, not after the run
        from kilovla.eval.closed_loop import check_unseen_seeds

        final_eval = cfg.eval.settings(cfg.env, cfg.seed)
        check_unseen_seeds(source.meta.demonstration_seeds, list(final_eval.tasks), final_eval.seed,
                           final_eval.episodes, env=final_eval.env, who=f"--policy.path {policy_dir}",
                           remedy="set another --seed (it also picks the final evaluation's), or --eval.episodes=0")
    cfg = _with_policy_resolution(cfg, declared)
    sde, n_action_steps = _sde(cfg, source), cfg.rollout.n_action_steps or declared.n_action_steps or 1
    state = source.rl_state() if folder is not None else {}  # resuming: `source` is the checkpoint
    state.setdefault("started_from", str(Path(policy_dir).resolve()))  # the KL's reference, whatever the cwd later
    cfg = fit_algorithm(cfg, source, n_action_steps, folder, state)
    version = state.get("version", 0)
    if folder is not None and state.get("compute_model", "real") != cfg.compute.model:
        raise KilovlaError(f"{folder}: this run's model compute was {state.get('compute_model', 'real')!r} (its weights "
                           f"{'never trained' if state.get('compute_model') == 'calibrated' else 'trained'}); resuming "
                           f"it with compute.model={cfg.compute.model!r} would mix the two: start a new run_dir")
    if cfg.compute.calibrated and not cfg.compute.fitted:
        cfg = dataclasses.replace(cfg, compute=calibrate(dataclasses.replace(cfg, policy=policy_dir)))

    # read before Ray starts: a learner.pt that would unpickle anything but plain data is refused in one line
    learner_state = read_learner_state(folder) if folder is not None else None
    if learner_state is not None:
        check_resume_fits(cfg, folder, learner_state)
    warn_if_warmup_unreachable(cfg, n_action_steps, version, state.get("env_steps", 0), replay_rows(learner_state))
    if folder is not None:  # checked: resuming an earlier checkpoint moves the later ones aside (one warning),
        ckpt.branch_at(run_dir / "checkpoints", folder)  # instead of rewriting them in place as this run goes on
    connect_ray(ray_address, num_cpus=max(2, os.cpu_count() or 2), what="kilovla rl")
    if use == "replace":
        clear(run_dir, RUN)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(config_mod.dump_yaml(cfg))
    logger = MetricsLogger(run_dir, resume_step=version if folder is not None else None)
    roles = Roles(cfg, source, sde, n_action_steps, version, state, faults or {})
    try:
        if folder is not None:
            ray.get([lw.load_state.remote(ray.put(learner_state)) for lw in roles.learners])
        roles.sync_weights(version)
        loop = (AsyncLoop if cfg.mode == "async" else SyncLoop)(cfg, roles, logger, time_budget_s)
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


def _with_policy_resolution(cfg: RLConfig, declared: Interface) -> RLConfig:
    """Rollouts and the final evaluation render at the policy's training resolution unless env.resolution
    says otherwise (the env's rule, `EnvType.render_resolution`, the one evaluations follow)."""
    resolution = env_type(cfg.env.env).render_resolution(declared, cfg.env.resolution, "--env.resolution")
    if resolution == cfg.env.resolution:
        return cfg
    return dataclasses.replace(cfg, env=dataclasses.replace(cfg.env, resolution=resolution))


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


def _evaluate(folder: Path, cfg: RLConfig) -> dict:
    from kilovla.eval.closed_loop import evaluate, load_policy

    report = evaluate(load_policy(str(folder)), cfg.eval.settings(cfg.env, cfg.seed),
                      out_dir=Path(cfg.run_dir) / "eval", label="rl final eval")
    return {"success_rate": report["overall_success_rate"],
            "per_task": {t: r["success_rate"] for t, r in report["per_task"].items()}}
