"""The pieces a supervised run is built from, each callable on its own (by the trainer, RL's learner,
LoRA or a parallelism plan), in the order `Trainer.__init__` calls them:

    start = plan_start(cfg, model_cfg)              # where the weights come from, checked from file headers
    meta = policy_meta(cfg, model_cfg, metas, ...)  # how the policy reads the data: cameras, state, stats
    processor = build_processor(cfg, model_cfg, meta)
    lake, layout, plan = build_data(cfg, model_cfg, meta, processor, metas)
    model = build_weights(cfg, start, model_cfg, world)   # materialised, on the run's device
    apply_freeze(model, ...)                        # then parallelize, build_optimizer, build_ema

`cfg` is a TrainConfig whose unset fields `with_policy_defaults` has filled.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from kilovla.data import DataLake, GlobalBatchPlan, LakeSource, PlanConfig, TokenLayout
from kilovla.data.meta import DatasetMeta
from kilovla.errors import KilovlaError
from kilovla.models.attention import resolve_backend
from kilovla.models.checkpoints import Checkpoint, is_sharded_policy_folder, load_sharded, load_weights, plan_load
from kilovla.models.family import chunk_length, family_of, moe_of, vocab_size
from kilovla.models.presets import build_model, policy_defaults
from kilovla.models.processor import CONSTANT, STATS_FOR, PolicyMeta, Processor
from kilovla.models.tokenize import find_tokenizer
from kilovla.policy_folder import STATE_DIR, Interface, PolicyFolder
from kilovla.train.config import TrainConfig, named, with_init_model

log = logging.getLogger(__name__)


def check_evaluation(cfg: TrainConfig, meta: PolicyMeta) -> None:
    """The checks the first closed-loop evaluation would make (tasks known, policy fits the env's
    action, state and cameras, no evaluation seed a demonstration started from), made at start so a
    mismatch costs no training."""
    from kilovla.eval.closed_loop import check_unseen_seeds

    settings = cfg.eval.settings(cfg.seed)  # what _evaluate will run
    settings.check_fits(Interface.of(meta))
    check_unseen_seeds(meta.demonstration_seeds, list(settings.tasks), settings.seed, settings.episodes,
                       env=settings.env, allow_seen_seeds=settings.allow_seen_seeds, who="eval.every's evaluation",
                       remedy="set another --seed (it also picks the evaluation's)")


def attention_in_use(model_cfg, device: torch.device) -> str:
    """The attention that runs: the varlen backend on the packed path, masked SDPA on the padded one."""
    if getattr(model_cfg, "packing", False):
        return resolve_backend(model_cfg.attention_backend, device)
    return "padded (sdpa)"


def start_weights(cfg: TrainConfig, d) -> None:
    """Say loudly (or refuse) when a large model would start from random weights."""
    if cfg.policy.init_from:
        return
    if d.needs_weights and not cfg.policy.random_init:
        raise KilovlaError(f"{cfg.policy.preset} is a fine-tuning recipe: give --policy.init_from=PATH (published "
                           "weights), or --policy.random_init=true to train it from random weights")
    if d.needs_weights or cfg.policy.preset.endswith("-3b"):
        log.warning("%s starts from RANDOM weights (no --policy.init_from): this trains a 3B model from scratch",
                    cfg.policy.preset)


def check_tokenizer_size(processor: Processor, model_cfg) -> None:
    tok = processor.tokenizer
    vocab = vocab_size(model_cfg)
    if tok.kind != "byte" and tok.vocab_size < 0.5 * vocab:
        log.warning("the %s tokenizer %s has %d tokens, under half the model's %d-token embedding: is it the "
                    "tokenizer of these weights?", tok.kind, getattr(tok, "path", "") or "", tok.vocab_size, vocab)


def with_policy_defaults(cfg: TrainConfig) -> TrainConfig:
    """Fill what the run leaves unset from the preset's fine-tuning defaults; find the tokenizer."""
    cfg = with_init_model(cfg)
    d, p = policy_defaults(cfg.policy.preset), cfg.policy
    pick = lambda mine, default: default if mine is None else mine  # noqa: E731
    near = [Path(p.init_from).expanduser()] if p.init_from else []
    start = PolicyFolder.find(near[0] if near[0].is_dir() else near[0].parent) if near else None
    policy = dataclasses.replace(
        p, state_keys=pick(p.state_keys, ["observation.state"]), normalization=pick(p.normalization, d.normalization),
        state_in_prompt=pick(p.state_in_prompt, d.state_in_prompt), embodiment_id=pick(p.embodiment_id, d.embodiment_id),
        image_resize=pick(p.image_resize, d.image_resize), augmentation=pick(p.augmentation, d.augmentation.to_dict()),
        tokenizer=find_tokenizer(d.tokenizer, p.tokenizer, near, p.preset, start and start.recorded_tokenizer))
    return dataclasses.replace(cfg, policy=policy, freeze_vision=pick(cfg.freeze_vision, d.freeze_vision),
                               freeze_vlm=pick(cfg.freeze_vlm, d.freeze_vlm))


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
        if cfg.policy.normalization == "quantile":
            stats = {**stats, **widen_collapsed_quantiles({k: stats[k] for k in needed}, first.files.path(stats_rel))}
    else:  # train/config.py check() refused any other name
        raise AssertionError(cfg.policy.stats)
    state_dim = int(sum(np.prod(first.features[k].shape) for k in cfg.policy.state_keys))
    action_dim = int(np.prod(first.features["action"].shape))
    image_size = [int(d) for d in first.features[next(iter(camera_map))].shape[:2]] if camera_map else None
    return PolicyMeta(image_size=image_size, preset=cfg.policy.preset, overrides=cfg.policy.overrides, camera_map=camera_map,
                      state_keys=list(cfg.policy.state_keys), state_dim=state_dim, action_dim=action_dim,
                      stats={k: stats[k] for k in needed}, normalization=cfg.policy.normalization,
                      state_in_prompt=cfg.policy.state_in_prompt, n_action_steps=cfg.policy.n_action_steps,
                      embodiment_id=cfg.policy.embodiment_id, tokenizer=cfg.policy.tokenizer,
                      image_resize=cfg.policy.image_resize, augmentation=dict(cfg.policy.augmentation),
                      init_from=init_from, demonstration_seeds=demonstration_seeds(metas, init_from))


