"""One prepared GPU run that measures kilovla's production paths at the published shapes.

    python benchmarks/gpu_probe.py --out gpu-probe                       # a CUDA machine: <= 5 min on an H200
    python benchmarks/gpu_probe.py --out gpu-probe --sections serve      # rerun one section, keep the others' rows
    python benchmarks/gpu_probe.py --out tmp --tiny                      # CPU, tiny presets: what the test runs

Random weights of `pi05-3b` and `groot-n15-3b` (presets.py), bf16 on CUDA. Sections:

- train_pi05 / train_groot: training steps of the global batch (32) at the LIBERO layout of
  `kilovla bench packing` (3 cameras x 256 image tokens, the third blank; prompts up to 200 tokens;
  action chunks of 10..chunk steps), accumulated over micro-batches, as `kilovla train` steps: fp32
  weights, bf16 autocast, AdamW, gradient clipping. Fixed padding (baseline) vs packing with the
  `auto` varlen backend (ours), and vs packing with each other varlen backend that trains here.
  Rows `gpu_train_samples_per_s_<shape>` (limit: padded / real tokens, the most packing can save),
  `..._<backend>`, `gpu_mfu_<shape>` (packed), `gpu_peak_memory_gb_<shape>`.
- serve: one action chunk of pi0.5 at batch 1, 4, 16, 64: eager vs CUDA graph (`GraphedSampler`, what
  `kilovla serve` runs), bf16 vs FP8 (`quantize_model` + the `auto` GEMM choice, as `kilovla quantize`).
  Rows `gpu_chunk_ms_<shape>_b<B>` (eager bf16 vs graph bf16), `gpu_chunk_per_s_fp8_<shape>_b<B>`
  (graph bf16 vs graph FP8).

Global batch 32 in micro-batches of 8 (halved on out-of-memory); 3 training repeats and 5 serving repeats.
Each section runs under its own time budget (100 / 75 / 90 s on CUDA: later repeats or variants, or a
batch size, skipped and said in the note) and its own try/except: a failure goes under "errors", the
next section runs, and the exit status is 1. DIR/gpu_probe.json (kilovla's bench rows, `bench.common.Row`)
and DIR/gpu_probe.md (a table) are rewritten after every section, so a run cut short keeps what it
measured; `--sections` keeps an earlier run's rows of the sections it does not rerun. `--fail-section S`
makes S raise (the test of the guard). `--fp8-kernel` as `kilovla quantize --kernel`: with torchao
installed `auto` times its Triton kernel too, which compiles per shape (minutes for a whole model).

The parts that need CUDA (bf16, CUDA graphs, FP8 GEMM kernels, peak memory, MFU's peak) are marked
`GPU-only`; on a CPU they fall back with one line saying what was skipped, and the same words go into
the row's note. Imports nothing beyond torch, numpy and kilovla (which reads safetensors), so it runs
on a bare GPU machine with the checkout and a torch.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import gc
import json
import logging
import os
import statistics
import sys
import time
import traceback
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

_SRC = Path(__file__).resolve().parents[1] / "src"
if _SRC.is_dir():  # the checkout's kilovla, installed or not (a bare GPU machine has only torch)
    sys.path.insert(0, str(_SRC))

import torch  # noqa: E402

from kilovla.bench.common import Row, _fmt, machine_info  # noqa: E402
from kilovla.bench.models import _backends_to_compare, _model_flops, libero_batch, token_counts  # noqa: E402
from kilovla.models.attention import resolve_backend  # noqa: E402
from kilovla.models.family import chunk_length  # noqa: E402
from kilovla.models.groot import GrootModel  # noqa: E402
from kilovla.models.pi05 import OPENPI_CAMERAS  # noqa: E402
from kilovla.models.presets import build_model  # noqa: E402
from kilovla.progress import Heartbeat  # noqa: E402
from kilovla.quant.fp8 import Fp8BlockLinear, Fp8Config, quantize_model, set_kernel  # noqa: E402
from kilovla.serve.graphs import GraphedSampler  # noqa: E402
from kilovla.train.metrics import peak_flops  # noqa: E402
from kilovla.train.optim import OptimConfig, build_optimizer, clip_gradients  # noqa: E402

SECTIONS = ("train_pi05", "train_groot", "serve")
OOM = torch.cuda.OutOfMemoryError


@dataclass(frozen=True, kw_only=True, slots=True)
class ProbeSize:
    """What one run measures. `H200` fits 5 minutes there; `TINY` runs on 2 CPU cores in seconds."""

    pi05: str
    groot: str
    pi05_overrides: dict = field(default_factory=dict)
    groot_overrides: dict = field(default_factory=dict)
    global_batch: int = 32
    micro_batch: int = 8  # halved on out-of-memory, said in the note
    train_repeats: int = 3
    serve_batches: tuple[int, ...] = (1, 4, 16, 64)
    serve_repeats: int = 5
    budget_s: dict = field(default_factory=dict)  # per section


# GR00T N1.5 has one camera slot; the probe gives it pi0.5's three so both train on the same LIBERO layout.
H200 = ProbeSize(pi05="pi05-3b", groot="groot-n15-3b", groot_overrides={"cameras": OPENPI_CAMERAS},
                 budget_s={"train_pi05": 100, "train_groot": 75, "serve": 90})
# libero_batch draws horizons of 10..chunk steps: the tiny presets' chunks (8) are stretched to 16.
TINY = ProbeSize(pi05="pi05-tiny", groot="groot-tiny", pi05_overrides={"chunk_size": 16},
                 groot_overrides={"cameras": OPENPI_CAMERAS, "action_horizon": 16}, global_batch=4, micro_batch=2,
                 train_repeats=1, serve_repeats=1, budget_s={"train_pi05": 60, "train_groot": 60, "serve": 60})


def shape_tag(preset_name: str) -> str:
    """The shape in a row name: 'pi05-3b' -> 'pi05_3b'."""
    return preset_name.replace("-", "_")


class Budget:
    """A section's deadline: measurement loops ask `left()` before each step."""

    def __init__(self, seconds: float):
        self.seconds, self.deadline = seconds, time.monotonic() + seconds

    def left(self) -> float:
        return self.deadline - time.monotonic()


