"""The one result format every benchmark suite writes (see DESIGN.md, Benchmarks).

`ratio` is oriented so that > 1 means ours is better: ours/baseline for throughput
(`higher_is_better=True`), baseline/ours for time, bytes and waste.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from kilovla.progress import note

DEFAULT_OUT = "bench-results"


@dataclass
class Row:
    name: str
    unit: str
    baseline: float | None
    ours: float | None
    ratio: float | None
    limit: float | None
    note: str

    def __post_init__(self) -> None:
        # A suite runs for minutes: each row is said as soon as it is measured (kilovla.progress).
        note(f"{self.name}: ours {_fmt(self.ours)}, baseline {_fmt(self.baseline)} {self.unit}")

    @classmethod
    def compare(cls, name: str, unit: str, baseline: float | None, ours: float | None, *, higher_is_better: bool,
                limit: float | None = None, note: str = "") -> Row:
        ratio = None
        if baseline is not None and ours is not None:
            num, den = (ours, baseline) if higher_is_better else (baseline, ours)
            ratio = round(num / den, 3) if den else None
        return cls(name, unit, _round(baseline), _round(ours), ratio, limit, note)


def _round(x: float | None) -> float | None:
    if x is None:
        return None
    return round(float(x), 4 if abs(x) < 10 else 1)


def machine_info() -> dict:
    import torch

    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    return {"cpu": cpu, "cores": os.cpu_count(), "gpu": gpu, "torch": torch.__version__.split("+")[0],
            "python": platform.python_version()}


def median_time(fn: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def write_suite(suite: str, rows: list[Row], *, quick: bool, out_dir: str | Path = DEFAULT_OUT,
                extra: dict | None = None, console=None, merge: bool = False) -> Path:
    """Print the table and write `out_dir/<suite>.json` atomically; returns the JSON path. `merge` (a run of
    part of the suite): rows and extra keys of an earlier same-`quick` file that this run did not measure stay."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{suite}.json"
    result = {"suite": suite, "quick": quick, "machine": machine_info(), "rows": [asdict(r) for r in rows]}
    if merge and path.is_file():
        try:
            earlier = json.loads(path.read_text())
        except (OSError, ValueError):
            earlier = {}
        if earlier.get("suite") == suite and earlier.get("quick") == quick:
            names = {r.name for r in rows}
            kept = [r for r in earlier.get("rows", []) if r.get("name") not in names]
            result = {**{k: v for k, v in earlier.items() if k not in ("machine", "rows", "kept_rows")}, **result,
                      "rows": kept + result["rows"]}
            if kept:  # measured by an earlier invocation, perhaps on another machine
                result["kept_rows"] = {"names": [r["name"] for r in kept], "machine": earlier.get("machine")}
    if extra:
        result.update(extra)
    tmp = out_dir / f".{suite}.json.{uuid.uuid4().hex[:8]}"
    tmp.write_text(json.dumps(result, indent=2))
    os.replace(tmp, path)
    print_rows(suite, rows, console=console)
    return path


def print_rows(title: str, rows: list[Row], console=None) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"kilovla bench {title}")
    for col in ("row", "unit", "baseline", "ours", "ratio", "limit", "note"):
        table.add_column(col, overflow="fold")
    for r in rows:
        table.add_row(r.name, r.unit, _fmt(r.baseline), _fmt(r.ours), _fmt(r.ratio), _fmt(r.limit), r.note)
    (console or Console(width=max(Console().width, 150))).print(table)


def _fmt(x) -> str:
    return "-" if x is None else f"{x:g}"


def write_results(out_dir: str | Path, suites: list[str]) -> tuple[Path, Path]:
    """Combine the suites' JSON into DIR/results.json and a markdown table DIR/results.md."""
    out_dir = Path(out_dir)
    combined = {"machine": machine_info(), "suites": {}}
    lines = ["# kilovla benchmark results", "", "| suite | row | unit | baseline | ours | ratio | limit | note |",
             "|---|---|---|---|---|---|---|---|"]
    for suite in suites:
        data = json.loads((out_dir / f"{suite}.json").read_text())
        combined["suites"][suite] = data
        for r in data["rows"]:
            lines.append(f"| {suite} | {r['name']} | {r['unit']} | {_fmt(r['baseline'])} | {_fmt(r['ours'])} | "
                         f"{_fmt(r['ratio'])} | {_fmt(r['limit'])} | {r['note']} |")
    paths = []
    for name, text in (("results.json", json.dumps(combined, indent=2)), ("results.md", "\n".join(lines) + "\n")):
        tmp = out_dir / f".{name}.{uuid.uuid4().hex[:8]}"
        tmp.write_text(text)
        os.replace(tmp, out_dir / name)
        paths.append(out_dir / name)
    return paths[0], paths[1]
