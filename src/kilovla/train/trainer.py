"""`kilovla train`: supervised VLA training on the data layer's packed plan, one process or many.

    kilovla train --config run.yaml --optim.lr=1e-4
    torchrun --nnodes N --nproc-per-node G -m kilovla train --config run.yaml

One optimizer step per global batch. Each rank gets its packed rows of the step from the plan
(the same global batch whatever the world size, the same number of rows on every rank) and
accumulates gradients over them; only the last row's backward reduces across ranks
(`distributed.gradient_sync`: DDP's no_sync, FSDP2's set_requires_gradient_sync). The loss of a row is the sum of its samples' losses scaled by
world_size / global_batch_size, so the averaged gradient is the mean over the global batch however
samples fall into rows and ranks; flow-matching noise and time are drawn per sample from
(seed, step, sample id), so they do not depend on the split either. That is what makes runs
resumable on another world size and a 2-process run equal to a 1-process one.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import signal
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from kilovla import config as config_mod
from kilovla.data import DataLake, GlobalBatchPlan, LakeSource, PlanConfig, TokenLayout, build_loader
from kilovla.data.lerobot import DatasetMeta
from kilovla.errors import KilovlaError
from kilovla.models.attention import resolve_backend
from kilovla.models.checkpoints import (is_sharded_policy_folder, load_sharded, load_weights, open_init_checkpoint,
                                        plan_load)
from kilovla.models.groot import GrootConfig, GrootModel
from kilovla.models.presets import build_model, policy_defaults, preset
from kilovla.models.processor import STATS_FOR, PolicyMeta, Processor
from kilovla.models.tokenize import find_tokenizer
from kilovla.train import checkpoint as ckpt
from kilovla.train.optim import OptimConfig, build_optimizer, clip_gradients
from kilovla.train import distributed
from kilovla.train.metrics import MetricsLogger, mfu, plot_learning_curve

log = logging.getLogger(__name__)


@dataclass
class DatasetConfig:
    roots: list[str] = field(default_factory=list)
    weights: list[float] | None = None
    video_backend: str = "auto"


@dataclass
class PolicyConfig:
    preset: str = "pi05-tiny"
    overrides: dict = field(default_factory=dict)  # model config fields, e.g. {"packing": true}
    camera_map: dict = field(default_factory=dict)  # empty: dataset cameras in order -> enabled model slots
    state_keys: list[str] = field(default_factory=lambda: ["observation.state"])
    # Unset (None) fields take the preset's fine-tuning defaults (models/presets.py, POLICY_DEFAULTS).
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
    image_resize: str | None = None  # stretch, pad
    augmentation: dict | None = None  # ImageAugmentation fields ({} turns the preset's off)


@dataclass
class BatchConfig:
    global_batch_size: int = 32  # samples per optimizer step, whatever the world size
    global_batch_tokens: int | None = None  # or tokens per optimizer step
    token_budget: int = 4096  # most tokens in one packed row (one forward pass)


@dataclass
class ParallelConfig:
    strategy: str = "ddp"  # or fsdp (one FSDP2 unit per transformer layer)
    bucket_cap_mb: int = 25
    gradient_as_bucket_view: bool = True
    static_graph: bool = False  # refused on several ranks: breaks accumulation over rows (see validate_config)
    find_unused_parameters: bool = False
    timeout_s: float = 1800.0  # a collective (or a step) that takes longer ends the run, naming rank and step


@dataclass
class LoaderConfig:
    engine: str = "inprocess"  # inprocess, torch, ray
    num_workers: int = 0


@dataclass
class CheckpointConfig:
    every: int = 500
    keep: int = 3


@dataclass
class EvalConfig:
    every: int = 0  # steps between closed-loop evaluations; 0: never
    env: str = "metaworld"
    tasks: list[str] = field(default_factory=list)
    episodes: int = 5
    batch_size: int = 5
    resolution: int = 64
    max_steps: int | None = None
    timeout_s: float = 3600.0  # how long the other ranks wait for rank 0's evaluation


@dataclass
class TrainConfig:
    run_dir: str = "runs/default"
    seed: int = 0
    steps: int = 1000
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    dataset: DatasetConfig = field(default_factory=DatasetConfig)
    batch: BatchConfig = field(default_factory=BatchConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    loader: LoaderConfig = field(default_factory=LoaderConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    ema_decay: float | None = None
    freeze_vision: bool | None = None  # unset: the preset's (GR00T N1.5 freezes its backbone)
    freeze_vlm: bool | None = None
    expert_only: bool = False
    gradient_checkpointing: bool = False
    precision: str = "auto"  # auto (bf16 autocast on CUDA, fp32 on CPU), fp32, bf16
    log_sample_ids: bool = False
    progress: bool = True


# -- setup ---------------------------------------------------------------------------------------------
PRECISIONS = ("auto", "fp32", "bf16")
STRATEGIES = ("ddp", "fsdp")


def validate_config(cfg: TrainConfig, world_size: int = 1) -> None:
    """Refuse values the run cannot use, before anything is built, read or written."""
    problems = []
    if cfg.batch.global_batch_tokens is None and cfg.batch.global_batch_size < 1:
        problems.append(f"batch.global_batch_size must be >= 1, not {cfg.batch.global_batch_size}")
    if cfg.batch.global_batch_tokens is not None and cfg.batch.global_batch_tokens < 1:
        problems.append(f"batch.global_batch_tokens must be >= 1, not {cfg.batch.global_batch_tokens}")
    if cfg.batch.token_budget < 1:
        problems.append(f"batch.token_budget must be >= 1, not {cfg.batch.token_budget}")
    if cfg.precision not in PRECISIONS:
        problems.append(f"precision must be one of {', '.join(PRECISIONS)}, not {cfg.precision!r}")
    if cfg.parallel.strategy not in STRATEGIES:
        problems.append(f"parallel.strategy must be one of {', '.join(STRATEGIES)}, not {cfg.parallel.strategy!r}")
    if cfg.eval.every < 0 or (cfg.eval.every and cfg.eval.episodes < 1):
        problems.append(f"eval.every must be >= 0 and eval.episodes >= 1 (got {cfg.eval.every}, {cfg.eval.episodes})")
    if problems:
        raise KilovlaError("; ".join(problems))
    if cfg.parallel.static_graph and cfg.parallel.strategy == "ddp" and world_size > 1:
        # The plan may give a rank several packed rows in any step; those are accumulated under
        # no_sync, which DDP's static graph does not support (PyTorch asserts expect_autograd_hooks_
        # at the first such row), so the run would die inside PyTorch at some step.
        raise KilovlaError("parallel.static_graph=true cannot be used on several ranks: a step accumulates "
                           "over several packed rows per rank (no_sync), which DDP's static graph does not "
                           "support; leave parallel.static_graph=false")


def check_evaluation(cfg: TrainConfig, meta: PolicyMeta) -> None:
    """The checks the first closed-loop evaluation would make (tasks known, policy fits the env's
    action, state and cameras), made at start so a mismatch costs no training."""
    from types import SimpleNamespace

    from kilovla.envs.base import check_tasks, env_spec
    from kilovla.eval.closed_loop import check_compatible

    if cfg.eval.env == "metaworld":
        from kilovla.envs import metaworld

        check_tasks(cfg.eval.env, list(cfg.eval.tasks), metaworld.task_names())
    elif not cfg.eval.tasks:
        raise KilovlaError(f"eval.every is set but eval.tasks is empty: name the {cfg.eval.env} tasks to evaluate")
    import inspect

    from kilovla.eval.closed_loop import evaluate

    cameras = inspect.signature(evaluate).parameters["cameras"].default  # what _evaluate will run with
    spec = env_spec(cfg.eval.env, cfg.eval.tasks[0], cameras=cameras,
                    **({"max_steps": cfg.eval.max_steps} if cfg.eval.max_steps else {}))
    policy = SimpleNamespace(name=meta.preset, action_dim=meta.action_dim, state_dim=meta.state_dim,
                             state_keys=list(meta.state_keys),
                             cameras=tuple(k.removeprefix("observation.images.") for k in meta.camera_map))
    check_compatible(policy, spec)


def attention_in_use(model_cfg, device: torch.device) -> str:
    """The attention that runs: the varlen backend on the packed path, masked SDPA on the padded one."""
    if getattr(model_cfg, "packing", False):
        return resolve_backend(model_cfg.attention_backend, device)
    return "padded (sdpa)"


def _start_weights(cfg: TrainConfig, d) -> None:
    """Say loudly (or refuse) when a large model would start from random weights."""
    if cfg.policy.init_from:
        return
    if d.needs_weights and not cfg.policy.random_init:
        raise KilovlaError(f"{cfg.policy.preset} is a fine-tuning recipe: give --policy.init_from=PATH (published "
                           "weights), or --policy.random_init=true to train it from random weights")
    if d.needs_weights or cfg.policy.preset.endswith("-3b"):
        log.warning("%s starts from RANDOM weights (no --policy.init_from): this trains a 3B model from scratch",
                    cfg.policy.preset)


def _check_tokenizer_size(processor: Processor, model_cfg) -> None:
    tok = processor.tokenizer
    vocab = model_cfg.lm.vocab_size if hasattr(model_cfg, "lm") else model_cfg.llm.vocab_size
    if tok.kind != "byte" and tok.vocab_size < 0.5 * vocab:
        log.warning("the %s tokenizer %s has %d tokens, under half the model's %d-token embedding: is it the "
                    "tokenizer of these weights?", tok.kind, getattr(tok, "path", "") or "", tok.vocab_size, vocab)


def with_policy_defaults(cfg: TrainConfig) -> TrainConfig:
    """Fill what the run leaves unset from the preset's fine-tuning defaults; find the tokenizer."""
    d, p = policy_defaults(cfg.policy.preset), cfg.policy
    pick = lambda mine, default: default if mine is None else mine  # noqa: E731
    near = [Path(p.init_from).expanduser()] if p.init_from else []
    policy = dataclasses.replace(
        p, normalization=pick(p.normalization, d.normalization),
        state_in_prompt=pick(p.state_in_prompt, d.state_in_prompt), embodiment_id=pick(p.embodiment_id, d.embodiment_id),
        image_resize=pick(p.image_resize, d.image_resize), augmentation=pick(p.augmentation, d.augmentation.to_dict()),
        tokenizer=find_tokenizer(d.tokenizer, p.tokenizer, near, p.preset))
    return dataclasses.replace(cfg, policy=policy, freeze_vision=pick(cfg.freeze_vision, d.freeze_vision),
                               freeze_vlm=pick(cfg.freeze_vlm, d.freeze_vlm))


