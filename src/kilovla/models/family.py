"""Model families: each folder under models/ (pi05/, groot/) registers one `Family` that answers
everything generic code asks about its models, so trainers, parallelism plans, LoRA, FP8 and the
checkpoint loader never name a family's classes or module paths.

    fam = family_of(model)            # or of a config; family("groot") by name
    fam.chunk_length(model.config)    # 50 for pi05-3b, 16 for groot-n15
    fam.fsdp_units(model)             # [[vit block], ..., [lm layer, expert layer], ...]

What a family answers, by who asks:

- building: `config_class`, `model_class`, `presets` (name -> config) and `recipes` (name ->
  `PolicyDefaults`), read by models/presets.py;
- the data and the processor: `chunk_length`, `camera_tokens` (one camera's image tokens) and
  `action_tokens` (the rest of the row past language: the suffix and any state token) that the token plan counts,
  `vocab_size`, `image_token_id`, `tokenizer_kind` (how a tokenizer file is read, and so the prompt format),
  `pooled_width` (the residual's features);
- writing a config: `overrides` (`ModelSettings`, a caller's family-neutral wishes such as the demo's
  chunk length and camera count -> that family's config overrides);
- training: `flow_time` (Beta(1.5, 1) draw -> t, the family's convention), `freeze_groups`,
  `gradient_checkpointing`;
- parallelism (train/distributed.py, tensor_parallel.py, pipeline.py): `fsdp_units`, `tp_layers`,
  `tp_split` and `tp_parts`, `pp_depth` and `keep_stage`;
- adapters and quantization: `lora_targets`, `fp8_layers` and `vision_tower` (regexes);
- checkpoints: `checkpoint_name` (which key map: "pi05", "pi0", "groot") and `keys` (`KeyMap`);
- a mixture-of-experts option (models/moe.py): `moe` (config -> its `MoEConfig`; None: the family has
  none), read through `moe_of`.

Adding a family: a folder models/<name>/ whose ``__init__`` calls `register(FAMILY)`, and its
module in `FAMILY_MODULES` below; nothing else.
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from torch import nn

from kilovla.errors import KilovlaError
from kilovla.models.attention import BACKENDS
from kilovla.models.images import ImageAugmentation

FAMILY_MODULES = ("kilovla.models.pi05", "kilovla.models.groot", "kilovla.models.smolvla", "kilovla.models.groot_n17")


@dataclass(frozen=True, kw_only=True)
class PolicyDefaults:
    """What a family's fine-tuning recipe sets outside the model config."""

    tokenizer: str = "byte"  # byte, paligemma (SentencePiece), qwen3 (tokenizer.json + Eagle template), smolvlm2
    normalization: str = "quantile"  # quantile (pi0.5), mean_std (pi0), min_max (GR00T)
    state_in_prompt: bool = False
    image_resize: str = "stretch"  # or pad (openpi's resize_with_pad), pad_top_left (LeRobot SmolVLA's)
    augmentation: ImageAugmentation = field(default_factory=ImageAugmentation)
    freeze_vision: bool = False
    freeze_vlm: bool = False  # GR00T: the whole Eagle backbone (tune_llm=False, tune_visual=False)
    embodiment_id: int = 0
    # A recipe for fine-tuning published weights: training it from random weights is refused unless
    # asked for (--policy.random_init=true), since a random 3B model is never what such a run wants.
    needs_weights: bool = False
    # the optimizer settings (train/optim.py OptimConfig fields) a run takes unless it sets them (--optim.lr=...);
    # empty: OptimConfig's defaults
    optim: Mapping[str, object] = field(default_factory=dict)


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelSettings:
    """Model settings stated without a family's field names (the demo's); `Family.overrides` writes them
    as the family's config overrides (keys of `--policy.overrides`).

        ModelSettings(chunk_length=10, max_state_dim=48, image_size=32, cameras=2, packing=True,
                      language_padding="longest")
        -> pi0-tiny: {"chunk_size": 10, ..., "disabled_cameras": ["right_wrist_0_rgb"], "vision": {"image_size": 32}}
    """

    chunk_length: int  # actions per chunk
    max_state_dim: int  # the state padded to this many dimensions
    image_size: int  # camera pixels (square)
    cameras: int  # cameras the data has: the model's enabled camera slots past this many are disabled (pruned)
    packing: bool
    language_padding: str  # "longest" (dynamic padding) or "max_length"
    language_tokens: int | None = None  # the prompt's token limit; None: the preset's

    def as_overrides(self, cfg, chunk_key: str) -> dict:
        """These settings as overrides of a config that names them as pi0's and GR00T's do (packing,
        language_padding, max_state_dim, disabled_cameras, vision.image_size), the chunk length under
        `chunk_key`; the camera slots disabled are the preset's enabled ones past the data's."""
        out = {chunk_key: self.chunk_length, "max_state_dim": self.max_state_dim, "packing": self.packing,
               "language_padding": self.language_padding,
               "disabled_cameras": [*cfg.disabled_cameras, *cfg.enabled_cameras[self.cameras:]],
               "vision": {"image_size": self.image_size}}
        if self.language_tokens is not None:
            out["max_language_tokens"] = self.language_tokens
        return out


