"""Residual SAC (rl/sac.py, models/residual.py): the residual starts as the identity, the replay buffer
links chunk transitions across segments, the update learns what the reward asks and nothing at lr 0,
and an RL folder is a policy folder eval, serve and quantize load."""

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from kilovla.rl.core.trajectory import Segment
from kilovla.rl import checks, checkpoints


@pytest.fixture(scope="module")
def policy_dir(reach_policy):
    """A tiny pi0.5 reading the environment state too (chunks of 4, all 4 executed)."""
    return reach_policy("--steps=2", "--checkpoint.every=2",
                        "--policy.overrides={chunk_size: 4, max_state_dim: 48}",
                        "--policy.state_keys=[observation.state, observation.environment_state]")


@pytest.fixture(scope="module")
def smolvla_dir(reach_policy):
    """policy_dir's run with smolvla-tiny."""
    return reach_policy("--steps=2", "--checkpoint.every=2", "--policy.preset=smolvla-tiny",
                        "--policy.overrides={chunk_size: 4, max_state_dim: 48}",
                        "--policy.state_keys=[observation.state, observation.environment_state]")


def _learner(policy_dir, segments_per_step, seed=0, **sac):
    """A residual agent of the folder (4 executed actions, the env state privileged) and its SAC learner."""
    from kilovla.rl.sac import SACConfig, SACLearner, load_residual_agent

    cfg = SACConfig(**sac)
    agent = load_residual_agent(policy_dir, 4, cfg, (("observation.environment_state", 39),))
    return agent, SACLearner(agent, 0.99, cfg, segments_per_step=segments_per_step, seed=seed)


def _obs(n, seed=0):
    rng = np.random.default_rng(seed)
    return {"observation.images.scene": rng.integers(0, 255, (n, 32, 32, 3), dtype=np.uint8),
            "observation.images.wrist": rng.integers(0, 255, (n, 32, 32, 3), dtype=np.uint8),
            "observation.state": rng.normal(size=(n, 4)).astype(np.float32),
            "observation.environment_state": rng.normal(size=(n, 39)).astype(np.float32),
            "task": ["reach the red goal"] * n}


@pytest.mark.parametrize("preset", ["pi0-tiny", "groot-tiny", "smolvla-tiny", "groot-n17-tiny"])
def test_a_fresh_residual_returns_the_base_chunk_exactly(preset):
    from kilovla.models.presets import build_model
    from kilovla.models.processor import PolicyMeta, Processor
    from kilovla.models.residual import ResidualActor, ResidualPolicyModel, ResidualSpec, pooled_width

    torch.manual_seed(0)
    base = build_model(preset).eval()
    cfg = base.config
    slot = cfg.cameras[0] if hasattr(cfg, "cameras") else cfg.vision_slots[0] if hasattr(cfg, "vision_slots") else None
    meta = PolicyMeta(preset=preset, camera_map={"observation.images.scene": slot} if slot else {},
                      state_dim=4, action_dim=4, stats=_stats(), n_action_steps=3)
    obs = {k: v for k, v in _obs(3).items() if k in ("observation.images.scene", "observation.state", "task")}
    batch = Processor(cfg, meta).observation_batch(obs)
    spec = ResidualSpec(steps=3, action_dim=4, features=pooled_width(cfg), state_dim=cfg.max_state_dim)
    actor = ResidualActor(spec)
    model = ResidualPolicyModel(base, actor)
    horizon = getattr(cfg, "chunk_size", None) or cfg.action_horizon
    noise = torch.randn(3, horizon, cfg.max_action_dim)
    assert torch.equal(model.sample_actions(batch, noise), base.sample_actions(batch, noise))
    with torch.no_grad():  # a trained residual moves exactly the executed part, by at most its scale
        actor.mean.weight.normal_()
        actor.mean.bias.fill_(3.0)
    moved = model.sample_actions(batch, noise) - base.sample_actions(batch, noise)
    assert moved[:, :3, :4].abs().min() > 0 and moved[:, :3, :4].abs().max() <= spec.scale + 1e-6
    assert moved[:, 3:].abs().max() == 0 and moved[:, :, 4:].abs().max() == 0


