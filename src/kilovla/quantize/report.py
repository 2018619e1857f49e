"""How much a quantized policy lost and gained: `DIR/quant_report.json` and a table.

- size: bytes of ``model.safetensors`` on disk for the source (null for an FSDP `state/` source),
  for a bf16 copy of the weights (the baseline) and for the quantized folder, and
  ``reduction_percent`` (quantized vs bf16);
- per-layer SQNR: of each FP8 weight against the original weight, and of each FP8 layer's output on
  the activations the original policy produces on held-out samples (activation quantization
  included). Values are finite: +300 dB means no noise at all (an all-zero layer), -300 dB means
  NaN / inf in an output (the worst, so a minimum never skips it; `fp8.sqnr_db`); an output SQNR of
  null means the layer never runs at inference (pi0.5's last prefix-layer q / o / MLP);
- action MSE: both policies' action chunks from the same observations (the inference path,
  `observation_batch`: no training augmentation) and the same flow noise, in action units on the real
  dims, over the chunk steps inside the episode (steps padded past its end are left out of the MSE,
  the variance and the count alike), divided by the variance of the dataset's actions on those steps
  (mean squared difference / mean per-dim variance);
- closed loop: success of both policies through `evaluate` on the same seeds; the caller passes the
  evaluation as a function, since evaluation sits above quantization in the package;
- latency: batch-1 action chunk (`sample_actions`, every flow step), medians of interleaved repeats.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from kilovla.models.family import chunk_length
from kilovla.quant.fp8 import Fp8Weights, sqnr_db

CAPTURE_ROWS = 4096  # activation rows (or token ids) per layer for its output SQNR, in whole calls


def heldout_rows(dataset: str | Path, policy, samples: int, batch_size: int = 16) -> list[dict]:
    """`samples` frames spread evenly over a dataset, as the data layer's batched rows (with the
    policy's action window), in batches of `batch_size`."""
    from kilovla.data.lerobot import LeRobotDataset
    from kilovla.data.meta import DatasetMeta

    chunk = chunk_length(policy.model.config)
    fps = DatasetMeta(dataset).fps
    ds = LeRobotDataset(dataset, delta_timestamps={"action": [i / fps for i in range(chunk)]})
    positions = np.unique(np.linspace(0, len(ds) - 1, min(samples, len(ds))).round().astype(int))
    return [ds.get_batch(positions[i:i + batch_size]) for i in range(0, len(positions), batch_size)]


def _noise(policy, batch_size: int, generator: torch.Generator) -> torch.Tensor:
    cfg = policy.model.config
    return torch.randn(batch_size, chunk_length(cfg), cfg.max_action_dim, generator=generator)


@torch.no_grad()
def compare_actions(baseline, quantized, rows: list[dict], seed: int = 0) -> dict:
    """Action chunks of both policies on the same rows and noise, and every FP8 layer's output SQNR
    on the activations the baseline produced there."""
    from kilovla.models.residual import base_of

    # layer names of the bases (an RL folder's residual actor is not quantized): what weight_sqnr is keyed by
    base, quantized_base = base_of(baseline.model), base_of(quantized.model)
    names = {n for n, m in quantized_base.named_modules() if isinstance(m, Fp8Weights)}
    # whole calls: GR00T's per-embodiment layers take two inputs, expert stacks their row counts
    captured: dict[str, list[tuple]] = {n: [] for n in names}
    counts = dict.fromkeys(names, 0)

    def capture(name):
        def hook(module, args):
            if counts[name] < CAPTURE_ROWS:
                captured[name].append(tuple(a.detach().cpu() if isinstance(a, torch.Tensor) else a for a in args))
                x = args[0]
                counts[name] += x.numel() // x.shape[-1] if x.is_floating_point() else x.numel()
        return hook

    handles = [base.get_submodule(n).register_forward_pre_hook(capture(n)) for n in names]
    generator = torch.Generator().manual_seed(seed)
    diffs, truth = [], []
    try:
        for row in rows:
            # The inference path: a policy at work sees its observations without training augmentation.
            batch = baseline.processor.observation_batch(row)
            noise = _noise(baseline, batch.batch_size, generator)
            ref = baseline.model.sample_actions(batch.to(baseline.device), noise=noise.to(baseline.device))
            got = quantized.model.sample_actions(batch.to(quantized.device), noise=noise.to(quantized.device))
            ref = baseline.processor.unnormalize_actions(ref.float().cpu().numpy())
            got = quantized.processor.unnormalize_actions(got.float().cpu().numpy())
            real = ~np.asarray(row["action_is_pad"], bool)  # (B, chunk): steps inside the episode
            diffs.append((got - ref)[real])
            truth.append(np.asarray(row["action"], np.float32)[real])
    finally:
        for h in handles:
            h.remove()
    diff, gt = np.concatenate(diffs), np.concatenate(truth)
    mse, variance = float(np.mean(diff**2)), float(np.mean(gt.var(axis=0)))
    if not math.isfinite(mse):  # NaN / inf actions: JSON has no number for it, the count says what happened
        return {"samples": int(len(gt)), "mse": None, "action_variance": variance, "relative": None,
                "non_finite_actions": int((~np.isfinite(diff)).sum()),
                "output_sqnr_db": _output_sqnr(baseline, quantized, names, captured)}
    return {"samples": int(len(gt)), "mse": mse, "action_variance": variance,
            "relative": mse / variance if variance > 0 else None,
            "output_sqnr_db": _output_sqnr(baseline, quantized, names, captured)}


