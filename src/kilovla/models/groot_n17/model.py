"""GR00T N1.7: a Qwen3-VL backbone (Cosmos-Reason2-2B) truncated to its first LLM layers and GR00T's
flow-matching DiT head (models/groot/dit.py) with alternating image / non-image cross-attention, with
the module names of NVIDIA's checkpoint (`backbone.model.model.{visual,language_model}.*`, `action_head.*`).

Per sample::

    camera      -> Qwen3-VL ViT: 16-px patches (the frame twice: temporal patch 2), learned position grid
                   resampled to the image's, 2-D RoPE; 2x2 patches merged into one LLM token; DeepStack:
                   features of `deepstack_layers` merged the same way, one per early LLM layer
    VL tokens   = [prompt with each camera's tokens at its placeholders]   (byte prompts: cameras first)
                  causal Qwen3 with interleaved multimodal RoPE (t, h, w sections), `llm.depth` layers
                  kept; DeepStack feature i added to image tokens after layer i; no final norm
    action head = vlln -> VL self-attention stack (depth 0: none) -> DiT over [state (1) | actions (H)]:
                  odd blocks self-attention, even blocks cross-attention to the non-image VL tokens
                  (index % (2 * attend_text_every) == 0) or to the image ones (the others)

Multimodal RoPE (transformers' Qwen3-VL `get_rope_index`): a text token at running position p has
(p, p, p); an image of g x g merged tokens starting at p gives its token (r, c) the position
(p, p + r, p + c), and the text after it starts at p + g.

Padded and packed paths (`config.packing`) as N1.5's: the packed one runs the LLM and the VL
self-attention as varlen calls over real tokens with positions restarting per sample, and each
cross-attention block as a varlen call from a sample's DiT tokens to that sample's image (or
non-image) tokens. NVIDIA's VL self-attention reads padding; ours masks it, so on padded batches
with that stack the two differ exactly there (the DiT masks padding in both).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from kilovla.errors import KilovlaError
from kilovla.models.attention import VarlenSpec, additive
from kilovla.models.batch import PackedBatch, PaddedBatch, pack_prefix, padded_prefix, place_images
from kilovla.models.family import CameraSlots
from kilovla.models.groot.dit import (VL, CrossView, DiTConfig, GrootHead, _ActionEncoder, _CategoryMLP, _DiT,
                                      _VLSelfAttention)
from kilovla.models.groot.qwen3 import QwenModel, attend
from kilovla.models.language import DecoderConfig
from kilovla.models.layers import rotate
from kilovla.models.moe import MoEConfig


@dataclass(frozen=True, kw_only=True)
class QwenViTConfig:
    """Qwen3-VL's vision tower; defaults: Cosmos-Reason2-2B's."""

    image_size: int = 224  # camera pixels (square), a multiple of patch_size * merge_size
    patch_size: int = 16
    temporal_patch_size: int = 2
    merge_size: int = 2  # merge_size x merge_size patches become one LLM token
    width: int = 1024
    depth: int = 24
    heads: int = 16
    mlp_dim: int = 4096
    position_embeddings: int = 2304  # a learned 48 x 48 grid, resampled to each image's patch grid
    deepstack_layers: tuple[int, ...] = (5, 11, 17)
    rope_theta: float = 10_000.0

    @property
    def grid(self) -> int:
        """Merged tokens per side."""
        return self.image_size // (self.patch_size * self.merge_size)

    @property
    def tokens(self) -> int:
        return self.grid ** 2


@dataclass(frozen=True, kw_only=True)
class GrootN17Config(CameraSlots):
    vision: QwenViTConfig = field(default_factory=QwenViTConfig)
    # The kept layers of the text model (`select_layer`: 16 of Cosmos-Reason2-2B's 28 in the release).
    llm: DecoderConfig = field(default_factory=lambda: DecoderConfig(
        width=2048, depth=16, heads=16, kv_heads=8, head_dim=128, mlp_dim=6144, vocab_size=151936))
    rope_theta: float = 5_000_000.0
    mrope_section: tuple[int, ...] = (24, 20, 20)  # (t, h, w) rotary frequencies; sums to llm.head_dim / 2
    vl_self_attention_depth: int = 4  # 0: none (NVIDIA builds it when the checkpoint's config has it)
    vl_self_attention_heads: int = 32
    vl_self_attention_head_dim: int = 64
    dit: DiTConfig = field(default_factory=lambda: DiTConfig(depth=32))
    attend_text_every: int = 2  # NVIDIA's attend_text_every_n_blocks
    hidden_size: int = 1024
    action_horizon: int = 40
    max_action_dim: int = 132
    max_state_dim: int = 132
    num_embodiments: int = 32
    max_seq_len: int = 1024
    # NVIDIA zeroes the state token of this share of training samples (0.8 in its config class, 0.2 in
    # LeRobot's); 0 trains deterministically.
    state_dropout: float = 0.0
    cameras: tuple[str, ...] = ("ego_view",)
    disabled_cameras: tuple[str, ...] = ()
    max_language_tokens: int = 200
    language_padding: str = "max_length"
    packing: bool = False
    attention_backend: str = "auto"  # varlen kernel of the packed path (models/attention.py)
    num_inference_steps: int = 4
    dropout: float = 0.0  # in the DiT and the VL self-attention (NVIDIA's attn_dropout: 0.2)
    # Qwen3-VL's <|image_pad|> (151655): camera tokens go where the prompt has these.
    image_token_id: int | None = None
    moe: MoEConfig = field(default_factory=MoEConfig)  # routed experts in the DiT blocks' feed-forwards

    def __post_init__(self):
        v = self.vision
        if self.vl_self_attention_depth and self.vl_self_attention_heads * self.vl_self_attention_head_dim \
                != self.llm.width:
            raise KilovlaError("the VL self-attention width must equal the LLM width")
        if len(self.mrope_section) != 3 or 2 * sum(self.mrope_section) != self.llm.head_dim:
            raise KilovlaError(f"mrope_section {list(self.mrope_section)} must be three numbers summing to "
                               f"llm.head_dim / 2 = {self.llm.head_dim // 2}")
        if v.image_size % (v.patch_size * v.merge_size):
            raise KilovlaError(f"vision.image_size {v.image_size} must be a multiple of patch_size * merge_size "
                               f"= {v.patch_size * v.merge_size}")
        if any(not 0 <= i < v.depth for i in v.deepstack_layers):
            raise KilovlaError(f"vision.deepstack_layers {list(v.deepstack_layers)} must be layers of the "
                               f"{v.depth}-layer vision tower")
        if self.dit.output_dim != self.hidden_size:
            raise KilovlaError(f"dit.output_dim {self.dit.output_dim} must equal hidden_size {self.hidden_size}: "
                               "the action decoder reads the DiT's output")
        self.check_shared()
        self.moe.check()

    @property
    def action_head_tokens(self) -> int:
        return 1 + self.action_horizon


def flow_time(beta: torch.Tensor) -> torch.Tensor:
    """N1.7's flow time from a Beta(1.5, 1) draw: (1 - beta) * 0.999, in [0, 0.999] (NVIDIA's
    `sample_time`; N1.5's is (0.999 - beta) / 0.999)."""
    return (1 - beta) * 0.999


