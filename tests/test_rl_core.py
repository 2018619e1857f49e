"""RL-VLA3's core without Ray: batcher (fake clock), staleness gate, streaming step, losses, flow log-probs."""

import copy
import dataclasses

import numpy as np
import pytest
import torch

from kilovla.errors import KilovlaError
from kilovla.batching import DynamicBatcher
from kilovla.rl.core.flow import FlowSDE, chain_log_prob, sample_chain
from kilovla.rl.core.losses import (decoupled_ppo_loss, gae, group_advantages, ppo_loss, sac_actor_loss, sac_critic_loss,
                                    sac_td_target, sac_temperature_loss)
from kilovla.rl.core.staleness import StalenessGate
from kilovla.rl.core.streaming import StreamingStep


# -- DynamicBatcher ------------------------------------------------------------------------------------
def test_batcher_flushes_at_max_batch_size_or_when_the_oldest_request_has_waited_max_wait():
    b = DynamicBatcher(max_batch_size=3, max_wait=0.010)
    b.put("a", now=0.000)
    assert not b.ready(0.009) and b.deadline() == pytest.approx(0.010)
    b.put("b", now=0.004)
    assert b.ready(0.010) and b.take(0.010) == ["a", "b"]  # deadline of the first arrival
    for i, t in enumerate((0.020, 0.021, 0.022, 0.023)):
        b.put(i, now=t)
    assert b.ready(0.022)  # full before any deadline
    assert b.take(0.022) == [0, 1, 2]  # never more than max_batch_size, oldest first
    assert not b.ready(0.025) and b.deadline() == pytest.approx(0.033)  # the leftover keeps its own arrival time
    assert b.stats.batch_sizes == {2: 1, 3: 1}
    assert b.stats.waits[:2] == pytest.approx([0.010, 0.006])


def test_batcher_clock_starts_at_the_first_arrival_after_an_idle_gap():
    """RL-VLA3 starts the wait before the first get(): after a long idle gap the first arrival goes
    alone. Here the wait starts at the arrival, so requests arriving just after it share its batch."""
    b = DynamicBatcher(max_batch_size=8, max_wait=0.010)
    assert not b.ready(100.0) and b.deadline() is None
    b.put("first", now=100.0)
    b.put("second", now=100.002)
    assert not b.ready(100.005)
    assert b.take(100.010) == ["first", "second"]


def test_batcher_drains_the_backlog_greedily_when_the_model_frees_up():
    b = DynamicBatcher(max_batch_size=16, max_wait=0.0)
    b.put("x", now=0.0)
    assert b.take(0.0) == ["x"]  # continuous batching: run at once
    for i in range(5):  # queued while the model ran for 30 ms
        b.put(i, now=0.001 + 0.005 * i)
    assert b.ready(0.030) and b.take(0.030) == [0, 1, 2, 3, 4]


def test_batcher_rejects_nonsense():
    with pytest.raises(KilovlaError):
        DynamicBatcher(0, 0.01)


# -- StalenessGate -------------------------------------------------------------------------------------
def test_gate_admits_what_the_next_versions_can_consume():
    gate = StalenessGate(max_staleness=1, batch_segments=4)
    tickets = [gate.try_admit(0) for _ in range(10)]
    assert tickets == [0, 1, 2, 3, 4, 5, 6, 7, None, None]  # (eta + v + 1) * B = 8 at version 0
    assert [gate.batch_of(t) for t in tickets[:8]] == [0] * 4 + [1] * 4
    gate.finish(0)
    assert gate.try_admit(0) is None  # finished but not consumed still counts
    gate.drop(5)  # a lost segment gives its ticket back: batch 1 still gets 4 segments
    assert gate.try_admit(0) == 5 and gate.dropped == 1
    assert gate.capacity(1) == 4  # version 1 makes room for one more batch


@pytest.mark.parametrize("eta", [0, 1, 2])
def test_no_consumed_sample_is_staler_than_max_staleness_under_random_schedules(eta):
    """Envs start and finish segments at random (stragglers and crashes included); the learner consumes
    the finished segments of its current batch in completion order and steps after B of them.
    Every consumed step's lag stays <= eta, and nothing deadlocks."""
    rng = np.random.default_rng(eta)
    batch, envs = 4, 6
    gate = StalenessGate(eta, batch)
    version, consumed_in_batch = 0, 0
    running: dict[int, dict] = {}  # env -> {"ticket": t, "versions": [...], "left": steps}
    finished: list[dict] = []
    for _ in range(6000):
        event = rng.random()
        if event < 0.4:  # an idle env tries to start a segment
            free = [e for e in range(envs) if e not in running]
            if free and (ticket := gate.try_admit(version)) is not None:
                running[int(rng.choice(free))] = {"ticket": ticket, "versions": [], "left": int(rng.integers(1, 6))}
        elif event < 0.85 and running:  # a running env takes a step; env 0 is slow
            e = int(rng.choice(list(running)))
            if e == 0 and rng.random() < 0.8:
                continue
            seg = running[e]
            seg["versions"].append(version)
            seg["left"] -= 1
            if seg["left"] == 0:
                gate.finish(seg["ticket"])
                finished.append(running.pop(e))
        elif event < 0.87 and running:  # an env crashes: its segment is dropped
            gate.drop(running.pop(int(rng.choice(list(running))))["ticket"])
        else:  # the learner consumes a finished segment of its current batch, if one has arrived
            ready = [s for s in finished if gate.batch_of(s["ticket"]) == version]
            if ready:
                finished.remove(ready[0])
                gate.consumed(version, ready[0]["versions"])  # raises if a lag exceeded eta
                consumed_in_batch += 1
                if consumed_in_batch == batch:
                    version, consumed_in_batch = version + 1, 0
    assert version > 20 and gate.dropped > 10
    assert max(gate.lags) <= eta and sum(gate.lags.values()) > 100
    if eta:
        assert max(gate.lags) >= 1  # rollouts did run ahead


