"""How GR00T N1.7 is split for parallel training: FSDP units only. Tensor and pipeline parallelism are
refused for now: N1.5's plans split the DiT, but N1.7's cross-attention views (image / non-image
tokens per block) and its backbone have not been run under them."""

from __future__ import annotations

from torch import nn

from kilovla.errors import KilovlaError


def fsdp_units(model) -> list[list[nn.Module]]:
    """ViT blocks, the patch merger and each DeepStack merger (at the 3B, 4 x 25M parameters the root would
    otherwise hold whole), Qwen layers, VL self-attention blocks, DiT blocks: one unit each."""
    head, visual = model.action_head, model.qwen.visual
    blocks = [*visual.blocks, visual.merger, *visual.deepstack_merger_list, *model.qwen.language_model.layers,
              *head.vl_self_attention.transformer_blocks, *head.model.transformer_blocks]
    return [[b] for b in blocks]


def refuse(kind: str):
    def refused(*args, **kwargs):
        raise KilovlaError(f"GR00T N1.7 has no {kind} plan yet: train it with parallel.tp=1 and parallel.pp=1 "
                           "(DDP or FSDP)")
    return refused


tp_layers = tp_split = tp_parts = refuse("tensor-parallel")
pp_depth = keep_stage = refuse("pipeline-parallel")
