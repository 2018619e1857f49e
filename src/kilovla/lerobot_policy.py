"""A LeRobot SmolVLA policy folder as a kilovla policy folder: `kilovla convert-policy SRC DST`.

What LeRobot (>= 0.4) publishes, e.g. ``HuggingFaceVLA/smolvla_libero``, and what each file becomes:

    config.json                SmolVLAConfig            -> policy.json: preset + overrides, cameras, dims
    model.safetensors          "model.vlm_with_expert.*", "model.*_proj"  -> model.safetensors (kilovla keys,
                                                           each tensor in its stored dtype)
    policy_preprocessor.json   its "normalizer_processor" step names the stats file of the state
    policy_postprocessor.json  its "unnormalizer_processor" step names the stats file of the action
    policy_*_normalizer_processor.safetensors  "observation.state.mean", "action.std", ... or per robot
                               "so100.buffer.action.mean"   -> policy.json stats
    (not in the folder)        SmolVLM2's tokenizer.json, given or found beside it  -> tokenizer/

config.json -> SmolVLAConfig: chunk_size, max_state_dim, max_action_dim, num_vlm_layers,
self_attn_every_n_layers, expert_width_multiplier, min_period, max_period by name; tokenizer_max_length ->
max_language_tokens, pad_language_to -> language_padding, num_steps -> num_inference_steps;
resize_imgs_with_padding must be the preset's vision.image_size (image_resize "pad_top_left").
input_features ``observation.images.<cam>`` -> camera slot <cam> in order, then `empty_cameras` blank slots;
``observation.state`` / output ``action`` shapes -> state_dim / action_dim; normalization_mapping's STATE
and ACTION (one mode for both: MEAN_STD, MIN_MAX or QUANTILES) -> normalization. The VLM's shapes are the
preset's: smolvla-base for ``HuggingFaceTB/SmolVLM2-500M-Video-Instruct``, else ``--policy.preset``.

Nothing is unpickled (JSON and safetensors only); a missing or bad file stops with one line naming it,
and DST appears only whole (built in a staging sibling, then renamed).
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

from kilovla.errors import KilovlaError
from kilovla.models.processor import STATS_FOR, PolicyMeta

CONFIG = "config.json"
PREPROCESSOR, POSTPROCESSOR = "policy_preprocessor.json", "policy_postprocessor.json"
VLM_PRESETS = {"HuggingFaceTB/SmolVLM2-500M-Video-Instruct": "smolvla-base"}
MODES = {"MEAN_STD": "mean_std", "MIN_MAX": "min_max", "QUANTILES": "quantile"}
# config.json key -> SmolVLAConfig field
FIELDS = {"chunk_size": "chunk_size", "max_state_dim": "max_state_dim", "max_action_dim": "max_action_dim",
          "num_vlm_layers": "num_vlm_layers", "self_attn_every_n_layers": "self_attn_every_n_layers",
          "expert_width_multiplier": "expert_width_multiplier", "min_period": "min_period",
          "max_period": "max_period", "tokenizer_max_length": "max_language_tokens",
          "pad_language_to": "language_padding", "num_steps": "num_inference_steps"}
# config.json settings kilovla's SmolVLA does not have: (key, the value it runs as)
UNSUPPORTED = (("n_obs_steps", 1), ("add_image_special_tokens", False), ("attention_mode", "cross_attn"),
               ("adapt_to_pi_aloha", False), ("use_delta_joint_actions_aloha", False))
IMAGES, STATE, ACTION = "observation.images.", "observation.state", "action"


HOLDS = f"a LeRobot SmolVLA folder holds {CONFIG}, model.safetensors, {PREPROCESSOR} and {POSTPROCESSOR}"


def read_json(path: Path, holds: str = HOLDS) -> dict:
    """A JSON object; missing, unreadable or not an object: one line naming `path` (`holds`: what the folder has)."""
    if not path.is_file():
        raise KilovlaError(f"{path}: missing ({holds})")
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise KilovlaError(f"{path}: not JSON: {e}") from None
    if not isinstance(data, dict):
        raise KilovlaError(f"{path}: expected a JSON object, found a {type(data).__name__}")
    return data


@dataclass(frozen=True)
class LeRobotSmolVLA:
    """What config.json says, in kilovla's terms."""

    preset: str
    overrides: dict
    cameras: tuple[str, ...]  # LeRobot's image features, in order ("observation.images.top", ...)
    image_size: list[int]  # [H, W] of the first camera
    state_dim: int
    action_dim: int
    normalization: str
    n_action_steps: int | None
    image_resize: str

    @classmethod
    def read(cls, folder: Path, preset_name: str | None = None) -> LeRobotSmolVLA:
        from kilovla.models.presets import preset

        where = folder / CONFIG
        cfg = read_json(where)
        if cfg.get("type") != "smolvla":
            raise KilovlaError(f"{where}: type {cfg.get('type')!r}; kilovla converts LeRobot SmolVLA policies "
                               "(type smolvla)")
        for key, runs_as in UNSUPPORTED:
            if cfg.get(key, runs_as) != runs_as:
                raise KilovlaError(f"{where}: {key}={cfg[key]!r} is not supported (kilovla's SmolVLA runs {runs_as!r})")
        if cfg.get("num_expert_layers", -1) > 0 and cfg["num_expert_layers"] != cfg.get("num_vlm_layers", 16):
            raise KilovlaError(f"{where}: num_expert_layers={cfg['num_expert_layers']}: kilovla's SmolVLA has one "
                               "expert layer per VLM layer")
        name, base = converted_preset(where, "vlm_model_name", cfg.get("vlm_model_name", ""), VLM_PRESETS,
                                      preset_name, "smolvla")
        overrides = {field: cfg[key] for key, field in FIELDS.items()
                     if key in cfg and cfg[key] != getattr(base, field, None)}
        inputs, outputs = _features(cfg, "input_features", where), _features(cfg, "output_features", where)
        cameras = tuple(k for k, f in inputs.items() if f.get("type") == "VISUAL"
                        and not k.removeprefix(IMAGES).startswith("empty_camera_"))
        if not cameras or STATE not in inputs or ACTION not in outputs:
            raise KilovlaError(f"{where}: input_features need {IMAGES}<camera> and {STATE}, output_features "
                               f"{ACTION}; found {sorted(inputs)} and {sorted(outputs)}")
        slots = (*[c.removeprefix(IMAGES) for c in cameras],
                 *[f"empty_camera_{i}" for i in range(int(cfg.get("empty_cameras", 0)))])
        if slots != base.cameras:
            overrides["cameras"] = list(slots)
        resize = cfg.get("resize_imgs_with_padding")
        if resize is not None and list(resize) != [base.vision.image_size] * 2:
            raise KilovlaError(f"{where}: resize_imgs_with_padding {list(resize)}: {name}'s vision tower takes "
                               f"{base.vision.image_size}x{base.vision.image_size} images")
        preset(name, **overrides)  # every value checked as a config's are, before any weight is read
        return cls(preset=name, overrides=overrides, cameras=cameras, image_size=_shape(inputs[cameras[0]])[1:],
                   state_dim=_width(inputs[STATE], where, STATE), action_dim=_width(outputs[ACTION], where, ACTION),
                   normalization=_mode(cfg.get("normalization_mapping", {}), where),
                   n_action_steps=cfg.get("n_action_steps"), image_resize="stretch" if resize is None else "pad_top_left")


