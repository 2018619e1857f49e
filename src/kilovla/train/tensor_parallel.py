"""Tensor parallelism (Megatron-style), applied to a plain model from outside with DTensor.

`apply_tp(model, tp_mesh)` shards every decoder layer of the language model and the action expert
(pi0 / pi0.5: Gemma LM + Gemma expert; GR00T N1.5: the DiT action head's blocks):

- attention: q (and k, v where the key/value heads divide by tp) column-parallel, so each rank
  computes its own heads, the output projection row-parallel (one all-reduce);
- MLP: gate/up column-parallel, down row-parallel (one all-reduce).

The model code stays as it is: a layer reads its local head count from the projection's output
(`view(..., -1, head_dim)`), and the attention kernels (dense and varlen alike) take whatever heads
they are given, with the packed rows' `cu_seqlens` shared by every head, so packing works unchanged.
Key/value heads that do not divide by tp (pi0's Gemma has one) stay whole on every rank: each rank
computes them and uses them for its own query heads, so its gradient of k and v is partial; an
identity op whose backward all-reduces over the tp group (`_SumGradient`) makes it whole, and the
replicated projection's weight gradient with it.

Everything else (vision tower, embeddings, projections, norms, adaRMS) is replicated and computed
identically on every rank of a tp group; its gradients come out whole on every rank because every
sharded module's input gradient is all-reduced (ColwiseParallel's input is a Replicate DTensor).

Sequence parallel is not applied: the sharded layers dominate compute (the MLP is 4-8x the width),
the norms it would split are a small share of it, and it would shard the packed rows' token
dimension that the varlen attention indexes across samples.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from kilovla.errors import KilovlaError


class _SumGradient(torch.autograd.Function):
    """Identity in forward; the gradient summed over `group` in backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


def _sum_gradient_hook(group):
    def hook(module, args, output):
        return _SumGradient.apply(output, group)

    return hook


def decoder_layers(model: nn.Module) -> list[tuple[nn.Module, int]]:
    """(layer, key/value heads) of each layer tensor parallelism shards."""
    from kilovla.models.groot import GrootModel
    from kilovla.models.pi05 import Pi05Model

    if isinstance(model, Pi05Model):
        c = model.config
        return ([(layer, c.lm.kv_heads) for layer in model.vlm.language_model.layers]
                + [(layer, c.expert.kv_heads) for layer in model.expert.layers])
    if isinstance(model, GrootModel):
        return [(block, model.config.dit.heads) for block in model.action_head.model.transformer_blocks]
    raise KilovlaError(f"no tensor-parallel plan for {type(model).__name__}")


def tp_problems(model_cfg, tp: int) -> list[str]:
    """What of a model config a tp degree does not divide (query heads, key/value heads that are
    neither divisible nor single, widths), from the config alone: checked before any work."""
    from kilovla.models.groot import GrootConfig

    if isinstance(model_cfg, GrootConfig):
        d = model_cfg.dit
        parts = {"DiT": (d.heads, d.heads, 4 * d.width)}
    else:
        parts = {"language model": (model_cfg.lm.heads, model_cfg.lm.kv_heads, model_cfg.lm.mlp_dim),
                 "action expert": (model_cfg.expert.heads, model_cfg.expert.kv_heads, model_cfg.expert.mlp_dim)}
    problems = []
    for part, (heads, kv, mlp) in parts.items():
        if heads % tp:
            problems.append(f"the {part}'s {heads} query heads")
        if kv % tp and kv != 1:
            problems.append(f"the {part}'s {kv} key/value heads (they must divide by tp, or be a single one)")
        if mlp % tp:
            problems.append(f"the {part}'s MLP width {mlp}")
    return [f"parallel.tp={tp} does not divide {p}" for p in problems]


_COLWISE = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "to_q", "to_k", "to_v", "proj_in")  # the rest: row-wise


def _plan_linears(layer: nn.Module) -> list[tuple[str, nn.Linear]]:
    """The projections of one layer that take part, by their short names."""
    if hasattr(layer, "attn1"):  # a GR00T DiT block (diffusers' names)
        a, ff = layer.attn1, layer.ff.net
        return [("to_q", a.to_q), ("to_k", a.to_k), ("to_v", a.to_v), ("to_out", a.to_out[0]),
                ("proj_in", ff[0].proj), ("proj_out", ff[2])]
    a, m = layer.self_attn, layer.mlp
    return [("q_proj", a.q_proj), ("k_proj", a.k_proj), ("v_proj", a.v_proj), ("o_proj", a.o_proj),
            ("gate_proj", m.gate_proj), ("up_proj", m.up_proj), ("down_proj", m.down_proj)]


def apply_tp(model: nn.Module, tp_mesh) -> nn.Module:
    """Shard the model's decoder layers over `tp_mesh` in place (see the module docstring)."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    tp = tp_mesh.size()
    problems = tp_problems(model.config, tp)
    if problems:
        raise KilovlaError("; ".join(problems))
    group = tp_mesh.get_group()
    for layer, kv in decoder_layers(model):
        if not any(True for _ in layer.parameters()):  # another pipeline stage's layer
            continue
        plan, hooked = {}, []
        for name, lin in _plan_linears(layer):
            path = _path_in(layer, lin)
            if name in ("k_proj", "v_proj", "to_k", "to_v") and kv % tp:  # whole on every rank
                hooked.append(lin)
            elif name in _COLWISE:
                plan[path] = ColwiseParallel()
            else:
                plan[path] = RowwiseParallel()
        parallelize_module(layer, tp_mesh, plan)
        for lin in hooked:
            lin.register_forward_hook(_sum_gradient_hook(group))
    return model


def _path_in(root: nn.Module, target: nn.Module) -> str:
    return next(name for name, m in root.named_modules() if m is target)
