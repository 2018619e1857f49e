"""How GR00T N1.5 is split for parallel training (read by train/distributed.py, tensor_parallel.py and
pipeline.py through the family): FSDP units, tensor-parallel blocks, pipeline stages.

Tensor and pipeline parallelism split the DiT's blocks; the backbone stays whole on the first
stage (frozen in N1.5's recipe, so forward only): the stages split the trained part evenly, not
the memory."""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

from kilovla.models.family import TPSplit
from kilovla.models.moe import MoEMLP


def fsdp_units(model) -> list[list[nn.Module]]:
    """ViT blocks, Qwen layers, VL self-attention blocks, DiT blocks: one unit each."""
    head = model.action_head
    blocks = [*model.eagle.vision_model.vision_model.encoder.layers, *model.eagle.language_model.model.layers,
              *head.vl_self_attention.transformer_blocks, *head.model.transformer_blocks]
    return [[b] for b in blocks]


def tp_layers(model) -> list[tuple[nn.Module, int]]:
    """The DiT's blocks; their key / value heads are their query heads."""
    return [(block, model.config.dit.heads) for block in model.action_head.model.transformer_blocks]


def tp_split(block) -> TPSplit:
    """diffusers' names; an MoE feed-forward stays whole (train/tensor_parallel.py)."""
    a = block.attn1
    column, row = ((), ()) if isinstance(block.ff, MoEMLP) else ((block.ff.net[0].proj,), (block.ff.net[2],))
    return TPSplit(column=(a.to_q, *column), kv=(a.to_k, a.to_v), row=(a.to_out[0], *row))


def tp_parts(cfg) -> dict[str, tuple[int, int, int]]:
    d = cfg.dit
    return {"DiT": (d.heads, d.heads, 4 * d.width)}


def pp_depth(cfg) -> int:
    """The DiT's blocks."""
    return cfg.dit.depth


def keep_stage(model, own: range, stage: int, pp: int, dropped: Callable[[], nn.Module]) -> list[str]:
    """Replace what the stage does not run by `dropped()`; the timestep encoder runs on every stage:
    its parameter names are returned."""
    head = model.action_head
    blocks = head.model.transformer_blocks
    for i in range(len(blocks)):
        if i not in own:
            blocks[i] = dropped()
    if stage > 0:  # the backbone, the VL self-attention and the DiT's input encoders run on the first stage
        model.backbone = dropped()
        for name in ("vlln", "vl_self_attention", "state_encoder", "action_encoder", "future_tokens",
                     "position_embedding"):
            setattr(head, name, dropped())
    if stage < pp - 1:  # the output projections and the decoder on the last
        head.model.proj_out_1, head.model.proj_out_2, head.action_decoder = dropped(), dropped(), dropped()
    return [n for n, _ in model.named_parameters() if n.startswith("action_head.model.timestep_encoder.")]
