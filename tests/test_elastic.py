"""Elastic training with torchrun's own agent on CPU/gloo: a lost node, a restart, the records it leaves."""

import json
import time
from pathlib import Path

import pytest

from conftest import train_args as _args
from kilovla.bench.common import _round
from kilovla.bench.elastic import free_port as _free_port, kill_node as _kill_node, lost_node_recovery
from kilovla.bench.elastic import torchrun_agent as _agent
from kilovla.config import load_config
from kilovla.errors import KilovlaError
from kilovla.train import elastic
from kilovla.train.trainer import TrainConfig, train


def _metrics(run_dir):
    complete = (Path(run_dir) / "metrics.jsonl").read_text().split("\n")[:-1]  # not a row being appended
    return [json.loads(line) for line in complete]


def _weights(run_dir, step):
    from safetensors.torch import load_file

    return load_file(str(Path(run_dir) / "checkpoints" / f"step_{step:06d}" / "model.safetensors"))


def _max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


def _wait_for_step(run_dir: Path, step: int, agents, timeout=180) -> None:
    path, t0 = run_dir / "metrics.jsonl", time.monotonic()
    while not (path.is_file() and any(r.get("step") == step for r in _metrics(run_dir))):
        assert all(a.poll() is None for a in agents), [a.communicate()[0][-3000:] for a in agents if a.poll() is not None]
        assert time.monotonic() - t0 < timeout, f"no step {step} within {timeout} s"
        time.sleep(0.2)


@pytest.fixture(scope="module")
def lost_node(train_dataset, tmp_path_factory):
    """Two agents, one rank each; the second node stops answering at step 4 and is killed once step 3 is
    logged: the run `kilovla bench elastic` times (its recovery row), read by the two tests below."""
    run = tmp_path_factory.mktemp("lost-node") / "run"
    row, extra = lost_node_recovery(_args(train_dataset, run), run, job="lost-node")
    return run, row, extra


def test_a_lost_node_restarts_on_the_survivor_with_the_uninterrupted_sample_stream(lost_node, reference):
    """The survivor re-rendezvouses alone, resumes the step-2 checkpoint without a flag change and finishes
    (lost_node_recovery raises if it does not)."""
    run = lost_node[0]
    records = _metrics(run)
    train_records = [r for r in records if r["kind"] == "train"]
    assert [r["step"] for r in train_records] == [1, 2, 3, 4]  # step 3, recomputed, logged once
    assert [r["world_size"] for r in train_records] == [2, 2, 1, 1]
    assert [r["sample_ids"] for r in train_records] == [r["sample_ids"] for r in _metrics(reference)]
    restart = next(r for r in records if r["kind"] == "restart")
    assert records.index(restart) == 2
    assert (restart["step"], restart["world_size_before"], restart["world_size_after"]) == (2, 2, 1)
    assert restart["steps_recomputed"] == 1 and restart["seconds_lost"] > 0 and restart["restart_count"] >= 1
    assert json.loads((run / "elastic.json").read_text())["run_id"] == "lost-node"
    assert _max_diff(_weights(reference, 4), _weights(run, 4)) < 1e-5  # on a smaller world: fp32 reduction order


def test_the_recovery_row_times_the_lost_node_in_its_parts(lost_node):
    """`kilovla bench elastic`'s recovery_s: the SIGKILL to the survivor's next step, with the parts the issue
    asks for, and the restart it read."""
    _, row, extra = lost_node
    assert row.name == "recovery_s" and row.baseline is None
    parts = extra["recovery_parts_s"]
    assert set(parts) == {"detection_s", "rendezvous_start_load_s", "first_step_s"}
    assert all(v >= 0 for v in parts.values())
    assert row.ours == _round(sum(parts.values()))  # as a Row rounds it: 4 decimals, 1 from 10 s up
    restart = extra["recovery_restart"]
    assert (restart["world_size_before"], restart["world_size_after"]) == (2, 1)


