"""A mixture-of-experts MLP for the action expert: E routed experts, each token sent to the top K of a
softmax router, plus optional shared experts every token passes through.

    cfg = MoEConfig(num_experts=8, top_k=2)       # --policy.moe.num_experts=8 --policy.moe.top_k=2
    mlp = MoEMLP(width=1024, hidden=4096, cfg=cfg, layer=3)
    y = mlp(x, Routing(valid=mask))               # x (B, T, W), mask (B, T): only real tokens are routed

Dropless (`capacity_factor` 0, the default) computes every token's K experts, so a token's output never
depends on the rest of the batch (padded and packed paths agree); a capacity factor c caps each expert at
ceil(c * tokens * K / E) assignments per forward pass, first come first served in token order, and the
assignments past it are dropped (their token keeps its residual path and its other experts), counted
in `moe/dropped_fraction`. Capacity applies in training only: evaluation and serving are dropless.

The forward is four functions, so expert parallelism can put its all-to-all between `dispatch` and
`expert_compute`: `route` (router logits -> top-k experts and weights), `dispatch` (assignments sorted by
expert, with per-expert counts, capacity applied), `expert_compute` (each expert on its tokens: `grouped_linear`,
one matmul per expert over the stacked weights) and `combine` (weighted scatter-add back to the tokens). Under
`--parallel.ep` a layer's `exchange` (train/expert_parallel.py) takes expert_compute's place: it sends
the assignments to their experts' ranks, runs expert_compute there and brings the outputs back.

Weights: one stacked parameter per projection, each expert's slice in nn.Linear's (out, in) layout:
``experts.gate_proj`` / ``experts.up_proj`` (E, H, W), ``experts.down_proj`` (E, W, H); dim 0 is what
expert parallelism shards, and a slice is a dense GatedMLP's weight, which upcycling copies
(`upcycle_sources`); other MLP kinds stack the same way (`GroupedExperts` subclasses: SmolVLA's SwiGLU,
GR00T's biased GELU feed-forward). From one seed, expert 0 draws what the dense MLP would (the global
generator) and everything else (experts 1.., shared experts, router) draws from a generator of its own,
so E = 1, K = 1 is the dense model, weight for weight.

The losses, per forward pass over the routed tokens: Switch Transformer's load balancing
E * sum_e f_e * P_e (f_e: expert e's share of the assignments, P_e: its mean router probability; 1 when
balanced) and ST-MoE's router z-loss mean(logsumexp(logits)^2). `moe_outputs` averages them over the
layers; the trainer adds aux_loss_coef * aux + z_loss_coef * z to the objective (`training_loss`), never
to the reported flow-matching loss.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from kilovla.errors import KilovlaError
from kilovla.models.layers import GatedMLP, SwiGLU


@dataclass(frozen=True, kw_only=True)
class MoEConfig:
    """`--policy.moe.*`: recorded in policy.json's model overrides (`moe`), so every reader rebuilds it."""

    num_experts: int = 0  # routed experts per expert layer; 0: the dense MLP
    top_k: int = 2  # experts per token
    shared_experts: int = 0  # experts every token passes through, beside its routed ones
    expert_dim: int | None = None  # a routed (and shared) expert's hidden width; None: the dense MLP's
    capacity_factor: float = 0.0  # 0: dropless; c > 0: at most ceil(c * tokens * top_k / num_experts) per expert
    aux_loss_coef: float = 0.01  # load-balancing loss weight in the training objective
    z_loss_coef: float = 0.001  # router z-loss weight in the training objective

    @property
    def enabled(self) -> bool:
        return self.num_experts > 0

    def problems(self) -> list[str]:
        out = []
        if self.num_experts < 0:
            out.append(f"policy.moe.num_experts must be >= 0, not {self.num_experts}")
        if self.enabled and not 1 <= self.top_k <= self.num_experts:
            out.append(f"policy.moe.top_k must be in [1, num_experts={self.num_experts}], not {self.top_k}")
        if self.shared_experts < 0 or (self.expert_dim is not None and self.expert_dim < 1):
            out.append(f"policy.moe.shared_experts must be >= 0 and expert_dim >= 1 (got {self.shared_experts}, "
                       f"{self.expert_dim})")
        for name in ("capacity_factor", "aux_loss_coef", "z_loss_coef"):
            if not 0 <= getattr(self, name) < math.inf:
                out.append(f"policy.moe.{name} must be finite and >= 0, not {getattr(self, name)}")
        return out

    def check(self) -> None:
        if self.problems():
            raise KilovlaError("; ".join(self.problems()))


