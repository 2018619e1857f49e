"""SmolVLA in and out: SmolVLM2's tokenizer and LeRobot's prompt, a LeRobot SmolVLA folder converted into a
policy folder (`kilovla convert-policy`), and LeRobot's normalizer keys beside the weights.

Nothing is downloaded: the tests build a tiny GPT-2-style tokenizer.json with `tokenizers` and write
LeRobot's files (config.json, model.safetensors, processor JSON + stats) themselves at smolvla-tiny shapes.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from kilovla.cli import main
from kilovla.errors import KilovlaError
from kilovla.models.checkpoints import Checkpoint, load_checkpoint, save_safetensors
from kilovla.models.presets import build_model, policy_defaults, preset
from kilovla.models.processor import PolicyMeta, Processor
from kilovla.models.tokenize import SmolVLM2Tokenizer, find_tokenizer

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TEXTS = ["pick up the red block\n", "open the top drawer\n", "put the bowl on the plate\n",
         "pick_up the cube and put it in the box\n"] * 10
VOCAB = 200  # under smolvla-tiny's 258-token embedding


def write_tokenizer(folder: Path, template: bool = False) -> Path:
    """A byte-level BPE tokenizer.json as GPT-2's and SmolVLM2's are; `template`: its post-processor wraps each
    text in <|im_start|> ... <|im_end|> (a file that adds special tokens, which the prompt must then carry)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    # the alphabet is the texts' characters (GPT-2's 256 bytes would not fit smolvla-tiny's embedding)
    tok.train_from_iterator(TEXTS, trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=SPECIALS))
    if template:
        tok.post_processor = processors.TemplateProcessing(
            single="<|im_start|> $A <|im_end|>", special_tokens=[(s, tok.token_to_id(s)) for s in SPECIALS[1:]])
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    return folder / "tokenizer.json"


def tiny_meta(tokenizer, **fields) -> PolicyMeta:
    stats = {k: {"mean": [0.0] * n, "std": [1.0] * n} for k, n in (("observation.state", 3), ("action", 4))}
    values = dict(preset="smolvla-tiny",
                  camera_map={"observation.images.top": "camera1"}, state_dim=3, action_dim=4, stats=stats,
                  normalization="mean_std", tokenizer=str(tokenizer), image_resize="pad_top_left")
    return PolicyMeta(**{**values, **fields})


def _processor(tokenizer) -> Processor:
    meta = tiny_meta(tokenizer)
    return Processor(preset(meta.preset, **meta.overrides), meta)


@pytest.fixture(scope="module")
def tokenizer_json(tmp_path_factory) -> Path:
    return write_tokenizer(tmp_path_factory.mktemp("smolvlm2"))


# -- the tokenizer and the prompt ------------------------------------------------------------------------
def test_smolvla_prompt_is_the_task_and_a_newline_without_bos(tokenizer_json):
    """LeRobot: task + "\\n" (never doubled, the task not cleaned), the file's special tokens (none here)."""
    from tokenizers import Tokenizer

    raw = Tokenizer.from_file(str(tokenizer_json))
    processor = _processor(tokenizer_json)
    assert processor.tokenizer.kind == "smolvlm2"
    ids, placeholders = processor.prompt_ids("pick_up the cube")
    assert placeholders == 0 and ids == raw.encode("pick_up the cube\n", add_special_tokens=False).ids
    assert processor.prompt_ids("pick_up the cube\n")[0] == ids
    assert raw.decode(ids) == "pick_up the cube\n"


def test_smolvla_prompt_carries_what_the_tokenizer_file_adds(tmp_path):
    path = write_tokenizer(tmp_path, template=True)
    tok = SmolVLM2Tokenizer(tmp_path)  # a folder holding tokenizer.json
    ids, _ = _processor(path).prompt_ids("open the top drawer")
    assert ids[0] == tok.token_id("<|im_start|>") and ids[-1] == tok.token_id("<|im_end|>")
    assert ids[1:-1] == tok.encode("open the top drawer\n", bos=False)


