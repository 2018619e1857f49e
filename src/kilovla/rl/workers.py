"""The RL-VLA3 roles as Ray actors: env workers, the inference server, the trajectory buffer, the learner.

- `EnvWorker`: several envs in one process, each in its own thread running its own loop
  (admission -> act -> execute the chunk in the env -> ... -> submit the segment), with no barrier
  between envs. For the synchronous baseline the same worker also steps all its envs at once
  (`observe` / `step_all`, the envs stepped in parallel threads) when the runner says so.
- `InferenceServer`: a policy replica; `act(obs)` requests from every env go through a
  `DynamicBatcher`, a background task (the shared `BatchingLoop`) runs each batch in one forward; `act_batch` is the synchronous
  path (one forward over all envs). Weights arrive with a version (`set_weights`) between batches.
  With calibrated compute (`calibrated.py`) a batch sleeps its fitted time and answers with
  stand-in actions instead of running the model; batching, versions and weight loading are unchanged.
- `TrajectoryBuffer`: the `StalenessGate` and the queue of finished segments; envs wait here for
  admission, the runner takes segments for the learner, each segment id at most once.
- `LearnerWorker`: the learner of the run's algorithm (rl/algorithms.py) in an actor; several form a DDP
  group (gloo on CPU, NCCL on GPU) over a TCP store, each consuming its share of every global batch.

Each role records how long it was busy, for the busy fractions in the metrics.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import threading
import time
from collections import deque

import numpy as np
import ray
import torch

from kilovla.rl import calibrated
from kilovla.batching import BatchingLoop, DynamicBatcher
from kilovla.rl.core.flow import FlowSDE
from kilovla.rl.core.staleness import StalenessGate
from kilovla.rl.core.trajectory import Episode, Segment, stack, step_reward


class _Busy:
    """Seconds spent working since creation (a role's busy fraction = busy / wall)."""

    def __init__(self):
        self.start, self.busy = time.monotonic(), 0.0
        self._lock = threading.Lock()

    def add(self, seconds: float) -> None:
        with self._lock:
            self.busy += seconds

    def fraction(self) -> float:
        return self.busy / max(1e-9, time.monotonic() - self.start)


# -- env workers ----------------------------------------------------------------------------------------
@ray.remote(num_cpus=0, max_concurrency=64)
class EnvWorker:
    """`envs` (EnvConfig, first seed) pairs; rewards: `step_reward` (reward_scale * env reward + success_bonus
    on success; with `shaping` "progress" the env reward's change since the episode's previous action). Env i's k-th episode since the run began uses seed first_seed[i] + k (`next_seed` goes back
    to the runner with every heartbeat, so a checkpoint resumes with the seeds not yet played).

    Each env lives in its own thread from construction on: a renderer's GL context belongs to the
    thread that made it, and the threads let one env's step (or injected latency) overlap another's.
    """

    def __init__(self, worker_id: int, incarnation: int, envs: list, segment_steps: int, reward_scale: float,
                 success_bonus: float, fault: dict | None = None, shaping: str = "reward"):
        torch.set_num_threads(1)
        # Software GL (llvmpipe) would start a render thread per core in every env's context: with
        # several envs per process, one each is faster and leaves the cores to the rest of the run.
        os.environ.setdefault("LP_NUM_THREADS", "1")
        self.id, self.incarnation, self.segment_steps = worker_id, incarnation, segment_steps
        self.reward_scale, self.success_bonus, self.progress = reward_scale, success_bonus, shaping == "progress"
        self.configs = [c for c, _ in envs]
        self.next_seed = [s for _, s in envs]
        n = len(self.configs)
        self.envs: list = [None] * n
        self.obs: list[dict | None] = [None] * n
        self.episode = [{"steps": 0, "return": 0.0, "seed": 0, "last": None} for _ in range(n)]
        self.fault = fault or {}
        self.busy = _Busy()
        self.env_steps = 0
        self.in_step_since: list[float | None] = [None] * n  # a hang shows as a long env step
        self._stop = threading.Event()
        self._threads = [concurrent.futures.ThreadPoolExecutor(1) for _ in range(n)]
        for f in [t.submit(self._build, i) for i, t in enumerate(self._threads)]:
            f.result()

    def _build(self, i: int) -> None:
        self.envs[i] = self.configs[i].build()
        self._reset(i)

    def _reset(self, i: int) -> None:
        seed = self.next_seed[i]
        self.next_seed[i] += 1
        self.obs[i] = self.envs[i].reset(seed=seed)[0]
        self.episode[i] = {"steps": 0, "return": 0.0, "seed": seed, "last": None}

    def _execute(self, i: int, actions: np.ndarray) -> tuple[float, bool, bool, list[Episode], int]:
        """Run a chunk's actions in env i (stop at the episode's end); -> reward, whether an episode ended,
        whether that end was the time limit (truncated, not terminated), the episodes that ended, actions executed."""
        t0 = time.monotonic()
        self.in_step_since[i] = t0
        self._inject(i)
        reward, ended, cut, finished, executed = 0.0, False, False, [], 0
        rendering = getattr(self.envs[i].unwrapped, "set_rendering", None)
        for k, action in enumerate(actions):
            if rendering is not None:  # only the chunk's last observation is ever looked at: render just that
                rendering(k == len(actions) - 1)
            obs, r, terminated, truncated, info = self.envs[i].step(action)
            success = bool(info.get("is_success", False))
            ep = self.episode[i]
            shaped = r - (r if ep["last"] is None else ep["last"]) if self.progress else r
            ep["last"] = r
            reward += step_reward(shaped, success, self.reward_scale, self.success_bonus)
            ep["steps"] += 1
            ep["return"] += r
            self.obs[i] = obs
            executed += 1
            if terminated or truncated:
                finished.append(Episode(self.configs[i].kwargs.get("task", ""), ep["seed"], success, ep["steps"], ep["return"]))
                if rendering is not None:
                    rendering(True)
                self._reset(i)
                ended, cut = True, bool(truncated and not terminated)
                break
        with self.busy._lock:
            self.env_steps += executed
        self.busy.add(time.monotonic() - t0)
        self.in_step_since[i] = None
        return reward, ended, cut, finished, executed

    def _inject(self, i: int) -> None:
        """Test faults: {"crash_after": n} ends this process, {"hang_after": n} stops answering."""
        if self.env_steps >= self.fault.get("crash_after", 1 << 62):
            os._exit(1)
        if self.env_steps >= self.fault.get("hang_after", 1 << 62):
            time.sleep(1 << 20)

    # async mode: every env runs its own loop
    def start(self, server, buffer) -> None:
        for i, thread in enumerate(self._threads):
            thread.submit(self._loop, i, server, buffer)

    def _loop(self, i: int, server, buffer) -> None:
        seq = 0
        try:
            while not self._stop.is_set():
                admitted = ray.get(buffer.admit.remote((self.id, self.incarnation, i)))
                if admitted is None:  # the run is over, or this worker has been replaced
                    return
                ticket, start = admitted
                steps, episodes, executed = [], [], 0
                for _ in range(self.segment_steps):
                    obs = self.obs[i]
                    out = ray.get(server.act.remote(obs))
                    reward, ended, cut, finished, n = self._execute(i, out["actions"])
                    episodes += finished
                    executed += n
                    steps.append((obs, out, reward, ended, cut))
                segment = _segment((self.id, self.incarnation, i, seq), ticket, start, steps, self.obs[i], episodes,
                                   executed)
                seq += 1
                ray.get(buffer.submit.remote(segment))
        except ray.exceptions.RayActorError:
            return  # the run is shutting its actors down

    # sync mode: the runner steps every env at once
    def observe(self) -> list[dict]:
        # On each env's own thread, so after any chunk still running there: a round abandoned because
        # another worker died leaves this worker's step_all going, and its mid-chunk observations
        # were never rendered (the actor serves calls concurrently).
        return [f.result() for f in [t.submit(lambda i=i: self.obs[i]) for i, t in enumerate(self._threads)]]

    def step_all(self, actions: list[np.ndarray]) -> list[tuple[float, bool, bool, list[Episode], int]]:
        return [f.result() for f in [t.submit(self._execute, i, a) for i, (t, a) in enumerate(zip(self._threads, actions))]]

    def heartbeat(self) -> dict:
        """Env steps so far, the longest env step in progress (a hang), the busy fraction per env."""
        now = time.monotonic()
        stuck = max((now - t for t in self.in_step_since if t is not None), default=0.0)
        return {"env_steps": self.env_steps, "stuck_s": stuck, "busy_fraction": self.busy.fraction() / max(1, len(self.envs)),
                "node": ray.get_runtime_context().get_node_id(), "next_seed": list(self.next_seed)}

    def stop(self) -> None:
        self._stop.set()


PPO_FIELDS = ("chain", "stochastic", "logp", "value")


def _segment(segment_id, ticket: int, start_version: int, steps: list, next_obs: dict, episodes: list[Episode],
             env_steps: int) -> Segment:
    obs, outs, rewards, ended, cut = zip(*steps)
    acted = {k: np.stack([np.asarray(o[k]) for o in outs]) for k in outs[0] if k not in ("actions", "version")}
    ppo = {k: acted.pop(k, None) for k in PPO_FIELDS}
    return Segment(segment_id=segment_id, ticket=ticket, start_version=start_version, obs=stack(list(obs)),
                   chain=ppo["chain"], stochastic=ppo["stochastic"],
                   logp=None if ppo["logp"] is None else ppo["logp"].astype(np.float32),
                   value=None if ppo["value"] is None else ppo["value"].astype(np.float32),
                   reward=np.array(rewards, np.float32), done=np.array(ended, bool), truncated=np.array(cut, bool),
                   version=np.array([o["version"] for o in outs]), next_obs=next_obs,
                   env_steps=env_steps, episodes=episodes, extras=acted)


def sync_segment(segment_id: tuple, start_version: int, steps: list, next_obs: dict) -> Segment:
    """A segment of the synchronous mode from its per-step records (obs, out, `EnvWorker._execute`'s result)."""
    records = [(obs, out, r[0], r[1], r[2]) for obs, out, r in steps]
    episodes = [ep for *_, r in steps for ep in r[3]]
    return _segment(segment_id, -1, start_version, records, next_obs, episodes, sum(r[4] for *_, r in steps))


# -- weight sync ----------------------------------------------------------------------------------------
class WeightChannel:
    """A two-member process group of its own (learner rank 0 sends, the inference server receives) over a
    TCP store: NCCL between GPUs, gloo on CPU. The weights go as one flat buffer per dtype, received in
    place into the server's parameters: no copy through the driver or the object store."""

    def __init__(self, host: str, port: int, rank: int, timeout_s: float):
        import torch.distributed as dist
        from datetime import timedelta

        timeout = timedelta(seconds=timeout_s)
        store = dist.TCPStore(host, port, world_size=2, is_master=rank == 0, timeout=timeout)
        if torch.cuda.is_available():
            self.pg = dist.ProcessGroupNCCL(store, rank, 2)
        else:
            self.pg = dist.ProcessGroupGloo(store, rank, 2, timeout)
        self.timeout = timeout

    def broadcast(self, tensors: list[torch.Tensor]) -> None:
        """The sender's values into every receiver's tensors (same shapes and dtypes on both sides)."""
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for t in tensors:
            by_dtype.setdefault(t.dtype, []).append(t)
        for group in by_dtype.values():
            flat = torch.cat([t.detach().reshape(-1) for t in group])
            self.pg.broadcast(flat, 0).wait(self.timeout)
            offset = 0
            with torch.no_grad():
                for t in group:
                    t.copy_(flat[offset:offset + t.numel()].view_as(t))
                    offset += t.numel()


# -- inference ----------------------------------------------------------------------------------------
@ray.remote(num_cpus=0)
class InferenceServer:
    def __init__(self, policy_dir: str, sde: FlowSDE, n_action_steps: int, max_batch_size: int, max_wait_s: float,
                 seed: int, threads: int, compute, algo, privileged: tuple):
        from kilovla.rl.algorithms import algorithm

        torch.set_num_threads(threads)
        self.model = algorithm(algo.name).load_agent(policy_dir, algo, sde, n_action_steps, privileged).eval()
        self.compute = compute
        self.batcher = DynamicBatcher(max_batch_size, max_wait_s)
        self.generator = torch.Generator().manual_seed(seed)
        self.version = 0
        self.busy = _Busy()
        self._task = None
        self._pool = concurrent.futures.ThreadPoolExecutor(1)
        self._lock = asyncio.Lock()  # weights never change inside a batch
        self.batching = BatchingLoop(self.batcher, self._forward, self._pool, lock=self._lock)
        self.fault = {}

    def _forward(self, observations: list[dict]) -> list[dict]:
        t0 = time.monotonic()
        out = calibrated.act(self.model, self.compute, observations, self.generator)
        self.busy.add(time.monotonic() - t0)
        return [{k: v[i] for k, v in out.items()} | {"version": self.version} for i in range(len(observations))]

    async def act(self, obs: dict) -> dict:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self.batching.run())
        return await self.batching.submit(obs)

    async def act_batch(self, observations: list[dict]) -> list[dict]:
        """The synchronous path: one forward over every env's observation, no batching wait."""
        self.batcher.stats.batch_sizes[len(observations)] += 1
        self.batcher.stats.waits.extend([0.0] * len(observations))
        async with self._lock:
            return await asyncio.get_running_loop().run_in_executor(self._pool, self._forward, observations)

    async def set_weights(self, weights: dict, version: int) -> int:
        if self.fault.get("hang_weight_sync_at") == version:
            await asyncio.sleep(1 << 20)
        async with self._lock:
            self.model.acting_module().load_state_dict(weights)
            self.version = version
        return version

    async def join_weight_channel(self, host: str, port: int, timeout_s: float) -> None:
        loop = asyncio.get_running_loop()
        self.channel = await loop.run_in_executor(self._pool, WeightChannel, host, port, 1, timeout_s)

    async def receive_weights(self, version: int) -> int:
        """The collective path of `set_weights`: the learner broadcasts, this replica receives in place."""
        if self.fault.get("hang_weight_sync_at") == version:
            await asyncio.sleep(1 << 20)
        tensors = list(self.model.acting_module().state_dict().values())
        async with self._lock:
            await asyncio.get_running_loop().run_in_executor(self._pool, self.channel.broadcast, tensors)
            self.version = version
        return version

    def inject(self, fault: dict) -> None:
        self.fault = fault

    def stats(self) -> dict:
        return {"busy_fraction": self.busy.fraction(), "version": self.version, **self.batcher.stats.summary()}


