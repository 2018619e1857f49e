"""pi0 and pi0.5: a PaliGemma prefix (SigLIP ViT -> projector -> Gemma) and a Gemma action expert that
share every attention call ("mixture of transformers"), trained by flow matching.

Token layout per sample (openpi)::

    prefix = [camera 1 tokens | camera 2 tokens | ... | language tokens]      LM weights
    suffix = pi0:   [state token | action tokens (H)]                          expert weights
             pi0.5: [action tokens (H)]  (time enters through adaRMS in every expert norm)

Attention: the prefix is bidirectional and never sees the suffix; the suffix sees the prefix and
itself (pi0's state token sees the prefix and itself only). Positions count only real tokens, so
padding never moves RoPE.

Two ways to run the same weights, chosen by `config.packing`:

- padded (openpi's reference): (B, N) tensors, padding and blank cameras present but masked, one
  dense attention per layer with an additive mask;
- packed: samples laid end to end with no padding at all; per layer one varlen call for prefix ->
  prefix and one for suffix -> [prefix | suffix] of the same sample (`attention.attend_varlen`).

Camera pruning (`disabled_cameras`) removes a camera before the ViT in either path; dynamic padding
(`language_padding="longest"`) pads language to the batch's longest prompt instead of 200 tokens.
All of them give the same outputs on real tokens as the plain padded path (tests/test_pi05.py).

Flow matching, openpi's convention: t ~ Beta(1.5, 1) * 0.999 + 0.001, x_t = t * noise + (1 - t) * a,
target u = noise - a; sampling integrates dx/dt = v from t = 1 to 0 in `num_inference_steps` Euler
steps, reusing the prefix's keys and values (KV cache) at every step.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
import torch.utils.checkpoint
import torch.nn.functional as F
from torch import nn

from kilovla.errors import KilovlaError
from kilovla.models.attention import VarlenSpec, additive, attend_dense, attend_varlen, prefix_lm_mask, resolve_backend
from kilovla.models.batch import PackedBatch, PaddedBatch, flow_loss, loss_weight, pack_prefix, padded_prefix
from kilovla.models.family import CameraSlots
from kilovla.models.language import Decoder, DecoderConfig
from kilovla.models.layers import sincos_time_embedding
from kilovla.models.moe import MoEConfig, Routing, moe_outputs
from kilovla.models.vision import ViTConfig, VisionTower

OPENPI_CAMERAS = ("base_0_rgb", "left_wrist_0_rgb", "right_wrist_0_rgb")


def flow_time(beta: torch.Tensor) -> torch.Tensor:
    """openpi's flow time from a Beta(1.5, 1) draw: t runs from actions (0.001) to noise (1)."""
    return beta * 0.999 + 0.001


@dataclass(frozen=True, kw_only=True)
class Pi05Config(CameraSlots):
    vision: ViTConfig = field(default_factory=ViTConfig)
    lm: DecoderConfig = field(default_factory=DecoderConfig)
    expert: DecoderConfig = field(default_factory=lambda: DecoderConfig(width=1024, mlp_dim=4096, vocab_size=0))
    pi05: bool = True  # False: pi0 (state token in the suffix, time mixed into action tokens)
    chunk_size: int = 50
    max_action_dim: int = 32
    max_state_dim: int = 32
    cameras: tuple[str, ...] = OPENPI_CAMERAS
    disabled_cameras: tuple[str, ...] = ()  # `cameras.<name>.enabled: false`: pruned before the ViT
    max_language_tokens: int = 200
    language_padding: str = "max_length"  # or "longest" (dynamic padding)
    packing: bool = False
    attention_backend: str = "auto"  # varlen kernel of the packed path (models/attention.py)
    num_inference_steps: int = 10
    moe: MoEConfig = field(default_factory=MoEConfig)  # routed experts in the action expert's MLPs (models/moe.py)

    def __post_init__(self):
        shared = ("heads", "kv_heads", "head_dim", "depth")
        if any(getattr(self.lm, a) != getattr(self.expert, a) for a in shared):
            raise KilovlaError(f"the LM and the action expert must share {shared} (they attend together)")
        self.check_shared()
        self.moe.check()

    @property
    def suffix_extra(self) -> int:
        return 0 if self.pi05 else 1  # pi0's state token


