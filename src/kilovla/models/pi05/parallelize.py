"""How pi0 / pi0.5 is split for parallel training (read by train/distributed.py, tensor_parallel.py and
pipeline.py through the family): FSDP units, tensor-parallel layers, pipeline stages.

The LM layer and the action-expert layer of one depth attend together (the expert layer runs inside
the LM layer's attention call), so they are one FSDP unit and one pipeline layer."""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

from kilovla.models.family import TPSplit
from kilovla.models.moe import MoEMLP


def fsdp_units(model) -> list[list[nn.Module]]:
    """ViT blocks, then each paired LM / expert layer (one forward call)."""
    vit = model.vlm.vision_tower.vision_model.encoder.layers
    pairs = zip(model.vlm.language_model.layers, model.expert.layers)
    return [[b] for b in vit] + [[lm, expert] for lm, expert in pairs]


def tp_layers(model) -> list[tuple[nn.Module, int]]:
    """Every LM and action-expert decoder layer, with its key / value heads."""
    c = model.config
    return ([(layer, c.lm.kv_heads) for layer in model.vlm.language_model.layers]
            + [(layer, c.expert.kv_heads) for layer in model.expert.layers])


def tp_split(layer) -> TPSplit:
    """Attention and the MLP; an MoE MLP stays whole (train/tensor_parallel.py)."""
    a, m = layer.self_attn, layer.mlp
    column, row = ((), ()) if isinstance(m, MoEMLP) else ((m.gate_proj, m.up_proj), (m.down_proj,))
    return TPSplit(column=(a.q_proj, *column), kv=(a.k_proj, a.v_proj), row=(a.o_proj, *row))


def tp_parts(cfg) -> dict[str, tuple[int, int, int]]:
    return {"language model": (cfg.lm.heads, cfg.lm.kv_heads, cfg.lm.mlp_dim),
            "action expert": (cfg.expert.heads, cfg.expert.kv_heads, cfg.expert.mlp_dim)}


def pp_depth(cfg) -> int:
    """The paired LM / expert layers."""
    return cfg.lm.depth


def keep_stage(model, own: range, stage: int, pp: int, dropped: Callable[[], nn.Module]) -> list[str]:
    """Replace what the stage does not run by `dropped()`; the time MLP (whose adaRMS condition enters
    every expert layer) runs on every stage: its parameter names are returned."""
    for layers in (model.vlm.language_model.layers, model.expert.layers):
        for i in range(len(layers)):
            if i not in own:
                layers[i] = dropped()
    if stage > 0:  # the embeddings run on the first stage only
        vlm = model.vlm
        vlm.vision_tower, vlm.multi_modal_projector = dropped(), dropped()
        if hasattr(vlm.language_model, "embed_tokens"):
            vlm.language_model.embed_tokens = dropped()
        for name in ("action_in_proj", "state_proj", "action_time_mlp_in", "action_time_mlp_out"):
            if hasattr(model, name):
                setattr(model, name, dropped())
    if stage < pp - 1:  # the head runs on the last stage only
        model.expert.norm, model.action_out_proj = dropped(), dropped()
        model.vlm.language_model.norm = dropped()
    return [n for n, _ in model.named_parameters() if n.startswith(("time_mlp_in.", "time_mlp_out."))]
