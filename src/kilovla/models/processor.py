"""Dataset rows and env observations -> model batches, and model actions -> env actions.

One processor serves training (`training_batch(row)` from the data layer's packed rows) and
inference (`observation_batch(obs)` from env observations), so both see identical inputs:

- cameras: `camera_map` sends "observation.images.<cam>" to a model camera slot; images (uint8 HWC,
  any size) are resized to the model's resolution; slots without a camera stay blank and masked;
- state: the `state_keys` features concatenated, normalised with the dataset stats (q01/q99 ->
  [-1, 1], pi0.5's default, or mean/std), zero-padded to the model's max_state_dim;
- language: the task, with the discretised state for pi0.5 when `state_in_prompt`, tokenised;
- actions (training): normalised, zero-padded to max_action_dim, `action_dim_mask` marks real dims.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from kilovla.errors import KilovlaError
from kilovla.models.batch import PaddedBatch
from kilovla.models.tokenize import ByteTokenizer, build_prompt, tokenize_batch


@dataclass
class PolicyMeta:
    preset: str
    overrides: dict = field(default_factory=dict)
    camera_map: dict[str, str] = field(default_factory=dict)  # "observation.images.<cam>" -> model slot
    state_keys: list[str] = field(default_factory=lambda: ["observation.state"])
    state_dim: int = 0
    action_dim: int = 0
    stats: dict = field(default_factory=dict)  # per feature: {"q01": [...], "q99": [...], "mean": ..., "std": ...}
    normalization: str = "quantile"  # or "mean_std"
    state_in_prompt: bool = False
    n_action_steps: int | None = None
    embodiment_id: int = 0  # GR00T: which per-embodiment encoders to use


CONSTANT = 1e-4  # a feature dimension narrower than this carries nothing: it normalises to 0


def _normalizer(stats: dict, mode: str):
    if mode == "quantile":
        lo, hi = np.asarray(stats["q01"], np.float32), np.asarray(stats["q99"], np.float32)
        const = hi - lo < CONSTANT
        scale = np.where(const, 1.0, hi - lo).astype(np.float32)
        return ((lambda x: np.where(const, 0.0, 2 * (x - lo) / scale - 1).astype(np.float32)),
                (lambda y: np.where(const, lo, (y + 1) / 2 * scale + lo).astype(np.float32)))
    if mode == "mean_std":
        mu, sd = np.asarray(stats["mean"], np.float32), np.asarray(stats["std"], np.float32)
        const = sd < CONSTANT
        sd = np.where(const, 1.0, sd).astype(np.float32)
        return ((lambda x: np.where(const, 0.0, (x - mu) / sd).astype(np.float32)),
                (lambda y: np.where(const, mu, y * sd + mu).astype(np.float32)))
    raise KilovlaError(f"normalization must be quantile or mean_std, not {mode!r}")


class Processor:
    def __init__(self, model_config, meta: PolicyMeta):
        self.cfg, self.meta = model_config, meta
        bad = [slot for slot in meta.camera_map.values() if slot not in model_config.cameras]
        if bad:
            raise KilovlaError(f"camera_map targets {bad} are not model cameras {list(model_config.cameras)}")
        missing = [k for k in [*meta.state_keys, "action"] if k not in meta.stats]
        if missing:
            raise KilovlaError(f"normalisation stats lack {missing}")
        if meta.state_dim > model_config.max_state_dim or meta.action_dim > model_config.max_action_dim:
            raise KilovlaError(f"state/action dims {meta.state_dim}/{meta.action_dim} exceed the model's "
                               f"{model_config.max_state_dim}/{model_config.max_action_dim}")
        self._state_norm = [_normalizer(meta.stats[k], meta.normalization)[0] for k in meta.state_keys]
        self._action_norm, self._action_unnorm = _normalizer(meta.stats["action"], meta.normalization)
        self.tokenizer = ByteTokenizer()

    def prompt(self, task: str, state: np.ndarray | None = None) -> str:
        return build_prompt(task, state if self.meta.state_in_prompt else None)

    def token_count(self, task: str) -> int:
        """Language tokens of a task's prompt (without the state, whose length is constant)."""
        return len(self.tokenizer.encode(self.prompt(task)))

    def _state(self, data: dict) -> np.ndarray:
        parts = []
        for key, norm in zip(self.meta.state_keys, self._state_norm):
            if key not in data:
                raise KilovlaError(f"the batch lacks {key!r}, a state input of the policy")
            parts.append(norm(np.asarray(data[key], np.float32)))
        return np.concatenate(parts, axis=-1)

    def observation_batch(self, data: dict) -> PaddedBatch:
        cfg = self.cfg
        state = self._state(data)
        b = len(state)
        size = cfg.vision.image_size
        images = torch.zeros(b, len(cfg.cameras), 3, size, size)
        present = torch.zeros(b, len(cfg.cameras), dtype=torch.bool)
        for key, slot in self.meta.camera_map.items():
            if key not in data:
                raise KilovlaError(f"the batch lacks camera {key!r} that the policy needs")
            frames = np.asarray(data[key])
            if frames.ndim == 5:  # a time window on the camera: the current frame is the last
                frames = frames[:, -1]
            t = torch.from_numpy(np.ascontiguousarray(frames)).permute(0, 3, 1, 2).float() / 255.0
            j = cfg.cameras.index(slot)
            images[:, j] = t if t.shape[-1] == size and t.shape[-2] == size else F.interpolate(
                t, size=(size, size), mode="bilinear", antialias=True, align_corners=False)
            present[:, j] = True
        prompts = [self.prompt(task, s) for task, s in zip(data["task"], state)]
        tokens, mask = tokenize_batch(self.tokenizer, prompts, cfg.max_language_tokens)
        padded_state = torch.zeros(b, cfg.max_state_dim)
        padded_state[:, : state.shape[1]] = torch.from_numpy(state)
        return PaddedBatch(images=images, image_masks=present, camera_names=cfg.cameras, tokens=tokens,
                           token_mask=mask, state=padded_state,
                           embodiment_id=torch.full((b,), self.meta.embodiment_id, dtype=torch.long))

    def training_batch(self, row: dict) -> PaddedBatch:
        """A packed row of the data layer (actions with a time window) -> a model batch with targets."""
        batch = self.observation_batch(row)
        actions = np.asarray(row["action"], np.float32)
        if actions.ndim != 3:
            raise KilovlaError("training rows need an action window: set delta_timestamps for 'action'")
        horizon = getattr(self.cfg, "chunk_size", None) or self.cfg.action_horizon
        if actions.shape[1] != horizon:
            raise KilovlaError(f"the dataset's action window has {actions.shape[1]} steps, the model predicts {horizon}")
        padded = torch.zeros(len(actions), horizon, self.cfg.max_action_dim)
        padded[..., : actions.shape[2]] = torch.from_numpy(self._action_norm(actions))
        dims = torch.zeros(self.cfg.max_action_dim, dtype=torch.bool)
        dims[: actions.shape[2]] = True
        batch.actions, batch.action_dim_mask = padded, dims
        batch.action_is_pad = torch.from_numpy(np.asarray(row["action_is_pad"], bool))
        return batch

    def unnormalize_actions(self, actions: np.ndarray) -> np.ndarray:
        return self._action_unnorm(actions[..., : self.meta.action_dim]).astype(np.float32)
