"""Training checkpoints: everything needed to continue exactly where a run stopped.

    run_dir/checkpoints/step_000120/
        model.safetensors    weights (kilovla keys)       \\ together a policy folder:
        policy.json          preset, cameras, stats, dims  / `kilovla eval --policy.path` takes it
        ema.safetensors      EMA weights (when enabled)
        optimizer.pt         optimizer state
        state/               FSDP runs instead: model + optimizer as torch.distributed.checkpoint shards
        trainer_state.json   step, plan state (a few integers), world size, LR-scheduler state
        rng.pt               torch / numpy / python RNG states
        config.yaml          the resolved training config
        stats.json           the dataset's normalisation stats
    run_dir/checkpoints/latest     the name of the newest complete checkpoint
    run_dir/checkpoints/pinned     branch points (`branch_at`), one name a line: never pruned
    run_dir/checkpoints/abandoned-20261203T193000Z/   the later checkpoints a branch left behind

A LoRA run (`--policy.lora.rank`, models/lora.py) writes its trainable tensors only: adapter.safetensors
(and adapter_ema.safetensors) in place of model.safetensors, `state/` without the frozen base, the
optimizer as always; policy.json's `lora` names the base (checked by fingerprint on load). Its last
checkpoint also holds the merged weights as model.safetensors (and ema.safetensors), a plain policy
folder, unless `--policy.lora.merge=false`.

Unsharded runs (one process, DDP) write full tensors from rank 0. FSDP runs write `state/` with
torch.distributed.checkpoint: each rank writes its own shards, so no rank holds the whole model, and
a run resumes on any world size (DCP reshards on load). The last checkpoint of an FSDP run also gets
model.safetensors, gathered on rank 0, so the policy folder a run ends with is one plain file; the
policy loader reads `state/` where model.safetensors is absent.

A checkpoint is written into a hidden temporary folder and renamed into place; an older folder of
the same step is swapped out atomically (`exchange`), and `latest` moves only after that: a crash or
a full disk mid-save leaves the previous checkpoint intact.

`checkpoint.async_save` (`save_async`): the model and optimizer go to `state/` through DCP's
async_save, whatever the parallelism: each rank copies its tensors to CPU memory (the step waits for
that copy only) and a background thread writes the files while training goes on. At most one save is
in flight (the next one, and the last checkpoint, which is written whole as above, first wait for it);
the hidden folder becomes the checkpoint only once every rank's files are written (`PendingSave`).

Resuming from a checkpoint that is not the run's newest starts a branch (`branch_at`): the later
checkpoints, of the run that is being replaced, move into `abandoned-<UTC time>/` (said in one
warning), `latest` points at the resumed-from checkpoint, and that checkpoint is pinned, so `keep`
counts the current branch only and never prunes the step it grew from:

    step_2 step_3 step_4 step_5, --resume step_3 --checkpoint.keep=1, two more steps
    -> step_3 (pinned) step_5 (new), abandoned-.../step_4 step_5 (the old branch)

A checkpoint inside an abandoned-*/ folder is the run's own too: resuming it branches the same way,
and it moves back beside the current branch's (pinned), so nothing is written over another branch's.

Resuming runs nothing a checkpoint folder holds: optimizer.pt, rng.pt and `state/` (its .metadata and
non-tensor items) are unpickled through `kilovla.safe_load`'s allowlists of plain data, so a folder
someone handed over can at worst be refused, in one line naming the file.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import dataclasses
import json
import os
import random
import logging
import shutil
import threading
import time
import uuid
import warnings
from concurrent.futures import Future
from pathlib import Path

import numpy as np
import torch

from kilovla.errors import KilovlaError
from kilovla.folders import latest_checkpoint
from kilovla.models.checkpoints import check_fits, read_safetensors, save_safetensors
from kilovla.models.lora import ADAPTER_EMA_FILE, ADAPTER_FILE, LoraSettings, merge_state
from kilovla.policy_folder import STATE_DIR, PolicyFolder, write_policy_json
from kilovla.train import distributed
from kilovla.train.optim import fused_adamw

PINNED = "pinned"
ABANDONED = "abandoned-"

log = logging.getLogger(__name__)


def step_of(folder: Path) -> int:
    return int(folder.name.removeprefix("step_"))


def _hidden(folder: Path, world) -> Path:
    """The hidden folder a checkpoint is written into (the same name on every rank), emptied by rank 0;
    every rank returns once it is there."""
    tmp = folder.parent / f".{folder.name}.tmp"
    if world.is_main:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    distributed.barrier(world, f"checkpoint {folder.name}")
    return tmp


def _write_run_files(tmp: Path, *, scheduler, trainer_state: dict, sharded: bool, policy_meta: dict,
                     config_yaml: str, stats: dict) -> None:
    """Rank 0: what a checkpoint holds beside its tensors (RNG, trainer state, policy.json, config, stats)."""
    torch.save({"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()},
               tmp / "rng.pt")
    state = {**trainer_state, "scheduler": scheduler.state_dict(), "sharded": sharded}
    (tmp / "trainer_state.json").write_text(json.dumps(state, indent=2))
    write_policy_json(tmp, policy_meta)
    (tmp / "config.yaml").write_text(config_yaml)
    (tmp / "stats.json").write_text(json.dumps(stats))


def _make_visible(tmp: Path, folder: Path, on_written=None) -> None:
    """Rank 0: the written folder reaches the disk (a node that dies, or loses power, after `latest` names
    it must not leave a named checkpoint with missing bytes), takes its name, then `latest` names it
    (`on_written`: a test's fault)."""
    fsync_tree(tmp)
    if on_written is not None:
        on_written()
    put_in_place(tmp, folder)
    point_latest(folder.parent, folder)
    _fsync(folder.parent)  # both renames


def fsync_tree(folder: Path) -> None:
    """fsync every file under `folder` and every folder in it (their entries)."""
    for path in [*folder.rglob("*"), folder]:
        _fsync(path)


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_failed(folder: Path, tmp: Path, world, error: BaseException) -> KilovlaError:
    if world.is_main:
        shutil.rmtree(tmp, ignore_errors=True)
    last = latest(folder.parent)
    return KilovlaError(f"cannot write checkpoint {folder}: {error}; "
                        f"{'the last good checkpoint ' + str(last) + ' is intact' if last else 'no earlier checkpoint'}")


def save(folder: Path, *, model, optimizer, scheduler, ema: dict | None, world, trainer_state: dict,
         policy_meta: dict, config_yaml: str, stats: dict, keep: int = 3, full_weights: bool = True,
         lora: LoraSettings | None = None, on_written=None) -> Path:
    """Every rank calls this (the state dicts of a sharded model are collectives). `full_weights`:
    also write model.safetensors when the model is sharded (the run's last checkpoint). `lora`: the
    model carries adapters; only its trainable tensors are written (plus the merged weights when
    `full_weights` and `lora.merge`)."""
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                         get_optimizer_state_dict)

    folder = Path(folder)
    root = folder.parent
    sharded = distributed.is_sharded(model)
    staged = distributed.is_pipeline_stage(model)
    what = f"checkpoint {folder.name}"
    tmp = root / f".{folder.name}.tmp"
    try:
        tmp = _hidden(folder, world)
        adapters = lora is not None
        full = StateDictOptions(full_state_dict=True, cpu_offload=True, ignore_frozen_params=adapters)
        if sharded:
            import torch.distributed.checkpoint as dcp

            dcp.save({"model": get_model_state_dict(model, options=StateDictOptions(ignore_frozen_params=adapters)),
                      "optim": get_optimizer_state_dict(model, optimizer)}, checkpoint_id=str(tmp / STATE_DIR))
            if staged:  # each stage holds its own keys: rank 0 reads the whole model back from the shards
                model_state = gathered_from_shards(tmp / STATE_DIR) if full_weights and world.is_main else None
            else:
                model_state = get_model_state_dict(model, options=full) if full_weights or adapters else None
        else:
            model_state = get_model_state_dict(model, options=full)
            optim_state = get_optimizer_state_dict(model, optimizer, options=full)
        merged = None
        if adapters and full_weights and lora.merge:  # the whole model, gathered (a collective when sharded)
            merged = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if world.is_main:
            ema_cpu = {k: v.cpu() for k, v in ema.items()} if ema is not None else None
            if adapters:
                save_safetensors(model_state, tmp / ADAPTER_FILE)
                if ema_cpu is not None:
                    save_safetensors({**model_state, **ema_cpu}, tmp / ADAPTER_EMA_FILE)
                if merged is not None:
                    save_safetensors(merge_state(merged, lora), tmp / "model.safetensors")
                    if ema_cpu is not None:
                        save_safetensors(merge_state({**merged, **ema_cpu}, lora), tmp / "ema.safetensors")
            else:
                if model_state is not None:
                    save_safetensors(model_state, tmp / "model.safetensors")
                if ema_cpu is not None:
                    save_safetensors({**model_state, **ema_cpu}, tmp / "ema.safetensors")
            if not sharded:
                torch.save({"optimizer": optim_state}, tmp / "optimizer.pt")
            _write_run_files(tmp, scheduler=scheduler, trainer_state=trainer_state, sharded=sharded,
                             policy_meta=policy_meta, config_yaml=config_yaml, stats=stats)
            _make_visible(tmp, folder, on_written)
    except OSError as e:
        raise _write_failed(folder, tmp, world, e) from None
    distributed.barrier(world, what)
    if world.is_main:
        prune(root, keep)
    return folder