def widen_collapsed_quantiles(stats: dict, source) -> dict:
    """`stats` with q01 / q99 set to min / max in the dimensions where the quantiles met but the values vary.

    With --policy.stats=dataset (the default recomputes quantiles over every frame, which do not meet): a
    dataset's stats.json holds each episode's quantiles averaged over episodes (LeRobot's aggregation), so a
    dimension constant within every episode and different across them (Meta-World's goal position, an object's
    start) gets q01 == q99: quantile normalisation then reads it as constant and feeds the policy 0, the goal
    invisible. min / max is its real range. One warning names the features and dimensions."""
    out, widened = {}, []
    for key, s in stats.items():
        if not all(f in s for f in ("q01", "q99", "min", "max")):
            out[key] = s
            continue
        lo, hi, mn, mx = (np.asarray(s[f], np.float64) for f in ("q01", "q99", "min", "max"))
        collapsed = (hi - lo < CONSTANT) & (mx - mn >= CONSTANT)
        if collapsed.any():
            widened.append(f"{key} {np.flatnonzero(collapsed).tolist()}")
            s = {**s, "q01": np.where(collapsed, mn, lo).tolist(), "q99": np.where(collapsed, mx, hi).tolist()}
        out[key] = s
    if widened:
        log.warning("%s: the averaged per-episode quantiles of %s meet (each episode constant there, the episodes "
                    "not): quantile normalisation would feed the policy 0; those dimensions use min/max instead",
                    source, "; ".join(widened))
    return out