def _chunk(model_cfg) -> int:
    return getattr(model_cfg, "chunk_size", None) or model_cfg.action_horizon


def policy_meta(cfg: TrainConfig, model_cfg, metas: list[DatasetMeta], init_from: dict | None = None) -> PolicyMeta:
    """How the policy reads this dataset: camera map, state keys, dims, stats; checked for fit.
    `cfg` has its defaults filled (`with_policy_defaults`)."""
    first = metas[0]
    problems = []
    for m in metas[1:]:
        if m.video_keys != first.video_keys or m.features["action"].shape != first.features["action"].shape:
            problems.append(f"{m.root} has cameras/actions unlike {first.root}")
    enabled = model_cfg.enabled_cameras
    camera_map = dict(cfg.policy.camera_map) or dict(zip(first.video_keys, enabled))
    if not cfg.policy.camera_map and len(first.video_keys) > len(enabled):
        problems.append(f"the dataset has {len(first.video_keys)} cameras {first.video_keys}, the model "
                        f"{cfg.policy.preset} takes {len(enabled)} ({list(enabled)}); set policy.camera_map")
    for key in camera_map:
        if key not in first.video_keys:
            problems.append(f"policy.camera_map names {key!r}, not a camera of {first.root}")
    if "action" not in first.features:
        problems.append(f"{first.root} has no 'action' feature")
    missing_state = [k for k in cfg.policy.state_keys if k not in first.features]
    if missing_state:
        problems.append(f"state keys {missing_state} are not features of {first.root}")
    if problems:
        raise KilovlaError("the dataset does not fit the policy: " + "; ".join(problems))
    needed = [*cfg.policy.state_keys, "action"]
    if cfg.policy.stats == "recompute":
        from kilovla.data.stats import feature_stats, stats_to_json

        columns = [m.load_columns(needed) for m in metas]
        stats = stats_to_json({k: feature_stats(np.concatenate([c[k] for c in columns])) for k in needed})
    elif cfg.policy.stats == "dataset":
        stats_rel = "meta/stats.json"
        stats = first.files.read_json(stats_rel)
        mode_keys = STATS_FOR.get(cfg.policy.normalization, ("mean", "std"))
        lacking = [k for k in needed if k not in stats or any(s not in stats[k] for s in mode_keys)]
        if lacking:
            raise KilovlaError(f"{first.files.path(stats_rel)}: no {'/'.join(mode_keys)} stats for {lacking} "
                               "(`kilovla data stats PATH` recomputes them)")
    else:
        raise KilovlaError(f"policy.stats must be recompute or dataset, not {cfg.policy.stats!r}")
    state_dim = int(sum(np.prod(first.features[k].shape) for k in cfg.policy.state_keys))
    action_dim = int(np.prod(first.features["action"].shape))
    return PolicyMeta(preset=cfg.policy.preset, overrides=cfg.policy.overrides, camera_map=camera_map,
                      state_keys=list(cfg.policy.state_keys), state_dim=state_dim, action_dim=action_dim,
                      stats={k: stats[k] for k in needed}, normalization=cfg.policy.normalization,
                      state_in_prompt=cfg.policy.state_in_prompt, n_action_steps=cfg.policy.n_action_steps,
                      embodiment_id=cfg.policy.embodiment_id, tokenizer=cfg.policy.tokenizer,
                      image_resize=cfg.policy.image_resize, augmentation=dict(cfg.policy.augmentation),
                      init_from=init_from)