class CameraSlots:
    """What every family's config has alike (a base of Pi05Config, GrootConfig, SmolVLAConfig): named
    `cameras`, some `disabled_cameras` (pruned), `language_padding` and an `attention_backend`."""

    @property
    def enabled_cameras(self) -> tuple[str, ...]:
        return tuple(c for c in self.cameras if c not in self.disabled_cameras)

    def check_shared(self) -> None:
        """The checks of those fields, for each config's __post_init__."""
        if self.language_padding not in ("max_length", "longest"):
            raise KilovlaError(f"language_padding must be max_length or longest, not {self.language_padding!r}")
        unknown = [c for c in self.disabled_cameras if c not in self.cameras]
        if unknown:
            raise KilovlaError(f"disabled cameras {unknown} are not among the model's cameras {list(self.cameras)}")
        if self.attention_backend not in BACKENDS:
            raise KilovlaError(f"attention_backend must be one of {BACKENDS}, not {self.attention_backend!r}")


@dataclass(frozen=True)
class TPSplit:
    """A layer's linears by how tensor parallelism splits them (train/tensor_parallel.py). `column`:
    by output (query heads, MLP gate / up); `kv`: key / value projections, split like `column` when
    the key / value heads divide by tp, else whole on every rank; `row`: by input (attention output,
    MLP down)."""

    column: tuple[nn.Linear, ...]
    kv: tuple[nn.Linear, ...]
    row: tuple[nn.Linear, ...]


@dataclass(frozen=True, kw_only=True)
class KeyMap:
    """How published checkpoints' keys map onto the family's (models/checkpoints.py `map_keys`)."""

    embed: str  # the token table's key
    tied: str  # the tied LM head that stands in for a missing token table, dropped otherwise
    rename: Callable[[str, str], str | None]  # (key, checkpoint name) -> kilovla key; None: dropped
    own_prefixes: tuple[str, ...]  # key prefixes only this family's checkpoints have
    unused: re.Pattern = re.compile(r"(?!)")  # stored keys dropped as never used (default: none)
    layouts: tuple[str, ...] = ()  # published layouts (checkpoints.LAYOUTS) of this family alone
    native_layout: str | None = None  # the layout an unprefixed file with `own_prefixes` keys is read as