def test_smolvla_prompt_is_cut_to_48_by_the_tokenizer_and_padded_right_to_48(tmp_path, tokenizer_json):
    long_task = " ".join(["pick up the red block"] * 20)
    processor = _processor(tokenizer_json)
    ids, _ = processor.prompt_ids(long_task)
    assert ids == processor.tokenizer.encode(long_task + "\n")[:48]
    templated = _processor(write_tokenizer(tmp_path, template=True))
    cut, _ = templated.prompt_ids(long_task)  # as transformers' truncation=True: the closing token is kept
    assert len(cut) == 48 and cut[-1] == templated.tokenizer.token_id("<|im_end|>")
    model = build_model("smolvla-tiny")
    batch = processor.observation_batch({"task": ["open it", long_task], "observation.state": np.zeros((2, 3)),
                                         "observation.images.top": np.zeros((2, 24, 40, 3), np.uint8)})
    padded = model._language(batch)  # language_padding="max_length": LeRobot's smolvla_base pads to 48
    short = processor.prompt_ids("open it")[0]
    assert padded.tokens.shape == (2, 48) and padded.token_mask.sum(1).tolist() == [len(short), 48]
    assert padded.tokens[0, :len(short)].tolist() == short and not padded.token_mask[0, len(short):].any()


def test_smolvla_base_uses_the_smolvlm2_tokenizer_found_next_to_the_checkpoint(tokenizer_json, tmp_path):
    assert policy_defaults("smolvla-base").tokenizer == "smolvlm2"
    assert find_tokenizer("smolvlm2", None, [tokenizer_json.parent]) == str(tokenizer_json.resolve())
    with pytest.raises(KilovlaError, match="smolvla-base needs SmolVLM2's tokenizer.json .*--policy.tokenizer=PATH"):
        find_tokenizer("smolvlm2", None, [tmp_path], "smolvla-base")


def test_smolvla_refuses_a_sentencepiece_tokenizer(tmp_path):
    import io

    import sentencepiece as spm

    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(sentence_iterator=iter(TEXTS), model_writer=buf, vocab_size=40,
                                   model_type="bpe")
    (tmp_path / "sp.model").write_bytes(buf.getvalue())
    with pytest.raises(KilovlaError, match="smolvla-tiny reads a smolvlm2 tokenizer .*not the paligemma tokenizer"):
        _processor(tmp_path / "sp.model")


# -- LeRobot's normalizer buffers beside the weights (LeRobot < 0.4) -------------------------------------
NORMALIZER_KEYS = {
    "plain": ("normalize_inputs.buffer_observation_state.mean", "normalize_targets.buffer_action.std",
              "unnormalize_outputs.buffer_action.mean"),
    "per_robot": ("normalize_inputs.so100_buffer_observation_state.mean",  # lerobot/smolvla_base before 0.4
                  "normalize_inputs.so100-red_buffer_observation_state.std", "normalize_targets.so100_buffer_action.std",
                  "unnormalize_outputs.so100-blue_buffer_action.mean"),
}


@pytest.mark.parametrize("name", ["smolvla-tiny", "pi0-tiny"])
@pytest.mark.parametrize("buffers", sorted(NORMALIZER_KEYS))
def test_auto_layout_reads_a_lerobot_file_with_normalizer_buffers_as_lerobot(tmp_path, name, buffers):
    source = build_model(name, seed=3)
    state = {f"model.{k}": v for k, v in source.state_dict().items()}
    state.update({k: torch.arange(4.0) for k in NORMALIZER_KEYS[buffers]})
    save_safetensors(state, tmp_path / "model.safetensors")
    ckpt = Checkpoint.open(tmp_path)
    assert ckpt.layout == "lerobot"
    target = build_model(name, seed=7)
    assert load_checkpoint(target, tmp_path) == "lerobot"
    assert all(torch.equal(a, b) for a, b in zip(source.state_dict().values(), target.state_dict().values()))


# -- a LeRobot SmolVLA folder -> a kilovla policy folder -------------------------------------------------
CAMERAS = ("observation.images.top", "observation.images.wrist")
STATE_DIM, ACTION_DIM = 3, 4


