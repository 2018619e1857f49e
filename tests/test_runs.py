"""A run's life in its run_dir: branching from an earlier checkpoint, starting from a policy folder's
weights and model, the settings refused before anything is written, a failed start, stale temporaries."""

import json
import logging
from pathlib import Path

import pytest
import torch

from conftest import unless_given
from kilovla.cli import main
from kilovla.config import load_config
from kilovla.data.synthetic import make_synthetic_dataset
from kilovla.train.trainer import TrainConfig, train


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    return make_synthetic_dataset(tmp_path_factory.mktemp("runs") / "ds", episodes=2, frames=(8, 10),
                                  resolution=(32, 32), seed=4)


def _args(dataset, run_dir, *extra):
    return [*unless_given([f"--run_dir={run_dir}", f"--dataset.roots=[{dataset}]", "--batch.global_batch_size=4",
                           "--checkpoint.every=1", "--progress=false"], list(extra)), *extra]


def _weights(folder):
    from safetensors.torch import load_file

    return load_file(str(Path(folder) / "model.safetensors"))


def _steps(folder):
    return sorted(p.name for p in Path(folder).iterdir() if p.name.startswith("step_"))


# -- resuming from an earlier checkpoint: a branch --------------------------------------------------------

def test_resuming_an_earlier_checkpoint_moves_the_later_ones_away_and_keeps_it(dataset, tmp_path, caplog):
    run = tmp_path / "run"
    train(load_config(TrainConfig, None, _args(dataset, run, "--steps=5", "--checkpoint.keep=3")))
    root = run / "checkpoints"
    assert _steps(root) == ["step_000003", "step_000004", "step_000005"]
    with caplog.at_level(logging.WARNING, logger="kilovla.train.checkpoint"):
        train(load_config(TrainConfig, None, _args(dataset, run, "--steps=7", "--checkpoint.keep=1")),
              resume=str(root / "step_000003"))
    # keep=1 counts the new branch only; the step it grew from stays, the old branch is set aside whole
    assert _steps(root) == ["step_000003", "step_000007"]
    assert (root / "latest").read_text() == "step_000007"
    [away] = [p for p in root.iterdir() if p.name.startswith("abandoned-")]
    assert _steps(away) == ["step_000004", "step_000005"]
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and str(away) in warnings[0]
    logged = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert logged == [1, 2, 3, 4, 5, 6, 7]  # the old branch's steps 4 and 5 logged once, by the new one


def test_resuming_a_checkpoint_of_an_abandoned_branch_branches_from_it(dataset, tmp_path):
    run = tmp_path / "run"
    root = run / "checkpoints"
    train(load_config(TrainConfig, None, _args(dataset, run, "--steps=5", "--checkpoint.keep=0")))
    train(load_config(TrainConfig, None, _args(dataset, run, "--steps=7", "--checkpoint.keep=0")),
          resume=str(root / "step_000003"))
    [first] = [p for p in root.iterdir() if p.name.startswith("abandoned-")]
    assert _steps(first) == ["step_000004", "step_000005"] and _steps(root)[-1] == "step_000007"
    train(load_config(TrainConfig, None, _args(dataset, run, "--steps=6", "--checkpoint.keep=0")),
          resume=str(first / "step_000004"))
    # step_4 came back as a branch point; the branch it replaced (4..7 grown from step_3) is set aside whole
    assert _steps(root) == ["step_000001", "step_000002", "step_000003", "step_000004", "step_000005", "step_000006"]
    assert (root / "pinned").read_text().split() == ["step_000003", "step_000004"]
    assert (root / "latest").read_text() == "step_000006"
    assert _steps(first) == ["step_000005"]
    [second] = [p for p in root.iterdir() if p.name.startswith("abandoned-") and p != first]
    assert _steps(second) == ["step_000004", "step_000005", "step_000006", "step_000007"]
    logged = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert logged == [1, 2, 3, 4, 5, 6]


