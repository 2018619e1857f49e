"""Expert parallelism (`--parallel.ep`): gloo processes that split pi0.5-tiny's routed experts give the
one-process run's gradient at every step (dropless, several packed rows per rank, uneven expert loads),
every expert's gradient on rank 0 under the one-process names; an ep=2 checkpoint resumes on one
process and on ep=2; settings ep cannot serve are refused in one line.

The routing regularizer is off in the equality runs: it is a mean over each forward pass's tokens, so it
changes with the rows a world size packs (plain DDP differs from one process by 2e-4..1e-3 with it on,
exactly as ep does)."""

import pytest

from kilovla.config import load_config
from kilovla.errors import KilovlaError
from kilovla.train.config import TrainConfig, validate_config
from tests.test_mesh import PACKED, _relative_error
from tests.test_train import _args, _gradients, _max_diff, _metrics, _run, _trained, _weights, dataset  # noqa: F401

MOE = ["--policy.moe.num_experts=4", "--policy.moe.top_k=2", "--policy.moe.aux_loss_coef=0",
       "--policy.moe.z_loss_coef=0", *PACKED]


def _assert_one_process_gradients(one, run, world_size):
    records = _metrics(run)
    assert [r["world_size"] for r in records] == [world_size] * 4
    assert min(r["rows_per_rank"] for r in records) >= 2  # every rank accumulates over several rows
    assert [r["sample_ids"] for r in _metrics(one)] == [r["sample_ids"] for r in records]
    assert all(max(r["moe/load"]) > 1.2 * min(r["moe/load"]) for r in records)  # uneven expert loads
    for step in range(1, 5):
        a, b = _gradients(one, step), _gradients(run, step)
        experts = [k for k in a if ".experts." in k]
        assert experts and all(b[k].shape[0] == 4 and b[k].abs().amax(dim=(1, 2)).gt(0).all() for k in experts)
        assert _relative_error(a, b) < 1e-4, f"step {step}"
    for a, b in zip(_metrics(one), records):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-5)  # the shards' squares summed over ep
    assert _max_diff(_weights(one, 4), _weights(run, 4)) < 1e-4


@pytest.mark.parametrize("nproc,ep,strategy", [(2, 2, "ddp"), (4, 2, "ddp"), (4, 4, "ddp"), (4, 2, "fsdp")])
def test_expert_parallel_ranks_give_the_one_process_gradients(dataset, references, tmp_path, nproc, ep, strategy):
    """2 ranks: each holds 2 of the 4 experts; 4 ranks with ep=2: two ep groups, each shard's gradient
    summed over the two ranks that hold it (under FSDP: sharded over them, reduce-scattered); 4 ranks
    with ep=4: one expert each."""
    run = _trained(dataset, tmp_path / "ep", "pi05-tiny", nproc=nproc,
                   extra=[*MOE, f"--parallel.ep={ep}", f"--parallel.strategy={strategy}"])
    _assert_one_process_gradients(references("pi05-tiny", MOE), run, nproc)


@pytest.mark.parametrize("second,save,strategy", [(1, "sync", "ddp"), (2, "sync", "ddp"), (1, "async", "ddp"),
                                                   (1, "sync", "fsdp")])
def test_an_ep2_checkpoint_resumes_on_one_process_and_on_ep2(dataset, references, tmp_path, second, save, strategy):
    one, run = references("pi05-tiny", MOE), tmp_path / "run"
    args = [*_args(dataset, run), *MOE, *(["--checkpoint.async_save=true"] if save == "async" else [])]
    killed = _run([*args, "--parallel.ep=2", f"--parallel.strategy={strategy}"], nproc=2,
                  env={"KILOVLA_FAULT_AFTER_STEP": "2"})
    assert killed.returncode != 0
    assert (run / "checkpoints" / "step_000002" / "state" / ".metadata").is_file()  # saved as shards
    resumed = _run([*args, "--resume", "auto", *(["--parallel.ep=2"] if second == 2 else [])], nproc=second)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert [r["world_size"] for r in _metrics(run)] == [2, 2, second, second]
    for a, b in zip(_metrics(one), _metrics(run)):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5)
    assert _max_diff(_weights(one, 4), _weights(run, 4)) < 1e-4


def _config(*args):
    return load_config(TrainConfig, None, list(args))


E4 = "--policy.moe.num_experts=4"


@pytest.mark.parametrize("args,world,message", [
    (["--parallel.ep=2"], 2, r"parallel.ep=2 needs routed experts to split: set --policy.moe.num_experts"),
    (["--parallel.ep=0", E4], 2, r"parallel.ep must be >= 1, not 0"),
    (["--parallel.ep=2", E4, "--policy.preset=groot-tiny"], 2, r"parallel.ep=2 with GR00T's MoE DiT is not supported"),
    (["--parallel.ep=2", E4], 3, r"parallel.ep=2 does not divide the data-parallel size 3"),
    (["--parallel.ep=2", E4], 1, r"parallel.ep=2 does not divide the data-parallel size 1"),
    (["--parallel.ep=4", E4], 2, r"parallel.ep=4 does not divide the data-parallel size 2"),
    (["--parallel.ep=4", E4.replace("4", "6")], 4, r"parallel.ep=4 does not divide policy.moe.num_experts=6"),
    (["--parallel.ep=2", E4, "--ema_decay=0.99"], 2, r"ema_decay with parallel.ep is not supported"),
    (["--parallel.ep=2", E4, "--policy.lora.rank=4"], 2, r"policy.lora with parallel.ep is not supported"),
    (["--parallel.ep=2", E4, "--eval.every=2"], 2, r"eval.every with parallel.ep is not supported"),
])
def test_expert_parallel_settings_that_cannot_work_are_refused_in_one_line(args, world, message):
    with pytest.raises(KilovlaError, match=message) as info:
        validate_config(_config(*args), world)
    assert "\n" not in str(info.value)



def test_the_scaling_model_counts_the_expert_all_to_all_by_hand():
    from kilovla.bench.scaling_model import CHUNK, NETWORK, NVLINK, SAMPLES_PER_GPU, ep_all_to_all_s, ep_table, shape

    s = shape("pi05-3b")
    assert ep_all_to_all_s(s, 1) == 0.0
    # tokens x top 2 x there and back x bf16 at width 1024 x 3 passes x 18 layers, 7/8 of it off the GPU
    per_gpu = SAMPLES_PER_GPU * CHUNK * 2 * 2 * 2 * 1024 * 3 * 18
    assert ep_all_to_all_s(s, 8) == pytest.approx(per_gpu * 7 / 8 / NVLINK)
    assert ep_all_to_all_s(s, 16) == pytest.approx(per_gpu * 15 / 16 / NETWORK)  # beyond a node
    assert [r["ep"] for r in ep_table()] == [2, 8, 16] and all(0 < r["fraction_of_step"] < 1 for r in ep_table())
