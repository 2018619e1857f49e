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
from dataclasses import dataclass, field

import torch

from kilovla.errors import KilovlaError
from kilovla.models.groot import DiTConfig, GrootConfig, GrootModel
from kilovla.models.images import GROOT_AUGMENTATION, OPENPI_AUGMENTATION, ImageAugmentation
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
# Eagle 2.5's Qwen3: 151643 BPE tokens + 37 added ones (<|im_start|> ... <IMG_CONTEXT>=151669 ...).
_N15_LLM = DecoderConfig(width=2048, depth=12, heads=16, kv_heads=8, head_dim=128, mlp_dim=6144, vocab_size=151680)
PRESETS = {
    "pi05-tiny": Pi05Config(pi05=True, **_TINY),
    "pi0-tiny": Pi05Config(pi05=False, **_TINY),
    "pi05-3b": Pi05Config(pi05=True, **_3B),
    "pi0-3b": Pi05Config(pi05=False, **{**_3B, "max_language_tokens": 48}),
    "groot-tiny": _GROOT_TINY,
    "groot-n15-3b": GrootConfig(llm=_N15_LLM),  # Eagle 2.5 (SigLIP + Qwen3-1.7B, 12 layers) + 16-layer DiT
    "pi05-base": Pi05Config(pi05=True, **_3B),
    "pi05-libero": Pi05Config(pi05=True, **{**_3B, "chunk_size": 10}),
    "pi0-base": Pi05Config(pi05=False, **{**_3B, "max_language_tokens": 48}),
    "groot-n15": GrootConfig(llm=_N15_LLM, dropout=0.2, image_token_id=151669),
}


@dataclass(frozen=True, kw_only=True)
class PolicyDefaults:
    """What a family's fine-tuning recipe sets outside the model config."""

    tokenizer: str = "byte"  # byte, paligemma (SentencePiece), qwen3 (tokenizer.json + Eagle template)
    normalization: str = "quantile"  # quantile (pi0.5), mean_std (pi0), min_max (GR00T)
    state_in_prompt: bool = False
    image_resize: str = "stretch"  # or pad (openpi's resize_with_pad)
    augmentation: ImageAugmentation = field(default_factory=ImageAugmentation)
    freeze_vision: bool = False
    freeze_vlm: bool = False  # GR00T: the whole Eagle backbone (tune_llm=False, tune_visual=False)
    embodiment_id: int = 0
    # A recipe for fine-tuning published weights: training it from random weights is refused unless
    # asked for (--policy.random_init=true), since a random 3B model is never what such a run wants.
    needs_weights: bool = False


_OPENPI = dict(tokenizer="paligemma", image_resize="pad", augmentation=OPENPI_AUGMENTATION)
POLICY_DEFAULTS = {
    "pi05-tiny": PolicyDefaults(),
    "pi0-tiny": PolicyDefaults(),
    "groot-tiny": PolicyDefaults(),
    "pi05-3b": PolicyDefaults(state_in_prompt=True),
    "pi0-3b": PolicyDefaults(),
    "groot-n15-3b": PolicyDefaults(),
    "pi05-base": PolicyDefaults(state_in_prompt=True, needs_weights=True, **_OPENPI),
    "pi05-libero": PolicyDefaults(state_in_prompt=False, needs_weights=True, **_OPENPI),
    "pi0-base": PolicyDefaults(normalization="mean_std", needs_weights=True, **_OPENPI),
    "groot-n15": PolicyDefaults(tokenizer="qwen3", normalization="min_max", augmentation=GROOT_AUGMENTATION,
                                freeze_vision=True, freeze_vlm=True, embodiment_id=31, needs_weights=True),
}


def policy_defaults(name: str) -> PolicyDefaults:
    if name not in POLICY_DEFAULTS:
        raise KilovlaError(f"unknown model preset {name!r}; available: {', '.join(PRESETS)}")
    return POLICY_DEFAULTS[name]


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
