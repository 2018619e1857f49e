"""The trainer: DDP equals one process, crash-resume is exact, elastic resume keeps the batches."""

import errno
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import train_args as _args, train_process as _run, trained_with_gradients as _trained, unless_given
from kilovla.cli import main
from kilovla.config import load_config
from kilovla.errors import KilovlaError
from kilovla.train.trainer import TrainConfig, train


@pytest.fixture(scope="module")
def dataset(train_dataset):
    return train_dataset


def _metrics(run_dir):
    return [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


def _weights(run_dir, step):
    from safetensors.torch import load_file

    return load_file(str(Path(run_dir) / "checkpoints" / f"step_{step:06d}" / "model.safetensors"))


def _max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


def _gradients(run, step):
    from safetensors.torch import load_file

    return load_file(str(run / "grads" / f"step_{step:06d}.safetensors"))


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
@pytest.mark.parametrize("family", ["pi05-tiny", "groot-tiny", "smolvla-tiny", "groot-n17-tiny"])
def test_two_gloo_ranks_accumulating_several_rows_train_like_one(dataset, references, tmp_path, family, strategy):
    one = references(family)
    two = _trained(dataset, tmp_path / "two", family, nproc=2, extra=[f"--parallel.strategy={strategy}"])
    records = _metrics(two)
    assert [r["world_size"] for r in records] == [2] * 4
    assert min(r["rows_per_rank"] for r in records) >= 3  # accumulation over several rows on every step
    assert [r["sample_ids"] for r in _metrics(one)] == [r["sample_ids"] for r in records]
    for step in range(1, 5):  # the averaged gradient over both ranks is the one-process gradient
        assert _max_diff(_gradients(one, step), _gradients(two, step)) < 1e-5, f"step {step}"
    for a, b in zip(_metrics(one), records):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5)
    assert _max_diff(_weights(one, 4), _weights(two, 4)) < 1e-5  # fp32 reduction order only


def test_a_killed_run_resumes_with_identical_losses(dataset, reference, tmp_path):
    run = tmp_path / "crash"
    killed = _run(_args(dataset, run), env={"KILOVLA_FAULT_AFTER_STEP": "3"})
    assert killed.returncode == -9  # SIGKILL after step 3; the last checkpoint is step 2
    assert [r["step"] for r in _metrics(run)] == [1, 2, 3]
    resumed = _run([*_args(dataset, run), "--resume", "auto"])
    assert resumed.returncode == 0, resumed.stderr
    assert [r["step"] for r in _metrics(run)] == [1, 2, 3, 4]  # step 3 logged once, by the resumed run
    assert [r["loss"] for r in _metrics(run)] == [r["loss"] for r in _metrics(reference)]
    wa, wb = _weights(reference, 4), _weights(run, 4)
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


def test_resuming_on_two_ranks_keeps_the_global_batches(dataset, reference, tmp_path):
    run = tmp_path / "elastic"
    assert _run(_args(dataset, run), env={"KILOVLA_FAULT_AFTER_STEP": "2"}).returncode == -9
    proc = _run([*_args(dataset, run), "--resume", "auto"], nproc=2)
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = _metrics(run)
    assert [r["world_size"] for r in records] == [1, 1, 2, 2]
    assert min(r["rows_per_rank"] for r in records[2:]) >= 3
    assert [r["sample_ids"] for r in records] == [r["sample_ids"] for r in _metrics(reference)]
    assert _max_diff(_weights(reference, 4), _weights(run, 4)) < 1e-5


def test_a_sharded_checkpoint_resumes_on_another_world_size(dataset, reference, tmp_path):
    from kilovla.policy_folder import load_policy_folder

    run = tmp_path / "sharded"
    killed = _run([*_args(dataset, run), "--parallel.strategy=fsdp"], nproc=2, env={"KILOVLA_FAULT_AFTER_STEP": "2"})
    assert killed.returncode != 0
    step2 = run / "checkpoints" / "step_000002"
    assert (step2 / "state" / ".metadata").is_file() and not (step2 / "model.safetensors").exists()
    policy = load_policy_folder(step2)  # a sharded checkpoint is still a policy folder
    assert policy.action_dim == 6
    proc = _run([*_args(dataset, run), "--resume", "auto"])  # 2 ranks -> 1
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "UserWarning" not in proc.stderr  # DCP's "assuming the intent is to load in a single process"
    assert _max_diff(_weights(reference, 4), _weights(run, 4)) < 1e-5