@pytest.mark.slow  # ~45 s: a one-node start, a node joining, the group restarted on two
def test_a_node_joining_restarts_the_group_on_two_with_the_uninterrupted_sample_stream(train_dataset, reference,
                                                                                        tmp_path):
    """One agent starts alone (`--nnodes=1:2`), its steps slowed while it is alone; a second agent joins after
    the step-2 checkpoint: torchrun restarts the workers (its restart count stays 0), and the run continues
    from the newest checkpoint on two ranks without a flag change."""
    run, port = tmp_path / "run", _free_port()
    args = _args(train_dataset, run)
    first = _agent(args, port, "scale-up", env={"KILOVLA_FAULT_SLOW": "1:4"}, heartbeat="")
    agents = [first]
    try:
        _wait_for_step(run, 2, agents)
        agents.append(_agent(args, port, "scale-up", host=False, heartbeat=""))
        out, _ = first.communicate(timeout=240)
        joined_out, _ = agents[1].communicate(timeout=60)
    finally:
        for agent in agents:
            if agent.poll() is None:
                _kill_node(agent)
    assert first.returncode == 0 and agents[1].returncode == 0, (out[-4000:], joined_out[-4000:])
    records = _metrics(run)
    train_records = [r for r in records if r["kind"] == "train"]
    assert [r["step"] for r in train_records] == [1, 2, 3, 4], (out[-4000:], joined_out[-4000:])
    sizes = [r["world_size"] for r in train_records]
    assert sizes[:2] == [1, 1] and sizes[-1] == 2, sizes
    assert [r["sample_ids"] for r in train_records] == [r["sample_ids"] for r in _metrics(reference)]
    restart = next(r for r in records if r["kind"] == "restart")
    assert (restart["world_size_before"], restart["world_size_after"]) == (1, 2)
    assert restart["restart_count"] == 0  # a membership change: torchrun's count cannot be the signal
    assert _max_diff(_weights(reference, 4), _weights(run, 4)) < 1e-5


def _cfg(run_dir, dataset, *flags):
    return load_config(TrainConfig, None, [f"--run_dir={run_dir}", f"--dataset.roots=[{dataset}]", "--steps=2",
                                           "--progress=false", *flags])


def _used_run_dir(run_dir: Path, job: str, world_size: int = 2) -> Path:
    """A run_dir an elastic job wrote before its first checkpoint: config.yaml, one metrics row, elastic.json."""
    run_dir.mkdir(parents=True)
    (run_dir / "config.yaml").write_text("steps: 2\n")
    (run_dir / "metrics.jsonl").write_text(json.dumps({"kind": "train", "step": 1, "loss": 1.0}) + "\n")
    (run_dir / "elastic.json").write_text(json.dumps({"run_id": job, "world_size": world_size, "started_at": 0}))
    return run_dir


def test_another_job_into_a_used_run_dir_is_refused_on_every_retry(train_dataset, tmp_path, monkeypatch):
    run = _used_run_dir(tmp_path / "run", "job-a")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-b")
    for restart_count in ("0", "1"):  # torchrun's retries of the refused start
        monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", restart_count)
        with pytest.raises(KilovlaError, match="run_dir holds a run: pass --resume auto"):
            train(_cfg(run, train_dataset))
        assert json.loads((run / "elastic.json").read_text())["run_id"] == "job-a"


def test_the_same_job_restarting_before_its_first_checkpoint_starts_over(train_dataset, tmp_path, monkeypatch):
    run = _used_run_dir(tmp_path / "run", "job-a")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-a")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    train(_cfg(run, train_dataset, "--batch.global_batch_size=16", "--batch.token_budget=150",
               "--policy.overrides.chunk_size=4"))
    records = _metrics(run)
    assert [(r["kind"], r["step"]) for r in records] == [("restart", 0), ("train", 1), ("train", 2)]
    assert (records[0]["world_size_before"], records[0]["world_size_after"], records[0]["steps_recomputed"]) == (2, 1, 1)
    assert json.loads((run / "elastic.json").read_text())["world_size"] == 1


