"""An off-policy run that cannot reach its learner's warm-up says so, from the config before Ray starts and
again as its last line, and summary.json names what its wall times measure (no Ray here)."""

import json
import time
from types import SimpleNamespace

from kilovla.rl import runner
from kilovla.rl import checks, checkpoints, loops

TINY = ("--steps=4", "--learner.batch_segments=4", "--rollout.segment_steps=3")


def _cfg(*overrides):
    return runner.load(None, ["--learner.algo.name=residual_sac", *TINY, *overrides])


def test_the_transition_budget_is_versions_x_segments_x_chunk_steps_or_what_max_env_steps_leaves():
    assert checks.transition_budget(_cfg(), n_action_steps=5) == 4 * 4 * 3
    assert checks.transition_budget(_cfg(), 5, version=3) == 12  # resumed at version 3 of 4
    # 60 env steps a version (12 transitions of 5 actions): 2 versions pass 100 env steps
    assert checks.transition_budget(_cfg("--max_env_steps=100"), 5) == 24
    assert checks.transition_budget(_cfg("--max_env_steps=100"), 5, version=1, env_steps=60) == 12
    assert checks.transition_budget(_cfg("--max_env_steps=100"), 5, env_steps=100) == 0


def test_a_residual_sac_run_below_its_warmup_is_warned_about_naming_the_flag_and_the_budget(caplog):
    with caplog.at_level("WARNING"):
        assert checks.warn_if_warmup_unreachable(_cfg(), 4)  # the default warm-up: 1000 transitions
    assert len(caplog.records) == 1
    assert caplog.records[0].getMessage().startswith(
        "learner.algo.sac.warmup_transitions=1000 cannot be reached: this run stores at most 48 transitions (--steps=4 "
        "x learner.batch_segments=4 x rollout.segment_steps=3), so the learner will make 0 updates")


def test_no_warning_when_the_budget_reaches_the_warmup_or_the_learner_is_ppo(caplog):
    with caplog.at_level("WARNING"):
        assert not checks.warn_if_warmup_unreachable(_cfg("--learner.algo.sac.warmup_transitions=48"), 4)
        assert not checks.warn_if_warmup_unreachable(_cfg("--learner.algo.name=ppo"), 4)
    assert caplog.text == ""


def test_filtered_bc_is_checked_against_its_own_warmup(caplog):
    with caplog.at_level("WARNING"):
        assert checks.warn_if_warmup_unreachable(_cfg("--learner.algo.name=filtered_bc",
                                                      "--learner.algo.filtered_bc.warmup=49"), 4)
        assert not checks.warn_if_warmup_unreachable(_cfg("--learner.algo.name=filtered_bc",
                                                          "--learner.algo.filtered_bc.warmup=48"), 4)
    assert "learner.algo.filtered_bc.warmup=49 cannot be reached" in caplog.text


def test_a_resumed_run_counts_the_transitions_its_replay_already_holds(caplog):
    cfg = _cfg("--learner.algo.sac.warmup_transitions=50")
    with caplog.at_level("WARNING"):
        assert not checks.warn_if_warmup_unreachable(cfg, 4, version=3, stored=38)  # 38 + 12 reach 50
        assert checks.warn_if_warmup_unreachable(cfg, 4, version=3, stored=37)
    assert "at most 12 transitions (--steps=4 from version 3 x" in caplog.text
    assert "on top of the 37 already stored" in caplog.text


def test_the_loop_summary_names_its_wall_time_rl_wall_s_and_reports_the_learner_against_its_warmup():
    roles = SimpleNamespace(replaced=0, stats=lambda: {"env_nodes": ["node"], "buffer": {
        "staleness_histogram": {"0": 48}, "dropped_segments": 0}})
    loop = loops.Loop(_cfg("--learner.algo.sac.warmup_transitions=100"), roles, None)
    loop.records = [{"env_steps_per_s": 10.0, "learner/updates": 0, "learner/replay": 12, "learner/replay_usable": 8},
                    {"env_steps_per_s": 10.0, "learner/updates": 0, "learner/replay": 24, "learner/replay_usable": 20}]
    summary = loop.summary()
    assert {"learner_updates": 0, "replay_transitions": 24, "replay_usable": 20, "warmup_transitions": 100}.items() \
        <= summary.items()
    assert 0.0 <= summary["rl_wall_s"] < 60.0 and "wall_s" not in summary  # the loop only; run() adds total_wall_s
    ppo = loops.Loop(_cfg("--learner.algo.name=ppo"), roles, None)
    assert ppo.learner_totals() == {} and "learner_updates" not in ppo.summary()


def _summary(**learner):
    return {"mode": "sync", "steps": 4, "rl_wall_s": 13.8, **learner}


def test_summary_json_adds_the_whole_calls_wall_time_to_the_rl_loops(tmp_path):
    started = time.monotonic() - 200.0  # Ray's start, the actors, the loop and the final eval took 200 s
    runner._finish(tmp_path, _summary(), started, _cfg())
    written = json.loads((tmp_path / "summary.json").read_text())
    assert written["rl_wall_s"] == 13.8 and 200.0 <= written["total_wall_s"] < 210.0
    assert "wall_s" not in written  # renamed: it measured the RL loop only


def test_a_run_that_ended_below_the_warmup_says_so_in_its_last_line(tmp_path, caplog):
    summary = _summary(learner_updates=0, replay_transitions=48, replay_usable=44, warmup_transitions=1000)
    with caplog.at_level("WARNING"):
        runner._finish(tmp_path, summary, time.monotonic(), _cfg())
    assert [r.getMessage() for r in caplog.records] == [
        "0 learner updates: the replay held 48 transitions (44 usable), below the warm-up of 1000 "
        "(learner.algo.sac.warmup_transitions); the policy did not change. Lower the warm-up or run more --steps"]
    assert json.loads((tmp_path / "summary.json").read_text())["learner_updates"] == 0


def test_no_closing_warning_when_the_learner_updated_or_is_ppo(tmp_path, caplog):
    with caplog.at_level("WARNING"):
        runner._finish(tmp_path, _summary(learner_updates=64, replay_transitions=48, replay_usable=44,
                                          warmup_transitions=8), time.monotonic(), _cfg())
        runner._finish(tmp_path, _summary(), time.monotonic(), _cfg("--learner.algo.name=ppo"))
    assert caplog.text == ""


def test_the_saved_replay_is_counted_for_every_off_policy_learner():
    """Resuming counts the stored rows whatever the ring's columns: SAC's have `reward`, filtered BC's do not."""
    import numpy as np

    from kilovla.rl.filtered_bc import SuccessReplay

    ring = SuccessReplay(8)
    ring.arrays = {"observation.state": np.zeros((8, 3), np.float32), "task": np.zeros(8, np.int64),
                   "chunk": np.zeros((8, 4, 2), np.float32)}
    ring.added = 5
    arrays, _ = ring.state_dict()
    assert checkpoints.replay_rows({"replay": arrays}) == len(ring) == 5
    assert checkpoints.replay_rows({"replay": {"reward": np.zeros(7), "terminal": np.zeros(7)}}) == 7
    assert checkpoints.replay_rows(None) == checkpoints.replay_rows({}) == 0