def test_the_gate_refuses_a_sample_that_arrives_too_stale():
    gate = StalenessGate(max_staleness=0, batch_segments=2)
    with pytest.raises(KilovlaError, match="staleness 1 > max_staleness 0"):
        gate.consumed(3, [2])


# -- StreamingStep -------------------------------------------------------------------------------------
def _regression(seed=0):
    g = torch.Generator().manual_seed(seed)
    model = torch.nn.Linear(5, 1).double()
    x, y = torch.randn(24, 5, generator=g, dtype=torch.float64), torch.randn(24, generator=g, dtype=torch.float64)
    return model, x, y


def test_streamed_micro_batches_give_the_full_batch_gradient_and_one_step():
    model, x, y = _regression()
    full = copy.deepcopy(model)
    ((full(x)[:, 0] - y) ** 2).mean().backward()
    expected = [p.grad.clone() for p in full.parameters()]

    params = list(model.parameters())
    seen_grads = []

    class Recorder(torch.optim.SGD):
        def step(self, closure=None):
            seen_grads.append([p.grad.clone() for p in params])
            return super().step(closure)

    opt = Recorder(params, lr=0.1)
    stream = StreamingStep(opt, global_batch=24, params=params)
    order = np.random.default_rng(1).permutation(24)
    outs = []
    for rows in np.split(order, [3, 4, 11, 20]):  # uneven micro-batches, arbitrary arrival order
        loss_sum = ((model(x[rows])[:, 0] - y[rows]) ** 2).sum()
        outs.append(stream.backward(loss_sum, len(rows)))
    assert outs[:-1] == [None] * 4 and outs[-1] is not None  # the optimizer stepped exactly once, at the end
    assert len(seen_grads) == 1 and stream.steps == 1
    for got, want in zip(seen_grads[0], expected):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_a_micro_batch_that_overruns_the_global_batch_is_refused():
    model, x, y = _regression()
    stream = StreamingStep(torch.optim.SGD(model.parameters(), lr=0.1), global_batch=4, params=list(model.parameters()))
    with pytest.raises(KilovlaError, match="overruns the global batch"):
        stream.completes(5)


# -- losses --------------------------------------------------------------------------------------------
def test_ppo_loss_by_hand():
    logp, old, adv = torch.tensor([0.0, 0.5, -0.5]), torch.zeros(3), torch.tensor([1.0, 1.0, -1.0])
    loss, stats = ppo_loss(logp, old, adv, clip=0.2)
    r = np.exp([0.0, 0.5, -0.5])  # 1, 1.6487, 0.6065
    expected = [-min(r[0], 1.0), -min(r[1], 1.2), -min(-r[2], -0.8)]
    torch.testing.assert_close(loss, torch.tensor(expected, dtype=torch.float32))
    assert stats["clip_fraction"] == pytest.approx(2 / 3)


def test_decoupled_ppo_equals_ppo_when_nothing_is_stale():
    g = torch.Generator().manual_seed(0)
    theta = torch.randn(6, generator=g, requires_grad=True)
    behav, adv = torch.randn(6, generator=g), torch.randn(6, generator=g)
    logp = theta * 0.3 + behav  # current policy, a little away from the behaviour policy
    a, _ = ppo_loss(logp, behav, adv)
    b, stats = decoupled_ppo_loss(logp, behav.clone(), behav, adv)  # proximal = behaviour
    torch.testing.assert_close(a, b)
    ga, = torch.autograd.grad(a.sum(), theta, retain_graph=True)
    gb, = torch.autograd.grad(b.sum(), theta)
    torch.testing.assert_close(ga, gb)
    assert stats["behav_weight_mean"] == pytest.approx(1.0)


def test_decoupled_ppo_weights_stale_samples_and_masks_far_ones():
    logp = torch.zeros(3, requires_grad=True)
    prox = torch.zeros(3)
    behav = torch.log(torch.tensor([0.8, 2.0, 0.25]))  # weights exp(prox - behav) = 1.25, 0.5, 4.0
    loss, stats = decoupled_ppo_loss(logp, prox, behav, torch.ones(3), behav_cap=2.0)
    torch.testing.assert_close(loss, torch.tensor([-1.25, -0.5, 0.0]))
    assert stats["behav_masked_fraction"] == pytest.approx(1 / 3)


def test_gae_by_hand():
    rewards, values = torch.tensor([1.0, 0.0, 2.0]), torch.tensor([0.5, 0.4, 0.3])
    dones = torch.tensor([False, True, False])  # the episode ends after step 1; step 2 starts a new one
    adv, ret = gae(rewards, values, dones, torch.tensor(0.7), gamma=0.9, lam=0.8)
    d2 = 2.0 + 0.9 * 0.7 - 0.3
    d1 = 0.0 - 0.4  # no bootstrap across the episode's end
    d0 = 1.0 + 0.9 * 0.4 - 0.5
    expected = torch.tensor([d0 + 0.9 * 0.8 * d1, d1, d2])
    torch.testing.assert_close(adv, expected)
    torch.testing.assert_close(ret, expected + values)


def test_group_advantages_by_hand():
    returns = torch.tensor([1.0, 3.0, 2.0, 2.0, 5.0])
    groups = torch.tensor([0, 0, 1, 1, 2])
    adv = group_advantages(returns, groups)
    torch.testing.assert_close(adv[:2], torch.tensor([-1.0, 1.0]), atol=1e-5, rtol=0)  # mean 2, std 1
    torch.testing.assert_close(adv[2:], torch.zeros(3))  # no spread, or a group of one: no signal