@dataclass(frozen=True, kw_only=True)
class Family:
    """One model family's answers (module docstring); `cfg` is the family's config, `model` its model."""

    name: str
    title: str  # in messages: "pi0/pi0.5", "GR00T"
    config_class: type
    model_class: type
    presets: Mapping[str, object]
    recipes: Mapping[str, PolicyDefaults]
    chunk_length: Callable[[object], int]
    overrides: Callable[[object, ModelSettings], dict]  # (the preset's config, settings) -> config overrides
    camera_tokens: Callable[[object], int]  # image tokens one camera adds to a row
    action_tokens: Callable[[object], int]
    vocab_size: Callable[[object], int]
    image_token_id: Callable[[object], int | None]
    pooled_width: Callable[[object], int]
    flow_time: Callable
    freeze_groups: Callable[[nn.Module], dict[str, list[nn.Module]]]  # "vision", "vlm"
    gradient_checkpointing: bool
    fsdp_units: Callable[[nn.Module], list[list[nn.Module]]]
    tp_layers: Callable[[nn.Module], list[tuple[nn.Module, int]]]  # (layer, its key / value heads)
    tp_split: Callable[[nn.Module], TPSplit]  # a layer's linears
    tp_parts: Callable[[object], dict[str, tuple[int, int, int]]]  # part -> (heads, kv heads, MLP width)
    pp_depth: Callable[[object], int]
    # (model, its stage's layers, stage, pp, what replaces a dropped module) -> shared parameter names
    keep_stage: Callable[[nn.Module, range, int, int, Callable[[], nn.Module]], list[str]]
    lora_targets: Callable[[bool, bool], str]  # (vision, llm) -> regex over module names
    fp8_layers: str  # regex of the layers FP8 quantizes by default
    vision_tower: str  # regex of the vision tower's modules (kept out of FP8's scope "all")
    checkpoint_names: tuple[str, ...]  # the key maps' names: "pi05", "pi0"
    checkpoint_name: Callable[[object], str]  # a config's
    keys: KeyMap
    # how a tokenizer file is read (models/tokenize.py load_tokenizer), and so which prompt the processor builds:
    # "smolvlm2" (SmolVLA's); None: by the file (a .model: PaliGemma's, else Qwen3's)
    tokenizer_kind: str | None = None
    # the chat template that places the images in the prompt when the config sets image_token_id (models/tokenize.py
    # IMAGE_PROMPTS): "eagle" (GR00T N1.5's, built in), "qwen3-vl" (N1.7's, read beside the tokenizer); None: none,
    # the images go before the prompt
    image_prompt: str | None = None
    moe: Callable[[object], object] | None = None  # config -> its MoEConfig; None: no MoE option

    def build(self, config) -> nn.Module:
        return self.model_class(config)


_FAMILIES: dict[str, Family] = {}


def register(spec: Family) -> Family:
    _FAMILIES[spec.name] = spec
    return spec


def families() -> list[Family]:
    for module in FAMILY_MODULES:
        importlib.import_module(module)
    return list(_FAMILIES.values())


def family(name: str) -> Family:
    """By family or checkpoint name: family("pi0") is the pi05 family."""
    for spec in families():
        if name == spec.name or name in spec.checkpoint_names:
            return spec
    raise KilovlaError(f"unknown model family {name!r}; available: {', '.join(_FAMILIES)}")


def family_of(obj) -> Family:
    """The family of a model or a model config (not of a wrapper: a residual's is its `base`'s)."""
    for spec in families():
        if isinstance(obj, (spec.config_class, spec.model_class)):
            return spec
    raise KilovlaError(f"{type(obj).__name__} is not a model or config of a registered family "
                       f"({', '.join(_FAMILIES)})")


def moe_of(config):
    """The MoEConfig of a model config (or a model) when its MoE is on, else None.

        moe_of(preset("pi05-tiny", moe={"num_experts": 4})) -> MoEConfig(num_experts=4, top_k=2, ...)
    """
    config = getattr(config, "config", config)
    fam = family_of(config)
    moe = fam.moe(config) if fam.moe is not None else None
    return moe if moe is not None and moe.enabled else None


def chunk_length(config) -> int:
    """Actions per chunk of a model config (pi0's chunk_size, GR00T's action_horizon)."""
    return family_of(config).chunk_length(config)


def vocab_size(config) -> int:
    return family_of(config).vocab_size(config)