def demonstration_seeds(metas: list[DatasetMeta], init_from: dict | None = None) -> dict[str, list[int]] | None:
    """The datasets' episode seeds per task, merged (sorted, once each) with those of the kilovla policy
    training starts from (its policy.json's, as it saw them too). None (unknown) as soon as one source
    records none (a dataset collected before the seed rule, LeRobot's own, a start policy that says
    null): a partial list would let eval claim that no evaluation seed was seen. One warning names them.

    >>> demonstration_seeds([collected_a, collected_b])  # doctest: +SKIP
    {'reach the red goal': [2000000000000000000, 2000000000000000001]}
    >>> demonstration_seeds([collected_a, lerobot_pusht])  # doctest: +SKIP
    None  (warning: ... lerobot_pusht records no episode seeds ...)
    """
    per_dataset, unknown = [], []
    for m in metas:
        seeds = m.episode_seeds()
        (unknown.append(str(m.root)) if seeds is None else per_dataset.append(seeds))
    if init_from is not None and init_from.get("layout") == "kilovla":
        path = Path(init_from["path"])
        source = PolicyFolder.find(path if path.is_dir() else path.parent)
        inherited = source.meta.demonstration_seeds if source is not None else None
        (unknown.append(f"{named('policy.init_from')}={path}") if inherited is None else per_dataset.append(inherited))
    if unknown:
        if per_dataset:  # all unknown is the plain case of data without seeds: nothing was dropped
            log.warning("%s record(s) no episode seeds: policy.json's demonstration_seeds is null (unknown), so eval "
                        "cannot tell which of its seeds the demonstrations started from", ", ".join(unknown))
        return None
    tasks = dict.fromkeys(t for seeds in per_dataset for t in seeds)
    return {t: sorted({s for seeds in per_dataset for s in seeds.get(t, ())}) for t in tasks}


def apply_freeze(model, *, freeze_vision: bool = False, freeze_vlm: bool = False,
                 gradient_checkpointing: bool = False) -> None:
    """Stop gradients to the vision tower (and its projector) or the whole VLM (the family's
    `freeze_groups`); switch on recompute where the family has it."""
    if not (freeze_vision or freeze_vlm or gradient_checkpointing):
        return
    fam = family_of(model)
    groups = fam.freeze_groups(model)
    for name, on in (("vision", freeze_vision), ("vlm", freeze_vlm)):
        for part in groups[name] if on else ():
            part.requires_grad_(False)
    if gradient_checkpointing:
        if fam.gradient_checkpointing:
            model.gradient_checkpointing = True
        else:
            log.warning("gradient checkpointing is not implemented for %s; it trains without it", fam.title)


@dataclass
class ModelStart:
    """Where a run's weights come from, settled before any work: a checkpoint file planned against the
    model built on the meta device (`init`), an FSDP checkpoint's `state/` (`record` only), or random
    weights (all None). `record` ({"path", "layout"}) goes into policy.json."""

    model: torch.nn.Module | None = None
    init: object | None = None  # models.checkpoints.InitCheckpoint
    record: dict | None = None


def open_init_checkpoint(path: str | Path) -> Checkpoint:
    """`--policy.init_from`: a policy folder, an openpi export, a LeRobot or Isaac-GR00T folder, or a file.
    A quantized policy folder is refused (training starts from float weights), and so are a LoRA run's
    unmerged adapters."""
    path = Path(path).expanduser()
    source = PolicyFolder.find(path)
    if source is not None:
        source.refuse_quantized("fine-tuning starts from float weights: use the folder it was quantized from")
        if source.adapters and not (path / "model.safetensors").is_file():
            raise KilovlaError(f"{path}: a LoRA run's adapters on their base, not weights to start from: use the "
                               "run's final checkpoint (merged), or resume the run with --resume")
    return Checkpoint.open(path)


