"""`kilovla convert-policy` of an Isaac-GR00T N1.7 folder (nvidia_policy.py): a fake published folder at the
tiny preset's shapes, in NVIDIA's file formats (sharded weights in its key layout, config.json,
processor_config.json, statistics.json, embodiment_id.json) with two embodiment tags."""

import json

import numpy as np
import pytest
import torch

from kilovla.cli import main
from kilovla.models.presets import build_model

TAGS = {  # tag: (video keys, state keys and widths, action keys and widths, action horizon)
    "libero_sim": (["image", "wrist_image"], {"eef_pos": 3, "gripper": 2}, {"eef_delta": 3, "grip": 1}, 6),
    "new_embodiment": (["ego_view"], {"arm": 4}, {"arm": 4, "hand": 2}, 8),
}
IDS = {"libero_sim": 1, "new_embodiment": 0}
CONFIG = {
    "model_type": "Gr00tN1d7", "architectures": ["Gr00tN1d7"], "model_name": "nvidia/Cosmos-Reason2-2B",
    "backbone_model_type": "qwen", "select_layer": 3, "backbone_embedding_dim": 32, "hidden_size": 32,
    "input_embedding_dim": 32, "action_horizon": 8, "max_state_dim": 8, "max_action_dim": 8,
    "max_num_embodiments": 2, "max_seq_len": 64, "attend_text_every_n_blocks": 2, "num_inference_timesteps": 6,
    "num_timestep_buckets": 1000, "use_alternate_vl_dit": True, "use_vlln": True, "add_pos_embed": True,
    "state_history_length": 1, "use_percentiles": True, "noise_beta_alpha": 1.5, "noise_beta_beta": 1.0,
    "noise_s": 0.999, "state_dropout_prob": 0.8,
    "diffusion_model_cfg": {"positional_embeddings": None, "num_layers": 4, "num_attention_heads": 2,
                            "attention_head_dim": 16, "norm_type": "ada_norm", "dropout": 0.2,
                            "final_dropout": True, "output_dim": 32, "interleave_self_attention": True},
    "vl_self_attention_cfg": {"num_layers": 1, "num_attention_heads": 2, "attention_head_dim": 16,
                              "dropout": 0.2, "final_dropout": True, "positional_embeddings": None},
}


def _modality(keys, horizon=1, relative=False):
    configs = None
    if horizon > 1:  # the action modality: one action config per key, as to_json_serializable writes them
        configs = [{"rep": "RELATIVE" if relative else "ABSOLUTE", "type": "NON_EEF", "format": "DEFAULT",
                    "state_key": None} for _ in keys]
    return {"delta_indices": list(range(horizon)), "modality_keys": list(keys), "sin_cos_embedding_keys": None,
            "mean_std_embedding_keys": None, "action_configs": configs}


def _stats(widths, seed):
    rng = np.random.default_rng(seed)
    out = {}
    for key, n in widths.items():
        lo = rng.uniform(-2, -1, n)
        hi = rng.uniform(1, 2, n)
        out[key] = {"min": (lo - 0.5).tolist(), "max": (hi + 0.5).tolist(), "q01": lo.tolist(), "q99": hi.tolist(),
                    "mean": ((lo + hi) / 2).tolist(), "std": ((hi - lo) / 4).tolist()}
    return out


def write_nvidia_folder(folder, tags=TAGS, relative=False):
    """NVIDIA's N1.7 folder at groot-n17-tiny's shapes; returns the source model and the statistics."""
    from kilovla.models.checkpoints import save_sharded

    folder.mkdir(parents=True, exist_ok=True)
    model = build_model("groot-n17-tiny", seed=5)
    state = dict(model.state_dict())
    state["backbone.model.lm_head.weight"] = state["backbone.model.model.language_model.embed_tokens.weight"]
    state = {k: v.clone() for k, v in state.items()}
    total = sum(v.numel() * v.element_size() for v in state.values())
    files = save_sharded({k: (tuple(v.shape), v.dtype) for k, v in state.items()}, state.__getitem__, folder,
                         max_shard_bytes=int(total * 0.6))
    assert [f.name for f in files] == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    (folder / "config.json").write_text(json.dumps(CONFIG, indent=2))
    configs, statistics = {}, {}
    for i, (tag, (video, state_keys, action_keys, horizon)) in enumerate(tags.items()):
        configs[tag] = {"video": _modality(video), "state": _modality(state_keys),
                        "action": _modality(action_keys, horizon, relative),
                        "language": _modality(["annotation.human.action.task_description"])}
        statistics[tag] = {"state": _stats(state_keys, 2 * i), "action": _stats(action_keys, 2 * i + 1)}
    kwargs = {"modality_configs": configs, "image_crop_size": None, "image_target_size": None,
              "use_albumentations": True, "model_name": "nvidia/Cosmos-Reason2-2B", "model_type": "qwen",
              "formalize_language": True, "max_state_dim": 8, "max_action_dim": 8, "max_action_horizon": 8,
              "use_percentiles": True, "use_mean_std": False, "clip_outliers": True,
              "apply_sincos_state_encoding": False, "use_relative_action": relative, "exclude_state": False,
              "state_dropout_prob": 0.0}
    (folder / "processor_config.json").write_text(json.dumps({"processor_class": "Gr00tN1d7Processor",
                                                               "processor_kwargs": kwargs}, indent=2))
    (folder / "statistics.json").write_text(json.dumps(statistics, indent=2))
    (folder / "embodiment_id.json").write_text(json.dumps(IDS, indent=2))
    return model, statistics