def test_resuming_the_newest_checkpoint_is_no_branch(dataset, tmp_path):
    run = tmp_path / "run"
    train(load_config(TrainConfig, None, _args(dataset, run, "--steps=2", "--checkpoint.keep=1")))
    train(load_config(TrainConfig, None, _args(dataset, run, "--steps=3", "--checkpoint.keep=1")), resume="auto")
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["latest", "step_000003"]


# -- starting from a kilovla policy folder: its model comes with it -------------------------------------

@pytest.fixture(scope="module")
def narrow_policy(dataset, tmp_path_factory):
    """A 2-step run's last checkpoint, trained with overrides and policy settings the preset does not have."""
    run = tmp_path_factory.mktemp("narrow") / "run"
    train(load_config(TrainConfig, None, _args(dataset, run, "--steps=2", "--policy.overrides.chunk_size=4",
                                               "--policy.overrides.expert.mlp_dim=48", "--policy.n_action_steps=3",
                                               "--policy.normalization=mean_std")))
    return run / "checkpoints" / "step_000002"


def test_init_from_a_policy_folder_builds_the_model_its_weights_were_trained_with(dataset, narrow_policy, tmp_path):
    run = tmp_path / "ft"
    train(load_config(TrainConfig, None, _args(dataset, run, "--steps=1", f"--policy.init_from={narrow_policy}",
                                               "--optim.lr=0", "--policy.overrides.packing=true")))
    policy = json.loads((run / "checkpoints" / "step_000001" / "policy.json").read_text())
    assert policy["preset"] == "pi05-tiny"
    assert policy["overrides"] == {"chunk_size": 4, "expert": {"mlp_dim": 48}, "packing": True}
    start, after = _weights(narrow_policy), _weights(run / "checkpoints" / "step_000001")
    assert after["paligemma_with_expert.gemma_expert.model.layers.0.mlp.up_proj.weight"].shape == (48, 32)
    assert start.keys() == after.keys() and all(torch.equal(start[k], after[k]) for k in start)  # lr 0: the folder's


def test_init_from_a_policy_folder_brings_its_policy_interface_settings(dataset, narrow_policy, tmp_path):
    """Unset, they are the folder's (what its weights were trained to read and emit), not the preset's."""
    run = tmp_path / "ft"
    train(load_config(TrainConfig, None, _args(dataset, run, "--steps=1", f"--policy.init_from={narrow_policy}")))
    policy = json.loads((run / "checkpoints" / "step_000001" / "policy.json").read_text())
    assert (policy["n_action_steps"], policy["normalization"]) == (3, "mean_std")  # preset: None, quantile
    base = json.loads((narrow_policy / "policy.json").read_text())
    assert policy["state_keys"] == base["state_keys"] and policy["camera_map"] == base["camera_map"]


