"""SmolVLA (models/smolvla/): shapes, masks, the loss reductions, sampling, packing and the LeRobot key
layout, at tiny shapes. Parity with LeRobot v0.4.4 itself: benchmarks/smolvla_reference/parity.py."""

import dataclasses

import pytest
import torch
from conftest import assert_training_reduces_loss
from safetensors.torch import save_file

from kilovla.errors import KilovlaError
from kilovla.models.batch import PaddedBatch
from kilovla.models.checkpoints import CheckpointError, load_checkpoint
from kilovla.models.family import family_of
from kilovla.models.presets import build_model, preset
from kilovla.models.tokenize import ByteTokenizer, tokenize_batch

TOL = dict(atol=1e-5, rtol=1e-5)
PROMPTS = ["pick up the red block", "open it", "put the cream cheese in the bowl and close the drawer"]


def _model(**overrides):
    model = build_model("smolvla-tiny", **overrides)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():  # trained-looking weights: attention far from uniform
        for name, p in model.named_parameters():
            p.copy_(torch.randn(p.shape, generator=g) * (0.1 if "norm" in name else p.shape[-1] ** -0.5)
                    + (1.0 if "norm" in name else 0.0))
    return model.eval()


def _batch(cfg, seed=0, horizons=None):
    """Three samples: prompts of three lengths, the second camera blank for one, a padded step or two
    (`action_is_pad`), the last 3 action dims not real."""
    g = torch.Generator().manual_seed(seed)
    b, s = len(PROMPTS), cfg.vision.image_size
    tokens, mask = tokenize_batch(ByteTokenizer(), PROMPTS, cfg.max_language_tokens)
    image_masks = torch.ones(b, len(cfg.cameras), dtype=torch.bool)
    image_masks[1, -1] = False
    pad = torch.zeros(b, cfg.chunk_size, dtype=torch.bool)
    pad[0, -2:] = pad[2, -1:] = True
    return PaddedBatch(
        images=torch.rand(b, len(cfg.cameras), 3, s, s, generator=g), image_masks=image_masks,
        camera_names=cfg.cameras, tokens=tokens, token_mask=mask, state=torch.randn(b, cfg.max_state_dim, generator=g),
        actions=torch.randn(b, cfg.chunk_size, cfg.max_action_dim, generator=g), action_is_pad=pad,
        action_dim_mask=torch.arange(cfg.max_action_dim) < cfg.max_action_dim - 3,
        horizon_mask=None if horizons is None else torch.arange(cfg.chunk_size)[None] < torch.tensor(horizons)[:, None])


def _noise_time(batch, seed=5):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch.actions.shape, generator=g), torch.rand(batch.batch_size, generator=g) * 0.9 + 0.05


def _run(model, batch, noise=None, time=None, **switches):
    old = model.config
    model.config = dataclasses.replace(old, **switches)
    if noise is None:
        noise, time = _noise_time(batch)
    try:
        with torch.no_grad():
            return model(batch, noise=noise, time=time)
    finally:
        model.config = old


def test_the_base_preset_has_the_published_shapes():
    model = build_model("smolvla-base", device="meta")
    cfg = model.config
    assert (cfg.camera_tokens, cfg.expert.width, cfg.expert.mlp_dim, cfg.num_vlm_layers) == (64, 720, 2048, 16)
    assert len(model.text.layers) == len(model.expert.layers) == 16
    assert model.vlm.connector.modality_projection.proj.weight.shape == (960, 768 * 16)
    # self-attention layers project the expert's own stream, cross-attention layers the VLM's 5 x 64 keys
    assert model.expert.layers[0].self_attn.k_proj.weight.shape == (320, 720)
    assert model.expert.layers[1].self_attn.k_proj.weight.shape == (320, 320)
    assert model.state_proj.weight.shape == (960, 32)
    # 450 M published, of which the VLM's unused lm_head (49280 x 960) is left out
    assert round(sum(p.numel() for p in model.parameters()) / 1e6) == 403


def test_forward_and_sampling_shapes():
    model = _model()
    cfg, batch = model.config, _batch(model.config)
    out = _run(model, batch)
    assert out["per_sample"].shape == (3,) and out["v_t"].shape == (3, cfg.chunk_size, cfg.max_action_dim)
    assert model.sample_actions(batch).shape == (3, cfg.chunk_size, cfg.max_action_dim)