def _stats():
    return {"observation.state": {"q01": [-1.0] * 4, "q99": [1.0] * 4},
            "action": {"q01": [-1.0] * 4, "q99": [1.0] * 4}}


def _segment(extras, slot=(0, 0, 0), seq=0, done=(), truncated=(), states=None, next_state=None, rewards=None):
    t_len = len(extras["features"])
    states = np.arange(t_len, dtype=np.float32)[:, None] if states is None else states
    done_a, cut = np.zeros(t_len, bool), np.zeros(t_len, bool)
    done_a[list(done)] = True
    cut[list(truncated)] = True
    return Segment(segment_id=(*slot, seq), ticket=seq, start_version=0, obs={"observation.state": states},
                   chain=None, stochastic=None, logp=None, value=None,
                   reward=np.ones(t_len, np.float32) if rewards is None else np.asarray(rewards, np.float32),
                   done=done_a | cut, truncated=cut, version=np.zeros(t_len, int),
                   next_obs={"observation.state": np.asarray(next_state, np.float32)}, extras=extras)


def _extras(t_len, rng, width=2):
    return {"features": rng.normal(size=(t_len, 3)).astype(np.float32),
            "state": rng.normal(size=(t_len, 2)).astype(np.float32),
            "privileged": np.zeros((t_len, 0), np.float32),
            "base": rng.normal(size=(t_len, 1, width)).astype(np.float32),
            "executed": rng.normal(size=(t_len, 1, width)).astype(np.float32)}


def test_the_replay_links_transitions_across_segments_and_never_through_a_cut_or_a_broken_chain():
    from kilovla.rl.sac import Replay

    rng = np.random.default_rng(0)
    replay = Replay(100, {"features": 3, "state": 2, "privileged": 0, "base": 2, "executed": 2}, gamma=0.5)
    # slot A: 3 steps, the episode goes on into its next segment, which starts at the state it promised
    replay.add_segment(_segment(_extras(3, rng), states=np.array([[0.], [1.], [2.]]), next_state=[3.]))
    assert list(replay.valid[:3]) == [True, True, False]  # the last waits for its successor
    replay.add_segment(_segment(_extras(3, rng), seq=1, states=np.array([[3.], [4.], [5.]]), done=[1],
                                next_state=[9.], rewards=[0, 1, 0]))
    assert replay.nxt[2] == 3 and replay.valid[2]
    assert replay.terminal[4] and replay.valid[4]  # terminated: needs no successor
    assert not replay.valid[3] or replay.nxt[3] == 4
    # the episode ended at index 4: Monte Carlo returns with gamma 0.5, backwards from the success
    np.testing.assert_allclose(replay.mc[:5], [1 + .5 * (1 + .5 * (1 + .5 * (0 + .5 * 1))),
                                               1 + .5 * (1 + .5 * (0 + .5 * 1)), 1 + .5 * (0 + .5 * 1), 0 + .5, 1.0])
    # slot B: a segment that does not start where the last one left off (a dropped sync round) links nothing
    replay.add_segment(_segment(_extras(2, rng), slot=(1, 0, 0), next_state=[7.]))
    replay.add_segment(_segment(_extras(2, rng), slot=(1, 0, 0), seq=1, states=np.array([[8.], [9.]]), next_state=[10.]))
    assert not replay.valid[7] and replay.nxt[7] == -1
    # a time-limit cut is not a transition (the cut state is never seen), and not a terminal either
    replay.add_segment(_segment(_extras(2, rng), slot=(2, 0, 0), truncated=[0], next_state=[5.]))
    assert not replay.valid[10] and not replay.terminal[10]
    idx = replay.sample(64, np.random.default_rng(1))
    assert replay.valid[idx].all()
    batch = replay.batch(idx)
    linked = ~replay.terminal[idx]
    np.testing.assert_array_equal(batch["next_features"].numpy()[linked], replay.data["features"][replay.nxt[idx][linked]])