class _Projector(nn.Module):
    def __init__(self, vision_width: int, width: int):
        super().__init__()
        self.linear = nn.Linear(vision_width, width)


class _PaliGemmaModel(nn.Module):
    def __init__(self, cfg: Pi05Config):
        super().__init__()
        self.vision_tower = VisionTower(cfg.vision)
        self.multi_modal_projector = _Projector(cfg.vision.width, cfg.lm.width)
        self.language_model = Decoder(cfg.lm)


class _PaliGemma(nn.Module):
    def __init__(self, cfg: Pi05Config):
        super().__init__()
        self.model = _PaliGemmaModel(cfg)


class _Expert(nn.Module):
    def __init__(self, cfg: Pi05Config):
        super().__init__()
        self.model = Decoder(cfg.expert, cond_dim=cfg.expert.width if cfg.pi05 else None, moe=cfg.moe)


class _PaliGemmaWithExpert(nn.Module):
    def __init__(self, cfg: Pi05Config):
        super().__init__()
        self.paligemma = _PaliGemma(cfg)
        self.gemma_expert = _Expert(cfg)


@dataclass
class _Stream:
    """One token stream of a forward pass: hidden states, RoPE positions, adaRMS condition, and (an MoE
    expert's stream while training) what its MoE layers route: its real tokens, their statistics."""

    x: torch.Tensor
    positions: torch.Tensor
    cond: torch.Tensor | None = None
    routing: Routing | None = None


