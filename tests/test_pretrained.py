"""Fine-tuning from published checkpoints: real tokenizers, every published file layout, the families' defaults.

Nothing can be downloaded here, so the tests write each layout themselves at tiny width, train a tiny
SentencePiece model and build a tiny Qwen-style tokenizer.json.
"""

import dataclasses
import io
import json
import logging
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import assert_training_reduces_loss

from kilovla.cli import main
from kilovla.config import load_config
from kilovla.data.synthetic import make_synthetic_dataset
from kilovla.errors import KilovlaError
from kilovla.models import tokenize
from kilovla.models.checkpoints import Checkpoint, CheckpointError, load_weights, save_safetensors, save_sharded
from kilovla.models.images import GROOT_AUGMENTATION, OPENPI_AUGMENTATION, ImageAugmentation, resize_with_pad
from kilovla.models.policy import VLAPolicy
from kilovla.policy_folder import load_policy_folder, save_policy
from kilovla.models.presets import build_model, policy_defaults, preset
from kilovla.models.processor import PolicyMeta, Processor
from kilovla.models.tokenize import (EAGLE_END, EAGLE_SYSTEM, QwenTokenizer, SentencePieceTokenizer, discretize_state,
                                     find_tokenizer)
from kilovla.train.build import apply_freeze, with_policy_defaults
from kilovla.train.trainer import TrainConfig

PI_EMBED = "paligemma_with_expert.paligemma.model.language_model.embed_tokens.weight"
GROOT_EMBED = "backbone.eagle_model.language_model.model.embed_tokens.weight"
TASKS = ["pick up the black bowl", "open the top drawer", "put the bowl on the plate", "turn on the stove"]


# -- tokenizers written here --------------------------------------------------------------------------
@pytest.fixture(scope="module")
def sp_model(tmp_path_factory) -> Path:
    """A tiny SentencePiece model with Gemma's special ids (pad 0, eos 1, bos 2), digits split, bytes as fallback."""
    import sentencepiece as spm

    lines = [*TASKS, "Task: open the drawer, State: 12 200 31;\nAction: ", "close the cabinet",
             "Task: push the plate to the stove, State: 0 128 255;\nAction: "] * 20
    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(sentence_iterator=iter(lines), model_writer=buf, vocab_size=400, model_type="bpe",
                                   byte_fallback=True, split_digits=True, normalization_rule_name="identity",
                                   remove_extra_whitespaces=False, add_dummy_prefix=False, pad_id=0, eos_id=1, bos_id=2,
                                   unk_id=3, hard_vocab_limit=False, minloglevel=2)
    path = tmp_path_factory.mktemp("sp") / "paligemma_tokenizer.model"
    path.write_bytes(buf.getvalue())
    return path


