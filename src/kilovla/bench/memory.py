"""`kilovla bench memory`: the peak memory of one training step of a 3B policy, by what trains.

Each configuration runs in a fresh process (`python -m kilovla.bench.memory --child ...`) so that one
peak cannot hide another: random weights of the published shapes (pi05-3b, groot-n15-3b) in float32,
a batch of 1 at the LIBERO layout (2 cameras present, 48 language tokens, 8-D state, the model's
action chunk), gradient checkpointing on (pi0 / pi0.5; GR00T has none), one forward, backward and
AdamW step. Peak: `ru_maxrss` on the CPU, `torch.cuda.max_memory_allocated` on a GPU.

- full: every parameter trainable. Where its bound (parameters x 16 bytes: fp32 weights, gradients,
  two AdamW moments) exceeds 80 % of this machine's memory it is not run; the row gives the bound,
  marked computed.
- expert_only: pi0.5 with its VLM frozen (the action expert and projections train); smolvla-base
  the same way, LeRobot's default for SmolVLA (its VLM and vision frozen, `state_proj` trained).
- lora: rank 16 adapters through peft on the family's default targets (models/lora.py), all else frozen.

Rows (DESIGN.md names): train_peak_mb_pi05_3b, train_peak_mb_groot_n15_3b (baseline full, ours LoRA),
train_peak_mb_pi05_3b_expert_only, train_peak_mb_smolvla_base_expert_only, train_step_s_pi05_3b_lora
(ours only). The JSON's extra holds every
run (peak, step time, trainable parameters, base weight bytes) and the target check
(LoRA peak <= 1.25 x the base weights' bytes, and below the expert-only peak).
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
        ("groot-n15-3b", "full"), ("groot-n15-3b", "lora"), ("smolvla-base", "expert_only"))
QUICK_PRESETS = {"pi05-3b": "pi05-tiny", "groot-n15-3b": "groot-tiny", "smolvla-base": "smolvla-tiny"}


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


def _bound(preset: str) -> dict:
    """Full fine-tuning's memory from the parameter count alone: fp32 weights + gradients + 2 AdamW moments."""
    from kilovla.models.presets import build_model

    n = sum(p.numel() for p in build_model(preset, device="meta").parameters())
    return {"preset": preset, "mode": "full", "peak_mb": 16 * n / 2**20, "computed": True, "parameters": n,
            "base_weight_mb": 4 * n / 2**20, "trainable": n}


