"""`kilovla serve`: openpi's own client against a real server process; batching across connections
gives each request its alone-actions; errors keep the connection (or close it with 1011); SIGTERM drains."""

import asyncio
import contextlib
import os
import re
import signal
import subprocess
import sys
import threading
import urllib.error
import urllib.request

import numpy as np
import pytest

from kilovla.serve.protocol import BadRequest, PolicyInputs, packb, to_policy_observation, unpackb

pytest.importorskip("openpi_client")
# openpi-client 0.1.2 calls websockets' connect() outside a context manager
pytestmark = pytest.mark.filterwarnings("ignore:connect\\(\\) must be used as a context manager:DeprecationWarning")


@pytest.fixture(scope="module")
def policy_dir(reach_policy):
    return reach_policy()


@pytest.fixture(scope="module")
def engine(policy_dir):
    from kilovla.serve.engine import PolicyEngine

    return PolicyEngine.load(policy_dir, device="cpu")


@pytest.fixture(scope="module")
def smolvla_dir(reach_policy):
    """The same 2-step run with smolvla-tiny (chunks of 4, the scene and wrist cameras in its two slots)."""
    return reach_policy("--policy.preset=smolvla-tiny")


# GR00T's chunks of 4 as the others' (its horizon, not chunk_size)
GROOT_CHUNK = "--policy.overrides={action_horizon: 4}"


@pytest.fixture(scope="module", params=["pi05-tiny", "smolvla-tiny", "groot-tiny", "groot-n17-tiny"])
def family_engine(request):
    """The engine of each family (GR00T's flow runs its time the other way, converted in its velocity_field)."""
    from kilovla.serve.engine import PolicyEngine

    if request.param == "pi05-tiny":
        return request.getfixturevalue("engine")
    if request.param == "smolvla-tiny":
        return PolicyEngine.load(request.getfixturevalue("smolvla_dir"), device="cpu")
    folder = request.getfixturevalue("reach_policy")(f"--policy.preset={request.param}", GROOT_CHUNK)
    return PolicyEngine.load(folder, device="cpu")


def _obs(rng, size=32, task="reach the goal"):
    return {"observation.images.scene": rng.integers(0, 255, (size, size, 3), dtype=np.uint8),
            "observation.images.wrist": rng.integers(0, 255, (size, size, 3), dtype=np.uint8),
            "observation.state": rng.standard_normal(4), "task": task}


class ServerProcess:
    def __init__(self, policy_dir, *flags):
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        self.proc = subprocess.Popen([sys.executable, "-m", "kilovla", "serve", "--policy", str(policy_dir),
                                      "--port", "0", *flags], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     text=True, env=env)
        line = self.proc.stdout.readline()
        match = re.search(r"ws://127\.0\.0\.1:(\d+)", line)
        assert match, line + self.proc.stderr.read()
        self.port = int(match.group(1))

    def stop(self) -> tuple[int, str]:
        self.proc.send_signal(signal.SIGTERM)
        out, _ = self.proc.communicate(timeout=60)
        return self.proc.returncode, out


@contextlib.contextmanager
def _in_process_server(engine, **cfg):
    """A PolicyServer on its own event loop thread; yields (server, url), then stops it."""
    from kilovla.serve.server import PolicyServer, ServeConfig

    server = PolicyServer(engine, ServeConfig(port=0, **cfg))
    ports, loop, stop = [], asyncio.new_event_loop(), asyncio.Event()
    thread = threading.Thread(target=lambda: loop.run_until_complete(server.serve(ready=ports.append, stop=stop)),
                              daemon=True)
    thread.start()
    while not ports:
        threading.Event().wait(0.01)
    try:
        yield server, f"ws://127.0.0.1:{ports[0]}"
    finally:
        loop.call_soon_threadsafe(stop.set)
        thread.join(60)


@pytest.fixture(scope="module")
def server(policy_dir):
    s = ServerProcess(policy_dir, "--max-wait-ms", "20")
    yield s
    if s.proc.poll() is None:
        s.stop()