def _bandit_segments(agent, n, rng, target):
    """One-step episodes (terminal at once) whose reward is -||executed - target||^2 in normalised units."""
    spec = agent.spec
    out = []
    for i in range(n):
        base = rng.uniform(-0.2, 0.2, (1, spec.steps, spec.action_dim)).astype(np.float32)
        delta = rng.uniform(-spec.scale, spec.scale, base.shape).astype(np.float32)
        executed = base + delta
        extras = {"features": rng.normal(size=(1, spec.features)).astype(np.float32),
                  "state": rng.normal(size=(1, spec.state_dim)).astype(np.float32),
                  "privileged": rng.normal(size=(1, 39)).astype(np.float32), "base": base, "executed": executed}
        reward = [-float(((executed - target) ** 2).sum())]
        out.append(_segment(extras, slot=(0, 0, i), done=[0], states=np.zeros((1, 1)), next_state=[0.], rewards=reward))
    return out


@pytest.mark.parametrize("lr", [3e-3, 0.0])
def test_the_update_moves_the_residual_toward_higher_reward_and_not_at_lr_0(policy_dir, lr):
    torch.manual_seed(0)
    agent, learner = _learner(policy_dir, 50, warmup_transitions=64, batch_size=64, utd=4.0, actor_lr=lr,
                              critic_lr=3e-3, actor_every=1, res_scale=0.3, init_alpha=1e-3, alpha_lr=0.0,
                              critic_warmup_updates=0, penalty=0.0)
    target = 0.25  # every executed action wants to be 0.25: the residual should push up by ~0.25 - base
    rng = np.random.default_rng(0)
    probe = _bandit_segments(agent, 64, np.random.default_rng(9), target)
    f, s, b = (torch.from_numpy(np.concatenate([p.extras[k] for p in probe])) for k in ("features", "state", "base"))
    before = agent.actor.deterministic(f, s, b).detach()
    stats = [learner.consume(_bandit_segments(agent, 50, rng, target)) for _ in range(8)]
    after = agent.actor.deterministic(f, s, b).detach()
    assert all(st is not None and st["updates_this_version"] == 200 for st in stats[2:])
    assert before.abs().max() == 0  # the identity at the start
    if lr == 0:
        assert after.abs().max() == 0
    else:  # mean correction clearly positive, toward the target
        assert after.mean() > 0.1, after.mean()
    assert stats[-1]["critic_loss"] < stats[1]["critic_loss"]


