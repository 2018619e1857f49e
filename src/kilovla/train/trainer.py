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

The run is a `Trainer` built from parts (`train.build`) in a visible order, with one method per
level of work, after torchtitan's `train.py`:

    trainer = Trainer(cfg, world, resume_from)   # model, processor, lake, plan, parallel, optimizer, EMA, resume
    trainer.forward_backward(row, ...)           # one packed row: loss, backward (reduced on the step's last row)
    trainer.pipeline_forward_backward(rows, ...) # or, on a pipeline stage, the step's rows as 1F1B micro-batches
    trainer.train_step(rows)                     # a rank's rows of one step, then clip + optimizer + EMA
    trainer.train()                              # the loop: metrics, checkpoints, evaluation, faults
    trainer.state_dict() / load_state_dict()     # step and plan position (checkpoint.py holds the tensors)

`train(cfg, resume)` checks the settings, the datasets and the run_dir before any of it. Under
torchrun's elastic agent a restart of the same job resumes its newest checkpoint by itself
(train/elastic.py).

A NaN or inf stops the run at its step (KilovlaError naming the step and the term, exit 2): the
global loss and gradient norm are checked before the optimizer step, on every rank alike, and the
weights before every checkpoint, so no checkpoint and no summary.json ever holds a non-finite value.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import signal
import statistics
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from kilovla import config as config_mod
from kilovla.data import TokenLayout, build_loader
from kilovla.data.meta import DatasetMeta
from kilovla.data.lake_index import LakeIndex
from kilovla.data.validate import check_dataset
from kilovla.data.writer import _atomic_write_text
from kilovla.errors import KilovlaError
from kilovla.folders import RUN, claim_run_dir, clear
from kilovla.models.batch import PaddedBatch
from kilovla.models.family import chunk_length, family_of, moe_of
from kilovla.models.moe import MoEMeter, training_loss
from kilovla.models.presets import build_model, policy_defaults, preset
from kilovla.progress import StepProgress
from kilovla.train import checkpoint as ckpt
from kilovla.train import distributed, elastic, pipeline
from kilovla.train.build import (apply_freeze, attention_in_use, build_data, build_ema, build_lora, build_processor,
                                 build_weights, check_resume_lora, flow_time, plan_start, policy_meta,
                                 start_weights, update_ema, with_policy_defaults)
from kilovla.train.config import TrainConfig, check_start_exists, validate_config, with_init_model
from kilovla.train.metrics import MetricsLogger, mfu, plot_learning_curve, read_metrics
from kilovla.train.optim import build_optimizer, clip_gradients

log = logging.getLogger(__name__)
__all__ = ["Trainer", "TrainConfig", "train"]


def train(cfg: TrainConfig, resume: str | None = None, on_eval=None) -> dict:
    """Check, build, run; returns the summary (also run_dir/summary.json on rank 0)."""
    t_start = time.perf_counter()
    check_start_exists(cfg)
    run_dir = Path(cfg.run_dir)
    restart = elastic.restart_of(run_dir)  # read before the process group forms, so before any rank writes it
    if restart is not None:  # the same elastic job again: its newest complete checkpoint, whatever --resume says
        resume = "auto"
    folder = ckpt.resolve(resume, run_dir) if resume else None
    if folder is not None:
        cfg = ckpt.with_resumed_start(folder, cfg)  # config.yaml and policy.json keep naming the run's start
    cfg = with_init_model(cfg)  # a policy folder to start from brings its preset and overrides
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    elastic.check_world(cfg.parallel.tp, cfg.parallel.pp, world_size, restart, cfg.parallel.ep)
    validate_config(cfg, world_size)
    if not cfg.dataset.roots:
        raise KilovlaError("no dataset: set dataset.roots (a list of LeRobot dataset folders)")
    index = None
    if cfg.dataset.index is None:
        for root in cfg.dataset.roots:  # what `kilovla data validate` calls an error stops the run here
            check_dataset(root)
    else:  # the same checks, recorded once per dataset version in the lake index
        index = LakeIndex.open(cfg.dataset.roots, None if cfg.dataset.index == "auto" else cfg.dataset.index)
        for entry in index.datasets():
            check_dataset(entry.root, problems=entry.problems)
    world = distributed.init(cfg.parallel.timeout_s or elastic.UNMEASURED_DEADLINE_S, tp=cfg.parallel.tp,
                             pp=cfg.parallel.pp, ep=cfg.parallel.ep)
    if world.is_main:
        elastic.warn_shared_store(world.size)
    if folder is not None:  # before the run_dir and its config.yaml say otherwise
        ckpt.check_resumed_settings(folder, cfg)
    use = claim_run_dir(run_dir, resume, folder, main=world.is_main)
    if folder is not None:
        at = json.loads((folder / "trainer_state.json").read_text())["step"]
        if at > cfg.steps:
            raise KilovlaError(f"{folder}: the checkpoint is at step {at}, past steps={cfg.steps}: "
                               f"set --steps above {at} to continue it")
        if at == cfg.steps:
            print(f"nothing to do: {folder} is at the last step ({at})", flush=True)
            return {"steps": at, "note": "nothing to do: the checkpoint is at the last step"}
    trainer = Trainer(cfg, world, resume_from=folder, on_eval=on_eval, index=index)
    if restart is not None and world.is_main:  # before a replaced run_dir loses what the earlier start logged
        trainer.restart = (restart, max((r["step"] for r in read_metrics(run_dir / "metrics.jsonl")
                                         if r.get("kind", "train") == "train"), default=0))
    if folder is not None and world.is_main:  # the checkpoint loaded: a branch from an earlier step can start
        ckpt.branch_at(run_dir / "checkpoints", folder)
    trainer.open_run_dir(replace=use == "replace")
    summary = trainer.train(t_start)
    # All ranks leave together: a process group torn down while a peer is still writing the summary
    # (after a pipeline's point-to-point sends) can abort in gloo's destructor.
    distributed.barrier(world, "the end of the run")
    distributed.shutdown()
    return summary


