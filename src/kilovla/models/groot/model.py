"""GR00T N1.5: an Eagle VLM (SigLIP -> mlp1 -> Qwen3 truncated to its first layers) and a flow-matching
DiT action head, with the module names of NVIDIA's checkpoint (`backbone.eagle_model.*`, `action_head.*`).

Per sample::

    VL tokens   = [camera tokens (256 each) | language tokens]   causal Qwen3, first `llm.depth` layers
    action head = vlln -> VL self-attention stack -> DiT over [state (1) | future tokens (32) | actions (16)]
                  DiT blocks alternate cross-attention to the VL tokens (even) and self-attention (odd),
                  AdaLayerNorm on the discretised flow time; per-embodiment state/action encoders/decoder

Flow matching in GR00T's convention (opposite to openpi): t = (0.999 - Beta(1.5, 1)) / 0.999,
x_t = (1 - t) * noise + t * actions, target velocity = actions - noise, the DiT sees
floor(t * 1000); sampling integrates from t = 0 (noise) to 1 in `num_inference_steps` Euler steps.

With `image_token_id` set (GR00T N1.5's Eagle prompt, `tokenize.eagle_prompt_ids`) the language
tokens are the whole chat template and each camera's tokens replace its run of ``<IMG_CONTEXT>``
placeholders, as Eagle does; without it (byte-tokenised models trained from scratch) the camera
tokens come first and the language after.

Padded and packed paths as in pi0.5 (`config.packing`): the packed one runs the causal LM and the
VL self-attention as varlen calls over real tokens, and the DiT's cross-attention as a varlen call
from each sample's 49 action-head tokens to that sample's VL tokens. The padded path masks padding
everywhere; NVIDIA's DiT leaves the VL padding unmasked in cross-attention, so on padded batches
our reference differs from theirs exactly where theirs attends to padding.

With `moe` (`--policy.moe.*`, models/moe.py) each DiT block's feed-forward is routed experts (`FeedForwardExperts`);
the LLM's and the VL self-attention's MLPs stay dense. The DiT's tokens are never padding, so both paths
route all of them, in the same order.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from kilovla.errors import KilovlaError
from kilovla.models.attention import (VarlenSpec, additive, attend_dense, attend_varlen,
                                      resolve_backend)
from kilovla.models.batch import PackedBatch, PaddedBatch, flow_loss, loss_weight, pack_prefix, padded_prefix
from kilovla.models.family import CameraSlots
from kilovla.models.language import DecoderConfig
from kilovla.models.layers import CategoryLinear, SwiGLU, apply_rope
from kilovla.models.moe import GroupedExperts, MoEConfig, MoEMLP, Routing, grouped_linear, moe_outputs
from kilovla.models.vision import ViTConfig, VisionTower


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


@dataclass(frozen=True, kw_only=True)
class GrootConfig(CameraSlots):
    vision: ViTConfig = field(default_factory=ViTConfig)
    llm: DecoderConfig = field(default_factory=lambda: DecoderConfig(
        width=2048, depth=12, heads=16, kv_heads=8, head_dim=128, mlp_dim=6144, vocab_size=151936))
    rope_theta: float = 1_000_000.0
    vl_self_attention_depth: int = 4
    vl_self_attention_heads: int = 32
    vl_self_attention_head_dim: int = 64
    dit: DiTConfig = field(default_factory=DiTConfig)
    hidden_size: int = 1024
    future_tokens: int = 32
    action_horizon: int = 16
    max_action_dim: int = 32
    max_state_dim: int = 64
    num_embodiments: int = 32
    max_seq_len: int = 1024
    cameras: tuple[str, ...] = ("ego_view",)
    disabled_cameras: tuple[str, ...] = ()
    max_language_tokens: int = 200
    language_padding: str = "max_length"
    packing: bool = False
    attention_backend: str = "auto"  # varlen kernel of the packed path (models/attention.py)
    num_inference_steps: int = 4
    # NVIDIA fine-tunes with 0.2 in the DiT and the VL self-attention (diffusers' attention-output,
    # feed-forward and final dropout); 0 trains from scratch deterministically.
    dropout: float = 0.0
    # Eagle's <IMG_CONTEXT> id (151669 in N1.5): camera features go where the prompt has these.
    image_token_id: int | None = None
    moe: MoEConfig = field(default_factory=MoEConfig)  # routed experts in the DiT blocks' feed-forwards (models/moe.py)

    def __post_init__(self):
        if self.vl_self_attention_heads * self.vl_self_attention_head_dim != self.llm.width:
            raise KilovlaError("the VL self-attention width must equal the LLM width")
        self.check_shared()
        self.moe.check()

    @property
    def action_head_tokens(self) -> int:
        return 1 + self.future_tokens + self.action_horizon


def _heads(x: torch.Tensor, n: int, d: int) -> torch.Tensor:
    """(..., n * d) -> (..., n, d); fewer heads where a tensor-parallel rank holds a share of them."""
    return x.view(*x.shape[:-1], -1, d)


def _attend(q, k, v, spec: VarlenSpec | None, mask: torch.Tensor | None, backend: str) -> torch.Tensor:
    """q/k/v (B, L, H, D) with an additive mask (or none), or packed (T, H, D) with a VarlenSpec."""
    scale = q.shape[-1] ** -0.5
    if spec is not None:
        return attend_varlen(q, k, v, spec, scale, backend)
    return attend_dense(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), mask, scale).transpose(1, 2)


# -- Eagle backbone ------------------------------------------------------------------------------------
class _QwenNorm(nn.Module):
    """Qwen3's RMSNorm: x / rms(x) * weight."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        var = x.float().pow(2).mean(-1, keepdim=True)
        return (x.float() * torch.rsqrt(var + self.eps)).to(x.dtype) * self.weight


