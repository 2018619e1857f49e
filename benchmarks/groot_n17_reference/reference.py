"""NVIDIA's GR00T N1.7 (the model files setup_venv.sh lays into VENV/src) on random weights at tiny shapes;
parity.py drives it. Runs in the side venv only:

    VENV/bin/python reference.py VENV/src CASE_DIR

CASE_DIR holds config.json (the shapes) and inputs.safetensors, both written by parity.py; this writes
weights.safetensors (NVIDIA's state dict) and outputs.safetensors there. Nothing comes from a hub: the
backbone's `from_pretrained` is answered with transformers' Qwen3VLForConditionalGeneration built from a
tiny Qwen3VLConfig, and the data collator (tokenizer and image processor) is not built, the inputs being
pre-tokenized. Every parameter gets Gaussian noise on top of its initialisation, so none is left at a
value (ones, zeros) that would hide a wrong mapping.
"""

from __future__ import annotations

import json
import sys
import types
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

PACKAGES = ("gr00t", "gr00t.model", "gr00t.model.modules", "gr00t.model.gr00t_n1d7", "gr00t.configs",
            "gr00t.configs.model")


def install_shims(src: Path) -> None:
    """gr00t's package __init__ files import its training stack (tyro, pipelines); only the model files are
    laid out, so the packages are bare namespaces here, with the two names the model files import."""
    sys.path.insert(0, str(src))
    for name in PACKAGES:
        mod = types.ModuleType(name)
        mod.__path__ = [str(src / name.replace(".", "/"))]
        sys.modules[name] = mod
    sys.modules["gr00t.configs.model"].register_model_config = lambda name, cls: None
    collator = types.ModuleType("gr00t.model.gr00t_n1d7.processing_gr00t_n1d7")

    class Gr00tN1d7DataCollator:
        def __init__(self, *args, **kwargs):
            pass

    collator.Gr00tN1d7DataCollator = Gr00tN1d7DataCollator
    sys.modules[collator.__name__] = collator


def qwen3vl_config(s: dict):
    from transformers import Qwen3VLConfig

    text = {"vocab_size": s["vocab_size"], "hidden_size": s["text_width"], "intermediate_size": s["text_mlp"],
            "num_hidden_layers": s["text_layers"], "num_attention_heads": s["text_heads"],
            "num_key_value_heads": s["text_kv_heads"], "head_dim": s["text_head_dim"], "rope_theta": s["rope_theta"],
            "rope_scaling": {"rope_type": "default", "mrope_section": s["mrope_section"], "mrope_interleaved": True},
            "rms_norm_eps": 1e-6, "max_position_embeddings": 512}
    vision = {"depth": s["vision_layers"], "hidden_size": s["vision_width"], "intermediate_size": s["vision_mlp"],
              "num_heads": s["vision_heads"], "patch_size": s["patch_size"], "temporal_patch_size": 2,
              "spatial_merge_size": 2, "out_hidden_size": s["text_width"], "in_channels": 3,
              "num_position_embeddings": s["position_embeddings"], "hidden_act": "gelu_pytorch_tanh",
              "deepstack_visual_indexes": s["deepstack_layers"]}
    return Qwen3VLConfig(text_config=text, vision_config=vision, image_token_id=s["image_token_id"],
                         video_token_id=s["image_token_id"] + 3, vision_start_token_id=s["image_token_id"] + 1,
                         vision_end_token_id=s["image_token_id"] + 2)


def build(s: dict):
    from transformers import Qwen3VLForConditionalGeneration

    import gr00t.model.modules.qwen3_backbone as qwen3_backbone
    from gr00t.configs.model.gr00t_n1d7 import Gr00tN1d7Config
    from gr00t.model.gr00t_n1d7.gr00t_n1d7 import Gr00tN1d7

    vlm = qwen3vl_config(s)

    class TinyQwen3VL:
        @staticmethod
        def from_pretrained(name, **kwargs):
            return Qwen3VLForConditionalGeneration(vlm)

    qwen3_backbone.Qwen3VLForConditionalGeneration = TinyQwen3VL
    dit = {"positional_embeddings": None, "num_layers": s["dit_layers"], "num_attention_heads": s["dit_heads"],
           "attention_head_dim": s["dit_head_dim"], "norm_type": "ada_norm", "dropout": 0.0, "final_dropout": True,
           "output_dim": s["hidden_size"], "interleave_self_attention": True}
    vlsa = {"num_layers": s["vl_self_attention_layers"], "num_attention_heads": s["vl_self_attention_heads"],
            "attention_head_dim": s["vl_self_attention_head_dim"], "dropout": 0.0, "final_dropout": True,
            "positional_embeddings": None}
    cfg = Gr00tN1d7Config(
        model_name="nvidia/Cosmos-Reason2-2B", select_layer=s["select_layer"], backbone_embedding_dim=s["text_width"],
        hidden_size=s["hidden_size"], input_embedding_dim=s["dit_heads"] * s["dit_head_dim"],
        max_state_dim=s["max_state_dim"], max_action_dim=s["max_action_dim"], action_horizon=s["action_horizon"],
        max_seq_len=s["max_seq_len"], max_num_embodiments=s["num_embodiments"], attend_text_every_n_blocks=2,
        diffusion_model_cfg=dit, vl_self_attention_cfg=vlsa, use_flash_attention=False, load_bf16=False,
        state_dropout_prob=0.0, model_dtype="float32", num_inference_timesteps=s["num_steps"])
    torch.manual_seed(s["seed"])
    model = Gr00tN1d7(cfg, transformers_loading_kwargs={}).float().eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * s["weight_noise"])
    return model


