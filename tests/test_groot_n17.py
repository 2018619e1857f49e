"""GR00T N1.7: the published shapes, Qwen3-VL's multimodal RoPE, the DiT's image / non-image
cross-attention, packing against the padded path, state dropout, a training run through the CLI, and
the issue's Meta-World packing check with the trained folder quantized, evaluated and served.
Equality with NVIDIA's code: benchmarks/groot_n17_reference/parity.py."""

import dataclasses
import json

import pytest
import torch
from conftest import QWEN3VL_TEMPLATE, assert_training_reduces_loss

from kilovla.cli import main
from kilovla.data.synthetic import make_synthetic_dataset
from kilovla.errors import KilovlaError
from kilovla.models.batch import PaddedBatch
from kilovla.models.family import family_of
from kilovla.models.groot_n17.model import mrope_angles, mrope_positions
from kilovla.models.presets import build_model, preset
from kilovla.models.tokenize import ByteTokenizer, tokenize_batch

TOL = dict(atol=1e-5, rtol=1e-5)
IMAGE = 299  # the image placeholder id of the chat-template models below (vocab 300)


def _model(**overrides):
    model = build_model("groot-n17-tiny", **overrides)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    return model.eval()


def _batch(cfg, seed=0):
    """Three samples, byte prompts of different lengths; the third has no wrist camera."""
    g = torch.Generator().manual_seed(seed)
    tokens, mask = tokenize_batch(ByteTokenizer(), ["pick the cube", "open the drawer please", "stack"],
                                  cfg.max_language_tokens)
    s = cfg.vision.image_size
    return PaddedBatch(
        images=torch.rand(3, 2, 3, s, s, generator=g),
        image_masks=torch.tensor([[1, 1], [1, 1], [1, 0]], dtype=torch.bool), camera_names=cfg.cameras,
        tokens=tokens, token_mask=mask, state=torch.randn(3, cfg.max_state_dim, generator=g),
        actions=torch.randn(3, cfg.action_horizon, cfg.max_action_dim, generator=g),
        action_is_pad=torch.rand(3, cfg.action_horizon, generator=g) < 0.2, embodiment_id=torch.tensor([0, 1, 1]))


def _template_batch(cfg, seed=0):
    """The same samples with the images at placeholder runs inside the prompt (Qwen3-VL's chat template)."""
    batch = _batch(cfg, seed)
    per, rows = cfg.vision.tokens, []
    for i, n in enumerate(batch.token_mask.sum(1).tolist()):
        text = batch.tokens[i, :n].tolist()
        images = int(batch.image_masks[i].sum())
        rows.append(text[:2] + sum(([IMAGE] * per + text[2 + k:3 + k] for k in range(images)), []) + text[2 + images:])
    length = max(map(len, rows))
    tokens = torch.zeros(3, length, dtype=torch.long)
    for i, r in enumerate(rows):
        tokens[i, :len(r)] = torch.tensor(r)
    mask = torch.arange(length)[None] < torch.tensor([len(r) for r in rows])[:, None]
    return dataclasses.replace(batch, tokens=tokens, token_mask=mask)


def _run(model, batch, **switches):
    old = model.config
    model.config = dataclasses.replace(old, **switches)
    g = torch.Generator().manual_seed(5)
    try:
        with torch.no_grad():
            return model(batch, noise=torch.randn(batch.actions.shape, generator=g), time=torch.rand(3, generator=g))
    finally:
        model.config = old


def test_the_3b_preset_has_the_published_shapes():
    model = build_model("groot-n17-3b", device="meta")
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    assert len(model.qwen.language_model.layers) == 16 and len(model.qwen.visual.blocks) == 24
    assert len(model.action_head.model.transformer_blocks) == 32
    assert len(model.action_head.vl_self_attention.transformer_blocks) == 4
    assert shapes["backbone.model.model.language_model.embed_tokens.weight"] == (151936, 2048)
    assert shapes["backbone.model.model.language_model.layers.0.self_attn.k_proj.weight"] == (1024, 2048)
    assert shapes["backbone.model.model.visual.patch_embed.proj.weight"] == (1024, 3, 2, 16, 16)
    assert shapes["backbone.model.model.visual.pos_embed.weight"] == (2304, 1024)
    assert shapes["backbone.model.model.visual.merger.linear_fc2.weight"] == (2048, 4096)
    assert shapes["backbone.model.model.visual.deepstack_merger_list.2.norm.weight"] == (4096,)
    assert shapes["action_head.action_encoder.W1.W"] == (32, 132, 1536)
    assert shapes["action_head.action_decoder.layer2.W"] == (32, 1024, 132)
    assert shapes["action_head.model.transformer_blocks.0.attn1.to_k.weight"] == (1536, 2048)
    assert shapes["action_head.model.transformer_blocks.1.attn1.to_k.weight"] == (1536, 1536)
    assert family_of(model).camera_tokens(model.config) == 49 and model.config.action_horizon == 40


