"""SmolVLA (LeRobot `policies/smolvla`, arXiv 2506.01844): a SmolVLM2 prefix (SigLIP ViT -> pixel
shuffle -> Llama decoder cut to its first `num_vlm_layers` layers) and a narrower Llama action expert,
one expert layer per VLM layer, trained by flow matching as pi0. Equal to LeRobot v0.4.4's code
(benchmarks/smolvla_reference/ checks it on shared random weights).

Token layout per sample::

    prefix = [camera 1 tokens | ... | language tokens | state token]     VLM weights
    suffix = [action tokens (H)]                                         expert weights

Attention: images and language attend bidirectionally; the state token sees them and itself, no
prefix token sees it; action tokens see the prefix and the action tokens before them (causal, unlike
pi0). Positions are `cumsum(pad mask) - 1` over [prefix | suffix], so padding never moves RoPE.

Layers alternate (`self_attn_every_n_layers`, 2 in the published model):

- self-attention layer: one joint attention over [prefix | suffix], each stream with its own q/k/v;
- cross-attention layer: the prefix attends to itself alone; the expert's queries (positions
  re-based to 0) attend to the prefix only, reading the VLM layer's post-RoPE keys and its values
  through the expert's own k/v projections (kv_heads*head_dim -> kv_heads*head_dim), unrotated.

Two ways to run the same weights (models/smolvla/attention.py has the attention of each): padded
(LeRobot's layout: padding and blank cameras present but masked, one dense mask) and packed
(`config.packing`: samples end to end without padding, varlen calls with one segment per sample;
a cross-attention layer's actions read their own sample's prefix only). They agree on real tokens.

Sampling (padded) runs the prefix once, keeps each layer's keys and values, and integrates 10 Euler
steps from noise (t = 1) to actions (t = 0) with the suffix alone.

Loss: `loss_reduction="kilovla"` averages (u - v)^2 over the elements that count (padded steps and
action dims divided out); `"lerobot_v044"` is that release's mean over every T x max_action_dim
element, pad mask ignored.

With `moe` (`--policy.moe.*`, models/moe.py) each action-expert layer's MLP is routed SwiGLU experts; the
VLM's layers stay dense. Only real action tokens are routed: the padded path leaves out the steps past a
sample's horizon, which the packed path never lays down.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.utils.checkpoint
import torch.nn.functional as F
from torch import nn

from kilovla.errors import KilovlaError
from kilovla.models.attention import additive, prefix_lm_mask, resolve_backend
from kilovla.models.batch import PackedBatch, PaddedBatch, flow_loss, loss_weight, pack_prefix, padded_prefix
from kilovla.models.family import CameraSlots
from kilovla.models.language import DecoderConfig, SelfAttentionProjections
from kilovla.models.layers import SwiGLU, apply_rope, sincos_time_embedding
from kilovla.models.moe import MoEConfig, MoEMLP, Routing, SwiGLUExperts, moe_outputs
from kilovla.models.smolvla.attention import DenseAttention, PackedAttention
from kilovla.models.vision import ViTConfig, VisionModel

SMOLVLA_CAMERAS = ("camera1", "camera2", "camera3")
LOSS_REDUCTIONS = ("kilovla", "lerobot_v044")


def flow_time(beta: torch.Tensor) -> torch.Tensor:
    """LeRobot's flow time from a Beta(1.5, 1) draw (pi0's): t runs from actions (0.001) to noise (1)."""
    return beta * 0.999 + 0.001


def expert_mlp_dim(width: int, multiple_of: int = 256) -> int:
    """LeRobot's `get_intermediate_size`: 2/3 * 4 * width rounded up to a multiple of 256 (720 -> 2048)."""
    hidden = 4 * int(2 * width / 3)
    return multiple_of * ((hidden + multiple_of - 1) // multiple_of)


@dataclass(frozen=True, kw_only=True)
class SmolVLAConfig(CameraSlots):
    vision: ViTConfig = field(default_factory=lambda: ViTConfig(image_size=512, patch_size=16, width=768, depth=12,
                                                                heads=12, mlp_dim=3072))
    scale_factor: int = 4  # pixel shuffle: tokens per camera = (image / patch / scale)^2
    # the VLM's text decoder as published (depth: all its layers); `num_vlm_layers` of them are kept
    text: DecoderConfig = field(default_factory=lambda: DecoderConfig(width=960, depth=32, heads=15, kv_heads=5,
                                                                      head_dim=64, mlp_dim=2560, vocab_size=49280))
    num_vlm_layers: int = 16
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10_000.0  # LeRobot's hand-written RoPE, not the text config's 100 000
    expert_width_multiplier: float = 0.75
    self_attn_every_n_layers: int = 2  # <= 0: every layer is a cross-attention layer
    chunk_size: int = 50
    max_state_dim: int = 32
    max_action_dim: int = 32
    cameras: tuple[str, ...] = SMOLVLA_CAMERAS
    disabled_cameras: tuple[str, ...] = ()
    max_language_tokens: int = 48
    language_padding: str = "max_length"  # or "longest" (dynamic padding)
    packing: bool = False
    attention_backend: str = "auto"
    num_inference_steps: int = 10
    min_period: float = 4e-3
    max_period: float = 4.0
    loss_reduction: str = "kilovla"  # or "lerobot_v044"
    moe: MoEConfig = field(default_factory=MoEConfig)  # routed experts in the action expert's MLPs (models/moe.py)

    def __post_init__(self):
        side = self.vision.image_size // self.vision.patch_size
        if self.vision.image_size % self.vision.patch_size or side % self.scale_factor:
            raise KilovlaError(f"vision.image_size {self.vision.image_size} must be a multiple of patch_size * "
                               f"scale_factor ({self.vision.patch_size} * {self.scale_factor})")
        if self.text.heads % self.text.kv_heads:
            raise KilovlaError(f"text.heads {self.text.heads} must be a multiple of text.kv_heads {self.text.kv_heads}")
        if int(self.text.width * self.expert_width_multiplier) % 2:
            raise KilovlaError(f"the expert width int({self.text.width} * {self.expert_width_multiplier}) must be even "
                               "(its time embedding is half sines, half cosines)")
        if not 1 <= self.num_vlm_layers <= self.text.depth:
            raise KilovlaError(f"num_vlm_layers must lie in [1, text.depth={self.text.depth}], "
                               f"not {self.num_vlm_layers}")
        if self.loss_reduction not in LOSS_REDUCTIONS:
            raise KilovlaError(f"loss_reduction must be one of {LOSS_REDUCTIONS}, not {self.loss_reduction!r}")
        self.check_shared()
        self.moe.check()

    @property
    def camera_tokens(self) -> int:
        return self.vision.tokens // self.scale_factor ** 2

    @property
    def lm(self) -> DecoderConfig:
        """The kept VLM decoder."""
        return DecoderConfig(**{**vars(self.text), "depth": self.num_vlm_layers})

    @property
    def expert(self) -> DecoderConfig:
        """The action expert: the VLM's heads and head_dim at `expert_width_multiplier` of its width."""
        width = int(self.text.width * self.expert_width_multiplier)
        return DecoderConfig(width=width, depth=self.num_vlm_layers, heads=self.text.heads,
                             kv_heads=self.text.kv_heads, head_dim=self.text.head_dim,
                             mlp_dim=expert_mlp_dim(width), vocab_size=0)

    def is_self_attention(self, layer: int) -> bool:
        n = self.self_attn_every_n_layers
        return n > 0 and layer % n == 0


class LlamaRMSNorm(nn.Module):
    """x / rms(x) * weight in float32 (Llama's; Gemma's `layers.RMSNorm` scales by 1 + weight)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


class LlamaLayer(nn.Module):
    """One stream's half of a SmolVLA layer, with the attention passed in (`attend`), as
    models/language.py's DecoderLayer. `cross`: an expert layer of a cross-attention layer, whose
    k/v projections read the VLM's keys and values (kv_heads * head_dim wide) instead of its own stream.
    `moe` (an expert layer's, enabled): routed experts in place of the MLP, `layer` seeding their draws."""

    def __init__(self, cfg: DecoderConfig, eps: float, theta: float, cross: bool = False, moe: MoEConfig | None = None,
                 layer: int = 0):
        super().__init__()
        self.head_dim, self.theta = cfg.head_dim, theta
        self.input_layernorm = LlamaRMSNorm(cfg.width, eps)
        self.self_attn = SelfAttentionProjections(cfg)
        if cross:
            kv = cfg.kv_heads * cfg.head_dim
            self.self_attn.k_proj = nn.Linear(kv, kv, bias=False)
            self.self_attn.v_proj = nn.Linear(kv, kv, bias=False)
        self.post_attention_layernorm = LlamaRMSNorm(cfg.width, eps)
        self.mlp = MoEMLP(cfg.width, cfg.mlp_dim, moe, layer, SwiGLUExperts) if moe else SwiGLU(cfg.width, cfg.mlp_dim)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, attend, keys_only: bool = False,
                cross_kv: tuple[torch.Tensor, torch.Tensor] | None = None,
                routing: Routing | None = None) -> tuple[torch.Tensor, ...]:
        """x (B, T, W) -> (x, *carry), `attend(q, k, v) -> (out, *carry)` with q/k/v (B, T, heads, head_dim).
        `cross_kv`: the VLM's (post-RoPE keys, values) this layer's k/v projections read (no RoPE on them).
        keys_only: q is None and x comes back unchanged (a stream nothing reads after this layer). routing: what
        an MoE MLP routes and where it records its statistics."""
        attn, hd = self.self_attn, self.head_dim
        h = self.input_layernorm(x)
        lead = h.shape[:-1]
        q = None if keys_only else apply_rope(attn.q_proj(h).view(*lead, -1, hd), positions, self.theta)
        if cross_kv is None:
            k = apply_rope(attn.k_proj(h).view(*lead, -1, hd), positions, self.theta)
            v = attn.v_proj(h).view(*lead, -1, hd)
        else:
            kp, vp = cross_kv
            k = attn.k_proj(kp.flatten(-2)).view(*kp.shape[:-2], -1, hd)
            v = attn.v_proj(vp.flatten(-2)).view(*vp.shape[:-2], -1, hd)
        out, *carry = attend(q, k, v)
        if keys_only:
            return (x, *carry)
        x = x + attn.o_proj(out.flatten(-2))
        h = self.post_attention_layernorm(x)
        return (x + (self.mlp(h, routing) if isinstance(self.mlp, MoEMLP) else self.mlp(h)), *carry)


class _TextModel(nn.Module):
    def __init__(self, cfg: SmolVLAConfig):
        super().__init__()
        lm = cfg.lm
        self.width = lm.width
        self.embed_tokens = nn.Embedding(lm.vocab_size, lm.width)
        self.layers = nn.ModuleList(LlamaLayer(lm, cfg.rms_norm_eps, cfg.rope_theta) for _ in range(lm.depth))
        self.norm = LlamaRMSNorm(lm.width, cfg.rms_norm_eps)


class _Projection(nn.Module):
    def __init__(self, n_in: int, n_out: int):
        super().__init__()
        self.proj = nn.Linear(n_in, n_out, bias=False)


class _Connector(nn.Module):
    """SmolVLM's connector: pixel shuffle (space to depth by `scale`) then a bias-free linear."""

    def __init__(self, cfg: SmolVLAConfig):
        super().__init__()
        self.scale = cfg.scale_factor
        self.modality_projection = _Projection(cfg.vision.width * cfg.scale_factor ** 2, cfg.text.width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(N, side*side, C) -> (N, side*side / s^2, text width), SmolVLMConnector.pixel_shuffle's order."""
        n, seq, c = x.shape
        side, s = math.isqrt(seq), self.scale
        x = x.view(n, side, side // s, c * s).permute(0, 2, 1, 3)
        x = x.reshape(n, side // s, side // s, c * s * s).permute(0, 2, 1, 3)
        return self.modality_projection.proj(x.reshape(n, seq // (s * s), c * s * s))


class _VLMModel(nn.Module):
    def __init__(self, cfg: SmolVLAConfig):
        super().__init__()
        self.vision_model = VisionModel(cfg.vision)
        self.connector = _Connector(cfg)
        self.text_model = _TextModel(cfg)


class _VLM(nn.Module):
    def __init__(self, cfg: SmolVLAConfig):
        super().__init__()
        self.model = _VLMModel(cfg)


class _Expert(nn.Module):
    def __init__(self, cfg: SmolVLAConfig):
        super().__init__()
        ex = cfg.expert
        moe = cfg.moe if cfg.moe.enabled else None
        self.layers = nn.ModuleList(LlamaLayer(ex, cfg.rms_norm_eps, cfg.rope_theta, cross=not cfg.is_self_attention(i),
                                               moe=moe, layer=i) for i in range(ex.depth))
        self.norm = LlamaRMSNorm(ex.width, cfg.rms_norm_eps)


class _VLMWithExpert(nn.Module):
    def __init__(self, cfg: SmolVLAConfig):
        super().__init__()
        self.vlm = _VLM(cfg)
        self.lm_expert = _Expert(cfg)


@dataclass(frozen=True)
class _Positions:
    """RoPE positions: the prefix's, the suffix's in self-attention layers (after the prefix), and in
    cross-attention layers (re-based to 0 within each sample's suffix)."""

    pre: torch.Tensor | None
    suf: torch.Tensor | None
    suf_cross: torch.Tensor | None


class SmolVLAModel(nn.Module):
    """State-dict keys are LeRobot's SmolVLAPolicy's without its leading "model." (the VLM's unused
    lm_head left out)."""

    def __init__(self, config: SmolVLAConfig):
        super().__init__()
        self.config = cfg = config
        self.gradient_checkpointing = False
        self.vlm_with_expert = _VLMWithExpert(cfg)
        w = cfg.expert.width
        self.state_proj = nn.Linear(cfg.max_state_dim, cfg.text.width)
        self.action_in_proj = nn.Linear(cfg.max_action_dim, w)
        self.action_out_proj = nn.Linear(w, cfg.max_action_dim)
        self.action_time_mlp_in = nn.Linear(2 * w, w)
        self.action_time_mlp_out = nn.Linear(w, w)
        # Nothing reads the prefix stream after the last layer's keys and values: these take no gradient.
        last = self.text.layers[-1]
        for unused in (last.self_attn.q_proj, last.self_attn.o_proj, last.post_attention_layernorm, last.mlp,
                       self.text.norm):
            unused.requires_grad_(False)

    # -- parts ---------------------------------------------------------------------------------------
    @property
    def vlm(self) -> _VLMModel:
        return self.vlm_with_expert.vlm.model

    @property
    def text(self) -> _TextModel:
        return self.vlm.text_model

    @property
    def expert(self) -> _Expert:
        return self.vlm_with_expert.lm_expert

    def embed_images(self, images: torch.Tensor) -> torch.Tensor:
        """(N, 3, H, W) in [0, 1] -> (N, camera_tokens, text width), scaled by sqrt(width) as LeRobot does."""
        size = self.config.vision.image_size
        if images.shape[-2:] != (size, size):
            raise KilovlaError(f"images are {tuple(images.shape[-2:])}, the model takes {size}x{size}")
        x = self.vlm.connector(self.vlm.vision_model(images))
        return x * torch.tensor(x.shape[-1] ** 0.5, dtype=x.dtype, device=x.device)

    def embed_language(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.text.embed_tokens(tokens) * math.sqrt(self.text.width)

    def embed_suffix(self, x_t: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        """Noisy actions (B, H, A) and time (B,) -> action tokens (B, H, expert width)."""
        cfg = self.config
        actions = self.action_in_proj(x_t)
        time_emb = sincos_time_embedding(t, actions.shape[-1], cfg.min_period, cfg.max_period).to(actions.dtype)
        mixed = torch.cat([actions, time_emb[:, None].expand_as(actions)], dim=-1)
        return self.action_time_mlp_out(F.silu(self.action_time_mlp_in(mixed)))

    # -- the layer loop --------------------------------------------------------------------------------
    def _layer(self, i: int, x_pre, x_suf, pos: _Positions, attend, cached=None, routing: Routing | None = None):
        """One VLM / expert layer pair -> (x_pre, x_suf, the prefix's post-RoPE (k, v)). The expert's forward
        runs inside the VLM layer's attention call, so a pair is one forward call (one FSDP unit). Either
        stream may be None: the prefix alone fills the sampler's cache; the suffix alone reads `cached`.
        `attend`: a plan of models/smolvla/attention.py; `routing`: an MoE expert's, while training."""
        ex = self.expert.layers[i]
        joint = self.config.is_self_attention(i)

        def run_expert(kp, vp, qp=None):
            """-> (new x_suf, the prefix's attention output when a joint layer is given qp)."""
            if not joint:
                (x,) = ex(x_suf, pos.suf_cross, lambda qs, ks, vs: (attend.cross(qs, ks, vs),), cross_kv=(kp, vp),
                          routing=routing)
                return x, None
            return ex(x_suf, pos.suf, lambda qs, ks, vs: attend.joint(qp, kp, vp, qs, ks, vs)[::-1], routing=routing)

        if x_pre is None:
            return None, run_expert(*cached[i])[0], None

        def attend_prefix(qp, kp, vp):
            if x_suf is None or not joint:
                out_p = None if qp is None else attend.prefix(qp, kp, vp)
                return out_p, None if x_suf is None else run_expert(kp, vp)[0], kp, vp
            new_suf, out_p = run_expert(kp, vp, qp)
            return out_p, new_suf, kp, vp

        last = i == self.config.num_vlm_layers - 1
        x_pre, x_suf, k, v = self.text.layers[i](x_pre, pos.pre, attend_prefix, keys_only=last)
        return x_pre, x_suf, (k, v)

    def _run_layers(self, x_pre, x_suf, pos: _Positions, attend, cached=None, routing: Routing | None = None):
        """Both streams through every layer -> (the expert's normed output or None, per-layer prefix (k, v))."""
        kv_cache = []
        recompute = self.gradient_checkpointing and torch.is_grad_enabled()
        for i in range(self.config.num_vlm_layers):
            args = (i, x_pre, x_suf, pos, attend, cached, routing)
            if recompute:
                x_pre, x_suf, kv = torch.utils.checkpoint.checkpoint(self._layer, *args, use_reentrant=False)
            else:
                x_pre, x_suf, kv = self._layer(*args)
            kv_cache.append(kv)
        return (None if x_suf is None else self.expert.norm(x_suf)), kv_cache

    # -- padded path ----------------------------------------------------------------------------------
    def _language(self, batch: PaddedBatch) -> PaddedBatch:
        """Language padded to max_language_tokens, or to the batch's longest prompt ("longest")."""
        cfg = self.config
        if cfg.language_padding == "longest":
            return batch.trim_language()
        extra = cfg.max_language_tokens - batch.tokens.shape[1]
        if extra < 0:
            raise KilovlaError(f"batch has {batch.tokens.shape[1]} language tokens, more than "
                               f"max_language_tokens={cfg.max_language_tokens}")
        return PaddedBatch(**{**vars(batch), "tokens": F.pad(batch.tokens, (0, extra)),
                              "token_mask": F.pad(batch.token_mask, (0, extra))})

    def _padded_layout(self, batch: PaddedBatch, horizon: int):
        """Prefix tokens (B, n, W), the attention plan, positions, which prefix tokens are real (B, n):
        what training and the sampler share."""
        batch = self._language(batch.select_cameras(self.config.enabled_cameras))
        img = self.embed_images(batch.images.flatten(0, 1))  # (B*C, P, W)
        x_pre, pre_mask = padded_prefix(img, batch.image_masks, self.embed_language(batch.tokens), batch.token_mask)
        b, dev = batch.batch_size, x_pre.device
        x_pre = torch.cat([x_pre, self.state_proj(batch.state)[:, None].to(x_pre.dtype)], dim=1)
        pre_mask = torch.cat([pre_mask, torch.ones(b, 1, dtype=torch.bool, device=dev)], dim=1)
        suf_mask = batch.horizon_mask if batch.horizon_mask is not None else \
            torch.ones(b, horizon, dtype=torch.bool, device=dev)
        # A 1 starts a block no earlier token sees: the state token, then every action token (causal).
        n = pre_mask.shape[1]
        ar = torch.cat([torch.zeros(n - 1, dtype=torch.bool, device=dev), torch.ones(1 + horizon, dtype=torch.bool,
                                                                                     device=dev)])
        input_mask = torch.cat([pre_mask, suf_mask], dim=1)
        positions = input_mask.long().cumsum(1) - 1
        suf = positions[:, n:]
        pos = _Positions(positions[:, :n], suf, suf - suf.min(dim=1, keepdim=True).values)
        attend = DenseAttention(additive(prefix_lm_mask(input_mask, ar)), n, self.config.text.head_dim ** -0.5)
        return x_pre, attend, pos, pre_mask

    def forward_padded(self, batch: PaddedBatch, x_t: torch.Tensor, t: torch.Tensor,
                       routing: Routing | None = None) -> torch.Tensor:
        """Velocity prediction (B, H, max_action_dim) through the padded path (LeRobot's layout)."""
        x_pre, attend, pos, _ = self._padded_layout(batch, x_t.shape[1])
        out, _ = self._run_layers(x_pre, self.embed_suffix(x_t, t), pos, attend, routing=routing)
        return self.action_out_proj(out)

    # -- packed path ----------------------------------------------------------------------------------
    def forward_packed(self, batch: PackedBatch, x_t: torch.Tensor, t: torch.Tensor,
                       routing: Routing | None = None) -> torch.Tensor:
        """Velocity prediction (B, H, max_action_dim) with every sample's real tokens end to end, no padding:
        per sample [its images | its language | its state] then the chunk positions it has."""
        cfg = self.config
        b, horizon, dev = batch.batch_size, x_t.shape[1], x_t.device
        img = self.embed_images(batch.images) if len(batch.images) else \
            x_t.new_zeros(0, cfg.camera_tokens, cfg.text.width)
        # The state token after each sample's language: pack_prefix keeps a sample's text in the given order.
        text = torch.cat([self.embed_language(batch.tokens), self.state_proj(batch.state).to(img.dtype)])
        text_sample = torch.cat([batch.token_sample, torch.arange(b, device=dev)])
        x_pre, pre_len, pre_pos = pack_prefix(img, batch.image_sample, text, text_sample, b)
        suf_valid = batch.horizon_mask if batch.horizon_mask is not None else \
            torch.ones(b, horizon, dtype=torch.bool, device=dev)
        suf_sample, suf_slot = suf_valid.nonzero(as_tuple=True)
        suf_len = suf_valid.sum(1)
        rank = torch.arange(len(suf_sample), device=dev) - torch.repeat_interleave(suf_len.cumsum(0) - suf_len, suf_len)
        pos = _Positions(pre_pos, pre_len[suf_sample] + rank, rank)
        attend = PackedAttention(pre_len, suf_len, cfg.text.head_dim ** -0.5,
                                 resolve_backend(cfg.attention_backend, dev))
        out, _ = self._run_layers(x_pre, self.embed_suffix(x_t, t)[suf_valid], pos, attend, routing=routing)
        v = x_t.new_zeros(b, horizon, cfg.max_action_dim)
        v[suf_sample, suf_slot] = self.action_out_proj(out).to(v.dtype)
        return v

    # -- training ------------------------------------------------------------------------------------
    def sample_time(self, n: int, device) -> torch.Tensor:
        beta = torch.distributions.Beta(torch.tensor(1.5, device=device), torch.tensor(1.0, device=device))
        return flow_time(beta.sample((n,)))

    def forward(self, batch: PaddedBatch | PackedBatch, noise: torch.Tensor | None = None,
                time: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        """Flow-matching loss: {"loss", "per_sample" (B,), "v_t" (B, H, A)}, reduced as `loss_reduction` says.
        A PaddedBatch runs packed when config.packing is set. With MoE the dict also holds the routing losses
        and counts (`moe_*`, models/moe.py `moe_outputs`)."""
        if batch.actions is None:
            raise KilovlaError("training needs actions in the batch")
        actions = batch.actions
        noise = torch.randn_like(actions) if noise is None else noise
        t = self.sample_time(actions.shape[0], actions.device) if time is None else time
        x_t = t[:, None, None] * noise + (1 - t[:, None, None]) * actions
        u_t = noise - actions
        if isinstance(batch, PaddedBatch) and self.config.packing:
            batch = batch.pack(self.config.enabled_cameras)
        packed = isinstance(batch, PackedBatch)
        # an MoE expert routes the real action tokens: the padded path's within the horizon, the packed path's all
        routing = Routing(valid=None if packed else batch.horizon_mask) if self.config.moe.enabled else None
        v_t = (self.forward_packed if packed else self.forward_padded)(batch, x_t, t, routing)
        if self.config.loss_reduction == "lerobot_v044":
            err = (u_t - v_t) ** 2
            out = {"loss": err.mean(), "per_sample": err.mean((1, 2)), "v_t": v_t}
        else:
            out = flow_loss(v_t, u_t, loss_weight(batch, u_t))
        if routing is not None:  # the routing losses beside the flow-matching loss (models/moe.py)
            out.update(moe_outputs(routing.stats, self.config.moe))
        return out

    # -- inference -------------------------------------------------------------------------------------
    def velocity_field(self, batch: PaddedBatch):
        """The prefix runs once; returns `field(x, t) -> v` (noise at t = 1, actions at t = 0; t (B,))
        reusing its keys and values, and pooled prefix features (B, 2 * kv_heads * head_dim): the last
        layer's keys and values averaged over the real prefix tokens."""
        x_pre, attend, pos, pre_mask = self._padded_layout(batch, self.config.chunk_size)
        _, cache = self._run_layers(x_pre, None, pos, attend)

        def field(x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
            out, _ = self._run_layers(None, self.embed_suffix(x, t), pos, attend, cache)
            return self.action_out_proj(out)

        real = pre_mask.to(x_pre.dtype)
        k, v = cache[-1]
        pooled = (torch.cat([k, v], dim=-1).flatten(-2) * real[..., None]).sum(1) / real.sum(1, keepdim=True)
        return field, pooled

    @torch.no_grad()
    def sample_actions(self, batch: PaddedBatch, noise: torch.Tensor | None = None,
                       use_cache: bool = True) -> torch.Tensor:
        """Euler-integrate the flow from noise (t = 1) to actions (t = 0): (B, chunk, max_action_dim)."""
        cfg = self.config
        x = torch.randn(batch.batch_size, cfg.chunk_size, cfg.max_action_dim, device=batch.state.device) \
            if noise is None else noise
        if use_cache:
            return self.integrate(self.velocity_field(batch)[0], x)
        return self.integrate(lambda x, t: self.forward_padded(batch, x, t), x)

    def integrate(self, field, x: torch.Tensor) -> torch.Tensor:
        """`num_inference_steps` Euler steps of `field` from noise x (t = 1) to actions (t = 0); t as LeRobot
        computes it (a Python float, then float32)."""
        dt = -1.0 / self.config.num_inference_steps
        for step in range(self.config.num_inference_steps):
            x = x + dt * field(x, torch.full((x.shape[0],), 1.0 + step * dt, device=x.device))
        return x