def _shifted_target(batch, noise, time, where):
    """Noise and actions changed at `where` (B, H, A) so that x_t stays as it was and only the target
    u_t = noise - actions moves: the model's velocity is the same, only the loss can change."""
    delta = where.float() * 3.0
    t = time[:, None, None]
    return noise + delta, batch.actions - delta * t / (1 - t)


def test_kilovla_reduction_divides_out_padded_steps_and_dims_lerobots_does_not():
    model = _model()
    batch = _batch(model.config)
    noise, time = _noise_time(batch)
    padded = batch.action_is_pad[..., None] | ~batch.action_dim_mask[None, None]
    noise2, actions2 = _shifted_target(batch, noise, time, padded)
    moved = dataclasses.replace(batch, actions=actions2)
    for reduction, same in (("kilovla", True), ("lerobot_v044", False)):
        a = _run(model, batch, noise, time, loss_reduction=reduction)
        b = _run(model, moved, noise2, time, loss_reduction=reduction)
        torch.testing.assert_close(a["v_t"], b["v_t"], **TOL)
        assert torch.allclose(a["per_sample"], b["per_sample"], **TOL) is same, reduction
    a = _run(model, batch, noise, time)
    err = (noise - batch.actions - a["v_t"]) ** 2
    torch.testing.assert_close(a["per_sample"], (err * ~padded).sum((1, 2)) / (~padded).sum((1, 2)), **TOL)
    b = _run(model, batch, noise, time, loss_reduction="lerobot_v044")
    torch.testing.assert_close(b["per_sample"], err.mean((1, 2)), **TOL)


def test_the_action_tokens_are_causal():
    """Changing action step j moves the velocity of steps j.. only (pi0's suffix is bidirectional)."""
    model = _model()
    batch = _batch(model.config)
    x, t = _noise_time(batch)
    j = 4
    x2 = x.clone()
    x2[:, j] += 1.0
    with torch.no_grad():
        v, v2 = model.forward_padded(batch, x, t), model.forward_padded(batch, x2, t)
    torch.testing.assert_close(v[:, :j], v2[:, :j], **TOL)
    assert (v[:, j:] - v2[:, j:]).abs().amax(dim=(0, 2)).min() > 1e-4


def _prefix_cache(model, batch):
    """Each layer's prefix keys and values, and which prefix tokens are real."""
    with torch.no_grad():
        x_pre, attend, pos, real = model._padded_layout(batch, model.config.chunk_size)
        return model._run_layers(x_pre, None, pos, attend)[1], real


def test_no_prefix_token_sees_the_state_token():
    """The state is the prefix's last token: every other real prefix token's keys and values stay when the
    state changes (after layer 0, where they could only see it), the state's own do not, nor the velocity."""
    model = _model()
    batch = _batch(model.config)
    other = dataclasses.replace(batch, state=batch.state + 1.0)
    (cache, real), (cache2, _) = _prefix_cache(model, batch), _prefix_cache(model, other)
    real[:, -1] = False
    for (k, v), (k2, v2) in zip(cache[1:], cache2[1:]):
        torch.testing.assert_close(k[real], k2[real], **TOL)
        torch.testing.assert_close(v[real], v2[real], **TOL)
        assert (k[:, -1] - k2[:, -1]).abs().max() > 1e-4
    x, t = _noise_time(batch)
    with torch.no_grad():
        assert (model.forward_padded(batch, x, t) - model.forward_padded(other, x, t)).abs().max() > 1e-4


def test_padded_language_and_a_blank_camera_change_nothing_real():
    """Padding tokens and a blank camera's pixels are masked and do not move positions."""
    model = _model()
    batch = _batch(model.config)
    tokens = torch.where(batch.token_mask, batch.tokens, 7)
    images = batch.images.clone()
    images[1, -1] = torch.rand(images[1, -1].shape)
    other = dataclasses.replace(batch, tokens=tokens, images=images)
    torch.testing.assert_close(_run(model, batch)["v_t"], _run(model, other)["v_t"], **TOL)
    torch.testing.assert_close(_run(model, batch)["v_t"], _run(model, batch, language_padding="longest")["v_t"], **TOL)
    torch.testing.assert_close(_run(model, batch)["v_t"],
                               _run(model, batch, max_language_tokens=80)["v_t"], **TOL)


def test_pruning_a_camera_equals_masking_it():
    model = _model()
    batch = _batch(model.config)
    blank = dataclasses.replace(batch, image_masks=batch.image_masks & torch.tensor([True, False]))
    pruned = _run(model, blank, disabled_cameras=(model.config.cameras[-1],))
    torch.testing.assert_close(_run(model, blank)["v_t"], pruned["v_t"], **TOL)
    torch.testing.assert_close(_run(model, blank, packing=True)["v_t"], pruned["v_t"], **TOL)


