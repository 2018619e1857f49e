"""Block-wise FP8 PTQ: the format, the layer, layer selection, policy folders, the report, bad input."""

from __future__ import annotations

import json
import re
import logging
import math
import shutil

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn

from kilovla.data.lerobot import LeRobotDataset
from kilovla.data.stats import compute_dataset_stats, stats_to_json
from kilovla.errors import KilovlaError
from kilovla.models.policy import VLAPolicy
from kilovla.policy_folder import load_policy_folder, save_policy
from kilovla.models.presets import build_model, preset
from kilovla.models.processor import PolicyMeta
from kilovla.quant import fp8
from kilovla.quant.fp8 import (FP8, Fp8BlockCategoryLinear, Fp8BlockEmbedding, Fp8BlockLinear, Fp8Config, checkpoint_bytes,
                               dequantize_fp8_blockwise,
                               fake_quantize_activations, quantize_activations_1x128, quantize_fp8_blockwise,
                               quantization_config, quantize_model, select_layers, sqnr_db)
from kilovla.quantize.folder import quantize_policy_folder

E4M3_REL = 2.0**-4  # half a unit in the last place of a 3-bit mantissa, relative
E4M3_SUBNORMAL_HALF_STEP = 2.0**-10  # in units of the block scale


# -- format ------------------------------------------------------------------------------------------
def test_round_trip_error_is_bounded_element_wise_and_per_block():
    torch.manual_seed(0)
    w = torch.randn(300, 260)
    w[:128, :128] *= 1e4  # blocks of very different magnitude: each keeps its own precision
    w[:128, 128:256] *= 1e-4
    q, s = quantize_fp8_blockwise(w, 128)
    back = dequantize_fp8_blockwise(q, s, 128)
    scale = s.repeat_interleave(128, 0).repeat_interleave(128, 1)[:300, :260]
    bound = w.abs() * E4M3_REL + scale * E4M3_SUBNORMAL_HALF_STEP
    assert q.dtype == torch.float8_e4m3fn and s.dtype == torch.float32
    assert torch.all((w - back).abs() <= bound * (1 + 1e-5))
    small = (slice(0, 128), slice(128, 256))
    assert sqnr_db(w[small], back[small]) > 28  # one scale for the whole tensor would flush this block to 0
    assert sqnr_db(w, back) > 28
    # every block's largest magnitude lands on e4m3's largest value
    amax = F.pad(w.abs(), (0, 124, 0, 84)).view(3, 128, 3, 128).amax(dim=(1, 3))
    torch.testing.assert_close(s, amax / 448.0)


@pytest.mark.parametrize("shape, block, scales", [((130, 3), 128, (2, 1)), ((256, 384), 128, (2, 3)),
                                                  ((1, 129), 128, (1, 2)), ((130, 3), 64, (3, 1))])
def test_scale_shapes_cover_ragged_edges(shape, block, scales):
    w = torch.randn(*shape)
    q, s = quantize_fp8_blockwise(w, block)
    assert tuple(q.shape) == shape and tuple(s.shape) == scales
    assert sqnr_db(w, dequantize_fp8_blockwise(q, s, block)) > 25


def test_an_edge_block_is_scaled_by_its_own_elements_only():
    w = torch.full((130, 3), 2.0)
    w[128:] = 5.0
    q, s = quantize_fp8_blockwise(w, 128)
    assert s[:, 0].tolist() == pytest.approx([2.0 / 448, 5.0 / 448])
    torch.testing.assert_close(dequantize_fp8_blockwise(q, s, 128), w)
    assert quantize_fp8_blockwise(torch.zeros(4, 4))[1].item() == 1.0  # an all-zero block divides by 1, not 0


def test_a_scale_of_the_wrong_shape_is_refused():
    q, s = quantize_fp8_blockwise(torch.randn(256, 256))
    with pytest.raises(KilovlaError, match=r"needs \(2, 2\)"):
        dequantize_fp8_blockwise(q, s[:1], 128)


def test_activations_get_one_scale_per_token_per_128_channels():
    x = torch.randn(3, 300)
    x[1, 200] = 50.0
    q, s = quantize_activations_1x128(x)
    assert q.shape == (3, 300) and s.shape == (3, 3)
    assert s[1, 1].item() == pytest.approx(50.0 / 448)
    assert s[0, 1].item() == pytest.approx(x[0, 128:256].abs().max().item() / 448)
    assert sqnr_db(x, fake_quantize_activations(x)) > 25


# -- the layer ---------------------------------------------------------------------------------------
def test_fp8_linear_computes_the_dequantized_math():
    torch.manual_seed(0)
    lin = nn.Linear(200, 300)
    x = torch.randn(2, 5, 200)
    weight_only = Fp8BlockLinear.from_module(lin, activations="none")
    w8a8 = Fp8BlockLinear.from_module(lin, activations="1x128")
    w = dequantize_fp8_blockwise(weight_only.weight, weight_only.weight_scale_inv)
    torch.testing.assert_close(weight_only(x), F.linear(x, w, lin.bias), rtol=0, atol=1e-6)
    torch.testing.assert_close(w8a8(x), F.linear(fake_quantize_activations(x), w, lin.bias), rtol=0, atol=1e-6)
    ref = lin(x).detach()
    assert sqnr_db(ref, weight_only(x)) > sqnr_db(ref, w8a8(x)) > 25
    assert w8a8(x.bfloat16()).dtype == torch.bfloat16
    # emulation dequantizes to the input's dtype and multiplies there (docs/architecture.md says so)
    xb = x.bfloat16()
    want = F.linear(xb, weight_only.dequantized_weight(torch.bfloat16), lin.bias.detach().bfloat16())
    assert torch.equal(weight_only(xb), want)


def test_casting_a_model_moves_but_never_retypes_the_fp8_payload():
    layer = Fp8BlockLinear.from_module(nn.Linear(64, 32))
    q = layer.weight.clone()
    model = nn.Sequential(layer, nn.Linear(32, 8))
    model.to(torch.bfloat16)
    assert layer.weight.dtype == torch.float8_e4m3fn and layer.weight_scale_inv.dtype == torch.float32
    assert torch.equal(layer.weight.view(torch.uint8), q.view(torch.uint8))
    assert model[1].weight.dtype == torch.bfloat16 and layer.bias.dtype == torch.bfloat16
    model.float()
    assert layer.weight.dtype == torch.float8_e4m3fn and layer.bias.dtype == torch.float32


def test_an_unavailable_kernel_falls_back_loudly_once(caplog, monkeypatch):
    monkeypatch.setattr(fp8, "_warned", set())
    layer = Fp8BlockLinear.from_module(nn.Linear(128, 128))
    other = Fp8BlockLinear.from_module(nn.Linear(128, 128))
    fp8.set_kernel(nn.Sequential(layer, other), "scaled_mm")
    x = torch.randn(4, 128)
    with caplog.at_level(logging.WARNING, logger="kilovla.quant.fp8"):
        out = layer(x)
        layer(x)
        other(x)
    lines = [r.getMessage() for r in caplog.records]
    assert lines == ["FP8 kernel scaled_mm needs a CUDA GPU (running on cpu); falling back to emulation "
                     "(dequantize + matmul)"]
    assert layer.kernel_used == {"cpu": "emulate"}
    torch.testing.assert_close(out, fp8._emulate(layer, x))
    layer.kernel = "nope"
    layer.kernel_used = {}
    with pytest.raises(KilovlaError, match="FP8 kernel must be one of"):
        layer(x)


# -- which layers -------------------------------------------------------------------------------------
PROJECTIONS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
               "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


