"""An RL checkpoint, run_dir/checkpoints/step_NNNNNN: a policy folder (`write_rl_policy_files`: the weight
files, replay.safetensors, policy.json, learner.pt) plus rl_state.json (what resumes the run: version,
counters, each env slot's next seed) and config.yaml; `read_learner_state` reads learner.pt back
(weights-only) with the replay buffer.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from kilovla import config as config_mod
from kilovla.models.processor import PolicyMeta
from kilovla.policy_folder import RL_STATE, write_rl_policy_files
from kilovla.rl.config import RLConfig
from kilovla.train import checkpoint as ckpt


def replay_rows(learner_state: dict | None) -> int:
    """Rows in a checkpoint's saved replay (0 without one). Residual SAC's and filtered BC's rings hold
    different columns (`reward`, `chunk`, ...), each with one row per stored transition."""
    return max((len(v) for v in (learner_state or {}).get("replay", {}).values()), default=0)


def read_learner_state(folder: Path) -> dict:
    """learner.pt (weights-only), with the replay buffer of residual SAC or filtered BC from replay.safetensors."""
    from kilovla.models.checkpoints import read_safetensors
    from kilovla.safe_load import load_torch

    state = load_torch(folder / "learner.pt")
    if (folder / "replay.safetensors").is_file():
        state["replay"] = read_safetensors(folder / "replay.safetensors")
    return state


def write_checkpoint(cfg: RLConfig, version: int, learner_state: dict, meta: PolicyMeta, rl_state: dict,
                     keep: int) -> Path:
    """Policy version `version` as run_dir/checkpoints/step_NNNNNN, written aside and moved in place whole; the
    `latest` pointer follows it and only the newest `keep` stay."""
    root = Path(cfg.run_dir) / "checkpoints"
    folder = root / f"step_{version:06d}"
    tmp = root / f".{folder.name}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    write_rl_policy_files(tmp, learner_state, meta)
    (tmp / RL_STATE).write_text(json.dumps(rl_state, indent=2))
    (tmp / "config.yaml").write_text(config_mod.dump_yaml(cfg))
    ckpt.put_in_place(tmp, folder)
    ckpt.point_latest(root, folder)
    ckpt.prune(root, keep)
    return folder