def plan_start(cfg: TrainConfig, model_cfg) -> ModelStart:
    """A checkpoint to start from is checked against the model from its file headers alone."""
    overrides = dict(cfg.policy.overrides)
    if cfg.policy.init_from and is_sharded_policy_folder(cfg.policy.init_from):
        # An FSDP run's intermediate checkpoint (weights only in state/): read as load_checkpoint does.
        _refuse_sharded_upcycling(Path(cfg.policy.init_from).expanduser(), model_cfg)
        return ModelStart(build_model(cfg.policy.preset, device="meta", **overrides), None,
                          {"path": str(Path(cfg.policy.init_from).expanduser().resolve()), "layout": "kilovla"})
    if cfg.policy.init_from:
        init = open_init_checkpoint(cfg.policy.init_from)
        model = build_model(cfg.policy.preset, device="meta", **overrides)
        plan_load(model, init, upcycle=True)  # an MoE model may start from a dense checkpoint's MLPs
        return ModelStart(model, init, {"path": str(init.path.resolve()), "layout": init.layout})
    return ModelStart()


def _refuse_sharded_upcycling(folder: Path, model_cfg) -> None:
    """Upcycling reads a dense checkpoint's MLPs from its file; an FSDP run's intermediate checkpoint has only
    DCP shards (state/), which load as they were saved."""
    from kilovla.safe_load import read_dcp_metadata

    if moe_of(model_cfg) is None:
        return
    keys = read_dcp_metadata(folder / STATE_DIR / ".metadata").state_dict_metadata
    if not any(".router." in k for k in keys):
        raise KilovlaError(f"{folder}: an FSDP run's intermediate checkpoint of a dense model (DCP shards in "
                           f"{STATE_DIR}/) cannot start an MoE model: upcycle from the run's final checkpoint "
                           "(model.safetensors)")


def build_weights(cfg: TrainConfig, start: ModelStart, world) -> torch.nn.Module:
    """The model with its starting weights, on the run's device."""
    if start.init is not None:  # materialised from the file tensor by tensor, in the model's (float32) dtype
        load_weights(start.model, start.init, device=world.device, progress=cfg.progress and world.is_main, upcycle=True)
        log.info("initialised from %s (%s layout, stored %s)", start.init.path, start.init.layout, start.init.dtypes())
        if start.init.fresh_routers:
            log.info("upcycled: every expert of %d MoE layers starts as the dense checkpoint's MLP, routers fresh",
                     len(start.init.fresh_routers))
        return start.model
    if start.record is not None:
        load_sharded(start.model, Path(start.record["path"]) / "state")
        log.info("initialised from %s (an FSDP checkpoint's state/)", start.record["path"])
        return start.model.to(world.device)
    return build_model(cfg.policy.preset, device=world.device, seed=cfg.seed, **dict(cfg.policy.overrides))


def build_processor(cfg: TrainConfig, model_cfg, meta: PolicyMeta) -> Processor:
    """Dataset rows -> model batches; the tokenizer and the in-training evaluation checked for fit."""
    processor = Processor(model_cfg, meta)
    check_tokenizer_size(processor, model_cfg)
    if cfg.eval.every:
        check_evaluation(cfg, meta)
    return processor


def token_layout(model_cfg, meta: PolicyMeta) -> TokenLayout:
    """How many tokens the model spends on a sample, as the plan counts them."""
    fam = family_of(model_cfg)
    return TokenLayout(tokens_per_camera=fam.camera_tokens(model_cfg), cameras=tuple(meta.camera_map),
                       max_language_tokens=model_cfg.max_language_tokens,
                       state_tokens=4 * meta.state_dim if meta.state_in_prompt else 0,
                       action_horizon=fam.action_tokens(model_cfg))


