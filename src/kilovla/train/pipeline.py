"""Pipeline parallelism: the decoder layers split into stages over the mesh's "pp" dimension, run
with a 1F1B schedule whose micro-batches are a replica's packed rows of the step.

    pi0 / pi0.5 (the paired LM / expert layers; two streams travel, prefix and suffix):
        stage 0:    ViT, projector, token embeddings, suffix embedding, layers [0, d/pp)
        stage s:    layers [s*d/pp, (s+1)*d/pp)
        last stage: ..., the expert's final norm, action_out_proj, the loss
    GR00T N1.5 (the DiT's blocks; the VL features travel beside the DiT tokens, as every other
    block cross-attends to them):
        stage 0:    the Eagle backbone, the VL self-attention, the state / action encoders, blocks [0, d/pp)
        stage s:    blocks [s*d/pp, (s+1)*d/pp)
        last stage: ..., the output projections, the action decoder, the loss
    The backbone stays on stage 0 whole (frozen in N1.5's recipe, so forward only): GR00T's stages
    split the trained part evenly, not the memory.

`keep_stage(model, stage, pp)` drops from a rank's model what its stage does not run (state-dict
keys and all; the family's `keep_stage`, models/<family>/parallelize.py, names what), so a stage
holds 1/pp of the layers. What every stage runs itself is kept on every
stage and stays identical: pi0.5's time MLP (its adaRMS condition enters every expert layer) and
GR00T's timestep encoder, whose gradients are summed over the stages (`sum_shared_gradients`)
before the optimizer step.

Shapes: packed rows differ in length from step to step, but every stage of a replica reads the
same rows, so each stage computes the shapes of what it receives from the row itself
(`Pi05Model.forward_stage`'s `receive`); only the hidden states travel, as float32, never a shape.
A step with fewer rows than stages runs as well, with a longer bubble (1F1B's warm-up is
min(pp - stage - 1, rows)).

An MoE's routing losses are a mean over all its layers; each stage adds its own layers' share
(`moe_outputs(..., layers=)`): the last stage to its loss, a stage before it to the hidden states it
sends (`carry_loss`), so that share's gradient runs when theirs comes back.

`Schedule` runs one step's rows on one rank: warm-up forwards, then one forward and one backward in
turn, then the remaining backwards. A send is held back until the rank next receives, and goes out
with that receive in one `batch_isend_irecv` (Megatron's send-forward-receive-backward): in the
steady state neighbouring stages send to each other at the same time, which on NCCL (one stream per
pair, sends that wait for their receive) would deadlock as two separate calls; on gloo too, each
direction between two ranks carries one kind of message, in order.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

from kilovla.errors import KilovlaError
from kilovla.models.family import family_of


def depth(model_cfg) -> int:
    """The layers pipeline stages split (the family's `pp_depth`): pi0's paired LM / expert layers,
    GR00T's DiT blocks."""
    return family_of(model_cfg).pp_depth(model_cfg)


def stage_layers(model_cfg, pp: int, stage: int) -> range:
    per = depth(model_cfg) // pp
    return range(stage * per, (stage + 1) * per)


def pp_problems(model_cfg, pp: int) -> list[str]:
    """What keeps a model config from `pp` stages, from the config alone (checked before any work)."""
    if depth(model_cfg) % pp:
        return [f"parallel.pp={pp} does not divide the model's {depth(model_cfg)} layers"]
    return []


class _CarryLoss(torch.autograd.Function):
    """Identity on `x`; in backward `loss` also gets gradient 1 (see `carry_loss`)."""

    @staticmethod
    def forward(ctx, x, loss):
        ctx.loss = (loss.dtype, loss.device)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        dtype, device = ctx.loss
        return grad, torch.ones((), dtype=dtype, device=device)


def carry_loss(x: torch.Tensor, loss: torch.Tensor) -> torch.Tensor:
    """`x`, with `loss` (a scalar) backpropagated when x's gradient arrives: how a stage before the last
    trains on a loss of its own layers (an MoE's routing losses), with the hidden states it sends, as
    Megatron's MoEAuxLossAutoScaler does."""
    return _CarryLoss.apply(x, loss)


class _Dropped(nn.Module):
    """Where a module of another stage was: no parameters, and an error if anything runs it."""

    def forward(self, *args, **kwargs):
        raise KilovlaError("a pipeline stage ran a module of another stage")


def keep_stage(model: nn.Module, stage: int, pp: int) -> list[str]:
    """Drop what `stage` of `pp` does not run from the model, in place (the family's `keep_stage`);
    returns the names of the parameters every stage keeps (their gradients are summed over the stages)."""
    shared = family_of(model).keep_stage(model, stage_layers(model.config, pp, stage), stage, pp, _Dropped)
    model.pipeline_stage = (stage, pp)
    return shared


def sum_shared_gradients(shared: list[torch.Tensor], world) -> None:
    """The gradient of a parameter every stage keeps (`shared`) is the sum of the stages' parts."""
    from kilovla.train.distributed import all_reduce_flat

    grads = [p.grad for p in shared if p.grad is not None]
    if grads:
        all_reduce_flat(grads, world.group("pp"))


class Schedule:
    """1F1B over one step's rows on one rank of the ("pp", "dp", "tp") mesh (see the module docstring).

    `forward(i, receive)` runs row i's share of the model on this stage (`receive` is None on the
    first stage) and returns the loss to backpropagate on the last stage, else the hidden states to
    send on."""

    def __init__(self, world):
        self.world = world
        self.stage, self.pp = world.pp_rank, world.pp
        step = world.size // world.pp  # ranks of one stage: the same (dp, tp) place one stage on
        self.prev = world.rank - step if self.stage > 0 else None
        self.next = world.rank + step if self.stage < self.pp - 1 else None

    def run(self, rows: int, forward: Callable) -> None:
        self._pending, self._inflight, self._saved = [], [], {}
        warmup = min(self.pp - self.stage - 1, rows)
        for i in range(warmup):
            self._forward(i, forward)
        for i in range(rows - warmup):
            self._forward(warmup + i, forward)
            self._backward(i)
        for i in range(rows - warmup, rows):
            self._backward(i)
        self._exchange()  # what is still held back
        for handle, _ in self._inflight:
            handle.wait()
        self._pending, self._inflight, self._saved = [], [], {}

    def _send(self, tensors, dst: int) -> None:
        self._pending += [(t.detach().to(torch.float32).contiguous(), dst) for t in tensors]

    def _exchange(self, like: torch.Tensor | None = None, src: int | None = None) -> torch.Tensor | None:
        """The held-back sends and (given `like`) one receive from `src`, as one batch; waits for the
        receive only (a sent tensor stays referenced until the step's end)."""
        ops = [dist.P2POp(dist.isend, t, dst) for t, dst in self._pending]
        buf = None
        if like is not None:
            buf = torch.empty(like.shape, dtype=torch.float32, device=like.device)
            ops.append(dist.P2POp(dist.irecv, buf, src))
        if not ops:
            return None
        handles = dist.batch_isend_irecv(ops)
        self._inflight += list(zip(handles[: len(self._pending)], self._pending))
        self._pending = []
        if buf is not None:
            handles[-1].wait()
        return buf

    def _forward(self, i: int, forward: Callable) -> None:
        inputs = []

        def receive(*templates):
            for tmpl in templates:
                t = self._exchange(tmpl, self.prev)
                inputs.append(t.to(tmpl.dtype).detach().requires_grad_())
            return tuple(inputs)

        out = forward(i, receive if self.prev is not None else None)
        if self.next is not None:
            self._send(out, self.next)
        self._saved[i] = (inputs, out)

    def _backward(self, i: int) -> None:
        inputs, out = self._saved.pop(i)
        if self.next is None:  # the last stage: `out` is the row's scaled loss
            out.backward()
        else:
            grads = [self._exchange(t, self.next).to(t.dtype) for t in out]
            pairs = [(t, g) for t, g in zip(out, grads) if t.requires_grad]
            if pairs:
                torch.autograd.backward([t for t, _ in pairs], [g for _, g in pairs])
        if self.prev is not None:
            self._send([t.grad if t.grad is not None else torch.zeros_like(t) for t in inputs], self.prev)
