"""The GR00T N1.5 `Family` (models/family.py): what generic code asks about these models."""

from __future__ import annotations

import re

from kilovla.models.family import Family, KeyMap, ModelSettings
from kilovla.models.groot import parallelize
from kilovla.models.groot.model import GrootConfig, GrootModel, flow_time
from kilovla.models.groot.presets import PRESETS, RECIPES

_DIT = r"action_head\.model\.transformer_blocks\.\d+\.(attn1\.(to_q|to_k|to_v|to_out\.0)|ff\.net\.(0\.proj|2))"
_LLM = r"backbone\.eagle_model\.language_model\.model\.layers\.\d+\.self_attn\.[qkvo]_proj"
_VISION = r"backbone\.eagle_model\.vision_model\.vision_model\.encoder\.layers\.\d+\." \
          r"(self_attn\.(q|k|v|out)_proj|mlp\.fc[12])"
# FP8's default: the LLM layers' attention and MLP, and the DiT's. The vision tower, AdaLayerNorm,
# projectors, per-embodiment encoders and the VL self-attention stay as they are.
_FP8 = (r"^(backbone\.eagle_model\.language_model\.model\.layers\.\d+"
        r"\.(self_attn\.[qkvo]_proj|mlp\.(gate|up|down)_proj)"
        r"|action_head\.model\.transformer_blocks\.\d+\.(attn1\.(to_[qkv]|to_out\.0)|ff\.net\.(0\.proj|2)))$")


def lora_targets(vision: bool, llm: bool) -> str:
    """The DiT's attention and feed-forward linears; `llm`: the Eagle LLM's q/k/v/o too."""
    parts = [_DIT] + ([_LLM] if llm else []) + ([_VISION] if vision else [])
    return "|".join(f"({p})" for p in parts)


def overrides(cfg: GrootConfig, s: ModelSettings) -> dict:
    """`s` as GrootConfig overrides: named as ModelSettings.as_overrides names them, the chunk as `action_horizon`."""
    return s.as_overrides(cfg, "action_horizon")


def freeze_groups(model) -> dict:
    return {"vision": [model.eagle.vision_model, model.eagle.mlp1], "vlm": [model.backbone]}

# What a GR00T config (N1.5's and N1.7's, which name these fields alike) says of its shapes
CONFIG_SHAPES = dict(chunk_length=lambda cfg: cfg.action_horizon, camera_tokens=lambda cfg: cfg.vision.tokens,
                     action_tokens=lambda cfg: cfg.action_head_tokens, vocab_size=lambda cfg: cfg.llm.vocab_size,
                     image_token_id=lambda cfg: cfg.image_token_id, pooled_width=lambda cfg: cfg.llm.width)


FAMILY = Family(
    name="groot", title="GR00T", config_class=GrootConfig, model_class=GrootModel, presets=PRESETS, recipes=RECIPES,
    overrides=overrides, **CONFIG_SHAPES,
    flow_time=flow_time,
    freeze_groups=freeze_groups, gradient_checkpointing=False,
    fsdp_units=parallelize.fsdp_units, tp_layers=parallelize.tp_layers, tp_split=parallelize.tp_split,
    tp_parts=parallelize.tp_parts,
    pp_depth=parallelize.pp_depth, keep_stage=parallelize.keep_stage,
    lora_targets=lora_targets,
    fp8_layers=_FP8,
    vision_tower=r"^backbone\.eagle_model\.vision_model\.",
    checkpoint_names=("groot",),
    checkpoint_name=lambda cfg: "groot",
    keys=KeyMap(embed="backbone.eagle_model.language_model.model.embed_tokens.weight",
                tied="backbone.eagle_model.language_model.lm_head.weight",
                unused=re.compile(r"backbone\.eagle_model\.vision_model\.vision_model\.head\."),
                rename=lambda key, name: key, own_prefixes=("backbone.eagle_model.", "action_head."),
                layouts=("groot", "lerobot-groot"), native_layout="groot"),
    moe=lambda cfg: cfg.moe, image_prompt="eagle",
)
