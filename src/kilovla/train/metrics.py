"""Metrics: one JSON line per step (and per evaluation), TensorBoard when installed, a PNG at the end."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

log = logging.getLogger(__name__)

# Dense bf16 peak FLOP/s per GPU (vendor figures), for MFU estimates.
PEAK_BF16_FLOPS = {"H100": 989e12, "H200": 989e12, "A100": 312e12, "L40S": 362e12}


def peak_flops(device) -> float | None:
    """The bf16 peak of a CUDA device, or None (CPU, or a GPU not in the table)."""
    import torch

    if getattr(device, "type", device) != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((v for k, v in PEAK_BF16_FLOPS.items() if k in name), None)


def mfu(params: int, tokens_per_s: float, device) -> float | None:
    """Model FLOPs utilisation: 6 * trainable params * tokens/s over the device's peak (attention left out)."""
    peak = peak_flops(device)
    return None if peak is None else 6.0 * params * tokens_per_s / peak


_told_no_tensorboard = False


def _tensorboard_writer(folder: Path, metrics_path: Path):
    """A SummaryWriter into `folder`, or None where tensorboard is not installed; that is said once per
    process, at WARNING, so a user who expects the TensorBoard curves learns why there are none."""
    global _told_no_tensorboard
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        if not _told_no_tensorboard:
            _told_no_tensorboard = True
            log.warning("tensorboard is not installed (pip install 'kilovla[tensorboard]'; `make venv` does): "
                        "metrics go to %s only", metrics_path)
        return None
    return SummaryWriter(str(folder))


class MetricsLogger:
    """Appends to run_dir/metrics.jsonl. `resume_step`: a run continuing from the checkpoint of that
    step first drops what the interrupted run logged after it, so no step appears twice."""

    def __init__(self, run_dir: Path, enabled: bool = True, resume_step: int | None = None):
        self.path = Path(run_dir) / "metrics.jsonl"
        self.enabled = enabled
        self._tb = None
        if enabled:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            if resume_step is not None:
                self._truncate_after(resume_step)
            self._tb = _tensorboard_writer(Path(run_dir) / "tensorboard", self.path)

    def _truncate_after(self, step: int) -> None:
        kept = [r for r in read_metrics(self.path) if r.get("step", 0) <= step]
        tmp = self.path.with_name(f".{self.path.name}.tmp")
        tmp.write_text("".join(json.dumps(r) + "\n" for r in kept))
        os.replace(tmp, self.path)

    def log(self, record: dict) -> None:
        if not self.enabled:
            return
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")
        if self._tb is not None:
            step = record.get("step", 0)
            for k, v in record.items():
                if isinstance(v, (int, float)) and k != "step":
                    self._tb.add_scalar(f"{record.get('kind', 'train')}/{k}", v, step)

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()


def read_metrics(path: Path) -> list[dict]:
    if not Path(path).is_file():
        return []
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def plot_learning_curve(metrics_path: Path, out_png: Path) -> Path | None:
    """Loss per step (and closed-loop success where evaluated) as a PNG."""
    records = read_metrics(metrics_path)
    train = [r for r in records if r.get("kind", "train") == "train"]
    evals = [r for r in records if r.get("kind") == "eval" and r.get("success_rate") is not None]
    if not train:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot([r["step"] for r in train], [r["loss"] for r in train], lw=1, label="train loss")
    ax.set_xlabel("step")
    ax.set_ylabel("flow-matching loss")
    ax.set_yscale("log")
    if evals:
        ax2 = ax.twinx()
        ax2.plot([r["step"] for r in evals], [r["success_rate"] for r in evals], "o-", color="tab:green",
                 label="closed-loop success")
        ax2.set_ylabel("success rate")
        ax2.set_ylim(0, 1)
    ax.set_title("kilovla training")
    fig.tight_layout()
    out_png = Path(out_png)
    fig.savefig(out_png, dpi=120)
    plt.close(fig)
    return out_png
