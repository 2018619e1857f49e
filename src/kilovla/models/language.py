"""Gemma-style decoder weights with HF module names (layers.N.{input_layernorm, self_attn.{q,k,v,o}_proj,
post_attention_layernorm, mlp.{gate,up,down}_proj}, norm), so PaliGemma / Gemma checkpoints load by name.

The forward pass lives with the model family (pi0's prefix and action expert share every attention
call, so no decoder runs alone); this file only holds the weights and the per-stream projections.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from kilovla.models.layers import AdaRMSNorm, GatedMLP, RMSNorm


@dataclass(frozen=True, kw_only=True)
class DecoderConfig:
    width: int = 2048
    depth: int = 18
    heads: int = 8
    kv_heads: int = 1
    head_dim: int = 256
    mlp_dim: int = 16384
    vocab_size: int = 257152  # 0: no embedding table (pi0's action expert)


class SelfAttentionProjections(nn.Module):
    def __init__(self, cfg: DecoderConfig):
        super().__init__()
        self.q_proj = nn.Linear(cfg.width, cfg.heads * cfg.head_dim, bias=False)
        self.k_proj = nn.Linear(cfg.width, cfg.kv_heads * cfg.head_dim, bias=False)
        self.v_proj = nn.Linear(cfg.width, cfg.kv_heads * cfg.head_dim, bias=False)
        self.o_proj = nn.Linear(cfg.heads * cfg.head_dim, cfg.width, bias=False)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: DecoderConfig, cond_dim: int | None = None):
        super().__init__()
        norm = (lambda: AdaRMSNorm(cfg.width, cond_dim)) if cond_dim else (lambda: RMSNorm(cfg.width))
        self.input_layernorm = norm()
        self.self_attn = SelfAttentionProjections(cfg)
        self.post_attention_layernorm = norm()
        self.mlp = GatedMLP(cfg.width, cfg.mlp_dim)


class Decoder(nn.Module):
    def __init__(self, cfg: DecoderConfig, cond_dim: int | None = None):
        super().__init__()
        self.cfg = cfg
        if cfg.vocab_size:
            self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.width)
        self.layers = nn.ModuleList(DecoderLayer(cfg, cond_dim) for _ in range(cfg.depth))
        self.norm = AdaRMSNorm(cfg.width, cond_dim) if cond_dim else RMSNorm(cfg.width)

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """Token embeddings scaled by sqrt(width), as Gemma does."""
        x = self.embed_tokens(tokens)
        return x * torch.tensor(self.cfg.width**0.5, dtype=x.dtype)