def test_fsdp_gathers_one_layer_at_a_time(tmp_path):
    """Each rank holds half the parameters; during forward and backward no more than the root's own
    parameters and one layer unit are whole at once (measured with module hooks)."""
    script = Path(__file__).parent / "distributed" / "fsdp_units.py"
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", str(script),
                           "pi05-tiny", "groot-tiny", "smolvla-tiny", "groot-n17-tiny"], capture_output=True, text=True,
                          timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert [r["family"] for r in results] == ["pi05-tiny", "groot-tiny", "smolvla-tiny", "groot-n17-tiny"]
    for r in results:
        assert r["units"] >= 10
        assert 0.49 < r["resident"] / r["total"] < 0.55
        assert r["peak_unsharded"] <= r["root"] + r["largest_unit"]
        assert r["peak_unsharded"] < 0.3 * r["total"]


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_fsdp_with_closed_loop_evaluation_finishes(reach_demos, tmp_path):
    proc = _run([f"--run_dir={tmp_path / 'run'}", "--steps=3", f"--dataset.roots=[{reach_demos}]",
                 "--batch.global_batch_size=8", "--batch.token_budget=512", "--policy.overrides.chunk_size=4",
                 "--parallel.strategy=fsdp", "--eval.every=2", "--eval.tasks=[reach-v3]", "--eval.episodes=1",
                 "--eval.resolution=32", "--eval.max_steps=8", "--progress=false", "--parallel.timeout_s=120"],
                nproc=2)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert [r["kind"] for r in _metrics(tmp_path / "run")] == ["train", "train", "eval", "train"]


def test_a_rank_that_stops_answering_ends_the_run_naming_rank_and_step(dataset, tmp_path):
    proc = _run([*_args(dataset, tmp_path / "hang"), "--parallel.timeout_s=10"], nproc=2,
                env={"KILOVLA_FAULT_HANG": "1:3"}, timeout=240)
    assert proc.returncode != 0
    assert "error: rank 0 waited for step 3: a collective did not complete within 10 s" in proc.stderr
    assert [r["step"] for r in _metrics(tmp_path / "hang")] == [1, 2]


def test_unknown_config_keys_suggest_the_closest():
    with pytest.raises(KilovlaError, match=r"unknown config key 'optim.lrr' \(did you mean 'optim.lr'\?\)"):
        load_config(TrainConfig, None, ["--optim.lrr=1e-4"])
    with pytest.raises(KilovlaError, match=r"config key 'steps': 'many' is not an int"):
        load_config(TrainConfig, None, ["--steps=many"])


def test_cli_reports_bad_config_with_exit_2(capsys):
    assert main(["train", "--optim.lrr=1"]) == 2
    assert "did you mean 'optim.lr'" in capsys.readouterr().err


def test_a_dataset_that_does_not_fit_the_policy_is_refused(dataset, tmp_path):
    cfg = load_config(TrainConfig, None, [f"--run_dir={tmp_path}", f"--dataset.roots=[{dataset}]",
                                          "--policy.state_keys=[observation.velocity]"])
    with pytest.raises(KilovlaError, match=r"state keys \['observation.velocity'\] are not features"):
        train(cfg)
    cfg = load_config(TrainConfig, None, [f"--run_dir={tmp_path}", f"--dataset.roots=[{dataset}]",
                                          "--policy.overrides.disabled_cameras=[left_wrist_0_rgb, right_wrist_0_rgb]"])
    with pytest.raises(KilovlaError, match=r"the dataset has 2 cameras .* takes 1"):
        train(cfg)


