"""kilovla.policy_folder: policy.json read once into a typed description, the interface it declares, its writers."""

import dataclasses
import json
import shutil
from pathlib import Path

import pytest
import torch

from kilovla.cli import main
from kilovla.errors import KilovlaError
from kilovla.models.policy import VLAPolicy
from kilovla.models.presets import build_model
from kilovla.models.processor import PolicyMeta
from kilovla.policy_folder import POLICY_JSON, Interface, PolicyFolder, save_policy, write_policy_json


def _meta(**fields) -> PolicyMeta:
    return PolicyMeta(preset="pi05-tiny", camera_map={"observation.images.scene": "base_0_rgb"},
                      state_keys=["observation.state", "observation.environment_state"], state_dim=43, action_dim=4,
                      stats={"observation.state": {"mean": [0.0] * 4, "q01": [0.0] * 4, "q99": [1.0] * 4},
                             "observation.environment_state": {"q01": [0.0] * 39, "q99": [1.0] * 39},
                             "action": {"q01": [0.0] * 4, "q99": [1.0] * 4}},
                      n_action_steps=5, image_size=[32, 40], overrides={"chunk_size": 8}, **fields)


@pytest.mark.parametrize("text, message", [
    (None, "not a policy folder \\(no policy.json; a policy folder holds policy.json and model.safetensors\\)"),
    ("{", "policy.json: not a policy description: not JSON"),
    ("[1, 2]", "policy.json: not a policy description: expected a JSON object, found a list"),
    ('{"preset": "pi05-tiny", "colour": "red"}', "policy.json: not a policy description: "),
    ('{"action_dim": 4}', "policy.json: not a policy description: "),
])
def test_a_folder_that_is_not_a_policy_is_named_with_its_file(tmp_path, text, message):
    if text is not None:
        (tmp_path / POLICY_JSON).write_text(text)
    with pytest.raises(KilovlaError, match=message) as err:
        PolicyFolder.open(tmp_path)
    assert str(err.value).startswith(str(tmp_path if text is None else tmp_path / POLICY_JSON))


LEGACY_DEMO = Path(__file__).parent / "fixtures" / "legacy_a039621" / "demo_checkpoint"


