"""Tensor parallelism (Megatron-style), applied to a plain model from outside with DTensor.

`apply_tp(model, tp_mesh)` shards every decoder layer of the language model and the action expert
(pi0 / pi0.5: Gemma LM + Gemma expert; GR00T N1.5: the DiT action head's blocks):

- attention: q (and k, v where the key/value heads divide by tp) column-parallel, so each rank
  computes its own heads, the output projection row-parallel (one all-reduce);
- MLP: gate/up column-parallel, down row-parallel (one all-reduce). An MoE layer's router and experts
  stay whole on every rank of a tp group (the family's `tp_split` leaves them out): its input is the
  same on each, so each routes and computes alike; `--parallel.ep` is the dimension that splits experts.

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
from kilovla.models.family import family_of


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
    """(layer, key/value heads) of each layer tensor parallelism shards (the family's plan)."""
    return family_of(model).tp_layers(model)


def tp_problems(model_cfg, tp: int) -> list[str]:
    """What of a model config a tp degree does not divide (query heads, key/value heads that are
    neither divisible nor single, widths), from the config alone: checked before any work."""
    problems = []
    for part, (heads, kv, mlp) in family_of(model_cfg).tp_parts(model_cfg).items():
        if heads % tp:
            problems.append(f"the {part}'s {heads} query heads")
        if kv % tp and kv != 1:
            problems.append(f"the {part}'s {kv} key/value heads (they must divide by tp, or be a single one)")
        if mlp % tp:
            problems.append(f"the {part}'s MLP width {mlp}")
    return [f"parallel.tp={tp} does not divide {p}" for p in problems]


def apply_tp(model: nn.Module, tp_mesh) -> nn.Module:
    """Shard the model's decoder layers over `tp_mesh` in place (see the module docstring)."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    tp = tp_mesh.size()
    problems = tp_problems(model.config, tp)
    if problems:
        raise KilovlaError("; ".join(problems))
    group = tp_mesh.get_group()
    split = family_of(model).tp_split
    for layer, kv in decoder_layers(model):
        if not any(True for _ in layer.parameters()):  # another pipeline stage's layer
            continue
        spec = split(layer)
        whole_kv = kv % tp != 0  # computed whole on every rank
        plan = {_path_in(layer, lin): ColwiseParallel() for lin in spec.column + (() if whole_kv else spec.kv)}
        plan.update({_path_in(layer, lin): RowwiseParallel() for lin in spec.row})
        parallelize_module(layer, tp_mesh, plan)
        for lin in spec.kv if whole_kv else ():
            lin.register_forward_hook(_sum_gradient_hook(group))
    return model


def _path_in(root: nn.Module, target: nn.Module) -> str:
    return next(name for name, m in root.named_modules() if m is target)
