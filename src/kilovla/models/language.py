"""Gemma-style decoder weights with HF module names (layers.N.{input_layernorm, self_attn.{q,k,v,o}_proj,
post_attention_layernorm, mlp.{gate,up,down}_proj}, norm), so PaliGemma / Gemma checkpoints load by name.

No decoder runs alone: pi0's prefix and action expert share every attention call. A `DecoderLayer`'s
forward is one stream's half of such a layer, with the attention itself passed in (`attend`); the
model family composes the two halves (models/pi05/model.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from kilovla.models.layers import AdaRMSNorm, GatedMLP, RMSNorm, apply_rope, gated_residual
from kilovla.models.moe import MoEConfig, MoEMLP, Routing


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
    """`moe` (enabled): routed experts in place of the MLP (models/moe.py); `layer` seeds their own draws."""

    def __init__(self, cfg: DecoderConfig, cond_dim: int | None = None, moe: MoEConfig | None = None, layer: int = 0):
        super().__init__()
        self.cfg = cfg
        norm = (lambda: AdaRMSNorm(cfg.width, cond_dim)) if cond_dim else (lambda: RMSNorm(cfg.width))
        self.input_layernorm = norm()
        self.self_attn = SelfAttentionProjections(cfg)
        self.post_attention_layernorm = norm()
        self.mlp = MoEMLP(cfg.width, cfg.mlp_dim, moe, layer) if moe else GatedMLP(cfg.width, cfg.mlp_dim)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, cond: torch.Tensor | None, attend,
                keys_only: bool = False, routing: Routing | None = None) -> tuple[torch.Tensor, ...]:
        """norm -> q, k, v (RoPE at `positions`) -> `attend(q, k, v)` -> output projection, MLP, with
        adaRMS gates when `cond` is given. x (..., T, W).

        `attend(q, k, v) -> (out, *carry)`: this stream's attention output (..., T, heads, head_dim),
        then whatever the attention call computed besides (in pi0, the other stream's layer runs
        inside it). Returns (x, *carry), so the carry is an output of this forward like x.
        keys_only: compute k and v only (q is None) and return x unchanged, for a stream nothing reads
        after this layer except through its keys and values. routing: what an MoE MLP routes and where it
        records its statistics (ignored by a dense MLP).
        """
        cfg, attn = self.cfg, self.self_attn
        h, gate = self.input_layernorm(x, cond)
        lead = h.shape[:-1]
        q = None if keys_only else apply_rope(attn.q_proj(h).view(*lead, -1, cfg.head_dim), positions)
        k = apply_rope(attn.k_proj(h).view(*lead, -1, cfg.head_dim), positions)
        out, *carry = attend(q, k, attn.v_proj(h).view(*lead, -1, cfg.head_dim))
        if keys_only:
            return (x, *carry)
        x = gated_residual(x, attn.o_proj(out.flatten(-2)), gate)
        h, gate = self.post_attention_layernorm(x, cond)
        y = self.mlp(h, routing) if isinstance(self.mlp, MoEMLP) else self.mlp(h)
        return (gated_residual(x, y, gate), *carry)


class Decoder(nn.Module):
    def __init__(self, cfg: DecoderConfig, cond_dim: int | None = None, moe: MoEConfig | None = None):
        super().__init__()
        self.cfg = cfg
        if cfg.vocab_size:
            self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.width)
        moe = moe if moe is not None and moe.enabled else None
        self.layers = nn.ModuleList(DecoderLayer(cfg, cond_dim, moe, i) for i in range(cfg.depth))
        self.norm = AdaRMSNorm(cfg.width, cond_dim) if cond_dim else RMSNorm(cfg.width)

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """Token embeddings scaled by sqrt(width), as Gemma does."""
        x = self.embed_tokens(tokens)
        return x * torch.tensor(self.cfg.width**0.5, dtype=x.dtype)