# -- flow log-probabilities ----------------------------------------------------------------------------
def test_sac_td_target_by_hand():
    reward, terminal = torch.tensor([1.0, 0.5]), torch.tensor([0.0, 1.0])
    q1, q2 = torch.tensor([2.0, 5.0]), torch.tensor([3.0, 4.0])
    # y = r + gamma (1 - terminal) min(Q1', Q2'): [1 + 0.5 x 2, 0.5 + 0]
    torch.testing.assert_close(sac_td_target(reward, terminal, q1, q2, 0.5), torch.tensor([2.0, 0.5]))
    # with the entropy in the backup: min - alpha logp' = [2 - 0.1 x -1, 4 - 0.1 x 2] = [2.1, 3.8]
    y = sac_td_target(reward, terminal, q1, q2, 0.5, next_logp=torch.tensor([-1.0, 2.0]), alpha=0.1)
    torch.testing.assert_close(y, torch.tensor([1.0 + 0.5 * 2.1, 0.5]))


def test_sac_critic_loss_by_hand():
    q1 = torch.tensor([1.0, 2.0], requires_grad=True)
    q2 = torch.tensor([0.0, 4.0], requires_grad=True)
    loss, stats = sac_critic_loss(q1, q2, torch.tensor([1.0, 3.0]))
    # 0.5 mean([0 + 1, 1 + 1]) = 0.75
    assert loss.item() == pytest.approx(0.75)
    assert stats == pytest.approx({"critic_loss": 0.75, "q": 1.5, "target": 2.0})
    loss.backward()  # d/dQ1 = (Q1 - y) / B, d/dQ2 = (Q2 - y) / B
    torch.testing.assert_close(q1.grad, torch.tensor([0.0, -0.5]))
    torch.testing.assert_close(q2.grad, torch.tensor([-0.5, 0.5]))


def test_sac_actor_loss_by_hand():
    logp = torch.tensor([-1.0, 1.0], requires_grad=True)
    q1, q2 = torch.tensor([2.0, 0.0]), torch.tensor([1.0, 3.0])
    mean = torch.tensor([[0.5], [-1.0]])
    loss, stats = sac_actor_loss(logp, q1, q2, 0.5, mean, penalty=0.2)
    # mean(0.5 logp - min(Q1, Q2)) = mean([-0.5 - 1, 0.5 - 0]) = -0.5; penalty 0.2 x mean([0.25, 1]) = 0.125
    assert loss.item() == pytest.approx(-0.375)
    assert stats == pytest.approx({"actor_loss": -0.375, "entropy": 0.0})
    loss.backward()
    torch.testing.assert_close(logp.grad, torch.tensor([0.25, 0.25]))  # alpha / B


def test_sac_temperature_loss_by_hand_shrinks_alpha_above_the_target_entropy():
    log_alpha = torch.tensor(2.0, requires_grad=True)
    logp = torch.tensor([-1.0, 1.0], requires_grad=True)
    loss = sac_temperature_loss(log_alpha, logp, target_entropy=-0.5)
    # -(2 x mean([-1.5, 0.5])) = 1.0
    assert loss.item() == pytest.approx(1.0)
    loss.backward()
    # entropy -mean(logp) = 0 is above its target -0.5: a positive gradient, so descent lowers alpha
    assert log_alpha.grad.item() == pytest.approx(0.5)
    assert logp.grad is None  # the actor is not trained through the temperature's loss


def test_flow_sde_noise_follows_pirl():
    sde = FlowSDE(steps=4, noise_level=0.5)
    x, v = torch.zeros(4, 1, 1), torch.zeros(4, 1, 1)
    _, std = sde.transition(x, v, torch.arange(4))
    torch.testing.assert_close(std.flatten(), torch.tensor([0.5, 0.4330, 0.25, 0.1443]), atol=1e-4, rtol=0)


def _policy_model(name):
    from kilovla.models.presets import build_model

    model = build_model(name, seed=0)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    return model.eval()


def _obs_batch(cfg, seed=0, n=3):
    from kilovla.models.batch import PaddedBatch
    from kilovla.models.tokenize import ByteTokenizer, tokenize_batch

    g = torch.Generator().manual_seed(seed)
    prompts = ["pick the cube", "open the drawer", "push"]
    tokens, mask = tokenize_batch(ByteTokenizer(), [prompts[i % 3] for i in range(n)], cfg.max_language_tokens)
    s = cfg.vision.image_size
    masks = torch.ones(n, len(cfg.cameras), dtype=torch.bool)
    masks[:, -1] = False
    return PaddedBatch(images=torch.rand(n, len(cfg.cameras), 3, s, s, generator=g), image_masks=masks,
                       camera_names=cfg.cameras, tokens=tokens, token_mask=mask,
                       state=torch.randn(n, cfg.max_state_dim, generator=g))


def _actor_critic(name):
    """`_policy_model(name)` as an ActorCritic for a 4-D state and action, 5 actions executed per chunk."""
    from kilovla.models.processor import PolicyMeta
    from kilovla.rl.policy import ActorCritic

    stats = {k: {"q01": [-1.0] * 4, "q99": [1.0] * 4} for k in ("observation.state", "action")}
    return ActorCritic(_policy_model(name), PolicyMeta(preset=name, state_dim=4, action_dim=4, stats=stats), FlowSDE(),
                       n_action_steps=5)


@pytest.mark.parametrize("stochastic", ["one", "all"])
@pytest.mark.parametrize("name", ["pi05-tiny", "pi0-tiny", "groot-tiny", "smolvla-tiny", "groot-n17-tiny"])
def test_a_stored_chain_is_rescored_exactly_and_the_ratio_moves_with_the_weights(name, stochastic):
    model = _policy_model(name)
    batch = _obs_batch(model.config)
    cfg = model.config
    horizon = getattr(cfg, "chunk_size", None) or cfg.action_horizon
    mask = torch.zeros(horizon, cfg.max_action_dim)
    mask[:5, :4] = 1  # executed: 5 actions of a 4-D env
    sde = FlowSDE(steps=4, noise_level=0.5, stochastic=stochastic)
    g = torch.Generator().manual_seed(3)
    field, _ = model.velocity_field(batch)
    chain, steps, logp = sample_chain(field, torch.randn(3, horizon, cfg.max_action_dim, generator=g), sde, mask, g)
    assert chain.shape == (3, 5, horizon, cfg.max_action_dim)
    assert steps.sum(1).tolist() == ([1, 1, 1] if stochastic == "one" else [4, 4, 4])
    field, _ = model.velocity_field(batch)
    rescored = chain_log_prob(field, chain, steps, sde, mask)
    torch.testing.assert_close(rescored, logp, atol=1e-4, rtol=1e-5)  # same weights: ratio exactly 1
    with torch.no_grad():  # other weights: another density for the same chain
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))
    field, _ = model.velocity_field(batch)
    assert (chain_log_prob(field, chain, steps, sde, mask) - logp).abs().max() > 1e-2
    rescored_grad = chain_log_prob(*[model.velocity_field(batch)[0]], chain, steps, sde, mask)
    rescored_grad.sum().backward()
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in model.parameters())


