"""Progress off a terminal: plain lines at least every 10 s of work, rates and ETA, a last line."""

import io
import subprocess
import sys

from kilovla.progress import PlainLines, StepProgress, TaskProgress, duration


class FakeClock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def test_plain_lines_are_throttled_and_a_heartbeat_fills_long_gaps():
    clock, out = FakeClock(), io.StringIO()
    lines = PlainLines("train", every_s=10, stream=out, clock=clock)
    lines.say("step 1/100", force=True)
    clock.t = 3
    lines.say("step 2/100")  # 3 s after the last line: not printed
    lines.beat()
    clock.t = 12
    lines.beat()  # 12 s of silence: the heartbeat repeats the last status
    clock.t = 14
    lines.say("step 3/100")  # 2 s after the heartbeat: not printed
    clock.t = 23
    lines.say("step 4/100")
    assert out.getvalue().splitlines() == ["train: step 1/100", "train: still at step 2/100 after 12s",
                                           "train: step 4/100"]


def test_step_progress_off_a_terminal_prints_start_rate_eta_and_end(capsys):
    with StepProgress("train", total=4, start=0, enabled=True, terminal=False) as progress:
        for step in range(1, 5):
            progress.update(step, f"loss {1 / step:.2f}")
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "train: step 0/4, starting"
    assert lines[-1].startswith("train: step 4/4 (100 %)  loss 0.25  elapsed") and "ETA 0s" in lines[-1]


def test_task_progress_off_a_terminal_names_the_task_and_the_count(capsys):
    progress = TaskProgress("eval", terminal=False)
    with progress:
        progress.callback("reach-v3", 1, 2)
        progress.callback("reach-v3", 2, 2)
    last = capsys.readouterr().out.splitlines()[-1]
    assert last.startswith("eval: reach-v3 2/2 episodes  (2 in 1 task(s)")


def test_duration_reads_like_a_clock():
    assert [duration(s) for s in (3, 106, 7300)] == ["3s", "1m46s", "2h01m"]


def test_train_with_stdout_in_a_file_prints_progress_lines(tmp_path):
    from kilovla.data.synthetic import make_synthetic_dataset

    ds = make_synthetic_dataset(tmp_path / "ds", episodes=2, frames=(12, 16), resolution=(32, 32), seed=2)
    log = tmp_path / "log"
    with log.open("w") as f:  # not a terminal, as in `kilovla train ... > log`
        proc = subprocess.run([sys.executable, "-m", "kilovla", "train", f"--run_dir={tmp_path / 'run'}", "--steps=3",
                               f"--dataset.roots=[{ds}]", "--batch.global_batch_size=4"], stdout=f,
                              stderr=subprocess.PIPE, text=True, timeout=300,
                              env={**__import__("os").environ, "KILOVLA_PROGRESS_EVERY_S": "0"})
    assert proc.returncode == 0, proc.stderr
    lines = [line for line in log.read_text().splitlines() if line.startswith("train: step")]
    assert lines[0] == "train: step 0/3, starting"
    assert [line.split()[2] for line in lines[1:4]] == ["1/3", "2/3", "3/3"]  # every update, with the throttle at 0
    assert all("samples/s" in line and "ETA" in line for line in lines[1:])


def test_a_bench_suite_off_a_terminal_says_each_row_as_it_is_measured(capsys):
    from kilovla.bench.common import Row
    from kilovla.progress import Heartbeat

    with Heartbeat("bench rl", terminal=False):
        Row.compare("env_steps_per_s_sigma_1.0", "steps/s", 44.8, 111.4, higher_is_better=True)
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "bench rl: running"
    assert lines[1].startswith("bench rl: env_steps_per_s_sigma_1.0: ours 111.4, baseline 44.8 steps/s")
    assert lines[2].startswith("bench rl: done in")


def test_quick_load_rows_are_named_for_the_tiny_shapes_they_measure():
    from kilovla.bench import load

    assert sorted(load.QUICK.values()) == ["groot_tiny", "pi05_tiny"]
    assert not set(load.QUICK.values()) & set(load.PRESETS.values())


def test_a_nested_heartbeat_speaks_and_the_outer_one_keeps_quiet_until_it_ends():
    """An evaluation inside a training run: the run must not repeat `still at step 2/2` over the eval's lines."""
    clock, out = FakeClock(), io.StringIO()
    train = PlainLines("train", every_s=10, stream=out, clock=clock)
    evaluation = PlainLines("eval", every_s=10, stream=out, clock=clock)
    train.start()
    try:
        train.say("step 2/2", force=True)
        evaluation.start()
        evaluation.say("reach-v3 0/4 episodes", force=True)
        clock.t = 12
        train.beat()
        evaluation.beat()
        evaluation.stop()
        clock.t = 15
        train.beat()  # 3 s after the evaluation ended: not yet
        clock.t = 23
        train.beat()
    finally:
        evaluation.stop()
        train.stop()
    assert out.getvalue().splitlines() == ["train: step 2/2", "eval: reach-v3 0/4 episodes",
                                           "eval: still at reach-v3 0/4 episodes after 12s",
                                           "train: still at step 2/2 after 23s"]


def test_task_progress_under_a_live_bar_prints_lines_instead_of_a_second_bar(monkeypatch):
    """rich shows one live display at a time: an evaluation during a training run on a terminal must not
    start a second bar (rich would raise LiveError)."""
    monkeypatch.setattr("kilovla.progress.on_terminal", lambda stream=None: True)
    with StepProgress("train", total=2, start=0, enabled=True):
        inner = TaskProgress("eval")
        with inner:
            inner.callback("reach-v3", 1, 1)
        assert inner.terminal is False
    assert TaskProgress("eval").terminal is True
