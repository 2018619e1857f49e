"""Why on-policy PPO did not move a flow policy here: the diagnostics of docs/rl_finetune.md, measured.

    PYTHONPATH=src python benchmarks/rl_diagnose.py --policy DIR --out rl-diagnose [--episodes 50] [--ppo-minutes 6]

On the policy folder DIR (reach-v3 + push-v3, at its training resolution):
- D1: closed-loop success of the deterministic policy (Euler steps from seeded noise) against PPO's
  stochastic rollout policy (Flow-SDE, `rollout.noise_level` 0.5, one stochastic step of 4), same seeds;
- D6: the spread of executed actions over 16 noise draws at fixed observations (is it steerable by
  its noise?), against the actions' own spread over observations;
- D7: does the frozen pooled prefix (what the critic reads) encode the goal? Ridge probe from the
  features to the goal xyz (Meta-World's last 3 state entries), R^2 on held-out resets; the same from
  the normalised state (which, for policies reading `observation.environment_state`, holds the goal);
- D8: what the failures are: per reach-v3 episode of the deterministic policy on fresh seeds, success,
  steps, and the hand's offset from the goal at the end (Meta-World's state: hand xyz first, goal xyz
  last): near misses with a common bias, or wild motion;
- a PPO run of `--ppo-minutes` (async, the old `FINETUNE` recipe with kl_coef 1.0): the critic's
  explained variance, the fraction of samples `behav_cap` masked, and the spread of log-ratios per
  version, from its metrics.jsonl.
Writes OUT/rl_diagnose.json and prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch

TASKS = ("reach-v3", "push-v3")
PPO_RECIPE = ("--learner.algo.name=ppo", "--env.workers=2", "--env.envs_per_worker=6", "--env.max_steps=200",
              "--rollout.segment_steps=8", "--rollout.sde_steps=4", "--learner.batch_segments=24",
              "--learner.max_staleness=1", "--learner.algo.micro_batch=48", "--learner.algo.optim.lr=3e-5",
              "--learner.algo.kl_coef=1.0", "--checkpoint.every=1000")


class StochasticRollout:
    """PPO's behaviour policy as a `Policy`: the actor-critic's Flow-SDE chain, executed chunk only."""

    def __init__(self, policy_dir: str, seed: int):
        from kilovla.policy_folder import load_policy_folder
        from kilovla.rl.core.flow import FlowSDE
        from kilovla.rl.policy import load_actor_critic

        base = load_policy_folder(policy_dir)
        self.model = load_actor_critic(policy_dir, FlowSDE(steps=4, noise_level=0.5)).eval()
        self.generator = torch.Generator().manual_seed(seed)
        for attr in ("name", "action_dim", "state_dim", "state_keys", "cameras", "n_action_steps", "meta"):
            setattr(self, attr, getattr(base, attr))

    def reset(self) -> None:
        pass

    def select_action(self, obs: dict) -> np.ndarray:
        return self.model.act(obs, self.generator)["actions"]


def observations(policy_dir: str, resolution: int, per_task: int, seed: int = 5_000_000) -> list[dict]:
    """Reset observations of fresh seeds, half of them after 10 steps of the deterministic policy."""
    from kilovla.envs.metaworld import MetaWorldEnv
    from kilovla.policy_folder import load_policy_folder

    policy = load_policy_folder(policy_dir)
    out = []
    for t, task in enumerate(TASKS):
        env = MetaWorldEnv(task, resolution=resolution)
        for i in range(per_task):
            obs, _ = env.reset(seed=seed + 1000 * t + i)
            if i % 2:
                for _ in range(2):
                    chunk = policy.select_action({k: (v[None] if not isinstance(v, str) else [v]) for k, v in obs.items()})[0]
                    for a in chunk[: policy.n_action_steps]:
                        obs, *_ = env.step(a)
            out.append(obs)
        env.close()
    return out


def _stack(obs: list[dict]) -> dict:
    from kilovla.rl.core.trajectory import stack

    return stack(obs)


def steerability(policy_dir: str, obs: list[dict], draws: int = 16) -> dict:
    from kilovla.policy_folder import load_policy_folder

    policy = load_policy_folder(policy_dir)
    batch = _stack(obs)
    n = policy.n_action_steps
    samples = []
    torch.manual_seed(0)
    for _ in range(draws):
        samples.append(policy.select_action(batch)[:, :n])
    samples = np.stack(samples)  # (draws, B, n, A)
    return {"action_std_over_noise": float(samples.std(0).mean()),
            "action_std_over_observations": float(samples[0].std(0).mean()), "observations": len(obs), "draws": draws}


def goal_probe(policy_dir: str, obs: list[dict]) -> dict:
    from kilovla.policy_folder import load_policy_folder

    policy = load_policy_folder(policy_dir)
    batch = policy.processor.observation_batch(_stack(obs))
    with torch.no_grad():
        _, features = policy.model.velocity_field(batch)
    goal = np.stack([o["observation.environment_state"][-3:] for o in obs])
    out = {}
    for name, x in (("features", features.float().numpy()), ("state", batch.state.float().numpy())):
        out[f"goal_r2_from_{name}"] = _ridge_r2(x, goal)
    return out


def _ridge_r2(x: np.ndarray, y: np.ndarray, lam: float = 1e-3) -> float:
    rng = np.random.default_rng(0)
    order = rng.permutation(len(x))
    train, test = order[: len(x) * 3 // 4], order[len(x) * 3 // 4:]
    mu, sd = x[train].mean(0), x[train].std(0) + 1e-6
    xs = np.c_[(x - mu) / sd, np.ones(len(x))]
    w = np.linalg.solve(xs[train].T @ xs[train] + lam * len(train) * np.eye(xs.shape[1]), xs[train].T @ y[train])
    pred = xs[test] @ w
    return float(1 - ((pred - y[test]) ** 2).sum() / ((y[test] - y[test].mean(0)) ** 2).sum())


def near_misses(policy_dir: str, resolution: int, episodes: int, task: str = "reach-v3") -> dict:
    """D8: the hand-minus-goal offset (m) at each episode's end, for the successes and for the failures."""
    from kilovla.envs.rollout import run_episodes
    from kilovla.envs.vector import EnvConfig, EnvPool
    from kilovla.eval.closed_loop import episode_seeds, load_policy

    torch.manual_seed(1)
    policy, first, last, ends = load_policy(policy_dir), {}, {}, []

    def on_step(ep, obs, action, reward, info):
        state = np.asarray(obs["observation.environment_state"], np.float64)
        first.setdefault(ep.index, state[-3:])
        last[ep.index] = state[:3]

    def on_end(ep, last_obs):
        ends.append((ep.success, ep.steps, (last[ep.index] - first[ep.index]).tolist()))

    configs = [EnvConfig("metaworld", {"task": task, "cameras": ("scene", "wrist"), "resolution": resolution})] * 10
    with EnvPool(configs, num_workers=2) as pool:
        run_episodes(pool, policy, episode_seeds(5, 0, episodes), n_action_steps=policy.n_action_steps,
                     on_step=on_step, on_end=on_end)
    out = {}
    for name, won in (("successes", True), ("failures", False)):
        offsets = np.array([o for s, _, o in ends if s == won]).reshape(-1, 3)
        out[name] = {"episodes": len(offsets), "mean_steps": float(np.mean([n for s, n, _ in ends if s == won] or [0])),
                     "distance_m": np.round(np.linalg.norm(offsets, axis=1), 3).tolist(),
                     "mean_offset_m": np.round(offsets.mean(0), 3).tolist() if len(offsets) else None}
    return {"near_misses": {"task": task, **out}}