@contextlib.contextmanager
def _taken_port():
    """A port another program listens on, for as long as the block runs."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield sock.getsockname()[1]


def test_serve_on_a_port_in_use_is_one_line_naming_host_and_port_before_the_policy_is_read(tmp_path):
    with _taken_port() as port:  # the folder does not exist either: the port is what is checked first
        proc = subprocess.run([sys.executable, "-m", "kilovla", "serve", "--policy", str(tmp_path / "no-policy"),
                               "--port", str(port)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stdout == ""
    errors = [line for line in proc.stderr.splitlines() if " is now --" not in line]  # old flags' notices
    assert errors == [f"error: --serve.host/--serve.port 127.0.0.1:{port}: cannot listen there: Address already in use"]


def test_a_port_taken_after_the_check_is_a_kilovla_error_and_leaves_nothing_running(engine):
    from kilovla.errors import KilovlaError
    from kilovla.serve.server import PolicyServer, ServeConfig

    threads = set(threading.enumerate())
    with _taken_port() as port:
        server = PolicyServer(engine, ServeConfig(port=port))
        with pytest.raises(KilovlaError, match=f"127.0.0.1:{port}: cannot listen there: Address already in use"):
            asyncio.run(server.serve())
    assert set(threading.enumerate()) <= threads


def test_msgpack_numpy_matches_openpi_clients_encoding():
    from openpi_client import msgpack_numpy

    data = {"a": np.arange(6, dtype=np.float32).reshape(2, 3), "b": np.uint8(7), "s": "x", "n": [1, 2.5]}
    ours, theirs = unpackb(msgpack_numpy.packb(data)), msgpack_numpy.unpackb(packb(data))
    for got in (ours, theirs):
        np.testing.assert_array_equal(got["a"], data["a"])
        assert got["b"] == 7 and got["s"] == "x" and got["n"] == [1, 2.5]
    assert packb(data) == msgpack_numpy.packb(data)  # byte for byte
    with pytest.raises(BadRequest, match="does not match its"):
        unpackb(packb({"a": {b"__ndarray__": True, b"data": b"123", b"dtype": "<f4", b"shape": [4]}}))


def test_openpi_client_gets_metadata_and_action_chunks(server, engine):
    from openpi_client import action_chunk_broker, websocket_client_policy

    client = websocket_client_policy.WebsocketClientPolicy(host="127.0.0.1", port=server.port)
    meta = client.get_server_metadata()
    assert meta["action_horizon"] == 4 and meta["action_dim"] == 4 and meta["model"] == "pi05-tiny"
    assert meta["observation_keys"] == ["observation.images.scene", "observation.images.wrist",
                                        "observation.state", "task"]
    rng = np.random.default_rng(0)
    out = client.infer(_obs(rng))
    assert out["actions"].shape == (4, 4) and out["actions"].dtype == np.float32
    assert set(out["policy_timing"]) == {"infer_ms"} and "infer_ms" in out["server_timing"]
    assert "prev_total_ms" in client.infer(_obs(rng))["server_timing"]
    broker = action_chunk_broker.ActionChunkBroker(client, action_horizon=4)
    steps = [broker.infer(_obs(rng))["actions"] for _ in range(5)]
    assert all(a.shape == (4,) for a in steps)


def test_libero_layout_and_any_image_size_and_chw_float(server):
    from openpi_client import websocket_client_policy

    client = websocket_client_policy.WebsocketClientPolicy(host="127.0.0.1", port=server.port)
    rng = np.random.default_rng(1)
    libero = {"observation/image": rng.integers(0, 255, (224, 224, 3), dtype=np.uint8),
              "observation/wrist_image": rng.random((3, 100, 100), dtype=np.float32),  # CHW float
              "observation/state": rng.standard_normal(4), "prompt": "reach the goal"}
    assert client.infer(libero)["actions"].shape == (4, 4)


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
def test_a_float_image_in_0_1_is_the_uint8_image_divided_by_255(dtype):
    inputs = PolicyInputs(cameras=["observation.images.scene"], state_keys=[], state_widths=[])
    pixels = np.arange(256, dtype=np.uint8).repeat(3).reshape(16, 16, 3)
    got = to_policy_observation({"observation.images.scene": (pixels / 255.0).astype(dtype)}, inputs)
    np.testing.assert_array_equal(got["observation.images.scene"], pixels)


def test_a_bad_request_names_the_key_and_the_connection_stays_open(server):
    from openpi_client import websocket_client_policy

    client = websocket_client_policy.WebsocketClientPolicy(host="127.0.0.1", port=server.port)
    rng = np.random.default_rng(2)
    obs = _obs(rng)
    del obs["observation.images.wrist"]
    with pytest.raises(RuntimeError, match="missing image 'observation.images.wrist'"):
        client.infer(obs)
    bad = _obs(rng)
    bad["observation.state"] = np.zeros(7)
    with pytest.raises(RuntimeError, match="observation.state: the policy reads 4 values, got shape \\[7\\]"):
        client.infer(bad)
    assert client.infer(_obs(rng))["actions"].shape == (4, 4)  # the same connection still serves


def test_roboarena_endpoints(server):
    from websockets.sync.client import connect

    with connect(f"ws://127.0.0.1:{server.port}", max_size=None) as ws:
        unpackb(ws.recv())
        ws.send(packb({"endpoint": "reset"}))
        assert ws.recv() == "reset successful"
        ws.send(packb({**_obs(np.random.default_rng(3)), "endpoint": "infer"}))
        assert unpackb(ws.recv())["actions"].shape == (4, 4)
        ws.send(b"\xc1 not msgpack")
        assert ws.recv().startswith("bad request: not a msgpack frame")


def test_healthz_and_the_api_key_is_checked_before_the_upgrade(policy_dir):
    from openpi_client import websocket_client_policy
    from websockets.exceptions import InvalidStatus

    s = ServerProcess(policy_dir, "--api-key", "s3cret")
    try:
        assert urllib.request.urlopen(f"http://127.0.0.1:{s.port}/healthz", timeout=10).read() == b"OK\n"
        with pytest.raises(InvalidStatus, match="401"):
            websocket_client_policy.WebsocketClientPolicy(host="127.0.0.1", port=s.port)
        with pytest.raises(InvalidStatus, match="401"):
            websocket_client_policy.WebsocketClientPolicy(host="127.0.0.1", port=s.port, api_key="wrong")
        client = websocket_client_policy.WebsocketClientPolicy(host="127.0.0.1", port=s.port, api_key="s3cret")
        assert client.infer(_obs(np.random.default_rng(4)))["actions"].shape == (4, 4)
    finally:
        rc, out = s.stop()
    assert rc == 0 and "stopped after 1 replies" in out


def test_a_request_s_actions_are_the_same_batched_or_alone(engine):
    from kilovla.serve.engine import Request

    rng = np.random.default_rng(5)
    inputs = engine.inputs()
    requests = [Request(to_policy_observation(_obs(rng, task=t), inputs), seed=i)
                for i, t in enumerate(["reach", "reach the red goal quickly", "go"])]
    batched, _ = engine.infer(requests)
    for r, got in zip(requests, batched):
        [alone], _ = engine.infer([r])
        np.testing.assert_allclose(got, alone, atol=1e-5)
    assert not np.allclose(batched[0], batched[1])


def test_concurrent_clients_are_batched_and_each_gets_its_own_reply(engine):
    """Eight connections at once into a server that waits 200 ms for a batch (or until every open
    connection has asked): fewer forwards than requests, and each reply equals that request run alone."""
    from websockets.sync.client import connect

    from kilovla.serve.engine import Request

    rng = np.random.default_rng(6)
    observations = [_obs(rng) for _ in range(8)]
    replies = [None] * 8
    connected = threading.Barrier(8)
    with _in_process_server(engine, max_batch=8, max_wait_ms=200) as (server, url):
        def client(i):
            with connect(url, max_size=None) as ws:
                unpackb(ws.recv())
                connected.wait(30)  # all eight are open: a lone early request waits for the others
                ws.send(packb({**observations[i], "seed": 100 + i}))
                replies[i] = unpackb(ws.recv())["actions"]

        threads = [threading.Thread(target=client, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
    stats = server.batcher.stats.summary()
    assert stats["requests"] == 8 and stats["batches"] < 8
    inputs = engine.inputs()
    for i in range(8):
        [alone], _ = engine.infer([Request(to_policy_observation(observations[i], inputs), seed=100 + i)])
        np.testing.assert_allclose(replies[i], alone, atol=1e-5)


def test_a_model_failure_closes_that_connection_with_1011_and_the_server_goes_on(engine, monkeypatch):
    from websockets.exceptions import ConnectionClosedError
    from websockets.sync.client import connect

    calls = {"n": 0}
    real = engine.infer

    def flaky(requests):
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("CUDA out of memory (injected)")
        return real(requests)

    monkeypatch.setattr(engine, "infer", flaky)
    rng = np.random.default_rng(7)
    with _in_process_server(engine, max_batch=1) as (_, url):
        with connect(url, max_size=None) as ws:
            unpackb(ws.recv())
            ws.send(packb(_obs(rng)))
            assert "CUDA out of memory (injected)" in ws.recv()
            with pytest.raises(ConnectionClosedError) as closed:
                ws.recv()
            assert closed.value.rcvd.code == 1011
        with connect(url, max_size=None) as ws:  # another robot is still served
            unpackb(ws.recv())
            ws.send(packb(_obs(rng)))
            assert unpackb(ws.recv())["actions"].shape == (4, 4)


def test_sigterm_answers_what_is_in_flight_then_exits(policy_dir):
    from websockets.sync.client import connect

    s = ServerProcess(policy_dir, "--max-wait-ms", "500")  # the request waits in the queue when SIGTERM comes
    with connect(f"ws://127.0.0.1:{s.port}", max_size=None) as ws:
        unpackb(ws.recv())
        ws.send(packb(_obs(np.random.default_rng(8))))
        threading.Event().wait(0.1)
        s.proc.send_signal(signal.SIGTERM)
        assert unpackb(ws.recv())["actions"].shape == (4, 4)
    out, _ = s.proc.communicate(timeout=60)
    assert s.proc.returncode == 0 and "stopped after 1 replies" in out
    with pytest.raises((urllib.error.URLError, ConnectionError)):
        urllib.request.urlopen(f"http://127.0.0.1:{s.port}/healthz", timeout=5)


# -- real-time chunking ----------------------------------------------------------------------------
def test_rtc_with_zero_weights_samples_exactly_as_without(family_engine):
    import torch

    from kilovla.models.rtc import prefix_weights, sample_actions_rtc

    np.testing.assert_allclose(prefix_weights(6, 1, 4, 5), [1, 2 / 3, 1 / 3, 0, 0, 0], atol=1e-6)
    assert prefix_weights(6, 2, 6, 3, "zeros").tolist() == [1, 1, 0, 0, 0, 0]
    rng, engine = np.random.default_rng(9), family_engine
    assert engine.supports_rtc
    obs = to_policy_observation(_obs(rng), engine.inputs())
    data = {k: np.stack([v]) for k, v in obs.items() if k != "task"} | {"task": [obs["task"]]}
    batch = engine.processor.observation_batch(data)
    noise = torch.randn(1, engine.horizon, engine.width, generator=torch.Generator().manual_seed(0))
    zeros = torch.zeros_like(noise)
    with torch.no_grad():
        plain = engine.model.sample_actions(batch, noise=noise)
    torch.testing.assert_close(sample_actions_rtc(engine.model, batch, noise, zeros, zeros), plain, rtol=0, atol=0)


def test_rtc_continues_the_given_prefix_and_shrinks_the_jump_at_the_junction(family_engine):
    """The robot executed 1 action of chunk A and sends the other 3 as the prefix; 2 more execute
    while the next chunk is computed (inference_delay 2). With RTC the new chunk's first 2 actions
    follow the prefix, and the step from the last frozen action to the new chunk's next is smaller."""
    from kilovla.models.family import family_of
    from kilovla.serve.engine import Request, Rtc

    rng, engine = np.random.default_rng(10), family_engine
    inputs = engine.inputs()
    first, second = (to_policy_observation(_obs(rng), inputs) for _ in range(2))
    [chunk], _ = engine.infer([Request(first, seed=1)])
    prefix, d = chunk[1:], 2
    [plain], _ = engine.infer([Request(second, seed=2)])
    [guided], _ = engine.infer([Request(second, seed=2, rtc=Rtc(prefix, inference_delay=d))])
    follow = lambda c: np.abs(c[:d] - prefix[:d]).mean()  # noqa: E731
    jump = lambda c: np.abs(c[d] - prefix[d - 1]).mean()  # noqa: E731
    assert follow(guided) < 0.5 * follow(plain)
    # GR00T's per-embodiment layers start at std 0.02 (NVIDIA's init): after 2 steps its flow barely reads
    # the noisy actions (a 1.0 change at one position moves the velocity by ~1e-6), so nothing carries past
    # the guided positions to the junction
    if not family_of(engine.model).name.startswith("groot"):
        assert jump(guided) < jump(plain)
    # a request without rtc in the same batch is untouched by its neighbour's guidance
    both, _ = engine.infer([Request(second, seed=2, rtc=Rtc(prefix, inference_delay=d)), Request(second, seed=2)])
    np.testing.assert_allclose(both[1], plain, atol=1e-5)
    np.testing.assert_allclose(both[0], guided, atol=1e-5)


