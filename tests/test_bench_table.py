"""`kilovla bench table`: a suite's JSON rendered as README's markdown, with machine and load; and the
load average every suite records at its start and end."""

from __future__ import annotations

import json

import pytest

from kilovla.bench import common
from kilovla.bench.common import README_END, README_START, Row, render_suite, suite_started, write_suite
from kilovla.cli import main


def _suite(tmp_path, name="packing", **machine):
    data = {"suite": name, "quick": False, "machine": {"cpu": "AMD EPYC", "cores": 2, "gpu": None, "torch": "2.13.0",
                                                       **machine},
            "rows": [{"name": "train_samples_per_s", "unit": "samples/s", "baseline": 19.8, "ours": 34.7,
                      "ratio": 1.75, "limit": None, "note": "padded | packed"}]}
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps(data))
    return path, data


def test_a_suite_records_the_load_average_at_its_start_and_end_beside_the_old_machine_keys(tmp_path, monkeypatch):
    loads = iter([0.5, 2.25])
    monkeypatch.setattr(common.os, "getloadavg", lambda: (next(loads), 0.0, 0.0))
    suite_started("envs")
    path = write_suite("envs", [Row.compare("env_steps_per_s_64", "steps/s", 50.0, 100.0, higher_is_better=True)],
                       quick=True, out_dir=tmp_path)
    machine = json.loads(path.read_text())["machine"]
    assert set(machine) >= {"cpu", "cores", "gpu", "torch", "python"}
    assert (machine["load_avg_1m_start"], machine["load_avg_1m_end"]) == (0.5, 2.25)


def test_a_suite_written_without_a_start_mark_says_its_start_load_is_unknown(tmp_path):
    path = write_suite("pruning", [Row.compare("train_samples_per_s", "samples/s", 1.0, 2.0, higher_is_better=True)],
                       quick=True, out_dir=tmp_path)
    machine = json.loads(path.read_text())["machine"]
    assert machine["load_avg_1m_start"] is None and isinstance(machine["load_avg_1m_end"], float)


def test_render_suite_gives_machine_load_provenance_and_every_column(tmp_path):
    _, data = _suite(tmp_path, load_avg_1m_start=1.36, load_avg_1m_end=3.1)
    data["provenance"] = "Transcribed from README at a039621."
    assert render_suite(data).splitlines() == [
        "### `kilovla bench packing`", "",
        "AMD EPYC, 2 cores, no GPU, torch 2.13.0; load average 1.36 at start, 3.1 at end. "
        "Transcribed from README at a039621.", "",
        "| row | unit | baseline | ours | ratio | limit | note |", "|---|---|---|---|---|---|---|",
        "| train_samples_per_s | samples/s | 19.8 | 34.7 | 1.75 | - | padded \\| packed |"]


def test_bench_table_writes_the_tables_between_readmes_markers_only(tmp_path, capsys):
    _suite(tmp_path)
    readme = tmp_path / "README.md"
    readme.write_text(f"# title\n\nbefore\n\n{README_START}\nstale\n{README_END}\n\nafter\n")
    assert main(["bench", "table", str(tmp_path), "--readme", str(readme)]) == 0
    text = readme.read_text()
    assert text.startswith("# title\n\nbefore\n\n" + README_START + "\n\n### `kilovla bench packing`")
    assert "stale" not in text and text.endswith(f"padded \\| packed |\n\n{README_END}\n\nafter\n")
    assert main(["bench", "table", str(tmp_path), "--readme", str(readme)]) == 0
    assert capsys.readouterr().out.splitlines()[-1].endswith("tables already current")


def test_bench_table_refuses_a_readme_without_markers_in_one_line(tmp_path, capsys):
    _suite(tmp_path)
    readme = tmp_path / "README.md"
    readme.write_text("# no markers\n")
    assert main(["bench", "table", str(tmp_path), "--readme", str(readme)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"error: {readme}: no '") and "\n" not in err
    assert readme.read_text() == "# no markers\n"


@pytest.mark.parametrize("readme", ["nonexist.md", "binary.md", "."])
def test_bench_table_refuses_a_readme_it_cannot_read_in_one_line(tmp_path, capsys, readme):
    _suite(tmp_path)
    (tmp_path / "binary.md").write_bytes(b"\xff\xfe\xfa")
    path = tmp_path / readme
    assert main(["bench", "table", str(tmp_path), "--readme", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"error: {path}: cannot be read (") and "\n" not in err, err


def test_bench_table_refuses_a_json_that_is_not_a_suite(tmp_path, capsys):
    (tmp_path / "x.json").write_text('{"rows": 3}')
    assert main(["bench", "table", str(tmp_path / "x.json")]) == 2
    assert capsys.readouterr().err.startswith(f"error: {tmp_path / 'x.json'}: not a bench result")


def test_bench_table_orders_suites_as_the_cli_lists_them_and_skips_results_json(tmp_path, capsys):
    _suite(tmp_path, "serve")
    _suite(tmp_path, "data")
    (tmp_path / "results.json").write_text("{}")
    assert main(["bench", "table", str(tmp_path)]) == 0
    titles = [line for line in capsys.readouterr().out.splitlines() if line.startswith("### ")]
    assert titles == ["### `kilovla bench data`", "### `kilovla bench serve`"]