def _output_sqnr(baseline, quantized, names, captured) -> dict[str, float | None]:
    from kilovla.models.residual import base_of

    layers = {}
    for name in sorted(names):
        if not captured[name]:  # pi0.5's last prefix layer: q, o and MLP weights that inference never reads
            layers[name] = None
            continue
        calls = [tuple(a.to(baseline.device) if isinstance(a, torch.Tensor) else a for a in args)
                 for args in captured[name]]
        ref, got = base_of(baseline.model).get_submodule(name), base_of(quantized.model).get_submodule(name)
        layers[name] = sqnr_db(torch.cat([ref(*a).flatten() for a in calls]), torch.cat([got(*a).flatten() for a in calls]))
    return layers


@torch.no_grad()
def chunk_latency(policies: dict, batch, repeats: int = 10, warmup: int = 2) -> dict[str, float]:
    """Median seconds of one batch-1 action chunk per policy, repeats interleaved."""
    times: dict[str, list[float]] = {name: [] for name in policies}
    for r in range(warmup + repeats):
        for name, policy in policies.items():
            b = batch.to(policy.device)
            cuda = policy.device.type == "cuda"
            if cuda:
                torch.cuda.synchronize(policy.device)
            t0 = time.perf_counter()
            policy.model.sample_actions(b)
            if cuda:
                torch.cuda.synchronize(policy.device)
            if r >= warmup:
                times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(t) for name, t in times.items()}


def folder_bytes(source: Path, state: dict[str, torch.Tensor], quantized: Path, scratch: Path) -> dict:
    """model.safetensors bytes on disk: the source (None when it is an FSDP `state/` checkpoint), a bf16
    copy of the source's weights `state` (written in `scratch`), the FP8 folder; and how much smaller
    the FP8 folder is than the bf16 copy, in percent."""
    from kilovla.models.checkpoints import save_safetensors

    bf16 = {k: v.detach().to("cpu", torch.bfloat16) if v.is_floating_point() else v.detach().cpu()
            for k, v in state.items()}
    copy = scratch / f".bf16-copy-{uuid.uuid4().hex[:8]}.safetensors"
    try:
        save_safetensors(bf16, copy)
        bf16_bytes = copy.stat().st_size
    finally:
        copy.unlink(missing_ok=True)
    file = source / "model.safetensors"
    quantized_bytes = (quantized / "model.safetensors").stat().st_size
    return {"source_bytes": file.stat().st_size if file.is_file() else None, "bf16_bytes": bf16_bytes,
            "quantized_bytes": quantized_bytes, "reduction_percent": 100 * (1 - quantized_bytes / bf16_bytes)}


def closed_loop_summary(evaluation: Callable[[object], dict], baseline, quantized, seed: int) -> dict:
    """Both policies through the same evaluation; torch is reseeded before each so the flow noise
    draws line up too."""
    out = {}
    for name, policy in (("baseline", baseline), ("quantized", quantized)):
        torch.manual_seed(seed)
        report = evaluation(policy)
        out[name] = {"overall": report["overall_success_rate"],
                     "per_task": {t: r["success_rate"] for t, r in report["per_task"].items()},
                     "episodes_per_task": report["episodes_per_task"]}
    a, b = out["baseline"]["overall"], out["quantized"]["overall"]
    out["difference_points"] = None if a is None or b is None else 100 * (b - a)
    return out


