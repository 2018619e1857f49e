"""SmolVLA presets and their fine-tuning recipes.

- ``smolvla-tiny``: seconds per step on a CPU (two 32-px cameras of 4 tokens each, a 4-layer
  48-wide decoder, byte tokenizer), for tests and parity at tiny shapes.
- ``smolvla-base``: ``lerobot/smolvla_base``'s shapes (SigLIP-B/16 at 512 px, pixel shuffle x4 -> 64
  tokens per camera, SmolLM2 text 960 wide, 15 / 5 heads of 64, MLP 2560, vocab 49280, the first
  16 of 32 layers kept, a 720-wide expert, chunk 50, dims 32, 48 prompt tokens); LeRobot's recipe:
  the VLM and vision frozen (the expert and `state_proj` train), mean/std normalisation, SmolVLM2's
  tokenizer (a local tokenizer.json) with LeRobot's prompt (models/tokenize.py), and its
  optimizer (SmolVLAConfig's, LeRobot v0.4.4): AdamW lr 1e-4, betas (0.9, 0.95), weight decay 1e-10
  (eps 1e-8, torch's default), gradients clipped at norm 10, 1000 warmup steps, cosine decay to 2.5e-6.
  LeRobot decays over a fixed 30 000 steps (a shorter run scales warmup and decay to fit it); kilovla's
  cosine ends at the run's last step, with the warmup as given.
"""

from __future__ import annotations

from kilovla.models.family import PolicyDefaults
from kilovla.models.language import DecoderConfig
from kilovla.models.smolvla.model import SmolVLAConfig
from kilovla.models.tokenize import BYTE_VOCAB_SIZE
from kilovla.models.vision import ViTConfig

PRESETS = {
    "smolvla-tiny": SmolVLAConfig(
        vision=ViTConfig(image_size=32, patch_size=8, width=32, depth=2, heads=4, mlp_dim=64), scale_factor=2,
        text=DecoderConfig(width=48, depth=4, heads=6, kv_heads=2, head_dim=8, mlp_dim=96, vocab_size=BYTE_VOCAB_SIZE),
        num_vlm_layers=4, rms_norm_eps=1e-6, chunk_size=8, max_state_dim=8, max_action_dim=8, max_language_tokens=48,
        cameras=("camera1", "camera2")),
    "smolvla-base": SmolVLAConfig(),
}

# LeRobot's SmolVLAConfig optimizer_* and scheduler_* defaults, as OptimConfig fields
LEROBOT_OPTIM = {"lr": 1e-4, "betas": (0.9, 0.95), "weight_decay": 1e-10, "clip_grad_norm": 10.0,
                 "warmup_steps": 1000, "min_lr_ratio": 2.5e-6 / 1e-4}

RECIPES = {
    "smolvla-tiny": PolicyDefaults(),
    "smolvla-base": PolicyDefaults(tokenizer="smolvlm2", normalization="mean_std", image_resize="pad_top_left",
                                   freeze_vision=True, freeze_vlm=True, needs_weights=True, optim=LEROBOT_OPTIM),
}