@dataclasses.dataclass
class PendingSave:
    """An asynchronous checkpoint (`save_async`): `state/` is being written in the background into the
    hidden folder. As soon as every rank's files are written, rank 0 renames the folder into place,
    moves `latest` and prunes, on the writer's thread (a node lost during the next step keeps it);
    until then the previous checkpoint is the newest complete one. `finish()` waits for all of it and
    raises what failed."""

    future: Future
    tmp: Path
    folder: Path
    world: object
    keep: int
    on_written: object = None

    def __post_init__(self):
        self._published = threading.Event()
        self._error: BaseException | None = None
        if self.world.is_main:
            self.future.add_done_callback(self._publish)
        else:
            self._published.set()

    def _publish(self, future: Future) -> None:
        try:
            if future.exception() is None:
                _make_visible(self.tmp, self.folder, self.on_written)
                prune(self.folder.parent, self.keep)
        except BaseException as e:  # raised by finish() on the training thread
            self._error = e
        finally:
            self._published.set()

    def done(self) -> bool:
        return self.future.done() and self._published.is_set()

    def finish(self) -> Path:
        from torch.distributed.checkpoint.api import CheckpointException

        try:
            self.future.result()
            self._published.wait()
            if self._error is not None:
                raise self._error
        except (OSError, CheckpointException) as e:  # CheckpointException is a BaseException
            raise _write_failed(self.folder, self.tmp, self.world, _cause(e)) from None
        return self.folder