# -- Qwen3-VL vision tower -------------------------------------------------------------------------------
def patchify(images: torch.Tensor, v: QwenViTConfig) -> torch.Tensor:
    """Images (N, 3, H, W) in [0, 1] -> Qwen3-VL's pixel_values (N, patches, 3 * T * P * P): normalised by
    mean = std = 0.5, the frame repeated over the temporal patch, patches ordered so that each
    merge_size x merge_size group is consecutive (the image processor's order)."""
    n, c, h, w = images.shape
    p, t, m = v.patch_size, v.temporal_patch_size, v.merge_size
    x = ((images - 0.5) / 0.5)[:, None].expand(n, t, c, h, w)
    x = x.reshape(n, t, c, h // p // m, m, p, w // p // m, m, p).permute(0, 3, 6, 4, 7, 2, 1, 5, 8)
    return x.reshape(n, (h // p) * (w // p), c * t * p * p)


class _VisionAttention(nn.Module):
    def __init__(self, v: QwenViTConfig):
        super().__init__()
        self.heads = v.heads
        self.qkv = nn.Linear(v.width, 3 * v.width)
        self.proj = nn.Linear(v.width, v.width)

    def forward(self, x, angles, backend: str):
        q, k, v = self.qkv(x).view(*x.shape[:-1], 3, self.heads, -1).unbind(-3)  # (N, S, heads, head_dim) each
        return self.proj(attend(rotate(q, angles), rotate(k, angles), v, None, None, backend).flatten(-2))


class _VisionMLP(nn.Module):
    def __init__(self, v: QwenViTConfig):
        super().__init__()
        self.linear_fc1, self.linear_fc2 = nn.Linear(v.width, v.mlp_dim), nn.Linear(v.mlp_dim, v.width)

    def forward(self, x):
        return self.linear_fc2(F.gelu(self.linear_fc1(x), approximate="tanh"))


class _VisionBlock(nn.Module):
    def __init__(self, v: QwenViTConfig):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(v.width, eps=1e-6), nn.LayerNorm(v.width, eps=1e-6)
        self.attn = _VisionAttention(v)
        self.mlp = _VisionMLP(v)

    def forward(self, x, angles, backend: str):
        x = x + self.attn(self.norm1(x), angles, backend)
        return x + self.mlp(self.norm2(x))


class _Merger(nn.Module):
    """merge_size^2 neighbouring patches -> one token of `out` width: LayerNorm per patch (DeepStack's:
    over the concatenation), then Linear, GELU, Linear."""

    def __init__(self, v: QwenViTConfig, out: int, postshuffle: bool):
        super().__init__()
        hidden = v.width * v.merge_size ** 2
        self.postshuffle = postshuffle
        self.norm = nn.LayerNorm(hidden if postshuffle else v.width, eps=1e-6)
        self.linear_fc1, self.linear_fc2 = nn.Linear(hidden, hidden), nn.Linear(hidden, out)

    def forward(self, x):  # (N, S, width) -> (N, S / merge^2, out)
        hidden = self.linear_fc1.in_features
        x = self.norm(x.reshape(*x.shape[:-2], -1, hidden)) if self.postshuffle else \
            self.norm(x).reshape(*x.shape[:-2], -1, hidden)
        return self.linear_fc2(F.gelu(self.linear_fc1(x)))


class _PatchEmbed(nn.Module):
    def __init__(self, v: QwenViTConfig):
        super().__init__()
        kernel = (v.temporal_patch_size, v.patch_size, v.patch_size)
        self.proj = nn.Conv3d(3, v.width, kernel_size=kernel, stride=kernel)

    def forward(self, pixels):  # (N, S, 3 * T * P * P) -> (N, S, width): the stride-sized Conv3d as a matmul
        return F.linear(pixels, self.proj.weight.flatten(1), self.proj.bias)


class QwenVisionModel(nn.Module):
    """transformers' Qwen3VLVisionModel on square images of one size (every camera's)."""

    def __init__(self, v: QwenViTConfig, out: int):
        super().__init__()
        self.v = v
        self.patch_embed = _PatchEmbed(v)
        self.pos_embed = nn.Embedding(v.position_embeddings, v.width)
        self.blocks = nn.ModuleList(_VisionBlock(v) for _ in range(v.depth))
        self.merger = _Merger(v, out, postshuffle=False)
        self.deepstack_merger_list = nn.ModuleList(_Merger(v, out, postshuffle=True) for _ in v.deepstack_layers)

    def _patch_grid(self, g: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Each patch's (row, column) in the processor's order (merge groups consecutive), g patches a side."""
        m = self.v.merge_size
        idx = torch.arange(g, device=self.pos_embed.weight.device).view(g // m, m)
        rows = idx[:, None, :, None].expand(g // m, g // m, m, m).reshape(-1)
        cols = idx[None, :, None, :].expand(g // m, g // m, m, m).reshape(-1)
        return rows, cols

    def position_embedding(self, g: int) -> torch.Tensor:
        """The learned grid resampled bilinearly (corners aligned) to g x g patches: (g * g, width)."""
        side, dev = int(self.v.position_embeddings ** 0.5), self.pos_embed.weight.device
        at = torch.linspace(0, side - 1, g, device=dev)
        lo = at.int()
        hi = (lo + 1).clip(max=side - 1)
        d = at - lo
        corners = [(lo, lo, (1 - d)[:, None] * (1 - d)[None]), (lo, hi, (1 - d)[:, None] * d[None]),
                   (hi, lo, d[:, None] * (1 - d)[None]), (hi, hi, d[:, None] * d[None])]
        emb = None
        for r, c, weight in corners:
            term = self.pos_embed((r[:, None] * side + c[None]).flatten()) * weight.flatten()[:, None]
            emb = term if emb is None else emb + term
        rows, cols = self._patch_grid(g)
        return emb[rows * g + cols]

    def rotary_angles(self, g: int) -> torch.Tensor:
        """2-D RoPE: a patch's angles are its row's then its column's, (g * g, head_dim / 2)."""
        half = self.v.width // self.v.heads // 2
        freq = 1.0 / (self.v.rope_theta ** (torch.arange(0, half, 2, dtype=torch.float,
                                                         device=self.pos_embed.weight.device) / half))
        rows, cols = self._patch_grid(g)
        return torch.cat([rows.float()[:, None] * freq, cols.float()[:, None] * freq], dim=-1)

    def forward(self, pixels: torch.Tensor, backend: str) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """pixels (N, g * g, 3 * T * P * P) -> merged tokens (N, g * g / merge^2, out) and the DeepStack
        features of the same shape, one per `deepstack_layers` entry."""
        g = self.v.image_size // self.v.patch_size
        x = self.patch_embed(pixels) + self.position_embedding(g)
        angles = self.rotary_angles(g)
        deep = []
        for i, block in enumerate(self.blocks):
            x = block(x, angles, backend)
            if i in self.v.deepstack_layers:
                deep.append(self.deepstack_merger_list[self.v.deepstack_layers.index(i)](x))
        return self.merger(x), deep


# -- multimodal RoPE ----------------------------------------------------------------------------------
def _segment_cumsum(x: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """Inclusive cumsum of x (T,) restarting at each segment of `lengths` (sum T)."""
    c = x.cumsum(0)
    before = torch.cat([c.new_zeros(1), c])[lengths.cumsum(0) - lengths]
    return c - torch.repeat_interleave(before, lengths)


def mrope_positions(image: torch.Tensor, valid: torch.Tensor, lengths: torch.Tensor, grid: int) -> torch.Tensor:
    """(t, h, w) positions (3, T) of tokens (T,) laid out as segments of `lengths` (a padded row or a
    packed sample each), `image` marking image tokens (grid x grid of them per image, in order),
    `valid` the real ones (padding takes no position step).

        text, image 2x2, text -> t: 0 1 1 1 1 3,  h: 0 1 1 2 2 3,  w: 0 1 2 1 2 3
    """
    per = grid * grid
    image = image & valid
    local = (_segment_cumsum(image.long(), lengths) - 1).remainder(per)
    step = torch.where(image, (local == per - 1).long() * grid, valid.long())
    start = _segment_cumsum(step, lengths) - step
    row, col = torch.where(image, local // grid, 0), torch.where(image, local % grid, 0)
    return torch.stack([start, start + row, start + col])


def mrope_angles(positions: torch.Tensor, head_dim: int, theta: float, section: tuple[int, ...]) -> torch.Tensor:
    """Interleaved multimodal RoPE angles (..., head_dim / 2) of positions (3, ...): frequency j rotates by
    the h position when j % 3 == 1 and j < 3 * section[1], by w when j % 3 == 2 and j < 3 * section[2],
    else by t."""
    freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float, device=positions.device) / head_dim))
    angles = positions.float()[..., None] * freq
    out = angles[0].clone()
    for axis in (1, 2):
        idx = slice(axis, 3 * section[axis], 3)
        out[..., idx] = angles[axis][..., idx]
    return out


# -- the model ---------------------------------------------------------------------------------------
class _Qwen3VLModel(nn.Module):
    def __init__(self, cfg: GrootN17Config):
        super().__init__()
        self.visual = QwenVisionModel(cfg.vision, cfg.llm.width)
        self.language_model = QwenModel(cfg.llm)


class _Qwen3VL(nn.Module):
    """transformers' Qwen3VLForConditionalGeneration, its LM head left out (never used)."""

    def __init__(self, cfg: GrootN17Config):
        super().__init__()
        self.model = _Qwen3VLModel(cfg)


class _Backbone(nn.Module):
    def __init__(self, cfg: GrootN17Config):
        super().__init__()
        self.model = _Qwen3VL(cfg)


class _ActionHead(nn.Module):
    def __init__(self, cfg: GrootN17Config):
        super().__init__()
        d = cfg.dit
        self.model = _DiT(cfg)
        self.state_encoder = _CategoryMLP(cfg.num_embodiments, cfg.max_state_dim, cfg.hidden_size, d.width)
        self.action_encoder = _ActionEncoder(cfg.num_embodiments, cfg.max_action_dim, d.width)
        self.action_decoder = _CategoryMLP(cfg.num_embodiments, d.output_dim, cfg.hidden_size, cfg.max_action_dim)
        self.vlln = nn.LayerNorm(cfg.llm.width)
        self.vl_self_attention = _VLSelfAttention(cfg)
        self.position_embedding = nn.Embedding(cfg.max_seq_len, d.width)


@dataclass
class _Layout:
    """The LLM's input: token features, which are real and which are image tokens, DeepStack additions."""

    x: torch.Tensor  # (B, L, W) or (T, W)
    valid: torch.Tensor  # (B, L) or (T,)
    image: torch.Tensor
    deep: list[torch.Tensor]  # each of x's shape, zero off image tokens
    lengths: torch.Tensor  # (B,): a row's length (padded) or a sample's (packed)


class GrootN17Model(GrootHead, nn.Module):
    flow_time = staticmethod(flow_time)

    def __init__(self, config: GrootN17Config):
        super().__init__()
        self.config = config
        self.backbone = _Backbone(config)
        self.action_head = _ActionHead(config)
        # The feature is the last kept layer's output before the final norm (NVIDIA's too): the norm stays
        # in the state dict but takes no gradient, so DDP finds a gradient for every trainable parameter.
        self.qwen.language_model.norm.requires_grad_(False)

    @property
    def qwen(self) -> _Qwen3VLModel:
        return self.backbone.model.model

    # -- backbone ----------------------------------------------------------------------------------
    def _embed_images(self, images: torch.Tensor, backend: str) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Images (N, 3, H, W) in [0, 1] -> LLM tokens (N, P, W) and DeepStack features, each (N, P, W)."""
        size = self.config.vision.image_size
        if images.shape[-2:] != (size, size):
            raise KilovlaError(f"images are {tuple(images.shape[-2:])}, the model takes {size}x{size}")
        return self.qwen.visual(patchify(images, self.config.vision), backend)

    def _layout_padded(self, batch: PaddedBatch, img, deep, text) -> _Layout:
        """img (B*C, P, W) and each DeepStack feature of the camera slots, text (B, L, W)."""
        cfg = self.config
        b, c = batch.image_masks.shape
        zeros = torch.zeros_like(text)
        if cfg.image_token_id is None:
            x, valid = padded_prefix(img, batch.image_masks, text, batch.token_mask)
            image = torch.arange(x.shape[1], device=x.device)[None].expand(b, -1) < c * img.shape[1]
            deep = [padded_prefix(d, batch.image_masks, zeros, batch.token_mask)[0] for d in deep]
        else:
            present = batch.image_masks.flatten()
            x = place_images(text, batch.tokens, batch.token_mask, img[present], cfg.image_token_id)
            deep = [place_images(zeros, batch.tokens, batch.token_mask, d[present], cfg.image_token_id) for d in deep]
            valid, image = batch.token_mask, batch.tokens == cfg.image_token_id
        return _Layout(x, valid, image & valid, deep, torch.full((b,), x.shape[1], device=x.device))

    def _layout_packed(self, batch: PackedBatch, img, deep, text) -> _Layout:
        """img (N, P, W) and each DeepStack feature of the present images, text (T, W)."""
        cfg, b = self.config, batch.batch_size
        zeros = torch.zeros_like(text)
        if cfg.image_token_id is None:
            def pack(images, tokens):
                return pack_prefix(images, batch.image_sample, tokens, batch.token_sample, b)
            x, lengths, _ = pack(img, text)
            image = pack(img.new_ones(*img.shape[:2], 1), zeros[:, :1])[0][:, 0] > 0
            deep = [pack(d, zeros)[0] for d in deep]
        else:
            x = place_images(text, batch.tokens, None, img, cfg.image_token_id)
            deep = [place_images(zeros, batch.tokens, None, d, cfg.image_token_id) for d in deep]
            image, lengths = batch.tokens == cfg.image_token_id, torch.bincount(batch.token_sample, minlength=b)
        return _Layout(x, torch.ones_like(image), image, deep, lengths)

    def _llm(self, lay: _Layout, spec: VarlenSpec | None, mask: torch.Tensor | None, backend: str) -> torch.Tensor:
        """The kept layers, DeepStack feature i added after layer i; the last layer's output, not normed."""
        cfg = self.config
        shape = lay.valid.shape
        positions = mrope_positions(lay.image.flatten(), lay.valid.flatten(), lay.lengths, cfg.vision.grid)
        angles = mrope_angles(positions.view(3, *shape), cfg.llm.head_dim, cfg.rope_theta, cfg.mrope_section)
        x = lay.x
        for i, layer in enumerate(self.qwen.language_model.layers):
            x = layer(x, angles, spec, mask, backend)
            if i < len(lay.deep):
                x = x + lay.deep[i]
        return x

    def _backbone_padded(self, batch: PaddedBatch, backend: str) -> tuple[torch.Tensor, _Layout]:
        """The backbone's output (B, L, W), not normed, and the layout it ran on; batch: the enabled cameras."""
        img, deep = self._embed_images(batch.images.flatten(0, 1), backend)
        lay = self._layout_padded(batch, img, deep, self.qwen.language_model.embed_tokens(batch.tokens))
        n, valid = lay.valid.shape[1], lay.valid
        causal = torch.ones(n, n, dtype=torch.bool, device=valid.device).tril()
        return self._llm(lay, None, additive(causal[None] & valid[:, None, :] & valid[:, :, None]), backend), lay

    def _vl_padded(self, batch: PaddedBatch, backend: str) -> VL:
        batch = batch.select_cameras(self.config.enabled_cameras)
        if self.config.language_padding == "longest":
            batch = batch.trim_language()
        x, lay = self._backbone_padded(batch, backend)
        return VL(self._vl_adapter(x, backend, valid=lay.valid), mask=lay.valid, image=lay.image)

    def _vl_packed(self, batch: PackedBatch, backend: str) -> VL:
        if len(batch.images):
            img, deep = self._embed_images(batch.images, backend)
        else:
            img, deep = batch.state.new_zeros(0, 1, self.config.llm.width), []
        lay = self._layout_packed(batch, img, deep, self.qwen.language_model.embed_tokens(batch.tokens))
        x = self._llm(lay, VarlenSpec.from_lengths(lay.lengths, lay.lengths, causal=True), None, backend)
        return VL(self._vl_adapter(x, backend, lengths=lay.lengths), lengths=lay.lengths, image=lay.image)

    def encode(self, batch: PaddedBatch | PackedBatch, run: bool = True) -> VL:
        """The VL features (after vlln and the VL self-attention) with their mask or lengths and image tokens."""
        if not run:
            raise KilovlaError("GR00T N1.7 has no pipeline-parallel plan: train it with parallel.pp=1")
        backend = self._backend(batch.state.device)
        if isinstance(batch, PaddedBatch) and self.config.packing:
            batch = batch.pack(self.config.enabled_cameras)
        if isinstance(batch, PackedBatch):
            return self._vl_packed(batch, backend)
        return self._vl_padded(batch, backend)

    def backbone_features(self, batch: PaddedBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """The padded backbone's output before vlln (NVIDIA's `backbone_features`) and which tokens are real."""
        x, lay = self._backbone_padded(batch.select_cameras(self.config.enabled_cameras), self._backend(batch.state.device))
        return x, lay.valid

    # -- action head -------------------------------------------------------------------------------
    def _state_tokens(self, state, embodiment) -> torch.Tensor:
        """The state token, zeroed for a `state_dropout` share of samples while training (NVIDIA's)."""
        s = super()._state_tokens(state, embodiment)
        if self.training and self.config.state_dropout > 0:
            drop = torch.rand(s.shape[0], device=s.device) < self.config.state_dropout
            s = s * (1 - drop[:, None, None].to(s.dtype))
        return s

    def _cross_attention(self, vl: VL, b: int, n: int) -> Callable[[int], CrossView]:
        """Block i sees the sample's non-image tokens when i % (2 * attend_text_every) == 0, else its image tokens."""
        views = {}
        for image in (False, True):
            keep = vl.image if image else ~vl.image
            if vl.lengths is None:
                views[image] = vl.x, None, additive((keep & vl.mask)[:, None, :].expand(b, n, -1))
            else:
                idx = keep.nonzero(as_tuple=True)[0]
                sample = torch.repeat_interleave(torch.arange(b, device=idx.device), vl.lengths)[idx]
                spec = VarlenSpec.from_lengths(torch.full_like(vl.lengths, n), torch.bincount(sample, minlength=b))
                views[image] = vl.x[idx], spec, None
        every = 2 * self.config.attend_text_every
        return lambda i: views[i % every != 0]
