"""An RL run's folder without Ray: resuming an earlier checkpoint starts a branch (the later checkpoints
move aside, as a supervised run's do), and a run that made no policy version still reports its learner's
totals and the 0-updates warning. Fast: a hand-made checkpoints/ layout, a stand-in for the actors."""

import json
import logging
import time
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import save_file

from kilovla.rl import runner
from kilovla.rl import loops

# What run() reads of a policy folder before Ray starts: a tiny pi0 at 32 px with Meta-World's cameras.
META = {"preset": "pi0-tiny", "action_dim": 4, "state_dim": 4, "state_keys": ["observation.state"],
        "camera_map": {"observation.images.scene": "base_0_rgb", "observation.images.wrist": "left_wrist_0_rgb"},
        "image_size": [32, 32]}


class _RayStarted(Exception):
    """Stands for everything after the checks: the test stops run() where Ray would start."""


def _ray_starts(*args, **kwargs):
    raise _RayStarted


def _rl_checkpoint(root, version):
    """checkpoints/step_<version> as an RL run writes it (a PPO learner, so no replay), plus `latest`."""
    folder = root / f"step_{version:06d}"
    folder.mkdir(parents=True)
    (folder / "policy.json").write_text(json.dumps(META))
    save_file({"w": torch.zeros(1)}, folder / "model.safetensors")  # weights the runner checks for before Ray
    (folder / "rl_state.json").write_text(json.dumps({"version": version, "env_steps": 10 * version,
                                                      "started_from": str(folder)}))
    torch.save({"algorithm": "ppo", "updates": version}, folder / "learner.pt")
    (root / "latest").write_text(folder.name)
    return folder


def test_resuming_an_earlier_rl_checkpoint_moves_the_later_ones_aside_before_ray(tmp_path, monkeypatch, caplog):
    run_dir = tmp_path / "rl1"
    root = run_dir / "checkpoints"
    for version in (1, 2, 3):
        _rl_checkpoint(root, version)
    (run_dir / "config.yaml").write_text("mode: async\n")
    (run_dir / "metrics.jsonl").write_text("")
    before = {p.name: (p / "rl_state.json").read_text() for p in root.glob("step_*")}
    monkeypatch.setattr(runner, "connect_ray", _ray_starts)
    cfg = runner.load(None, [f"--run_dir={run_dir}", "--env.tasks=[reach-v3]", "--learner.algo.name=ppo",
                             "--learner.algo.kl_coef=0", "--eval.episodes=0", "--progress=false"])
    with caplog.at_level(logging.WARNING), pytest.raises(_RayStarted):
        runner.run(cfg, resume=str(root / "step_000001"))

    [away] = [p for p in root.iterdir() if p.name.startswith("abandoned-")]
    assert sorted(p.name for p in away.iterdir()) == ["step_000002", "step_000003"]
    assert {p.name: (p / "rl_state.json").read_text() for p in away.iterdir()} == \
        {k: v for k, v in before.items() if k != "step_000001"}  # moved whole, not rewritten
    assert sorted(p.name for p in root.glob("step_*")) == ["step_000001"]
    assert (root / "latest").read_text().strip() == "step_000001"
    assert (root / "pinned").read_text().split() == ["step_000001"]  # pruning never takes the branch point
    [warning] = [r.getMessage() for r in caplog.records if "not the run's newest checkpoint" in r.getMessage()]
    assert "step_000002, step_000003" in warning and str(away) in warning


def test_resuming_the_newest_rl_checkpoint_moves_nothing(tmp_path, monkeypatch):
    run_dir = tmp_path / "rl1"
    root = run_dir / "checkpoints"
    for version in (1, 2):
        _rl_checkpoint(root, version)
    (run_dir / "config.yaml").write_text("mode: async\n")
    monkeypatch.setattr(runner, "connect_ray", _ray_starts)
    cfg = runner.load(None, [f"--run_dir={run_dir}", "--env.tasks=[reach-v3]", "--learner.algo.name=ppo",
                             "--learner.algo.kl_coef=0", "--eval.episodes=0", "--progress=false"])
    with pytest.raises(_RayStarted):
        runner.run(cfg, resume="auto")
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_000001", "step_000002"]


def _loop_without_versions(algo_flags, held):
    """A loop that ended before its first policy version (no metrics records), its final checkpoint's
    learner holding `held`."""
    cfg = runner.load(None, ["--env.tasks=[reach-v3]", "--eval.episodes=0", *algo_flags])
    return loops.Loop(cfg, SimpleNamespace(held=held), logger=None), cfg


def test_a_run_with_no_policy_version_reports_0_updates_and_warns_last(tmp_path, caplog):
    """max_env_steps reached before the first version: summary.json says 0 updates (not null) and the
    replay the learner holds, and the run's last line is the 0-updates warning."""
    loop, cfg = _loop_without_versions(["--learner.algo.name=residual_sac", "--learner.algo.sac.warmup_transitions=8"],
                                       {"updates": 0, "replay": 5})
    with caplog.at_level(logging.WARNING):
        summary = runner._finish(tmp_path, {"steps": 0, **loop.learner_totals()}, time.monotonic(), cfg)
    written = json.loads((tmp_path / "summary.json").read_text())
    assert (written["learner_updates"], written["replay_transitions"], written["warmup_transitions"]) == (0, 5, 8)
    assert summary["learner_updates"] == 0
    assert caplog.records[-1].getMessage().startswith(
        "0 learner updates: the replay held 5 transitions, below the warm-up of 8 "
        "(learner.algo.sac.warmup_transitions)")


def test_a_run_ended_by_max_env_steps_before_its_first_version_warns_even_with_the_warmup_reached(tmp_path, caplog):
    loop, cfg = _loop_without_versions(["--learner.algo.name=residual_sac", "--learner.algo.sac.warmup_transitions=8",
                                        "--max_env_steps=1"], {"updates": 0, "replay": 8})
    with caplog.at_level(logging.WARNING):
        runner._finish(tmp_path, {"steps": 0, "env_steps": 40, **loop.learner_totals()}, time.monotonic(), cfg)
    assert json.loads((tmp_path / "summary.json").read_text())["learner_updates"] == 0
    assert caplog.records[-1].getMessage() == (
        "0 learner updates: the run ended at 40 env steps (--max_env_steps=1), before its first policy version; "
        "the policy did not change. Raise --max_env_steps")


def test_a_resumed_run_with_no_new_version_reports_the_checkpoints_updates(tmp_path, caplog):
    loop, cfg = _loop_without_versions(["--learner.algo.name=filtered_bc"], {"updates": 7, "replay": 300})
    with caplog.at_level(logging.WARNING):
        runner._finish(tmp_path, {"steps": 3, **loop.learner_totals()}, time.monotonic(), cfg)
    written = json.loads((tmp_path / "summary.json").read_text())
    assert (written["learner_updates"], written["replay_transitions"]) == (7, 300)
    assert not [r for r in caplog.records if "0 learner updates" in r.getMessage()]
