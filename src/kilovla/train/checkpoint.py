"""Training checkpoints: everything needed to continue exactly where a run stopped.

    run_dir/checkpoints/step_000120/
        model.safetensors    weights (kilovla keys)       \\ together a policy folder:
        policy.json          preset, cameras, stats, dims  / `kilovla eval --policy` takes it
        ema.safetensors      EMA weights (when enabled)
        optimizer.pt         optimizer and LR-scheduler state
        trainer_state.json   step, plan state (a few integers), metrics of the step
        rng.pt               torch / numpy / python RNG states
        config.yaml          the resolved training config
        stats.json           the dataset's normalisation stats
    run_dir/checkpoints/latest     the name of the newest complete checkpoint

A checkpoint is written into a hidden temporary folder and renamed into place, and `latest` moves
only after that: a crash or a full disk mid-save leaves the previous checkpoint intact.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import uuid
from pathlib import Path

import numpy as np
import torch

from kilovla.errors import KilovlaError
from kilovla.models.checkpoints import read_safetensors, save_safetensors


def save(folder: Path, *, model_state: dict, ema_state: dict | None, optimizer_state: dict, scheduler_state: dict,
         trainer_state: dict, policy_meta: dict, config_yaml: str, stats: dict, keep: int = 3) -> Path:
    folder = Path(folder)
    root = folder.parent
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / f".{folder.name}.tmp-{uuid.uuid4().hex[:8]}"
    try:
        tmp.mkdir()
        save_safetensors(model_state, tmp / "model.safetensors")
        if ema_state is not None:
            save_safetensors(ema_state, tmp / "ema.safetensors")
        torch.save({"optimizer": optimizer_state, "scheduler": scheduler_state}, tmp / "optimizer.pt")
        torch.save({"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()},
                   tmp / "rng.pt")
        (tmp / "trainer_state.json").write_text(json.dumps(trainer_state, indent=2))
        (tmp / "policy.json").write_text(json.dumps(policy_meta, indent=2))
        (tmp / "config.yaml").write_text(config_yaml)
        (tmp / "stats.json").write_text(json.dumps(stats))
        if folder.exists():
            shutil.rmtree(folder)
        os.replace(tmp, folder)
        latest_tmp = root / f".latest.{uuid.uuid4().hex[:8]}"
        latest_tmp.write_text(folder.name)
        os.replace(latest_tmp, root / "latest")
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        last = latest(root)
        raise KilovlaError(f"cannot write checkpoint {folder}: {e}; "
                           f"{'the last good checkpoint ' + str(last) + ' is intact' if last else 'no earlier checkpoint'}") from None
    _prune(root, keep)
    return folder


def _prune(root: Path, keep: int) -> None:
    steps = sorted(p for p in root.glob("step_*") if p.is_dir())
    for old in steps[:-keep] if keep > 0 else []:
        shutil.rmtree(old, ignore_errors=True)


def latest(root: Path) -> Path | None:
    pointer = Path(root) / "latest"
    if not pointer.is_file():
        return None
    folder = Path(root) / pointer.read_text().strip()
    return folder if folder.is_dir() else None


def resolve(resume: str, run_dir: Path) -> Path | None:
    """'auto' -> the run's latest checkpoint (None if there is none); else the given folder."""
    if resume == "auto":
        return latest(run_dir / "checkpoints")
    folder = Path(resume)
    if not (folder / "trainer_state.json").is_file():
        raise KilovlaError(f"{folder}: not a kilovla training checkpoint (no trainer_state.json)")
    return folder


def load(folder: Path, model, ema: dict | None, optimizer, scheduler) -> dict:
    """Restore weights, EMA, optimizer, scheduler and RNG into a (possibly sharded) model; returns the
    trainer state. Every rank reads the files itself."""
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, set_model_state_dict,
                                                         set_optimizer_state_dict)

    from kilovla.models.checkpoints import check_fits

    weights = read_safetensors(folder / "model.safetensors")
    # Sharded parameters report their local shard's shape; compare against the full shapes.
    full = {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in model.state_dict().items()}
    check_fits(full, weights, str(folder / "model.safetensors"))
    options = StateDictOptions(full_state_dict=True)
    set_model_state_dict(model, weights, options=options)
    if ema is not None and (folder / "ema.safetensors").is_file():
        for k, v in read_safetensors(folder / "ema.safetensors").items():
            if k in ema:
                ema[k].copy_(v)
    states = torch.load(folder / "optimizer.pt", weights_only=False)
    set_optimizer_state_dict(model, optimizer, states["optimizer"], options=options)
    scheduler.load_state_dict(states["scheduler"])
    rng = torch.load(folder / "rng.pt", weights_only=False)
    torch.set_rng_state(rng["torch"])
    np.random.set_state(rng["numpy"])
    random.setstate(rng["python"])
    return json.loads((folder / "trainer_state.json").read_text())