@dataclass
class Probe:
    """Where and how the run measures: the device, its compute dtype, and the CPU fallbacks said so far."""

    size: ProbeSize
    device: torch.device
    fp8_kernel: str = "auto"
    fallbacks: list[str] = field(default_factory=list)

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    @property
    def dtype_name(self) -> str:
        return "bf16" if self.cuda else "fp32"

    def autocast(self):
        # GPU-only: bf16 autocast, as `kilovla train` / `kilovla serve` on CUDA; on a CPU kilovla computes in fp32.
        return torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.cuda)

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def fallback(self, what: str) -> str:
        """Say once that a GPU-only part was skipped here, and why; returns the words for a row note."""
        if what not in self.fallbacks:
            self.fallbacks.append(what)
            print(f"gpu_probe: {self.device.type}: {what}", flush=True)
        return what


def seconds_of(probe: Probe, fn: Callable[[], object]) -> float:
    probe.sync()
    t0 = time.perf_counter()
    fn()
    probe.sync()
    return time.perf_counter() - t0


# -- training ---------------------------------------------------------------------------------------
def groot_token_counts(cfg, batch) -> tuple[int, int]:
    """(tokens the padded path processes, real tokens): VL tokens plus the 49 action-head tokens per sample,
    which packing cannot shorten."""
    p, head, n = cfg.vision.tokens, cfg.action_head_tokens, batch.batch_size
    padded = n * (len(cfg.cameras) * p + cfg.max_language_tokens + head)
    real = int(batch.image_masks.sum()) * p + int(batch.token_mask.sum()) + n * head
    return padded, real


