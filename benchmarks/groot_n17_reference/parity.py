"""kilovla's GR00T N1.7 against NVIDIA's (reference.py, in the side venv setup_venv.sh makes) on the same
random weights and inputs at tiny shapes, fp32 on CPU.

    bash benchmarks/groot_n17_reference/setup_venv.sh ISAAC_GR00T_GIT_DIR      # once
    PYTHONPATH=src python benchmarks/groot_n17_reference/parity.py [--venv DIR] [--out DIR] [--json OUT.json]

Per case this writes the inputs (pre-tokenized prompts with Qwen3-VL's vision start / image pad / vision
end tokens, images in [0, 1], which the reference turns into pixel_values with transformers' Qwen3-VL
image processor, no resize, mean = std = 0.5), runs NVIDIA's code on them, loads NVIDIA's state dict into `GrootN17Model` with `load_state_dict(strict=True)` (its unused LM
head left out: the module trees are the same) and compares, as max |kilovla - NVIDIA| and as that error
scaled by max(1, |NVIDIA|) elementwise:

- pixel_values: kilovla's `patchify` against the image processor's;
- backbone features: the truncated Qwen3-VL's output before vlln, at real tokens; which are image tokens;
- the training flow time drawn from the global RNG (seed 3), and the loss with forward's own noise and
  time draws (seed 4);
- v_t: the velocity for the reference's noise and t; (u_t - v_t)^2 masked per element; the loss;
- v_t and the loss through the packed path (`packing=True`);
- the velocity of each of the 4 Euler steps of `get_action`, and the sampled actions.

Cases: "unpadded" (two samples of two cameras and equal prompt lengths, a one-layer VL self-attention)
and "padded" (the second sample has one camera and a shorter, right-padded prompt; no VL
self-attention, which NVIDIA runs over padding unmasked). Exits 1 when a scaled difference exceeds --tol.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from kilovla.models.batch import PaddedBatch
from kilovla.models.groot.dit import DiTConfig
from kilovla.models.groot_n17 import GrootN17Config, GrootN17Model, QwenViTConfig
from kilovla.models.groot_n17.model import patchify
from kilovla.models.language import DecoderConfig

HERE = Path(__file__).resolve().parent
SHAPES = {"vocab_size": 320, "image_token_id": 300, "text_width": 32, "text_mlp": 64, "select_layer": 3,
          "text_layers": 4, "text_heads": 4, "text_kv_heads": 2, "text_head_dim": 8, "rope_theta": 100.0,
          "mrope_section": [2, 1, 1], "image_size": 48, "patch_size": 8, "vision_layers": 3, "vision_width": 32,
          "vision_heads": 2, "vision_mlp": 64, "position_embeddings": 16, "deepstack_layers": [0, 2],
          "dit_layers": 4, "dit_heads": 2, "dit_head_dim": 16, "hidden_size": 32, "max_state_dim": 8,
          "max_action_dim": 8, "action_dim": 6, "action_horizon": 8, "max_seq_len": 64, "num_embodiments": 2,
          "vl_self_attention_heads": 2, "vl_self_attention_head_dim": 16, "num_steps": 4, "seed": 0,
          "weight_noise": 0.05}
CASES = {"unpadded": {"vl_self_attention_layers": 1, "padded": False},
         "padded": {"vl_self_attention_layers": 0, "padded": True}}


def config_of(s: dict) -> GrootN17Config:
    return GrootN17Config(
        vision=QwenViTConfig(image_size=s["image_size"], patch_size=s["patch_size"], width=s["vision_width"],
                             depth=s["vision_layers"], heads=s["vision_heads"], mlp_dim=s["vision_mlp"],
                             position_embeddings=s["position_embeddings"], deepstack_layers=tuple(s["deepstack_layers"])),
        llm=DecoderConfig(width=s["text_width"], depth=s["select_layer"], heads=s["text_heads"],
                          kv_heads=s["text_kv_heads"], head_dim=s["text_head_dim"], mlp_dim=s["text_mlp"],
                          vocab_size=s["vocab_size"]),
        rope_theta=s["rope_theta"], mrope_section=tuple(s["mrope_section"]),
        vl_self_attention_depth=s["vl_self_attention_layers"], vl_self_attention_heads=s["vl_self_attention_heads"],
        vl_self_attention_head_dim=s["vl_self_attention_head_dim"],
        dit=DiTConfig(depth=s["dit_layers"], heads=s["dit_heads"], head_dim=s["dit_head_dim"],
                      output_dim=s["hidden_size"]),
        hidden_size=s["hidden_size"], action_horizon=s["action_horizon"], max_action_dim=s["max_action_dim"],
        max_state_dim=s["max_state_dim"], num_embodiments=s["num_embodiments"], max_seq_len=s["max_seq_len"],
        num_inference_steps=s["num_steps"], cameras=("cam0", "cam1"), image_token_id=s["image_token_id"])


def prompt(g: torch.Generator, s: dict, texts: list[int], images: int) -> list[int]:
    """Random text runs with `images` images between them: [text | <vision_start> <image_pad> x P <vision_end> | ...]."""
    img, per = s["image_token_id"], (s["image_size"] // s["patch_size"] // 2) ** 2
    out = []
    for i, n in enumerate(texts):
        out += torch.randint(0, img, (n,), generator=g).tolist()
        if i < images:
            out += [img + 1] + [img] * per + [img + 2]
    return out


def make_inputs(s: dict, padded: bool) -> tuple[PaddedBatch, dict]:
    """The batch kilovla reads and the tensors NVIDIA's model reads, of the same samples."""
    g = torch.Generator().manual_seed(s["seed"] + 1)
    b, h, a = 2, s["action_horizon"], s["max_action_dim"]
    prompts = [prompt(g, s, [3, 2, 4], 2), prompt(g, s, [2, 3], 1) if padded else prompt(g, s, [1, 3, 5], 2)]
    length = max(map(len, prompts))
    tokens = torch.zeros(b, length, dtype=torch.long)
    mask = torch.zeros(b, length, dtype=torch.bool)
    for i, p in enumerate(prompts):
        tokens[i, :len(p)], mask[i, :len(p)] = torch.tensor(p), True
    images = torch.rand(b, 2, 3, s["image_size"], s["image_size"], generator=g)
    present = torch.tensor([[True, True], [True, not padded]])
    is_pad = torch.zeros(b, h, dtype=torch.bool)
    is_pad[1, -2:] = True
    dims = torch.arange(a) < s["action_dim"]
    batch = PaddedBatch(images=images, image_masks=present, camera_names=("cam0", "cam1"), tokens=tokens,
                        token_mask=mask, state=torch.randn(b, s["max_state_dim"], generator=g),
                        actions=torch.randn(b, h, a, generator=g), action_is_pad=is_pad, action_dim_mask=dims,
                        embodiment_id=torch.tensor([1, 0]))
    ref = {"input_ids": tokens, "attention_mask": mask.long(), "images": images[present], "state": batch.state[:, None],
           "action": batch.actions, "action_mask": ((~is_pad)[..., None] & dims).float(),
           "embodiment_id": batch.embodiment_id, "time": torch.tensor([0.3, 0.8])}
    return batch, ref


