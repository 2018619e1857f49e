"""The pi0 / pi0.5 `Family` (models/family.py): what generic code asks about these models."""

from __future__ import annotations

import re

from kilovla.errors import KilovlaError
from kilovla.models.family import Family, KeyMap, ModelSettings
from kilovla.models.pi05 import parallelize
from kilovla.models.pi05.model import Pi05Config, Pi05Model, flow_time
from kilovla.models.pi05.presets import PRESETS, RECIPES

_LM = r"paligemma_with_expert\.(paligemma\.model\.language_model|gemma_expert\.model)\.layers\.\d+\." \
      r"(self_attn\.[qkvo]_proj|mlp\.(gate|up|down)_proj)"
_VISION = r"paligemma_with_expert\.paligemma\.model\.vision_tower\.vision_model\.encoder\.layers\.\d+\." \
          r"(self_attn\.(q|k|v|out)_proj|mlp\.fc[12])"
# pi0.5 from LeRobot: pi0's state_proj and the legacy expert norms (adaRMS has .dense instead) are dropped.
_PI05_LEGACY = re.compile(r"paligemma_with_expert\.gemma_expert\.model\."
                          r"(layers\.\d+\.(input|post_attention)_layernorm|norm)\.weight$")


def lora_targets(vision: bool, llm: bool) -> str:
    """As LeRobot's PEFT defaults: the LM's and the expert's attention and MLP projections."""
    if llm:
        raise KilovlaError("policy.lora.llm is GR00T's switch: pi0 / pi0.5 adapt their language model by default")
    return "|".join(f"({p})" for p in [_LM] + ([_VISION] if vision else []))


def rename(key: str, name: str) -> str | None:
    """pi0.5 reads LeRobot's ``action_time_mlp_*`` as ``time_mlp_*``; pi0 the other way round."""
    if name == "pi05":
        if key.startswith("state_proj.") or _PI05_LEGACY.match(key):
            return None
        if key.startswith("action_time_mlp_"):
            return key.replace("action_time_mlp_", "time_mlp_", 1)
    elif key.startswith("time_mlp_"):
        return key.replace("time_mlp_", "action_time_mlp_", 1)
    return key


def overrides(cfg: Pi05Config, s: ModelSettings) -> dict:
    """`s` as Pi05Config overrides: named as ModelSettings.as_overrides names them, the chunk as `chunk_size`."""
    return s.as_overrides(cfg, "chunk_size")


def freeze_groups(model) -> dict:
    vlm = model.vlm
    return {"vision": [vlm.vision_tower, vlm.multi_modal_projector], "vlm": [model.paligemma_with_expert.paligemma]}


FAMILY = Family(
    name="pi05", title="pi0/pi0.5", config_class=Pi05Config, model_class=Pi05Model, presets=PRESETS, recipes=RECIPES,
    chunk_length=lambda cfg: cfg.chunk_size, overrides=overrides,
    camera_tokens=lambda cfg: cfg.vision.tokens,
    action_tokens=lambda cfg: cfg.chunk_size + cfg.suffix_extra,
    vocab_size=lambda cfg: cfg.lm.vocab_size,
    image_token_id=lambda cfg: None,
    pooled_width=lambda cfg: 2 * cfg.lm.kv_heads * cfg.lm.head_dim,  # the last layer's keys and values
    flow_time=flow_time,
    freeze_groups=freeze_groups, gradient_checkpointing=True,
    fsdp_units=parallelize.fsdp_units, tp_layers=parallelize.tp_layers, tp_split=parallelize.tp_split,
    tp_parts=parallelize.tp_parts,
    pp_depth=parallelize.pp_depth, keep_stage=parallelize.keep_stage,
    lora_targets=lora_targets,
    fp8_layers=f"^{_LM}$",
    vision_tower=r"^paligemma_with_expert\.paligemma\.model\.vision_tower\.",
    checkpoint_names=("pi05", "pi0"),
    checkpoint_name=lambda cfg: "pi05" if cfg.pi05 else "pi0",
    keys=KeyMap(embed="paligemma_with_expert.paligemma.model.language_model.embed_tokens.weight",
                tied="paligemma_with_expert.paligemma.lm_head.weight",
                unused=re.compile(r"paligemma_with_expert\.gemma_expert\.lm_head\.weight$"),
                rename=rename, own_prefixes=("paligemma_with_expert.",), layouts=("openpi", "lerobot")),
    moe=lambda cfg: cfg.moe,
)
