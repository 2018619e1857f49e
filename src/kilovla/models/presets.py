"""Named model configurations, and the defaults each family fine-tunes with.

- ``pi05-tiny`` / ``pi0-tiny`` / ``groot-tiny``: seconds per step on a CPU, for tests and the demo
  (byte tokenizer, no augmentation).
- ``pi05-3b`` / ``pi0-3b`` / ``groot-n15-3b``: the architectures of the published checkpoints
  (PaliGemma-3B + Gemma-300M expert; GR00T N1.5's Eagle 2.5 truncated to 12 Qwen3 layers + DiT head),
  shapes and state-dict keys included, with neutral processing (byte tokenizer unless
  ``--policy.tokenizer`` names one, quantile normalisation, no augmentation, everything trains; pi0.5
  sees its state in the prompt): for training from scratch or inspecting. Build them on the meta device to look without allocating:
  ``build_model("pi05-3b", device="meta")``.
- Fine-tuning a published checkpoint (``--policy.init_from``), the families' own recipes:

  - ``pi05-base``: openpi's pi0.5 base; everything trains; chunk 50; PaliGemma tokens (200); the
    discretised state in the prompt; quantile normalisation; resize-with-pad + openpi augmentation.
  - ``pi05-libero``: as openpi's ``pi05_libero``: chunk 10 and no state at all (pi0.5 has no state
    projection, so with discrete state off the model never sees it).
  - ``pi0-base``: openpi's pi0 base; state token in the suffix; 48 language tokens; mean/std.
  - ``groot-n15``: NVIDIA's GR00T N1.5 3B; backbone frozen (``tune_llm=False, tune_visual=False``),
    dropout 0.2 in the DiT and VL self-attention; chunk 16, action / state padded to 32 / 64;
    Qwen3 tokens in the Eagle chat template; min/max normalisation; embodiment ``new_embodiment``
    (31); stretched images + GR00T augmentation.

  These four refuse to train without ``--policy.init_from`` (a random 3B model is never what a
  fine-tuning recipe means); ``--policy.random_init=true`` allows it. The ``-3b`` presets train from
  random weights with one warning line saying so.

  `policy_defaults(name)` gives the part outside the model config; every item can be overridden per
  run (``--policy.state_in_prompt``, ``--policy.normalization``, ``--freeze_vlm``, ...).
"""

from __future__ import annotations

import dataclasses
import difflib
import typing

import torch

from kilovla.config import _coerce, _unknown
from kilovla.errors import KilovlaError
from kilovla.models.family import PolicyDefaults, families, family_of

__all__ = ["PRESETS", "POLICY_DEFAULTS", "PolicyDefaults", "build_model", "policy_defaults", "preset"]

# Each family's folder holds its presets and recipes (models/<family>/presets.py).
PRESETS = {name: config for fam in families() for name, config in fam.presets.items()}
POLICY_DEFAULTS = {name: recipe for fam in families() for name, recipe in fam.recipes.items()}


def check_preset(name: str, flag: str = "", known: dict | None = None) -> None:
    """Refuse a name that is not a registered preset (a key of `known`, default PRESETS), with did-you-mean;
    `flag`: the CLI's spelling (`--policy.preset`), named with the value as typed."""
    if name in (PRESETS if known is None else known):
        return
    close = difflib.get_close_matches(name, PRESETS, n=1, cutoff=0.5)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    raise KilovlaError(f"{f'{flag}={name}: ' if flag else ''}unknown model preset {name!r}{hint}; "
                       f"available: {', '.join(PRESETS)}")


def policy_defaults(name: str) -> PolicyDefaults:
    check_preset(name, known=POLICY_DEFAULTS)
    return POLICY_DEFAULTS[name]


def preset(name: str, **overrides):
    """A preset's config with fields replaced; a dict replaces fields of a nested config:
    ``preset("pi05-tiny", vision={"image_size": 64})``. Every key and value is checked as a config
    file's are: ``expert={"widht": 64}`` -> KilovlaError "unknown config key
    'policy.overrides.expert.widht' (did you mean 'policy.overrides.expert.width'?)"."""
    check_preset(name)
    return _replaced(PRESETS[name], overrides, type(PRESETS[name]), OVERRIDES_KEY)


OVERRIDES_KEY = "policy.overrides."  # where model overrides sit in a run's config (and its policy.json)


def _replaced(config, overrides, root, key: str):
    """`config` with the fields `overrides` names replaced, each value checked against its field's type."""
    if not isinstance(overrides, dict):
        raise KilovlaError(f"config key {key.rstrip('.')!r}: expected a mapping of {type(config).__name__} "
                           f"fields, got {overrides!r}")
    hints = typing.get_type_hints(type(config))
    changes = {}
    for field, value in overrides.items():
        if field not in hints:
            raise _unknown(root, f"{key}{field}", prefix=OVERRIDES_KEY)
        current = getattr(config, field)
        if dataclasses.is_dataclass(current):
            changes[field] = _replaced(current, value, root, f"{key}{field}.")
        else:
            changes[field] = _coerce(value, hints[field], f"{key}{field}")
    return dataclasses.replace(config, **changes)


def build_model(name: str, device: str | torch.device = "cpu", seed: int = 0, **overrides) -> torch.nn.Module:
    config = preset(name, **overrides)
    with torch.device(device):
        torch.manual_seed(seed)
        return family_of(config).build(config)
