"""Dataset rows and env observations -> model batches, and model actions -> env actions.

One processor serves training (`training_batch(row)` from the data layer's packed rows) and
inference (`observation_batch(obs)` from env observations), so both see identical inputs:

- cameras: `camera_map` sends "observation.images.<cam>" to a model camera slot; images (uint8 HWC,
  any size) are resized to the model's resolution (stretched, or openpi's resize-with-pad) and, in
  training batches, augmented (`models/images.py`); slots without a camera stay blank and masked;
- state: the `state_keys` features concatenated, normalised with the dataset stats (q01/q99 ->
  [-1, 1] for pi0.5, mean/std for pi0, min/max -> [-1, 1] for GR00T), zero-padded to max_state_dim;
- language: the family's prompt (`models/tokenize.py`): openpi's pi0 / pi0.5 format (the discretised
  state in the text when `state_in_prompt`), a chat template with image placeholders (GR00T N1.5's
  Eagle one; N1.7's Qwen3-VL one, read beside the tokenizer), or LeRobot SmolVLA's (task + "\\n") with
  SmolVLM2's tokenizer, tokenised with the policy's tokenizer ("byte", or a path to a real one);
- actions (training): normalised, zero-padded to max_action_dim, `action_dim_mask` marks real dims.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from kilovla.errors import KilovlaError
from kilovla.models.batch import PaddedBatch
from kilovla.models.family import chunk_length, family_of, vocab_size
from kilovla.models.images import RESIZE_MODES, ImageAugmentation, resize_images
from kilovla.models.tokenize import (IMAGE_PROMPTS, PAD, QWEN3VL_IMAGE_TOKEN, load_tokenizer, openpi_prompt_ids,
                                     pad_prompts, smolvla_prompt_ids, truncate)

log = logging.getLogger(__name__)
_warned_unplaced = False  # `Processor._warn_unplaced_images` speaks once per process


@dataclass
class PolicyMeta:
    preset: str
    overrides: dict = field(default_factory=dict)
    camera_map: dict[str, str] = field(default_factory=dict)  # "observation.images.<cam>" -> model slot
    state_keys: list[str] = field(default_factory=lambda: ["observation.state"])
    # "min": the least value of an int (or of a list's ints) policy.json may hold (policy_folder.py checks it)
    state_dim: int = field(default=0, metadata={"min": 0})
    action_dim: int = field(default=0, metadata={"min": 1})
    stats: dict = field(default_factory=dict)  # per feature: {"q01": [...], "q99": [...], "mean": ..., "std": ...}
    normalization: str = "quantile"  # or "mean_std", "min_max"
    state_in_prompt: bool = False
    n_action_steps: int | None = field(default=None, metadata={"min": 1})
    embodiment_id: int = field(default=0, metadata={"min": 0})  # GR00T: which per-embodiment encoders to use
    tokenizer: str = "byte"  # or a path: absolute, or relative to the policy folder
    image_resize: str = "stretch"  # or "pad" (openpi's resize_with_pad), "pad_top_left" (LeRobot SmolVLA's)
    augmentation: dict = field(default_factory=dict)  # ImageAugmentation fields; empty: none
    init_from: dict | None = None  # {"path", "layout"} of the checkpoint training started from
    # [H, W] of the training data's camera frames (eval renders at it)
    image_size: list[int] | None = field(default=None, metadata={"min": 1})
    residual: dict | None = None  # an RL residual on top of these weights (models/residual.py ResidualSpec)
    lora: dict | None = None  # LoRA adapters and their base (models/lora.py describe); merged: weights hold them
    # per dataset task (instruction), the env seeds of the demonstrations trained on (meta/episodes' `seed`, of
    # the datasets that record it); None: unknown. Folders made from this one (RL, FP8, LoRA) keep it; eval
    # refuses these seeds
    demonstration_seeds: dict[str, list[int]] | None = None


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
    if mode == "min_max":  # GR00T: [min, max] -> [-1, 1], a constant dimension -> 0
        lo, hi = np.asarray(stats["min"], np.float32), np.asarray(stats["max"], np.float32)
        const = hi - lo < CONSTANT
        scale = np.where(const, 1.0, hi - lo).astype(np.float32)
        return ((lambda x: np.where(const, 0.0, 2 * (x - lo) / scale - 1).astype(np.float32)),
                (lambda y: np.where(const, lo, (y + 1) / 2 * scale + lo).astype(np.float32)))
    raise KilovlaError(f"normalization must be one of {NORMALIZATIONS}, not {mode!r}")


NORMALIZATIONS = ("quantile", "mean_std", "min_max")
STATS_FOR = {"quantile": ("q01", "q99"), "mean_std": ("mean", "std"), "min_max": ("min", "max")}


class Processor:
    """`root`: the policy folder a relative `meta.tokenizer` path is read from."""

    def __init__(self, model_config, meta: PolicyMeta, root: str | Path | None = None):
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
        spec = meta.tokenizer
        if spec != "byte" and root is not None and not Path(spec).is_absolute():
            spec = str(Path(root) / spec)
        self.tokenizer = load_tokenizer(spec, family_of(model_config).tokenizer_kind)
        self.augmentation = ImageAugmentation.from_dict(meta.augmentation)
        if meta.image_resize not in RESIZE_MODES:
            raise KilovlaError(f"image_resize must be one of {RESIZE_MODES}, not {meta.image_resize!r}")
        self.image_token_id = family_of(model_config).image_token_id(model_config)
        self.chat_template_file: Path | None = None  # the template file the prompt is built by, where one is
        self._check_tokenizer()

    def _check_tokenizer(self) -> None:
        cfg, tok = self.cfg, self.tokenizer
        vocab = vocab_size(cfg)
        if tok.vocab_size > vocab:
            raise KilovlaError(f"the {tok.kind} tokenizer {getattr(tok, 'path', '') or ''} has {tok.vocab_size} "
                               f"tokens, the model's embedding {vocab}")
        wanted = family_of(cfg).tokenizer_kind
        if wanted is not None and tok.kind not in ("byte", wanted):
            raise KilovlaError(f"{self.meta.preset} reads a {wanted} tokenizer (a tokenizer.json), not the {tok.kind} "
                               f"tokenizer {tok.path}")
        fam = family_of(cfg)
        if self.image_token_id is None:
            self._warn_unplaced_images(fam)
            return
        if fam.image_prompt is None:
            raise KilovlaError(f"{self.meta.preset}: image_token_id is set, but {fam.title} places no images by a chat "
                               "template; leave image_token_id unset: the images then go before the prompt")
        placeholder = IMAGE_PROMPTS[fam.image_prompt][0]
        if tok.kind != "qwen3":
            raise KilovlaError(f"{self.meta.preset} builds chat prompts with {placeholder} placeholders: it needs "
                               f"a Qwen3 tokenizer (--policy.tokenizer=PATH), not the {tok.kind} tokenizer")
        if tok.token_id(placeholder) != self.image_token_id:
            raise KilovlaError(f"{tok.path}: {placeholder} is token {tok.token_id(placeholder)}, the model "
                               f"expects {self.image_token_id} (config image_token_id)")
        if self.meta.state_in_prompt:
            raise KilovlaError("GR00T reads the state through its state encoder; state_in_prompt is pi0.5's")
        self.prompt_ids("check")  # a chat template that is missing or does not render fails here, not mid-run
        if fam.image_prompt == "qwen3-vl":  # the prompt reads it: a policy folder copies it beside the tokenizer
            self.chat_template_file = tok.chat_template.path

    def _warn_unplaced_images(self, fam) -> None:
        """A tokenizer that can build the family's chat prompt while image_token_id is unset: the images go
        before the prompt instead, which is not the published model's input. Said once per process."""
        global _warned_unplaced
        tok = self.tokenizer
        if _warned_unplaced or fam.image_prompt != "qwen3-vl" or tok.kind != "qwen3":
            return
        try:
            template = tok.chat_template
        except KilovlaError:  # a tokenizer_config.json that does not parse: no prompt would be built from it
            return
        if tok.has_token(QWEN3VL_IMAGE_TOKEN) and template is not None:
            _warned_unplaced = True
            log.warning("%s: the tokenizer %s has %s and a chat template, but image_token_id is unset: the images go "
                        "before the prompt, not at the template's placeholders as NVIDIA's processor puts them; set "
                        "--policy.overrides.image_token_id=%d for NVIDIA's prompt", self.meta.preset, tok.path,
                        QWEN3VL_IMAGE_TOKEN, tok.token_id(QWEN3VL_IMAGE_TOKEN))

    def prompt_ids(self, task: str, state: np.ndarray | None = None) -> tuple[list[int], int]:
        """The prompt's token ids and how many of them are image placeholders (a GR00T chat template's)."""
        if self.image_token_id is not None:
            n = len(self.meta.camera_map)
            build = IMAGE_PROMPTS[family_of(self.cfg).image_prompt][1]
            return build(self.tokenizer, task, n, self.cfg.vision.tokens, self.image_token_id), n * self.cfg.vision.tokens
        if self.tokenizer.kind == "smolvlm2":
            return smolvla_prompt_ids(self.tokenizer, task, self.cfg.max_language_tokens), 0
        return openpi_prompt_ids(self.tokenizer, task, state if self.meta.state_in_prompt else None), 0

    def token_count(self, task: str) -> int:
        """Language tokens of a task's prompt, without the discretised state (the token layout adds an
        upper bound for it) and without image placeholders (counted as camera tokens)."""
        ids, placeholders = self.prompt_ids(task, np.zeros(0, np.float32))
        return len(ids) - placeholders

    def _state(self, data: dict) -> np.ndarray:
        parts = []
        for key, norm in zip(self.meta.state_keys, self._state_norm):
            if key not in data:
                raise KilovlaError(f"the batch lacks {key!r}, a state input of the policy")
            parts.append(norm(np.asarray(data[key], np.float32)))
        return np.concatenate(parts, axis=-1)

    def observation_batch(self, data: dict, rngs: list[np.random.Generator] | None = None) -> PaddedBatch:
        """Observations -> a model batch; with `rngs` (one per sample) images are augmented for training."""
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
            frames = np.ascontiguousarray(frames)  # a decoded request's frames are read-only: torch warns, copy
            t = torch.from_numpy(frames if frames.flags.writeable else frames.copy()).permute(0, 3, 1, 2).float() / 255.0
            t = resize_images(t, size, self.meta.image_resize)
            if rngs is not None and self.augmentation.enabled:
                t = self.augmentation.apply(t, slot, rngs)
            else:
                t = self.augmentation.inference(t, slot)
            j = cfg.cameras.index(slot)
            images[:, j] = t
            present[:, j] = True
        ids = []
        for task, s in zip(data["task"], state):
            prompt, placeholders = self.prompt_ids(task, s)
            ids.append(truncate(prompt, cfg.max_language_tokens, keep_extra=placeholders))
        tokens, mask = pad_prompts(ids, PAD)
        padded_state = torch.zeros(b, cfg.max_state_dim)
        padded_state[:, : state.shape[1]] = torch.from_numpy(state)
        return PaddedBatch(images=images, image_masks=present, camera_names=cfg.cameras, tokens=tokens,
                           token_mask=mask, state=padded_state,
                           embodiment_id=torch.full((b,), self.meta.embodiment_id, dtype=torch.long))

    def training_batch(self, row: dict, seed: int = 0) -> PaddedBatch:
        """A packed row of the data layer (actions with a time window) -> a model batch with targets.

        Image augmentation draws per sample from (seed, step, sample id), like the flow noise."""
        step = int(row.get("step", 0))
        ids = row.get("sample_index", range(len(row["task"])))
        rngs = [np.random.default_rng([seed, step, int(i), 1]) for i in ids]
        batch = self.observation_batch(row, rngs=rngs)
        actions = np.asarray(row["action"], np.float32)
        if actions.ndim != 3:
            raise KilovlaError("training rows need an action window: set delta_timestamps for 'action'")
        horizon = chunk_length(self.cfg)
        if actions.shape[1] != horizon:
            raise KilovlaError(f"the dataset's action window has {actions.shape[1]} steps, the model predicts {horizon}")
        padded = torch.zeros(len(actions), horizon, self.cfg.max_action_dim)
        padded[..., : actions.shape[2]] = torch.from_numpy(self._action_norm(actions))
        dims = torch.zeros(self.cfg.max_action_dim, dtype=torch.bool)
        dims[: actions.shape[2]] = True
        batch.actions, batch.action_dim_mask = padded, dims
        batch.action_is_pad = torch.from_numpy(np.asarray(row["action_is_pad"], bool))
        return batch

    def normalize_actions(self, actions: np.ndarray) -> np.ndarray:
        """Actions in the robot's units (..., action_dim) -> the model's normalised space."""
        return self._action_norm(np.asarray(actions, np.float32)).astype(np.float32)

    def unnormalize_actions(self, actions: np.ndarray) -> np.ndarray:
        return self._action_unnorm(actions[..., : self.meta.action_dim]).astype(np.float32)