def test_stochastic_steps_have_the_stated_spread():
    """The empirical spread of a stochastic transition matches its std (for a zero velocity field)."""
    sde = FlowSDE(steps=4, noise_level=0.5, stochastic="all")
    field = lambda x, t: torch.zeros_like(x)  # noqa: E731
    chain, _, _ = sample_chain(field, torch.zeros(4000, 1, 1), sde, torch.ones(1, 1), torch.Generator().manual_seed(0))
    assert chain[:, 1].std().item() == pytest.approx(0.5, rel=0.05)  # the first step, from t = 1


def test_deterministic_sampling_stays_the_default_outside_rl():
    model = _policy_model("pi05-tiny")
    batch = _obs_batch(model.config)
    noise = torch.randn(3, model.config.chunk_size, model.config.max_action_dim)
    torch.testing.assert_close(model.sample_actions(batch, noise=noise), model.sample_actions(batch, noise=noise))
    field, _ = model.velocity_field(batch)
    x = noise
    for k in range(model.config.num_inference_steps):  # plain Euler with the same field
        x = x - field(x, torch.full((3,), 1.0 - k / model.config.num_inference_steps)) / model.config.num_inference_steps
    torch.testing.assert_close(model.sample_actions(batch, noise=noise), x)


@pytest.mark.parametrize("name", ["groot-tiny", "groot-n17-tiny"])
def test_groot_sampling_through_the_field_equals_its_own_convention(name):
    """GR00T integrates from t = 0 (noise) to 1; the field turns that into openpi's convention."""
    model = _policy_model(name)
    batch = _obs_batch(model.config)
    cfg = model.config
    noise = torch.randn(3, cfg.action_horizon, cfg.max_action_dim)
    vl = model.encode(batch)
    emb = model._embodiment(batch)
    x, dt = noise, 1.0 / cfg.num_inference_steps
    for k in range(cfg.num_inference_steps):
        x = x + dt * model.velocity(vl, batch.state, x, torch.full((3,), k * dt), emb)
    torch.testing.assert_close(model.sample_actions(batch, noise=noise), x)


def test_flow_sde_config_is_checked():
    with pytest.raises(KilovlaError):
        FlowSDE(steps=0)
    with pytest.raises(KilovlaError):
        dataclasses.replace(FlowSDE(), stochastic="some")


# -- rewards -------------------------------------------------------------------------------------------
def test_at_the_plain_shapings_documented_scale_any_successful_episode_outscores_any_near_miss():
    """env.shaping=reward at the scale its comment gives (the default, progress shaping, pays no hovering at
    all: tests/test_rl_workers.py)."""
    from kilovla.rl.core.trajectory import step_reward
    from kilovla.rl.config import EnvSection
    from kilovla.envs.base import env_type

    METAWORLD_MAX_REWARD = env_type("metaworld").max_reward  # noqa: N806

    env = EnvSection(shaping="reward", reward_scale=2e-4)
    reward = lambda r, s: step_reward(r, s, env.reward_scale, env.success_bonus)  # noqa: E731
    # the best failure: the largest shaped reward on every step of a full-length episode, never a success
    best_miss = sum(reward(METAWORLD_MAX_REWARD, False) for _ in range(env.max_steps))
    # the worst success: nothing but zero shaped reward, then success on the first step (the episode terminates)
    worst_success = reward(0.0, True)
    assert worst_success > best_miss
    assert best_miss == pytest.approx(env.max_steps * METAWORLD_MAX_REWARD * env.reward_scale)


# -- truncation ----------------------------------------------------------------------------------------
def test_gae_bootstraps_through_a_truncation_but_not_a_termination():
    rewards, values = torch.tensor([1.0, 0.0, 2.0]), torch.tensor([0.5, 0.4, 0.3])
    dones = torch.tensor([False, True, False])
    truncated = torch.tensor([False, True, False])  # step 1 hit max_steps: its return goes on
    cut_values = torch.tensor([0.0, 0.6, 0.0])
    adv, ret = gae(rewards, values, dones, torch.tensor(0.7), gamma=0.9, lam=0.8, truncated=truncated,
                   truncation_values=cut_values)
    d2 = 2.0 + 0.9 * 0.7 - 0.3
    d1 = 0.0 + 0.9 * 0.6 - 0.4  # bootstrapped with the truncation's value, not the next episode's
    d0 = 1.0 + 0.9 * 0.4 - 0.5
    expected = torch.tensor([d0 + 0.9 * 0.8 * d1, d1, d2])  # and no advantage flows back across the cut
    torch.testing.assert_close(adv, expected)
    torch.testing.assert_close(ret, expected + values)


# -- the learner: advantage scale independent of how a global batch arrives -------------------------------
class _TinyActorCritic(torch.nn.Module):
    """What `Learner` needs of an `ActorCritic`: a Gaussian policy over a 2-D action, a value head."""

    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.vla = torch.nn.Linear(3, 2)
        self.value_head = torch.nn.Linear(3, 1)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)

    def value(self, obs):
        with torch.no_grad():
            return self.value_head(torch.as_tensor(obs["x"], dtype=torch.float32))[:, 0].numpy()

    def forward(self, obs, chain, stochastic, reference=None, objective="logp", seeds=None):
        x = torch.as_tensor(obs["x"], dtype=torch.float32)
        mean = self.vla(x)
        error = ((chain[:, -1, 0] - mean) ** 2).sum(-1)  # "flow": the regression error on the executed action
        kl = None if reference is None else 0.5 * ((mean - reference(x).detach()) ** 2).sum(-1)
        return error if objective == "flow" else -0.5 * error, self.value_head(x)[:, 0], kl


