"""pi0 / pi0.5 presets (models/presets.py describes each) and their fine-tuning recipes."""

from __future__ import annotations

from kilovla.models.family import PolicyDefaults
from kilovla.models.images import OPENPI_AUGMENTATION
from kilovla.models.language import DecoderConfig
from kilovla.models.pi05.model import Pi05Config
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
PRESETS = {
    "pi05-tiny": Pi05Config(pi05=True, **_TINY),
    "pi0-tiny": Pi05Config(pi05=False, **_TINY),
    "pi05-3b": Pi05Config(pi05=True, **_3B),
    "pi0-3b": Pi05Config(pi05=False, **{**_3B, "max_language_tokens": 48}),
    "pi05-base": Pi05Config(pi05=True, **_3B),
    "pi05-libero": Pi05Config(pi05=True, **{**_3B, "chunk_size": 10}),
    "pi0-base": Pi05Config(pi05=False, **{**_3B, "max_language_tokens": 48}),
}

_OPENPI = dict(tokenizer="paligemma", image_resize="pad", augmentation=OPENPI_AUGMENTATION)
RECIPES = {
    "pi05-tiny": PolicyDefaults(),
    "pi0-tiny": PolicyDefaults(),
    "pi05-3b": PolicyDefaults(state_in_prompt=True),
    "pi0-3b": PolicyDefaults(),
    "pi05-base": PolicyDefaults(state_in_prompt=True, needs_weights=True, **_OPENPI),
    "pi05-libero": PolicyDefaults(state_in_prompt=False, needs_weights=True, **_OPENPI),
    "pi0-base": PolicyDefaults(normalization="mean_std", needs_weights=True, **_OPENPI),
}
