"""A policy folder: the one place that reads, checks and writes what kilovla hands a trained policy on in.

    model.safetensors     weights (kilovla keys); an FSDP run's intermediate checkpoints hold `state/`
                          (torch.distributed.checkpoint shards) instead
    ema.safetensors       the weights' moving average (a run with `ema_decay`)
    policy.json           `PolicyMeta`: preset + config overrides, camera mapping, state keys, dims, stats,
                          tokenizer, image processing, where training started from (`init_from`), the
                          preset's model `family` (an older folder lacks it), and in
                          a `kilovla quantize` folder its `quantization_config` (FP8 layers, quant/fp8.py)
    adapter.safetensors   a LoRA run's intermediate checkpoints: its adapters instead of model.safetensors;
                          policy.json `lora` names their base (models/lora.py), rebuilt and checked on load
    residual.safetensors  an RL run's residual actor (policy.json `residual`; models/residual.py): the folder's
                          policy is the base above plus its bounded correction of each executed chunk
    rl_state.json         an RL checkpoint: what resumes the run (written by rl/checkpoints.py, read by rl/runner.py)
    tokenizer/            the tokenizer files when the policy uses a real one (`save_policy`)

`PolicyFolder.open(path)` reads policy.json once; what it says is then asked of the folder, not re-read:

    >>> folder = PolicyFolder.open("runs/mw/checkpoints/step_000120")  # doctest: +SKIP
    >>> folder.interface().state_widths, folder.quantization is None   # doctest: +SKIP
    ((4,), True)
    >>> policy = folder.load("cpu", ema=False)                         # doctest: +SKIP

The writers (`write_policy_json`, `save_policy`, `write_rl_policy_files`) are the only code that writes
policy.json; training, RL and quantization call them.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import types
import typing
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from kilovla.errors import KilovlaError
from kilovla.models.family import chunk_length, family_of
from kilovla.models.presets import PRESETS, build_model, preset
from kilovla.models.processor import PolicyMeta

POLICY_JSON = "policy.json"
FAMILY_KEY = "family"  # policy.json's record of the preset's family (models/family.py), beside PolicyMeta's fields
EMA_FILE = "ema.safetensors"
STATE_DIR = "state"  # an FSDP checkpoint's shards (train/checkpoint.py)
RL_STATE = "rl_state.json"
# An RL checkpoint's weight files: (file, key prefixes of the learner's model, the prefix its keys lose)
CHECKPOINT_FILES = (("model.safetensors", ("vla.",), "vla."), ("value_head.safetensors", ("value_head.",), "value_head."),
                    ("residual.safetensors", ("actor.",), "actor."), ("critic.safetensors", ("critics.", "targets."), ""))


WEIGHTS = ("model.safetensors", "model.safetensors.index.json", STATE_DIR, "adapter.safetensors")


def not_a_policy_folder(path: str | Path, lacks: str, flag: str | None = None) -> str:
    """The one message for a folder that lacks `lacks` (policy.json or its weights), whichever command reads it."""
    said = f"{flag} {path}" if flag else str(path)
    if (Path(path) / "config.json").is_file() and not (Path(path) / POLICY_JSON).is_file():  # a published layout
        return (f"{said}: a published policy folder (config.json), not a kilovla one: convert it first, "
                f"`kilovla convert-policy {path} NEW_FOLDER` (LeRobot SmolVLA, Isaac-GR00T N1.7)")
    return f"{said}: not a policy folder (no {lacks}; a policy folder holds policy.json and model.safetensors)"


@dataclass(frozen=True)
class Interface:
    """What a policy declares to an env or a client: the dims, inputs and chunking its weights fix.

        PolicyFolder.open(step).interface() -> Interface(name="pi05-tiny", action_dim=4, state_dim=4,
            state_keys=("observation.state",), state_widths=(4,), cameras=("scene",), camera_keys=
            ("observation.images.scene",), image_size=(32, 32), n_action_steps=5, chunk_length=10)
    """

    name: str
    action_dim: int
    state_dim: int
    state_keys: tuple[str, ...]
    state_widths: tuple[int | None, ...]  # each state key's width, from the normalisation stats (None: no stats)
    cameras: tuple[str, ...]  # env camera names ("scene")
    camera_keys: tuple[str, ...]  # the observation keys they arrive under ("observation.images.scene")
    image_size: tuple[int, int] | None  # [H, W] of the training frames; None: an earlier version's folder
    n_action_steps: int | None  # actions of a chunk that run before the next prediction; None: the whole chunk
    chunk_length: int  # actions the model predicts per chunk
    where: str = field(default=POLICY_JSON, compare=False)  # the policy.json it was read from, for messages

    def checked_state_widths(self) -> tuple[int, ...]:
        """`state_widths`, each known (what a client must send): a key without stats is named."""
        for key, width in zip(self.state_keys, self.state_widths):
            if width is None:
                raise KilovlaError(f"{self.where}: no stats for state key {key!r}")
        return self.state_widths

    @classmethod
    def of(cls, meta: PolicyMeta, name: str | None = None, where: str = POLICY_JSON) -> Interface:
        return cls(name=name or meta.preset, action_dim=meta.action_dim, state_dim=meta.state_dim,
                   state_keys=tuple(meta.state_keys), state_widths=tuple(state_width(meta, k) for k in meta.state_keys),
                   cameras=tuple(k.removeprefix("observation.images.") for k in meta.camera_map),
                   camera_keys=tuple(meta.camera_map), image_size=tuple(meta.image_size) if meta.image_size else None,
                   n_action_steps=meta.n_action_steps, chunk_length=chunk_length(preset(meta.preset, **meta.overrides)),
                   where=where)


def state_width(meta: PolicyMeta, key: str) -> int | None:
    """A state key's width: the length of its normalisation stats (mean, q01 or min, whichever is there);
    None without stats."""
    stats = meta.stats.get(key, {})
    found = next((stats[n] for n in ("mean", "q01", "min") if n in stats), None)
    return None if found is None else int(np.asarray(found).size)


_NAMES = {int: ("an int", "ints"), float: ("a number", "numbers"), bool: ("true or false", "booleans"),
          str: ("a string", "strings"), list: ("a list", "lists"), dict: ("a mapping", "mappings")}


def _describe(hint, least: int | None, plural: bool = False) -> str:
    """The JSON value a PolicyMeta annotation asks for, in words ("null or a list of positive ints")."""
    args = typing.get_args(hint)
    if typing.get_origin(hint) in (types.UnionType, typing.Union):
        return "null or " + _describe(next(a for a in args if a is not type(None)), least, plural)
    base = typing.get_origin(hint) or hint
    one, many = _NAMES[base]
    if base is int and least is not None:
        one, many = ("a positive int", "positive ints") if least == 1 else (f"an int >= {least}", f"ints >= {least}")
    said = many if plural else one
    if base is list and args:
        said += " of " + _describe(args[0], least, plural=True)
    elif base is dict and args:
        said += " of strings to " + _describe(args[1], least, plural=True)
    return said


def _fits(value, hint, least: int | None) -> bool:
    """Whether a JSON value is what the annotation `hint` asks for (`least`: the least int)."""
    args = typing.get_args(hint)
    if typing.get_origin(hint) in (types.UnionType, typing.Union):
        kinds = [a for a in args if a is not type(None)]
        return (value is None and type(None) in args) or any(_fits(value, a, least) for a in kinds)
    base = typing.get_origin(hint) or hint
    if base is int:
        return isinstance(value, int) and not isinstance(value, bool) and (least is None or value >= least)
    if base is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if not isinstance(value, base):
        return False
    if base is list and args:
        return all(_fits(v, args[0], least) for v in value)
    if base is dict and args:
        return all(isinstance(k, str) and _fits(v, args[1], least) for k, v in value.items())
    return True


def preset_family(name: str) -> str:
    """The family name of preset `name` ("pi0-tiny" -> "pi05")."""
    return family_of(preset(name)).name


def _family_problem(recorded, preset_name: str) -> str | None:
    """What is wrong with policy.json's `family` beside its preset; None when it is absent (an older folder) or fits."""
    if recorded is None or preset_name not in PRESETS:  # an unknown preset is named where the model is built
        return None
    own = preset_family(preset_name)
    if recorded != own:
        return f"key {FAMILY_KEY!r}: {recorded!r}, but preset {preset_name!r} is a {own!r} model"
    return None


