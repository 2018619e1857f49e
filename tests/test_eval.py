"""Closed-loop evaluation and demonstration collection."""

import json

import numpy as np
import pytest

from kilovla.cli import main
from kilovla.data import LeRobotDataset
from kilovla.envs.collect import collect
from kilovla.eval.closed_loop import evaluate, load_policy
from kilovla.eval.intervals import wilson_interval
from kilovla.eval.settings import EvalSettings
from kilovla.errors import KilovlaError
from kilovla.policy import RandomPolicy

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")
FAST = {"resolution": 32, "max_steps": 60}


def test_scripted_policy_succeeds_and_reports(tmp_path):
    report = evaluate(load_policy("scripted"), EvalSettings(tasks=["reach-v3"], episodes=2, batch_size=2, videos=1, **FAST),
                      out_dir=tmp_path)
    assert report["overall_success_rate"] == 1.0
    r = report["per_task"]["reach-v3"]
    assert r["episodes"] == 2 and 0 < r["mean_steps"] < 60
    saved = json.loads((tmp_path / "report.json").read_text())
    assert {"overall_success_rate", "overall_success_ci95", "per_task", "env", "policy", "seed"} <= set(saved)
    assert r["success_ci95"] == pytest.approx((0.3424, 1.0), abs=1e-4)  # Wilson, 2 of 2
    assert "| reach-v3 | 100.0% | 34.2% - 100.0% | 2 |" in (tmp_path / "report.md").read_text()
    [video] = (tmp_path / "videos" / "reach-v3").glob("*.mp4")
    assert video.name == "episode_000_success.mp4" and video.stat().st_size > 0


@pytest.mark.parametrize("wins, n, low, high", [
    (20, 20, 0.8389, 1.0), (10, 20, 0.2993, 0.7007), (0, 10, 0.0, 0.2775), (46, 50, 0.8116, 0.9685), (1, 1, 0.2065, 1.0)])
def test_wilson_interval_matches_the_closed_form(wins, n, low, high):
    assert wilson_interval(wins, n) == pytest.approx((low, high), abs=1e-4)


def test_wilson_interval_narrows_with_episodes_and_refuses_impossible_counts():
    small, large = wilson_interval(9, 10), wilson_interval(90, 100)
    assert small[0] < large[0] < 0.9 < large[1] < small[1]
    for wins, n in ((3, 2), (-1, 5), (0, 0)):
        with pytest.raises(KilovlaError, match="success interval"):
            wilson_interval(wins, n)


def test_random_policy_stays_near_zero():
    report = evaluate(RandomPolicy(4, seed=0), EvalSettings(tasks=["push-v3"], episodes=3, batch_size=3, **FAST))
    assert report["overall_success_rate"] == 0.0


class _FirstObservations:
    """Records the first observation of every episode (what the seed decides), then acts at random."""

    action_dim, n_action_steps = 4, None

    def __init__(self):
        self.first, self._random = [], RandomPolicy(4, seed=0)

    def reset(self):
        pass

    def select_action(self, obs):
        if not self.first:
            self.first = [s.copy() for s in obs["observation.environment_state"]]
        return self._random.select_action(obs)


def test_evaluation_seeds_are_fixed():
    def first_observations(seed):
        policy = _FirstObservations()
        evaluate(policy, EvalSettings(tasks=["reach-v3"], episodes=3, batch_size=3, seed=seed, resolution=16, max_steps=2))
        return np.array(policy.first)

    a, b, other = first_observations(0), first_observations(0), first_observations(1)
    np.testing.assert_array_equal(a, b)  # same seed: the same goals and object positions
    assert len({tuple(s) for s in a}) == 3  # every episode of a task gets its own seed
    assert not np.allclose(a, other)


def test_a_policy_that_does_not_fit_the_env_is_refused():
    policy = RandomPolicy(7)
    policy.action_dim, policy.cameras = 7, ("agentview",)
    with pytest.raises(KilovlaError, match=r"action_dim 7 \(policy\) vs 4 \(metaworld\); cameras"):
        evaluate(policy, EvalSettings(tasks=["reach-v3"], episodes=1, **FAST))


def test_a_crashed_env_process_fails_its_task_only(tmp_path):
    import os
    import signal

    import psutil

    def kill_worker(task, done, total):
        if task == "reach-v3" and done == 1:
            me = psutil.Process()
            helpers = {p.pid for p in me.children()}  # the forkserver and resource tracker
            for worker in me.children(recursive=True):
                if worker.pid not in helpers:  # env workers are forked by the forkserver
                    os.kill(worker.pid, signal.SIGKILL)

    settings = EvalSettings(tasks=["reach-v3", "drawer-close-v3"], episodes=3, batch_size=1, workers=1, resolution=32,
                            max_steps=100)
    report = evaluate(load_policy("scripted"), settings, progress=kill_worker, out_dir=tmp_path)
    crashed = report["per_task"]["reach-v3"]
    assert "crashed" in crashed["error"] and crashed["seeds_running"]
    # The expert solves every episode it finishes; the ones the crash cut off count as failures.
    assert 1 <= crashed["crashed_episodes"] <= 2 and crashed["episodes"] == 3
    assert crashed["success_rate"] == pytest.approx((3 - crashed["crashed_episodes"]) / 3)
    assert report["per_task"]["drawer-close-v3"]["success_rate"] == 1.0
    assert report["crashed_episodes"] == crashed["crashed_episodes"]
    assert report["overall_success_rate"] == pytest.approx((crashed["success_rate"] + 1.0) / 2)
    assert "crashed, counted as failures" in (tmp_path / "report.md").read_text()


