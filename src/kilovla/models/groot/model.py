"""GR00T N1.5: an Eagle VLM (SigLIP -> mlp1 -> Qwen3 truncated to its first layers) and a flow-matching
DiT action head, with the module names of NVIDIA's checkpoint (`backbone.eagle_model.*`, `action_head.*`).

Per sample::

    VL tokens   = [camera tokens (256 each) | language tokens]   causal Qwen3, first `llm.depth` layers
    action head = vlln -> VL self-attention stack -> DiT over [state (1) | future tokens (32) | actions (16)]
                  DiT blocks alternate cross-attention to the VL tokens (even) and self-attention (odd),
                  AdaLayerNorm on the discretised flow time; per-embodiment state/action encoders/decoder
                  (models/groot/dit.py, shared with N1.7, which also says GR00T's flow-matching convention)

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

from dataclasses import dataclass, field

import torch
from torch import nn

from kilovla.errors import KilovlaError
from kilovla.models.attention import VarlenSpec, additive
from kilovla.models.batch import PackedBatch, PaddedBatch, pack_prefix, padded_prefix, place_images
from kilovla.models.family import CameraSlots
from kilovla.models.groot.dit import (VL, DiTConfig, GrootHead, _ActionEncoder, _CategoryMLP, _DiT,
                                      _VLSelfAttention, flow_time)
from kilovla.models.groot.qwen3 import QwenModel
from kilovla.models.language import DecoderConfig
from kilovla.models.layers import rope_angles
from kilovla.models.moe import MoEConfig
from kilovla.models.vision import ViTConfig, VisionTower

__all__ = ["DiTConfig", "GrootConfig", "GrootModel", "flow_time"]


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



# -- Eagle backbone ------------------------------------------------------------------------------------
class _QwenForCausalLM(nn.Module):
    def __init__(self, c: DecoderConfig):
        super().__init__()
        self.model = QwenModel(c)


class _EagleModel(nn.Module):
    def __init__(self, cfg: GrootConfig):
        super().__init__()
        self.vision_model = VisionTower(cfg.vision)
        self.mlp1 = nn.Sequential(nn.Linear(cfg.vision.width, cfg.llm.width))
        self.language_model = _QwenForCausalLM(cfg.llm)


class _Backbone(nn.Module):
    def __init__(self, cfg: GrootConfig):
        super().__init__()
        self.eagle_model = _EagleModel(cfg)


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



class GrootModel(GrootHead, nn.Module):
    def __init__(self, config: GrootConfig):
        super().__init__()
        self.config = config
        self.backbone = _Backbone(config)
        self.action_head = _ActionHead(config)

    @property
    def eagle(self) -> _EagleModel:
        return self.backbone.eagle_model

    # -- backbone ----------------------------------------------------------------------------------
    def _llm(self, x, positions, spec: VarlenSpec | None, mask: torch.Tensor | None, backend: str):
        angles = rope_angles(positions, self.config.llm.head_dim, self.config.rope_theta)
        for layer in self.eagle.language_model.model.layers:
            x = layer(x, angles, spec, mask, backend)
        return self.eagle.language_model.model.norm(x)

    def _embed_images(self, images):
        if images.shape[-1] != self.config.vision.image_size:
            raise KilovlaError(f"images are {tuple(images.shape[-2:])}, the model takes "
                               f"{self.config.vision.image_size}x{self.config.vision.image_size}")
        return self.eagle.mlp1(self.eagle.vision_model(images))

    def _vl_padded(self, batch: PaddedBatch, backend: str, run: bool = True) -> VL:
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
            x = place_images(text, batch.tokens, batch.token_mask, present, cfg.image_token_id)
            valid = batch.token_mask
        if not run:
            return VL(x, mask=valid)
        positions = valid.long().cumsum(1) - 1
        n = valid.shape[1]
        causal = torch.ones(n, n, dtype=torch.bool, device=x.device).tril()
        mask = additive(causal[None] & valid[:, None, :] & valid[:, :, None])
        x = self._llm(x, positions, None, mask, backend)
        return VL(self._vl_adapter(x, backend, valid=valid), mask=valid)

    def _vl_packed(self, batch: PackedBatch, backend: str, run: bool = True) -> VL:
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
            x = place_images(text, batch.tokens, None, img, self.config.image_token_id)
            lengths = torch.bincount(batch.token_sample, minlength=b)
            positions = torch.arange(len(x), device=x.device) - torch.repeat_interleave(lengths.cumsum(0) - lengths,
                                                                                       lengths)
        if not run:
            return VL(x, lengths=lengths)
        x = self._llm(x, positions, VarlenSpec.from_lengths(lengths, lengths, causal=True), None, backend)
        return VL(self._vl_adapter(x, backend, lengths=lengths), lengths=lengths)

    def encode(self, batch: PaddedBatch | PackedBatch, run: bool = True) -> VL:
        """The VL features; `run=False`: their shape (zeros) and mask or lengths only."""
        backend = self._backend(batch.state.device)
        if isinstance(batch, PaddedBatch) and self.config.packing:
            batch = batch.pack(self.config.enabled_cameras)
        if isinstance(batch, PackedBatch):
            return self._vl_packed(batch, backend, run)
        return self._vl_padded(batch, backend, run)

    # -- action head -------------------------------------------------------------------------------
    def _extra_tokens(self, b: int) -> list[torch.Tensor]:
        """N1.5's future tokens, between state and actions."""
        return [self.action_head.future_tokens.weight[None].expand(b, -1, -1)]
