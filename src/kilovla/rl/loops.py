"""The two schedules of a run over the same roles (rl/roles.py), one policy version per global batch:

- `SyncLoop` (the baseline): every env steps in lock step, one batched inference per step; after
  `segment_steps` steps the learner trains on the batch while the envs wait.
- `AsyncLoop` (RL-VLA3): every env runs its own loop and the learner trains segments as they arrive;
  rollout, inference and training overlap, `max_staleness` bounding how far rollouts run ahead.

`Loop` is what both share: counters, one metrics row per version, periodic checkpoints, the summary.
The loops decide who waits for whom; they reach the actors only through `RunRoles` (rl/roles.py's `Roles`
over Ray), so a fake can stand in for them (tests/test_rl_loops.py).
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Protocol

import numpy as np

from kilovla.progress import StepProgress
from kilovla.rl.algorithms import algorithm
from kilovla.rl.config import RLConfig
from kilovla.rl.roles import WorkerLost
from kilovla.train.metrics import MetricsLogger

log = logging.getLogger(__name__)


class RunRoles(Protocol):
    """What the loops call on a run's actors (`Roles`): every call returns once the actors answered."""

    envs: list  # one handle per env worker
    learners: list  # one per learner rank
    incarnation: dict[int, int]  # env worker -> its current incarnation (a segment id's second field)
    replaced: int  # env workers replaced so far
    held: dict  # the learner's updates and replay rows as of the newest checkpoint

    def start_envs(self, workers: list[int]) -> None:
        """Start these env workers' own loops (async mode)."""

    def check_envs(self, force: bool = False) -> list[int]:
        """Replace env workers that died or hang; the replaced ones."""

    def take(self, most: int, timeout_s: float) -> list:
        """Up to `most` finished segments of the current global batch ([] after `timeout_s`)."""

    def consume(self, shares: list[list]) -> list[dict | None]:
        """Each learner rank trains its share; each rank's result (a step's stats when a version completed)."""

    def sync_weights(self, version: int) -> None:
        """The learner's weights to the inference server."""

    def set_buffer_version(self, version: int) -> None:
        """New segments start at `version`."""

    def observe(self) -> list[list[dict]]:
        """Every env's current observation, per worker (sync mode); WorkerLost when a worker is lost."""

    def act_batch(self, observations: list[dict]) -> list[dict]:
        """One forward over these observations (sync mode); WorkerLost when a worker is lost."""

    def step_all(self, actions: list[list]) -> list[list[tuple]]:
        """Each worker's envs execute their chunks (sync mode); WorkerLost when a worker is lost."""

    def stats(self) -> dict:
        """Inference, buffer, learner and env statistics for a metrics row."""

    def checkpoint(self, version: int, counters: dict, keep: int) -> Path:
        """A checkpoint folder of this version."""


class Loop:
    """What both modes share: counters, metrics per version, checkpoints, the progress bar."""

    def __init__(self, cfg: RLConfig, roles: RunRoles, logger: MetricsLogger, time_budget_s: float | None = None):
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


class AsyncLoop(Loop):
    def run(self, version: int, state: dict) -> None:
        self._start(version, state)
        roles, cfg = self.roles, self.cfg
        roles.start_envs(list(range(len(roles.envs))))
        ranks, batch = len(roles.learners), cfg.learner.batch_segments
        in_batch, pending = 0, []  # segments consumed towards this version; taken, not yet trained
        with StepProgress("rl", cfg.steps, version, cfg.progress) as progress:
            while self.going():
                roles.start_envs(roles.check_envs())
                pending += roles.take(batch - in_batch - len(pending), 1.0)
                n = len(pending) - len(pending) % ranks  # every rank trains the same number of segments
                if n == 0:
                    continue
                ready, pending = pending[:n], pending[n:]
                results = roles.consume([ready[r::ranks] for r in range(ranks)])
                self.count(ready)
                in_batch += n
                if results[0] is not None:
                    roles.sync_weights(results[0]["version"])
                    roles.set_buffer_version(results[0]["version"])
                    in_batch = 0
                    self.stepped(results[0], progress)


class SyncLoop(Loop):
    dropped = 0  # segments of rounds lost to a dying or hung worker
    consumed_samples = 0  # every one acted by the learner's current weights: lag 0

    def rollout_stats(self, stats: dict) -> dict:
        return {"staleness_histogram": {"0": self.consumed_samples} if self.consumed_samples else {},
                "dropped_segments": self.dropped}

    def run(self, version: int, state: dict) -> None:
        self._start(version, state)
        roles, cfg = self.roles, self.cfg
        ranks, seq = len(roles.learners), 0
        with StepProgress("rl", cfg.steps, version, cfg.progress) as progress:
            while self.going():
                segments = []
                while len(segments) < cfg.learner.batch_segments:
                    try:
                        segments += self._round(seq)
                    except WorkerLost:
                        self.dropped += len(roles.envs) * cfg.env.envs_per_worker  # every env's partial segment
                        for w in roles.check_envs(force=True):  # a worker died or hangs: the round's steps are dropped
                            log.warning("sync round restarted after env worker %d was replaced", w)
                        continue
                    seq += 1
                results = roles.consume([segments[r::ranks] for r in range(ranks)])
                self.count(segments)
                self.consumed_samples += sum(len(s) for s in segments)
                roles.sync_weights(results[0]["version"])
                self.stepped(results[0], progress)

    def _round(self, seq: int) -> list:
        """`segment_steps` lock-step steps of every env."""
        from kilovla.rl.workers import sync_segment

        roles = self.roles
        steps = [[[] for _ in range(self.cfg.env.envs_per_worker)] for _ in roles.envs]
        obs = roles.observe()
        for _ in range(self.cfg.rollout.segment_steps):
            flat = [o for per_worker in obs for o in per_worker]
            outs = roles.act_batch(flat)
            n = self.cfg.env.envs_per_worker
            per_worker = [outs[w * n:(w + 1) * n] for w in range(len(roles.envs))]
            results = roles.step_all([[o["actions"] for o in outs_w] for outs_w in per_worker])
            for w in range(len(roles.envs)):
                for e in range(n):
                    steps[w][e].append((obs[w][e], per_worker[w][e], results[w][e]))
            obs = roles.observe()
        return [sync_segment((w, self.roles.incarnation[w], e, seq), self.version, steps[w][e], obs[w][e])
                for w in range(len(roles.envs)) for e in range(self.cfg.env.envs_per_worker)]
