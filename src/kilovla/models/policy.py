"""A learned VLA (pi0, pi0.5, GR00T N1.5) as a `Policy`: observations in, unnormalised action chunks out.

Pre- and post-processing are the `Processor`'s, the same the trainer uses. A policy folder on disk
(what it holds, how it is read, checked, loaded and written) is `kilovla.policy_folder`'s.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from kilovla.models.processor import PolicyMeta, Processor


class VLAPolicy:
    """`root`: the policy folder, where a relative tokenizer path in `meta` points."""

    def __init__(self, model: torch.nn.Module, meta: PolicyMeta, device: str | torch.device = "cpu",
                 root: str | Path | None = None):
        self.model, self.meta, self.device = model.to(device).eval(), meta, torch.device(device)
        self.processor = Processor(model.config, meta, root)
        self.name = meta.preset
        self.action_dim, self.state_dim, self.state_keys = meta.action_dim, meta.state_dim, list(meta.state_keys)
        self.cameras = tuple(k.removeprefix("observation.images.") for k in meta.camera_map)
        self.n_action_steps = meta.n_action_steps

    def reset(self) -> None:
        pass

    def select_action(self, obs: dict) -> np.ndarray:
        batch = self.processor.observation_batch(obs).to(self.device)
        return self.processor.unnormalize_actions(self.model.sample_actions(batch).float().cpu().numpy())
