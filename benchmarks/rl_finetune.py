"""RL fine-tuning of a supervised checkpoint, one recipe change per row (docs/rl_finetune.md).

    PYTHONPATH=src python benchmarks/rl_finetune.py --policy DIR --out rlft kl_1 lr_3e-5 ...
    python benchmarks/rl_finetune.py --out rlft --table     # the rows so far, as markdown

Each row is `kilovla bench rl`'s `success_gain`: closed-loop success of DIR on reach-v3 and push-v3
(`--episodes` fixed-seed episodes per task, 50 by default, `bench.rl.EVAL_SEED`), an async RL run with
the row's recipe for at most `--minutes` (and `--env-steps`), then success again; plus the run's
training-episode success in its first and last quarter of policy versions. Rows go to
OUT/rl_finetune.jsonl. PPO rows (E2-E11 of docs/rl_finetune.md) are `PPO_FINETUNE` plus their
overrides, from the narrow-expert checkpoint of `benchmarks/demo_ablation.py narrow_expert`;
residual SAC rows (`sac_*`) are `kilovla bench rl`'s `GAIN` recipe plus theirs.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from kilovla.bench.rl import GAIN, closed_loop, success_gain
from kilovla.errors import KilovlaError

# The PPO recipe of the E-rows: 12 envs in 2 workers at 64 px, 200-step episodes, 4-step SDE chains while
# acting, one version of staleness, 24 segments (192 samples) per step at lr 3e-5, a KL penalty to the start.
PPO_FINETUNE = ["--learner.algo.name=ppo", "--env.workers=2", "--env.envs_per_worker=6", "--env.resolution=64",
                "--env.max_steps=200", "--rollout.segment_steps=8", "--rollout.sde_steps=4", "--learner.batch_segments=24",
                "--learner.max_staleness=1", "--learner.algo.micro_batch=48", "--learner.algo.optim.lr=3e-5",
                "--learner.algo.kl_coef=1.0", "--checkpoint.every=20"]
SAC_VARIANTS: dict[str, list[str]] = {  # row -> overrides of bench.rl.GAIN (residual SAC, the default)
    "sac_default": [],
    "sac_soft_q": ["--learner.algo.sac.backup_entropy=true", "--learner.algo.sac.init_alpha=0.01",
                   "--learner.algo.sac.alpha_lr=3e-4", "--learner.algo.sac.init_std=0.5",
                   "--learner.algo.sac.critic_warmup_updates=0", "--learner.algo.sac.actor_lr=3e-4"],
}
VARIANTS: dict[str, list[str]] = {  # row -> overrides of PPO_FINETUNE (which has kl_coef 1.0, 24 segments, lr 3e-5)
    "lr_1e-4": ["--learner.algo.kl_coef=0", "--learner.algo.optim.lr=1e-4"],
    "lr_3e-5": ["--learner.algo.kl_coef=0"],
    "lr_1e-5_batch_48": ["--learner.algo.kl_coef=0", "--learner.algo.optim.lr=1e-5", "--learner.batch_segments=48",
                         "--learner.algo.optim.warmup_steps=5"],
    "kl_1": [],
    # a constant small learning rate: every run rose while the learning rate warmed up, then fell
    "lr_5e-6_constant": ["--learner.algo.kl_coef=0", "--learner.algo.optim.lr=5e-6", "--learner.algo.optim.warmup_steps=0"],
    # advantage-weighted regression on the executed chunks' flow-matching error instead of PPO
    "awr_t1": ["--learner.algo.kl_coef=0", "--learner.algo.policy_loss=awr"],
    "awr_t0.1": ["--learner.algo.kl_coef=0", "--learner.algo.policy_loss=awr", "--learner.algo.awr_temperature=0.1"],
    "awr_t0.1_sde_10": ["--learner.algo.kl_coef=0", "--learner.algo.policy_loss=awr", "--learner.algo.awr_temperature=0.1",
                        "--rollout.sde_steps=10"],
    "awr_t0.1_sde_10_kl_0.1_lr_1e-5": ["--learner.algo.kl_coef=0.1", "--learner.algo.policy_loss=awr",
                                       "--learner.algo.awr_temperature=0.1", "--rollout.sde_steps=10",
                                       "--learner.algo.optim.lr=1e-5"],
}


def training_success(run_dir: Path) -> tuple[float, float]:
    """Training-episode success (weighted by episodes) over the first and the last quarter of versions."""
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    quarter = max(1, len(records) // 4)

    def rate(rs):
        episodes = sum(r["episodes"] for r in rs)
        return sum((r["success_rate"] or 0.0) * r["episodes"] for r in rs) / max(1, episodes)

    return rate(records[:quarter]), rate(records[-quarter:])


def table(out: Path) -> str:
    rows = out / "rl_finetune.jsonl"
    if not rows.is_file() or not rows.read_text().strip():
        return f"no rows yet in {rows}"
    lines = ["| row | overrides | before | after | change (points) | training success first -> last quarter | versions | env steps |",
             "|---|---|---|---|---|---|---|---|"]
    for line in rows.read_text().splitlines():
        r = json.loads(line)
        per = ", ".join(f"{t} {v['before']:.0%} -> {v['after']:.0%}" for t, v in r["per_task"].items())
        overrides = " ".join(SAC_VARIANTS.get(r["name"], VARIANTS.get(r["name"], []))) or "(the recipe)" \
            if r["name"] in {**VARIANTS, **SAC_VARIANTS} else "(a row no longer defined)"
        lines.append(f"| {r['name']} | {overrides} | {r['before']:.0%} | "
                     f"{r['after']:.0%} ({per}) | {(r['after'] - r['before']) * 100:+.0f} | "
                     f"{r['training_success'][0]:.2f} -> {r['training_success'][1]:.2f} | {r['rl_steps']} | {r['env_steps']} |")
    return "\n".join(lines)


def _overrides(name: str) -> list[str]:
    """The row's recipe and its flags: PPO rows on PPO_FINETUNE, SAC rows on GAIN."""
    if name in SAC_VARIANTS:
        return [*GAIN, *SAC_VARIANTS[name]]
    return [*PPO_FINETUNE, *VARIANTS[name]]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("variants", nargs="*", help=f"rows to run: {', '.join([*VARIANTS, *SAC_VARIANTS])}")
    parser.add_argument("--policy", help="the supervised policy folder to fine-tune")
    parser.add_argument("--out", default="rl_finetune")
    parser.add_argument("--minutes", type=float, default=14.0)
    parser.add_argument("--env-steps", type=int, default=250_000)
    parser.add_argument("--episodes", type=int, default=50, help="closed-loop episodes per task, before and after")
    parser.add_argument("--table", action="store_true")
    args = parser.parse_args()
    out = Path(args.out)
    if args.table:
        print(table(out))
        return
    if not args.policy or not args.variants:
        parser.error("running rows needs --policy DIR and at least one row")
    unknown = [v for v in args.variants if v not in VARIANTS and v not in SAC_VARIANTS]
    if unknown:
        parser.error(f"unknown rows {unknown}; known: {', '.join([*VARIANTS, *SAC_VARIANTS])}")
    if args.minutes <= 0:
        parser.error(f"--minutes must be > 0, got {args.minutes}")
    if not Path(args.policy).is_dir():
        parser.error(f"--policy {args.policy}: not a folder")
    taken = [v for v in args.variants if (out / "runs" / v).exists()]
    if taken:  # a run directory's metrics append: a second run would mix its training success with the first's
        parser.error(f"{out / 'runs'} already holds {taken}: pick another --out or remove them")
    out.mkdir(parents=True, exist_ok=True)
    before = None
    for name in args.variants:
        run_dir = out / "runs" / name
        try:
            before = before or closed_loop(args.policy, args.episodes)
            gain = success_gain(args.policy, run_dir, mode="async", env_steps=args.env_steps, minutes=args.minutes,
                                before=before, episodes=args.episodes, recipe=(), overrides=_overrides(name))
        except KilovlaError as e:
            parser.error(str(e))
        gain.pop("curve")
        row = {"name": name, "policy": args.policy, "minutes": args.minutes, "episodes": args.episodes,
               "before": before["success"], "after": gain["after"]["success"], "rl_steps": gain["versions"],
               "per_task": {t: {"before": before["per_task"][t]["success"], "after": gain["after"]["per_task"][t]["success"]}
                            for t in before["per_task"]},
               "env_steps": gain["env_steps"], "training_success": training_success(run_dir)}
        with open(out / "rl_finetune.jsonl", "a") as f:
            f.write(json.dumps(row) + "\n")
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
