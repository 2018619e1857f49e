"""Weight files follow the umask, like every other file kilovla writes."""

import os
import stat
from pathlib import Path

import pytest
import torch

from kilovla.models.checkpoints import save_safetensors
from kilovla.models.policy import VLAPolicy
from kilovla.models.presets import build_model
from kilovla.models.processor import PolicyMeta

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def _metaworld_policy() -> VLAPolicy:
    """A random tiny pi0.5 that fits Meta-World (4-D state and actions, two cameras)."""
    stats = {"observation.state": {"q01": [-1] * 4, "q99": [1] * 4}, "action": {"q01": [-1] * 4, "q99": [1] * 4}}
    meta = PolicyMeta(preset="pi05-tiny", overrides={"disabled_cameras": ["right_wrist_0_rgb"]},
                      camera_map={"observation.images.scene": "base_0_rgb", "observation.images.wrist": "left_wrist_0_rgb"},
                      state_dim=4, action_dim=4, stats=stats, n_action_steps=4)
    return VLAPolicy(build_model("pi05-tiny", seed=1, disabled_cameras=("right_wrist_0_rgb",)), meta)


# -- permissions -------------------------------------------------------------------------------------------
@pytest.fixture()
def umask_022():
    old = os.umask(0o022)
    yield
    os.umask(old)


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_saved_weights_follow_the_umask(tmp_path, umask_022):
    save_safetensors({"w": torch.zeros(2)}, tmp_path / "model.safetensors")
    assert _mode(tmp_path / "model.safetensors") == 0o644


def test_a_quantized_folder_follows_the_umask(tmp_path, umask_022):
    from kilovla.quant.fp8 import Fp8Config
    from kilovla.quant.folder import quantize_policy_folder

    _metaworld_policy().save(tmp_path / "src")
    quantize_policy_folder(tmp_path / "src", tmp_path / "q", Fp8Config(), latency_repeats=1)
    assert _mode(tmp_path / "q") == 0o755
    files = [p for p in (tmp_path / "q").rglob("*") if p.is_file()]
    assert "model.safetensors" in {p.name for p in files}
    assert {p.relative_to(tmp_path / "q").as_posix(): _mode(p) for p in files} == {
        p.relative_to(tmp_path / "q").as_posix(): 0o644 for p in files}