def _segments(n, t_len, seed=0):
    from kilovla.rl.core.trajectory import Segment

    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        done = np.zeros(t_len, bool)
        done[t_len // 2] = i % 2 == 0
        out.append(Segment(segment_id=(0, 0, i, 0), ticket=i, start_version=0,
                           obs={"x": rng.normal(size=(t_len, 3)).astype(np.float32)},
                           chain=rng.normal(size=(t_len, 2, 1, 2)).astype(np.float32),
                           stochastic=np.ones((t_len, 1), bool), logp=rng.normal(size=t_len).astype(np.float32) - 2,
                           value=rng.normal(size=t_len).astype(np.float32),
                           reward=(rng.random(t_len) + 0.5).astype(np.float32),  # all good: advantages mostly > 0
                           done=done, truncated=np.zeros(t_len, bool), version=np.zeros(t_len, int),
                           next_obs={"x": rng.normal(size=3).astype(np.float32)}))
    return out


def _learner_after(calls, steps=2):
    from kilovla.rl.config import AlgoConfig
    from kilovla.rl.ppo import Learner

    model = _TinyActorCritic()
    cfg = AlgoConfig(freeze_vision=False, freeze_vlm=False, micro_batch=3)
    cfg.optim.clip_grad_norm = 0.0
    learner = Learner(model, cfg, segments_per_step=4, segment_steps=5, total_steps=10)
    grads = []
    params = list(model.parameters())
    step = learner.optimizer.step

    def recording_step(*a, **k):
        grads.append([p.grad.clone() for p in params])
        return step(*a, **k)

    learner.optimizer.step = recording_step
    results = []
    for batch in range(steps):
        for segments in calls(_segments(4, 5, seed=batch)):
            results.append(learner.consume(segments))
    return model, grads, [r for r in results if r is not None]


@pytest.mark.filterwarnings(r"ignore:Seems like `optimizer.step\(\)` has been overridden")
def test_a_global_batch_trains_the_same_in_one_call_or_segment_by_segment():
    whole, grads_whole, out_whole = _learner_after(lambda segs: [segs])
    single, grads_single, out_single = _learner_after(lambda segs: [[s] for s in segs])
    assert len(grads_whole) == len(grads_single) == 2  # the second batch uses the scale learned from the first
    for a, b in zip(grads_whole, grads_single):
        for ga, gb in zip(a, b):
            torch.testing.assert_close(ga, gb, rtol=1e-5, atol=1e-6)
    for pa, pb in zip(whole.parameters(), single.parameters()):
        torch.testing.assert_close(pa, pb, rtol=1e-5, atol=1e-6)
    assert out_whole[0]["advantage_scale"] == pytest.approx(out_single[0]["advantage_scale"])
    assert out_whole[0]["advantage_scale"] != 1.0


def test_a_kl_penalty_pulls_the_policy_back_to_where_the_run_began():
    """kl_coef > 0: the learner's gradient includes the KL to the frozen start policy; 0: it does not."""
    from kilovla.rl.config import AlgoConfig
    from kilovla.rl.ppo import Learner

    def distance_after(kl_coef):
        model = _TinyActorCritic()
        reference = copy.deepcopy(model.vla).requires_grad_(False)
        with torch.no_grad():
            model.vla.bias.add_(1.0)  # where noisy updates took it
        cfg = AlgoConfig(freeze_vision=False, freeze_vlm=False, micro_batch=4, kl_coef=kl_coef)
        cfg.optim.lr = 0.05
        learner = Learner(model, cfg, segments_per_step=4, segment_steps=5, total_steps=10,
                          reference=reference if kl_coef else None)
        segments = _segments(4, 5)
        for seg in segments:  # no advantage anywhere: only the KL can move the policy
            seg.reward[:], seg.value[:], seg.done[:] = 0.0, 0.0, True
        out = [learner.consume([seg]) for seg in segments][-1]
        assert ("kl_to_start" in out) == bool(kl_coef)
        return (model.vla.bias - reference.bias).abs().sum().item()

    assert distance_after(0.0) == pytest.approx(2.0)  # the policy stays where it was
    assert distance_after(1.0) < 2.0 - 0.05


@pytest.mark.parametrize("stochastic", ["one", "all"])
def test_the_chain_kl_is_zero_at_the_reference_and_the_gaussians_kl_elsewhere(stochastic):
    model = _policy_model("pi0-tiny")
    reference = copy.deepcopy(model)
    batch = _obs_batch(model.config)
    cfg = model.config
    mask = torch.zeros(cfg.chunk_size, cfg.max_action_dim)
    mask[:5, :4] = 1
    sde = FlowSDE(steps=4, noise_level=0.5, stochastic=stochastic)
    g = torch.Generator().manual_seed(3)
    field, _ = model.velocity_field(batch)
    chain, steps, _ = sample_chain(field, torch.randn(3, cfg.chunk_size, cfg.max_action_dim, generator=g), sde, mask, g)
    ref_field, _ = reference.velocity_field(batch)
    logp, kl = chain_log_prob(field, chain, steps, sde, mask, reference=ref_field)
    torch.testing.assert_close(logp, chain_log_prob(field, chain, steps, sde, mask))
    assert kl.abs().max() < 1e-6
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))
    field, _ = model.velocity_field(batch)
    _, kl = chain_log_prob(field, chain, steps, sde, mask, reference=ref_field)
    expected = torch.zeros(3)  # by hand: KL of two Gaussians with one std, per stochastic transition
    for k in range(sde.steps):
        kk = torch.full((3,), k)
        mean, std = sde.transition(chain[:, k], field(chain[:, k], sde.time(kk.float())), kk)
        ref_mean, _ = sde.transition(chain[:, k], ref_field(chain[:, k], sde.time(kk.float())), kk)
        per = (((mean - ref_mean) / std) ** 2 * mask).flatten(1).sum(1) / 2
        expected += torch.where(steps[:, k], per, torch.zeros(3)) / steps.sum(1)
    torch.testing.assert_close(kl, expected, rtol=1e-4, atol=1e-5)
    assert kl.min() > 1e-3