def staging_buffers():
    """The CPU copy `save_async` stages into, kept from one save to the next: a fresh copy each time costs
    a first touch of every page (8 GB of state: ~9 s of the step's time, ~0.4 s reused; `kilovla bench
    elastic`). Only one save is in flight at a time, so its buffers are free again when the next begins."""
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    pinned = torch.cuda.is_available()
    return DefaultStager(StagingOptions(use_pinned_memory=pinned, use_shared_memory=False, use_async_staging=False,
                                        use_non_blocking_copy=False))


def _cause(e: BaseException) -> str:
    """What failed, in one line: a CheckpointException's first rank's own error ("No space left on device")."""
    failures = getattr(e, "failures", None)
    if failures:
        rank, (inner, *_) = next(iter(failures.items()))
        return f"rank {rank}: {getattr(inner, 'strerror', None) or str(inner).strip().splitlines()[0][:300]}"
    text = str(e).strip()
    return text.splitlines()[0][:300] if text else type(e).__name__


def save_async(folder: Path, *, model, optimizer, scheduler, ema: dict | None, world, trainer_state: dict,
               policy_meta: dict, config_yaml: str, stats: dict, keep: int = 3, group=None,
               on_written=None, stager=None) -> PendingSave:
    """Start a checkpoint whose model and optimizer go to `state/` through DCP's async_save: every rank
    stages a copy of its tensors (in CPU memory) before this returns, and the files are written from
    the copy on a background thread over `group` (a gloo group of its own, so its collectives never
    interleave with the step's; None in one process), fsync'ed. Any model layout (one process, DDP,
    FSDP, TP, PP) loads back through `load`'s `state/` path on any world size; an EMA goes there too
    (as `ema`; only the last checkpoint, which `save` writes whole, has ema.safetensors). Not for
    LoRA runs (validate_config refuses them). `stager`: `staging_buffers()`, reused across saves (None: a
    fresh copy)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    folder = Path(folder)
    tmp = folder.parent / f".{folder.name}.tmp"
    try:
        tmp = _hidden(folder, world)
        state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, optimizer)}
        if ema is not None:
            state["ema"] = ema
        alone = not torch.distributed.is_initialized()
        if alone:  # DCP's thread warns that it assumes one process: it is one (a filter for every thread)
            warnings.filterwarnings("ignore", message="torch.distributed is disabled.* save in a single process")
        future = dcp.async_save(state, checkpoint_id=str(tmp / STATE_DIR), process_group=group, no_dist=alone,
                                async_stager=stager)
        if world.is_main:
            _write_run_files(tmp, scheduler=scheduler, trainer_state=trainer_state,
                             sharded=distributed.is_sharded(model), policy_meta=policy_meta,
                             config_yaml=config_yaml, stats=stats)
    except OSError as e:
        raise _write_failed(folder, tmp, world, e) from None
    return PendingSave(future, tmp, folder, world, keep, on_written)


def _holds_ema(state_dir: Path) -> bool:
    from kilovla.safe_load import read_dcp_metadata

    return any(k.startswith("ema.") for k in read_dcp_metadata(state_dir / ".metadata").state_dict_metadata)


def gathered_from_shards(state_dir: Path) -> dict[str, torch.Tensor]:
    """The whole model from a `state/` folder, read in this one process (a pipeline run's rank 0, whose
    stage holds only its own layers): the tensors' shapes come from DCP's metadata."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from kilovla.safe_load import load_dcp, read_dcp_metadata

    meta = read_dcp_metadata(Path(state_dir) / ".metadata")
    model = {k.removeprefix("model."): torch.empty(tuple(m.size), dtype=m.properties.dtype)
             for k, m in meta.state_dict_metadata.items()
             if k.startswith("model.") and isinstance(m, TensorStorageMetadata)}
    state = {"model": model}
    load_dcp(state, state_dir, no_dist=True)
    return state["model"]


