"""Block-wise FP8 post-training quantization (DeepSeek-V3's recipe, Hugging Face's "fp8" layout).

A quantized Linear stores its weight as float8_e4m3fn (N, K) plus one float32 inverse scale per
block x block tile, ``weight_scale_inv`` of shape (ceil(N/block), ceil(K/block)), so that
``W[i, j] = q[i, j] * weight_scale_inv[i // block, j // block]``; ragged edge tiles are simply
smaller (shapes that are not multiples of the block need no padding on disk). Activations are
either left alone (``activations="none"``: weight-only) or quantized on the fly per 1 x 128 tile
of each token (``"1x128"``: W8A8, what the FP8 GEMMs compute).

`Fp8BlockLinear` picks its GEMM at run time, per device, on the first call:

- ``scaled_mm``: cuBLASLt's block-scaled FP8 GEMM through ``torch.nn.functional.scaled_mm`` (Hopper,
  CUDA >= 12.9, N and K multiples of 128, 1x128 activations);
- ``torchao``: torchao's Triton block-wise FP8 GEMM (SM >= 8.9, torchao with Triton installed);
- ``emulate``: dequantize the weight to the activation dtype (float32 on CPU, where kilovla computes
  in float32), then an ordinary matmul in that dtype. Always available, the only choice on CPU
  (torch refuses block scales there) and the reference the others are tested against.

Scales are floored at float32's smallest normal number (`SCALE_FLOOR`): a tile whose largest
magnitude is so small that ``amax / 448`` would round to 0 (or to a subnormal) would otherwise
divide by zero and dequantize its zeros to ``0 * inf = NaN``. Non-finite weights are refused
(`quantize_model` names the layer): a NaN or inf in a tile would poison its scale.

``kernel="auto"`` (the default) takes the fastest available; a kernel that cannot run falls back
to ``emulate`` with one warning line per reason. Which layers are quantized is a regex over module
names (`select_layers`); each family's default (its `fp8_layers`, models/<family>/spec.py) takes the
language model and the action expert (GR00T: the LLM layers and the DiT) and keeps the vision tower, norms, projectors and embeddings.
``scope="all"`` takes every layer whose weight can be blocked outside the vision tower: Linear
layers, the token table (`Fp8BlockEmbedding`: rows dequantized as they are looked up) and GR00T's
per-embodiment Linear (`Fp8BlockCategoryLinear`: a (C, in, out) stack blocked matrix by matrix). Those
two are weight-only (no GEMM reads a token table; no batched block-scaled GEMM exists for the stack).
An MoE layer's expert stacks (`Fp8GroupedExperts`: each (E, out, in) stack blocked expert by expert) go
with the dense MLP they replace, in the family default and under "all"; weight-only too, for the same
reason as the per-embodiment stack.
"""

from __future__ import annotations

import logging
import math
import re
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from kilovla.errors import KilovlaError
from kilovla.models.family import family_of
from kilovla.models.layers import CategoryLinear
from kilovla.models.moe import GroupedExperts

log = logging.getLogger(__name__)

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite float8_e4m3fn
ACTIVATION_TILE = 128  # activations are scaled per 1 x 128 tile of each token
KERNELS = ("auto", "scaled_mm", "torchao", "emulate")
ACTIVATIONS = ("1x128", "none")
SQNR_CAP_DB = 300.0  # what `sqnr_db` reports for "no noise"; float64 round-off measures far less
SCALE_FLOOR = torch.finfo(torch.float32).tiny  # smallest normal float32: 1 / SCALE_FLOOR is finite

# `--scope all`: every layer whose weight can be blocked (Linear, GR00T's per-embodiment Linear, token
# tables) except the vision tower's (each family's `vision_tower`). The paper keeps only the vision tower
# in high precision; the family defaults (`fp8_layers`) leave the token table alone too, which caps
# pi0.5-3B at 34 % smaller than bf16.
SCOPES = ("default", "all")
_TOKEN_TABLE = re.compile(r"(^|\.)embed_tokens$")


@dataclass(frozen=True, kw_only=True, slots=True)
class Fp8Config:
    """What `kilovla quantize` does: ``include`` / ``exclude`` are regexes searched in module names;
    without ``include``, ``scope`` picks the layers ("default": the family's language model and action
    expert; "all": everything but the vision tower); ``dtype`` is what the layers that stay
    unquantized are stored as on disk."""

    block: int = 128
    include: str | None = None
    exclude: str | None = None
    scope: str = "default"
    activations: str = "1x128"
    dtype: str = "bfloat16"

    def __post_init__(self):
        if self.block < 16 or self.block % 16:
            raise KilovlaError(f"--quant.block {self.block}: a block must be a positive multiple of 16 "
                               "(FP8 GEMMs work on 16-wide tiles; the GPU kernels need 128)")
        if self.activations not in ACTIVATIONS:
            raise KilovlaError(f"--quant.activations must be one of {ACTIVATIONS}, not {self.activations!r}")
        if self.dtype not in ("bfloat16", "float16", "float32"):
            raise KilovlaError(f"--quant.dtype must be bfloat16, float16 or float32, not {self.dtype!r}")
        if self.scope not in SCOPES:
            raise KilovlaError(f"--quant.scope must be one of {SCOPES}, not {self.scope!r}")
        if self.scope != "default" and self.include is not None:
            raise KilovlaError(f"--quant.scope {self.scope} and --quant.include {self.include!r}: choose one (quant.include names the "
                               "layers itself)")
        for flag, pattern in (("--quant.include", self.include), ("--quant.exclude", self.exclude)):
            if pattern is not None:
                try:
                    re.compile(pattern)
                except re.error as e:
                    raise KilovlaError(f"{flag} {pattern!r}: not a regular expression: {e}") from None


