"""Where an evaluation writes, what it says while it runs, and which checkpoint a policy path means."""

import datetime
import json
import re
from pathlib import Path

import pytest

from kilovla.cli import main
from kilovla.errors import KilovlaError
from kilovla.eval.closed_loop import evaluate, load_policy, new_output_dir
from kilovla.eval.settings import EvalSettings
from kilovla.folders import policy_folder
from kilovla.policy import RandomPolicy

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")
QUICK = ["--tasks", "reach-v3", "--episodes", "1", "--resolution", "32", "--max-steps", "5", "--videos", "0"]


# -- the output folder ---------------------------------------------------------------------------------
def _earlier_evaluation(folder: Path) -> dict[str, str]:
    (folder / "videos" / "reach-v3").mkdir(parents=True)
    (folder / "videos" / "reach-v3" / "episode_000_failure.mp4").write_text("old video")
    (folder / "report.json").write_text('{"old": true}')
    return {str(p.relative_to(folder)): p.read_text() for p in folder.rglob("*") if p.is_file()}


def test_eval_out_holding_an_evaluation_is_refused_and_left_as_it_was(tmp_path, capsys):
    before = _earlier_evaluation(tmp_path / "ev")
    assert main(["eval", *QUICK, "--out", str(tmp_path / "ev")]) == 2
    err = capsys.readouterr().err
    assert f"error: --out {tmp_path / 'ev'}: already holds an evaluation (report.json); not overwriting it" in err
    after = {str(p.relative_to(tmp_path / "ev")): p.read_text() for p in (tmp_path / "ev").rglob("*") if p.is_file()}
    assert after == before


def test_eval_into_a_dataset_folder_says_it_holds_a_dataset_not_an_evaluation(tmp_path, capsys):
    for sub in ("meta", "data", "videos/observation.images.scene"):
        (tmp_path / "ds" / sub).mkdir(parents=True)
    assert main(["eval", *QUICK, "--output_dir", str(tmp_path / "ds")]) == 2
    out, err = capsys.readouterr()
    assert err.strip().splitlines()[-1] == (f"error: --output_dir {tmp_path / 'ds'}: holds a LeRobot dataset (meta), "
                                            "not an evaluation; not writing into it: use a new folder, or leave out "
                                            "--output_dir for a fresh one under eval-output/")
    assert out == "" and sorted(p.name for p in (tmp_path / "ds").iterdir()) == ["data", "meta", "videos"]


def test_eval_without_out_writes_a_new_timestamped_folder_each_run_and_says_which(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["eval", *QUICK]) == 0
    assert main(["eval", *QUICK]) == 0
    out = capsys.readouterr().out
    folders = sorted(p.name for p in (tmp_path / "eval-output").iterdir())
    assert len(folders) == 2
    for name in folders:
        assert re.fullmatch(r"\d{4}-\d\d-\d\d_\d\d-\d\d-\d\d_metaworld_scripted(_2)?", name)
        assert f"wrote eval-output/{name}/report.json" in out
        assert json.loads((tmp_path / "eval-output" / name / "report.json").read_text())["episodes_per_task"] == 1


def test_new_output_dir_names_date_time_env_and_policy_and_never_reuses_one(tmp_path):
    now = datetime.datetime(2026, 12, 3, 19, 30, 5)
    first = new_output_dir(tmp_path, "metaworld", "runs/a/checkpoints/step_000120", now)
    assert first == tmp_path / "2026-12-03_19-30-05_metaworld_a-step_000120"
    assert first.is_dir() and not any(first.iterdir())  # claimed by creating it
    assert new_output_dir(tmp_path, "metaworld", "runs/a/checkpoints/step_000120", now).name.endswith("_2")
    assert new_output_dir(tmp_path, "libero", "ws://gpu-host:8000", now).name == "2026-12-03_19-30-05_libero_gpu-host-8000"


def test_two_evaluations_picking_a_folder_in_the_same_second_get_two_folders(tmp_path):
    """Neither has written anything yet when the second picks: the name is claimed by creating it."""
    now = datetime.datetime(2026, 12, 3, 19, 30, 5)
    picked = [new_output_dir(tmp_path / "eval-output", "metaworld", "scripted", now) for _ in range(3)]
    assert [p.name for p in picked] == ["2026-12-03_19-30-05_metaworld_scripted",
                                        "2026-12-03_19-30-05_metaworld_scripted_2",
                                        "2026-12-03_19-30-05_metaworld_scripted_3"]
    assert all(p.is_dir() for p in picked)


def test_an_eval_refused_after_its_folder_was_picked_leaves_no_empty_folder(tmp_path, monkeypatch, capsys):
    from kilovla.eval import closed_loop

    def refuse(*args, **kwargs):  # as evaluate refuses seeds the policy's demonstrations started from
        raise KilovlaError("--seed 0: the policy's demonstrations started from these seeds")

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(closed_loop, "evaluate", refuse)
    assert main(["eval", *QUICK]) == 2
    assert "error: --seed 0: the policy's demonstrations" in capsys.readouterr().err
    assert not (tmp_path / "eval-output").exists()  # no empty folder, nor the eval-output/ this run made


