"""The denoising loop as CUDA graphs, one per batch shape: what `kilovla serve` runs on a GPU.

A chunk of pi0.5 at batch 1 is ~100 small kernels per denoising step; launching them costs more than
computing them (benchmarks/gpu_fp8_probe.py: 273 ms eager vs 83.8 ms graphed at pi05-3b). The first
batch of a shape (batch size, language length) is captured after warm-up runs on a side stream into
static input tensors; later batches of that shape copy their inputs in and replay. At most
`max_graphs` shapes are kept (least recently used first out). A capture that fails says why once and
that shape runs eagerly from then on. Off CUDA nothing is captured: `GraphedSampler` is the eager call.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import fields, replace

import torch

from kilovla.models.batch import PaddedBatch

log = logging.getLogger(__name__)


class GraphedSampler:
    def __init__(self, model, device: torch.device, enabled: bool = True, max_graphs: int = 16):
        self.model, self.device = model, torch.device(device)
        self.enabled = enabled and self.device.type == "cuda"
        self.max_graphs = max_graphs
        self._graphs: OrderedDict[tuple, tuple] = OrderedDict()
        self._eager_shapes: set[tuple] = set()

    @staticmethod
    def _key(batch: PaddedBatch, noise: torch.Tensor) -> tuple:
        return tuple((f.name, tuple(getattr(batch, f.name).shape)) for f in fields(batch)
                     if isinstance(getattr(batch, f.name), torch.Tensor)) + (("noise", tuple(noise.shape)),)

    def __call__(self, batch: PaddedBatch, noise: torch.Tensor) -> torch.Tensor:
        key = self._key(batch, noise)
        if not self.enabled or key in self._eager_shapes:
            return self.model.sample_actions(batch, noise=noise)
        if key not in self._graphs:
            try:
                self._graphs[key] = self._capture(batch, noise)
            except RuntimeError as e:  # e.g. an op that cannot be captured: run this shape eagerly, loudly
                log.warning("CUDA graph capture failed for batch shape %s (%s); running it eagerly", key, e)
                self._eager_shapes.add(key)
                return self.model.sample_actions(batch, noise=noise)
            while len(self._graphs) > self.max_graphs:
                self._graphs.popitem(last=False)
        self._graphs.move_to_end(key)
        graph, static_batch, static_noise, out = self._graphs[key]
        for f in fields(batch):
            value = getattr(batch, f.name)
            if isinstance(value, torch.Tensor):
                getattr(static_batch, f.name).copy_(value)
        static_noise.copy_(noise)
        graph.replay()
        return out.clone()

    def _capture(self, batch: PaddedBatch, noise: torch.Tensor):
        static_batch = replace(batch, **{f.name: getattr(batch, f.name).clone() for f in fields(batch)
                                         if isinstance(getattr(batch, f.name), torch.Tensor)})
        static_noise = noise.clone()
        run = lambda: self.model.sample_actions(static_batch, noise=static_noise)  # noqa: E731
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(3):
                run()
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = run()
        return graph, static_batch, static_noise, out