def test_rtc_requests_are_checked_and_an_rl_residual_refuses_them(engine, server, monkeypatch):
    from openpi_client import websocket_client_policy

    from kilovla.serve.server import PolicyServer, ServeConfig

    client = websocket_client_policy.WebsocketClientPolicy(host="127.0.0.1", port=server.port)
    rng = np.random.default_rng(11)
    out = client.infer({**_obs(rng), "rtc": {"inference_delay": 1, "prefix": np.zeros((3, 4), np.float32)}})
    assert out["actions"].shape == (4, 4)
    with pytest.raises(RuntimeError, match=r"rtc.prefix must be a finite \(k, 4\) array"):
        client.infer({**_obs(rng), "rtc": {"inference_delay": 1, "prefix": np.zeros((3, 7), np.float32)}})
    monkeypatch.setattr(engine, "supports_rtc", False)
    with pytest.raises(BadRequest, match="an RL residual policy.* refuses rtc"):
        PolicyServer(engine, ServeConfig())._rtc({"inference_delay": 1, "prefix": np.zeros((3, 4))})


# -- a served policy in closed-loop evaluation -----------------------------------------------------
def test_a_served_policy_acts_as_the_local_one(server, policy_dir):
    import torch

    from kilovla.eval.closed_loop import load_policy

    local, served = load_policy(policy_dir), load_policy(f"ws://127.0.0.1:{server.port}")
    assert served.cameras == local.cameras and served.action_dim == local.action_dim
    rng = np.random.default_rng(12)
    batch = {"observation.images.scene": rng.integers(0, 255, (3, 32, 32, 3), dtype=np.uint8),
             "observation.images.wrist": rng.integers(0, 255, (3, 32, 32, 3), dtype=np.uint8),
             "observation.state": rng.standard_normal((3, 4)).astype(np.float32), "task": ["reach"] * 3}
    torch.manual_seed(3)
    mine = local.select_action(batch)
    torch.manual_seed(3)
    theirs = served.select_action(batch)  # three connections: the server may batch them
    np.testing.assert_allclose(theirs, mine, atol=1e-5)
    served.close()


