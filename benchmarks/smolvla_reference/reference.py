"""LeRobot v0.4.4 SmolVLA reference outputs at tiny shapes, for kilovla's parity tests.

Run with the side venv (see setup_venv.sh):
    .cache/smolvla-ref-venv/bin/python benchmarks/smolvla_reference/reference.py OUT_DIR [--shapes JSON] [--knob V ...]

Builds SmolVLAPolicy (so the state-dict keys are LeRobot's, "model.vlm_with_expert...") from a
tiny SmolVLMConfig made in code, with seeded random weights, and writes weights, inputs, outputs
and config.json to OUT_DIR. Nothing is downloaded.
"""

import argparse
import importlib.abc
import importlib.machinery
import importlib.metadata
import importlib.util
import json
import math
import os
import sys
import types
from pathlib import Path

import torch

DEFAULT_SHAPES = {
    "seed": 0,
    "batch_size": 2,
    # vision (SigLIP-style, SmolVLMVisionConfig)
    "vision_layers": 2,
    "vision_width": 32,
    "vision_heads": 4,
    "vision_mlp": 64,
    "image_size": 32,
    "patch_size": 8,
    "scale_factor": 2,  # pixel shuffle of the connector: tokens per camera = (image/patch/scale)^2
    # text (Llama-style decoder, the VLM's text_config)
    "text_layers": 4,  # layers of the built VLM; truncated to num_vlm_layers
    "num_vlm_layers": 4,
    "text_width": 48,
    "text_heads": 6,
    "text_kv_heads": 2,
    "head_dim": 8,
    "text_mlp": 96,
    "vocab_size": 128,
    "rms_norm_eps": 1e-6,
    # SmolVLA
    "expert_width_multiplier": 0.75,
    "num_expert_layers": -1,
    "self_attn_every_n_layers": 2,
    "chunk_size": 6,
    "max_state_dim": 8,
    "max_action_dim": 8,
    "state_dim": 5,  # real dims; zero-padded to max_state_dim
    "action_dim": 4,  # real dims; zero-padded to max_action_dim
    "num_cameras": 2,  # present cameras
    "empty_cameras": 1,  # missing cameras LeRobot adds as -1 images with mask False
    "prompt_length": 7,  # padded language length
    "prompt_lengths": [7, 4],  # valid tokens per sample (right padding)
    "action_pad_steps": [0, 2],  # trailing padded action steps per sample (action_is_pad)
    "num_steps": 10,
    "min_period": 4e-3,
    "max_period": 4.0,
    "vision_position_ids": "auto",  # "auto" (arange iff transformers' bucketing is wrong), "arange", "bucketize"
}
VLM_NAME = "HuggingFaceTB/SmolVLM2-500M-Video-Instruct"  # only ever passed to the patched loaders


def parse_shapes(argv=None):
    """Output folder plus the shape dict: defaults, then --shapes JSON, then --KNOB VALUE flags."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--shapes", type=Path, help="JSON file with any subset of the knobs")
    for key, value in DEFAULT_SHAPES.items():
        kind = json.loads if isinstance(value, list) else type(value)
        parser.add_argument(f"--{key}", type=kind, default=None)
    args = parser.parse_args(argv)
    shapes = dict(DEFAULT_SHAPES)
    if args.shapes is not None:
        extra = json.loads(args.shapes.read_text())
        unknown = sorted(set(extra) - set(DEFAULT_SHAPES))
        if unknown:
            parser.error(f"{args.shapes}: unknown knobs {unknown}")
        shapes.update(extra)
    shapes.update({k: getattr(args, k) for k in DEFAULT_SHAPES if getattr(args, k) is not None})
    check_shapes(shapes, parser.error)
    return args.out_dir, shapes


def check_shapes(s, fail):
    b = s["batch_size"]
    if len(s["prompt_lengths"]) != b or len(s["action_pad_steps"]) != b:
        fail("prompt_lengths and action_pad_steps need one entry per sample")
    if max(s["prompt_lengths"]) > s["prompt_length"] or min(s["prompt_lengths"]) < 1:
        fail("prompt_lengths must lie in [1, prompt_length]")
    if s["state_dim"] > s["max_state_dim"] or s["action_dim"] > s["max_action_dim"]:
        fail("state_dim/action_dim must not exceed max_state_dim/max_action_dim")
    side = s["image_size"] // s["patch_size"]
    if s["image_size"] % s["patch_size"] or side % s["scale_factor"]:
        fail("image_size must be a multiple of patch_size * scale_factor")
    if s["text_heads"] % s["text_kv_heads"] or s["vision_width"] % s["vision_heads"]:
        fail("heads must divide evenly (text_heads by text_kv_heads, vision_width by vision_heads)")
    if s["num_vlm_layers"] > s["text_layers"]:
        fail("num_vlm_layers must not exceed text_layers")


class _Unavailable:
    """Stands for any torchvision object; using one (rather than naming it) fails loudly."""

    def __init__(self, *args, **kwargs):
        raise RuntimeError("torchvision is stubbed in the SmolVLA reference venv")


class _TorchvisionStub(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Serves torchvision and every submodule as a module whose attributes are placeholder classes."""

    def find_spec(self, name, path=None, target=None):
        if name == "torchvision" or name.startswith("torchvision."):
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec):
        module = types.ModuleType(spec.name)
        module.__path__ = []
        module.__getattr__ = lambda attr: type(attr, (_Unavailable,), {"__module__": spec.name})
        return module

    def exec_module(self, module):
        pass


