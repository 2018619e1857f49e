"""Process groups and parallelism, applied to a plain model from outside.

`init()` reads torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK): gloo on CPU, NCCL on CUDA; a
plain `python -m kilovla train` is world size 1 and needs no process group. Every collective has a
timeout (`parallel.timeout_s`); one that does not complete ends the run with a message naming the
rank and what it was doing (`CollectiveTimeout`), never a silent hang.

`parallelize(model, strategy, world)`:

- ``ddp``: DistributedDataParallel, bucketed all-reduce. Not `static_graph`: a step accumulates over
  several packed rows with `no_sync`, and a static graph assumes every backward all-reduces (it
  dies at the first `no_sync` row). No `find_unused_parameters`: the models freeze what they never
  use, so every trainable parameter gets a gradient in every backward.
- ``fsdp``: FSDP2, one unit per transformer layer (`layer_units`, the family's `fsdp_units`: ViT
  blocks; each paired LM/expert layer of pi0/pi0.5; GR00T's Qwen layers, VL self-attention and DiT
  blocks), then the root for what is left (embeddings, projections, norms). A unit's parameters are
  gathered for its forward and backward only, so at most a layer or two are whole at a time. bf16
  parameters with fp32 gradient reduction on CUDA when training in bf16.

`gradient_sync(model, sync)` is the one switch for accumulation: DDP's `no_sync`, FSDP2's
`set_requires_gradient_sync`; the trainer turns it off for every row of a step but the last.
"""

from __future__ import annotations

import contextlib
import faulthandler
import logging
import math
import os
import sys
import threading
import time
import warnings
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn

from kilovla.errors import KilovlaError

log = logging.getLogger(__name__)


class CollectiveTimeout(KilovlaError):
    """A collective did not complete in time: a peer died, hangs, or is still busy elsewhere."""

    exit_code = 1


