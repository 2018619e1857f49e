"""attend(): one attention call, several backends.

Two kinds of call:

- dense: q (B, H, Lq, D), k/v (B, Hkv, Lk, D) and an additive float mask (B, 1, Lq, Lk)
  (0 where allowed, `BIG_NEG` where not). Backend `sdpa_dense`; the padded reference path.
- varlen: packed sequences, q (Tq, H, D), k/v (Tk, Hkv, D), and `VarlenSpec(cu_q, cu_k, max_q, max_k)`:
  query segment i attends to key segment i only; `causal=True` adds the causal mask within a
  segment (query and key segments then have equal lengths). Backends:

  | backend        | where     | how                                                            |
  |----------------|-----------|----------------------------------------------------------------|
  | sdpa_segments  | CPU, CUDA | one SDPA call per segment; the exact varlen reference          |
  | sdpa_masked    | CPU, CUDA | one SDPA call over the whole packed row, block-diagonal mask   |
  | sdpa_batched   | CPU, CUDA | one SDPA call, segments stacked and padded to the longest      |
  | flex           | CPU, CUDA | flex_attention with a same-segment mask (eager on CPU)         |
  | flash_attn     | CUDA      | flash_attn_varlen_func (FlashAttention-2)                      |
  | torch_varlen   | CUDA      | torch.nn.attention.varlen.varlen_attn (torch >= 2.9)           |

`auto` (the models' default) picks per device: flash_attn, else torch_varlen on CUDA; on CPU
`CPU_AUTO`, the fastest exact backend in `kilovla bench packing` (its `attention_backend_*` rows).
There the per-segment loop pays a call (and a slice copy in backward) per sample, the masked call
computes every off-diagonal block and throws it away, flex has no CPU backward; stacking the
segments into one padded batch wastes only up to the longest segment, and wins.

`resolve_backend(name, device)` checks availability once and falls back to `sdpa_segments` with a
warning when the requested kernel cannot run here (a CUDA kernel on a CPU machine, a missing package).
Heads: k/v may have fewer heads than q (GQA/MQA, as Gemma's single KV head); they are repeated.
"""

from __future__ import annotations

import functools
import inspect
import logging
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kilovla.errors import KilovlaError

log = logging.getLogger(__name__)

# openpi's masked logit: large and negative but finite, so a fully masked row stays finite.
BIG_NEG = -2.3819763e38
VARLEN_BACKENDS = ("sdpa_segments", "sdpa_masked", "sdpa_batched", "flex", "flash_attn", "torch_varlen")
BACKENDS = ("auto", "sdpa_dense", *VARLEN_BACKENDS)
CPU_AUTO = "sdpa_batched"  # measured: `kilovla bench packing`, rows attention_backend_*