def ppo_health(policy_dir: str, out: Path, minutes: float) -> dict:
    from kilovla.rl import runner

    run_dir = out / "ppo"
    cfg = runner.load(None, [f"--run_dir={run_dir}", f"--policy={policy_dir}", "--mode=async",
                             f"--env.tasks=[{','.join(TASKS)}]", "--eval.episodes=0", "--progress=false", *PPO_RECIPE,
                             "--steps=100000"])
    runner.run(cfg, time_budget_s=minutes * 60)
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    pick = lambda k: [r[f"learner/{k}"] for r in records if f"learner/{k}" in r]  # noqa: E731
    ev, masked, spread = pick("explained_variance"), pick("behav_masked_fraction"), pick("log_ratio_std")
    return {"versions": len(records), "env_steps": records[-1]["env_steps"] if records else 0,
            "explained_variance_first_quarter": float(np.mean(ev[: max(1, len(ev) // 4)])) if ev else None,
            "explained_variance_last_quarter": float(np.mean(ev[-max(1, len(ev) // 4):])) if ev else None,
            "behav_masked_fraction": float(np.mean(masked)) if masked else None,
            "log_ratio_std": float(np.mean(spread)) if spread else None}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--policy", required=True)
    parser.add_argument("--out", default="rl-diagnose")
    parser.add_argument("--episodes", type=int, default=50, help="closed-loop episodes per task, each policy")
    parser.add_argument("--ppo-minutes", type=float, default=6.0)
    args = parser.parse_args()
    from kilovla.eval.closed_loop import evaluate, load_policy
    from kilovla.eval.settings import EvalSettings

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = json.loads((Path(args.policy) / "policy.json").read_text())
    resolution = max(meta.get("image_size") or [64])
    t0 = time.monotonic()
    settings = EvalSettings(tasks=TASKS, episodes=args.episodes, batch_size=10, seed=1, resolution=resolution)
    torch.manual_seed(0)
    deterministic = evaluate(load_policy(args.policy), settings)
    stochastic = evaluate(StochasticRollout(args.policy, seed=0), settings)
    obs = observations(args.policy, resolution, per_task=100)
    result = {"policy": args.policy, "episodes_per_task": args.episodes,
              "success_deterministic": deterministic["overall_success_rate"],
              "success_stochastic_rollout": stochastic["overall_success_rate"],
              "per_task": {t: {"deterministic": deterministic["per_task"][t]["success_rate"],
                               "stochastic": stochastic["per_task"][t]["success_rate"]} for t in TASKS},
              **steerability(args.policy, obs), **goal_probe(args.policy, obs),
              **near_misses(args.policy, resolution, episodes=20)}
    if args.ppo_minutes > 0:
        result["ppo"] = ppo_health(args.policy, out, args.ppo_minutes)
    result["minutes"] = (time.monotonic() - t0) / 60
    (out / "rl_diagnose.json").write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
