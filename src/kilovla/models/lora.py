"""LoRA adapters on pi0 / pi0.5 / GR00T through Hugging Face `peft` (its LoRA layers, injected in place).

    settings = LoraSettings(rank=16)
    apply_lora(model, settings)            # peft's lora.Linear around the family's target linears; all else frozen
    merged = merge_state(model.state_dict(), settings)   # plain kilovla keys, W + (alpha / r) B A

Per-family targets (`default_targets`, each family's `lora_targets`), as LeRobot's PEFT defaults for pi0 / pi0.5: the language
model's and the action expert's attention (q, k, v, o) and MLP (gate, up, down) projections; GR00T:
the DiT action head's attention (to_q, to_k, to_v, to_out) and feed-forward linears, with `llm` the
Eagle LLM's q/k/v/o too. `vision` adds the vision tower's attention and MLP on either family.
An MoE action expert's routed and shared experts and routers (models/moe.py: stacked weights, not
linears) take no adapters: they stay frozen, or train in full when `full` names their MLP module
(``...gemma_expert.model.layers.3.mlp``); a `targets` regex that names them is refused.

The model keeps its own class (`peft.inject_adapter_in_model`, no PeftModel wrapper), so the trainer,
FSDP2's per-layer units, gradient checkpointing and evaluation see the same modules as without LoRA;
a wrapped linear's weight is renamed `<name>.base_layer.weight` and its adapters are
`<name>.lora_A.default.weight` / `<name>.lora_B.default.weight`.

A folder that holds adapters (`adapter.safetensors`) names its base in policy.json `lora.base`: the
`init_from` checkpoint, or preset + seed + device of a random start, and a fingerprint of the base
weights that loading checks, so adapters are never put on weights they were not trained on.
"""

from __future__ import annotations

import dataclasses
import hashlib
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

from kilovla.errors import KilovlaError
from kilovla.models.family import family_of

ADAPTER_FILE = "adapter.safetensors"
ADAPTER_EMA_FILE = "adapter_ema.safetensors"
ADAPTER_NAME = "default"


@dataclass
class LoraSettings:
    """`--policy.lora.*`. rank 0: no LoRA (every other field is then ignored)."""

    rank: int = 0
    alpha: float | None = None  # None: alpha = rank (scale 1, as openpi's gemma_2b_lora / gemma_300m_lora)
    dropout: float = 0.0
    targets: str | None = None  # a regex over module names (full match); None: the family's defaults
    vision: bool = False  # also the vision tower
    llm: bool = False  # GR00T: also the Eagle LLM's q/k/v/o (pi0 / pi0.5 adapt their LM by default)
    full: list[str] = field(default_factory=list)  # module names trained in full beside the adapters
    merge: bool = True  # the run's last checkpoint also holds merged weights (model.safetensors)

    @property
    def enabled(self) -> bool:
        return self.rank > 0

    @property
    def scaling(self) -> float:
        return (self.alpha if self.alpha is not None else self.rank) / self.rank

    def check(self) -> list[str]:
        problems = []
        if self.rank < 0:
            problems.append(f"policy.lora.rank must be >= 0, not {self.rank}")
        if self.enabled and not 0.0 <= self.dropout < 1.0:
            problems.append(f"policy.lora.dropout must be in [0, 1), not {self.dropout}")
        if self.enabled and self.alpha is not None and self.alpha <= 0:
            problems.append(f"policy.lora.alpha must be > 0, not {self.alpha}")
        return problems


def default_targets(model: torch.nn.Module, settings: LoraSettings) -> str:
    """The family's targets (its `lora_targets`), with the vision tower / Eagle LLM where asked."""
    return family_of(model).lora_targets(settings.vision, settings.llm)


def targets_of(model: torch.nn.Module, settings: LoraSettings) -> str:
    return settings.targets or default_targets(model, settings)