@dataclass(frozen=True)
class VarlenSpec:
    cu_q: torch.Tensor  # (n + 1,) int32 prefix sums of query segment lengths
    cu_k: torch.Tensor  # (n + 1,) int32 prefix sums of key segment lengths
    max_q: int
    max_k: int
    causal: bool = False

    @classmethod
    def from_lengths(cls, q_lengths: torch.Tensor, k_lengths: torch.Tensor, causal: bool = False) -> VarlenSpec:
        zero = torch.zeros(1, dtype=torch.int32, device=q_lengths.device)
        cu_q = torch.cat([zero, q_lengths.cumsum(0).to(torch.int32)])
        cu_k = torch.cat([zero, k_lengths.cumsum(0).to(torch.int32)])
        return cls(cu_q, cu_k, int(q_lengths.max()), int(k_lengths.max()), causal)

    @functools.cached_property
    def slots(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(segment, position) of every query and every key; computed once, reused by every layer."""
        seg_q, seg_k = _segment_ids(self.cu_q, int(self.cu_q[-1])), _segment_ids(self.cu_k, int(self.cu_k[-1]))
        pos_q = torch.arange(len(seg_q), device=seg_q.device) - self.cu_q.long()[seg_q]
        pos_k = torch.arange(len(seg_k), device=seg_k.device) - self.cu_k.long()[seg_k]
        return seg_q, pos_q, seg_k, pos_k


def _repeat_kv(x: torch.Tensor, n_rep: int, dim: int) -> torch.Tensor:
    return x if n_rep == 1 else x.repeat_interleave(n_rep, dim=dim)


def attend_dense(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                 scale: float) -> torch.Tensor:
    """q (B, H, Lq, D), k/v (B, Hkv, Lk, D), additive mask (B, 1, Lq, Lk) or None -> (B, H, Lq, D)."""
    rep = q.shape[1] // k.shape[1]
    return F.scaled_dot_product_attention(q, _repeat_kv(k, rep, 1), _repeat_kv(v, rep, 1),
                                          attn_mask=None if mask is None else mask.to(q.dtype), scale=scale)


def _segments(q, k, v, spec: VarlenSpec, scale: float) -> torch.Tensor:
    rep = q.shape[1] // k.shape[1]
    out = torch.empty_like(q)
    cu_q, cu_k = spec.cu_q.tolist(), spec.cu_k.tolist()
    for i in range(len(cu_q) - 1):
        qs, ks = slice(cu_q[i], cu_q[i + 1]), slice(cu_k[i], cu_k[i + 1])
        if cu_q[i + 1] == cu_q[i]:
            continue
        qi = q[qs].transpose(0, 1)  # (H, Lq, D)
        ki = _repeat_kv(k[ks].transpose(0, 1), rep, 0)
        vi = _repeat_kv(v[ks].transpose(0, 1), rep, 0)
        out[qs] = F.scaled_dot_product_attention(qi, ki, vi, scale=scale, is_causal=spec.causal).transpose(0, 1)
    return out


def _segment_ids(cu: torch.Tensor, total: int) -> torch.Tensor:
    return torch.searchsorted(cu[1:].long(), torch.arange(total, device=cu.device), right=True)


def _masked(q, k, v, spec: VarlenSpec, scale: float) -> torch.Tensor:
    seg_q, pos_q, seg_k, pos_k = spec.slots
    mask = seg_q[:, None] == seg_k[None, :]  # (Tq, Tk) block-diagonal
    if spec.causal:
        mask &= pos_q[:, None] >= pos_k[None, :]
    rep = q.shape[1] // k.shape[1]
    out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], _repeat_kv(k.transpose(0, 1), rep, 0)[None],
                                         _repeat_kv(v.transpose(0, 1), rep, 0)[None], attn_mask=mask[None, None],
                                         scale=scale)
    return out[0].transpose(0, 1)


def _batched(q, k, v, spec: VarlenSpec, scale: float) -> torch.Tensor:
    seg_q, pos_q, seg_k, pos_k = spec.slots
    n = len(spec.cu_q) - 1

    def stack(x, seg, pos, length):  # (T, H, D) -> (n, H, length, D), zeros past each segment's end
        out = x.new_zeros(n, length, *x.shape[1:])
        out[seg, pos] = x
        return out.transpose(1, 2)

    rep = q.shape[1] // k.shape[1]
    k_len = (spec.cu_k[1:] - spec.cu_k[:-1]).long()
    mask = (torch.arange(spec.max_k, device=q.device)[None, :] < k_len[:, None])[:, None, None, :]  # (n, 1, 1, Lk)
    if spec.causal:
        mask = mask & (torch.arange(spec.max_q, device=q.device)[:, None]
                       >= torch.arange(spec.max_k, device=q.device)[None, :])
    out = F.scaled_dot_product_attention(stack(q, seg_q, pos_q, spec.max_q),
                                         _repeat_kv(stack(k, seg_k, pos_k, spec.max_k), rep, 1),
                                         _repeat_kv(stack(v, seg_k, pos_k, spec.max_k), rep, 1), attn_mask=mask,
                                         scale=scale)
    return out.transpose(1, 2)[seg_q, pos_q]


def _flex(q, k, v, spec: VarlenSpec, scale: float) -> torch.Tensor:
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    seg_q, pos_q, seg_k, pos_k = spec.slots
    causal = spec.causal

    def same_segment(b, h, qi, ki):
        same = seg_q[qi] == seg_k[ki]
        return same & (pos_q[qi] >= pos_k[ki]) if causal else same

    block = create_block_mask(same_segment, None, None, q.shape[0], k.shape[0], device=q.device)
    rep = q.shape[1] // k.shape[1]
    out = flex_attention(q.transpose(0, 1)[None], _repeat_kv(k.transpose(0, 1), rep, 0)[None],
                         _repeat_kv(v.transpose(0, 1), rep, 0)[None], block_mask=block, scale=scale)
    return out[0].transpose(0, 1)


def _flash_attn(q, k, v, spec: VarlenSpec, scale: float) -> torch.Tensor:
    from flash_attn import flash_attn_varlen_func

    return flash_attn_varlen_func(q, k, v, spec.cu_q, spec.cu_k, spec.max_q, spec.max_k, softmax_scale=scale,
                                  causal=spec.causal)


def _torch_varlen(q, k, v, spec: VarlenSpec, scale: float) -> torch.Tensor:
    from torch.nn.attention.varlen import varlen_attn

    params = inspect.signature(varlen_attn).parameters
    kwargs = {"scale": scale} if "scale" in params else {}
    if "is_causal" in params:  # torch 2.9 spelling
        kwargs["is_causal"] = spec.causal
    elif "window_size" in params:  # later: (-1, 0) is causal
        kwargs["window_size"] = (-1, 0) if spec.causal else (-1, -1)
    rep = q.shape[1] // k.shape[1]
    if "enable_gqa" in params and rep > 1:
        kwargs["enable_gqa"] = True
    else:
        k, v = _repeat_kv(k, rep, 1), _repeat_kv(v, rep, 1)
    return varlen_attn(q, k, v, spec.cu_q, spec.cu_k, spec.max_q, spec.max_k, **kwargs)


_VARLEN = {"sdpa_segments": _segments, "sdpa_masked": _masked, "sdpa_batched": _batched, "flex": _flex,
           "flash_attn": _flash_attn, "torch_varlen": _torch_varlen}


@functools.cache
def _available(backend: str, device_type: str) -> str | None:
    """None if `backend` can run on this device, else why not."""
    if backend in ("sdpa_dense", "sdpa_segments", "sdpa_masked", "sdpa_batched"):
        return None
    if backend == "flex":
        try:
            from torch.nn.attention.flex_attention import flex_attention  # noqa: F401
        except ImportError as e:
            return f"flex_attention unavailable ({e})"
        return None
    if device_type != "cuda":
        return "needs a CUDA device"
    if backend == "flash_attn":
        try:
            import flash_attn  # noqa: F401
        except ImportError:
            return "the flash-attn package is not installed"
        return None
    try:
        from torch.nn.attention.varlen import varlen_attn  # noqa: F401
    except ImportError:
        return "this torch has no torch.nn.attention.varlen"
    return None


def resolve_backend(name: str, device: torch.device | str) -> str:
    """The varlen backend to use: `name` if it runs here, else sdpa_segments (with a warning);
    `auto`: flash_attn, torch_varlen on CUDA, `CPU_AUTO` elsewhere."""
    if name not in BACKENDS:
        raise KilovlaError(f"attention backend must be one of {', '.join(BACKENDS)}, not {name!r}")
    device_type = torch.device(device).type
    if name == "auto":
        if device_type == "cuda":
            return next((b for b in ("flash_attn", "torch_varlen") if _available(b, "cuda") is None), "sdpa_batched")
        return CPU_AUTO
    why = _available(name, device_type)
    if why is None:
        return name
    _warn_fallback(name, why)
    return "sdpa_segments"


@functools.cache
def _warn_fallback(name: str, why: str) -> None:
    log.warning("attention backend %s %s; falling back to sdpa_segments", name, why)


def attend_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: VarlenSpec, scale: float,
                  backend: str = "sdpa_segments") -> torch.Tensor:
    """q (Tq, H, D), k/v (Tk, Hkv, D) -> (Tq, H, D); segment i of q sees segment i of k only
    (and, with spec.causal, only keys at or before its own position)."""
    if backend == "auto":
        backend = resolve_backend("auto", q.device)
    elif backend == "sdpa_dense":  # a padded-path setting: its varlen twin is the exact per-segment loop
        backend = "sdpa_segments"
    return _VARLEN[backend](q, k, v, spec, scale)


def prefix_lm_mask(input_mask: torch.Tensor, ar_mask: torch.Tensor) -> torch.Tensor:
    """openpi's attention rule as a bool (B, N, N) mask: i sees j iff cumsum(ar)[j] <= cumsum(ar)[i]
    and both are real tokens. ar_mask (B, N) or (N,): 1 starts a new causal block.

    >>> prefix_lm_mask(torch.ones(1, 4, dtype=torch.bool), torch.tensor([0, 0, 1, 0])).int()[0]
    tensor([[1, 1, 0, 0],
            [1, 1, 0, 0],
            [1, 1, 1, 1],
            [1, 1, 1, 1]], dtype=torch.int32)
    """
    ar = ar_mask.expand_as(input_mask).int()
    cum = ar.cumsum(dim=1)
    allowed = cum[:, None, :] <= cum[:, :, None]
    valid = input_mask[:, None, :] & input_mask[:, :, None]
    return allowed & valid


def additive(mask: torch.Tensor) -> torch.Tensor:
    """bool (B, Lq, Lk) -> float (B, 1, Lq, Lk) with 0 / BIG_NEG."""
    return torch.where(mask, 0.0, BIG_NEG)[:, None].float()