@pytest.mark.parametrize("base", ["policy_dir", "smolvla_dir"])
def test_an_rl_folder_round_trips_through_the_checkpoint_and_every_loader(base, request, tmp_path):
    """The learner's state as the runner writes it: a policy folder (base + residual) that the policy API
    loads with the residual applied, and a learner.pt + replay.safetensors that resume it exactly; for a
    pi0.5 base and a SmolVLA one."""
    from kilovla.models.checkpoints import read_safetensors
    from kilovla.policy_folder import load_policy_folder
    from kilovla.safe_load import load_torch

    torch.manual_seed(0)
    # a bound and a std that are nobody's default: a loader that falls back to a default acts differently
    sac = dict(warmup_transitions=16, batch_size=16, utd=1.0, critic_warmup_updates=4, res_scale=0.55, init_std=0.45)
    policy_dir = request.getfixturevalue(base)
    agent, learner = _learner(policy_dir, 20, **sac)
    rng = np.random.default_rng(0)
    learner.consume(_bandit_segments(agent, 20, rng, 0.25))
    learner.consume(_bandit_segments(agent, 20, rng, 0.25))
    with torch.no_grad():  # a few updates barely move the mean; make the correction large and input-dependent
        torch.nn.init.normal_(agent.actor.mean.weight, std=0.2, generator=torch.Generator().manual_seed(1))
        agent.actor.mean.bias.fill_(0.4)
    folder = _write_like_the_runner(learner, policy_dir, tmp_path / "ck")
    policy = load_policy_folder(folder)
    assert policy.model.actor.spec == agent.actor.spec
    obs = _obs(2)
    torch.manual_seed(5)
    got = policy.select_action(obs)
    batch = policy.processor.observation_batch(obs)
    torch.manual_seed(5)
    noise = torch.randn(2, 4, policy.model.config.max_action_dim)
    with torch.no_grad():
        base = agent.vla.sample_actions(batch, noise)
        field, features = agent.vla.velocity_field(batch)
        want = base.clone()
        correction = agent.actor.deterministic(features, batch.state, base[:, :4, :4])
        want[:, :4, :4] += correction
    assert correction.abs().mean() > 0.2 and correction.std() > 0.1  # the residual acts, and differs per dim
    np.testing.assert_allclose(got, policy.processor.unnormalize_actions(want.numpy()), atol=1e-5)
    # resume: a fresh learner from the folder continues with the same buffer, optimizers and counters
    state = load_torch(folder / "learner.pt")
    state["replay"] = read_safetensors(folder / "replay.safetensors")
    _, resumed = _learner(str(folder), 20, seed=123, **sac)
    resumed.load_state_dict(state)
    segs = _bandit_segments(agent, 20, np.random.default_rng(3), 0.25)
    a, b = learner.consume(segs), resumed.consume(segs)
    assert a["version"] == b["version"] == 3
    for k in ("critic_loss", "actor_loss", "q", "alpha"):
        assert a[k] == pytest.approx(b[k], rel=1e-6), k


def _write_like_the_runner(learner, policy_dir, folder):
    from pathlib import Path

    from kilovla.policy_folder import write_rl_policy_files as write_policy_files

    folder.mkdir(parents=True)
    write_policy_files(folder, learner.state_dict(), json.loads((Path(policy_dir) / "policy.json").read_text()))
    return folder


@pytest.fixture(scope="module")
def rl_folder(policy_dir, tmp_path_factory):
    """An RL folder whose residual is not zero (a few SAC updates on the bandit)."""
    torch.manual_seed(0)
    agent, learner = _learner(policy_dir, 40, warmup_transitions=16, batch_size=16, utd=2.0, critic_warmup_updates=0,
                              actor_every=1, actor_lr=1e-2, penalty=0.0)
    learner.consume(_bandit_segments(agent, 40, np.random.default_rng(0), 0.25))
    return _write_like_the_runner(learner, policy_dir, tmp_path_factory.mktemp("rlfolder") / "ck")


def test_serve_answers_an_rl_folder_with_the_residual_and_refuses_rtc_for_it(rl_folder):
    from kilovla.policy_folder import load_policy_folder
    from kilovla.serve.engine import PolicyEngine, Request

    engine = PolicyEngine.load(rl_folder, device="cpu")
    policy = load_policy_folder(rl_folder)
    obs = {k: v[0] for k, v in _obs(1).items() if k != "task"} | {"task": "reach the red goal"}
    served, _ = engine.infer([Request(obs, seed=3)])
    noise = engine.noise([Request(obs, seed=3)])
    batch = policy.processor.observation_batch({k: (v[None] if k != "task" else [v]) for k, v in obs.items()})
    want = policy.processor.unnormalize_actions(policy.model.sample_actions(batch, noise).numpy())[0]
    base = policy.processor.unnormalize_actions(policy.model.base.sample_actions(batch, noise).numpy())[0]
    np.testing.assert_allclose(served[0] if served[0].ndim == 2 else served, want, atol=1e-5)
    assert np.abs(want[:4] - base[:4]).max() > 1e-4  # the residual acts
    assert not engine.supports_rtc


