"""`kilovla bench serve`: what dynamic batching across connections buys `kilovla serve`.

Every measurement is a real server process (`python -m kilovla serve --policy.path=DIR --serve.port=0 ...`) and
N client processes, each with its own openpi-client `WebsocketClientPolicy` connection, sending
requests in a closed loop (send, wait for the reply, send again). Baseline: the same server with
batching off (`--serve.max_batch=1`, one request at a time as openpi serves); ours: `--serve.max_batch=16
--serve.max_wait_ms=5`. Baseline and ours runs alternate, so drift on a shared box hits both.

Rows:

- serve_requests_per_s_{1,4,16}: replies per second, first send to last reply, with 1, 4, 16 clients;
- serve_p50_ms_16 / serve_p99_ms_16: per-request latency (send -> reply, at the client), 16 clients;
- serve_rss_growth_mb (ours only): the server's RSS after minus before a load of 1000 requests over
  64 connections (256 in `--quick`), and whether every request was answered exactly once: each
  client got one reply per request and no frame more, and the server's `stopped after N replies`
  equals the requests all clients sent.

A client's requests carry the policy's own keys (the metadata frame's `observation_keys`) at its
training resolution (`image_size`): random uint8 images and a random state. The mean batch size in
the notes is measured from the replies: every request of one forward gets the same
`policy_timing.infer_ms`, so distinct values count forwards.

    path = run(quick=True, out_dir="bench-results", policy=None)   # -> bench-results/serve.json

The policy is `--policy.path=DIR`; else in `--quick` the one `kilovla demo --quick` trains into
OUT/serve-demo-quick (kept for the next run), in full the `make demo` checkpoint (demo-output/),
trained with the demo's full recipe into OUT/serve-demo when there is none.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from kilovla.bench.common import DEFAULT_OUT, Row, write_suite
from kilovla.errors import KilovlaError
from kilovla.progress import note

CLIENT_COUNTS = (1, 4, 16)
OURS_MAX_BATCH = 16
# Tuned once (2 shared CPU cores, 16 clients, the quick demo policy, 6 s runs): 2, 5 and 10 ms gave
# 74-163 requests/s, within the box's noise, all ~7x batching off; batches average ~8 (the clients
# split into two groups, one queuing while the other's forward runs), so a longer wait buys little.
OURS_MAX_WAIT_MS = 5.0
PROMPT = "reach the goal"


@dataclass(frozen=True, kw_only=True, slots=True)
class ServeBenchSize:
    duration_s: float  # each closed-loop throughput measurement
    repeats: int  # baseline/ours pairs per client count, interleaved
    warmup: int  # requests each client sends before the clock starts
    load_requests: int  # the RSS row's load ...
    load_connections: int  # ... over this many client processes


FULL = ServeBenchSize(duration_s=20.0, repeats=3, warmup=3, load_requests=1000, load_connections=64)
QUICK = ServeBenchSize(duration_s=6.0, repeats=1, warmup=2, load_requests=256, load_connections=64)


# -- the client: one process, one connection ----------------------------------------------------
def state_widths(policy: str | Path) -> dict[str, int]:
    """Each state key's width, from the folder's policy.json stats (the metadata frame gives only
    their sum, `state_dim`): {"observation.state": 4, "observation.environment_state": 39}."""
    from kilovla.policy_folder import PolicyFolder

    declared = PolicyFolder.open(policy).interface()
    return dict(zip(declared.state_keys, declared.checked_state_widths()))


def observations(metadata: dict, widths: dict[str, int], rng: np.random.Generator, n: int) -> list[dict]:
    """`n` random requests in the policy's own keys, at its training resolution.

    {"cameras": ["observation.images.scene"], "image_size": [32, 32], ...}, {"observation.state": 4}
    -> [{"observation.images.scene": (32, 32, 3) uint8, "observation.state": (4,) float32, "task": ...}, ...]
    """
    h, w = metadata["image_size"] or (96, 96)
    out = []
    for _ in range(n):
        obs = {cam: rng.integers(0, 256, (h, w, 3), dtype=np.uint8) for cam in metadata["cameras"]}
        obs.update({key: rng.standard_normal(widths[key]).astype(np.float32) for key in metadata["state_keys"]})
        obs["task"] = PROMPT
        out.append(obs)
    return out


def client_main(port: int, seed: int, warmup: int, duration_s: float, requests: int, widths: dict[str, int]) -> None:
    """One client process: connect, `warmup` requests, print `ready`, wait for `go` on stdin, then a
    closed loop for `duration_s` seconds (or `requests` requests when duration_s is 0); print one JSON line."""
    from openpi_client import websocket_client_policy

    report: dict = {"sent": 0, "answered": 0, "bad_replies": 0, "extra_frames": 0, "latency_ms": [], "infer_ms": []}
    try:
        client = websocket_client_policy.WebsocketClientPolicy(host="127.0.0.1", port=port)
        meta = client.get_server_metadata()
        pool = observations(meta, widths, np.random.default_rng(seed), 4)
        shape = (meta["action_horizon"], meta["action_dim"])
        for i in range(warmup):
            report["sent"] += 1
            _check(client.infer(pool[i % len(pool)]), shape, report)
        print(json.dumps({"ready": True}), flush=True)
        sys.stdin.readline()  # "go": every client starts together
        t0 = time.monotonic()
        deadline = t0 + duration_s
        report["t_first"] = t0
        i = 0
        while (time.monotonic() < deadline) if duration_s > 0 else (i < requests):
            obs = pool[i % len(pool)]
            i += 1
            report["sent"] += 1
            start = time.monotonic()
            reply = client.infer(obs)
            report["latency_ms"].append(1e3 * (time.monotonic() - start))
            report["infer_ms"].append(float(reply.get("policy_timing", {}).get("infer_ms", -1.0)))
            _check(reply, shape, report)
        report["t_last"] = time.monotonic()
        report["measured"] = i
        try:  # a second reply to any request would be waiting by now; the client's socket is its own
            client._ws.recv(timeout=0.3)
            report["extra_frames"] += 1
        except TimeoutError:
            pass
        client._ws.close()
        report["metadata"] = {k: meta.get(k) for k in ("model", "image_size", "device", "action_horizon")}
    except Exception as e:  # noqa: BLE001  reported to the parent, which names the client
        report["error"] = f"{type(e).__name__}: {e}"
    print(json.dumps(report), flush=True)


def _check(reply: dict, shape: tuple, report: dict) -> None:
    actions = np.asarray(reply.get("actions")) if isinstance(reply, dict) else None
    if actions is not None and actions.shape == tuple(shape) and np.isfinite(actions).all():
        report["answered"] += 1
    else:
        report["bad_replies"] += 1


# -- the server and the clients as processes ------------------------------------------------------
class ServerProcess:
    """`python -m kilovla serve --serve.port=0` as a child; `port` from its first stdout line."""

    def __init__(self, policy: str, max_batch: int, max_wait_ms: float, log_dir: Path):
        env = {k: v for k, v in os.environ.items() if k != "KILOVLA_API_KEY"}  # loopback, no key
        self.log = log_dir / f"server-b{max_batch}-{time.monotonic_ns()}.log"
        self._log_file = self.log.open("w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kilovla", "serve", f"--policy.path={policy}", "--serve.port=0",
             f"--serve.max_batch={max_batch}", f"--serve.max_wait_ms={max_wait_ms:g}"],
            stdout=subprocess.PIPE, stderr=self._log_file, text=True, env=env)
        for line in self.proc.stdout:
            match = re.search(r"on ws://127\.0\.0\.1:(\d+)", line)
            if match:
                self.port = int(match.group(1))
                return
        self.proc.wait()
        tail = self._tail()
        self._log_file.close()
        raise KilovlaError(f"kilovla serve exited ({self.proc.returncode}) before listening:\n{tail}")

    def rss_mb(self) -> float:
        import psutil

        return psutil.Process(self.proc.pid).memory_info().rss / 2**20

    def stop(self) -> int:
        """SIGTERM; the replies it says it sent (`stopped after N replies`)."""
        self.proc.send_signal(signal.SIGTERM)
        out, _ = self.proc.communicate(timeout=120)
        self._log_file.close()
        match = re.search(r"stopped after (\d+) replies", out)
        if self.proc.returncode != 0 or not match:
            raise KilovlaError(f"kilovla serve did not stop cleanly ({self.proc.returncode}):\n{out}\n{self._tail()}")
        return int(match.group(1))

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self._log_file.close()

    def _tail(self) -> str:
        self._log_file.flush()
        return "\n".join(self.log.read_text().splitlines()[-20:])


@dataclass
class Measurement:
    max_batch: int
    clients: int
    replies: int  # requests in the measured loop (each answered, else `exactly_once` is False)
    wall_s: float  # first send to last reply
    latency_ms: list[float]
    mean_batch: float
    sent: int  # every request, warm-up included
    server_replies: int
    exactly_once: bool
    rss_before_mb: float
    rss_after_mb: float
    metadata: dict = field(default_factory=dict)
    load_average: float = 0.0

    @property
    def requests_per_s(self) -> float:
        return self.replies / self.wall_s

    def summary(self) -> dict:
        return {"clients": self.clients, "max_batch": self.max_batch, "requests_per_s": self.requests_per_s,
                "replies": self.replies, "wall_s": self.wall_s, "mean_batch": self.mean_batch,
                "p50_ms": float(np.percentile(self.latency_ms, 50)),
                "p99_ms": float(np.percentile(self.latency_ms, 99)),
                "sent": self.sent, "server_replies": self.server_replies, "exactly_once": self.exactly_once,
                "rss_before_mb": self.rss_before_mb, "rss_after_mb": self.rss_after_mb,
                "load_average_1m_before": self.load_average}


def measure(policy: str, *, max_batch: int, max_wait_ms: float, clients: int, warmup: int, log_dir: Path,
            duration_s: float = 0.0, requests: int = 0) -> Measurement:
    """One server, `clients` client processes: a closed loop for `duration_s` s, or `requests`
    requests in all (split over the clients) when duration_s is 0."""
    kind = "batching off" if max_batch == 1 else f"max batch {max_batch}, wait {max_wait_ms:g} ms"
    load = f"{duration_s:g} s" if duration_s else f"{requests} requests"
    note(f"serve: {clients} clients, {kind}, {load}")
    load_average = os.getloadavg()[0]
    widths = state_widths(policy)
    server = ServerProcess(policy, max_batch, max_wait_ms, log_dir)
    procs = []
    try:
        for i in range(clients):
            share = requests // clients + (i < requests % clients)
            code = ("import sys; from kilovla.bench.serve import client_main; "
                    f"client_main({server.port}, {i}, {warmup}, {duration_s}, {share}, {widths!r})")
            procs.append(subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                          text=True))
        for i, p in enumerate(procs):
            line = json.loads(p.stdout.readline() or '{"error": "exited"}')
            if "error" in line:
                raise KilovlaError(f"bench serve client {i}: {line['error']}")
        before = server.rss_mb()
        for p in procs:
            p.stdin.write("go\n")
            p.stdin.flush()
        reports = []
        for i, p in enumerate(procs):
            report = json.loads(p.stdout.readline() or '{"error": "exited"}')
            if "error" in report:
                raise KilovlaError(f"bench serve client {i}: {report['error']}")
            reports.append(report)
            p.wait(timeout=60)
        time.sleep(0.5)  # the server handles the closes
        after = server.rss_mb()
        server_replies = server.stop()
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        server.kill()
    sent = sum(r["sent"] for r in reports)
    answered = sum(r["answered"] for r in reports)
    exactly_once = (all(r["answered"] == r["sent"] and not r["bad_replies"] and not r["extra_frames"] for r in reports)
                    and server_replies == sent == answered)
    infer_ms = [t for r in reports for t in r["infer_ms"]]
    return Measurement(max_batch=max_batch, clients=clients, replies=sum(r["measured"] for r in reports),
                       wall_s=max(r["t_last"] for r in reports) - min(r["t_first"] for r in reports),
                       latency_ms=[t for r in reports for t in r["latency_ms"]],
                       mean_batch=len(infer_ms) / max(1, len(set(infer_ms))), sent=sent,
                       server_replies=server_replies, exactly_once=exactly_once, rss_before_mb=before,
                       rss_after_mb=after, metadata=reports[0]["metadata"], load_average=load_average)


# -- the suite ----------------------------------------------------------------------------------
def demo_policy(out: Path, quick: bool) -> str:
    """The demo's policy: quick, `kilovla demo --quick` into OUT/serve-demo-quick (kept); full, the
    `make demo` checkpoint, else the demo's full recipe into OUT/serve-demo."""
    from kilovla.demo import run_demo
    from kilovla.train.checkpoint import latest

    if not quick:
        from kilovla.bench.rl import default_policy

        try:
            return default_policy()
        except KilovlaError:
            pass
    folder = out / ("serve-demo-quick" if quick else "serve-demo")
    found = latest(folder / "run" / "checkpoints")
    if found is not None:
        return str(found)
    note(f"serve: training the demo's policy ({'--quick' if quick else 'full recipe'}) into {folder}")
    return str(run_demo(out_dir=folder, quick=quick)["train"]["checkpoint"])