class _QwenAttention(nn.Module):
    def __init__(self, c: DecoderConfig):
        super().__init__()
        self.q_proj = nn.Linear(c.width, c.heads * c.head_dim, bias=False)
        self.k_proj = nn.Linear(c.width, c.kv_heads * c.head_dim, bias=False)
        self.v_proj = nn.Linear(c.width, c.kv_heads * c.head_dim, bias=False)
        self.o_proj = nn.Linear(c.heads * c.head_dim, c.width, bias=False)
        self.q_norm, self.k_norm = _QwenNorm(c.head_dim), _QwenNorm(c.head_dim)


class _QwenLayer(nn.Module):
    """One causal Qwen3 layer; an FSDP unit of its own."""

    def __init__(self, c: DecoderConfig, rope_theta: float):
        super().__init__()
        self.c, self.rope_theta = c, rope_theta
        self.input_layernorm, self.post_attention_layernorm = _QwenNorm(c.width), _QwenNorm(c.width)
        self.self_attn = _QwenAttention(c)
        self.mlp = SwiGLU(c.width, c.mlp_dim)

    def forward(self, x, positions, spec: VarlenSpec | None, mask: torch.Tensor | None, backend: str):
        """x (B, L, W) with an additive mask, or packed (T, W) with a causal VarlenSpec."""
        c, a = self.c, self.self_attn
        h = self.input_layernorm(x)
        q = apply_rope(a.q_norm(_heads(a.q_proj(h), c.heads, c.head_dim)), positions, self.rope_theta)
        k = apply_rope(a.k_norm(_heads(a.k_proj(h), c.kv_heads, c.head_dim)), positions, self.rope_theta)
        v = _heads(a.v_proj(h), c.kv_heads, c.head_dim)
        x = x + a.o_proj(_attend(q, k, v, spec, mask, backend).flatten(-2))
        return x + self.mlp(self.post_attention_layernorm(x))


class _QwenModel(nn.Module):
    def __init__(self, c: DecoderConfig, rope_theta: float):
        super().__init__()
        self.embed_tokens = nn.Embedding(c.vocab_size, c.width)
        self.layers = nn.ModuleList(_QwenLayer(c, rope_theta) for _ in range(c.depth))
        self.norm = _QwenNorm(c.width)


class _QwenForCausalLM(nn.Module):
    def __init__(self, c: DecoderConfig, rope_theta: float):
        super().__init__()
        self.model = _QwenModel(c, rope_theta)


