"""The Qwen3 decoder both GR00T backbones truncate: Eagle 2.5's language model (N1.5) and Qwen3-VL's text
model (N1.7). One layer: RMSNorm, attention with RMSNorm on each head's queries and keys (GQA), SwiGLU.

The layer takes rotary angles, not positions, so each backbone says how its positions turn into
angles: N1.5 rotates by 1-D positions (`layers.rope_angles`), N1.7 by interleaved multimodal RoPE
(models/groot_n17/model.py `mrope_angles`).
"""

from __future__ import annotations

import torch
from torch import nn

from kilovla.models.attention import VarlenSpec, attend_dense, attend_varlen
from kilovla.models.language import DecoderConfig, SelfAttentionProjections
from kilovla.models.layers import SwiGLU, rotate


def heads(x: torch.Tensor, n: int, d: int) -> torch.Tensor:
    """(..., n * d) -> (..., n, d); fewer heads where a tensor-parallel rank holds a share of them."""
    return x.view(*x.shape[:-1], -1, d)


def attend(q, k, v, spec: VarlenSpec | None, mask: torch.Tensor | None, backend: str) -> torch.Tensor:
    """q/k/v (B, L, H, D) with an additive mask (or none), or packed (T, H, D) with a VarlenSpec."""
    scale = q.shape[-1] ** -0.5
    if spec is not None:
        return attend_varlen(q, k, v, spec, scale, backend)
    return attend_dense(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), mask, scale).transpose(1, 2)


class QwenNorm(nn.Module):
    """Qwen3's RMSNorm: x / rms(x) * weight."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        var = x.float().pow(2).mean(-1, keepdim=True)
        return (x.float() * torch.rsqrt(var + self.eps)).to(x.dtype) * self.weight


class _QwenAttention(SelfAttentionProjections):
    def __init__(self, c: DecoderConfig):
        super().__init__(c)
        self.q_norm, self.k_norm = QwenNorm(c.head_dim), QwenNorm(c.head_dim)


class QwenLayer(nn.Module):
    """One causal Qwen3 layer; an FSDP unit of its own."""

    def __init__(self, c: DecoderConfig):
        super().__init__()
        self.c = c
        self.input_layernorm, self.post_attention_layernorm = QwenNorm(c.width), QwenNorm(c.width)
        self.self_attn = _QwenAttention(c)
        self.mlp = SwiGLU(c.width, c.mlp_dim)

    def forward(self, x, angles, spec: VarlenSpec | None, mask: torch.Tensor | None, backend: str):
        """x (B, L, W) with an additive mask, or packed (T, W) with a causal VarlenSpec; angles
        (B, L, head_dim / 2) or (T, head_dim / 2), the rotary angles of each token."""
        c, a = self.c, self.self_attn
        h = self.input_layernorm(x)
        q = rotate(a.q_norm(heads(a.q_proj(h), c.heads, c.head_dim)), angles)
        k = rotate(a.k_norm(heads(a.k_proj(h), c.kv_heads, c.head_dim)), angles)
        v = heads(a.v_proj(h), c.kv_heads, c.head_dim)
        x = x + a.o_proj(attend(q, k, v, spec, mask, backend).flatten(-2))
        return x + self.mlp(self.post_attention_layernorm(x))


class QwenModel(nn.Module):
    """The token table, the layers and the final norm (transformers' names)."""

    def __init__(self, c: DecoderConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(c.vocab_size, c.width)
        self.layers = nn.ModuleList(QwenLayer(c) for _ in range(c.depth))
        self.norm = QwenNorm(c.width)