@pytest.mark.parametrize("key, value, message", [
    ("action_dim", "four", "key 'action_dim': 'four' is not a positive int"),
    ("stats", None, "key 'stats': None is not a mapping"),
    ("n_action_steps", "x", "key 'n_action_steps': 'x' is not null or a positive int"),
    ("n_action_steps", -3, "key 'n_action_steps': -3 is not null or a positive int"),
    ("image_size", -32, "key 'image_size': -32 is not null or a list of positive ints"),
    ("image_size", [-32, 32], "key 'image_size': \\[-32, 32\\] is not null or a list of positive ints"),
    ("state_keys", "observation.state", "key 'state_keys': 'observation.state' is not a list of strings"),
    ("state_in_prompt", 1, "key 'state_in_prompt': 1 is not true or false"),
    ("preset", None, "missing key 'preset'"),
    ("future_field", 1, "unknown key 'future_field'"),  # a typo or a later version's key: refused, not ignored
])
def test_a_hand_edited_policy_json_is_refused_in_one_line_naming_the_key(tmp_path, capsys, key, value, message):
    folder = tmp_path / "policy"
    shutil.copytree(LEGACY_DEMO, folder)
    fields = json.loads((folder / POLICY_JSON).read_text())
    if key == "preset":
        del fields[key]
    else:
        fields[key] = value
    (folder / POLICY_JSON).write_text(json.dumps(fields))
    with pytest.raises(KilovlaError, match=f"^{folder / POLICY_JSON}: not a policy description: {message}$"):
        PolicyFolder.open(folder)
    assert main(["eval", f"--policy.path={folder}", "--env.type=metaworld", "--env.task=reach-v3"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"{folder / POLICY_JSON}: not a policy description: " in err, err


@pytest.mark.parametrize("lacks", ["policy.json", "model.safetensors"])
@pytest.mark.parametrize("command", ["eval", "serve", "rl", "quantize"])
def test_every_command_names_a_folder_that_is_not_a_policy_the_same_way(tmp_path, capsys, command, lacks):
    folder = tmp_path / "policy"
    shutil.copytree(LEGACY_DEMO, folder)
    (folder / lacks).unlink()
    flags = {"eval": ["--env.type=metaworld", "--env.task=reach-v3", f"--output_dir={tmp_path / 'out'}"],
             "serve": ["--serve.device=cpu"], "rl": [f"--run_dir={tmp_path / 'rl'}"],
             "quantize": [f"--output_dir={tmp_path / 'q'}"]}[command]
    assert main([command, f"--policy.path={folder}", *flags]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].endswith(f"{folder}: not a policy folder (no {lacks}; a policy folder holds "
                                             "policy.json and model.safetensors)"), err


def test_the_interface_is_what_the_folder_declares(tmp_path):
    write_policy_json(tmp_path, _meta())
    assert PolicyFolder.open(tmp_path).interface() == Interface(
        name="pi05-tiny", action_dim=4, state_dim=43, state_keys=("observation.state", "observation.environment_state"),
        state_widths=(4, 39), cameras=("scene",), camera_keys=("observation.images.scene",), image_size=(32, 40),
        n_action_steps=5, chunk_length=8)
    assert PolicyFolder.open(tmp_path).interface(name="runs/a").name == "runs/a"


def test_a_state_key_without_stats_is_named(tmp_path):
    meta = _meta()
    del meta.stats["observation.environment_state"]
    write_policy_json(tmp_path, meta)
    declared = PolicyFolder.open(tmp_path).interface()
    assert declared.state_widths == (4, None)
    with pytest.raises(KilovlaError, match="policy.json: no stats for state key 'observation.environment_state'"):
        declared.checked_state_widths()


def test_the_variants_are_read_once_and_typed(tmp_path):
    write_policy_json(tmp_path, _meta(lora={"rank": 4, "merged": False}), quantization={"quant_method": "fp8"})
    folder = PolicyFolder.open(tmp_path)
    assert folder.quantization == {"quant_method": "fp8"} and folder.adapters and folder.residual_spec() is None
    assert not folder.has_ema and not folder.sharded and folder.rl_state() is None
    (tmp_path / "state").mkdir()
    (tmp_path / "ema.safetensors").write_bytes(b"")
    (tmp_path / "rl_state.json").write_text('{"version": 3}')
    assert folder.sharded and folder.has_ema and folder.rl_state() == {"version": 3}


def test_a_quantized_folder_is_refused_in_the_callers_words(tmp_path):
    write_policy_json(tmp_path, _meta(), quantization={"quant_method": "fp8"})
    with pytest.raises(KilovlaError, match=r"already quantized \(policy.json has a quantization_config\); do not"):
        PolicyFolder.open(tmp_path).refuse_quantized("do not", said="already quantized")
    write_policy_json(tmp_path, _meta())
    PolicyFolder.open(tmp_path).refuse_quantized("do not")  # float weights pass


def test_fields_an_older_folder_lacks_are_not_recorded(tmp_path):
    fields = {k: v for k, v in json.loads(json.dumps(_meta().__dict__)).items() if k != "image_resize"}
    (tmp_path / POLICY_JSON).write_text(json.dumps(fields))
    folder = PolicyFolder.open(tmp_path)
    assert "image_resize" not in folder.recorded and "state_keys" in folder.recorded
    assert folder.meta.image_resize == "stretch"  # the loader's default for it


def test_a_saved_policy_loads_back_the_same(tmp_path):
    torch.manual_seed(0)
    meta = dataclasses.replace(_meta(), state_keys=["observation.state"], state_dim=4)
    policy = VLAPolicy(build_model("pi05-tiny", chunk_size=8), meta)
    save_policy(policy, tmp_path / "p")
    assert sorted(p.name for p in (tmp_path / "p").iterdir()) == ["model.safetensors", "policy.json"]  # no temp left
    loaded = PolicyFolder.open(tmp_path / "p").load()
    assert loaded.meta == policy.meta and loaded.source == str(tmp_path / "p") and loaded.ema is False
    for k, v in policy.model.state_dict().items():
        torch.testing.assert_close(loaded.model.state_dict()[k], v, msg=k)
    with pytest.raises(KilovlaError, match="ema.safetensors: missing; only runs with ema_decay"):
        PolicyFolder.open(tmp_path / "p").load(ema=True)


@pytest.mark.parametrize("name, family", [("pi05-tiny", "pi05"), ("pi0-tiny", "pi05"), ("groot-tiny", "groot"),
                                          ("smolvla-tiny", "smolvla")])
def test_policy_json_records_the_presets_family(tmp_path, name, family):
    write_policy_json(tmp_path, PolicyMeta(preset=name, action_dim=4))
    assert json.loads((tmp_path / POLICY_JSON).read_text())["family"] == family
    assert PolicyFolder.open(tmp_path).family == family


def test_a_folder_written_before_the_family_was_recorded_still_names_it():
    assert "family" not in json.loads((LEGACY_DEMO / POLICY_JSON).read_text())
    assert PolicyFolder.open(LEGACY_DEMO).family == "pi05"


def test_a_family_that_contradicts_the_preset_is_refused(tmp_path):
    write_policy_json(tmp_path, PolicyMeta(preset="smolvla-tiny", action_dim=4))
    fields = json.loads((tmp_path / POLICY_JSON).read_text())
    (tmp_path / POLICY_JSON).write_text(json.dumps({**fields, "family": "groot"}))
    with pytest.raises(KilovlaError, match="not a policy description: key 'family': 'groot', but preset "
                                           "'smolvla-tiny' is a 'smolvla' model$"):
        PolicyFolder.open(tmp_path)