def test_collect_writes_a_valid_dataset_of_successful_episodes(tmp_path):
    from kilovla.data.validate import validate_dataset

    report = collect(tmp_path / "demos", tasks=["reach-v3", "drawer-close-v3"], episodes_per_task=2,
                     resolution=32, batch_size=2)
    assert report.kept == {"reach-v3": 2, "drawer-close-v3": 2}
    assert validate_dataset(str(tmp_path / "demos")) == []
    ds = LeRobotDataset(tmp_path / "demos")
    assert ds.num_episodes == 4 and ds.meta.fps == 80
    assert ds.meta.tasks == ["reach the red goal", "close the drawer"]
    last = ds.get_batch(np.array([ds.meta.episodes.row_to[0] - 1]))
    assert last["next.success"][0]  # episodes end on success
    assert last["observation.images.scene"].shape == (1, 32, 32, 3)


def test_collect_with_expert_labels_records_the_noise_free_action_of_each_visited_state(tmp_path):
    """Same seeds, same noise: the same states are visited, and only the recorded actions differ."""
    from kilovla.envs.metaworld import MetaWorldExpertPolicy

    kwargs = dict(tasks=["reach-v3"], episodes_per_task=1, resolution=16, batch_size=1, noise_std=0.3)
    collect(tmp_path / "executed", **kwargs)
    collect(tmp_path / "expert", labels="expert", **kwargs)
    executed, expert = (LeRobotDataset(tmp_path / name) for name in ("executed", "expert"))
    rows = np.arange(len(expert))
    a, b = executed.get_batch(rows), expert.get_batch(rows)
    np.testing.assert_array_equal(a["observation.environment_state"], b["observation.environment_state"])
    assert np.abs(np.asarray(a["action"]) - np.asarray(b["action"])).mean() > 0.05  # the noise, left out
    clean = MetaWorldExpertPolicy().select_action({"observation.environment_state": np.asarray(b["observation.environment_state"]),
                                                   "env_task": ["reach-v3"] * len(rows)})[:, 0]
    np.testing.assert_allclose(np.asarray(b["action"]), clean, atol=1e-6)
    with pytest.raises(KilovlaError, match="labels must be"):
        collect(tmp_path / "bad", labels="noisy", **kwargs)


def test_cli_rejects_unknown_tasks_and_envs(capsys):
    assert main(["eval", "--tasks", "push-v9", "--episodes", "1"]) == 2
    assert "unknown metaworld task(s) ['push-v9']; valid tasks:" in capsys.readouterr().err
    assert main(["eval", "--env", "gazebo", "--episodes", "1"]) == 2
    assert main(["eval", "--policy", "/nonexistent/ckpt", "--episodes", "1", "--tasks", "reach-v3"]) == 2


def test_cli_eval_scripted(tmp_path):
    assert main(["eval", "--tasks", "reach-v3", "--episodes", "2", "--resolution", "32", "--videos", "0",
                 "--out", str(tmp_path)]) == 0
    assert json.loads((tmp_path / "report.json").read_text())["per_task"]["reach-v3"]["success_rate"] == 1.0


class _ChunkPolicy:
    """Looks at both cameras, returns 4-action chunks of zeros; records what it was shown."""

    name, action_dim, cameras = "chunks", 4, ("scene", "wrist")

    def __init__(self):
        self.calls = 0

    def reset(self):
        pass

    def select_action(self, batch):
        assert batch["observation.images.scene"].shape[1:] == (32, 32, 3)  # the policy always gets its images
        self.calls += 1
        return np.zeros((len(batch["task"]), 4, 4), np.float32)


def _count_renders(monkeypatch) -> list:
    from kilovla.envs.metaworld import MetaWorldEnv

    rendered, real = [], MetaWorldEnv._render
    monkeypatch.setattr(MetaWorldEnv, "_render", lambda self: (out := real(self)) and rendered.append(1) or out)
    return rendered


def test_evaluation_renders_only_the_frames_a_policy_or_a_video_looks_at(monkeypatch, tmp_path):
    rendered = _count_renders(monkeypatch)
    policy = _ChunkPolicy()
    report = evaluate(policy, EvalSettings(tasks=["reach-v3"], episodes=2, batch_size=2, resolution=32, max_steps=20))
    assert report["per_task"]["reach-v3"]["mean_steps"] == 20
    assert len(rendered) == 2 + policy.calls * 2  # the two resets, and each chunk's last observation
    rendered.clear()
    report = evaluate(load_policy("scripted"), EvalSettings(tasks=["reach-v3"], episodes=3, batch_size=3, resolution=32,
                                                            max_steps=20, videos=1), out_dir=tmp_path)
    steps = [int(s) for s in [report["per_task"]["reach-v3"]["mean_steps"]]]
    assert len(rendered) <= 3 + 20  # the state-only expert: the resets and the recorded episode's frames
    [video] = (tmp_path / "videos" / "reach-v3").glob("*.mp4")
    from kilovla.data.video import probe_video

    assert probe_video(video)["frames"] >= min(steps)  # the recorded episode still has every frame