def install_torchvision_stub():
    """lerobot's configs/datasets import torchvision at module level; SmolVLA never calls it.

    The only torchvision wheels reachable here are CUDA builds whose _C.so fails to load on the CPU
    torch, so torchvision is left out of the venv and a stand-in finder serves placeholder modules.
    It has no distribution metadata, so transformers' availability probe still reports it absent.
    """
    if any(p.name.startswith("torchvision") for p in importlib.metadata.distributions()
           if getattr(p, "name", None)):
        raise SystemExit("torchvision is installed in the side venv; remove it (see README)")
    sys.meta_path.insert(0, _TorchvisionStub())


def import_lerobot(vlm_config):
    """Import the v0.4.4 SmolVLA modules with the two hub loaders patched to offline tiny objects."""
    install_torchvision_stub()
    # lerobot/policies/__init__.py imports every policy's config (groot's pulls diffusers); register
    # the package without running it so only SmolVLA's own import chain is loaded.
    root = Path(importlib.util.find_spec("lerobot").submodule_search_locations[0])
    policies = types.ModuleType("lerobot.policies")
    policies.__path__ = [str(root / "policies")]
    policies.__spec__ = importlib.machinery.ModuleSpec("lerobot.policies", None, is_package=True)
    sys.modules["lerobot.policies"] = policies
    from lerobot.policies.smolvla import configuration_smolvla, modeling_smolvla, smolvlm_with_expert

    tokenizer = types.SimpleNamespace(
        fake_image_token_id=vlm_config.text_config.vocab_size - 2,
        global_image_token_id=vlm_config.text_config.vocab_size - 1,
    )

    def offline_config(model_id, *args, **kwargs):
        assert model_id == VLM_NAME, model_id
        return vlm_config

    def offline_processor(model_id, *args, **kwargs):
        assert model_id == VLM_NAME, model_id
        return types.SimpleNamespace(tokenizer=tokenizer)

    smolvlm_with_expert.AutoConfig = types.SimpleNamespace(from_pretrained=offline_config)
    smolvlm_with_expert.AutoProcessor = types.SimpleNamespace(from_pretrained=offline_processor)
    return configuration_smolvla, modeling_smolvla, smolvlm_with_expert


def build_vlm_config(s):
    from transformers import SmolVLMConfig

    vision = {
        "hidden_size": s["vision_width"],
        "intermediate_size": s["vision_mlp"],
        "num_hidden_layers": s["vision_layers"],
        "num_attention_heads": s["vision_heads"],
        "image_size": s["image_size"],
        "patch_size": s["patch_size"],
        "num_channels": 3,
    }
    text = {
        "model_type": "llama",
        "hidden_size": s["text_width"],
        "intermediate_size": s["text_mlp"],
        "num_hidden_layers": s["text_layers"],
        "num_attention_heads": s["text_heads"],
        "num_key_value_heads": s["text_kv_heads"],
        "head_dim": s["head_dim"],
        "vocab_size": s["vocab_size"],
        "rms_norm_eps": s["rms_norm_eps"],
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
    }
    return SmolVLMConfig(vision_config=vision, text_config=text, scale_factor=s["scale_factor"])


def build_policy(s, configuration, modeling):
    from lerobot.configs.types import FeatureType, PolicyFeature

    side = s["image_size"]
    inputs = {f"observation.images.cam{i}": PolicyFeature(FeatureType.VISUAL, (3, side, side))
              for i in range(s["num_cameras"])}
    inputs["observation.state"] = PolicyFeature(FeatureType.STATE, (s["state_dim"],))
    config = configuration.SmolVLAConfig(
        device="cpu",
        input_features=inputs,
        output_features={"action": PolicyFeature(FeatureType.ACTION, (s["action_dim"],))},
        chunk_size=s["chunk_size"],
        n_action_steps=s["chunk_size"],
        max_state_dim=s["max_state_dim"],
        max_action_dim=s["max_action_dim"],
        resize_imgs_with_padding=(side, side),
        empty_cameras=s["empty_cameras"],
        tokenizer_max_length=s["prompt_length"],
        num_steps=s["num_steps"],
        vlm_model_name=VLM_NAME,
        load_vlm_weights=False,
        num_expert_layers=s["num_expert_layers"],
        num_vlm_layers=s["num_vlm_layers"],
        self_attn_every_n_layers=s["self_attn_every_n_layers"],
        expert_width_multiplier=s["expert_width_multiplier"],
        min_period=s["min_period"],
        max_period=s["max_period"],
    )
    torch.manual_seed(s["seed"])
    policy = modeling.SmolVLAPolicy(config)
    randomize_weights(policy, s["seed"])
    return policy.eval()