def _stage_part(weights: dict, optim: dict, names: set[str]) -> tuple[dict, dict]:
    """A whole model's weights and optimizer state (keyed by parameter name), cut to a pipeline
    stage's own `names`."""
    groups = [{**g, "params": [n for n in g["params"] if n in names]} for g in optim.get("param_groups", [])]
    return ({k: v for k, v in weights.items() if k in names},
            {"state": {k: v for k, v in optim.get("state", {}).items() if k in names}, "param_groups": groups})


def put_in_place(tmp: Path, folder: Path) -> None:
    """Rename `tmp` to `folder`; an existing `folder` is swapped out in one atomic exchange and then removed."""
    if not folder.exists():
        os.replace(tmp, folder)
        return
    if _exchange(tmp, folder):
        shutil.rmtree(tmp, ignore_errors=True)  # now holds the old checkpoint
        return
    old = folder.with_name(f".{folder.name}.old-{uuid.uuid4().hex[:8]}")  # no renameat2: two renames
    os.replace(folder, old)
    os.replace(tmp, folder)
    shutil.rmtree(old, ignore_errors=True)


def point_latest(root: Path, folder: Path) -> None:
    tmp = root / f".latest.{uuid.uuid4().hex[:8]}"
    try:
        tmp.write_text(folder.name)
        os.replace(tmp, root / "latest")
    except OSError:
        tmp.unlink(missing_ok=True)  # a full disk leaves no stray file beside `latest`
        raise


def _exchange(a: Path, b: Path) -> bool:
    """Swap two paths atomically with Linux's renameat2(RENAME_EXCHANGE); False where unsupported."""
    libc_name = ctypes.util.find_library("c")
    if libc_name is None:
        return False
    libc = ctypes.CDLL(libc_name, use_errno=True)
    if not hasattr(libc, "renameat2"):
        return False
    at_fdcwd, rename_exchange = -100, 2
    return libc.renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0


def prune(root: Path, keep: int) -> None:
    """Remove all but the newest `keep` checkpoints of the current branch (0: keep all); the branch
    points in `pinned` are neither counted nor removed."""
    pinned = pinned_names(root)
    steps = sorted((p for p in root.glob("step_*") if p.is_dir() and p.name not in pinned), key=step_of)
    for old in steps[:-keep] if keep > 0 else []:
        shutil.rmtree(old, ignore_errors=True)


def pinned_names(root: Path) -> set[str]:
    path = Path(root) / PINNED
    return set(path.read_text().split()) if path.is_file() else set()