def test_forward_and_sampling_shapes():
    model = _model()
    batch = _batch(model.config)
    out = _run(model, batch)
    assert out["v_t"].shape == batch.actions.shape and out["loss"].ndim == 0 and torch.isfinite(out["loss"])
    assert model.sample_actions(batch).shape == batch.actions.shape


def test_mrope_positions_are_qwen3_vl_s():
    # text, a 2x2 image, text; then padding, which takes no step
    image = torch.tensor([0, 1, 1, 1, 1, 0, 0], dtype=torch.bool)
    valid = torch.tensor([1, 1, 1, 1, 1, 1, 0], dtype=torch.bool)
    pos = mrope_positions(image, valid, torch.tensor([7]), grid=2)
    assert pos[:, :6].tolist() == [[0, 1, 1, 1, 1, 3], [0, 1, 1, 2, 2, 3], [0, 1, 2, 1, 2, 3]]
    # two packed samples: positions restart at each
    both = mrope_positions(torch.cat([image[:6], image[:6]]), torch.ones(12, dtype=torch.bool),
                           torch.tensor([6, 6]), grid=2)
    assert both[:, 6:].tolist() == both[:, :6].tolist() == pos[:, :6].tolist()


def test_mrope_angles_interleave_the_sections():
    t, h, w = torch.tensor([[5]]), torch.tensor([[7]]), torch.tensor([[11]])
    angles = mrope_angles(torch.stack([t, h, w]), head_dim=16, theta=100.0, section=(4, 2, 2))[0, 0]
    freq = 1.0 / 100.0 ** (torch.arange(0, 16, 2).float() / 16)
    axis = torch.tensor([5, 7, 11, 5, 7, 11, 5, 5])  # j % 3 == 1 below 6: h; j % 3 == 2 below 6: w; else t
    torch.testing.assert_close(angles, axis * freq)


def test_cross_attention_blocks_alternate_non_image_and_image_tokens():
    model = _model()
    vl = model.encode(_batch(model.config))
    b, n = 3, model.config.action_head_tokens
    views = model._cross_attention(vl, b, n)
    for block, sees in ((0, ~vl.image & vl.mask), (2, vl.image & vl.mask)):
        _, spec, mask = views(block)
        assert spec is None and torch.equal(mask[:, 0, 0] == 0, sees)  # additive: (B, 1, Lq, Lk)
    assert vl.image.sum() == 5 * model.config.vision.tokens  # the five present cameras


@pytest.mark.parametrize("switches", [
    {"packing": True},
    {"language_padding": "longest"},
    {"disabled_cameras": ("wrist",)},
    {"packing": True, "attention_backend": "flex"},
    {"packing": True, "language_padding": "longest", "disabled_cameras": ("wrist",)},
], ids=["packing", "dynamic-padding", "pruning", "flex", "all"])
@pytest.mark.parametrize("template", [False, True], ids=["byte-prompt", "chat-template"])
def test_switches_equal_the_padded_path(switches, template):
    model = _model(**({"image_token_id": IMAGE, "llm": {"vocab_size": 300}} if template else {}))
    batch = (_template_batch if template else _batch)(model.config)
    if "disabled_cameras" in switches:  # pruning a camera no sample has changes nothing
        if template:  # a pruned camera's placeholders are the prompt's business
            pytest.skip("the chat template names every camera it has")
        batch = dataclasses.replace(batch, image_masks=batch.image_masks & torch.tensor([True, False]))
    a, b = _run(model, batch), _run(model, batch, **switches)
    torch.testing.assert_close(a["v_t"], b["v_t"], **TOL)
    torch.testing.assert_close(a["loss"], b["loss"], **TOL)


