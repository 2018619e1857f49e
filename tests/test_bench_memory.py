"""`kilovla bench memory --quick`: every configuration in its own process, rows under their 3B names."""

import json

from kilovla.cli import main


def test_the_memory_suite_measures_each_way_of_training_in_a_fresh_process(tmp_path):
    assert main(["bench", "memory", "--quick", "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "memory.json").read_text())
    rows = {r["name"]: r for r in data["rows"]}
    assert set(rows) == {"train_peak_mb_pi05_3b", "train_peak_mb_groot_n15_3b", "train_peak_mb_pi05_3b_expert_only",
                         "train_peak_mb_smolvla_base_expert_only", "train_step_s_pi05_3b_lora",
                         "train_peak_mb_groot_n17_3b", "train_peak_mb_groot_n17_3b_dit_only"}
    runs = {(r["preset"], r["mode"]): r for r in data["runs"]}
    assert set(runs) == {("pi05-tiny", m) for m in ("full", "expert_only", "lora")} | \
        {("groot-tiny", m) for m in ("full", "lora")} | {("smolvla-tiny", "expert_only")} | \
        {("groot-n17-tiny", m) for m in ("full", "expert_only", "lora")}
    for preset in ("pi05-tiny", "groot-tiny", "groot-n17-tiny"):  # the tiny models fit: measured, not computed
        full, lora = runs[(preset, "full")], runs[(preset, "lora")]
        assert not full.get("computed") and full["trainable"] > 0.8 * full["parameters"]  # (pi0.5 never trains a few)
        assert 0 < lora["trainable"] < full["trainable"] and lora["peak_mb"] > 0
    assert runs[("pi05-tiny", "expert_only")]["trainable"] < runs[("pi05-tiny", "full")]["trainable"]
    assert rows["train_step_s_pi05_3b_lora"]["ours"] > 0
    smol = runs[("smolvla-tiny", "expert_only")]  # the expert and state_proj train, the VLM does not
    assert 0 < smol["trainable"] < 0.8 * smol["parameters"] and rows["train_peak_mb_smolvla_base_expert_only"]["ours"] > 0
    n17 = runs[("groot-n17-tiny", "expert_only")]  # the action head trains, the Qwen3-VL backbone does not
    assert 0 < n17["trainable"] < runs[("groot-n17-tiny", "full")]["trainable"] and not n17.get("computed")
    assert rows["train_peak_mb_groot_n17_3b_dit_only"]["ours"] > 0
    n17_row = rows["train_peak_mb_groot_n17_3b"]
    assert n17_row["baseline"] > 0 and n17_row["ours"] > 0 and n17_row["limit"] > 0
    assert "groot_n17_lora_within_1.25x_base" in data["target"]


def test_a_run_too_big_for_the_machine_is_given_as_its_computed_bound():
    """groot-n17-3b with its backbone frozen: every fp32 weight (4 bytes), and 12 more bytes per trainable one."""
    from kilovla.bench.memory import _bound
    from kilovla.models.presets import build_model
    from kilovla.train.build import apply_freeze

    model = build_model("groot-n17-3b", device="meta")
    apply_freeze(model, freeze_vlm=True)
    n = sum(p.numel() for p in model.parameters())
    head = sum(p.numel() for p in model.action_head.parameters())
    bound = _bound("groot-n17-3b", "expert_only")
    assert bound["computed"] and bound["trainable"] == head and bound["parameters"] == n
    assert bound["peak_mb"] == (4 * n + 12 * head) / 2**20
    full = _bound("groot-n17-3b", "full")
    assert full["peak_mb"] > bound["peak_mb"] > 0.8 * 24 * 1024  # neither runs on a 24 GiB machine