@pytest.mark.parametrize("temperature", [1.0, 0.5])
def test_advantage_weighted_regression_moves_the_policy_toward_the_better_action(temperature):
    """policy_loss "awr": from one observation the policy tried two actions; the one that paid more than
    expected pulls harder, so the policy ends nearer it (with equal weights it would end between them)."""
    from kilovla.rl.config import AlgoConfig
    from kilovla.rl.ppo import Learner

    model = _TinyActorCritic()
    cfg = AlgoConfig(freeze_vision=False, freeze_vlm=False, micro_batch=4, policy_loss="awr", awr_temperature=temperature,
                     normalize_advantages=False, value_lr=0.0)
    cfg.optim.lr = 0.05
    learner = Learner(model, cfg, segments_per_step=2, segment_steps=4, total_steps=200)
    good, bad = np.array([1.0, -1.0], np.float32), np.array([-1.0, 1.0], np.float32)
    segments = _segments(2, 4)
    for seg, action, reward in zip(segments, (good, bad), (1.0, -1.0)):
        seg.obs["x"][:] = np.array([0.5, -0.2, 0.3], np.float32)
        seg.chain[:, -1, 0] = action
        seg.reward[:], seg.value[:], seg.done[:] = reward, 0.0, True  # advantage = reward
    for _ in range(150):
        out = learner.consume(segments)
    assert out["awr_weight_max"] == pytest.approx(np.exp(1.0 / temperature), rel=1e-5)  # over both micro-batches
    mean = model.vla(torch.tensor([[0.5, -0.2, 0.3]]))[0].detach().numpy()
    weights = np.exp(np.array([1.0, -1.0]) / temperature)  # the weighted least-squares optimum
    np.testing.assert_allclose(mean, (weights[0] * good + weights[1] * bad) / weights.sum(), atol=0.05)


def test_awr_loss_by_hand():
    from kilovla.rl.core.losses import awr_loss

    error = torch.tensor([1.0, 2.0, 3.0], requires_grad=True)
    advantages = torch.tensor([0.0, 2.0, 10.0], requires_grad=True)
    loss, stats = awr_loss(error, advantages, temperature=2.0, max_weight=20.0)
    torch.testing.assert_close(loss, torch.tensor([1.0, 2.0 * np.e, 60.0]))
    loss.sum().backward()
    torch.testing.assert_close(error.grad, torch.tensor([1.0, np.e, 20.0]))
    assert advantages.grad is None  # the weights carry no gradient
    assert stats["awr_weight_max"] == 20.0


@pytest.mark.parametrize("name", ["pi05-tiny", "pi0-tiny", "groot-tiny", "smolvla-tiny", "groot-n17-tiny"])
def test_the_flow_matching_error_is_the_supervised_loss(name):
    """flow_matching_error through the velocity field equals the model's own training loss on the same
    chunk, t and noise (GR00T: its time runs the other way), and is 0 for a field that knows the chunk."""
    from kilovla.rl.core.flow import flow_draws, flow_matching_error

    model = _policy_model(name)
    batch = _obs_batch(model.config)
    cfg = model.config
    horizon = getattr(cfg, "chunk_size", None) or cfg.action_horizon
    actions = torch.randn(3, horizon, cfg.max_action_dim, generator=torch.Generator().manual_seed(5))
    mask = torch.zeros(horizon, cfg.max_action_dim)
    mask[:, :4] = 1
    field, _ = model.velocity_field(batch)
    t, noise = flow_draws(torch.tensor([11, 12, 13]), actions.shape[1:])
    error = flow_matching_error(field, actions, mask, t, noise)
    time = 1.0 - t if name.startswith("groot") else t
    supervised = dataclasses.replace(batch, actions=actions, action_dim_mask=mask[0].bool())
    torch.testing.assert_close(error, model(supervised, noise=noise, time=time)["per_sample"], rtol=1e-4, atol=1e-5)
    knows = lambda x, t: (x - actions) / t[:, None, None]  # noqa: E731  the exact velocity toward `actions`
    assert flow_matching_error(knows, actions, mask, t, noise).abs().max() < 1e-4
    wrong = actions.clone()
    wrong[..., 4:] += 1.0  # only unexecuted dims differ: no error
    assert flow_matching_error(lambda x, t: (x - wrong) / t[:, None, None], actions, mask, t, noise).abs().max() < 1e-4


def test_flow_draws_follow_openpis_time_and_depend_on_the_seed_alone():
    from kilovla.rl.core.flow import flow_draws

    t, noise = flow_draws(torch.arange(4000), (2, 3))
    assert float(t.min()) >= 0.001 and float(t.max()) <= 1.0
    assert float(t.mean()) == pytest.approx(0.6 * 0.999 + 0.001, abs=0.01)  # Beta(1.5, 1) has mean 0.6
    assert float(noise.std()) == pytest.approx(1.0, abs=0.02)
    t2, noise2 = flow_draws(torch.tensor([7, 3]), (2, 3))
    torch.testing.assert_close(t2, t[[7, 3]])
    torch.testing.assert_close(noise2, noise[[7, 3]])


def _awr_critic(n):
    """A real pi0-tiny actor-critic whose observations are row numbers into n random model inputs."""
    critic = _actor_critic("pi0-tiny")
    inputs = _obs_batch(critic.vla.config, n=n)

    def rows(obs):
        index = torch.as_tensor(np.asarray(obs["row"]))
        return dataclasses.replace(inputs, **{k: getattr(inputs, k)[index] for k in
                                             ("images", "image_masks", "tokens", "token_mask", "state")})

    critic.batch = rows
    return critic