@dataclass
class _Totals:
    """Sums over a step's rows on this rank (then over ranks), or over a whole run."""

    loss: float = 0.0
    samples: float = 0.0
    tokens: float = 0.0  # real tokens, as the plan counts them
    tensor_tokens: float = 0.0  # token positions the forward passes computed, padding included
    capacity: float = 0.0  # rows x token budget
    data_wait: float = 0.0
    rows: int = 0
    moe: MoEMeter = dataclasses.field(default_factory=MoEMeter)  # routing figures (an MoE expert's)


class Trainer:
    """One supervised run. Construction builds every component, in the order each needs the last."""

    def __init__(self, cfg: TrainConfig, world: distributed.World, resume_from: Path | None = None, on_eval=None,
                 index: LakeIndex | None = None):
        torch.manual_seed(cfg.seed)
        start_weights(cfg, policy_defaults(cfg.policy.preset))
        self.cfg = cfg = with_policy_defaults(cfg)
        self.world, self.on_eval, self.resume_from = world, on_eval, resume_from
        self.run_dir = Path(cfg.run_dir)
        self.model_cfg = preset(cfg.policy.preset, **dict(cfg.policy.overrides))
        start = plan_start(cfg, self.model_cfg)
        self.metas = [d.meta for d in index.datasets()] if index else [DatasetMeta(r) for r in cfg.dataset.roots]
        self.meta = policy_meta(cfg, self.model_cfg, self.metas, init_from=start.record)
        self.processor = build_processor(cfg, self.model_cfg, self.meta)
        self.lake, self.layout, self.plan = build_data(cfg, self.model_cfg, self.meta, self.processor, self.metas, index)
        self.model = build_weights(cfg, start, world)
        self.lora = cfg.policy.lora if cfg.policy.lora.enabled else None
        if self.lora is not None:  # adapters on a frozen base: the freeze switches have nothing left to freeze
            self.lora_section = build_lora(self.model, self.lora, cfg, start, world)
            apply_freeze(self.model, gradient_checkpointing=cfg.gradient_checkpointing)
        else:
            apply_freeze(self.model, freeze_vision=cfg.freeze_vision, freeze_vlm=cfg.freeze_vlm or cfg.expert_only,
                         gradient_checkpointing=cfg.gradient_checkpointing)
        if cfg.ema_decay and cfg.parallel.strategy == "fsdp" and world.size > 1:
            raise KilovlaError("ema_decay with parallel.strategy=fsdp is not supported yet; use ddp or drop the EMA")
        self.shared, self.schedule = [], None
        if world.pp > 1:  # this rank's stage keeps its own layers only
            self.shared = pipeline.keep_stage(self.model, world.pp_rank, world.pp)
            self.stage_layers = pipeline.stage_layers(self.model_cfg, world.pp, world.pp_rank)
            self.schedule = pipeline.Schedule(world)
        self.bf16 = cfg.precision == "bf16" or (cfg.precision == "auto" and world.device.type == "cuda")
        p = cfg.parallel
        self.step_model = distributed.parallelize(self.model, p.strategy, world, bucket_cap_mb=p.bucket_cap_mb,
                                                  gradient_as_bucket_view=p.gradient_as_bucket_view,
                                                  static_graph=p.static_graph,
                                                  find_unused_parameters=p.find_unused_parameters, bf16=self.bf16)
        self.trainable, self.optimizer, self.scheduler = build_optimizer(self.model, cfg.optim, cfg.steps)
        self.trainable_names = [n for n, p in self.model.named_parameters() if p.requires_grad]
        self.n_trainable = sum(p.numel() for p in self.trainable)  # a sharded (DTensor) parameter reports its full size
        # the parameters every pipeline stage holds alike (their gradients summed over the stages)
        self.shared_params = [p for n, p in self.model.named_parameters() if n in self.shared]
        self.shared_ids = frozenset(id(p) for p in self.shared_params)
        if world.pp > 1:  # a stage holds its own layers: the model's count is the stages' sum (shared ones once)
            shared = sum(p.numel() for p in self.shared_params if p.requires_grad)
            self.n_trainable = int(distributed.all_reduce_sum(self.n_trainable - shared, world, over="pp")) + shared
        self.ema = build_ema(self.model, cfg.ema_decay)
        self.step = 0
        if resume_from is not None:
            self.load_checkpoint(resume_from)
        self.backend = attention_in_use(self.model_cfg, world.device)
        self.family_time = flow_time(self.model)
        self.autocast = torch.autocast(world.device.type, dtype=torch.bfloat16, enabled=self.bf16)
        self.phase = f"step {self.step + 1}"  # what a collective failure or timeout is reported as
        self.faults = _Faults(world.rank, world.size)
        self.pending: ckpt.PendingSave | None = None  # the asynchronous checkpoint in flight
        self.save_group = distributed.side_group(world) if cfg.checkpoint.async_save else None
        self.stager = ckpt.staging_buffers() if cfg.checkpoint.async_save else None
        self.last_save = time.monotonic()  # for checkpoint.every_minutes
        self.restart: tuple[dict, int] | None = None  # an elastic restart: the previous start's record, its last step
        self.step_times: deque[float] = deque(maxlen=50)  # this start's last step times: the elastic step deadline

    # -- state ---------------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """The trainer's own state (the tensors are saved by checkpoint.py beside it)."""
        return {"step": self.step, "plan": self.plan.state_dict(), "world_size": self.world.size,
                "strategy": self.cfg.parallel.strategy if self.world.size > 1 else "single", "tp": self.world.tp}

    def load_state_dict(self, state: dict) -> None:
        self.plan.load_state_dict(state["plan"])
        self.step = self.plan.step

    def load_checkpoint(self, folder: Path) -> None:
        saved = ckpt.check_same_model(folder, self.cfg.policy.preset).meta
        ckpt.check_same_moe(folder, saved.overrides or {}, dict(self.cfg.policy.overrides))
        if self.lora is not None:
            check_resume_lora(folder, saved.lora, self.lora_section)
        elif saved.lora:
            raise KilovlaError(f"{folder}: a LoRA run's checkpoint (rank {saved.lora.get('rank')}): resume it with "
                               "the same --policy.lora settings")
        self.load_state_dict(ckpt.load(folder, self.model, self.ema, self.optimizer, self.scheduler, self.world,
                                       adapters=self.lora is not None))

    @torch.no_grad()
    def check_finite_weights(self) -> None:
        """Raise before a checkpoint would hold a NaN or inf: finite losses and gradients can still step
        a weight past float range (a learning rate of 1e40). Every rank counts its own pieces (a
        shard's, a stage's) and takes the sum over all ranks, so all stop or none does."""
        tensors = [*self.model.parameters(), *(self.ema or {}).values()]
        local = sum(float((~torch.isfinite(t.to_local() if hasattr(t, "to_local") else t)).sum()) for t in tensors)
        if distributed.all_reduce_sum(local, self.world):
            raise KilovlaError(f"step {self.step}: weights are NaN or inf after the optimizer step (optim.lr="
                               f"{self.cfg.optim.lr:g} too high?): stopped before writing a checkpoint; the last "
                               "one written is intact")

    def save_checkpoint(self, final: bool) -> None:
        """A checkpoint of this step: in the background under checkpoint.async_save (not the last one),
        after the one in flight is complete."""
        cfg, meta = self.cfg, self.meta
        if self.lora is not None:  # adapters on their base; the last checkpoint's weights are merged ones
            merged = final and self.lora.merge
            meta = dataclasses.replace(meta, lora={**self.lora_section, "merged": merged})
        self.finish_pending()
        folder = self.run_dir / "checkpoints" / f"step_{self.step:06d}"
        parts = dict(model=self.model, optimizer=self.optimizer, scheduler=self.scheduler, world=self.world,
                     trainer_state=self.state_dict(), policy_meta=dataclasses.asdict(meta),
                     config_yaml=config_mod.dump_yaml(cfg), stats=self.metas[0].files.read_json("meta/stats.json"),
                     keep=cfg.checkpoint.keep, on_written=self.faults.in_checkpoint(self.step))
        if cfg.checkpoint.async_save and not final:
            self.pending = ckpt.save_async(folder, **parts, ema=self.ema, group=self.save_group,
                                           stager=self.stager)
        else:
            ckpt.save(folder, **parts, ema=self.ema, full_weights=final, lora=self.lora)
        self.last_save = time.monotonic()

    def finish_pending(self, wait: bool = True) -> None:
        """Make the asynchronous checkpoint in flight visible once written (`wait`: block until it is)."""
        if self.pending is not None and (wait or self.pending.done()):
            pending, self.pending = self.pending, None
            pending.finish()

    def checkpoint_due(self) -> bool:
        """checkpoint.every steps, the last step, or checkpoint.every_minutes since the last save began
        on any rank (a collective then: every rank saves, or none)."""
        cfg, done = self.cfg, self.step
        if done % cfg.checkpoint.every == 0 or done == cfg.steps:
            return True
        if cfg.checkpoint.every_minutes is None:
            return False
        late = time.monotonic() - self.last_save >= cfg.checkpoint.every_minutes * 60
        return distributed.all_reduce_sum(float(late), self.world) > 0

    # -- one row, one step -----------------------------------------------------------------------------
    def _row_inputs(self, row: dict) -> tuple:
        """A packed row's batch, flow noise and time on the device, and what scales its summed loss so
        a step's gradient is the global batch's mean."""
        step, world = row["step"], self.world
        batch = self.processor.training_batch(row, seed=self.cfg.seed).to(world.device)
        noise, t = _sample_noise(self.model_cfg, self.cfg.seed, step, row["sample_index"], self.family_time)
        return batch, noise.to(world.device), t.to(world.device), world.dp_size / len(self.plan.global_batch(step))

    def forward_backward(self, row: dict, totals: _Totals) -> None:
        """Loss and backward over one packed row; gradients are reduced across ranks only on the step's
        last row."""
        batch, noise, t, scale = self._row_inputs(row)
        last = row["row"] == row["rows_in_step"] - 1
        with distributed.gradient_sync(self.step_model, sync=last), self.autocast:
            out = self.step_model(batch, noise=noise, time=t)
            loss = training_loss(out) * scale  # the flow-matching loss (+ an MoE's routing losses)
            loss.backward()
        totals.loss += float(out["per_sample"].detach().sum())
        totals.moe.add(out, len(out["per_sample"]))
        self._count(row, batch, totals)

    def pipeline_forward_backward(self, rows: list[dict], totals: _Totals) -> None:
        """A step's rows through this rank's pipeline stage, as micro-batches of the 1F1B schedule
        (train/pipeline.py); the loss exists on the last stage only."""
        inputs = [self._row_inputs(row) for row in rows]

        def forward(i, receive):
            batch, noise, t, scale = inputs[i]
            with self.autocast:
                out = self.model.forward_stage(batch, noise=noise, time=t, layers=self.stage_layers, receive=receive)
            samples = len(rows[i]["sample_index"])
            totals.moe.add(out, samples)  # this stage's layers' routing
            if "hidden" not in out:  # the last stage
                totals.loss += float(out["per_sample"].detach().sum())
                return training_loss(out) * scale
            if "moe_regularizer" in out:  # this stage's routing losses, once per sample as training_loss adds them
                *rest, last = out["hidden"]
                return (*rest, pipeline.carry_loss(last, out["moe_regularizer"] * samples * scale))
            return out["hidden"]

        self.schedule.run(len(rows), forward)
        for row, (batch, *_) in zip(rows, inputs):
            self._count(row, batch, totals)

    def _count(self, row: dict, batch, totals: _Totals) -> None:
        real = float(row["lengths"].sum())
        totals.tokens += real
        totals.tensor_tokens += _tensor_tokens(batch, self.model_cfg, self.layout, real)
        totals.capacity += self.cfg.batch.token_budget
        totals.rows += 1

    def train_step(self, rows: Iterator[dict], faults: _Faults, watchdog) -> dict | None:
        """The rank's rows of the next step, pulled from `rows` as they compute, then clip, optimizer
        step, schedule and EMA. Returns the step's metrics record (None when the plan has no rows left)."""
        cfg, world = self.cfg, self.world
        totals, ids, step_rows = _Totals(), [], []
        t_step = time.perf_counter()
        while True:
            t_wait = time.perf_counter()
            row = next(rows, None)
            if row is None:
                return None
            totals.data_wait += time.perf_counter() - t_wait
            if row["row"] == 0:
                self.phase = f"step {row['step'] + 1}"
                watchdog.arm(self.phase, elastic.step_deadline(cfg.parallel.timeout_s, list(self.step_times)))
                faults.step_begins(row["step"] + 1, row)
            if self.schedule is None:
                self.forward_backward(row, totals)
            else:  # a pipeline stage runs the step's rows together
                step_rows.append(row)
            ids += row["sample_index"].tolist()
            if row["row"] == row["rows_in_step"] - 1:
                break
        if self.schedule is not None:
            self.pipeline_forward_backward(step_rows, totals)
            pipeline.sum_shared_gradients(self.shared_params, world)
        self.step = row["step"] + 1
        if world.mesh is not None and not distributed.is_fsdp(self.model):  # ddp on the data dimension
            distributed.data_parallel_reduce(self.trainable, world)
        elif world.ep > 1:  # fsdp with expert shards
            distributed.fsdp_expert_average(self.trainable, world)
        _dump_gradients(self.model, self.trainable_names, self.step, world)
        if world.mesh is not None:
            grad_norm = distributed.mesh_clip_gradients(self.trainable, cfg.optim.clip_grad_norm, world,
                                                        self.shared_ids)
        else:
            grad_norm = clip_gradients(self.trainable, cfg.optim.clip_grad_norm)
        summed = self._sum_over_ranks(totals)
        try:
            check_finite_step(self.step, summed["loss"] / len(self.plan.global_batch(self.step - 1)), grad_norm)
        except KilovlaError:
            if torch.distributed.is_initialized():  # each rank says it stopped; none leaves before all have
                log.error("rank %d of %d stops at step %d", world.rank, world.size, self.step)
                torch.distributed.barrier()
            raise
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        update_ema(self.ema, self.model, cfg.ema_decay)
        self.step_times.append(time.perf_counter() - t_step)
        return self._record(totals, summed, ids, grad_norm, self.step_times[-1])

    def _sum_over_ranks(self, totals: _Totals) -> dict[str, float]:
        """The step's loss and token counts over every rank: the same numbers on each, so a check of
        them stops every rank at the same step."""
        world = self.world
        totals.loss = distributed.all_reduce_sum(totals.loss, world, over="pp")  # the last stage's
        return {k: distributed.all_reduce_sum(getattr(totals, k), world, over="dp")
                for k in ("loss", "tokens", "tensor_tokens", "capacity")}

    def _record(self, totals: _Totals, summed: dict[str, float], ids: list[int], grad_norm: float,
                elapsed: float) -> dict:
        world = self.world
        global_n = len(self.plan.global_batch(self.step - 1))
        tokens = summed["tokens"]
        record = {"kind": "train", "step": self.step, "loss": summed["loss"] / global_n,
                  "lr": self.scheduler.get_last_lr()[0], "grad_norm": grad_norm, "samples_per_s": global_n / elapsed,
                  "tokens_per_s": tokens / elapsed,
                  "padding_fraction": 1 - tokens / summed["tensor_tokens"] if summed["tensor_tokens"] else 0.0,
                  "budget_unused_fraction": 1 - tokens / summed["capacity"] if summed["capacity"] else 0.0,
                  "data_wait_fraction": totals.data_wait / elapsed, "step_time_s": elapsed,
                  "rows_per_rank": totals.rows, "peak_memory_mb": _memory_mb(world.device),
                  "world_size": world.size, "tp": world.tp, "attention_backend": self.backend,
                  "samples": global_n, "tokens": tokens, "tensor_tokens": summed["tensor_tokens"],
                  "capacity": summed["capacity"]}
        over_dp = lambda v: distributed.all_reduce_sum(v, world, over="dp")  # noqa: E731
        # a replica's stages hold different layers: their routing figures add up, their samples are the same
        record.update(totals.moe.record(lambda v: over_dp(distributed.all_reduce_sum(v, world, over="pp")),
                                        samples=over_dp))
        if (util := mfu(self.n_trainable, tokens / elapsed / world.size, world.device)) is not None:
            record["mfu"] = util
        if self.cfg.log_sample_ids:
            mine = ids if world.tp_rank == 0 and world.pp_rank == 0 else []  # one rank per replica
            record["sample_ids"] = sorted(i for r in distributed.all_gather_objects(mine, world) for i in r)
        return record

    # -- the run -------------------------------------------------------------------------------------
    def open_run_dir(self, replace: bool = False) -> None:
        """Rank 0 writes config.yaml and says once how the run runs (with or without the progress bar)."""
        cfg, world = self.cfg, self.world
        video_sources = [d for d in self.lake.datasets if d.meta.video_keys]
        self.frames_from_cache = bool(video_sources) and all(d.frame_cache is not None for d in video_sources)
        if not world.is_main:
            return
        if replace:
            clear(self.run_dir, RUN)
        try:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            (self.run_dir / "config.yaml").write_text(config_mod.dump_yaml(cfg))
            elastic.record_start(self.run_dir, world.size)
        except OSError as e:
            raise KilovlaError(f"{self.run_dir}: cannot write the run folder ({e.strerror or e})") from None
        mc = self.model_cfg
        asked = f" ({mc.attention_backend})" if mc.packing and self.backend != mc.attention_backend else ""
        mesh = f", pp={world.pp} x dp={world.dp_size} x tp={world.tp}" if world.mesh is not None else ""
        mesh += f" (ep={world.ep}: {world.ep} ranks split the experts)" if world.ep > 1 else ""
        lora = (f", LoRA rank {self.lora.rank} ({self.n_trainable:,} parameters trained)"
                if self.lora is not None else "")
        moe = moe_of(mc)
        experts = f" with an MoE action expert (E={moe.num_experts}, K={moe.top_k})" if moe else ""
        line = (f"kilovla train: {cfg.policy.preset}{experts}, {world.size} rank(s)"
                f"{f' ({cfg.parallel.strategy}{mesh})' if world.size > 1 else ''}, attention {self.backend}{asked}, "
                f"{'bf16' if self.bf16 else 'fp32'}{lora}, from step {self.step}"
                f"{', frames from the frame cache' if self.frames_from_cache else ''}")
        log.info("%s", line)
        print(line, flush=True)

    def train(self, t_start: float | None = None) -> dict:
        """Every step left in the plan: metrics, progress, checkpoints, evaluations, injected faults."""
        cfg, world = self.cfg, self.world
        t_start = time.perf_counter() if t_start is None else t_start
        logger = MetricsLogger(self.run_dir, enabled=world.is_main,
                               resume_step=self.step if self.resume_from is not None else None)
        if self.restart is not None:
            previous, last_logged = self.restart
            record = elastic.restart_record(previous, self.resume_from, world.size, last_logged)
            logger.log(record)
            print(f"elastic restart of job {previous['run_id']}: from step {record['step']} on {world.size} rank(s) "
                  f"(was {record['world_size_before']}), {record['steps_recomputed']} step(s) to recompute, "
                  f"{record['seconds_lost']:.0f} s lost", flush=True)
        loader_kwargs = {"num_workers": cfg.loader.num_workers} if cfg.loader.engine == "torch" else {}
        rows = iter(build_loader(cfg.loader.engine, self.lake, self.plan, rank=world.dp_rank, world_size=world.dp_size,
                                 steps=cfg.steps - self.step, **loader_kwargs))
        faults, watchdog = self.faults, distributed.Watchdog(world)
        progress = StepProgress("train", cfg.steps, self.step, enabled=cfg.progress and world.is_main)
        history: list[dict] = []
        self.model.train()
        try:
            with progress:
                while (record := self.train_step(rows, faults, watchdog)) is not None:
                    logger.log(record)
                    history.append(record)
                    progress.update(self.step, f"loss {record['loss']:.4f}  {record['samples_per_s']:.0f} samples/s")
                    self._after_step(logger, watchdog)
                    faults.step_done(self.step, self.settle_checkpoint)
        except KilovlaError:
            raise
        except Exception as e:
            failure = distributed.collective_failure(e, world, self.phase)
            if failure is not None:
                raise failure from None
            raise
        finally:
            watchdog.close()
        logger.close()
        return self.summary(history, t_start) if world.is_main and history else {}

    def settle_checkpoint(self) -> None:
        """A test's kill after a step: the step's checkpoint complete and visible on every rank first (rank 0
        renames it after its own write; a rank that died sooner could have torchrun stop rank 0 mid-rename)."""
        self.finish_pending()
        distributed.barrier(self.world, f"checkpoint at step {self.step}")

    def _after_step(self, logger: MetricsLogger, watchdog) -> None:
        cfg, done = self.cfg, self.step
        self.finish_pending(wait=False)
        if self.checkpoint_due():
            self.phase = f"checkpoint at step {done}"
            watchdog.arm(self.phase, self.world.timeout_s)
            self.check_finite_weights()
            self.save_checkpoint(final=done == cfg.steps)
        if cfg.eval.every and done % cfg.eval.every == 0:
            self.phase = f"evaluation at step {done}"
            watchdog.arm(self.phase, cfg.eval.timeout_s)
            _evaluate(self.model, self.meta, cfg, done, logger, self.world, self.on_eval)
        watchdog.disarm()

    def summary(self, history: list[dict], t_start: float) -> dict:
        """This invocation's figures: rates over its wall time (set-up, checkpoints, evaluations and this
        plot included), the median step's rate beside them; padding and unused budget over all its steps."""
        total = {k: sum(r[k] for r in history) for k in ("samples", "tokens", "tensor_tokens", "capacity")}
        tail = history[len(history) // 5:] or history
        plot = plot_learning_curve(self.run_dir / "metrics.jsonl", self.run_dir / "learning_curve.png")
        wall_s = time.perf_counter() - t_start
        summary = {"steps": history[-1]["step"], "steps_this_run": len(history),
                   "samples_per_s": total["samples"] / wall_s, "tokens_per_s": total["tokens"] / wall_s,
                   "step_samples_per_s": statistics.median(r["samples_per_s"] for r in tail),
                   "padding_fraction": 1 - total["tokens"] / total["tensor_tokens"] if total["tensor_tokens"] else 0.0,
                   "budget_unused_fraction": 1 - total["tokens"] / total["capacity"] if total["capacity"] else 0.0,
                   "data_wait_fraction": statistics.mean(r["data_wait_fraction"] for r in tail),
                   "final_loss": history[-1]["loss"], "checkpoint": str(ckpt.latest(self.run_dir / "checkpoints")),
                   "attention_backend": self.backend, "frames_from_cache": self.frames_from_cache,
                   "plot": str(plot) if plot else None, "wall_s": wall_s}
        # strict JSON (no NaN): a non-finite loss has stopped the run before it gets here
        _atomic_write_text(self.run_dir / "summary.json", json.dumps(summary, indent=2, allow_nan=False))
        return summary


def check_finite_step(step: int, loss: float, grad_norm: float) -> None:
    """Raise (one line naming the step and the term) when the step's loss or gradient norm is NaN or
    inf, before the optimizer step turns it into weights. Both are the global figures, the same on
    every rank (the loss all-reduced, the norm over all gradients), so every rank stops at this step
    and none waits in a collective for one that left.

    >>> check_finite_step(3, float("nan"), float("nan"))
    Traceback (most recent call last):
    kilovla.errors.KilovlaError: step 3: the flow-matching loss is nan: stopped before the optimizer step ...
    """
    if not np.isfinite(loss):
        term = f"the flow-matching loss is {loss}"
    elif not np.isfinite(grad_norm):
        term = f"the gradient norm is {grad_norm} (the loss is {loss:.6g})"
    else:
        return
    raise KilovlaError(f"step {step}: {term}: stopped before the optimizer step, no checkpoint of it written "
                       "(a NaN or inf in the data, which `kilovla data validate` finds, or a learning rate too high)")


def _sample_noise(model_cfg, seed: int, step: int, sample_ids: np.ndarray, family_time) -> tuple[torch.Tensor, torch.Tensor]:
    """Noise and flow time per sample from (seed, step, sample id): independent of rows and ranks."""
    horizon, dim = chunk_length(model_cfg), model_cfg.max_action_dim
    noise, beta = [], []
    for sid in sample_ids.tolist():
        rng = np.random.default_rng([seed, step, sid])
        noise.append(rng.standard_normal((horizon, dim)))
        beta.append(rng.beta(1.5, 1.0))
    return (torch.as_tensor(np.stack(noise), dtype=torch.float32),
            family_time(torch.as_tensor(beta, dtype=torch.float32)))


def _tensor_tokens(batch, model_cfg, layout: TokenLayout, real: float) -> float:
    """Token positions the forward pass computes for a row: the `real` ones on the packed path; on the
    padded path every enabled camera slot and the language as the model pads it (to the longest
    prompt with dynamic padding, else to max_language_tokens)."""
    if getattr(model_cfg, "packing", False) or not isinstance(batch, PaddedBatch):
        return real
    if model_cfg.language_padding == "longest":
        language = int(batch.token_mask.sum(1).max())
    else:
        language = max(model_cfg.max_language_tokens, batch.tokens.shape[1])
    # GR00T's Eagle prompt (image_token_id) holds the image tokens among its language tokens.
    images = 0 if family_of(model_cfg).image_token_id(model_cfg) is not None else \
        len(model_cfg.enabled_cameras) * layout.tokens_per_camera
    return float(batch.batch_size * (images + language + layout.state_tokens + layout.action_horizon))


def _memory_mb(device: torch.device) -> float:
    """Peak memory of this process so far: CUDA allocations, or the peak resident set on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**10  # KiB on Linux


class _Faults:
    """Deterministic faults for the crash, hang and NaN tests, from the environment:
    KILOVLA_FAULT_AFTER_STEP=N SIGKILLs the run after step N's checkpoint (an asynchronous one written);
    KILOVLA_FAULT_IN_CHECKPOINT=N SIGKILLs rank 0 once checkpoint N's files are written, before they
    become the checkpoint;
    KILOVLA_FAULT_HANG=R:N makes rank R (`*`: every rank) stop answering when step N begins;
    KILOVLA_FAULT_NAN=R:N puts a NaN in one action value of rank R's first row of step N;
    KILOVLA_FAULT_SLOW=W:S makes each step S seconds longer while the world has W ranks (a run that a
    node joins before it ends).
    Under torchrun they fire on its first attempt only (TORCHELASTIC_RESTART_COUNT 0): a restarted
    group runs clean. A node joining restarts the group with the count still 0, so every fault stays
    armed then; SLOW acts only while the world has W ranks."""

    def __init__(self, rank: int, world_size: int = 1):
        first = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
        self.kill_after = int(os.environ.get("KILOVLA_FAULT_AFTER_STEP", "-1")) if first else -1
        self.kill_in_checkpoint = int(os.environ.get("KILOVLA_FAULT_IN_CHECKPOINT", "-1")) if first else -1
        self.hang_at = self._rank_step("KILOVLA_FAULT_HANG", rank) if first else -1
        self.nan_at = self._rank_step("KILOVLA_FAULT_NAN", rank) if first else -1
        self.slow_s = self._rank_step("KILOVLA_FAULT_SLOW", world_size, value=float) if first else -1

    @staticmethod
    def _rank_step(name: str, who: int, value=int):
        """N of `R:N` in $name when R is `who` (a rank; SLOW's: the world size) or `*`, else -1."""
        given = os.environ.get(name, "")
        r, _, n = given.partition(":")
        return value(n) if given and (r == "*" or int(r) == who) else -1

    def step_begins(self, step: int, row: dict) -> None:
        if self.slow_s > 0:
            time.sleep(self.slow_s)
        if step == self.hang_at:
            time.sleep(10**6)
        if step == self.nan_at:
            row["action"] = row["action"].copy()
            row["action"].flat[0] = np.nan

    def step_done(self, step: int, settle) -> None:
        if step == self.kill_after:
            settle()  # the step's checkpoint complete, if one is still being written
            os.kill(os.getpid(), signal.SIGKILL)

    def in_checkpoint(self, step: int):
        """What checkpoint `step` calls between writing its files and making them visible (None: nothing)."""
        return (lambda: os.kill(os.getpid(), signal.SIGKILL)) if step == self.kill_in_checkpoint else None


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
            # a parameter the loss does not reach (pi0.5's last LM layer's LoRA MLP) has no gradient: zero
            grads[name] = torch.zeros(p.shape) if g is None else g.detach().cpu().clone()
    if world.pp > 1:  # each stage holds its own parameters: gather one replica's on rank 0 (a test aid)
        parts = distributed.all_gather_objects(grads if world.dp_rank == 0 and world.tp_rank == 0 else {}, world)
        grads = {k: v for part in parts for k, v in part.items()}
    if world.is_main:
        save_safetensors(grads, Path(out) / f"step_{step:06d}.safetensors")


# -- the loop ------------------------------------------------------------------------------------------


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
            if cfg.policy.lora.enabled:
                from kilovla.models.lora import apply_lora

                apply_lora(eval_model, cfg.policy.lora)
            eval_model.load_state_dict(full, assign=True)
    if world.is_main:
        policy = VLAPolicy(eval_model, meta, world.device)
        report = evaluate(policy, cfg.eval.settings(cfg.seed))
        model.train()
        record = {"kind": "eval", "step": step, "success_rate": report["overall_success_rate"],
                  "crashed_episodes": report.get("crashed_episodes", 0),
                  **{f"success/{t}": r["success_rate"] for t, r in report["per_task"].items()}}
        logger.log(record)
        if on_eval is not None:
            on_eval(record)
    distributed.barrier(world, f"evaluation at step {step}", cfg.eval.timeout_s)