class Pi05Model(nn.Module):
    """State-dict keys follow openpi's PyTorch port (LeRobot's, without its leading "model.")."""

    def __init__(self, config: Pi05Config):
        super().__init__()
        self.config = cfg = config
        self.gradient_checkpointing = False
        self.paligemma_with_expert = _PaliGemmaWithExpert(cfg)
        w = cfg.expert.width
        self.action_in_proj = nn.Linear(cfg.max_action_dim, w)
        self.action_out_proj = nn.Linear(w, cfg.max_action_dim)
        if cfg.pi05:
            self.time_mlp_in = nn.Linear(w, w)
            self.time_mlp_out = nn.Linear(w, w)
        else:
            self.state_proj = nn.Linear(cfg.max_state_dim, w)
            self.action_time_mlp_in = nn.Linear(2 * w, w)
            self.action_time_mlp_out = nn.Linear(w, w)
        # Nothing reads the prefix stream after the last layer's keys and values (see `_layer`): these
        # weights stay in the state dict (checkpoints carry them) but take no gradient.
        last = self.vlm.language_model.layers[-1]
        for unused in (last.self_attn.q_proj, last.self_attn.o_proj, last.post_attention_layernorm, last.mlp,
                       self.vlm.language_model.norm):
            unused.requires_grad_(False)

    # -- parts ---------------------------------------------------------------------------------------
    @property
    def vlm(self) -> _PaliGemmaModel:
        return self.paligemma_with_expert.paligemma.model

    @property
    def expert(self) -> Decoder:
        return self.paligemma_with_expert.gemma_expert.model

    def embed_images(self, images: torch.Tensor) -> torch.Tensor:
        """(N, 3, H, W) in [0, 1] -> (N, tokens, lm width)."""
        if images.shape[-1] != self.config.vision.image_size or images.shape[-2] != self.config.vision.image_size:
            raise KilovlaError(f"images are {tuple(images.shape[-2:])}, the model takes "
                               f"{self.config.vision.image_size}x{self.config.vision.image_size}")
        return self.vlm.multi_modal_projector.linear(self.vlm.vision_tower(images))

    def embed_suffix(self, state: torch.Tensor, x_t: torch.Tensor, t: torch.Tensor, embed: bool = True):
        """-> suffix tokens (B, extra + H, W_expert) and the adaRMS condition (B, W_expert) or None.
        `embed=False`: zeros in place of the tokens (a later pipeline stage receives them)."""
        w = self.config.expert.width
        time_emb = sincos_time_embedding(t, w).to(x_t.dtype)
        if not embed:
            tokens = x_t.new_zeros(x_t.shape[0], self.config.suffix_extra + x_t.shape[1], w)
        if self.config.pi05:
            cond = F.silu(self.time_mlp_out(F.silu(self.time_mlp_in(time_emb))))
            return (self.action_in_proj(x_t) if embed else tokens), cond
        if not embed:
            return tokens, None
        actions = self.action_in_proj(x_t)
        mixed = torch.cat([actions, time_emb[:, None].expand_as(actions)], dim=-1)
        actions = self.action_time_mlp_out(F.silu(self.action_time_mlp_in(mixed)))
        return torch.cat([self.state_proj(state)[:, None], actions], dim=1), None

    # -- the shared layer loop ----------------------------------------------------------------------
    def _layer(self, i: int, x_pre, x_suf, pre: _Stream | None, suf: _Stream | None, attention):
        """One mixture-of-transformers layer; returns the new streams and the prefix's (k, v).

        The two streams meet only in attention: `attention(i, qkv_pre, qkv_suf) -> (out_pre, out_suf)`
        computes both at once. So the expert layer's forward runs inside the attention call of the LM
        layer's forward, and the LM layer's forward returns both streams: a paired LM/expert layer is
        one forward call with every result as its output, one unit for whatever wraps a module's
        forward (FSDP gathers its parameters before and frees them after, and again for backward).
        Nothing reads the prefix stream after the last layer (only its keys and values matter), so
        the last LM layer computes no queries, attention output or MLP.
        """
        lp, ls = self.vlm.language_model.layers[i], self.expert.layers[i]
        if pre is None:  # the suffix alone, attending to cached prefix keys and values
            (x_suf,) = ls(x_suf, suf.positions, suf.cond, lambda q, k, v: (attention(i, None, (q, k, v))[1],),
                          routing=suf.routing)
            return None, x_suf, None

        def attend_prefix(q, k, v):
            if suf is None:
                return attention(i, (q, k, v), None)[0], None, k, v

            def attend_both(qs, ks, vs):
                out_pre, out_suf = attention(i, (q, k, v), (qs, ks, vs))
                return out_suf, out_pre

            new_suf, out_pre = ls(x_suf, suf.positions, suf.cond, attend_both, routing=suf.routing)
            return out_pre, new_suf, k, v

        x_pre, x_suf, k, v = lp(x_pre, pre.positions, None, attend_prefix, keys_only=i == self.config.lm.depth - 1)
        return x_pre, x_suf, (k, v)

    def _run_layers(self, layers: range, x_pre, x_suf, pre: _Stream | None, suf: _Stream | None, attention,
                    collect_kv: bool = False):
        """Hidden states (x_pre, x_suf) through `layers`; -> (x_pre, x_suf, per-layer prefix (k, v) if
        `collect_kv`). With `gradient_checkpointing` set, each layer's activations are recomputed in backward."""
        kv_cache = []
        recompute = self.gradient_checkpointing and torch.is_grad_enabled()
        for i in layers:
            if recompute:
                x_pre, x_suf, kv = torch.utils.checkpoint.checkpoint(self._layer, i, x_pre, x_suf, pre, suf, attention,
                                                                     use_reentrant=False)
            else:
                x_pre, x_suf, kv = self._layer(i, x_pre, x_suf, pre, suf, attention)
            if collect_kv:
                kv_cache.append(kv)
        return x_pre, x_suf, kv_cache

    def _layers(self, pre: _Stream | None, suf: _Stream | None, attention, collect_kv: bool = False):
        """Run both streams through every layer; `attention(i, qkv_pre, qkv_suf) -> (out_pre, out_suf)`.
        Returns the expert's normed output and (with `collect_kv`) the prefix's keys and values per layer."""
        _, x_suf, kv_cache = self._run_layers(range(self.config.lm.depth), pre.x if pre else None,
                                              suf.x if suf else None, pre, suf, attention, collect_kv)
        if suf is not None:
            x_suf = self.expert.norm(x_suf, suf.cond)[0]
        return x_suf, kv_cache

    # -- padded path ----------------------------------------------------------------------------------
    def _padded_prefix(self, batch: PaddedBatch, embed: bool = True):
        cfg = self.config
        batch = batch.select_cameras(cfg.enabled_cameras)
        if cfg.language_padding == "longest":
            batch = batch.trim_language()
        else:
            extra = cfg.max_language_tokens - batch.tokens.shape[1]
            if extra < 0:
                raise KilovlaError(f"batch has {batch.tokens.shape[1]} language tokens, more than "
                                   f"max_language_tokens={cfg.max_language_tokens}")
            batch = PaddedBatch(**{**vars(batch), "tokens": F.pad(batch.tokens, (0, extra)),
                                   "token_mask": F.pad(batch.token_mask, (0, extra))})
        if embed:
            img = self.embed_images(batch.images.flatten(0, 1))  # (B*C, P, W)
            text = self.vlm.language_model.embed(batch.tokens)
        else:  # the shapes only (a later pipeline stage)
            img = batch.state.new_zeros(batch.images.shape[0] * batch.images.shape[1], cfg.vision.tokens, cfg.lm.width)
            text = batch.state.new_zeros(*batch.tokens.shape, cfg.lm.width)
        return padded_prefix(img, batch.image_masks, text, batch.token_mask)

    def _padded_suffix_masks(self, batch: PaddedBatch, horizon: int):
        b = batch.batch_size
        dev = batch.tokens.device
        hmask = batch.horizon_mask if batch.horizon_mask is not None else torch.ones(b, horizon, dtype=torch.bool, device=dev)
        extra = self.config.suffix_extra
        suf_mask = torch.cat([torch.ones(b, extra, dtype=torch.bool, device=dev), hmask], dim=1)
        ar = torch.zeros(extra + horizon, dtype=torch.bool, device=dev)
        ar[: extra + 1] = True  # the state block (pi0) and the action block each start a causal block
        return suf_mask, ar

    def _padded_layout(self, batch: PaddedBatch, horizon: int, embed: bool = True):
        """Prefix tokens, the additive attention mask (B, 1, N, N), RoPE positions (B, N) over
        [prefix | suffix], and the prefix length: what the padded path and the sampler share."""
        x_pre, pre_mask = self._padded_prefix(batch, embed)
        suf_mask, suf_ar = self._padded_suffix_masks(batch, horizon)
        input_mask = torch.cat([pre_mask, suf_mask], dim=1)
        ar = torch.cat([torch.zeros(pre_mask.shape[1], dtype=torch.bool, device=suf_ar.device), suf_ar])
        positions = input_mask.long().cumsum(1) - 1
        return x_pre, additive(prefix_lm_mask(input_mask, ar)), positions, pre_mask.shape[1]

    def _dense_attention(self, mask: torch.Tensor, n_prefix: int, cached=None):
        scale = self.config.lm.head_dim ** -0.5

        def attention(i, qkv_p, qkv_s):
            q_pre = qkv_p[0] if qkv_p is not None else None
            queries = [q for q in (q_pre, qkv_s[0] if qkv_s is not None else None) if q is not None]
            if not queries:
                return None, None
            q = torch.cat(queries, dim=1).transpose(1, 2)
            if qkv_p is not None:
                parts = [x for x in (qkv_p, qkv_s) if x is not None]
                k = torch.cat([x[1] for x in parts], dim=1)
                v = torch.cat([x[2] for x in parts], dim=1)
            else:  # suffix only, prefix keys/values from the cache
                k = torch.cat([cached[i][0], qkv_s[1]], dim=1)
                v = torch.cat([cached[i][1], qkv_s[2]], dim=1)
            rows = slice(0 if q_pre is not None else n_prefix, None if qkv_s is not None else n_prefix)
            cols = slice(None) if qkv_s is not None else slice(0, n_prefix)
            out = attend_dense(q, k.transpose(1, 2), v.transpose(1, 2), mask[:, :, rows, cols], scale).transpose(1, 2)
            if q_pre is None:
                return None, out
            if qkv_s is None:
                return out, None
            return out[:, :n_prefix], out[:, n_prefix:]

        return attention

    def _padded_streams(self, batch: PaddedBatch, x_t: torch.Tensor, t: torch.Tensor, embed: bool = True):
        """The padded reference path's two streams at the first layer, its attention and `finish(out) -> v`
        (the expert's normed output -> velocities (B, H, A)); `embed=False` (a later pipeline stage):
        zeros of the streams' shapes in place of their embeddings (see `forward_stage`)."""
        x_pre, mask, positions, n = self._padded_layout(batch, x_t.shape[1], embed)
        suffix, cond = self.embed_suffix(batch.state, x_t, t, embed)
        pre = _Stream(x_pre, positions[:, :n])
        routing = Routing(valid=self._padded_suffix_masks(batch, x_t.shape[1])[0]) if self.config.moe.enabled else None
        suf = _Stream(suffix, positions[:, n:], None if cond is None else cond[:, None], routing)
        extra = self.config.suffix_extra
        return pre, suf, self._dense_attention(mask, n), lambda out: self.action_out_proj(out[:, extra:])

    def forward_padded(self, batch: PaddedBatch, x_t: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        """Velocity prediction (B, H, A) through the padded reference path."""
        pre, suf, attention, finish = self._padded_streams(batch, x_t, t)
        return finish(self._layers(pre, suf, attention)[0])

    # -- packed path ----------------------------------------------------------------------------------
    def _packed_streams(self, batch: PackedBatch, x_t: torch.Tensor, t: torch.Tensor, embed: bool = True):
        """The packed path's streams, attention and `finish`, as `_padded_streams`: every sample's tokens
        laid end to end, no padding."""
        cfg = self.config
        b, horizon = batch.batch_size, x_t.shape[1]
        dev = x_t.device
        # Prefix: per sample, its images' tokens then its language tokens.
        if embed:
            img = self.embed_images(batch.images) if len(batch.images) else x_t.new_zeros(0, 1, cfg.lm.width)
            text = self.vlm.language_model.embed(batch.tokens)
        else:  # the shapes only (a later pipeline stage)
            img = x_t.new_zeros(len(batch.images), cfg.vision.tokens, cfg.lm.width)
            text = x_t.new_zeros(len(batch.tokens), cfg.lm.width)
        x_pre, pre_len, pre_pos = pack_prefix(img, batch.image_sample, text, batch.token_sample, b)
        # Suffix: [state] + the chunk positions each sample has.
        suffix, cond = self.embed_suffix(batch.state, x_t, t, embed)
        hmask = batch.horizon_mask if batch.horizon_mask is not None else torch.ones(b, horizon, dtype=torch.bool, device=dev)
        extra = cfg.suffix_extra
        suf_valid = torch.cat([torch.ones(b, extra, dtype=torch.bool, device=dev), hmask], dim=1)
        x_suf = suffix[suf_valid]
        suf_sample, suf_slot = suf_valid.nonzero(as_tuple=True)
        suf_len = suf_valid.sum(1)
        suf_pos = pre_len[suf_sample] + (torch.arange(len(x_suf), device=dev)
                                         - torch.repeat_interleave(suf_len.cumsum(0) - suf_len, suf_len))
        pre = _Stream(x_pre, pre_pos)
        suf = _Stream(x_suf, suf_pos, None if cond is None else cond[suf_sample],
                      Routing() if cfg.moe.enabled else None)  # no padding: every token is routed
        attention = self._varlen_attention(pre_len, suf_len, suf_slot, dev)
        is_action = suf_slot >= extra

        def finish(out: torch.Tensor) -> torch.Tensor:
            v = x_t.new_zeros(b, horizon, cfg.max_action_dim)
            v[suf_sample[is_action], suf_slot[is_action] - extra] = self.action_out_proj(out[is_action])
            return v

        return pre, suf, attention, finish

    def _varlen_attention(self, pre_len: torch.Tensor, suf_len: torch.Tensor, suf_slot: torch.Tensor, dev):
        """Index plans for the varlen calls of one packed batch (built once, used by every layer)."""
        backend = resolve_backend(self.config.attention_backend, dev)
        scale = self.config.lm.head_dim ** -0.5
        pre_len_np, suf_len_np = pre_len.cpu().numpy(), suf_len.cpu().numpy()
        pre_start = np.concatenate([[0], np.cumsum(pre_len_np)[:-1]])
        suf_start = np.concatenate([[0], np.cumsum(suf_len_np)[:-1]])
        n_pre = int(pre_len_np.sum())
        extra = self.config.suffix_extra

        def kv_index(suffix_keys: np.ndarray) -> torch.Tensor:
            """Rows of cat(prefix, suffix) holding each sample's prefix then its first suffix_keys[i] suffix tokens."""
            parts = []
            for ps, pl, ss, sk in zip(pre_start, pre_len_np, suf_start, suffix_keys):
                parts += [np.arange(ps, ps + pl), n_pre + ss + np.arange(sk)]
            return torch.as_tensor(np.concatenate(parts), device=dev)

        spec_pre = VarlenSpec.from_lengths(pre_len, pre_len)
        groups = []  # (suffix rows queried, kv rows, spec)
        if extra:  # pi0: state tokens see the prefix and themselves; actions see everything
            state_rows = torch.as_tensor(suf_start, device=dev)
            ones = torch.ones_like(suf_len)
            groups.append((state_rows, kv_index(np.ones_like(suf_len_np)), VarlenSpec.from_lengths(ones, pre_len + 1)))
            action_rows = (suf_slot >= extra).nonzero(as_tuple=True)[0]
            groups.append((action_rows, kv_index(suf_len_np), VarlenSpec.from_lengths(suf_len - 1, pre_len + suf_len)))
        else:
            all_rows = torch.arange(int(suf_len_np.sum()), device=dev)
            groups.append((all_rows, kv_index(suf_len_np), VarlenSpec.from_lengths(suf_len, pre_len + suf_len)))

        def attention(i, qkv_p, qkv_s):
            qp, kp, vp = qkv_p
            qs, ks, vs = qkv_s
            out_p = None if qp is None else attend_varlen(qp, kp, vp, spec_pre, scale, backend)
            k_all, v_all = torch.cat([kp, ks]), torch.cat([vp, vs])
            out_s = torch.empty_like(qs)
            for rows, kv, spec in groups:
                out_s[rows] = attend_varlen(qs[rows], k_all[kv], v_all[kv], spec, scale, backend)
            return out_p, out_s

        return attention

    # -- training ------------------------------------------------------------------------------------
    def sample_time(self, n: int, device) -> torch.Tensor:
        beta = torch.distributions.Beta(torch.tensor(1.5, device=device), torch.tensor(1.0, device=device))
        return flow_time(beta.sample((n,)))

    def forward(self, batch: PaddedBatch | PackedBatch, noise: torch.Tensor | None = None,
                time: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        """Flow-matching loss. A PaddedBatch runs packed when config.packing is set. With MoE the dict also
        holds the routing losses and counts (`moe_*`, models/moe.py `moe_outputs`)."""
        return self.forward_stage(batch, noise, time)

    def forward_stage(self, batch: PaddedBatch | PackedBatch, noise: torch.Tensor | None = None,
                      time: torch.Tensor | None = None, layers: range | None = None, receive=None):
        """`forward` over `layers` only (every layer by default): one pipeline stage's share of it
        (train/pipeline.py). A stage after the first passes `receive(x_pre, x_suf) -> (x_pre, x_suf)`,
        which is given zeros of the two streams' shapes and returns the hidden states the stage
        before sent (the shapes follow from the batch, which every stage of a replica reads);
        positions, attention plans and the adaRMS condition are computed here from the batch. Returns
        the loss dict after the last layer, else {"hidden": (x_pre, x_suf)} for the next stage; with MoE
        either holds the stage's routing (`moe_outputs`: its layers' part of the model's means)."""
        depth = self.config.lm.depth
        layers = range(depth) if layers is None else layers
        if batch.actions is None:
            raise KilovlaError("training needs actions in the batch")
        actions = batch.actions
        b = actions.shape[0]
        noise = torch.randn_like(actions) if noise is None else noise
        t = self.sample_time(b, actions.device) if time is None else time
        x_t = t[:, None, None] * noise + (1 - t[:, None, None]) * actions
        u_t = noise - actions
        if isinstance(batch, PaddedBatch) and self.config.packing:
            batch = batch.pack(self.config.enabled_cameras)
        streams = self._packed_streams if isinstance(batch, PackedBatch) else self._padded_streams
        pre, suf, attention, finish = streams(batch, x_t, t, embed=receive is None)
        x_pre, x_suf = (pre.x, suf.x) if receive is None else receive(pre.x, suf.x)
        x_pre, x_suf, _ = self._run_layers(layers, x_pre, x_suf, pre, suf, attention)
        if layers.stop < depth:
            out = {"hidden": (x_pre, x_suf)}
        else:
            out = flow_loss(finish(self.expert.norm(x_suf, suf.cond)[0]), u_t, loss_weight(batch, u_t))
        if suf.routing is not None:  # the routing losses beside the flow-matching loss (models/moe.py)
            out.update(moe_outputs(suf.routing.stats, self.config.moe, layers=self.config.expert.depth))
        return out

    # -- inference -------------------------------------------------------------------------------------
    def velocity_field(self, batch: PaddedBatch):
        """The prefix runs once; returns `field(x, t) -> v` (openpi's convention: noise at t = 1, actions
        at t = 0; t of shape (B,)) reusing its keys and values, and pooled prefix features (B, F): the
        last layer's keys and values averaged over the real prefix tokens (for a value head)."""
        x_pre, mask, positions, n = self._padded_layout(batch, self.config.chunk_size)
        _, cache = self._layers(_Stream(x_pre, positions[:, :n]), None, self._dense_attention(mask, n), collect_kv=True)
        attention = self._dense_attention(mask, n, cached=cache)

        def field(x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
            suffix, cond = self.embed_suffix(batch.state, x, t)
            suf = _Stream(suffix, positions[:, n:], None if cond is None else cond[:, None])
            out, _ = self._layers(None, suf, attention)
            return self.action_out_proj(out[:, self.config.suffix_extra:])

        real = (mask[:, 0, 0, :n] == 0).to(x_pre.dtype)  # the prefix tokens a prefix token may see: the real ones
        k, v = cache[-1]
        pooled = (torch.cat([k, v], dim=-1).flatten(-2) * real[..., None]).sum(1) / real.sum(1, keepdim=True)
        return field, pooled

    @torch.no_grad()
    def sample_actions(self, batch: PaddedBatch, noise: torch.Tensor | None = None, use_cache: bool = True) -> torch.Tensor:
        """Euler-integrate the flow from noise (t = 1) to actions (t = 0): (B, chunk, max_action_dim)."""
        cfg = self.config
        b = batch.batch_size
        x = torch.randn(b, cfg.chunk_size, cfg.max_action_dim, device=batch.state.device) if noise is None else noise
        if not use_cache:
            return self._sample_uncached(batch, x)
        field, _ = self.velocity_field(batch)
        return self.integrate(field, x)

    def integrate(self, field, x: torch.Tensor) -> torch.Tensor:
        """Euler steps of `field` (from `velocity_field`) from noise x (t = 1) to actions (t = 0)."""
        dt = -1.0 / self.config.num_inference_steps
        for step in range(self.config.num_inference_steps):
            x = x + dt * field(x, torch.full((x.shape[0],), 1.0 + step * dt, device=x.device))
        return x

    def _sample_uncached(self, batch: PaddedBatch, x: torch.Tensor) -> torch.Tensor:
        dt = -1.0 / self.config.num_inference_steps
        for step in range(self.config.num_inference_steps):
            t = torch.full((batch.batch_size,), 1.0 + step * dt, device=x.device)
            x = x + dt * self.forward_padded(batch, x, t)
        return x
