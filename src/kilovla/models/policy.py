"""A learned VLA (pi0, pi0.5, GR00T N1.5) as a `Policy`: observations in, unnormalised action chunks out.

A policy checkpoint is a folder::

    model.safetensors   weights (kilovla keys)
    policy.json         preset + config overrides, camera mapping, dims, normalisation stats

Pre-processing: camera images (uint8 HWC, any size) are resized to the model's resolution and mapped
to the model's camera slots (slots with no camera are blank and masked); the state is normalised
with the dataset stats (q01/q99 -> [-1, 1], pi0.5's default, or mean/std), zero-padded, and, for
pi0.5 with `state_in_prompt`, discretised into the prompt. Post-processing undoes the action
normalisation and cuts the padding to the env's action dims.
"""

from __future__ import annotations

import dataclasses
import json
import os
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from kilovla.errors import KilovlaError
from kilovla.models.batch import PaddedBatch
from kilovla.models.checkpoints import load_checkpoint, save_safetensors
from kilovla.models.groot import GrootModel
from kilovla.models.pi05 import Pi05Model
from kilovla.models.tokenize import ByteTokenizer, build_prompt, tokenize_batch


@dataclass
class PolicyMeta:
    preset: str
    overrides: dict = field(default_factory=dict)
    camera_map: dict[str, str] = field(default_factory=dict)  # "observation.images.<cam>" -> model slot
    state_dim: int = 0
    action_dim: int = 0
    stats: dict = field(default_factory=dict)  # {"observation.state": {"q01": [...], ...}, "action": {...}}
    normalization: str = "quantile"  # or "mean_std"
    state_in_prompt: bool = False
    n_action_steps: int | None = None
    embodiment_id: int = 0  # GR00T: which per-embodiment encoders to use


def _normalizer(stats: dict, mode: str):
    if mode == "quantile":
        lo, hi = np.asarray(stats["q01"], np.float32), np.asarray(stats["q99"], np.float32)
        scale = np.maximum(hi - lo, 1e-8)
        return (lambda x: 2 * (x - lo) / scale - 1), (lambda y: (y + 1) / 2 * scale + lo)
    if mode == "mean_std":
        mu, sd = np.asarray(stats["mean"], np.float32), np.maximum(np.asarray(stats["std"], np.float32), 1e-8)
        return (lambda x: (x - mu) / sd), (lambda y: y * sd + mu)
    raise KilovlaError(f"normalization must be quantile or mean_std, not {mode!r}")


class VLAPolicy:
    def __init__(self, model: Pi05Model | GrootModel, meta: PolicyMeta, device: str | torch.device = "cpu"):
        self.model, self.meta, self.device = model.to(device).eval(), meta, torch.device(device)
        cfg = model.config
        bad = [slot for slot in meta.camera_map.values() if slot not in cfg.cameras]
        if bad:
            raise KilovlaError(f"camera_map targets {bad} are not model cameras {list(cfg.cameras)}")
        self.name = meta.preset
        self.action_dim, self.state_dim = meta.action_dim, meta.state_dim
        self.cameras = tuple(k.removeprefix("observation.images.") for k in meta.camera_map)
        self.n_action_steps = meta.n_action_steps
        self._norm_state, _ = _normalizer(meta.stats["observation.state"], meta.normalization)
        _, self._unnorm_action = _normalizer(meta.stats["action"], meta.normalization)
        self.tokenizer = ByteTokenizer()

    def reset(self) -> None:
        pass

    def preprocess(self, obs: dict) -> PaddedBatch:
        cfg = self.model.config
        state = np.asarray(obs["observation.state"], np.float32)
        b = len(state)
        norm_state = self._norm_state(state)
        size = cfg.vision.image_size
        images = torch.zeros(b, len(cfg.cameras), 3, size, size)
        present = torch.zeros(b, len(cfg.cameras), dtype=torch.bool)
        for key, slot in self.meta.camera_map.items():
            if key not in obs:
                raise KilovlaError(f"observation lacks camera {key!r} that the policy needs")
            frames = torch.as_tensor(np.asarray(obs[key])).permute(0, 3, 1, 2).float() / 255.0
            j = cfg.cameras.index(slot)
            images[:, j] = F.interpolate(frames, size=(size, size), mode="bilinear", antialias=True, align_corners=False)
            present[:, j] = True
        prompts = [build_prompt(task, s if self.meta.state_in_prompt else None) for task, s in zip(obs["task"], norm_state)]
        tokens, mask = tokenize_batch(self.tokenizer, prompts, cfg.max_language_tokens)
        padded_state = torch.zeros(b, cfg.max_state_dim)
        padded_state[:, : state.shape[1]] = torch.as_tensor(norm_state)
        return PaddedBatch(images=images, image_masks=present, camera_names=cfg.cameras, tokens=tokens,
                           token_mask=mask, state=padded_state,
                           embodiment_id=torch.full((b,), self.meta.embodiment_id, dtype=torch.long)).to(self.device)

    def select_action(self, obs: dict) -> np.ndarray:
        actions = self.model.sample_actions(self.preprocess(obs)).float().cpu().numpy()
        return self._unnorm_action(actions[..., : self.action_dim]).astype(np.float32)

    def save(self, folder: str | Path) -> Path:
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        save_safetensors(self.model.state_dict(), folder / "model.safetensors")
        tmp = folder / f".policy.json.{uuid.uuid4().hex[:8]}"
        tmp.write_text(json.dumps(dataclasses.asdict(self.meta), indent=2))
        os.replace(tmp, folder / "policy.json")
        return folder


def load_checkpoint_policy(folder: str | Path, device: str = "cpu") -> VLAPolicy:
    from kilovla.models.presets import build_model

    folder = Path(folder)
    meta_path = folder / "policy.json"
    if not meta_path.is_file():
        raise KilovlaError(f"{meta_path}: missing; a policy checkpoint folder holds policy.json and model.safetensors")
    try:
        meta = PolicyMeta(**json.loads(meta_path.read_text()))
    except (json.JSONDecodeError, TypeError) as e:
        raise KilovlaError(f"{meta_path}: not a policy description: {e}") from None
    overrides = {k: tuple(v) if isinstance(v, list) else v for k, v in meta.overrides.items()}
    model = build_model(meta.preset, device="meta", **overrides)
    load_checkpoint(model, folder / "model.safetensors")
    return VLAPolicy(model, meta, device)