EAGLE_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<IMG_CONTEXT>", "<img>", "</img>"]


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory) -> Path:
    """A tiny byte-level BPE with Qwen's pre-tokenizer and Eagle's added tokens: tokenizer.json, and the
    vocab.json + merges.txt + tokenizer_config.json that Isaac-GR00T ships instead."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(tokenize._QWEN_SPLIT), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    # "<image" is one pre-token under Qwen's split (not GPT-2's), so a wrong pre-tokenizer changes ids
    tok.train_from_iterator([*TASKS, "You are a helpful assistant.", "system user assistant", "<image 1><image 2>"] * 10,
                            trainers.BpeTrainer(vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                                show_progress=False))
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in EAGLE_SPECIALS])
    folder = tmp_path_factory.mktemp("qwen")
    tok.save(str(folder / "tokenizer.json"))
    vocab_folder = folder / "eagle2_hg_model"
    vocab_folder.mkdir()
    tok.model.save(str(vocab_folder))
    (vocab_folder / "tokenizer_config.json").write_text(json.dumps({"added_tokens_decoder": {
        str(tok.token_to_id(s)): {"content": s, "special": True} for s in EAGLE_SPECIALS}}))
    return folder


def test_pi05_prompt_ids_match_the_sentencepiece_model(sp_model):
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_file=str(sp_model))  # independent of kilovla's wrapper
    tok = SentencePieceTokenizer(sp_model)
    state = np.array([-1.0, 0.0, 0.5, 1.0, -1.5])
    ids = tokenize.openpi_prompt_ids(tok, "  pick_up the\nbowl ", state)
    text = "Task: pick up the bowl, State: 0 128 192 255 -1;\nAction: "
    assert ids == sp.encode(text, add_bos=True) and ids[0] == sp.bos_id() == 2
    assert sp.decode(ids) == text  # the prompt round-trips through the tokenizer
    pi0 = tokenize.openpi_prompt_ids(tok, "close the cabinet;")
    assert pi0 == sp.encode("close the cabinet;", add_bos=True) + sp.encode("\n")
    assert pi0 != sp.encode("close the cabinet;\n", add_bos=True)  # ";\n" is one piece: openpi encodes "\n" alone
    assert discretize_state(np.array([-1.2, -1.0, 0.9921875, 2.0])) == [-1, 0, 255, 255]  # openpi does not clip


def test_eagle_prompt_ids_match_the_tokenizer(qwen_dir):
    from tokenizers import Tokenizer

    raw = Tokenizer.from_file(str(qwen_dir / "tokenizer.json"))
    ctx = raw.token_to_id("<IMG_CONTEXT>")
    full = (EAGLE_SYSTEM + "".join(f"<image {k}><img>" + "<IMG_CONTEXT>" * 16 + "</img>" for k in (1, 2))
            + "pick up the black bowl" + EAGLE_END)
    expected = raw.encode(full, add_special_tokens=False).ids
    for source in (qwen_dir / "tokenizer.json", qwen_dir / "eagle2_hg_model"):  # both published forms
        tok = QwenTokenizer(source)
        ids = tokenize.eagle_prompt_ids(tok, "pick up the black bowl", 2, 16, ctx)
        assert ids == expected
        assert tok.decode(ids) == full
    assert expected.count(ctx) == 32 and raw.token_to_id("<|im_start|>") in expected


def test_prompts_over_the_budget_warn_once_with_counts(caplog, monkeypatch):
    monkeypatch.setattr(tokenize, "_warned_truncation", False)
    with caplog.at_level(logging.WARNING, logger="kilovla.models.tokenize"):
        tokens, mask = tokenize.tokenize_batch(tokenize.ByteTokenizer(), ["x" * 30, "y" * 40], 20)
    assert tokens.shape == (2, 20) and mask.all()
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1
    assert "a prompt of 31 language tokens is longer than max_language_tokens=20: its last 11 tokens are cut" in warnings[0]


# -- images --------------------------------------------------------------------------------------------
def _pil_resize_with_pad(image: np.ndarray, size: int) -> np.ndarray:
    """openpi_client's algorithm, written here with PIL as the reference."""
    from PIL import Image

    im = Image.fromarray(image)
    w, h = im.size
    ratio = max(w / size, h / size)
    rw, rh = int(w / ratio), int(h / ratio)
    out = Image.new(im.mode, (size, size), 0)
    out.paste(im.resize((rw, rh), resample=Image.BILINEAR), (max(0, int((size - rw) / 2)), max(0, int((size - rh) / 2))))
    return np.asarray(out)


@pytest.mark.parametrize("shape", [(48, 96), (90, 30), (20, 40)])  # wide, tall, upscaled
def test_resize_with_pad_matches_openpi(shape):
    rng = np.random.default_rng(0)
    yy, xx = np.mgrid[0:shape[0], 0:shape[1]]
    image = np.stack([(xx * 255 / shape[1]), (yy * 255 / shape[0]), rng.integers(0, 40, shape)], -1).astype(np.uint8)
    ours = resize_with_pad(torch.from_numpy(image).permute(2, 0, 1)[None].float() / 255, 32, 32)[0]
    ref = _pil_resize_with_pad(image, 32)
    diff = np.abs(ours.permute(1, 2, 0).numpy() * 255 - ref.astype(np.float32))
    assert diff.max() <= 3.0 and diff.mean() < 0.75  # PIL rounds to uint8 and uses fixed point
    assert (ref == 0).all(-1).sum() == (ours == 0).all(0).sum().item() > 0  # the same black bars


def test_lerobot_smolvla_pads_at_the_top_and_left():
    """A 2 x 4 image in a 4 x 4 square: LeRobot's SmolVLA puts it in the bottom rows, openpi centres it; a
    tall one sits in the right columns. Downscaling is LeRobot's plain bilinear (no antialiasing)."""
    from kilovla.models.images import RESIZE_MODES, resize_images
    wide = (torch.arange(8.0) + 1).reshape(1, 1, 2, 4).expand(1, 3, 2, 4) / 8
    out = resize_images(wide, 4, "pad_top_left")
    assert (out[0, :, :2] == 0).all() and torch.equal(out[0, :, 2:], wide[0])
    assert (out[0, :, 0] == 0).all() and torch.equal(resize_images(wide, 4, "pad")[0, :, 1:3], wide[0])
    tall = wide.transpose(2, 3)
    out = resize_images(tall, 4, "pad_top_left")
    assert (out[0, :, :, :2] == 0).all() and torch.equal(out[0, :, :, 2:], tall[0])
    big = torch.rand(1, 3, 8, 16, generator=torch.Generator().manual_seed(0))
    out = resize_images(big, 4, "pad_top_left")
    plain = torch.nn.functional.interpolate(big, size=(2, 4), mode="bilinear", align_corners=False)
    assert (out[0, :, :2] == 0).all() and torch.equal(out[:, :, 2:], plain)
    assert "pad_top_left" in RESIZE_MODES