def apply_freeze(model, *, freeze_vision: bool = False, freeze_vlm: bool = False,
                 gradient_checkpointing: bool = False) -> None:
    """Stop gradients to the vision tower (and its projector) or the whole VLM; switch on recompute."""
    groot = isinstance(model, GrootModel)
    if freeze_vision:
        parts = [model.eagle.vision_model, model.eagle.mlp1] if groot else [model.vlm.vision_tower, model.vlm.multi_modal_projector]
        for p in parts:
            p.requires_grad_(False)
    if freeze_vlm:
        (model.backbone if groot else model.paligemma_with_expert.paligemma).requires_grad_(False)
    if gradient_checkpointing:
        if groot:
            log.warning("gradient checkpointing is implemented for pi0/pi0.5; GR00T trains without it")
        else:
            model.gradient_checkpointing = True


def _sample_noise(model_cfg, seed: int, step: int, sample_ids: np.ndarray, family_time) -> tuple[torch.Tensor, torch.Tensor]:
    """Noise and flow time per sample from (seed, step, sample id): independent of rows and ranks."""
    horizon, dim = _chunk(model_cfg), model_cfg.max_action_dim
    noise, beta = [], []
    for sid in sample_ids.tolist():
        rng = np.random.default_rng([seed, step, sid])
        noise.append(rng.standard_normal((horizon, dim)))
        beta.append(rng.beta(1.5, 1.0))
    return (torch.as_tensor(np.stack(noise), dtype=torch.float32),
            family_time(torch.as_tensor(beta, dtype=torch.float32)))


