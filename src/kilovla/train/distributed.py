"""Process groups and parallelism, applied to a plain model from outside.

`init()` reads torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK): gloo on CPU, NCCL on CUDA; a
plain `python -m kilovla train` is world size 1 and needs no process group.
`parallelize(model, cfg, world)`: DDP with bucketed all-reduce, or FSDP2 (`fully_shard` on every
decoder layer, then the root) for models that do not fit one device.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from kilovla.errors import KilovlaError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class World:
    rank: int = 0
    size: int = 1
    local_rank: int = 0
    device: torch.device = torch.device("cpu")

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def init() -> World:
    size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local = int(os.environ.get("LOCAL_RANK", "0"))
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", local) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    if size > 1 and not dist.is_initialized():
        dist.init_process_group("nccl" if cuda else "gloo")
    return World(rank, size, local, device)


def shutdown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def parallelize(model: nn.Module, strategy: str, world: World, *, bucket_cap_mb: int = 25,
                gradient_as_bucket_view: bool = True, static_graph: bool = True,
                find_unused_parameters: bool = False) -> nn.Module:
    if world.size == 1:
        return model
    if strategy == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        if find_unused_parameters:
            log.warning("DDP with find_unused_parameters=True: an extra graph traversal every step")
        return DistributedDataParallel(
            model, device_ids=[world.local_rank] if world.device.type == "cuda" else None,
            bucket_cap_mb=bucket_cap_mb, gradient_as_bucket_view=gradient_as_bucket_view,
            static_graph=static_graph, find_unused_parameters=find_unused_parameters)
    if strategy == "fsdp":
        try:
            from torch.distributed.fsdp import fully_shard, register_fsdp_forward_method
        except ImportError:
            raise KilovlaError("FSDP2 needs torch >= 2.6 (torch.distributed.fsdp.fully_shard)") from None
        # One FSDP unit at the root: parameters, gradients and optimizer state are sharded at rest and
        # gathered for the forward. Per-layer units would gather one layer at a time, but FSDP2
        # gathers on a unit's forward(), and the mixture-of-transformers loop calls the layers'
        # projections directly rather than each layer's forward().
        fully_shard(model)
        if hasattr(model, "sample_actions"):
            register_fsdp_forward_method(model, "sample_actions")
        return model
    raise KilovlaError(f"parallel.strategy must be ddp or fsdp, not {strategy!r}")


def unwrap(model: nn.Module) -> nn.Module:
    return model.module if hasattr(model, "module") else model


def all_reduce_sum(value: float, world: World) -> float:
    if world.size == 1:
        return value
    t = torch.tensor([value], dtype=torch.float64, device=world.device)
    dist.all_reduce(t)
    return float(t.item())


def all_gather_objects(obj, world: World) -> list:
    if world.size == 1:
        return [obj]
    out = [None] * world.size
    dist.all_gather_object(out, obj)
    return out
