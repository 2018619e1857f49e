"""Checkpoint key maps (openpi / LeRobot layouts, strict) and learned policies in closed loop."""

import numpy as np
import pytest
import torch

from kilovla.errors import KilovlaError
from kilovla.models.checkpoints import CheckpointError, load_checkpoint, save_safetensors
from kilovla.models.policy import VLAPolicy
from kilovla.policy_folder import load_policy_folder, save_policy
from kilovla.models.processor import PolicyMeta
from kilovla.models.presets import build_model

EMBED = "paligemma_with_expert.paligemma.model.language_model.embed_tokens.weight"


def _random_state(name):
    model = build_model(name, seed=3)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.1)
    return model, {k: v.clone() for k, v in model.state_dict().items()}


def _same_weights(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        torch.testing.assert_close(sa[k], sb[k], msg=k)


def test_lerobot_layout_loads_strictly(tmp_path):
    src, state = _random_state("pi05-tiny")
    lerobot = {f"model.{k}": v for k, v in state.items()}
    # LeRobot pi05 exports: tied LM head instead of the embedding, old time-MLP names, pi0's state_proj,
    # and the action expert's unused LM head.
    lerobot["model.paligemma_with_expert.paligemma.lm_head.weight"] = lerobot.pop(f"model.{EMBED}")
    for part in ("weight", "bias"):
        lerobot[f"model.action_time_mlp_in.{part}"] = lerobot.pop(f"model.time_mlp_in.{part}")
    lerobot["model.state_proj.weight"] = torch.zeros(32, 8)
    lerobot["model.paligemma_with_expert.gemma_expert.lm_head.weight"] = torch.zeros(258, 32)
    save_safetensors(lerobot, tmp_path / "model.safetensors")
    dst = build_model("pi05-tiny", seed=9)
    assert load_checkpoint(dst, tmp_path) == "lerobot"
    _same_weights(src, dst)


def test_openpi_layout_loads_strictly(tmp_path):
    src, state = _random_state("pi0-tiny")
    save_safetensors(state, tmp_path / "openpi.safetensors")
    dst = build_model("pi0-tiny", seed=9)
    assert load_checkpoint(dst, tmp_path / "openpi.safetensors") == "openpi"
    _same_weights(src, dst)


def test_mismatches_are_listed_in_one_message(tmp_path):
    _, state = _random_state("pi05-tiny")
    state.pop("action_out_proj.bias")
    state["action_in_proj.weight"] = torch.zeros(32, 9)
    state["extra.head.weight"] = torch.zeros(2)
    save_safetensors(state, tmp_path / "model.safetensors")
    with pytest.raises(CheckpointError) as err:
        load_checkpoint(build_model("pi05-tiny"), tmp_path)
    msg = str(err.value)
    assert msg.startswith(f"{tmp_path}: does not fit the model")
    assert "missing keys: action_out_proj.bias" in msg
    assert "unexpected keys: extra.head.weight" in msg
    assert "action_in_proj.weight: checkpoint (32, 9) vs model (32, 8)" in msg


def test_a_checkpoint_of_another_model_is_refused(tmp_path):
    _, state = _random_state("pi0-tiny")
    save_safetensors(state, tmp_path / "model.safetensors")
    with pytest.raises(CheckpointError, match="missing keys: .*time_mlp_in"):
        load_checkpoint(build_model("pi05-tiny"), tmp_path)


def test_corrupt_and_missing_files(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"not safetensors")
    with pytest.raises(CheckpointError, match="cannot read safetensors"):
        load_checkpoint(build_model("pi05-tiny"), tmp_path)
    with pytest.raises(CheckpointError, match="no such checkpoint file"):
        load_checkpoint(build_model("pi05-tiny"), tmp_path / "nope.safetensors")


def _metaworld_policy(action_dim=4):
    stats = {"observation.state": {"q01": [-1] * 4, "q99": [1] * 4}, "action": {"q01": [-1] * action_dim, "q99": [1] * action_dim}}
    meta = PolicyMeta(preset="pi05-tiny", overrides={"disabled_cameras": ["right_wrist_0_rgb"]},
                      camera_map={"observation.images.scene": "base_0_rgb", "observation.images.wrist": "left_wrist_0_rgb"},
                      state_dim=4, action_dim=action_dim, stats=stats, n_action_steps=4)
    return VLAPolicy(build_model("pi05-tiny", disabled_cameras=("right_wrist_0_rgb",)), meta)


def test_policy_round_trips_and_acts(tmp_path):
    policy = _metaworld_policy()
    save_policy(policy, tmp_path / "ckpt")
    loaded = load_policy_folder(tmp_path / "ckpt")
    obs = {"observation.images.scene": np.zeros((2, 40, 40, 3), np.uint8),
           "observation.images.wrist": np.full((2, 40, 40, 3), 200, np.uint8),
           "observation.state": np.zeros((2, 4), np.float32), "task": ["reach the red goal", "close the drawer"]}
    torch.manual_seed(0)
    a = policy.select_action(obs)
    torch.manual_seed(0)
    b = loaded.select_action(obs)
    assert a.shape == (2, 8, 4)
    np.testing.assert_allclose(a, b, atol=1e-6)


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_learned_policies_run_in_closed_loop(tmp_path):
    from kilovla.cli import main

    save_policy(_metaworld_policy(), tmp_path / "ckpt")
    assert main(["eval", "--policy", str(tmp_path / "ckpt"), "--tasks", "reach-v3", "--episodes", "1",
                 "--resolution", "32", "--max-steps", "12", "--videos", "0", "--out", str(tmp_path / "ev")]) == 0
    save_policy(_metaworld_policy(action_dim=7), tmp_path / "bad")
    with pytest.raises(KilovlaError, match=r"action_dim 7 \(policy\) vs 4 \(metaworld\)"):
        from kilovla.eval.closed_loop import evaluate, load_policy
        from kilovla.eval.settings import EvalSettings

        evaluate(load_policy(str(tmp_path / "bad")), EvalSettings(tasks=["reach-v3"], episodes=1))


def test_checkpoint_folders_are_pruned_in_step_order_and_replaced_whole(tmp_path):
    from kilovla.train.checkpoint import prune, put_in_place

    root = tmp_path / "checkpoints"
    for step in (999_998, 999_999, 1_000_000, 40):  # as strings, step_1000000 sorts first
        (root / f"step_{step:06d}").mkdir(parents=True)
    prune(root, keep=2)
    assert sorted(p.name for p in root.iterdir()) == ["step_1000000", "step_999999"]
    # Writing a step that exists swaps the new folder in whole; nothing of the old one stays.
    (root / "step_999999" / "old.txt").write_text("old")
    new = root / ".step_999999.tmp"
    new.mkdir()
    (new / "model.safetensors").write_text("new")
    put_in_place(new, root / "step_999999")
    assert sorted(p.name for p in (root / "step_999999").iterdir()) == ["model.safetensors"]
    assert sorted(p.name for p in root.iterdir()) == ["step_1000000", "step_999999"]


def test_peak_memory_is_the_peak_not_the_current_resident_set():
    import psutil

    from kilovla.train.trainer import _memory_mb

    before = _memory_mb(torch.device("cpu"))
    block = np.ones(400 * 2**20 // 8)  # 400 MiB, touched
    held = psutil.Process().memory_info().rss / 2**20
    del block
    assert psutil.Process().memory_info().rss / 2**20 < held - 300  # returned to the system
    assert _memory_mb(torch.device("cpu")) >= max(before, held) - 1