def test_packed_sampling_equals_padded_sampling():
    model = _model()
    batch = _batch(model.config)
    noise = torch.randn(3, 8, 8, generator=torch.Generator().manual_seed(2))
    padded = model.sample_actions(batch, noise=noise)
    model.config = dataclasses.replace(model.config, packing=True)
    torch.testing.assert_close(model.sample_actions(batch, noise=noise), padded, **TOL)


def test_the_flow_time_is_n17s_not_n15s():
    # NVIDIA's N1.7 samples t = (1 - Beta(1.5, 1)) * 0.999 (N1.5: (0.999 - beta) / 0.999); the trainer
    # draws through the family's flow_time, the model's forward through sample_time
    beta = torch.tensor([0.0, 0.5, 1.0])
    torch.testing.assert_close(family_of(preset("groot-n17-tiny")).flow_time(beta), torch.tensor([0.999, 0.4995, 0.0]))
    t = _model().sample_time(4096, torch.device("cpu"))
    assert 0 <= float(t.min()) and float(t.max()) <= 0.999


def test_state_dropout_zeroes_the_state_token_in_training_only():
    model = _model(state_dropout=1.0)
    batch = _batch(model.config)
    other = dataclasses.replace(batch, state=batch.state + 1.0)
    assert not torch.allclose(_run(model, batch)["v_t"], _run(model, other)["v_t"])  # eval: the state counts
    model.train()
    torch.testing.assert_close(_run(model, batch)["v_t"], _run(model, other)["v_t"])  # every state dropped


def test_training_reduces_the_loss():
    torch.manual_seed(0)
    model = build_model("groot-n17-tiny")
    assert_training_reduces_loss(model, _batch(model.config))


def test_bad_shapes_are_refused_in_one_line():
    with pytest.raises(KilovlaError, match="mrope_section"):
        preset("groot-n17-tiny", mrope_section=(2, 2, 2))
    with pytest.raises(KilovlaError, match="multiple of patch_size"):
        preset("groot-n17-tiny", vision={"image_size": 40})
    with pytest.raises(KilovlaError, match="takes 32x32"):
        _run(_model(), _batch(preset("groot-n17-tiny", vision={"image_size": 64})))
    with pytest.raises(KilovlaError, match="no tensor-parallel plan"):
        family_of(preset("groot-n17-tiny")).tp_parts(preset("groot-n17-tiny"))
    with pytest.raises(KilovlaError, match="no pipeline-parallel plan"):
        family_of(preset("groot-n17-tiny")).pp_depth(preset("groot-n17-tiny"))


def test_the_cli_trains_the_tiny_preset_packed_and_records_the_family(tmp_path):
    data = make_synthetic_dataset(tmp_path / "ds", episodes=3, frames=(12, 16), resolution=(32, 32), seed=4)
    run = tmp_path / "run"
    assert main(["train", f"--run_dir={run}", "--steps=2", f"--dataset.roots=[{data}]", "--batch.global_batch_size=4",
                 "--batch.token_budget=200", "--checkpoint.every=2", "--policy.preset=groot-n17-tiny",
                 "--policy.overrides.packing=true", "--progress=false", "--optim.warmup_steps=1"]) == 0
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2] and all(r["loss"] > 0 for r in rows)
    policy = next(run.rglob("policy.json"))
    assert json.loads(policy.read_text())["family"] == "groot-n17"


