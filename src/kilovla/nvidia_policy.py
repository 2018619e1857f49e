"""Isaac-GR00T's GR00T N1.7 checkpoint folder as a kilovla policy folder: `kilovla convert-policy SRC DST`.

What NVIDIA publishes (``nvidia/GR00T-N1.7-3B``, ``nvidia/GR00T-N1.7-LIBERO/libero_10``; written by
Isaac-GR00T's ``save_pretrained`` of the model and of ``Gr00tN1d7Processor``), and what each file becomes:

    config.json            Gr00tN1d7Config (model_type "Gr00tN1d7")  -> policy.json: preset + overrides
    model-0000k-of-0000n.safetensors + model.safetensors.index.json   NVIDIA's keys, which are kilovla's
                           (``backbone.model.*``, ``action_head.*``)  -> model.safetensors
    processor_config.json  processor_kwargs.modality_configs[tag]: video / state / action ModalityConfigs
                           (delta_indices, modality_keys, mean_std_embedding_keys, sin_cos_embedding_keys,
                           action_configs) and use_percentiles, use_relative_action, apply_sincos_state_encoding
    statistics.json        {tag: {"state" | "action" | "relative_action": {key: {min, max, mean, std, q01, q99}}}}
    embodiment_id.json     {tag: projector index}; absent: Isaac-GR00T's built-in table (`BUILTIN_IDS`)
    (these three beside the weights, where Gr00tPolicy's AutoProcessor reads them, or in processor/)

One embodiment tag (``--policy.robot=TAG``, or the only tag with statistics) becomes the policy: its video
keys the cameras (``observation.images.<key>``), its state and action keys concatenated in the modality
config's order one ``observation.state`` and one ``action`` with their stats, its action horizon
n_action_steps, its projector index embodiment_id. NVIDIA normalises each key to [-1, 1] from q01/q99
(``use_percentiles``) or min/max, or by mean/std for the modality's ``mean_std_embedding_keys``: kilovla's
``quantile``, ``min_max`` and ``mean_std``, one mode for every key. Refused in one line, since kilovla
cannot represent them: keys of mixed modes, sin/cos-encoded state, state-relative actions
(``use_relative_action`` with a RELATIVE action config), per-step stats, a state history or several
video frames. Not carried: ``clip_outliers`` (NVIDIA clips normalised state and actions to [-1, 1];
kilovla does not) and the image crop / resize settings (the preset's).

Nothing is unpickled (JSON and safetensors only); DST appears only whole (lerobot_policy.write_converted).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from kilovla.errors import KilovlaError
from kilovla.lerobot_policy import (ACTION, CONFIG, IMAGES, STATE, check_conversion, converted_preset, read_json,
                                    write_converted)
from kilovla.models.processor import STATS_FOR, PolicyMeta

MODEL_TYPE = "Gr00tN1d7"
PROCESSOR, STATISTICS, EMBODIMENT_IDS = "processor_config.json", "statistics.json", "embodiment_id.json"
HOLDS = (f"an Isaac-GR00T N1.7 folder holds {CONFIG}, model*.safetensors, {PROCESSOR}, {STATISTICS} "
         f"and {EMBODIMENT_IDS}")
BACKBONES = {"nvidia/Cosmos-Reason2-2B": "groot-n17-3b"}
# Isaac-GR00T's projector index of each pretrained tag (processing_gr00t_n1d7.py), used when a folder
# has no embodiment_id.json, as Isaac-GR00T does.
BUILTIN_IDS = {"simpler_env_google": 0, "simpler_env_widowx": 1, "libero_sim": 2, "new_embodiment": 10,
               "robocasa_panda_omron": 10, "robocasa_gr1_tabletop": 10, "unitree_g1_sonic": 11,
               "oxe_droid_relative_eef_relative_joint": 24, "real_g1_relative_eef_relative_joints": 25,
               "unitree_g1_full_body_with_waist_height_nav_cmd": 25, "real_r1_pro_sharpa_relative_eef": 26,
               "real_r1_pro_sharpa_relative_eef_human": 26, "real_r1_pro_sharpa_relative_eef_maxinsights": 26,
               "real_r1_pro_sharpa_relative_eef_mecka": 26, "xdof_relative_eef_relative_joint": 27,
               "xdof_relative_eef_relative_joint_subtask": 27}
# config.json key -> GrootN17Config field; "a.b": a key of the nested dict a
FIELDS = {"select_layer": "llm.depth", "backbone_embedding_dim": "llm.width", "hidden_size": "hidden_size",
          "action_horizon": "action_horizon", "max_state_dim": "max_state_dim", "max_action_dim": "max_action_dim",
          "max_num_embodiments": "num_embodiments", "max_seq_len": "max_seq_len",
          "attend_text_every_n_blocks": "attend_text_every", "num_inference_timesteps": "num_inference_steps",
          "num_timestep_buckets": "dit.timestep_buckets", "diffusion_model_cfg.num_layers": "dit.depth",
          "diffusion_model_cfg.num_attention_heads": "dit.heads",
          "diffusion_model_cfg.attention_head_dim": "dit.head_dim", "diffusion_model_cfg.output_dim": "dit.output_dim",
          "vl_self_attention_cfg.num_layers": "vl_self_attention_depth",
          "vl_self_attention_cfg.num_attention_heads": "vl_self_attention_heads",
          "vl_self_attention_cfg.attention_head_dim": "vl_self_attention_head_dim"}
# config.json settings kilovla's N1.7 does not have: (key, the value it runs as)
UNSUPPORTED = (("backbone_model_type", "qwen"), ("use_alternate_vl_dit", True), ("use_vlln", True),
               ("add_pos_embed", True), ("state_history_length", 1), ("reproject_vision", False),
               ("noise_beta_alpha", 1.5), ("noise_beta_beta", 1.0), ("noise_s", 0.999))


def is_groot_n17(folder: str | Path) -> bool:
    """Whether `folder`'s config.json is Isaac-GR00T's N1.7 model config (what convert-policy dispatches on)."""
    try:
        cfg = json.loads((Path(folder).expanduser() / CONFIG).read_text())
    except (OSError, ValueError):
        return False
    return isinstance(cfg, dict) and (cfg.get("model_type") == MODEL_TYPE
                                      or MODEL_TYPE in (cfg.get("architectures") or []))


def read_model(folder: Path, preset_name: str | None) -> tuple[str, dict]:
    """config.json as (preset, overrides), every value checked as a config's are."""
    from kilovla.models.presets import preset

    where = folder / CONFIG
    cfg = read_json(where, HOLDS)
    for key, runs_as in UNSUPPORTED:
        if cfg.get(key, runs_as) != runs_as:
            raise KilovlaError(f"{where}: {key}={cfg[key]!r} is not supported (kilovla's GR00T N1.7 runs {runs_as!r})")
    name, base = converted_preset(where, "model_name", cfg.get("model_name", ""), BACKBONES, preset_name, "groot-n17")
    overrides: dict = {}
    for key, target in FIELDS.items():
        value = _lookup(cfg, key, where)
        if target == "vl_self_attention_depth" and value is None and cfg.get("vl_self_attention_cfg") is None:
            value = 0  # NVIDIA builds no VL self-attention without its config
        if value is None:
            continue
        part, _, sub = target.partition(".")
        ours = getattr(getattr(base, part), sub) if sub else getattr(base, part)
        if value != ours and sub:
            overrides.setdefault(part, {})[sub] = value
        elif value != ours:
            overrides[part] = value
    width = _lookup(cfg, "input_embedding_dim", where)
    dit = overrides.get("dit", {})
    if width is not None and width != dit.get("heads", base.dit.heads) * dit.get("head_dim", base.dit.head_dim):
        raise KilovlaError(f"{where}: input_embedding_dim {width} must equal the DiT's num_attention_heads x "
                           "attention_head_dim")
    preset(name, **overrides)
    return name, overrides


