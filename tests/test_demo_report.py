"""The demo's closing tables, built from a report dict (no demo run): the success rates in one table whose
columns are the learned policy and the scripted expert, the run's facts (dataset, padding, training
throughput, wall time per phase) in another, in the console and in report.md alike."""

from rich.console import Console

from kilovla.demo import SUCCESS_COLUMNS, print_table, report_markdown, run_facts, success_rows


def _report() -> dict:
    rate = {"policy": 0.5, "expert": 1.0, "policy_ci95": [0.1, 0.9], "expert_ci95": [0.34, 1.0], "episodes": 2}
    return {
        "tasks": ["reach-v3", "drawer-close-v3"], "env_backend": "metaworld 3.1.1",
        "per_task": {"reach-v3": dict(rate), "drawer-close-v3": {**rate, "policy": 0.0, "policy_ci95": [0.0, 0.66]}},
        "policy_success_rate": 0.25, "expert_success_rate": 1.0, "policy_success_ci95": [0.05, 0.7],
        "expert_success_ci95": [0.51, 1.0], "relative_success": 0.25,
        "evaluation": {"episodes_per_task": 2},
        "dataset": {"episodes": 6, "frames": 392, "size_bytes": 3 * 2**20},
        "train": {"steps": 30, "samples_per_s": 1168.9, "step_samples_per_s": 1636.0, "padding_fraction": 0.012,
                  "budget_unused_fraction": 0.034, "final_loss": 0.6585, "data_wait_fraction": 0.02,
                  "frames_from_cache": True},
        "phase_wall_s": {"collect": 12.3, "frame_cache": 2.1, "train": 5.0, "evaluate": 150.0, "report": 0.6},
        "wall_s": 170.0, "machine": {"cpu": "AMD EPYC", "cores": 2},
        "files": {"videos": {"reach-v3": "eval-policy/videos/reach-v3/episode_000_success.mp4"},
                  "success_chart": None, "learning_curve": None},
    }


def test_the_success_table_has_a_row_per_task_and_overall_in_the_policy_and_expert_columns():
    assert SUCCESS_COLUMNS == ("task", "learned policy", "scripted expert")
    assert success_rows(_report()) == [("reach-v3 (2 episodes)", "50% [10%, 90%]", "100% [34%, 100%]"),
                                       ("drawer-close-v3 (2 episodes)", "0% [0%, 66%]", "100% [34%, 100%]"),
                                       ("overall", "25% [5%, 70%]", "100% [51%, 100%]")]


def test_the_run_facts_name_padding_dataset_one_throughput_and_the_wall_time_of_each_phase():
    facts = run_facts(_report())
    assert [name for name, _ in facts] == [
        "dataset", "training", "training samples/s (all samples / training wall time, set-up included)",
        "padding (of the token positions computed)", "packed rows' unused token budget", "data wait (of step time)",
        "wall time", "machine"]
    values = dict(facts)
    assert values["dataset"] == "6 episodes, 392 frames, 3.0 MiB"
    assert values["training samples/s (all samples / training wall time, set-up included)"] == "1169"
    assert values["padding (of the token positions computed)"] == "1.2%"
    assert values["wall time"] == "collect 12 s, frame cache 2 s, train 5 s, evaluate 2.5 min, report 1 s; total 2.8 min"
    # one samples/s figure: the median step's rate (report["train"]["step_samples_per_s"]) is not a second one
    assert sum("samples/s" in name or "samples/s" in value for name, value in facts) == 1


def test_the_console_prints_the_success_table_and_then_the_facts_in_a_table_of_their_own():
    console = Console(record=True, width=200)
    print_table(console, _report())
    text = console.export_text()
    results, facts = text.split("the run")  # the facts table's title
    header, rows = results.splitlines()[2], results.splitlines()[4:]  # under the title and the top border
    assert "learned policy" in header and "scripted expert" in header
    assert "success reach-v3 (2 episodes)" in rows[0] and "50% [10%, 90%]" in rows[0]
    assert "success overall" in rows[3] and "25% [5%, 70%]" in rows[3] and "100% [51%, 100%]" in rows[3]
    for fact in ("padding", "MiB", "samples/s", "wall time", "AMD EPYC"):
        assert fact not in results and fact in facts, fact
    assert "reaches 25% of the scripted expert's success" in results


def test_report_md_keeps_the_facts_out_of_the_policy_and_expert_columns():
    lines = report_markdown(_report()).splitlines()
    success = lines[lines.index("| task | learned policy | scripted expert | video |"):]
    success = success[:success.index("")]
    assert success[2:] == ["| reach-v3 (2 episodes) | 50% [10%, 90%] | 100% [34%, 100%] | "
                           "[mp4](eval-policy/videos/reach-v3/episode_000_success.mp4) |",
                           "| drawer-close-v3 (2 episodes) | 0% [0%, 66%] | 100% [34%, 100%] | - |",
                           "| **overall** | **25% [5%, 70%]** | **100% [51%, 100%]** | |"]
    assert "| padding (of the token positions computed) | 1.2% |" in lines
    assert lines.index("| the run | |") > lines.index(success[-1])
