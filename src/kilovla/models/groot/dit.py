"""GR00T's action head, shared by N1.5 (models/groot/model.py) and N1.7 (models/groot_n17/): a flow-matching
DiT over [state | (N1.5: future tokens) | actions] with AdaLayerNorm on the discretised flow time,
per-embodiment state / action encoders and action decoder, vlln and an optional VL self-attention
stack, with the module names of NVIDIA's checkpoints (`action_head.*`).

Flow matching in GR00T's convention (opposite to openpi): t = (0.999 - Beta(1.5, 1)) / 0.999 (N1.5;
N1.7's `flow_time` is (1 - Beta(1.5, 1)) * 0.999), x_t = (1 - t) * noise + t * actions, target velocity = actions - noise, the DiT sees
floor(t * 1000); sampling integrates from t = 0 (noise) to 1 in `num_inference_steps` Euler steps.

`GrootHead` is what both models do past their backbones (training loss, velocity, sampling); a model
says only which extra tokens sit between state and actions (`_extra_tokens`) and what each
cross-attention block sees (`_cross_attention`): N1.5 every VL token, N1.7 the image or non-image ones.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from kilovla.errors import KilovlaError
from kilovla.models.attention import VarlenSpec, additive, resolve_backend
from kilovla.models.batch import PackedBatch, PaddedBatch, flow_loss, loss_weight
from kilovla.models.groot.qwen3 import attend, heads
from kilovla.models.layers import CategoryLinear
from kilovla.models.moe import GroupedExperts, MoEConfig, MoEMLP, Routing, grouped_linear, moe_outputs


def flow_time(beta: torch.Tensor) -> torch.Tensor:
    """GR00T's flow time from a Beta(1.5, 1) draw: t runs from noise (0) to actions (1)."""
    return (0.999 - beta) / 0.999


@dataclass(frozen=True, kw_only=True)
class DiTConfig:
    depth: int = 16
    heads: int = 32
    head_dim: int = 48
    output_dim: int = 1024
    timestep_buckets: int = 1000

    @property
    def width(self) -> int:
        return self.heads * self.head_dim



class _Attention(nn.Module):
    """diffusers' Attention names: to_q, to_k, to_v, to_out.0 (all with bias), to_out.1 its dropout."""

    def __init__(self, dim: int, heads: int, head_dim: int, kv_dim: int | None = None, dropout: float = 0.0):
        super().__init__()
        inner = heads * head_dim
        self.heads, self.head_dim = heads, head_dim
        self.to_q = nn.Linear(dim, inner)
        self.to_k = nn.Linear(kv_dim or dim, inner)
        self.to_v = nn.Linear(kv_dim or dim, inner)
        self.to_out = nn.ModuleList([nn.Linear(inner, dim), nn.Dropout(dropout)])

    def forward(self, x, kv, spec: VarlenSpec | None, mask: torch.Tensor | None, backend: str) -> torch.Tensor:
        """Padded x (B, L, D) with a mask; with a VarlenSpec x is packed (T, D) or (B, L, D) read as B*L rows."""
        h, d = self.heads, self.head_dim
        lead = x.shape[:-1]
        if spec is not None:
            x = x.reshape(-1, x.shape[-1])
        out = attend(heads(self.to_q(x), h, d), heads(self.to_k(kv), h, d), heads(self.to_v(kv), h, d),
                      spec, mask, backend)
        return self.to_out[1](self.to_out[0](out.flatten(-2))).view(*lead, -1)


class _FeedForward(nn.Module):
    """diffusers' FeedForward with GELU(tanh) and final dropout: net.0.proj, net.1 (dropout), net.2, net.3."""

    def __init__(self, dim: int, dropout: float = 0.0, hidden: int | None = None):
        super().__init__()
        hidden = hidden or 4 * dim
        proj = nn.Module()
        proj.proj = nn.Linear(dim, hidden)
        self.net = nn.ModuleList([proj, nn.Dropout(dropout), nn.Linear(hidden, dim), nn.Dropout(dropout)])

    def forward(self, x):
        h = self.net[1](F.gelu(self.net[0].proj(x), approximate="tanh"))
        return self.net[3](self.net[2](h))


