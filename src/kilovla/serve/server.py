"""`kilovla serve`: a policy folder behind openpi's websocket protocol, batched across robots.

    kilovla serve --policy.path=DIR [--serve.host=127.0.0.1] [--serve.port=8000] [--serve.max_batch=16]
                  [--serve.max_wait_ms=5] [--serve.api_key=KEY] [--serve.layout=auto|lerobot|libero|droid]
                  [--serve.map=REQUEST_KEY=POLICY_KEY ...]

One asyncio event loop speaks the protocol (`protocol.py`): the metadata frame on connect, msgpack
requests and `{"actions", "server_timing", "policy_timing"}` replies, `GET /healthz`, the
`Authorization: Api-Key` check before the upgrade. The model runs on one inference thread, never on
the loop, so handshakes, pings and health checks stay responsive while it computes. Requests of
every connection go into one `DynamicBatcher`, run by the shared `BatchingLoop`: when the model is free and a batch is ready (full at
`serve.max_batch`, its oldest request has waited `serve.max_wait_ms`, or every open connection is already
queued), the queued requests run as one forward, and each reply goes back to the connection that asked. `--serve.max_batch=1` serves one request
at a time, as openpi does.

Errors: a malformed frame or observation gets a text frame naming the problem and the connection
stays open; a failure inside the model gets a text frame and close 1011 for the connections of that
batch, and the server keeps serving. RoboArena's variant: the `endpoint` field is stripped, "reset"
is answered with the text "reset successful". SIGTERM (or SIGINT) stops accepting connections,
answers what is queued or running, then exits.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import os
import signal
import socket
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from http import HTTPStatus

import numpy as np

from kilovla.batching import BatchingLoop, DynamicBatcher
from kilovla.errors import KilovlaError
from kilovla.serve.engine import PolicyEngine, Request, Rtc
from kilovla.serve.protocol import BadRequest, packb, to_policy_observation, unpackb

log = logging.getLogger(__name__)
LOCAL_HOSTS = ("127.0.0.1", "localhost", "::1")
RTC_FIELDS = ("inference_delay", "prefix", "execution_horizon", "max_guidance_weight")
MAX_GUIDANCE_WEIGHT = 100.0  # LeRobot uses 10 for 10-step flow; far beyond it guidance only overshoots


@dataclass
class ServeConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    max_batch: int = 16
    max_wait_ms: float = 5.0
    api_key: str | None = None
    max_message_mb: float | None = None  # None: no cap (openpi's default)
    layout: str | None = None  # None: detected per request
    mapping: dict[str, str] = field(default_factory=dict)


class PolicyServer:
    def __init__(self, engine: PolicyEngine, cfg: ServeConfig):
        if cfg.max_batch < 1 or cfg.max_wait_ms < 0:
            raise KilovlaError(f"--serve.max_batch must be >= 1 and --serve.max_wait_ms >= 0, got {cfg.max_batch}, {cfg.max_wait_ms}")
        self.engine, self.cfg = engine, cfg
        self.inputs = engine.inputs()
        self.inputs.mapping = dict(cfg.mapping)
        self.metadata = engine.metadata()
        self.batcher = DynamicBatcher(cfg.max_batch, cfg.max_wait_ms / 1e3)
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kilovla-infer")
        self.answered = 0  # replies sent with actions
        self.in_flight = 0  # requests queued or in a running batch
        self.connections = 0  # open connections: each has at most one request in flight (openpi is lock-step)
        self.stopping = False  # SIGTERM came: what is queued is answered, nothing new is taken
        self.batching: BatchingLoop | None = None  # made by `serve`, in its event loop
        known = {*self.inputs.cameras, *self.inputs.state_keys, "task"}
        wrong = {k: v for k, v in self.inputs.mapping.items() if v not in known}
        if wrong:
            raise KilovlaError(f"--serve.map {', '.join(f'{k}={v}' for k, v in wrong.items())}: not a key of the policy "
                               f"(its keys: {', '.join(sorted(known))})")

    # -- HTTP before the upgrade ---------------------------------------------------------------------
    def _process_request(self, connection, request):
        if request.path == "/healthz":
            return connection.respond(HTTPStatus.OK, "OK\n")
        if self.cfg.api_key is not None:
            given = request.headers.get("Authorization", "")
            if not hmac.compare_digest(given.encode(), f"Api-Key {self.cfg.api_key}".encode()):
                return connection.respond(HTTPStatus.UNAUTHORIZED, "missing or wrong Authorization: Api-Key header\n")
        return None

    # -- one connection ------------------------------------------------------------------------------
    async def _handle(self, ws) -> None:
        from websockets.exceptions import ConnectionClosed

        self.connections += 1
        try:
            await ws.send(packb(self.metadata))
            last = None
            async for message in ws:
                if self.stopping:
                    await ws.close(1001, "server shutting down")
                    return
                start = time.monotonic()
                reply = await self._answer(message)
                if isinstance(reply, _Failure):
                    await ws.send(reply.text)
                    await ws.close(1011, "Internal server error. Traceback included in previous frame.")
                    return
                if isinstance(reply, dict) and last is not None:
                    reply["server_timing"]["prev_total_ms"] = 1e3 * (start - last)
                await ws.send(reply if isinstance(reply, str) else packb(reply))
                last = start
        except ConnectionClosed:
            return
        finally:
            self.connections -= 1

    async def _answer(self, message) -> dict | str | _Failure:
        """A reply frame for one message: a dict (packed), a text (an error naming the problem, or
        RoboArena's reset), or a failure that closes the connection."""
        if isinstance(message, str):
            return "bad request: send msgpack binary frames (openpi's protocol), not text"
        try:
            obs = unpackb(message)
            if not isinstance(obs, dict):
                raise BadRequest(f"a request must be a map of observation keys, got {type(obs).__name__}")
            obs = dict(obs)
            endpoint = obs.pop("endpoint", "infer")
            if not isinstance(endpoint, str) or endpoint not in ("infer", "reset"):
                raise BadRequest(f"endpoint must be 'infer' or 'reset', got {endpoint!r}"[:200])
            if endpoint == "reset":
                return "reset successful"
            seed, noise = obs.pop("seed", None), obs.pop("noise", None)
            if seed is not None and (not isinstance(seed, (int, np.integer)) or isinstance(seed, bool)
                                     or not 0 <= int(seed) < 2**63):
                raise BadRequest(f"seed must be an integer in [0, 2^63), got {seed!r}")
            seed = None if seed is None else int(seed)
            shape = tuple(self.metadata["noise_shape"])
            if noise is not None and (not hasattr(noise, "shape") or tuple(noise.shape) != shape
                                      or noise.dtype.kind != "f" or not np.isfinite(noise).all()):
                raise BadRequest(f"noise must be a finite float array of shape {list(shape)}")
            rtc = self._rtc(obs.pop("rtc", None))
            request = Request(to_policy_observation(obs, self.inputs, self.cfg.layout), seed, noise, rtc)
        except (BadRequest, ValueError, TypeError, KeyError, AttributeError, OverflowError, MemoryError) as e:
            # whatever a malformed request trips over is its own fault: said to it, the connection stays
            return f"bad request: {e if isinstance(e, BadRequest) else f'{type(e).__name__}: {e}'}"[:2000]
        t0 = time.monotonic()
        self.in_flight += 1
        try:
            actions, infer_ms = await self.batching.submit(request, t0)
        except Exception:  # noqa: BLE001  the model failed on this batch: reported like openpi does
            return _Failure(traceback.format_exc())
        finally:
            self.in_flight -= 1
        self.answered += 1
        return {"actions": actions, "policy_timing": {"infer_ms": infer_ms},
                "server_timing": {"infer_ms": 1e3 * (time.monotonic() - t0)}}

    def _rtc(self, spec) -> Rtc | None:
        """`obs["rtc"] = {"inference_delay": d, "prefix": (k, action_dim) array in action units,
        "execution_horizon": s (optional), "max_guidance_weight": beta (optional)}`."""
        if spec is None:
            return None
        if not self.engine.supports_rtc:
            raise BadRequest(f"rtc: {self.metadata['model']} is an RL residual policy, whose correction real-time "
                             "chunking would not guide; it refuses rtc")
        if not isinstance(spec, dict) or "prefix" not in spec or "inference_delay" not in spec:
            raise BadRequest("rtc must be a map with 'inference_delay' and 'prefix'")
        unknown = sorted(set(spec) - set(RTC_FIELDS), key=str)
        if unknown:
            raise BadRequest(f"rtc: unknown field(s) {unknown}; known: {', '.join(RTC_FIELDS)}")
        prefix, d = spec["prefix"], spec["inference_delay"]
        dim = self.metadata["action_dim"]
        if not isinstance(prefix, np.ndarray) or prefix.ndim != 2 or prefix.shape[1] != dim or not len(prefix) \
                or prefix.dtype.kind not in "fiu" or not np.isfinite(prefix).all():
            got = list(prefix.shape) if isinstance(prefix, np.ndarray) else type(prefix).__name__
            raise BadRequest(f"rtc.prefix must be a finite (k, {dim}) array with k >= 1, got {got}")
        s = spec.get("execution_horizon")
        for name, value in (("inference_delay", d), ("execution_horizon", s)):
            if value is not None and (not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < 0):
                raise BadRequest(f"rtc.{name} must be an integer >= 0, got {value!r}")
        if d > len(prefix):
            raise BadRequest(f"rtc.inference_delay {d} is longer than the prefix ({len(prefix)} actions): the "
                             "actions that execute before the new chunk arrives must be in the prefix")
        beta = spec.get("max_guidance_weight", 10.0)
        if not isinstance(beta, (int, float, np.floating, np.integer)) or isinstance(beta, bool) \
                or not 0 < beta <= MAX_GUIDANCE_WEIGHT:
            raise BadRequest(f"rtc.max_guidance_weight must be a number in (0, {MAX_GUIDANCE_WEIGHT:g}], got {beta!r}")
        return Rtc(np.asarray(prefix, np.float32), int(d), None if s is None else int(s), float(beta))

    # -- batching ------------------------------------------------------------------------------------
    def _forward(self, requests: list[Request]) -> list[tuple[np.ndarray, float]]:
        """On the inference thread: one forward over the batch -> (chunk, the forward's ms) per request."""
        chunks, infer_ms = self.engine.infer(requests)
        return [(chunk, infer_ms) for chunk in chunks]

    def _all_queued(self, queued: int) -> bool:
        # Every open connection is already waiting in the queue: no one else can join this batch.
        return queued >= self.connections

    # -- the server ----------------------------------------------------------------------------------
    async def serve(self, ready=None, stop: asyncio.Event | None = None) -> None:
        """Serve until SIGTERM / SIGINT (or `stop` is set); `ready(port)` is called once listening."""
        from websockets.asyncio.server import serve

        loop = asyncio.get_running_loop()
        self.batching = BatchingLoop(self.batcher, self._forward, self.executor, all_queued=self._all_queued)
        stop = stop or asyncio.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            try:
                loop.add_signal_handler(sig, stop.set)
            except (ValueError, RuntimeError):  # not the main thread (tests): `stop` only
                pass
        max_size = None if self.cfg.max_message_mb is None else int(self.cfg.max_message_mb * 2**20)
        batches = asyncio.create_task(self.batching.run())
        async with contextlib.AsyncExitStack() as listening:
            try:
                server = await listening.enter_async_context(
                    serve(self._handle, self.cfg.host, self.cfg.port, compression=None, max_size=max_size,
                          process_request=self._process_request))
            except OSError as e:  # the port is taken, or the host is not this machine's
                batches.cancel()
                self.executor.shutdown(wait=False)
                raise KilovlaError(_cannot_listen(self.cfg.host, self.cfg.port, e)) from None
            port = server.sockets[0].getsockname()[1]
            if ready is not None:
                ready(port)
            await stop.wait()
            self.stopping = True  # open connections get what they asked before now, then 1001
            server.close(close_connections=False)  # no new connections
            while self.in_flight:
                await asyncio.sleep(0.01)
            for ws in list(server.connections):
                await ws.close(1001, "server shutting down")
        batches.cancel()
        self.executor.shutdown(wait=True)


@dataclass
class _Failure:
    text: str


def _cannot_listen(host: str, port: int, e: OSError) -> str:
    # asyncio's strerror repeats the address; getaddrinfo's errors have negative numbers of their own
    reason = os.strerror(e.errno) if e.errno and e.errno > 0 else (e.strerror or str(e))
    return f"--serve.host/--serve.port {host}:{port}: cannot listen there: {reason}"


def check_listenable(host: str, port: int) -> None:
    """KilovlaError naming host:port unless a server could listen there now (bound as asyncio binds,
    with SO_REUSEADDR, then released): `run` asks before it spends minutes loading the policy."""
    if not 0 <= port <= 65535:
        raise KilovlaError(f"--serve.port {port}: must be in 0..65535 (0: any free port)")
    try:
        addresses = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise KilovlaError(_cannot_listen(host, port, e)) from None
    for family, kind, proto, _, address in addresses:
        with socket.socket(family, kind, proto) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                sock.bind(address)
            except OSError as e:
                raise KilovlaError(_cannot_listen(host, port, e)) from None


def run(policy: str, cfg: ServeConfig, device: str = "auto", ema: bool = False, precision: str = "auto",
        cuda_graphs: bool = True) -> int:
    """`kilovla serve`: load the policy, warm it up, serve until SIGTERM."""
    check_listenable(cfg.host, cfg.port)
    if cfg.api_key is None and cfg.host not in LOCAL_HOSTS:
        log.warning("listening on %s without --serve.api_key: anyone who can reach this port can run the policy", cfg.host)
    engine = PolicyEngine.load(policy, device=device, ema=ema, precision=precision, cuda_graphs=cuda_graphs)
    engine.warm_up()
    server = PolicyServer(engine, cfg)

    def ready(port: int) -> None:
        print(f"kilovla serve: {engine.policy.name} from {engine.folder} on ws://{cfg.host}:{port} ({engine.device} "
              f"{'bf16' if engine.bf16 else 'fp32'}{', CUDA graphs' if engine.sampler.enabled else ''}, "
              f"batches of up to {cfg.max_batch} within {cfg.max_wait_ms:g} ms"
              f"{', api key required' if cfg.api_key else ''})", flush=True)

    asyncio.run(server.serve(ready))
    stats = server.batcher.stats.summary()
    print(f"kilovla serve: stopped after {server.answered} replies ({stats['batches']} batches, mean batch "
          f"{stats['mean_batch_size']:.2f}, queue wait p99 {1e3 * stats['queue_wait_p99_s']:.1f} ms)", flush=True)
    return 0
