"""Tensor and pipeline parallelism on a device mesh: 4 gloo processes as TP=2 x DP=2 (and PP=2 x DP=2)
give the one-process run's gradient at every step, with several packed rows per replica and
clipping off; checkpoints resume across mesh shapes; meshes that cannot work are refused up front."""

import pytest
import torch

from kilovla.config import load_config
from kilovla.errors import KilovlaError
from kilovla.train.config import TrainConfig, validate_config
from tests.test_train import _args, _gradients, _max_diff, _metrics, _run, _trained, _weights, dataset  # noqa: F401


PACKED = ["--policy.overrides.packing=true"]  # the varlen path: rows of samples laid end to end


def _relative_error(a: dict, b: dict) -> float:
    """|a - b| / |a| over all parameters together (the issue's measure), and no tensor off by more than 1e-5."""
    assert a.keys() == b.keys()
    num = sum(float((a[k] - b[k]).double().pow(2).sum()) for k in a)
    den = sum(float(a[k].double().pow(2).sum()) for k in a)
    assert _max_diff(a, b) < 1e-5
    return (num / den) ** 0.5


def _assert_same_gradients(one, mesh, world_size=4, tp=1):
    records = _metrics(mesh)
    assert [(r["world_size"], r["tp"]) for r in records] == [(world_size, tp)] * 4
    assert min(r["rows_per_rank"] for r in records) >= 2  # every replica accumulates over several rows
    assert [r["sample_ids"] for r in _metrics(one)] == [r["sample_ids"] for r in records]
    for step in range(1, 5):
        assert _relative_error(_gradients(one, step), _gradients(mesh, step)) < 1e-4, f"step {step}"
    for a, b in zip(_metrics(one), records):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-5)  # what clipping scales by
    # AdamW divides by the root of the second moment: a parameter with a near-zero gradient moves by
    # ~lr whatever its size, so weights agree less tightly than the gradients that made them.
    assert _max_diff(_weights(one, 4), _weights(mesh, 4)) < 1e-4


@pytest.mark.slow
@pytest.mark.parametrize("family,strategy,packed", [("pi05-tiny", "ddp", True), ("pi0-tiny", "fsdp", False),
                                                    ("groot-tiny", "ddp", True)])
def test_tp2_by_dp2_gives_the_one_process_gradients(dataset, references, tmp_path, family, strategy, packed):
    """pi0/pi0.5: the single key/value head stays whole on both tp ranks (its gradient summed over
    them); GR00T: the DiT's heads split, biases and all. Packed rows: the heads split, cu_seqlens shared."""
    mesh = _trained(dataset, tmp_path / "mesh", family, nproc=4,
                    extra=["--parallel.tp=2", f"--parallel.strategy={strategy}", *(PACKED if packed else [])])
    _assert_same_gradients(references(family, PACKED if packed else ()), mesh, tp=2)


@pytest.mark.slow
@pytest.mark.parametrize("family,mesh,packed", [("pi05-tiny", ["--parallel.pp=2"], True),
                                                ("pi0-tiny", ["--parallel.pp=2", "--parallel.tp=2"], False),
                                                ("groot-tiny", ["--parallel.pp=2"], True)])
def test_pipeline_stages_give_the_one_process_gradients(dataset, references, tmp_path, family, mesh, packed):
    """PP=2 x DP=2 and TP=2 x PP=2: 1F1B over several rows per replica (rows of different lengths:
    each stage takes the shapes it receives from the row), one layer per stage, pi0.5's time MLP and
    GR00T's timestep encoder on both stages (their gradients summed over them); GR00T's VL features
    travel beside the DiT tokens and their gradient back into the backbone."""
    # GR00T: 4 DiT blocks, so the second stage has a cross-attention block (the VL features' gradient crosses)
    model = ["--policy.overrides.dit.depth=4"] if family.startswith("groot") else []
    run = _trained(dataset, tmp_path / "mesh", family, nproc=4, extra=[*mesh, *model, *(PACKED if packed else [])])
    one = references(family, [*PACKED, *model]) if packed else references(family)
    _assert_same_gradients(one, run, tp=2 if "--parallel.tp=2" in mesh else 1)