def branch_at(root: Path, folder: Path) -> Path | None:
    """A run resumed from `folder`, a checkpoint of this run's `root` (run_dir/checkpoints), continues
    from it: the checkpoints after it, the branch being replaced, move into
    `root/abandoned-<UTC time>/` (one warning names it), `latest` points at `folder`, and `folder` is
    pinned against pruning. A `folder` inside one of `root`'s abandoned-*/ folders is this run's too:
    the current branch's checkpoints from its step on are set aside the same way and `folder` moves
    back into `root` (where the new checkpoints are written beside it, not over the current branch's).
    Returns the new abandoned folder; None when nothing was set aside: `folder` is the newest
    checkpoint (a plain resume) or lies outside `root` (another run's, which is only read).

        step_2 step_3 step_4, branch_at(root, root / "step_2") -> root/abandoned-20261203T193000Z/ holding
        step_3 step_4; root keeps step_2, `latest` and `pinned` name step_2
        then branch_at(root, root / "abandoned-20261203T193000Z/step_3") -> step_2 step_3 in root, both pinned
    """
    root, folder = Path(root), Path(folder)
    parent = folder.resolve().parent
    revived = parent.parent == root.resolve() and parent.name.startswith(ABANDONED)
    if not root.is_dir() or (parent != root.resolve() and not revived):
        return None
    # revived: a current-branch checkpoint of the same step is replaced by the one resumed from, so it goes too
    later = sorted((p for p in root.glob("step_*") if p.is_dir() and step_of(p) >= step_of(folder) + (not revived)),
                   key=step_of)
    if not later and not revived:
        return None
    away = None
    if later:
        stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
        away = root / f"{ABANDONED}{stamp}"
        n = 1
        while away.exists():  # two branches within a second
            n += 1
            away = root / f"{ABANDONED}{stamp}-{n}"
        away.mkdir()
        for p in later:
            os.replace(p, away / p.name)
    if revived:
        os.replace(folder, root / folder.name)
        folder = root / folder.name
    point_latest(root, folder)
    pinned = {name for name in pinned_names(root) if (root / name).is_dir()} | {folder.name}
    tmp = root / f".{PINNED}.{uuid.uuid4().hex[:8]}"
    tmp.write_text("".join(f"{name}\n" for name in sorted(pinned)))
    os.replace(tmp, root / PINNED)
    log.warning("resuming from %s, not the run's newest checkpoint%s%s", folder.name,
                f" (brought back from {parent.name}/)" if revived else "",
                f": the current branch's later checkpoints ({', '.join(p.name for p in later)}) moved to {away}"
                if later else "")
    return away


# optim.* settings the resumed optimizer and scheduler state fix: AdamW's param_groups (lr, betas,
# weight_decay) and LambdaLR's base_lrs come back from the checkpoint, so a new value would not run;
# warmup_steps and min_lr_ratio would bend the schedule mid-run. clip_grad_norm is read every step
# from the config, so a new one does apply (from the resumed step on) and is not refused.
FIXED_BY_OPTIMIZER = ("lr", "betas", "weight_decay", "warmup_steps", "min_lr_ratio")


def check_same_model(folder: Path, preset: str) -> PolicyFolder:
    """Refuse resuming a checkpoint of another model: the first thing a resume must agree on. Returns the
    checkpoint's policy folder, read."""
    saved = PolicyFolder.open(folder)
    if saved.meta.preset != preset:
        raise KilovlaError(f"{folder}: a checkpoint of {saved.meta.preset!r}, not of {preset!r}")
    return saved


def check_same_moe(folder: Path, saved: dict, mine: dict) -> None:
    """Refuse, in one line, resuming a checkpoint whose mixture-of-experts settings (policy.json's
    overrides.moe, the routing-loss weights and capacity aside) are not this run's: the experts' stacks would
    not fit the model, or fit another routing. `saved`, `mine`: the two runs' policy overrides."""
    from kilovla.train.config import TRAINING_OVERRIDES, named

    skip = {key.removeprefix("moe.") for key in TRAINING_OVERRIDES}
    theirs, ours = saved.get("moe") or {}, mine.get("moe") or {}
    if not (theirs.get("num_experts") or ours.get("num_experts")):
        return  # both dense
    differ = [f"moe.{k}={ours.get(k)!r} (the checkpoint's: {theirs.get(k)!r})" for k in sorted(theirs.keys() | ours.keys())
              if k not in skip and theirs.get(k) != ours.get(k)]
    if differ:
        raise KilovlaError(f"{folder}: cannot resume with {', '.join(differ)}: give the checkpoint's "
                           f"{named('policy.moe', '--policy.moe')} settings again (or --config RUN/config.yaml), "
                           f"or fine-tune from it in a new run_dir ({named('policy.init_from', '--policy.init_from')}"
                           f"={folder})")