def test_a_served_smolvla_policy_acts_as_the_local_one_and_kilovla_eval_runs_it(smolvla_dir, tmp_path):
    """`kilovla serve` (a process: the batched server) of a SmolVLA folder, and `kilovla eval` of it, local
    and through the server: the same actions, the same episodes."""
    import json

    import torch

    from kilovla.cli import main
    from kilovla.eval.closed_loop import load_policy

    s = ServerProcess(smolvla_dir, "--max-wait-ms", "20")
    try:
        local, served = load_policy(smolvla_dir), load_policy(f"ws://127.0.0.1:{s.port}")
        assert served.cameras == local.cameras and served.action_dim == local.action_dim == 4
        rng = np.random.default_rng(13)
        batch = {"observation.images.scene": rng.integers(0, 255, (2, 32, 32, 3), dtype=np.uint8),
                 "observation.images.wrist": rng.integers(0, 255, (2, 32, 32, 3), dtype=np.uint8),
                 "observation.state": rng.standard_normal((2, 4)).astype(np.float32), "task": ["reach"] * 2}
        torch.manual_seed(3)
        mine = local.select_action(batch)
        torch.manual_seed(3)
        np.testing.assert_allclose(served.select_action(batch), mine, atol=1e-5)
        served.close()
        args = ["--tasks", "reach-v3", "--episodes", "1", "--batch-size", "1", "--max-steps", "6", "--videos", "0"]
        for name, policy in (("local", str(smolvla_dir)), ("served", f"ws://127.0.0.1:{s.port}")):
            torch.manual_seed(0)
            assert main(["eval", "--policy", policy, "--out", str(tmp_path / name), *args]) == 0
    finally:
        code, _ = s.stop()
    assert code == 0
    local, served = (json.loads((tmp_path / d / "report.json").read_text())["per_task"]["reach-v3"]
                     for d in ("local", "served"))
    assert (served["successes"], served["mean_steps"], served["seeds"]) == \
        (local["successes"], local["mean_steps"], local["seeds"])
    assert local["mean_steps"] == 6  # 6 steps of a 2-step policy: no success ends it early


