"""Packing, rank balancing and the global batch plan's guarantees."""

import numpy as np
import pytest

from kilovla.data.packing import balance_ranks, imbalance, pack_best_fit, pack_min_rows, plan_rank_rows, sample_cost
from kilovla.data.plan import GlobalBatchPlan, PlanConfig, padding_fraction
from kilovla.errors import KilovlaError


def _lengths(n, seed=0):
    rng = np.random.default_rng(seed)
    return rng.choice([2, 3], n) * 256 + rng.integers(8, 49, n) + 8 + rng.choice([10, 25, 50], n)


def test_best_fit_keeps_every_sample_once_and_respects_the_budget():
    lengths = _lengths(500)
    rows = pack_best_fit(lengths, 8192)
    flat = np.concatenate(rows)
    assert sorted(flat.tolist()) == list(range(500))
    assert max(lengths[r].sum() for r in rows) <= 8192


def test_best_fit_fills_rows_to_within_two_percent_on_vla_lengths():
    lengths = _lengths(2048)
    rows = pack_best_fit(lengths, 16384)
    assert padding_fraction([lengths[r].sum() for r in rows], 16384) < 0.02


def test_min_rows_fills_clustered_lengths_where_best_fit_leaves_gaps():
    # one dataset, four instructions: 2 cameras x 256 + 20-55 language tokens + 8 state + 50 actions
    lengths = np.random.default_rng(1).choice([590, 591, 596, 626], 2048)
    best = pack_best_fit(lengths, 16384)
    ours = pack_min_rows(lengths, 16384)
    assert padding_fraction([lengths[r].sum() for r in best], 16384) > 0.02
    assert padding_fraction([lengths[r].sum() for r in ours], 16384) <= 0.02
    assert len(ours) == -(-lengths.sum() // 16384)  # the lower bound
    assert sorted(np.concatenate(ours).tolist()) == list(range(2048))
    assert max(lengths[r].sum() for r in ours) <= 16384


@pytest.mark.parametrize("seed", range(4))
def test_min_rows_meets_the_lower_bound_where_greedy_orders_need_a_row_more(seed):
    # ~99 % full rows at the bound: best-fit and worst-fit decreasing both end one row over it here
    from kilovla.data.packing import _worst_fit_min_rows, pack_exact_fill

    lengths = _lengths(2048, seed)
    bound = -(-int(lengths.sum()) // 16384)
    best = pack_best_fit(lengths, 16384)
    assert len(best) == bound + 1 and _worst_fit_min_rows(lengths, 16384, bound, len(best)) is None
    for rows in (pack_min_rows(lengths, 16384), pack_exact_fill(lengths, 16384)):
        assert len(rows) == bound
        assert sorted(np.concatenate(rows).tolist()) == list(range(2048))
        assert max(lengths[r].sum() for r in rows) <= 16384
    assert padding_fraction([lengths[r].sum() for r in pack_min_rows(lengths, 16384)], 16384) < 0.011


@pytest.mark.parametrize("seed", range(5))
def test_min_rows_never_needs_more_rows_than_best_fit(seed):
    lengths = _lengths(700, seed)
    ours = pack_min_rows(lengths, 8192)
    assert len(ours) <= len(pack_best_fit(lengths, 8192))
    assert sorted(np.concatenate(ours).tolist()) == list(range(700))
    assert max(lengths[r].sum() for r in ours) <= 8192


def test_a_sample_longer_than_the_budget_is_an_error():
    with pytest.raises(KilovlaError, match="does not fit the token budget"):
        pack_best_fit(np.array([10, 300]), 256)


def test_ranks_get_balanced_compute_and_the_same_number_of_rows():
    lengths = _lengths(64 * 32, seed=2)
    ranks = plan_rank_rows(lengths, 64, 8192)
    assert len({len(r) for r in ranks}) == 1
    cost = sample_cost(lengths)
    assert imbalance([sum(cost[row].sum() for row in r) for r in ranks]) < 1.01
    naive = cost.reshape(64, 32).sum(1)
    assert imbalance(naive) > 1.03  # the problem being solved is real on these lengths


def test_balance_needs_at_least_one_sample_per_rank():
    with pytest.raises(KilovlaError, match="cannot feed"):
        balance_ranks(np.array([5, 6]), 3)


@pytest.fixture
def plan():
    return GlobalBatchPlan(_lengths(1000), PlanConfig(seed=7, global_batch_size=64, token_budget=8192))


def test_every_sample_appears_once_per_epoch(plan):
    steps = plan.steps_in_epoch(0)
    seen = np.concatenate([plan.global_batch(s) for s in range(steps)])
    assert len(seen) == steps * 64 and len(np.unique(seen)) == len(seen)


def test_epochs_are_shuffled_differently(plan):
    n = plan.steps_in_epoch(0)
    assert not np.array_equal(plan.global_batch(0), plan.global_batch(n))


def test_the_plan_is_a_pure_function_of_seed_and_step(plan):
    other = GlobalBatchPlan(plan.lengths, plan.config)
    for step in (0, 5, 17, 40):
        assert np.array_equal(plan.global_batch(step), other.global_batch(step))
    moved = GlobalBatchPlan(plan.lengths, PlanConfig(seed=8, global_batch_size=64, token_budget=8192))
    assert not np.array_equal(plan.global_batch(0), moved.global_batch(0))


@pytest.mark.parametrize("world_size", [1, 2, 4, 8])
def test_global_batches_do_not_depend_on_the_world_size(plan, world_size):
    for step in (0, 3, 20):
        ranks = plan.all_rank_rows(step, world_size)
        got = np.concatenate([np.concatenate(rows) for rows in ranks])
        assert sorted(got.tolist()) == sorted(plan.global_batch(step).tolist())
        assert len({len(rows) for rows in ranks}) == 1


def test_state_dict_resumes_at_the_same_step(plan):
    plan.step = 12
    state = plan.state_dict()
    assert all(isinstance(v, (int, str, type(None))) for v in state.values())
    fresh = GlobalBatchPlan(plan.lengths, plan.config)
    fresh.load_state_dict(state)
    assert fresh.step == 12
    assert np.array_equal(fresh.rank_rows(12, 1, 2)[0], plan.rank_rows(12, 1, 2)[0])


def test_a_state_from_another_plan_is_refused(plan):
    state = plan.state_dict()
    other = GlobalBatchPlan(plan.lengths, PlanConfig(seed=7, global_batch_size=32, token_budget=8192))
    with pytest.raises(KilovlaError, match="global_batch_size"):
        other.load_state_dict(state)


def test_token_budgeted_global_batches_stay_under_the_budget():
    lengths = _lengths(1000)
    plan = GlobalBatchPlan(lengths, PlanConfig(seed=0, global_batch_tokens=40_000, token_budget=8192))
    sizes = [lengths[plan.global_batch(s)].sum() for s in range(plan.steps_in_epoch(0))]
    assert max(sizes) <= 40_000 and min(sizes) > 40_000 - lengths.max()
    epoch, i = plan.locate(plan.steps_in_epoch(0) + 2)
    assert (epoch, i) == (1, 2)


def test_mixture_weights_scale_each_dataset_per_epoch():
    lengths = _lengths(300)
    source = np.repeat([0, 1], [100, 200])
    plan = GlobalBatchPlan(lengths, PlanConfig(seed=0, global_batch_size=10, drop_last=False),
                           offsets=np.array([0, 100, 300]), weights=np.array([2.0, 0.5]))
    order = plan.epoch_order(0)
    assert (source[order] == 0).sum() == 200 and (source[order] == 1).sum() == 100
    assert np.all(np.bincount(order[source[order] == 0], minlength=100)[:100] == 2)
