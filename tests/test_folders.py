"""Nothing lost: writers replace only folders of their own kind; a run_dir holding a run is continued
only with --resume; refusals write nothing."""

import hashlib
import json
from pathlib import Path

import pytest

from kilovla.cli import main
from kilovla.data.synthetic import make_synthetic_dataset
from kilovla.errors import KilovlaError
from kilovla.folders import DATASET, RUN, check_replaceable, claim_run_dir

SYNTH = ["--episodes", "2", "--min-frames", "12", "--max-frames", "16", "--resolution", "32"]


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    return make_synthetic_dataset(tmp_path_factory.mktemp("folders") / "ds", episodes=3, frames=(12, 16),
                                  resolution=(32, 32), seed=1)


def _train_args(dataset, run_dir, steps=2, *extra):
    return ["train", f"--run_dir={run_dir}", f"--steps={steps}", f"--dataset.roots=[{dataset}]",
            "--batch.global_batch_size=4", "--checkpoint.every=2", "--progress=false", *extra]


def _snapshot(folder: Path) -> dict:
    """Every file under `folder` with its bytes' hash and mtime: what 'nothing changed' means."""
    return {str(p.relative_to(folder)): (hashlib.sha256(p.read_bytes()).hexdigest(), p.stat().st_mtime_ns)
            for p in sorted(folder.rglob("*")) if p.is_file()}


def test_synth_overwrite_keeps_a_folder_with_a_stray_file(tmp_path, capsys):
    target = tmp_path / "d"
    target.mkdir()
    (target / "precious.txt").write_text("hi")
    assert main(["data", "synth", str(target), "--overwrite", *SYNTH]) == 2
    assert "d: holds precious.txt, which is not part of a LeRobot dataset" in capsys.readouterr().err
    assert (target / "precious.txt").read_text() == "hi" and sorted(p.name for p in target.iterdir()) == ["precious.txt"]


def test_synth_overwrite_replaces_a_dataset(tmp_path):
    target = tmp_path / "d"
    assert main(["data", "synth", str(target), *SYNTH]) == 0
    assert main(["data", "synth", str(target), "--overwrite", "--seed", "3", *SYNTH]) == 0
    assert (target / "meta" / "info.json").is_file()


def test_a_dataset_with_a_stray_file_beside_it_is_not_replaced(tmp_path, dataset, capsys):
    import shutil

    target = tmp_path / "d"
    shutil.copytree(dataset, target)
    (target / "notes.md").write_text("mine")
    assert main(["data", "synth", str(target), "--overwrite", *SYNTH]) == 2
    assert "holds notes.md" in capsys.readouterr().err
    assert (target / "notes.md").read_text() == "mine"


def test_convert_overwrite_keeps_a_folder_of_other_files(tmp_path, v21_root, capsys):
    target = tmp_path / "out"
    (target / "work").mkdir(parents=True)
    (target / "work" / "thesis.tex").write_text("x")
    assert main(["data", "convert", str(v21_root), str(target), "--overwrite"]) == 2
    assert "holds work, which is not part of a LeRobot dataset" in capsys.readouterr().err
    assert (target / "work" / "thesis.tex").read_text() == "x"


def test_collect_overwrite_keeps_a_folder_of_other_files(tmp_path, capsys):
    target = tmp_path / "out"
    target.mkdir()
    (target / "precious.txt").write_text("hi")
    assert main(["collect", "--tasks", "reach-v3", "--episodes-per-task", "1", "--resolution", "16",
                 "--out", str(target), "--overwrite"]) == 2
    assert "holds precious.txt" in capsys.readouterr().err
    assert (target / "precious.txt").read_text() == "hi"


def test_demo_keeps_an_output_folder_of_other_files(tmp_path, capsys):
    (tmp_path / ".kilovla-demo").write_text("")  # an earlier demo's folder ...
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "precious.txt").write_text("hi")
    assert main(["demo", "--quick", "--out", str(tmp_path)]) == 2
    assert "run: holds precious.txt, which is not part of a kilovla run" in capsys.readouterr().err
    (tmp_path / "run" / "precious.txt").unlink()
    (tmp_path / "thesis.tex").write_text("x")
    assert main(["demo", "--quick", "--out", str(tmp_path)]) == 2
    assert "holds thesis.tex, which is not part of a kilovla demo output" in capsys.readouterr().err
    assert (tmp_path / "thesis.tex").read_text() == "x"