@pytest.mark.parametrize("flag, message", [
    ("--policy.overrides.expert.mlp_dim=64", "policy.overrides.expert.mlp_dim=64 but policy.init_from="),
    ("--policy.preset=pi0-tiny", "policy.preset=pi0-tiny but policy.init_from="),
    ("--policy.state_keys=[action]", "policy.state_keys=['action'] but policy.init_from="),
])
def test_a_setting_that_contradicts_the_init_from_folder_is_one_line_exit_2(dataset, narrow_policy, tmp_path,
                                                                           capsys, flag, message):
    run = tmp_path / "ft"
    assert main(["train", *_args(dataset, run, "--steps=1", f"--policy.init_from={narrow_policy}", flag)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and message in err and "\n" not in err
    assert any(theirs in err for theirs in ("48", "pi05-tiny", "=3", "['observation.state']"))  # the folder's value
    assert not run.exists()


def test_init_from_brings_n_action_steps_as_a_default_a_run_may_change(narrow_policy):
    """How many actions of a chunk run per prediction is an execution choice, not part of the weights."""
    from kilovla.train.config import with_init_model

    brought = with_init_model(load_config(TrainConfig, None, [f"--policy.init_from={narrow_policy}"]))
    chosen = with_init_model(load_config(TrainConfig, None, [f"--policy.init_from={narrow_policy}",
                                                             "--policy.n_action_steps=2"]))
    assert (brought.policy.n_action_steps, chosen.policy.n_action_steps) == (3, 2)


@pytest.mark.parametrize("where", ["run", "latest"])
def test_init_from_a_run_folder_or_its_latest_brings_the_newest_checkpoints_model(narrow_policy, where):
    from kilovla.train.config import with_init_model

    run = narrow_policy.parent.parent
    path = run if where == "run" else run / "checkpoints" / "latest"
    cfg = with_init_model(load_config(TrainConfig, None, [f"--policy.init_from={path}"]))
    assert cfg.policy.init_from == str(narrow_policy)  # resolved once: weights and model from one folder
    assert cfg.policy.overrides == {"chunk_size": 4, "expert": {"mlp_dim": 48}}


def test_settings_equal_to_the_init_from_folder_are_accepted(narrow_policy):
    from kilovla.train.config import with_init_model

    cfg = with_init_model(load_config(TrainConfig, None, [f"--policy.init_from={narrow_policy}",
                                                          "--policy.preset=pi05-tiny",
                                                          "--policy.overrides.chunk_size=4"]))
    assert cfg.policy.preset == "pi05-tiny"
    assert cfg.policy.overrides == {"chunk_size": 4, "expert": {"mlp_dim": 48}}


# -- TensorBoard ------------------------------------------------------------------------------------------

def test_missing_tensorboard_is_a_warning_said_once(tmp_path, monkeypatch, caplog):
    import sys

    from kilovla.train import metrics

    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # import raises ImportError
    monkeypatch.setattr(metrics, "_told_no_tensorboard", False, raising=False)
    with caplog.at_level(logging.INFO, logger="kilovla.train.metrics"):
        for name in ("a", "b"):
            metrics.MetricsLogger(tmp_path / name).close()
    said = [r for r in caplog.records if r.name == "kilovla.train.metrics"]
    assert [r.levelno for r in said] == [logging.WARNING]
    assert "pip install 'kilovla[tensorboard]'" in said[0].getMessage()
    assert not (tmp_path / "a" / "tensorboard").exists()


def test_installed_tensorboard_gets_the_scalars(tmp_path):
    pytest.importorskip("tensorboard")
    from kilovla.train.metrics import MetricsLogger

    logger = MetricsLogger(tmp_path)
    logger.log({"step": 1, "loss": 0.5})
    logger.close()
    assert any(p.name.startswith("events.out.tfevents") for p in (tmp_path / "tensorboard").iterdir())


# -- counts that mean nothing ------------------------------------------------------------------------------

@pytest.mark.parametrize("flag, message", [
    ("--steps=0", "steps must be >= 1, not 0"),
    ("--steps=-1", "steps must be >= 1, not -1"),
    ("--checkpoint.every=0", "checkpoint.every must be >= 1, not 0"),
    ("--checkpoint.keep=-1", "checkpoint.keep must be >= 0, not -1"),
    ("--loader.engine=threads", "loader.engine must be one of inprocess, torch, ray, not 'threads'"),
    ("--loader.num_workers=-2", "loader.num_workers must be >= 0, not -2"),
    ("--optim.warmup_steps=-1", "optim.warmup_steps must be >= 0, not -1"),
    ("--optim.lr=-0.1", "optim.lr must be >= 0, not -0.1"),
    ("--optim.min_lr_ratio=2", "optim.min_lr_ratio must be in [0, 1], not 2"),
    ("--ema_decay=1.5", "ema_decay must be in [0, 1)"),
    ("--dataset.weights=[1,2]", "dataset.weights must be one positive number per dataset.roots entry (1)"),
    ("--batch.global_batch_size=0", "batch.global_batch_size must be >= 1, not 0"),
    ("--policy.n_action_steps=9", "policy.n_action_steps must be in [1, 8] (the model predicts chunks of 8), not 9"),
    ("--policy.n_action_steps=0", "policy.n_action_steps must be in [1, 8]"),
])
def test_a_count_that_means_nothing_is_refused_before_anything_is_written(dataset, tmp_path, capsys, flag, message):
    run = tmp_path / "run"
    assert main(["train", *_args(dataset, run, *unless_given(["--steps=2"], [flag]), flag)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and message in err and "\n" not in err
    assert not run.exists()


# -- LoRA on random weights ---------------------------------------------------------------------------------

def test_lora_on_random_weights_warns_once_and_on_an_init_from_does_not(dataset, narrow_policy, tmp_path, caplog):
    pytest.importorskip("peft")
    lora = ["--steps=1", "--policy.lora.rank=4"]
    with caplog.at_level(logging.WARNING, logger="kilovla.train.build"):
        train(load_config(TrainConfig, None, _args(dataset, tmp_path / "random", *lora)))
    said = [r.getMessage() for r in caplog.records if r.name == "kilovla.train.build"]
    assert len(said) == 1 and "LoRA on RANDOM weights" in said[0] and "--policy.lora.full" in said[0]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="kilovla.train.build"):
        train(load_config(TrainConfig, None, _args(dataset, tmp_path / "ft", *lora,
                                                   f"--policy.init_from={narrow_policy}")))
    assert not [r for r in caplog.records if r.name == "kilovla.train.build"]


# -- a run that stopped before its first step -------------------------------------------------------------

def test_a_run_dir_left_by_a_run_that_failed_at_step_0_is_reused_and_says_so(dataset, tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text("steps: 2\n")  # what a run writes before its first step
    (run / "tensorboard").mkdir()
    (run / "notes.txt").write_text("mine")
    assert main(["train", *_args(dataset, run, "--steps=2")]) == 0
    assert "stopped before its first step" in capsys.readouterr().out
    assert [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()] == [1, 2]
    assert (run / "notes.txt").read_text() == "mine"


def test_a_run_dir_with_a_logged_step_still_counts_as_a_run(dataset, tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text("steps: 2\n")
    (run / "metrics.jsonl").write_text('{"step": 1, "loss": 1.0}\n')
    assert main(["train", *_args(dataset, run, "--steps=2")]) == 2
    assert "run_dir holds a run: pass --resume auto" in capsys.readouterr().err
    assert (run / "metrics.jsonl").read_text() == '{"step": 1, "loss": 1.0}\n'


# -- staging folders a killed writer left ------------------------------------------------------------------

def test_writing_a_dataset_removes_the_staging_folders_of_dead_writers_of_that_destination(tmp_path):
    import subprocess
    import sys

    from kilovla.staging import _host, staging_path

    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead = int(gone.stdout)  # a pid whose process has exited
    dest = tmp_path / "ds"
    killed = tmp_path / f".ds.tmp-{_host()}-{dead}-0123abcd"
    live = staging_path(dest)  # this process: a writer still at work
    elsewhere = tmp_path / f".ds.tmp-otherhost-{dead}-0123abcd"  # another host's, on a shared filesystem
    other_dest = tmp_path / f".other.tmp-{_host()}-{dead}-0123abcd"
    legacy = tmp_path / ".ds.tmp-0123abcd"  # named before names carried a pid
    for p in (killed, live, elsewhere, other_dest, legacy):
        (p / "data").mkdir(parents=True)
    make_synthetic_dataset(dest, episodes=1, frames=4, resolution=(16, 16), seed=0)
    assert not killed.exists()
    assert all(p.exists() for p in (live, elsewhere, other_dest, legacy))
    assert (dest / "meta" / "info.json").is_file()


# -- resuming with settings the saved optimizer and schedule fix ---------------------------------------------

@pytest.mark.parametrize("flag, message", [
    ("--optim.lr=0.0001", "optim.lr=0.0001 (the checkpoint's: 0.0003)"),
    ("--optim.betas=[0.8,0.9]", "optim.betas=[0.8, 0.9] (the checkpoint's: [0.9, 0.95])"),
    ("--optim.warmup_steps=7", "optim.warmup_steps=7 (the checkpoint's: 50)"),
])
def test_resuming_with_another_optimizer_setting_is_one_line_exit_2(dataset, tmp_path, capsys, flag, message):
    run = tmp_path / "run"
    assert main(["train", *_args(dataset, run, "--steps=2")]) == 0
    before = (run / "config.yaml").read_text()
    assert main(["train", *_args(dataset, run, "--steps=3", flag), "--resume=auto"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and message in err and "\n" not in err
    assert "--policy.init_from=" in err  # the remedy: fine-tune from it in a new run
    assert (run / "config.yaml").read_text() == before and _steps(run / "checkpoints") == ["step_000001",
                                                                                          "step_000002"]


def test_resuming_with_more_steps_says_how_the_stretched_schedule_moves_the_learning_rate(dataset, tmp_path, caplog):
    run = tmp_path / "run"
    train(load_config(TrainConfig, None, _args(dataset, run, "--steps=4", "--optim.warmup_steps=1")))
    with caplog.at_level(logging.WARNING, logger="kilovla.train.checkpoint"):
        train(load_config(TrainConfig, None, _args(dataset, run, "--steps=6", "--optim.warmup_steps=1")),
              resume="auto")
    [said] = [r.getMessage() for r in caplog.records if "cosine" in r.getMessage()]
    # step 4 of 4 is the cosine's end (lr x min_lr_ratio); of 6 it is 3/5 of the way
    assert "steps=6, the checkpoint's run had steps=4" in said and "from 3e-05 to 0.000123" in said


def test_resuming_with_another_starting_checkpoint_is_refused_and_the_same_one_is_not(dataset, tmp_path, capsys):
    """config.yaml and policy.json named the new start while the weights continued from the checkpoint."""
    first = tmp_path / "first"
    assert main(["train", *_args(dataset, first, "--steps=2")]) == 0
    a, b = first / "checkpoints" / "step_000001", first / "checkpoints" / "step_000002"
    run = tmp_path / "run"
    assert main(["train", *_args(dataset, run, "--steps=1", f"--policy.path={a}")]) == 0
    assert main(["train", *_args(dataset, run, "--steps=2", f"--policy.path={a}"), "--resume=auto"]) == 0
    before = (run / "config.yaml").read_text()
    capsys.readouterr()
    assert main(["train", *_args(dataset, run, "--steps=3", f"--policy.path={b}"), "--resume=auto"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err and f"--policy.path={b} (the checkpoint's: {a})" in err
    assert f"(--policy.path={run / 'checkpoints' / 'step_000002'}, a fresh" in err  # the remedy, as typed
    assert (run / "config.yaml").read_text() == before and _steps(run / "checkpoints")[-1] == "step_000002"
    assert main(["train", *_args(dataset, run, "--steps=3"), "--resume=auto"]) == 0  # none given: fine
    # ... and the run still names its start (config.yaml said init_from: null, policy.json lost it)
    assert "init_from: " + str(a) in (run / "config.yaml").read_text()
    record = json.loads((run / "checkpoints" / "step_000003" / "policy.json").read_text())["init_from"]
    assert record["path"] == str(a.resolve())
    assert main(["train", *_args(dataset, first, "--steps=3", f"--policy.path={a}"), "--resume=auto"]) == 2
    assert "(the checkpoint's: None)" in capsys.readouterr().err  # started from random weights


def test_a_contradiction_names_policy_path_when_it_was_typed(dataset, narrow_policy, tmp_path, capsys):
    run = tmp_path / "ft"
    assert main(["train", *_args(dataset, run, "--steps=1", f"--policy.path={narrow_policy}",
                                 "--policy.preset=pi0-tiny")]) == 2
    assert f"policy.preset=pi0-tiny but policy.path={narrow_policy} was trained with" in capsys.readouterr().err