class _EagleModel(nn.Module):
    def __init__(self, cfg: GrootConfig):
        super().__init__()
        self.vision_model = VisionTower(cfg.vision)
        self.mlp1 = nn.Sequential(nn.Linear(cfg.vision.width, cfg.llm.width))
        self.language_model = _QwenForCausalLM(cfg.llm, cfg.rope_theta)


class _Backbone(nn.Module):
    def __init__(self, cfg: GrootConfig):
        super().__init__()
        self.eagle_model = _EagleModel(cfg)


# -- action head -------------------------------------------------------------------------------------
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
        out = _attend(_heads(self.to_q(x), h, d), _heads(self.to_k(kv), h, d), _heads(self.to_v(kv), h, d),
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


class _ActionHead(nn.Module):
    def __init__(self, cfg: GrootConfig):
        super().__init__()
        d = cfg.dit
        self.model = _DiT(cfg)
        self.state_encoder = _CategoryMLP(cfg.num_embodiments, cfg.max_state_dim, cfg.hidden_size, d.width)
        self.action_encoder = _ActionEncoder(cfg.num_embodiments, cfg.max_action_dim, d.width)
        self.action_decoder = _CategoryMLP(cfg.num_embodiments, d.output_dim, cfg.hidden_size, cfg.max_action_dim)
        self.future_tokens = nn.Embedding(cfg.future_tokens, d.width)
        self.vlln = nn.LayerNorm(cfg.llm.width)
        self.vl_self_attention = _VLSelfAttention(cfg)
        self.position_embedding = nn.Embedding(cfg.max_seq_len, d.width)


@dataclass
class _VL:
    """Backbone output: per-token features plus how to attend to them (padded mask or varlen lengths)."""

    x: torch.Tensor  # (B, L, W) padded or (T, W) packed
    mask: torch.Tensor | None = None  # (B, L) padded
    lengths: torch.Tensor | None = None  # (B,) packed


class GrootModel(nn.Module):
    def __init__(self, config: GrootConfig):
        super().__init__()
        self.config = config
        self.backbone = _Backbone(config)
        self.action_head = _ActionHead(config)

    @property
    def eagle(self) -> _EagleModel:
        return self.backbone.eagle_model

    def _backend(self, device) -> str:
        return resolve_backend(self.config.attention_backend, device)

    # -- backbone ----------------------------------------------------------------------------------
    def _llm(self, x, positions, spec: VarlenSpec | None, mask: torch.Tensor | None, backend: str):
        for layer in self.eagle.language_model.model.layers:
            x = layer(x, positions, spec, mask, backend)
        return self.eagle.language_model.model.norm(x)

    def _embed_images(self, images):
        if images.shape[-1] != self.config.vision.image_size:
            raise KilovlaError(f"images are {tuple(images.shape[-2:])}, the model takes "
                               f"{self.config.vision.image_size}x{self.config.vision.image_size}")
        return self.eagle.mlp1(self.eagle.vision_model(images))

    def _place_images(self, text: torch.Tensor, tokens: torch.Tensor, valid: torch.Tensor | None,
                      images: torch.Tensor) -> torch.Tensor:
        """Eagle's prompt: the i-th present image's tokens replace the i-th run of placeholders (in
        sample order, then camera order). text (..., W) embeddings of tokens (...); images (N, P, W)."""
        slots = tokens == self.config.image_token_id
        if valid is not None:
            slots &= valid
        if int(slots.sum()) != images.shape[0] * images.shape[1]:
            raise KilovlaError(f"the prompts hold {int(slots.sum())} image placeholders, the batch has "
                               f"{images.shape[0]} images of {images.shape[1]} tokens")
        return text.masked_scatter(slots[..., None], images.to(text.dtype))

    def _vl_padded(self, batch: PaddedBatch, backend: str, run: bool = True) -> _VL:
        """`run=False` (a later pipeline stage): zeros of the VL features' shape with their mask, the
        backbone not run (the stage receives the features)."""
        cfg = self.config
        batch = batch.select_cameras(cfg.enabled_cameras)
        if cfg.language_padding == "longest":
            batch = batch.trim_language()
        if run:
            img = self._embed_images(batch.images.flatten(0, 1))
            text = self.eagle.language_model.model.embed_tokens(batch.tokens)
        else:
            img = batch.state.new_zeros(batch.images.shape[0] * batch.images.shape[1], cfg.vision.tokens, cfg.llm.width)
            text = batch.state.new_zeros(*batch.tokens.shape, cfg.llm.width)
        if cfg.image_token_id is None:
            x, valid = padded_prefix(img, batch.image_masks, text, batch.token_mask)
        else:
            present = img.view(*batch.image_masks.shape, *img.shape[1:])[batch.image_masks]
            x, valid = self._place_images(text, batch.tokens, batch.token_mask, present), batch.token_mask
        if not run:
            return _VL(x, mask=valid)
        positions = valid.long().cumsum(1) - 1
        n = valid.shape[1]
        causal = torch.ones(n, n, dtype=torch.bool, device=x.device).tril()
        mask = additive(causal[None] & valid[:, None, :] & valid[:, :, None])
        x = self._llm(x, positions, None, mask, backend)
        x = self.action_head.vlln(x)
        keys = additive((valid[:, None, :] & valid[:, :, None]))
        for block in self.action_head.vl_self_attention.transformer_blocks:
            x = block(x, mask=keys, backend=backend)
        return _VL(x, mask=valid)

    def _vl_packed(self, batch: PackedBatch, backend: str, run: bool = True) -> _VL:
        """`run=False`: the shapes and lengths only, as `_vl_padded`."""
        cfg, b = self.config, batch.batch_size
        if run:
            img = self._embed_images(batch.images) if len(batch.images) else batch.state.new_zeros(0, 1, cfg.llm.width)
            text = self.eagle.language_model.model.embed_tokens(batch.tokens)
        else:
            img = batch.state.new_zeros(len(batch.images), cfg.vision.tokens, cfg.llm.width)
            text = batch.state.new_zeros(len(batch.tokens), cfg.llm.width)
        if cfg.image_token_id is None:
            x, lengths, positions = pack_prefix(img, batch.image_sample, text, batch.token_sample, b)
        else:
            x = self._place_images(text, batch.tokens, None, img)
            lengths = torch.bincount(batch.token_sample, minlength=b)
            positions = torch.arange(len(x), device=x.device) - torch.repeat_interleave(lengths.cumsum(0) - lengths,
                                                                                       lengths)
        if not run:
            return _VL(x, lengths=lengths)
        x = self._llm(x, positions, VarlenSpec.from_lengths(lengths, lengths, causal=True), None, backend)
        x = self.action_head.vlln(x)
        spec = VarlenSpec.from_lengths(lengths, lengths)
        for block in self.action_head.vl_self_attention.transformer_blocks:
            x = block(x, spec=spec, backend=backend)
        return _VL(x, lengths=lengths)

    def encode(self, batch: PaddedBatch | PackedBatch, run: bool = True) -> _VL:
        """The VL features; `run=False`: their shape (zeros) and mask or lengths only."""
        backend = self._backend(batch.state.device)
        if isinstance(batch, PaddedBatch) and self.config.packing:
            batch = batch.pack(self.config.enabled_cameras)
        if isinstance(batch, PackedBatch):
            return self._vl_packed(batch, backend, run)
        return self._vl_padded(batch, backend, run)

    # -- action head -------------------------------------------------------------------------------
    def velocity(self, vl: _VL, state, x_t, t, embodiment) -> torch.Tensor:
        """DiT prediction of d x / d t for noisy actions x_t at flow time t (GR00T's convention)."""
        x, temb = self._dit_inputs(state, x_t, t, embodiment)
        x = self._dit_blocks(range(self.config.dit.depth), x, temb, vl)
        return self._decode(x, temb, x_t.shape[1], embodiment)

    def _dit_inputs(self, state, x_t, t, embodiment, embed: bool = True):
        """The DiT's tokens [state | future | actions] (B, 1 + F + H, D) and its time embedding;
        `embed=False` (a later pipeline stage): zeros in place of the tokens, which it receives."""
        cfg, head = self.config, self.action_head
        b, horizon = x_t.shape[:2]
        t_disc = (t * cfg.dit.timestep_buckets).long()
        temb = head.model.timestep_encoder(t_disc)
        if not embed:
            return x_t.new_zeros(b, cfg.action_head_tokens, cfg.dit.width), temb
        state_emb = head.state_encoder(state[:, None], embodiment)
        actions = head.action_encoder(x_t, t_disc, embodiment) + head.position_embedding.weight[:horizon][None]
        future = head.future_tokens.weight[None].expand(b, -1, -1)
        return torch.cat([state_emb, future, actions], dim=1), temb  # (B, 49, D)

    def _dit_blocks(self, blocks: range, x, temb, vl: _VL, routing: Routing | None = None):
        """DiT blocks `blocks` over x: odd ones self-attention among a sample's action-head tokens
        (never padded), even ones cross-attention to the VL tokens; `routing`: an MoE DiT's, while training."""
        head, (b, n) = self.action_head, x.shape[:2]
        backend = self._backend(x.device)
        if vl.lengths is None:
            cross_mask, cross_spec = additive(vl.mask[:, None, :].expand(b, n, -1)), None
        else:
            cross_mask, cross_spec = None, VarlenSpec.from_lengths(torch.full_like(vl.lengths, n), vl.lengths)
        for i in blocks:
            block = head.model.transformer_blocks[i]
            x = block(x, temb, routing=routing) if i % 2 else \
                block(x, temb, vl.x, spec=cross_spec, mask=cross_mask, backend=backend, routing=routing)
        return x

    def _decode(self, x, temb, horizon: int, embodiment) -> torch.Tensor:
        head = self.action_head
        shift, scale = head.model.proj_out_1(F.silu(temb)).chunk(2, dim=-1)
        x = head.model.norm_out(x[:, -horizon:]) * (1 + scale[:, None]) + shift[:, None]  # per token: decode actions only
        return head.action_decoder(head.model.proj_out_2(x), embodiment)

    def sample_time(self, n: int, device) -> torch.Tensor:
        beta = torch.distributions.Beta(torch.tensor(1.5, device=device), torch.tensor(1.0, device=device))
        return flow_time(beta.sample((n,)))

    def _embodiment(self, batch) -> torch.Tensor:
        if batch.embodiment_id is not None:
            return batch.embodiment_id
        return torch.zeros(batch.state.shape[0], dtype=torch.long, device=batch.state.device)

    def forward(self, batch: PaddedBatch | PackedBatch, noise: torch.Tensor | None = None,
                time: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        if batch.actions is None:
            raise KilovlaError("training needs actions in the batch")
        actions = batch.actions
        if actions.shape[1] != self.config.action_horizon:
            raise KilovlaError(f"GR00T predicts {self.config.action_horizon}-step chunks; the batch has {actions.shape[1]}")
        return self.forward_stage(batch, noise, time)

    def forward_stage(self, batch: PaddedBatch | PackedBatch, noise: torch.Tensor | None = None,
                      time: torch.Tensor | None = None, layers: range | None = None, receive=None):
        """`forward` over the DiT blocks `layers` only: one pipeline stage's share (train/pipeline.py;
        the first stage also runs the backbone and the VL self-attention). A later stage passes
        `receive(vl, x) -> (vl, x)`, given zeros of the VL features' and the DiT tokens' shapes (both
        follow from the batch); returns the loss dict after the last block, else {"hidden": (vl features, x)};
        with MoE either holds the stage's routing (`moe_outputs`: its blocks' part of the model's means)."""
        if batch.actions is None:
            raise KilovlaError("training needs actions in the batch")
        actions = batch.actions
        if actions.shape[1] != self.config.action_horizon:
            raise KilovlaError(f"GR00T predicts {self.config.action_horizon}-step chunks; the batch has {actions.shape[1]}")
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
        t = 1, actions at t = 0, t of shape (B,)), so samplers serve both families, and the VL features
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
