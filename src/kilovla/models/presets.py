"""Named model configurations.

- ``pi05-tiny`` / ``pi0-tiny`` / ``groot-tiny``: seconds per step on a CPU, for tests and the demo.
- ``pi05-3b`` / ``pi0-3b``: PaliGemma-3B (SigLIP So400m/14 at 224 px + Gemma-2B) with the Gemma-300M
  action expert, the shapes and state-dict keys of the published openpi / LeRobot checkpoints.
- ``groot-n15-3b``: GR00T N1.5 (Eagle 2.5 backbone truncated to 12 LLM layers, DiT action head) with
  the module names of NVIDIA's checkpoint. Build
  them on the meta device to inspect without allocating: ``build_model("pi05-3b", device="meta")``.
"""

from __future__ import annotations

import dataclasses

import torch

from kilovla.errors import KilovlaError
from kilovla.models.groot import DiTConfig, GrootConfig, GrootModel
from kilovla.models.language import DecoderConfig
from kilovla.models.pi05 import Pi05Config, Pi05Model
from kilovla.models.tokenize import BYTE_VOCAB_SIZE
from kilovla.models.vision import ViTConfig

_TINY = dict(
    vision=ViTConfig(image_size=32, patch_size=8, width=32, depth=2, heads=2, mlp_dim=64),
    lm=DecoderConfig(width=48, depth=2, heads=2, kv_heads=1, head_dim=16, mlp_dim=96, vocab_size=BYTE_VOCAB_SIZE),
    expert=DecoderConfig(width=32, depth=2, heads=2, kv_heads=1, head_dim=16, mlp_dim=64, vocab_size=0),
    chunk_size=8, max_action_dim=8, max_state_dim=8, max_language_tokens=48,
)
_3B = dict(
    vision=ViTConfig(image_size=224, patch_size=14, width=1152, depth=27, heads=16, mlp_dim=4304),
    lm=DecoderConfig(width=2048, depth=18, heads=8, kv_heads=1, head_dim=256, mlp_dim=16384, vocab_size=257152),
    expert=DecoderConfig(width=1024, depth=18, heads=8, kv_heads=1, head_dim=256, mlp_dim=4096, vocab_size=0),
    chunk_size=50, max_action_dim=32, max_state_dim=32, max_language_tokens=200,
)
_GROOT_TINY = GrootConfig(
    vision=ViTConfig(image_size=32, patch_size=8, width=32, depth=2, heads=2, mlp_dim=64),
    llm=DecoderConfig(width=32, depth=2, heads=4, kv_heads=2, head_dim=8, mlp_dim=64, vocab_size=BYTE_VOCAB_SIZE),
    vl_self_attention_depth=1, vl_self_attention_heads=2, vl_self_attention_head_dim=16,
    dit=DiTConfig(depth=2, heads=2, head_dim=16, output_dim=32), hidden_size=32, future_tokens=4,
    action_horizon=8, max_action_dim=8, max_state_dim=8, num_embodiments=2, max_seq_len=64,
    cameras=("ego_view", "wrist"), max_language_tokens=48,
)
PRESETS = {
    "pi05-tiny": Pi05Config(pi05=True, **_TINY),
    "pi0-tiny": Pi05Config(pi05=False, **_TINY),
    "pi05-3b": Pi05Config(pi05=True, **_3B),
    "pi0-3b": Pi05Config(pi05=False, **{**_3B, "max_language_tokens": 48}),
    "groot-tiny": _GROOT_TINY,
    "groot-n15-3b": GrootConfig(),  # Eagle 2.5 (SigLIP + Qwen3-1.7B, 12 layers) + 16-layer DiT
}


def preset(name: str, **overrides):
    """A preset's config with fields replaced; a dict replaces fields of a nested config:
    ``preset("pi05-tiny", vision={"image_size": 64})``."""
    if name not in PRESETS:
        raise KilovlaError(f"unknown model preset {name!r}; available: {', '.join(PRESETS)}")
    base = PRESETS[name]
    names = {f.name for f in dataclasses.fields(base)}
    unknown = sorted(set(overrides) - names)
    if unknown:
        raise KilovlaError(f"{name} has no config fields {unknown}; fields: {', '.join(sorted(names))}")
    resolved = {}
    for key, value in overrides.items():
        current = getattr(base, key)
        if isinstance(value, dict) and dataclasses.is_dataclass(current):
            value = dataclasses.replace(current, **value)
        elif isinstance(value, list):
            value = tuple(value)
        resolved[key] = value
    return dataclasses.replace(base, **resolved)


def build_model(name: str, device: str | torch.device = "cpu", seed: int = 0, **overrides) -> Pi05Model | GrootModel:
    config = preset(name, **overrides)
    with torch.device(device):
        torch.manual_seed(seed)
        return GrootModel(config) if isinstance(config, GrootConfig) else Pi05Model(config)