def build_data(cfg: TrainConfig, model_cfg, meta: PolicyMeta, processor: Processor,
               metas: list[DatasetMeta], index=None) -> tuple[DataLake, TokenLayout, GlobalBatchPlan]:
    """The lake over the run's datasets (action windows of the model's chunk) and its seeded plan; `index`: the
    datasets' lake index (`LakeIndex`), or None to read each."""
    chunk = chunk_length(model_cfg)
    weights = cfg.dataset.weights or [1.0] * len(metas)
    sources = [LakeSource(root=str(r), weight=w, delta_timestamps={"action": [i / m.fps for i in range(chunk)]})
               for r, w, m in zip(cfg.dataset.roots, weights, metas)]
    layout = token_layout(model_cfg, meta)
    lake = DataLake(sources, layout, count_tokens=processor.token_count, video_backend=cfg.dataset.video_backend,
                    index=index)
    plan = GlobalBatchPlan.from_lake(lake, PlanConfig(seed=cfg.seed, global_batch_size=cfg.batch.global_batch_size,
                                                      global_batch_tokens=cfg.batch.global_batch_tokens,
                                                      token_budget=cfg.batch.token_budget))
    return lake, layout, plan


def build_lora(model: torch.nn.Module, settings, cfg: TrainConfig, start: ModelStart, world) -> dict:
    """peft adapters on the run's starting weights (models/lora.py); returns policy.json's `lora` section,
    which names the base (the init_from checkpoint, or preset + seed + device of a random start)."""
    from kilovla.models.lora import apply_lora, describe

    base = {"preset": cfg.policy.preset, "overrides": dict(cfg.policy.overrides)}
    base.update({"init_from": start.record} if start.record else {"seed": cfg.seed, "device": world.device.type})
    if start.record is None and not settings.full and world.is_main:
        # adapters learn a correction to weights that carry something; on a random base everything they
        # wrap stays random and frozen, which is rarely what the run means
        log.warning("LoRA on RANDOM weights (no --policy.init_from): the base stays random and frozen, only the "
                    "adapters train; give --policy.init_from, or name modules to train in full with "
                    "--policy.lora.full")
    apply_lora(model, settings)
    if start.init is not None and start.init.fresh_routers and not any(
            p.requires_grad for n, p in model.named_parameters() if n.endswith(".router.weight")):
        raise KilovlaError(f"{named('policy.lora.rank')}={settings.rank} on an MoE model upcycled from the dense "
                           f"{cfg.policy.init_from}: LoRA keeps experts and routers frozen, so every expert would stay "
                           "a copy of the dense MLP and every router at its random start; train the MoE layers in full "
                           f"({named('policy.lora.full', '--policy.lora.full')}=[{start.init.fresh_routers[0]}, ...]) or upcycle "
                           "without LoRA")
    n = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters())
    log.info("LoRA rank %d: %d trainable parameters of %d (%.2f%%)", settings.rank, n, total, 100 * n / total)
    return describe(settings, model, base, merged=False)


def check_resume_lora(folder: Path, saved: dict | None, mine: dict) -> None:
    """A LoRA checkpoint resumes only on the base and adapter shape it was trained with."""
    if not saved:
        raise KilovlaError(f"{folder}: not a LoRA checkpoint (policy.json has no lora section): resume it without "
                           "--policy.lora.rank, or start a new run_dir")
    def value(section, key):  # alpha unset is alpha = rank
        v = section.get(key)
        return section.get("rank") if key == "alpha" and v is None else v

    for key in ("rank", "alpha", "dropout", "targets", "full", "fingerprint"):
        if value(saved, key) != value(mine, key):
            raise KilovlaError(f"{folder}: its LoRA {key} is {value(saved, key)!r}, this run's {value(mine, key)!r}"
                               + (" (the base weights differ: another init_from or seed)" if key == "fingerprint" else ""))


def build_ema(model: torch.nn.Module, decay: float | None) -> dict[str, torch.Tensor] | None:
    """A copy of every trainable parameter, or None without an EMA."""
    return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad} if decay else None


@torch.no_grad()
def update_ema(ema: dict[str, torch.Tensor] | None, model: torch.nn.Module, decay: float) -> None:
    if ema is None:
        return
    for n, p in model.named_parameters():
        if n in ema:
            ema[n].mul_(decay).add_(p.detach(), alpha=1 - decay)


def flow_time(model) -> callable:
    """The family's flow time from a Beta(1.5, 1) draw (GR00T's t runs from noise (0) to actions (1))."""
    return family_of(model).flow_time