def _convert(src, dst, *flags):
    return main(["convert-policy", str(src), str(dst), "--policy.tokenizer=byte", "--policy.preset=groot-n17-tiny",
                 *flags])


def _concat(stats, stat):
    return [v for entry in stats.values() for v in entry[stat]]


@pytest.mark.parametrize("tag", list(TAGS))
def test_convert_takes_weights_cameras_dims_and_stats_of_the_chosen_tag(tmp_path, tag):
    from kilovla.policy_folder import load_policy_folder

    src, dst = tmp_path / "GR00T-N1.7-LIBERO" / "libero_10", tmp_path / "converted"
    model, statistics = write_nvidia_folder(src)
    assert _convert(src, dst, f"--policy.robot={tag}") == 0
    policy = load_policy_folder(dst)
    for key, value in model.state_dict().items():
        assert torch.equal(policy.model.state_dict()[key], value), key
    video, state_keys, action_keys, horizon = TAGS[tag]
    meta = policy.meta
    assert meta.camera_map == {f"observation.images.{v}": v for v in video}
    assert meta.overrides == {"num_inference_steps": 6, "cameras": video}
    assert (meta.state_keys, meta.state_dim, meta.action_dim) == (["observation.state"], sum(state_keys.values()),
                                                                   sum(action_keys.values()))
    assert (meta.n_action_steps, meta.embodiment_id, meta.normalization) == (horizon, IDS[tag], "quantile")
    stats = statistics[tag]
    for feature, modality in (("observation.state", "state"), ("action", "action")):
        assert meta.stats[feature] == {s: _concat(stats[modality], s) for s in ("q01", "q99")}
    # NVIDIA's percentile mode: q01 -> -1, q99 -> 1, key by key in the modality config's order
    q01, q99 = np.array(_concat(stats["action"], "q01")), np.array(_concat(stats["action"], "q99"))
    np.testing.assert_allclose(policy.processor.unnormalize_actions(np.stack([-np.ones_like(q01), np.ones_like(q99)])),
                               np.stack([q01, q99]), rtol=1e-6)
    state = np.array(_concat(stats["state"], "q99"))
    batch = policy.processor.observation_batch({
        **{f"observation.images.{v}": np.zeros((1, 32, 32, 3), np.uint8) for v in video},
        "observation.state": state[None].astype(np.float32), "task": ["pick it up"]})
    np.testing.assert_allclose(batch.state[0, :len(state)].numpy(), np.ones(len(state)), rtol=1e-5)
    assert batch.embodiment_id.tolist() == [IDS[tag]]
    assert json.loads((dst / "policy.json").read_text())["init_from"]["embodiment_tag"] == tag


def test_with_the_backbones_tokenizer_the_prompt_is_nvidias_chat_template(tmp_path, qwen3vl_dir):
    """A real Qwen3-VL tokenizer (its chat template beside it): the converted policy places each camera at its
    <|image_pad|> run, as NVIDIA's processor does, and the folder carries the template."""
    from kilovla.models.tokenize import QwenTokenizer, qwen3vl_prompt_ids
    from kilovla.policy_folder import load_policy_folder

    src, dst = tmp_path / "nvidia", tmp_path / "converted"
    write_nvidia_folder(src)
    assert main(["convert-policy", str(src), str(dst), f"--policy.tokenizer={qwen3vl_dir / 'tokenizer.json'}",
                 "--policy.preset=groot-n17-tiny", "--policy.robot=libero_sim"]) == 0
    policy = load_policy_folder(dst)
    tok = QwenTokenizer(qwen3vl_dir / "tokenizer.json")
    pad = tok.token_id("<|image_pad|>")
    assert policy.meta.overrides["image_token_id"] == pad and (dst / "tokenizer" / "chat_template.jinja").is_file()
    ids, placeholders = policy.processor.prompt_ids("Open the drawer.")
    assert ids == qwen3vl_prompt_ids(tok, "open the drawer", 2, 4, pad) and placeholders == 8


