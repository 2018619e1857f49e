"""A learned VLA (pi0, pi0.5, GR00T N1.5) as a `Policy`: observations in, unnormalised action chunks out.

A policy checkpoint is a folder (the trainer's checkpoints are such folders)::

    model.safetensors   weights (kilovla keys); an FSDP run's intermediate checkpoints hold `state/`
                        (torch.distributed.checkpoint shards) instead
    policy.json         preset + config overrides, camera mapping, state keys, dims, normalisation stats,
                        tokenizer, image processing, where training started from (`init_from`), and
                        in a `kilovla quantize` folder its `quantization_config` (FP8 layers, quant/fp8.py)
    adapter.safetensors   a LoRA run's intermediate checkpoints: its adapters instead of model.safetensors;
                        policy.json `lora` names their base (models/lora.py), which is rebuilt and checked
    residual.safetensors  an RL run's residual actor (policy.json `residual`; models/residual.py): the folder's
                        policy is the base above plus its bounded correction of each executed chunk
    tokenizer/          the tokenizer files when the policy uses a real tokenizer (`VLAPolicy.save`;
                        trainer checkpoints record the tokenizer's absolute path instead)

Pre- and post-processing are the `Processor`'s, the same the trainer uses.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import uuid
from pathlib import Path

import numpy as np
import torch

from kilovla.errors import KilovlaError
from kilovla.models.checkpoints import load_checkpoint, save_safetensors
from kilovla.models.groot import GrootModel
from kilovla.models.pi05 import Pi05Model
from kilovla.models.processor import PolicyMeta, Processor


class VLAPolicy:
    """`root`: the policy folder, where a relative tokenizer path in `meta` points."""

    def __init__(self, model: Pi05Model | GrootModel, meta: PolicyMeta, device: str | torch.device = "cpu",
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

    def save(self, folder: str | Path) -> Path:
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        save_safetensors(self.model.state_dict(), folder / "model.safetensors")
        meta = self.meta
        tokenizer = getattr(self.processor.tokenizer, "path", None)
        if tokenizer is not None:  # the folder carries its tokenizer, so it runs wherever it is copied
            dst = folder / "tokenizer" / tokenizer.name
            if tokenizer.resolve() != dst.resolve():
                dst.parent.mkdir(exist_ok=True)
                if tokenizer.is_dir():
                    shutil.copytree(tokenizer, dst, dirs_exist_ok=True)
                else:
                    shutil.copy2(tokenizer, dst)
            meta = dataclasses.replace(meta, tokenizer=f"tokenizer/{tokenizer.name}")
        tmp = folder / f".policy.json.{uuid.uuid4().hex[:8]}"
        tmp.write_text(json.dumps(dataclasses.asdict(meta), indent=2))
        os.replace(tmp, folder / "policy.json")
        return folder


def load_checkpoint_policy(folder: str | Path, device: str = "cpu", ema: bool = False) -> VLAPolicy:
    """`ema`: the exponential moving average of the weights (ema.safetensors, written by a run with
    `ema_decay`) instead of the last weights."""
    from kilovla.models.presets import build_model

    folder = Path(folder)
    meta_path = folder / "policy.json"
    if ema and not (folder / "ema.safetensors").is_file() and not (folder / "adapter_ema.safetensors").is_file():
        raise KilovlaError(f"{folder / 'ema.safetensors'}: missing; only runs with ema_decay write EMA weights")
    if not meta_path.is_file():
        raise KilovlaError(f"{meta_path}: missing; a policy checkpoint folder holds policy.json and model.safetensors")
    try:
        fields = json.loads(meta_path.read_text())
        quantization = fields.pop("quantization_config", None)
        meta = PolicyMeta(**fields)
    except (json.JSONDecodeError, TypeError, AttributeError) as e:
        raise KilovlaError(f"{meta_path}: not a policy description: {e}") from None
    if meta.lora and not meta.lora.get("merged"):  # a LoRA run's checkpoint: its adapters on their base
        from kilovla.models.lora import ADAPTER_EMA_FILE, ADAPTER_FILE, build_base, load_adapters, merged_model

        adapters = folder / (ADAPTER_EMA_FILE if ema else ADAPTER_FILE)
        model = load_adapters(build_base(meta.lora, str(meta_path)), meta.lora, adapters, str(meta_path))
        # merged here, so every consumer (eval, serve, rl, quantize) gets a plain model and writes plain folders
        model = merged_model(model, meta.lora, meta.preset, meta.overrides)
        meta = dataclasses.replace(meta, lora={**meta.lora, "merged": True})
    elif quantization is None:
        model = build_model(meta.preset, device="meta", **meta.overrides)
        load_checkpoint(model, folder / "ema.safetensors" if ema else folder)  # or model.safetensors, or FSDP shards
    else:  # a `kilovla quantize` folder; quant builds on models, so it is imported only here
        from kilovla.quant.fp8 import load_quantized_weights

        model = build_model(meta.preset, device="meta", **meta.overrides)
        load_quantized_weights(model, quantization, folder, str(meta_path))
    if meta.residual is not None:  # an RL folder: the base's weights above, its learned residual beside them
        model = with_residual(model, meta, folder)
    policy = VLAPolicy(model, meta, device, root=folder)
    policy.source, policy.ema = str(folder), ema  # recorded in evaluation reports
    return policy


def with_residual(model, meta: PolicyMeta, folder: Path):
    """The base `model` with the residual actor of `folder` (residual.safetensors) on top."""
    from kilovla.models.checkpoints import read_safetensors
    from kilovla.models.residual import RESIDUAL_FILE, ResidualActor, ResidualPolicyModel, ResidualSpec, check_fits

    spec = ResidualSpec.from_json(meta.residual, str(folder / "policy.json"))
    check_fits(spec, model.config, meta.action_dim, str(folder / "policy.json"))
    path = folder / RESIDUAL_FILE
    if not path.is_file():
        raise KilovlaError(f"{path}: missing; policy.json names a residual actor")
    actor = ResidualActor(spec)
    try:
        actor.load_state_dict(read_safetensors(path))
    except RuntimeError as e:
        raise KilovlaError(f"{path}: does not match policy.json's residual: {str(e).splitlines()[0]}") from None
    return ResidualPolicyModel(model, actor)