def _measure(preset: str, mode: str, rank: int, tmp: Path) -> dict:
    out = tmp / f"{preset}-{mode}.json"
    env = {**os.environ, "OMP_NUM_THREADS": str(len(os.sched_getaffinity(0)))}
    proc = subprocess.run([sys.executable, "-m", "kilovla.bench.memory", "--child", preset, mode, str(rank), str(out)],
                          capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        raise RuntimeError(f"bench memory: {preset} {mode} failed (exit {proc.returncode}): {proc.stderr[-2000:]}")
    return json.loads(out.read_text())


def run(*, quick: bool = False, out_dir: str | Path = DEFAULT_OUT, console=None) -> Path:
    import torch

    from kilovla.progress import note

    out = Path(out_dir)
    tmp = out / "memory-runs"
    tmp.mkdir(parents=True, exist_ok=True)
    limit = (torch.cuda.get_device_properties(0).total_memory if torch.cuda.is_available()
             else psutil.virtual_memory().total)
    runs, rank = {}, QUICK_LORA_RANK if quick else LORA_RANK
    for preset, mode in RUNS:
        name = QUICK_PRESETS[preset] if quick else preset
        if mode == "full" and (bound := _bound(name))["peak_mb"] * 2**20 > 0.8 * limit:
            runs[(preset, mode)] = bound
            note(f"memory: {name} full fine-tuning needs >= {bound['peak_mb']:.0f} MiB (computed): not run")
            continue
        runs[(preset, mode)] = _measure(name, mode, rank, tmp)
        note(f"memory: {name} {mode}: peak {runs[(preset, mode)]['peak_mb']:.0f} MiB, "
             f"step {runs[(preset, mode)]['step_s']:.1f} s")

    def peak(preset, mode):
        return runs[(preset, mode)]["peak_mb"]

    def how(r):
        return "computed: parameters x 16 bytes" if r.get("computed") else f"measured ({r['measure']})"

    p_lora, g_lora = runs[("pi05-3b", "lora")], runs[("groot-n15-3b", "lora")]
    rows = [
        Row.compare("train_peak_mb_pi05_3b", "MiB", peak("pi05-3b", "full"), p_lora["peak_mb"], higher_is_better=False,
                    limit=round(1.25 * p_lora["base_weight_mb"], 1),
                    note=f"full fine-tuning {how(runs[('pi05-3b', 'full')])} vs LoRA rank {rank} "
                         f"({p_lora['trainable'] / 1e6:.1f} M trainable), batch 1, LIBERO layout, gradient "
                         f"checkpointing, fp32 weights; limit: 1.25 x the base weights ({p_lora['base_weight_mb']:.0f} MiB)"),
        Row.compare("train_peak_mb_groot_n15_3b", "MiB", peak("groot-n15-3b", "full"), g_lora["peak_mb"],
                    higher_is_better=False, limit=round(1.25 * g_lora["base_weight_mb"], 1),
                    note=f"full fine-tuning {how(runs[('groot-n15-3b', 'full')])} vs LoRA rank {rank} on the DiT "
                         f"({g_lora['trainable'] / 1e6:.1f} M trainable), batch 1, no gradient checkpointing (GR00T has "
                         f"none); limit: 1.25 x the base weights ({g_lora['base_weight_mb']:.0f} MiB)"),
        Row.compare("train_peak_mb_pi05_3b_expert_only", "MiB", None, peak("pi05-3b", "expert_only"),
                    higher_is_better=False,
                    note=f"VLM frozen, {runs[('pi05-3b', 'expert_only')]['trainable'] / 1e6:.0f} M trainable; "
                         f"{how(runs[('pi05-3b', 'expert_only')])}"),
        Row.compare("train_peak_mb_smolvla_base_expert_only", "MiB", None, peak("smolvla-base", "expert_only"),
                    higher_is_better=False,
                    note=f"LeRobot's SmolVLA recipe: VLM and vision frozen, "
                         f"{runs[('smolvla-base', 'expert_only')]['trainable'] / 1e6:.0f} M of "
                         f"{runs[('smolvla-base', 'expert_only')]['parameters'] / 1e6:.0f} M trainable, batch 1; "
                         f"{how(runs[('smolvla-base', 'expert_only')])}"),
        Row.compare("train_step_s_pi05_3b_lora", "s", None, p_lora["step_s"], higher_is_better=False,
                    note=f"one forward + backward + AdamW step, batch 1, {p_lora['device']}"),
    ]
    target = {"pi05_lora_within_1.25x_base": p_lora["peak_mb"] <= 1.25 * p_lora["base_weight_mb"],
              "pi05_lora_below_expert_only": p_lora["peak_mb"] < peak("pi05-3b", "expert_only"),
              "groot_lora_within_1.25x_base": g_lora["peak_mb"] <= 1.25 * g_lora["base_weight_mb"]}
    extra = {"runs": list(runs.values()), "target": target, "lora_rank": rank,
             "machine_memory_mb": limit / 2**20}
    return write_suite("memory", rows, quick=quick, out_dir=out_dir, extra=extra, console=console)


if __name__ == "__main__":
    if len(sys.argv) == 6 and sys.argv[1] == "--child":
        child(*sys.argv[2:])
    else:
        sys.exit("usage: python -m kilovla.bench.memory --child PRESET MODE RANK OUT.json (kilovla bench memory runs it)")
