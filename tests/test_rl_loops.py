"""The run's schedules (rl/loops.py) against a fake of the actors (`RunRoles`): who waits for whom, with no Ray.
A fake learner completes a version once `batch_segments` segments reached it, summed over its ranks."""

import numpy as np
import pytest

from kilovla.rl import loops
from kilovla.rl.config import load
from kilovla.rl.core.trajectory import Episode
from kilovla.rl.roles import WorkerLost


class FakeLogger:
    def __init__(self):
        self.rows = []

    def log(self, row):
        self.rows.append(row)


class FakeRoles:
    """Records every call; `segments` are what the buffer hands out, `lose_at` the sync calls that fail."""

    def __init__(self, cfg, workers=2, ranks=1, segments=(), bites=(), replace=(), lose_at=()):
        self.cfg, self.envs, self.learners = cfg, [object()] * workers, [object()] * ranks
        self.incarnation = {w: 0 for w in range(workers)}
        self.replaced, self.held = 0, {"updates": 0, "replay": 0}
        self.queue, self.replace = list(segments), list(replace)  # replace: check_envs' answers, in order
        self.bites = list(bites)  # at most bites[i] segments on the i-th take
        self.lose_at, self.sync_calls = set(lose_at), 0
        self.calls, self.in_version, self.version = [], 0, 0

    def start_envs(self, workers):
        self.calls.append(("start_envs", list(workers)))

    def check_envs(self, force=False):
        replaced = self.replace.pop(0) if self.replace else []
        self.calls.append(("check_envs", force, replaced))
        return replaced

    def take(self, most, timeout_s):
        n = min(most, self.bites.pop(0)) if self.bites else most
        out, self.queue = self.queue[:n], self.queue[n:]
        self.calls.append(("take", most, len(out)))
        return out

    def consume(self, shares):
        self.calls.append(("consume", [len(s) for s in shares]))
        self.in_version += sum(len(s) for s in shares)
        if self.in_version < self.cfg.learner.batch_segments:
            return [None] * len(shares)
        self.in_version, self.version = 0, self.version + 1
        return [{"version": self.version, "loss": 0.5}] * len(shares)

    def sync_weights(self, version):
        self.calls.append(("sync_weights", version))

    def set_buffer_version(self, version):
        self.calls.append(("set_buffer_version", version))

    def _sync_call(self):
        self.sync_calls += 1
        if self.sync_calls in self.lose_at:
            raise WorkerLost("env worker 1 died")

    def observe(self):
        self._sync_call()
        n = self.cfg.env.envs_per_worker
        return [[{"observation.state": np.full(2, 10 * w + e, np.float32)} for e in range(n)] for w in range(len(self.envs))]

    def act_batch(self, observations):
        self._sync_call()
        return [{"actions": np.zeros((1, 2), np.float32), "version": self.version} for _ in observations]

    def step_all(self, actions):
        self._sync_call()
        return [[(1.0, False, False, [], 1) for _ in per_worker] for per_worker in actions]

    def stats(self):
        inference = {"busy_fraction": 0.5, "batch_size_histogram": {}, "mean_batch_size": 1.0,
                     "queue_wait_p50_s": 0.0, "queue_wait_p99_s": 0.0}
        return {"inference": inference, "buffer": {"staleness_histogram": {}, "dropped_segments": 0},
                "learner_busy_fraction": 0.5, "env_busy_fraction": 0.5, "env_steps_executed": 0, "env_nodes": ["n"]}

    def checkpoint(self, version, counters, keep):
        self.calls.append(("checkpoint", version))


class Seg:
    """A finished async segment as the loops count it."""

    def __init__(self, env_steps=3, success=None):
        self.env_steps = env_steps
        self.episodes = [] if success is None else [Episode(task="reach-v3", seed=0, success=success, steps=env_steps,
                                                            return_=1.0)]

    def __len__(self):
        return 1


def _cfg(*flags):
    return load(None, ["--progress=false", "--checkpoint.every=100", "--learner.algo.name=ppo", *flags])


def _run(kind, cfg, roles):
    logger = FakeLogger()
    loop = kind(cfg, roles, logger)
    loop.run(0, {})
    return loop, logger


def test_async_ranks_train_equal_shares_and_the_odd_segment_waits_for_the_next_take():
    cfg = _cfg("--steps=1", "--learner.batch_segments=4", "--learner.ranks=2")
    roles = FakeRoles(cfg, ranks=2, segments=[Seg() for _ in range(4)], bites=[3, 1])
    loop, logger = _run(loops.AsyncLoop, cfg, roles)
    takes = [c for c in roles.calls if c[0] in ("take", "consume")]
    # 4 wanted, 3 came: 2 trained (one a rank), 1 waits; then 4 - 2 trained - 1 waiting = 1 more is asked for
    assert takes == [("take", 4, 3), ("consume", [1, 1]), ("take", 1, 1), ("consume", [1, 1])]
    after = [c for c in roles.calls if c[0] in ("sync_weights", "set_buffer_version")]
    assert after == [("sync_weights", 1), ("set_buffer_version", 1)]  # the version goes out once, when complete
    assert loop.version == 1 and [r["step"] for r in logger.rows] == [1] and loop.env_steps == 12