def _stats_tensors(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = {}
    for key, n in (("observation.state", STATE_DIM), ("action", ACTION_DIM)):
        out[f"{key}.mean"], out[f"{key}.std"] = torch.randn(n, generator=g), torch.rand(n, generator=g) + 0.5
        out[f"{key}.min"], out[f"{key}.max"] = -torch.rand(n, generator=g) - 1, torch.rand(n, generator=g) + 1
    return out


def write_lerobot_folder(folder: Path, seed: int = 3, robots: tuple[str, ...] = ()) -> dict[str, torch.Tensor]:
    """LeRobot's files for smolvla-tiny's shapes (random weights, the VLM in bf16 as published); returns the
    stats written (per robot, keys "<robot>.buffer.<feature>.<stat>", when `robots`)."""
    model = build_model("smolvla-tiny", seed=seed)
    cfg = model.config
    state = {f"model.{k}": v.to(torch.bfloat16) if ".vlm." in k else v for k, v in model.state_dict().items()}
    state["model.vlm_with_expert.vlm.lm_head.weight"] = torch.randn(cfg.text.vocab_size, cfg.text.width)
    save_safetensors(state, folder / "model.safetensors")
    features = {c: {"type": "VISUAL", "shape": [3, 24, 40]} for c in CAMERAS}
    config = {"type": "smolvla", "n_obs_steps": 1, "chunk_size": cfg.chunk_size, "n_action_steps": 5,
              "normalization_mapping": {"VISUAL": "IDENTITY", "STATE": "MEAN_STD", "ACTION": "MEAN_STD"},
              "input_features": {**features, "observation.state": {"type": "STATE", "shape": [STATE_DIM]}},
              "output_features": {"action": {"type": "ACTION", "shape": [ACTION_DIM]}},
              "max_state_dim": cfg.max_state_dim, "max_action_dim": cfg.max_action_dim,
              "resize_imgs_with_padding": [32, 32], "empty_cameras": 0, "tokenizer_max_length": 48, "num_steps": 10,
              "vlm_model_name": "HuggingFaceTB/SmolVLM2-500M-Video-Instruct", "pad_language_to": "max_length",
              "num_vlm_layers": 4, "self_attn_every_n_layers": 2, "expert_width_multiplier": 0.75,
              "attention_mode": "cross_attn", "add_image_special_tokens": False, "num_expert_layers": -1}
    (folder / "config.json").write_text(json.dumps(config))
    stats = _stats_tensors(seed)
    if robots:
        stats = {f"{r}.buffer.{k}": v + i for i, r in enumerate(robots) for k, v in stats.items()}
    norm = {"eps": 1e-8, "features": {"observation.state": {"type": "STATE", "shape": [STATE_DIM]},
                                      "action": {"type": "ACTION", "shape": [ACTION_DIM]}},
            "norm_map": config["normalization_mapping"]}
    for name, step, index in (("policy_preprocessor", "normalizer_processor", 5),
                              ("policy_postprocessor", "unnormalizer_processor", 0)):
        state_file = f"{name}_step_{index}_{step}.safetensors"
        save_safetensors(stats, folder / state_file)
        steps = [{"registry_name": "rename_observations_processor", "config": {"rename_map": {}}},
                 {"registry_name": step, "config": norm, "state_file": state_file}]
        (folder / f"{name}.json").write_text(json.dumps({"name": name, "steps": steps}))
    return stats


def _observation(n=2, seed=0):
    rng = np.random.default_rng(seed)
    obs = {"task": ["pick up the red block", "open the top drawer"][:n],
           "observation.state": rng.normal(size=(n, STATE_DIM)).astype(np.float32)}
    for c in CAMERAS:
        obs[c] = rng.integers(0, 255, (n, 24, 40, 3), dtype=np.uint8)
    return obs


def _reference(src: Path, tokenizer: Path, stats: dict, prefix: str = ""):
    """The kilovla model built from the same weights (read straight from LeRobot's file) with the same stats."""
    from kilovla.models.policy import VLAPolicy

    model = build_model("smolvla-tiny", cameras=["top", "wrist"])
    load_checkpoint(model, src / "model.safetensors")
    picked = {k: {s: stats[f"{prefix}{k}.{s}"].tolist() for s in ("mean", "std")} for k in ("observation.state", "action")}
    meta = tiny_meta(tokenizer, overrides={"cameras": ["top", "wrist"]}, stats=picked,
                     camera_map={c: c.removeprefix("observation.images.") for c in CAMERAS},
                     state_dim=STATE_DIM, action_dim=ACTION_DIM)
    return VLAPolicy(model, meta)


def _actions(policy, obs):
    torch.manual_seed(11)  # the same flow noise for both
    return policy.select_action(obs)


def test_convert_policy_gives_the_actions_of_the_same_weights_and_stats(tmp_path, tokenizer_json):
    from kilovla.policy_folder import PolicyFolder

    src, dst = tmp_path / "smolvla_libero", tmp_path / "converted"
    src.mkdir()
    stats = write_lerobot_folder(src)
    assert main(["convert-policy", str(src), str(dst), f"--policy.tokenizer={tokenizer_json}",
                 "--policy.preset=smolvla-tiny"]) == 0
    folder = PolicyFolder.open(dst)
    interface = folder.interface()
    assert (interface.cameras, interface.image_size, interface.n_action_steps, interface.state_widths,
            interface.action_dim) == (("top", "wrist"), (24, 40), 5, (STATE_DIM,), ACTION_DIM)
    assert folder.meta.image_resize == "pad_top_left" and folder.meta.tokenizer == "tokenizer/tokenizer.json"
    assert Checkpoint.open(dst).dtypes()["BF16"] == Checkpoint.open(src).dtypes()["BF16"]  # the VLM stays bf16
    converted = folder.load()
    obs = _observation()
    expected = _actions(_reference(src, tokenizer_json, stats), obs)
    assert expected.shape == (2, 8, ACTION_DIM) and np.abs(expected).max() > 0.1
    np.testing.assert_allclose(_actions(converted, obs), expected, rtol=1e-6, atol=1e-6)
    from kilovla.serve.engine import PolicyEngine, Request
    from kilovla.serve.protocol import to_policy_observation

    engine = PolicyEngine.load(dst, device="cpu")  # what `kilovla serve --policy.path=DST` runs
    one = {k: v[0] for k, v in obs.items()}
    [served], _ = engine.infer([Request(to_policy_observation(one, engine.inputs()), seed=0)])
    assert served.shape[-1] == ACTION_DIM and np.isfinite(served).all()


def test_convert_policy_takes_the_stats_of_the_chosen_robot(tmp_path, tokenizer_json):
    from kilovla.policy_folder import load_policy_folder

    src = tmp_path / "smolvla_base"
    src.mkdir()
    stats = write_lerobot_folder(src, robots=("so100", "so100-red"))
    argv = ["convert-policy", str(src), str(tmp_path / "a"), f"--policy.tokenizer={tokenizer_json}",
            "--policy.preset=smolvla-tiny"]
    with pytest.raises(KilovlaError, match=r"stats are kept per robot \(so100, so100-red\); choose one with "
                                           r"--policy.robot=NAME"):
        from kilovla.lerobot_policy import convert_lerobot_policy

        convert_lerobot_policy(src, tmp_path / "a", tokenizer_json, "smolvla-tiny")
    assert main([*argv, "--policy.robot=so100-red"]) == 0
    obs = _observation()
    np.testing.assert_allclose(_actions(load_policy_folder(tmp_path / "a"), obs),
                               _actions(_reference(src, tokenizer_json, stats, "so100-red.buffer."), obs),
                               rtol=1e-6, atol=1e-6)


def test_convert_policy_refuses_a_missing_stats_file_in_one_line_writing_nothing(tmp_path, tokenizer_json, capsys):
    src, dst = tmp_path / "lerobot", tmp_path / "out" / "converted"
    src.mkdir()
    write_lerobot_folder(src)
    (src / "policy_postprocessor_step_0_unnormalizer_processor.safetensors").unlink()
    rc = main(["convert-policy", str(src), str(dst), f"--policy.tokenizer={tokenizer_json}", "--policy.preset=smolvla-tiny"])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1
    assert err.startswith(f"error: {src / 'policy_postprocessor_step_0_unnormalizer_processor.safetensors'}: missing; ")
    assert not dst.exists() and not list(tmp_path.glob("out/.converted*"))


def test_convert_policy_refuses_weights_of_other_shapes_naming_the_file(tmp_path, tokenizer_json, capsys):
    src = tmp_path / "lerobot"
    src.mkdir()
    write_lerobot_folder(src)  # smolvla-tiny's weights; config.json's vlm_model_name says smolvla-base
    config = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**config, "resize_imgs_with_padding": [512, 512]}))
    assert main(["convert-policy", str(src), str(tmp_path / "x"), f"--policy.tokenizer={tokenizer_json}"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {src}: does not fit the model; missing keys: ") and err.count("\n") == 1
    assert not (tmp_path / "x").exists()


def test_eval_of_an_unconverted_lerobot_folder_says_how_to_convert_it(tmp_path, capsys):
    src = tmp_path / "lerobot"
    src.mkdir()
    write_lerobot_folder(src)
    assert main(["eval", f"--policy.path={src}", "--eval.n_episodes=1"]) == 2
    assert f"kilovla convert-policy {src} NEW_FOLDER" in capsys.readouterr().err


def test_convert_policy_refuses_a_state_without_stats_rather_than_leaving_it_unnormalised(tmp_path, tokenizer_json):
    """lerobot/smolvla_base's migrated files keep action stats per robot and none for the state: LeRobot then
    skips the state's normalisation silently; kilovla stops, naming the file and the stats it lacks."""
    from kilovla.lerobot_policy import convert_lerobot_policy

    src = tmp_path / "smolvla_base"
    src.mkdir()
    stats = write_lerobot_folder(src, robots=("so100",))
    stats_file = src / "policy_preprocessor_step_5_normalizer_processor.safetensors"
    save_safetensors({k: v for k, v in stats.items() if ".action." in k}, stats_file)
    with pytest.raises(KilovlaError, match=rf"^{stats_file}: no so100\.buffer\.observation\.state\.mean, "
                                           r"so100\.buffer\.observation\.state\.std \(mean_std normalisation"):
        convert_lerobot_policy(src, tmp_path / "out", tokenizer_json, "smolvla-tiny")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("case, said", [
    ("dst under a file", "cannot create it: {tmp}/afile is a file, not a folder"),
    ("preset of another family", "--policy.preset=pi0-tiny: not a SmolVLA preset (smolvla-tiny, smolvla-base)"),
    ("byte tokenizer", "--policy.tokenizer=byte: LeRobot's SmolVLA reads SmolVLM2's tokens"),
    ("a kilovla folder", "{tmp}/kilovla: a kilovla policy folder already (policy.json); use it as it is"),
])
def test_convert_policy_refuses_what_cannot_be_converted_in_one_line(tmp_path, tokenizer_json, capsys, case, said):
    src, dst = tmp_path / "lerobot", tmp_path / "out"
    src.mkdir()
    write_lerobot_folder(src)
    flags = [f"--policy.tokenizer={tokenizer_json}", "--policy.preset=smolvla-tiny"]
    if case == "dst under a file":
        (tmp_path / "afile").write_text("mine")
        dst = tmp_path / "afile" / "sub"
    elif case == "preset of another family":
        flags[1] = "--policy.preset=pi0-tiny"
    elif case == "byte tokenizer":
        flags[0] = "--policy.tokenizer=byte"
    else:
        src = tmp_path / "kilovla"
        src.mkdir()
        (src / "policy.json").write_text("{}")
    assert main(["convert-policy", str(src), str(dst), *flags]) == 2
    err = capsys.readouterr().err
    assert said.format(tmp=tmp_path) in err and err.count("\n") == 1
    assert not dst.exists()


def test_a_folder_s_recorded_tokenizer_wins_over_a_byte_preset(tmp_path, tokenizer_json):
    """Fine-tuning a converted SmolVLA folder on smolvla-tiny (a byte preset) kept SmolVLM2's token ids
    only if the folder's tokenizer is taken: the byte tokenizer would silently read other ids."""
    from kilovla.models.tokenize import find_tokenizer

    assert find_tokenizer("byte", None, [], "smolvla-tiny", recorded=lambda: str(tokenizer_json)) == str(tokenizer_json)
    assert find_tokenizer("byte", None, [], "smolvla-tiny", recorded=lambda: None) == "byte"
