"""Many envs, stepped together: `EnvPool`.

Envs are spread over `num_workers` processes, several per process, each process stepping its envs
in turn (rendering is the cost; 2 processes use 2 cores). `num_workers=0` keeps every env in the
calling process. Workers start with "forkserver": a process that has rendered must not fork
renderers (they hang in software GL), and forkserver never inherits a GL context.

Every env gets its own seed per episode, so a run is reproducible whatever the worker count.
A crashed worker raises `EnvCrashed` naming the envs (and their tasks and seeds) that were lost.

`rebuild(configs)` swaps the envs (the next task) inside the same worker processes: a new pool of 5
Meta-World envs in 2 workers took ~2.4 s to its first observations (the simulator imported, the first
GL context, every renderer made), a rebuilt one ~1 s (each env ~0.1 s, its renderer ~0.4 s). Each
worker's software GL (llvmpipe) renders with the worker's share of the cores: on 2 cores with 2
workers, in the worker's own thread (`LP_NUM_THREADS=0`), which renders the same pixels ~10 % faster
than llvmpipe's default of a render thread per core in every process.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import traceback
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from kilovla.errors import KilovlaError


@dataclass(frozen=True)
class EnvConfig:
    """How to build one env: simulator name, kwargs for it, and an optional latency model."""

    env: str
    kwargs: dict
    latency: dict | None = None

    def build(self):
        from kilovla.envs.base import make_env
        from kilovla.envs.latency import LatencyModel, LatencyWrapper

        env = make_env(self.env, **self.kwargs)
        return LatencyWrapper(env, LatencyModel(**self.latency)) if self.latency else env


class EnvCrashed(RuntimeError):
    def __init__(self, envs: list[int], detail: str):
        self.envs = envs
        self.seeds: list[int] = []  # filled in by run_episodes: the episodes that were running
        super().__init__(f"env worker crashed (envs {envs}): {detail}")


def _build(conn, configs: list[EnvConfig]) -> list | None:
    """The worker's envs, and "ready" to the parent; None (and the error to the parent) where one cannot be built."""
    try:
        envs = [c.build() for c in configs]
    except BaseException as e:  # report construction errors to the parent instead of dying silently
        conn.send(("error", f"{type(e).__name__}: {e}"))
        return None
    conn.send(("ready", None))
    return envs


def gl_threads(num_workers: int) -> int:
    """llvmpipe's render threads per env worker: the worker's share of this process's cores, 0 (render in the
    worker's own thread) where that is one core."""
    share = len(os.sched_getaffinity(0)) // max(num_workers, 1)
    return share if share > 1 else 0


def _worker(conn, configs: list[EnvConfig], threads: int) -> None:
    # read when the first GL context is made; a value the forkserver was started with (a user's) wins
    os.environ.setdefault("LP_NUM_THREADS", str(threads))
    envs = _build(conn, configs)
    if envs is None:
        return
    while True:
        cmd, arg = conn.recv()
        try:
            if cmd == "build":
                for env in envs:
                    env.close()
                envs = _build(conn, arg)
                if envs is None:
                    return
            elif cmd == "reset":
                conn.send(("ok", [env.reset(seed=s) if s is not None else None for env, s in zip(envs, arg)]))
            elif cmd == "step":
                conn.send(("ok", [env.step(a) if a is not None else None for env, a in zip(envs, arg)]))
            elif cmd == "call":
                name, args = arg
                conn.send(("ok", [getattr(env.unwrapped, name)(*args) for env in envs]))
            elif cmd == "render":
                conn.send(("ok", [_set_rendering(env, on) for env, on in zip(envs, arg)]))
            elif cmd == "close":
                for env in envs:
                    env.close()
                conn.send(("ok", None))
                return
        except BaseException as e:
            conn.send(("error", f"{type(e).__name__}: {e}\n{traceback.format_exc(limit=3)}"))


def _set_rendering(env, on: bool | None) -> None:
    """Camera images in this env's next observations or not, where the env can skip them (None: leave as is)."""
    switch = getattr(env.unwrapped, "set_rendering", None)
    if on is not None and switch is not None:
        switch(on)


