"""Progress of long work: a live bar on a terminal, plain lines everywhere else.

    with StepProgress("train", total=1000, start=0, enabled=True) as p:
        p.update(step, "loss 0.0412  530 samples/s")

On a terminal: a rich progress bar. Not on a terminal (`> log`, CI, a batch scheduler), where a bar
would print nothing until it ends: a line when the work starts, a line at an update once
`PLAIN_EVERY_S` seconds have passed since the last one, a heartbeat line from a background thread
when an update is longer in coming than that, and a last line at the end:

    train: step 120/1000 (12 %)  loss 0.0412  530 samples/s  elapsed 14s  ETA 1m46s
    train: still at step 120/1000 (12 %) after 25s (checkpoint at step 120?)

Progress nests: an evaluation inside a training run speaks through its own lines while the run's
heartbeat stays silent (only the innermost heartbeat speaks), and its bar becomes plain lines under
the run's bar (a terminal shows one live bar at a time).

`StepProgress` counts steps (train, rl); `TaskProgress` episodes per task (eval, collect);
`CountProgress` items (data cache, data synth); `Heartbeat` wraps work with no counter of its own
(a benchmark suite) and prints the lines `note()` gives it.
"""

from __future__ import annotations

import os
import sys
import threading
import time

PLAIN_EVERY_S = float(os.environ.get("KILOVLA_PROGRESS_EVERY_S", "10"))

_speaking: list[PlainLines] = []  # started heartbeats, innermost last: only that one beats
_live_bars: list[object] = []  # rich bars on screen now (rich shows one at a time)


def _bar_shown(bar, shown: bool) -> None:
    if shown:
        _live_bars.append(bar)
    elif bar in _live_bars:
        _live_bars.remove(bar)


def on_terminal(stream=None) -> bool:
    return (stream or sys.stdout).isatty()


def duration(seconds: float) -> str:
    """3 -> '3s', 106 -> '1m46s', 7300 -> '2h01m'."""
    s = int(round(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


class PlainLines:
    """Throttled plain lines with a heartbeat: `say(line)` prints at most every `every_s` unless
    forced; when nothing was printed for `every_s`, the heartbeat repeats the last status."""

    def __init__(self, label: str, every_s: float = PLAIN_EVERY_S, stream=None, clock=time.monotonic):
        self.label, self.every_s, self.clock = label, every_s, clock
        self.stream = stream or sys.stdout
        self.t0 = self.last = clock()
        self.status = "starting"
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = None

    POLL_S = 0.5  # how often the heartbeat thread looks; it speaks this much before every_s is up

    def say(self, status, force: bool = False) -> None:
        """`status`: a line, or a function giving it (the heartbeat then repeats it with fresh figures)."""
        with self._lock:
            self.status = status
            if force or self.clock() - self.last >= self.every_s - self.POLL_S:  # before the heartbeat would
                self._print(f"{self.label}: {self._text()}")

    def _text(self) -> str:
        return self.status() if callable(self.status) else self.status

    def _print(self, line: str) -> None:
        print(line, file=self.stream, flush=True)
        self.last = self.clock()

    def beat(self) -> None:
        """One heartbeat check (the thread calls it; tests call it with a fake clock)."""
        if _speaking and _speaking[-1] is not self:  # work nested inside this one speaks for both
            return
        with self._lock:
            if self.clock() - self.last >= max(self.every_s - self.POLL_S, 1.0):
                self._print(f"{self.label}: still at {self._text()} after {duration(self.clock() - self.t0)}")

    def start(self) -> PlainLines:
        def loop():
            while not self._stop.wait(self.POLL_S):
                self.beat()

        self._thread = threading.Thread(target=loop, name=f"progress-{self.label}", daemon=True)
        _speaking.append(self)
        self._thread.start()
        return self

    def stop(self) -> None:
        if self in _speaking:
            _speaking.remove(self)
            if _speaking:  # the outer work speaks again from now, not at once
                _speaking[-1].last = _speaking[-1].clock()
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2)


class StepProgress:
    """Steps of a run with a one-line summary beside them; silent when disabled."""

    def __init__(self, label: str, total: int, start: int, enabled: bool, terminal: bool | None = None):
        self.enabled, self.label, self.total, self.start = enabled, label, total, start
        self.terminal = on_terminal() if terminal is None else terminal
        self._bar = self._plain = None
        self.step, self.info = start, ""
        if not enabled:
            return
        if self.terminal:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

            self._bar = Progress(TextColumn(label), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[info]}"),
                                 TimeRemainingColumn())
            self._task = self._bar.add_task(label, total=total, completed=start, info="")
        else:
            self._plain = PlainLines(label)

    def _status(self) -> str:
        pct = 100 * self.step / self.total if self.total else 100
        done = self.step - self.start
        elapsed = self._plain.clock() - self._plain.t0
        eta = f"  ETA {duration(elapsed / done * (self.total - self.step))}" if done > 0 else ""
        return f"step {self.step}/{self.total} ({pct:.0f} %)  {self.info}  elapsed {duration(elapsed)}{eta}".replace("    ", "  ")

    def __enter__(self):
        if self._bar is not None:
            self._bar.__enter__()
            _bar_shown(self._bar, True)
        elif self._plain is not None:
            self._plain.say(f"step {self.start}/{self.total}, starting", force=True)
            self._plain.start()
        return self

    def __exit__(self, *exc):
        if self._bar is not None:
            _bar_shown(self._bar, False)
            self._bar.__exit__(*exc)
        elif self._plain is not None:
            self._plain.stop()
            self._plain.say(self._status() + ("" if exc[0] is None else "  (stopped by an error)"), force=True)

    def update(self, step: int, info: str) -> None:
        self.step, self.info = step, info
        if self._bar is not None:
            self._bar.update(self._task, completed=step, info=info)
        elif self._plain is not None:
            self._plain.say(self._status)


