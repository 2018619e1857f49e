"""Checkpoint I/O: safetensors in and out, every published file layout, loading without a second copy.

kilovla's own keys are openpi's PyTorch port's for pi0 / pi0.5 (``paligemma_with_expert...``,
``action_in_proj``, ...) and NVIDIA's for GR00T N1.5 (``backbone.eagle_model.*``, ``action_head.*``).
The published layouts map onto them (`detect_layout`, `map_keys`):

- ``kilovla``: ``kilovla train`` / ``policy_folder.save_policy``; kilovla's keys, model.safetensors + policy.json.
- ``openpi``: openpi's JAX -> PyTorch converter; unprefixed keys, bf16 by default, config.json.
- ``lerobot``: LeRobot's pi0 / pi05 / SmolVLA policies; every key prefixed ``model.``, config.json. Files
  of LeRobot before 0.4 also hold the normalisation buffers (`LEROBOT_NORMALIZERS`: ``normalize_inputs.
  buffer_observation_state.mean``, or per robot ``normalize_inputs.so100_buffer_observation_state.mean``),
  unprefixed: they do not count against the prefix and are dropped (policy.json keeps the stats).
- ``lerobot-groot``: LeRobot's GR00T policy; every key prefixed ``_groot_model.``.
- ``groot``: Isaac-GR00T's ``save_pretrained`` (``nvidia/GR00T-N1.5-3B``); unprefixed, sharded,
  backbone bf16, config.json + experiment_cfg/metadata.json.

Any of them may be one file or Hugging Face shards (``model.safetensors.index.json``). Known
differences are mapped, everything else must match exactly:

- tied embeddings: ``paligemma.lm_head.weight`` (openpi, LeRobot) or the Qwen ``lm_head.weight``
  (LeRobot GR00T) fills a missing ``embed_tokens``, and is dropped otherwise;
- never-used weights are dropped: the action expert's ``lm_head``, SigLIP's pooling ``head``;
- pi0.5 from LeRobot: ``action_time_mlp_*`` -> ``time_mlp_*``, pi0's ``state_proj`` and the legacy
  expert ``*_layernorm.weight`` / ``norm.weight`` (adaRMS has ``.dense`` instead) are dropped, as
  LeRobot's own loader does; pi0: ``time_mlp_*`` -> ``action_time_mlp_*``.

Loading is strict and planned from the file headers before any weight is read: missing,
unexpected and misshapen keys come back together in one `CheckpointError` naming the checkpoint.
Weights are then read tensor by tensor straight into the model's parameters (a model built on the
meta device is materialised first), cast to the parameters' dtype: a 3B model never exists twice in
memory, and a bf16 file gives an fp32 model when the model is fp32.

Which entry point: `load_weights(model, path)` / `load_checkpoint` for any layout (streaming,
strict); `Checkpoint.open` for ``--policy.init_from`` (train/build.open_init_checkpoint first
refuses quantized policy folders and LoRA adapters); `read_safetensors` when a whole state dict is
wanted (resuming kilovla's own training checkpoints).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import uuid
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from kilovla.errors import KilovlaError
from kilovla.models.family import families, family_of
from kilovla.models.family import family as family_spec  # `family` names a checkpoint's family string here

LAYOUTS = ("kilovla", "openpi", "lerobot", "lerobot-groot", "groot")
_PREFIX = {"lerobot": "model.", "lerobot-groot": "_groot_model."}
# LeRobot < 0.4's normalisation modules inside the policy: their buffers sit beside the "model." weights
LEROBOT_NORMALIZERS = re.compile(r"(normalize_inputs|normalize_targets|unnormalize_outputs)\.")
DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
          "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
          "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}
_FLOAT = ("F64", "F32", "F16", "BF16")


class CheckpointError(KilovlaError):
    pass


# -- reading safetensors headers and tensors ------------------------------------------------------------
@dataclass(frozen=True)
class StoredTensor:
    """Where one tensor lies: file, dtype name ("BF16"), shape, absolute byte range."""

    file: Path
    dtype: str
    shape: tuple[int, ...]
    start: int
    end: int


def read_header(path: Path) -> dict[str, StoredTensor]:
    """The tensors of a safetensors file from its header alone (8-byte length + JSON), checked."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            if n <= 0 or 8 + n > size:
                raise ValueError("header length out of range")
            header = json.loads(f.read(n))
    except (OSError, ValueError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path}: cannot read safetensors: {e}") from None
    out = {}
    base = 8 + n
    for key, info in header.items():
        if key == "__metadata__":
            continue
        try:
            dtype, shape, (begin, end) = info["dtype"], tuple(info["shape"]), info["data_offsets"]
        except (KeyError, TypeError, ValueError):
            raise CheckpointError(f"{path}: cannot read safetensors: bad header entry for {key!r}") from None
        if dtype not in DTYPES:
            raise CheckpointError(f"{path}: {key} has dtype {dtype}, which kilovla does not read")
        if end - begin != math.prod(shape) * DTYPES[dtype].itemsize or base + end > size:
            raise CheckpointError(f"{path}: {key} lies outside the file (truncated download?)")
        out[key] = StoredTensor(path, dtype, shape, base + begin, base + end)
    return out


