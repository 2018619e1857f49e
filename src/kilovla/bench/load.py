"""`kilovla bench load`: peak memory and time to load a published-size checkpoint.

Random weights shaped like ``pi05-3b`` and ``groot-n15-3b`` are written as Hugging Face shards of
bf16 safetensors (2 GB each) into a temporary folder (``$KILOVLA_BENCH_TMP`` or the system's), which
is deleted afterwards. Each load runs in a fresh process: build the model on the meta device, then
`load_weights` (plan from the headers, materialise, read tensor by tensor into the parameters).

- ``load_peak_rss_mb_<preset>``: bf16 parameters. baseline = the process before loading + 2x the
  bf16 bytes, what a naive load holds (the model, and the whole state dict read beside it);
  limit = the process + 1x (the parameters alone).
- ``load_peak_rss_mb_<preset>_fp32``: fp32 parameters, kilovla's training dtype. baseline = process
  + 3x bf16 bytes (fp32 model + bf16 state dict), limit = process + 2x.
- ``load_s_<preset>``: wall time of the bf16 load (files in the page cache, written just before).

``--quick`` runs the tiny presets instead, for a smoke test; its rows are named for them (``load_peak_rss_mb_pi05_tiny``).
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from kilovla.bench.common import DEFAULT_OUT, Row, write_suite

PRESETS = {"pi05-3b": "pi05_3b", "groot-n15-3b": "groot_n15_3b"}
QUICK = {"pi05-tiny": "pi05_tiny", "groot-tiny": "groot_tiny"}  # rows named for the shapes they measure
SHARD_BYTES = 2 * 10**9


def write_random_checkpoint(name: str, folder: Path, max_shard_bytes: int = SHARD_BYTES) -> int:
    """Random bf16 weights with `name`'s keys and shapes, sharded; returns the bytes written."""
    import torch

    from kilovla.models.checkpoints import save_sharded
    from kilovla.models.presets import build_model

    specs = {k: (tuple(v.shape), torch.bfloat16) for k, v in build_model(name, device="meta").state_dict().items()}
    folder.mkdir(parents=True, exist_ok=True)
    save_sharded(specs, lambda k: torch.empty(specs[k][0], dtype=torch.bfloat16).uniform_(-0.05, 0.05), folder,
                 max_shard_bytes)
    return sum(math.prod(shape) * 2 for shape, _ in specs.values())


def _status_mb(field: str) -> float:
    """A memory line of /proc/self/status in MiB (VmRSS: now, VmHWM: peak of this process image;
    unlike ru_maxrss, VmHWM does not inherit the parent's peak across fork + exec)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    raise RuntimeError(f"/proc/self/status has no {field}")


def measure_load(name: str, folder: str, dtype: str) -> dict:
    """In this process: meta build + `load_weights`; peak RSS and wall time (run in a fresh process)."""
    import time

    import torch

    from kilovla.models.checkpoints import load_weights
    from kilovla.models.presets import build_model

    before = _status_mb("VmRSS")
    t0 = time.perf_counter()
    model = build_model(name, device="meta")
    load_weights(model, folder, dtype=getattr(torch, dtype), progress=False)
    wall = time.perf_counter() - t0
    params = sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20
    return {"before_mb": before, "peak_mb": _status_mb("VmHWM"), "wall_s": wall, "params_mb": params}


def _in_fresh_process(name: str, folder: Path, dtype: str) -> dict:
    code = ("import json, sys; from kilovla.bench.load import measure_load; "
            f"print(json.dumps(measure_load({name!r}, {str(folder)!r}, {dtype!r})))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    if proc.returncode != 0:
        raise RuntimeError(f"loading {name} failed: {proc.stderr.strip().splitlines()[-1:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def run(quick: bool = False, out_dir: str | Path = DEFAULT_OUT) -> Path:
    from rich.console import Console

    console = Console(stderr=True)
    rows: list[Row] = []
    tmp = Path(tempfile.mkdtemp(prefix="kilovla-load-", dir=os.environ.get("KILOVLA_BENCH_TMP")))
    try:
        for name, label in (QUICK if quick else PRESETS).items():
            folder = tmp / name
            console.print(f"load: writing random bf16 {name} weights to {folder}")
            nbytes = write_random_checkpoint(name, folder)
            mb = nbytes / 2**20
            bf16 = _in_fresh_process(name, folder, "bfloat16")
            fp32 = _in_fresh_process(name, folder, "float32")
            shape = f"{name} shapes, {len(list(folder.glob('*.safetensors')))} bf16 shards, {mb:.0f} MiB"
            rows.append(Row.compare(f"load_peak_rss_mb_{label}", "MiB", bf16["before_mb"] + 2 * mb, bf16["peak_mb"],
                                    higher_is_better=False, limit=round(bf16["before_mb"] + mb),
                                    note=f"{shape}; into bf16 params; baseline = process ({bf16['before_mb']:.0f}) "
                                         "+ 2x bf16 bytes (naive: model + state dict)"))
            rows.append(Row.compare(f"load_peak_rss_mb_{label}_fp32", "MiB", fp32["before_mb"] + 3 * mb,
                                    fp32["peak_mb"], higher_is_better=False, limit=round(fp32["before_mb"] + 2 * mb),
                                    note="into fp32 params (training dtype); baseline = process + fp32 model + "
                                         "bf16 state dict"))
            rows.append(Row.compare(f"load_s_{label}", "s", None, bf16["wall_s"], higher_is_better=False,
                                    note=f"meta build + plan + read into bf16 params, {mb / bf16['wall_s']:.0f} MiB/s; "
                                         f"fp32: {fp32['wall_s']:.1f} s"))
            shutil.rmtree(folder, ignore_errors=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return write_suite("load", rows, quick=quick, out_dir=out_dir)
