"""RL fine-tuning of a supervised checkpoint, one recipe change per row (docs/rl_finetune.md).

    PYTHONPATH=src python benchmarks/rl_finetune.py --policy DIR --out rlft kl_1 lr_3e-5 ...
    python benchmarks/rl_finetune.py --out rlft --table     # the rows so far, as markdown

Each row is `kilovla bench rl`'s `success_gain`: closed-loop success of DIR on reach-v3 and push-v3
(`--episodes` fixed-seed episodes per task, 50 by default, eval seed 0), an async RL run of `FINETUNE` with the row's
overrides for at most `--minutes`, then success again; plus the run's training-episode success in
its first and last quarter of policy versions. Rows go to OUT/rl_finetune.jsonl. The start used in
docs/rl_finetune.md is the narrow-expert checkpoint of `benchmarks/demo_ablation.py narrow_expert`.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from kilovla.bench.rl import success_gain
from kilovla.errors import KilovlaError

VARIANTS: dict[str, list[str]] = {  # row -> overrides of FINETUNE (which has kl_coef 1.0, 24 segments, lr 3e-5)
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
        overrides = " ".join(VARIANTS[r["name"]]) or "(FINETUNE)" if r["name"] in VARIANTS else "(a row no longer defined)"
        lines.append(f"| {r['name']} | {overrides} | {r['before']:.0%} | "
                     f"{r['after']:.0%} ({per}) | {(r['after'] - r['before']) * 100:+.0f} | "
                     f"{r['training_success'][0]:.2f} -> {r['training_success'][1]:.2f} | {r['rl_steps']} | {r['env_steps']} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("variants", nargs="*", help=f"rows to run: {', '.join(VARIANTS)}")
    parser.add_argument("--policy", help="the supervised policy folder to fine-tune")
    parser.add_argument("--out", default="rl_finetune")
    parser.add_argument("--minutes", type=float, default=14.0)
    parser.add_argument("--episodes", type=int, default=50, help="closed-loop episodes per task, before and after")
    parser.add_argument("--table", action="store_true")
    args = parser.parse_args()
    out = Path(args.out)
    if args.table:
        print(table(out))
        return
    if not args.policy or not args.variants:
        parser.error("running rows needs --policy DIR and at least one row")
    unknown = [v for v in args.variants if v not in VARIANTS]
    if unknown:
        parser.error(f"unknown rows {unknown}; known: {', '.join(VARIANTS)}")
    if args.minutes <= 0:
        parser.error(f"--minutes must be > 0, got {args.minutes}")
    if not Path(args.policy).is_dir():
        parser.error(f"--policy {args.policy}: not a folder")
    taken = [v for v in args.variants if (out / "runs" / v).exists()]
    if taken:  # a run directory's metrics append: a second run would mix its training success with the first's
        parser.error(f"{out / 'runs'} already holds {taken}: pick another --out or remove them")
    out.mkdir(parents=True, exist_ok=True)
    for name in args.variants:
        run_dir = out / "runs" / name
        try:
            gain = success_gain(args.policy, run_dir, minutes=args.minutes, episodes=args.episodes,
                                overrides=VARIANTS[name])
        except KilovlaError as e:
            parser.error(str(e))
        row = {"name": name, "policy": args.policy, "minutes": args.minutes, "episodes": args.episodes, **gain,
               "training_success": training_success(run_dir)}
        with open(out / "rl_finetune.jsonl", "a") as f:
            f.write(json.dumps(row) + "\n")
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
