"""Episode seeds: evaluation never starts from a demonstration's initial state unless asked to.

The seed rule (envs/seeds.py) keeps collect's, eval's and RL's streams apart; collect records each
episode's seed in the dataset, training carries them into policy.json (`demonstration_seeds`), every
folder made from a policy keeps them, and eval counts and refuses the evaluation seeds among them."""

import json
import shutil
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from kilovla.cli import main
from kilovla.data.meta import DatasetMeta
from kilovla.envs.seeds import SEED_RULE, collect_seed, eval_seed, rl_train_seed, stream_of
from kilovla.errors import KilovlaError
from kilovla.eval.closed_loop import episode_seeds, evaluate, load_policy

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")
REACH = "reach the red goal"  # the instruction collect records for reach-v3: the dataset's task name


def test_eval_collect_and_rl_seed_streams_never_meet():
    user_seeds, tasks, episodes = [0, 1, 2, 7, 123, 10**9 - 1], [0, 1, 2, 49, 999], [*range(60), 10**6 - 1]
    evals = [eval_seed(s, t, i) for s in user_seeds for t in tasks for i in episodes]
    collects = [collect_seed(s, t, i) for s in user_seeds for t in tasks for i in episodes]
    rl = [rl_train_seed(s, w, e) + k for s in user_seeds for w in (0, 1, 999) for e in (0, 1, 99) for k in (0, 1, 9999)]
    assert len(set(evals)) == len(evals) and len(set(collects)) == len(collects)  # no two episodes share a seed
    assert not set(evals) & set(collects) and not set(evals) & set(rl) and not set(collects) & set(rl)
    assert {stream_of(s) for s in evals} == {"eval"} and {stream_of(s) for s in collects} == {"collect"}
    assert {stream_of(s) for s in rl} == {"rl"} and max(rl) < 2**63  # fits meta/episodes' int64 column
    assert episode_seeds(0, 0, 3) == [eval_seed(0, 0, i) for i in range(3)]  # eval's seeds come from the rule


def test_default_eval_and_collect_seeds_differ_and_keep_libero_init_states():
    """The issue's case: both default to --seed 0, and once both started task 0 from seeds 0, 1, 2..."""
    assert collect_seed(0, 0, 0) == 2 * 10**18 and eval_seed(0, 0, 0) == 10**18
    assert [eval_seed(3, 2, i) % 50 for i in (0, 1, 49, 50)] == [0, 1, 49, 0]  # LIBERO: init state = episode mod 50


@pytest.mark.parametrize("call, message", [
    (lambda: eval_seed(-1, 0, 0), r"seed must be an integer in \[0, 1000000000\)"),
    (lambda: collect_seed(10**9, 0, 0), "seed must be an integer"),
    (lambda: eval_seed(0, 1000, 0), r"task index must be an integer in \[0, 1000\)"),
    (lambda: collect_seed(0, 0, 10**6), "episode must be an integer"),
    (lambda: rl_train_seed(0, 1000, 0), "worker must be an integer"),
    (lambda: rl_train_seed(0, 0, 100), "env slot must be an integer"),
    (lambda: episode_seeds(0, 0, 10**6 + 1), "episodes must be at most 1000000 per task"),
])
def test_the_seed_rule_refuses_values_outside_its_fields(call, message):
    with pytest.raises(KilovlaError, match=message):
        call()


@pytest.fixture(scope="module")
def trained(reach_policy, reach_demos):
    """A tiny policy trained on 2 collected reach-v3 demonstrations, and those demonstrations."""
    return {"policy": Path(reach_policy()), "dataset": reach_demos}


def test_collect_records_each_episode_seed_and_the_seed_rule(trained):
    from kilovla.data import LeRobotDataset
    from kilovla.data.validate import validate_dataset

    root = trained["dataset"]
    episodes = pq.read_table(root / "meta/episodes/chunk-000/file-000.parquet")
    assert episodes.schema.field("seed").type == "int64"
    seeds = episodes.column("seed").to_pylist()
    assert seeds == [collect_seed(0, 0, i) for i in range(2)]  # the expert solves reach-v3's first two tries
    assert json.loads((root / "meta/info.json").read_text())["kilovla_seed_rule"] == SEED_RULE
    assert DatasetMeta(root).episode_seeds() == {REACH: seeds}
    assert validate_dataset(str(root)) == [] and LeRobotDataset(root).num_episodes == 2  # the column reads as before