def test_a_checkpoint_of_another_model_is_refused(dataset, reference, tmp_path):
    cfg = load_config(TrainConfig, None, [*_args(dataset, tmp_path / "other")[0:1], f"--dataset.roots=[{dataset}]",
                                          "--policy.preset=groot-tiny", "--progress=false"])
    with pytest.raises(KilovlaError, match="a checkpoint of 'pi05-tiny', not of 'groot-tiny'"):
        train(cfg, resume=str(reference / "checkpoints" / "step_000004"))


def test_a_full_disk_keeps_the_last_good_checkpoint(dataset, tmp_path, monkeypatch):
    from kilovla.train import checkpoint

    real = checkpoint.save_safetensors
    calls = {"n": 0}

    def failing(state, path, metadata=None):
        calls["n"] += 1
        if calls["n"] > 1:  # the second checkpoint hits a full disk
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(state, path, metadata)

    monkeypatch.setattr(checkpoint, "save_safetensors", failing)
    cfg = load_config(TrainConfig, None, _args(dataset, tmp_path / "run"))
    with pytest.raises(KilovlaError, match=r"No space left on device; the last good checkpoint .*step_000002 is intact"):
        train(cfg)
    folders = sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir())
    assert folders == ["latest", "step_000002"]


def test_runs_write_metrics_a_plot_and_policy_checkpoints(dataset, reference):
    records = _metrics(reference)
    assert {"loss", "lr", "grad_norm", "samples_per_s", "tokens_per_s", "padding_fraction", "data_wait_fraction",
            "step_time_s", "peak_memory_mb"} <= set(records[0])
    assert (reference / "learning_curve.png").stat().st_size > 0
    assert (reference / "config.yaml").exists()
    from kilovla.eval.closed_loop import load_policy

    policy = load_policy(str(reference / "checkpoints" / "step_000004"))
    assert policy.action_dim == 6 and policy.cameras == ("front", "wrist")