def write_report(folder: Path, report: dict) -> Path:
    """quant_report.json and quant_report.md, each written to a temp name and renamed."""
    lines = ["# FP8 quantization report", "", "| what | baseline | quantized | |", "|---|---|---|---|"]
    lines += [f"| {what} | {base} | {ours} | {note} |" for what, base, ours, note in report_rows(report)]
    for name, text in (("quant_report.json", json.dumps(report, indent=2, allow_nan=False)), ("quant_report.md", "\n".join(lines) + "\n")):
        tmp = folder / f".{name}.{uuid.uuid4().hex[:8]}"
        tmp.write_text(text)
        os.replace(tmp, folder / name)
    return folder / "quant_report.json"


def report_rows(report: dict) -> list[tuple[str, str, str, str]]:
    """(what, baseline, quantized, note) lines shared by the table and the markdown."""
    rows = []
    s = report["size"]
    source = "FSDP state/ shards" if s["source_bytes"] is None else f"{s['source_bytes'] / 1024:.1f} KiB"
    rows.append(("model.safetensors", f"{s['bf16_bytes'] / 1024:.1f} KiB (bf16)", f"{s['quantized_bytes'] / 1024:.1f} KiB",
                 f"{s['reduction_percent']:.1f} % smaller than bf16; source {source}; "
                 f"{s['fp8_params']} of {s['total_params']} params in FP8"))
    layers = report["layers"]
    rows.append(("min weight SQNR", "", f"{min(v['weight_sqnr_db'] for v in layers.values()):.1f} dB",
                 f"{len(layers)} FP8 layers"))
    a = report.get("actions")
    if a:
        name, value = min_output_sqnr(report)
        idle = sum(v.get("output_sqnr_db", 0) is None for v in layers.values())
        rows.append(("min layer output SQNR", "", "-" if value is None else f"{value:.1f} dB",
                     ("no selected layer runs at inference" if name is None else name)
                     + (f"; {idle} layers never run in inference" if idle else "")))
        rel = "-" if a["relative"] is None else f"{100 * a['relative']:.3f} %"
        bad = f"; {a['non_finite_actions']} non-finite action values" if a.get("non_finite_actions") else ""
        rows.append(("action MSE / action variance", "", rel, f"{a['samples']} held-out action steps{bad}"))
    else:
        rows.append(("action MSE", "", "not measured", "pass --quant.dataset=DIR"))
    c = report.get("closed_loop")
    if c:
        pct = lambda x: "-" if x is None else f"{100 * x:.1f} %"  # noqa: E731
        rows.append(("closed-loop success", pct(c["baseline"]["overall"]), pct(c["quantized"]["overall"]),
                     f"{c['baseline']['episodes_per_task']} episodes per task, same seeds"))
        for task in c["baseline"]["per_task"]:
            rows.append((f"  {task}", pct(c["baseline"]["per_task"][task]), pct(c["quantized"]["per_task"].get(task)), ""))
    else:
        rows.append(("closed-loop success", "", "not run", "pass --eval.n_episodes=N"))
    lat = report["latency"]
    rows.append(("batch-1 action chunk", f"{1e3 * lat['baseline_s']:.1f} ms", f"{1e3 * lat['quantized_s']:.1f} ms",
                 f"{lat['device']}, FP8 kernel: {lat['kernel']}"))
    return rows


def min_output_sqnr(report: dict) -> tuple[str | None, float | None]:
    """The FP8 layer with the lowest output SQNR on held-out samples (layers that never ran left out;
    (None, None) when none ran). `sqnr_db` maps NaN outputs to its floor, so none is skipped."""
    measured = {n: v["output_sqnr_db"] for n, v in report["layers"].items() if v.get("output_sqnr_db") is not None}
    if not measured:
        return None, None
    name = min(measured, key=measured.get)
    return name, measured[name]


def print_report(report: dict, console=None) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"FP8 block-wise PTQ of {report['source']}")
    for col in ("what", "baseline", "quantized", "note"):
        table.add_column(col, overflow="fold")
    for row in report_rows(report):
        table.add_row(*row)
    (console or Console(width=max(Console().width, 120))).print(table)