# -- the trajectory buffer ----------------------------------------------------------------------------
class TrajectoryBufferCore:
    """(The `TrajectoryBuffer` actor's class, usable without Ray.) The staleness gate and the finished segments. Envs wait in `admit`; the runner `take`s the
    segments of the learner's current global batch (their tickets say which batch they belong to)."""

    def __init__(self, max_staleness: int, batch_segments: int, version: int = 0):
        self.gate = StalenessGate(max_staleness, batch_segments, consumed_batches=version)
        self.version = version
        self.running: dict[tuple, int] = {}  # (worker, incarnation, env) -> ticket of its running segment
        self.replaced: set[tuple] = set()  # (worker, incarnation) of replaced workers: never admitted again
        self.ready: dict[int, list[Segment]] = {}  # global batch -> its finished segments
        self.seen: set[tuple] = set()
        self.closed = False
        self._changed = asyncio.Condition()
        self.wait_s = 0.0

    async def admit(self, env_key: tuple) -> tuple[int, int] | None:
        """Wait until the gate lets this env start a segment: (ticket, version), or None when closed."""
        t0 = time.monotonic()
        async with self._changed:
            ticket = None

            def admitted() -> bool:
                # asked each time it wakes: a worker replaced while its envs wait here must get no ticket
                # (one it got would never be finished nor dropped, and the gate would stall for good)
                nonlocal ticket
                gone = env_key[:2] in self.replaced
                ticket = None if self.closed or gone else self.gate.try_admit(self.version)
                return self.closed or gone or ticket is not None

            await self._changed.wait_for(admitted)
            self.wait_s += time.monotonic() - t0
            if ticket is None:
                return None
            self.running[env_key] = ticket
            return ticket, self.version

    async def submit(self, segment: Segment) -> bool:
        async with self._changed:
            key = segment.segment_id[:3]
            if segment.segment_id in self.seen or self.running.get(key) != segment.ticket:
                return False  # from a replaced worker, or a duplicate: never consumed
            self.seen.add(segment.segment_id)
            self.gate.finish(self.running.pop(key))
            self.ready.setdefault(self.gate.batch_of(segment.ticket), []).append(segment)
            self._changed.notify_all()
            return True

    async def drop_worker(self, worker_id: int, incarnation: int) -> int:
        """A replaced worker's running segments are lost (their tickets go to new segments), and it is never
        admitted again, whatever it still sends before it is gone."""
        async with self._changed:
            self.replaced.add((worker_id, incarnation))
            lost = [k for k in self.running if k[:2] == (worker_id, incarnation)]
            for k in lost:
                self.gate.drop(self.running.pop(k))
            self._changed.notify_all()
            return len(lost)

    async def take(self, most: int, timeout: float) -> list[Segment]:
        """Finished segments of the current global batch (at least one, at most `most`), or [] after `timeout`."""
        async with self._changed:
            try:
                await asyncio.wait_for(self._changed.wait_for(lambda: bool(self.ready.get(self.version))), timeout)
            except asyncio.TimeoutError:
                return []
            queue = self.ready[self.version]
            out, self.ready[self.version] = queue[:most], queue[most:]
        for s in out:
            self.gate.consumed(self.version, s.version)
        return out

    async def set_version(self, version: int) -> None:
        """The learner stepped and the inference servers act with `version`: new segments start at it."""
        async with self._changed:
            self.ready.pop(self.version, None)
            self.version = version
            self._changed.notify_all()

    async def close(self) -> None:
        async with self._changed:
            self.closed = True
            self._changed.notify_all()

    def stats(self) -> dict:
        return {"staleness_histogram": {str(k): v for k, v in sorted(self.gate.lags.items())},
                "dropped_segments": self.gate.dropped, "accepted_segments": self.gate.accepted,
                "running_segments": len(self.gate.running), "admission_wait_s": self.wait_s}


