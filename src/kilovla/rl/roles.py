"""The actors of a run (`Roles`): the inference server, the trajectory buffer, the learner ranks and the
env workers (rl/workers.py), their placement on Ray's nodes, the replacement of env workers that die or
hang, weight sync, checkpoints and the statistics the loops log.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import numpy as np
import torch

from kilovla.envs.seeds import rl_train_seed
from kilovla.errors import KilovlaError
from kilovla.policy_folder import PolicyFolder
from kilovla.rl.algorithm import LearnerRun
from kilovla.rl.checkpoints import replay_rows, write_checkpoint
from kilovla.rl.config import RLConfig
from kilovla.rl.core.flow import FlowSDE

log = logging.getLogger(__name__)
# Training episodes use envs/seeds.py's rl stream, disjoint from the evaluation and demonstration seeds and
# per run seed, worker and env slot: 3e18 + seed * 1e9 + worker * 1e6 + env slot * 1e4 + episode counter
# (the counter, i.e. each slot's next seed, is saved in every checkpoint; a replaced worker skips
# REPLACEMENT_SEED_SKIP seeds).
REPLACEMENT_SEED_SKIP = 1000
MAX_BUILD_FAILURES = 3  # a worker that dies this many times in a row before answering ends the run
STARTUP_S = 120.0  # a new env worker's grace period to start before it counts as hung


def first_train_seed(run_seed: int, worker: int, env_slot: int) -> int:
    """The first episode seed of an env slot; its episodes count up from here (10_000 seeds per slot)."""
    return rl_train_seed(run_seed, worker, env_slot)


def privileged_entries(cfg: RLConfig) -> tuple:
    """(key, width) of the env's privileged observation entries (Meta-World's 39-d state), for critics only."""
    from kilovla.envs.base import env_spec

    spec = env_spec(cfg.env.env, cfg.env.tasks[0], cameras=tuple(cfg.env.cameras), max_steps=cfg.env.max_steps)
    return tuple(tuple(e) for e in spec.extra_state)


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


class WorkerLost(Exception):
    """A sync round cannot finish: an env worker died, its node is gone, or it (or the server) hangs."""


def _round_call(refs, timeout: float | None):
    """ray.get for a sync round: a lost worker, node or deadline is WorkerLost (the round is dropped)."""
    import ray

    try:
        return ray.get(refs, timeout=timeout)
    except (ray.exceptions.RayActorError, ray.exceptions.ActorUnschedulableError, ray.exceptions.GetTimeoutError) as e:
        raise WorkerLost(str(e)) from e


class Roles:
    """The actors of a run, their creation, replacement and weight sync; the loops' `RunRoles` (rl/loops.py)."""

    def __init__(self, cfg: RLConfig, source: PolicyFolder, sde: FlowSDE, n_action_steps: int, version: int,
                 state: dict, faults: dict):
        import ray

        from kilovla.rl import workers

        policy_dir = str(source.path)
        self.cfg, self.policy_dir, self.faults = cfg, policy_dir, faults
        self.started_from = state["started_from"]  # the policy the run began with (the KL's reference)
        self.meta = source.meta
        self.privileged = privileged_entries(cfg)
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

    def start_envs(self, workers: list[int]) -> None:
        for w in workers:
            self.envs[w].start.remote(self.server, self.buffer)

    def take(self, most: int, timeout_s: float) -> list:
        import ray

        return ray.get(self.buffer.take.remote(most, timeout_s))

    def consume(self, shares: list[list]) -> list[dict | None]:
        import ray

        return ray.get([lw.consume.remote(share) for lw, share in zip(self.learners, shares)])

    def set_buffer_version(self, version: int) -> None:
        import ray

        ray.get(self.buffer.set_version.remote(version))

    def observe(self) -> list[list[dict]]:
        return _round_call([w.observe.remote() for w in self.envs], self.cfg.env.timeout_s)

    def act_batch(self, observations: list[dict]) -> list[dict]:
        return _round_call(self.server.act_batch.remote(observations), None)

    def step_all(self, actions: list[list]) -> list[list[tuple]]:
        return _round_call([w.step_all.remote(a) for w, a in zip(self.envs, actions)], self.cfg.env.timeout_s)

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
        state = {"version": version, "started_from": self.started_from, "compute_model": self.cfg.compute.model,
                 "next_seeds": {str(w): s for w, s in self.next_seed.items()},
                 "replaced_workers": self.replaced, **counters}
        return write_checkpoint(self.cfg, version, learner_state, self.meta, state, keep)

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