def test_check_replaceable_wants_the_kind_s_marker(tmp_path):
    (tmp_path / "data").mkdir()  # a folder of a dataset's names but no meta/: someone's own data
    with pytest.raises(KilovlaError, match="is not a LeRobot dataset .no meta."):
        check_replaceable(tmp_path, DATASET)
    (tmp_path / "meta").mkdir()
    check_replaceable(tmp_path, DATASET)
    check_replaceable(tmp_path / "absent", RUN)


def test_a_second_train_into_a_run_dir_is_refused_and_changes_nothing(tmp_path, dataset, capsys):
    run = tmp_path / "run"
    assert main(_train_args(dataset, run, 2)) == 0
    before = _snapshot(run)
    capsys.readouterr()
    assert main(_train_args(dataset, run, 4)) == 2
    assert "run_dir holds a run: pass --resume auto or use a new run_dir" in capsys.readouterr().err
    assert _snapshot(run) == before


def test_resume_auto_without_a_checkpoint_starts_fresh_and_says_so(tmp_path, dataset, capsys):
    run = tmp_path / "run"
    assert main(_train_args(dataset, run, 2)) == 0
    import shutil

    shutil.rmtree(run / "checkpoints")  # a run that died before its first checkpoint
    capsys.readouterr()
    assert main(_train_args(dataset, run, 2, "--resume") + ["auto"]) == 0
    assert "no checkpoint in" in capsys.readouterr().out
    steps = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2]  # the earlier run's steps are gone, not mixed in


def test_resume_past_the_last_step_is_refused_before_anything_is_written(tmp_path, dataset, capsys):
    run = tmp_path / "run"
    assert main(_train_args(dataset, run, 4)) == 0
    capsys.readouterr()
    assert main(_train_args(dataset, tmp_path / "new", 2, "--resume") + [str(run / "checkpoints" / "step_000004")]) == 2
    assert "is at step 4, past steps=2" in capsys.readouterr().err
    assert not (tmp_path / "new").exists()


def test_resuming_another_run_s_checkpoint_into_a_run_dir_is_refused(tmp_path, dataset):
    (tmp_path / "a" / "checkpoints" / "step_000002").mkdir(parents=True)
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "metrics.jsonl").write_text("")
    with pytest.raises(KilovlaError, match="holds another run"):
        claim_run_dir(tmp_path / "b", str(tmp_path / "a" / "checkpoints" / "step_000002"),
                      tmp_path / "a" / "checkpoints" / "step_000002")
    assert claim_run_dir(tmp_path / "a", "auto", tmp_path / "a" / "checkpoints" / "step_000002") == "resume"


def test_rl_into_a_run_dir_holding_a_run_is_refused_before_ray(tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"step": 1}\n')
    (run / "config.yaml").write_text("mode: sync\n")
    before = _snapshot(run)
    assert main(["rl", f"--run_dir={run}", "--policy", str(tmp_path / "whatever")]) == 2
    assert "run_dir holds a run: pass --resume auto" in capsys.readouterr().err
    assert _snapshot(run) == before


def test_data_bench_refusing_a_cache_leaves_no_folder(tmp_path, tiny_root, capsys):
    out = tmp_path / "out"
    assert main(["data", "bench", str(tiny_root), "--cache", str(tmp_path / "no-cache"), "--out", str(out), "--quick"]) == 2
    assert "manifest.json: missing" in capsys.readouterr().err
    assert not out.exists()


def test_demo_does_not_take_a_folder_that_only_looks_like_its_output(tmp_path, dataset, capsys):
    import shutil

    shutil.copytree(dataset, tmp_path / "dataset")  # the user's own dataset/, no demo ever ran here
    assert main(["demo", "--quick", "--out", str(tmp_path)]) == 2
    assert "is not a kilovla demo output (no .kilovla-demo or report.json)" in capsys.readouterr().err
    assert (tmp_path / "dataset" / "meta" / "info.json").read_text() == (dataset / "meta" / "info.json").read_text()


