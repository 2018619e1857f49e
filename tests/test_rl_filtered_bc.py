"""Success-filtered self-imitation (rl/filtered_bc.py): only succeeded episodes enter the replay, whole and
stitched across segments (never across a gap), the update pulls the VLA's chunks toward the stored ones
(and does nothing at lr 0), and a resumed learner continues exactly."""

import copy

import numpy as np
import pytest
import torch

from kilovla.rl.core.trajectory import Episode, Segment
from kilovla.rl import checks, checkpoints


@pytest.fixture(scope="module")
def policy_dir(reach_policy):
    """A tiny pi0.5 reading the environment state too (chunks of 4, all 4 executed)."""
    return reach_policy("--steps=2", "--checkpoint.every=2",
                        "--policy.overrides={chunk_size: 4, max_state_dim: 48}",
                        "--policy.state_keys=[observation.state, observation.environment_state]")


def _obs(states, seed=0):
    n = len(states)
    rng = np.random.default_rng(seed)
    return {"observation.images.scene": rng.integers(0, 255, (n, 32, 32, 3), dtype=np.uint8),
            "observation.images.wrist": rng.integers(0, 255, (n, 32, 32, 3), dtype=np.uint8),
            "observation.state": np.repeat(np.asarray(states, np.float32)[:, None], 4, 1),
            "observation.environment_state": np.zeros((n, 39), np.float32),
            "task": ["reach the red goal"] * n}


def _segment(states, next_state, slot=(0, 0, 0), seq=0, ends=(), chain=None, seed=0):
    """Steps at the given (scalar) states; `ends`: {step: success} where an episode ended."""
    t_len = len(states)
    done, cut = np.zeros(t_len, bool), np.zeros(t_len, bool)
    episodes = []
    for t, success in dict(ends).items():
        done[t], cut[t] = True, not success
        episodes.append(Episode("reach-v3", 0, success, 10, 1.0))
    chain = np.zeros((t_len, 2, 4, 32), np.float32) if chain is None else chain
    nxt = {k: v[0] if not isinstance(v, list) else v[0] for k, v in _obs([next_state]).items()}
    return Segment(segment_id=(*slot, seq), ticket=seq, start_version=0, obs=_obs(states, seed), chain=chain,
                   stochastic=np.zeros((t_len, 1), bool), logp=np.zeros(t_len, np.float32), value=np.zeros(t_len, np.float32),
                   reward=np.zeros(t_len, np.float32), done=done, version=np.zeros(t_len, int), next_obs=nxt,
                   truncated=cut, episodes=episodes)


def test_only_succeeded_episodes_enter_the_replay_whole_and_never_across_a_gap():
    from kilovla.rl.filtered_bc import SuccessReplay

    replay = SuccessReplay(100)
    chunks = lambda n, v: np.full((n, 4, 32), v, np.float32)  # noqa: E731
    # slot A: an episode over two segments (the second starts where the first left off) that succeeds
    assert replay.add_segment(_segment([0, 1, 2], 3), chunks(3, 1.0)) == 0
    assert replay.add_segment(_segment([3, 4, 5], 9, seq=1, ends={1: True}), chunks(3, 2.0)) == 5
    np.testing.assert_array_equal(replay.arrays["observation.state"][:5, 0], [0, 1, 2, 3, 4])
    np.testing.assert_array_equal(replay.arrays["chunk"][:5, 0, 0], [1, 1, 1, 2, 2])
    # the step after the success began a new episode, still running
    assert len(replay.pending[(0, 0, 0)]["rows"]) == 1
    # slot B: a time-limit cut (a failure) stores nothing
    assert replay.add_segment(_segment([0, 1], 5, slot=(1, 0, 0), ends={1: False}), chunks(2, 3.0)) == 0
    # slot C: a segment that does not start where the last one ended drops the partial episode
    replay.add_segment(_segment([0, 1], 2, slot=(2, 0, 0)), chunks(2, 4.0))
    assert replay.add_segment(_segment([7, 8], 9, slot=(2, 0, 0), seq=1, ends={1: True}), chunks(2, 5.0)) == 2
    np.testing.assert_array_equal(replay.arrays["observation.state"][5:7, 0], [7, 8])
    assert len(replay) == 7 and replay.episodes == {"succeeded": 2, "failed": 1}
    obs, batch_chunks = replay.batch(np.array([0, 6]))
    assert obs["task"] == ["reach the red goal"] * 2 and obs["observation.images.scene"].shape == (2, 32, 32, 3)
    assert batch_chunks[:, 0, 0].tolist() == [1.0, 5.0]
    # the ring keeps the newest once full
    small = SuccessReplay(3)
    small.add_segment(_segment([0, 1, 2, 3], 4, ends={3: True}), chunks(4, 1.0))
    assert len(small) == 3 and small.added == 4
    assert small.arrays["observation.state"][0, 0] == 3  # step 3 overwrote step 0


