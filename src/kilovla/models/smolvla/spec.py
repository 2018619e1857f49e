"""The SmolVLA `Family` (models/family.py): what generic code asks about these models."""

from __future__ import annotations

from kilovla.models.family import Family, KeyMap, ModelSettings
from kilovla.models.smolvla import parallelize
from kilovla.models.smolvla.model import SmolVLAConfig, SmolVLAModel, flow_time
from kilovla.models.smolvla.presets import PRESETS, RECIPES

_PROJ = r"self_attn\.[qkvo]_proj|mlp\.(gate|up|down)_proj"
_TEXT = rf"vlm_with_expert\.vlm\.model\.text_model\.layers\.\d+\.({_PROJ})"
_EXPERT = rf"vlm_with_expert\.lm_expert\.layers\.\d+\.({_PROJ})"
_VISION = r"vlm_with_expert\.vlm\.model\.vision_model\.encoder\.layers\.\d+\.(self_attn\.(q|k|v|out)_proj|mlp\.fc[12])"
_HEADS = r"(state_proj|action_in_proj|action_out_proj|action_time_mlp_in|action_time_mlp_out)"


def lora_targets(vision: bool, llm: bool) -> str:
    """As LeRobot's PEFT defaults: the expert's q/v projections and the five projections around it;
    `llm`: the VLM's decoder layers too; `vision`: the ViT's."""
    parts = [r"vlm_with_expert\.lm_expert\.layers\.\d+\.self_attn\.(q|v)_proj", _HEADS]
    parts += ([_TEXT] if llm else []) + ([_VISION] if vision else [])
    return "|".join(f"({p})" for p in parts)


def overrides(cfg: SmolVLAConfig, s: ModelSettings) -> dict:
    """`s` as SmolVLAConfig overrides: named as ModelSettings.as_overrides names them, the chunk as `chunk_size`."""
    return s.as_overrides(cfg, "chunk_size")


def freeze_groups(model) -> dict:
    return {"vision": [model.vlm.vision_model, model.vlm.connector], "vlm": [model.vlm_with_expert.vlm]}


FAMILY = Family(
    name="smolvla", title="SmolVLA", config_class=SmolVLAConfig, model_class=SmolVLAModel, presets=PRESETS,
    recipes=RECIPES, chunk_length=lambda cfg: cfg.chunk_size, overrides=overrides,
    camera_tokens=lambda cfg: cfg.camera_tokens,  # after the connector's pixel shuffle
    action_tokens=lambda cfg: cfg.chunk_size + 1,  # the prefix's state token counted here
    vocab_size=lambda cfg: cfg.text.vocab_size,
    image_token_id=lambda cfg: None,
    pooled_width=lambda cfg: 2 * cfg.text.kv_heads * cfg.text.head_dim,  # the last layer's keys and values
    flow_time=flow_time,
    freeze_groups=freeze_groups, gradient_checkpointing=True,
    fsdp_units=parallelize.fsdp_units, tp_layers=parallelize.tp_layers, tp_split=parallelize.tp_split,
    tp_parts=parallelize.tp_parts, pp_depth=parallelize.pp_depth, keep_stage=parallelize.keep_stage,
    lora_targets=lora_targets,
    fp8_layers=f"^({_TEXT}|{_EXPERT})$",
    vision_tower=r"^vlm_with_expert\.vlm\.model\.vision_model\.",
    checkpoint_names=("smolvla",),
    checkpoint_name=lambda cfg: "smolvla",
    # lerobot/smolvla_base: LeRobot's layout ("model." prefix; pre-0.4 normalisation buffers are dropped by
    # checkpoints.map_keys). The VLM's lm_head is never used: as `tied` it is dropped beside the embedding the
    # checkpoint always holds.
    keys=KeyMap(embed="vlm_with_expert.vlm.model.text_model.embed_tokens.weight",
                tied="vlm_with_expert.vlm.lm_head.weight",
                rename=lambda key, name: key, own_prefixes=("vlm_with_expert.",)),
    tokenizer_kind="smolvlm2",
    moe=lambda cfg: cfg.moe,
)
