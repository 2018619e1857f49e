"""pi0 / pi0.5: every optimisation switch against the plain padded path, on the same samples."""

import dataclasses

import pytest
import torch
from conftest import assert_training_reduces_loss

from kilovla.errors import KilovlaError
from kilovla.models.attention import VarlenSpec, additive, attend_dense, attend_varlen, prefix_lm_mask
from kilovla.models.batch import PaddedBatch
from kilovla.models.presets import build_model
from kilovla.models.tokenize import ByteTokenizer, build_prompt, tokenize_batch

TOL = dict(atol=1e-5, rtol=1e-5)
PROMPTS = ["pick up the black bowl", "open the drawer", "put the cream cheese in the bowl and close it"]


def _randomize(model):
    """Trained-looking weights: no zero-initialised parameter may hide a difference."""
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    return model


def _model(name="pi05-tiny", **cfg):
    return _randomize(build_model(name, **cfg)).eval()


def _batch(cfg, blank_last_camera=True, horizons=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    b = len(PROMPTS)
    tokens, mask = tokenize_batch(ByteTokenizer(), PROMPTS, cfg.max_language_tokens)
    tokens = torch.nn.functional.pad(tokens, (0, cfg.max_language_tokens - tokens.shape[1]))  # openpi: fixed length
    mask = torch.nn.functional.pad(mask, (0, cfg.max_language_tokens - mask.shape[1]))
    image_masks = torch.ones(b, len(cfg.cameras), dtype=torch.bool)
    if blank_last_camera:
        image_masks[:, -1] = False
    s = cfg.vision.image_size
    horizon_mask = None
    if horizons is not None:
        horizon_mask = torch.arange(cfg.chunk_size)[None] < torch.tensor(horizons)[:, None]
    return PaddedBatch(
        images=torch.rand(b, len(cfg.cameras), 3, s, s, generator=g), image_masks=image_masks, camera_names=cfg.cameras,
        tokens=tokens, token_mask=mask, state=torch.randn(b, cfg.max_state_dim, generator=g),
        actions=torch.randn(b, cfg.chunk_size, cfg.max_action_dim, generator=g),
        action_is_pad=torch.rand(b, cfg.chunk_size, generator=g) < 0.2, horizon_mask=horizon_mask)


def _run(model, batch, **switches):
    old = model.config
    model.config = dataclasses.replace(old, **switches)
    g = torch.Generator().manual_seed(5)
    noise = torch.randn(batch.actions.shape, generator=g)
    t = torch.rand(batch.batch_size, generator=g)
    try:
        with torch.no_grad():
            return model(batch, noise=noise, time=t)
    finally:
        model.config = old


def _same(a, b, horizon_mask=None):
    va, vb = a["v_t"], b["v_t"]
    if horizon_mask is not None:
        va, vb = va[horizon_mask], vb[horizon_mask]
    torch.testing.assert_close(va, vb, **TOL)
    torch.testing.assert_close(a["loss"], b["loss"], **TOL)


@pytest.mark.parametrize("name", ["pi05-tiny", "pi0-tiny"])
def test_packing_equals_padding(name):
    model = _model(name)
    batch = _batch(model.config)
    _same(_run(model, batch), _run(model, batch, packing=True))


@pytest.mark.parametrize("name", ["pi05-tiny", "pi0-tiny"])
def test_packing_equals_padding_with_per_sample_horizons(name):
    model = _model(name)
    batch = _batch(model.config, horizons=[8, 3, 5])
    _same(_run(model, batch), _run(model, batch, packing=True), batch.horizon_mask)


def test_dynamic_language_padding_equals_fixed_200_style_padding():
    model = _model()
    batch = _batch(model.config)
    assert batch.tokens.shape[1] == model.config.max_language_tokens
    _same(_run(model, batch), _run(model, batch, language_padding="longest"))


def test_pruning_a_blank_camera_equals_masking_it():
    model = _model()
    batch = _batch(model.config, blank_last_camera=True)
    pruned = _run(model, batch, disabled_cameras=(model.config.cameras[-1],))
    _same(_run(model, batch), pruned)


def test_all_switches_together_equal_the_plain_path():
    model = _model()
    batch = _batch(model.config)
    together = _run(model, batch, packing=True, language_padding="longest", disabled_cameras=(model.config.cameras[-1],))
    _same(_run(model, batch), together)


@pytest.mark.parametrize("backend", ["flex", "sdpa_masked", "sdpa_batched", "auto"])
@pytest.mark.parametrize("family", ["pi05-tiny", "pi0-tiny"])
def test_varlen_backends_equal_the_segment_reference(family, backend):
    model = _model(family)
    batch = _batch(model.config, horizons=[8, 3, 5])
    reference = _run(model, batch, packing=True, attention_backend="sdpa_segments")
    _same(reference, _run(model, batch, packing=True, attention_backend=backend))


def test_packed_positions_restart_for_every_sample():
    """RoPE positions in the packed path: each sample's prefix counts 0.. its length, its suffix goes on
    from there, exactly the positions the padded path gives its real tokens."""
    model = _model(packing=True)
    batch = _batch(model.config, horizons=[8, 3, 5])
    seen = []
    hook = lambda mod, args, kwargs: seen.append(args[1])  # noqa: E731  DecoderLayer.forward(x, positions, ...)
    handles = [model.vlm.language_model.layers[0].register_forward_pre_hook(hook, with_kwargs=True),
               model.expert.layers[0].register_forward_pre_hook(hook, with_kwargs=True)]
    _run(model, batch)
    for h in handles:
        h.remove()
    prefix, suffix = seen
    prefix_len = 16 * 2 + batch.token_mask.sum(1)  # two present cameras of 16 tokens, then the real prompt
    expected_prefix = torch.cat([torch.arange(n) for n in prefix_len.tolist()])
    expected_suffix = torch.cat([n + torch.arange(h) for n, h in zip(prefix_len.tolist(), [8, 3, 5])])
    assert torch.equal(prefix, expected_prefix)
    assert torch.equal(suffix, expected_suffix)


def test_a_cuda_backend_on_cpu_falls_back_loudly(caplog):
    model = _model()
    batch = _batch(model.config)
    with caplog.at_level("WARNING"):
        out = _run(model, batch, packing=True, attention_backend="flash_attn")
    assert "falling back to sdpa_segments" in caplog.text
    _same(out, _run(model, batch, packing=True))


def test_an_unmasked_camera_changes_the_output():
    model = _model()
    masked = _run(model, _batch(model.config, blank_last_camera=True))
    seen = _run(model, _batch(model.config, blank_last_camera=False))
    assert not torch.allclose(masked["v_t"], seen["v_t"], atol=1e-3)


@pytest.mark.parametrize("name", ["pi05-tiny", "pi0-tiny"])
def test_kv_cached_sampling_equals_recomputing_the_prefix(name):
    model = _model(name)
    batch = _batch(model.config)
    noise = torch.randn(batch.batch_size, model.config.chunk_size, model.config.max_action_dim)
    torch.testing.assert_close(model.sample_actions(batch, noise=noise),
                               model.sample_actions(batch, noise=noise, use_cache=False), **TOL)


def test_varlen_backends_agree_with_dense_masked_attention():
    g = torch.Generator().manual_seed(0)
    lq, lk = torch.tensor([3, 5, 1]), torch.tensor([4, 6, 2])
    q = torch.randn(int(lq.sum()), 4, 8, generator=g)
    k, v = (torch.randn(int(lk.sum()), 2, 8, generator=g) for _ in range(2))
    spec = VarlenSpec.from_lengths(lq, lk)
    ref = attend_varlen(q, k, v, spec, 8**-0.5, "sdpa_segments")
    torch.testing.assert_close(attend_varlen(q, k, v, spec, 8**-0.5, "flex"), ref, **TOL)
    seg_q = torch.repeat_interleave(torch.arange(3), lq)
    seg_k = torch.repeat_interleave(torch.arange(3), lk)
    mask = additive((seg_q[:, None] == seg_k[None])[None])
    dense = attend_dense(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], mask, 8**-0.5)
    torch.testing.assert_close(dense[0].transpose(0, 1), ref, **TOL)