def groot_model_flops(model: GrootModel, batch) -> float:
    """Forward + backward FLOPs of the real tokens, as `bench.models._model_flops` counts pi0.5's: 6 x params x
    tokens per stream; the ViT on image tokens, the LLM and the VL self-attention on VL tokens, the DiT on
    the 49 action-head tokens (attention, and the cross-attention K/V over the VL tokens, left out)."""
    count = lambda m: sum(p.numel() for p in m.parameters())  # noqa: E731
    eagle, head = model.eagle, model.action_head
    images = int(batch.image_masks.sum()) * model.config.vision.tokens
    vl = images + int(batch.token_mask.sum())
    return 6.0 * ((count(eagle.vision_model) + count(eagle.mlp1)) * images
                  + (count(eagle.language_model.model.layers) + count(head.vl_self_attention)) * vl
                  + count(head.model) * batch.batch_size * model.config.action_head_tokens)


def micro_batches(batch, size: int):
    """The global batch in slices of `size` samples (the per-sample tensors cut, the rest shared)."""
    n = batch.batch_size
    for start in range(0, n, size):
        yield dataclasses.replace(batch, **{f.name: v[start:start + size] for f in dataclasses.fields(batch)
                                            if isinstance(v := getattr(batch, f.name), torch.Tensor)
                                            and v.dim() and v.shape[0] == n})


@dataclass
class TrainTiming:
    micro_batch: int
    global_batch: int
    times: list[float] = field(default_factory=list)
    peak_bytes: int = 0
    notes: list[str] = field(default_factory=list)
    error: str | None = None

    @property
    def samples_per_s(self) -> float | None:
        return self.global_batch / statistics.median(self.times) if self.times else None

    @property
    def peak_gb(self) -> float | None:
        return self.peak_bytes / 1e9 if self.peak_bytes else None


def train_step(probe: Probe, model, optimizer, trainable, batch, micro: int) -> None:
    """One optimizer step over the global batch, as `Trainer.train_step`: per micro-batch the summed
    per-sample loss / global batch, backward; then clip, step."""
    n = batch.batch_size
    for mb in micro_batches(batch, micro):
        with probe.autocast():
            loss = model(mb)["per_sample"].sum() / n
        loss.backward()
    clip_gradients(trainable, OptimConfig().clip_grad_norm)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def timed_step(probe: Probe, model, optimizer, trainable, batch, switches: dict, timing: TrainTiming) -> float:
    """Seconds of one step with the config `switches`; out of memory halves the micro-batch and retries."""
    model.config = dataclasses.replace(model.config, **switches)
    while True:
        try:
            if probe.cuda:  # GPU-only: the allocator's peak (weights + AdamW state + this step's activations)
                torch.cuda.reset_peak_memory_stats(probe.device)
            t = seconds_of(probe, lambda: train_step(probe, model, optimizer, trainable, batch, timing.micro_batch))
            if probe.cuda:
                timing.peak_bytes = max(timing.peak_bytes, torch.cuda.max_memory_allocated(probe.device))
            return t
        except OOM:
            optimizer.zero_grad(set_to_none=True)
            gc.collect()
            torch.cuda.empty_cache()
            if timing.micro_batch == 1:
                raise
            timing.micro_batch //= 2
            timing.notes.append(f"out of memory: micro-batch {timing.micro_batch}")


def measure_training(probe: Probe, model, batches, variants: dict[str, dict], budget: Budget) -> dict[str, TrainTiming]:
    """Median step time of each variant: one warm-up step each (allocator, kernels, AdamW state), then
    repeats interleaved across variants until `train_repeats` or the section's budget runs out."""
    trainable, optimizer, _ = build_optimizer(model, OptimConfig(), steps=1000)
    size = probe.size
    timings = {v: TrainTiming(size.micro_batch, batches[0].batch_size) for v in variants}
    estimate = 0.0
    for name, switches in variants.items():
        if budget.left() < 2 * estimate:
            timings[name].error = "skipped: section time budget spent"
            continue
        try:
            estimate = max(estimate, timed_step(probe, model, optimizer, trainable, batches[0], switches, timings[name]))
        except Exception as e:  # noqa: BLE001 - a variant that cannot train here is a row note, not the section's end
            timings[name].error = f"{type(e).__name__}: {e}"[:300]
            optimizer.zero_grad(set_to_none=True)
    live = [v for v in variants if timings[v].error is None]
    for r in range(size.train_repeats):
        for name in live:
            t = timings[name]
            if t.error is not None or budget.left() < (t.times[-1] if t.times else estimate):
                continue
            try:
                t.times.append(timed_step(probe, model, optimizer, trainable, batches[r % len(batches)], variants[name], t))
            except Exception as e:  # noqa: BLE001 - as in the warm-up
                t.error = f"{type(e).__name__}: {e}"[:300]
                optimizer.zero_grad(set_to_none=True)
    for name in live:
        t = timings[name]
        if t.error is not None:
            continue
        if not t.times:
            t.error = "skipped: section time budget spent after the warm-up"
        elif len(t.times) < size.train_repeats:
            t.notes.append(f"{len(t.times)} of {size.train_repeats} repeats (section time budget)")
    del optimizer, trainable
    return timings


