"""The `kilovla` command: exit codes, one-line errors, JSON outputs."""

import json
import os
import subprocess
import sys

import pytest

from kilovla.cli import main
from kilovla.errors import KilovlaError


def test_version_prints_the_installed_package_version_and_exits_0():
    from importlib.metadata import version

    proc = subprocess.run([sys.executable, "-m", "kilovla", "--version"], capture_output=True, text=True)
    assert proc.returncode == 0 and proc.stdout == f"kilovla {version('kilovla')}\n"


def test_data_info_json(tiny_root, capsys):
    assert main(["data", "info", str(tiny_root), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["episodes"] == 4 and info["fps"] == 10
    assert info["cameras"] == ["observation.images.front", "observation.images.wrist"]
    assert info["video_codec"] == ["av1"] and info["size_bytes"] > 0


def test_data_info_table_shows_one_codec_not_a_list(tiny_root, capsys):
    assert main(["data", "info", str(tiny_root)]) == 0
    [row] = [line for line in capsys.readouterr().out.splitlines() if "video_codec" in line]
    assert "av1" in row and "[" not in row


def test_validate_passes_a_good_dataset(tiny_root, capsys):
    assert main(["data", "validate", str(tiny_root), "--deep"]) == 0


def test_validate_passes_lerobots_own_fixture(lerobot_fixture):
    assert main(["data", "validate", str(lerobot_fixture), "--deep"]) == 0


def test_bad_input_exits_2_with_one_line_naming_the_file(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "kilovla", "data", "info", str(tmp_path)],
                          capture_output=True, text=True)
    assert proc.returncode == 2
    assert proc.stderr.strip() == f"error: {tmp_path}/meta/info.json: missing"
    assert "Traceback" not in proc.stderr


def _run_cli(*args):
    proc = subprocess.run([sys.executable, "-m", "kilovla", *args], capture_output=True, text=True)
    return proc.returncode, proc.stderr


def _edit_info(root, fn):
    path = root / "meta/info.json"
    info = json.loads(path.read_text())
    fn(info)
    path.write_text(json.dumps(info))


@pytest.mark.parametrize("command", ["info", "validate"])
def test_truncated_episode_metadata_is_one_line_naming_the_file(tiny_copy, command):
    episodes = tiny_copy / "meta/episodes/chunk-000/file-000.parquet"
    episodes.write_bytes(episodes.read_bytes()[: episodes.stat().st_size // 2])
    rc, err = _run_cli("data", command, str(tiny_copy))
    assert rc == 2 and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1
    assert err.startswith(f"error: {episodes}: cannot read parquet")


@pytest.mark.parametrize("command", ["info", "validate"])
def test_features_given_as_a_list_is_one_line_naming_the_field(tiny_copy, command):
    _edit_info(tiny_copy, lambda info: info.update(features=[{"name": k, **v} for k, v in info["features"].items()]))
    rc, err = _run_cli("data", command, str(tiny_copy))
    assert rc == 2 and "Traceback" not in err
    assert err.strip() == (f"error: {tiny_copy}/meta/info.json: 'features' must be a mapping of name -> spec, "
                           "got a list")


@pytest.mark.parametrize("command", ["info", "validate"])
def test_a_string_in_a_shape_is_one_line_naming_the_feature(tiny_copy, command):
    _edit_info(tiny_copy, lambda info: info["features"]["action"].update(shape=["six"]))
    rc, err = _run_cli("data", command, str(tiny_copy))
    assert rc == 2 and "Traceback" not in err
    assert err.strip() == (f"error: {tiny_copy}/meta/info.json: feature 'action': 'shape' must be a list of "
                           "non-negative integers, got ['six']")


def test_data_info_on_a_plain_file_says_it_is_not_a_dataset_folder(tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    rc, err = _run_cli("data", "info", str(tmp_path / "notes.txt"))
    assert rc == 2 and err == f"error: {tmp_path}/notes.txt: not a LeRobot dataset folder (a file)\n"


@pytest.mark.parametrize("flags, said", [
    (["--min_frames=50", "--max_frames=10"], "--min_frames=50 is above --max_frames=10"),
    (["--min_frames=0"], "--min_frames=0: an episode needs at least 1 frame"),
    (["--resolution=0"], "--resolution=0: frames must be at least 4 pixels a side"),
    (["--resolution=5", "--codec=libx264"], "--resolution=5: libx264 (yuv420p) needs an even number"),
    (["--fps=0"], "--fps=0: must be at least 1"),
    (["--episodes", "0"], "--episodes=0: must be at least 1"),  # a space or "=": the message says "="
    (["--cameras=front,front"], "--cameras=front,front: camera names must be non-empty and distinct"),
])
def test_data_synth_flags_no_dataset_can_be_made_of_are_one_line_and_nothing_is_written(tmp_path, flags, said):
    rc, err = _run_cli("data", "synth", str(tmp_path / "ds"), *flags)
    assert rc == 2 and err.startswith(f"error: {said}") and len(err.splitlines()) == 1
    assert list(tmp_path.iterdir()) == []


def test_data_synth_under_a_file_is_one_line_naming_the_file_and_nothing_is_written(tmp_path):
    (tmp_path / "file.txt").write_text("mine")
    proc = subprocess.run([sys.executable, "-m", "kilovla", "data", "synth", str(tmp_path / "file.txt/a/ds")],
                          capture_output=True, text=True)
    assert proc.returncode == 2 and proc.stdout == ""  # no progress lines either: checked before they start
    assert proc.stderr == (f"error: {tmp_path}/file.txt/a/ds: cannot create it: {tmp_path}/file.txt is a file, "
                           "not a folder\n")
    assert [p.name for p in tmp_path.iterdir()] == ["file.txt"]


def test_data_convert_under_a_file_is_one_line_naming_the_file_and_nothing_is_written(v21_root, tmp_path):
    (tmp_path / "file.txt").write_text("mine")
    rc, err = _run_cli("data", "convert", str(v21_root), str(tmp_path / "file.txt/v3"))
    assert rc == 2 and err == (f"error: {tmp_path}/file.txt/v3: cannot create it: {tmp_path}/file.txt is a file, "
                               "not a folder\n")
    assert [p.name for p in tmp_path.iterdir()] == ["file.txt"]


def test_stats_rewrites_stats_json(tiny_copy, capsys):
    before = json.loads((tiny_copy / "meta/stats.json").read_text())
    assert main(["data", "stats", str(tiny_copy)]) == 0
    after = json.loads((tiny_copy / "meta/stats.json").read_text())
    assert after["action"]["mean"] == pytest.approx(before["action"]["mean"], rel=1e-6)
    assert after["action"]["count"] == before["action"]["count"]


def test_convert_then_validate(v21_root, tmp_path):
    assert main(["data", "convert", str(v21_root), str(tmp_path / "v3")]) == 0
    assert main(["data", "validate", str(tmp_path / "v3"), "--deep"]) == 0


def test_bench_data_quick_writes_the_named_rows(tmp_path):
    assert main(["bench", "data", "--quick", f"--output_dir={tmp_path}", "--world_size=64"]) == 0
    result = json.loads((tmp_path / "data.json").read_text())
    assert result["suite"] == "data" and result["quick"] is True
    assert set(result["machine"]) >= {"cpu", "cores", "gpu", "torch"}
    rows = {r["name"]: r for r in result["rows"]}
    for name in ("loader_samples_per_s", "getitem_samples_per_s", "cache_samples_per_s", "cache_bytes",
                 "first_batch_s", "padding_fraction", "rank_imbalance_tokens", "rank_imbalance_attention"):
        assert rows[name]["baseline"] is not None and rows[name]["ours"] is not None, name
    assert rows["loader_samples_per_s"]["limit"] > 0
    assert result["workers"] == len(os.sched_getaffinity(0))
    frames = sum(p.stat().st_size for p in (tmp_path / "cache").glob("frames-*/**/*.npy"))
    assert rows["cache_bytes"]["ours"] == pytest.approx(frames, rel=1e-4)  # the cache as it lies on disk
    assert rows["padding_fraction"]["ours"] < rows["padding_fraction"]["baseline"]
    assert rows["rank_imbalance_attention"]["ours"] < rows["rank_imbalance_attention"]["baseline"]


def test_demo_quick_runs_the_closed_loop(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("KILOVLA_CACHE_DIR", str(tmp_path / "caches"))
    assert main(["demo", "--quick", "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "report.json").read_text())
    # training read the frames the demo decoded once, not the videos
    assert report["train"]["frames_from_cache"] and report["frame_cache"]["path"].startswith(str(tmp_path / "caches"))
    assert {"tasks", "policy_success_rate", "expert_success_rate", "policy_success_ci95", "train", "wall_s"} <= set(report)
    assert {"steps", "samples_per_s", "padding_fraction", "final_loss", "data_wait_fraction"} <= set(report["train"])
    assert report["train"]["steps"] == 30 and report["expert_success_rate"] == 1.0
    assert 0.0 <= report["train"]["data_wait_fraction"] < 1.0 and 0.0 <= report["train"]["padding_fraction"] < 1.0
    low, high = report["policy_success_ci95"]
    assert 0.0 <= low <= report["policy_success_rate"] <= high <= 1.0
    assert report["expert_success_ci95"] == pytest.approx((0.5101, 1.0), abs=1e-4)  # Wilson, 4 of 4 episodes
    assert report["dataset"]["episodes"] == 6
    ev = report["evaluation"]
    for task in report["tasks"]:  # evaluated on seeds no demonstration was recorded on
        assert len(ev["seeds"][task]) == 2 and len(ev["demonstration_seeds"][task]) == 3
        assert not set(ev["seeds"][task]) & set(ev["demonstration_seeds"][task])
        assert report["per_task"][task]["expert_ci95"][1] == 1.0
    for name in ("report.md", "learning_curve.png", "success_per_task.png"):
        assert (tmp_path / name).stat().st_size > 0
    videos = report["files"]["videos"]
    assert sorted(videos) == sorted(report["tasks"]) and all((tmp_path / v).stat().st_size > 0 for v in videos.values())
    md = (tmp_path / "report.md").read_text()
    assert "![success per task](success_per_task.png)" in md and f"[mp4]({videos['reach-v3']})" in md
    assert "| **overall** | **" in md and "[51%, 100%]" in md
    printed = capsys.readouterr().out
    assert "success overall" in printed and "[51%, 100%]" in printed


def test_demo_refuses_an_output_path_that_is_a_file(tmp_path, capsys):
    (tmp_path / "report").write_text("mine")
    assert main(["demo", "--quick", "--out", str(tmp_path / "report")]) == 2
    assert "report: exists and is not a folder" in capsys.readouterr().err
    assert (tmp_path / "report").read_text() == "mine"


@pytest.mark.parametrize("command", [["bench", "data", "--quick"], ["bench", "packing", "--quick"],
                                     ["data", "bench", "--quick", "--dataset.root=DATA"]])
def test_bench_refuses_an_output_path_that_is_a_file_before_any_work(tmp_path, capsys, command, tiny_root):
    (tmp_path / "results").write_text("mine")
    command = [str(tiny_root) if c == "--dataset.root=DATA" else c for c in command]
    assert main([*command, f"--output_dir={tmp_path / 'results'}"]) == 2
    assert "results: exists and is not a folder" in capsys.readouterr().err
    assert (tmp_path / "results").read_text() == "mine"


def test_demo_refuses_to_evaluate_on_demonstration_seeds(tmp_path):
    from kilovla.demo import QUICK, evaluate_both
    from kilovla.eval.closed_loop import episode_seeds

    recipe = QUICK.replace(eval_seed=0)
    overlapping = {"drawer-close-v3": episode_seeds(0, 1, 1)}  # drawer-close is the recipe's second task
    with pytest.raises(KilovlaError, match=r"drawer-close-v3: evaluation seeds \[1000000000001000000\] were also demonstration"):
        evaluate_both(recipe, str(tmp_path / "never-read"), tmp_path, overlapping)


def test_bench_all_combines_suites_into_results(tmp_path):
    from kilovla.bench.common import Row, write_results, write_suite

    write_suite("data", [Row.compare("padding_fraction", "fraction", 0.3, 0.02, higher_is_better=False)],
                quick=True, out_dir=tmp_path)
    write_suite("envs", [Row.compare("env_steps_per_s_64", "steps/s", 50.0, 100.0, higher_is_better=True)],
                quick=True, out_dir=tmp_path)
    json_path, md_path = write_results(tmp_path, ["data", "envs"])
    combined = json.loads(json_path.read_text())
    assert combined["suites"]["data"]["rows"][0]["ratio"] == 15.0
    assert combined["suites"]["envs"]["rows"][0]["ratio"] == 2.0
    assert "| envs | env_steps_per_s_64 | steps/s | 50 | 100 | 2 |" in md_path.read_text()


def test_a_partial_suite_run_keeps_the_rows_it_did_not_measure(tmp_path):
    """`bench rl --only gain` then `--only throughput` into one --out: both rows stay; a re-measured row is replaced."""
    from kilovla.bench.common import Row, write_suite

    gain = Row("rl_success_gain_points", "points", 50.0, 20.0, None, None, note="first")
    write_suite("rl", [gain], quick=False, out_dir=tmp_path, extra={"success_gain": {"async": 1}}, merge=True)
    speed = Row.compare("env_steps_per_s_sigma_0", "env-steps/s", 100.0, 110.0, higher_is_better=True)
    write_suite("rl", [speed], quick=False, out_dir=tmp_path, extra={"throughput": {}}, merge=True)
    data = json.loads((tmp_path / "rl.json").read_text())
    assert [r["name"] for r in data["rows"]] == ["rl_success_gain_points", "env_steps_per_s_sigma_0"]
    assert data["success_gain"] == {"async": 1} and data["throughput"] == {}
    assert data["kept_rows"]["names"] == ["rl_success_gain_points"] and data["kept_rows"]["machine"]
    again = Row("rl_success_gain_points", "points", 50.0, 25.0, None, None, note="second")
    write_suite("rl", [again], quick=False, out_dir=tmp_path, merge=True)
    rows = {r["name"]: r for r in json.loads((tmp_path / "rl.json").read_text())["rows"]}
    assert rows["rl_success_gain_points"]["note"] == "second" and len(rows) == 2
    write_suite("rl", [speed], quick=True, out_dir=tmp_path, merge=True)  # a --quick run replaces a full one
    assert [r["name"] for r in json.loads((tmp_path / "rl.json").read_text())["rows"]] == ["env_steps_per_s_sigma_0"]
    write_suite("rl", [again], quick=False, out_dir=tmp_path)  # a whole-suite run writes its rows only
    assert [r["name"] for r in json.loads((tmp_path / "rl.json").read_text())["rows"]] == ["rl_success_gain_points"]


def test_data_bench_runs_on_a_dataset_smaller_than_the_bench_batch(tiny_root, tmp_path):
    # tiny_root has ~80 frames, fewer than the suite's global batches (and 16 samples x 2 ranks fit)
    assert main(["data", "bench", str(tiny_root), "--quick", "--world_size=2", f"--output_dir={tmp_path}"]) == 0
    rows = {r["name"]: r for r in json.loads((tmp_path / "data.json").read_text())["rows"]}
    assert rows["loader_samples_per_s"]["ours"] > 0
    assert rows["rank_imbalance_attention"]["ours"] <= rows["rank_imbalance_attention"]["baseline"]


def test_demo_cache_falls_back_to_the_videos_where_it_cannot_be_written(tiny_copy, tmp_path, monkeypatch, caplog):
    from kilovla.data.lerobot import LeRobotDataset
    from kilovla.demo import build_demo_cache

    (tmp_path / "a-file").write_text("")
    monkeypatch.setenv("KILOVLA_CACHE_DIR", str(tmp_path / "a-file" / "caches"))
    assert build_demo_cache(tiny_copy) is None
    assert "frame cache not built" in caplog.text and "training decodes the videos" in caplog.text
    assert LeRobotDataset(tiny_copy).frame_cache is None  # and training reads the videos
    monkeypatch.setenv("KILOVLA_CACHE_DIR", str(tmp_path / "caches"))
    assert build_demo_cache(tiny_copy).parts > 0 and LeRobotDataset(tiny_copy).frame_cache is not None