def test_eval_out_under_a_file_is_refused_in_one_line_before_any_episode(tmp_path, monkeypatch, capsys):
    from kilovla.eval import closed_loop

    (tmp_path / "afile").write_text("not a folder")
    monkeypatch.setattr(closed_loop, "evaluate", lambda *a, **k: pytest.fail("an episode ran"))
    assert main(["eval", *QUICK, "--out", str(tmp_path / "afile" / "sub")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert "--out is now --output_dir" in err[:-1]  # the old flags say their new spelling, then one error line
    errors = [line for line in err if " is now --" not in line]
    assert errors == [f"error: --out {tmp_path / 'afile' / 'sub'}: cannot create it: {tmp_path / 'afile'} "
                      "is a file, not a folder"]
    assert main(["eval", "--env.task=reach-v3", f"--output_dir={tmp_path / 'afile' / 'sub'}"]) == 2
    assert capsys.readouterr().err.strip() == (f"error: --output_dir {tmp_path / 'afile' / 'sub'}: cannot create "
                                               f"it: {tmp_path / 'afile'} is a file, not a folder")


def test_evaluate_into_a_folder_replaces_the_earlier_evaluation_whole(tmp_path):
    """The demo and RL write their evaluation into the same folder each time: the old videos go with the old
    report (a stale failure video must not sit beside a new success), a file of the user's stays."""
    _earlier_evaluation(tmp_path / "ev")
    (tmp_path / "ev" / "notes.txt").write_text("mine")
    evaluate(load_policy("scripted"), EvalSettings(tasks=["reach-v3"], episodes=1, batch_size=1, videos=1, resolution=32,
                                                   max_steps=60), out_dir=tmp_path / "ev")
    assert [p.name for p in (tmp_path / "ev" / "videos" / "reach-v3").iterdir()] == ["episode_000_success.mp4"]
    assert "old" not in json.loads((tmp_path / "ev" / "report.json").read_text())
    assert (tmp_path / "ev" / "notes.txt").read_text() == "mine"


def test_evaluate_without_replace_refuses_an_earlier_evaluation_before_any_episode(tmp_path):
    _earlier_evaluation(tmp_path / "ev")
    policy = RandomPolicy(4)
    policy.select_action = lambda obs: pytest.fail("an episode ran")
    with pytest.raises(KilovlaError, match="already holds an evaluation"):
        evaluate(policy, EvalSettings(tasks=["reach-v3"], episodes=1, resolution=16), out_dir=tmp_path / "ev", replace=False)


# -- n_action_steps ------------------------------------------------------------------------------------
def test_more_action_steps_than_the_chunk_holds_are_refused_naming_the_chunk():
    with pytest.raises(KilovlaError, match="^n_action_steps 99: the policy predicts chunks of 8 actions; "
                                           "execute 8 or fewer per chunk$"):
        evaluate(RandomPolicy(4, chunk=8), EvalSettings(tasks=["reach-v3"], episodes=1, n_action_steps=99, resolution=16))
    with pytest.raises(KilovlaError, match="n_action_steps 0: must be >= 1"):
        evaluate(RandomPolicy(4, chunk=8), EvalSettings(tasks=["reach-v3"], episodes=1, n_action_steps=0, resolution=16))


# -- what an evaluation says while it runs -------------------------------------------------------------
def test_progress_counts_finished_episodes_so_it_only_rises():
    """Episodes end out of order (the expert solves some seeds sooner): the count is how many ended."""
    heard = []
    evaluate(load_policy("scripted"), EvalSettings(tasks=["reach-v3"], episodes=6, batch_size=6, resolution=16, max_steps=60),
             progress=lambda task, done, total: heard.append((task, done, total)))
    assert heard == [("reach-v3", n, 6) for n in range(7)]


def test_an_evaluation_without_progress_of_its_own_says_what_runs_and_its_success_rate(capsys):
    """What train's in-training eval and RL's final eval get: lines off a terminal, the rate at the end."""
    evaluate(load_policy("scripted"), EvalSettings(tasks=["reach-v3"], episodes=2, batch_size=2, resolution=16, max_steps=60),
             label="eval at step 2")
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "eval at step 2: starting"
    assert lines[-2].startswith("eval at step 2: reach-v3 2/2 episodes")
    assert lines[-1] == "eval at step 2: success rate 100.0% (2/2 episodes, 1 task(s); 95 % Wilson 34.2% - 100.0%)"


# -- which checkpoint a policy path means -------------------------------------------------------------
def _run(root: Path, steps=(2, 4), latest: int | None = 4) -> Path:
    for step in steps:
        (root / "checkpoints" / f"step_{step:06d}").mkdir(parents=True)
        (root / "checkpoints" / f"step_{step:06d}" / "policy.json").write_text("{}")
    if latest is not None:
        (root / "checkpoints" / "latest").write_text(f"step_{latest:06d}")
    (root / "config.yaml").write_text("steps: 4\n")
    return root


@pytest.mark.parametrize("given", ["run", "run/checkpoints", "run/checkpoints/latest", "run/checkpoints/last"])
def test_a_run_folder_or_its_latest_means_the_newest_complete_checkpoint(tmp_path, given):
    _run(tmp_path / "run", latest=2)  # step_000004 exists but `latest` was never moved to it: incomplete
    assert policy_folder(tmp_path / given) == tmp_path / "run" / "checkpoints" / "step_000002"


def test_a_policy_folder_or_another_layout_is_taken_as_given(tmp_path):
    step = _run(tmp_path / "run") / "checkpoints" / "step_000002"
    assert policy_folder(step) == step
    (tmp_path / "openpi").mkdir()
    assert policy_folder(tmp_path / "openpi") == tmp_path / "openpi"
    lerobot = tmp_path / "lerobot" / "checkpoints" / "last" / "pretrained_model"
    lerobot.mkdir(parents=True)
    (tmp_path / "lerobot" / "checkpoints" / "last").joinpath("README").write_text("a LeRobot checkpoint")
    assert policy_folder(tmp_path / "lerobot" / "checkpoints" / "last") == tmp_path / "lerobot" / "checkpoints" / "last"


def test_a_run_without_a_complete_checkpoint_is_one_line(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "config.yaml").write_text("steps: 4\n")
    assert main(["eval", "--policy", str(tmp_path / "empty"), *QUICK]) == 2
    assert "a kilovla run without a complete checkpoint (no " in capsys.readouterr().err
    _run(tmp_path / "unpointed", latest=None)
    with pytest.raises(KilovlaError, match=r"holds step_000002, step_000004 but no `latest` pointer .* pass "
                                           r".*step_000004 if it is whole"):
        policy_folder(tmp_path / "unpointed" / "checkpoints" / "latest")
    _run(tmp_path / "dangling", latest=6)  # the pointer names a step deleted since
    with pytest.raises(KilovlaError, match=r"holds step_000002, step_000004 but `latest` names step_000006, which "
                                           r"is not there: pass .*step_000004 if it is whole"):
        policy_folder(tmp_path / "dangling")


@pytest.fixture(scope="module")
def trained_run(reach_policy) -> Path:
    return Path(reach_policy()).parents[1]


@pytest.mark.parametrize("given", ["", "checkpoints/latest", "checkpoints/last"])
def test_eval_of_a_run_evaluates_its_newest_checkpoint(trained_run, tmp_path, given):
    assert main(["eval", "--policy", str(trained_run / given), *QUICK, "--out", str(tmp_path / "ev")]) == 0
    report = json.loads((tmp_path / "ev" / "report.json").read_text())
    assert report["policy_source"] == str(trained_run / "checkpoints" / "step_000002")


def test_eval_refuses_more_action_steps_than_a_learned_chunk_before_writing(trained_run, tmp_path, capsys):
    assert main(["eval", "--policy", str(trained_run), *QUICK, "--n-action-steps", "99",
                 "--out", str(tmp_path / "ev")]) == 2
    assert "error: n_action_steps 99: the policy predicts chunks of 4 actions" in capsys.readouterr().err
    assert not (tmp_path / "ev").exists()


def test_serve_and_fine_tuning_take_a_run_folder_for_its_newest_checkpoint(trained_run):
    from kilovla.config import load_config
    from kilovla.serve.engine import PolicyEngine
    from kilovla.train.build import with_policy_defaults
    from kilovla.train.trainer import TrainConfig

    newest = trained_run / "checkpoints" / "step_000002"
    assert Path(PolicyEngine.load(trained_run / "checkpoints" / "last", device="cpu").folder) == newest
    cfg = load_config(TrainConfig, None, [f"--policy.init_from={trained_run}"])
    assert with_policy_defaults(cfg).policy.init_from == str(newest)


def test_quantize_takes_a_run_folder_for_its_newest_checkpoint(trained_run, tmp_path):
    assert main(["quantize", str(trained_run), "--out", str(tmp_path / "q"), "--activations", "none",
                 "--latency-repeats", "1"]) == 0
    report = json.loads((tmp_path / "q" / "quant_report.json").read_text())
    assert str(trained_run / "checkpoints" / "step_000002") in json.dumps(report)


def test_rl_from_a_run_without_a_checkpoint_is_one_line_before_ray(tmp_path, capsys):
    (tmp_path / "sft").mkdir()
    (tmp_path / "sft" / "metrics.jsonl").write_text('{"step": 1}\n')
    assert main(["rl", f"--run_dir={tmp_path / 'rl'}", "--policy", str(tmp_path / "sft")]) == 2
    assert f"error: {tmp_path / 'sft'}: a kilovla run without a complete checkpoint" in capsys.readouterr().err


def test_a_checkpoint_of_another_layout_with_a_config_yaml_is_not_taken_for_a_run(tmp_path):
    (tmp_path / "export").mkdir()
    (tmp_path / "export" / "config.yaml").write_text("model: pi05\n")
    (tmp_path / "export" / "model.safetensors").write_bytes(b"")
    assert policy_folder(tmp_path / "export") == tmp_path / "export"