@pytest.mark.slow
def test_kilovla_eval_of_a_served_policy_reports_what_a_local_eval_does(server, policy_dir, tmp_path):
    import json

    from kilovla.cli import main

    args = ["--tasks", "reach-v3", "--episodes", "2", "--batch-size", "2", "--max-steps", "12", "--videos", "0"]
    import torch

    torch.manual_seed(0)
    assert main(["eval", "--policy", str(policy_dir), "--out", str(tmp_path / "local"), *args]) == 0
    torch.manual_seed(0)
    assert main(["eval", "--policy", f"ws://127.0.0.1:{server.port}", "--out", str(tmp_path / "served"), *args]) == 0
    local, served = (json.loads((tmp_path / d / "report.json").read_text()) for d in ("local", "served"))
    assert served["per_task"]["reach-v3"]["successes"] == local["per_task"]["reach-v3"]["successes"]
    assert served["per_task"]["reach-v3"]["mean_steps"] == local["per_task"]["reach-v3"]["mean_steps"]
    assert served["per_task"]["reach-v3"]["seeds"] == local["per_task"]["reach-v3"]["seeds"]


def test_a_client_that_leaves_mid_batch_does_not_disturb_the_rest(engine):
    from websockets.sync.client import connect

    rng = np.random.default_rng(13)
    with _in_process_server(engine, max_batch=3, max_wait_ms=300) as (server, url):
        sockets = [connect(url, max_size=None) for _ in range(3)]
        for ws in sockets:
            unpackb(ws.recv())
            ws.send(packb({**_obs(rng), "seed": 1}))
        sockets[1].close()  # leaves while its request waits in the batch
        replies = [unpackb(sockets[i].recv())["actions"] for i in (0, 2)]
        assert all(r.shape == (4, 4) for r in replies)
        for ws in (sockets[0], sockets[2]):  # and they keep being served
            ws.send(packb(_obs(rng)))
            assert unpackb(ws.recv())["actions"].shape == (4, 4)
            ws.close()
    assert server.batcher.stats.batch_sizes[3] == 1 and server.in_flight == 0