def _read_into(f, t: StoredTensor, dest: torch.Tensor) -> None:
    """Read `t` from the open raw file `f` into `dest`, casting to dest's dtype; no full-size copy
    when the dtypes match and dest is a contiguous CPU tensor."""
    stored = DTYPES[t.dtype]
    direct = stored == dest.dtype and dest.device.type == "cpu" and dest.is_contiguous()
    buf = dest.view(-1).view(torch.uint8) if direct else torch.empty(t.end - t.start, dtype=torch.uint8)
    view = memoryview(buf.numpy())
    f.seek(t.start)
    done = 0
    while done < len(view):
        n = f.readinto(view[done:])
        if not n:
            raise CheckpointError(f"{t.file}: ends inside a tensor (truncated?)")
        done += n
    if not direct:
        dest.copy_(buf.view(stored).view(t.shape))


# -- a checkpoint on disk ------------------------------------------------------------------------------
@dataclass
class Checkpoint:
    """A checkpoint's files and tensors, found from a file or a folder (single file or shards)."""

    path: Path  # as given: a file or a folder
    root: Path  # the folder
    files: list[Path]
    tensors: dict[str, StoredTensor]
    layout: str = "openpi"
    dropped: list[str] = field(default_factory=list)
    # upcycling a dense checkpoint into an MoE model (`plan_load(upcycle=True)`): expert stack key -> copies
    # of the dense MLP weight it is read from, and the MoE layers whose router starts fresh
    upcycled: dict[str, int] = field(default_factory=dict)
    fresh_routers: list[str] = field(default_factory=list)

    @classmethod
    def open(cls, path: str | Path, layout: str = "auto") -> Checkpoint:
        path = Path(path)
        files = _weight_files(path)
        tensors: dict[str, StoredTensor] = {}
        for f in files:
            for key, t in read_header(f).items():
                if key in tensors:
                    raise CheckpointError(f"{path}: {key} is stored twice ({tensors[key].file.name}, {f.name})")
                tensors[key] = t
        root = path if path.is_dir() else path.parent
        index = root / "model.safetensors.index.json"
        if path.is_dir() and index.is_file():
            named = json.loads(index.read_text()).get("weight_map", {})
            absent = sorted(k for k in named if k not in tensors)
            if absent:
                raise CheckpointError(f"{index}: names {len(absent)} tensors its shards lack, e.g. {absent[0]}")
        if layout == "auto":
            layout = detect_layout(tensors, root if path.is_dir() else None)
        if layout not in LAYOUTS:
            raise KilovlaError(f"checkpoint layout must be one of {LAYOUTS}, not {layout!r}")
        return cls(path, root, files, tensors, layout)

    @property
    def nbytes(self) -> int:
        return sum(t.end - t.start for t in self.tensors.values())

    def dtypes(self) -> dict[str, int]:
        """Stored dtype -> number of tensors."""
        out: dict[str, int] = {}
        for t in self.tensors.values():
            out[t.dtype] = out.get(t.dtype, 0) + 1
        return out


def _weight_files(path: Path) -> list[Path]:
    if path.is_file():
        return [path]
    if not path.is_dir():
        raise CheckpointError(f"{path}: no such checkpoint file or folder")
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise CheckpointError(f"{index}: not a safetensors index: {e}") from None
        files = [path / name for name in sorted(set(weight_map.values()))]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise CheckpointError(f"{index}: names shards that are not there: {', '.join(missing)}")
        return files
    single = path / "model.safetensors"
    if single.is_file():
        return [single]
    raise CheckpointError(f"{single}: no such checkpoint file (nor model.safetensors.index.json with shards)")