def test_awr_through_the_actor_critic_scores_the_executed_chunk_and_keeps_the_kl():
    from kilovla.rl.core.flow import flow_draws, flow_matching_error

    critic = _awr_critic(3)
    reference = copy.deepcopy(critic.vla).requires_grad_(False)
    with torch.no_grad():
        for p in critic.vla.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(2)))
    obs = {"row": np.arange(3)}
    acted = critic.act(obs, torch.Generator().manual_seed(4))
    chain, stochastic, seeds = torch.as_tensor(acted["chain"]), torch.as_tensor(acted["stochastic"]), torch.tensor([5, 6, 7])
    score, _, kl = critic(obs, chain, stochastic, reference, objective="flow", seeds=seeds)
    field, _ = critic.vla.velocity_field(critic.batch(obs))
    actions = chain[:, -1].clone()
    actions[..., 4:] = 0.0  # the env's 4 dims; the rest zero, as in supervised batches
    t, noise = flow_draws(seeds, actions.shape[1:])
    torch.testing.assert_close(score, flow_matching_error(field, actions, critic.executed, t, noise))
    _, expected_kl = chain_log_prob(field, chain, stochastic, critic.sde, critic.executed,
                                    reference=reference.velocity_field(critic.batch(obs))[0])
    torch.testing.assert_close(kl, expected_kl)
    assert kl.min() > 0
    with pytest.raises(KilovlaError, match="not 'flow_matching'"):
        critic(obs, chain, stochastic, objective="flow_matching")