def test_policy_threads_leave_the_env_workers_their_cores_and_restore(monkeypatch):
    import torch

    from kilovla.eval.closed_loop import policy_threads

    monkeypatch.setattr("os.cpu_count", lambda: 4)
    before = torch.get_num_threads()
    torch.set_num_threads(4)
    try:
        with policy_threads(3):
            assert torch.get_num_threads() == 1
        assert torch.get_num_threads() == 4
        with policy_threads(0):  # envs in this process: the policy keeps every thread
            assert torch.get_num_threads() == 4
        with pytest.raises(RuntimeError), policy_threads(2):
            assert torch.get_num_threads() == 2
            raise RuntimeError("an env crashed")
        assert torch.get_num_threads() == 4
    finally:
        torch.set_num_threads(before)


def test_eval_renders_at_the_policy_s_training_resolution_unless_told(caplog):
    from types import SimpleNamespace

    from kilovla.envs.base import env_type

    render_resolution = env_type("metaworld").render_resolution

    trained = SimpleNamespace(name="pi05-tiny", meta=SimpleNamespace(image_size=[32, 32]))
    assert render_resolution(trained, None) == 32
    with caplog.at_level("WARNING"):
        assert render_resolution(trained, 64) == 64
    assert "rendering at 64 px, but pi05-tiny was trained on 32x32 frames" in caplog.text
    caplog.clear()
    older = SimpleNamespace(name="old", meta=SimpleNamespace(image_size=None))  # a folder of an earlier version
    with caplog.at_level("WARNING"):
        assert render_resolution(older, None) == 96
    assert "does not record its training resolution" in caplog.text
    assert render_resolution(SimpleNamespace(name="scripted"), None) == 96


def test_eval_ema_loads_the_folder_s_ema_weights(monkeypatch, capsys):
    from kilovla.eval import closed_loop

    asked = {}

    def load_policy(spec, **kwargs):
        asked.update(kwargs)
        raise KilovlaError("stop here")

    monkeypatch.setattr(closed_loop, "load_policy", load_policy)
    assert main(["eval", "--policy", "some/folder", "--ema", "--tasks", "reach-v3"]) == 2
    assert asked["ema"] is True


def test_an_evaluation_beside_plays_in_its_own_process_and_reports_as_evaluate_does(tmp_path, capfd):
    import os
    import signal
    import time

    from kilovla.eval.closed_loop import Beside

    settings = EvalSettings(tasks=["reach-v3", "drawer-close-v3"], episodes=2, batch_size=2, **FAST)
    here = evaluate(load_policy("scripted"), settings)
    with Beside("scripted", settings, tmp_path / "beside", "eval expert") as beside:
        deadline = time.monotonic() + 120
        while not (tmp_path / "beside" / "report.json").exists():  # it plays while this process does other work
            assert beside._process.is_alive() and time.monotonic() < deadline
            time.sleep(0.2)
        assert beside._process.pid != os.getpid()
        there = beside.result()
        assert beside.result() is there  # asked again: the same report
    assert there["per_task"] == here["per_task"]
    said = capfd.readouterr().out  # the line is said here, once (not also by the process, under a progress bar)
    assert said.count(f"eval expert: success rate {here['overall_success_rate']:.1%} (") == 1

    # bad input is the evaluation's KilovlaError; a fault and a death are RuntimeErrors
    with Beside("scripted", EvalSettings(tasks=["nope-v3"], episodes=1, **FAST), tmp_path / "bad", "eval expert") as bad:
        with pytest.raises(KilovlaError, match=r"^eval expert: .*nope-v3"):
            bad.result()
    (tmp_path / "a-file").write_text("")
    with Beside("scripted", settings, tmp_path / "a-file" / "out", "eval expert") as faulty:
        with pytest.raises(RuntimeError, match=r"^eval expert: (NotADirectoryError|FileExistsError).*\nTraceback"):
            faulty.result()
    with Beside("scripted", settings, tmp_path / "killed", "eval expert") as killed:
        os.kill(killed._process.pid, signal.SIGKILL)
        with pytest.raises(RuntimeError, match=r"eval expert: its process ended \(exit code -9\) before its report"):
            killed.result()

    # leaving the block ends a process still playing (its env workers too), and says so when asked after
    long = EvalSettings(tasks=["push-v3"], episodes=40, batch_size=4, workers=2, **FAST)
    with pytest.raises(ValueError), Beside("random", long, tmp_path / "left", "eval random") as left:
        time.sleep(3)
        raise ValueError("the parent's own error")
    assert left._process.exitcode == 128 + signal.SIGTERM  # it exited (closing its pool), not killed mid-write
    with pytest.raises(RuntimeError, match="closed before its report"):
        left.result()