def _lookup(cfg: dict, key: str, where: Path):
    outer, _, inner = key.partition(".")
    if not inner:
        return cfg.get(outer)
    nested = cfg.get(outer)
    if nested is not None and not isinstance(nested, dict):
        raise KilovlaError(f"{where}: {outer} must be a JSON object, not {nested!r}")
    return (nested or {}).get(inner)


# -- the processor assets ------------------------------------------------------------------------------
@dataclass(frozen=True)
class Embodiment:
    """One embodiment tag of processor_config.json and statistics.json, in kilovla's terms."""

    folder: Path  # where processor_config.json lies
    tag: str
    embodiment_id: int
    cameras: tuple[str, ...]  # the video keys
    horizon: int  # the action steps of a chunk (len(delta_indices))
    normalization: str
    state_stats: dict[str, list[float]]  # the state keys' stats, concatenated in order
    action_stats: dict[str, list[float]]

    @classmethod
    def read(cls, folder: Path, robot: str | None) -> Embodiment:
        """`folder`'s processor assets: beside the weights (Gr00tPolicy's AutoProcessor.from_pretrained), or
        in a processor/ subfolder (as some training runs save them)."""
        if not (folder / PROCESSOR).is_file() and (folder / "processor" / PROCESSOR).is_file():
            folder = folder / "processor"
        where = folder / PROCESSOR
        kwargs = read_json(where, HOLDS).get("processor_kwargs")
        configs = kwargs.get("modality_configs") if isinstance(kwargs, dict) else None
        if not isinstance(configs, dict) or not all(isinstance(c, dict) for c in configs.values()):
            raise KilovlaError(f"{where}: processor_kwargs.modality_configs must map embodiment tags to "
                               "{video, state, action} modality configs")
        stats_file = folder / STATISTICS
        stats = read_json(stats_file, HOLDS)
        tags = [t for t in configs if t in stats]
        if robot is None and len(tags) != 1:
            raise KilovlaError(f"{where}: {len(tags)} embodiment tags with statistics ({', '.join(tags) or 'none'}); "
                               "choose one with --policy.robot=TAG")
        tag = robot if robot is not None else tags[0]
        if tag not in tags:
            raise KilovlaError(f"{where}: --policy.robot={tag}: no such embodiment tag with statistics; it has "
                               f"{', '.join(tags) or 'none'}")
        config, where = configs[tag], f"{where}: modality_configs.{tag}"
        video, state, action = (_modality(config, m, where) for m in ("video", "state", "action"))
        for name, m in (("video", video), ("state", state)):
            if m["delta_indices"] != [0]:
                raise KilovlaError(f"{where}.{name}.delta_indices {m['delta_indices']}: kilovla reads the current "
                                   "frame only ([0])")
        horizon = len(action["delta_indices"])
        if action["delta_indices"] != list(range(horizon)) or not horizon:
            raise KilovlaError(f"{where}.action.delta_indices {action['delta_indices']}: kilovla predicts the next "
                               "steps 0, 1, ..., n-1")
        _check_representable(kwargs, state, action, where)
        mode = _mode(kwargs, state, action, where)
        tag_stats = stats[tag] if isinstance(stats[tag], dict) else {}
        return cls(folder=folder, tag=tag, embodiment_id=_embodiment_id(folder, tag),
                   cameras=tuple(video["modality_keys"]), horizon=horizon, normalization=mode,
                   state_stats=_concatenated(tag_stats, "state", state["modality_keys"], mode, stats_file, tag),
                   action_stats=_concatenated(tag_stats, "action", action["modality_keys"], mode, stats_file, tag))


