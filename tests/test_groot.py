"""GR00T N1.5: packing, dynamic padding and camera pruning against the padded path; checkpoint names."""

import dataclasses

import pytest
import torch
from conftest import assert_training_reduces_loss

from kilovla.errors import KilovlaError
from kilovla.models.batch import PaddedBatch
from kilovla.models.checkpoints import CheckpointError, load_checkpoint, save_safetensors
from kilovla.models.presets import build_model
from kilovla.models.tokenize import ByteTokenizer, tokenize_batch

TOL = dict(atol=1e-5, rtol=1e-5)


def _model(**overrides):
    model = build_model("groot-tiny", **overrides)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    return model.eval()


def _batch(cfg, seed=0):
    g = torch.Generator().manual_seed(seed)
    tokens, mask = tokenize_batch(ByteTokenizer(), ["pick the cube", "open the drawer please", "stack"],
                                  cfg.max_language_tokens)
    pad = cfg.max_language_tokens - tokens.shape[1]
    tokens, mask = torch.nn.functional.pad(tokens, (0, pad)), torch.nn.functional.pad(mask, (0, pad))
    s = cfg.vision.image_size
    return PaddedBatch(
        images=torch.rand(3, 2, 3, s, s, generator=g), image_masks=torch.tensor([[1, 0], [1, 0], [1, 0]], dtype=torch.bool),
        camera_names=cfg.cameras, tokens=tokens, token_mask=mask, state=torch.randn(3, cfg.max_state_dim, generator=g),
        actions=torch.randn(3, cfg.action_horizon, cfg.max_action_dim, generator=g),
        action_is_pad=torch.rand(3, cfg.action_horizon, generator=g) < 0.2, embodiment_id=torch.tensor([0, 1, 1]))


def _run(model, batch, **switches):
    old = model.config
    model.config = dataclasses.replace(old, **switches)
    g = torch.Generator().manual_seed(5)
    try:
        with torch.no_grad():
            return model(batch, noise=torch.randn(batch.actions.shape, generator=g), time=torch.rand(3, generator=g))
    finally:
        model.config = old


def _same(a, b):
    torch.testing.assert_close(a["v_t"], b["v_t"], **TOL)
    torch.testing.assert_close(a["loss"], b["loss"], **TOL)
    assert a.keys() == b.keys()
    for key in ("moe_aux_loss", "moe_z_loss", "moe_load", "moe_dropped", "moe_assignments"):  # with MoE
        if key in a:
            torch.testing.assert_close(a[key], b[key], **TOL)


@pytest.mark.parametrize("switches", [
    {"packing": True},
    {"language_padding": "longest"},
    {"disabled_cameras": ("wrist",)},
    {"packing": True, "attention_backend": "flex"},
    {"packing": True, "language_padding": "longest", "disabled_cameras": ("wrist",)},
], ids=["packing", "dynamic-padding", "pruning", "flex", "all"])
@pytest.mark.parametrize("moe", [{}, {"num_experts": 4, "top_k": 2, "shared_experts": 1, "capacity_factor": 1.0}],
                         ids=["dense", "moe"])  # MoE: the DiT's feed-forwards routed, with a capacity
def test_switches_equal_the_padded_path(switches, moe):
    model = _model(moe=moe)
    batch = _batch(model.config)
    _same(_run(model, batch), _run(model, batch, **switches))


def test_embodiments_use_their_own_encoders():
    model = _model()
    batch = _batch(model.config)
    other = dataclasses.replace(batch, embodiment_id=torch.tensor([1, 0, 0]))
    assert not torch.allclose(_run(model, batch)["v_t"], _run(model, other)["v_t"])


def test_flow_time_follows_groot_convention():
    t = build_model("groot-tiny").sample_time(20000, "cpu")
    assert t.max() <= 0.999 and t.min() >= -0.001 / 0.999
    assert abs(t.mean().item() - (0.999 - 0.6) / 0.999) < 0.01


def test_packed_sampling_equals_padded_sampling():
    model = _model()
    batch = _batch(model.config)
    noise = torch.randn(3, 8, 8, generator=torch.Generator().manual_seed(2))
    padded = model.sample_actions(batch, noise=noise)
    model.config = dataclasses.replace(model.config, packing=True)
    packed = model.sample_actions(batch, noise=noise)
    torch.testing.assert_close(packed, padded, **TOL)
    assert not torch.allclose(model.sample_actions(batch, noise=noise + 0.5), packed, atol=1e-3)  # noise matters


def test_dropout_acts_in_training_only():
    model = _model()
    batch = _batch(model.config)
    reference = _run(model, batch)
    model.config = dataclasses.replace(model.config, dropout=0.2)
    dropped = build_model("groot-tiny", dropout=0.2)
    dropped.load_state_dict(model.state_dict())
    _same(reference, _run(dropped.eval(), batch))  # eval: dropout is the identity
    dropped.train()
    first, second = _run(dropped, batch)["v_t"], _run(dropped, batch)["v_t"]
    assert not torch.allclose(first, second)  # a fresh mask per call
    assert not torch.allclose(first, reference["v_t"])


def test_training_reduces_the_loss():
    torch.manual_seed(0)
    model = build_model("groot-tiny")
    batch = _batch(model.config)
    assert_training_reduces_loss(model, batch)


def test_a_chunk_of_the_wrong_length_is_refused():
    model = _model()
    batch = _batch(model.config)
    with pytest.raises(KilovlaError, match="8-step chunks; the batch has 5"):
        _run(model, dataclasses.replace(batch, actions=batch.actions[:, :5], action_is_pad=None))


def test_nvidia_checkpoint_names_load_strictly(tmp_path):
    src = _model()
    state = dict(src.state_dict())
    state["backbone.eagle_model.language_model.lm_head.weight"] = torch.zeros(258, 32)  # unused, dropped
    save_safetensors(state, tmp_path / "model.safetensors")
    dst = build_model("groot-tiny", seed=7)
    assert load_checkpoint(dst, tmp_path) == "groot"
    for k, v in src.state_dict().items():
        torch.testing.assert_close(dst.state_dict()[k], v)
    state.pop("action_head.future_tokens.weight")
    save_safetensors(state, tmp_path / "model.safetensors")
    with pytest.raises(CheckpointError, match="missing keys: action_head.future_tokens.weight"):
        load_checkpoint(build_model("groot-tiny"), tmp_path)


def test_n15_preset_has_the_published_shapes():
    sd = build_model("groot-n15-3b", device="meta").state_dict()
    assert sd["backbone.eagle_model.vision_model.vision_model.embeddings.patch_embedding.weight"].shape == (1152, 3, 14, 14)
    assert sd["backbone.eagle_model.mlp1.0.weight"].shape == (2048, 1152)
    assert "backbone.eagle_model.language_model.model.layers.11.self_attn.q_norm.weight" in sd
    assert "backbone.eagle_model.language_model.model.layers.12.self_attn.q_proj.weight" not in sd  # 12 of 28 layers
    assert sd["backbone.eagle_model.language_model.model.layers.0.self_attn.k_proj.weight"].shape == (1024, 2048)
    assert sd["action_head.model.transformer_blocks.0.attn1.to_k.weight"].shape == (1536, 2048)  # cross-attention
    assert sd["action_head.model.transformer_blocks.1.attn1.to_k.weight"].shape == (1536, 1536)  # self-attention
    assert sd["action_head.state_encoder.layer1.W"].shape == (32, 64, 1024)
    assert sd["action_head.action_encoder.W2.W"].shape == (32, 3072, 1536)
    assert sd["action_head.future_tokens.weight"].shape == (32, 1536)