def test_sampling_is_deterministic_and_the_kv_cache_changes_nothing():
    model = _model()
    batch = _batch(model.config)
    noise, _ = _noise_time(batch)
    a = model.sample_actions(batch, noise=noise.clone())
    torch.testing.assert_close(a, model.sample_actions(batch, noise=noise.clone()), atol=0, rtol=0)
    torch.testing.assert_close(a, model.sample_actions(batch, noise=noise.clone(), use_cache=False), **TOL)
    assert (a - noise).abs().max() > 1e-2


def test_rtc_without_guidance_is_plain_sampling():
    from kilovla.models.rtc import sample_actions_rtc

    model = _model()
    batch = _batch(model.config)
    noise, _ = _noise_time(batch)
    rtc = sample_actions_rtc(model, batch, noise.clone(), torch.zeros_like(noise), torch.zeros_like(noise))
    torch.testing.assert_close(rtc, model.sample_actions(batch, noise=noise.clone()), **TOL)


@pytest.mark.parametrize("moe", [{}, {"num_experts": 4, "top_k": 2, "shared_experts": 1, "capacity_factor": 1.0}],
                         ids=["dense", "moe"])
@pytest.mark.parametrize("every", [2, 3, -1])
@pytest.mark.parametrize("backend", ["sdpa_segments", "sdpa_batched", "sdpa_masked"])
def test_packing_equals_padding(backend, every, moe):
    """Three samples in one row: equal to the padded path on real tokens, with a schedule of self and
    cross layers (every 2, every 3, all cross) and per-sample horizons; with MoE (the expert's MLPs routed,
    with a capacity) the same routing too, the steps past a horizon never routed."""
    model = _model(self_attn_every_n_layers=every, moe=moe)
    batch = _batch(model.config, horizons=[8, 5, 7])
    padded = _run(model, batch)
    packed = _run(model, batch, packing=True, attention_backend=backend)
    h = batch.horizon_mask
    torch.testing.assert_close(padded["v_t"][h], packed["v_t"][h], **TOL)
    torch.testing.assert_close(padded["per_sample"], packed["per_sample"], **TOL)
    assert padded.keys() == packed.keys()
    for key in ("moe_aux_loss", "moe_z_loss", "moe_load", "moe_dropped", "moe_assignments"):
        if key in padded:
            torch.testing.assert_close(padded[key], packed[key], **TOL)
    if moe:  # the real steps (8 + 5 + 7) x top 2 x 4 expert layers
        assert int(padded["moe_assignments"]) == 20 * 2 * 4


def test_packed_training_matches_padded_gradients():
    model = _model()
    batch = _batch(model.config)
    noise, time = _noise_time(batch)
    grads = []
    for packing in (False, True):
        model.config = dataclasses.replace(model.config, packing=packing)
        model.zero_grad()
        model(batch, noise=noise, time=time)["loss"].backward()
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None]))
    torch.testing.assert_close(grads[0], grads[1], atol=1e-5, rtol=1e-4)


def test_training_reduces_the_loss():
    model = _model()
    model.train()
    assert_training_reduces_loss(model, _batch(model.config))


def test_lerobot_key_layout_loads_strictly(tmp_path):
    """A file with LeRobot's keys ("model." prefix, the VLM's lm_head beside the embedding; with or without
    pre-0.4 normalisation buffers) loads into every parameter; a missing key is refused with its name."""
    source, target = _model(), build_model("smolvla-tiny", seed=7)
    cfg = source.config
    state = {f"model.{k}": v.clone() for k, v in source.state_dict().items()}
    state["model.vlm_with_expert.vlm.lm_head.weight"] = torch.randn(cfg.text.vocab_size, cfg.text.width)
    assert "model.vlm_with_expert.lm_expert.layers.1.self_attn.k_proj.weight" in state
    save_file(state, tmp_path / "model.safetensors")
    assert load_checkpoint(target, tmp_path / "model.safetensors") == "lerobot"
    for (name, a), b in zip(source.state_dict().items(), target.state_dict().values()):
        assert torch.equal(a, b), name
    state["normalize_inputs.buffer_observation_state.mean"] = torch.zeros(cfg.max_state_dim)  # pre-0.4 LeRobot
    save_file(state, tmp_path / "with_stats.safetensors")
    target = build_model("smolvla-tiny", seed=7)
    load_checkpoint(target, tmp_path / "with_stats.safetensors", layout="lerobot")
    assert all(torch.equal(a, b) for a, b in zip(source.state_dict().values(), target.state_dict().values()))
    del state["normalize_inputs.buffer_observation_state.mean"], state["model.state_proj.weight"]
    save_file(state, tmp_path / "broken.safetensors")
    with pytest.raises(CheckpointError, match="missing keys: state_proj.weight"):
        load_checkpoint(target, tmp_path / "broken.safetensors")


