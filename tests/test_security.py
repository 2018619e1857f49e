"""A folder someone handed over cannot run code: every pickled file kilovla reads from a run, policy or
dataset folder is refused, in one line naming it, when it would unpickle anything but plain data, and
the files kilovla itself writes (and wrote before) still load. Weight files follow the umask."""

import json
import os
import pickle
import random
import shutil
import stat
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from kilovla.cli import main
from kilovla.errors import KilovlaError
from kilovla.models.checkpoints import read_safetensors, save_safetensors
from kilovla.models.policy import VLAPolicy
from kilovla.policy_folder import save_policy
from kilovla.models.presets import build_model
from kilovla.models.processor import PolicyMeta
from kilovla.safe_load import UnsafeFileError, load_torch

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


class WritesMarker:
    """What a hostile pickle does, made visible: unpickling it creates the file `marker`."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def _craft(path: Path, marker: Path, *, raw_pickle: bool = False) -> None:
    """Replace `path` by a file whose unpickling would create `marker` (a torch.save file, or a bare pickle
    as DCP's .metadata is)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if raw_pickle:
        path.write_bytes(pickle.dumps(WritesMarker(marker)))
    else:
        torch.save({"optimizer": WritesMarker(marker)}, path)


def _refused_in_one_line(capsys, path: Path) -> None:
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and err.startswith(f"error: {path}: not loaded: it would unpickle io.open"), err


# -- a tiny training run and its checkpoint ----------------------------------------------------------------
def _train_args(dataset, run_dir, steps):
    return [f"--run_dir={run_dir}", f"--steps={steps}", f"--dataset.roots=[{dataset}]", "--batch.global_batch_size=8",
            "--batch.token_budget=150", "--checkpoint.every=2", "--policy.preset=pi05-tiny", "--progress=false",
            "--policy.overrides.chunk_size=4", "--optim.warmup_steps=1"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """(dataset, run_dir) of a 2-step pi05-tiny run with its checkpoint at step 2."""
    from kilovla.config import load_config
    from kilovla.data.synthetic import make_synthetic_dataset
    from kilovla.train.trainer import TrainConfig, train

    root = tmp_path_factory.mktemp("security")
    dataset = make_synthetic_dataset(root / "ds", episodes=4, frames=(16, 20), resolution=(32, 32), seed=4)
    train(load_config(TrainConfig, None, _train_args(dataset, root / "run", steps=2)))
    return dataset, root / "run"


def _copy_run(trained, tmp_path) -> tuple[Path, Path, Path]:
    """A copy of the trained run to tamper with: (dataset, run_dir, its step-2 checkpoint)."""
    dataset, run = trained
    shutil.copytree(run, tmp_path / "run")
    return dataset, tmp_path / "run", tmp_path / "run" / "checkpoints" / "step_000002"


def _as_sharded(folder: Path, poison_lr: Path | None = None) -> None:
    """Turn an unsharded checkpoint into an FSDP-style one (state/ written by DCP from its own weights and
    optimizer state); `poison_lr`: the first param group's lr becomes an object creating that file."""
    import torch.distributed.checkpoint as dcp

    optim = torch.load(folder / "optimizer.pt", weights_only=True)["optimizer"]  # our own file, just written
    if poison_lr is not None:
        optim["param_groups"][0]["lr"] = WritesMarker(poison_lr)
    state = {"model": read_safetensors(folder / "model.safetensors"), "optim": optim}
    dcp.save(state, checkpoint_id=str(folder / "state"), no_dist=True)
    (folder / "optimizer.pt").unlink()


@pytest.mark.parametrize("name", ["optimizer.pt", "rng.pt"])
def test_train_resume_refuses_a_pickle_that_runs_code(trained, tmp_path, capsys, name):
    dataset, run, folder = _copy_run(trained, tmp_path)
    marker = tmp_path / "marker"
    _craft(folder / name, marker)
    assert main(["train", *_train_args(dataset, run, steps=3), "--resume", str(folder)]) == 2
    _refused_in_one_line(capsys, folder / name)
    assert not marker.exists()


def test_train_resume_refuses_a_crafted_dcp_metadata(trained, tmp_path, capsys):
    dataset, run, folder = _copy_run(trained, tmp_path)
    _as_sharded(folder)
    marker = tmp_path / "marker"
    _craft(folder / "state" / ".metadata", marker, raw_pickle=True)
    assert main(["train", *_train_args(dataset, run, steps=3), "--resume", str(folder)]) == 2
    _refused_in_one_line(capsys, folder / "state" / ".metadata")
    assert not marker.exists()


def test_train_resume_refuses_a_non_tensor_dcp_item_that_runs_code(trained, tmp_path, capsys):
    """DCP torch.saves an optimizer's param_groups values into the shards and itself loads them with
    weights_only=False; here the .metadata is genuine and only the lr item is hostile."""
    dataset, run, folder = _copy_run(trained, tmp_path)
    marker = tmp_path / "marker"
    _as_sharded(folder, poison_lr=marker)
    assert main(["train", *_train_args(dataset, run, steps=3), "--resume", str(folder)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0, err
    assert err.startswith(f"error: {folder / 'state'}/") and "(item optim.param_groups.0.lr): not loaded" in err, err
    assert not marker.exists()


def test_a_genuine_dcp_checkpoint_still_resumes(trained, tmp_path):
    dataset, run, folder = _copy_run(trained, tmp_path)
    _as_sharded(folder)
    assert main(["train", *_train_args(dataset, run, steps=3), "--resume", str(folder)]) == 0
    assert json.loads((run / "checkpoints" / "step_000003" / "trainer_state.json").read_text())["step"] == 3


def test_files_written_the_way_earlier_versions_wrote_them_still_load(tmp_path):
    """rng.pt and optimizer.pt exactly as train/checkpoint.save writes them (torch.save of numpy's RNG
    tuple and of AdamW's full state dict)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    np.random.seed(5)
    random.seed(5)
    torch.manual_seed(5)
    torch.save({"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()},
               tmp_path / "rng.pt")
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95))
    model(torch.randn(4, 3)).sum().backward()
    optimizer.step()
    full = get_optimizer_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    torch.save({"optimizer": full}, tmp_path / "optimizer.pt")

    rng = load_torch(tmp_path / "rng.pt")
    want = np.random.rand(3)
    np.random.set_state(rng["numpy"])
    np.testing.assert_array_equal(np.random.rand(3), want)
    random.setstate(rng["python"])
    torch.set_rng_state(rng["torch"])
    optim = load_torch(tmp_path / "optimizer.pt")["optimizer"]
    assert optim["param_groups"][0]["betas"] == (0.9, 0.95)
    torch.testing.assert_close(optim["state"]["weight"]["exp_avg"], full["state"]["weight"]["exp_avg"])


# -- FSDP policy folders: init_from, eval, quantize -----------------------------------------------------------
def _metaworld_policy() -> VLAPolicy:
    """A random tiny pi0.5 that fits Meta-World (4-D state and actions, two cameras)."""
    stats = {"observation.state": {"q01": [-1] * 4, "q99": [1] * 4}, "action": {"q01": [-1] * 4, "q99": [1] * 4}}
    meta = PolicyMeta(preset="pi05-tiny", overrides={"disabled_cameras": ["right_wrist_0_rgb"]},
                      camera_map={"observation.images.scene": "base_0_rgb", "observation.images.wrist": "left_wrist_0_rgb"},
                      state_dim=4, action_dim=4, stats=stats, n_action_steps=4)
    return VLAPolicy(build_model("pi05-tiny", seed=1, disabled_cameras=("right_wrist_0_rgb",)), meta)


def _sharded_policy_folder(tmp_path: Path, marker: Path) -> Path:
    """A Meta-World policy folder whose weights are only in state/, with a genuine DCP save whose
    .metadata is then replaced by a hostile pickle."""
    import torch.distributed.checkpoint as dcp

    policy = _metaworld_policy()
    folder = tmp_path / "policy"
    save_policy(policy, folder)
    (folder / "model.safetensors").unlink()
    dcp.save({"model": policy.model.state_dict()}, checkpoint_id=str(folder / "state"), no_dist=True)
    _craft(folder / "state" / ".metadata", marker, raw_pickle=True)
    return folder


def test_eval_of_an_fsdp_folder_refuses_a_crafted_metadata(tmp_path, capsys):
    marker = tmp_path / "marker"
    folder = _sharded_policy_folder(tmp_path, marker)
    assert main(["eval", f"--policy.path={folder}", "--env.task=reach-v3", "--eval.n_episodes=1", "--env.resolution=32",
                 "--env.max_steps=4", "--eval.videos=0", f"--output_dir={tmp_path / 'ev'}"]) == 2
    _refused_in_one_line(capsys, folder / "state" / ".metadata")
    assert not marker.exists()


def test_quantize_of_an_fsdp_folder_refuses_a_crafted_metadata(tmp_path, capsys):
    marker = tmp_path / "marker"
    folder = _sharded_policy_folder(tmp_path, marker)
    assert main(["quantize", f"--policy.path={folder}", f"--output_dir={tmp_path / 'q'}"]) == 2
    _refused_in_one_line(capsys, folder / "state" / ".metadata")
    assert not marker.exists() and not (tmp_path / "q").exists()


def test_a_state_folder_of_another_model_is_one_line_not_a_dcp_traceback(tmp_path, capsys):
    """DCP wraps every failure in a CheckpointException, a BaseException that `except Exception` misses."""
    import torch.distributed.checkpoint as dcp

    folder = save_policy(_metaworld_policy(), tmp_path / "policy")
    (folder / "model.safetensors").unlink()
    dcp.save({"model": {"w": torch.zeros(2)}}, checkpoint_id=str(folder / "state"), no_dist=True)
    assert main(["eval", f"--policy.path={folder}", "--env.task=reach-v3", "--eval.n_episodes=1", "--env.resolution=32",
                 "--env.max_steps=4", "--eval.videos=0", f"--output_dir={tmp_path / 'ev'}"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and err.startswith(f"error: {folder / 'state'}: does not fit the model: "), err


def test_init_from_an_fsdp_folder_refuses_a_crafted_metadata(trained, tmp_path, capsys):
    dataset, _ = trained
    marker = tmp_path / "marker"
    folder = tmp_path / "step_000002"
    import torch.distributed.checkpoint as dcp

    dcp.save({"model": {"w": torch.zeros(2)}}, checkpoint_id=str(folder / "state"), no_dist=True)
    _craft(folder / "state" / ".metadata", marker, raw_pickle=True)
    assert main(["train", *_train_args(dataset, tmp_path / "ft", steps=1), f"--policy.init_from={folder}"]) == 2
    _refused_in_one_line(capsys, folder / "state" / ".metadata")
    assert not marker.exists()


# -- RL resume ------------------------------------------------------------------------------------------------
def _rl_checkpoint(tmp_path: Path) -> Path:
    """An RL run's checkpoint folder as the runner resumes it (policy folder + rl_state.json), no learner.pt."""
    folder = tmp_path / "run" / "checkpoints" / "step_000002"
    save_policy(_metaworld_policy(), folder)
    (folder / "rl_state.json").write_text(json.dumps({"version": 2, "compute_model": "real"}))
    return folder


def test_rl_resume_refuses_a_learner_state_that_runs_code_before_ray_starts(tmp_path):
    from kilovla.rl import runner

    folder = _rl_checkpoint(tmp_path)
    marker = tmp_path / "marker"
    _craft(folder / "learner.pt", marker)
    cfg = runner.load(None, [f"--run_dir={tmp_path / 'run'}", "--steps=3", "--env.tasks=[reach-v3]", "--env.workers=1",
                             "--env.envs_per_worker=1", "--env.resolution=32", "--eval.episodes=0", "--progress=false"])
    with pytest.raises(UnsafeFileError, match=f"^{folder / 'learner.pt'}: not loaded: it would unpickle io.open"):
        runner.run(cfg, resume=str(folder))
    assert not marker.exists()
    assert "ray" not in sys.modules or not sys.modules["ray"].is_initialized()


def test_a_learner_state_written_as_the_runner_writes_it_still_loads(tmp_path):
    """learner.pt is torch.save of LearnerWorker.state(): weights, AdamW with a value-head group, LambdaLR,
    the version and the advantage scale."""
    from kilovla.rl.ppo import AdvantageScale
    from kilovla.train.optim import OptimConfig, build_optimizer

    model = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.Linear(2, 1))
    _, optimizer, scheduler = build_optimizer(model, OptimConfig(), steps=10,
                                              extra_groups=[{"params": list(model[1].parameters()), "lr": 1e-3}])
    model(torch.randn(4, 3)).sum().backward()
    optimizer.step()
    scheduler.step()
    scale = AdvantageScale()
    scale.observe(np.ones(3))
    scale.step()
    state = {"model": {k: v.detach().cpu().clone() for k, v in model.state_dict().items()},
             "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(), "version": 7,
             "advantage_scale": scale.state_dict()}
    torch.save(state, tmp_path / "learner.pt")

    loaded = load_torch(tmp_path / "learner.pt")
    assert loaded["version"] == 7 and loaded["advantage_scale"] == scale.state_dict()
    optimizer.load_state_dict(loaded["optimizer"])
    scheduler.load_state_dict(loaded["scheduler"])
    assert scheduler.state_dict() == state["scheduler"]
    torch.testing.assert_close(loaded["model"], state["model"])


# -- LIBERO's official init states ------------------------------------------------------------------------------
def _save_as_libero_did(states: np.ndarray, path: Path) -> None:
    """torch.save of a numpy array as the official LIBERO files are: pickled under numpy 1.x, which names
    numpy.core (numpy 2 writes numpy._core; protocol 2's GLOBAL opcode is plain text, so it can be renamed)."""
    import io

    buf = io.BytesIO()
    torch.save(states, buf, _use_new_zipfile_serialization=False, pickle_protocol=2)
    data = buf.getvalue().replace(b"cnumpy._core.multiarray\n", b"cnumpy.core.multiarray\n")
    assert b"cnumpy.core.multiarray\n_reconstruct" in data
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)


def _official_copy(tmp_path: Path) -> Path:
    """An 'official' LIBERO source tree: the installed suites' BDDL files, and their init states saved as
    the official release saves them."""
    pytest.importorskip("libero.libero")
    from kilovla.envs.libero import SUITES, _require, _suite

    _require()  # LIBERO's config location, before libero.libero is imported
    from libero.libero import get_libero_path

    root = tmp_path / "official" / "libero" / "libero"
    shutil.copytree(get_libero_path("bddl_files"), root / "bddl_files")
    for name in SUITES:
        suite = _suite(name)
        for i in range(suite.get_num_tasks()):
            task = suite.get_task(i)
            _save_as_libero_did(np.asarray(suite.get_task_init_states(i)),
                                root / "init_files" / task.problem_folder / task.init_states_file)
    return tmp_path / "official"


def test_libero_compare_reads_the_official_init_states(tmp_path):
    from kilovla.envs.libero import compare_with_official

    assert compare_with_official(_official_copy(tmp_path)) == []


def test_libero_compare_refuses_an_init_state_file_that_runs_code(tmp_path):
    from kilovla.envs.libero import _suite, compare_with_official

    root = _official_copy(tmp_path)
    task = _suite("libero_spatial").get_task(0)
    crafted = root / "libero" / "libero" / "init_files" / task.problem_folder / task.init_states_file
    marker = tmp_path / "marker"
    _craft(crafted, marker)
    with pytest.raises(KilovlaError, match=f"^{crafted}: not loaded: it would unpickle io.open"):
        compare_with_official(root)
    assert not marker.exists()


# -- permissions -------------------------------------------------------------------------------------------
@pytest.fixture()
def umask_022():
    old = os.umask(0o022)
    yield
    os.umask(old)


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_saved_weights_follow_the_umask(tmp_path, umask_022):
    save_safetensors({"w": torch.zeros(2)}, tmp_path / "model.safetensors")
    assert _mode(tmp_path / "model.safetensors") == 0o644


def test_a_quantized_folder_follows_the_umask(tmp_path, umask_022):
    from kilovla.quant.fp8 import Fp8Config
    from kilovla.quantize.folder import quantize_policy_folder

    save_policy(_metaworld_policy(), tmp_path / "src")
    quantize_policy_folder(tmp_path / "src", tmp_path / "q", Fp8Config(), latency_repeats=1)
    assert _mode(tmp_path / "q") == 0o755
    files = [p for p in (tmp_path / "q").rglob("*") if p.is_file()]
    assert "model.safetensors" in {p.name for p in files}
    assert {p.relative_to(tmp_path / "q").as_posix(): _mode(p) for p in files} == {
        p.relative_to(tmp_path / "q").as_posix(): 0o644 for p in files}


class RunsAShellCommand:
    """The most common hostile pickle: os.system (posix.system), which torch names differently."""

    def __init__(self, marker: Path):
        self.command = f"touch {marker}"

    def __reduce__(self):
        return (os.system, (self.command,))


def test_an_os_system_pickle_is_refused_naming_what_it_would_run(tmp_path):
    from kilovla.safe_load import UnsafeFileError, load_torch

    marker, path = tmp_path / "marker", tmp_path / "optimizer.pt"
    torch.save({"optimizer": RunsAShellCommand(marker)}, path)
    with pytest.raises(UnsafeFileError, match=r"optimizer.pt: not loaded: it would unpickle posix.system"):
        load_torch(path)
    assert not marker.exists()