def _modality(config: dict, name: str, where: str) -> dict:
    m = config.get(name)
    if not isinstance(m, dict) or not isinstance(m.get("delta_indices"), list) \
            or not isinstance(m.get("modality_keys"), list) or not m["modality_keys"]:
        raise KilovlaError(f"{where}: no {name} modality config with delta_indices and modality_keys")
    return m


def _check_representable(kwargs: dict, state: dict, action: dict, where: str) -> None:
    """Refuse what the processor does that kilovla's cannot: sin/cos-encoded state, state-relative actions."""
    if kwargs.get("apply_sincos_state_encoding") and state.get("sin_cos_embedding_keys"):
        raise KilovlaError(f"{where}.state: sin/cos-encoded keys {state['sin_cos_embedding_keys']}: kilovla "
                           "normalises state, it does not encode it")
    configs = action.get("action_configs") or []
    relative = [k for k, c in zip(action["modality_keys"], configs)
                if isinstance(c, dict) and str(c.get("rep", "")).upper() == "RELATIVE"]
    if kwargs.get("use_relative_action") and relative:
        raise KilovlaError(f"{where}.action: relative actions {relative} (use_relative_action): kilovla's actions "
                           "are absolute, not relative to the state")
    if kwargs.get("formalize_language", True) is not True:
        raise KilovlaError(f"{where}: formalize_language is {kwargs['formalize_language']!r}: kilovla's N1.7 prompt "
                           "formalises the task (lower case, no punctuation), as NVIDIA's default does")


