"""How SmolVLA is split for parallel training: FSDP units only. Tensor and pipeline parallelism are
refused: a cross-attention layer's expert re-projects the VLM layer's whole keys and values, which a
head-sharded VLM layer does not hold, and no plan splits that yet."""

from __future__ import annotations

from torch import nn

from kilovla.errors import KilovlaError


def fsdp_units(model) -> list[list[nn.Module]]:
    """ViT blocks, then each VLM / expert layer pair (one forward call: the expert runs inside the VLM layer's)."""
    vit = model.vlm.vision_model.encoder.layers
    return [[b] for b in vit] + [[lm, ex] for lm, ex in zip(model.text.layers, model.expert.layers)]


def refuse(kind: str):
    def refused(*args, **kwargs):
        raise KilovlaError(f"SmolVLA has no {kind} plan: train it with parallel.tp=1 and parallel.pp=1 (DDP or FSDP)")
    return refused


tp_layers = tp_split = tp_parts = refuse("tensor-parallel")
pp_depth = keep_stage = refuse("pipeline-parallel")