def _images(n=2, size=32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.rand(n, 3, size, size, generator=g)


def test_openpi_augmentation_spares_wrist_geometry_and_repeats_per_sample():
    geometric = ImageAugmentation(crop_scale=0.8, rotate_degrees=20.0, geometric_skip=("wrist",))
    x = _images()
    rngs = lambda: [np.random.default_rng([0, 3, i, 1]) for i in range(2)]  # noqa: E731
    base = geometric.apply(x, "base_0_rgb", rngs())
    assert not torch.allclose(base, x)
    torch.testing.assert_close(geometric.apply(x, "base_0_rgb", rngs()), base)  # same (seed, step, sample)
    torch.testing.assert_close(geometric.apply(x, "left_wrist_0_rgb", rngs()), x)
    assert not torch.allclose(base[0], geometric.apply(x, "base_0_rgb", [np.random.default_rng(9)] * 2)[0])
    colour = OPENPI_AUGMENTATION.apply(x, "left_wrist_0_rgb", rngs())
    assert not torch.allclose(colour, x) and colour.min() >= 0 and colour.max() <= 1
    gray = x.mean(1, keepdim=True).expand_as(x).clone()
    hue_only = ImageAugmentation(hue=0.3).apply(gray, "cam", rngs())
    torch.testing.assert_close(hue_only, gray, atol=1e-5, rtol=0)  # a hue shift leaves grey grey


def test_groot_crops_the_centre_at_inference():
    x = _images(1, 40)
    out = GROOT_AUGMENTATION.inference(x, "ego_view")
    expected = torch.nn.functional.interpolate(x[..., 1:39, 1:39], size=(40, 40), mode="bilinear", align_corners=False)
    torch.testing.assert_close(out, expected)
    torch.testing.assert_close(OPENPI_AUGMENTATION.inference(x, "base_0_rgb"), x)


# -- policies at tiny width ------------------------------------------------------------------------------
def _stats(dim):
    return {"q01": [-1.0] * dim, "q99": [1.0] * dim, "mean": [0.0] * dim, "std": [1.0] * dim,
            "min": [-2.0] * (dim - 1) + [0.5], "max": [2.0] * (dim - 1) + [0.5]}


def _meta(name, overrides, cameras, tokenizer="byte", state_dim=5, action_dim=6, **fields):
    d = policy_defaults(name)
    values = dict(normalization=d.normalization, state_in_prompt=d.state_in_prompt, image_resize=d.image_resize,
                  augmentation=d.augmentation.to_dict(), embodiment_id=d.embodiment_id)
    values.update(fields)
    return PolicyMeta(preset=name, overrides=overrides, camera_map=cameras, state_dim=state_dim, action_dim=action_dim,
                      stats={"observation.state": _stats(state_dim), "action": _stats(action_dim)},
                      tokenizer=str(tokenizer), **values)


def _row(meta, horizon, n=4, seed=0):
    rng = np.random.default_rng(seed)
    row = {"task": [TASKS[i % len(TASKS)] for i in range(n)],
           "observation.state": rng.uniform(-1, 1, (n, meta.state_dim)).astype(np.float32),
           "action": rng.normal(size=(n, horizon, meta.action_dim)).astype(np.float32),
           "action_is_pad": np.zeros((n, horizon), bool), "step": 0, "sample_index": np.arange(n)}
    for key in meta.camera_map:
        row[key] = rng.integers(0, 255, (n, 24, 40, 3), dtype=np.uint8)  # not square: resize_with_pad pads
    return row


def _random_weights(name, seed=3, **overrides):
    model = build_model(name, seed=seed, **overrides)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    return model


def _check_loaded(src, dst, stored_dtype=lambda key: torch.float32):
    s, d = src.state_dict(), dst.state_dict()
    assert s.keys() == d.keys()
    for k in s:
        assert d[k].dtype == torch.float32, k  # cast to the training dtype whatever was stored
        torch.testing.assert_close(d[k], s[k].to(stored_dtype(k)).float(), atol=0, rtol=0, msg=k)


def _finetune(model, processor, meta, horizon):
    row = _row(meta, horizon)
    obs = processor.observation_batch(row)
    actions = model.eval().sample_actions(obs)
    assert actions.dtype == torch.float32 and torch.isfinite(actions).all()
    model.train()
    assert_training_reduces_loss(model, processor.training_batch(row, seed=1), steps=30)


PI_CAMERAS = {"observation.images.front": "base_0_rgb", "observation.images.wrist": "left_wrist_0_rgb"}


def _openpi_export(folder: Path, src, max_shard_bytes=40_000) -> None:
    """openpi's JAX -> PyTorch converter: unprefixed keys, the whole model bf16, the tied LM head in
    place of the embedding, the expert's unused LM head; here sharded as Hugging Face shards."""
    state = {k: v.to(torch.bfloat16) for k, v in src.state_dict().items()}
    state["paligemma_with_expert.paligemma.lm_head.weight"] = state.pop(PI_EMBED)
    state["paligemma_with_expert.gemma_expert.lm_head.weight"] = torch.randn(17, 32).to(torch.bfloat16)
    folder.mkdir(parents=True)
    files = save_sharded({k: (tuple(v.shape), v.dtype) for k, v in state.items()}, state.__getitem__, folder,
                         max_shard_bytes=max_shard_bytes)
    assert len(files) > 1
    (folder / "config.json").write_text(json.dumps({"action_dim": 32, "action_horizon": 8, "paligemma_variant": "gemma_2b",
                                                    "action_expert_variant": "gemma_300m", "precision": "bfloat16"}))


def test_sharded_bf16_openpi_export_fine_tunes_with_the_sentencepiece_prompt(tmp_path, sp_model):
    overrides = {"lm": {"vocab_size": 400}}
    src = _random_weights("pi05-tiny", **overrides)
    _openpi_export(tmp_path / "pi05_export", src)
    ckpt = Checkpoint.open(tmp_path / "pi05_export")
    assert ckpt.layout == "openpi" and ckpt.dtypes() == {"BF16": len(ckpt.tensors)} and len(ckpt.files) > 1
    model = build_model("pi05-tiny", device="meta", **overrides)
    load_weights(model, ckpt)
    assert ckpt.dropped == ["paligemma_with_expert.gemma_expert.lm_head.weight"]
    _check_loaded(src, model, lambda k: torch.bfloat16)
    meta = _meta("pi05-tiny", overrides, PI_CAMERAS, sp_model, state_in_prompt=True, image_resize="pad",
                 augmentation=OPENPI_AUGMENTATION.to_dict())
    processor = Processor(model.config, meta)
    ids, _ = processor.prompt_ids("pick up the black bowl", np.zeros(5, np.float32))
    import sentencepiece as spm

    assert ids == spm.SentencePieceProcessor(model_file=str(sp_model)).encode(
        "Task: pick up the black bowl, State: 128 128 128 128 128;\nAction: ", add_bos=True)
    _finetune(model, processor, meta, 8)


def test_lerobot_pi05_folder_with_legacy_norm_keys(tmp_path):
    src = _random_weights("pi05-tiny")
    state = {f"model.{k}": v for k, v in src.state_dict().items()}
    state["model.paligemma_with_expert.paligemma.lm_head.weight"] = state.pop(f"model.{PI_EMBED}")
    for part in ("weight", "bias"):
        state[f"model.action_time_mlp_in.{part}"] = state.pop(f"model.time_mlp_in.{part}")
    expert = "model.paligemma_with_expert.gemma_expert.model"
    for i in range(2):  # what older LeRobot pi05 exports carry and LeRobot's own loader drops
        state[f"{expert}.layers.{i}.input_layernorm.weight"] = torch.zeros(32)
        state[f"{expert}.layers.{i}.post_attention_layernorm.weight"] = torch.zeros(32)
    state[f"{expert}.norm.weight"] = torch.zeros(32)
    state["model.state_proj.weight"] = torch.zeros(32, 8)
    folder = tmp_path / "lerobot_pi05"
    save_safetensors(state, folder / "model.safetensors")
    (folder / "config.json").write_text(json.dumps({"type": "pi05", "chunk_size": 8}))
    (folder / "policy_preprocessor.json").write_text(json.dumps({"name": "policy_preprocessor", "steps": []}))
    model = build_model("pi05-tiny", device="meta")
    ckpt = load_weights(model, folder)
    assert ckpt.layout == "lerobot" and len(ckpt.dropped) == 6
    _check_loaded(src, model)
    meta = _meta("pi05-tiny", {}, PI_CAMERAS)
    _finetune(model, Processor(model.config, meta), meta, 8)


def test_lerobot_pi0_folder_with_pi05_time_mlp_names(tmp_path):
    src = _random_weights("pi0-tiny")
    state = {f"model.{k}": v for k, v in src.state_dict().items()}
    for part in ("in", "out"):  # LeRobot's pi0 loader renames these back to action_time_mlp_*
        for p in ("weight", "bias"):
            state[f"model.time_mlp_{part}.{p}"] = state.pop(f"model.action_time_mlp_{part}.{p}")
    save_safetensors(state, tmp_path / "lerobot_pi0" / "model.safetensors")
    model = build_model("pi0-tiny", device="meta")
    assert load_weights(model, tmp_path / "lerobot_pi0").layout == "lerobot"
    _check_loaded(src, model)


GROOT_CAMERAS = {"observation.images.front": "ego_view", "observation.images.wrist": "wrist"}


def test_lerobot_groot_folder_with_prefix_and_tied_head(tmp_path):
    src = _random_weights("groot-tiny")
    state = {f"_groot_model.{k}": v for k, v in src.state_dict().items()}
    # LeRobot's save keeps the tied Qwen LM head and drops the embedding it shares storage with
    state["_groot_model.backbone.eagle_model.language_model.lm_head.weight"] = state.pop(f"_groot_model.{GROOT_EMBED}")
    folder = tmp_path / "lerobot_groot"
    save_safetensors(state, folder / "model.safetensors")
    (folder / "config.json").write_text(json.dumps({"type": "groot", "base_model_path": "nvidia/GR00T-N1.5-3B"}))
    model = build_model("groot-tiny", device="meta")
    assert load_weights(model, folder).layout == "lerobot-groot"
    _check_loaded(src, model)
    meta = _meta("groot-tiny", {}, GROOT_CAMERAS, normalization="min_max", embodiment_id=1)
    _finetune(model, Processor(model.config, meta), meta, 8)


def _n15_folder(folder: Path, src) -> None:
    """Isaac-GR00T's save_pretrained: HF shards, unprefixed keys, the backbone in bf16 and the action
    head in fp32, SigLIP's unused pooling head, config.json and experiment_cfg/metadata.json."""
    state = {k: v.to(torch.bfloat16) if k.startswith("backbone.") else v for k, v in src.state_dict().items()}
    siglip_head = "backbone.eagle_model.vision_model.vision_model.head."
    state[siglip_head + "probe"] = torch.zeros(1, 1, 32, dtype=torch.bfloat16)
    state[siglip_head + "attention.in_proj_weight"] = torch.zeros(96, 32, dtype=torch.bfloat16)
    state[siglip_head + "mlp.fc1.weight"] = torch.zeros(64, 32, dtype=torch.bfloat16)
    folder.mkdir(parents=True)
    save_sharded({k: (tuple(v.shape), v.dtype) for k, v in state.items()}, state.__getitem__, folder,
                 max_shard_bytes=100_000)
    (folder / "config.json").write_text(json.dumps({"model_type": "gr00t_n1_5", "torch_dtype": "bfloat16",
                                                    "action_head_cfg": {"action_horizon": 8}}))
    (folder / "experiment_cfg").mkdir()
    (folder / "experiment_cfg" / "metadata.json").write_text(json.dumps({"new_embodiment": {"statistics": {}}}))


def _eagle_overrides(qwen_dir):
    tok = QwenTokenizer(qwen_dir / "tokenizer.json")
    return {"llm": {"vocab_size": tok.vocab_size}, "image_token_id": tok.token_id("<IMG_CONTEXT>"),
            "max_language_tokens": 100}


def test_isaac_groot_n15_folder_fine_tunes_with_the_eagle_prompt(tmp_path, qwen_dir):
    overrides = _eagle_overrides(qwen_dir)
    src = _random_weights("groot-tiny", **overrides)
    _n15_folder(tmp_path / "GR00T-N1.5-3B", src)
    model = build_model("groot-tiny", device="meta", **overrides)
    ckpt = load_weights(model, tmp_path / "GR00T-N1.5-3B")
    assert ckpt.layout == "groot" and len(ckpt.files) > 1 and set(ckpt.dtypes()) == {"BF16", "F32"}
    assert len(ckpt.dropped) == 3
    _check_loaded(src, model, lambda k: torch.bfloat16 if k.startswith("backbone.") else torch.float32)
    tokenizer = find_tokenizer("qwen3", None, [qwen_dir])
    meta = _meta("groot-tiny", overrides, GROOT_CAMERAS, tokenizer, normalization="min_max", embodiment_id=1,
                 augmentation=GROOT_AUGMENTATION.to_dict())
    processor = Processor(model.config, meta)
    batch = processor.observation_batch(_row(meta, 8))
    assert int((batch.tokens == overrides["image_token_id"]).sum(1)[0]) == 2 * 16  # two cameras of 16 tokens
    model.backbone.requires_grad_(False)  # as groot-n15 fine-tunes: the action head only
    _finetune(model, processor, meta, 8)


def test_eagle_layout_places_camera_tokens_at_the_placeholders(qwen_dir):
    overrides = _eagle_overrides(qwen_dir)
    model = _random_weights("groot-tiny", **overrides).eval()
    meta = _meta("groot-tiny", overrides, GROOT_CAMERAS, qwen_dir / "tokenizer.json", normalization="min_max")
    row = _row(meta, 8, n=3)
    row["task"] = ["pick", "open the top drawer and then put the bowl on the plate", "stove"]
    batch = Processor(model.config, meta).observation_batch(row)
    seen = {}

    def record(module, args):
        seen.setdefault("x", args[0])

    model.eagle.language_model.model.layers[0].register_forward_pre_hook(record)
    with torch.no_grad():
        padded = model.encode(batch)
        images = model._embed_images(batch.images.flatten(0, 1)).view(3, 2, 16, -1)
    slots = batch.tokens == overrides["image_token_id"]
    torch.testing.assert_close(seen["x"][slots].view(3, 2, 16, -1), images)
    first = int(slots[0].nonzero()[0])
    assert first > 10  # the system turn comes before the first camera, as in Eagle's template
    model.config = dataclasses.replace(model.config, packing=True)
    with torch.no_grad():
        packed = model.encode(batch)
    torch.testing.assert_close(packed.x, padded.x[padded.mask], atol=1e-5, rtol=1e-5)
    bad = dataclasses.replace(batch, image_masks=torch.zeros_like(batch.image_masks))
    with pytest.raises(KilovlaError, match="image placeholders"):
        model.encode(bad)


def test_eagle_prompts_need_a_matching_qwen_tokenizer(qwen_dir, sp_model):
    overrides = _eagle_overrides(qwen_dir)
    cfg = preset("groot-tiny", **overrides)
    with pytest.raises(KilovlaError, match="needs a Qwen3 tokenizer"):
        Processor(cfg, _meta("groot-tiny", overrides, GROOT_CAMERAS))
    other = preset("groot-tiny", **{**overrides, "image_token_id": 5})
    with pytest.raises(KilovlaError, match=r"<IMG_CONTEXT> is token \d+, the model expects 5"):
        Processor(other, _meta("groot-tiny", overrides, GROOT_CAMERAS, qwen_dir / "tokenizer.json"))
    with pytest.raises(KilovlaError, match="has 400 tokens, the model's embedding 258"):
        Processor(preset("pi05-tiny"), _meta("pi05-tiny", {}, PI_CAMERAS, sp_model))


def test_min_max_normalisation_maps_the_range_to_plus_minus_one():
    meta = _meta("groot-tiny", {}, GROOT_CAMERAS, normalization="min_max", state_dim=3, action_dim=3)
    processor = Processor(preset("groot-tiny"), meta)
    x = np.array([[-2.0, 0.0, 0.5], [2.0, 1.0, 0.5]], np.float32)
    norm = processor._action_norm(x)
    np.testing.assert_allclose(norm, [[-1.0, 0.0, 0.0], [1.0, 0.5, 0.0]])  # a constant dimension -> 0
    np.testing.assert_allclose(processor.unnormalize_actions(norm), x)


# -- the families' defaults ------------------------------------------------------------------------------
def test_presets_carry_the_published_fine_tuning_defaults(sp_model, qwen_dir):
    assert preset("pi05-base").chunk_size == 50 and preset("pi05-libero").chunk_size == 10
    assert preset("pi0-base").max_language_tokens == 48 and not preset("pi0-base").pi05
    n15 = preset("groot-n15")
    assert (n15.dropout, n15.image_token_id, n15.action_horizon, n15.max_action_dim, n15.max_state_dim,
            n15.llm.vocab_size) == (0.2, 151669, 16, 32, 64, 151680)

    def resolved(name, *extra):
        return with_policy_defaults(load_config(TrainConfig, None, [f"--policy.preset={name}", *extra]))

    base = resolved("pi05-base", f"--policy.tokenizer={sp_model}")
    assert (base.policy.state_in_prompt, base.policy.normalization, base.policy.image_resize, base.freeze_vlm) == \
        (True, "quantile", "pad", False)
    assert base.policy.augmentation == OPENPI_AUGMENTATION.to_dict() and base.policy.tokenizer == str(sp_model)
    assert not resolved("pi05-libero", f"--policy.tokenizer={sp_model}").policy.state_in_prompt
    assert resolved("pi0-base", f"--policy.tokenizer={sp_model}").policy.normalization == "mean_std"
    assert resolved("pi05-3b").policy.state_in_prompt  # a default pi0.5 sees its state
    groot = resolved("groot-n15", f"--policy.tokenizer={qwen_dir / 'tokenizer.json'}")
    assert (groot.policy.normalization, groot.policy.embodiment_id, groot.freeze_vlm, groot.freeze_vision) == \
        ("min_max", 31, True, True)
    assert groot.policy.augmentation == GROOT_AUGMENTATION.to_dict()
    assert resolved("groot-n15", f"--policy.tokenizer={qwen_dir / 'tokenizer.json'}", "--freeze_vlm=false").freeze_vlm \
        is False  # a run's own setting wins
    with pytest.raises(KilovlaError, match="pi05-base needs PaliGemma's SentencePiece model"):
        resolved("pi05-base")
    model = build_model("groot-tiny")
    apply_freeze(model, freeze_vision=groot.freeze_vision, freeze_vlm=groot.freeze_vlm)
    assert not any(p.requires_grad for p in model.backbone.parameters())
    assert all(p.requires_grad for p in model.action_head.parameters())


def test_the_tokenizer_is_found_next_to_the_checkpoint(tmp_path, sp_model, qwen_dir):
    ckpt = tmp_path / "pi05_base"
    ckpt.mkdir()
    (ckpt / "paligemma_tokenizer.model").write_bytes(sp_model.read_bytes())
    assert find_tokenizer("paligemma", None, [ckpt]) == str((ckpt / "paligemma_tokenizer.model").resolve())
    assert find_tokenizer("qwen3", None, [qwen_dir]) == str((qwen_dir / "tokenizer.json").resolve())
    assert find_tokenizer("paligemma", "byte", [ckpt]) == "byte"  # --policy.tokenizer wins
    with pytest.raises(KilovlaError, match="looked for .*tokenizer.json"):
        find_tokenizer("qwen3", None, [ckpt])


# -- kilovla train --policy.init_from -------------------------------------------------------------------
@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    return make_synthetic_dataset(tmp_path_factory.mktemp("ft") / "ds", episodes=4, frames=(16, 20),
                                  resolution=(32, 32), seed=5)


def _train_args(dataset, run_dir, *extra):
    return ["train", f"--run_dir={run_dir}", "--steps=2", f"--dataset.roots=[{dataset}]", "--batch.global_batch_size=4",
            "--batch.token_budget=512", "--checkpoint.every=2", "--policy.overrides.chunk_size=4", "--progress=false",
            "--optim.warmup_steps=1", *extra]


def test_train_from_a_published_layout_records_where_it_started(dataset, tmp_path, sp_model):
    src = _random_weights("pi05-tiny", lm={"vocab_size": 400})
    _openpi_export(tmp_path / "export", src)
    (tmp_path / "export" / "paligemma_tokenizer.model").write_bytes(sp_model.read_bytes())
    run = tmp_path / "run"
    assert main(_train_args(dataset, run, f"--policy.init_from={tmp_path / 'export'}", "--freeze_vlm=true",
                            "--policy.overrides.lm.vocab_size=400", "--policy.tokenizer=" + str(sp_model),
                            "--policy.state_in_prompt=true", "--policy.image_resize=pad")) == 0
    step = run / "checkpoints" / "step_000002"
    meta = json.loads((step / "policy.json").read_text())
    assert meta["init_from"] == {"path": str((tmp_path / "export").resolve()), "layout": "openpi"}
    assert meta["tokenizer"] == str(sp_model) and meta["state_in_prompt"] and meta["image_resize"] == "pad"
    from safetensors.torch import load_file

    trained, start = load_file(str(step / "model.safetensors")), src.state_dict()
    frozen = [k for k in trained if k.startswith("paligemma_with_expert.paligemma.")]
    assert frozen and all(torch.equal(trained[k], start[k].to(torch.bfloat16).float()) for k in frozen)
    assert not torch.equal(trained["action_in_proj.weight"], start["action_in_proj.weight"].to(torch.bfloat16).float())
    policy = load_policy_folder(step)
    assert isinstance(policy.processor.tokenizer, SentencePieceTokenizer)
    save_policy(policy, tmp_path / "copy")  # a saved policy folder carries its tokenizer
    copied = json.loads((tmp_path / "copy" / "policy.json").read_text())
    assert copied["tokenizer"] == "tokenizer/paligemma_tokenizer.model"
    assert (tmp_path / "copy" / "tokenizer" / "paligemma_tokenizer.model").read_bytes() == sp_model.read_bytes()
    assert isinstance(load_policy_folder(tmp_path / "copy").processor.tokenizer, SentencePieceTokenizer)


def test_a_checkpoint_that_does_not_fit_stops_with_its_keys(dataset, tmp_path, capsys):
    src = _random_weights("pi05-tiny", lm={"width": 64})  # wrong width
    state = {k: v for k, v in src.state_dict().items() if ".language_model.layers.1." not in k}  # a missing layer
    save_safetensors(state, tmp_path / "bad" / "model.safetensors")
    run = tmp_path / "run"
    assert main(_train_args(dataset, run, f"--policy.init_from={tmp_path / 'bad'}")) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"{tmp_path / 'bad'}: does not fit the model" in err
    assert "missing keys: paligemma_with_expert.paligemma.model.language_model.layers.1." in err
    assert f"{PI_EMBED}: checkpoint (258, 64) vs model (258, 48)" in err
    assert not run.exists()


def test_a_quantized_policy_folder_cannot_seed_training(dataset, tmp_path, capsys):
    meta = _meta("pi05-tiny", {}, PI_CAMERAS)
    save_policy(VLAPolicy(build_model("pi05-tiny"), meta), tmp_path / "fp8")
    fields = json.loads((tmp_path / "fp8" / "policy.json").read_text())
    fields["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [128, 128]}
    (tmp_path / "fp8" / "policy.json").write_text(json.dumps(fields))
    run = tmp_path / "run"
    assert main(_train_args(dataset, run, f"--policy.init_from={tmp_path / 'fp8'}")) == 2
    assert "a quantized policy folder (policy.json has a quantization_config)" in capsys.readouterr().err
    assert not run.exists()


def test_broken_shard_sets_are_named(tmp_path):
    src = _random_weights("pi05-tiny")
    _openpi_export(tmp_path / "export", src)
    shards = sorted((tmp_path / "export").glob("model-*.safetensors"))
    data = shards[-1].read_bytes()
    shards[-1].write_bytes(data[: len(data) - 100])
    with pytest.raises(CheckpointError, match="lies outside the file"):
        Checkpoint.open(tmp_path / "export")
    shards[-1].unlink()
    with pytest.raises(CheckpointError, match=f"names shards that are not there: {shards[-1].name}"):
        Checkpoint.open(tmp_path / "export")


@pytest.mark.gpu
def test_weights_load_straight_onto_the_gpu(tmp_path):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    src = _random_weights("pi05-tiny")
    _openpi_export(tmp_path / "export", src)
    model = build_model("pi05-tiny", device="meta")
    load_weights(model, tmp_path / "export", device="cuda")
    assert all(p.device.type == "cuda" and p.dtype == torch.float32 for p in model.parameters())
    _check_loaded(src, model.cpu(), lambda k: torch.bfloat16)


def test_a_tokenizer_far_smaller_than_the_embedding_warns(sp_model, caplog):
    from kilovla.train.build import check_tokenizer_size as _check_tokenizer_size

    small = Processor(preset("pi05-tiny", lm={"vocab_size": 1000}),
                      _meta("pi05-tiny", {"lm": {"vocab_size": 1000}}, {"observation.images.front": "base_0_rgb"},
                            tokenizer=sp_model))
    fits = Processor(preset("pi05-tiny", lm={"vocab_size": 400}),
                     _meta("pi05-tiny", {"lm": {"vocab_size": 400}}, {"observation.images.front": "base_0_rgb"},
                           tokenizer=sp_model))
    with caplog.at_level("WARNING", logger="kilovla.train.trainer"):
        _check_tokenizer_size(fits, fits.cfg)
        assert not caplog.records
        _check_tokenizer_size(small, small.cfg)
    assert len(caplog.records) == 1
    assert "has 400 tokens, under half the model's 1000-token embedding" in caplog.records[0].getMessage()