def _mode(kwargs: dict, state: dict, action: dict, where: str) -> str:
    """kilovla's one normalisation mode for every state and action key, as NVIDIA normalises each."""
    ranged = "quantile" if kwargs.get("use_percentiles") else "min_max"
    modes = {}
    for name, m in (("state", state), ("action", action)):
        mean_std = set(m.get("mean_std_embedding_keys") or [])
        for key in m["modality_keys"]:
            modes[f"{name}.{key}"] = "mean_std" if key in mean_std else ranged
    if len(set(modes.values())) > 1:
        raise KilovlaError(f"{where}: keys normalised differently ({', '.join(f'{k}: {v}' for k, v in modes.items())});"
                           " kilovla normalises state and action with one mode")
    return next(iter(modes.values()))


def _concatenated(stats: dict, modality: str, keys: list[str], mode: str, where: Path, tag: str) -> dict:
    """The stats of `mode` (STATS_FOR) of `keys`, each key's values in order, as one feature's."""
    out: dict[str, list[float]] = {s: [] for s in STATS_FOR[mode]}
    groups = stats.get(modality) if isinstance(stats.get(modality), dict) else {}
    for key in keys:
        entry = groups.get(key)
        if not isinstance(entry, dict):
            raise KilovlaError(f"{where}: no {tag}.{modality}.{key} statistics")
        widths = set()
        for s in out:
            values = entry.get(s)
            if not isinstance(values, list) or not all(isinstance(v, (int, float)) for v in values):
                raise KilovlaError(f"{where}: {tag}.{modality}.{key}.{s} must be a list of numbers (per-step "
                                   f"statistics are not supported), not {values!r}"[:300])
            out[s] += [float(v) for v in values]
            widths.add(len(values))
        if len(widths) != 1:
            raise KilovlaError(f"{where}: {tag}.{modality}.{key}: its {', '.join(out)} differ in length")
    return out


def _embodiment_id(folder: Path, tag: str) -> int:
    path = folder / EMBODIMENT_IDS
    ids = read_json(path, HOLDS) if path.is_file() else {}
    value = ids.get(tag, BUILTIN_IDS.get(tag))
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise KilovlaError(f"{path}: embodiment tag {tag} has no projector index ({value!r}), nor in Isaac-GR00T's "
                           "built-in table")
    return value


# -- the conversion --------------------------------------------------------------------------------------
def convert_groot_n17_policy(source: str | Path, output: str | Path, tokenizer: str | None = None,
                             preset_name: str | None = None, robot: str | None = None) -> Path:
    """`source` (an Isaac-GR00T N1.7 folder) as the kilovla policy folder `output` (which must not exist)."""
    from kilovla.models.presets import preset
    from kilovla.models.tokenize import QWEN3VL_IMAGE_TOKEN, QwenTokenizer, find_tokenizer

    source, output = check_conversion(source, output, "an Isaac-GR00T N1.7 checkpoint folder")
    name, overrides = read_model(source, preset_name)
    body = Embodiment.read(source, robot)
    if list(body.cameras) != list(preset(name, **overrides).cameras):
        overrides["cameras"] = list(body.cameras)
    cfg = preset(name, **overrides)
    if body.embodiment_id >= cfg.num_embodiments:
        raise KilovlaError(f"{body.folder / EMBODIMENT_IDS}: {body.tag}'s projector index {body.embodiment_id} is not "
                           f"below config.json's max_num_embodiments {cfg.num_embodiments}")
    if body.horizon > cfg.action_horizon:
        raise KilovlaError(f"{body.folder / PROCESSOR}: {body.tag}'s action horizon {body.horizon} exceeds "
                           f"config.json's action_horizon {cfg.action_horizon}")
    tok = find_tokenizer("qwen3", tokenizer, [source], name, near_flag=f"the Isaac-GR00T folder {source}")
    if tok != "byte":  # NVIDIA's prompt: the backbone's chat template, each camera at its <|image_pad|> run
        overrides["image_token_id"] = QwenTokenizer(tok).token_id(QWEN3VL_IMAGE_TOKEN)
    meta = PolicyMeta(preset=name, overrides=overrides, camera_map={IMAGES + c: c for c in body.cameras},
                      state_keys=[STATE], state_dim=len(next(iter(body.state_stats.values()))),
                      action_dim=len(next(iter(body.action_stats.values()))),
                      stats={STATE: body.state_stats, ACTION: body.action_stats}, normalization=body.normalization,
                      n_action_steps=body.horizon, embodiment_id=body.embodiment_id, tokenizer=tok,
                      init_from={"path": str(source.resolve()), "layout": "groot", "embodiment_tag": body.tag})
    return write_converted(meta, source, output, layout="groot")
