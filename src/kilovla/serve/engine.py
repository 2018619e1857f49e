"""The model side of `kilovla serve`: a policy folder that answers a batch of requests in one forward.

    engine = PolicyEngine.load("runs/mw/checkpoints/step_002000")
    [chunk] = engine.infer([Request(obs={"observation.images.scene": ..., "observation.state": ..., "task": ...},
                                    seed=7)])        # (H, action_dim), unnormalised

Each request's initial flow noise is given (`noise`), or drawn from its own `seed`, or from the
engine's generator when it sends neither; with noise or a seed a request's actions do not depend on
what else shares its batch (to float rounding). The prefix KV cache is computed once per batch and reused across the denoising steps
(`sample_actions`). Requests whose prompts differ share a batch: language is padded per batch.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from kilovla.errors import KilovlaError
from kilovla.folders import policy_folder
from kilovla.machine import resolve_device
from kilovla.models.family import chunk_length
from kilovla.models.images import resize_images
from kilovla.models.rtc import prefix_weights, sample_actions_rtc
from kilovla.policy_folder import Interface, PolicyFolder
from kilovla.serve.graphs import GraphedSampler
from kilovla.serve.protocol import PolicyInputs

log = logging.getLogger(__name__)


@dataclass
class Request:
    obs: dict  # the policy's keys (protocol.to_policy_observation)
    seed: int | None = None  # the initial flow noise from this seed
    noise: np.ndarray | None = None  # or given: (horizon, max_action_dim), as `kilovla eval --policy.path=ws://` sends it
    rtc: Rtc | None = None  # real-time chunking: continue the previous chunk


@dataclass
class Rtc:
    """The unexecuted rest of the previous chunk, in the robot's action units, and when the new
    chunk takes over (models/rtc.py)."""

    prefix: np.ndarray  # (k, action_dim)
    inference_delay: int  # actions that execute before the new chunk arrives: the new one must repeat them
    execution_horizon: int | None = None  # guidance fades out here (default: the end of the prefix)
    max_guidance_weight: float = 10.0


class PolicyEngine:
    """`precision`: bf16 autocast or fp32 (auto: bf16 on CUDA); `cuda_graphs`: capture the denoising loop
    per batch shape on CUDA (`graphs.py`; ignored elsewhere)."""

    def __init__(self, policy, folder: str, device: str = "cpu", precision: str = "auto", cuda_graphs: bool = True):
        if precision not in ("auto", "fp32", "bf16"):
            raise KilovlaError(f"--serve.precision must be auto, fp32 or bf16, not {precision!r}")
        self.policy, self.folder, self.device = policy, folder, torch.device(device)
        cuda = self.device.type == "cuda"
        self.bf16 = precision == "bf16" or (precision == "auto" and cuda)
        if self.bf16 and not cuda:
            log.warning("bf16 on %s: autocast there is slower than fp32 on most CPUs", self.device)
        self.sampler = GraphedSampler(policy.model, self.device, enabled=cuda_graphs)
        self.model, self.processor, self.meta = policy.model, policy.processor, policy.meta
        self.interface = Interface.of(self.meta, where=f"{folder}/policy.json")
        cfg = self.model.config
        self.horizon = chunk_length(cfg)
        self.width = cfg.max_action_dim
        self._generator = torch.Generator().manual_seed(0)
        self.supports_rtc = not self.meta.residual  # RTC would not guide an RL residual's correction
        self._lock = threading.Lock()  # one forward at a time, whichever thread asks

    @classmethod
    def load(cls, folder: str | Path, device: str = "auto", ema: bool = False, precision: str = "auto",
             cuda_graphs: bool = True) -> PolicyEngine:
        device = str(resolve_device(device, "--serve.device"))
        folder = policy_folder(folder)  # a run folder or its checkpoints/latest: the newest checkpoint
        policy = PolicyFolder.open(folder, flag="--policy.path").load(device, ema=ema)
        return cls(policy, str(folder), device, precision=precision, cuda_graphs=cuda_graphs)

    def inputs(self) -> PolicyInputs:
        return PolicyInputs(cameras=list(self.interface.camera_keys), state_keys=list(self.interface.state_keys),
                            state_widths=list(self.interface.checked_state_widths()))

    def metadata(self) -> dict:
        """The frame a client gets on connect (openpi's `get_server_metadata()`)."""
        size = self.meta.image_size
        return {"server": "kilovla", "model": self.meta.preset, "policy": self.policy.name,
                "policy_folder": str(Path(self.folder).resolve()),
                "action_horizon": int(self.horizon), "action_dim": int(self.meta.action_dim),
                "n_action_steps": self.meta.n_action_steps, "cameras": list(self.meta.camera_map),
                "image_size": list(size) if size else None, "state_keys": list(self.meta.state_keys),
                "state_widths": self.inputs().state_widths, "state_dim": int(self.meta.state_dim),
                "observation_keys": [*self.meta.camera_map, *self.meta.state_keys, "task"],
                "layouts": ["lerobot", "libero", "droid"], "device": str(self.device),
                "noise_shape": [int(self.horizon), int(self.width)], "rtc": self.supports_rtc,
                "precision": "bf16" if self.bf16 else "fp32", "cuda_graphs": self.sampler.enabled}

    def noise(self, requests: list[Request]) -> torch.Tensor:
        out = []
        for r in requests:
            if r.noise is not None:
                out.append(torch.from_numpy(np.array(r.noise, np.float32)))  # a copy: a request's is read-only
                continue
            g = torch.Generator().manual_seed(int(r.seed)) if r.seed is not None else self._generator
            out.append(torch.randn(self.horizon, self.width, generator=g))
        return torch.stack(out)

    def rtc_guidance(self, requests: list[Request]) -> tuple[torch.Tensor, torch.Tensor]:
        """Each request's prefix, normalised and padded to (H, max_action_dim), and its guidance weights
        (all zero for a request without RTC: it samples as it would alone)."""
        b, dim = len(requests), self.meta.action_dim
        prefix = torch.zeros(b, self.horizon, self.width)
        weights = torch.zeros(b, self.horizon, self.width)
        for i, r in enumerate(requests):
            if r.rtc is None:
                continue
            p = self.processor.normalize_actions(r.rtc.prefix)[: self.horizon]
            prefix[i, : len(p), :dim] = torch.from_numpy(p)
            s = r.rtc.execution_horizon if r.rtc.execution_horizon is not None else len(p)
            w = prefix_weights(self.horizon, r.rtc.inference_delay, s, len(p))
            weights[i, :, :dim] = torch.from_numpy(w)[:, None]
        return prefix, weights

    def _stack_images(self, images: list[np.ndarray]) -> np.ndarray:
        """Robots' frames of one camera as one array. Frames of different sizes are each resized to the
        model's input first, as the processor would resize each alone (on the 0-255 scale, so its
        division by 255 follows): a request's actions do not depend on its neighbours' cameras."""
        if len({im.shape for im in images}) == 1:
            return np.stack(images)
        size = self.model.config.vision.image_size
        out = []
        for im in images:
            t = torch.from_numpy(np.array(im)).permute(2, 0, 1)[None].float()  # a copy: a request's is read-only
            out.append(resize_images(t, size, self.meta.image_resize)[0].permute(1, 2, 0).numpy())
        return np.stack(out)

    def warm_up(self) -> float:
        """One request of zeros before the server says it is ready (first-call allocations, a batch-1
        CUDA graph); returns its ms."""
        size = self.meta.image_size or [self.model.config.vision.image_size] * 2
        obs = {k: np.zeros((*size, 3), np.uint8) for k in self.meta.camera_map}
        obs.update({k: np.zeros(w, np.float32) for k, w in zip(self.meta.state_keys, self.inputs().state_widths)})
        t0 = time.perf_counter()
        self.infer([Request({**obs, "task": ""}, seed=0)])
        return 1e3 * (time.perf_counter() - t0)

    def infer(self, requests: list[Request]) -> tuple[list[np.ndarray], float]:
        """One forward for the batch: the actions of each request (H, action_dim) and the model's ms."""
        data = {k: self._stack_images([r.obs[k] for r in requests]) for k in self.meta.camera_map}
        data.update({k: np.stack([r.obs[k] for r in requests]) for k in self.meta.state_keys})
        data["task"] = [r.obs["task"] for r in requests]
        rtc = any(r.rtc is not None for r in requests)
        # RTC differentiates the action expert: no inference_mode then (its tensors refuse autograd).
        autocast = torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.bf16)
        with self._lock, (torch.no_grad() if rtc else torch.inference_mode()), autocast:
            noise = self.noise(requests).to(self.device)
            batch = self.processor.observation_batch(data).to(self.device)
            t0 = time.perf_counter()
            if rtc:
                prefix, weights = self.rtc_guidance(requests)
                beta = torch.tensor([r.rtc.max_guidance_weight if r.rtc is not None else 0.0 for r in requests])
                actions = sample_actions_rtc(self.model, batch, noise, prefix.to(self.device), weights.to(self.device),
                                             max_guidance_weight=beta.to(self.device))
            else:
                actions = self.sampler(batch, noise)
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            infer_ms = 1e3 * (time.perf_counter() - t0)
        chunks = self.processor.unnormalize_actions(actions.float().cpu().numpy())
        return [np.ascontiguousarray(c) for c in chunks], infer_ms