# -- the format ------------------------------------------------------------------------------------
def _blocks(x: torch.Tensor, rows: int, cols: int) -> tuple[torch.Tensor, tuple[int, int]]:
    """(..., N, K) -> zero-padded (..., N/rows, rows, K/cols, cols) view, and the block counts."""
    n, k = x.shape[-2:]
    nb, kb = math.ceil(n / rows), math.ceil(k / cols)
    padded = F.pad(x, (0, kb * cols - k, 0, nb * rows - n))
    return padded.view(*x.shape[:-2], nb, rows, kb, cols), (nb, kb)


def scale_shape(shape, block: int) -> tuple[int, ...]:
    """The `weight_scale_inv` shape of an (..., N, K) weight: (..., ceil(N/block), ceil(K/block))."""
    *lead, n, k = shape
    return (*lead, math.ceil(n / block), math.ceil(k / block))


def quantize_fp8_blockwise(weight: torch.Tensor, block: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """(..., N, K) float -> (q float8_e4m3fn (..., N, K), weight_scale_inv float32 (..., ceil(N/block),
    ceil(K/block))): block x block tiles of the last two dims (a stack of matrices is blocked matrix
    by matrix).

    Each tile's largest magnitude maps to 448 (e4m3's max); an all-zero tile gets scale 1; a scale never
    falls below `SCALE_FLOOR`. A weight with NaN or inf is refused.

    >>> q, s = quantize_fp8_blockwise(torch.full((130, 3), 2.0), block=128)
    >>> q.shape, s.shape, s[:, 0].tolist()
    (torch.Size([130, 3]), torch.Size([2, 1]), [0.004464285913854837, 0.004464285913854837])
    """
    if weight.ndim < 2:
        raise KilovlaError(f"block-wise FP8 needs a weight of at least 2 dims, got shape {tuple(weight.shape)}")
    w = weight.detach().float()
    if not bool(torch.isfinite(w).all()):
        bad = int((~torch.isfinite(w)).sum())
        raise KilovlaError(f"the weight has {bad} non-finite values (NaN or inf); FP8 scales cannot represent them")
    tiles, _ = _blocks(w, block, block)
    scale_inv = _scales(tiles.abs().amax(dim=(-3, -1)))  # (..., nb, kb)
    q = (tiles / scale_inv[..., :, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    n, k = w.shape[-2:]
    return q.flatten(-2, -1).flatten(-3, -2)[..., :n, :k].contiguous(), scale_inv.contiguous()


def _scales(amax: torch.Tensor) -> torch.Tensor:
    """Inverse scales from tile maxima: amax / 448, floored at SCALE_FLOOR; 1 for an all-zero tile."""
    return torch.where(amax > 0, (amax / FP8_MAX).clamp_min(SCALE_FLOOR), torch.ones_like(amax))


def dequantize_fp8_blockwise(q: torch.Tensor, scale_inv: torch.Tensor, block: int = 128,
                             dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The inverse of `quantize_fp8_blockwise`: W[..., i, j] = q[..., i, j] * scale_inv[..., i // block, j // block]."""
    expected = scale_shape(q.shape, block)
    if tuple(scale_inv.shape) != expected:
        n, k = q.shape[-2:]
        raise KilovlaError(f"weight_scale_inv has shape {tuple(scale_inv.shape)}; a {n}x{k} weight in "
                           f"{block}x{block} blocks needs {expected}")
    tiles, _ = _blocks(q.float(), block, block)
    n, k = q.shape[-2:]
    return (tiles * scale_inv[..., :, None, :, None].float()).flatten(-2, -1).flatten(-3, -2)[..., :n, :k].to(dtype)


def quantize_activations_1x128(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(M, K) -> (q float8 (M, K), inverse scales float32 (M, ceil(K/128))): one scale per token per
    128 channels, as DeepSeek-V3 quantizes activations."""
    m, k = x.shape
    tiles = F.pad(x.float(), (0, (-k) % ACTIVATION_TILE)).view(m, -1, ACTIVATION_TILE)
    scale_inv = _scales(tiles.abs().amax(dim=-1))
    q = (tiles / scale_inv[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q.flatten(1)[:, :k], scale_inv


def fake_quantize_activations(x: torch.Tensor) -> torch.Tensor:
    """x rounded through 1x128 FP8 and back, in x's dtype: what the W8A8 GEMM sees."""
    flat = x.reshape(-1, x.shape[-1])
    q, s = quantize_activations_1x128(flat)
    k = flat.shape[1]
    tiles = F.pad(q.float(), (0, (-k) % ACTIVATION_TILE)).view(len(flat), -1, ACTIVATION_TILE) * s[..., None]
    return tiles.flatten(1)[:, :k].reshape(x.shape).to(x.dtype)


def sqnr_db(reference: torch.Tensor, test: torch.Tensor, chunk: int = 1 << 24) -> float:
    """Signal-to-quantization-noise ratio, 20 log10(|ref| / |ref - test|) (torchao's `compute_error`),
    always a finite number in [-SQNR_CAP_DB, SQNR_CAP_DB] so that reports stay valid JSON and a minimum
    over layers never skips a broken one: no noise at all (an all-zero layer, an exact match) is
    +SQNR_CAP_DB; NaN or inf on either side, or noise without signal, is -SQNR_CAP_DB (the worst).
    Sums run in float64 over `chunk` elements at a time (a 3B model's token table is 0.5 B values)."""
    ref, got = reference.detach().reshape(-1), test.detach().reshape(-1)
    signal = noise = 0.0
    for i in range(0, len(ref), chunk):
        r, g = ref[i:i + chunk].double(), got[i:i + chunk].double()
        if not (bool(torch.isfinite(r).all()) and bool(torch.isfinite(g).all())):
            return -SQNR_CAP_DB
        signal += float(r.square().sum())
        noise += float((r - g).square().sum())
    if noise == 0:
        return SQNR_CAP_DB
    if signal == 0:
        return -SQNR_CAP_DB
    value = 10 * math.log10(signal / noise)
    return max(-SQNR_CAP_DB, min(SQNR_CAP_DB, value))


# -- the layers ------------------------------------------------------------------------------------
class Fp8Weights(nn.Module):
    """What every FP8 module shares: float8 payload buffers (one, ``PAYLOAD``, except for an MoE layer's
    expert stacks) and beside each its float32 inverse scales ``<payload>_scale_inv``, which keep their
    dtypes when the model is cast. ``out_dtype``, where a module has one, follows the model's casts."""

    PAYLOAD = "weight"
    WEIGHT_ONLY = True  # activations never quantized (no GEMM of its own reads them in FP8)
    out_dtype: torch.dtype | None = None

    @classmethod
    def payload_names(cls, module: nn.Module) -> tuple[str, ...]:
        """The weights of `module` (the layer to quantize, or its FP8 module) that are stored in FP8."""
        return (cls.PAYLOAD,)

    def _apply(self, fn, recurse=True):
        # `.float()` / `.to(bfloat16)` on the whole model may move the FP8 payloads and their scales,
        # never re-type them: q cast to bf16 reads as wrong weights, silently.
        if self.out_dtype is not None:
            self.out_dtype = fn(torch.zeros((), dtype=self.out_dtype)).dtype
        keys = [key for name in self.payload_names(self) for key in (name, name + "_scale_inv")]
        payload = {key: self._buffers[key] for key in keys}
        super()._apply(fn, recurse)
        for key, before in payload.items():
            after = self._buffers[key]
            if after.dtype != before.dtype:
                self._buffers[key] = before.to(after.device)
        return self

    def dequantized_weight(self, dtype: torch.dtype = torch.float32, name: str | None = None) -> torch.Tensor:
        name = name or self.PAYLOAD
        return dequantize_fp8_blockwise(self._buffers[name], self._buffers[name + "_scale_inv"], self.block, dtype)

    def _register_payload(self, shape, block: int, device, name: str | None = None) -> None:
        self.block, name = block, name or self.PAYLOAD
        self.register_buffer(name, torch.empty(shape, dtype=FP8, device=device))
        self.register_buffer(name + "_scale_inv", torch.ones(scale_shape(shape, block), dtype=torch.float32,
                                                             device=device))

    @classmethod
    def empty_like(cls, module: nn.Module, block: int = 128, activations: str = "1x128") -> Fp8Weights:
        """An FP8 module of `module`'s shape on its device, payload unset (to load a state dict into)."""
        raise NotImplementedError

    @classmethod
    def from_module(cls, module: nn.Module, block: int = 128, activations: str = "1x128") -> Fp8Weights:
        """`module` quantized: its weights (`payload_names`) block-wise FP8, its other parameters (biases)
        copied, frozen."""
        new = cls.empty_like(module, block, activations)
        payloads = cls.payload_names(module)
        for name in payloads:
            q, s = quantize_fp8_blockwise(getattr(module, name), block)
            new._buffers[name].copy_(q)
            new._buffers[name + "_scale_inv"].copy_(s)
        for name, p in module.named_parameters(recurse=False):
            if name not in payloads:
                setattr(new, name, nn.Parameter(p.detach().clone(), requires_grad=False))
        return new


class Fp8BlockLinear(Fp8Weights):
    """A Linear whose weight is block-wise FP8: buffers ``weight`` (float8_e4m3fn, (N, K)) and
    ``weight_scale_inv`` (float32), an optional ``bias``. Output dtype = input dtype.

    ``kernel`` chooses the GEMM ("auto", "scaled_mm", "torchao", "emulate"); the choice is made per
    device on the first call and can be read back from ``kernel_used``.
    """

    WEIGHT_ONLY = False  # with activations "1x128", W8A8

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *, block: int = 128,
                 activations: str = "1x128", device=None):
        super().__init__()
        self.in_features, self.out_features, self.activations = in_features, out_features, activations
        self.kernel = "auto"
        self.kernel_used: dict[str, str] = {}
        self._register_payload((out_features, in_features), block, device)
        self.bias = nn.Parameter(torch.zeros(out_features, device=device), requires_grad=False) if bias else None

    @classmethod
    def empty_like(cls, linear: nn.Linear, block: int = 128, activations: str = "1x128") -> Fp8BlockLinear:
        return cls(linear.in_features, linear.out_features, linear.bias is not None, block=block,
                   activations=activations, device=linear.weight.device)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"block={self.block}, activations={self.activations}, kernel={self.kernel}")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        device = x.device.type
        kernel = self.kernel_used.get(device)
        if kernel is None:
            kernel = self.kernel_used[device] = select_kernel(self, x)
        return _GEMMS[kernel](self, x)


class Fp8BlockEmbedding(Fp8Weights):
    """A token table (an Embedding read by index) in block-wise FP8: ``weight`` (V, D) float8 with
    (ceil(V/block), ceil(D/block)) scales. Only the looked-up rows are dequantized, so a lookup costs
    what it did; the output has the dtype the rest of the model computes in (tracked through casts).
    No GEMM reads the table, so there is nothing to quantize on the activation side."""

    def __init__(self, num_embeddings: int, embedding_dim: int, *, block: int = 128, device=None,
                 dtype: torch.dtype = torch.float32):
        super().__init__()
        self.num_embeddings, self.embedding_dim, self.out_dtype = num_embeddings, embedding_dim, dtype
        self._register_payload((num_embeddings, embedding_dim), block, device)

    @classmethod
    def empty_like(cls, table: nn.Embedding, block: int = 128, activations: str = "1x128") -> Fp8BlockEmbedding:
        return cls(table.num_embeddings, table.embedding_dim, block=block, device=table.weight.device,
                   dtype=table.weight.dtype)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, block={self.block}"

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        flat = ids.reshape(-1)  # index_select refuses negative ids, as nn.Embedding does
        rows = self.weight.index_select(0, flat).to(self.out_dtype)
        scales = self.weight_scale_inv.index_select(0, flat // self.block).repeat_interleave(self.block, dim=-1)
        return (rows * scales[:, :self.embedding_dim].to(self.out_dtype)).view(*ids.shape, self.embedding_dim)


class Fp8BlockCategoryLinear(Fp8Weights):
    """GR00T's per-embodiment Linear (`CategoryLinear`: one (in, out) matrix per embodiment, picked
    per sample) in block-wise FP8: ``W`` (C, in, out) float8 with (C, ceil(in/block), ceil(out/block))
    scales, ``b`` kept. Weight-only: the matrices of the batch's embodiments are dequantized to the
    input's dtype and multiplied there (there is no batched block-scaled GEMM to call)."""

    PAYLOAD = "W"

    def __init__(self, categories: int, n_in: int, n_out: int, *, block: int = 128, device=None):
        super().__init__()
        self.categories, self.n_in, self.n_out = categories, n_in, n_out
        self._register_payload((categories, n_in, n_out), block, device)
        self.b = nn.Parameter(torch.zeros(categories, n_out, device=device), requires_grad=False)

    @classmethod
    def empty_like(cls, layer, block: int = 128, activations: str = "1x128") -> Fp8BlockCategoryLinear:
        c, n_in, n_out = layer.W.shape
        return cls(c, n_in, n_out, block=block, device=layer.W.device)

    def extra_repr(self) -> str:
        return f"categories={self.categories}, n_in={self.n_in}, n_out={self.n_out}, block={self.block}"

    def forward(self, x: torch.Tensor, cat: torch.Tensor) -> torch.Tensor:
        w = dequantize_fp8_blockwise(self.W[cat], self.W_scale_inv[cat], self.block, x.dtype)
        return torch.bmm(x, w) + self.b[cat][:, None].to(x.dtype)


class Fp8GroupedExperts(Fp8Weights):
    """An MoE layer's expert stacks (models/moe.py: `GroupedExperts` or another kind of it) in block-wise
    FP8: each weight stack (E, out, in) as float8 with (E, ceil(out/block), ceil(in/block)) scales, so every
    expert has its own block x block tiles (none spans two experts); bias stacks (E, out) kept. Weight-only:
    the stacks are dequantized to the model's dtype and the kind's own math runs on them, as the
    per-embodiment stack does (no grouped block-scaled GEMM is called)."""

    def __init__(self, kind: type[GroupedExperts], shapes: dict[str, tuple[int, ...]], *, block: int = 128,
                 device=None, dtype: torch.dtype = torch.float32, dropout: float = 0.0):
        super().__init__()
        self.kind, self.out_dtype, self.dropout = kind, dtype, dropout
        self.payloads = tuple(name for name, shape in shapes.items() if len(shape) == 3)
        for name, shape in shapes.items():  # in the stacks' own order, as their state dict lists them
            if name in self.payloads:
                self._register_payload(shape, block, device, name)
            else:
                setattr(self, name, nn.Parameter(torch.zeros(shape, device=device), requires_grad=False))

    @classmethod
    def payload_names(cls, module: nn.Module) -> tuple[str, ...]:
        if isinstance(module, Fp8GroupedExperts):
            return module.payloads
        return tuple(name for name, p in module.named_parameters(recurse=False) if p.ndim == 3)

    @classmethod
    def empty_like(cls, experts: GroupedExperts, block: int = 128, activations: str = "1x128") -> Fp8GroupedExperts:
        first = next(experts.parameters())
        return cls(type(experts), {name: tuple(p.shape) for name, p in experts.named_parameters(recurse=False)},
                   block=block, device=first.device, dtype=first.dtype, dropout=getattr(experts, "dropout", 0.0))

    def extra_repr(self) -> str:
        return f"{self.kind.__name__}, experts={len(self.down_proj)}, block={self.block}"

    def stacks(self) -> dict[str, torch.Tensor]:
        kept = {name: p for name, p in self.named_parameters(recurse=False)}
        return {**kept, **{name: self.dequantized_weight(self.out_dtype, name) for name in self.payloads}}

    def activation(self, x: torch.Tensor) -> torch.Tensor:
        return self.kind.activation(x)

    def compute(self, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
        return self.kind.compute(self, x, counts)

    def forward(self, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
        return self.compute(x, counts)

    def all_summed(self, x: torch.Tensor) -> torch.Tensor:
        return self.kind.all_summed(self, x)


def _emulate(layer: Fp8BlockLinear, x: torch.Tensor) -> torch.Tensor:
    """Dequantize to x's dtype + matmul in x's dtype: the math of the FP8 GEMMs (products of dequantized
    values); exact for float32 inputs, bf16-rounded for bf16 inputs."""
    if layer.activations == "1x128":
        x = fake_quantize_activations(x)
    bias = None if layer.bias is None else layer.bias.to(x.dtype)
    return F.linear(x, layer.dequantized_weight(x.dtype), bias)


def _scaled_mm(layer: Fp8BlockLinear, x: torch.Tensor) -> torch.Tensor:
    """cuBLASLt block-scaled GEMM (torch >= 2.9 on SM90, CUDA >= 12.9).

    Layouts (a wrong one gives silent wrong answers, PyTorch PR #166752): A = activations (M, K)
    row-major with 1x128 scales (M, K/128) stored column-major; B = weight.t() (column-major) with
    the 128x128 scales padded to L4 = round_up(K/128, 4) K-blocks and passed as (L4, N/128) with
    stride (1, L4). cuBLASLt also wants the token count a multiple of 4 (zero rows are added).
    """
    lead, k = x.shape[:-1], x.shape[-1]
    flat = x.reshape(-1, k)
    m = len(flat)
    flat = F.pad(flat, (0, 0, 0, (-m) % 4))
    q, s = quantize_activations_1x128(flat)
    scale_a = s.t().contiguous().t()
    kb = layer.weight_scale_inv.shape[1]
    scale_b = F.pad(layer.weight_scale_inv, (0, (-kb) % 4), value=1.0).t()
    out = F.scaled_mm(q, layer.weight.t(), scale_a, F.ScalingType.BlockWise1x128, scale_b,
                      F.ScalingType.BlockWise128x128, output_dtype=torch.bfloat16)[:m]
    if layer.bias is not None:
        out = out + layer.bias.to(out.dtype)
    return out.to(x.dtype).reshape(*lead, -1)


def _torchao(layer: Fp8BlockLinear, x: torch.Tensor) -> torch.Tensor:
    """torchao's Triton GEMM (DeepSeek's `fp8_gemm`), scales in the checkpoint's own layout. The
    activations go through our quantizer: DeepSeek's divides an all-zero tile by a zero scale (NaN)."""
    from torchao.prototype.blockwise_fp8_inference import blockwise_fp8_gemm

    lead, k = x.shape[:-1], x.shape[-1]
    q, s = quantize_activations_1x128(x.reshape(-1, k))
    out = blockwise_fp8_gemm(q.contiguous(), s.contiguous(), layer.weight, layer.weight_scale_inv, layer.block)
    if layer.bias is not None:
        out = out + layer.bias.to(out.dtype)
    return out.to(x.dtype).reshape(*lead, -1)


_GEMMS = {"emulate": _emulate, "scaled_mm": _scaled_mm, "torchao": _torchao}


def kernel_unavailable(name: str, layer: Fp8BlockLinear, device: torch.device) -> str | None:
    """Why `name` cannot run this layer on `device` (None: it can)."""
    if name == "emulate":
        return None
    if device.type != "cuda":
        return f"needs a CUDA GPU (running on {device.type})"
    if layer.activations != "1x128":
        return "needs 1x128 activation quantization (this checkpoint is weight-only)"
    if layer.block != 128:
        return f"needs 128x128 weight blocks (this checkpoint has {layer.block}x{layer.block})"
    cap = torch.cuda.get_device_capability(device)
    if name == "scaled_mm":
        cuda = tuple(int(v) for v in (torch.version.cuda or "0.0").split(".")[:2])
        if cap != (9, 0):
            return f"cuBLASLt block scaling runs on Hopper (SM 9.0) only, this GPU is SM {cap[0]}.{cap[1]}"
        if cuda < (12, 9):
            return f"needs CUDA >= 12.9, torch was built with {torch.version.cuda}"
        if not hasattr(F, "scaled_mm"):
            return "this torch has no torch.nn.functional.scaled_mm"
        if layer.in_features % 128 or layer.out_features % 128:
            return f"needs N and K multiples of 128 (layer is {layer.out_features}x{layer.in_features})"
        return None
    if name == "torchao":
        if cap < (8, 9):
            return f"needs SM >= 8.9, this GPU is SM {cap[0]}.{cap[1]}"
        if layer.in_features % 128:
            return f"needs K a multiple of 128 (layer has K={layer.in_features})"
        try:
            from torch.utils._triton import has_triton
            import torchao.prototype.blockwise_fp8_inference  # noqa: F401
        except ImportError:
            return "needs torchao (pip install torchao)"
        return None if has_triton() else "needs Triton"
    raise KilovlaError(f"FP8 kernel must be one of {KERNELS}, not {name!r}")


_warned: set[str] = set()
_fastest: dict[tuple, str] = {}


def _fall_back(message: str) -> str:
    if message not in _warned:
        _warned.add(message)
        log.warning("%s; falling back to emulation (dequantize + matmul)", message)
    return "emulate"


def select_kernel(layer: Fp8BlockLinear, x: torch.Tensor) -> str:
    """The GEMM this layer uses for inputs like `x` (see the module docstring)."""
    requested = layer.kernel
    if requested not in KERNELS:
        raise KilovlaError(f"FP8 kernel must be one of {KERNELS}, not {requested!r}")
    if requested != "auto":
        why = kernel_unavailable(requested, layer, x.device)
        return requested if why is None else _fall_back(f"FP8 kernel {requested} {why}")
    runnable = [k for k in ("scaled_mm", "torchao") if kernel_unavailable(k, layer, x.device) is None]
    if not runnable:
        why = kernel_unavailable("scaled_mm", layer, x.device)
        return _fall_back(f"no FP8 block GEMM for this layer here (scaled_mm {why})")
    if len(runnable) == 1:
        return runnable[0]
    key = (x.device.index, layer.out_features, layer.in_features)
    if key not in _fastest:
        _fastest[key] = _time_kernels(layer, x, runnable)
    return _fastest[key]


@torch.no_grad()
def _time_kernels(layer: Fp8BlockLinear, x: torch.Tensor, kernels: list[str]) -> str:
    """Both GPU kernels run here: keep the faster on a 64-token input of this layer's shape."""
    probe = torch.randn(64, layer.in_features, device=x.device, dtype=torch.bfloat16)
    best, best_t = kernels[0], float("inf")
    for name in kernels:
        for _ in range(3):
            _GEMMS[name](layer, probe)
        torch.cuda.synchronize(x.device)
        t0 = time.perf_counter()
        for _ in range(20):
            _GEMMS[name](layer, probe)
        torch.cuda.synchronize(x.device)
        if time.perf_counter() - t0 < best_t:
            best, best_t = name, time.perf_counter() - t0
    return best


def set_kernel(model: nn.Module, kernel: str) -> None:
    """Ask every Fp8BlockLinear of `model` for `kernel` (re-selected on the next call)."""
    if kernel not in KERNELS:
        raise KilovlaError(f"FP8 kernel must be one of {KERNELS}, not {kernel!r}")
    for m in model.modules():
        if isinstance(m, Fp8BlockLinear):
            m.kernel, m.kernel_used = kernel, {}


# -- which layers ----------------------------------------------------------------------------------
def fp8_class(name: str, module: nn.Module) -> type[Fp8Weights] | None:
    """The FP8 module that can replace `module` (None: its weight cannot be blocked). Embeddings only
    as token tables (``embed_tokens``, read by index); positional tables are read whole as ``.weight``."""
    if isinstance(module, nn.Embedding):
        return Fp8BlockEmbedding if _TOKEN_TABLE.search(name) else None
    if isinstance(module, GroupedExperts):
        return Fp8GroupedExperts
    return {nn.Linear: Fp8BlockLinear, CategoryLinear: Fp8BlockCategoryLinear}.get(type(module))


def select_layers(model: nn.Module, include: str | None = None, exclude: str | None = None,
                  scope: str = "default") -> list[str]:
    """Names of the layers to quantize.

    With ``include`` the regex is searched in the names of the modules that own parameters, and a
    match whose weight cannot be blocked (a norm's 1-D weight, a conv's 4-D kernel, a positional
    table read whole) stops with a message naming it. Without it, ``scope`` decides: "default" is the
    family's regex (its `fp8_layers`) and every MoE layer's expert stacks (where a family's default
    takes the dense MLP they replace), "all" every layer that can be blocked outside the vision tower.
    ``exclude`` then removes matches.
    """
    if any(isinstance(m, Fp8Weights) for m in model.modules()):
        raise KilovlaError("the model is already quantized to FP8")
    exc = re.compile(exclude) if exclude else None
    owners = [(n, m) for n, m in model.named_modules() if n and any(True for _ in m.parameters(recurse=False))]
    if include is None and scope == "all":
        tower = re.compile(family_of(model).vision_tower)
        pattern = f"--quant.scope=all{f' --quant.exclude={exclude!r}' if exclude else ''}"
        chosen = [(n, m) for n, m in owners if fp8_class(n, m) and not tower.search(n) and not (exc and exc.search(n))]
    else:
        regex = include if include is not None else family_of(model).fp8_layers
        inc = re.compile(regex)
        pattern = f"--quant.include={regex!r}{f' --quant.exclude={exclude!r}' if exclude else ''}"
        experts = include is None  # the default's MoE stacks, which no family's regex names
        chosen = [(n, m) for n, m in owners
                  if (inc.search(n) or (experts and isinstance(m, GroupedExperts))) and not (exc and exc.search(n))]
    if not chosen:
        raise KilovlaError(f"{pattern} selects no layer; layers look like {', '.join(n for n, _ in owners[:3])}")
    bad = [f"{n} ({type(m).__name__}, weight {tuple(next(m.parameters(recurse=False)).shape)})"
           for n, m in chosen if fp8_class(n, m) is None]
    if bad:
        shown = "; ".join(bad[:5]) + (f" ... ({len(bad)} in all)" if len(bad) > 5 else "")
        raise KilovlaError(f"{pattern} selects layers whose weights cannot be blocked (Linear, per-embodiment Linear "
                           f"and token-table weights can): {shown}; narrow --quant.include or add them to --quant.exclude")
    return [n for n, _ in chosen]


def _replace(model: nn.Module, name: str, new: nn.Module) -> None:
    parent_name, _, attr = name.rpartition(".")
    setattr(model.get_submodule(parent_name) if parent_name else model, attr, new)


@torch.no_grad()
def quantize_model(model: nn.Module, config: Fp8Config) -> dict[str, float]:
    """Replace the selected layers by their FP8 modules in place; returns each layer's weight SQNR
    (dB) against its original weight."""
    names = select_layers(model, config.include, config.exclude, config.scope)
    weights = {n: _payload_values(fp8_class(n, model.get_submodule(n)), model.get_submodule(n)) for n in names}
    # Checked before any layer is replaced, so a refusal leaves the model as it was.
    bad = [f"{n} ({int(c)} of {w.numel()} values)" for n, w in weights.items() if (c := (~torch.isfinite(w)).sum())]
    if bad:
        shown = "; ".join(bad[:5]) + (f" ... ({len(bad)} layers in all)" if len(bad) > 5 else "")
        raise KilovlaError(f"non-finite weights (NaN or inf) in {shown}: FP8 block scales cannot represent them; "
                           "fix the checkpoint or --quant.exclude those layers")
    sqnr = {}
    for name in names:
        module = model.get_submodule(name)
        layer = fp8_class(name, module).from_module(module, config.block, config.activations)
        sqnr[name] = sqnr_db(weights[name], _payload_values(type(layer), layer))
        _replace(model, name, layer)
    return sqnr


def _payload_values(cls: type[Fp8Weights], module: nn.Module) -> torch.Tensor:
    """Every FP8 weight of `module` (the layer, or its FP8 module dequantized), flattened into one vector."""
    if isinstance(module, Fp8Weights):
        return torch.cat([module.dequantized_weight(name=n).reshape(-1) for n in module.payload_names(module)])
    return torch.cat([getattr(module, n).detach().reshape(-1) for n in cls.payload_names(module)])


def quantization_config(config: Fp8Config, layers: list[str], model: nn.Module) -> dict:
    """The `quantization_config` of policy.json.

    Hugging Face's fp8 fields (`FineGrainedFP8Config`) where they say something true: ``quant_method``,
    ``weight_block_size``, ``modules_to_not_convert`` (every Linear of `model` that is not in `layers`)
    and, for 1x128 activations only, ``activation_scheme: "dynamic"`` (HF knows no weight-only scheme,
    so a weight-only folder carries none). kilovla's own keys: ``activations`` ("1x128" or "none",
    what the loader runs), ``modules`` (the FP8 layers), ``weight_only_modules`` (those of them that run
    weight-only whatever ``activations`` says: token tables, per-embodiment and expert stacks),
    ``kept_dtype``, ``scope``, ``include``, ``exclude``.
    A module's kind (Linear, token table, per-embodiment Linear) is the model's own at that name."""
    chosen = set(layers)
    fields = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [config.block, config.block]}
    if config.activations == "1x128":
        fields["activation_scheme"] = "dynamic"
    fields["modules_to_not_convert"] = sorted(n for n, m in model.named_modules()
                                              if isinstance(m, nn.Linear) and n not in chosen)
    def kind(name):
        module = model.get_submodule(name)
        return type(module) if isinstance(module, Fp8Weights) else fp8_class(name, module)

    fields.update(activations=config.activations, kept_dtype=config.dtype, scope=config.scope,
                  include=config.include, exclude=config.exclude, modules=list(layers),
                  weight_only_modules=[n for n in layers if kind(n).WEIGHT_ONLY])
    return fields


def _read_quantization_config(qconfig, source: str) -> tuple[int, str, list[str]]:
    """(block, activations, FP8 module names) from a policy.json's quantization_config, checked."""
    if not isinstance(qconfig, dict):
        raise KilovlaError(f"{source}: quantization_config must be a JSON object, not {type(qconfig).__name__}")
    if qconfig.get("quant_method") != "fp8":
        raise KilovlaError(f"{source}: unsupported quantization_config quant_method {qconfig.get('quant_method')!r}; "
                           "kilovla reads block-wise fp8")
    size, activations, names = qconfig.get("weight_block_size"), qconfig.get("activations"), qconfig.get("modules")
    if not (isinstance(size, list) and len(size) == 2 and all(isinstance(v, int) and v > 0 for v in size)):
        raise KilovlaError(f"{source}: quantization_config weight_block_size {size!r}: expected [block, block]")
    if size[0] != size[1]:
        raise KilovlaError(f"{source}: quantization_config weight_block_size {size}: kilovla stores square blocks")
    if activations not in ACTIVATIONS:
        raise KilovlaError(f"{source}: quantization_config activations {activations!r}: expected one of {ACTIVATIONS}")
    scheme = qconfig.get("activation_scheme")
    if scheme != ("dynamic" if activations == "1x128" else None):
        raise KilovlaError(f"{source}: quantization_config activation_scheme {scheme!r} contradicts activations "
                           f"{activations!r} (1x128 goes with 'dynamic'; weight-only has no activation_scheme)")
    if not (isinstance(names, list) and all(isinstance(n, str) for n in names)):
        raise KilovlaError(f"{source}: quantization_config modules must be a list of module names")
    return size[0], activations, names


def prepare_quantized(model: nn.Module, qconfig: dict, source: str) -> None:
    """Turn the layers a policy.json's `quantization_config` names into empty FP8 modules (on the
    model's device, typically meta) so the quantized state dict loads strictly."""
    block, activations, names = _read_quantization_config(qconfig, source)
    for name in names:
        try:
            module = model.get_submodule(name)
        except AttributeError:
            raise KilovlaError(f"{source}: quantization_config names {name!r}, which this model does not have") from None
        cls = fp8_class(name, module)
        if cls is None:
            raise KilovlaError(f"{source}: quantization_config names {name!r}, a {type(module).__name__}, "
                               "whose weight cannot be blocked")
        _replace(model, name, cls.empty_like(module, block, activations))


def _check_block_size(model: nn.Module, folder, source: str) -> None:
    """The block size policy.json claims against the one model.safetensors was written with (its
    metadata) and against every stored scale's shape: a wrong block dequantizes silently wrong."""
    from safetensors import safe_open

    from kilovla.models.checkpoints import read_header

    path = Path(folder) / "model.safetensors"
    layers = {n: m for n, m in model.named_modules() if isinstance(m, Fp8Weights)}
    if not layers or not path.is_file():
        return
    block = next(iter(layers.values())).block
    stored = read_header(path)  # first: a truncated file is named here, before safetensors reads it
    with safe_open(str(path), "pt") as f:
        written = (f.metadata() or {}).get("weight_block_size")
    if written is not None and written != str(block):
        raise KilovlaError(f"{source}: weight_block_size [{block}, {block}] does not match the {written}x{written} "
                           f"blocks {path.name} was quantized with; restore weight_block_size [{written}, {written}]")
    for name, layer, payload in [(n, m, p) for n, m in layers.items() for p in m.payload_names(m)]:
        key = f"{payload}_scale_inv"
        t, want = stored.get(f"{name}.{key}"), layer._buffers[key]
        if t is not None and tuple(t.shape) != tuple(want.shape):
            shape = "x".join(map(str, layer._buffers[payload].shape))
            mismatch = (f"a {shape} weight in {block}x{block} blocks has {tuple(want.shape)} scales, the file stores "
                        f"{tuple(t.shape)}")
            if written is None:  # no block size in the file's metadata: either side may be wrong
                raise KilovlaError(f"{source}: weight_block_size [{block}, {block}] does not match {name}.{key} in "
                                   f"{path}: {mismatch}")
            raise KilovlaError(f"{path}: {name}.{key} is damaged: {mismatch} (the file says it was written with "
                               f"{written}x{written} blocks)")


def _check_scales(model: nn.Module, path) -> None:
    """Every loaded inverse scale finite and positive: a NaN or zero scale turns its whole tile into
    NaN or zeros, silently."""
    for name, layer in model.named_modules():
        for payload in layer.payload_names(layer) if isinstance(layer, Fp8Weights) else ():
            scales = layer._buffers[f"{payload}_scale_inv"]
            bad = int((~(torch.isfinite(scales) & (scales > 0))).sum())
            if bad:
                raise KilovlaError(f"{path}: {name}.{payload}_scale_inv has {bad} scales that are not finite "
                                   "positive numbers; the file is damaged")


def load_quantized_weights(model: nn.Module, qconfig: dict, path, source: str) -> None:
    """Load a quantized policy folder's weights: FP8 layers as stored, the kept layers (stored in
    `kept_dtype`) up-cast to the model's float32, the dtype kilovla computes in."""
    from kilovla.models.checkpoints import load_checkpoint

    prepare_quantized(model, qconfig, source)
    _check_block_size(model, path, source)
    load_checkpoint(model, path)  # reads each tensor into the model's own dtype: FP8 as FP8, the rest float32
    file = Path(path) / "model.safetensors"
    _check_scales(model, file if file.is_file() else path)


def checkpoint_bytes(model: nn.Module, layers: list[str], block: int = 128, kept_bytes: int = 2) -> dict[str, int]:
    """Tensor bytes of the model's state dict in bf16 (`kept_bytes` per element) and with `layers` in
    block-wise FP8 (1 byte per weight element + 4 per block scale), counted from shapes and dtypes
    only: works on the meta device."""
    chosen = set(layers)
    baseline = quantized = fp8_params = 0
    for name, module in model.named_modules():
        payloads = fp8_class(name, module).payload_names(module) if name in chosen else ()
        for pname, p in module.named_parameters(recurse=False):
            baseline += p.numel() * kept_bytes
            if pname in payloads:
                quantized += p.numel() + 4 * math.prod(scale_shape(p.shape, block))
                fp8_params += p.numel()
            else:
                quantized += p.numel() * kept_bytes
    return {"baseline_bytes": baseline, "quantized_bytes": quantized, "fp8_params": fp8_params,
            "total_params": sum(p.numel() for p in model.parameters())}