def test_async_starts_every_env_worker_then_restarts_only_the_replaced_ones():
    cfg = _cfg("--steps=1", "--learner.batch_segments=2")
    roles = FakeRoles(cfg, workers=3, segments=[Seg(), Seg()], bites=[1, 1], replace=[[], [1]])
    _run(loops.AsyncLoop, cfg, roles)
    starts = [c[1] for c in roles.calls if c[0] == "start_envs"]
    assert starts == [[0, 1, 2], [], [1]]


def test_async_counts_successes_per_task_and_stops_at_max_env_steps():
    cfg = _cfg("--steps=10", "--learner.batch_segments=2", "--max_env_steps=5")
    roles = FakeRoles(cfg, segments=[Seg(3, True), Seg(3, False)] + [Seg() for _ in range(10)])
    loop, logger = _run(loops.AsyncLoop, cfg, roles)
    assert loop.version == 1 and loop.env_steps == 6  # past max_env_steps after the first version: no second
    assert logger.rows[0]["success/reach-v3"] == 0.5 and logger.rows[0]["success_rate"] == 0.5


def test_sync_a_lost_round_drops_every_envs_partial_segment_and_the_round_starts_over():
    cfg = _cfg("--mode=sync", "--steps=1", "--learner.batch_segments=4", "--env.workers=2", "--env.envs_per_worker=2",
               "--rollout.segment_steps=2")
    # calls of a round: observe, then per step act_batch, step_all, observe; the 3rd call (step_all) is lost
    roles = FakeRoles(cfg, lose_at={3}, replace=[[1]])
    loop, _ = _run(loops.SyncLoop, cfg, roles)
    assert [c for c in roles.calls if c[0] == "check_envs"] == [("check_envs", True, [1])]
    assert loop.dropped == 4  # 2 workers x 2 envs
    consumed = [c for c in roles.calls if c[0] == "consume"]
    assert consumed == [("consume", [4])]
    assert loop.consumed_samples == 8 and loop.env_steps == 8  # 4 segments of 2 steps, one env step each
    assert loop.rollout_stats(roles.stats()) == {"staleness_histogram": {"0": 8}, "dropped_segments": 4}


def test_sync_segments_carry_their_round_and_worker_incarnation():
    cfg = _cfg("--mode=sync", "--steps=1", "--learner.batch_segments=8", "--env.workers=2", "--env.envs_per_worker=2",
               "--rollout.segment_steps=1")
    roles = FakeRoles(cfg)
    roles.incarnation[1] = 3
    trained = []
    consume = roles.consume
    roles.consume = lambda shares: (trained.extend(s for share in shares for s in share), consume(shares))[1]
    _run(loops.SyncLoop, cfg, roles)
    ids = sorted(s.segment_id for s in trained)
    assert ids == sorted((w, 3 if w else 0, e, seq) for w in range(2) for e in range(2) for seq in range(2))
    first = next(s for s in trained if s.segment_id == (1, 3, 1, 0))
    np.testing.assert_array_equal(first.obs["observation.state"][0], [11.0, 11.0])  # worker 1, env 1's observation


def test_sync_ranks_train_disjoint_equal_shares_of_the_batch():
    cfg = _cfg("--mode=sync", "--steps=1", "--learner.batch_segments=4", "--learner.ranks=2", "--env.workers=2",
               "--env.envs_per_worker=2", "--rollout.segment_steps=1")
    roles = FakeRoles(cfg, ranks=2)
    shares = []
    consume = roles.consume
    roles.consume = lambda s: (shares.extend([x.segment_id for x in share] for share in s), consume(s))[1]
    _run(loops.SyncLoop, cfg, roles)
    assert [c for c in roles.calls if c[0] == "consume"] == [("consume", [2, 2])]
    # the round's 4 segments (worker, incarnation, env, round), each trained by exactly one rank
    assert sorted(shares[0] + shares[1]) == [(w, 0, e, 0) for w in range(2) for e in range(2)]


@pytest.mark.parametrize("steps, every, expected", [(3, 1, [1, 2]), (4, 2, [2])])
def test_periodic_checkpoints_skip_the_last_version_which_the_run_writes_itself(steps, every, expected):
    cfg = _cfg(f"--steps={steps}", "--learner.batch_segments=1", f"--checkpoint.every={every}")
    roles = FakeRoles(cfg, segments=[Seg() for _ in range(steps)])
    _run(loops.AsyncLoop, cfg, roles)
    assert [c[1] for c in roles.calls if c[0] == "checkpoint"] == expected