def run(*, quick: bool = False, out_dir: str | Path = DEFAULT_OUT, policy: str | None = None, console=None,
        size: ServeBenchSize | None = None) -> Path:
    size = size or (QUICK if quick else FULL)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    policy = str(policy or demo_policy(out, quick))
    runs: dict[tuple[int, int], list[Measurement]] = {}  # (clients, max batch) -> its runs
    with tempfile.TemporaryDirectory(prefix="kilovla-bench-serve-") as logs:
        for clients in CLIENT_COUNTS:
            for r in range(size.repeats):
                for max_batch in ((1, OURS_MAX_BATCH) if r % 2 == 0 else (OURS_MAX_BATCH, 1)):
                    runs.setdefault((clients, max_batch), []).append(measure(
                        policy, max_batch=max_batch, max_wait_ms=OURS_MAX_WAIT_MS, clients=clients,
                        warmup=size.warmup, duration_s=size.duration_s, log_dir=Path(logs)))
        load = measure(policy, max_batch=OURS_MAX_BATCH, max_wait_ms=OURS_MAX_WAIT_MS, clients=size.load_connections,
                       warmup=1, requests=size.load_requests, log_dir=Path(logs))
    every = [m for ms in runs.values() for m in ms] + [load]
    extra = {"policy": policy, "size": {k: getattr(size, k) for k in size.__slots__},
             "ours": {"max_batch": OURS_MAX_BATCH, "max_wait_ms": OURS_MAX_WAIT_MS},
             "exactly_once": all(m.exactly_once for m in every), "measurements": [m.summary() for m in every]}
    return write_suite("serve", suite_rows(runs, load, size, policy), quick=quick, out_dir=out, extra=extra,
                       console=console)


