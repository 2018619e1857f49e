"""Loader engines execute the same plan: identical rows, resumable, packed metadata consistent."""

import numpy as np
import pytest

from kilovla.data import DataLake, GlobalBatchPlan, InProcessLoader, LakeSource, PlanConfig, TokenLayout, TorchLoader
from kilovla.data.loader import build_loader, packing_fields
from kilovla.errors import KilovlaError

LAYOUT = TokenLayout(tokens_per_camera=32, action_horizon=4, state_tokens=1)
REQUEST = {"action": [0.0, 0.1, 0.2, 0.3], "observation.images.front": [-0.1, 0.0]}


@pytest.fixture
def lake(tiny_root):
    return DataLake([LakeSource(root=str(tiny_root), delta_timestamps=REQUEST)], LAYOUT)


def _plan(lake):
    return GlobalBatchPlan.from_lake(lake, PlanConfig(seed=1, global_batch_size=16, token_budget=512))


def _summary(rows):
    return [(r["step"], r["row"], r["sample_index"].tolist(), int(np.asarray(r["observation.images.front"]).sum()))
            for r in rows]


def test_rows_carry_consistent_packing_metadata(lake):
    row = next(iter(InProcessLoader(lake, _plan(lake), steps=1)))
    n = len(row["sample_index"])
    assert row["cu_seqlens"].tolist() == [0, *np.cumsum(row["lengths"]).tolist()]
    assert len(row["position_ids"]) == row["cu_seqlens"][-1] <= 512
    assert (row["position_ids"][row["cu_seqlens"][:-1]] == 0).all()
    assert row["action"].shape == (n, 4, 6) and row["action_is_pad"].shape == (n, 4)
    assert row["observation.images.front"].shape == (n, 2, 64, 96, 3)
    assert row["observation.images.front"].dtype == np.uint8
    np.testing.assert_array_equal(row["lengths"], lake.lengths[row["sample_index"]])


def test_position_ids_restart_for_every_sample():
    f = packing_fields(np.array([2, 3]))
    assert f["position_ids"].tolist() == [0, 1, 0, 1, 2]


def test_torch_workers_deliver_exactly_the_in_process_rows(lake):
    want = _summary(InProcessLoader(lake, _plan(lake), steps=3))
    got = _summary(TorchLoader(lake, _plan(lake), steps=3, num_workers=2))
    assert got == want


def test_resuming_from_a_state_dict_continues_the_same_sequence(lake):
    straight = _summary(InProcessLoader(lake, _plan(lake), steps=4))
    first = _plan(lake)
    part1 = _summary(InProcessLoader(lake, first, steps=2))
    state = first.state_dict()
    assert state["step"] == 2
    resumed = _plan(lake)
    resumed.load_state_dict(state)
    part2 = _summary(InProcessLoader(lake, resumed, steps=2))
    assert part1 + part2 == straight


def test_each_rank_loads_its_share_of_the_global_batch(lake):
    ids = []
    for rank in range(2):
        rows = list(InProcessLoader(lake, _plan(lake), rank=rank, world_size=2, steps=1))
        ids += [i for r in rows for i in r["sample_index"].tolist()]
    assert sorted(ids) == sorted(_plan(lake).global_batch(0).tolist())


def test_a_lake_mixes_datasets_by_global_id(tiny_root, v21_root):
    both = DataLake([LakeSource(root=str(tiny_root), delta_timestamps=REQUEST),
                     LakeSource(root=str(v21_root), delta_timestamps=REQUEST, weight=0.5)], LAYOUT)
    n = len(both.datasets[0])
    batch = both.get_batch(np.array([n + 1, 0, n]))
    assert batch["dataset_index"].tolist() == [1, 0, 1]
    np.testing.assert_array_equal(batch["action"][0], both.datasets[1].get_batch(np.array([1]))["action"][0])


def test_unknown_engines_are_refused(lake):
    with pytest.raises(KilovlaError, match="loader engine"):
        build_loader("dask", lake, _plan(lake))


@pytest.mark.ray
def test_ray_actor_pool_delivers_the_in_process_rows(lake):
    ray = pytest.importorskip("ray")
    want = _summary(InProcessLoader(lake, _plan(lake), steps=2))
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        got = _summary(build_loader("ray", lake, _plan(lake), steps=2, num_actors=2))
    finally:
        ray.shutdown()
    assert got == want