def run_train(probe: Probe, family: str, rows: list[Row], extra: dict, budget: Budget) -> None:
    size = probe.size
    name, overrides = (size.pi05, size.pi05_overrides) if family == "pi05" else (size.groot, size.groot_overrides)
    tag = shape_tag(name)
    model = build_model(name, device=probe.device, seed=0, **overrides).train()  # fp32 weights, as `kilovla train`
    cfg = model.config
    batches = [libero_batch(cfg, size.global_batch, seed).to(probe.device) for seed in (0, 1)]
    counts = groot_token_counts if family == "groot" else token_counts
    padded, real = map(sum, zip(*(counts(cfg, b) for b in batches)))
    auto = resolve_backend("auto", probe.device)
    variants = {"padded": {"packing": False}, auto: {"packing": True, "attention_backend": "auto"}}
    for backend in _backends_to_compare(probe.device.type):
        variants.setdefault(backend, {"packing": True, "attention_backend": backend})
    timings = measure_training(probe, model, batches, variants, budget)
    extra.update(preset=name, overrides={k: list(v) if isinstance(v, tuple) else v for k, v in overrides.items()},
                 params=sum(p.numel() for p in model.parameters()), padded_tokens=padded, real_tokens=real,
                 auto_backend=auto, variants={v: dataclasses.asdict(t) | {"samples_per_s": t.samples_per_s}
                                              for v, t in timings.items()})

    memory_note = "" if probe.cuda else probe.fallback("peak memory skipped: torch.cuda.max_memory_allocated needs CUDA")
    precision = "bf16 autocast" if probe.cuda else probe.fallback("fp32, not bf16: kilovla computes in fp32 on a CPU")
    layout = (f"{name} random weights{_overrides_note(overrides)}, {probe.device.type}, {precision}; LIBERO layout "
              f"(3 cameras x {cfg.vision.tokens} image tokens, third blank; language <= {cfg.max_language_tokens}; "
              f"horizon 10-{chunk_length(cfg)}); global batch {size.global_batch}")
    limit = round(padded / real, 3)
    base = timings["padded"]

    def said(t: TrainTiming) -> str:
        parts = [f"micro-batch {t.micro_batch}"] + t.notes + ([t.error] if t.error else [])
        if t.peak_gb is not None:
            parts.append(f"peak {t.peak_gb:.1f} GB")
        return ", ".join(parts)

    ours = timings[auto]
    rows.append(Row.compare(f"gpu_train_samples_per_s_{tag}", "samples/s", base.samples_per_s, ours.samples_per_s,
                            higher_is_better=True, limit=limit,
                            note=f"{layout}; fixed padding ({said(base)}) vs packing + varlen {auto}, the auto choice "
                                 f"({said(ours)}); limit = padded/real tokens"))
    for backend in variants:
        if backend in ("padded", auto):
            continue
        t = timings[backend]
        rows.append(Row.compare(f"gpu_train_samples_per_s_{tag}_{backend}", "samples/s", base.samples_per_s,
                                t.samples_per_s, higher_is_better=True, limit=limit,
                                note=f"{layout}; fixed padding vs packing + varlen {backend} ({said(t)})"))
    if not probe.cuda:
        rows.append(Row.compare(f"gpu_train_samples_per_s_{tag}_flex", "samples/s", base.samples_per_s, None,
                                higher_is_better=True,
                                note=probe.fallback("flex skipped: flex_attention has no backward on a CPU")))

    # The packed path's model FLOPs per sample; MFU = that x samples/s / the device's dense bf16 peak.
    flops = (groot_model_flops if family == "groot" else _model_flops)(model, batches[0]) / batches[0].batch_size
    extra["model_tflops_per_sample"] = flops / 1e12
    peak = peak_flops(probe.device)  # GPU-only: a CPU has no entry in train.metrics.PEAK_BF16_FLOPS
    mfu = None if peak is None or ours.samples_per_s is None else flops * ours.samples_per_s / peak
    mfu_note = (f"model FLOPs of the real tokens ({flops / 1e12:.3g} TFLOP/sample: 6 x params x tokens per stream, "
                "attention left out) x samples/s / dense bf16 peak, packed path")
    if peak is None and not probe.cuda:
        mfu_note = probe.fallback("MFU skipped: no bf16 peak FLOP/s for a CPU (train.metrics.PEAK_BF16_FLOPS)")
    elif peak is None:
        mfu_note += f"; no peak known for {torch.cuda.get_device_name(probe.device)} (train.metrics.PEAK_BF16_FLOPS)"
    rows.append(Row.compare(f"gpu_mfu_{tag}", "fraction", None, mfu, higher_is_better=True, note=f"{layout}; {mfu_note}"))
    rows.append(Row.compare(f"gpu_peak_memory_gb_{tag}", "GB", base.peak_gb, ours.peak_gb, higher_is_better=False,
                            note=memory_note or f"{layout}; torch.cuda.max_memory_allocated of a step (fp32 weights, "
                                                f"grads, AdamW state, activations): fixed padding vs packing + {auto}"))