def test_the_family_answers_for_smolvla():
    model = _model()
    fam = family_of(model)
    assert fam.name == "smolvla" and fam.chunk_length(model.config) == 8
    units = fam.fsdp_units(model)
    assert len(units) == model.config.vision.depth + model.config.num_vlm_layers
    covered = {id(p) for unit in units for m in unit for p in m.parameters()}
    assert all(id(p) in covered for p in [*model.text.layers.parameters(), *model.expert.layers.parameters()])
    groups = fam.freeze_groups(model)
    assert model.vlm.vision_model in groups["vision"] and model.vlm_with_expert.vlm in groups["vlm"]
    with pytest.raises(KilovlaError, match="SmolVLA has no tensor-parallel plan"):
        fam.tp_parts(model.config)
    with pytest.raises(KilovlaError, match="SmolVLA has no pipeline-parallel plan"):
        fam.pp_depth(model.config)
    import re
    names = [n for n, _ in model.named_modules()]
    lora = [n for n in names if re.fullmatch(fam.lora_targets(False, False), n)]
    assert "vlm_with_expert.lm_expert.layers.0.self_attn.q_proj" in lora and "state_proj" in lora
    assert not any(n.startswith("vlm_with_expert.vlm.") for n in lora)
    fp8 = [n for n in names if re.search(fam.fp8_layers, n)]
    assert "vlm_with_expert.vlm.model.text_model.layers.3.mlp.down_proj" in fp8 and not any("vision" in n for n in fp8)


def test_the_token_plan_counts_the_rows_the_model_builds():
    """A padded row is the plan's fixed count: 4 tokens per camera after the pixel shuffle, not the
    vision tower's 16; pi0's and GR00T's cameras still count their tower's tokens."""
    from kilovla.models.processor import PolicyMeta
    from kilovla.train.build import token_layout
    model = _model()
    cfg, batch = model.config, _batch(model.config)
    layout = token_layout(cfg, PolicyMeta(preset="smolvla-tiny", camera_map={f"observation.images.{c}": c
                                                                             for c in cfg.cameras}))
    with torch.no_grad():
        prefix = model._padded_layout(batch, cfg.chunk_size)[0].shape[1]
    assert layout.tokens_per_camera == 4 and layout.fixed_tokens(len(cfg.cameras)) == prefix + cfg.chunk_size
    for name in ("pi0-tiny", "groot-tiny"):
        other = preset(name)
        assert token_layout(other, PolicyMeta(preset=name)).tokens_per_camera == other.vision.tokens


def test_bad_shapes_are_refused_in_one_line():
    with pytest.raises(KilovlaError, match="num_vlm_layers must lie in"):
        preset("smolvla-tiny", num_vlm_layers=9)
    with pytest.raises(KilovlaError, match="multiple of patch_size"):
        preset("smolvla-tiny", vision={"image_size": 40})
    with pytest.raises(KilovlaError, match="loss_reduction must be one of"):
        preset("smolvla-tiny", loss_reduction="sum")


def test_gradient_checkpointing_gives_the_same_gradients():
    model = _model()
    model.train()
    batch = _batch(model.config)
    noise, time = _noise_time(batch)
    grads = []
    for recompute in (False, True):
        model.gradient_checkpointing = recompute
        model.zero_grad()
        model(batch, noise=noise, time=time)["loss"].backward()
        grads.append([p.grad.clone() for p in model.parameters() if p.grad is not None])
    assert len(grads[0]) == len(grads[1]) > 0
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, **TOL)


def test_the_unused_last_layer_parts_take_no_gradient_and_the_rest_do():
    """The prefix stream after the last layer is read only through its keys and values."""
    model = _model()
    model.train()
    batch = _batch(model.config)
    model(batch, noise=_noise_time(batch)[0], time=_noise_time(batch)[1])["loss"].backward()
    frozen = [n for n, p in model.named_parameters() if not p.requires_grad]
    assert frozen and all(n.startswith(("vlm_with_expert.vlm.model.text_model.layers.3.",
                                        "vlm_with_expert.vlm.model.text_model.norm.")) for n in frozen)
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)
