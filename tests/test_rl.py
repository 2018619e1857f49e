"""RL-VLA3 on Ray: both modes end to end, faults (crashed and hung env workers, a hung weight sync, a
killed driver), DDP learners, and a two-node local cluster. Small: 32 px Meta-World, a tiny pi0.5."""

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from kilovla.errors import KilovlaError

pytestmark = [pytest.mark.ray, pytest.mark.slow, pytest.mark.filterwarnings("ignore::UserWarning"),
              pytest.mark.filterwarnings("ignore::DeprecationWarning")]


@pytest.fixture(scope="module")
def policy_dir(reach_policy):
    """A tiny pi0.5 reading the environment state too (3 training steps, a checkpoint at the last)."""
    return reach_policy("--steps=3", "--checkpoint.every=3",
                        "--policy.overrides={chunk_size: 4, max_state_dim: 48}",
                        "--policy.state_keys=[observation.state, observation.environment_state]")


@pytest.fixture(scope="module")
def local_ray():
    import ray

    ray.init(address="local", num_cpus=2, include_dashboard=False, logging_level="ERROR")  # never another test's
    yield
    ray.shutdown()


def _config(policy_dir, run_dir, *overrides):
    from kilovla.rl import runner

    return runner.load(None, [
        f"--run_dir={run_dir}", f"--policy={policy_dir}", "--steps=3", "--env.tasks=[reach-v3]", "--env.workers=2",
        "--env.envs_per_worker=2", "--env.resolution=32", "--env.max_steps=30", "--rollout.segment_steps=3",
        "--learner.batch_segments=4", "--learner.algo.micro_batch=6", "--checkpoint.every=2", "--eval.episodes=2",
        "--eval.batch_size=2", "--progress=false", "--learner.algo.name=ppo", *overrides])