def _overrides_note(overrides: dict) -> str:
    if not overrides:
        return ""
    return " (" + ", ".join(f"{k}={len(v) if isinstance(v, tuple) else v}" for k, v in overrides.items()) + ")"


# -- serving ----------------------------------------------------------------------------------------
def serving_pair(preset_name: str, device, kernel: str = "auto", **overrides):
    """(bf16 model, its FP8 copy) in eval mode on `device`, random weights: the FP8 one quantized as
    `kilovla quantize` does (the family's default layers, 128x128 blocks, 1x128 activations) with its GEMM
    chosen by `kernel`. On a CPU the models stay fp32 (kilovla's CPU dtype)."""
    model = build_model(preset_name, device=device, seed=0, **overrides).eval()
    if torch.device(device).type == "cuda":
        model = model.to(torch.bfloat16)
    fp8 = copy.deepcopy(model)
    quantize_model(fp8, Fp8Config())
    set_kernel(fp8, kernel)  # GPU-only: the block-scaled GEMMs; on a CPU every choice emulates, with a warning
    return model, fp8


def chunk_seconds(probe: Probe, fn: Callable[[], torch.Tensor], repeats: int,
                  warmups: int = 1) -> tuple[float, torch.Tensor]:
    """(median seconds of fn() after `warmups` calls, its last output); a GraphedSampler captures in its first."""
    out = None

    def call():
        nonlocal out
        out = fn()

    for _ in range(warmups):
        seconds_of(probe, call)
    return statistics.median(seconds_of(probe, call) for _ in range(repeats)), out


def kernels_used(model) -> list[str]:
    return sorted({k for m in model.modules() if isinstance(m, Fp8BlockLinear) for k in m.kernel_used.values()})


def serve_batch(probe: Probe, model, fp8, batch, noise) -> dict:
    """Seconds of one chunk: eager bf16, bf16 CUDA graph, FP8 CUDA graph (`GraphedSampler`, as `kilovla serve`
    under inference mode); whatever was measured before an out-of-memory stays."""
    t: dict = {"eager_bf16": None, "graph_bf16": None, "graph_fp8": None, "graph_vs_eager_max_abs_diff": None,
               "problem": ""}
    repeats = probe.size.serve_repeats
    try:
        with torch.inference_mode(), probe.autocast():
            t["eager_bf16"], eager = chunk_seconds(probe, lambda: model.sample_actions(batch, noise=noise), repeats)
            graphed = GraphedSampler(model, probe.device)  # GPU-only: off CUDA it is the eager call
            t["graph_bf16"], out = chunk_seconds(probe, lambda: graphed(batch, noise), repeats)
            t["graph_vs_eager_max_abs_diff"] = float((out.float() - eager.float()).abs().max())
            del graphed, out, eager  # its graph's memory pool goes before the FP8 one is captured
            graphed = GraphedSampler(fp8, probe.device)
            t["graph_fp8"], _ = chunk_seconds(probe, lambda: graphed(batch, noise), repeats)
    except OOM:
        done = [k for k in ("eager_bf16", "graph_bf16") if t[k] is not None]
        t["problem"] = f"out of memory after {', '.join(done) or 'nothing'}"
    return t


