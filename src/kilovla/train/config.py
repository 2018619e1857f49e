"""The settings of a supervised run (`kilovla train --config run.yaml --optim.lr=1e-4`) and the checks
made on them before anything is built, read or written.

Each section is a dataclass filled from YAML and dotted overrides (`kilovla.config.load_config`);
unset policy fields (None) take the preset's fine-tuning defaults (`build.with_policy_defaults`).
A kilovla policy folder given as `policy.init_from` brings the preset and model overrides its weights
were trained with (`with_init_model`), as LeRobot's `--policy.path` brings a checkpoint's config.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from contextvars import ContextVar
from dataclasses import dataclass, field

from kilovla.errors import KilovlaError
from kilovla.eval.settings import EvalSettings
from kilovla.models.lora import LoraSettings
from kilovla.models.moe import MoEConfig
from kilovla.train.optim import OptimSettings


@dataclass
class DatasetConfig:
    roots: list[str] = field(default_factory=list)
    weights: list[float] | None = None
    video_backend: str = "auto"
    # the lake index (data/lake_index.py): "auto" (at its default place, built or brought up to date on
    # start), a path, or null (read and validate every dataset's meta/ and frames in every rank)
    index: str | None = "auto"


@dataclass
class PolicyConfig:
    preset: str | None = None  # unset: the init_from policy folder's, else DEFAULT_PRESET (with_init_model)
    overrides: dict = field(default_factory=dict)  # model config fields, e.g. {"packing": true}
    camera_map: dict = field(default_factory=dict)  # empty: dataset cameras in order -> enabled model slots
    state_keys: list[str] | None = None  # unset: the init_from policy folder's, else ["observation.state"]
    # Unset (None) fields take the init_from policy folder's (INTERFACE), else the preset's fine-tuning
    # defaults (models/presets.py, POLICY_DEFAULTS).
    normalization: str | None = None  # quantile, mean_std, min_max
    state_in_prompt: bool | None = None
    n_action_steps: int | None = None
    embodiment_id: int | None = None
    # "recompute": exact stats over every frame of the training data (the default: LeRobot's stats.json
    # averages per-episode quantiles, which collapses features that are constant within an episode,
    # like a goal position, to zero width); "dataset": meta/stats.json as stored.
    stats: str = "recompute"
    init_from: str | None = None  # a checkpoint to fine-tune: policy folder, openpi, LeRobot or Isaac-GR00T
    random_init: bool = False  # allow a fine-tuning preset (pi05-base, groot-n15...) to start from random weights
    tokenizer: str | None = None  # "byte" or a path; unset: the preset's kind, found next to init_from
    image_resize: str | None = None  # stretch, pad, pad_top_left
    augmentation: dict | None = None  # ImageAugmentation fields ({} turns the preset's off)
    lora: LoraSettings = field(default_factory=LoraSettings)  # --policy.lora.rank=16: LoRA adapters (models/lora.py)
    # --policy.moe.num_experts=8: routed experts in the action expert (models/moe.py); written into
    # `overrides` (as `moe`) by with_init_model, so policy.json records it as the model's
    moe: MoEConfig = field(default_factory=MoEConfig)


@dataclass
class BatchConfig:
    global_batch_size: int = 32  # samples per optimizer step, whatever the world size
    global_batch_tokens: int | None = None  # or tokens per optimizer step
    token_budget: int = 4096  # most tokens in one packed row (one forward pass)


@dataclass
class ParallelConfig:
    strategy: str = "ddp"  # or fsdp (one FSDP2 unit per transformer layer); with tp, on the data dimension
    tp: int = 1  # tensor-parallel degree: ranks that share one model replica (train/tensor_parallel.py)
    pp: int = 1  # pipeline stages over pi0's decoder layers or GR00T's DiT blocks, 1F1B (train/pipeline.py)
    ep: int = 1  # expert-parallel degree: data-parallel ranks that split the routed experts (train/expert_parallel.py)
    bucket_cap_mb: int = 25
    gradient_as_bucket_view: bool = True
    static_graph: bool = False  # refused on several ranks: breaks accumulation over rows (see validate_config)
    find_unused_parameters: bool = False
    # a collective (or a step) that takes longer ends the run, naming rank and step; unset: 1800, and under
    # torchrun elastic a step's deadline is 10x the median step, at least 300 (train/elastic.py)
    timeout_s: float | None = None


@dataclass
class LoaderConfig:
    engine: str = "inprocess"  # inprocess, torch, ray
    num_workers: int = 0


@dataclass
class CheckpointConfig:
    every: int = 500
    keep: int = 3
    every_minutes: float | None = None  # also a checkpoint once this much wall time passed since the last one
    async_save: bool = False  # write model + optimizer in the background from a staged copy (DCP async_save)


@dataclass(frozen=True, kw_only=True)
class InTrainingEval(EvalSettings):
    """The `eval:` section: what the closed-loop evaluation during training runs (EvalSettings' fields,
    with smaller defaults) and when. Its seed defaults to the run's (`settings`)."""

    every: int = 0  # steps between closed-loop evaluations; 0: never
    tasks: tuple[str, ...] = ()
    episodes: int = 5
    batch_size: int = 5
    seed: int | None = None  # None: the run's seed
    timeout_s: float = 3600.0  # how long the other ranks wait for rank 0's evaluation

    def settings(self, run_seed: int) -> InTrainingEval:
        """These settings with the evaluation seed filled in: the run's unless `seed` says otherwise."""
        return self if self.seed is not None else dataclasses.replace(self, seed=run_seed)