def test_the_only_tag_needs_no_robot_flag_and_the_assets_may_lie_in_processor(tmp_path):
    from kilovla.policy_folder import load_policy_folder

    src = tmp_path / "one"
    write_nvidia_folder(src, tags={"libero_sim": TAGS["libero_sim"]})
    (src / "processor").mkdir()
    for name in ("processor_config.json", "statistics.json", "embodiment_id.json"):
        (src / name).rename(src / "processor" / name)
    assert _convert(src, tmp_path / "out") == 0
    assert load_policy_folder(tmp_path / "out").meta.embodiment_id == IDS["libero_sim"]
    from kilovla.serve.engine import PolicyEngine, Request
    from kilovla.serve.protocol import to_policy_observation

    engine = PolicyEngine.load(tmp_path / "out", device="cpu")  # what `kilovla serve --policy.path=DST` runs
    rng = np.random.default_rng(0)
    one = {"task": "put the bowl on the plate", "observation.state": rng.normal(size=5).astype(np.float32),
           **{f"observation.images.{v}": rng.integers(0, 255, (48, 64, 3), dtype=np.uint8)
              for v in ("image", "wrist_image")}}
    [served], _ = engine.infer([Request(to_policy_observation(one, engine.inputs()), seed=0)])
    assert served.shape[-1] == 4 and np.isfinite(served).all()


@pytest.mark.parametrize("case, said", [
    ("missing statistics", "{src}/statistics.json: missing (an Isaac-GR00T N1.7 folder holds"),
    ("unknown tag", "--policy.robot=gr1: no such embodiment tag with statistics; it has libero_sim, new_embodiment"),
    ("two tags", "2 embodiment tags with statistics (libero_sim, new_embodiment); choose one with --policy.robot=TAG"),
    ("relative actions", "modality_configs.libero_sim.action: relative actions ['eef_delta', 'grip'] "
                         "(use_relative_action): kilovla's actions are absolute"),
    ("mixed modes", "keys normalised differently (state.eef_pos: mean_std, state.gripper: quantile"),
    ("per-step stats", "libero_sim.action.grip.q01 must be a list of numbers (per-step statistics"),
    ("unsupported model", "{src}/config.json: use_alternate_vl_dit=False is not supported"),
    ("task as given", "formalize_language is False: kilovla's N1.7 prompt formalises the task"),
    ("built-in projector index", "{src}/embodiment_id.json: libero_sim's projector index 2 is not below "
                                 "config.json's max_num_embodiments 2"),
])
def test_what_cannot_be_converted_is_refused_in_one_line_writing_nothing(tmp_path, capsys, case, said):
    src, dst = tmp_path / "nvidia", tmp_path / "out"
    write_nvidia_folder(src, relative=case == "relative actions")
    flags = ["--policy.robot=libero_sim"]
    processor, stats = json.loads((src / "processor_config.json").read_text()), json.loads(
        (src / "statistics.json").read_text())
    if case == "missing statistics":
        (src / "statistics.json").unlink()
    elif case == "unknown tag":
        flags = ["--policy.robot=gr1"]
    elif case == "two tags":
        flags = []
    elif case == "mixed modes":
        state = processor["processor_kwargs"]["modality_configs"]["libero_sim"]["state"]
        state["mean_std_embedding_keys"] = ["eef_pos"]
    elif case == "per-step stats":
        stats["libero_sim"]["action"]["grip"]["q01"] = [[0.0]] * 6
    elif case == "built-in projector index":  # no embodiment_id.json: Isaac-GR00T's table gives libero_sim 2
        (src / "embodiment_id.json").unlink()
    elif case == "task as given":
        processor["processor_kwargs"]["formalize_language"] = False
    elif case == "unsupported model":
        (src / "config.json").write_text(json.dumps({**CONFIG, "use_alternate_vl_dit": False}))
    (src / "processor_config.json").write_text(json.dumps(processor))
    if case != "missing statistics":
        (src / "statistics.json").write_text(json.dumps(stats))
    assert _convert(src, dst, *flags) == 2
    err = capsys.readouterr().err
    assert said.format(src=src) in err and err.count("\n") == 1, err
    assert not dst.exists() and [p.name for p in tmp_path.iterdir()] == ["nvidia"]