def serve_skip(probe: Probe, b: int, last: tuple[int, float, int] | None, budget: Budget, weights: int) -> str:
    """Why batch `b` is not measured ('' if it is): the section's time budget, or a memory estimate scaled
    from the last batch measured (`last`: its batch size, seconds, peak bytes)."""
    if budget.left() <= 0:
        return f"skipped: section time budget ({budget.seconds:.0f} s) spent"
    if last is None:
        return ""
    prev, seconds, peak = last
    estimate = seconds * max(1.0, 0.75 * b / prev)  # compute-bound batches grow sublinearly at first
    if estimate > budget.left():
        return f"skipped: ~{estimate:.0f} s estimated, {budget.left():.0f} s left of the section time budget"
    if probe.cuda and peak:
        need = weights + (peak - weights) * b / prev
        total = torch.cuda.get_device_properties(probe.device).total_memory
        if need > 0.9 * total:
            return f"skipped: memory short (~{need / 1e9:.0f} GB estimated from batch {prev}, {total / 1e9:.0f} GB on the GPU)"
    return ""


def run_serve(probe: Probe, rows: list[Row], extra: dict, budget: Budget, warnings: list[str]) -> None:
    size = probe.size
    name, overrides = size.pi05, size.pi05_overrides
    tag = shape_tag(name)
    model, fp8 = serving_pair(name, probe.device, probe.fp8_kernel, **overrides)
    cfg = model.config
    weights = torch.cuda.memory_allocated(probe.device) if probe.cuda else 0
    graphs_note = ("" if probe.cuda else
                   probe.fallback("CUDA graphs skipped: GraphedSampler runs eagerly off CUDA, so 'graph' is eager"))
    kernel_note = ("" if probe.cuda else
                   probe.fallback("FP8 GEMM kernels skipped: they need CUDA; FP8 layers emulate (dequantize + matmul)"))
    what = (f"{name} random weights{_overrides_note(overrides)}, {probe.device.type}, {probe.dtype_name}; LIBERO "
            f"layout, {cfg.num_inference_steps} flow steps, chunk {cfg.chunk_size}")
    extra.update(preset=name, weights_gb=weights / 1e9, batches={})
    last = None
    for b in size.serve_batches:
        skip = serve_skip(probe, b, last, budget, weights)
        if skip:
            t = {"eager_bf16": None, "graph_bf16": None, "graph_fp8": None, "graph_vs_eager_max_abs_diff": None,
                 "problem": skip}
            print(f"gpu_probe: serve batch {b} {skip}", flush=True)
        else:
            batch = libero_batch(cfg, b, seed=b).to(probe.device)
            noise = torch.randn(b, cfg.chunk_size, cfg.max_action_dim,
                                generator=torch.Generator().manual_seed(b)).to(probe.device)
            seen = len(warnings)
            if probe.cuda:  # GPU-only: the peak scales the memory estimate of the next batch size
                torch.cuda.reset_peak_memory_stats(probe.device)
            t0 = time.monotonic()
            t = serve_batch(probe, model, fp8, batch, noise)
            seconds = time.monotonic() - t0
            del batch, noise
            gc.collect()
            peak = torch.cuda.max_memory_allocated(probe.device) if probe.cuda else 0
            if probe.cuda:
                torch.cuda.empty_cache()
            t.update(seconds=seconds, peak_gb=peak / 1e9 if peak else None)
            last = (b, seconds, peak)
            failed = [w for w in warnings[seen:] if "CUDA graph capture failed" in w]
            if failed:
                t["problem"] = "; ".join(filter(None, [t["problem"], "capture failed, ran eagerly: " + failed[0][:200]]))
        extra["batches"][b] = t
        ms = {k: None if t[k] is None else 1e3 * t[k] for k in ("eager_bf16", "graph_bf16")}
        per_s = {k: None if t[k] is None else b / t[k] for k in ("graph_bf16", "graph_fp8")}
        diff = t["graph_vs_eager_max_abs_diff"]
        rows.append(Row.compare(
            f"gpu_chunk_ms_{tag}_b{b}", "ms", ms["eager_bf16"], ms["graph_bf16"], higher_is_better=False,
            note=f"{what}; batch {b}: eager sample_actions vs GraphedSampler (input copy + replay)"
                 + (f"; graph - eager max |diff| {diff:.2g}" if diff is not None else "")
                 + "".join(f"; {s}" for s in (t["problem"], graphs_note) if s)))
        rows.append(Row.compare(
            f"gpu_chunk_per_s_fp8_{tag}_b{b}", "chunks/s", per_s["graph_bf16"], per_s["graph_fp8"],
            higher_is_better=True,
            note=f"{what}; batch {b}, chunks/s = batch / chunk latency: bf16 graph vs FP8 graph (FP8Config() "
                 f"default layers, kernel {probe.fp8_kernel} -> {', '.join(kernels_used(fp8)) or '-'})"
                 + "".join(f"; {s}" for s in (t["problem"], kernel_note, graphs_note) if s)))
    extra["fp8_kernels"] = kernels_used(fp8)