def _learner(policy_dir, lr, seed=0, **bc):
    from kilovla.rl.filtered_bc import FilteredBCConfig, FilteredBCLearner
    from kilovla.rl.core.flow import FlowSDE
    from kilovla.rl.policy import load_actor_critic
    from kilovla.train.optim import OptimConfig

    torch.manual_seed(0)
    model = load_actor_critic(policy_dir, FlowSDE(), 4)
    optim = OptimConfig(lr=lr, warmup_steps=0, min_lr_ratio=1.0, weight_decay=0.0)
    cfg = FilteredBCConfig(**{"replay_size": 64, "batch_size": 8, "utd": 8.0, "warmup": 4, **bc})
    return model, FilteredBCLearner(model, cfg, optim, segments_per_step=2, total_steps=100, freeze_vision=False,
                                    freeze_vlm=False, seed=seed)


def _successes(n, target, seed=0, width=8):
    """n one-segment episodes of 4 chunk steps that succeed at the last step, each executing `target`
    (chunks of the tiny model's 4 x 8 padded actions)."""
    chain = np.zeros((4, 2, 4, width), np.float32)
    chain[:, -1, :, :4] = target
    return [_segment([10 * i + k for k in range(4)], 10 * i + 4, slot=(0, 0, i), ends={3: True}, chain=chain, seed=i)
            for i in range(n)]


@pytest.mark.parametrize("lr", [3e-3, 0.0])
def test_the_update_pulls_the_policy_toward_its_successes_and_not_at_lr_0(policy_dir, lr):
    model, learner = _learner(policy_dir, lr)
    target = 0.8
    probe = _segment([0, 1, 2, 3], 4, seed=99).obs

    @torch.no_grad()
    def distance():
        torch.manual_seed(1)
        batch = model.batch(probe)
        field, _ = model.vla.velocity_field(batch)
        chunk = model.vla.integrate(field, torch.randn(4, model.horizon, model.vla.config.max_action_dim))
        return float((chunk[:, :, :4] - target).abs().mean())

    assert model.vla.config.max_action_dim == 8
    before = [p.detach().clone() for p in model.vla.parameters()]
    d0 = distance()
    out = [learner.consume(_successes(2, target, seed)) for seed in range(6)]
    assert all(o is not None for o in out) and out[-1]["version"] == 6
    assert out[-1]["replay"] == 48 and out[-1]["updates"] == 6 * 8 * 8 // 8  # utd 8 rows per step, batches of 8
    assert np.isfinite(out[-1]["flow_loss"]) and out[-1]["grad_norm"] > 0
    grads = [p.grad for p in learner.trainable if p.grad is not None]
    assert grads and max(g.abs().max().item() for g in grads) > 0  # the last update had gradients either way
    moved = max((a - b).abs().max().item() for a, b in zip(model.vla.parameters(), before))
    if lr == 0:
        assert moved == 0 and distance() == pytest.approx(d0)
    else:
        assert distance() < 0.5 * d0, (d0, distance())


def test_a_resumed_learner_continues_exactly(policy_dir):
    model, learner = _learner(policy_dir, 1e-3)
    for seed in range(2):
        learner.consume(_successes(2, 0.5, seed))
    state = copy.deepcopy(learner.state_dict())  # as Ray would hand it over: a copy, not the live tensors
    learner.consume(_successes(2, 0.5, 7))
    expected = {k: v.clone() for k, v in model.vla.state_dict().items()}
    _, again = _learner(policy_dir, 1e-3)
    again.load_state_dict(state)
    again.consume(_successes(2, 0.5, 7))
    for k, v in again.model.vla.state_dict().items():
        torch.testing.assert_close(v, expected[k], rtol=0, atol=0, msg=k)
    assert again.replay.added == learner.replay.added and again.updates == learner.updates