class FeedForwardExperts(GroupedExperts):
    """E `_FeedForward`s stacked for an MoE DiT block (models/moe.py): up_proj (E, H, W), up_bias (E, H),
    down_proj (E, W, H), down_bias (E, W); dropout where the dense one has it (its draws differ)."""

    dense_keys = {"up_proj": "net.0.proj.weight", "up_bias": "net.0.proj.bias", "down_proj": "net.2.weight",
                  "down_bias": "net.2.bias"}

    def __init__(self, n: int, width: int, hidden: int, dropout: float = 0.0):
        super().__init__(n, width, hidden)
        self.dropout = dropout

    @staticmethod
    def shapes(width: int, hidden: int) -> dict[str, tuple[int, ...]]:
        return {"up_proj": (hidden, width), "up_bias": (hidden,), "down_proj": (width, hidden), "down_bias": (width,)}

    @staticmethod
    def dense(width: int, hidden: int) -> nn.Module:
        return _FeedForward(width, hidden=hidden)

    def fan_in(self, name: str) -> int:
        """A bias draws as its linear's (nn.Linear: U(+-1 / sqrt(in_features)))."""
        return getattr(self, name.replace("_bias", "_proj")).shape[-1]

    def compute(self, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
        s = self.stacks()
        h = F.gelu(grouped_linear(x, s["up_proj"], counts, s["up_bias"]), approximate="tanh")
        y = grouped_linear(F.dropout(h, self.dropout, self.training), s["down_proj"], counts, s["down_bias"])
        return F.dropout(y, self.dropout, self.training)


class _AdaLayerNorm(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.linear = nn.Linear(dim, 2 * dim)
        self.norm = nn.LayerNorm(dim, eps=1e-5, elementwise_affine=False)

    def forward(self, x, temb):
        scale, shift = self.linear(F.silu(temb)).chunk(2, dim=-1)
        return self.norm(x) * (1 + scale[:, None]) + shift[:, None]


class _Block(nn.Module):
    """A transformer block of the VL self-attention stack (LayerNorm, self-attention) or of the DiT
    (AdaLayerNorm on the flow time, cross-attention to the VL tokens when `kv_dim` is set); an FSDP unit.
    `moe` (a DiT block's, enabled): routed experts in place of the feed-forward, `layer` seeding their draws."""

    def __init__(self, dim: int, heads: int, head_dim: int, kv_dim: int | None, ada: bool, dropout: float = 0.0,
                 moe: MoEConfig | None = None, layer: int = 0):
        super().__init__()
        self.ada = ada
        self.norm1 = _AdaLayerNorm(dim) if ada else nn.LayerNorm(dim, eps=1e-5)
        self.attn1 = _Attention(dim, heads, head_dim, kv_dim, dropout)
        self.norm3 = nn.LayerNorm(dim, eps=1e-5, elementwise_affine=not ada)
        self.ff = MoEMLP(dim, 4 * dim, moe, layer, partial(FeedForwardExperts, dropout=dropout)) if moe else \
            _FeedForward(dim, dropout)

    def forward(self, x, temb=None, context=None, spec: VarlenSpec | None = None, mask: torch.Tensor | None = None,
                backend: str = "sdpa_segments", routing: Routing | None = None):
        """Self-attention over x, or cross-attention from x to `context`; `spec`/`mask` say who sees whom;
        `routing`: what an MoE feed-forward routes and where it records its statistics."""
        h = self.norm1(x, temb) if self.ada else self.norm1(x)
        x = x + self.attn1(h, h if context is None else context, spec, mask, backend)
        h = self.norm3(x)
        return x + (self.ff(h, routing) if isinstance(self.ff, MoEMLP) else self.ff(h))


class _VLSelfAttention(nn.Module):
    def __init__(self, cfg: GrootConfig):
        super().__init__()
        self.transformer_blocks = nn.ModuleList(
            _Block(cfg.llm.width, cfg.vl_self_attention_heads, cfg.vl_self_attention_head_dim, None, ada=False,
                   dropout=cfg.dropout)
            for _ in range(cfg.vl_self_attention_depth))


class _TimestepEncoder(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        embedder = nn.Module()
        embedder.linear_1, embedder.linear_2 = nn.Linear(256, dim), nn.Linear(dim, dim)
        self.timestep_embedder = embedder

    def forward(self, t_discrete: torch.Tensor) -> torch.Tensor:
        # diffusers Timesteps(256, flip_sin_to_cos=True, downscale_freq_shift=1)
        half = 128
        exponent = -math.log(10000.0) * torch.arange(half, device=t_discrete.device, dtype=torch.float32) / (half - 1)
        angles = t_discrete.float()[:, None] * exponent.exp()[None]
        emb = torch.cat([angles.cos(), angles.sin()], dim=-1)
        e = self.timestep_embedder
        return e.linear_2(F.silu(e.linear_1(emb)))


class _DiT(nn.Module):
    def __init__(self, cfg: GrootConfig):
        super().__init__()
        d = cfg.dit
        self.timestep_encoder = _TimestepEncoder(d.width)
        self.transformer_blocks = nn.ModuleList(
            _Block(d.width, d.heads, d.head_dim, cfg.llm.width if i % 2 == 0 else None, ada=True, dropout=cfg.dropout,
                   moe=cfg.moe if cfg.moe.enabled else None, layer=i)
            for i in range(d.depth))
        self.norm_out = nn.LayerNorm(d.width, eps=1e-6, elementwise_affine=False)
        self.proj_out_1 = nn.Linear(d.width, 2 * d.width)
        self.proj_out_2 = nn.Linear(d.width, d.output_dim)


class _CategoryMLP(nn.Module):
    def __init__(self, categories, n_in, hidden, n_out):
        super().__init__()
        self.layer1, self.layer2 = CategoryLinear(categories, n_in, hidden), CategoryLinear(categories, hidden, n_out)

    def forward(self, x, cat):
        return self.layer2(F.relu(self.layer1(x, cat)), cat)


class _ActionEncoder(nn.Module):
    def __init__(self, categories, action_dim, width):
        super().__init__()
        self.width = width
        self.W1 = CategoryLinear(categories, action_dim, width)
        self.W2 = CategoryLinear(categories, 2 * width, width)
        self.W3 = CategoryLinear(categories, width, width)

    def forward(self, actions, t_discrete, cat):
        half = self.width // 2
        exponent = -torch.arange(half, device=actions.device, dtype=torch.float32) * (math.log(10000.0) / half)
        freqs = t_discrete.float()[:, None, None].expand(-1, actions.shape[1], 1) * exponent.exp()
        tau = torch.cat([freqs.sin(), freqs.cos()], dim=-1).to(actions.dtype)
        x = self.W2(torch.cat([self.W1(actions, cat), tau], dim=-1), cat)
        return self.W3(x * torch.sigmoid(x), cat)


@dataclass
class VL:
    """Backbone output: per-token features plus how to attend to them (padded mask or varlen lengths)."""

    x: torch.Tensor  # (B, L, W) padded or (T, W) packed
    mask: torch.Tensor | None = None  # (B, L) padded
    lengths: torch.Tensor | None = None  # (B,) packed
    image: torch.Tensor | None = None  # (B, L) or (T,): which tokens are image tokens (N1.7's DiT reads it)



# A cross-attention block's view of the VL tokens: (keys / values, varlen spec, additive mask).
CrossView = tuple[torch.Tensor, VarlenSpec | None, torch.Tensor | None]


class GrootHead:
    """What GR00T N1.5 and N1.7 models do past their backbones, as a base of each model class (which has
    `config`, `action_head` and `encode(batch, run) -> VL`). Hooks a model fills in: `_extra_tokens`
    (DiT tokens between state and actions) and `_cross_attention` (what each cross-attention block sees)."""

    flow_time = staticmethod(flow_time)  # Beta(1.5, 1) draw -> flow time; N1.7 has its own

    def _backend(self, device) -> str:
        return resolve_backend(self.config.attention_backend, device)

    def _extra_tokens(self, b: int) -> list[torch.Tensor]:
        return []

    def _state_tokens(self, state, embodiment) -> torch.Tensor:
        return self.action_head.state_encoder(state[:, None], embodiment)

    def _vl_adapter(self, x, backend: str, valid: torch.Tensor | None = None,
                    lengths: torch.Tensor | None = None) -> torch.Tensor:
        """vlln, then the VL self-attention stack among a sample's real tokens: x (B, L, W) with `valid`
        (B, L), or packed (T, W) with `lengths` (B,)."""
        x = self.action_head.vlln(x)
        if lengths is None:
            mask, spec = additive(valid[:, None, :] & valid[:, :, None]), None
        else:
            mask, spec = None, VarlenSpec.from_lengths(lengths, lengths)
        for block in self.action_head.vl_self_attention.transformer_blocks:
            x = block(x, spec=spec, mask=mask, backend=backend)
        return x

    def _cross_attention(self, vl: VL, b: int, n: int) -> Callable[[int], CrossView]:
        """Every real VL token, the same for every cross-attention block (N1.5's DiT)."""
        if vl.lengths is None:
            view = vl.x, None, additive(vl.mask[:, None, :].expand(b, n, -1))
        else:
            view = vl.x, VarlenSpec.from_lengths(torch.full_like(vl.lengths, n), vl.lengths), None
        return lambda block: view

    def velocity(self, vl: VL, state, x_t, t, embodiment) -> torch.Tensor:
        """DiT prediction of d x / d t for noisy actions x_t at flow time t (GR00T's convention)."""
        x, temb = self._dit_inputs(state, x_t, t, embodiment)
        x = self._dit_blocks(range(self.config.dit.depth), x, temb, vl)
        return self._decode(x, temb, x_t.shape[1], embodiment)

    def _dit_inputs(self, state, x_t, t, embodiment, embed: bool = True):
        """The DiT's tokens [state | extra | actions] (B, action_head_tokens, D) and its time embedding;
        `embed=False` (a later pipeline stage): zeros in place of the tokens, which it receives."""
        cfg, head = self.config, self.action_head
        b, horizon = x_t.shape[:2]
        t_disc = (t * cfg.dit.timestep_buckets).long()
        temb = head.model.timestep_encoder(t_disc)
        if not embed:
            return x_t.new_zeros(b, cfg.action_head_tokens, cfg.dit.width), temb
        actions = head.action_encoder(x_t, t_disc, embodiment) + head.position_embedding.weight[:horizon][None]
        return torch.cat([self._state_tokens(state, embodiment), *self._extra_tokens(b), actions], dim=1), temb

    def _dit_blocks(self, blocks: range, x, temb, vl: VL, routing: Routing | None = None):
        """DiT blocks `blocks` over x: odd ones self-attention among a sample's action-head tokens
        (never padded), even ones cross-attention to the VL tokens; `routing`: an MoE DiT's, while training."""
        head, (b, n) = self.action_head, x.shape[:2]
        backend = self._backend(x.device)
        cross = self._cross_attention(vl, b, n)
        for i in blocks:
            block = head.model.transformer_blocks[i]
            if i % 2:
                x = block(x, temb, routing=routing)
            else:
                context, spec, mask = cross(i)
                x = block(x, temb, context, spec=spec, mask=mask, backend=backend, routing=routing)
        return x

    def _decode(self, x, temb, horizon: int, embodiment) -> torch.Tensor:
        head = self.action_head
        shift, scale = head.model.proj_out_1(F.silu(temb)).chunk(2, dim=-1)
        x = head.model.norm_out(x[:, -horizon:]) * (1 + scale[:, None]) + shift[:, None]  # per token: decode actions only
        return head.action_decoder(head.model.proj_out_2(x), embodiment)

    def sample_time(self, n: int, device) -> torch.Tensor:
        beta = torch.distributions.Beta(torch.tensor(1.5, device=device), torch.tensor(1.0, device=device))
        return self.flow_time(beta.sample((n,)))

    def _embodiment(self, batch) -> torch.Tensor:
        if batch.embodiment_id is not None:
            return batch.embodiment_id
        return torch.zeros(batch.state.shape[0], dtype=torch.long, device=batch.state.device)

    def _check_actions(self, batch) -> torch.Tensor:
        if batch.actions is None:
            raise KilovlaError("training needs actions in the batch")
        if batch.actions.shape[1] != self.config.action_horizon:
            raise KilovlaError(f"GR00T predicts {self.config.action_horizon}-step chunks; "
                               f"the batch has {batch.actions.shape[1]}")
        return batch.actions

    def forward(self, batch: PaddedBatch | PackedBatch, noise: torch.Tensor | None = None,
                time: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        self._check_actions(batch)
        return self.forward_stage(batch, noise, time)

    def forward_stage(self, batch: PaddedBatch | PackedBatch, noise: torch.Tensor | None = None,
                      time: torch.Tensor | None = None, layers: range | None = None, receive=None):
        """`forward` over the DiT blocks `layers` only: one pipeline stage's share (train/pipeline.py;
        the first stage also runs the backbone and the VL self-attention). A later stage passes
        `receive(vl, x) -> (vl, x)`, given zeros of the VL features' and the DiT tokens' shapes (both
        follow from the batch); returns the loss dict after the last block, else {"hidden": (vl features, x)};
        with MoE either holds the stage's routing (`moe_outputs`: its blocks' part of the model's means)."""
        actions = self._check_actions(batch)
        depth = self.config.dit.depth
        layers = range(depth) if layers is None else layers
        noise = torch.randn_like(actions) if noise is None else noise
        t = self.sample_time(actions.shape[0], actions.device) if time is None else time
        x_t = (1 - t[:, None, None]) * noise + t[:, None, None] * actions
        target = actions - noise
        emb = self._embodiment(batch)
        vl = self.encode(batch, run=receive is None)
        x, temb = self._dit_inputs(batch.state, x_t, t, emb, embed=receive is None)
        if receive is not None:
            vl.x, x = receive(vl.x, x)
        routing = Routing() if self.config.moe.enabled else None  # the DiT's tokens: none is padding, all routed
        x = self._dit_blocks(layers, x, temb, vl, routing)
        if layers.stop < depth:
            out = {"hidden": (vl.x, x)}
        else:
            out = flow_loss(self._decode(x, temb, x_t.shape[1], emb), target, loss_weight(batch, target))
        if routing is not None:  # the routing losses beside the flow-matching loss (models/moe.py)
            out.update(moe_outputs(routing.stats, self.config.moe, layers=depth))
        return out

    def velocity_field(self, batch: PaddedBatch | PackedBatch):
        """The VL features are computed once; returns `field(x, t) -> v` in openpi's convention (noise at
        t = 1, actions at t = 0, t of shape (B,)), so samplers serve every family, and the VL features
        averaged over real tokens (B, F) for a value head. GR00T's own time runs the other way:
        t_groot = 1 - t and its velocity (actions - noise) is the negative of openpi's."""
        vl = self.encode(batch)  # once: the VL features do not depend on the flow time
        emb = self._embodiment(batch)

        def field(x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
            return -self.velocity(vl, batch.state, x, 1.0 - t, emb)

        if vl.lengths is None:
            real = vl.mask.to(vl.x.dtype)
            pooled = (vl.x * real[..., None]).sum(1) / real.sum(1, keepdim=True)
        else:
            sample = torch.repeat_interleave(torch.arange(len(vl.lengths), device=vl.x.device), vl.lengths)
            pooled = torch.zeros(len(vl.lengths), vl.x.shape[-1], dtype=vl.x.dtype, device=vl.x.device)
            pooled = pooled.index_add(0, sample, vl.x) / vl.lengths[:, None]
        return field, pooled

    @torch.no_grad()
    def sample_actions(self, batch: PaddedBatch | PackedBatch, noise: torch.Tensor | None = None) -> torch.Tensor:
        """Euler-integrate GR00T's flow from noise (t = 0) to actions (t = 1) in `num_inference_steps`."""
        cfg = self.config
        b = batch.state.shape[0]
        x = torch.randn(b, cfg.action_horizon, cfg.max_action_dim, device=batch.state.device) if noise is None else noise
        field, _ = self.velocity_field(batch)
        return self.integrate(field, x)

    def integrate(self, field, x: torch.Tensor) -> torch.Tensor:
        """Euler steps of `field` (from `velocity_field`, openpi's time convention) from noise to actions."""
        dt = 1.0 / self.config.num_inference_steps
        for step in range(self.config.num_inference_steps):
            x = x - dt * field(x, torch.full((x.shape[0],), 1.0 - step * dt, device=x.device))
        return x