def suite_rows(runs: dict[tuple[int, int], list[Measurement]], load: Measurement, size: ServeBenchSize,
               policy: str) -> list[Row]:
    from kilovla.bench.common import machine_info

    machine = machine_info()
    meta = load.metadata
    busiest = max(m.load_average for m in [*(m for ms in runs.values() for m in ms), load])
    where = (f"policy {meta.get('model')} {Path(policy).name} at {'x'.join(map(str, meta.get('image_size') or []))} px "
             f"on {meta.get('device')}; {machine['cores']} cores {machine['cpu']}"
             f"{', ' + machine['gpu'] if machine['gpu'] else ''}, 1-min load average <= {busiest:.1f} before each run")
    ours_kind = f"max batch {OURS_MAX_BATCH}, wait {OURS_MAX_WAIT_MS:g} ms"
    rows = []
    for clients in CLIENT_COUNTS:
        base, ours = runs[(clients, 1)], runs[(clients, OURS_MAX_BATCH)]
        rows.append(Row.compare(
            f"serve_requests_per_s_{clients}", "requests/s", _median([m.requests_per_s for m in base]),
            _median([m.requests_per_s for m in ours]), higher_is_better=True,
            note=f"{clients} client processes, closed loop, {len(base)} x {size.duration_s:g} s per side (median, "
                 f"interleaved); {sum(m.replies for m in base)} / {sum(m.replies for m in ours)} requests; "
                 f"batching off vs {ours_kind} (mean batch {_mean([m.mean_batch for m in ours]):.1f}); {where}"))
    base, ours = runs[(16, 1)], runs[(16, OURS_MAX_BATCH)]
    lat_base = [t for m in base for t in m.latency_ms]
    lat_ours = [t for m in ours for t in m.latency_ms]
    for q in (50, 99):
        rows.append(Row.compare(
            f"serve_p{q}_ms_16", "ms", float(np.percentile(lat_base, q)), float(np.percentile(lat_ours, q)),
            higher_is_better=False,
            note=f"send -> reply at the client, 16 client processes, {len(lat_base)} / {len(lat_ours)} requests over "
                 f"{len(base)} x {size.duration_s:g} s; batching off vs {ours_kind}; {where}"))
    shrunk = f"; {size.load_requests} not 1000 in --quick" if size.load_requests != 1000 else ""
    rows.append(Row.compare(
        "serve_rss_growth_mb", "MiB", None, load.rss_after_mb - load.rss_before_mb, higher_is_better=False,
        note=f"server RSS {load.rss_before_mb:.0f} -> {load.rss_after_mb:.0f} MiB over {size.load_requests} requests "
             f"on {size.load_connections} connections (client processes, loopback{shrunk}), {ours_kind}, "
             f"{load.wall_s:.1f} s; exactly once: {'yes' if load.exactly_once else 'NO'} ({load.sent} sent incl. "
             f"{load.sent - load.replies} warm-up, {load.server_replies} replies by the server's count); {where}"))
    return rows


def _median(xs: list[float]) -> float:
    return float(np.median(xs))


def _mean(xs: list[float]) -> float:
    return float(np.mean(xs))