# -- the run ----------------------------------------------------------------------------------------
class _Warnings(logging.Handler):
    """kilovla's warning lines (a backend or kernel fallback, a failed capture), kept for the JSON."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(f"{record.name}: {record.getMessage()}")


def run_section(name: str, probe: Probe, fail: set[str], warnings: _Warnings) -> dict:
    """One section under its budget; whatever it raises becomes its "error" (its rows so far stay)."""
    rows: list[Row] = []
    extra: dict = {}
    budget = Budget(probe.size.budget_s[name])
    result = {"rows": rows, "extra": extra, "error": None, "budget_s": budget.seconds}
    seen = len(warnings.lines)
    t0 = time.monotonic()
    try:
        with Heartbeat(f"gpu_probe {name}"):
            if name in fail:
                raise RuntimeError(f"injected failure (--fail-section {name})")
            if name == "serve":
                run_serve(probe, rows, extra, budget, warnings.lines)
            else:
                run_train(probe, name.removeprefix("train_"), rows, extra, budget)
    except Exception as e:  # noqa: BLE001 - the probe's contract: record, go on to the next section
        result["error"] = f"{type(e).__name__}: {e}"
        result["traceback"] = traceback.format_exc()
        print(f"gpu_probe: section {name} failed: {result['error']}", file=sys.stderr, flush=True)
    finally:
        gc.collect()
        if probe.cuda:
            torch.cuda.empty_cache()
    result["seconds"] = round(time.monotonic() - t0, 1)
    result["warnings"] = warnings.lines[seen:]
    return result


def machine(probe: Probe) -> dict:
    info = machine_info()
    info.update(cuda=torch.version.cuda, device=str(probe.device))
    if probe.cuda:
        p = torch.cuda.get_device_properties(probe.device)
        info.update(gpu_memory_gb=round(p.total_memory / 1e9, 1), capability=f"{p.major}.{p.minor}")
    return info


def document(probe: Probe, sections: dict[str, dict], tiny: bool) -> dict:
    rows = [r for name in SECTIONS if name in sections for r in sections[name]["rows"]]
    errors = [{"section": n, "error": s["error"]} for n, s in sections.items() if s.get("error")]
    return {"suite": "gpu_probe", "tiny": tiny, "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "machine": machine(probe), "fallbacks": probe.fallbacks, "errors": errors,
            "sections": {n: {k: v for k, v in s.items() if k != "rows"} | {"rows": [r["name"] for r in s["rows"]]}
                         for n, s in sections.items()},
            "rows": rows}


def markdown(doc: dict) -> str:
    m = doc["machine"]
    lines = ["# kilovla GPU probe", "",
             f"{m['gpu'] or m['cpu']} ({m['device']}), torch {m['torch']}, CUDA {m['cuda'] or '-'}, "
             f"Python {m['python']}, {doc['date']}{' (--tiny)' if doc['tiny'] else ''}", "",
             "| row | unit | baseline | ours | ratio | limit | note |", "|---|---|---|---|---|---|---|"]
    for r in doc["rows"]:
        lines.append(f"| {r['name']} | {r['unit']} | {_fmt(r['baseline'])} | {_fmt(r['ours'])} | {_fmt(r['ratio'])} | "
                     f"{_fmt(r['limit'])} | {r['note'].replace('|', '/')} |")
    lines += ["", "Sections: " + ", ".join(f"{n} {s['seconds']} s" + (f" (kept from the run of {s['kept_from']})"
                                                                        if "kept_from" in s else "")
                                          for n, s in doc["sections"].items())]
    if doc["errors"]:
        lines += ["", "Errors:"] + [f"- {e['section']}: {e['error']}" for e in doc["errors"]]
    if doc["fallbacks"]:
        lines += ["", "Skipped off CUDA:"] + [f"- {f}" for f in doc["fallbacks"]]
    return "\n".join(lines) + "\n"


def _write(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}")
    tmp.write_text(text)
    os.replace(tmp, path)


def earlier_sections(path: Path, tiny: bool, device: torch.device) -> dict[str, dict]:
    """The sections of an earlier run into the same folder on the same kind of run, kept on a rerun of others."""
    try:
        old = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    if old.get("tiny") != tiny or old.get("machine", {}).get("device") != str(device):
        return {}
    by_name = {r["name"]: r for r in old.get("rows", [])}
    return {n: {"kept_from": old.get("date"), **s, "rows": [by_name[r] for r in s.get("rows", []) if r in by_name]}
            for n, s in old.get("sections", {}).items() if n in SECTIONS}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="folder for gpu_probe.json and gpu_probe.md")
    p.add_argument("--sections", default=",".join(SECTIONS), help=f"comma list of {', '.join(SECTIONS)}")
    p.add_argument("--tiny", action="store_true", help="tiny presets and batches (the CPU test)")
    p.add_argument("--fail-section", action="append", default=[], choices=SECTIONS,
                   help="make this section raise at its start (tests the guard)")
    p.add_argument("--fp8-kernel", default="auto", help="the FP8 GEMM of the serve section (kilovla quantize --kernel)")
    p.add_argument("--device", default=None, help="default: cuda when available, else cpu")
    args = p.parse_args(argv)
    names = [s.strip() for s in args.sections.split(",") if s.strip()]
    unknown = sorted(set(names) - set(SECTIONS))
    if unknown:
        p.error(f"--sections: unknown {unknown}; choose from {', '.join(SECTIONS)}")

    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    warnings = _Warnings()
    logging.getLogger("kilovla").addHandler(warnings)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    probe = Probe(TINY if args.tiny else H200, device, args.fp8_kernel)
    if args.tiny and not probe.cuda:
        # Tiny shapes gain nothing from a second thread, and on a shared CPU it mostly waits for the others.
        torch.set_num_threads(1)
    if not probe.cuda:
        probe.fallback("no CUDA device: every GPU-only part falls back (each said below and in its row's note)")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    json_path, md_path = out / "gpu_probe.json", out / "gpu_probe.md"
    sections = {n: s for n, s in earlier_sections(json_path, args.tiny, device).items() if n not in names}
    for name in names:
        result = run_section(name, probe, set(args.fail_section), warnings)
        result["rows"] = [dataclasses.asdict(r) for r in result["rows"]]
        sections[name] = result
        doc = document(probe, sections, args.tiny)
        _write(json_path, json.dumps(doc, indent=2, default=str))
        _write(md_path, markdown(doc))
    print(markdown(doc), end="")
    print(f"wrote {json_path} and {md_path}")
    return 1 if any(sections[n].get("error") for n in names) else 0


if __name__ == "__main__":
    sys.exit(main())
