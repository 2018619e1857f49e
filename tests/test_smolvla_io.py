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
VOCAB = 320  # the tokenizer's size: smolvla-tiny's embedding is widened to it


def write_tokenizer(folder: Path, template: bool = False) -> Path:
    """A byte-level BPE tokenizer.json as GPT-2's and SmolVLM2's are; `template`: its post-processor wraps each
    text in <|im_start|> ... <|im_end|> (a file that adds special tokens, which the prompt must then carry)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(TEXTS, trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=SPECIALS,
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    if template:
        tok.post_processor = processors.TemplateProcessing(
            single="<|im_start|> $A <|im_end|>", special_tokens=[(s, tok.token_to_id(s)) for s in SPECIALS[1:]])
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    return folder / "tokenizer.json"


def tiny_meta(tokenizer, **fields) -> PolicyMeta:
    stats = {k: {"mean": [0.0] * n, "std": [1.0] * n} for k, n in (("observation.state", 3), ("action", 4))}
    values = dict(preset="smolvla-tiny", overrides={"text": {"vocab_size": VOCAB}},
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
    model = build_model("smolvla-tiny", text={"vocab_size": VOCAB})
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
