"""GR00T N1.7 presets and their recipes.

- ``groot-n17-tiny``: seconds per step on a CPU (two 32-px cameras of 4 tokens each: 8-px patches
  merged 2x2; a 2-layer 32-wide ViT with DeepStack from both layers; 3 Qwen3 layers 32 wide with
  MRoPE sections (2, 1, 1); a 4-block DiT, so both kinds of cross-attention block run; byte tokenizer).
- ``groot-n17-3b``: ``nvidia/GR00T-N1.7-3B``'s shapes as its config.json and weights have them (not the
  README's): Cosmos-Reason2-2B (Qwen3-VL-2B) with 16 of its 28 text layers kept (2048 wide, 16 / 8
  heads of 128, MLP 6144, vocab 151936, rope_theta 5e6, MRoPE (24, 20, 20)), its 24-layer 1024-wide
  ViT (16-px patches, temporal patch 2, 2x2 merge, a 48 x 48 position grid, DeepStack from layers 5,
  11, 17) at 224 px (NVIDIA's 230-px crop as the Qwen3-VL processor resizes it: 49 tokens a camera),
  the 4-layer VL self-attention, a 32-block DiT 1536 wide, state and action 132-d, horizon 40.
  Neutral processing (byte tokenizer unless ``--policy.tokenizer`` names one, quantile
  normalisation, everything trains), as the other ``-3b`` presets.
"""

from __future__ import annotations

from kilovla.models.family import PolicyDefaults
from kilovla.models.groot.dit import DiTConfig
from kilovla.models.groot_n17.model import GrootN17Config, QwenViTConfig
from kilovla.models.language import DecoderConfig
from kilovla.models.tokenize import BYTE_VOCAB_SIZE

PRESETS = {
    "groot-n17-tiny": GrootN17Config(
        vision=QwenViTConfig(image_size=32, patch_size=8, width=32, depth=2, heads=2, mlp_dim=64,
                             position_embeddings=16, deepstack_layers=(0, 1)),
        llm=DecoderConfig(width=32, depth=3, heads=4, kv_heads=2, head_dim=8, mlp_dim=64, vocab_size=BYTE_VOCAB_SIZE),
        mrope_section=(2, 1, 1), vl_self_attention_depth=1, vl_self_attention_heads=2, vl_self_attention_head_dim=16,
        dit=DiTConfig(depth=4, heads=2, head_dim=16, output_dim=32), hidden_size=32, action_horizon=8,
        max_action_dim=8, max_state_dim=8, num_embodiments=2, max_seq_len=64, cameras=("ego_view", "wrist"),
        max_language_tokens=48),
    "groot-n17-3b": GrootN17Config(),
}
RECIPES = {"groot-n17-tiny": PolicyDefaults(), "groot-n17-3b": PolicyDefaults()}