def test_prefix_lm_mask_follows_openpi_for_pi0s_state_block():
    # prefix (2 tokens, 1 padding), state, 2 actions
    valid = torch.tensor([[True, False, True, True, True]])
    ar = torch.tensor([0, 0, 1, 1, 0])
    m = prefix_lm_mask(valid, ar)[0].int()
    assert m.tolist() == [[1, 0, 0, 0, 0],   # prefix sees the prefix only
                          [0, 0, 0, 0, 0],   # padding sees nothing
                          [1, 0, 1, 0, 0],   # state sees prefix + itself
                          [1, 0, 1, 1, 1],   # actions see everything real
                          [1, 0, 1, 1, 1]]


def test_flow_matching_time_follows_openpi():
    t = build_model("pi05-tiny").sample_time(20000, "cpu")
    assert 0.001 <= t.min() and t.max() <= 1.0
    assert abs(t.mean().item() - (0.6 * 0.999 + 0.001)) < 0.01  # Beta(1.5, 1) has mean 0.6


def test_training_reduces_the_loss_on_one_batch():
    torch.manual_seed(0)
    model = build_model("pi05-tiny")
    batch = _batch(model.config)
    assert_training_reduces_loss(model, batch)


def test_packed_gradients_equal_padded_gradients():
    model = _model()
    batch = _batch(model.config)
    grads = []
    for packing in (False, True):
        model.zero_grad()
        model.config = dataclasses.replace(model.config, packing=packing)
        g = torch.Generator().manual_seed(5)
        model(batch, noise=torch.randn(batch.actions.shape, generator=g), time=torch.rand(3, generator=g))["loss"].backward()
        # The last layer's prefix queries feed nothing: no grad in the packed path, zeros in the padded one.
        grads.append(torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).flatten()
                                for p in model.parameters()]))
    torch.testing.assert_close(grads[0], grads[1], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("packing", [False, True], ids=["padded", "packed"])
def test_gradient_checkpointing_gives_the_same_gradients(packing):
    """Recomputing each layer's activations in backward changes memory, not the gradient."""
    model = _model(packing=packing)
    batch = _batch(model.config, horizons=[8, 3, 5])
    grads = []
    for recompute in (False, True):
        model.zero_grad(set_to_none=True)
        model.gradient_checkpointing = recompute
        g = torch.Generator().manual_seed(5)
        model(batch, noise=torch.randn(batch.actions.shape, generator=g), time=torch.rand(3, generator=g))["loss"].backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys() and len(grads[0]) > 20
    for name in grads[0]:
        torch.testing.assert_close(grads[1][name], grads[0][name], atol=1e-6, rtol=1e-5, msg=name)


def test_pi05_prompt_writes_the_discretised_state():
    prompt = build_prompt("pick up the bowl", state=torch.tensor([-1.0, 0.0, 1.0]).numpy())
    assert prompt == "Task: pick up the bowl, State: 0 128 255;\nAction: "


def test_batches_that_do_not_fit_the_config_are_refused():
    model = _model()
    batch = _batch(model.config)
    with pytest.raises(KilovlaError, match="more than max_language_tokens"):
        _run(model, dataclasses.replace(batch, tokens=torch.zeros(3, 60, dtype=torch.long),
                                        token_mask=torch.ones(3, 60, dtype=torch.bool)))
    with pytest.raises(KilovlaError, match="the model needs"):
        _run(model, batch.select_cameras(model.config.cameras[:2]))
    with pytest.raises(KilovlaError, match="the model takes 32x32"):
        _run(model, dataclasses.replace(batch, images=torch.rand(3, 3, 3, 16, 16)))


def test_3b_presets_have_the_published_shapes():
    model = build_model("pi05-3b", device="meta")
    keys = dict(model.state_dict())
    assert keys["paligemma_with_expert.paligemma.model.vision_tower.vision_model.embeddings.patch_embedding.weight"].shape == (1152, 3, 14, 14)
    assert keys["paligemma_with_expert.paligemma.model.language_model.embed_tokens.weight"].shape == (257152, 2048)
    assert keys["paligemma_with_expert.paligemma.model.language_model.layers.17.self_attn.k_proj.weight"].shape == (256, 2048)
    assert keys["paligemma_with_expert.gemma_expert.model.layers.0.input_layernorm.dense.weight"].shape == (3072, 1024)
    assert keys["action_in_proj.weight"].shape == (1024, 32)
    n = sum(p.numel() for p in model.parameters())
    assert 3.30e9 < n < 3.40e9  # PaliGemma-3B + Gemma-300M expert + adaRMS
    pi0 = build_model("pi0-3b", device="meta").state_dict()
    assert "state_proj.weight" in pi0 and "paligemma_with_expert.gemma_expert.model.layers.0.input_layernorm.weight" in pi0


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["flash_attn", "torch_varlen"])
def test_cuda_varlen_backends_match_the_reference(backend):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from kilovla.models.attention import resolve_backend

    if resolve_backend(backend, "cuda") != backend:
        pytest.skip(f"{backend} unavailable on this CUDA machine")
    g = torch.Generator(device="cuda").manual_seed(0)
    lq, lk = torch.tensor([30, 50, 10], device="cuda"), torch.tensor([40, 60, 20], device="cuda")
    q = torch.randn(int(lq.sum()), 8, 64, device="cuda", generator=g, dtype=torch.bfloat16)
    k, v = (torch.randn(int(lk.sum()), 1, 64, device="cuda", generator=g, dtype=torch.bfloat16) for _ in range(2))
    spec = VarlenSpec.from_lengths(lq, lk)
    ref = attend_varlen(q.float(), k.float(), v.float(), spec, 0.125, "sdpa_segments")
    torch.testing.assert_close(attend_varlen(q, k, v, spec, 0.125, backend).float(), ref, atol=2e-2, rtol=2e-2)