def meta_problem(fields: dict) -> str | None:
    """What keeps policy.json's `fields` from being a PolicyMeta, checked against its annotations and each
    field's "min" (a missing or unknown key, a value of the wrong type or range); None when they fit."""
    hints = typing.get_type_hints(PolicyMeta)
    declared = {f.name: f for f in dataclasses.fields(PolicyMeta)}
    for name, f in declared.items():
        if name not in fields and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            return f"missing key {name!r}"
    for name, value in fields.items():
        if name not in declared:  # no kilovla version wrote a key PolicyMeta lacks (but quantization_config)
            return f"unknown key {name!r}"
        least = declared[name].metadata.get("min")
        if not _fits(value, hints[name], least):
            shown = repr(value) if len(repr(value)) <= 60 else repr(value)[:57] + "..."
            return f"key {name!r}: {shown} is not {_describe(hints[name], least)}"
    return None


@dataclass(frozen=True)
class PolicyFolder:
    """A checked policy folder. `quantization`: policy.json's `quantization_config` (None: float weights);
    `recorded`: the fields policy.json holds (a folder of an earlier version lacks some; `meta` has their
    defaults)."""

    path: Path
    meta: PolicyMeta
    quantization: dict | None = None
    recorded: frozenset[str] = frozenset()

    @classmethod
    def open(cls, path: str | Path, flag: str | None = None) -> PolicyFolder:
        """Read and check `path`/policy.json (KilovlaError naming the file when it is missing or not a policy;
        `flag`, the option that named `path`, heads the message for a folder without one)."""
        path = Path(path).expanduser()
        where = path / POLICY_JSON
        if not where.is_file():
            raise KilovlaError(not_a_policy_folder(path, POLICY_JSON, flag))
        try:
            fields = json.loads(where.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise KilovlaError(f"{where}: not a policy description: not JSON: {e}") from None
        if not isinstance(fields, dict):
            raise KilovlaError(f"{where}: not a policy description: expected a JSON object, found a "
                               f"{type(fields).__name__}")
        quantization = fields.pop("quantization_config", None)
        recorded_family = fields.pop(FAMILY_KEY, None)
        if fields.get("overrides", {}) is None:  # earlier versions wrote null for no overrides
            fields["overrides"] = {}
        problem = meta_problem(fields) or _family_problem(recorded_family, fields["preset"])
        if problem:
            raise KilovlaError(f"{where}: not a policy description: {problem}")
        return cls(path, PolicyMeta(**fields), quantization, frozenset(fields))

    @classmethod
    def find(cls, path: str | Path) -> PolicyFolder | None:
        """`open`, or None where `path` is no kilovla policy folder (an openpi, LeRobot or GR00T checkpoint, a file)."""
        path = Path(path).expanduser()
        return cls.open(path) if (path / POLICY_JSON).is_file() else None

    @property
    def where(self) -> str:
        return str(self.path / POLICY_JSON)

    @property
    def family(self) -> str:
        """The model family of the folder's preset ("pi05", "groot", "smolvla"): what policy.json records, and
        for a folder written before it did, the preset's."""
        return preset_family(self.meta.preset)

    def check_weights(self, flag: str | None = None) -> None:
        """Refuse a folder without weights: model.safetensors (or its shards), an FSDP run's `state/` or a LoRA
        run's adapters."""
        if not any((self.path / name).exists() for name in WEIGHTS):
            raise KilovlaError(not_a_policy_folder(self.path, "model.safetensors", flag))

    @property
    def adapters(self) -> bool:
        """A LoRA run's intermediate checkpoint: adapters on their base, not merged weights."""
        return bool(self.meta.lora) and not self.meta.lora.get("merged")

    @property
    def has_ema(self) -> bool:
        from kilovla.models.lora import ADAPTER_EMA_FILE

        return any((self.path / name).is_file() for name in (EMA_FILE, ADAPTER_EMA_FILE))

    @property
    def sharded(self) -> bool:
        """An FSDP run's intermediate checkpoint: weights only in `state/`, no model.safetensors (nor shards)."""
        from kilovla.models.checkpoints import is_sharded_policy_folder

        return is_sharded_policy_folder(self.path)

    def rl_state(self) -> dict | None:
        """rl_state.json of an RL checkpoint (None for other folders)."""
        path = self.path / RL_STATE
        if not path.is_file():
            return None
        try:
            return json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise KilovlaError(f"{path}: not JSON: {e}") from None

    def refuse_quantized(self, remedy: str, said: str = "a quantized policy folder") -> None:
        """Training, RL and quantization start from float weights: a quantized folder stops them here."""
        if self.quantization is not None:
            raise KilovlaError(f"{self.path}: {said} (policy.json has a quantization_config); {remedy}")

    def recorded_tokenizer(self) -> str | None:
        """The tokenizer policy.json names, as an absolute path (relative names are the folder's); None: "byte"."""
        if self.meta.tokenizer == "byte":
            return None
        path = self.path / self.meta.tokenizer
        if not path.exists():
            raise KilovlaError(f"{self.where}: its tokenizer {self.meta.tokenizer} is not there; pass --policy.tokenizer=PATH")
        return str(path.resolve())

    def interface(self, name: str | None = None) -> Interface:
        return Interface.of(self.meta, name, self.where)

    def model_config(self):
        """The model config the weights fit (preset + overrides), built without weights."""
        return preset(self.meta.preset, **self.meta.overrides)

    def residual_spec(self):
        """The residual actor's description (models/residual.ResidualSpec), checked against the base's shape
        without loading weights; None for a folder without a residual."""
        from kilovla.models.residual import ResidualSpec, check_fits

        if self.meta.residual is None:
            return None
        spec = ResidualSpec.from_json(self.meta.residual, self.where)
        check_fits(spec, self.model_config(), self.meta.action_dim, self.where)
        return spec

    def residual_actor(self):
        """The residual actor with its weights (residual.safetensors), checked against policy.json."""
        from kilovla.models.checkpoints import read_safetensors
        from kilovla.models.residual import RESIDUAL_FILE, ResidualActor

        spec = self.residual_spec()
        path = self.path / RESIDUAL_FILE
        if not path.is_file():
            raise KilovlaError(f"{path}: missing; policy.json names a residual actor")
        actor = ResidualActor(spec)
        try:
            actor.load_state_dict(read_safetensors(path))
        except RuntimeError as e:
            raise KilovlaError(f"{path}: does not match policy.json's residual: {str(e).splitlines()[0]}") from None
        return actor

    @property
    def label(self) -> str:
        """What the folder holds, for reports and banners: "pi0-tiny", "pi0-tiny FP8 W8A8",
        "pi0-tiny + LoRA", "pi0-tiny + residual_sac residual"."""
        parts = [self.meta.preset]
        if self.quantization is not None:
            parts.append("FP8 " + ("W8A8" if self.quantization.get("activations") == "1x128" else "weight-only"))
        if self.adapters:
            parts.append("+ LoRA")
        if self.meta.residual is not None:
            parts.append(f"+ {self.meta.residual.get('algorithm', 'RL')} residual")
        return " ".join(parts)

    def load(self, device: str | torch.device = "cpu", ema: bool = False):
        """The folder as a `VLAPolicy` on `device`. `ema`: the exponential moving average of the weights
        (ema.safetensors, written by a run with `ema_decay`) instead of the last weights."""
        from kilovla.models.policy import VLAPolicy
        from kilovla.models.residual import ResidualPolicyModel

        if ema and not self.has_ema:
            raise KilovlaError(f"{self.path / EMA_FILE}: missing; only runs with ema_decay write EMA weights")
        self.check_weights()
        model, meta = self._base_model(ema)
        if self.adapters:  # merged on load, so every consumer (eval, serve, rl, quantize) writes plain folders
            meta = dataclasses.replace(meta, lora={**meta.lora, "merged": True})
        if meta.residual is not None:  # an RL folder: the base's weights, its learned residual beside them
            model = ResidualPolicyModel(model, self.residual_actor())
        policy = VLAPolicy(model, meta, device, root=self.path)
        policy.name, policy.source, policy.ema = self.label, str(self.path), ema  # recorded in evaluation reports
        return policy

    def _base_model(self, ema: bool):
        from kilovla.models.checkpoints import load_checkpoint
        from kilovla.quant.fp8 import load_quantized_weights

        meta = self.meta
        if self.adapters:  # a LoRA run's checkpoint: its adapters on their base
            from kilovla.models.lora import ADAPTER_EMA_FILE, ADAPTER_FILE, build_base, load_adapters, merged_model

            adapters = self.path / (ADAPTER_EMA_FILE if ema else ADAPTER_FILE)
            model = load_adapters(build_base(meta.lora, self.where), meta.lora, adapters, self.where)
            return merged_model(model, meta.lora, meta.preset, meta.overrides), meta
        model = build_model(meta.preset, device="meta", **meta.overrides)
        if self.quantization is None:
            load_checkpoint(model, self.path / EMA_FILE if ema else self.path)  # or model.safetensors, or FSDP shards
        else:  # a `kilovla quantize` folder
            load_quantized_weights(model, self.quantization, self.path, self.where)
        return model, meta


def load_policy_folder(folder: str | Path, device: str | torch.device = "cpu", ema: bool = False):
    """`PolicyFolder.open(folder).load(device, ema)`: a policy folder as a `VLAPolicy`."""
    return PolicyFolder.open(folder).load(device, ema)


# -- writing ---------------------------------------------------------------------------------------------
def write_policy_json(folder: str | Path, meta: PolicyMeta | dict, quantization: dict | None = None) -> None:
    """policy.json, written atomically (a temporary name, then renamed): `meta` (a PolicyMeta, or its
    fields as a dict) plus a quantized folder's `quantization_config`."""
    folder = Path(folder)
    fields = dataclasses.asdict(meta) if dataclasses.is_dataclass(meta) else dict(meta)
    fields.pop(FAMILY_KEY, None)  # a dict read from another policy.json: recomputed, never copied
    name = fields.pop("preset")
    fields = {"preset": name, FAMILY_KEY: preset_family(name), **fields}
    if quantization is not None:
        fields["quantization_config"] = quantization
    tmp = folder / f".{POLICY_JSON}.{uuid.uuid4().hex[:8]}"
    tmp.write_text(json.dumps(fields, indent=2))
    os.replace(tmp, folder / POLICY_JSON)


def save_policy(policy, folder: str | Path, *, state: dict | None = None, metadata: dict | None = None,
                quantization: dict | None = None) -> Path:
    """A `VLAPolicy` as a policy folder: model.safetensors (`state`, default the model's own; `metadata` in
    its header), the tokenizer's files when it uses a real one (so the folder runs wherever it is
    copied), and policy.json (with a quantized model's `quantization`)."""
    from kilovla.models.checkpoints import save_safetensors

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    save_safetensors(policy.model.state_dict() if state is None else state, folder / "model.safetensors",
                     metadata=metadata)
    meta = policy.meta
    tokenizer = getattr(policy.processor.tokenizer, "path", None)
    if tokenizer is not None:
        dst = folder / "tokenizer" / tokenizer.name
        if tokenizer.resolve() != dst.resolve():
            dst.parent.mkdir(exist_ok=True)
            if tokenizer.is_dir():
                shutil.copytree(tokenizer, dst, dirs_exist_ok=True)
            else:
                shutil.copy2(tokenizer, dst)
                # the chat template the prompt is built by goes beside the copy (GR00T N1.7 places its images by it)
                template = policy.processor.chat_template_file
                if template is not None:
                    shutil.copy2(template, dst.parent / template.name)
        meta = dataclasses.replace(meta, tokenizer=f"tokenizer/{tokenizer.name}")
    write_policy_json(folder, meta, quantization)
    return folder


def write_rl_policy_files(folder: Path, learner_state: dict, meta: PolicyMeta | dict) -> None:
    """A learner's state (`LearnerWorker.state`) as a policy folder: the weight files of CHECKPOINT_FILES,
    the replay buffer of residual SAC or filtered BC (replay.safetensors), policy.json (with the residual's
    description) and learner.pt, the rest (weights-only: tensors, numbers, dicts)."""
    from kilovla.models.checkpoints import save_safetensors

    learner_state = dict(learner_state)
    fields = dataclasses.asdict(meta) if dataclasses.is_dataclass(meta) else dict(meta)
    weights = learner_state.pop("model")
    for name, prefixes, strip in CHECKPOINT_FILES:
        part = {k.removeprefix(strip): v for k, v in weights.items() if k.startswith(prefixes)}
        if part:
            save_safetensors(part, folder / name)
    if "replay" in learner_state:  # an off-policy learner's buffer: tensors, never pickled
        save_safetensors(learner_state.pop("replay"), folder / "replay.safetensors")
    if "residual" in learner_state:  # its weights are in the files above; resume reads them from there
        fields["residual"] = learner_state["residual"]
        fields["n_action_steps"] = learner_state["residual"]["steps"]  # eval and serve replan as it was trained
    else:  # PPO keeps the weights in learner.pt too (resume reads them from there)
        learner_state["model"] = weights
    torch.save(learner_state, folder / "learner.pt")
    write_policy_json(folder, fields)