@pytest.mark.filterwarnings(r"ignore:Seems like `optimizer.step\(\)` has been overridden")
def test_awr_trains_a_global_batch_the_same_however_it_is_split():
    """Each sample's flow time and noise come from its own seed, so whole, segment by segment or in
    other micro-batches, a global batch gives one gradient (a real pi0-tiny model)."""
    from kilovla.rl.core.trajectory import Segment
    from kilovla.rl.config import AlgoConfig
    from kilovla.rl.ppo import Learner

    critic = _awr_critic(12)
    g = torch.Generator().manual_seed(0)
    segments = []
    for i in range(4):
        obs = {"row": np.arange(3 * i, 3 * i + 3)}
        acted = critic.act(obs, g)
        segments.append(Segment(segment_id=(0, 0, i, 0), ticket=i, start_version=0, obs=obs, chain=acted["chain"],
                                stochastic=acted["stochastic"], logp=acted["logp"], value=acted["value"],
                                reward=np.array([0.5, -1.0, 2.0], np.float32) * (i + 1), done=np.array([False, False, True]),
                                truncated=np.zeros(3, bool), version=np.zeros(3, int), next_obs={"row": np.array(0)}))

    def gradient(calls, micro_batch):
        model = copy.deepcopy(critic)
        model.batch = critic.batch
        cfg = AlgoConfig(policy_loss="awr", micro_batch=micro_batch)
        cfg.optim.clip_grad_norm = 0.0
        learner = Learner(model, cfg, segments_per_step=4, segment_steps=3, total_steps=10)
        seen = []
        step = learner.optimizer.step

        def recording_step(*a, **k):
            seen.append(torch.cat([p.grad.flatten().clone() for p in learner.trainable if p.grad is not None]))
            return step(*a, **k)

        learner.optimizer.step = recording_step
        for part in calls(segments):
            out = learner.consume(part)
        assert out is not None and len(seen) == 1
        return seen[0]

    whole = gradient(lambda segs: [segs], 12)
    assert whole.abs().max() > 0
    torch.testing.assert_close(gradient(lambda segs: [[s] for s in segs], 12), whole, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(gradient(lambda segs: [segs], 5), whole, rtol=1e-4, atol=1e-6)


def test_a_uniformly_good_segment_keeps_positive_advantages():
    from kilovla.rl.ppo import AdvantageScale

    scale = AdvantageScale(momentum=0.9)
    scale.observe(np.array([1.0, 3.0]))
    scale.step()
    assert scale.scale == pytest.approx(np.sqrt(5.0))  # bias-corrected: the first batch's RMS
    adv = np.array([0.5, 1.0, 2.0]) / scale.scale
    assert (adv > 0).all()  # divided, not centred


# -- the trajectory buffer -----------------------------------------------------------------------------
def test_a_replaced_workers_waiting_env_gets_no_ticket_and_the_new_incarnation_proceeds():
    import asyncio

    from kilovla.rl.workers import TrajectoryBufferCore

    async def scenario():
        buffer = TrajectoryBufferCore(max_staleness=0, batch_segments=1)
        assert await buffer.admit((0, 0, 0)) == (0, 0)  # env 0 of worker 0 runs the batch's only segment
        waiting = asyncio.create_task(buffer.admit((0, 0, 1)))  # env 1 of the same worker waits for room
        await asyncio.sleep(0.01)
        assert not waiting.done()
        assert await buffer.drop_worker(0, 0) == 1
        assert await asyncio.wait_for(waiting, 1.0) is None  # replaced: no ticket for it
        admitted = await asyncio.wait_for(buffer.admit((0, 1, 0)), 1.0)  # the new incarnation
        assert admitted == (0, 0)
        assert buffer.running == {(0, 1, 0): 0}

    asyncio.run(scenario())


# -- the run's config, checked before Ray starts --------------------------------------------------------
@pytest.mark.parametrize("override, message", [
    ({"env.workers": 0}, "env.workers must be >= 1"), ({"env.envs_per_worker": 0}, "env.envs_per_worker must be >= 1"),
    ({"learner.batch_segments": 0}, "learner.batch_segments must be >= 1"),
    ({"rollout.segment_steps": 0}, "rollout.segment_steps must be >= 1"),
    ({"learner.max_staleness": -1}, "learner.max_staleness must be >= 0"), ({"mode": "lockstep"}, "mode must be sync or async"),
    ({"mode": "sync", "learner.batch_segments": 12}, "must be a multiple of the number of envs"),
    ({"learner.algo.kl_coef": -0.1}, "learner.algo.kl_coef must be >= 0"),
    ({"learner.algo.policy_loss": "reinforce"}, "policy_loss must be ppo or awr"),
    ({"learner.algo.awr_temperature": 0.0}, "awr_temperature must be > 0"),
    ({"learner.algo.awr_max_weight": 0.5}, "awr_max_weight >= 1"),
    ({"learner.algo.awr_temperature": float("nan")}, "must be finite"),
    ({"learner.algo.kl_coef": float("inf")}, "must be finite"),
])
def test_a_bad_rl_config_is_refused_in_one_line_before_ray_starts(override, message, monkeypatch):
    from kilovla.rl import runner

    cfg = runner.RLConfig(policy="unused")
    for key, value in override.items():
        *sections, name = key.split(".")
        owner = cfg
        for section in sections:
            owner = getattr(owner, section)
        setattr(owner, name, value)
    monkeypatch.setattr(runner, "connect_ray", lambda *a, **k: pytest.fail("Ray started before the config was checked"))
    with pytest.raises(KilovlaError, match=message) as err:
        runner.run(cfg)
    assert "\n" not in str(err.value)


def test_a_policy_that_does_not_fit_the_env_or_an_unknown_task_is_refused():
    import dataclasses

    from kilovla.policy_folder import Interface
    from kilovla.rl.checks import check_policy_fits_env
    from kilovla.rl.config import RLConfig

    fits = Interface(name="policy", action_dim=4, state_dim=43,
                     state_keys=("observation.state", "observation.environment_state"), state_widths=(4, 39),
                     cameras=("scene",), camera_keys=("observation.images.scene",), image_size=None,
                     n_action_steps=None, chunk_length=10)
    check_policy_fits_env(RLConfig(), fits)
    with pytest.raises(KilovlaError, match="action_dim 7"):
        check_policy_fits_env(RLConfig(), dataclasses.replace(fits, action_dim=7))
    cfg = RLConfig()
    cfg.env.tasks = ["reach-v9"]
    with pytest.raises(KilovlaError, match="unknown metaworld task"):
        check_policy_fits_env(cfg, fits)


def test_training_seeds_of_different_slots_workers_and_runs_never_meet():
    from kilovla.rl.roles import first_train_seed

    starts = sorted(first_train_seed(s, w, e) for s in range(3) for w in range(8) for e in range(100))
    assert all(b - a >= 10_000 for a, b in zip(starts, starts[1:]))  # room for 10_000 episodes per slot


@pytest.mark.parametrize("name", ["pi0-tiny", "groot-tiny", "smolvla-tiny", "groot-n17-tiny"])
def test_the_critic_sees_the_state_the_prefix_does_not_carry(name):
    """pi0 and GR00T put the state in the action stream: the value head must read it itself, or two
    observations with the same images and prompt but the hand elsewhere get the same value (SmolVLA's
    prefix holds a state token: its value moves with the state too)."""
    critic = _actor_critic(name)
    model = critic.vla
    batch = _obs_batch(model.config)
    moved = dataclasses.replace(batch, state=batch.state + 1.0)
    with torch.no_grad():
        _, features = model.velocity_field(batch)
        _, same_features = model.velocity_field(moved)
        values, moved_values = critic._value(features, batch), critic._value(same_features, moved)
    if name == "pi0-tiny":
        torch.testing.assert_close(features, same_features)  # the prefix alone cannot tell them apart
    assert (values - moved_values).abs().min() > 1e-4


def test_every_algorithm_is_registered_once_with_checkpoint_files_the_folder_knows():
    from kilovla.errors import KilovlaError
    from kilovla.policy_folder import CHECKPOINT_FILES
    from kilovla.rl.algorithms import algorithm, registry

    assert list(registry()) == ["ppo", "residual_sac", "filtered_bc"]
    files = {name for name, _, _ in CHECKPOINT_FILES}
    for name, algo in registry().items():
        assert algorithm(name) is algo and algo.name == name
        assert set(algo.checkpoint_files) <= files, name
    assert [n for n, a in registry().items() if a.trains_residual] == ["residual_sac"]
    with pytest.raises(KilovlaError, match="learner.algo.name must be one of ppo, residual_sac, filtered_bc, not 'dsrl'"):
        algorithm("dsrl")


def test_each_algorithm_names_its_own_warmup_flag():
    from kilovla.rl.algorithms import algorithm
    from kilovla.rl.config import AlgoConfig

    algo = AlgoConfig()
    assert algorithm("ppo").warmup(algo) is None
    assert algorithm("residual_sac").warmup(algo) == ("learner.algo.sac.warmup_transitions", 1_000)
    assert algorithm("filtered_bc").warmup(algo) == ("learner.algo.filtered_bc.warmup", 256)


def test_the_final_evaluation_runs_the_eval_sections_episodes_on_the_run_s_env():
    """rl/runner.py's final evaluation: eval.episodes, eval.tasks (default: the training tasks) and
    eval.batch_size on env.env with env's cameras, step limit and resolution, at the run's seed."""
    from kilovla.eval.settings import EvalSettings
    from kilovla.rl.config import RLConfig

    cfg = RLConfig()
    cfg.env.resolution = 32
    assert cfg.eval.settings(cfg.env, 3) == EvalSettings(env="metaworld", tasks=("reach-v3", "push-v3"), episodes=10,
                                                         batch_size=10, seed=3, cameras=("scene", "wrist"),
                                                         resolution=32, max_steps=150)
    cfg.eval.tasks, cfg.eval.episodes, cfg.eval.batch_size = ["push-v3"], 4, 2
    assert cfg.eval.settings(cfg.env, 0) == EvalSettings(tasks=("push-v3",), episodes=4, batch_size=2, seed=0,
                                                         cameras=("scene", "wrist"), resolution=32, max_steps=150)