@dataclass(frozen=True)
class World:
    rank: int = 0
    size: int = 1
    local_rank: int = 0
    device: torch.device = torch.device("cpu")
    timeout_s: float = 1800.0
    control: object = field(default=None, compare=False)  # a gloo group for barriers that name the missing rank
    # with tensor, pipeline or expert parallelism: the ("pp", "dp", "tp") DeviceMesh; rank = (pp * dp_size + dp) * tp + tp.
    # With ep, "dp" is ("edp", "ep") flattened: dp = edp * ep + ep_rank (train/expert_parallel.py)
    mesh: object = field(default=None, compare=False)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def _dim(self, name: str) -> int:
        if self.mesh is None or (name in ("ep", "edp") and "ep" not in self.mesh.mesh_dim_names):
            return 1
        return self.mesh[name].size()

    def dim_size(self, name: str) -> int:
        """Ranks along one mesh dimension ("dp", "tp", "pp", "ep"); without a mesh every rank is a replica."""
        return self.dp_size if name == "dp" else self._dim(name)

    @property
    def tp(self) -> int:
        return self._dim("tp")

    @property
    def pp(self) -> int:
        return self._dim("pp")

    @property
    def ep(self) -> int:
        return self._dim("ep")

    @property
    def dp_size(self) -> int:
        """Model replicas: what the plan splits a global batch over."""
        return self.size // (self.tp * self.pp)

    @property
    def dp_rank(self) -> int:
        """This rank's replica: the ranks of one replica (its tp ranks and pp stages) read the same rows."""
        return (self.rank // self.tp) % self.dp_size

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp

    @property
    def pp_rank(self) -> int:
        return self.rank // (self.tp * self.dp_size)

    def group(self, name: str):
        """The process group of one mesh dimension through this rank ("dp", "tp", "pp"); None (the
        whole world) without a mesh, where only "dp" has more than one rank."""
        return None if self.mesh is None else self.mesh[name].get_group()

    @property
    def dp_group(self):
        return self.group("dp")

    @property
    def tp_group(self):
        return self.group("tp")


def init(timeout_s: float = 1800.0, tp: int = 1, pp: int = 1, ep: int = 1) -> World:
    """The process group of a torchrun launch; with `tp` or `pp` > 1 also the ("pp", "dp", "tp") mesh, with
    `ep` > 1 the ("pp", "edp", "ep", "tp") mesh whose ("edp", "ep") flattened is "dp"."""
    size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local = int(os.environ.get("LOCAL_RANK", "0"))
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", local) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    control = None
    if size > 1:
        # A rank that dies in native code (SIGABRT from a C++ `terminate`, SIGSEGV) prints every thread's Python
        # stack to stderr first, which torchrun passes on: where in the step, or in the teardown, it died.
        if not faulthandler.is_enabled():
            faulthandler.enable(all_threads=True)
        timeout = timedelta(seconds=timeout_s)
        if not dist.is_initialized():
            dist.init_process_group("nccl" if cuda else "gloo", timeout=timeout)
        # monitored_barrier (which names the ranks that did not arrive) exists on gloo only.
        control = dist.new_group(backend="gloo", timeout=timeout) if cuda else dist.group.WORLD
    mesh = None
    if tp * pp * ep > 1:
        if size % (tp * pp * ep):
            raise KilovlaError(f"parallel.tp={tp} x parallel.pp={pp} x parallel.ep={ep} does not divide the world "
                               f"size {size}")
        from torch.distributed.device_mesh import init_device_mesh

        dp = size // (tp * pp)
        if ep == 1:
            mesh = init_device_mesh(device.type, (pp, dp, tp), mesh_dim_names=("pp", "dp", "tp"))
        else:  # torchtitan's layout: ep borrows the inner ranks of the data dimension
            mesh = init_device_mesh(device.type, (pp, dp // ep, ep, tp), mesh_dim_names=("pp", "edp", "ep", "tp"))
            mesh[("edp", "ep")]._flatten("dp")
    return World(rank, size, local, device, timeout_s, control, mesh)


def side_group(world: World):
    """A gloo group of every rank for collectives that run beside the step's on a background thread (an
    asynchronous checkpoint's); None in one process."""
    return None if world.size == 1 else dist.new_group(backend="gloo", timeout=timedelta(seconds=world.timeout_s))


def shutdown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


# -- parallelism -----------------------------------------------------------------------------------
def layer_units(model: nn.Module) -> list[list[nn.Module]]:
    """The transformer layers of a model, in forward order, each a list of modules that run as one
    forward call (the family's `fsdp_units`: a pi0 LM layer runs its paired expert layer inside its
    own forward)."""
    from kilovla.models.family import family_of

    return family_of(model).fsdp_units(model)


def parallelize(model: nn.Module, strategy: str, world: World, *, bucket_cap_mb: int = 25,
                gradient_as_bucket_view: bool = True, static_graph: bool = False,
                find_unused_parameters: bool = False, bf16: bool = False) -> nn.Module:
    """Wrap `model` for `world`; returns what the training step calls (the model itself under FSDP or
    tensor parallelism). With `world.mesh`, the model's decoder layers are sharded over its "tp"
    dimension first (train/tensor_parallel.py), the routed experts over its "ep" dimension
    (train/expert_parallel.py), and `strategy` applies to its "dp" dimension: fsdp shards over it (the
    expert stacks over "edp"), ddp leaves the gradient average to the trainer (`data_parallel_reduce`),
    as DistributedDataParallel does not take DTensor parameters."""
    if world.size == 1:
        return model
    if world.mesh is not None:  # (a pipeline stage's model holds its own layers already: train/pipeline.py)
        if world.tp > 1:
            from kilovla.train.tensor_parallel import apply_tp

            apply_tp(model, world.mesh["tp"])
        if world.ep > 1:
            from kilovla.train.expert_parallel import apply_ep

            apply_ep(model, world.mesh["ep"])
        if strategy == "ddp" or world.dp_size == 1:
            return model
    if strategy == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        if static_graph:
            log.warning("DDP with static_graph=True: it breaks with accumulation over several rows per step (no_sync)")
        if find_unused_parameters:
            log.warning("DDP with find_unused_parameters=True: an extra graph traversal every step")
        return DistributedDataParallel(
            model, device_ids=[world.local_rank] if world.device.type == "cuda" else None,
            bucket_cap_mb=bucket_cap_mb, gradient_as_bucket_view=gradient_as_bucket_view,
            static_graph=static_graph, find_unused_parameters=find_unused_parameters)
    if strategy == "fsdp":
        try:
            from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard, register_fsdp_forward_method
        except ImportError:
            raise KilovlaError("FSDP2 needs torch >= 2.6 (torch.distributed.fsdp.fully_shard)") from None
        # The models never modify a module's output in place, which is all this warning is about.
        warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")
        kwargs = {} if world.mesh is None else {"mesh": world.mesh["dp"]}
        if bf16 and world.device.type == "cuda":
            kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        if world.ep > 1:  # expert shards: FSDP over the ranks that hold the same experts ("edp")
            from kilovla.train.expert_parallel import expert_stacks

            for experts in expert_stacks(model):
                fully_shard(experts, **{**kwargs, "mesh": world.mesh["edp"]})
        units = layer_units(model)
        for i, unit in enumerate(units):
            # The last unit's parameters are needed again at once by backward: keep them gathered.
            fully_shard(unit if len(unit) > 1 else unit[0], reshard_after_forward=i < len(units) - 1, **kwargs)
        fully_shard(model, **kwargs)
        if hasattr(model, "sample_actions"):
            register_fsdp_forward_method(model, "sample_actions")
        return model
    raise KilovlaError(f"parallel.strategy must be ddp or fsdp, not {strategy!r}")


def is_fsdp(model: nn.Module) -> bool:
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:
        return False
    return isinstance(model, FSDPModule)


def is_pipeline_stage(model: nn.Module) -> bool:
    """A model that holds one pipeline stage's share of the layers (train/pipeline.py `keep_stage`)."""
    return getattr(model, "pipeline_stage", None) is not None


def is_sharded(model: nn.Module) -> bool:
    """FSDP2, tensor parallelism (the parameters are DTensors) or a pipeline stage (a share of the
    parameters): saved and loaded by their shards."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:
        return False
    return is_fsdp(model) or is_pipeline_stage(model) or any(isinstance(p, DTensor) for p in model.parameters())


def unwrap(model: nn.Module) -> nn.Module:
    return model.module if hasattr(model, "module") else model


@contextlib.contextmanager
def gradient_sync(model: nn.Module, sync: bool):
    """Reduce gradients across ranks in this backward (`sync`), or only accumulate them locally."""
    if hasattr(model, "no_sync") and not sync:  # DDP
        with model.no_sync():
            yield
        return
    if is_fsdp(model):
        model.set_requires_gradient_sync(sync)
    yield


# -- collectives with a deadline ---------------------------------------------------------------------
def collective_failure(error: BaseException, world: World, what: str) -> CollectiveTimeout | None:
    """A CollectiveTimeout naming the rank and `what`, if `error` came from a collective; else None."""
    if world.size == 1:
        return None
    text = str(error)
    markers = ("Timed out", "timed out", "Timeout", "Connection closed by peer", "Connection reset",
               "monitoredBarrier", "NCCL", "Gloo", "gloo")
    if not isinstance(error, getattr(dist, "DistError", ())) and not any(m in text for m in markers):
        return None
    first = text.strip().splitlines()[0] if text.strip() else type(error).__name__
    # The rank that notices cannot tell which peer it waits for (a collective only fails as a whole).
    return CollectiveTimeout(f"rank {world.rank} waited for {what}: a collective did not complete within "
                             f"{world.timeout_s:g} s, or a peer left ({first[:300]})")


def barrier(world: World, what: str, timeout_s: float | None = None) -> None:
    """All ranks meet here; rank 0 names the ranks that did not arrive within the timeout."""
    if world.size == 1:
        return
    timeout = timedelta(seconds=timeout_s or world.timeout_s)
    try:
        dist.monitored_barrier(group=world.control, timeout=timeout, wait_all_ranks=True)
    except RuntimeError as e:
        raise CollectiveTimeout(f"rank {world.rank}: {what}: not every rank arrived within "
                                f"{timeout.total_seconds():g} s, or a peer left ({str(e).strip().splitlines()[0][:300]})") from None


class Watchdog:
    """Ends the process when one phase of the run (a step, a checkpoint, an evaluation) takes longer
    than its deadline: a backstop for hangs that raise nothing (an NCCL collective whose peer is gone).

        dog = Watchdog(world); dog.arm("step 12", 600); ...; dog.disarm()
    """

    def __init__(self, world: World, grace_s: float = 30.0):
        self.world, self.grace_s = world, grace_s
        self._what: str | None = None
        self._deadline, self._timeout_s = 0.0, 0.0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = None
        if world.size > 1:
            self._thread = threading.Thread(target=self._watch, name="kilovla-watchdog", daemon=True)
            self._thread.start()

    def arm(self, what: str, timeout_s: float) -> None:
        """A short deadline gets as much grace as itself (a collective's own timeout speaks first)."""
        with self._lock:
            self._what, self._timeout_s = what, timeout_s
            self._deadline = time.monotonic() + timeout_s + min(self.grace_s, timeout_s)

    def disarm(self) -> None:
        with self._lock:
            self._what = None

    def close(self) -> None:
        self._stop.set()

    def _watch(self) -> None:
        while not self._stop.wait(1.0):
            with self._lock:
                what, late = self._what, self._what is not None and time.monotonic() > self._deadline
            if late:
                print(f"error: rank {self.world.rank} waited for {what} past its deadline ({self._timeout_s:g} s, "
                      "parallel.timeout_s); another rank is gone or hangs. Ending the run.", file=sys.stderr, flush=True)
                os._exit(1)


def all_reduce_sum(value: float, world: World, over: str | None = None) -> float:
    """The sum of `value` over all ranks, or over one mesh dimension through this rank (`over`: "dp"
    sums over the model replicas, whose ranks hold different rows; "pp" over a replica's stages)."""
    if world.size == 1 or (over is not None and world.dim_size(over) == 1):
        return value
    t = torch.tensor([value], dtype=torch.float64, device=world.device)
    dist.all_reduce(t, group=world.group(over) if over else None)
    return float(t.item())


# -- gradients on a mesh --------------------------------------------------------------------------
def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def all_reduce_flat(tensors: list[torch.Tensor], group, divide: int = 1) -> None:
    """Sum `tensors` over `group` in place, one flat all-reduce per dtype, then divide by `divide`
    (gloo has no AVG)."""
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in tensors:
        by_dtype.setdefault(t.dtype, []).append(t)
    for same in by_dtype.values():
        flat = torch.cat([t.reshape(-1) for t in same])
        dist.all_reduce(flat, group=group)
        if divide != 1:
            flat /= divide
        offset = 0
        for t in same:
            t.copy_(flat[offset:offset + t.numel()].view_as(t))
            offset += t.numel()


def data_parallel_reduce(params: list[torch.Tensor], world: World) -> None:
    """The gradient average over the model replicas (the mesh's "dp" dimension) when the data dimension
    runs as ddp: DistributedDataParallel does not take DTensor parameters nor a pipeline stage's. Expert
    shards (`--parallel.ep`) are summed over "edp" only, the ranks holding the same shard, and divided alike:
    each shard's gradient already holds its ep group's tokens (train/expert_parallel.py)."""
    if world.dp_size == 1:
        return
    if world.ep == 1:
        all_reduce_flat([_local(p.grad) for p in params if p.grad is not None], world.dp_group, world.dp_size)
        return
    from kilovla.train.expert_parallel import is_expert_shard

    experts = [p for p in params if is_expert_shard(p)]
    for p in experts:  # a shard none of the step's tokens reached still takes part in the all-reduce
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    all_reduce_flat([_local(p.grad) for p in params if p.grad is not None and not is_expert_shard(p)],
                    world.dp_group, world.dp_size)
    if world.dim_size("edp") > 1:
        all_reduce_flat([_local(p.grad) for p in experts], world.group("edp"), world.dp_size)
    else:
        for p in experts:
            _local(p.grad).div_(world.dp_size)


def fsdp_expert_average(params: list[torch.Tensor], world: World) -> None:
    """FSDP averages an expert shard's gradient over "edp", the ranks that hold it; the average over every
    replica divides by ep more (gloo has no PREMUL_SUM for FSDP's own divide factor)."""
    from kilovla.train.expert_parallel import is_expert_shard

    for p in params:
        if p.grad is not None and is_expert_shard(p):
            _local(p.grad).div_(world.ep)


def _sharded_dims(t: torch.Tensor) -> tuple[str, ...]:
    """The mesh dimensions a DTensor is split over (none for a plain tensor or a replicated one)."""
    if not hasattr(t, "placements"):
        return ()
    names = t.device_mesh.mesh_dim_names
    # not replicated nor partial: split, counting FSDP-over-TP's _StridedShard (whose is_shard() is False)
    return tuple(names[i] for i, p in enumerate(t.placements) if not (p.is_replicate() or p.is_partial()))


def mesh_clip_gradients(params: list[torch.Tensor], max_norm: float, world: World,
                        shared: frozenset[int] = frozenset()) -> float:
    """The global gradient norm of a model on `world.mesh`, whatever mix it holds of plain,
    tp-sharded, (under FSDP) dp- or 2D-sharded gradients and pipeline stages' own parameters; clipped
    to `max_norm` when > 0. The squares of each kind's local pieces are summed over the mesh
    dimensions it is split over, one all-reduce per kind, then over the stages, except for the
    parameters (ids in `shared`) that every stage holds alike."""
    grads = [(p.grad, id(p) in shared) for p in params if p.grad is not None]
    squares: dict[tuple, torch.Tensor] = {}
    for g, everywhere in grads:
        key = (_sharded_dims(g), everywhere)
        sq = _local(g).detach().double().pow(2).sum()  # on the gradients' device, as NCCL needs
        squares[key] = squares[key] + sq if key in squares else sq
    stage_sq, shared_sq = 0.0, 0.0
    for (dims, everywhere), sq in sorted(squares.items()):  # the same order on every rank
        for name in dims:  # summed over each dimension in turn: over all the pieces
            dist.all_reduce(sq, group=world.group(name))
        if everywhere:
            shared_sq += float(sq)
        else:
            stage_sq += float(sq)
    norm = math.sqrt(all_reduce_sum(stage_sq, world, over="pp") + shared_sq)
    if max_norm > 0 and math.isfinite(norm):
        coef = max_norm / (norm + 1e-6)
        if coef < 1:
            for g, _ in grads:
                _local(g).mul_(coef)
    return norm


def all_gather_objects(obj, world: World) -> list:
    if world.size == 1:
        return [obj]
    out = [None] * world.size
    dist.all_gather_object(out, obj)
    return out