def test_quantize_takes_the_base_of_an_rl_folder_and_keeps_its_residual(rl_folder, reach_demos, tmp_path):
    from kilovla.policy_folder import load_policy_folder
    from kilovla.models.residual import ResidualPolicyModel
    from kilovla.quant.fp8 import Fp8Weights
    from kilovla.quantize.folder import quantize_policy_folder

    # reach_demos: the demonstrations the test policy was trained on
    report = quantize_policy_folder(rl_folder, tmp_path / "q", dataset=reach_demos, samples=8, latency_repeats=1)
    assert report["layers"] and not any(k.startswith(("base.", "actor.")) for k in report["layers"])  # the base's names
    quantized = load_policy_folder(tmp_path / "q")
    assert isinstance(quantized.model, ResidualPolicyModel)
    assert any(isinstance(m, Fp8Weights) for m in quantized.model.base.modules())
    assert not any(isinstance(m, Fp8Weights) for m in quantized.model.actor.modules())  # the actor as it was
    original = load_policy_folder(rl_folder)
    for k, v in original.model.actor.state_dict().items():
        assert torch.equal(v, quantized.model.actor.state_dict()[k]), k


def test_bench_rl_only_is_checked_before_any_work(tmp_path):
    from kilovla.bench import rl as rl_bench
    from kilovla.cli import main
    from kilovla.errors import KilovlaError

    with pytest.raises(KilovlaError, match="no --quick form"):
        rl_bench.run(quick=True, only="gain", out_dir=tmp_path)
    with pytest.raises(KilovlaError, match="must be gain or throughput"):
        rl_bench.run(only="speed", out_dir=tmp_path)
    assert main(["bench", "fp8", "--only", "gain", "--out", str(tmp_path)]) == 2
    assert not any(tmp_path.iterdir())  # nothing built, nothing written


def test_residual_sac_settings_out_of_range_are_one_line_each():
    from kilovla.errors import KilovlaError
    from kilovla.rl import runner

    for flag, match in (("--learner.algo.sac.replay_size=500", "replay_size = 500 is out of range .at least 1000"),
                        ("--learner.algo.sac.actor_lr=-1", "actor_lr = -1.0 is out of range"),
                        ("--learner.algo.sac.hidden=0", "hidden = 0 is out of range"),
                        ("--learner.algo.gamma=1.5", "learner.algo.gamma = 1.5 is out of range"),
                        ("--learner.ranks=2", "learner.ranks must be 1")):
        cfg = runner.load(None, ["--learner.algo.name=residual_sac", "--learner.batch_segments=32", flag])
        with pytest.raises(KilovlaError, match=match):
            checks.check_config(cfg)


def test_a_residual_entry_with_a_bound_that_is_not_a_positive_finite_number_is_refused(rl_folder):
    from kilovla.errors import KilovlaError
    from kilovla.models.residual import ResidualSpec

    saved = json.loads((rl_folder / "policy.json").read_text())["residual"]
    assert ResidualSpec.from_json(saved, "policy.json").scale == saved["scale"]
    for bad in (float("nan"), float("inf"), -0.5, True):
        with pytest.raises(KilovlaError, match="residual entry has bad scale"):
            ResidualSpec.from_json({**saved, "scale": bad}, "policy.json")


