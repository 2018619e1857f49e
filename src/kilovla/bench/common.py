"""The one result format every benchmark suite writes (see DESIGN.md, Benchmarks).

`ratio` is oriented so that > 1 means ours is better: ours/baseline for throughput
(`higher_is_better=True`), baseline/ours for time, bytes and waste.
"""

from __future__ import annotations

import json
import os
import statistics
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from kilovla.errors import KilovlaError
from kilovla.machine import load_average, machine_info
from kilovla.progress import note

# `kilovla bench SUITE`'s suites, in the order `bench all` runs them and `bench table` prints them
SUITES = ("data", "lake", "envs", "packing", "pruning", "moe", "scaling", "elastic", "load", "memory", "rl", "fp8",
          "serve")

DEFAULT_OUT = "bench-results"
README_START = "<!-- bench-tables:start (kilovla bench table docs/bench --readme README.md) -->"
README_END = "<!-- bench-tables:end -->"
_load_at_start: dict[str, float | None] = {}


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


def suite_started(suite: str) -> None:
    """Note the load average as a suite starts; `write_suite` records it beside the one at the end."""
    _load_at_start[suite] = load_average()


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
    machine = {**machine_info(), "load_avg_1m_start": _load_at_start.pop(suite, None),
               "load_avg_1m_end": load_average()}
    result = {"suite": suite, "quick": quick, "machine": machine, "rows": [asdict(r) for r in rows]}
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


# -- README's tables, rendered from the suites' JSON ----------------------------------------------------
def describe_machine(machine: dict) -> str:
    """One line: `AMD EPYC, 2 cores, no GPU, torch 2.13.0; load average 1.36 at start`."""
    parts = [str(machine.get("cpu") or "unknown CPU")]
    if machine.get("cores"):
        parts.append(f"{machine['cores']} cores")
    parts.append(machine["gpu"] if machine.get("gpu") else "no GPU")
    if machine.get("torch"):
        parts.append(f"torch {machine['torch']}")
    text = ", ".join(parts)
    start, end = machine.get("load_avg_1m_start"), machine.get("load_avg_1m_end")
    loads = [f"{v:g} at {when}" for v, when in ((start, "start"), (end, "end")) if v is not None]
    text += "; load average " + (", ".join(loads) if loads else "not recorded")
    return text


def render_suite(data: dict) -> str:
    """A suite's JSON as README's markdown: a heading, the machine and load, the provenance when the
    file carries one, the rows. The table's columns are the JSON's keys, so nothing is re-typed.

    >>> print(render_suite({"suite": "x", "quick": False, "machine": {"cpu": "EPYC", "cores": 2},
    ...     "rows": [{"name": "r", "unit": "s", "baseline": 2.0, "ours": 1.0, "ratio": 2.0, "limit": None,
    ...               "note": "n"}]}))
    ### `kilovla bench x`
    <BLANKLINE>
    EPYC, 2 cores, no GPU; load average not recorded.
    <BLANKLINE>
    | row | unit | baseline | ours | ratio | limit | note |
    |---|---|---|---|---|---|---|
    | r | s | 2 | 1 | 2 | - | n |
    """
    title = f"### `kilovla bench {data['suite']}{' --quick' if data.get('quick') else ''}`"
    about = describe_machine(data.get("machine") or {}) + "."
    kept = data.get("kept_rows")
    if kept:
        about += f" Rows {', '.join(kept['names'])}: an earlier run on {describe_machine(kept.get('machine') or {})}."
    if data.get("provenance"):
        about += f" {data['provenance']}"
    lines = [title, "", about, "", "| row | unit | baseline | ours | ratio | limit | note |",
             "|---|---|---|---|---|---|---|"]
    for r in data["rows"]:
        cells = [r["name"], r["unit"], *(_fmt(r.get(k)) for k in ("baseline", "ours", "ratio", "limit")),
                 str(r.get("note", "")).replace("|", "\\|")]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def suite_files(path: str | Path) -> list[Path]:
    """`path` is one suite's JSON or a folder of them (results.json, the combined file, is not a suite)."""
    path = Path(path)
    if path.is_file():
        return [path]
    if not path.is_dir():
        raise KilovlaError(f"{path}: no such file or folder of bench JSON")
    files = [p for p in sorted(path.glob("*.json")) if p.name != "results.json"]
    if not files:
        raise KilovlaError(f"{path}: holds no <suite>.json")
    return files


def render_tables(path: str | Path) -> str:
    """Every suite under `path`, one table each, in the suites' order (SUITES), then any other."""

    loaded = []
    for f in suite_files(path):
        try:
            data = json.loads(f.read_text())
            if not isinstance(data.get("rows"), list) or "suite" not in data:
                raise ValueError("no suite or rows")
        except (OSError, ValueError, AttributeError) as e:
            raise KilovlaError(f"{f}: not a bench result ({e})") from None
        loaded.append(data)
    order = {s: i for i, s in enumerate(SUITES)}
    loaded.sort(key=lambda d: (order.get(d["suite"], len(order)), d["suite"], bool(d.get("quick"))))
    return "\n\n".join(render_suite(d) for d in loaded)


def update_readme(readme: str | Path, tables: str) -> bool:
    """Put `tables` between README's two markers (README_START / README_END); True if it changed."""
    readme = Path(readme)
    try:
        text = readme.read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise KilovlaError(f"{readme}: cannot be read ({getattr(e, 'strerror', None) or e})") from None
    start, end = text.find(README_START), text.find(README_END)
    if start < 0 or end < start:
        raise KilovlaError(f"{readme}: no '{README_START}' ... '{README_END}' block to fill")
    new = text[:start + len(README_START)] + "\n\n" + tables + "\n\n" + text[end:]
    if new == text:
        return False
    tmp = readme.with_name(f".{readme.name}.{uuid.uuid4().hex[:8]}")
    tmp.write_text(new)
    os.replace(tmp, readme)
    return True
