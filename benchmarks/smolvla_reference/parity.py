"""kilovla's SmolVLAModel against LeRobot v0.4.4's outputs (reference.py), on the same weights and inputs.

Run with kilovla's venv (no LeRobot needed; the reference folders come from reference.py):
    PYTHONPATH=src python benchmarks/smolvla_reference/parity.py REF_DIR [REF_DIR ...] [--json OUT.json]

Per folder: the weights load through kilovla's checkpoint loader (LeRobot's "model."-prefixed layout,
strict), the inputs become a PaddedBatch (the empty camera a blank slot with its mask off, images back
in [0, 1]), and these are compared in fp32, as max |kilovla - LeRobot| and as the error scaled by
max(1, |LeRobot|) elementwise (the check: squared errors reach ~40, where fp32 spacing is 4e-6):

- v_t: the velocity for the reference's fixed noise and time;
- (u_t - v_t)^2: the unreduced loss per element;
- per-sample loss, loss_reduction="lerobot_v044": against `loss_per_sample` and the policy's own
  `SmolVLAPolicy.forward(reduction="none")`;
- per-sample loss, loss_reduction="kilovla": against LeRobot's unreduced loss averaged over the
  elements that count (steps not in `action_is_pad`, the first `action_dim` dims);
- v_t and the per-sample loss through the packed path (`packing=True`: no padding, varlen attention);
- the velocity of each of the 10 Euler steps, and the sampled actions (KV-cached and uncached).

Exits 1 when any scaled difference exceeds --tol (1e-5).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file

from kilovla.models.batch import PaddedBatch
from kilovla.models.checkpoints import load_checkpoint
from kilovla.models.language import DecoderConfig
from kilovla.models.smolvla import SmolVLAConfig, SmolVLAModel
from kilovla.models.vision import ViTConfig


def config_of(shapes: dict, reduction: str) -> SmolVLAConfig:
    s = shapes
    cams = s["num_cameras"] + s["empty_cameras"]
    return SmolVLAConfig(
        vision=ViTConfig(image_size=s["image_size"], patch_size=s["patch_size"], width=s["vision_width"],
                         depth=s["vision_layers"], heads=s["vision_heads"], mlp_dim=s["vision_mlp"]),
        scale_factor=s["scale_factor"],
        text=DecoderConfig(width=s["text_width"], depth=s["text_layers"], heads=s["text_heads"],
                           kv_heads=s["text_kv_heads"], head_dim=s["head_dim"], mlp_dim=s["text_mlp"],
                           vocab_size=s["vocab_size"]),
        num_vlm_layers=s["num_vlm_layers"], rms_norm_eps=s["rms_norm_eps"],
        expert_width_multiplier=s["expert_width_multiplier"], self_attn_every_n_layers=s["self_attn_every_n_layers"],
        chunk_size=s["chunk_size"], max_state_dim=s["max_state_dim"], max_action_dim=s["max_action_dim"],
        cameras=tuple(f"cam{i}" for i in range(cams)), max_language_tokens=s["prompt_length"],
        num_inference_steps=s["num_steps"], min_period=s["min_period"], max_period=s["max_period"],
        loss_reduction=reduction)


def batch_of(x: dict, s: dict, names: tuple[str, ...]) -> PaddedBatch:
    raw = x["images_raw"]  # (present cams, B, 3, H, W) in [0, 1]; the model maps them to [-1, 1] as LeRobot does
    blank = torch.zeros(x["images"].shape[0] - raw.shape[0], *raw.shape[1:])  # -1 after that map
    dims = torch.arange(s["max_action_dim"]) < s["action_dim"]
    return PaddedBatch(images=torch.cat([raw, blank]).transpose(0, 1), image_masks=x["img_masks"].T,
                       camera_names=names, tokens=x["lang_tokens"], token_mask=x["lang_masks"], state=x["state"],
                       actions=x["actions"], action_is_pad=x["action_is_pad"], action_dim_mask=dims)


def compare(ref_dir: Path) -> dict[str, dict[str, float]]:
    shapes = json.loads((ref_dir / "config.json").read_text())["shapes"]
    x, ref = load_file(ref_dir / "inputs.safetensors"), load_file(ref_dir / "outputs.safetensors")
    models = {}
    for reduction in ("lerobot_v044", "kilovla"):
        models[reduction] = model = SmolVLAModel(config_of(shapes, reduction)).eval()
        layout = load_checkpoint(model, ref_dir / "weights.safetensors", layout="lerobot")
        assert layout == "lerobot", layout
    model = models["lerobot_v044"]
    batch = batch_of(x, shapes, model.config.cameras)
    diff = {}  # name -> (kilovla, LeRobot)
    with torch.no_grad():
        out = model(batch, noise=x["noise"], time=x["time"])
        diff["v_t"] = out["v_t"], ref["v_t"]
        diff["(u_t - v_t)^2"] = (x["noise"] - x["actions"] - out["v_t"]) ** 2, ref["losses"]
        diff["loss per sample (lerobot_v044)"] = out["per_sample"], ref["loss_per_sample"]
        diff["policy loss per sample (lerobot_v044)"] = out["per_sample"], ref["policy_loss_per_sample"]
        weight = (~x["action_is_pad"])[..., None] * batch.action_dim_mask[None, None]
        expected = (ref["losses"] * weight).sum((1, 2)) / weight.sum((1, 2))
        diff["loss per sample (kilovla)"] = models["kilovla"](batch, noise=x["noise"], time=x["time"])["per_sample"], \
            expected
        model.config = dataclasses.replace(model.config, packing=True)  # the samples end to end, no padding
        packed = model(batch, noise=x["noise"], time=x["time"])
        model.config = dataclasses.replace(model.config, packing=False)
        diff["v_t (packed)"] = packed["v_t"], ref["v_t"]
        diff["loss per sample (packed, lerobot_v044)"] = packed["per_sample"], ref["loss_per_sample"]
        seen = []
        hook = model.action_out_proj.register_forward_hook(lambda mod, args, out: seen.append(out.detach().clone()))
        diff["sampled actions (cached)"] = model.sample_actions(batch, noise=x["sample_noise"].clone()), \
            ref["sampled_actions"]
        hook.remove()
        diff["step velocities (cached)"] = torch.stack(seen), ref["sample_velocities"]
        diff["sampled actions (uncached)"] = model.sample_actions(batch, noise=x["sample_noise"].clone(),
                                                                  use_cache=False), ref["sampled_actions"]
    return {name: {"abs": float((a - b).abs().max()), "scaled": float(((a - b).abs() / b.abs().clamp(min=1)).max())}
            for name, (a, b) in diff.items()}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("ref_dirs", type=Path, nargs="+")
    parser.add_argument("--tol", type=float, default=1e-5)
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args(argv)
    torch.use_deterministic_algorithms(True)
    results = {str(d): compare(d) for d in args.ref_dirs}
    worst = max(v["scaled"] for r in results.values() for v in r.values())
    for d, r in results.items():
        print(f"\n{d}")
        print(f"  {'quantity':42s} {'max abs diff':>13s} {'max scaled':>11s}")
        for name, v in r.items():
            print(f"  {name:42s} {v['abs']:13.3e} {v['scaled']:11.3e}{'' if v['scaled'] <= args.tol else '  > tol'}")
    record = {"tolerance": args.tol, "max_scaled_diff": worst, "pass": worst <= args.tol, "results": results}
    print(json.dumps(record))
    if args.json:
        args.json.write_text(json.dumps(record, indent=2) + "\n")
    return 0 if worst <= args.tol else 1


if __name__ == "__main__":
    sys.exit(main())
