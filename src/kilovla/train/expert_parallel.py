"""Expert parallelism (`--parallel.ep=N`): the routed experts of every MoE layer (models/moe.py) split over
N ranks, as torchtitan composes it: EP borrows ranks from the data dimension, so every group of N
consecutive data-parallel ranks holds all experts between them, E/N each.

    torchrun --nproc-per-node=4 -m kilovla train --policy.moe.num_experts=8 --parallel.ep=2
    mesh ("pp", "edp", "ep", "tp") = (1, 2, 2, 1); "dp" is ("edp", "ep") flattened (all 4 replicas)
    rank 0 holds experts 0-3, rank 1 experts 4-7; ranks 2 and 3 the same again

A layer's forward keeps moe.py's route -> dispatch -> expert_compute -> combine; `ExpertExchange` stands
between dispatch and combine: the per-expert counts go to every rank of the ep group first (an
all-to-all of E integers), then each assignment's token row travels to its expert's rank
(all_to_all_single with uneven splits, differentiable: `_AllToAll`), the rank runs `expert_compute` on
its own experts, and the outputs travel back the same way. gloo (CPU) and NCCL (CUDA) both take
all_to_all_single with uneven splits, so the CPU tests run the production path.

Gradients (`data_parallel_reduce` in train/distributed.py): a rank's expert shard already holds the
gradient of every token of its ep group that reached it; summing it over "edp" (the ranks that hold
the same shard) covers the whole batch once, as the all-reduce over "dp" does for every other
parameter. Under FSDP the expert stacks are their own FSDP units over "edp" (`parallelize`), the rest
over "dp"; FSDP's average over edp is divided by ep more (`fsdp_expert_average`). The shards are DTensors (Shard(0) over "ep"), so checkpoints, the gradient norm and
KILOVLA_DUMP_GRADS see the whole stack under the one-process names.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from kilovla.errors import KilovlaError
from kilovla.models.moe import Dispatch, GroupedExperts, MoEMLP


def ep_problems(cfg, world_size: int) -> list[str]:
    """What `--parallel.ep` cannot do with these settings or this world size, one line each."""
    from kilovla.models.family import family_of, moe_of
    from kilovla.models.presets import preset

    p, ep = cfg.parallel, cfg.parallel.ep
    if ep < 1:
        return [f"parallel.ep must be >= 1, not {ep}"]
    if ep == 1:
        return []
    model_cfg = preset(cfg.policy.preset, **dict(cfg.policy.overrides))
    moe = moe_of(model_cfg)
    if moe is None:
        return [f"parallel.ep={ep} needs routed experts to split: set --policy.moe.num_experts"]
    problems = []
    dp = world_size // (p.tp * p.pp) if world_size % (p.tp * p.pp) == 0 else None
    if dp is not None and dp % ep:
        problems.append(f"parallel.ep={ep} does not divide the data-parallel size {dp} (world size {world_size} "
                        f"/ (tp={p.tp} x pp={p.pp})): ep borrows its ranks from the data dimension")
    if moe.num_experts % ep:
        problems.append(f"parallel.ep={ep} does not divide policy.moe.num_experts={moe.num_experts}")
    refused = [("ema_decay", bool(cfg.ema_decay)), ("policy.lora", cfg.policy.lora.enabled),
               ("eval.every", bool(cfg.eval.every))]
    problems += [f"{what} with parallel.ep is not supported yet: drop one of them"
                 + (" (evaluate the checkpoints with kilovla eval)" if what == "eval.every" else "")
                 for what, on in refused if on]
    return problems


class _AllToAll(torch.autograd.Function):
    """all_to_all_single with uneven splits; its gradient is the same exchange the other way."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, out_splits: list[int], in_splits: list[int], group) -> torch.Tensor:
        ctx.splits, ctx.group = (out_splits, in_splits), group
        out = x.new_empty((sum(out_splits), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        out_splits, in_splits = ctx.splits
        return _AllToAll.apply(grad.contiguous(), in_splits, out_splits, ctx.group), None, None, None


class ExpertExchange:
    """Dispatch and combine over an ep group: assignments (M, W) in `Dispatch` order -> expert outputs (M, W)
    in the same order, each computed on the rank that holds its expert."""

    def __init__(self, group, num_experts: int):
        self.group, self.size = group, dist.get_world_size(group)
        self.local = num_experts // self.size

    def __call__(self, experts: GroupedExperts, x: torch.Tensor, plan: Dispatch, k: int) -> torch.Tensor:
        n, local = self.size, self.local
        rows = x[plan.assignment // k]  # (M, W), sorted by expert: rank r's experts are one block
        counts = torch.empty_like(plan.counts)  # (n * local,): [source rank, my expert]
        dist.all_to_all_single(counts, plan.counts.contiguous(), group=self.group)
        counts = counts.view(n, local)
        send = plan.counts.view(n, local).sum(1).tolist()
        recv = counts.sum(1).tolist()
        got = _AllToAll.apply(rows, recv, send, self.group)  # (R, W), by source, then by my expert
        expert_of = torch.repeat_interleave(torch.arange(local, device=x.device).repeat(n), counts.reshape(-1))
        order = torch.argsort(expert_of, stable=True)
        mine = counts.sum(0)
        y = experts(got[order], mine.tolist())  # (R, W), by my expert
        return _AllToAll.apply(y[torch.argsort(order)], send, recv, self.group)


def apply_ep(model: nn.Module, mesh) -> None:
    """Every MoE layer's routed experts split over the 1-D "ep" `mesh` (Shard(0): experts r*E/N .. (r+1)*E/N
    on its rank r), its forward exchanging tokens with `ExpertExchange`. Every rank holds the whole
    initialised stack before (one seed), so each keeps its slice."""
    from torch.distributed.tensor import Shard, distribute_tensor

    for m in model.modules():
        if isinstance(m, MoEMLP):
            for name, p in list(m.experts.named_parameters(recurse=False)):  # every stack is (E, ...)
                setattr(m.experts, name, nn.Parameter(distribute_tensor(p.data, mesh, [Shard(0)]),
                                                      requires_grad=p.requires_grad))
            m.exchange = ExpertExchange(mesh.get_group(), m.cfg.num_experts)


def expert_stacks(model: nn.Module) -> list[GroupedExperts]:
    """The routed expert stacks of every MoE layer (what `apply_ep` splits)."""
    return [m.experts for m in model.modules() if isinstance(m, MoEMLP)]


def is_expert_shard(t: torch.Tensor) -> bool:
    """A tensor (a parameter or its gradient) split over the "ep" mesh dimension."""
    return hasattr(t, "placements") and "ep" in (t.device_mesh.mesh_dim_names or ())