def detect_layout(keys: Iterable[str], folder: Path | None = None) -> str:
    keys = list(keys)
    if folder is not None and (folder / "policy.json").is_file():
        return "kilovla"
    weights = [k for k in keys if not LEROBOT_NORMALIZERS.match(k)]
    for layout, prefix in _PREFIX.items():
        if weights and all(k.startswith(prefix) for k in weights):
            return layout
    for fam in families():  # an unprefixed file of a family with a layout of its own (Isaac-GR00T's)
        if fam.keys.native_layout and any(k.startswith(fam.keys.own_prefixes) for k in keys):
            return fam.keys.native_layout
    return "openpi"


# -- key maps -----------------------------------------------------------------------------------------
def map_keys(stored: Iterable[str], layout: str, family: str) -> tuple[dict[str, str], list[str]]:
    """Stored keys -> {kilovla key: stored key} and the stored keys dropped as known and unused.

    `family`: "pi05", "pi0" or "groot" (the model's checkpoint name), whose `KeyMap` decides the
    renames (module docstring).
    """
    if layout not in LAYOUTS:
        raise KilovlaError(f"checkpoint layout must be one of {LAYOUTS}, not {layout!r}")
    keys = family_spec(family).keys
    prefix = _PREFIX.get(layout, "")
    mapping: dict[str, str] = {}
    dropped: list[str] = []
    tied = None
    for src in stored:
        if layout == "lerobot" and LEROBOT_NORMALIZERS.match(src):
            dropped.append(src)
            continue
        key = src.removeprefix(prefix) if prefix and src.startswith(prefix) else src
        if key == keys.tied:
            tied = src
            continue
        renamed = None if keys.unused.match(key) else keys.rename(key, family)
        if renamed is None:
            dropped.append(src)
            continue
        mapping[renamed] = src
    if tied is not None:  # the tied LM head stands in for the embedding it shares storage with
        if keys.embed in mapping:
            dropped.append(tied)
        else:
            mapping[keys.embed] = tied
    return mapping, dropped


def model_family(model: nn.Module) -> str:
    """The model's checkpoint name: "pi05", "pi0" or "groot"."""
    return family_of(model).checkpoint_name(model.config)


def _checkpoint_family(layout: str, keys: Iterable[str]):
    """The family a checkpoint's keys or layout belong to, None when neither tells."""
    keys = list(keys)
    return (next((f for f in families() if any(k.startswith(f.keys.own_prefixes) for k in keys)), None)
            or next((f for f in families() if layout in f.keys.layouts), None))


def _shape(x) -> tuple[int, ...]:
    return tuple(x.shape) if hasattr(x, "shape") else tuple(x)


def check_fits(own: Mapping, state: Mapping, source: str, hint: str = "") -> None:
    """Every missing / unexpected / misshapen key of `state` against `own` (tensors or shapes), in one
    CheckpointError."""
    missing = sorted(set(own) - set(state))
    unexpected = sorted(set(state) - set(own))
    shapes = sorted(f"{k}: checkpoint {_shape(state[k])} vs model {_shape(own[k])}"
                    for k in set(own) & set(state) if _shape(state[k]) != _shape(own[k]))
    if missing or unexpected or shapes:
        parts = []
        for title, items in (("missing keys", missing), ("unexpected keys", unexpected), ("wrong shapes", shapes)):
            if items:
                shown = ", ".join(items[:8]) + (f" ... ({len(items)} in all)" if len(items) > 8 else "")
                parts.append(f"{title}: {shown}")
        raise CheckpointError(f"{source}: does not fit the model; " + "; ".join(parts) + hint)


