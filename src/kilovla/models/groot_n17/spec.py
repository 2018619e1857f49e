"""The GR00T N1.7 `Family` (models/family.py): what generic code asks about these models."""

from __future__ import annotations

from kilovla.models.family import Family, KeyMap, ModelSettings
from kilovla.models.groot.spec import CONFIG_SHAPES
from kilovla.models.groot_n17 import parallelize
from kilovla.models.groot_n17.model import GrootN17Config, GrootN17Model, flow_time
from kilovla.models.groot_n17.presets import PRESETS, RECIPES

_DIT = r"action_head\.model\.transformer_blocks\.\d+\.(attn1\.(to_q|to_k|to_v|to_out\.0)|ff\.net\.(0\.proj|2))"
_LLM_LAYERS = r"backbone\.model\.model\.language_model\.layers\.\d+"
_VISION = r"backbone\.model\.model\.visual\.blocks\.\d+\.(attn\.(qkv|proj)|mlp\.linear_fc[12])"
# FP8's default: the LLM layers' attention and MLP, and the DiT's; the vision tower, AdaLayerNorm,
# projectors, per-embodiment encoders and the VL self-attention stay as they are.
_FP8 = rf"^({_LLM_LAYERS}\.(self_attn\.[qkvo]_proj|mlp\.(gate|up|down)_proj)|{_DIT})$"


def lora_targets(vision: bool, llm: bool) -> str:
    """The DiT's attention and feed-forward linears; `llm`: the LLM's q/k/v/o too; `vision`: the ViT's."""
    parts = [_DIT] + ([rf"{_LLM_LAYERS}\.self_attn\.[qkvo]_proj"] if llm else []) + ([_VISION] if vision else [])
    return "|".join(f"({p})" for p in parts)


def overrides(cfg: GrootN17Config, s: ModelSettings) -> dict:
    """`s` as GrootN17Config overrides: named as ModelSettings.as_overrides names them, the chunk as `action_horizon`."""
    return s.as_overrides(cfg, "action_horizon")


def freeze_groups(model) -> dict:
    return {"vision": [model.qwen.visual], "vlm": [model.backbone]}


FAMILY = Family(
    name="groot-n17", title="GR00T N1.7", config_class=GrootN17Config, model_class=GrootN17Model, presets=PRESETS,
    recipes=RECIPES, overrides=overrides, **CONFIG_SHAPES,
    flow_time=flow_time,
    freeze_groups=freeze_groups, gradient_checkpointing=False,
    fsdp_units=parallelize.fsdp_units, tp_layers=parallelize.tp_layers, tp_split=parallelize.tp_split,
    tp_parts=parallelize.tp_parts, pp_depth=parallelize.pp_depth, keep_stage=parallelize.keep_stage,
    lora_targets=lora_targets,
    fp8_layers=_FP8,
    vision_tower=r"^backbone\.model\.model\.visual\.",
    checkpoint_names=("groot-n17",),
    checkpoint_name=lambda cfg: "groot-n17",
    # NVIDIA's layout (`backbone.model.*`: transformers' Qwen3-VL tree; `action_head.*`); its tied LM head
    # is never used. Its files (sharded, or LeRobot's under `_groot_model.`) load as N1.5's layouts do; the
    # checkpoint's processor assets (embodiment tags, modality config) are read by kilovla/nvidia_policy.py.
    keys=KeyMap(embed="backbone.model.model.language_model.embed_tokens.weight", tied="backbone.model.lm_head.weight",
                rename=lambda key, name: key, own_prefixes=("backbone.model.",)),
    moe=lambda cfg: cfg.moe, image_prompt="qwen3-vl",
)