def test_pi05_default_takes_the_language_model_and_the_action_expert():
    model = build_model("pi05-3b", device="meta")
    chosen = select_layers(model)
    lm = "paligemma_with_expert.paligemma.model.language_model.layers"
    expert = "paligemma_with_expert.gemma_expert.model.layers"
    expected = {f"{stack}.{i}.{p}" for stack in (lm, expert) for i in range(18) for p in PROJECTIONS}
    assert set(chosen) == expected
    linears = {n for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    kept = linears - set(chosen)
    assert any("vision_tower" in n for n in kept) and not any("vision_tower" in n for n in chosen)
    assert {"paligemma_with_expert.paligemma.model.multi_modal_projector.linear", "action_in_proj",
            "time_mlp_in", f"{expert}.0.input_layernorm.dense"} <= kept


# a GR00T DiT block's Linear layers (N1.5 and N1.7 alike)
DIT_PROJECTIONS = ("attn1.to_q", "attn1.to_k", "attn1.to_v", "attn1.to_out.0", "ff.net.0.proj", "ff.net.2")


def test_groot_default_takes_the_llm_layers_and_the_dit():
    model = build_model("groot-n15-3b", device="meta")
    chosen = set(select_layers(model))
    llm = {f"backbone.eagle_model.language_model.model.layers.{i}.{p}" for i in range(12) for p in PROJECTIONS}
    dit = {f"action_head.model.transformer_blocks.{i}.{p}" for i in range(16) for p in DIT_PROJECTIONS}
    assert chosen == llm | dit
    assert not any(k in n for n in chosen for k in ("vision_model", "vl_self_attention", "norm1", "proj_out", "mlp1"))


def test_groot_n17_default_takes_the_llm_layers_and_the_dit_and_never_the_vision_tower():
    model = build_model("groot-n17-3b", device="meta")
    chosen = set(select_layers(model))
    llm = {f"backbone.model.model.language_model.layers.{i}.{p}" for i in range(16) for p in PROJECTIONS}
    dit = {f"action_head.model.transformer_blocks.{i}.{p}" for i in range(32) for p in DIT_PROJECTIONS}
    assert chosen == llm | dit
    assert not any(".visual." in n for n in select_layers(model, scope="all"))


def test_smolvla_default_takes_the_text_decoder_and_the_expert():
    """The family spec's scope: the 16 kept SmolLM2 layers and the expert's, never the SigLIP tower; scope
    "all" adds the connector, the token table and the action / state projections."""
    model = build_model("smolvla-base", device="meta")
    chosen = set(select_layers(model))
    stacks = ("vlm_with_expert.vlm.model.text_model.layers", "vlm_with_expert.lm_expert.layers")
    assert chosen == {f"{stack}.{i}.{p}" for stack in stacks for i in range(16) for p in PROJECTIONS}
    wide = set(select_layers(model, scope="all"))
    assert wide - chosen == {"vlm_with_expert.vlm.model.connector.modality_projection.proj",
                             "vlm_with_expert.vlm.model.text_model.embed_tokens", "state_proj", "action_in_proj",
                             "action_out_proj", "action_time_mlp_in", "action_time_mlp_out"}
    assert not any("vision_model" in n for n in wide)


def test_selection_by_regex():
    model = build_model("pi05-tiny")
    assert select_layers(model, include=r"mlp\.down_proj$") == [
        f"paligemma_with_expert.{s}.layers.{i}.mlp.down_proj"
        for s in ("paligemma.model.language_model", "gemma_expert.model") for i in range(2)]
    assert select_layers(model, include=r"mlp\.down_proj$", exclude="gemma_expert") == [
        f"paligemma_with_expert.paligemma.model.language_model.layers.{i}.mlp.down_proj" for i in range(2)]
    quantize_model(model, Fp8Config(include=r"vision_tower.*(fc1|fc2)$"))
    assert sum(isinstance(m, Fp8BlockLinear) for m in model.modules()) == 4


@pytest.mark.parametrize("kwargs, message", [
    ({"include": "no_such_layer"}, "selects no layer"),
    ({"include": "layernorm"}, r"cannot be blocked .*input_layernorm \(RMSNorm, weight \(48,\)\)"),
    ({"include": "patch_embedding"}, r"cannot be blocked .*Conv2d, weight \(32, 3, 8, 8\)"),
])
def test_selections_that_cannot_work_are_refused(kwargs, message):
    with pytest.raises(KilovlaError, match=message):
        select_layers(build_model("pi05-tiny"), **kwargs)


def test_bad_settings_and_requantizing_are_refused():
    with pytest.raises(KilovlaError, match="positive multiple of 16"):
        Fp8Config(block=100)
    with pytest.raises(KilovlaError, match="not a regular expression"):
        Fp8Config(include="(")
    model = build_model("pi05-tiny")
    quantize_model(model, Fp8Config())
    with pytest.raises(KilovlaError, match="already quantized"):
        quantize_model(model, Fp8Config(include="vision_tower.*fc1$"))


def test_sizes_are_counted_from_shapes_on_the_meta_device():
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(300, 200), nn.Linear(200, 7, bias=False))
    got = checkpoint_bytes(model, ["0"], block=128)
    assert got["baseline_bytes"] == 2 * (300 * 200 + 200 + 200 * 7)
    assert got["quantized_bytes"] == 300 * 200 + 4 * math.ceil(200 / 128) * math.ceil(300 / 128) + 2 * (200 + 200 * 7)
    big = build_model("pi05-3b", device="meta")
    cfg = preset("pi05-3b")
    per_layer = lambda c: c.width * c.heads * c.head_dim * 2 + 2 * c.width * c.kv_heads * c.head_dim + 3 * c.width * c.mlp_dim  # noqa: E731
    counts = checkpoint_bytes(big, select_layers(big))
    assert counts["fp8_params"] == 18 * (per_layer(cfg.lm) + per_layer(cfg.expert))
    assert counts["baseline_bytes"] == 2 * counts["total_params"]


def _groot_batch(cfg):
    from kilovla.models.batch import PaddedBatch
    from kilovla.models.tokenize import ByteTokenizer, tokenize_batch

    g = torch.Generator().manual_seed(0)
    tokens, mask = tokenize_batch(ByteTokenizer(), ["pick the cube", "open the drawer please"], cfg.max_language_tokens)
    s = cfg.vision.image_size
    return PaddedBatch(images=torch.rand(2, 2, 3, s, s, generator=g), image_masks=torch.tensor([[1, 1], [1, 0]]).bool(),
                       camera_names=cfg.cameras, tokens=tokens, token_mask=mask,
                       state=torch.randn(2, cfg.max_state_dim, generator=g), embodiment_id=torch.tensor([0, 1]))


@pytest.mark.parametrize("packing", [False, True])
def test_a_quantized_groot_samples_actions_close_to_the_original(packing):
    import dataclasses

    model = build_model("groot-tiny").eval()
    model.config = dataclasses.replace(model.config, packing=packing)
    batch = _groot_batch(model.config)
    noise = torch.randn(2, model.config.action_horizon, model.config.max_action_dim, generator=torch.Generator().manual_seed(1))
    want = model.sample_actions(batch, noise=noise)
    sqnr = quantize_model(model, Fp8Config())
    assert len(sqnr) == 2 * 7 + 2 * 6 and isinstance(model.action_head.model.transformer_blocks[0].attn1.to_out[0], Fp8BlockLinear)
    got = model.sample_actions(batch, noise=noise)
    assert not torch.equal(got, want) and sqnr_db(want, got) > 25