def test_ema_freezing_and_checkpointing_switches(dataset, tmp_path):
    from safetensors.torch import load_file

    plain = train(load_config(TrainConfig, None, _args(dataset, tmp_path / "sw", steps=2)))
    cfg = load_config(TrainConfig, None, [*_args(dataset, tmp_path / "sw2", steps=2), "--ema_decay=0.5",
                                          "--freeze_vision=true", "--gradient_checkpointing=true"])
    switched = train(cfg)
    step = Path(switched["checkpoint"])
    model, ema = load_file(str(step / "model.safetensors")), load_file(str(step / "ema.safetensors"))
    start = load_file(str(Path(plain["checkpoint"]) / "model.safetensors"))
    vision = [k for k in model if "vision_tower" in k]
    trained = "action_in_proj.weight"
    assert not torch.equal(ema[trained], model[trained])  # EMA lags the weights
    from kilovla.models.presets import build_model

    fresh = build_model("pi05-tiny", seed=0, chunk_size=4).state_dict()
    assert all(torch.equal(model[k], fresh[k]) for k in vision)
    assert not torch.equal(start[trained], fresh[trained])


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_in_training_closed_loop_evaluation_is_logged(reach_demos, tmp_path, capsys):
    seen = []
    cfg = load_config(TrainConfig, None, [
        f"--run_dir={tmp_path / 'run'}", "--steps=2", f"--dataset.roots=[{reach_demos}]",
        "--batch.global_batch_size=8", "--batch.token_budget=512", "--policy.overrides.chunk_size=4",
        "--eval.every=2", "--eval.tasks=[reach-v3]", "--eval.episodes=1", "--eval.resolution=32",
        "--eval.max_steps=8", "--progress=false"])
    train(cfg, on_eval=seen.append)
    assert len(seen) == 1 and seen[0]["step"] == 2 and 0.0 <= seen[0]["success_rate"] <= 1.0
    kinds = [json.loads(line)["kind"] for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert kinds == ["train", "train", "eval"]
    said = capsys.readouterr().out.splitlines()  # the evaluation says what runs and what it came to
    rate = seen[0]["success_rate"]  # one episode: 0 or 1
    assert "eval: starting" in said
    assert any(line.startswith(f"eval: success rate {rate:.1%} ({rate:.0f}/1 episodes, 1 task(s);") for line in said)


# -- the review's defects: refused at start, before anything is written ------------------------------
@pytest.mark.parametrize("flag, message", [
    ("--batch.global_batch_size=0", "error: batch.global_batch_size must be >= 1, not 0"),
    ("--precision=fp16", "error: --precision must be one of auto, fp32, bf16, not 'fp16'"),
    ("--parallel.strategy=fsdpx", "error: --parallel.strategy must be one of ddp, fsdp, not 'fsdpx'"),
    ("--policy.normalization=minmax", "error: --policy.normalization must be one of quantile, mean_std, min_max, "
                                      "not 'minmax'"),
    ("--policy.image_resize=crop", "error: --policy.image_resize must be one of stretch, pad, pad_top_left, not 'crop'"),
    ("--policy.stats=mine", "error: --policy.stats must be one of recompute, dataset, not 'mine'"),
])
def test_bad_batch_precision_or_strategy_is_one_line_exit_2(dataset, tmp_path, flag, message):
    proc = _run([*unless_given(_args(dataset, tmp_path / "bad"), [flag]), flag])
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines() == [message]
    assert not (tmp_path / "bad").exists()


def test_a_zero_batch_plan_is_refused_not_divided_by():
    from kilovla.data.plan import GlobalBatchPlan, PlanConfig

    with pytest.raises(KilovlaError, match="global_batch_size must be >= 1, not 0"):
        GlobalBatchPlan(np.full(10, 5), PlanConfig(global_batch_size=0, token_budget=100))


def test_static_graph_on_several_ranks_is_refused_at_start(dataset, tmp_path):
    from kilovla.train.config import validate_config

    cfg = load_config(TrainConfig, None, [*_args(dataset, tmp_path / "sg"), "--parallel.static_graph=true"])
    validate_config(cfg, world_size=1)  # one process: no DDP, nothing to refuse
    with pytest.raises(KilovlaError, match=r"parallel.static_graph=true cannot be used on several ranks: a step "
                                           r"accumulates over several packed rows per rank \(no_sync\)"):
        validate_config(cfg, world_size=2)
    proc = _run([*_args(dataset, tmp_path / "sg"), "--parallel.static_graph=true"], env={"WORLD_SIZE": "2"})
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1 and "static_graph" in proc.stderr
    assert not (tmp_path / "sg").exists()


def test_evaluation_settings_are_checked_before_any_step(tmp_path):
    from kilovla.envs.collect import collect

    collect(tmp_path / "mw", tasks=["reach-v3"], episodes_per_task=1, resolution=32, batch_size=1)
    base = [f"--run_dir={tmp_path / 'run'}", "--steps=2", f"--dataset.roots=[{tmp_path / 'mw'}]",
            "--batch.global_batch_size=4", "--batch.token_budget=512", "--policy.overrides.chunk_size=4",
            "--eval.every=1", "--eval.episodes=1", "--progress=false"]
    with pytest.raises(KilovlaError, match=r"unknown metaworld task\(s\) \['reach-v9'\]"):
        train(load_config(TrainConfig, None, [*base, "--eval.tasks=[reach-v9]"]))
    assert not (tmp_path / "run").exists()
    with pytest.raises(KilovlaError, match=r"does not fit env libero: action_dim 4 \(policy\) vs 7"):
        train(load_config(TrainConfig, None, [*base, "--eval.env=libero", "--eval.tasks=[libero_spatial/t0]"]))
    assert not (tmp_path / "run").exists()


def test_the_recorded_attention_is_what_runs(dataset, tmp_path, capsys):
    padded = train(load_config(TrainConfig, None, _args(dataset, tmp_path / "pad", steps=1)))
    assert "attention padded (sdpa)," in capsys.readouterr().out  # printed with --progress=false too
    assert padded["attention_backend"] == "padded (sdpa)"
    assert _metrics(tmp_path / "pad")[0]["attention_backend"] == "padded (sdpa)"
    packed = train(load_config(TrainConfig, None, [*_args(dataset, tmp_path / "pk", steps=1),
                                                   "--policy.overrides.packing=true"]))
    from kilovla.models.attention import resolve_backend

    assert packed["attention_backend"] == resolve_backend("auto", torch.device("cpu")) != "padded (sdpa)"


def test_a_fine_tuning_preset_without_weights_is_refused_and_a_3b_one_warns(dataset, tmp_path, caplog):
    from kilovla.train.build import start_weights as _start_weights
    from kilovla.models.presets import policy_defaults

    cfg = load_config(TrainConfig, None, [f"--run_dir={tmp_path / 'r'}", f"--dataset.roots=[{dataset}]",
                                          "--policy.preset=pi05-base"])
    with pytest.raises(KilovlaError, match=r"pi05-base is a fine-tuning recipe: give --policy.init_from=PATH"):
        train(cfg)
    assert not (tmp_path / "r").exists()
    allowed = load_config(TrainConfig, None, ["--policy.preset=pi05-base", "--policy.random_init=true"])
    with caplog.at_level("WARNING", logger="kilovla.train.trainer"):
        _start_weights(allowed, policy_defaults("pi05-base"))
        _start_weights(load_config(TrainConfig, None, ["--policy.preset=pi05-3b"]), policy_defaults("pi05-3b"))
        _start_weights(load_config(TrainConfig, None, ["--policy.preset=pi05-tiny"]), policy_defaults("pi05-tiny"))
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 2 and all("RANDOM weights" in w for w in warnings)


def test_init_from_an_fsdp_checkpoint_with_only_state(dataset, tmp_path):
    """An FSDP run's intermediate checkpoint holds its weights in state/ only; init_from reads it."""
    import torch.distributed.checkpoint as dcp

    from kilovla.models.presets import build_model

    src = build_model("pi05-tiny", seed=7, chunk_size=4)
    folder = tmp_path / "step_000002"
    dcp.save({"model": src.state_dict()}, checkpoint_id=str(folder / "state"), no_dist=True)
    run = tmp_path / "ft"
    cfg = load_config(TrainConfig, None, [*_args(dataset, run, steps=1), f"--policy.init_from={folder}",
                                          "--optim.lr=0"])
    train(cfg)
    final = _weights(run, 1)
    want = src.state_dict()
    assert max((final[k] - want[k]).abs().max().item() for k in want) == 0.0
    policy = json.loads((run / "checkpoints" / "step_000001" / "policy.json").read_text())
    assert policy["init_from"]["path"] == str(folder.resolve())


def test_a_resumed_run_reports_its_rate_over_wall_time(dataset, tmp_path):
    import time

    args = [f"--run_dir={tmp_path / 'run'}", f"--dataset.roots=[{dataset}]", "--batch.global_batch_size=8",
            "--checkpoint.every=1", "--progress=false"]
    train(load_config(TrainConfig, None, [*args, "--steps=3"]))
    t0 = time.perf_counter()
    summary = train(load_config(TrainConfig, None, [*args, "--steps=6"]), resume="auto")
    wall = time.perf_counter() - t0
    # The median step's rate leaves out set-up and the checkpoint after every step; the run's does not.
    assert summary["steps"] == 6 and summary["steps_this_run"] == 3
    assert summary["samples_per_s"] == pytest.approx(3 * 8 / wall, rel=0.05)
    assert summary["step_samples_per_s"] > summary["samples_per_s"]


@pytest.mark.parametrize("family", ["pi05-tiny", "smolvla-tiny"])
def test_padding_counts_padded_tokens_and_the_unused_budget_apart(dataset, tmp_path, family):
    """The lake's token plan (the family's camera, language and action tokens per sample) is what the model
    computes: a packed row holds no padding."""
    def run(name, packing):
        return train(load_config(TrainConfig, None, [
            f"--run_dir={tmp_path / name}", f"--dataset.roots=[{dataset}]", "--steps=2", "--batch.global_batch_size=4",
            "--batch.token_budget=100000", "--progress=false", f"--policy.overrides={{packing: {packing}}}",
            f"--policy.preset={family}"]))

    packed, padded = run("packed", "true"), run("padded", "false")
    policy = json.loads((tmp_path / "packed" / "checkpoints" / "step_000002" / "policy.json").read_text())
    assert policy["image_size"] == [32, 32]  # what `kilovla eval` renders at by default
    assert packed["padding_fraction"] == 0.0  # a packed row holds real tokens only
    assert padded["padding_fraction"] > 0.1  # language padded to max_language_tokens
    # 4 samples fill a small part of a 100k-token budget: unused budget, not padding
    assert packed["budget_unused_fraction"] > 0.9 and padded["budget_unused_fraction"] > 0.9


def test_smolvla_trains_on_a_weighted_lake_of_two_datasets_from_its_index(dataset, tmp_path):
    from kilovla.data.lake_index import default_index_path
    from kilovla.data.lerobot import LeRobotDataset
    from kilovla.data.synthetic import make_synthetic_dataset

    second = make_synthetic_dataset(tmp_path / "second", episodes=2, frames=(12, 16), resolution=(32, 32), seed=7)
    summary = train(load_config(TrainConfig, None, [
        f"--run_dir={tmp_path / 'run'}", f"--dataset.roots=[{dataset}, {second}]", "--dataset.weights=[1, 0.5]",
        "--steps=3", "--batch.global_batch_size=8", "--batch.token_budget=400", "--progress=false",
        "--log_sample_ids=true", "--policy.preset=smolvla-tiny", "--policy.overrides={packing: true}"]))
    first = len(LeRobotDataset(dataset))
    ids = [i for r in _metrics(tmp_path / "run") if r["kind"] == "train" for i in r["sample_ids"]]
    assert len(ids) == 24 and any(i < first for i in ids) and any(i >= first for i in ids)  # both datasets drawn
    assert default_index_path([str(dataset), str(second)]).with_suffix(".json").is_file()  # from the lake index
    assert summary["padding_fraction"] == 0.0  # the plan's token counts are what the model computes
    assert json.loads((tmp_path / "run" / "checkpoints" / "step_000003" / "policy.json").read_text())["family"] == \
        "smolvla"


@pytest.mark.parametrize("flag", ["--run_dir=", "--policy.path=", "--dataset.index=", "--policy.tokenizer="])
def test_an_empty_path_is_refused_and_nothing_is_written(dataset, tmp_path, monkeypatch, capsys, flag):
    """`--run_dir=` trained into the current folder; an empty init_from trained from random weights."""
    monkeypatch.chdir(tmp_path)
    argv = [*unless_given(_args(dataset, tmp_path / "run", steps=1), [flag]), flag]
    assert main(["train", *argv]) == 2
    assert capsys.readouterr().err.strip().endswith(f"{flag[:-1]} is empty: give a path"
                                                    + ("" if flag == "--run_dir=" else " or leave it unset"))
    assert list(tmp_path.iterdir()) == []


def test_an_rl_folder_with_a_residual_actor_is_refused_as_starting_weights(reach_demos, tmp_path, capsys):
    """The new checkpoint had residual: null: the RL run's actor was silently dropped."""
    rl = Path(__file__).parent / "fixtures" / "legacy_a039621" / "rl_residual_sac"
    assert main(["train", f"--run_dir={tmp_path / 'run'}", f"--dataset.roots=[{reach_demos}]",
                 "--steps=1", "--progress=false", f"--policy.path={rl}"]) == 2
    assert capsys.readouterr().err.strip() == (
        f"error: {rl}: an RL policy folder (policy.json has a residual actor), which supervised training would drop: "
        "train from the policy folder its RL run started from")
    assert not (tmp_path / "run").exists()


def test_train_names_the_flags_typed_and_the_library_its_keys(dataset, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["train", f"--dataset.roots=[{dataset}]", "--steps=-2"]) == 2
    assert capsys.readouterr().err.strip() == "error: --steps must be >= 1, not -2"
    assert main(["train", f"--dataset.roots=[{dataset}]", "--policy.path=nonexist"]) == 2
    assert capsys.readouterr().err.strip() == "error: --policy.path nonexist: no such checkpoint file or folder"
    assert main(["train", f"--dataset.roots=[{dataset}]", "--policy.init_from=nonexist"]) == 2
    assert capsys.readouterr().err.strip() == "error: --policy.init_from nonexist: no such checkpoint file or folder"
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(KilovlaError, match="^steps must be >= 1, not -2$"):  # a YAML user reads the key
        train(load_config(TrainConfig, None, [f"--dataset.roots=[{dataset}]", "--steps=-2"]))
    with pytest.raises(KilovlaError, match="^policy.init_from nonexist: no such checkpoint file or folder$"):
        train(load_config(TrainConfig, None, [f"--dataset.roots=[{dataset}]", "--policy.init_from=nonexist"]))


def test_the_unknown_seeds_warning_names_the_flag_typed(caplog):
    from kilovla.train.build import demonstration_seeds
    from kilovla.train.config import typed_flags

    class Seeded:  # a dataset whose episodes record their seeds
        root = "ds"

        def episode_seeds(self):
            return {"reach": [1]}

    start = {"layout": "kilovla", "path": str(Path(__file__).parent / "fixtures" / "legacy_a039621" / "demo_checkpoint")}
    with typed_flags({"policy.init_from": "--policy.path"}):
        assert demonstration_seeds([Seeded()], start) is None
    assert f"--policy.path={start['path']} record(s) no episode seeds" in caplog.text
    caplog.clear()
    assert demonstration_seeds([Seeded()], start) is None
    assert f"policy.init_from={start['path']} record(s)" in caplog.text and "--policy.path" not in caplog.text


def test_a_state_dim_constant_in_each_episode_keeps_its_range_with_the_datasets_stats(reach_demos, caplog):
    """stats.json averages each episode's quantiles (LeRobot's aggregation): reach-v3's goal (the last 3 dims of
    environment_state, fixed within an episode, drawn per episode) has q01 == q99 there. Training on those stats
    (--policy.stats=dataset) widens the dims to min/max, so the policy sees the goal instead of a constant 0."""
    from kilovla.data.lerobot import LeRobotDataset
    from kilovla.models.presets import preset
    from kilovla.models.processor import _normalizer
    from kilovla.train.build import policy_meta, with_policy_defaults
    from kilovla.train.config import with_init_model

    ds = LeRobotDataset(reach_demos)
    stored = json.loads((reach_demos / "meta" / "stats.json").read_text())["observation.environment_state"]
    assert np.allclose(stored["q01"][-3:], stored["q99"][-3:]) and not np.allclose(stored["min"][-3:], stored["max"][-3:])
    cfg = with_policy_defaults(with_init_model(load_config(TrainConfig, None, [
        f"--dataset.roots=[{reach_demos}]", "--policy.state_keys=[observation.state, observation.environment_state]",
        "--policy.stats=dataset"])))
    meta = policy_meta(cfg, preset(cfg.policy.preset), [ds.meta])
    env = meta.stats["observation.environment_state"]
    np.testing.assert_allclose(env["q01"][-3:], stored["min"][-3:])
    np.testing.assert_allclose(env["q99"][-3:], stored["max"][-3:])
    assert env["q01"][:3] == stored["q01"][:3]  # dims whose quantiles did not meet keep them
    assert "36, 37, 38]" in caplog.text  # and the objects' start positions (4, 5; 22, 23 a frame later)
    goals = ds.get_batch(np.array([0, ds.meta.episodes.row_to[0]]))["observation.environment_state"]
    assert not np.allclose(goals[0, -3:], goals[1, -3:])  # the two episodes' goals differ, and so do their inputs
    normalise = _normalizer(env, "quantile")[0]
    assert not np.allclose(normalise(goals[0])[-3:], normalise(goals[1])[-3:])
