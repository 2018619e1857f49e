"""`kilovla bench scaling`: the trainer on 2 ranks (torchrun, gloo on CPU, NCCL on GPU), DDP and FSDP2,
with one packed row per rank per step against several.

Each configuration is a real `kilovla train` run on a synthetic dataset (pi0.5 tiny, 64 px, two
cameras); the rows report the median training throughput over the steps after warm-up, from the
run's metrics.jsonl. Rows `train_samples_per_s_{ddp,fsdp}_rows`: baseline = 1 row per rank (a
gradient reduction for every row's worth of samples), ours = 4 rows per rank accumulated with one
reduction per step. Row `train_samples_per_s_fsdp_vs_ddp`: the per-layer FSDP2 cost against DDP at 4
rows per rank (ratio < 1 is what sharding costs in communication on this machine). Rows
`train_samples_per_s_{tp2,pp2}`: the same 2 ranks as one model replica split by tensor parallelism
(heads and MLP halves, two all-reduces per layer) or as two pipeline stages (1F1B over the step's 8
rows), against DDP on them at the same global batch: what a mesh costs where the model would fit
one device anyway; on GPUs that do not hold the model, it is the only way to train at all. Row
`train_samples_per_s_ep2`: pi0.5's action expert as a mixture of 4 experts (top 2), DDP (each rank
all 4 experts) vs EP=2 (2 experts a rank, tokens exchanged by two all-to-alls per MoE layer) on the
same 2 ranks and batch: what the expert exchange costs where the experts fit one device.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from kilovla.bench.common import DEFAULT_OUT, Row, write_suite
from kilovla.data.synthetic import make_synthetic_dataset

SAMPLES_PER_ROW = 4
MOE = ("--policy.moe.num_experts=4", "--policy.moe.top_k=2")
TOKEN_BUDGET = 760  # 4 samples of ~150-180 tokens (2 x 64 camera tokens, a short prompt, 8 actions)


def _train(dataset: Path, run: Path, strategy: str, rows_per_rank: int, steps: int, mesh: tuple = ()) -> list[dict]:
    world = 2
    args = [*mesh, f"--run_dir={run}", f"--steps={steps}", f"--dataset.roots=[{dataset}]",
            f"--batch.global_batch_size={world * rows_per_rank * SAMPLES_PER_ROW}",
            f"--batch.token_budget={TOKEN_BUDGET}", f"--checkpoint.every={steps}", "--progress=false",
            "--policy.overrides={packing: true, vision: {image_size: 64}}", f"--parallel.strategy={strategy}"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(world), "-m", "kilovla", "train", *args]
    env = {**os.environ, "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 2) // world))}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800)
    if proc.returncode != 0:
        raise RuntimeError(f"{strategy} {' '.join(mesh)} run with {rows_per_rank} rows per rank failed:\n"
                           f"{proc.stderr[-2000:]}")
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def run(*, quick: bool = False, out_dir: str | Path = DEFAULT_OUT, console=None) -> Path:
    steps, warmup = (4, 1) if quick else (10, 3)
    results: dict[tuple[str, int], dict] = {}
    with tempfile.TemporaryDirectory(prefix="kilovla-scaling-") as tmp:
        dataset = make_synthetic_dataset(Path(tmp) / "ds", episodes=12, frames=(30, 50), resolution=(64, 64), seed=0)
        runs = [(strategy, rows, ()) for strategy in ("ddp", "fsdp") for rows in (1, 4)]
        runs += [(name, 4, (f"--parallel.{name[:2]}=2",)) for name in ("tp2", "pp2")]
        runs += [("ddp_moe", 4, MOE), ("ep2", 4, (*MOE, "--parallel.ep=2"))]
        for strategy, rows, mesh in runs:
            records = _train(dataset, Path(tmp) / f"{strategy}-{rows}", "ddp" if mesh else strategy, rows, steps,
                             mesh)[warmup:]
            results[(strategy, rows)] = {
                "samples_per_s": statistics.median(r["samples_per_s"] for r in records),
                "step_time_s": statistics.median(r["step_time_s"] for r in records),
                "rows_per_rank": statistics.median(r["rows_per_rank"] for r in records),
                "attention_backend": records[-1]["attention_backend"]}
    rows = []
    for strategy in ("ddp", "fsdp"):
        one, four = results[(strategy, 1)], results[(strategy, 4)]
        rows.append(Row.compare(
            f"train_samples_per_s_{strategy}_rows", "samples/s", one["samples_per_s"], four["samples_per_s"],
            higher_is_better=True,
            note=f"2 ranks, {strategy}; {one['rows_per_rank']:g} vs {four['rows_per_rank']:g} rows per rank per step "
                 f"(step {one['step_time_s']:.2f} s vs {four['step_time_s']:.2f} s); pi05-tiny 64 px, "
                 f"{four['attention_backend']}"))
    rows.append(Row.compare("train_samples_per_s_fsdp_vs_ddp", "samples/s", results[("ddp", 4)]["samples_per_s"],
                            results[("fsdp", 4)]["samples_per_s"], higher_is_better=True,
                            note="2 ranks, 4 rows per rank: DDP vs FSDP2 with one unit per layer"))
    ddp = results[("ddp", 4)]
    for name, how in (("tp2", "TP=2 (one replica: heads and MLP split over the 2 ranks)"),
                      ("pp2", "PP=2 (one replica: 1 layer per stage, 1F1B)")):
        mesh = results[(name, 4)]
        rows.append(Row.compare(f"train_samples_per_s_{name}", "samples/s", ddp["samples_per_s"], mesh["samples_per_s"],
                                higher_is_better=True,
                                note=f"2 ranks, {SAMPLES_PER_ROW * 8} samples a step: DDP (2 replicas, 4 rows each) vs "
                                     f"{how}, {mesh['rows_per_rank']:g} rows per replica; step {ddp['step_time_s']:.2f} s "
                                     f"vs {mesh['step_time_s']:.2f} s"))
    moe, ep = results[("ddp_moe", 4)], results[("ep2", 4)]
    rows.append(Row.compare("train_samples_per_s_ep2", "samples/s", moe["samples_per_s"], ep["samples_per_s"],
                            higher_is_better=True,
                            note=f"2 ranks, MoE expert E=4 K=2: DDP (all experts on each rank) vs EP=2 (2 experts a "
                                 f"rank, all-to-all per MoE layer); step {moe['step_time_s']:.2f} s vs "
                                 f"{ep['step_time_s']:.2f} s"))
    from kilovla.bench.scaling_model import ep_table, table

    extra = {"runs": {f"{s}_rows_{r}": v for (s, r), v in results.items()}, "world_size": 2,
             "scaling_model": table(), "scaling_model_ep": ep_table()}  # estimates for 8-1024 GPUs (bench/scaling_model.py), not measured
    return write_suite("scaling", rows, quick=quick, out_dir=out_dir, extra=extra, console=console)