def compare(case: str, out_dir: Path, venv: Path) -> dict[str, dict[str, float]]:
    s = {**SHAPES, **CASES[case]}
    d = out_dir / case
    d.mkdir(parents=True, exist_ok=True)
    batch, ref_in = make_inputs(s, s["padded"])
    (d / "config.json").write_text(json.dumps({"shapes": s}, indent=1))
    save_file({k: v.contiguous() for k, v in ref_in.items()}, d / "inputs.safetensors")
    subprocess.run([str(venv / "bin" / "python"), str(HERE / "reference.py"), str(venv / "src"), str(d)], check=True)
    ref = load_file(d / "outputs.safetensors")
    state = load_file(d / "weights.safetensors")
    state.pop("backbone.model.lm_head.weight")
    model = GrootN17Model(config_of(s)).eval()
    model.load_state_dict(state, strict=True)
    diff = {}
    with torch.no_grad():
        feats, valid = model.backbone_features(batch)
        diff["backbone features"] = feats[valid], ref["backbone_features"][valid]
        diff["pixel_values"] = patchify(ref_in["images"], model.config.vision).flatten(0, 1), ref["pixel_values"]
        diff["image tokens"] = model.encode(batch).image.float(), ref["image_mask"].float()
        torch.manual_seed(3)
        diff["flow time draws (seed 3)"] = model.sample_time(64, torch.device("cpu")), ref["time_drawn"]
        torch.manual_seed(4)
        diff["loss, own noise and t (seed 4)"] = model(batch)["loss"].reshape(1), ref["loss_drawn"]
        out = model(batch, noise=ref["noise"], time=ref_in["time"])
        weight = ref_in["action_mask"]
        diff["v_t"] = out["v_t"], ref["v_t"]
        diff["(u_t - v_t)^2 masked"] = (out["v_t"] - (batch.actions - ref["noise"])) ** 2 * weight, ref["action_loss"]
        diff["loss"] = out["loss"].reshape(1), ref["loss"]
        model.config = dataclasses.replace(model.config, packing=True)
        packed = model(batch, noise=ref["noise"], time=ref_in["time"])
        model.config = dataclasses.replace(model.config, packing=False)
        diff["v_t (packed)"] = packed["v_t"], ref["v_t"]
        diff["loss (packed)"] = packed["loss"].reshape(1), ref["loss"]
        seen = []
        hook = model.action_head.action_decoder.register_forward_hook(lambda m, a, o: seen.append(o.detach().clone()))
        diff["sampled actions (4 steps)"] = model.sample_actions(batch, noise=ref["sample_noise"].clone()), \
            ref["sampled_actions"]
        hook.remove()
        diff["step velocities"] = torch.stack(seen), ref["step_velocities"]
    return {name: {"abs": float((a - b).abs().max()), "scaled": float(((a - b).abs() / b.abs().clamp(min=1)).max())}
            for name, (a, b) in diff.items()}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--venv", type=Path, default=Path("/work/venvs/groot-n17-ref"))
    parser.add_argument("--out", type=Path, help="where the cases' inputs and outputs go (default: a temp dir)")
    parser.add_argument("--tol", type=float, default=1e-5)
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args(argv)
    torch.use_deterministic_algorithms(True)
    out_dir = args.out or Path(tempfile.mkdtemp(prefix="groot-n17-parity-"))
    results = {case: compare(case, out_dir, args.venv) for case in CASES}
    worst = max(v["scaled"] for r in results.values() for v in r.values())
    for case, r in results.items():
        print(f"\n{case}")
        print(f"  {'quantity':32s} {'max abs diff':>13s} {'max scaled':>11s}")
        for name, v in r.items():
            print(f"  {name:32s} {v['abs']:13.3e} {v['scaled']:11.3e}{'' if v['scaled'] <= args.tol else '  > tol'}")
    record = {"tolerance": args.tol, "max_scaled_diff": worst, "pass": worst <= args.tol, "results": results}
    print(json.dumps(record))
    if args.json:
        args.json.write_text(json.dumps(record, indent=2) + "\n")
    return 0 if worst <= args.tol else 1


if __name__ == "__main__":
    sys.exit(main())