def test_a_dataset_without_a_seed_column_still_reads(lerobot_fixture):
    meta = DatasetMeta(lerobot_fixture)  # LeRobot's own fixture: no seed column
    assert meta.episode_seeds() is None and len(meta.episodes) > 0


def test_the_writer_takes_a_seed_for_every_episode_or_none(tmp_path):
    from kilovla.data.writer import DatasetWriter

    writer = DatasetWriter(tmp_path / "ds", fps=10, features={"action": {"dtype": "float32", "shape": [2]}})
    writer.add_frame({"action": np.zeros(2, np.float32), "task": "t"})
    writer.save_episode(seed=5)
    writer.add_frame({"action": np.zeros(2, np.float32), "task": "t"})
    with pytest.raises(KilovlaError, match="a seed for every episode or for none"):
        writer.save_episode()
    writer.abort()


def test_training_records_the_datasets_episode_seeds_in_policy_json(trained):
    saved = json.loads((trained["policy"] / "policy.json").read_text())
    assert saved["demonstration_seeds"] == {REACH: [collect_seed(0, 0, 0), collect_seed(0, 0, 1)]}


def _seen_policy(trained, folder, seeds):
    """A copy of the trained policy whose demonstrations (by policy.json) started from `seeds`."""
    shutil.copytree(trained["policy"], folder)
    fields = json.loads((folder / "policy.json").read_text())
    (folder / "policy.json").write_text(json.dumps({**fields, "demonstration_seeds": {REACH: seeds}}))
    return folder


def test_eval_refuses_seeds_a_demonstration_started_from(trained, tmp_path, capsys):
    policy = _seen_policy(trained, tmp_path / "seen", episode_seeds(0, 0, 2))
    args = ["eval", "--policy", str(policy), "--tasks", "reach-v3", "--episodes", "2", "--batch-size", "2",
            "--max-steps", "2", "--videos", "0", "--out", str(tmp_path / "out")]
    assert main(args) == 2
    assert "2 of its 2 evaluation episodes (seed 0) start from a demonstration's seed" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()  # refused before any episode ran
    assert main([*args, "--allow-seen-seeds"]) == 0
    assert json.loads((tmp_path / "out" / "report.json").read_text())["demonstration_seeds_shared"] == 2


def test_eval_reports_no_shared_seeds_for_a_trained_policy_and_none_for_a_scripted_one(trained):
    from kilovla.eval.settings import EvalSettings

    fast = EvalSettings(tasks=["reach-v3"], episodes=2, batch_size=2, resolution=32, max_steps=2)
    assert evaluate(load_policy(str(trained["policy"])), fast)["demonstration_seeds_shared"] == 0
    assert evaluate(load_policy("scripted"), fast)["demonstration_seeds_shared"] is None  # records no demonstrations


def test_derived_folders_keep_the_demonstration_seeds(trained, tmp_path):
    """FP8 (policy.save), RL (policy.json's fields, the residual added) and a loaded LoRA checkpoint's meta."""
    from kilovla.policy_folder import load_policy_folder
    from kilovla.quant.fp8 import Fp8Config
    from kilovla.quantize.folder import quantize_policy_folder
    from kilovla.policy_folder import write_rl_policy_files as write_policy_files

    want = json.loads((trained["policy"] / "policy.json").read_text())["demonstration_seeds"]
    assert want == {REACH: [collect_seed(0, 0, 0), collect_seed(0, 0, 1)]}
    quantize_policy_folder(trained["policy"], tmp_path / "fp8", Fp8Config(), latency_repeats=1)
    assert json.loads((tmp_path / "fp8" / "policy.json").read_text())["demonstration_seeds"] == want
    assert load_policy_folder(tmp_path / "fp8").meta.demonstration_seeds == want
    (tmp_path / "rl").mkdir()
    write_policy_files(tmp_path / "rl", {"model": {}}, json.loads((trained["policy"] / "policy.json").read_text()))
    assert json.loads((tmp_path / "rl" / "policy.json").read_text())["demonstration_seeds"] == want