def test_user_dot_files_are_not_taken_for_kilovla_temporary_names(tmp_path, dataset, capsys):
    import shutil

    target = tmp_path / "d"
    shutil.copytree(dataset, target)
    (target / ".data_backup").mkdir()
    (target / ".data_backup" / "p.txt").write_text("p")
    assert main(["data", "synth", str(target), "--overwrite", *SYNTH]) == 2
    assert "holds .data_backup" in capsys.readouterr().err
    assert (target / ".data_backup" / "p.txt").read_text() == "p"


def test_a_run_dir_may_hold_a_log_and_notes_beside_the_run(tmp_path, dataset, capsys):
    run = tmp_path / "run"
    run.mkdir()
    (run / "train.log").write_text("the shell opened this before kilovla started\n")
    assert main(_train_args(dataset, run, 2)) == 0
    (run / "NOTES.md").write_text("mine")
    assert main(_train_args(dataset, run, 4, "--resume") + ["auto"]) == 0
    import shutil

    shutil.rmtree(run / "checkpoints")
    assert main(_train_args(dataset, run, 2, "--resume") + ["auto"]) == 0  # fresh: the run's files replaced
    assert (run / "NOTES.md").read_text() == "mine" and (run / "train.log").exists()


def test_resume_auto_without_a_latest_pointer_keeps_the_checkpoints(tmp_path, dataset, capsys):
    run = tmp_path / "run"
    assert main(_train_args(dataset, run, 4)) == 0
    (run / "checkpoints" / "latest").unlink()
    before = _snapshot(run)
    capsys.readouterr()
    assert main(_train_args(dataset, run, 6, "--resume") + ["auto"]) == 2
    err = capsys.readouterr().err
    assert "holds step_000002, step_000004 but no `latest` pointer" in err and "--resume" in err
    assert _snapshot(run) == before


def test_resume_auto_of_another_kind_of_run_is_one_line(tmp_path, dataset, capsys):
    run = tmp_path / "run"
    assert main(_train_args(dataset, run, 2)) == 0
    capsys.readouterr()
    assert main(["rl", f"--run_dir={run}", "--resume", "auto"]) == 2
    assert "is not of this kind of run (no rl_state.json)" in capsys.readouterr().err


def test_an_empty_latest_pointer_names_no_checkpoint(tmp_path):
    """An empty `latest` (a write cut short) must not name checkpoints/ itself as the checkpoint."""
    from kilovla.folders import latest_checkpoint
    from kilovla.train.checkpoint import latest

    root = tmp_path / "checkpoints"
    (root / "step_000002").mkdir(parents=True)
    (root / "latest").write_text("")
    assert latest_checkpoint(root) is None and latest(root) is None
    (root / "latest").write_text("step_000002\n")
    assert latest(root) == root / "step_000002"


def _errors(err: str) -> str:
    """stderr less the old flags' one-line notices of their new spelling ("--out is now --output_dir")."""
    return "\n".join(line for line in err.strip().splitlines() if " is now --" not in line)


def test_collect_of_no_episodes_per_task_names_the_flag(tmp_path, capsys):
    assert main(["collect", "--tasks", "reach-v3", "--episodes-per-task", "0", "--out", str(tmp_path / "out")]) == 2
    assert _errors(capsys.readouterr().err) == "error: --episodes-per-task 0: must be >= 1"
    assert not (tmp_path / "out").exists()


def test_collect_into_an_existing_folder_names_the_cli_flag(tmp_path, capsys):
    (tmp_path / "out").mkdir()
    assert main(["collect", "--tasks", "reach-v3", "--episodes-per-task", "1", "--resolution", "16",
                 "--out", str(tmp_path / "out")]) == 2
    out, err = capsys.readouterr()
    assert _errors(err) == f"error: {tmp_path / 'out'}: already exists (--collect.overwrite replaces it)"
    assert out == ""  # refused before "collect: starting"
