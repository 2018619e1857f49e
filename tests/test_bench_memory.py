"""`kilovla bench memory --quick`: every configuration in its own process, rows under their 3B names."""

import json

from kilovla.cli import main


def test_the_memory_suite_measures_each_way_of_training_in_a_fresh_process(tmp_path):
    assert main(["bench", "memory", "--quick", "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "memory.json").read_text())
    rows = {r["name"]: r for r in data["rows"]}
    assert set(rows) == {"train_peak_mb_pi05_3b", "train_peak_mb_groot_n15_3b", "train_peak_mb_pi05_3b_expert_only",
                         "train_peak_mb_smolvla_base_expert_only", "train_step_s_pi05_3b_lora"}
    runs = {(r["preset"], r["mode"]): r for r in data["runs"]}
    assert set(runs) == {("pi05-tiny", m) for m in ("full", "expert_only", "lora")} | \
        {("groot-tiny", m) for m in ("full", "lora")} | {("smolvla-tiny", "expert_only")}
    for preset in ("pi05-tiny", "groot-tiny"):  # the tiny models fit: measured, not computed
        full, lora = runs[(preset, "full")], runs[(preset, "lora")]
        assert not full.get("computed") and full["trainable"] > 0.8 * full["parameters"]  # (pi0.5 never trains a few)
        assert 0 < lora["trainable"] < full["trainable"] and lora["peak_mb"] > 0
    assert runs[("pi05-tiny", "expert_only")]["trainable"] < runs[("pi05-tiny", "full")]["trainable"]
    assert rows["train_step_s_pi05_3b_lora"]["ours"] > 0
    smol = runs[("smolvla-tiny", "expert_only")]  # the expert and state_proj train, the VLM does not
    assert 0 < smol["trainable"] < 0.8 * smol["parameters"] and rows["train_peak_mb_smolvla_base_expert_only"]["ours"] > 0