class _Lines:
    """A rich bar on a terminal (`_bar`), plain lines elsewhere (`_plain`); a context manager that says
    when the work starts and, off a terminal, what it came to (`_last`)."""

    terminal: bool

    def _last(self) -> str | None:
        raise NotImplementedError

    def __enter__(self):
        self._results: list[str] = []
        _open.append(self)
        if self.terminal:
            self._bar.__enter__()
            _bar_shown(self._bar, True)
        else:
            self._plain.say("starting", force=True)
            self._plain.start()
        return self

    def __exit__(self, *exc):
        _open.remove(self)
        if self.terminal:
            _bar_shown(self._bar, False)
            self._bar.__exit__(*exc)
        else:
            self._plain.stop()
            last = self._last()
            if last is not None:
                self._plain.say(last, force=True)
        for line in self._results:
            print(line, flush=True)


_open: list[_Lines] = []  # entered progress, innermost last


def result(line: str) -> None:
    """Say what the work came to (an evaluation's success rate): after the innermost open progress's
    last line (and its bar), or at once when none is open."""
    if _open:
        _open[-1]._results.append(line)
    else:
        print(line, flush=True)


class TaskProgress(_Lines):
    """Episodes per task (evaluation, collection): `callback(task, done, total)`; a context manager."""

    def __init__(self, label: str, terminal: bool | None = None):
        self.label = label
        # under another bar (an evaluation during training): plain lines, which rich prints above it
        self.terminal = (on_terminal() and not _live_bars) if terminal is None else terminal
        self._done: dict[str, tuple[int, int]] = {}
        if self.terminal:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

            self._bar = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
            self._rows: dict[str, int] = {}
        else:
            self._plain = PlainLines(label)

    def callback(self, task: str, done: int, total: int) -> None:
        self._done[task] = (done, total)
        if self.terminal:
            if task not in self._rows:
                self._rows[task] = self._bar.add_task(f"{self.label} {task}", total=total)
            self._bar.update(self._rows[task], completed=done)
        else:
            self._plain.say(lambda: self._status(task))

    def _status(self, task: str) -> str:
        done, total = self._done[task]
        all_done = sum(d for d, _ in self._done.values())
        elapsed = self._plain.clock() - self._plain.t0
        rate = all_done / elapsed if elapsed > 0 else 0.0
        eta = f"  ETA {duration((total - done) / rate)} for this task" if rate > 0 and done < total else ""
        return (f"{task} {done}/{total} episodes  ({all_done} in {len(self._done)} task(s), {rate:.2f} episodes/s, "
                f"elapsed {duration(elapsed)}){eta}")

    def _last(self) -> str | None:
        return self._status(next(reversed(self._done))) if self._done else None


class CountProgress(_Lines):
    """Items of one job (episodes written, parts decoded): `callback(done, total)`; a context manager.
    `stream`: where the lines go (stderr when stdout carries the command's JSON)."""

    def __init__(self, label: str, total: int | None = None, terminal: bool | None = None, stream=None):
        self.label, self.total = label, total
        self.terminal = on_terminal(stream) if terminal is None else terminal
        self.done = 0
        if self.terminal:
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

            self._bar = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                                 TimeElapsedColumn(), transient=True, console=Console(file=stream or sys.stdout))
            self._task = self._bar.add_task(label, total=total)
        else:
            self._plain = PlainLines(label, stream=stream)

    def callback(self, done: int, total: int | None = None) -> None:
        self.done, self.total = done, total if total is not None else self.total
        if self.terminal:
            self._bar.update(self._task, completed=done, total=self.total)
        else:
            self._plain.say(self._status)

    def _status(self) -> str:
        elapsed = self._plain.clock() - self._plain.t0
        rate = self.done / elapsed if elapsed > 0 else 0.0
        eta = (f"  ETA {duration((self.total - self.done) / rate)}"
               if rate > 0 and self.total and self.done < self.total else "")
        return f"{self.done}/{self.total or '?'}  ({rate:.2f}/s, elapsed {duration(elapsed)}){eta}"

    def _last(self) -> str:
        return self._status()


_active: list[Heartbeat] = []


class Heartbeat:
    """Long work without a counter (a benchmark suite): off a terminal, a line at least every
    `PLAIN_EVERY_S` saying what is running; `note(line)` prints a line at once (on a terminal too)
    and becomes the status the heartbeat repeats."""

    def __init__(self, label: str, terminal: bool | None = None):
        self.label = label
        self.terminal = on_terminal() if terminal is None else terminal
        self._plain = PlainLines(label)

    def __enter__(self):
        _active.append(self)
        self._plain.say("running", force=True)
        if not self.terminal:
            self._plain.start()
        return self

    def __exit__(self, *exc):
        self._plain.stop()
        _active.remove(self)
        self._plain.say(f"done in {duration(self._plain.clock() - self._plain.t0)}"
                        + ("" if exc[0] is None else " (stopped by an error)"), force=True)

    def note(self, line: str) -> None:
        self._plain.say(f"{line}  (elapsed {duration(self._plain.clock() - self._plain.t0)})", force=True)
        self._plain.status = f"running (last: {line.split(':')[0]})"


def note(line: str) -> None:
    """Say `line` through the innermost active Heartbeat; nothing when none is active."""
    if _active:
        _active[-1].note(line)