def apply_lora(model: torch.nn.Module, settings: LoraSettings) -> torch.nn.Module:
    """Inject peft LoRA layers (B = 0: the model computes exactly what it did) and leave only the
    adapters and `settings.full` trainable. Returns `model` itself."""
    try:
        import peft
    except ImportError:
        raise KilovlaError("policy.lora needs Hugging Face peft: pip install 'kilovla[lora]'") from None
    pattern = targets_of(model, settings)
    try:
        regex = re.compile(pattern)
    except re.error as e:
        raise KilovlaError(f"policy.lora.targets is not a regular expression: {e}") from None
    # A linear the model itself keeps frozen (pi0.5's last LM layer's q/o projections and MLP: nothing reads
    # the prefix after that layer's keys and values) would get adapters without gradients: left alone.
    linear = [n for n, m in model.named_modules()
              if isinstance(m, torch.nn.Linear) and regex.fullmatch(n) and m.weight.requires_grad]
    _refuse_stacked_targets(model, regex, pattern)
    if not linear:
        raise KilovlaError(f"policy.lora.targets {pattern!r} matches no linear layer of {type(model).__name__}")
    names = dict(model.named_modules())
    missing = [n for n in settings.full if n not in names]
    if missing:
        raise KilovlaError(f"policy.lora.full names {missing}, not modules of {type(model).__name__}")
    config = peft.LoraConfig(r=settings.rank, lora_alpha=settings.alpha if settings.alpha is not None else settings.rank,
                             lora_dropout=settings.dropout, target_modules=linear, bias="none")
    peft.inject_adapter_in_model(config, model, adapter_name=ADAPTER_NAME)
    model.requires_grad_(False)
    for name, p in model.named_parameters():
        if ".lora_" in name:
            p.requires_grad_(True)
    for name in settings.full:
        names[name].requires_grad_(True)
    return model


def _refuse_stacked_targets(model: torch.nn.Module, regex: re.Pattern, pattern: str) -> None:
    """MoE experts and routers are stacked weights that peft's LoRA layers (linears) do not wrap here."""
    from kilovla.models.moe import MoEMLP

    moe = [n for n, m in model.named_modules() if isinstance(m, MoEMLP)]
    named = [n for n, _ in model.named_modules() if regex.fullmatch(n) and any(n.startswith(f"{m}.") for m in moe)]
    if named:
        raise KilovlaError(f"policy.lora.targets {pattern!r} names MoE experts or routers ({named[0]}): kilovla "
                           "puts no LoRA adapters on their stacked weights; leave them frozen, or train them in full "
                           f"with policy.lora.full=[{named[0].rsplit('.', 1)[0]}]")


def is_lora(model: torch.nn.Module) -> bool:
    return any(".lora_" in n for n, _ in model.named_parameters())


def merge_state(state: dict[str, torch.Tensor], settings: LoraSettings) -> dict[str, torch.Tensor]:
    """A LoRA model's full state dict -> the plain model's (kilovla keys): each adapted weight becomes
    W + scaling * B @ A in W's dtype (computed in float32); adapters dropped, `.base_layer` unwrapped."""
    out = {}
    for key, value in state.items():
        if ".lora_" not in key:
            out[key.replace(".base_layer.", ".")] = value
    suffix = f".lora_A.{ADAPTER_NAME}.weight"
    for key in state:
        if key.endswith(suffix):
            prefix = key[: -len(suffix)]
            a, b = state[key].float(), state[f"{prefix}.lora_B.{ADAPTER_NAME}.weight"].float()
            w = out[f"{prefix}.weight"]
            out[f"{prefix}.weight"] = (w.float() + settings.scaling * (b @ a)).to(w.dtype)
    return out


FINGERPRINT_SAMPLES = 256  # values of each base tensor, evenly spaced over it