def _records(run_dir):
    return [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


def test_async_run_replaces_a_crashed_and_a_hung_env_worker(policy_dir, local_ray, tmp_path):
    from kilovla.policy_folder import load_policy_folder
    from kilovla.rl import runner

    # the AWR loss with a KL anchor here (the sync test below trains PPO)
    cfg = _config(policy_dir, tmp_path / "run", "--learner.max_staleness=1", "--env.timeout_s=4",
                  "--learner.algo.policy_loss=awr", "--learner.algo.kl_coef=0.5")
    faults = {"env_workers": {0: {"crash_after": 20}, 1: {"hang_after": 30}}}
    summary = runner.run(cfg, faults=faults)
    assert summary["steps"] == 3 and summary["replaced_workers"] == 2
    assert summary["dropped_segments"] >= 1  # the segments that were running are dropped, never trained on
    assert set(summary["staleness_histogram"]) <= {"0", "1"}  # max_staleness 1
    records = _records(tmp_path / "run")
    assert [r["step"] for r in records] == [1, 2, 3]
    executed = [r["env_steps_executed"] for r in records]  # a replaced worker's steps stay counted
    assert executed == sorted(executed) and executed[-1] >= summary["env_steps"]
    assert {"env_steps_per_s", "success_rate", "busy/env", "busy/inference", "busy/learner", "batch_size_histogram",
            "queue_wait_p50_s", "queue_wait_p99_s", "staleness_histogram", "learner/policy_loss"} <= set(records[-1])
    assert all(r["learner/flow_error"] > 0 and r["learner/awr_weight_max"] >= r["learner/awr_weight_mean"] > 0
               and r["learner/grad_norm"] > 0 for r in records)
    assert "learner/logp_gap" not in records[-1]
    assert records[0]["learner/kl_to_start"] < 1e-9 < records[-1]["learner/kl_to_start"]
    final = Path(summary["checkpoint"])
    assert (final / "value_head.safetensors").is_file()
    assert load_policy_folder(final).action_dim == 4  # an RL checkpoint is a policy folder
    assert 0.0 <= summary["eval"]["success_rate"] <= 1.0


@pytest.mark.shares_cpu  # sync rounds and kill -9 at a checkpoint: nothing here is timed
def test_sync_mode_with_two_ddp_learners_and_collective_weight_sync(policy_dir, local_ray, tmp_path):
    from kilovla.rl import runner

    summary = runner.run(_config(policy_dir, tmp_path / "run", "--mode=sync", "--learner.ranks=2", "--steps=2",
                                 "--eval.episodes=0", "--weight_sync=collective", "--learner.algo.kl_coef=0.5"),
                         faults={"env_workers": {0: {"crash_after": 10}}})
    records = _records(tmp_path / "run")
    assert summary["steps"] == 2 and [r["step"] for r in records] == [1, 2]
    assert summary["replaced_workers"] == 1
    assert summary["dropped_segments"] >= 4 and summary["dropped_segments"] % 4 == 0  # the whole lock-step round
    assert records[-1]["staleness_histogram"] == {"0": 2 * 4 * 3}  # 2 batches of 4 segments x 3 steps, none stale
    assert records[-1]["mean_batch_size"] == 4  # one forward over all four envs per lock step
    assert all(r["learner/grad_norm"] > 0 for r in records)
    assert all(r["learner/logp_gap"] < 1e-4 for r in records)  # nothing stale: the learner rescores the chains exactly
    # the KL to the start policy: none before the first step, some after it (each rank holds the reference)
    assert records[0]["learner/kl_to_start"] < 1e-9 < records[1]["learner/kl_to_start"]


def test_a_calibrated_run_does_not_resume_as_a_real_one(policy_dir, tmp_path):
    """A calibrated run's weights never trained; resuming it with real compute (or the reverse) is refused
    before Ray starts."""
    import shutil

    from kilovla.rl import runner

    folder = tmp_path / "run" / "checkpoints" / "step_000002"
    shutil.copytree(policy_dir, folder)
    (folder / "rl_state.json").write_text(json.dumps({"version": 2, "compute_model": "calibrated"}))
    with pytest.raises(KilovlaError, match="model compute was 'calibrated' .* compute.model='real'"):
        runner.run(_config(policy_dir, tmp_path / "run", "--eval.episodes=0"), resume=str(folder))


def test_calibrated_compute_runs_the_whole_schedule_but_not_the_model(policy_dir, local_ray, tmp_path):
    """`compute.model: calibrated`: the run calibrates itself on the real policy, then the server and learner
    sleep instead of computing; versions, staleness, consumption and weight sync still happen."""
    import torch

    from kilovla.models.checkpoints import read_safetensors
    from kilovla.rl import runner

    cfg = _config(policy_dir, tmp_path / "run", "--compute.model=calibrated", "--learner.max_staleness=1",
                  "--eval.episodes=0", "--learner.algo.kl_coef=0.5")  # timed with the KL's reference forward
    summary = runner.run(cfg)
    fitted = summary["compute"]
    assert fitted["model"] == "calibrated" and fitted["infer_base_s"] + fitted["infer_per_sample_s"] > 0
    assert fitted["learn_base_s"] + fitted["learn_per_sample_s"] > 0 and fitted["learn_bootstrap_s"] > 0
    records = _records(tmp_path / "run")
    assert [r["step"] for r in records] == [1, 2, 3]
    assert all(r["learner/compute_sleep_s"] >= fitted["learn_base_s"] for r in records)
    assert not any("learner/policy_loss" in r for r in records)  # the loss was never computed
    lags = records[-1]["staleness_histogram"]
    assert set(lags) <= {"0", "1"} and sum(lags.values()) == 3 * 4 * 3  # 3 batches x 4 segments x 3 steps, once each
    assert records[-1]["env_steps_executed"] >= summary["env_steps"] > 0
    start, end = read_safetensors(Path(policy_dir) / "model.safetensors"), read_safetensors(
        Path(summary["checkpoint"]) / "model.safetensors")
    assert end and all(torch.equal(start[k], end[k]) for k in end)  # no backward ran: the published weights are the start's


def test_a_hung_weight_sync_ends_the_run_with_one_message(policy_dir, local_ray, tmp_path):
    from kilovla.rl import runner

    cfg = _config(policy_dir, tmp_path / "run", "--weight_sync_timeout_s=3", "--eval.episodes=0")
    with pytest.raises(KilovlaError, match="weight sync of policy version 1 to the inference server did not complete "
                                           "within 3 s"):
        runner.run(cfg, faults={"server": {"hang_weight_sync_at": 1}})


def _kill_driver_at(run, steps: int, algo: list, checkpoint: str) -> tuple[list, dict]:
    """Start `kilovla rl` (async, tiny) in its own session, kill -9 it and its Ray once `checkpoint` is
    written; returns the command line and environment to resume it with."""
    args = [sys.executable, "-m", "kilovla", "rl", "--mode", "async", "--policy", str(algo[0]),
            f"--run_dir={run}", f"--steps={steps}", "--env.tasks=[reach-v3]", "--env.workers=1", "--env.envs_per_worker=2",
            "--env.resolution=32", "--env.max_steps=30", "--rollout.segment_steps=3", "--learner.batch_segments=2",
            "--checkpoint.every=2", "--eval.episodes=0", "--progress=false", *algo[1:]]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    driver = subprocess.Popen(args, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    deadline = time.monotonic() + 240
    while not (run / "checkpoints" / checkpoint / "rl_state.json").is_file():
        assert driver.poll() is None and time.monotonic() < deadline, driver.stderr.read().decode()[-2000:]
        time.sleep(0.5)
    os.killpg(driver.pid, signal.SIGKILL)  # the driver and the Ray instance it started
    driver.wait()
    return args, env


@pytest.mark.shares_cpu  # sync rounds and kill -9 at a checkpoint: nothing here is timed
def test_a_killed_driver_resumes_from_its_last_checkpoint(policy_dir, tmp_path):
    run = tmp_path / "run"
    args, env = _kill_driver_at(run, 5, [policy_dir, "--learner.algo.name=ppo", "--learner.algo.kl_coef=0.5",
                                         "--learner.algo.optim.lr=1e-3", "--learner.algo.optim.warmup_steps=0"],
                                "step_000002")
    from kilovla.rl.roles import first_train_seed

    saved = json.loads((run / "checkpoints" / "step_000002" / "rl_state.json").read_text())["next_seeds"]["0"]
    assert all(s > first_train_seed(0, 0, e) for e, s in enumerate(saved))  # the seeds played are not replayed
    resumed = subprocess.run([*args, "--resume", "auto"], env=env, capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert json.loads(resumed.stdout[resumed.stdout.index("{"):])["steps"] == 5
    steps = [r["step"] for r in _records(run)]
    assert steps[-3:] == [3, 4, 5] and steps.count(3) == 1  # continued after step 2; nothing logged twice
    # the KL's reference is still the policy the run began with, not the checkpoint it resumed from
    assert _records(run)[-3]["learner/kl_to_start"] > 1e-6


SAC = ("--learner.algo.name=residual_sac", "--learner.algo.sac.warmup_transitions=8", "--learner.algo.sac.batch_size=16",
       "--learner.algo.sac.critic_warmup_updates=4",
       "--learner.algo.sac.utd=2")


@pytest.mark.shares_cpu  # sync rounds and kill -9 at a checkpoint: nothing here is timed
def test_residual_sac_in_sync_mode_loses_only_a_crashed_workers_round_and_writes_a_policy_folder(policy_dir, local_ray,
                                                                                                tmp_path):
    from kilovla.policy_folder import load_policy_folder
    from kilovla.models.residual import ResidualPolicyModel
    from kilovla.rl import runner

    summary = runner.run(_config(policy_dir, tmp_path / "run", "--mode=sync", "--steps=4", *SAC),
                         faults={"env_workers": {0: {"crash_after": 10}}})
    records = _records(tmp_path / "run")
    assert summary["steps"] == 4 and [r["step"] for r in records] == [1, 2, 3, 4]
    assert summary["replaced_workers"] == 1 and summary["dropped_segments"] % 4 == 0 < summary["dropped_segments"]
    last = records[-1]
    # 4 versions x 4 segments x 3 chunk steps stored; updates at utd 2 once 8 transitions are usable
    assert last["learner/replay"] == 48 and last["learner/updates"] > 0
    assert {"learner/alpha", "learner/entropy", "learner/q", "learner/critic_loss", "learner/residual_at_bound",
            "successes"} <= set(last)
    final = Path(summary["checkpoint"])
    for name in ("model.safetensors", "residual.safetensors", "critic.safetensors", "replay.safetensors", "learner.pt"):
        assert (final / name).is_file(), name
    assert not (final / "value_head.safetensors").exists()
    assert json.loads((final / "policy.json").read_text())["residual"]["algorithm"] == "residual_sac"
    assert isinstance(load_policy_folder(final).model, ResidualPolicyModel)
    assert 0.0 <= summary["eval"]["success_rate"] <= 1.0
    with pytest.raises(KilovlaError, match="holds a residual actor"):  # PPO would drop the residual
        runner.run(_config(final, tmp_path / "ppo", "--steps=1"))


@pytest.mark.shares_cpu  # sync rounds and kill -9 at a checkpoint: nothing here is timed
def test_residual_sac_resumes_after_kill_9_with_its_buffer(policy_dir, tmp_path):
    from kilovla.models.checkpoints import read_safetensors

    run = tmp_path / "run"
    args, env = _kill_driver_at(run, 6, [policy_dir, *SAC], "step_000004")
    saved = read_safetensors(run / "checkpoints" / "step_000004" / "replay.safetensors")
    assert len(saved["reward"]) == 4 * 2 * 3  # every transition of 4 versions of 2 segments x 3 steps
    resumed = subprocess.run([*args, "--resume", "auto"], env=env, capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert json.loads(resumed.stdout[resumed.stdout.index("{"):])["steps"] == 6
    records = _records(run)
    steps = [r["step"] for r in records]
    assert steps[-2:] == [5, 6] and steps.count(5) == 1
    assert records[-1]["learner/replay"] == 6 * 2 * 3  # the saved buffer plus what came after: nothing lost
    final = read_safetensors(run / "checkpoints" / "step_000006" / "replay.safetensors")
    assert torch.equal(final["features"][:24], saved["features"])


BC = ("--learner.algo.name=filtered_bc", "--learner.algo.filtered_bc.warmup=1", "--learner.algo.filtered_bc.batch_size=4",
      "--learner.algo.freeze_vlm=false")


@pytest.mark.shares_cpu  # sync rounds and kill -9 at a checkpoint: nothing here is timed
def test_filtered_bc_in_sync_mode_survives_a_crashed_worker_writes_a_policy_folder_and_resumes_after_kill_9(
        policy_dir, local_ray, tmp_path):
    """The tiny policy seldom succeeds in 30 steps: this checks the plumbing (the outcome of every episode
    counted, the folder, the replay carried through kill -9); tests/test_rl_filtered_bc.py checks the learning."""
    from kilovla.policy_folder import load_policy_folder
    from kilovla.rl import runner

    summary = runner.run(_config(policy_dir, tmp_path / "run", "--mode=sync", "--steps=3", *BC),
                         faults={"env_workers": {0: {"crash_after": 10}}})
    records = _records(tmp_path / "run")
    assert summary["replaced_workers"] == 1 and [r["step"] for r in records] == [1, 2, 3]
    last = records[-1]
    # every episode the learner saw end is judged once (30-step episodes; 3 versions x 4 segments x 3 chunks of 4
    # steps); those of the crashed worker's dropped round never reach it
    judged = last["learner/episodes_succeeded"] + last["learner/episodes_failed"]
    assert 0 < judged <= sum(r["episodes"] for r in records)
    assert last["learner/replay"] >= 0 and last["learner/updates"] >= 0
    final = Path(summary["checkpoint"])
    assert (final / "model.safetensors").is_file() and (final / "learner.pt").is_file()
    assert load_policy_folder(final).action_dim == 4 and not json.loads((final / "policy.json").read_text()).get("residual")
    assert 0.0 <= summary["eval"]["success_rate"] <= 1.0

    run = tmp_path / "killed"
    args, env = _kill_driver_at(run, 8, [policy_dir, *BC], "step_000004")
    saved = _records(run)[3]
    resumed = subprocess.run([*args, "--resume", "auto"], env=env, capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    records = _records(run)
    steps = [r["step"] for r in records]
    assert steps[-4:] == [5, 6, 7, 8] and steps.count(5) == 1
    # the learner's counters went on from the checkpoint's: exactly the episodes the resumed run delivered
    # were judged on top of the saved ones (an episode left waiting at the kill is dropped, not judged)
    judged = lambda r: r["learner/episodes_succeeded"] + r["learner/episodes_failed"]  # noqa: E731
    assert judged(saved) > 0 and judged(records[-1]) - judged(saved) == sum(r["episodes"] for r in records[-4:])
    assert records[-1]["learner/replay"] >= saved["learner/replay"]
    assert (run / "checkpoints" / "step_000008" / "replay.safetensors").is_file()


def test_a_critic_of_another_width_is_relearned_from_a_policy_and_refused_on_resume(policy_dir, tmp_path, caplog,
                                                                                    monkeypatch):
    """Folders written before the critic read the state: as --policy the critic starts afresh (and the
    driver says so); as a run to resume they are refused in one line before Ray starts."""
    import shutil

    import torch

    from kilovla.models.checkpoints import save_safetensors
    from kilovla.rl import runner
    from kilovla.rl.core.flow import FlowSDE
    from kilovla.rl.policy import load_actor_critic

    folder = tmp_path / "run" / "checkpoints" / "step_000002"
    shutil.copytree(policy_dir, folder)
    fresh = load_actor_critic(str(folder), FlowSDE())
    narrow = {"0.weight": torch.ones(256, fresh.value_head[0].in_features - 48), "0.bias": torch.ones(256),
              "2.weight": torch.ones(1, 256), "2.bias": torch.ones(1)}
    save_safetensors(narrow, folder / "value_head.safetensors")
    with caplog.at_level("WARNING"):
        model = load_actor_critic(str(folder), FlowSDE())
    assert "starting a fresh critic" in caplog.text
    assert not torch.equal(model.value_head[2].weight, torch.ones(1, 256))
    caplog.clear()
    from kilovla.policy_folder import PolicyFolder
    from kilovla.rl.ppo import check_value_head

    with caplog.at_level("WARNING"):  # and in the driver, where the user sees it (Ray keeps the actors' logs)
        check_value_head(PolicyFolder.open(folder), resuming=False)
    assert "starting a fresh critic" in caplog.text
    (folder / "rl_state.json").write_text(json.dumps({"version": 2, "started_from": str(folder)}))
    monkeypatch.setattr(runner, "connect_ray", lambda *a, **k: pytest.fail("Ray started before the critic was checked"))
    with pytest.raises(KilovlaError, match="cannot be resumed") as err:
        runner.run(_config(policy_dir, tmp_path / "run"), resume=str(folder))
    assert "\n" not in str(err.value)


def test_env_workers_spread_over_a_two_node_cluster_and_survive_losing_one(policy_dir, tmp_path):
    import ray
    from ray.cluster_utils import Cluster

    if ray.is_initialized():
        ray.shutdown()
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    second = cluster.add_node(num_cpus=1)
    cluster.wait_for_nodes()
    try:
        ray.init(address=cluster.address, logging_level="ERROR")
        # sync: every round needs every worker, so both have played (and reported their node) by step 1
        driver = _Driver(_config(policy_dir, tmp_path / "run", "--mode=sync", "--steps=4", "--eval.episodes=0"))
        metrics = tmp_path / "run" / "metrics.jsonl"
        while driver.is_alive() and not (metrics.is_file() and metrics.read_text().strip()):
            time.sleep(0.2)
        cluster.remove_node(second)  # the env worker there dies; the server, buffer, learner are the driver's
        summary = driver.summary(300)
        assert summary["steps"] == 4 and summary["env_nodes"] == 2 and summary["replaced_workers"] >= 1
    finally:
        ray.shutdown()
        cluster.shutdown()


def test_a_node_listed_alive_that_takes_no_worker_is_not_tried_again(policy_dir, local_ray, tmp_path, monkeypatch):
    import ray

    listed = ray.nodes

    def with_a_ghost():  # Ray may list a crashed node as alive for a while
        nodes = listed()
        return [*nodes, {**nodes[0], "NodeID": "ab" * 28, "Alive": True}]

    monkeypatch.setattr(ray, "nodes", with_a_ghost)
    driver = _Driver(_config(policy_dir, tmp_path / "run", "--mode=sync", "--steps=2", "--eval.episodes=0"))
    summary = driver.summary(240)  # sync needs every worker: re-sent to the ghost, it never ended
    assert summary["steps"] == 2 and summary["replaced_workers"] == 1 and summary["env_nodes"] == 1


class _Driver(threading.Thread):
    """`runner.run(cfg)` in a thread, so that a test can act on the cluster while it runs."""

    def __init__(self, cfg):
        super().__init__(daemon=True)
        self.cfg, self.out = cfg, {}
        self.start()

    def run(self):
        from kilovla.rl import runner

        try:
            self.out["summary"] = runner.run(self.cfg)
        except Exception as e:  # noqa: BLE001  reported by summary()
            self.out["error"] = e

    def summary(self, timeout_s: float) -> dict:
        self.join(timeout_s)
        assert not self.is_alive(), f"the run did not end within {timeout_s:g} s"
        assert "summary" in self.out, repr(self.out.get("error"))
        return self.out["summary"]


def test_resuming_a_kl_run_whose_start_policy_is_gone_is_refused_in_one_line(policy_dir, tmp_path, monkeypatch):
    import shutil

    from kilovla.rl import runner

    start = tmp_path / "start"
    shutil.copytree(policy_dir, start)
    step = tmp_path / "run" / "checkpoints" / "step_000002"
    shutil.copytree(policy_dir, step)
    (step / "rl_state.json").write_text(json.dumps({"version": 2, "started_from": str(start)}))
    cfg = _config(start, tmp_path / "run", "--learner.algo.kl_coef=0.5")
    monkeypatch.setattr(runner, "connect_ray", lambda *a, **k: pytest.fail("Ray started before the reference was checked"))
    shutil.rmtree(start)
    with pytest.raises(KilovlaError, match="the policy this run began with.*is gone") as err:
        runner.run(cfg, resume=str(step))
    assert "\n" not in str(err.value)