def _features(cfg: dict, key: str, where: Path) -> dict:
    features = cfg.get(key)
    if not isinstance(features, dict) or not all(isinstance(f, dict) for f in features.values()):
        raise KilovlaError(f"{where}: {key} must map feature names to {{type, shape}}, not {features!r}")
    return features


def _shape(feature: dict) -> list[int]:
    return [int(d) for d in feature.get("shape", [])]


def _width(feature: dict, where: Path, name: str) -> int:
    shape = _shape(feature)
    if len(shape) != 1 or shape[0] < 1:
        raise KilovlaError(f"{where}: {name} has shape {shape}; SmolVLA reads a flat vector")
    return shape[0]


def _mode(mapping: dict, where: Path) -> str:
    state, action = mapping.get("STATE", "MEAN_STD"), mapping.get("ACTION", "MEAN_STD")
    if state != action or state not in MODES:
        raise KilovlaError(f"{where}: normalization_mapping STATE={state}, ACTION={action}: kilovla normalises "
                           f"state and action alike, with one of {', '.join(MODES)}")
    return MODES[state]


# -- the normalizer stats --------------------------------------------------------------------------------
def read_stats(folder: Path, feature: str, mode: str, robot: str | None = None) -> dict[str, list[float]]:
    """`feature`'s stats of `mode` (STATS_FOR) from the stats file of the processor step that normalises it
    (state: the preprocessor's normalizer, action: the postprocessor's unnormalizer), each a list."""
    from kilovla.models.checkpoints import read_safetensors

    pipeline, step = ((PREPROCESSOR, "normalizer_processor") if feature == STATE
                      else (POSTPROCESSOR, "unnormalizer_processor"))
    where = folder / pipeline
    steps = read_json(where).get("steps", [])
    entry = next((s for s in steps if isinstance(s, dict) and s.get("registry_name") == step), None)
    if entry is None or not isinstance(entry.get("state_file"), str):
        raise KilovlaError(f"{where}: no {step} step with a state_file (its normalisation stats)")
    path = folder / entry["state_file"]
    if path.resolve().parent != folder.resolve():
        raise KilovlaError(f"{where}: state_file {entry['state_file']!r} lies outside {folder}")
    if not path.is_file():
        raise KilovlaError(f"{path}: missing; {where} names it as the {step}'s stats")
    tensors = read_safetensors(path)
    prefix = _robot_prefix(tensors, feature, robot, path)
    wanted = {s: f"{prefix}{feature}.{s}" for s in STATS_FOR[mode]}
    absent = [k for k in wanted.values() if k not in tensors]
    if absent:
        raise KilovlaError(f"{path}: no {', '.join(absent)} ({mode} normalisation of {feature}); it holds "
                           f"{', '.join(sorted(tensors)[:8])}")
    return {s: tensors[k].to(torch.float64).reshape(-1).tolist() for s, k in wanted.items()}