@dataclass
class Routing:
    """What a forward pass tells its MoE layers: which tokens are real (`valid`, shaped as the tokens
    without their width; None: all) and where each layer leaves its `RouterStats`."""

    valid: torch.Tensor | None = None
    stats: list = field(default_factory=list)


@dataclass
class RouterStats:
    """One layer's routing over one forward pass."""

    aux_loss: torch.Tensor  # load balancing, with gradient
    z_loss: torch.Tensor  # router z-loss, with gradient
    load: torch.Tensor  # (E,) assignments routed to each expert (before capacity)
    dropped: torch.Tensor  # () assignments over capacity


@dataclass
class Dispatch:
    """Token-expert assignments grouped by expert. An assignment a is token a // K's (a % K)-th choice."""

    assignment: torch.Tensor  # (M,) kept assignments, sorted by expert (token order within one)
    counts: torch.Tensor  # (E,) kept assignments per expert
    load: torch.Tensor  # (E,) assignments routed per expert, before capacity


def route(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Router logits (N, E) -> softmax probabilities (N, E), top-k experts (N, K) and their weights (N, K),
    renormalised to sum to 1 (so K copies of one MLP give that MLP's output).

    >>> route(torch.tensor([[0.0, 1.0, 0.0]]), 1)[1:]
    (tensor([[1]]), tensor([[1.]]))
    """
    probs = logits.float().softmax(-1)
    top, experts = probs.topk(k, dim=-1)
    return probs, experts, top / top.sum(-1, keepdim=True)


def dispatch(experts: torch.Tensor, num_experts: int, capacity: int | None = None) -> Dispatch:
    """Top-k choices (N, K) -> assignments sorted by expert; with `capacity`, each expert keeps its first
    `capacity` in token order.

    >>> d = dispatch(torch.tensor([[1], [0], [1]]), 2, capacity=1)
    >>> d.assignment.tolist(), d.counts.tolist(), d.load.tolist()
    ([1, 0], [1, 1], [1, 2])
    """
    flat = experts.reshape(-1)
    order = torch.argsort(flat, stable=True)
    load = torch.bincount(flat, minlength=num_experts)
    if capacity is None:
        return Dispatch(order, load, load)
    rank = torch.arange(len(order), device=flat.device) - torch.repeat_interleave(load.cumsum(0) - load, load)
    return Dispatch(order[rank < capacity], load.clamp(max=capacity), load)


class GroupedExperts(nn.Module):
    """E GeGLU MLPs as stacked weights: gate_proj, up_proj (E, H, W), down_proj (E, W, H).

    A subclass stacks another MLP kind (SwiGLUExperts: Llama's; GR00T's diffusers FeedForward in
    models/groot/model.py). Each kind says which dense MLP one expert is: `dense` builds it (MoEMLP builds
    one for the dense model's draws, and expert 0 takes its weights) and `dense_keys` names which of its
    parameters each stack's slices are (upcycling reads them); every kind has `down_proj`."""

    dense_keys = {"gate_proj": "gate_proj.weight", "up_proj": "up_proj.weight", "down_proj": "down_proj.weight"}

    def __init__(self, n: int, width: int, hidden: int):
        super().__init__()
        for name, shape in self.shapes(width, hidden).items():  # registered (and initialised) in this order
            self.register_parameter(name, nn.Parameter(torch.empty(n, *shape)))

    @staticmethod
    def shapes(width: int, hidden: int) -> dict[str, tuple[int, ...]]:
        """One expert's slice of each stack."""
        return {"gate_proj": (hidden, width), "up_proj": (hidden, width), "down_proj": (width, hidden)}

    @staticmethod
    def dense(width: int, hidden: int) -> nn.Module:
        return GatedMLP(width, hidden)

    @staticmethod
    def activation(x: torch.Tensor) -> torch.Tensor:
        return F.gelu(x, approximate="tanh")

    def stacks(self) -> dict[str, torch.Tensor]:
        """Every stack as this rank holds it: all experts, or under expert parallelism (DTensor stacks) its
        local experts."""
        return {name: _local(p) for name, p in self.named_parameters(recurse=False)}

    def compute(self, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """Every expert on its rows: x (M, W) sorted by expert, `counts` rows per expert -> (M, W); expert e
        computes what the dense MLP with its slices would."""
        s = self.stacks()
        h = self.activation(grouped_linear(x, s["gate_proj"], counts)) * grouped_linear(x, s["up_proj"], counts)
        return grouped_linear(h, s["down_proj"], counts)

    def forward(self, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """`compute` as a module call, for hooks that wrap one (FSDP's gather of expert shards, the FP8
        report's capture of each layer's inputs)."""
        return self.compute(x, counts)

    def fan_in(self, name: str) -> int:
        """The inputs of the linear a stack's slices are (nn.Linear draws U(+-1 / sqrt(fan_in)))."""
        return getattr(self, name).shape[-1]

    def all_summed(self, x: torch.Tensor) -> torch.Tensor:
        """Every expert on every token, summed (the shared experts)."""
        n = len(self.down_proj)
        return self(x.repeat(n, 1), [len(x)] * n).view(n, *x.shape).sum(0)


class SwiGLUExperts(GroupedExperts):
    """E Llama / Qwen MLPs (models/layers.py SwiGLU): GroupedExperts' weights, SiLU in place of GELU."""

    @staticmethod
    def dense(width: int, hidden: int) -> nn.Module:
        return SwiGLU(width, hidden)

    @staticmethod
    def activation(x: torch.Tensor) -> torch.Tensor:
        return F.silu(x)


def _local(p: torch.Tensor) -> torch.Tensor:
    return p.to_local() if hasattr(p, "to_local") else p


def expert_compute(experts: GroupedExperts, x: torch.Tensor, plan: Dispatch, k: int) -> torch.Tensor:
    """Each expert on its assigned tokens: x (N, W) -> (M, W), one row per kept assignment, in `plan` order."""
    return experts(x[plan.assignment // k], plan.counts.tolist())


class _GroupedLinear(torch.autograd.Function):
    """`grouped_linear`'s forward and backward: one matmul per expert, each writing its block of the output
    and, in backward, its slice of the stacked weight's gradient in place. Autograd through per-expert slices
    instead (indexing or unbinding the stack) builds the stack's gradient from E pieces: a zero-filled
    stack per expert when indexed, a concatenation of E slices when unbound, either of them the size of all
    experts' weights per layer (on CPU, E=8 at width 1024, the concatenation alone took a third of a step)."""

    @staticmethod
    def forward(ctx, x, weight, bias, counts):
        out = x.new_empty(len(x), weight.shape[1])
        for e, (a, b) in enumerate(_bounds(counts)):
            if b > a:
                if bias is None:
                    torch.mm(x[a:b], weight[e].t(), out=out[a:b])
                else:
                    torch.addmm(bias[e], x[a:b], weight[e].t(), out=out[a:b])
        ctx.save_for_backward(x, weight)
        ctx.counts = counts
        return out

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        grad = grad.contiguous()
        gx = x.new_empty(x.shape) if need_x else None
        gw = weight.new_zeros(weight.shape) if need_w else None  # an expert without rows keeps 0
        gb = weight.new_zeros(weight.shape[:2]) if need_b else None
        for e, (a, b) in enumerate(_bounds(ctx.counts)):
            if b == a:
                continue
            if need_x:
                torch.mm(grad[a:b], weight[e], out=gx[a:b])
            if need_w:
                torch.mm(grad[a:b].t(), x[a:b], out=gw[e])
            if need_b:
                gb[e] = grad[a:b].sum(0)
        return gx, gw, gb, None


def _bounds(counts: list[int]) -> list[tuple[int, int]]:
    ends = list(itertools.accumulate(counts))
    return list(zip([0] + ends[:-1], ends))


def grouped_linear(x: torch.Tensor, weight: torch.Tensor, counts: list[int],
                   bias: torch.Tensor | None = None) -> torch.Tensor:
    """Rows x (M, in) grouped by expert (`counts` rows each) times each expert's slice of `weight` (E, out, in),
    plus its `bias` (E, out) -> (M, out): F.linear per expert, as one autograd node whose gradient is the
    stack's (`_GroupedLinear`). Under autocast the operands are cast to its dtype first, as F.linear's are.

    >>> w = torch.stack([torch.eye(2), 2 * torch.eye(2)])
    >>> grouped_linear(torch.ones(3, 2), w, [1, 2]).tolist()
    [[1.0, 1.0], [2.0, 2.0], [2.0, 2.0]]
    """
    device = x.device.type
    if torch.is_autocast_enabled(device):
        dtype = torch.get_autocast_dtype(device)
        x, weight = x.to(dtype), weight.to(dtype)
        bias = bias.to(dtype) if bias is not None else None
        with torch.autocast(device, enabled=False):
            return _GroupedLinear.apply(x, weight, bias, counts)
    return _GroupedLinear.apply(x, weight, bias, counts)


def combine(y: torch.Tensor, weights: torch.Tensor, plan: Dispatch, n: int, k: int) -> torch.Tensor:
    """Expert outputs (M, W) weighted by their router weights (N, K), summed per token -> (N, W)."""
    w = weights.reshape(-1)[plan.assignment].to(y.dtype)
    return y.new_zeros(n, y.shape[-1]).index_add_(0, plan.assignment // k, y * w[:, None])


def router_losses(logits: torch.Tensor, probs: torch.Tensor, load: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(load balancing, z-loss) over N tokens: E * sum_e (load_e / (N K)) * mean_n probs_ne, and
    mean_n logsumexp(logits_n)^2. Zero tokens: both 0."""
    if len(logits) == 0:
        zero = logits.sum()
        return zero, zero
    share = load.float() / load.sum()
    aux = probs.shape[-1] * (share * probs.mean(0)).sum()
    return aux, torch.logsumexp(logits.float(), dim=-1).pow(2).mean()


def _uniform(shape, fan_in: int, generator: torch.Generator) -> torch.Tensor:
    """nn.Linear's default initialisation (kaiming uniform, a = sqrt 5): U(-1/sqrt(fan_in), 1/sqrt(fan_in))."""
    bound = 1.0 / math.sqrt(fan_in)
    return torch.empty(shape, device="cpu").uniform_(-bound, bound, generator=generator)


class Router(nn.Module):
    """Linear router, float32 logits (autocast off: under bf16 autocast F.linear would round them to bf16
    before the top-k and the z-loss)."""

    def __init__(self, width: int, experts: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(experts, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.autocast(x.device.type, enabled=False):
            return F.linear(x.float(), self.weight.float())


class MoEMLP(nn.Module):
    """Routed experts (+ shared ones) in place of a dense MLP(width, hidden): a GatedMLP, or the kind
    `experts` (n, width, hidden) -> GroupedExperts stacks; see the module docstring."""

    def __init__(self, width: int, hidden: int, cfg: MoEConfig, layer: int = 0,
                 experts: Callable[[int, int, int], GroupedExperts] = GroupedExperts):
        super().__init__()
        self.cfg = cfg
        h = cfg.expert_dim or hidden
        self.router = Router(width, cfg.num_experts)
        self.experts = experts(cfg.num_experts, width, h)
        self.shared = experts(cfg.shared_experts, width, h) if cfg.shared_experts else None
        self.exchange = None  # expert parallelism's dispatch and combine (train/expert_parallel.py); None: local
        dense = self.experts.dense(width, hidden)  # the dense model's draws from the global generator, in its order
        self.init_seed = (torch.initial_seed() * 1_000_003 + 7919 * (layer + 1)) % 2**63
        if self.router.weight.is_meta:
            return
        with torch.no_grad():
            self.reset_router()
            own = torch.Generator().manual_seed(self.init_seed + 1)
            for group in (self.experts, self.shared) if self.shared else (self.experts,):
                for name, p in group.named_parameters():
                    p.copy_(_uniform(p.shape, group.fan_in(name), own))
            if h == hidden:
                for name, key in self.experts.dense_keys.items():
                    getattr(self.experts, name)[0].copy_(dense.get_parameter(key))

    @torch.no_grad()
    def reset_router(self) -> None:
        """The router's own initialisation (also after upcycling, where the dense checkpoint has none)."""
        w = self.router.weight
        w.copy_(_uniform(w.shape, w.shape[-1], torch.Generator().manual_seed(self.init_seed)))

    def capacity(self, tokens: int) -> int | None:
        """Assignments an expert keeps in a training forward pass of `tokens`; None: all (dropless, and always
        outside training, so an action never depends on the other requests in its batch)."""
        c = self.cfg.capacity_factor
        if c == 0 or not self.training:
            return None
        return math.ceil(c * tokens * self.cfg.top_k / self.cfg.num_experts)

    def forward(self, x: torch.Tensor, routing: Routing | None = None) -> torch.Tensor:
        """x (..., W) -> (..., W); tokens `routing.valid` leaves out get 0 (never routed, never counted)."""
        cfg, width = self.cfg, x.shape[-1]
        flat = x.reshape(-1, width)
        valid = routing.valid.reshape(-1) if routing is not None and routing.valid is not None else None
        tokens = flat if valid is None else flat[valid]
        logits = self.router(tokens)  # (N, E) float32
        probs, experts, weights = route(logits, cfg.top_k)
        plan = dispatch(experts, cfg.num_experts, self.capacity(len(tokens)))
        compute = expert_compute if self.exchange is None else self.exchange
        out = combine(compute(self.experts, tokens, plan, cfg.top_k), weights, plan, len(tokens), cfg.top_k)
        if self.shared is not None:
            out = out + self.shared.all_summed(tokens)
        if routing is not None:
            aux, z = router_losses(logits, probs, plan.load)
            routing.stats.append(RouterStats(aux, z, plan.load.detach(), (plan.load - plan.counts).sum().detach()))
        if valid is not None:
            out = flat.new_zeros(flat.shape).index_copy_(0, valid.nonzero(as_tuple=True)[0], out.to(flat.dtype))
        return out.reshape(x.shape)


def moe_outputs(stats: list[RouterStats], cfg: MoEConfig, layers: int | None = None) -> dict[str, torch.Tensor]:
    """The layers' routing over one forward pass, for the loss dict: `moe_aux_loss` and `moe_z_loss` (means
    over layers, with gradient), `moe_regularizer` (their weighted sum, what training adds), `moe_load` (E,)
    assignments per expert and `moe_dropped` / `moe_assignments` (counts), summed over layers. `layers`: the
    model's MoE layers, where `stats` holds one pipeline stage's share of them: the losses are then that
    stage's part of the model's means (summed over its layers, divided by all of them)."""
    n = layers or len(stats)
    aux = torch.stack([s.aux_loss for s in stats]).sum() / n
    z = torch.stack([s.z_loss for s in stats]).sum() / n
    load = torch.stack([s.load for s in stats]).sum(0)
    return {"moe_aux_loss": aux, "moe_z_loss": z, "moe_regularizer": cfg.aux_loss_coef * aux + cfg.z_loss_coef * z,
            "moe_load": load, "moe_dropped": torch.stack([s.dropped for s in stats]).sum(), "moe_assignments": load.sum()}


def training_loss(out: dict[str, torch.Tensor]) -> torch.Tensor:
    """What a row backpropagates before the trainer's scaling: its samples' summed flow-matching losses,
    plus (with MoE) the routing regularizer once per sample, so a step's regularizer is the
    sample-weighted mean of its rows'."""
    per_sample = out["per_sample"]
    if "moe_regularizer" not in out:
        return per_sample.sum()
    return per_sample.sum() + out["moe_regularizer"].to(per_sample.dtype) * len(per_sample)


@dataclass
class MoEMeter:
    """A step's routing figures summed over its rows, for metrics.jsonl: `moe/aux_loss`, `moe/z_loss`
    (sample-weighted means), `moe/dropped_fraction` and `moe/load` (each expert's share of the assignments)."""

    samples: float = 0.0
    aux: float = 0.0
    z: float = 0.0
    dropped: float = 0.0
    assignments: float = 0.0
    load: list[float] = field(default_factory=list)

    def add(self, out: dict, samples: int) -> None:
        """A forward pass's routing (`out`: its loss dict, or a pipeline stage's share) over `samples` samples."""
        if "moe_load" not in out:
            return
        n = float(samples)
        self.samples += n
        self.aux += n * float(out["moe_aux_loss"].detach())
        self.z += n * float(out["moe_z_loss"].detach())
        self.dropped += float(out["moe_dropped"])
        self.assignments += float(out["moe_assignments"])
        load = out["moe_load"].tolist()
        self.load = [a + b for a, b in zip(self.load, load)] if self.load else [float(v) for v in load]

    def record(self, total=lambda v: v, samples=None) -> dict:
        """The metrics, every figure first summed over ranks by `total(float) -> float` (the sample count by
        `samples`, default `total`: pipeline stages each count a row's samples once, and sum their layers'
        figures); {} without MoE. Every rank calls it alike (its collectives), whether or not its rows had
        routed tokens."""
        if not self.load:
            return {}
        samples, assignments = (samples or total)(self.samples), total(self.assignments)
        load = [total(v) for v in self.load]
        return {"moe/aux_loss": total(self.aux) / max(samples, 1), "moe/z_loss": total(self.z) / max(samples, 1),
                "moe/dropped_fraction": total(self.dropped) / max(assignments, 1),
                "moe/load": [v / max(sum(load), 1) for v in load]}


def upcycle_sources(model: nn.Module, mapping: dict[str, str]) -> tuple[dict[str, tuple[str, int]], list[str]]:
    """Sparse upcycling from a dense checkpoint: for each MoE layer whose experts and router `mapping` (model key
    -> stored key) lacks but whose dense MLP (its kind's `dense_keys`: ``<layer>.{gate,up,down}_proj.weight``
    for a GatedMLP, ``<layer>.net.{0.proj,2}.{weight,bias}`` for GR00T's feed-forward) it holds, every
    routed and shared expert starts as that MLP. Returns {expert stack key: (dense model key, experts)} and
    the MoE layers (module names) whose router starts from its own initialisation (`MoEMLP.reset_router`).

        mapping has "...layers.0.mlp.gate_proj.weight", model has "...layers.0.mlp.experts.gate_proj" (4, H, W)
        -> {"...layers.0.mlp.experts.gate_proj": ("...layers.0.mlp.gate_proj.weight", 4), ...}, ["...layers.0.mlp"]
    """
    sources, fresh = {}, []
    for name, m in model.named_modules():
        if not isinstance(m, MoEMLP):
            continue
        stacks = [("experts", m.experts)] + ([("shared", m.shared)] if m.shared is not None else [])
        wanted = {f"{name}.{group}.{p}": (f"{name}.{key}", len(experts.down_proj))
                  for group, experts in stacks for p, key in experts.dense_keys.items()}
        if (f"{name}.router.weight" not in mapping and not any(k in mapping for k in wanted)
                and all(dense in mapping for dense, _ in wanted.values())):
            sources.update(wanted)
            fresh.append(name)
    return sources, fresh
