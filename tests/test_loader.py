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


def test_worker_rows_arrive_as_the_same_numpy_arrays(lake, monkeypatch):
    from kilovla.data import loader as loader_mod

    monkeypatch.setattr(loader_mod, "SHARED_MEMORY_MIN_BYTES", 1024)  # the tiny frames go through shared memory too
    want = list(InProcessLoader(lake, _plan(lake), steps=1))
    got = list(TorchLoader(lake, _plan(lake), steps=1, num_workers=1, pin_memory=False))
    assert len(got) == len(want)
    for a, b in zip(want, got):
        assert set(a) == set(b)
        for key, value in a.items():
            assert type(b[key]) is type(value), key
            if isinstance(value, np.ndarray):
                assert b[key].dtype == value.dtype and b[key].shape == value.shape, key
                if value.dtype != object:
                    np.testing.assert_array_equal(b[key], value, err_msg=key)


def _assert_same_rows(want, got):
    assert len(got) == len(want)
    for a, b in zip(want, got):
        assert set(a) == set(b)
        for key, value in a.items():
            if isinstance(value, np.ndarray) and value.dtype != object:
                np.testing.assert_array_equal(b[key], value, err_msg=key)


def _taking(monkeypatch):
    """Record the slot and the placed arrays of every row the main process takes out of a slot."""
    from kilovla.data import loader as loader_mod

    taken = []
    original = loader_mod._SharedSlots.take
    monkeypatch.setattr(loader_mod._SharedSlots, "take",
                        lambda self, b: taken.append((b["_slot"][0], bool(b["_slot"][1]))) or original(self, b))
    return taken


def _copied(row):
    return {k: v.copy() if isinstance(v, np.ndarray) else v for k, v in row.items()}


def test_worker_rows_come_through_shared_slots_reused_once_the_consumer_drops_a_row(lake, monkeypatch):
    # 2 workers x prefetch 2: 4 rows in flight, 7 slots, ~20 rows; a consumer that keeps a copy of each
    # row and drops the row itself frees its slot, so every row comes through one and each is reused
    taken = _taking(monkeypatch)
    want = list(InProcessLoader(lake, _plan(lake), steps=6))
    got = [_copied(row) for row in TorchLoader(lake, _plan(lake), steps=6, num_workers=2, pin_memory=False)]
    _assert_same_rows(want, got)
    assert len(taken) == len(want) > 3 * 7 and all(placed for _, placed in taken)
    assert {slot for slot, _ in taken} == set(range(7))


def test_rows_a_consumer_holds_are_never_overwritten(lake, monkeypatch):
    # Rows are views of their slot: holding every row of 6 steps keeps all 7 slots taken, and the rows
    # after them leave the workers as tensors instead of overwriting a held one
    taken = _taking(monkeypatch)
    want = list(InProcessLoader(lake, _plan(lake), steps=6))
    got = list(TorchLoader(lake, _plan(lake), steps=6, num_workers=2, pin_memory=False))
    _assert_same_rows(want, got)
    assert sorted(slot for slot, _ in taken) == list(range(7)) and len(want) > 7


def test_a_row_that_does_not_fit_its_slot_leaves_as_tensors_and_frees_the_slot(lake, monkeypatch):
    from kilovla.data import loader as loader_mod

    taken = _taking(monkeypatch)
    monkeypatch.setattr(loader_mod, "_slot_capacity", lambda lake, rows: (1 << 20) + 64)
    monkeypatch.setattr(loader_mod, "SHARED_MEMORY_MIN_BYTES", 1024)
    monkeypatch.setattr(loader_mod._SharedSlots, "__init__", _tiny_slots(loader_mod._SharedSlots.__init__))
    want = list(InProcessLoader(lake, _plan(lake), steps=6))
    got = list(TorchLoader(lake, _plan(lake), steps=6, num_workers=2, pin_memory=False))
    _assert_same_rows(want, got)
    assert len(taken) == len(want) and not any(placed for _, placed in taken)


def _tiny_slots(init):
    def tiny(self, count, capacity):
        init(self, count, 4096)  # smaller than any row's frames
    return tiny


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
@pytest.mark.shares_cpu  # the rows delivered, nothing timed
def test_ray_actor_pool_delivers_the_in_process_rows(lake):
    ray = pytest.importorskip("ray")
    want = _summary(InProcessLoader(lake, _plan(lake), steps=2))
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        got = _summary(build_loader("ray", lake, _plan(lake), steps=2, num_actors=2))
    finally:
        ray.shutdown()
    assert got == want