def pixels(images: torch.Tensor, s: dict) -> dict:
    """pixel_values and image_grid_thw of images (N, 3, H, W) in [0, 1] by the image processor Qwen3-VL's
    processor uses, without its resize and at Qwen3-VL's mean = std = 0.5."""
    import transformers
    from transformers.models.auto.image_processing_auto import IMAGE_PROCESSOR_MAPPING_NAMES

    slow = IMAGE_PROCESSOR_MAPPING_NAMES["qwen3_vl"][0]  # the class AutoImageProcessor gives Qwen3-VL
    proc = getattr(transformers, slow)(do_resize=False, do_rescale=False, image_mean=[0.5] * 3, image_std=[0.5] * 3,
                                 patch_size=s["patch_size"], temporal_patch_size=2, merge_size=2)
    out = proc(images=list(images.numpy()), return_tensors="pt", input_data_format="channels_first")
    return {"pixel_values": out["pixel_values"].float(), "image_grid_thw": out["image_grid_thw"]}


def run(model, x: dict, s: dict) -> dict:
    head, horizon = model.action_head, s["action_horizon"]
    vl = {"input_ids": x["input_ids"], "attention_mask": x["attention_mask"], **pixels(x["images"], s)}
    act = {"state": x["state"], "embodiment_id": x["embodiment_id"]}
    seen = []
    head.action_decoder.register_forward_hook(lambda mod, args, out: seen.append(out.detach().clone()))
    out = {"pixel_values": vl["pixel_values"]}
    with torch.no_grad():
        torch.manual_seed(3)  # the training flow time, NVIDIA's own draw
        out["time_drawn"] = head.sample_time(64, torch.device("cpu"), torch.float32)
        torch.manual_seed(4)  # the loss with forward's own noise and time draws
        out["loss_drawn"] = model.forward({**vl, **act, "action": x["action"], "action_mask": x["action_mask"]})[
            "loss"].reshape(1)
        seen.clear()
        bb = model.backbone(model.backbone.prepare_input(dict(vl)))
        out["backbone_features"] = bb["backbone_features"]
        out["image_mask"] = bb["image_mask"].to(torch.uint8)
        head.sample_time = lambda batch_size, device, dtype: x["time"].to(device, dtype)
        torch.manual_seed(1)  # forward's first draw is its noise
        out["noise"] = torch.randn(x["action"].shape)
        torch.manual_seed(1)
        res = model.forward({**vl, **act, "action": x["action"], "action_mask": x["action_mask"]})
        out["v_t"] = seen.pop()[:, -horizon:]
        out["loss"], out["action_loss"] = res["loss"].reshape(1), res["action_loss"]
        torch.manual_seed(2)  # get_action's first draw is its starting noise
        out["sample_noise"] = torch.randn(x["action"].shape)
        torch.manual_seed(2)
        out["sampled_actions"] = model.get_action({**vl, **act})["action_pred"]
        out["step_velocities"] = torch.stack([v[:, -horizon:] for v in seen])
    return out


def main(src: Path, case: Path) -> None:
    install_shims(src)
    s = json.loads((case / "config.json").read_text())["shapes"]
    model = build(s)
    x = load_file(case / "inputs.safetensors")
    save_file({k: v.detach().contiguous().clone() for k, v in model.state_dict().items()}, case / "weights.safetensors")
    save_file({k: v.contiguous() for k, v in run(model, x, s).items()}, case / "outputs.safetensors")


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