def _memory_mb(device: torch.device) -> float:
    """Peak memory of this process so far: CUDA allocations, or the peak resident set on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**10  # KiB on Linux


class _Faults:
    """Deterministic faults for the crash and hang tests, from the environment:
    KILOVLA_FAULT_AFTER_STEP=N SIGKILLs the run after step N's checkpoint;
    KILOVLA_FAULT_HANG=R:N makes rank R stop answering when step N begins."""

    def __init__(self, rank: int):
        self.kill_after = int(os.environ.get("KILOVLA_FAULT_AFTER_STEP", "-1"))
        hang = os.environ.get("KILOVLA_FAULT_HANG", "")
        r, _, n = hang.partition(":")
        self.hang_at = int(n) if hang and int(r) == rank else -1

    def step_begins(self, step: int) -> None:
        if step == self.hang_at:
            time.sleep(10**6)

    def step_done(self, step: int) -> None:
        if step == self.kill_after:
            os.kill(os.getpid(), signal.SIGKILL)


def _dump_gradients(model, trainable_names: list[str], step: int, world) -> None:
    """KILOVLA_DUMP_GRADS=DIR: the full gradient of every trainable parameter before the optimizer step,
    as DIR/step_NNNNNN.safetensors (rank 0), for the equivalence tests of accumulation and sharding."""
    out = os.environ.get("KILOVLA_DUMP_GRADS")
    if not out:
        return
    from kilovla.models.checkpoints import save_safetensors

    grads = {}
    for name, p in model.named_parameters():
        if name in trainable_names:
            g = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad  # a collective when sharded
            grads[name] = g.detach().cpu().clone()
    if world.is_main:
        save_safetensors(grads, Path(out) / f"step_{step:06d}.safetensors")


# -- the loop ------------------------------------------------------------------------------------------
def train(cfg: TrainConfig, resume: str | None = None, on_eval=None) -> dict:
    t_start = time.perf_counter()
    validate_config(cfg, int(os.environ.get("WORLD_SIZE", "1")))
    world = distributed.init(cfg.parallel.timeout_s)
    run_dir = Path(cfg.run_dir)
    if not cfg.dataset.roots:
        raise KilovlaError("no dataset: set dataset.roots (a list of LeRobot dataset folders)")
    torch.manual_seed(cfg.seed)
    _start_weights(cfg, policy_defaults(cfg.policy.preset))
    cfg = with_policy_defaults(cfg)
    overrides = dict(cfg.policy.overrides)
    model_cfg = preset(cfg.policy.preset, **overrides)
    init = None
    init_record = None
    if cfg.policy.init_from and is_sharded_policy_folder(cfg.policy.init_from):
        # An FSDP run's intermediate checkpoint (weights only in state/): read as load_checkpoint does.
        model = build_model(cfg.policy.preset, device="meta", **overrides)
        init_record = {"path": str(Path(cfg.policy.init_from).expanduser().resolve()), "layout": "kilovla"}
    elif cfg.policy.init_from:  # checked against the model from the file headers, before any work
        init = open_init_checkpoint(cfg.policy.init_from)
        model = build_model(cfg.policy.preset, device="meta", **overrides)
        plan_load(model, init)
        init_record = {"path": str(init.path.resolve()), "layout": init.layout}
    metas = [DatasetMeta(r) for r in cfg.dataset.roots]
    meta = policy_meta(cfg, model_cfg, metas, init_from=init_record)
    processor = Processor(model_cfg, meta)
    _check_tokenizer_size(processor, model_cfg)
    if cfg.eval.every:
        check_evaluation(cfg, meta)
    chunk = _chunk(model_cfg)
    weights = cfg.dataset.weights or [1.0] * len(metas)
    sources = [LakeSource(root=str(r), weight=w, delta_timestamps={"action": [i / m.fps for i in range(chunk)]})
               for r, w, m in zip(cfg.dataset.roots, weights, metas)]
    suffix = model_cfg.action_head_tokens if isinstance(model_cfg, GrootConfig) else chunk
    layout = TokenLayout(tokens_per_camera=model_cfg.vision.tokens, cameras=tuple(meta.camera_map),
                         max_language_tokens=model_cfg.max_language_tokens,
                         state_tokens=4 * meta.state_dim if meta.state_in_prompt else 0,
                         action_horizon=suffix + (0 if getattr(model_cfg, "pi05", True) else 1))
    lake = DataLake(sources, layout, count_tokens=processor.token_count, video_backend=cfg.dataset.video_backend)
    plan = GlobalBatchPlan.from_lake(lake, PlanConfig(seed=cfg.seed, global_batch_size=cfg.batch.global_batch_size,
                                                      global_batch_tokens=cfg.batch.global_batch_tokens,
                                                      token_budget=cfg.batch.token_budget))
    if init is not None:  # materialised from the file tensor by tensor, in the model's (float32) dtype
        load_weights(model, init, device=world.device, progress=cfg.progress and world.is_main)
        log.info("initialised from %s (%s layout, stored %s)", init.path, init.layout, init.dtypes())
    elif init_record is not None:
        load_sharded(model, Path(init_record["path"]) / "state")
        model.to(world.device)
        log.info("initialised from %s (an FSDP checkpoint's state/)", init_record["path"])
    else:
        model = build_model(cfg.policy.preset, device=world.device, seed=cfg.seed, **overrides)
    apply_freeze(model, freeze_vision=cfg.freeze_vision, freeze_vlm=cfg.freeze_vlm or cfg.expert_only,
                 gradient_checkpointing=cfg.gradient_checkpointing)
    if cfg.ema_decay and cfg.parallel.strategy == "fsdp" and world.size > 1:
        raise KilovlaError("ema_decay with parallel.strategy=fsdp is not supported yet; use ddp or drop the EMA")
    cuda = world.device.type == "cuda"
    bf16 = cfg.precision == "bf16" or (cfg.precision == "auto" and cuda)
    step_model = distributed.parallelize(model, cfg.parallel.strategy, world, bucket_cap_mb=cfg.parallel.bucket_cap_mb,
                                         gradient_as_bucket_view=cfg.parallel.gradient_as_bucket_view,
                                         static_graph=cfg.parallel.static_graph,
                                         find_unused_parameters=cfg.parallel.find_unused_parameters, bf16=bf16)
    trainable, optimizer, scheduler = build_optimizer(model, cfg.optim, cfg.steps)
    trainable_names = [n for n, p in model.named_parameters() if p.requires_grad]
    n_trainable = sum(p.numel() for p in trainable)  # a sharded (DTensor) parameter reports its full size
    ema = ({n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
           if cfg.ema_decay else None)
    start_step = 0
    folder = ckpt.resolve(resume, run_dir) if resume else None
    if folder is not None:
        saved = json.loads((folder / "policy.json").read_text())
        if saved.get("preset") != cfg.policy.preset:
            raise KilovlaError(f"{folder}: a checkpoint of {saved.get('preset')!r}, not of {cfg.policy.preset!r}")
        state = ckpt.load(folder, model, ema, optimizer, scheduler, world)
        plan.load_state_dict(state["plan"])
        start_step = plan.step
    backend = attention_in_use(model_cfg, world.device)
    video_sources = [d for d in lake.datasets if d.meta.video_keys]
    frames_from_cache = bool(video_sources) and all(d.frame_cache is not None for d in video_sources)
    if world.is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.yaml").write_text(config_mod.dump_yaml(cfg))
        asked = f" ({model_cfg.attention_backend})" if model_cfg.packing and backend != model_cfg.attention_backend else ""
        start_line = (f"kilovla train: {cfg.policy.preset}, {world.size} rank(s)"
                      f"{f' ({cfg.parallel.strategy})' if world.size > 1 else ''}, attention {backend}{asked}, "
                      f"{'bf16' if bf16 else 'fp32'}, from step {start_step}"
                      f"{', frames from the frame cache' if frames_from_cache else ''}")
        log.info("%s", start_line)
        print(start_line, flush=True)  # once, on rank 0, with or without the progress bar
    logger = MetricsLogger(run_dir, enabled=world.is_main, resume_step=start_step if folder is not None else None)
    steps_left = cfg.steps - start_step
    if steps_left <= 0:
        return {"steps": start_step, "note": "nothing to do: the checkpoint is at the last step"}
    loader_kwargs = {"num_workers": cfg.loader.num_workers} if cfg.loader.engine == "torch" else {}
    loader = build_loader(cfg.loader.engine, lake, plan, rank=world.rank, world_size=world.size, steps=steps_left,
                          **loader_kwargs)
    autocast = torch.autocast(world.device.type, dtype=torch.bfloat16, enabled=bf16)
    family_time = lambda beta: (0.999 - beta) / 0.999 if isinstance(model, GrootModel) else beta * 0.999 + 0.001  # noqa: E731
    faults = _Faults(world.rank)
    watchdog = distributed.Watchdog(world)
    history: list[dict] = []
    progress = StepProgress("train", cfg.steps, start_step, enabled=cfg.progress and world.is_main)
    model.train()
    step_loss = step_tokens = step_capacity = data_wait = 0.0
    step_ids: list[int] = []
    step_rows = 0
    phase = f"step {start_step + 1}"
    t_step = time.perf_counter()
    rows = iter(loader)
    try:
        with progress:
            while True:
                t_wait = time.perf_counter()
                try:
                    row = next(rows)
                except StopIteration:
                    break
                data_wait += time.perf_counter() - t_wait
                step = row["step"]
                if row["row"] == 0:
                    phase = f"step {step + 1}"
                    faults.step_begins(step + 1)
                    watchdog.arm(phase, world.timeout_s)
                global_n = len(plan.global_batch(step))
                batch = processor.training_batch(row, seed=cfg.seed).to(world.device)
                noise, t = _sample_noise(model_cfg, cfg.seed, step, row["sample_index"], family_time)
                last = row["row"] == row["rows_in_step"] - 1
                # Every row but the step's last only accumulates: one gradient reduction per step.
                with distributed.gradient_sync(step_model, sync=last), autocast:
                    out = step_model(batch, noise=noise.to(world.device), time=t.to(world.device))
                    loss = out["per_sample"].sum() * (world.size / global_n)
                    loss.backward()
                step_loss += float(out["per_sample"].detach().sum())
                step_tokens += float(row["lengths"].sum())
                step_capacity += cfg.batch.token_budget
                step_ids += row["sample_index"].tolist()
                step_rows += 1
                if not last:
                    continue
                _dump_gradients(model, trainable_names, step + 1, world)
                grad_norm = clip_gradients(trainable, cfg.optim.clip_grad_norm)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad(set_to_none=True)
                if ema is not None:
                    with torch.no_grad():
                        for n, p in model.named_parameters():
                            if n in ema:
                                ema[n].mul_(cfg.ema_decay).add_(p.detach(), alpha=1 - cfg.ema_decay)
                elapsed = time.perf_counter() - t_step
                total_loss = distributed.all_reduce_sum(step_loss, world) / global_n
                tokens = distributed.all_reduce_sum(step_tokens, world)
                capacity = distributed.all_reduce_sum(step_capacity, world)
                record = {"kind": "train", "step": step + 1, "loss": total_loss, "lr": scheduler.get_last_lr()[0],
                          "grad_norm": grad_norm, "samples_per_s": global_n / elapsed, "tokens_per_s": tokens / elapsed,
                          "padding_fraction": 1 - tokens / capacity if capacity else 0.0,
                          "data_wait_fraction": data_wait / elapsed, "step_time_s": elapsed,
                          "rows_per_rank": step_rows, "peak_memory_mb": _memory_mb(world.device),
                          "world_size": world.size, "attention_backend": backend}
                if (util := mfu(n_trainable, tokens / elapsed / world.size, world.device)) is not None:
                    record["mfu"] = util
                if cfg.log_sample_ids:
                    record["sample_ids"] = sorted(i for ids in distributed.all_gather_objects(step_ids, world) for i in ids)
                logger.log(record)
                history.append(record)
                progress.update(step + 1, f"loss {record['loss']:.4f}  {record['samples_per_s']:.0f} samples/s")
                done = step + 1
                if done % cfg.checkpoint.every == 0 or done == cfg.steps:
                    phase = f"checkpoint at step {done}"
                    watchdog.arm(phase, world.timeout_s)
                    _save(run_dir, done, model, ema, optimizer, scheduler, plan, meta, cfg, metas[0], world,
                          final=done == cfg.steps)
                if cfg.eval.every and done % cfg.eval.every == 0:
                    phase = f"evaluation at step {done}"
                    watchdog.arm(phase, cfg.eval.timeout_s)
                    _evaluate(model, meta, cfg, done, logger, world, on_eval)
                watchdog.disarm()
                faults.step_done(done)
                step_loss = step_tokens = step_capacity = data_wait = 0.0
                step_ids, step_rows = [], 0
                t_step = time.perf_counter()
    except KilovlaError:
        raise
    except Exception as e:
        failure = distributed.collective_failure(e, world, phase)
        if failure is not None:
            raise failure from None
        raise
    finally:
        watchdog.close()
    logger.close()
    summary = {}
    if world.is_main and history:
        plot = plot_learning_curve(run_dir / "metrics.jsonl", run_dir / "learning_curve.png")
        tail = history[len(history) // 5:] or history
        summary = {"steps": history[-1]["step"], "samples_per_s": statistics.median(r["samples_per_s"] for r in tail),
                   "tokens_per_s": statistics.median(r["tokens_per_s"] for r in tail),
                   "padding_fraction": statistics.mean(r["padding_fraction"] for r in history),
                   "data_wait_fraction": statistics.mean(r["data_wait_fraction"] for r in tail),
                   "final_loss": history[-1]["loss"], "checkpoint": str(ckpt.latest(run_dir / "checkpoints")),
                   "attention_backend": backend, "frames_from_cache": frames_from_cache,
                   "plot": str(plot) if plot else None, "wall_s": time.perf_counter() - t_start}
        (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    distributed.shutdown()
    return summary


def _save(run_dir, step, model, ema, optimizer, scheduler, plan, meta, cfg, first_meta, world, final: bool) -> None:
    import dataclasses as dc

    ckpt.save(Path(run_dir) / "checkpoints" / f"step_{step:06d}", model=model, optimizer=optimizer,
              scheduler=scheduler, ema=ema, world=world,
              trainer_state={"step": step, "plan": plan.state_dict(), "world_size": world.size,
                             "strategy": cfg.parallel.strategy if world.size > 1 else "single"},
              policy_meta=dc.asdict(meta), config_yaml=config_mod.dump_yaml(cfg),
              stats=first_meta.files.read_json("meta/stats.json"), keep=cfg.checkpoint.keep, full_weights=final)


def _evaluate(model, meta, cfg, step, logger, world, on_eval) -> None:
    """Closed-loop evaluation on rank 0 while the other ranks wait at a barrier. A sharded model is
    gathered first (every rank takes part) into a plain copy on rank 0, so that no collective runs
    while only rank 0 is busy."""
    from kilovla.eval.closed_loop import evaluate
    from kilovla.models.policy import VLAPolicy

    eval_model = model
    if distributed.is_sharded(model):
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if world.is_main:
            eval_model = build_model(cfg.policy.preset, device="meta", **cfg.policy.overrides)
            eval_model.load_state_dict(full, assign=True)
    if world.is_main:
        policy = VLAPolicy(eval_model, meta, world.device)
        report = evaluate(policy, env=cfg.eval.env, tasks=list(cfg.eval.tasks), episodes=cfg.eval.episodes,
                          batch_size=cfg.eval.batch_size, resolution=cfg.eval.resolution,
                          max_steps=cfg.eval.max_steps, seed=cfg.seed)
        model.train()
        record = {"kind": "eval", "step": step, "success_rate": report["overall_success_rate"],
                  "crashed_episodes": report.get("crashed_episodes", 0),
                  **{f"success/{t}": r["success_rate"] for t, r in report["per_task"].items()}}
        logger.log(record)
        if on_eval is not None:
            on_eval(record)
    distributed.barrier(world, f"evaluation at step {step}", cfg.eval.timeout_s)


class StepProgress:
    """A rich progress bar over steps with a one-line summary beside it; silent when disabled.
    The trainer and the RL runner both show one."""

    def __init__(self, label: str, total: int, start: int, enabled: bool):
        self.enabled = enabled
        if enabled:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

            self._p = Progress(TextColumn(label), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[info]}"),
                               TimeRemainingColumn())
            self._task = self._p.add_task(label, total=total, completed=start, info="")

    def __enter__(self):
        if self.enabled:
            self._p.__enter__()
        return self

    def __exit__(self, *exc):
        if self.enabled:
            self._p.__exit__(*exc)

    def update(self, step: int, info: str) -> None:
        if self.enabled:
            self._p.update(self._task, completed=step, info=info)