@dataclass
class TrainConfig:
    run_dir: str = "runs/default"
    seed: int = 0
    steps: int = 1000
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    dataset: DatasetConfig = field(default_factory=DatasetConfig)
    batch: BatchConfig = field(default_factory=BatchConfig)
    # unset fields: the preset's recipe (PolicyDefaults.optim), else OptimConfig's (filled by with_init_model)
    optim: OptimSettings = field(default_factory=OptimSettings)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    loader: LoaderConfig = field(default_factory=LoaderConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    eval: InTrainingEval = field(default_factory=InTrainingEval)
    ema_decay: float | None = None
    freeze_vision: bool | None = None  # unset: the preset's (GR00T N1.5 freezes its backbone)
    freeze_vlm: bool | None = None
    expert_only: bool = False
    gradient_checkpointing: bool = False
    precision: str = "auto"  # auto (bf16 autocast on CUDA, fp32 on CPU), fp32, bf16
    log_sample_ids: bool = False
    progress: bool = True


# The flags `kilovla train` was given for config keys ({"steps": "--steps", "policy.init_from":
# "--policy.path"}): messages about a key name it as the user typed it; a YAML user reads the key.
_TYPED: ContextVar[dict[str, str]] = ContextVar("typed_flags", default={})


@contextlib.contextmanager
def typed_flags(flags: dict[str, str]):
    """While inside, `named(key)` is the flag in `flags` that set `key`."""
    token = _TYPED.set(flags)
    try:
        yield
    finally:
        _TYPED.reset(token)


def named(key: str, otherwise: str | None = None) -> str:
    """`key` as the user gave it: its typed flag, else `otherwise` (a remedy's flag), else the key."""
    return _TYPED.get().get(key, otherwise or key)


DEFAULT_PRESET = "pi05-tiny"
PRECISIONS = ("auto", "fp32", "bf16")
LOADER_ENGINES = ("inprocess", "torch", "ray")


def _flat(d: dict, prefix: str = "") -> dict:
    """{"lm": {"width": 96}} -> {"lm.width": 96}"""
    out = {}
    for k, v in d.items():
        out.update(_flat(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v})
    return out


def _merged(base: dict, mine: dict) -> dict:
    out = dict(base)
    for k, v in mine.items():
        out[k] = _merged(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def with_init_model(cfg: TrainConfig) -> TrainConfig:
    """The run's preset and model overrides: a kilovla policy folder as `policy.init_from` brings its own
    (the model its weights fit), under the ones the run sets that it lacks, and the policy interface
    (INTERFACE: state keys, cameras, ...) for the fields the run leaves unset; a value the run sets that
    differs from the folder's is refused in one line. Without such a folder an unset preset is
    DEFAULT_PRESET. The optimizer settings the run leaves unset are then that preset's recipe's
    (`with_optim_recipe`). Applying it twice changes nothing.

        init_from trained with preset pi05-tiny, overrides {chunk_size: 4}; the run sets {packing: true}
        -> preset pi05-tiny, overrides {chunk_size: 4, packing: true}
        the run sets {chunk_size: 8} -> KilovlaError naming policy.overrides.chunk_size, 8 and 4
    """
    from pathlib import Path

    from kilovla.folders import policy_folder
    from kilovla.policy_folder import PolicyFolder

    cfg = _moe_in_overrides(cfg)
    p = cfg.policy
    if p.init_from:  # a run folder or its checkpoints/latest: the run's newest complete checkpoint, read once here
        p = dataclasses.replace(p, init_from=str(policy_folder(Path(p.init_from).expanduser())))
        cfg = dataclasses.replace(cfg, policy=p)
    folder = PolicyFolder.find(p.init_from) if p.init_from else None
    if folder is None:
        return with_optim_recipe(cfg if p.preset else
                                 dataclasses.replace(cfg, policy=dataclasses.replace(p, preset=DEFAULT_PRESET)))
    if folder.meta.residual is not None:  # training loads model.safetensors, the base: the actor would be lost
        raise KilovlaError(f"{folder.path}: an RL policy folder (policy.json has a residual actor), which supervised "
                           "training would drop: train from the policy folder its RL run started from")
    preset, overrides = folder.meta.preset, folder.meta.overrides
    where = f"{named('policy.init_from').removeprefix('--')}={p.init_from} was trained with"  # beside bare keys
    if p.preset and p.preset != preset:
        raise KilovlaError(f"policy.preset={p.preset} but {where} preset {preset}: drop policy.preset (the folder's "
                           "is used) or start from weights of that preset")
    theirs, mine = _flat(overrides), _flat(dict(p.overrides))
    for key, value in mine.items():
        if key in theirs and theirs[key] != value and key not in TRAINING_OVERRIDES:
            raise KilovlaError(f"policy.overrides.{key}={value!r} but {where} {key}={theirs[key]!r}: drop the "
                               "override (the folder's is used) or start from other weights")
    brought = {}
    for key, value in _interface(folder).items():
        mine = getattr(p, key)
        if mine is None or mine == {}:
            brought[key] = value
        elif mine != value and key not in ADJUSTABLE:
            raise KilovlaError(f"policy.{key}={mine!r} but {where} {key}={value!r}: drop policy.{key} (the folder's "
                               "is used) or start from other weights")
    return with_optim_recipe(dataclasses.replace(cfg, policy=dataclasses.replace(
        p, preset=preset, **brought, overrides=_merged(overrides, dict(p.overrides)))))


def with_optim_recipe(cfg: TrainConfig) -> TrainConfig:
    """`cfg` with its `optim` filled (OptimSettings.filled): the run's values, else the recipe of its preset
    (PolicyDefaults.optim: smolvla-base's is LeRobot's), else OptimConfig's defaults. Filling twice changes nothing."""
    from kilovla.models.presets import policy_defaults

    return dataclasses.replace(cfg, optim=cfg.optim.filled(policy_defaults(cfg.policy.preset).optim))


# Model overrides that are training choices, not the weights' shape: a run may set others than its init_from's.
TRAINING_OVERRIDES = ("moe.aux_loss_coef", "moe.z_loss_coef", "moe.capacity_factor")


def _moe_in_overrides(cfg: TrainConfig) -> TrainConfig:
    """`policy.moe` fields set (those unlike MoEConfig's defaults) moved into `policy.overrides.moe`, where the
    model config and policy.json take them (all of MoEConfig's fields when num_experts is set, so a folder
    does not depend on later defaults); a family without an MoE option refuses them in one line.

        policy.moe.aux_loss_coef=0.1 -> policy.overrides {"moe": {"aux_loss_coef": 0.1}}
        policy.moe.num_experts=8 -> policy.overrides {"moe": {"num_experts": 8, "top_k": 2, ...}}
    """
    from kilovla.models.family import families, family_of
    from kilovla.models.presets import preset

    p, default = cfg.policy, MoEConfig()
    given = {f.name: getattr(p.moe, f.name) for f in dataclasses.fields(MoEConfig)
             if getattr(p.moe, f.name) != getattr(default, f.name)}
    if not given:
        return cfg
    if "num_experts" in given:
        given = dataclasses.asdict(p.moe)
    fam = family_of(preset(p.preset)) if p.preset else None
    if fam is not None and fam.moe is None:
        raise KilovlaError(f"policy.moe: {fam.title} ({p.preset}) has no mixture-of-experts option; the families "
                           f"with one: {', '.join(f.title for f in families() if f.moe is not None)}")
    overrides = _merged(dict(p.overrides), {"moe": given})
    return dataclasses.replace(cfg, policy=dataclasses.replace(p, moe=default, overrides=overrides))


def check_start_exists(cfg: TrainConfig) -> None:
    """A starting checkpoint that is not there stops the run before its datasets are read (validate_config
    does not look: a config file may name weights that are fetched later)."""
    from pathlib import Path

    start = cfg.policy.init_from
    if start and not Path(start).expanduser().exists():
        raise KilovlaError(f"{named('policy.init_from')} {start}: no such checkpoint file or folder")


# The policy-interface settings a kilovla policy folder's policy.json records that a run starting from
# it inherits (how its weights read observations and emit actions: LeRobot's --policy.path brings the
# input features the same way): without them a fine-tune silently dropped state dims or cameras the
# base was trained on. Not brought: the tokenizer (found next to init_from by build.find_tokenizer),
# the stats (recomputed on the new data), augmentation (a training choice, not the interface).
INTERFACE = ("camera_map", "state_keys", "normalization", "state_in_prompt", "n_action_steps", "embodiment_id",
             "image_resize")
# Of those, how many actions of a chunk run before the next prediction is an execution choice the weights do
# not fix: brought as the default, and a run may set another.
ADJUSTABLE = ("n_action_steps",)


def _interface(folder) -> dict:
    """The INTERFACE values `folder` (a PolicyFolder)'s policy.json records (set, non-empty ones)."""
    values = {k: getattr(folder.meta, k) for k in INTERFACE if k in folder.recorded}
    return {k: v for k, v in values.items() if v not in (None, {}, [])}


STRATEGIES = ("ddp", "fsdp")
STATS_MODES = ("recompute", "dataset")


def validate_config(cfg: TrainConfig, world_size: int = 1) -> None:
    """Refuse values the run cannot use, before anything is built, read or written."""
    from kilovla.models.presets import preset

    from kilovla.models.family import chunk_length
    from kilovla.train.expert_parallel import ep_problems

    cfg = with_init_model(cfg)
    model_cfg = preset(cfg.policy.preset, **dict(cfg.policy.overrides))  # every override's key and type
    problems = _count_problems(cfg)
    steps, chunk = cfg.policy.n_action_steps, chunk_length(model_cfg)
    if steps is not None and not 1 <= steps <= chunk:
        problems.append(f"policy.n_action_steps must be in [1, {chunk}] (the model predicts chunks of {chunk}), "
                        f"not {steps}")
    if cfg.batch.global_batch_tokens is None and cfg.batch.global_batch_size < 1:
        problems.append(f"batch.global_batch_size must be >= 1, not {cfg.batch.global_batch_size}")
    if cfg.batch.global_batch_tokens is not None and cfg.batch.global_batch_tokens < 1:
        problems.append(f"batch.global_batch_tokens must be >= 1, not {cfg.batch.global_batch_tokens}")
    if cfg.batch.token_budget < 1:
        problems.append(f"batch.token_budget must be >= 1, not {cfg.batch.token_budget}")
    problems += _choice_problems(cfg)
    if cfg.eval.every < 0 or (cfg.eval.every and cfg.eval.episodes < 1):
        problems.append(f"eval.every must be >= 0 and eval.episodes >= 1 (got {cfg.eval.every}, {cfg.eval.episodes})")
    problems += cfg.policy.lora.check()
    problems += _mesh_problems(cfg, world_size)
    problems += ep_problems(cfg, world_size)
    if cfg.policy.lora.enabled and cfg.expert_only:
        problems.append("policy.lora.rank and expert_only are two ways to choose what trains: pick one")
    if cfg.policy.lora.enabled and (cfg.freeze_vision is not None or cfg.freeze_vlm is not None):
        problems.append("with policy.lora the base is frozen whole and the adapters choose what trains: drop "
                        "freeze_vision / freeze_vlm (policy.lora.vision and .llm add adapters there)")
    if problems:
        raise KilovlaError("; ".join(problems))
    if cfg.parallel.static_graph and cfg.parallel.strategy == "ddp" and world_size > 1:
        # The plan may give a rank several packed rows in any step; those are accumulated under
        # no_sync, which DDP's static graph does not support (PyTorch asserts expect_autograd_hooks_
        # at the first such row), so the run would die inside PyTorch at some step.
        raise KilovlaError("parallel.static_graph=true cannot be used on several ranks: a step accumulates "
                           "over several packed rows per rank (no_sync), which DDP's static graph does not "
                           "support; leave parallel.static_graph=false")


def _choice_problems(cfg: TrainConfig) -> list[str]:
    """A named mode that is none of its names (`--policy.normalization=minmax`), before anything is built."""
    from kilovla.models.images import RESIZE_MODES
    from kilovla.models.processor import NORMALIZATIONS

    choices = [("precision", cfg.precision, PRECISIONS), ("parallel.strategy", cfg.parallel.strategy, STRATEGIES),
               ("loader.engine", cfg.loader.engine, LOADER_ENGINES), ("policy.stats", cfg.policy.stats, STATS_MODES),
               ("policy.normalization", cfg.policy.normalization, NORMALIZATIONS),
               ("policy.image_resize", cfg.policy.image_resize, RESIZE_MODES)]
    return [f"{named(key)} must be one of {', '.join(names)}, not {value!r}" for key, value, names in choices
            if value is not None and value not in names]


def _count_problems(cfg: TrainConfig) -> list[str]:
    """Counts and rates that mean nothing (a run of 0 steps, a checkpoint every 0 steps), which would
    otherwise finish at once, divide by zero at the first step, or fail after config.yaml is written."""
    problems = []
    at_least = [("steps", cfg.steps, 1), ("checkpoint.every", cfg.checkpoint.every, 1),
                ("checkpoint.keep", cfg.checkpoint.keep, 0), ("loader.num_workers", cfg.loader.num_workers, 0),
                ("optim.warmup_steps", cfg.optim.warmup_steps, 0)]
    if cfg.eval.every:
        at_least.append(("eval.batch_size", cfg.eval.batch_size, 1))
    problems += [f"{named(name)} must be >= {low}, not {value}" for name, value, low in at_least if value < low]
    paths = [("run_dir", cfg.run_dir), ("policy.init_from", cfg.policy.init_from),
             ("policy.tokenizer", cfg.policy.tokenizer), ("dataset.index", cfg.dataset.index),
             *(("dataset.roots", root) for root in cfg.dataset.roots)]
    problems += [f"{named(name)} is empty: give a path" + (" or leave it unset" if name != "run_dir" else "")
                 for name, value in paths if isinstance(value, str) and not value.strip()]
    if not cfg.optim.lr >= 0:
        problems.append(f"optim.lr must be >= 0, not {cfg.optim.lr}")
    if not 0 <= cfg.optim.min_lr_ratio <= 1:
        problems.append(f"optim.min_lr_ratio must be in [0, 1], not {cfg.optim.min_lr_ratio}")
    if cfg.ema_decay is not None and not 0 <= cfg.ema_decay < 1:
        problems.append(f"ema_decay must be in [0, 1) (0 or unset: no EMA), not {cfg.ema_decay}")
    if cfg.parallel.timeout_s is not None and not cfg.parallel.timeout_s > 0:
        problems.append(f"parallel.timeout_s must be > 0, not {cfg.parallel.timeout_s}")
    if cfg.checkpoint.every_minutes is not None and not 0 < cfg.checkpoint.every_minutes < math.inf:
        problems.append(f"checkpoint.every_minutes must be a number > 0 (or unset), not {cfg.checkpoint.every_minutes}")
    if cfg.checkpoint.async_save and cfg.policy.lora.enabled:
        problems.append("checkpoint.async_save with policy.lora is not supported yet: save synchronously "
                        "(checkpoint.async_save=false)")
    weights = cfg.dataset.weights
    if weights is not None and (len(weights) != len(cfg.dataset.roots) or not all(w > 0 for w in weights)):
        problems.append(f"dataset.weights must be one positive number per dataset.roots entry "
                        f"({len(cfg.dataset.roots)}), not {list(weights)}")
    return problems


def _mesh_problems(cfg: TrainConfig, world_size: int) -> list[str]:
    """What a tp/pp mesh cannot do with these settings or this world size."""
    p = cfg.parallel
    if p.tp < 1 or p.pp < 1:
        return [f"parallel.tp and parallel.pp must be >= 1 (got {p.tp}, {p.pp})"]
    if p.tp == 1 and p.pp == 1:
        return []
    from kilovla.models.presets import preset
    from kilovla.train.pipeline import pp_problems
    from kilovla.train.tensor_parallel import tp_problems

    problems = []
    if world_size % (p.tp * p.pp):
        problems.append(f"parallel.tp={p.tp} x parallel.pp={p.pp} does not divide the world size {world_size} "
                        "(torchrun --nproc-per-node x --nnodes)")
    model_cfg = preset(cfg.policy.preset, **dict(cfg.policy.overrides))
    if p.tp > 1:
        problems += tp_problems(model_cfg, p.tp)
    if p.pp > 1:
        problems += pp_problems(model_cfg, p.pp)
        if p.strategy == "fsdp":
            problems.append("parallel.pp with parallel.strategy=fsdp is not supported yet: use ddp on the data "
                            "dimension (a stage holds 1/pp of the layers already)")
        if cfg.eval.every:
            problems.append("eval.every with parallel.pp is not supported yet: evaluate the checkpoints with "
                            "kilovla eval")
    mesh = " and ".join(f"parallel.{k}" for k in ("tp", "pp") if getattr(p, k) > 1)
    if cfg.ema_decay:
        problems.append(f"ema_decay with {mesh} is not supported yet: drop the EMA or the {mesh}")
    if cfg.policy.lora.enabled:
        problems.append(f"policy.lora with {mesh} is not supported yet: LoRA fits a 3B model on one device "
                        "(docs/usage.md, LoRA); drop one of them")
    return problems
