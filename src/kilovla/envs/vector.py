"""Many envs, stepped together: `EnvPool`.

Envs are spread over `num_workers` processes, several per process, each process stepping its envs
in turn (rendering is the cost; 2 processes use 2 cores). `num_workers=0` keeps every env in the
calling process. Workers start with "forkserver": a process that has rendered must not fork
renderers (they hang in software GL), and forkserver never inherits a GL context.

Every env gets its own seed per episode, so a run is reproducible whatever the worker count.
A crashed worker raises `EnvCrashed` naming the envs (and their tasks and seeds) that were lost.
"""

from __future__ import annotations

import multiprocessing as mp
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


def _worker(conn, configs: list[EnvConfig]) -> None:
    try:
        envs = [c.build() for c in configs]
    except BaseException as e:  # report construction errors to the parent instead of dying silently
        conn.send(("error", f"{type(e).__name__}: {e}"))
        return
    conn.send(("ready", None))
    while True:
        cmd, arg = conn.recv()
        try:
            if cmd == "reset":
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
        if not configs:
            raise KilovlaError("an env pool needs at least one env")
        self.configs = list(configs)
        self.num_envs = len(configs)
        self.num_workers = min(num_workers, self.num_envs)
        if self.num_workers == 0:
            self._envs = [c.build() for c in self.configs]
            return
        self._slices = [s.tolist() for s in np.array_split(np.arange(self.num_envs), self.num_workers)]
        ctx = mp.get_context(context)
        self._conns, self._procs = [], []
        for idx in self._slices:
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_worker, args=(child, [self.configs[i] for i in idx]), daemon=True)
            proc.start()
            child.close()
            self._conns.append(parent)
            self._procs.append(proc)
        for w in range(self.num_workers):
            status, detail = self._recv(w)
            if status == "error":
                self.close()
                raise KilovlaError(f"cannot build envs {self._slices[w]}: {detail}")

    def _recv(self, w: int):
        try:
            return self._conns[w].recv()
        except (EOFError, ConnectionResetError, OSError):
            raise EnvCrashed(self._slices[w], f"worker process {self._procs[w].pid} died "
                             f"(exit code {self._procs[w].exitcode})") from None

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
            arg = per_env if cmd == "call" else [per_env[i] for i in idx]
            try:
                self._conns[w].send((cmd, arg))
            except (BrokenPipeError, OSError):
                raise EnvCrashed(idx, "worker process is gone") from None
        out = []
        for w in range(self.num_workers):
            status, result = self._recv(w)
            if status == "error":
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