def plan_load(model: nn.Module, checkpoint: Checkpoint, source: str | None = None,
              upcycle: bool = False) -> dict[str, StoredTensor]:
    """{model key: stored tensor}, checked against the model from the headers alone. `upcycle`: an MoE
    model's experts may start as a dense checkpoint's MLP (models/moe.py `upcycle_sources`), read once per
    expert (`load_weights`), their routers freshly initialised."""
    family = model_family(model)
    mapping, checkpoint.dropped = map_keys(checkpoint.tensors, checkpoint.layout, family)
    if upcycle:
        from kilovla.models.moe import upcycle_sources

        sources, checkpoint.fresh_routers = upcycle_sources(model, mapping)
        checkpoint.upcycled = {key: copies for key, (_, copies) in sources.items()}
        for key, (dense, _) in sources.items():
            mapping[key] = mapping[dense]
        for dense, _ in sources.values():
            mapping.pop(dense, None)
    state = model.state_dict()
    own = {k: v.shape for k, v in state.items()}
    fresh = {f"{name}.router.weight" for name in checkpoint.fresh_routers}
    own = {k: v for k, v in own.items() if k not in fresh}
    stored = {k: (checkpoint.upcycled[k], *checkpoint.tensors[s].shape) if k in checkpoint.upcycled
              else checkpoint.tensors[s].shape for k, s in mapping.items()}
    misfit = [k for k in checkpoint.upcycled if stored[k] != tuple(own[k])]
    if misfit:  # every expert is a copy of the dense MLP: it must be as wide
        k = misfit[0]
        raise KilovlaError(f"{checkpoint.path}: upcycling copies its dense MLP {mapping[k]} {tuple(stored[k][1:])} into "
                           f"every expert, but {k} is {tuple(own[k])}: leave policy.moe.expert_dim unset "
                           "(the dense MLP's width) to upcycle, or start the MoE model without this checkpoint")
    owner, mine = _checkpoint_family(checkpoint.layout, mapping), family_of(model)
    hint = ""
    if owner is not None and owner is not mine:
        hint = f" (a {checkpoint.layout} checkpoint of {owner.title}, the model is " \
               f"{family if len(mine.checkpoint_names) > 1 else mine.title})"
    check_fits(own, stored, source or str(checkpoint.path), hint)
    plan = {k: checkpoint.tensors[mapping[k]] for k in own}
    # A non-float tensor loads only into a tensor of its own dtype (an Fp8BlockLinear's FP8 payload).
    odd = sorted({t.dtype for k, t in plan.items() if t.dtype not in _FLOAT and DTYPES.get(t.dtype) != state[k].dtype})
    if odd:
        raise CheckpointError(f"{source or checkpoint.path}: weights stored as {', '.join(odd)}; kilovla loads float "
                              "weights (a quantized checkpoint needs `kilovla eval`, not loading as float)")
    # ... and an FP8 payload only from its own dtype: casting bf16 values to FP8 would drop their scales.
    fp8 = (torch.float8_e4m3fn, torch.float8_e5m2)
    recast = sorted(k for k, t in plan.items() if state[k].dtype in fp8 and DTYPES[t.dtype] != state[k].dtype)
    if recast:
        raise CheckpointError(f"{source or checkpoint.path}: {recast[0]} is stored as {plan[recast[0]].dtype}, but the "
                              f"quantized layer reads it as {str(state[recast[0]].dtype).removeprefix('torch.')}"
                              + (f" ({len(recast)} such tensors)" if len(recast) > 1 else ""))
    return plan


# -- loading -------------------------------------------------------------------------------------------
def materialize(model: nn.Module, device: str | torch.device = "cpu", dtype: torch.dtype | None = None) -> nn.Module:
    """Give a meta-device model real (uninitialised) storage on `device`, in `dtype` when given."""
    if dtype is not None:
        model.to(dtype)  # on meta: free
    return model.to_empty(device=device)


def load_weights(model: nn.Module, checkpoint: Checkpoint | str | Path, *, device: str | torch.device | None = None,
                 dtype: torch.dtype | None = None, source: str | None = None, progress: bool = True,
                 upcycle: bool = False) -> Checkpoint:
    """Strictly load a checkpoint into `model`, tensor by tensor, each cast to its parameter's dtype.

    A model on the meta device is materialised on `device` (default cpu) in `dtype` (default: as
    built, float32) after the plan is checked, so a mismatch allocates nothing. `upcycle`: see `plan_load`."""
    ckpt = checkpoint if isinstance(checkpoint, Checkpoint) else Checkpoint.open(checkpoint)
    plan = plan_load(model, ckpt, source, upcycle)
    if any(t.is_meta for t in model.state_dict().values()):
        materialize(model, device or "cpu", dtype)
    state = model.state_dict()
    by_file: dict[Path, list[tuple[str, StoredTensor]]] = {}
    for key, t in plan.items():
        by_file.setdefault(t.file, []).append((key, t))
    total = sum(t.end - t.start for t in plan.values())
    with _load_progress(total, str(ckpt.path), progress and total > 256 * 2**20) as advance, torch.no_grad():
        for path, items in by_file.items():
            with open(path, "rb", buffering=0) as f:
                for key, t in sorted(items, key=lambda kt: kt[1].start):
                    for dest in state[key] if key in ckpt.upcycled else (state[key],):  # each expert its copy
                        _read_into(f, t, dest)
                    advance(t.end - t.start)
    modules = dict(model.named_modules())
    for name in ckpt.fresh_routers:
        modules[name].reset_router()
    return ckpt