def test_the_folder_replans_as_its_residual_was_trained_and_eval_refuses_to_run_past_it(policy_dir, tmp_path):
    # a residual of 2 corrected actions on a base that executes 4: policy.json says 2, and an evaluation
    # asked to execute 4 would run 2 actions a chunk uncorrected: refused before any env starts
    from kilovla.errors import KilovlaError
    from kilovla.eval.closed_loop import evaluate
    from kilovla.eval.settings import EvalSettings
    from kilovla.policy_folder import load_policy_folder
    from kilovla.rl.sac import SACConfig, SACLearner, load_residual_agent

    assert json.loads((Path(policy_dir) / "policy.json").read_text())["n_action_steps"] == 4
    agent = load_residual_agent(policy_dir, 2, SACConfig(), (("observation.environment_state", 39),))
    folder = _write_like_the_runner(SACLearner(agent, 0.99, SACConfig(), segments_per_step=4), policy_dir, tmp_path / "ck")
    policy = load_policy_folder(folder)
    assert policy.n_action_steps == policy.model.actor.spec.steps == 2
    with pytest.raises(KilovlaError, match="residual corrects only the first 2 actions"):
        evaluate(policy, EvalSettings(tasks=["reach-v3"], episodes=1, n_action_steps=4, resolution=32))


def test_resume_needs_the_actor_and_its_critics_whole_and_names_the_file(rl_folder, tmp_path):
    import shutil

    from kilovla.errors import KilovlaError
    from kilovla.rl import runner

    cfg = runner.load(None, ["--learner.algo.name=residual_sac"])
    state = checkpoints.read_learner_state(rl_folder)
    checks.check_resume_fits(cfg, rl_folder, state)  # the folder as written resumes
    for name in ("critic.safetensors", "residual.safetensors"):
        for damage in ("missing", "truncated"):
            folder = tmp_path / f"{name}-{damage}"
            shutil.copytree(rl_folder, folder)
            if damage == "missing":
                (folder / name).unlink()
            else:
                (folder / name).write_bytes((folder / name).read_bytes()[:100])
            with pytest.raises(KilovlaError, match=name.replace(".", r"\.")):
                checks.check_resume_fits(cfg, folder, state)


def test_a_run_from_an_rl_folder_takes_the_residual_settings_it_was_made_with(rl_folder, caplog):
    from kilovla.models.residual import ResidualSpec
    from kilovla.rl import runner
    from kilovla.rl.sac import with_saved_residual

    saved = json.loads((rl_folder / "policy.json").read_text())["residual"]
    spec = ResidualSpec.from_json(saved, "policy.json")
    cfg = runner.load(None, ["--learner.algo.name=residual_sac", f"--learner.algo.sac.res_scale={saved['scale'] + 0.25}",
                             f"--learner.algo.sac.hidden={saved['hidden'] * 2}"])
    with caplog.at_level("WARNING"):
        kept = with_saved_residual(cfg, spec, str(rl_folder))
    sac = kept.learner.algo.sac
    assert (sac.res_scale, sac.hidden, sac.init_std, sac.depth) == (saved["scale"], saved["hidden"], saved["init_std"],
                                                                    saved["depth"])
    assert "replace the config's" in caplog.text and f"res_scale={saved['scale']}" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING"):
        assert with_saved_residual(kept, spec, str(rl_folder)) == kept  # nothing to replace, no warning
    assert caplog.text == ""


def test_a_run_that_cannot_reach_its_warmup_says_so_before_ray_starts(policy_dir, tmp_path, caplog, monkeypatch):
    from kilovla.rl import runner

    def no_ray(*args, **kwargs):
        raise RuntimeError("Ray would start here")

    monkeypatch.setattr(runner, "connect_ray", no_ray)
    cfg = runner.load(None, [f"--run_dir={tmp_path / 'run'}", f"--policy={policy_dir}", "--steps=4",
                             "--env.tasks=[reach-v3]", "--env.workers=1", "--env.envs_per_worker=2",
                             "--rollout.segment_steps=3", "--learner.batch_segments=4",
                             "--learner.algo.sac.replay_size=1000"])
    with caplog.at_level("WARNING"), pytest.raises(RuntimeError, match="Ray would start here"):
        runner.run(cfg)
    assert "learner.algo.sac.warmup_transitions=1000 cannot be reached: this run stores at most 48 transitions" \
        in caplog.text