TrajectoryBuffer = ray.remote(num_cpus=0)(TrajectoryBufferCore)


# -- the learner ----------------------------------------------------------------------------------------
@ray.remote(num_cpus=0)
class LearnerWorker:
    """One learner rank. `address()` then `start(...)` on every rank at once: ranks > 1 form a DDP group
    whose TCP store lives on rank 0's node."""

    def __init__(self, policy_dir: str, sde: FlowSDE, n_action_steps: int, run, threads: int, privileged: tuple):
        from kilovla.rl.algorithms import algorithm

        torch.set_num_threads(threads)
        torch.manual_seed(0)
        self.algorithm, self.run = algorithm(run.algo.name), run  # run: algorithm.LearnerRun
        self.model = self.algorithm.load_agent(policy_dir, run.algo, sde, n_action_steps, privileged).eval()  # no dropout
        self.busy = _Busy()

    def address(self) -> tuple[str, int]:
        """This node's address and a free port on it, for a process group's store."""
        import socket

        with socket.socket() as sock:
            sock.bind(("", 0))
            return ray.util.get_node_ip_address(), sock.getsockname()[1]

    def start(self, rank: int = 0, world_size: int = 1, store: tuple | None = None) -> None:
        from kilovla.train import distributed

        if world_size > 1:
            import torch.distributed as dist

            host, port = store
            dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo",
                                    init_method=f"tcp://{host}:{port}", rank=rank, world_size=world_size)
        self.learner = self.algorithm.learner(self.model, self.run, distributed.World(rank=rank, size=world_size))

    def consume(self, segments: list[Segment]) -> dict | None:
        t0 = time.monotonic()
        out = self.learner.consume(segments)
        self.busy.add(time.monotonic() - t0)
        return out

    def weights(self) -> dict:
        return self.learner.weights()

    def join_weight_channel(self, host: str, port: int, timeout_s: float) -> None:
        self.channel = WeightChannel(host, port, 0, timeout_s)

    def send_weights(self) -> None:
        self.channel.broadcast(list(self.model.acting_module().state_dict().values()))

    def state(self) -> dict:
        return self.learner.state_dict()

    def load_state(self, state: dict) -> None:
        self.learner.load_state_dict(state)

    def busy_fraction(self) -> float:
        return self.busy.fraction()