def load_checkpoint(model: nn.Module, path: str | Path, layout: str = "auto") -> str:
    """Load weights into `model` (materialised on the cpu if it is on the meta device); returns the layout.
    A policy folder whose model.safetensors is absent but holds an FSDP run's `state/` shards is read
    with torch.distributed.checkpoint."""
    path = Path(path)
    if is_sharded_policy_folder(path):
        load_sharded(model, path / "state")
        return "kilovla"
    return load_weights(model, Checkpoint.open(path, layout), source=str(path)).layout


def is_sharded_policy_folder(path: str | Path) -> bool:
    """An FSDP run's intermediate checkpoint: its weights only in `state/` (torch.distributed.checkpoint),
    no model.safetensors (nor shards) beside it."""
    path = Path(path).expanduser()
    return (path.is_dir() and not (path / "model.safetensors").exists()
            and not (path / "model.safetensors.index.json").exists() and (path / "state").is_dir())


@contextlib.contextmanager
def _load_progress(total: int, label: str, enabled: bool):
    """Yields advance(n_bytes); a rich bar with the transfer rate when enabled."""
    if not enabled:
        yield lambda n: None
        return
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TransferSpeedColumn

    with Progress(TextColumn("load"), BarColumn(), DownloadColumn(), TransferSpeedColumn(), TextColumn(label),
                  transient=True) as bar:
        task = bar.add_task("load", total=total)
        yield lambda n: bar.advance(task, n)


# -- writing -------------------------------------------------------------------------------------------
def read_safetensors(path: str | Path) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    path = Path(path)
    if path.is_dir():
        path = path / "model.safetensors"
    if not path.is_file():
        raise CheckpointError(f"{path}: no such checkpoint file")
    try:
        return load_file(str(path))
    except (SafetensorError, OSError) as e:
        raise CheckpointError(f"{path}: cannot read safetensors: {e}") from None


def load_sharded(model: nn.Module, state_dir: str | Path) -> None:
    """Weights from a torch.distributed.checkpoint folder (an FSDP run's checkpoint `state/`), read in
    this one process; a model built on the meta device is materialised on the CPU first."""
    from kilovla.safe_load import load_dcp

    if any(p.is_meta for p in model.parameters()):
        model.to_empty(device="cpu")
    state = {"model": model.state_dict()}
    try:
        load_dcp(state, state_dir, no_dist=True)
    except KilovlaError:  # already one line naming the file (refused or unreadable)
        raise
    except Exception as e:  # noqa: BLE001  a missing or misshapen key
        raise CheckpointError(f"{state_dir}: does not fit the model: {str(e).strip()[:500]}") from None


def save_safetensors(state: dict[str, torch.Tensor], path: str | Path, metadata: dict[str, str] | None = None) -> None:
    """Write atomically (temp file + rename), with the mode the umask gives any new file; shared tensors
    are stored once each."""
    from safetensors.torch import save_file

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    seen: dict[int, str] = {}
    clean = {}
    for key, tensor in state.items():
        ptr = tensor.untyped_storage().data_ptr() if tensor.device.type != "meta" else id(tensor)
        clean[key] = tensor.detach().contiguous().clone() if ptr in seen else tensor.detach().contiguous()
        seen.setdefault(ptr, key)
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        tmp.touch()  # created the ordinary way, so its mode is what the umask gives (0644 under 022)
        mode = tmp.stat().st_mode & 0o777
        save_file(clean, str(tmp), metadata=metadata)
        os.chmod(tmp, mode)  # safetensors writes 0600, which would keep a shared policy folder from colleagues
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def save_sharded(specs: Mapping[str, tuple[tuple[int, ...], torch.dtype]], make: Callable[[str], torch.Tensor],
                 folder: str | Path, max_shard_bytes: int = 5 * 10**9) -> list[Path]:
    """Hugging Face's sharded layout: ``model-0000k-of-0000n.safetensors`` + ``model.safetensors.index.json``.

    `specs` gives each tensor's shape and dtype, `make(key)` the tensor itself, called one shard at
    a time, so writing never holds more than a shard in memory. The index is written last."""
    folder = Path(folder)
    shards: list[list[str]] = [[]]
    size = 0
    for key, (shape, dtype) in specs.items():
        nbytes = math.prod(shape) * dtype.itemsize
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(key)
        size += nbytes
    names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    weight_map = {}
    for name, keys in zip(names, shards):
        save_safetensors({k: make(k) for k in keys}, folder / name, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(keys, name))
    total = sum(math.prod(s) * d.itemsize for s, d in specs.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    tmp = folder / f".model.safetensors.index.json.{uuid.uuid4().hex[:8]}"
    tmp.write_text(json.dumps(index, indent=2))
    os.replace(tmp, folder / "model.safetensors.index.json")
    return [folder / n for n in names]