def test_a_lone_client_does_not_wait_for_company(engine):
    """With one connection open, its request runs at once, not after --max-wait-ms."""
    import time

    from websockets.sync.client import connect

    with _in_process_server(engine, max_batch=16, max_wait_ms=2000) as (_, url), connect(url, max_size=None) as ws:
        unpackb(ws.recv())
        t0 = time.monotonic()
        ws.send(packb(_obs(np.random.default_rng(14))))
        unpackb(ws.recv())
        assert time.monotonic() - t0 < 1.5


def test_robots_with_different_camera_sizes_share_a_batch(engine):
    from kilovla.serve.engine import Request

    rng = np.random.default_rng(15)
    inputs = engine.inputs()
    small, large = _obs(rng, size=32), _obs(rng, size=96)
    large["observation.images.wrist"] = rng.integers(0, 255, (60, 80, 3), dtype=np.uint8)
    requests = [Request(to_policy_observation(o, inputs), seed=i) for i, o in enumerate((small, large))]
    batched, _ = engine.infer(requests)
    for r, got in zip(requests, batched):
        [alone], _ = engine.infer([r])
        np.testing.assert_allclose(got, alone, atol=1e-5)


def test_a_decoded_requests_read_only_frames_reach_torch_as_writable_copies(engine, monkeypatch):
    """msgpack hands the server read-only arrays (frames, flow noise); torch.from_numpy of one warns (once per
    process)."""
    import torch

    from kilovla.serve.engine import Request

    rng = np.random.default_rng(17)
    inputs = engine.inputs()
    small, large = _obs(rng, size=32), _obs(rng, size=96)  # two sizes: each frame resized alone
    for obs in (small, large):
        for value in obs.values():
            if isinstance(value, np.ndarray):
                value.flags.writeable = False
    given, from_numpy, as_tensor = [], torch.from_numpy, torch.as_tensor
    monkeypatch.setattr(torch, "from_numpy", lambda a: given.append(a.flags.writeable) or from_numpy(a))
    monkeypatch.setattr(torch, "as_tensor", lambda a, *args, **kw: (
        given.append(a.flags.writeable) if isinstance(a, np.ndarray) else None) or as_tensor(a, *args, **kw))
    noise = np.zeros((engine.horizon, engine.width), np.float32)  # as `eval --policy.path=ws://` sends it
    noise.flags.writeable = False
    engine.infer([Request(to_policy_observation(small, inputs), noise=noise),
                  Request(to_policy_observation(large, inputs), seed=1)])
    assert len(given) >= 2 and all(given)