def test_filtered_bc_and_shaping_settings_out_of_range_are_one_line_each():
    from kilovla.errors import KilovlaError
    from kilovla.rl import runner

    for flags, match in ((["--learner.algo.filtered_bc.utd=0"], "filtered_bc.utd = 0.0 is out of range"),
                         (["--learner.algo.filtered_bc.replay_size=10"], "replay_size = 10 is out of range .at least"),
                         (["--learner.algo.filtered_bc.batch_size=0"], "batch_size = 0 is out of range"),
                         (["--learner.algo.optim.lr=nan"], "optim.lr = nan is out of range"),
                         (["--learner.algo.optim.betas=[0.9, 1.5]"], r"optim.betas\[1\] = 1.5 is out of range"),
                         (["--learner.algo.optim.min_lr_ratio=-1"], "min_lr_ratio = -1.0 is out of range"),
                         (["--learner.ranks=2"], "filtered_bc samples one replay buffer on one learner"),
                         (["--env.shaping=potential"], "env.shaping must be reward or progress")):
        cfg = runner.load(None, ["--learner.algo.name=filtered_bc", "--learner.batch_segments=32", *flags])
        with pytest.raises(KilovlaError, match=match):
            checks.check_config(cfg)
    with pytest.raises(KilovlaError, match="learner.algo.name must be one of ppo, residual_sac, filtered_bc"):
        checks.check_config(runner.load(None, ["--learner.algo.name=dsrl"]))


def test_waiting_episodes_and_the_replay_survive_the_checkpoint_files_and_resume_is_checked_before_ray(tmp_path):
    """A checkpoint taken mid-episode: the waiting rows go through learner.pt (weights-only) and finish after
    resume; resuming with another algorithm or replay size is refused in one line, before Ray."""
    from kilovla.errors import KilovlaError
    from kilovla.policy_folder import write_rl_policy_files
    from kilovla.rl import runner
    from kilovla.rl.filtered_bc import SuccessReplay

    chunks = np.ones((3, 4, 32), np.float32)
    replay = SuccessReplay(50)
    replay.add_segment(_segment([0, 1, 2], 3, ends={1: True}), chunks)  # one success, then a new episode begins
    replay.add_segment(_segment([7, 8, 9], 10, slot=(1, 0, 0)), chunks)  # another env's, still running
    arrays, rest = replay.state_dict()
    state = {"model": {"vla.w": torch.zeros(2)}, "replay": arrays, "replay_rest": rest, "algorithm": "filtered_bc"}
    write_rl_policy_files(tmp_path, state, {"preset": "pi05-tiny"})
    loaded = checkpoints.read_learner_state(tmp_path)
    again = SuccessReplay(50)
    again.load_state_dict(loaded["replay"], loaded["replay_rest"])
    assert len(again) == 2 and set(again.pending) == {(0, 0, 0), (1, 0, 0)}
    assert again.add_segment(_segment([10, 11], 12, slot=(1, 0, 0), seq=1, ends={1: True}), chunks[:2]) == 5
    np.testing.assert_array_equal(again.arrays["observation.state"][2:7, 0], [7, 8, 9, 10, 11])
    # a replaced worker (incarnation 1) never continues incarnation 0's episode
    assert again.add_segment(_segment([2, 3], 4, slot=(0, 1, 0), ends={1: True}), chunks[:2]) == 2
    assert (0, 0, 0) not in again.pending

    def check(*flags):
        checks.check_resume_fits(runner.load(None, list(flags)), tmp_path, loaded)

    check("--learner.algo.name=filtered_bc", "--learner.algo.filtered_bc.replay_size=50")
    with pytest.raises(KilovlaError, match="written by learner.algo.name=filtered_bc; resume it with that"):
        check("--learner.algo.name=ppo")
    with pytest.raises(KilovlaError, match="holds up to 50 entries; resume with --learner.algo.filtered_bc.replay_size=50"):
        check("--learner.algo.name=filtered_bc", "--learner.algo.filtered_bc.replay_size=60")
