"""Building blocks shared by the model families: Gemma RMSNorm, adaRMS, RoPE, gated MLP, time embedding,
per-category linear."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    """Gemma's RMSNorm: x / rms(x) * (1 + weight), computed in float32."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim))

    def forward(self, x: torch.Tensor, cond: torch.Tensor | None = None) -> tuple[torch.Tensor, None]:
        var = x.float().pow(2).mean(-1, keepdim=True)
        out = x.float() * torch.rsqrt(var + self.eps) * (1.0 + self.weight.float())
        return out.to(x.dtype), None


class AdaRMSNorm(nn.Module):
    """pi0.5's adaptive RMSNorm: (scale, shift, gate) = dense(cond); x / rms(x) * (1 + scale) + shift.

    The gate multiplies the residual branch that follows (see `gated_residual`). The dense weight
    starts at zero and the bias at PyTorch's default, as openpi's PyTorch port does: with a zero bias
    too (the JAX init) every gate starts at 0 and the expert's layers are silent until trained, which
    slows training from scratch.
    """

    def __init__(self, dim: int, cond_dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.dense = nn.Linear(cond_dim, 3 * dim)
        nn.init.zeros_(self.dense.weight)

    def forward(self, x: torch.Tensor, cond: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x (..., T, D), cond broadcastable to (..., T, cond_dim)."""
        var = x.float().pow(2).mean(-1, keepdim=True)
        normed = x.float() * torch.rsqrt(var + self.eps)
        scale, shift, gate = self.dense(cond).float().chunk(3, dim=-1)
        return (normed * (1.0 + scale) + shift).to(x.dtype), gate.to(x.dtype)


def gated_residual(x: torch.Tensor, y: torch.Tensor, gate: torch.Tensor | None) -> torch.Tensor:
    return x + y if gate is None else x + y * gate


class GatedMLP(nn.Module):
    """Gemma's GeGLU MLP: down(gelu_tanh(gate(x)) * up(x))."""

    def __init__(self, width: int, hidden: int):
        super().__init__()
        self.gate_proj = nn.Linear(width, hidden, bias=False)
        self.up_proj = nn.Linear(width, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, width, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.gelu(self.gate_proj(x), approximate="tanh") * self.up_proj(x))


class SwiGLU(GatedMLP):
    """Llama's and Qwen's MLP: down(silu(gate(x)) * up(x)) (the same weights as Gemma's)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def rope_angles(positions: torch.Tensor, dim: int, theta: float = 10_000.0) -> torch.Tensor:
    """The rotary angles of integer positions (..., T) for heads of `dim`: (..., T, dim / 2)."""
    freq = theta ** (-torch.arange(dim // 2, device=positions.device, dtype=torch.float32) * 2.0 / dim)
    return positions.float()[..., None] * freq


def rotate(x: torch.Tensor, angles: torch.Tensor) -> torch.Tensor:
    """Rotary embedding (halves rotated, as Llama / Qwen) on the last dim of x (..., T, H, D) by angles
    (..., T, D / 2), float32 math."""
    half = x.shape[-1] // 2
    sin, cos = angles.sin()[..., None, :], angles.cos()[..., None, :]
    x1, x2 = x.float()[..., :half], x.float()[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


def apply_rope(x: torch.Tensor, positions: torch.Tensor, theta: float = 10_000.0) -> torch.Tensor:
    """Rotary embedding on the last dim of x (..., T, H, D) at integer positions (..., T), float32 math."""
    return rotate(x, rope_angles(positions, x.shape[-1], theta))


def sincos_time_embedding(t: torch.Tensor, dim: int, min_period: float = 4e-3, max_period: float = 4.0) -> torch.Tensor:
    """openpi's flow-matching time embedding: (B,) in [0, 1] -> (B, dim)."""
    fraction = torch.linspace(0.0, 1.0, dim // 2, device=t.device, dtype=torch.float64)
    period = min_period * (max_period / min_period) ** fraction
    angles = t.double()[:, None] * (2.0 * math.pi / period)[None]
    return torch.cat([angles.sin(), angles.cos()], dim=-1).to(torch.float32)


class CategoryLinear(nn.Module):
    """One linear per category (GR00T's per-embodiment encoders): x (B, N, in), cat (B,) -> (B, N, out)."""

    def __init__(self, categories: int, n_in: int, n_out: int):
        super().__init__()
        self.W = nn.Parameter(0.02 * torch.randn(categories, n_in, n_out))
        self.b = nn.Parameter(torch.zeros(categories, n_out))

    def forward(self, x, cat):
        return torch.bmm(x, self.W[cat]) + self.b[cat][:, None]