def _block_magnitudes(rows: int, cols: int, seed: int) -> torch.Tensor:
    """A factor of 2^-6 .. 2^6 per 128x128 block: a scale applied to the wrong block shows at once."""
    g = torch.Generator().manual_seed(seed)
    e = torch.randint(-6, 7, (-(-rows // 128), -(-cols // 128)), generator=g).float()
    return (2.0**e).repeat_interleave(128, 0).repeat_interleave(128, 1)[:rows, :cols]


def test_a_stack_of_matrices_is_blocked_matrix_by_matrix():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(3, 200, 140, generator=g) * torch.tensor([1e-3, 1.0, 50.0])[:, None, None]
    q, s = quantize_fp8_blockwise(w, 128)
    assert q.shape == w.shape and s.shape == (3, 2, 2)
    for i in range(3):
        qi, si = quantize_fp8_blockwise(w[i], 128)
        assert torch.equal(q[i].view(torch.uint8), qi.view(torch.uint8)) and torch.equal(s[i], si)
    assert torch.equal(dequantize_fp8_blockwise(q, s), torch.stack([dequantize_fp8_blockwise(q[i], s[i]) for i in range(3)]))


def test_a_token_table_looks_up_its_dequantized_rows():
    table = nn.Embedding(300, 200)
    with torch.no_grad():
        table.weight.mul_(_block_magnitudes(300, 200, seed=1))
    fp = Fp8BlockEmbedding.from_module(table)
    assert fp.weight.dtype == FP8 and fp.weight_scale_inv.shape == (3, 2)
    ids = torch.tensor([[0, 127, 128, 299], [5, 256, 255, 1]])  # rows of all three row blocks, both column blocks
    assert torch.equal(fp(ids), fp.dequantized_weight()[ids])
    assert sqnr_db(table(ids), fp(ids)) > 25
    fp.to(torch.bfloat16)
    assert fp(ids).dtype == torch.bfloat16 and fp.weight.dtype == FP8


def test_a_per_embodiment_linear_uses_each_samples_own_matrix():
    from kilovla.models.groot import CategoryLinear

    layer = CategoryLinear(4, 200, 140)
    with torch.no_grad():
        layer.W.mul_(torch.stack([_block_magnitudes(200, 140, seed=c) for c in range(4)]))
        layer.b.normal_()
    fp = Fp8BlockCategoryLinear.from_module(layer)
    assert fp.W.dtype == FP8 and fp.W_scale_inv.shape == (4, 2, 2) and not fp.b.requires_grad
    x, cat = torch.randn(3, 5, 200), torch.tensor([2, 0, 2])
    assert torch.equal(fp(x, cat), torch.bmm(x, fp.dequantized_weight()[cat]) + layer.b[cat][:, None].detach())
    assert sqnr_db(layer(x, cat), fp(x, cat)) > 25


def test_scope_all_takes_every_blockable_layer_but_the_vision_tower():
    pi = build_model("pi05-tiny", device="meta")
    chosen = set(select_layers(pi, scope="all"))
    linears = {n for n, m in pi.named_modules() if isinstance(m, nn.Linear) and "vision_tower" not in n}
    assert chosen == linears | {"paligemma_with_expert.paligemma.model.language_model.embed_tokens"}
    assert set(select_layers(pi)) < chosen
    groot = build_model("groot-tiny", device="meta")
    chosen = set(select_layers(groot, scope="all"))
    assert {"action_head.action_encoder.W2", "action_head.state_encoder.layer1",
            "backbone.eagle_model.language_model.model.embed_tokens"} <= chosen
    assert any("vl_self_attention" in n for n in chosen)
    assert not any(n.startswith("backbone.eagle_model.vision_model") or n.endswith(("position_embedding", "future_tokens"))
                   for n in chosen)
    assert set(select_layers(groot, scope="all", exclude="action_encoder")) == {n for n in chosen if "action_encoder" not in n}
    # positional tables are read whole (`.weight`), not by index: they cannot be blocked
    with pytest.raises(KilovlaError, match=r"cannot be blocked .*action_head\.position_embedding \(Embedding"):
        select_layers(groot, include=r"action_head\.position_embedding")
    with pytest.raises(KilovlaError, match="choose one"):
        Fp8Config(scope="all", include="x")
    with pytest.raises(KilovlaError, match="--quant.scope must be one of"):
        Fp8Config(scope="everything")


def test_scope_all_brings_the_3b_shapes_past_40_percent():
    for name, default, wide in (("pi05-3b", 0.34, 0.43), ("groot-n15-3b", 0.22, 0.41)):
        model = build_model(name, device="meta")
        for scope, floor in (("default", default), ("all", wide)):
            c = checkpoint_bytes(model, select_layers(model, scope=scope))
            assert floor < 1 - c["quantized_bytes"] / c["baseline_bytes"] < floor + 0.01, (name, scope)


def test_a_groot_quantized_with_scope_all_round_trips_through_its_state_dict():
    from kilovla.quant.fp8 import prepare_quantized, quantization_config

    model = build_model("groot-tiny").eval()
    batch = _groot_batch(model.config)
    noise = torch.randn(2, model.config.action_horizon, model.config.max_action_dim, generator=torch.Generator().manual_seed(1))
    want = model.sample_actions(batch, noise=noise)
    config = Fp8Config(scope="all")
    layers = list(quantize_model(model, config))
    got = model.sample_actions(batch, noise=noise)
    assert sqnr_db(want, got) > 20
    fresh = build_model("groot-tiny").eval()
    prepare_quantized(fresh, quantization_config(config, layers, fresh), "test")
    fresh.load_state_dict(model.state_dict(), strict=True)
    assert torch.equal(fresh.sample_actions(batch, noise=noise), got)
    kinds = {type(m) for m in fresh.modules()}
    assert {Fp8BlockLinear, Fp8BlockEmbedding, Fp8BlockCategoryLinear} <= kinds
    # the stack's bytes by hand: one FP8 byte per value, a float32 scale per block of every category's matrix
    meta = build_model("groot-tiny", device="meta")
    c, n_in, n_out = meta.action_head.action_encoder.W2.W.shape
    counts = checkpoint_bytes(meta, ["action_head.action_encoder.W2"])
    hand = c * n_in * n_out + 4 * c * math.ceil(n_in / 128) * math.ceil(n_out / 128)
    assert counts["baseline_bytes"] - counts["quantized_bytes"] == 2 * c * n_in * n_out - hand


# -- policy folders -----------------------------------------------------------------------------------
AUGMENTATION = {"crop_scale": 0.7, "brightness": 0.4, "rotate_degrees": 10.0}  # training only: the report must not see it


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """A tiny pi0.5 policy folder that fits the synthetic dataset it comes with."""
    from kilovla.data.synthetic import make_synthetic_dataset

    root = tmp_path_factory.mktemp("fp8")
    ds = make_synthetic_dataset(root / "ds", episodes=3, frames=(12, 20), seed=3)
    stats = stats_to_json(compute_dataset_stats(LeRobotDataset(ds)))
    meta = PolicyMeta(preset="pi05-tiny", overrides={"disabled_cameras": ["right_wrist_0_rgb"]},
                      camera_map={"observation.images.front": "base_0_rgb", "observation.images.wrist": "left_wrist_0_rgb"},
                      state_dim=6, action_dim=6, stats={k: stats[k] for k in ("observation.state", "action")},
                      n_action_steps=4, augmentation=AUGMENTATION)
    model = build_model("pi05-tiny", seed=1, disabled_cameras=("right_wrist_0_rgb",))
    with torch.no_grad():  # adaRMS starts at zero: give the expert's conditioning some weight to carry
        for m in model.modules():
            if hasattr(m, "dense"):
                m.dense.weight.normal_(0, 0.05)
    save_policy(VLAPolicy(model, meta), root / "policy")
    out = root / "policy-fp8"
    report = quantize_policy_folder(root / "policy", out, Fp8Config(), dataset=ds, samples=32, latency_repeats=1)
    return {"root": root, "dataset": ds, "source": root / "policy", "out": out, "report": report}


def test_a_quantized_folder_stores_the_hf_fp8_layout(folders):
    state = load_file(str(folders["out"] / "model.safetensors"))
    source = load_file(str(folders["source"] / "model.safetensors"))
    qcfg = json.loads((folders["out"] / "policy.json").read_text())["quantization_config"]
    assert qcfg["quant_method"] == "fp8" and qcfg["weight_block_size"] == [128, 128]
    assert qcfg["activation_scheme"] == "dynamic" and len(qcfg["modules"]) == 28 and qcfg["activations"] == "1x128"
    # Hugging Face's modules_to_not_convert: exactly the Linear layers that stay in high precision
    linears = {n for n, m in build_model("pi05-tiny", disabled_cameras=("right_wrist_0_rgb",), device="meta").named_modules()
               if isinstance(m, nn.Linear)}
    assert set(qcfg["modules_to_not_convert"]) == linears - set(qcfg["modules"])
    assert any("vision_tower" in n for n in qcfg["modules_to_not_convert"])
    assert qcfg["weight_only_modules"] == []  # every default FP8 layer of pi0.5 is a Linear: W8A8
    for name in qcfg["modules"]:
        q, s = state[f"{name}.weight"], state[f"{name}.weight_scale_inv"]
        want_q, want_s = quantize_fp8_blockwise(source[f"{name}.weight"])
        assert q.dtype == torch.float8_e4m3fn and s.dtype == torch.float32
        assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8)) and torch.equal(s, want_s)
    kept = [k for k in state if not k.endswith(".weight_scale_inv") and k.rsplit(".", 1)[0] not in qcfg["modules"]]
    assert kept and all(state[k].dtype == torch.bfloat16 for k in kept)
    assert set(state) == set(source) | {f"{n}.weight_scale_inv" for n in qcfg["modules"]}


def test_a_quantized_folder_loads_as_a_policy_and_acts_like_the_original(folders):
    original = load_policy_folder(folders["source"])
    quantized = load_policy_folder(folders["out"])
    layers = [m for m in quantized.model.modules() if isinstance(m, Fp8BlockLinear)]
    assert len(layers) == 28 and all(m.weight.dtype == torch.float8_e4m3fn for m in layers)
    assert all(p.dtype == torch.float32 for p in quantized.model.parameters())
    ds = LeRobotDataset(folders["dataset"])
    rows = ds.get_batch(np.arange(0, len(ds), 4))
    torch.manual_seed(0)
    a = original.select_action(rows)
    torch.manual_seed(0)
    b = quantized.select_action(rows)
    variance = np.asarray(rows["action"]).var(axis=0).mean()
    assert a.shape == b.shape == (len(rows["task"]), 8, 6)
    assert 0 < np.mean((a - b) ** 2) < 0.01 * variance


def test_a_scope_all_folder_stores_the_token_table_in_fp8_and_acts_like_the_original(folders, tmp_path):
    out = tmp_path / "all"
    report = quantize_policy_folder(folders["source"], out, Fp8Config(scope="all"), dataset=folders["dataset"], samples=16,
                                    latency_repeats=1)
    table = "paligemma_with_expert.paligemma.model.language_model.embed_tokens"
    state = load_file(str(out / "model.safetensors"))
    assert state[f"{table}.weight"].dtype == torch.float8_e4m3fn and f"{table}.weight_scale_inv" in state
    assert json.loads((out / "policy.json").read_text())["quantization_config"]["scope"] == "all"
    assert report["size"]["reduction_percent"] > folders["report"]["size"]["reduction_percent"] + 5
    assert report["layers"][table]["output_sqnr_db"] > 25  # measured on the token ids the policy looked up
    assert report["actions"]["relative"] < 0.01
    quantized = load_policy_folder(out)
    assert isinstance(quantized.model.get_submodule(table), Fp8BlockEmbedding)
    ds = LeRobotDataset(folders["dataset"])
    rows = ds.get_batch(np.arange(0, len(ds), 4))
    torch.manual_seed(0)
    a = load_policy_folder(folders["source"]).select_action(rows)
    torch.manual_seed(0)
    b = quantized.select_action(rows)
    assert 0 < np.mean((a - b) ** 2) < 0.01 * np.asarray(rows["action"]).var(axis=0).mean()


def test_ema_quantizes_the_folders_ema_weights(folders, tmp_path, capsys):
    from kilovla.cli import main

    source = tmp_path / "with-ema"
    shutil.copytree(folders["source"], source)
    state = load_file(str(source / "model.safetensors"))
    ema = {k: v * 0.5 if v.is_floating_point() else v for k, v in state.items()}  # weights unlike the last ones
    save_file(ema, str(source / "ema.safetensors"))
    report = quantize_policy_folder(source, tmp_path / "q", Fp8Config(), latency_repeats=1, ema=True)
    stored = load_file(str(tmp_path / "q" / "model.safetensors"))
    name = report["quantization_config"]["modules"][0]
    assert report["weights"] == "ema"
    assert torch.equal(stored[f"{name}.weight_scale_inv"], quantize_fp8_blockwise(ema[f"{name}.weight"])[1])
    assert main(["quantize", str(folders["source"]), "--out", str(tmp_path / "none"), "--ema"]) == 2
    assert "ema.safetensors is missing" in capsys.readouterr().err and not (tmp_path / "none").exists()


def test_the_report_measures_what_the_issue_asks(folders):
    report = folders["report"]
    on_disk = json.loads((folders["out"] / "quant_report.json").read_text())
    assert on_disk["size"] == report["size"]
    s = report["size"]
    assert s["quantized_bytes"] == (folders["out"] / "model.safetensors").stat().st_size
    assert on_disk["size"]["reduction_percent"] == pytest.approx(100 * (1 - s["quantized_bytes"] / s["bf16_bytes"]))
    assert 10 < s["reduction_percent"] < 50
    assert s["quantized_bytes"] < s["bf16_bytes"] < s["source_bytes"]
    layers = report["layers"]
    assert len(layers) == 28 and min(v["weight_sqnr_db"] for v in layers.values()) > 25
    measured = [v["output_sqnr_db"] for v in layers.values() if v["output_sqnr_db"] is not None]
    idle = [n for n, v in layers.items() if v["output_sqnr_db"] is None]
    # pi0.5 never reads the prefix stream after its last layer: q, o and the MLP there never run
    assert sorted(idle) == sorted(f"paligemma_with_expert.paligemma.model.language_model.layers.1.{p}"
                                  for p in ("self_attn.q_proj", "self_attn.o_proj", "mlp.gate_proj",
                                            "mlp.up_proj", "mlp.down_proj"))
    assert len(measured) == 23 and min(measured) > 25
    a = report["actions"]
    assert a["samples"] > 100 and 0 < a["relative"] < 0.01
    assert report["latency"]["kernel"] == "emulate" and report["latency"]["quantized_s"] > 0
    assert (folders["out"] / "quant_report.md").read_text().startswith("# FP8 quantization report")


# -- the command ----------------------------------------------------------------------------------------
def _entries(folder):
    return sorted(p.name for p in folder.iterdir())


def _errors(err: str) -> str:
    """stderr less the old flags' notices of their new spelling (`--out is now --output_dir`)."""
    return "\n".join(line for line in err.strip().splitlines() if " is now --" not in line)


@pytest.mark.parametrize("args, message", [
    (["--include", "nothing_matches"], "selects no layer"),
    (["--include", "layernorm"], "cannot be blocked"),
    (["--block", "100"], "positive multiple of 16"),
])
def test_quantize_refuses_bad_selections_and_writes_nothing(folders, tmp_path, capsys, args, message):
    from kilovla.cli import main

    before = _entries(tmp_path)
    assert main(["quantize", str(folders["source"]), "--out", str(tmp_path / "q"), *args]) == 2
    err = _errors(capsys.readouterr().err)
    assert len(err.splitlines()) == 1 and message in err
    assert _entries(tmp_path) == before


def test_quantize_refuses_a_quantized_policy_and_an_existing_output(folders, tmp_path, capsys):
    from kilovla.cli import main

    assert main(["quantize", str(folders["out"]), "--out", str(tmp_path / "q2")]) == 2
    assert "already quantized (policy.json has a quantization_config)" in capsys.readouterr().err
    existing = tmp_path / "exists"
    existing.mkdir()
    (existing / "keep.txt").write_text("mine")
    assert main(["quantize", str(folders["source"]), "--out", str(existing)]) == 2
    assert "already exists; nothing was written" in capsys.readouterr().err
    assert _entries(existing) == ["keep.txt"] and _entries(tmp_path) == ["exists"]


def test_a_failure_midway_leaves_nothing_behind(folders, tmp_path, monkeypatch):
    from kilovla.quantize import folder as quant_folder

    def broken(*args, **kwargs):
        raise RuntimeError("disk full")

    monkeypatch.setattr(quant_folder.qreport, "write_report", broken)
    with pytest.raises(RuntimeError, match="disk full"):
        quantize_policy_folder(folders["source"], tmp_path / "q", Fp8Config(), latency_repeats=1)
    assert _entries(tmp_path) == []


def _metaworld_policy_folder(folder):
    """An untrained tiny pi0.5 that fits Meta-World's observations and actions."""
    stats = {"observation.state": {"q01": [-1] * 4, "q99": [1] * 4}, "action": {"q01": [-1] * 4, "q99": [1] * 4}}
    meta = PolicyMeta(preset="pi05-tiny", overrides={"disabled_cameras": ["right_wrist_0_rgb"]},
                      camera_map={"observation.images.scene": "base_0_rgb", "observation.images.wrist": "left_wrist_0_rgb"},
                      state_dim=4, action_dim=4, stats=stats, n_action_steps=4)
    save_policy(VLAPolicy(build_model("pi05-tiny", disabled_cameras=("right_wrist_0_rgb",)), meta), folder)


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_a_quantized_policy_runs_in_closed_loop(tmp_path):
    from kilovla.cli import main

    _metaworld_policy_folder(tmp_path / "ckpt")
    assert main(["quantize", str(tmp_path / "ckpt"), "--out", str(tmp_path / "q"), "--activations", "none",
                 "--latency-repeats", "1"]) == 0
    assert json.loads((tmp_path / "q" / "policy.json").read_text())["quantization_config"]["activations"] == "none"
    assert main(["eval", "--policy", str(tmp_path / "q"), "--tasks", "reach-v3", "--episodes", "1",
                 "--resolution", "32", "--max-steps", "12", "--videos", "0", "--out", str(tmp_path / "ev")]) == 0
    report = json.loads((tmp_path / "ev" / "report.json").read_text())
    assert report["per_task"]["reach-v3"]["episodes"] == 1


def test_kilovla_quantize_of_a_smolvla_folder_acts_like_the_original(reach_policy, reach_demos, tmp_path):
    from kilovla.cli import main

    source = reach_policy("--policy.preset=smolvla-tiny")
    assert main(["quantize", str(source), "--out", str(tmp_path / "q"), "--latency-repeats", "1"]) == 0
    fields = json.loads((tmp_path / "q" / "policy.json").read_text())
    assert fields["family"] == "smolvla" and fields["quantization_config"]["scope"] == "default"
    assert set(fields["quantization_config"]["modules"]) == set(select_layers(build_model("smolvla-tiny", device="meta")))
    original, quantized = load_policy_folder(source), load_policy_folder(tmp_path / "q")
    assert sum(isinstance(m, Fp8BlockLinear) for m in quantized.model.modules()) == 56  # 2 x 4 layers x 7
    ds = LeRobotDataset(reach_demos)
    rows = ds.get_batch(np.arange(0, len(ds), 8))
    torch.manual_seed(0)
    a = original.select_action(rows)
    torch.manual_seed(0)
    b = quantized.select_action(rows)
    assert a.shape == b.shape and sqnr_db(torch.from_numpy(a), torch.from_numpy(b)) > 20


@pytest.mark.parametrize("n, k, m", [(384, 1280, 3), (256, 512, 1), (2048, 256, 130)])
def test_the_scaled_mm_call_passes_torchs_layout_checks(n, k, m):
    """torch's meta kernel for block-scaled `scaled_mm` checks the scale shapes and strides cuBLASLt
    needs (1x128 scales column-major, 128x128 scales padded to 4 K-blocks and K-major); the numbers
    themselves are checked on a GPU (tests/test_fp8_gpu.py)."""
    layer = Fp8BlockLinear(k, n, device="meta")
    out = fp8._scaled_mm(layer, torch.empty(2, m, k, device="meta"))
    assert out.shape == (2, m, n) and out.dtype == torch.float32
    q = torch.empty(4, k, dtype=torch.float8_e4m3fn, device="meta")
    row_major_scales = torch.empty(4, math.ceil(k / 128), device="meta")
    with pytest.raises(RuntimeError, match="1x128 x 128x128 blockwise scaling"):
        F.scaled_mm(q, layer.weight.t(), row_major_scales, F.ScalingType.BlockWise1x128,
                    layer.weight_scale_inv.t(), F.ScalingType.BlockWise128x128, output_dtype=torch.bfloat16)


@pytest.mark.slow
@pytest.mark.shares_cpu  # sizes, SQNR, success rates: the latency row is not asserted on
@pytest.mark.filterwarnings("ignore::UserWarning")
def test_bench_fp8_writes_the_named_rows(tmp_path):
    from kilovla.bench import fp8 as fp8_bench

    _metaworld_policy_folder(tmp_path / "ckpt")
    path = fp8_bench.run(quick=True, out_dir=tmp_path / "out", policy=tmp_path / "ckpt", tasks=["reach-v3"],
                         resolution=32, episodes=1)
    result = json.loads(path.read_text())
    rows = {r["name"]: r for r in result["rows"]}
    assert list(rows) == ["checkpoint_bytes_3b", "checkpoint_bytes_3b_all", "checkpoint_bytes_3b_groot",
                          "checkpoint_bytes_3b_groot_all", "checkpoint_bytes_tiny", "min_layer_sqnr_db", "action_mse_rel",
                          "success_rate", "chunk_latency_ms", "checkpoint_bytes_tiny_all", "min_layer_sqnr_db_all",
                          "action_mse_rel_all", "success_rate_all"]
    assert rows["checkpoint_bytes_3b"]["ratio"] == pytest.approx(1 / (1 - result["pi05-3b"]["reduction"]), rel=1e-3)
    assert result["pi05-3b"]["vision_layers_quantized"] == 0 and result["groot-n15-3b"]["vision_layers_quantized"] == 0
    assert rows["checkpoint_bytes_tiny"]["ours"] == (tmp_path / "out" / "fp8-policy" / "model.safetensors").stat().st_size
    assert rows["min_layer_sqnr_db"]["ours"] > 25 and rows["min_layer_sqnr_db"]["baseline"] is None
    assert 0 <= rows["success_rate"]["baseline"] <= 1 and 0 <= rows["success_rate"]["ours"] <= 1
    assert result["report"]["closed_loop"]["baseline"]["episodes_per_task"] == 1
    assert rows["checkpoint_bytes_3b_all"]["ours"] < rows["checkpoint_bytes_3b"]["ours"]
    assert rows["checkpoint_bytes_tiny_all"]["ours"] == (tmp_path / "out" / "fp8-policy-all" / "model.safetensors").stat().st_size
    assert rows["checkpoint_bytes_tiny_all"]["ours"] < rows["checkpoint_bytes_tiny"]["ours"]
    assert rows["success_rate_all"]["baseline"] == rows["success_rate"]["baseline"]


def test_a_dataset_that_does_not_fit_is_named(folders, tmp_path, capsys):
    from kilovla.cli import main
    from kilovla.data.synthetic import make_synthetic_dataset

    other = make_synthetic_dataset(tmp_path / "other", episodes=1, frames=12, cameras=("left",), seed=1)
    assert main(["quantize", str(folders["source"]), "--out", str(tmp_path / "q"), "--dataset", str(other)]) == 2
    err = capsys.readouterr().err
    assert f"--quant.dataset {other} does not fit the policy" in err and "observation.images.front" in err
    assert _entries(tmp_path) == ["other"]


def test_fp8_weights_load_only_into_fp8_layers(folders, tmp_path):
    from kilovla.models.checkpoints import CheckpointError, load_checkpoint, save_safetensors

    state = load_file(str(folders["out"] / "model.safetensors"))
    plain = {k: v for k, v in state.items() if not k.endswith("weight_scale_inv")}
    save_safetensors(plain, tmp_path / "model.safetensors")
    with pytest.raises(CheckpointError, match="weights stored as F8_E4M3"):
        load_checkpoint(build_model("pi05-tiny", disabled_cameras=("right_wrist_0_rgb",), device="meta"), tmp_path)


# -- what the review found -------------------------------------------------------------------------------
def _refuses_before_loading(monkeypatch):
    """Loading the weights is the first expensive step: these refusals must come before it."""
    from kilovla.policy_folder import PolicyFolder

    def never(*args, **kwargs):
        raise AssertionError("the weights were loaded before the input was checked")

    monkeypatch.setattr(PolicyFolder, "load", never)


def test_tiny_tiles_get_a_floored_scale_and_never_dequantize_to_nan():
    w = torch.zeros(256, 256)
    w[0, 0] = 1e-44  # amax / 448 underflows to 0 in float32: 0 / 0 and 0 * inf without a floor
    w[0, 128] = 3e-43
    w[128, 0] = -2e-40  # amax / 448 is subnormal
    q, s = quantize_fp8_blockwise(w)
    back = dequantize_fp8_blockwise(q, s)
    assert torch.isfinite(back).all() and (s >= fp8.SCALE_FLOOR).all()
    assert (back - w).abs().max() <= 2e-40 and s[1, 1] == 1.0
    x = torch.zeros(2, 256)
    x[0, 3], x[1, 200] = 1e-44, 5e-43
    qa, sa = quantize_activations_1x128(x)
    assert (sa > 0).all() and torch.isfinite(fake_quantize_activations(x)).all()
    layer = Fp8BlockLinear.from_module(nn.Linear(256, 256))
    assert torch.isfinite(layer(x)).all()


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_non_finite_weights_are_refused_naming_the_layer(value):
    with pytest.raises(KilovlaError, match="non-finite"):
        quantize_fp8_blockwise(torch.tensor([[1.0, value]]))
    model = build_model("pi05-tiny")
    name = "paligemma_with_expert.gemma_expert.model.layers.1.mlp.up_proj"
    with torch.no_grad():
        model.get_submodule(name).weight[3, 4] = value
    with pytest.raises(KilovlaError, match=rf"non-finite weights \(NaN or inf\) in {re.escape(name)} \(1 of"):
        quantize_model(model, Fp8Config())
    assert not any(isinstance(m, Fp8BlockLinear) for m in model.modules())  # refused before any replacement


def test_a_folder_with_non_finite_weights_exits_2_and_writes_nothing(folders, tmp_path, capsys):
    from kilovla.cli import main
    from kilovla.models.checkpoints import save_safetensors

    src = tmp_path / "nan-policy"
    src.mkdir()
    (src / "policy.json").write_text((folders["source"] / "policy.json").read_text())
    state = load_file(str(folders["source"] / "model.safetensors"))
    name = "paligemma_with_expert.paligemma.model.language_model.layers.0.self_attn.k_proj"
    state[f"{name}.weight"][0, 0] = float("nan")
    save_safetensors(state, src / "model.safetensors")
    assert main(["quantize", str(src), "--out", str(tmp_path / "deep" / "q"), "--latency-repeats", "1"]) == 2
    err = _errors(capsys.readouterr().err)
    assert len(err.splitlines()) == 1 and name in err and "non-finite" in err
    assert _entries(tmp_path) == ["nan-policy"]


def test_sqnr_is_always_a_finite_number_and_nan_counts_as_worst():
    x = torch.randn(8, 8)
    assert sqnr_db(torch.zeros(4, 4), torch.zeros(4, 4)) == fp8.SQNR_CAP_DB  # an all-zero layer: no noise
    assert sqnr_db(x, x) == fp8.SQNR_CAP_DB
    broken = x.clone()
    broken[0, 0] = float("nan")
    assert sqnr_db(x, broken) == -fp8.SQNR_CAP_DB
    assert sqnr_db(torch.zeros(4), torch.ones(4)) == -fp8.SQNR_CAP_DB
    assert 20 < sqnr_db(x, x + 0.01 * torch.randn(8, 8)) < 60


@torch.no_grad()
def test_a_layer_that_outputs_nan_is_the_reports_minimum_and_the_json_stays_valid(folders):
    from kilovla.quantize import report as qreport

    baseline = load_policy_folder(folders["source"])
    quantized = load_policy_folder(folders["out"])
    name = "paligemma_with_expert.gemma_expert.model.layers.0.mlp.down_proj"
    quantized.model.get_submodule(name).weight_scale_inv.fill_(float("nan"))
    rows = qreport.heldout_rows(folders["dataset"], baseline, 4)
    got = qreport.compare_actions(baseline, quantized, rows)
    assert got["mse"] is None and got["relative"] is None and got["non_finite_actions"] > 0
    report = {"layers": {n: {"weight_sqnr_db": 30.0, "output_sqnr_db": v} for n, v in got.pop("output_sqnr_db").items()}}
    assert qreport.min_output_sqnr(report) == (name, -fp8.SQNR_CAP_DB)
    json.dumps({**report, "actions": got}, allow_nan=False)


@torch.no_grad()
def test_action_mse_is_in_action_units_on_the_inference_path_without_padded_steps(folders):
    """Two samples, the second at the dataset's very end (its chunk runs past the episode: padded
    steps), a policy with training augmentation on: the report's numbers against a direct computation."""
    from kilovla.quantize import report as qreport

    baseline = load_policy_folder(folders["source"])
    quantized = load_policy_folder(folders["out"])
    assert baseline.processor.augmentation.enabled
    rows = qreport.heldout_rows(folders["dataset"], baseline, 2)
    [row] = rows
    pad = np.asarray(row["action_is_pad"], bool)
    assert pad.shape == (2, 8) and not pad[0].any() and pad[1].sum() == 7
    got = qreport.compare_actions(baseline, quantized, rows, seed=5)

    noise = torch.randn(2, 8, baseline.model.config.max_action_dim, generator=torch.Generator().manual_seed(5))
    batch = baseline.processor.observation_batch(row)
    ref = baseline.model.sample_actions(batch, noise=noise).numpy()
    ours = quantized.model.sample_actions(batch, noise=noise).numpy()
    unnorm = baseline.processor.unnormalize_actions
    diff = unnorm(ours) - unnorm(ref)
    want = float(np.mean(diff[~pad] ** 2))
    assert got["samples"] == 9 and got["mse"] == pytest.approx(want, rel=1e-5)
    truth = np.asarray(row["action"], np.float32)[~pad]
    assert got["action_variance"] == pytest.approx(float(truth.var(axis=0).mean()), rel=1e-5)
    # each wrong way of computing it gives a different number, so the test can tell them apart
    normalised = float(np.mean((ours[..., :6] - ref[..., :6])[~pad] ** 2))
    with_padding = float(np.mean(diff ** 2))
    train = baseline.processor.training_batch(row)
    augmented = float(np.mean((unnorm(quantized.model.sample_actions(train, noise=noise).numpy())
                               - unnorm(baseline.model.sample_actions(train, noise=noise).numpy()))[~pad] ** 2))
    for wrong in (normalised, with_padding, augmented):
        assert abs(wrong - want) > 0.02 * want


def test_the_loader_honours_the_stored_activations(folders, tmp_path):
    weight_only = tmp_path / "wo"
    quantize_policy_folder(folders["source"], weight_only, Fp8Config(activations="none"), latency_repeats=1)
    qcfg = json.loads((weight_only / "policy.json").read_text())["quantization_config"]
    assert qcfg["activations"] == "none" and "activation_scheme" not in qcfg  # HF has no weight-only scheme
    name = "paligemma_with_expert.gemma_expert.model.layers.0.mlp.up_proj"
    for folder, w8a8 in ((weight_only, False), (folders["out"], True)):
        layer = load_policy_folder(folder).model.get_submodule(name)
        x = torch.randn(3, layer.in_features, generator=torch.Generator().manual_seed(0))
        w = layer.dequantized_weight()
        plain, fake = F.linear(x, w, layer.bias), F.linear(fake_quantize_activations(x), w, layer.bias)
        assert layer.activations == ("1x128" if w8a8 else "none")
        torch.testing.assert_close(layer(x), fake if w8a8 else plain, rtol=0, atol=1e-6)
        assert not torch.allclose(layer(x), plain if w8a8 else fake, rtol=0, atol=1e-6)


def _edited_copy(folder, dst, edit):
    import shutil

    shutil.copytree(folder, dst)
    fields = json.loads((dst / "policy.json").read_text())
    edit(fields)
    (dst / "policy.json").write_text(json.dumps(fields))
    return dst


def test_an_edited_quantization_config_is_named(folders, tmp_path):
    def block(f):
        f["quantization_config"]["weight_block_size"] = [64, 64]

    def scheme(f):
        f["quantization_config"]["activations"] = "none"

    with pytest.raises(KilovlaError, match=r"weight_block_size \[64, 64\] does not match the 128x128 blocks"):
        load_policy_folder(_edited_copy(folders["out"], tmp_path / "block", block))
    with pytest.raises(KilovlaError, match="activation_scheme 'dynamic' contradicts activations 'none'"):
        load_policy_folder(_edited_copy(folders["out"], tmp_path / "scheme", scheme))


def test_block_size_mismatch_is_named_from_the_scale_shapes_too(tmp_path):
    from kilovla.quant.fp8 import load_quantized_weights

    model = nn.Sequential(nn.Linear(256, 200))
    qcfg = quantization_config(Fp8Config(), list(select_layers(model, include="0")), model)
    quantize_model(model, Fp8Config(include="0"))
    from kilovla.models.checkpoints import save_safetensors

    save_safetensors(model.state_dict(), tmp_path / "model.safetensors")  # no block size in the metadata
    fresh = nn.Sequential(nn.Linear(256, 200))
    with pytest.raises(KilovlaError, match=r"weight_block_size \[64, 64\] does not match 0.weight_scale_inv in .*: .* "
                                           r"\(4, 4\) scales, the file stores \(2, 2\)"):
        load_quantized_weights(fresh, {**qcfg, "weight_block_size": [64, 64]}, tmp_path, "policy.json")


def _damaged_copy(folder, tmp_path, edit):
    """A copy of a quantized folder whose model.safetensors went through `edit(state)`, metadata kept."""
    from safetensors import safe_open

    out = tmp_path / "damaged"
    shutil.copytree(folder, out)
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        metadata = f.metadata()
    state = load_file(str(out / "model.safetensors"))
    edit(state)
    save_file(state, str(out / "model.safetensors"), metadata=metadata)
    return out


TABLE = "paligemma_with_expert.paligemma.model.language_model.embed_tokens"


@pytest.mark.parametrize("edit, message", [
    (lambda s: s.__setitem__(f"{TABLE}.weight_scale_inv", s[f"{TABLE}.weight_scale_inv"][:1]),
     rf"model.safetensors: {TABLE}.weight_scale_inv is damaged: .* the file stores \(1, 1\)"),
    (lambda s: s[f"{TABLE}.weight_scale_inv"].__setitem__(0, float("nan")),
     rf"model.safetensors: {TABLE}.weight_scale_inv has 1 scales that are not finite"),
    (lambda s: s.__setitem__(f"{TABLE}.weight", s[f"{TABLE}.weight"].to(torch.bfloat16)),
     rf"{TABLE}.weight is stored as BF16, but the quantized layer reads it as float8_e4m3fn"),
])
def test_a_damaged_quantized_file_is_named(folders, tmp_path, edit, message):
    source = tmp_path / "all"
    quantize_policy_folder(folders["source"], source, Fp8Config(scope="all"), latency_repeats=1)
    with pytest.raises(KilovlaError, match=message):
        load_policy_folder(_damaged_copy(source, tmp_path, edit))


def test_a_truncated_quantized_file_is_named_not_a_traceback(folders, tmp_path):
    broken = tmp_path / "truncated"
    shutil.copytree(folders["out"], broken)
    data = (broken / "model.safetensors").read_bytes()
    (broken / "model.safetensors").write_bytes(data[:-100])
    with pytest.raises(KilovlaError, match="lies outside the file"):
        load_policy_folder(broken)


def test_a_token_table_refuses_negative_ids_as_an_embedding_does():
    fp = Fp8BlockEmbedding.from_module(nn.Embedding(300, 8))
    with pytest.raises(IndexError):
        fp(torch.tensor([-1]))


def test_a_policy_json_that_is_a_list_is_named(tmp_path, capsys):
    from kilovla.cli import main

    src = tmp_path / "p"
    src.mkdir()
    (src / "policy.json").write_text("[1, 2]")
    (src / "model.safetensors").write_bytes(b"")
    assert main(["quantize", str(src), "--out", str(tmp_path / "q")]) == 2
    assert "not a policy description: expected a JSON object" in capsys.readouterr().err
    assert _entries(tmp_path) == ["p"]


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_an_fsdp_intermediate_checkpoint_is_accepted(folders, tmp_path):
    import torch.distributed.checkpoint as dcp

    src = tmp_path / "step_000100"
    src.mkdir()
    (src / "policy.json").write_text((folders["source"] / "policy.json").read_text())
    model = load_policy_folder(folders["source"]).model
    dcp.save({"model": model.state_dict()}, checkpoint_id=str(src / "state"), no_dist=True)
    report = quantize_policy_folder(src, tmp_path / "q", Fp8Config(), latency_repeats=1)
    assert report["size"]["source_bytes"] is None and report["size"]["bf16_bytes"] == folders["report"]["size"]["bf16_bytes"]
    ours, theirs = load_file(str(tmp_path / "q" / "model.safetensors")), load_file(str(folders["out"] / "model.safetensors"))
    assert set(ours) == set(theirs)
    assert all(torch.equal(ours[k].view(torch.uint8), theirs[k].view(torch.uint8)) for k in ours)


@pytest.mark.parametrize("args, message", [
    (["--include", "nothing_matches"], "selects no layer"),
    (["--samples", "0", "--dataset", "DS"], "--samples 0: must be >= 1"),
    (["--latency-repeats", "0"], "--latency-repeats 0: must be >= 1"),
    (["--dataset", "MISSING"], "no such folder"),
    (["--dataset", "OTHER"], "does not fit the policy: it lacks observation.images.front"),
    (["--device", "cuda"], "no CUDA GPU"),
])
def test_cheap_checks_come_before_the_weights_and_write_nothing(folders, tmp_path, capsys, monkeypatch, args, message):
    from kilovla.cli import main
    from kilovla.data.synthetic import make_synthetic_dataset

    if "OTHER" in args:
        make_synthetic_dataset(tmp_path / "other", episodes=1, frames=12, cameras=("left",), seed=1)
    if args[-1] == "cuda" and torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    paths = {"DS": str(folders["dataset"]), "MISSING": str(tmp_path / "missing"), "OTHER": str(tmp_path / "other")}
    args = [paths.get(a, a) for a in args]
    _refuses_before_loading(monkeypatch)
    before = _entries(tmp_path)
    assert main(["quantize", str(folders["source"]), "--out", str(tmp_path / "a" / "b" / "q"), *args]) == 2
    err = _errors(capsys.readouterr().err)
    assert len(err.splitlines()) == 1 and message in err
    assert _entries(tmp_path) == before


def test_an_out_below_a_file_is_refused(folders, tmp_path, capsys, monkeypatch):
    from kilovla.cli import main

    (tmp_path / "file").write_text("x")
    _refuses_before_loading(monkeypatch)
    assert main(["quantize", str(folders["source"]), "--out", str(tmp_path / "file" / "sub" / "q")]) == 2
    assert f"{tmp_path / 'file'} is a file, not a folder" in capsys.readouterr().err
    assert _entries(tmp_path) == ["file"]


def test_a_failure_midway_removes_the_parent_folders_it_made(folders, tmp_path, monkeypatch):
    from kilovla.quantize import folder as quant_folder

    def broken(*args, **kwargs):
        raise RuntimeError("disk full")

    (tmp_path / "kept").mkdir()
    monkeypatch.setattr(quant_folder.qreport, "write_report", broken)
    with pytest.raises(RuntimeError, match="disk full"):
        quantize_policy_folder(folders["source"], tmp_path / "kept" / "x" / "y" / "q", Fp8Config(), latency_repeats=1)
    assert _entries(tmp_path) == ["kept"] and _entries(tmp_path / "kept") == []


def test_selecting_only_layers_inference_never_runs_reports_null(folders, tmp_path, capsys):
    from kilovla.cli import main

    idle = r"language_model\.layers\.1\.mlp\.down_proj$"
    assert main(["quantize", str(folders["source"]), "--out", str(tmp_path / "q"), "--include", idle,
                 "--dataset", str(folders["dataset"]), "--samples", "4", "--latency-repeats", "1"]) == 0
    assert "no selected layer runs at inference" in capsys.readouterr().out
    report = json.loads((tmp_path / "q" / "quant_report.json").read_text())
    assert [v["output_sqnr_db"] for v in report["layers"].values()] == [None]


def test_the_closed_loop_comparison_uses_the_envs_cameras_and_checks_them_first(tmp_path, capsys, monkeypatch):
    """A LIBERO-shaped policy (agentview + wrist): `kilovla eval`'s cameras for LIBERO, --max-steps passed
    on; a policy that does not fit the env is refused before its weights are loaded."""
    import kilovla.eval.closed_loop as closed_loop
    from kilovla.cli import main
    from kilovla.envs import libero

    stats = {"observation.state": {"q01": [-1] * 8, "q99": [1] * 8}, "action": {"q01": [-1] * 7, "q99": [1] * 7}}
    meta = PolicyMeta(preset="pi05-tiny", overrides={"disabled_cameras": ["right_wrist_0_rgb"]},
                      camera_map={"observation.images.agentview": "base_0_rgb", "observation.images.wrist": "left_wrist_0_rgb"},
                      state_dim=8, action_dim=7, stats=stats, n_action_steps=4)
    save_policy(VLAPolicy(build_model("pi05-tiny", disabled_cameras=("right_wrist_0_rgb",)), meta), tmp_path / "lib")
    monkeypatch.setattr(libero, "expand_tasks", lambda names: names)  # no LIBERO install needed to name a task
    calls = []

    def fake_evaluate(policy, settings, **kwargs):
        spec = settings.spec()
        libero.spec(settings.tasks[0], cameras=spec.cameras).check_fits(policy)
        calls.append({"cameras": spec.cameras, "max_steps": settings.max_steps})
        return {"overall_success_rate": 0.5, "per_task": {"libero_spatial/0": {"success_rate": 0.5}},
                "episodes_per_task": settings.episodes}

    monkeypatch.setattr(closed_loop, "evaluate", fake_evaluate)
    common = ["--env", "libero", "--tasks", "libero_spatial/0", "--eval-episodes", "2", "--latency-repeats", "1"]
    assert main(["quantize", str(tmp_path / "lib"), "--out", str(tmp_path / "q"), *common, "--max-steps", "7"]) == 0
    assert [(c["cameras"], c["max_steps"]) for c in calls] == [(("agentview", "wrist"), 7)] * 2
    report = json.loads((tmp_path / "q" / "quant_report.json").read_text())
    assert report["closed_loop"]["difference_points"] == 0

    _metaworld_policy_folder(tmp_path / "mw")
    _refuses_before_loading(monkeypatch)
    assert main(["quantize", str(tmp_path / "mw"), "--out", str(tmp_path / "q2"), *common]) == 2
    err = capsys.readouterr().err
    assert "does not fit env libero" in err and "cameras ['scene', 'wrist'] (policy)" in err
    assert not (tmp_path / "q2").exists()


def test_device_auto_is_the_cpu_here_and_the_latency_says_where():
    from kilovla.machine import resolve_device

    assert resolve_device("auto", "--quant.device").type == ("cuda" if torch.cuda.is_available() else "cpu")
    with pytest.raises(KilovlaError, match="--quant.device 'nonsense'"):
        resolve_device("nonsense", "--quant.device")


@pytest.mark.gpu
def test_quantize_on_the_gpu_selects_a_gpu_kernel(folders, tmp_path):
    report = quantize_policy_folder(folders["source"], tmp_path / "q", Fp8Config(), latency_repeats=2, device="auto",
                                    dataset=folders["dataset"], samples=8)
    assert report["latency"]["device"].startswith("cuda")
    # the tiny model's 48-wide layers are not multiples of 128: the GPU kernels refuse them, loudly
    assert report["latency"]["kernel"] == "emulate"
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("no FP8 GEMM before SM 8.9")
    big = nn.Sequential(nn.Linear(256, 384)).cuda()
    quantize_model(big, Fp8Config(include="0"))
    big(torch.randn(4, 256, device="cuda"))
    assert big[0].kernel_used["cuda"] in ("scaled_mm", "torchao")


@pytest.mark.parametrize("policy, flags, message", [
    ("MISSING", [], "not a policy folder"),
    ("SOURCE", [], "does not fit env metaworld"),  # made for the synthetic data
    ("METAWORLD", ["--fp8.dataset", "SYNTHETIC"], "error: --fp8.dataset {SYNTHETIC} does not fit the policy"),
    ("METAWORLD", ["--fp8.episodes=-1"], "error: --fp8.episodes=-1: must be >= 0"),
    ("METAWORLD", ["--episodes", "-1"], "error: --episodes -1: must be >= 0"),  # the old spelling, named as typed
])
def test_a_refused_bench_fp8_writes_nothing(folders, tmp_path, capsys, policy, flags, message):
    """Refused before the held-out episodes are collected: not even the --output_dir folder is made."""
    from kilovla.cli import main

    _metaworld_policy_folder(tmp_path / "mw")
    paths = {"MISSING": str(tmp_path / "missing"), "SOURCE": str(folders["source"]), "METAWORLD": str(tmp_path / "mw"),
             "SYNTHETIC": str(folders["dataset"])}
    argv = ["bench", "fp8", "--quick", f"--policy.path={paths[policy]}", f"--output_dir={tmp_path / 'out'}",
            *[paths.get(a, a) for a in flags]]
    assert main(argv) == 2
    assert message.format(**paths) in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_bench_fp8_refused_midway_removes_the_episodes_it_collected(tmp_path, monkeypatch):
    from kilovla.bench import fp8 as fp8_bench

    def refuse(*args, **kwargs):
        raise KilovlaError("refused")

    _metaworld_policy_folder(tmp_path / "mw")
    monkeypatch.setattr(fp8_bench, "quantize_policy_folder", refuse)
    with pytest.raises(KilovlaError, match="refused"):
        fp8_bench.run(quick=True, out_dir=tmp_path / "out", policy=tmp_path / "mw", tasks=["reach-v3"], resolution=16,
                      episodes=0)
    assert not (tmp_path / "out").exists()
    (tmp_path / "out").mkdir()  # a folder that was there stays, less what this run collected
    with pytest.raises(KilovlaError, match="refused"):
        fp8_bench.run(quick=True, out_dir=tmp_path / "out", policy=tmp_path / "mw", tasks=["reach-v3"], resolution=16,
                      episodes=0)
    assert _entries(tmp_path / "out") == []