def check_resumed_settings(folder: Path, cfg) -> None:
    """Refuse, in one line naming each key with both values, optim settings that differ from those the
    checkpoint in `folder` was trained with (its config.yaml): the saved optimizer and schedule would
    win while the run's config.yaml claimed the new ones. So is another policy.init_from (the weights
    continue from the checkpoint); none, or the run's own, is fine. A larger `steps` is allowed (extending a run)
    but stretches the cosine to the new last step, so the learning rate jumps: one warning says by how much.
    Seed and batch sizes are checked by the plan's state (data/plan.py).

        trained with optim.lr=3e-4, resumed with --optim.lr=1e-4 -> KilovlaError "... optim.lr=0.0001
        (the checkpoint's: 0.0003) ... --policy.init_from=..."
    """
    from kilovla.config import to_dict
    from kilovla.train.config import named
    from kilovla.train.optim import OptimConfig, _lr_lambda

    check_same_model(folder, cfg.policy.preset)  # another model's optimizer settings are beside the point
    saved = _trained_config(folder)
    if saved is None:
        return
    theirs, mine = saved.get("optim") or {}, to_dict(cfg.optim)
    differ = [f"optim.{k}={mine[k]!r} (the checkpoint's: {theirs[k]!r})"
              for k in FIXED_BY_OPTIMIZER if k in theirs and theirs[k] != mine[k]]
    started = (saved.get("policy") or {}).get("init_from")
    if cfg.policy.init_from and not _same_path(cfg.policy.init_from, started):
        # the weights continue from the checkpoint: config.yaml and policy.json would name another start
        differ.append(f"{named('policy.init_from')}={cfg.policy.init_from} (the checkpoint's: {started})")
    if differ:
        raise KilovlaError(f"{folder}: cannot resume with {', '.join(differ)}: the checkpoint's weights, optimizer "
                           "and schedule state would run instead; resume with the checkpoint's values, or fine-tune "
                           f"from it in a new run_dir ({named('policy.init_from', '--policy.init_from')}={folder}, a fresh "
                           "optimizer and schedule)")
    old_steps, at = saved.get("steps"), json.loads((Path(folder) / "trainer_state.json").read_text())["step"]
    if isinstance(old_steps, int) and old_steps != cfg.steps and at < cfg.steps:
        optim = OptimConfig(**{k: v for k, v in theirs.items() if k in OptimConfig.__dataclass_fields__})
        before, after = (_lr_lambda(optim, n)(at) * optim.lr for n in (old_steps, cfg.steps))
        if before != after:
            log.warning("steps=%d, the checkpoint's run had steps=%d: the cosine schedule now ends at step %d, so the "
                        "learning rate at step %d goes from %.3g to %.3g", cfg.steps, old_steps, cfg.steps, at,
                        before, after)


def with_resumed_start(folder: Path, cfg):
    """`cfg` with policy.init_from unset taken from the checkpoint's run (its config.yaml): resumed without
    it, the run's config.yaml was rewritten with `init_from: null` and its next policy.json lost the record
    of its start (and the demonstration seeds the start brings). A start that is gone since stays unset,
    said in one warning (the weights continue from the checkpoint either way)."""
    saved = None if cfg.policy.init_from else _trained_config(folder)
    started = ((saved or {}).get("policy") or {}).get("init_from")
    if not started:
        return cfg
    if not Path(started).expanduser().exists():
        log.warning("%s: the run started from %s, which is gone; this run's config.yaml and policy.json will not "
                    "name its start", folder, started)
        return cfg
    return dataclasses.replace(cfg, policy=dataclasses.replace(cfg.policy, init_from=started))


def _trained_config(folder: Path) -> dict | None:
    """The config.yaml the checkpoint in `folder` was trained with, as a mapping (None: it has none)."""
    import yaml

    path = Path(folder) / "config.yaml"
    if not path.is_file():
        return None
    try:
        return yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as e:
        raise KilovlaError(f"{path}: not a training config: {e}") from None


