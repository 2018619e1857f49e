"""A served policy as a `Policy`: `kilovla eval --policy.path=ws://HOST:PORT` runs the simulator here and
the policy there.

    policy = ServedPolicy("ws://127.0.0.1:8000", api_key=None)
    chunk = policy.select_action(batch)   # (B, H, action_dim): one request per env, on B connections

Each env of the batch has its own connection, so the server batches them as it batches robots.
The initial flow noise is drawn here, from torch's global generator exactly as a local policy
draws it (`torch.randn(B, H, max_action_dim)`), and sent with each request: a local and a served
evaluation of the same policy and seeds then run the same actions (to float rounding).
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

from kilovla.errors import KilovlaError
from kilovla.serve.protocol import packb, unpackb


class ServedPolicy:
    def __init__(self, url: str, api_key: str | None = None, timeout_s: float = 300.0):
        self.url, self.api_key, self.timeout_s = url, api_key, timeout_s
        self.source = url
        self._connections = []
        first = self._connect()
        self.metadata = self._metadata
        m = self.metadata
        if not isinstance(m, dict) or "noise_shape" not in m:
            first.close()
            raise KilovlaError(f"{url}: not a kilovla policy server (its metadata has no noise_shape)")
        self._connections.append(first)
        self.name = f"{m.get('policy', m['model'])} @ {url}"  # an earlier server sends no "policy"
        self.action_dim, self.state_dim = m["action_dim"], m["state_dim"]
        self.state_keys = list(m["state_keys"])
        self.cameras = tuple(k.removeprefix("observation.images.") for k in m["cameras"])
        self.n_action_steps = m.get("n_action_steps")
        self.meta = _Meta(m.get("image_size"))
        self._pool: ThreadPoolExecutor | None = None

    def _connect(self):
        from websockets.exceptions import InvalidStatus
        from websockets.sync.client import connect

        headers = {"Authorization": f"Api-Key {self.api_key}"} if self.api_key else None
        try:
            ws = connect(self.url, compression=None, max_size=None, additional_headers=headers,
                         open_timeout=30, close_timeout=5)
        except InvalidStatus as e:
            raise KilovlaError(f"{self.url}: the server refused the connection ({e.response.status_code}: "
                               f"{e.response.body.decode(errors='replace').strip()})") from None
        except OSError as e:
            raise KilovlaError(f"{self.url}: cannot connect: {e}") from None
        self._metadata = unpackb(ws.recv(timeout=self.timeout_s))
        return ws

    def reset(self) -> None:
        pass

    def _ask(self, i: int, request: dict) -> np.ndarray:
        ws = self._connections[i]
        ws.send(packb(request))
        reply = ws.recv(timeout=self.timeout_s)
        if isinstance(reply, str):
            raise KilovlaError(f"{self.url}: the server answered: {reply.strip().splitlines()[-1]}")
        return np.asarray(unpackb(reply)["actions"])

    def select_action(self, batch: dict) -> np.ndarray:
        n = len(batch["task"])
        while len(self._connections) < n:
            self._connections.append(self._connect())
        if self._pool is None or self._pool._max_workers < n:
            self._pool = ThreadPoolExecutor(max_workers=n, thread_name_prefix="kilovla-client")
        noise = torch.randn(n, *self.metadata["noise_shape"]).numpy()
        keys = [k for k in batch if k.startswith("observation.")]
        requests = []
        for i in range(n):
            request = {k: _current(np.asarray(batch[k][i])) for k in keys}
            request.update(task=str(batch["task"][i]), noise=noise[i])
            requests.append(request)
        return np.stack(list(self._pool.map(self._ask, range(n), requests)))

    def close(self) -> None:
        for ws in self._connections:
            ws.close()
        if self._pool is not None:
            self._pool.shutdown()


class _Meta:
    def __init__(self, image_size):
        self.image_size = image_size


def _current(value: np.ndarray) -> np.ndarray:
    """A camera with a time window (T, H, W, 3): the current frame, the last."""
    return value[-1] if value.ndim == 4 else value