MESHES = {"one": (1, []), "tp2": (4, ["--parallel.tp=2"]), "pp2": (4, ["--parallel.pp=2"])}


@pytest.mark.slow
@pytest.mark.parametrize("first,second", [("tp2", "one"), ("one", "tp2"), ("pp2", "tp2")])
def test_a_checkpoint_resumes_on_another_mesh(dataset, reference, tmp_path, first, second):
    run = tmp_path / "run"
    (n1, mesh1), (n2, mesh2) = MESHES[first], MESHES[second]
    killed = _run([*_args(dataset, run), *mesh1], nproc=n1, env={"KILOVLA_FAULT_AFTER_STEP": "2"})
    assert killed.returncode != 0
    if mesh1:  # a mesh run's checkpoint is its shards
        assert (run / "checkpoints" / "step_000002" / "state" / ".metadata").is_file()
    resumed = _run([*_args(dataset, run), *mesh2, "--resume", "auto"], nproc=n2)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert [r["world_size"] for r in _metrics(run)] == [n1, n1, n2, n2]
    assert [r["sample_ids"] for r in _metrics(run)] == [r["sample_ids"] for r in _metrics(reference)]
    # the last checkpoint holds one plain model.safetensors, whatever the mesh
    assert _max_diff(_weights(reference, 4), _weights(run, 4)) < 1e-4


def _config(*args):
    return load_config(TrainConfig, None, list(args))


@pytest.mark.parametrize("args,world,message", [
    (["--parallel.tp=2"], 3, r"parallel.tp=2 x parallel.pp=1 does not divide the world size 3"),
    (["--parallel.tp=4"], 4, r"parallel.tp=4 does not divide the language model's 2 query heads"),
    (["--parallel.tp=2", "--policy.preset=groot-tiny", "--policy.overrides.dit.heads=3"], 4,
     r"does not divide the DiT's 3 query heads"),
    (["--parallel.tp=2"] + [f"--policy.overrides.{p}.{k}={v}" for p in ("lm", "expert") for k, v in (("heads", 6), ("kv_heads", 3))], 4,
     r"the language model's 3 key/value heads"),
    (["--parallel.tp=2", "--ema_decay=0.99"], 4, r"ema_decay with parallel.tp is not supported yet"),
    (["--parallel.tp=2", "--policy.lora.rank=4"], 4, r"policy.lora with parallel.tp is not supported yet"),
    (["--parallel.pp=4"], 4, r"parallel.pp=4 does not divide the model's 2 layers"),
    (["--parallel.pp=4", "--policy.preset=groot-tiny"], 4, r"parallel.pp=4 does not divide the model's 2 layers"),
    (["--parallel.pp=2", "--parallel.strategy=fsdp"], 4, r"parallel.pp with parallel.strategy=fsdp"),
    (["--parallel.pp=2", "--eval.every=2"], 4, r"eval.every with parallel.pp is not supported yet"),
    (["--parallel.pp=2", "--parallel.tp=2"], 6, r"parallel.tp=2 x parallel.pp=2 does not divide the world size 6"),
])
def test_meshes_that_cannot_work_are_refused_before_any_work(args, world, message):
    with pytest.raises(KilovlaError, match=message):
        validate_config(_config(*args), world)



def test_the_scaling_model_counts_the_published_shapes():
    from kilovla.bench.scaling_model import estimate, shape

    pi05 = shape("pi05-3b")
    assert 3.3e9 < pi05.params < 3.4e9 and pi05.layers == 18  # the 3.35 B parameters
    # weak scaling: more GPUs, more samples a second; DDP holds 16 bytes a parameter on every GPU
    assert estimate(pi05, 64)["samples_per_s"] > 4 * estimate(pi05, 8)["samples_per_s"]
    assert estimate(pi05, 8)["memory_gb"] > 16 * pi05.params / 1e9
    assert estimate(pi05, 8, fsdp=True)["memory_gb"] < estimate(pi05, 8)["memory_gb"] / 4