def _same_path(a: str, b: str | None) -> bool:
    return b is not None and Path(a).expanduser().resolve() == Path(b).expanduser().resolve()


latest = latest_checkpoint  # an empty pointer names no checkpoint (it used to name checkpoints/ itself)


def resolve(resume: str, run_dir: Path, marker: str = "trainer_state.json") -> Path | None:
    """'auto' -> the run's latest checkpoint (None if there is none); else the given folder, which must
    hold `marker` (trainer_state.json for supervised runs, rl_state.json for RL runs)."""
    if resume == "auto":
        folder = latest(Path(run_dir) / "checkpoints")
        if folder is not None and not (folder / marker).is_file():
            raise KilovlaError(f"{folder}: the run_dir's latest checkpoint is not of this kind of run (no {marker}): "
                               "use a new run_dir")
        return folder
    folder = Path(resume)
    if not (folder / marker).is_file():
        raise KilovlaError(f"{folder}: not a kilovla checkpoint of this kind (no {marker})")
    return folder


def load(folder: Path, model, ema: dict | None, optimizer, scheduler, world, adapters: bool = False) -> dict:
    """Restore weights, EMA, optimizer, scheduler and RNG into a (possibly sharded) model; returns the
    trainer state. A `state/` checkpoint is read shard by shard (any world size); a full one is read by
    rank 0 and broadcast into a sharded model, or read by every rank otherwise. `adapters`: a LoRA
    run's checkpoint, which holds the trainable tensors only (the base is the model's already)."""
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                         get_optimizer_state_dict, set_model_state_dict,
                                                         set_optimizer_state_dict)

    from kilovla.safe_load import load_dcp, load_torch

    folder = Path(folder)
    trainer_state = json.loads((folder / "trainer_state.json").read_text())
    only = StateDictOptions(ignore_frozen_params=adapters, strict=not adapters)
    if (folder / STATE_DIR).is_dir():
        state = {"model": get_model_state_dict(model, options=only), "optim": get_optimizer_state_dict(model, optimizer)}
        if ema is not None and _holds_ema(folder / STATE_DIR):  # an asynchronous checkpoint's
            state["ema"] = ema
        try:
            # One process (an FSDP run resumed without torchrun): say so, rather than DCP warning that it assumes it.
            load_dcp(state, folder / STATE_DIR, no_dist=not torch.distributed.is_initialized())
        except KilovlaError:  # already one line naming the file (refused or unreadable)
            raise
        except Exception as e:  # noqa: BLE001  a missing or misshapen key
            raise KilovlaError(f"{folder / STATE_DIR}: does not fit the model: {str(e).strip()[:500]}") from None
        set_model_state_dict(model, state["model"], options=only)
        set_optimizer_state_dict(model, optimizer, state["optim"])
    else:
        staged = distributed.is_pipeline_stage(model)
        # FSDP: rank 0 reads and broadcasts; a pipeline stage reads the file itself and keeps its own keys
        broadcast = distributed.is_sharded(model) and not staged
        reader = world.is_main or not broadcast
        weights_file = folder / (ADAPTER_FILE if adapters else "model.safetensors")
        weights = read_safetensors(weights_file) if reader else {}
        optim = load_torch(folder / "optimizer.pt")["optimizer"] if reader else {}
        if reader:  # a sharded parameter (DTensor) reports its full shape
            trainable = {n for n, p in model.named_parameters() if p.requires_grad}
            own = {k: v for k, v in model.state_dict().items() if not adapters or k in trainable}
            if staged:
                weights, optim = _stage_part(weights, optim, set(own))
            check_fits(own, weights, str(weights_file))
        options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=broadcast, strict=not adapters)
        set_model_state_dict(model, weights, options=options)
        set_optimizer_state_dict(model, optimizer, optim, options=options)
    for group in optimizer.param_groups:  # fused or not is this mesh's choice; loading took the saving run's
        group["fused"] = fused_adamw(group["params"])
    ema_file = folder / (ADAPTER_EMA_FILE if adapters else "ema.safetensors")
    if ema is not None and ema_file.is_file():
        for k, v in read_safetensors(ema_file).items():
            if k in ema:
                ema[k].copy_(v)
    scheduler.load_state_dict(trainer_state["scheduler"])
    rng = load_torch(folder / "rng.pt")
    torch.set_rng_state(rng["torch"])
    np.random.set_state(rng["numpy"])
    random.setstate(rng["python"])
    return trainer_state

