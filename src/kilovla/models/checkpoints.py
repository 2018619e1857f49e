"""Checkpoint I/O: safetensors in and out, with key maps for the published layouts.

kilovla's own keys are openpi's PyTorch port's (`paligemma_with_expert.paligemma.model...`,
`action_in_proj`, ...). Foreign layouts map onto them:

- ``openpi``: the same keys.
- ``lerobot``: LeRobot's pi0 / pi05 policies prefix every key with ``model.``; older pi05 exports
  call the time MLP ``action_time_mlp_*`` and carry pi0's unused ``state_proj``.
- both may store ``paligemma.lm_head.weight`` (tied to the token embedding; used to fill
  ``embed_tokens`` when that is absent) and the action expert's unused ``lm_head``: accepted, dropped.
- ``groot``: NVIDIA's GR00T N1.5 names (``backbone.eagle_model.*``, ``action_head.*``) are kilovla's;
  the truncated LLM's unused ``lm_head`` is dropped.

Loading is strict: missing keys, unexpected keys and shape mismatches are reported together in one
`CheckpointError` that names the file, instead of a traceback from `load_state_dict`.
"""

from __future__ import annotations

import os
import uuid
import warnings
from pathlib import Path

import torch
from torch import nn

from kilovla.errors import KilovlaError

LAYOUTS = ("kilovla", "openpi", "lerobot", "groot")
_TIED_LM_HEAD = "paligemma_with_expert.paligemma.lm_head.weight"
_EMBED = "paligemma_with_expert.paligemma.model.language_model.embed_tokens.weight"
_UNUSED = ("paligemma_with_expert.gemma_expert.lm_head.weight", "backbone.eagle_model.language_model.lm_head.weight")


class CheckpointError(KilovlaError):
    pass


def detect_layout(keys) -> str:
    keys = list(keys)
    if keys and all(k.startswith("model.") for k in keys):
        return "lerobot"
    if any(k.startswith("backbone.eagle_model.") for k in keys):
        return "groot"
    return "openpi"


def to_kilovla_keys(state: dict[str, torch.Tensor], layout: str, pi05: bool = True) -> dict[str, torch.Tensor]:
    """Rename a foreign state dict to kilovla's keys (see the module docstring)."""
    if layout not in LAYOUTS:
        raise KilovlaError(f"checkpoint layout must be one of {LAYOUTS}, not {layout!r}")
    out = {}
    for key, value in state.items():
        if layout == "lerobot":
            key = key.removeprefix("model.")
        if pi05 and key.startswith("action_time_mlp_"):
            key = key.replace("action_time_mlp_", "time_mlp_")
        if pi05 and key.startswith("state_proj."):
            continue
        out[key] = value
    if _EMBED not in out and _TIED_LM_HEAD in out:
        out[_EMBED] = out[_TIED_LM_HEAD]
    for key in (_TIED_LM_HEAD, *_UNUSED):
        out.pop(key, None)
    return out


def check_fits(own: dict[str, torch.Tensor], state: dict[str, torch.Tensor], source: str) -> None:
    """Every missing / unexpected / misshapen key of `state` against `own`, in one CheckpointError."""
    missing = sorted(set(own) - set(state))
    unexpected = sorted(set(state) - set(own))
    shapes = sorted(f"{k}: checkpoint {tuple(state[k].shape)} vs model {tuple(own[k].shape)}"
                    for k in set(own) & set(state) if tuple(state[k].shape) != tuple(own[k].shape))
    if missing or unexpected or shapes:
        parts = []
        for title, items in (("missing keys", missing), ("unexpected keys", unexpected), ("wrong shapes", shapes)):
            if items:
                shown = ", ".join(items[:8]) + (f" ... ({len(items)} in all)" if len(items) > 8 else "")
                parts.append(f"{title}: {shown}")
        raise CheckpointError(f"{source}: does not fit the model; " + "; ".join(parts))


def load_state(model: nn.Module, state: dict[str, torch.Tensor], source: str) -> None:
    """Strict load; every missing / unexpected / misshapen key reported at once."""
    check_fits(model.state_dict(), state, source)
    model.load_state_dict(state, strict=True, assign=any(p.is_meta for p in model.parameters()))


def read_safetensors(path: str | Path) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    path = Path(path)
    if path.is_dir():
        path = path / "model.safetensors"
    if not path.is_file():
        raise CheckpointError(f"{path}: no such checkpoint file")
    try:
        return load_file(str(path))
    except (SafetensorError, OSError) as e:
        raise CheckpointError(f"{path}: cannot read safetensors: {e}") from None


def load_sharded(model: nn.Module, state_dir: str | Path) -> None:
    """Weights from a torch.distributed.checkpoint folder (an FSDP run's checkpoint `state/`), read in
    this one process; a model built on the meta device is materialised on the CPU first."""
    import torch.distributed.checkpoint as dcp

    if any(p.is_meta for p in model.parameters()):
        model.to_empty(device="cpu")
    state = {"model": model.state_dict()}
    try:
        with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(state, checkpoint_id=str(state_dir), no_dist=True)
    except Exception as e:  # noqa: BLE001  DCP reports missing or misshapen keys as a CheckpointException
        raise CheckpointError(f"{state_dir}: does not fit the model: {str(e).strip()[:500]}") from None


def load_checkpoint(model: nn.Module, path: str | Path, layout: str = "auto") -> str:
    """Load weights into `model` from a safetensors file, or a folder holding model.safetensors or an
    FSDP run's sharded `state/`; returns the layout used."""
    path = Path(path)
    if path.is_dir() and not (path / "model.safetensors").exists() and (path / "state").is_dir():
        load_sharded(model, path / "state")
        return "kilovla"
    state = read_safetensors(path)
    layout = detect_layout(state) if layout == "auto" else layout
    load_state(model, to_kilovla_keys(state, layout, getattr(getattr(model, "config", None), "pi05", True)), str(path))
    return layout


def save_safetensors(state: dict[str, torch.Tensor], path: str | Path, metadata: dict[str, str] | None = None) -> None:
    """Write atomically (temp file + rename); shared tensors are stored once each."""
    from safetensors.torch import save_file

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    seen: dict[int, str] = {}
    clean = {}
    for key, tensor in state.items():
        ptr = tensor.untyped_storage().data_ptr() if tensor.device.type != "meta" else id(tensor)
        clean[key] = tensor.detach().contiguous().clone() if ptr in seen else tensor.detach().contiguous()
        seen.setdefault(ptr, key)
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        save_file(clean, str(tmp), metadata=metadata)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