def _robot_prefix(tensors: dict, feature: str, robot: str | None, path: Path) -> str:
    """"" for plain keys ("action.mean"), else "<robot>.buffer." of the keys stored per robot
    ("so100.buffer.action.mean", lerobot/smolvla_base): `robot`, or the only one there is."""
    robots = sorted({k.split(".buffer.", 1)[0] for k in tensors if ".buffer." in k})
    if robot is None:
        if not robots or any(k.startswith(f"{feature}.") for k in tensors):
            return ""  # plain keys (read_stats names any that are missing)
        if len(robots) > 1:
            raise KilovlaError(f"{path}: stats are kept per robot ({', '.join(robots)}); choose one with "
                               "--policy.robot=NAME")
        robot = robots[0]
    if robot not in robots:
        raise KilovlaError(f"{path}: --policy.robot={robot}: no such robot; it has {', '.join(robots) or 'none'}")
    return f"{robot}.buffer."


# -- the conversion --------------------------------------------------------------------------------------
def convert_lerobot_policy(source: str | Path, output: str | Path, tokenizer: str | None = None,
                           preset_name: str | None = None, robot: str | None = None) -> Path:
    """`source` (a LeRobot SmolVLA folder) as the kilovla policy folder `output` (which must not exist)."""
    from kilovla.models.tokenize import find_tokenizer

    source, output = check_conversion(source, output, "a LeRobot SmolVLA policy folder")
    if tokenizer == "byte":
        raise KilovlaError("--policy.tokenizer=byte: LeRobot's SmolVLA reads SmolVLM2's tokens; give its tokenizer.json")
    spec = LeRobotSmolVLA.read(source, preset_name)
    stats = {STATE: read_stats(source, STATE, spec.normalization, robot),
             ACTION: read_stats(source, ACTION, spec.normalization, robot)}
    for key, dim in ((STATE, spec.state_dim), (ACTION, spec.action_dim)):
        widths = {len(v) for v in stats[key].values()}
        if widths != {dim}:
            raise KilovlaError(f"{source}: the {key} stats have {sorted(widths)} values, config.json's {key} {dim}")
    tok = find_tokenizer("smolvlm2", tokenizer, [source], spec.preset, near_flag=f"the LeRobot folder {source}")
    meta = PolicyMeta(preset=spec.preset, overrides=spec.overrides,
                      camera_map={c: c.removeprefix(IMAGES) for c in spec.cameras}, state_keys=[STATE],
                      state_dim=spec.state_dim, action_dim=spec.action_dim, stats=stats,
                      normalization=spec.normalization, n_action_steps=spec.n_action_steps, tokenizer=tok,
                      image_resize=spec.image_resize, image_size=spec.image_size,
                      init_from={"path": str(source.resolve()), "layout": "lerobot"})
    return write_converted(meta, source, output, layout="lerobot")