def test_a_run_with_the_chat_template_trains_packed_and_its_folder_carries_the_template(qwen3vl_dir, tmp_path):
    from kilovla.policy_folder import load_policy_folder, save_policy
    from kilovla.models.tokenize import QwenTokenizer

    pad = QwenTokenizer(qwen3vl_dir / "tokenizer.json").token_id("<|image_pad|>")
    data = make_synthetic_dataset(tmp_path / "ds", episodes=3, frames=(12, 16), resolution=(32, 32), seed=4)
    run = tmp_path / "run"
    assert main(["train", f"--run_dir={run}", "--steps=2", f"--dataset.roots=[{data}]", "--batch.global_batch_size=4",
                 "--batch.token_budget=200", "--checkpoint.every=2", "--policy.preset=groot-n17-tiny",
                 "--policy.overrides.packing=true", "--progress=false", "--optim.warmup_steps=1",
                 f"--policy.tokenizer={qwen3vl_dir / 'tokenizer.json'}", f"--policy.overrides.image_token_id={pad}"]) == 0
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2] and min(r["samples"] / r["rows_per_rank"] for r in rows) > 1
    policy = load_policy_folder(run / "checkpoints" / "step_000002")
    ids, _ = policy.processor.prompt_ids("open the drawer")
    save_policy(policy, tmp_path / "copy")  # the template goes with the tokenizer
    assert (tmp_path / "copy" / "tokenizer" / "chat_template.jinja").read_text() == QWEN3VL_TEMPLATE
    assert load_policy_folder(tmp_path / "copy").processor.prompt_ids("open the drawer")[0] == ids


def test_every_trainable_parameter_gets_a_gradient():
    # DDP (no find_unused_parameters) needs it; the LLM's final norm is frozen: the feature is taken before it
    model = _model().train()
    model(_batch(model.config))["loss"].backward()
    assert [n for n, p in model.named_parameters() if p.requires_grad and p.grad is None] == []
    assert not model.qwen.language_model.norm.weight.requires_grad


@pytest.fixture(scope="module")
def packed_run(reach_demos, tmp_path_factory):
    """The issue's packing check: the tiny preset on Meta-World's two 32-px cameras, packed into 600-token rows."""
    run = tmp_path_factory.mktemp("n17") / "run"
    assert main(["train", f"--run_dir={run}", "--steps=2", f"--dataset.roots=[{reach_demos}]",
                 "--policy.preset=groot-n17-tiny", "--policy.overrides.packing=true", "--batch.token_budget=600",
                 "--progress=false"]) == 0
    return run