class EnvPool:
    """`reset(seeds)` and `step(actions)` over N envs; None in a slot leaves that env alone."""

    def __init__(self, configs: Sequence[EnvConfig], num_workers: int = 0, context: str = "forkserver"):
        self.num_workers = min(num_workers, len(configs))
        self._context = context
        self._take(configs)
        self._start()

    def _start(self) -> None:
        """`configs`' envs, in this process or in new worker processes."""
        if self.num_workers == 0:
            self._envs = [c.build() for c in self.configs]
            return
        ctx = mp.get_context(self._context)
        self._conns, self._procs = [], []
        self._broken = False  # a command failed part-way: the workers' replies may be out of step
        for idx in self._slices:
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_worker, daemon=True,
                               args=(child, [self.configs[i] for i in idx], gl_threads(self.num_workers)))
            proc.start()
            child.close()
            self._conns.append(parent)
            self._procs.append(proc)
        self._await_built()

    def _take(self, configs: Sequence[EnvConfig]) -> None:
        if not configs:
            raise KilovlaError("an env pool needs at least one env")
        self.configs = list(configs)
        self.num_envs = len(configs)
        if self.num_workers:
            self._slices = [s.tolist() for s in np.array_split(np.arange(self.num_envs), self.num_workers)]

    def _await_built(self) -> None:
        for w in range(self.num_workers):
            status, detail = self._recv(w)
            if status == "error":
                self.close()
                raise KilovlaError(f"cannot build envs {self._slices[w]}: {detail}")

    def rebuild(self, configs: Sequence[EnvConfig]) -> None:
        """Replace every env with those of `configs` (any number: a worker may hold none), in the same worker
        processes; in new ones where a worker has died (between tasks, or with envs it could not build) or a command
        failed part-way (a crashed env) and left them out of step."""
        # in this process, or a worker died between tasks, or replies out of step: start afresh
        restart = self.num_workers == 0 or self._broken or not all(proc.is_alive() for proc in self._procs)
        self._take(configs)
        if restart:
            self.close()
            self._start()
            return
        for w, idx in enumerate(self._slices):
            self._send(w, ("build", [self.configs[i] for i in idx]))
        self._await_built()

    def _recv(self, w: int):
        try:
            return self._conns[w].recv()
        except (EOFError, ConnectionResetError, OSError):
            self._broken = True
            raise EnvCrashed(self._slices[w], f"worker process {self._procs[w].pid} died "
                             f"(exit code {self._procs[w].exitcode})") from None

    def _send(self, w: int, message) -> None:
        try:
            self._conns[w].send(message)
        except (BrokenPipeError, OSError):
            self._broken = True
            raise EnvCrashed(self._slices[w], "worker process is gone") from None

    def _run(self, cmd: str, per_env: list) -> list:
        if self.num_workers == 0:
            envs = self._envs
            if cmd == "reset":
                return [e.reset(seed=s) if s is not None else None for e, s in zip(envs, per_env)]
            if cmd == "step":
                return [e.step(a) if a is not None else None for e, a in zip(envs, per_env)]
            if cmd == "render":
                return [_set_rendering(e, on) for e, on in zip(envs, per_env)]
            name, args = per_env
            return [getattr(e.unwrapped, name)(*args) for e in envs]
        for w, idx in enumerate(self._slices):
            self._send(w, (cmd, per_env if cmd == "call" else [per_env[i] for i in idx]))
        out = []
        for w in range(self.num_workers):
            status, result = self._recv(w)
            if status == "error":
                self._broken = True
                raise EnvCrashed(self._slices[w], result)
            out += result
        return out

    def reset(self, seeds: Sequence[int | None]) -> list:
        """(obs, info) per env; envs whose seed is None are not reset (None in their slot)."""
        return self._run("reset", list(seeds))

    def step(self, actions: Sequence[np.ndarray | None]) -> list:
        """(obs, reward, terminated, truncated, info) per env; None actions skip that env."""
        return self._run("step", list(actions))

    def set_rendering(self, flags: Sequence[bool | None]) -> None:
        """Per env: render camera images in the next observations (True), skip them (False), or leave it."""
        self._run("render", list(flags))

    def call(self, method: str, *args) -> list:
        """`env.unwrapped.<method>(*args)` on every env."""
        return self._run("call", (method, args))

    def close(self) -> None:
        if self.num_workers == 0:
            for env in getattr(self, "_envs", []):
                env.close()
            return
        for conn, proc in zip(self._conns, self._procs):
            try:
                conn.send(("close", None))
                conn.recv()
            except (BrokenPipeError, EOFError, OSError):
                pass
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class WarmPool:
    """One `EnvPool` across a run of tasks: `with_envs(configs)` returns it holding `configs`' envs, its workers
    started on the first call and kept warm for the next ones (`EnvPool.rebuild`)."""

    def __init__(self, num_workers: int = 0):
        self.num_workers = num_workers
        self.pool: EnvPool | None = None

    def with_envs(self, configs: Sequence[EnvConfig]) -> EnvPool:
        if self.pool is None:
            self.pool = EnvPool(configs, num_workers=self.num_workers)
        else:
            self.pool.rebuild(configs)
        return self.pool

    def close(self) -> None:
        if self.pool is not None:
            self.pool.close()
            self.pool = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
