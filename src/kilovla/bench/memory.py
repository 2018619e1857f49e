"""`kilovla bench memory`: the peak memory of one training step of a 3B policy, by what trains.

Each configuration runs in a fresh process (`python -m kilovla.bench.memory --child ...`) so that one
peak cannot hide another: random weights of the published shapes (pi05-3b, groot-n15-3b,
groot-n17-3b, smolvla-base) in float32, a batch of 1 at the LIBERO layout (2 cameras present, 48
language tokens, 8-D state, the model's action chunk), gradient checkpointing on (pi0 / pi0.5; GR00T
has none), one forward, backward and AdamW step. Peak: `ru_maxrss` on the CPU, `torch.cuda.max_memory_allocated` on a GPU.

- full: every parameter trainable.
- expert_only: pi0.5 with its VLM frozen (the action expert and projections train); smolvla-base
  the same way, LeRobot's default for SmolVLA (its VLM and vision frozen, `state_proj` trained);
  groot-n17-3b with its Qwen3-VL backbone frozen (the action head trains: DiT, VL self-attention,
  vlln, state / action encoders and decoder).
- lora: rank 16 adapters through peft on the family's default targets (models/lora.py), all else frozen.

A full or expert_only run whose bound (fp32 weights x 4 bytes + trainable parameters x 12: gradients
and two AdamW moments) exceeds 80 % of this machine's memory is not run; the row gives the bound,
marked computed.

Rows (DESIGN.md names): train_peak_mb_pi05_3b, train_peak_mb_groot_n15_3b (baseline full, ours LoRA),
train_peak_mb_groot_n17_3b (the same pair), train_peak_mb_pi05_3b_expert_only,
train_peak_mb_smolvla_base_expert_only, train_peak_mb_groot_n17_3b_dit_only, train_step_s_pi05_3b_lora
(ours only). The JSON's extra holds every run (peak, step time, trainable parameters, base weight
bytes) and the target check (LoRA peak <= 1.25 x the base weights' bytes, and below the expert-only peak).
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import psutil

from kilovla.bench.common import DEFAULT_OUT, Row, write_suite

LORA_RANK = 16
QUICK_LORA_RANK = 2  # the tiny presets are narrower than 16
LANGUAGE_TOKENS = 48
RUNS = (("pi05-3b", "full"), ("pi05-3b", "expert_only"), ("pi05-3b", "lora"),
        ("groot-n15-3b", "full"), ("groot-n15-3b", "lora"), ("smolvla-base", "expert_only"),
        ("groot-n17-3b", "full"), ("groot-n17-3b", "expert_only"), ("groot-n17-3b", "lora"))
QUICK_PRESETS = {"pi05-3b": "pi05-tiny", "groot-n15-3b": "groot-tiny", "smolvla-base": "smolvla-tiny",
                 "groot-n17-3b": "groot-n17-tiny"}


def _batch(cfg, device):
    import torch

    from kilovla.models.batch import PaddedBatch

    g = torch.Generator().manual_seed(0)
    cams, s = len(cfg.cameras), cfg.vision.image_size
    from kilovla.models.family import chunk_length, vocab_size

    horizon, vocab = chunk_length(cfg), vocab_size(cfg)
    batch = PaddedBatch(images=torch.rand(1, cams, 3, s, s, generator=g),
                        image_masks=torch.arange(cams).unsqueeze(0) < min(2, cams), camera_names=cfg.cameras,
                        tokens=torch.randint(1, min(vocab, 250), (1, LANGUAGE_TOKENS), generator=g),
                        token_mask=torch.ones(1, LANGUAGE_TOKENS, dtype=torch.bool),
                        state=torch.randn(1, cfg.max_state_dim, generator=g),
                        actions=torch.randn(1, horizon, cfg.max_action_dim, generator=g),
                        action_is_pad=torch.zeros(1, horizon, dtype=torch.bool))
    return batch.to(device), torch.randn(batch.actions.shape, generator=g).to(device), torch.rand(1, generator=g).to(device)


def child(preset: str, mode: str, rank: str, out: str) -> None:
    """One configuration's step, measured in this (fresh) process; writes its record to `out`."""
    import torch

    from kilovla.models.lora import LoraSettings, apply_lora
    from kilovla.models.presets import build_model
    from kilovla.train.build import apply_freeze

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    t0 = time.perf_counter()
    model = build_model(preset, device=device)
    built_s = time.perf_counter() - t0
    base_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    if mode == "lora":
        apply_lora(model, LoraSettings(rank=int(rank)))
    apply_freeze(model, freeze_vlm=mode == "expert_only", gradient_checkpointing=True)
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trainable, lr=1e-5, fused=False, foreach=False)
    batch, noise, t = _batch(model.config, device)
    model.train()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    loss = model(batch, noise=noise, time=t)["loss"]
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    step_s = time.perf_counter() - t0
    peak = (torch.cuda.max_memory_allocated() if device.type == "cuda"
            else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
    record = {"preset": preset, "mode": mode, "peak_mb": peak / 2**20, "step_s": step_s, "build_s": built_s,
              "device": device.type, "measure": "cuda max_memory_allocated" if device.type == "cuda" else "ru_maxrss",
              "base_weight_mb": base_bytes / 2**20, "parameters": sum(p.numel() for p in model.parameters()),
              "trainable": sum(p.numel() for p in trainable), "loss": float(loss)}
    Path(out).write_text(json.dumps(record))


def _bound(preset: str, mode: str) -> dict:
    """A full or expert_only step's memory from parameter counts alone: every fp32 weight (4 bytes) and, for
    each trainable one, its gradient and two AdamW moments (12 bytes)."""
    from kilovla.models.presets import build_model
    from kilovla.train.build import apply_freeze

    model = build_model(preset, device="meta")
    apply_freeze(model, freeze_vlm=mode == "expert_only")
    n = sum(p.numel() for p in model.parameters())
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return {"preset": preset, "mode": mode, "peak_mb": (4 * n + 12 * trainable) / 2**20, "computed": True,
            "parameters": n, "base_weight_mb": 4 * n / 2**20, "trainable": trainable}


def _measure(preset: str, mode: str, rank: int, tmp: Path) -> dict:
    out = tmp / f"{preset}-{mode}.json"
    env = {**os.environ, "OMP_NUM_THREADS": str(len(os.sched_getaffinity(0)))}
    proc = subprocess.run([sys.executable, "-m", "kilovla.bench.memory", "--child", preset, mode, str(rank), str(out)],
                          capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        raise RuntimeError(f"bench memory: {preset} {mode} failed (exit {proc.returncode}): {proc.stderr[-2000:]}")
    return json.loads(out.read_text())


def _runs(quick: bool, tmp: Path, limit: int, rank: int) -> dict:
    """Every configuration of RUNS measured in its own process, or its bound where that exceeds 80 % of `limit`."""
    from kilovla.progress import note

    runs = {}
    for preset, mode in RUNS:
        name = QUICK_PRESETS[preset] if quick else preset
        if mode != "lora" and (bound := _bound(name, mode))["peak_mb"] * 2**20 > 0.8 * limit:
            runs[(preset, mode)] = bound
            note(f"memory: {name} {mode} needs >= {bound['peak_mb']:.0f} MiB (computed): not run")
            continue
        runs[(preset, mode)] = _measure(name, mode, rank, tmp)
        note(f"memory: {name} {mode}: peak {runs[(preset, mode)]['peak_mb']:.0f} MiB, "
             f"step {runs[(preset, mode)]['step_s']:.1f} s")
    return runs


def _how(r: dict) -> str:
    return "computed: weights x 4 bytes + trainable x 12" if r.get("computed") else f"measured ({r['measure']})"


def _groot_lora_row(name: str, preset: str, runs: dict, rank: int) -> Row:
    lora = runs[(preset, "lora")]
    return Row.compare(name, "MiB", runs[(preset, "full")]["peak_mb"], lora["peak_mb"], higher_is_better=False,
                       limit=round(1.25 * lora["base_weight_mb"], 1),
                       note=f"full fine-tuning {_how(runs[(preset, 'full')])} vs LoRA rank {rank} on the DiT "
                            f"({lora['trainable'] / 1e6:.1f} M trainable), batch 1, no gradient checkpointing (GR00T "
                            f"has none); limit: 1.25 x the base weights ({lora['base_weight_mb']:.0f} MiB)")


def _rows(runs: dict, rank: int) -> list[Row]:
    p_lora, p_expert = runs[("pi05-3b", "lora")], runs[("pi05-3b", "expert_only")]
    smol, n17 = runs[("smolvla-base", "expert_only")], runs[("groot-n17-3b", "expert_only")]
    return [
        Row.compare("train_peak_mb_pi05_3b", "MiB", runs[("pi05-3b", "full")]["peak_mb"], p_lora["peak_mb"],
                    higher_is_better=False, limit=round(1.25 * p_lora["base_weight_mb"], 1),
                    note=f"full fine-tuning {_how(runs[('pi05-3b', 'full')])} vs LoRA rank {rank} "
                         f"({p_lora['trainable'] / 1e6:.1f} M trainable), batch 1, LIBERO layout, gradient "
                         f"checkpointing, fp32 weights; limit: 1.25 x the base weights ({p_lora['base_weight_mb']:.0f} MiB)"),
        _groot_lora_row("train_peak_mb_groot_n15_3b", "groot-n15-3b", runs, rank),
        _groot_lora_row("train_peak_mb_groot_n17_3b", "groot-n17-3b", runs, rank),
        Row.compare("train_peak_mb_pi05_3b_expert_only", "MiB", None, p_expert["peak_mb"], higher_is_better=False,
                    note=f"VLM frozen, {p_expert['trainable'] / 1e6:.0f} M trainable; {_how(p_expert)}"),
        Row.compare("train_peak_mb_smolvla_base_expert_only", "MiB", None, smol["peak_mb"], higher_is_better=False,
                    note=f"LeRobot's SmolVLA recipe: VLM and vision frozen, {smol['trainable'] / 1e6:.0f} M of "
                         f"{smol['parameters'] / 1e6:.0f} M trainable, batch 1; {_how(smol)}"),
        Row.compare("train_peak_mb_groot_n17_3b_dit_only", "MiB", None, n17["peak_mb"], higher_is_better=False,
                    note=f"Qwen3-VL backbone frozen (freeze_vlm): the action head trains (DiT, VL self-attention, "
                         f"encoders), {n17['trainable'] / 1e6:.0f} M of {n17['parameters'] / 1e6:.0f} M, batch 1; "
                         f"{_how(n17)}"),
        Row.compare("train_step_s_pi05_3b_lora", "s", None, p_lora["step_s"], higher_is_better=False,
                    note=f"one forward + backward + AdamW step, batch 1, {p_lora['device']}"),
    ]


def run(*, quick: bool = False, out_dir: str | Path = DEFAULT_OUT, console=None) -> Path:
    import torch

    tmp = Path(out_dir) / "memory-runs"
    tmp.mkdir(parents=True, exist_ok=True)
    limit = (torch.cuda.get_device_properties(0).total_memory if torch.cuda.is_available()
             else psutil.virtual_memory().total)
    rank = QUICK_LORA_RANK if quick else LORA_RANK
    runs = _runs(quick, tmp, limit, rank)
    p_lora = runs[("pi05-3b", "lora")]

    def within(preset):
        return runs[(preset, "lora")]["peak_mb"] <= 1.25 * runs[(preset, "lora")]["base_weight_mb"]

    target = {"pi05_lora_within_1.25x_base": within("pi05-3b"),
              "pi05_lora_below_expert_only": p_lora["peak_mb"] < runs[("pi05-3b", "expert_only")]["peak_mb"],
              "groot_lora_within_1.25x_base": within("groot-n15-3b"),
              "groot_n17_lora_within_1.25x_base": within("groot-n17-3b")}
    extra = {"runs": list(runs.values()), "target": target, "lora_rank": rank,
             "machine_memory_mb": limit / 2**20}
    return write_suite("memory", _rows(runs, rank), quick=quick, out_dir=out_dir, extra=extra, console=console)


if __name__ == "__main__":
    if len(sys.argv) == 6 and sys.argv[1] == "--child":
        child(*sys.argv[2:])
    else:
        sys.exit("usage: python -m kilovla.bench.memory --child PRESET MODE RANK OUT.json (kilovla bench memory runs it)")