def test_each_rtc_request_keeps_its_own_guidance_weight(engine, server):
    from openpi_client import websocket_client_policy

    from kilovla.serve.engine import Request, Rtc

    rng = np.random.default_rng(16)
    obs = to_policy_observation(_obs(rng), engine.inputs())
    prefix = np.full((3, 4), 0.5, np.float32)
    mild, strong = Rtc(prefix, 1, max_guidance_weight=1.0), Rtc(prefix, 1, max_guidance_weight=50.0)
    batched, _ = engine.infer([Request(obs, seed=1, rtc=mild), Request(obs, seed=1, rtc=strong)])
    for rtc, got in zip((mild, strong), batched):
        [alone], _ = engine.infer([Request(obs, seed=1, rtc=rtc)])
        np.testing.assert_allclose(got, alone, atol=1e-5)
    client = websocket_client_policy.WebsocketClientPolicy(host="127.0.0.1", port=server.port)
    for beta in (float("inf"), 1e300, 0.0):
        with pytest.raises(RuntimeError, match=r"rtc.max_guidance_weight must be a number in \(0, 100\]"):
            client.infer({**_obs(rng), "rtc": {"inference_delay": 1, "prefix": prefix, "max_guidance_weight": beta}})
    with pytest.raises(RuntimeError, match="rtc.inference_delay 5 is longer than the prefix"):
        client.infer({**_obs(rng), "rtc": {"inference_delay": 5, "prefix": prefix}})


@pytest.mark.parametrize("field, value, said", [
    ("observation.state", "abc", "observation.state: must be numbers"),
    ("observation.state", [[0.0], [0.0, 0.0]], "observation.state: must be numbers"),
    ("observation.state", np.zeros((2, 2)), "the policy reads 4 values, got shape [2, 2]"),
    ("observation.images.scene", np.zeros((0, 0, 3), np.uint8), "an image must be an (H, W, 3)"),
    # a float image on the 0-255 scale is refused, not scaled again and clipped to white
    ("observation.images.scene", np.full((32, 32, 3), 200.0, np.float32),
     "observation.images.scene: a float image must hold values in [0, 1], got [200, 200]"),
    ("observation.images.wrist", np.full((3, 32, 32), 1.5, np.float16), "values in [0, 1], got [1.5, 1.5]"),
    ("observation.images.scene", np.full((32, 32, 3), -0.25, np.float64), "values in [0, 1], got [-0.25, -0.25]"),
    ("observation.images.scene", np.full((32, 32, 3), np.nan, np.float32), "the image holds NaN or inf"),
    ("endpoint", np.zeros(3), "endpoint must be 'infer' or 'reset'"),
])
def test_misshapen_requests_get_a_bad_request_text_and_the_connection_stays(server, field, value, said):
    from websockets.sync.client import connect

    rng = np.random.default_rng(17)
    with connect(f"ws://127.0.0.1:{server.port}", max_size=None) as ws:
        unpackb(ws.recv())
        ws.send(packb({**_obs(rng), field: value}))
        reply = ws.recv()
        assert isinstance(reply, str) and reply.startswith("bad request") and said in reply
        ws.send(packb(_obs(rng)))
        assert unpackb(ws.recv())["actions"].shape == (4, 4)