def test_rl_refuses_a_final_evaluation_on_demonstration_seeds_before_ray(trained, tmp_path, monkeypatch):
    from kilovla.rl import runner

    policy = _seen_policy(trained, tmp_path / "seen", episode_seeds(0, 0, 1))
    cfg = runner.load(None, [f"--run_dir={tmp_path / 'run'}", f"--policy={policy}", "--env.tasks=[reach-v3]",
                             "--env.resolution=32", "--eval.episodes=2", "--progress=false"])
    monkeypatch.setattr(runner, "connect_ray", lambda *a, **k: pytest.fail("Ray started before the seeds were checked"))
    with pytest.raises(KilovlaError, match="1 of its 2 evaluation episodes"):
        runner.run(cfg)


def _train_args(trained, tmp_path, dataset, *more):
    return [f"--run_dir={tmp_path / 'run'}", "--steps=1", f"--dataset.roots=[{dataset}]", "--batch.global_batch_size=4",
            "--batch.token_budget=512", "--policy.overrides={chunk_size: 4}", "--policy.n_action_steps=4",
            "--progress=false", *more]


def test_training_refuses_an_in_training_evaluation_on_demonstration_seeds_before_any_step(trained, tmp_path):
    from conftest import rewrite_parquet, set_column
    from kilovla.config import load_config
    from kilovla.train.trainer import TrainConfig, train

    dataset = tmp_path / "seen"
    shutil.copytree(trained["dataset"], dataset)
    rewrite_parquet(dataset / "meta/episodes/chunk-000/file-000.parquet",
                    lambda t: set_column(t, "seed", episode_seeds(0, 0, 2)))  # recorded on eval's own seeds
    cfg = load_config(TrainConfig, None, _train_args(trained, tmp_path, dataset, "--eval.every=1",
                                                     "--eval.tasks=[reach-v3]", "--eval.episodes=3"))
    with pytest.raises(KilovlaError, match=r"eval.every's evaluation: 2 of its 3 evaluation episodes \(seed 0\)"):
        train(cfg)
    assert not list((tmp_path / "run").rglob("*.safetensors"))  # no step ran, no checkpoint


def test_fine_tuning_keeps_the_start_policys_demonstration_seeds(trained, tmp_path):
    """A policy trained from another has seen that one's demonstrations too."""
    from kilovla.config import load_config
    from kilovla.train.trainer import TrainConfig, train

    start = _seen_policy(trained, tmp_path / "start", [7])  # the start policy's own record
    cfg = load_config(TrainConfig, None, _train_args(trained, tmp_path, trained["dataset"],
                                                     f"--policy.init_from={start}"))
    saved = json.loads((Path(train(cfg)["checkpoint"]) / "policy.json").read_text())
    assert saved["demonstration_seeds"] == {REACH: [7, collect_seed(0, 0, 0), collect_seed(0, 0, 1)]}


def test_a_malformed_demonstration_seeds_entry_is_one_line():
    from kilovla.eval.closed_loop import check_unseen_seeds

    with pytest.raises(KilovlaError, match="demonstration_seeds must map each task to a list of seeds, got \\[1, 2\\]"):
        check_unseen_seeds([1, 2], ["reach-v3"], 0, 2)


def test_training_on_a_dataset_without_seeds_beside_seeded_ones_records_the_seeds_as_unknown(trained, tmp_path,
                                                                                            caplog):
    """A partial list would let eval report 0 shared seeds where part of the data's seeds are unknown."""
    import logging

    from conftest import rewrite_parquet
    from kilovla.config import load_config
    from kilovla.train.trainer import TrainConfig, train

    old = tmp_path / "pre-rule"  # the same demonstrations, collected before episodes recorded their seed
    shutil.copytree(trained["dataset"], old)
    rewrite_parquet(old / "meta/episodes/chunk-000/file-000.parquet", lambda t: t.drop_columns(["seed"]))
    args = _train_args(trained, tmp_path, trained["dataset"], "--dataset.index=null")
    args[2] = f"--dataset.roots=[{trained['dataset']},{old}]"
    with caplog.at_level(logging.WARNING, logger="kilovla.train.build"):
        saved = json.loads((Path(train(load_config(TrainConfig, None, args))["checkpoint"]) / "policy.json").read_text())
    assert saved["demonstration_seeds"] is None
    said = [r.getMessage() for r in caplog.records if "episode seeds" in r.getMessage()]
    assert len(said) == 1 and str(old) in said[0] and str(trained["dataset"]) not in said[0].split(" record")[0]