def test_meta_world_samples_pack_several_to_a_600_token_row(packed_run):
    rows = [json.loads(line) for line in (packed_run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert r["capacity"] == 600 * r["rows_per_rank"] and r["samples"] >= 2 * r["rows_per_rank"], r
        assert r["padding_fraction"] == 0.0 and r["tokens"] == r["tensor_tokens"]  # the plan counts what runs
    meta = json.loads((packed_run / "checkpoints" / "step_000002" / "policy.json").read_text())
    assert len(meta["camera_map"]) == 2  # both cameras feed the model


def test_a_trained_folder_quantizes_evaluates_and_serves(packed_run, tmp_path):
    """`kilovla quantize` (the LLM and the DiT, never the vision tower), `kilovla eval` of the result,
    and the serving engine: a batch of requests answers as each request alone."""
    import numpy as np

    from kilovla.quant.fp8 import select_layers
    from kilovla.serve.engine import PolicyEngine, Request
    from kilovla.serve.protocol import to_policy_observation

    folder = packed_run / "checkpoints" / "step_000002"
    assert main(["quantize", str(folder), f"--output_dir={tmp_path / 'q'}", "--quant.latency_repeats=1"]) == 0
    modules = json.loads((tmp_path / "q" / "policy.json").read_text())["quantization_config"]["modules"]
    assert set(modules) == set(select_layers(build_model("groot-n17-tiny", device="meta")))
    assert len(modules) == 3 * 7 + 4 * 6 and not any(".visual." in m for m in modules)
    assert main(["eval", f"--policy.path={tmp_path / 'q'}", "--env.task=reach-v3", "--eval.n_episodes=1",
                 "--env.max_steps=6", "--eval.videos=0", f"--output_dir={tmp_path / 'ev'}"]) == 0
    assert json.loads((tmp_path / "ev" / "report.json").read_text())["per_task"]["reach-v3"]["episodes"] == 1

    engine = PolicyEngine.load(folder, device="cpu")
    assert engine.metadata()["rtc"] is True
    rng = np.random.default_rng(0)
    requests = [Request(to_policy_observation({
        "observation.images.scene": rng.integers(0, 255, (32, 32, 3), dtype=np.uint8),
        "observation.images.wrist": rng.integers(0, 255, (32, 32, 3), dtype=np.uint8),
        "observation.state": rng.standard_normal(4), "task": task}, engine.inputs()), seed=i)
        for i, task in enumerate(["reach the goal", "reach"])]
    batched, _ = engine.infer(requests)
    for r, got in zip(requests, batched):
        [alone], _ = engine.infer([r])
        np.testing.assert_allclose(got, alone, atol=1e-5)


def test_the_n17_prompt_is_qwen3_vl_processors(qwen3vl_dir):
    """transformers' Qwen3VLProcessor on the same tokenizer and template (as Isaac-GR00T's N1.7 processor calls
    it: apply_chat_template without the generation prompt, then the processor on the text and the images): the
    same ids, each image's <|image_pad|> grown to its merged patches; the task formalised as NVIDIA does."""
    import numpy as np
    from PIL import Image
    from transformers import PreTrainedTokenizerFast, Qwen3VLProcessor
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    from kilovla.models.tokenize import QwenTokenizer, qwen3vl_prompt_ids

    class ImagesOnly(Qwen3VLProcessor):  # its class check of the video processor imports torchvision, which kilovla
        def check_argument_for_proper_class(self, name, argument):  # does not install; no video is processed here
            return None if name == "video_processor" else super().check_argument_for_proper_class(name, argument)

    reference = ImagesOnly(
        image_processor=Qwen2VLImageProcessorPil(patch_size=8, merge_size=2, temporal_patch_size=2,
                                                 min_pixels=32 * 32, max_pixels=32 * 32),
        tokenizer=PreTrainedTokenizerFast(tokenizer_file=str(qwen3vl_dir / "tokenizer.json")),
        video_processor=None, chat_template=QWEN3VL_TEMPLATE)
    tok = QwenTokenizer(qwen3vl_dir / "tokenizer.json")
    pad = tok.token_id("<|image_pad|>")
    images = [Image.fromarray(np.full((32, 32, 3), v, np.uint8)) for v in (10, 200)]
    for n in (1, 2):
        conversation = [{"role": "user", "content": [*({"type": "image", "image": im} for im in images[:n]),
                                                     {"type": "text", "text": "pick up the cube"}]}]
        text = reference.apply_chat_template(conversation, tokenize=False, add_generation_prompt=False)
        expected = reference(text=[text], images=images[:n], return_tensors="np")["input_ids"][0].tolist()
        ids = qwen3vl_prompt_ids(tok, "Pick up the Cube!", n, 4, pad)  # 32 px, 8-px patches, 2x2 merge: 4 tokens
        assert ids == expected
        assert ids.count(pad) == 4 * n and tok.decode(ids).startswith("<|im_start|>user\n<|vision_start|>")


def _n17_processor(tokenizer, cameras=2):
    from kilovla.models.processor import PolicyMeta, Processor

    from kilovla.models.tokenize import QwenTokenizer

    cfg = preset("groot-n17-tiny", image_token_id=QwenTokenizer(tokenizer).token_id("<|image_pad|>"))
    stats = {k: {"min": [-1.0] * 4, "max": [1.0] * 4} for k in ("observation.state", "action")}
    camera_map = {f"observation.images.{c}": c for c in cfg.cameras[:cameras]}
    return Processor(cfg, PolicyMeta(preset="groot-n17-tiny", state_dim=4, action_dim=4, stats=stats,
                                     camera_map=camera_map, tokenizer=str(tokenizer), normalization="min_max"))


def test_the_processor_places_each_camera_at_its_placeholder_run(qwen3vl_dir):
    processor = _n17_processor(qwen3vl_dir / "tokenizer.json")
    ids, placeholders = processor.prompt_ids("open the drawer")
    pad, per = processor.image_token_id, processor.cfg.vision.tokens
    assert placeholders == 2 * per and ids.count(pad) == 2 * per
    runs = "".join("I" if i == pad else "t" for i in ids)
    assert runs.count("t" + "I" * per + "t") == 2  # one run per camera, each between vision start and end


def test_a_tokenizer_without_a_chat_template_is_refused_in_one_line(qwen3vl_dir, tmp_path):
    (tmp_path / "tokenizer.json").write_bytes((qwen3vl_dir / "tokenizer.json").read_bytes())
    with pytest.raises(KilovlaError, match=r"no chat template beside the tokenizer .* looked for chat_template.jinja"):
        _n17_processor(tmp_path / "tokenizer.json")
    (tmp_path / "chat_template.jinja").write_text("{{ messages[0].content[0].text }}")  # writes no image
    with pytest.raises(KilovlaError, match=r"chat_template.jinja: the chat template writes 0 <\|image_pad\|> for 2"):
        _n17_processor(tmp_path / "tokenizer.json")
    (tmp_path / "chat_template.jinja").write_text("{% for m in messages %}")  # not closed
    with pytest.raises(KilovlaError, match=r"the chat template does not render"):
        _n17_processor(tmp_path / "tokenizer.json")
    (tmp_path / "chat_template.jinja").write_bytes(b"\xff\xfe{{ x }}")
    with pytest.raises(KilovlaError, match=r"chat_template.jinja: not a readable UTF-8 template"):
        _n17_processor(tmp_path / "tokenizer.json")
    (tmp_path / "chat_template.jinja").unlink()
    (tmp_path / "chat_template.json").write_text('{"chat_template": "unclosed')  # named, not skipped for another
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": QWEN3VL_TEMPLATE}))
    with pytest.raises(KilovlaError, match=r"chat_template.json: not a JSON file"):
        _n17_processor(tmp_path / "tokenizer.json")
    (tmp_path / "chat_template.json").write_text(json.dumps({"chat_template": [{"name": "tool_use", "template": ""}]}))
    with pytest.raises(KilovlaError, match=r"named chat templates \['tool_use'\] but no \"default\" one"):
        _n17_processor(tmp_path / "tokenizer.json")
    (tmp_path / "chat_template.json").unlink()  # tokenizer_config.json's template is read then
    assert _n17_processor(tmp_path / "tokenizer.json").chat_template_file == tmp_path / "tokenizer_config.json"


def test_a_template_tokenizer_without_image_token_id_is_warned_about(qwen3vl_dir, caplog, monkeypatch):
    import kilovla.models.processor as processor_module
    from kilovla.models.processor import PolicyMeta, Processor

    monkeypatch.setattr(processor_module, "_warned_unplaced", False)
    stats = {k: {"min": [-1.0] * 4, "max": [1.0] * 4} for k in ("observation.state", "action")}
    meta = PolicyMeta(preset="groot-n17-tiny", state_dim=4, action_dim=4, stats=stats, normalization="min_max",
                      tokenizer=str(qwen3vl_dir / "tokenizer.json"))
    with caplog.at_level("WARNING"):
        processor = Processor(preset("groot-n17-tiny"), meta)
    assert processor.prompt_ids("open the drawer")[1] == 0  # the images go before the prompt
    assert "image_token_id is unset" in caplog.text and "--policy.overrides.image_token_id=" in caplog.text


@pytest.mark.parametrize("prefix", ["", "_groot_model."], ids=["isaac-gr00t", "lerobot"])
def test_the_published_layout_loads_strictly_onto_the_meta_device(prefix, tmp_path):
    # NVIDIA's keys (sharded, with the tied LM head) and LeRobot's under `_groot_model.`
    from kilovla.models.checkpoints import CheckpointError, load_checkpoint, save_sharded

    source = build_model("groot-n17-tiny", seed=5)
    state = dict(source.state_dict())
    state["backbone.model.lm_head.weight"] = state["backbone.model.model.language_model.embed_tokens.weight"]
    state = {prefix + k: v.clone() for k, v in state.items()}
    files = save_sharded({k: (tuple(v.shape), v.dtype) for k, v in state.items()}, state.__getitem__, tmp_path,
                         max_shard_bytes=200_000)
    assert len(files) > 1
    model = build_model("groot-n17-tiny", device="meta")
    assert load_checkpoint(model, tmp_path) == ("lerobot-groot" if prefix else "groot")
    for key, value in source.state_dict().items():
        assert torch.equal(model.state_dict()[key], value), key
    with pytest.raises(CheckpointError, match="missing"):  # strict: the N1.5 preset's tree is not this one
        load_checkpoint(build_model("groot-tiny", device="meta"), tmp_path)