def base_fingerprint(model: torch.nn.Module) -> str:
    """A short hash of the frozen base: every parameter's name (kilovla's), shape and 256 values spread
    evenly over it, enough to tell another checkpoint, seed, initialisation or a re-set tensor apart
    (not a change of a few values between the samples: a fingerprint, not a checksum)."""
    h = hashlib.sha256()
    for name, p in sorted((n.replace(".base_layer.", "."), p) for n, p in model.named_parameters()
                          if ".lora_" not in n):
        flat = p.detach().reshape(-1)
        h.update(f"{name}:{tuple(p.shape)}".encode())
        h.update(flat[:: max(1, flat.numel() // FINGERPRINT_SAMPLES)].float().cpu().numpy().tobytes())
    return h.hexdigest()[:16]


def describe(settings: LoraSettings, model: torch.nn.Module, base: dict, merged: bool) -> dict:
    """policy.json's `lora` section: the adapters' shape, their base, whether the folder's weights are merged."""
    return {**dataclasses.asdict(settings), "targets": targets_of(model, settings), "base": base,
            "fingerprint": base_fingerprint(model), "merged": merged}


def settings_from(section: dict, where: str) -> LoraSettings:
    """policy.json's `lora` section as settings, checked as `--policy.lora.*` would be."""
    fields = {f.name for f in dataclasses.fields(LoraSettings)}
    try:
        settings = LoraSettings(**{k: v for k, v in section.items() if k in fields})
    except TypeError as e:
        raise KilovlaError(f"{where}: lora section: {e}") from None
    problems = [f"{k} must be {t}, not {getattr(settings, k)!r}"
                for k, t, ok in (("rank", "a positive integer", lambda v: isinstance(v, int) and v > 0),
                                 ("alpha", "a positive number or null", lambda v: v is None or isinstance(v, (int, float))),
                                 ("dropout", "a number", lambda v: isinstance(v, (int, float))),
                                 ("full", "a list of module names", lambda v: isinstance(v, list)))
                if not ok(getattr(settings, k))]
    problems = problems or settings.check()
    if problems:
        raise KilovlaError(f"{where}: lora section: {'; '.join(problems)}")
    return settings


def build_base(section: dict, where: str) -> torch.nn.Module:
    """The frozen base a folder's adapters were trained on, with its weights (on the cpu)."""
    from kilovla.models.checkpoints import load_checkpoint
    from kilovla.models.presets import build_model

    base = section.get("base")
    if not isinstance(base, dict) or not isinstance(base.get("preset"), str):
        raise KilovlaError(f"{where}: lora.base must name the adapters' base (its preset, and init_from or seed)")
    if base.get("init_from"):
        path = Path(str(base["init_from"].get("path", ""))).expanduser()
        if not path.exists():
            raise KilovlaError(f"{where}: the adapters' base {path} (lora.base.init_from) is missing: put it back, "
                               "or use the run's final (merged) checkpoint")
        model = build_model(base["preset"], device="meta", **base.get("overrides", {}))
        load_checkpoint(model, path, base["init_from"].get("layout", "auto"))
        return model
    device = base.get("device", "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise KilovlaError(f"{where}: the adapters' random base was drawn on cuda; no GPU here to draw it again")
    return build_model(base["preset"], device=device, seed=int(base.get("seed", 0)), **base.get("overrides", {})).cpu()


def load_adapters(model: torch.nn.Module, section: dict, path, where: str) -> torch.nn.Module:
    """Put the adapters of `path` (adapter.safetensors) on `model`, the base, after checking its fingerprint."""
    from kilovla.models.checkpoints import read_safetensors

    settings = settings_from(section, where)
    apply_lora(model, dataclasses.replace(settings, targets=section.get("targets") or settings.targets))
    if section.get("fingerprint") and base_fingerprint(model) != section["fingerprint"]:
        raise KilovlaError(f"{where}: the base weights differ from those the adapters were trained on "
                           f"(fingerprint {base_fingerprint(model)} vs {section['fingerprint']})")
    if not path.is_file():
        raise KilovlaError(f"{path}: missing; policy.json says the folder holds LoRA adapters")
    weights = read_safetensors(path)
    trainable = {n: p for n, p in model.named_parameters() if p.requires_grad}
    if set(weights) != set(trainable):
        raise KilovlaError(f"{path}: does not fit the adapters policy.json describes ({len(set(weights) - set(trainable))} "
                           f"unexpected, {len(set(trainable) - set(weights))} missing tensors)")
    wrong = [f"{k} {tuple(v.shape)} (expected {tuple(trainable[k].shape)})" for k, v in weights.items()
             if v.shape != trainable[k].shape]
    if wrong:
        raise KilovlaError(f"{path}: does not fit the adapters policy.json describes: {', '.join(wrong[:3])}")
    bad = [k for k, v in weights.items() if v.is_floating_point() and not torch.isfinite(v).all()]
    if bad:
        raise KilovlaError(f"{path}: non-finite values in {len(bad)} tensor(s), e.g. {bad[0]}")
    model.load_state_dict(weights, strict=False)
    model.requires_grad_(False)
    return model


def merged_model(model: torch.nn.Module, section: dict, preset: str, overrides: dict) -> torch.nn.Module:
    """The plain model (kilovla keys) computing what `model`, the base with its adapters, computes:
    W + scaling * B @ A in every adapted linear. What eval, serve, rl and quantize load."""
    from kilovla.models.presets import build_model

    plain = build_model(preset, device="meta", **overrides)
    plain.load_state_dict(merge_state(model.state_dict(), settings_from(section, "lora")), assign=True)
    return plain
