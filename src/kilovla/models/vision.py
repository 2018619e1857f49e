"""SigLIP-style vision transformer, with the module names of HF's SiglipVisionModel (so PaliGemma
checkpoints load by name): embeddings.{patch_embedding, position_embedding}, encoder.layers.N.*,
post_layernorm. Images (N, 3, H, W) in [0, 1] -> tokens (N, (H/p)*(W/p), width)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True, kw_only=True)
class ViTConfig:
    image_size: int = 224
    patch_size: int = 14
    width: int = 1152
    depth: int = 27
    heads: int = 16
    mlp_dim: int = 4304

    @property
    def tokens(self) -> int:
        return (self.image_size // self.patch_size) ** 2


class _Embeddings(nn.Module):
    def __init__(self, cfg: ViTConfig):
        super().__init__()
        self.patch_embedding = nn.Conv2d(3, cfg.width, cfg.patch_size, stride=cfg.patch_size)
        self.position_embedding = nn.Embedding(cfg.tokens, cfg.width)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = self.patch_embedding(images).flatten(2).transpose(1, 2)  # (N, P, W)
        return x + self.position_embedding.weight[None]


class _Attention(nn.Module):
    def __init__(self, cfg: ViTConfig):
        super().__init__()
        self.heads = cfg.heads
        self.q_proj, self.k_proj, self.v_proj, self.out_proj = (nn.Linear(cfg.width, cfg.width) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, t, w = x.shape
        q, k, v = (p(x).view(n, t, self.heads, -1).transpose(1, 2) for p in (self.q_proj, self.k_proj, self.v_proj))
        return self.out_proj(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(n, t, w))


class _MLP(nn.Module):
    def __init__(self, cfg: ViTConfig):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(cfg.width, cfg.mlp_dim), nn.Linear(cfg.mlp_dim, cfg.width)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x), approximate="tanh"))


class _Layer(nn.Module):
    def __init__(self, cfg: ViTConfig):
        super().__init__()
        self.layer_norm1, self.layer_norm2 = nn.LayerNorm(cfg.width, eps=1e-6), nn.LayerNorm(cfg.width, eps=1e-6)
        self.self_attn, self.mlp = _Attention(cfg), _MLP(cfg)

    def forward(self, x):
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.mlp(self.layer_norm2(x))


class _Encoder(nn.Module):
    def __init__(self, cfg: ViTConfig):
        super().__init__()
        self.layers = nn.ModuleList(_Layer(cfg) for _ in range(cfg.depth))


class VisionModel(nn.Module):
    def __init__(self, cfg: ViTConfig):
        super().__init__()
        self.cfg = cfg
        self.embeddings = _Embeddings(cfg)
        self.encoder = _Encoder(cfg)
        self.post_layernorm = nn.LayerNorm(cfg.width, eps=1e-6)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        """images (N, 3, H, W) float in [0, 1] -> (N, tokens, width)."""
        x = self.embeddings(images * 2.0 - 1.0)
        for layer in self.encoder.layers:
            x = layer(x)
        return self.post_layernorm(x)


class VisionTower(nn.Module):
    """HF nesting: vision_tower.vision_model.*"""

    def __init__(self, cfg: ViTConfig):
        super().__init__()
        self.vision_model = VisionModel(cfg)

    def forward(self, images):
        return self.vision_model(images)