class _FakeRay:
    """Records what connect_ray asks of Ray, without starting one."""

    def __init__(self, initialized=False):
        self.initialized = initialized
        self.calls = []

    def is_initialized(self):
        return self.initialized

    def init(self, **kwargs):
        self.calls.append(kwargs)
        if kwargs.get("address") == "refuse:1":
            raise ConnectionError("Could not find any running Ray instance.\nmore detail")
        self.initialized = True


@pytest.fixture
def fake_ray(monkeypatch):
    import sys

    fake = _FakeRay()
    monkeypatch.setitem(sys.modules, "ray", fake)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    return fake


def test_ray_starts_locally_only_with_a_log_line(fake_ray, caplog):
    from kilovla.data.ray_cluster import connect_ray

    with caplog.at_level("WARNING", logger="kilovla.data.ray_cluster"):
        connect_ray(num_cpus=3)
    assert fake_ray.calls == [{"address": "local", "num_cpus": 3, "include_dashboard": False, "log_to_driver": False}]
    assert len(caplog.records) == 1 and "starting a local Ray with 3 CPUs" in caplog.records[0].getMessage()


def test_ray_address_from_the_environment_is_honoured(fake_ray, monkeypatch, caplog):
    from kilovla.data.ray_cluster import connect_ray

    monkeypatch.setenv("RAY_ADDRESS", "10.1.2.3:6379")
    with caplog.at_level("WARNING", logger="kilovla.data.ray_cluster"):
        connect_ray()
    assert fake_ray.calls == [{"address": "10.1.2.3:6379", "log_to_driver": False}]
    assert not caplog.records  # joined the cluster: nothing to warn about


def test_an_explicit_address_wins_and_an_initialised_ray_is_left_alone(fake_ray, monkeypatch):
    from kilovla.data.ray_cluster import connect_ray

    monkeypatch.setenv("RAY_ADDRESS", "10.1.2.3:6379")
    connect_ray("auto")
    assert fake_ray.calls == [{"address": "auto", "log_to_driver": False}]
    connect_ray("other:1")  # already initialised: no second init
    assert len(fake_ray.calls) == 1


def test_an_unreachable_cluster_is_one_clear_error(fake_ray):
    from kilovla.data.ray_cluster import connect_ray

    with pytest.raises(KilovlaError, match=r"^cannot connect to the Ray cluster at 'refuse:1': "
                                           r"Could not find any running Ray instance.$"):
        connect_ray("refuse:1")


def test_the_ray_loader_joins_the_cluster_named_by_ray_address(lake, fake_ray, monkeypatch):
    from kilovla.data.loader import RayLoader

    monkeypatch.setenv("RAY_ADDRESS", "10.9.9.9:6379")
    fake_ray.put = lambda obj: obj
    fake_ray.remote = lambda **kw: (_ for _ in ()).throw(RuntimeError("stop after init"))
    with pytest.raises(RuntimeError, match="stop after init"):
        next(iter(RayLoader(lake, _plan(lake), steps=1)))
    assert fake_ray.calls == [{"address": "10.9.9.9:6379", "log_to_driver": False}]


def test_in_process_prefetch_yields_the_rows_of_a_plain_loop(lake):
    plain = _summary(InProcessLoader(lake, _plan(lake), steps=3, prefetch=0))
    ahead = _summary(InProcessLoader(lake, _plan(lake), steps=3, prefetch=3))
    assert plain == ahead and len(plain) > 3


def test_a_fetch_error_surfaces_at_its_row_when_prefetching(lake, monkeypatch):
    from kilovla.data import loader as loader_mod
    from kilovla.errors import DatasetError

    plan = _plan(lake)
    bad = plan.rank_rows(1, 0, 1)[0]
    real = loader_mod.fetch_row

    def flaky(lk, ids):
        if np.array_equal(ids, bad):
            raise DatasetError("videos/x.mp4", "corrupt video")
        return real(lk, ids)

    monkeypatch.setattr(loader_mod, "fetch_row", flaky)
    got = []
    with pytest.raises(DatasetError, match="corrupt video"):
        for row in InProcessLoader(lake, plan, steps=3, prefetch=2):
            got.append(row["step"])
    assert got == [0] * len(plan.rank_rows(0, 0, 1))  # every row before the bad one, none after