def test_hostile_frames_are_bad_requests_not_crashes(server):
    import msgpack
    from websockets.sync.client import connect

    frames = [msgpack.packb({1: 2}), msgpack.packb({"observation.state": {b"__ndarray__": True, b"dtype": "<f4"}}),
              msgpack.packb({"x": {b"__npgeneric__": True, b"data": 1000, b"dtype": "|i1"}}),
              msgpack.packb({"x": {b"__ndarray__": True, b"data": b"", b"dtype": "O", b"shape": [0]}}),
              msgpack.packb({"x": msgpack.ExtType(5, b"xx")})]
    with connect(f"ws://127.0.0.1:{server.port}", max_size=None) as ws:
        unpackb(ws.recv())
        for frame in frames:
            ws.send(frame)
            assert ws.recv().startswith("bad request"), frame
        ws.send(packb(_obs(np.random.default_rng(18))))
        assert unpackb(ws.recv())["actions"].shape == (4, 4)


def test_sigterm_under_load_answers_what_was_asked_then_exits(policy_dir):
    import time

    from websockets.exceptions import ConnectionClosed
    from websockets.sync.client import connect

    s = ServerProcess(policy_dir)
    rng = np.random.default_rng(19)
    stop_at, answered, closed = time.monotonic() + 30, [0], []

    def robot():
        with connect(f"ws://127.0.0.1:{s.port}", max_size=None) as ws:
            unpackb(ws.recv())
            try:
                while time.monotonic() < stop_at:  # keeps asking, as a robot would
                    ws.send(packb(_obs(rng)))
                    unpackb(ws.recv())
                    answered[0] += 1
            except ConnectionClosed as e:
                closed.append(e.rcvd.code if e.rcvd else None)

    threads = [threading.Thread(target=robot) for _ in range(4)]
    for t in threads:
        t.start()
    while answered[0] < 8:
        threading.Event().wait(0.05)
    t0 = time.monotonic()
    s.proc.send_signal(signal.SIGTERM)
    out, _ = s.proc.communicate(timeout=30)
    for t in threads:
        t.join(30)
    assert s.proc.returncode == 0 and time.monotonic() - t0 < 10
    assert closed == [1001] * 4 and f"stopped after {answered[0]} replies" in out


def test_a_float_image_just_above_1_is_refused_showing_the_value_that_is_out_of_range():
    from kilovla.serve.protocol import as_hwc_uint8

    with pytest.raises(BadRequest, match=r"got \[0, 1.0000001\]"):  # %g would say [0, 1]
        as_hwc_uint8(np.array([0.0, 1.0000001, 0.5], np.float32).reshape(1, 1, 3), "observation.images.scene")


def test_serve_says_which_checkpoint_a_latest_pointer_resolved_to(monkeypatch, capsys):
    from types import SimpleNamespace

    from kilovla.serve import server as server_mod

    class Engine:  # what run() reads of a loaded engine; `folder` is what PolicyEngine.load resolved
        meta, folder = SimpleNamespace(preset="pi0-tiny"), "runs/mw/checkpoints/step_000004"
        policy = SimpleNamespace(name="pi0-tiny FP8 W8A8")
        device, bf16, sampler = "cpu", False, SimpleNamespace(enabled=False)

        def warm_up(self):
            pass

    class Server:
        answered, batcher = 0, SimpleNamespace(stats=SimpleNamespace(summary=lambda: {
            "batches": 0, "mean_batch_size": 0.0, "queue_wait_p99_s": 0.0}))

        def __init__(self, engine, cfg):
            pass

        async def serve(self, ready):
            ready(8123)

    monkeypatch.setattr(server_mod, "check_listenable", lambda host, port: None)
    monkeypatch.setattr(server_mod.PolicyEngine, "load", classmethod(lambda cls, policy, **kw: Engine()))
    monkeypatch.setattr(server_mod, "PolicyServer", Server)
    assert server_mod.run("runs/mw/checkpoints/last", server_mod.ServeConfig()) == 0
    assert "kilovla serve: pi0-tiny FP8 W8A8 from runs/mw/checkpoints/step_000004 on ws://" in capsys.readouterr().out


@pytest.mark.parametrize("device, message", [
    ("tpu", "error: --serve.device 'tpu': "),
    pytest.param("cuda", "error: --serve.device cuda: this machine has no CUDA GPU torch can use (use cpu or auto)",
                 marks=pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="a CUDA GPU is here")),
])
def test_serve_refuses_a_device_it_cannot_use_in_one_line(capsys, device, message):
    from pathlib import Path

    from kilovla.cli import main

    demo = Path(__file__).parent / "fixtures" / "legacy_a039621" / "demo_checkpoint"
    assert main(["serve", f"--policy.path={demo}", f"--serve.device={device}", "--serve.port=0"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(message), err