def test_a_restart_onto_a_world_tp_does_not_divide_is_refused_in_one_line(train_dataset, tmp_path, monkeypatch):
    run = _used_run_dir(tmp_path / "run", "job-a", world_size=4)
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-a")
    monkeypatch.setenv("WORLD_SIZE", "3")
    with pytest.raises(KilovlaError) as e:
        train(_cfg(run, train_dataset, "--parallel.tp=2"))
    assert str(e.value) == ("elastic restart onto 3 ranks (was 4): parallel.tp=2 x parallel.pp=1 x parallel.ep=1 does "
                            "not divide it; torchrun's retries end the job: relaunch it with --resume auto on a world "
                            "size that tp x pp x ep divides (torchrun --nnodes and --nproc-per-node)")
    with pytest.raises(KilovlaError, match=r"onto 3 ranks \(was 4\): .* parallel.ep=2 does not divide it"):
        elastic.check_world(1, 1, 3, {"world_size": 4}, ep=2)


@pytest.mark.parametrize("run_id, elastic_run", [(None, False), ("none", False), ("job-7", True)])
def test_the_step_deadline_follows_the_step_time_under_elastic_only(monkeypatch, run_id, elastic_run):
    if run_id is None:
        monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    else:
        monkeypatch.setenv("TORCHELASTIC_RUN_ID", run_id)
    assert elastic.step_deadline(None, []) == 1800
    assert elastic.step_deadline(None, [40.0, 50.0, 900.0]) == (500 if elastic_run else 1800)
    assert elastic.step_deadline(None, [2.0, 2.5]) == (300 if elastic_run else 1800)
    assert elastic.step_deadline(12.0, [40.0, 50.0]) == 12.0  # parallel.timeout_s, when set, wins


@pytest.mark.slow  # ~40 s: the watchdogs' 10 s deadline and grace, then a restart
def test_hung_ranks_end_by_their_watchdog_and_torchrun_restarts_the_group(train_dataset, reference, tmp_path):
    """Both ranks stop answering at step 3 (no collective fails: only the watchdogs can end them); the
    agent restarts the group, which resumes the step-2 checkpoint and finishes."""
    run = tmp_path / "run"
    agent = _agent([*_args(train_dataset, run), "--parallel.timeout_s=10"], _free_port(), "hung", nnodes="1",
                   nproc=2, restarts=1, env={"KILOVLA_FAULT_HANG": "*:3"})
    try:
        out, _ = agent.communicate(timeout=240)
    finally:
        if agent.poll() is None:
            _kill_node(agent)
    assert agent.returncode == 0, out[-4000:]
    assert "waited for step 3 past its deadline (10 s, parallel.timeout_s)" in out
    records = _metrics(run)
    assert [(r["kind"], r["step"]) for r in records] == [("train", 1), ("train", 2), ("restart", 2), ("train", 3),
                                                         ("train", 4)]
    assert (records[2]["world_size_before"], records[2]["world_size_after"]) == (2, 2)
    assert [r["sample_ids"] for r in records if r["kind"] == "train"] == [r["sample_ids"] for r in _metrics(reference)]
    for a, b in zip(_metrics(reference), [r for r in records if r["kind"] == "train"]):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5)  # 2 ranks against 1: reduction order only
    assert _max_diff(_weights(reference, 4), _weights(run, 4)) < 1e-5


def test_a_restartable_group_on_the_shared_rendezvous_store_is_warned_about(monkeypatch, caplog):
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "3")
    elastic.warn_shared_store(2)
    assert "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in caplog.text
    caplog.clear()
    elastic.warn_shared_store(1)  # one rank: no process group to reconnect
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "0")
    elastic.warn_shared_store(2)  # no restarts
    assert caplog.text == ""


def test_a_rank_that_aborts_in_native_code_prints_its_python_stacks(tmp_path):
    """A C++ `terminate` (SIGABRT) in one rank of a gloo group leaves more than torchrun's "Signal 6": every
    thread's Python stack, so the log says where in the step or the teardown it died."""
    import subprocess
    import sys

    script = tmp_path / "abort_rank1.py"
    script.write_text("import os\nfrom kilovla.train import distributed\n\n\ndef lose_rank_one(world):\n"
                      "    if world.rank == 1:\n        os.abort()\n    distributed.barrier(world, 'the end')\n\n\n"
                      "lose_rank_one(distributed.init(timeout_s=30))\n")
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           str(script)], capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert "Fatal Python error: Aborted" in proc.stderr, proc.stderr[-3000:]
    assert 'abort_rank1.py", line 7 in lose_rank_one' in proc.stderr
