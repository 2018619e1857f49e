"""A NaN or inf stops training at its step: one line naming the step and the term, exit 2, no checkpoint
of it, on every rank at the same step."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from kilovla.cli import main
from kilovla.data.synthetic import make_synthetic_dataset


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    return make_synthetic_dataset(tmp_path_factory.mktemp("nonfinite") / "ds", episodes=4, frames=(16, 24),
                                  resolution=(32, 32), seed=5)


def _args(dataset, run_dir, steps=3):
    return [f"--run_dir={run_dir}", f"--steps={steps}", f"--dataset.roots=[{dataset}]", "--batch.global_batch_size=8",
            "--batch.token_budget=150", "--checkpoint.every=1", "--policy.preset=pi05-tiny", "--progress=false",
            "--policy.overrides.chunk_size=4", "--optim.warmup_steps=1"]


def _steps_logged(run_dir):
    return [json.loads(line)["step"] for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


def _checkpoints(run_dir):
    return sorted(p.name for p in (Path(run_dir) / "checkpoints").glob("step_*"))


def _all_finite(run_dir, name):
    weights = load_file(str(Path(run_dir) / "checkpoints" / name / "model.safetensors"))
    return all(bool(torch.isfinite(t).all()) for t in weights.values())


def test_a_nan_in_a_step_s_data_stops_the_run_at_that_step(dataset, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("KILOVLA_FAULT_NAN", "0:2")  # rank 0's data of step 2 holds a NaN action
    run = tmp_path / "run"
    assert main(["train", *_args(dataset, run)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error: step 2: the flow-matching loss is nan: stopped before the optimizer step")
    assert _steps_logged(run) == [1]
    assert _checkpoints(run) == ["step_000001"] and _all_finite(run, "step_000001")
    assert not (run / "summary.json").exists()


def test_a_diverging_learning_rate_on_finite_data_stops_the_same_way(dataset, tmp_path, capsys):
    run = tmp_path / "run"
    assert main(["train", *_args(dataset, run), "--optim.lr=1e30"]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("error: step 2: the flow-matching loss is nan: stopped before the optimizer step"), err
    assert _steps_logged(run) == [1] and _checkpoints(run) == ["step_000001"] and _all_finite(run, "step_000001")


def test_weights_stepped_past_float_range_are_never_checkpointed(dataset, tmp_path, monkeypatch, capsys):
    from kilovla.train import trainer

    real = trainer.update_ema

    def overflowing(ema, model, decay):  # as an optimizer step of a huge learning rate would
        real(ema, model, decay)
        with torch.no_grad():
            next(model.parameters()).view(-1)[0] = float("inf")

    monkeypatch.setattr(trainer, "update_ema", overflowing)
    run = tmp_path / "run"
    assert main(["train", *_args(dataset, run)]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("error: step 1: weights are NaN or inf after the optimizer step"), err
    assert _checkpoints(run) == []


def test_a_non_finite_gradient_norm_under_a_finite_loss_is_named_as_such():
    from kilovla.errors import KilovlaError
    from kilovla.train.trainer import check_finite_step

    check_finite_step(4, 1.5, 2.0)  # finite: nothing to say
    with pytest.raises(KilovlaError, match=r"^step 4: the gradient norm is inf \(the loss is 1.5\): stopped before "
                                           r"the optimizer step"):
        check_finite_step(4, 1.5, float("inf"))


def test_a_finite_run_writes_strict_json(dataset, tmp_path):
    run = tmp_path / "run"
    assert main(["train", *_args(dataset, run, steps=1)]) == 0

    def refuse(name):
        raise ValueError(f"{name} in summary.json")

    summary = json.loads((run / "summary.json").read_text(), parse_constant=refuse)
    assert summary["steps"] == 1


def test_every_rank_stops_at_the_step_one_rank_s_nan_reaches(dataset, tmp_path):
    """Rank 1's data of step 2 holds the NaN; rank 0's does not. Both read the all-reduced loss, so both
    stop at step 2 and neither waits in a collective for the other. Each rank says so before a barrier;
    after the first rank exits torchrun may SIGTERM the other before its error line, so the error lines
    are at least one, all of step 2."""
    run = tmp_path / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "KILOVLA_FAULT_NAN": "1:2"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "-m", "kilovla", "train",
           *_args(dataset, run), "--parallel.timeout_s=60"]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=240)
    assert proc.returncode != 0
    ranks = re.findall(r"rank (\d) of 2 stops at step (\d+)", proc.stderr)
    assert sorted(ranks) == [("0", "2"), ("1", "2")], proc.stderr[-3000:]
    stops = re.findall(r"error: step (\d+): the flow-matching loss is nan", proc.stderr)
    assert stops in (["2"], ["2", "2"]) and proc.stderr.count("error: ") == len(stops), proc.stderr[-3000:]
    assert "exitcode  : 2" in proc.stderr and "waited" not in proc.stderr, proc.stderr[-3000:]
    assert _steps_logged(run) == [1] and _checkpoints(run) == ["step_000001"]