def converted_preset(where: Path, field: str, value: str, known: dict[str, str], preset_name: str | None,
                     family_name: str) -> tuple[str, object]:
    """(preset name, its config) a published folder converts to: `--policy.preset`, else the one `known` maps
    its config.json's `field` (the backbone's name) to; a preset of another family is refused."""
    from kilovla.models.family import family, family_of
    from kilovla.models.presets import check_preset, preset

    name = preset_name or known.get(value)
    if name is None:
        raise KilovlaError(f"{where}: {field} {value!r} has no kilovla preset; name the preset with its "
                           f"shapes, --policy.preset=NAME (known: {', '.join(known)})")
    check_preset(name, "--policy.preset")
    base = preset(name)
    if family_of(base).name != family_name:
        raise KilovlaError(f"--policy.preset={name}: not a {family(family_name).title} preset "
                           f"({', '.join(family(family_name).presets)})")
    return name, base


def check_conversion(source: str | Path, output: str | Path, what: str) -> tuple[Path, Path]:
    """`source` and `output` as paths, once `source` is a folder and `output` a new one (`what`: the kind
    of folder `source` should be)."""
    from kilovla.folders import check_parent

    source, output = Path(source).expanduser(), Path(output).expanduser().absolute()
    if not source.is_dir():
        raise KilovlaError(f"{source}: no such folder ({what})")
    if output.exists():
        raise KilovlaError(f"{output}: already exists; convert-policy writes a new folder")
    check_parent(output)
    if (source / "policy.json").is_file() and not (source / CONFIG).is_file():
        raise KilovlaError(f"{source}: a kilovla policy folder already (policy.json); use it as it is")
    return source, output


def write_converted(meta: PolicyMeta, source: Path, output: Path, layout: str) -> Path:
    """`source`'s weights (of `layout`) under `meta` as the policy folder `output`, which appears only whole;
    each tensor keeps its stored dtype (bf16 stays bf16: no bigger than the published folder)."""
    from kilovla.models.checkpoints import DTYPES, Checkpoint, load_weights, plan_load
    from kilovla.models.policy import VLAPolicy
    from kilovla.models.presets import build_model
    from kilovla.policy_folder import save_policy
    from kilovla.staging import remove_stale_staging, staging_path

    model = build_model(meta.preset, device="meta", **meta.overrides)
    ckpt = Checkpoint.open(source, layout=layout)
    stored = {k: DTYPES[t.dtype] for k, t in plan_load(model, ckpt).items()}  # refused here before any read
    load_weights(model, ckpt)
    policy = VLAPolicy(model, meta)  # the processor checks the tokenizer, stats and cameras
    state = {k: v.to(stored[k]) for k, v in model.state_dict().items()}
    output.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_staging(output)
    tmp = staging_path(output)
    try:
        save_policy(policy, tmp, state=state, metadata={"format": "pt", "converted_from": str(source.resolve())})
        os.replace(tmp, output)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return output
