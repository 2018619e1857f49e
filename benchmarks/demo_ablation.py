"""What limits the demo's learned policy: one `DemoRecipe` field changed per row, each a measured run.

    PYTHONPATH=src nice -n 10 python benchmarks/demo_ablation.py --out ablation baseline state_token ...
    PYTHONPATH=src python benchmarks/demo_ablation.py --out ablation --seeds 0,1,2 full final_weights
    python benchmarks/demo_ablation.py --out ablation --table      # the rows so far, as markdown

Each variant is `kilovla demo`'s own code path (collect -> train -> evaluate on seeds disjoint from
the demonstrations') with the changes listed in VARIANTS applied to a base recipe. `--steps` and
`--eval-episodes` shrink every variant alike (reduced-scale ablations on a shared machine); a variant
that sets train_steps itself keeps its ratio to the base. Datasets are shared between variants that
record the same demonstrations, and a variant that changes only `n_action_steps` re-evaluates the
checkpoint of the run it shares everything else with. Rows go to OUT/ablation.jsonl: success overall
and per task with 95 % Wilson intervals, wall and CPU seconds per stage (CPU seconds compare better
than wall time when others share the machine). `--seeds S,...` runs each variant once per seed as
`kilovla demo --seed=S` does (demonstrations and training on S, evaluation on S + 1), rows named
`variant@S`.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import resource
import sys
import time
from pathlib import Path

from kilovla.demo import (DEMO_PRESET, DENSE_MODEL, FULL, PRESET_MODELS, DemoRecipe, build_demo_cache,
                          collect_demonstrations, evaluate_both, train_policy)

# The demo before this ablation: pi0.5 sees images and the prompt only (it has no state projection,
# and the state stayed out of the prompt), 64 px, the noisy executed actions recorded, no EMA.
MAIN_BEFORE = dict(preset="pi05-tiny", state_in_prompt=False, resolution=64, collect_labels="executed",
                   episodes_per_task=20, train_steps=2500, lr=1e-3, ema_decay=None, n_action_steps=5, model={},
                   frame_cache=False)

# The `make demo` recipe before the wide action expert (62 % of the expert at full scale).
NARROW = dict(model={})

# The `make demo` recipe of stops 54-55: MoE action expert, final weights, each step 3 packed rows of 4096 tokens.
MOE_FINAL = dict(ema_decay=None, model=PRESET_MODELS[DEMO_PRESET], token_budget=4096)

VARIANTS: dict[str, tuple[str, dict]] = {
    "before": ("main's demo recipe: pi0.5, no state input", MAIN_BEFORE),
    "state_token": ("pi0: the state as one continuous token", dict(MAIN_BEFORE, preset="pi0-tiny")),
    "state_prompt": ("pi0.5: the state as discretised prompt text", dict(MAIN_BEFORE, state_in_prompt=True)),
    "state_token_32px": ("pi0 with the state token, 32 px images", dict(MAIN_BEFORE, preset="pi0-tiny", resolution=32)),
    "more_demos": ("pi0, 32 px, 50 demonstrations per task",
                   dict(MAIN_BEFORE, preset="pi0-tiny", resolution=32, episodes_per_task=50)),
    "replan_2": ("pi0, 32 px, re-plan every 2 actions",
                 dict(MAIN_BEFORE, preset="pi0-tiny", resolution=32, n_action_steps=2)),
    "ema": ("pi0, 32 px, EMA weights (0.995) evaluated",
            dict(MAIN_BEFORE, preset="pi0-tiny", resolution=32, ema_decay=0.995)),
    "dart": ("pi0, 32 px, noise-free expert actions recorded (DART)",
             dict(MAIN_BEFORE, preset="pi0-tiny", resolution=32, collect_labels="expert")),
    "full": ("the recipe `make demo` runs", {}),
    # one field of the earlier `make demo` recipe (the preset's 32-wide action expert, 62 %) changed: does
    # more fitting per minute close the gap? wide_expert did, and is the recipe since
    "narrow_expert": ("the earlier make-demo recipe: the preset's action expert (32, MLP 64)", NARROW),
    "wide_expert": ("action expert 2x wider (64, MLP 256)", dict(NARROW, model=DENSE_MODEL)),
    "small_batch": ("half the tokens per step, twice the steps",
                    dict(NARROW, batch_tokens=6000, train_steps=2 * FULL.train_steps)),
    "lr_2e-3": ("learning rate 2e-3", dict(NARROW, lr=2e-3)),
    # issue 46: the EMA (decay 0.995, ~200 steps) trailed the final weights in 5 of 6 runs at 1000 steps
    "final_weights": ("the final weights evaluated, no EMA; the dense action expert",
                      dict(ema_decay=None, model=DENSE_MODEL)),
    "final_1500": ("the final weights, 1500 steps", dict(ema_decay=None, train_steps=1500, model=DENSE_MODEL)),
    # reach-v3's failures stop 5-7 cm from the goal, just outside its 5 cm radius: the demonstrations ended at
    # the first success, at that radius's edge
    "hold_10": ("the final weights; demonstrations run 10 steps past their first success",
                dict(ema_decay=None, collect_hold=10, model=DENSE_MODEL)),
    # stop 54: with the reach expert aiming its TCP at the goal, push-v3 (grasp misses, a puck lost on the way) is
    # the task left short; MoE at the dense demo's active width gained push 0-10 points at stop 52
    "moe_final": ("the final weights; MoE action expert (4 experts of 128, top 2): the demo's recipe at stops 54-55",
                  MOE_FINAL),
    # issue 46's time bar: training is ~half of the demo's wall time, and 1500 steps gained nothing over 1000 (stop 53)
    "moe_800": ("moe_final with 800 training steps", dict(MOE_FINAL, train_steps=800)),
    # the same tokens per step in one packed row instead of three: 1.2-1.6x the training steps per second
    "one_row": ("moe_final with each step one packed row of 12000 tokens (not 3 of 4096): the demo's recipe since stop 56",
                dict(MOE_FINAL, token_budget=12000)),
}


def seeded(recipe: DemoRecipe, seed: int) -> DemoRecipe:
    """The recipe `kilovla demo --seed=S` runs: demonstrations and training on S, evaluation on S + 1."""
    return recipe.replace(collect_seed=seed, train_seed=seed, eval_seed=seed + 1)


def _key(recipe: DemoRecipe, fields: tuple[str, ...]) -> str:
    values = {f: getattr(recipe, f) for f in fields}
    return hashlib.sha1(json.dumps(values, sort_keys=True, default=str).encode()).hexdigest()[:10]


DATA_FIELDS = ("tasks", "episodes_per_task", "collect_noise", "collect_labels", "collect_seed", "collect_hold",
               "resolution")  # not `workers`: the demonstrations are the same whatever the worker count
EVAL_FIELDS = ("n_action_steps", "eval_episodes", "eval_seed", "videos_per_task", "workers")


def _cpu_s() -> float:
    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def run_variant(name: str, recipe: DemoRecipe, out: Path) -> dict:
    data = out / "datasets" / _key(recipe, DATA_FIELDS)
    train_fields = tuple(f.name for f in dataclasses.fields(recipe) if f.name not in EVAL_FIELDS)
    run = out / "runs" / _key(recipe, train_fields)
    times, cpu = {}, {}

    def stage(label, fn):
        t, c = time.perf_counter(), _cpu_s()
        result = fn()
        times[label], cpu[label] = time.perf_counter() - t, _cpu_s() - c
        return result

    seeds_file = data / "demonstration_seeds.json"
    if not seeds_file.is_file():
        collected = stage("collect", lambda: collect_demonstrations(recipe, data))
        seeds_file.write_text(json.dumps(collected.seeds))
    seeds = json.loads(seeds_file.read_text())
    if recipe.frame_cache:  # as the demo does; a valid cache is kept, not decoded again
        stage("cache", lambda: build_demo_cache(data))
    summary_file = run / "summary.json"
    if not summary_file.is_file():
        stage("train", lambda: train_policy(recipe, data, run, progress=False))
    summary = json.loads(summary_file.read_text())
    learned, expert = stage("evaluate", lambda: evaluate_both(recipe, summary["checkpoint"], out / "evals" / name, seeds))
    row = {"name": name, "change": VARIANTS.get(name.partition("@")[0], ("", {}))[0], "recipe": dataclasses.asdict(recipe),
           "success": learned["overall_success_rate"], "ci95": learned["overall_success_ci95"],
           "expert": expert["overall_success_rate"],
           "per_task": {t: r["success_rate"] for t, r in learned["per_task"].items()},
           "final_loss": summary["final_loss"], "samples_per_s": summary["samples_per_s"],
           "wall_s": times, "cpu_s": cpu, "time": time.strftime("%Y-%m-%d %H:%M")}
    with (out / "ablation.jsonl").open("a") as f:
        f.write(json.dumps(row) + "\n")
    return row


def table(rows: list[dict]) -> str:
    tasks = list(rows[0]["per_task"]) if rows else []
    lines = ["| variant | change | success [95 % CI] | " + " | ".join(t.removesuffix("-v3") for t in tasks)
             + " | final loss | train min (CPU min) |", "|---" * (5 + len(tasks)) + "|"]
    for r in rows:
        train = r["wall_s"].get("train")
        cpu = r["cpu_s"].get("train")
        lines.append(f"| {r['name']} | {r['change']} | {r['success']:.0%} [{r['ci95'][0]:.0%}, {r['ci95'][1]:.0%}] | "
                     + " | ".join(f"{r['per_task'][t]:.0%}" for t in tasks) + f" | {r['final_loss']:.3f}"
                     + (f" | {train / 60:.1f} ({cpu / 60:.1f}) |" if train is not None else " | (reused) |"))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("variants", nargs="*", help=f"any of {', '.join(VARIANTS)}")
    p.add_argument("--out", default="ablation")
    p.add_argument("--steps", type=int, default=None, help="train steps of the base recipe (reduced scale)")
    p.add_argument("--eval-episodes", type=int, default=None)
    p.add_argument("--seeds", default=None, help="comma-separated: each variant once per seed (rows variant@S)")
    p.add_argument("--table", action="store_true", help="print the rows of OUT/ablation.jsonl as markdown")
    args = p.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    unknown = [v for v in args.variants if v not in VARIANTS]
    if unknown:
        p.error(f"unknown variants {unknown}; known: {', '.join(VARIANTS)}")
    for name in args.variants:
        recipe = FULL.replace(**VARIANTS[name][1])
        if args.steps:
            recipe = recipe.replace(train_steps=round(recipe.train_steps * args.steps / FULL.train_steps))
        if args.eval_episodes:
            recipe = recipe.replace(eval_episodes=args.eval_episodes)
        runs = [(name, recipe)] if args.seeds is None else \
            [(f"{name}@{s}", seeded(recipe, int(s))) for s in args.seeds.split(",")]
        for label, each in runs:
            row = run_variant(label, each, out)
            print(json.dumps({k: row[k] for k in ("name", "success", "ci95", "per_task", "wall_s", "cpu_s")}), flush=True)
    if args.table:
        rows = [json.loads(line) for line in (out / "ablation.jsonl").read_text().splitlines() if line.strip()]
        print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