def randomize_weights(module, seed):
    """Seeded weights with O(1) activations (HF's 0.02 init would make attention nearly uniform)."""
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, param in sorted(module.state_dict(keep_vars=True).items()):
            if name.endswith("norm.weight") or "layernorm" in name or "layer_norm" in name:
                fresh = 1.0 + 0.1 * torch.randn(param.shape, generator=gen) if name.endswith("weight") \
                    else 0.1 * torch.randn(param.shape, generator=gen)
            elif name.endswith("bias"):
                fresh = 0.1 * torch.randn(param.shape, generator=gen)
            elif "embedding" in name or "embed_tokens" in name:
                fresh = torch.randn(param.shape, generator=gen) / math.sqrt(param.shape[-1])
            else:
                fan_in = math.prod(param.shape[1:])
                fresh = torch.randn(param.shape, generator=gen) / math.sqrt(fan_in)
            param.copy_(fresh.to(param.dtype))


def vision_bucketing_is_exact(s):
    """Replays transformers 4.57's fp32 position-id bucketing (issue 41190) for a full image."""
    n = s["image_size"] // s["patch_size"]
    boundaries = torch.arange(1 / n, 1.0, 1 / n)
    coords = torch.arange(n, dtype=torch.float32) / n * (1 - 1e-6)
    return bool(torch.equal(torch.bucketize(coords, boundaries, right=True), torch.arange(n)))


def patch_vision_position_ids(s):
    """Use arange position ids (what the bucketing means for a full, unpadded image)."""
    from transformers.models.smolvlm import modeling_smolvlm

    mode = s["vision_position_ids"]
    exact = vision_bucketing_is_exact(s)
    use_arange = mode == "arange" or (mode == "auto" and not exact)
    if use_arange:
        def forward(self, pixel_values, patch_attention_mask):
            embeds = self.patch_embedding(pixel_values).flatten(2).transpose(1, 2)
            ids = torch.arange(embeds.shape[1], device=embeds.device)
            return embeds + self.position_embedding(ids)[None]

        modeling_smolvlm.SmolVLMVisionEmbeddings.forward = forward
    return {"bucketing_exact_in_fp32": exact, "position_ids_used": "arange" if use_arange else "bucketize"}


def make_inputs(s, gen):
    """Model-level inputs (images already in [-1, 1]) plus the raw [0, 1] images the policy takes."""
    b, side = s["batch_size"], s["image_size"]
    raw = [torch.rand(b, 3, side, side, generator=gen) for _ in range(s["num_cameras"])]
    images = [img * 2.0 - 1.0 for img in raw]  # the same op as SmolVLAPolicy.prepare_images
    images += [torch.ones_like(images[0]) * -1 for _ in range(s["empty_cameras"])]
    img_masks = torch.zeros(len(images), b, dtype=torch.bool)
    img_masks[: s["num_cameras"]] = True
    lengths = torch.tensor(s["prompt_lengths"])
    lang_masks = torch.arange(s["prompt_length"])[None, :] < lengths[:, None]
    lang_tokens = torch.randint(0, s["vocab_size"] - 2, (b, s["prompt_length"]), generator=gen)
    lang_tokens = torch.where(lang_masks, lang_tokens, torch.zeros_like(lang_tokens))
    state = torch.zeros(b, s["max_state_dim"])
    state[:, : s["state_dim"]] = torch.randn(b, s["state_dim"], generator=gen)
    actions = torch.zeros(b, s["chunk_size"], s["max_action_dim"])
    actions[..., : s["action_dim"]] = torch.randn(b, s["chunk_size"], s["action_dim"], generator=gen)
    pad_steps = torch.tensor(s["action_pad_steps"])
    action_is_pad = torch.arange(s["chunk_size"])[None, :] >= (s["chunk_size"] - pad_steps)[:, None]
    shape = (b, s["chunk_size"], s["max_action_dim"])
    return {
        "images": torch.stack(images, dim=0),  # (cams incl. empty, B, 3, H, W) in [-1, 1]
        "images_raw": torch.stack(raw, dim=0),  # (present cams, B, 3, H, W) in [0, 1]
        "img_masks": img_masks,  # (cams, B)
        "lang_tokens": lang_tokens,
        "lang_masks": lang_masks,
        "state": state,
        "actions": actions,
        "action_is_pad": action_is_pad,
        "noise": torch.randn(shape, generator=gen),
        "time": torch.rand(b, generator=gen) * 0.999 + 0.001,
        "sample_noise": torch.randn(shape, generator=gen),
    }


