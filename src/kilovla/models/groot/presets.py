"""GR00T presets (models/presets.py describes each) and their fine-tuning recipes."""

from __future__ import annotations

from kilovla.models.family import PolicyDefaults
from kilovla.models.groot.model import DiTConfig, GrootConfig
from kilovla.models.images import GROOT_AUGMENTATION
from kilovla.models.language import DecoderConfig
from kilovla.models.tokenize import BYTE_VOCAB_SIZE
from kilovla.models.vision import ViTConfig

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
    "groot-tiny": _GROOT_TINY,
    "groot-n15-3b": GrootConfig(llm=_N15_LLM),  # Eagle 2.5 (SigLIP + Qwen3-1.7B, 12 layers) + 16-layer DiT
    "groot-n15": GrootConfig(llm=_N15_LLM, dropout=0.2, image_token_id=151669),
}
RECIPES = {
    "groot-tiny": PolicyDefaults(),
    "groot-n15-3b": PolicyDefaults(),
    "groot-n15": PolicyDefaults(tokenizer="qwen3", normalization="min_max", augmentation=GROOT_AUGMENTATION,
                                freeze_vision=True, freeze_vlm=True, embodiment_id=31, needs_weights=True),
}
