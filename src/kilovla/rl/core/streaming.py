"""`StreamingStep`: train micro-batches as they arrive, step the optimizer once per global batch.

Each micro-batch's loss is a *sum* over its samples, scaled by 1 / global_batch before backward, so
the gradient accumulated over any split of a global batch into micro-batches (any sizes, any
order) is the full-batch mean gradient. Only the micro-batch that completes the global batch
reduces gradients across learner ranks (`sync`), then the optimizer steps once.

    stream = StreamingStep(optimizer, global_batch=256, clip_grad_norm=1.0, params=trainable)
    for micro in arriving_batches:
        with gradient_sync(model, sync=stream.completes(len(micro))):
            stats = stream.backward(loss_sum(micro), len(micro))   # steps when the batch is full
"""

from __future__ import annotations

import torch

from kilovla.errors import KilovlaError
from kilovla.train.optim import clip_gradients


class StreamingStep:
    def __init__(self, optimizer: torch.optim.Optimizer, global_batch: int, params: list[torch.Tensor],
                 clip_grad_norm: float = 0.0, scheduler=None):
        if global_batch < 1:
            raise KilovlaError(f"global_batch must be >= 1, got {global_batch}")
        self.optimizer, self.global_batch, self.params = optimizer, global_batch, params
        self.clip_grad_norm, self.scheduler = clip_grad_norm, scheduler
        self.seen = 0  # samples accumulated towards the current global batch
        self.steps = 0

    def completes(self, n: int) -> bool:
        """Would a micro-batch of n samples complete the global batch?"""
        if self.seen + n > self.global_batch:
            raise KilovlaError(f"a micro-batch of {n} overruns the global batch ({self.seen} of {self.global_batch} seen)")
        return self.seen + n == self.global_batch

    def backward(self, loss_sum: torch.Tensor, n: int) -> dict | None:
        """Accumulate d(loss_sum / global_batch); on the batch's last micro-batch, clip and step.
        Returns {"grad_norm": ...} when the optimizer stepped, else None."""
        last = self.completes(n)
        (loss_sum / self.global_batch).backward()
        self.seen += n
        if not last:
            return None
        norm = clip_gradients(self.params, self.clip_grad_norm)
        self.optimizer.step()
        if self.scheduler is not None:
            self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.seen, self.steps = 0, self.steps + 1
        return {"grad_norm": norm}