def capture_velocities(model):
    """Collects every action_out_proj output: v_t of forward, then one per Euler step."""
    seen = []
    model.action_out_proj.register_forward_hook(lambda mod, args, out: seen.append(out.detach().clone()))
    return seen


def run_model(policy, x):
    model = policy.model
    seen = capture_velocities(model)
    images, img_masks = list(x["images"]), list(x["img_masks"])
    args = (images, img_masks, x["lang_tokens"], x["lang_masks"], x["state"])
    with torch.no_grad():
        losses = model.forward(*args, x["actions"], x["noise"], x["time"])
        v_t = seen.pop(0)
        sampled = model.sample_actions(*args, noise=x["sample_noise"].clone())
    return {
        "losses": losses,  # (B, T, max_action_dim) = (u_t - v_t)^2, unreduced
        "loss_per_sample": losses.mean(dim=(1, 2)),
        "v_t": v_t,
        "u_t": x["noise"] - x["actions"],
        "sampled_actions": sampled,  # (B, T, max_action_dim), from sample_noise, num_steps Euler steps
        "sample_velocities": torch.stack(seen, dim=0),  # (num_steps, B, T, max_action_dim)
    }


def run_policy(policy, s, x):
    """SmolVLAPolicy.forward(reduction='none') on the raw batch, without and with its pad-mask key."""
    batch = {f"observation.images.cam{i}": x["images_raw"][i] for i in range(s["num_cameras"])}
    batch["observation.state"] = x["state"][:, : s["state_dim"]]
    batch["observation.language.tokens"] = x["lang_tokens"]
    batch["observation.language.attention_mask"] = x["lang_masks"]
    batch["action"] = x["actions"][..., : s["action_dim"]]
    batch["action_is_pad"] = x["action_is_pad"]  # what datasets provide; v0.4.4 reads "actions_id_pad"
    with torch.no_grad():
        plain, _ = policy.forward(dict(batch), noise=x["noise"], time=x["time"], reduction="none")
        batch["actions_id_pad"] = x["action_is_pad"]
        masked, _ = policy.forward(dict(batch), noise=x["noise"], time=x["time"], reduction="none")
    return {"policy_loss_per_sample": plain, "policy_loss_per_sample_actions_id_pad": masked}


def versions():
    names = ("lerobot", "transformers", "torch", "safetensors", "numpy", "huggingface-hub")
    return {name: importlib.metadata.version(name) for name in names}


def derived_shapes(policy, s):
    swe = policy.model.vlm_with_expert
    tokens_per_cam = (s["image_size"] // s["patch_size"] // s["scale_factor"]) ** 2
    cams = s["num_cameras"] + s["empty_cameras"]
    return {
        "expert_width": swe.expert_hidden_size,
        "expert_mlp": swe.lm_expert.config.intermediate_size,
        "expert_layers": swe.num_expert_layers,
        "vlm_layers": swe.num_vlm_layers,
        "tokens_per_camera": tokens_per_cam,
        "prefix_length": cams * tokens_per_cam + s["prompt_length"] + 1,
        "suffix_length": s["chunk_size"],
        "vision_attn_implementation": swe.vlm.config.vision_config._attn_implementation,
    }


def main(argv=None):
    out_dir, s = parse_shapes(argv)
    torch.use_deterministic_algorithms(True)
    vlm_config = build_vlm_config(s)
    configuration, modeling, _ = import_lerobot(vlm_config)
    vision_note = patch_vision_position_ids(s)
    policy = build_policy(s, configuration, modeling)
    x = make_inputs(s, torch.Generator().manual_seed(s["seed"] + 2))
    outputs = run_model(policy, x)
    outputs.update(run_policy(policy, s, x))
    from safetensors.torch import save_file

    out_dir.mkdir(parents=True, exist_ok=True)
    weights = {k: v.detach().to(torch.float32).contiguous() for k, v in policy.state_dict().items()}
    save_file(weights, out_dir / "weights.safetensors")
    save_file({k: v.contiguous() for k, v in x.items()}, out_dir / "inputs.safetensors")
    save_file({k: v.contiguous() for k, v in outputs.items()}, out_dir / "outputs.safetensors")
    record = {"shapes": s, "derived": derived_shapes(policy, s), "vision_position_ids": vision_note,
              "versions": versions(), "vlm_model_name_patched": VLM_NAME}
    (out_dir / "config.json").write_text(json.dumps(record, indent=2) + "\n")
    for name, tensor in outputs.items():
        print(f"{name:40s} {tuple(tensor.shape)}")
    print(f"wrote {out_dir}")


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    main()
