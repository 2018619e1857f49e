"""`kilovla demo`: the closed loop on an embedded default, no network, no flags.

    collect scripted demonstrations (Meta-World, the default task set, two cameras, noisy expert)
      -> train a tiny VLA with packing, dynamic padding and the unused camera pruned
      -> evaluate it closed-loop on seeds disjoint from the demonstrations', and the scripted
         expert on the same seeds
      -> two tables (success: learned policy vs scripted expert; the run's facts), and DIR/report.json,
         report.md, learning_curve.png, success_per_task.png and one video per task (eval-policy/videos/<task>/)

`DemoRecipe` holds every choice of the run; `FULL` is what `make demo` runs, chosen by the ablation
in docs/demo_ablation.md (`benchmarks/demo_ablation.py` re-runs it, one recipe field changed per
row). `QUICK` (`--quick`) is the minute-scale smoke run the tests use. Success rates carry 95 %
Wilson intervals: 20 episodes per task still leave a rate of 90 % uncertain by about +-10 points.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import shutil
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console
from rich.table import Table

from kilovla.config import load_config
from kilovla.data.meta import DatasetMeta
from kilovla.envs.collect import collect
from kilovla.envs.metaworld import DEFAULT_CAMERAS, DEFAULT_TASKS
from kilovla.errors import KilovlaError
from kilovla.eval.intervals import wilson_interval
from kilovla.eval.settings import EvalSettings
from kilovla.folders import DATASET, DEMO, DEMO_MARKER, RUN, check_replaceable, clear

log = logging.getLogger(__name__)

DEMO_PRESET = "pi0-tiny"
# The demo's model overrides by preset; a preset not named trains its own model. pi0-tiny: the action
# expert twice the preset's width (its MLP 4x), as its 32-wide expert under-fit (docs/demo_ablation.md,
# `wide_expert`: 62 % -> 95 % of the expert at the same step count): DENSE_MODEL, the demo's model until stop
# 54, which the benches and tests calibrated on it keep. Since then its MLPs are 4 routed experts of 128 with 2
# per token (the dense MLP's active width): push-v3 75 / 75 / 85 % -> 90 / 85 / 85 % on seeds 0-2, 95.3 % ->
# 97.3 % pooled (`moe_final` against `final_weights`, stop 54).
DENSE_MODEL = {"expert": {"width": 64, "mlp_dim": 256}}
PRESET_MODELS = {DEMO_PRESET: {**DENSE_MODEL, "moe": {"num_experts": 4, "top_k": 2, "expert_dim": 128}}}


@dataclass(frozen=True, kw_only=True, slots=True)
class DemoRecipe:
    """Every choice of a demo run: data, model, optimisation, evaluation."""

    tasks: tuple[str, ...] = DEFAULT_TASKS
    # data
    episodes_per_task: int = 20  # successful scripted demonstrations recorded per task
    collect_noise: float = 0.1  # std of the Gaussian noise on the expert's actions while recording
    collect_labels: str = "expert"  # the action recorded: "executed" (noisy) or "expert" (noise-free, DART)
    collect_seed: int = 0
    collect_hold: int = 0  # steps each demonstration runs past its first success (the expert settling into the goal)
    resolution: int = 32  # both cameras, pixels
    # decode the demonstrations' videos once into a frame cache (data/frame_cache.py) before training:
    # bit-identical frames, and the ~12 epochs of training stop decoding on the training cores. False
    # builds none; training still reads a valid one that is already there
    frame_cache: bool = True
    # model: a preset plus config overrides; packing, dynamic padding and the pruning of the model's camera
    # slots past the env's two are always on (they change speed, not the result: the equivalence tests say so)
    preset: str = DEMO_PRESET  # pi0 reads the state as one continuous token; pi0.5 only as prompt text
    # model config overrides. None (the default): PRESET_MODELS[preset], i.e. the wide expert with pi0-tiny,
    # and with any other preset none (its own model). A dict replaces that choice whole: keep the "expert"
    # entry when changing e.g. "vision" on pi0-tiny (`kilovla demo --policy.overrides.*` merges into
    # `preset_model()` instead)
    model: dict | None = None
    state_in_prompt: bool = False  # pi0.5 reads the state only as discretised prompt text
    chunk_size: int = 10  # actions predicted per inference
    n_action_steps: int = 5  # of them executed before re-planning
    augmentation: dict | None = None  # ImageAugmentation fields; None: the preset's (none for tiny presets)
    # optimisation
    train_steps: int = 1000
    batch_tokens: int = 12000  # tokens per optimizer step (~180 samples at 32 px, ~75 at 64 px)
    # tokens per packed row: a step is batch_tokens in rows of at most this many. One row per step computes the same
    # step in a third of the calls: 1.2-1.6x the steps per second of 3 rows of 4096 on 2 cores, and 99 / 97 / 98 %
    # on seeds 0-2 against 98 / 97 / 97 % (docs/demo_ablation.md, `one_row`, stop 56)
    token_budget: int = 12000
    lr: float = 1e-3
    warmup_steps: int = 50
    min_lr_ratio: float = 0.1  # cosine decay to lr * this at the last step
    # evaluate the EMA of the weights instead of the last weights; None: the last weights, which beat the EMA (0.995)
    # in 5 of 6 three-seed runs at 1000 steps (docs/demo_ablation.md, stop 52)
    ema_decay: float | None = None
    # evaluation
    eval_episodes: int = 20  # per task, for the policy and for the expert
    eval_seed: int = 1  # closed_loop.episode_seeds(eval_seed, ...): disjoint from the collection seeds
    train_seed: int = 0  # the training run's seed (model init, sampling order)
    videos_per_task: int = 1
    # env processes: one per env stepped together (5), which the OS spreads over the cores; 2 workers held 3 and 2
    # envs, so one core idled a third of every step. Collection 104-107 -> 92 s on 2 cores back to back, 105.9 ->
    # 105.1 s in a paired demo run; the same demonstrations and evaluation (every env is seeded per episode, whatever
    # process it is in; on 2 cores the policy keeps one torch thread either way)
    workers: int = 5

    def replace(self, **changes) -> DemoRecipe:
        return dataclasses.replace(self, **changes)

    def preset_model(self) -> dict:
        """`model`, or where it is None the demo's choice for the preset (PRESET_MODELS, else none)."""
        return PRESET_MODELS.get(self.preset, {}) if self.model is None else self.model

    def evaluation(self) -> EvalSettings:
        """The closed loop both the learned policy and the scripted expert are evaluated on (videos: the
        learned policy's)."""
        return EvalSettings(tasks=self.tasks, episodes=self.eval_episodes, seed=self.eval_seed, batch_size=5,
                            resolution=self.resolution, workers=self.workers, n_action_steps=self.n_action_steps,
                            videos=self.videos_per_task)


FULL = DemoRecipe()
QUICK = DemoRecipe(tasks=("reach-v3", "drawer-close-v3"), episodes_per_task=3, resolution=32, train_steps=30,
                   eval_episodes=2, workers=0)


def train_overrides(recipe: DemoRecipe, data: Path, run: Path, progress: bool) -> list[str]:
    """The recipe as `kilovla train` flags (dotted overrides of TrainConfig)."""
    flags = [
        f"--run_dir={run}", f"--seed={recipe.train_seed}", f"--steps={recipe.train_steps}", f"--dataset.roots=[{data}]",
        # Steps fixed in tokens, so that packed rows come out full (one row per step: token_budget = batch_tokens).
        f"--batch.global_batch_tokens={recipe.batch_tokens}", f"--batch.token_budget={recipe.token_budget}",
        f"--checkpoint.every={recipe.train_steps}", f"--policy.preset={recipe.preset}",
        f"--policy.overrides={json.dumps(model_overrides(recipe))}",
        "--policy.state_keys=[observation.state, observation.environment_state]",
        f"--policy.state_in_prompt={str(recipe.state_in_prompt).lower()}",
        f"--policy.n_action_steps={recipe.n_action_steps}", f"--optim.lr={recipe.lr}",
        f"--optim.warmup_steps={recipe.warmup_steps}", f"--optim.min_lr_ratio={recipe.min_lr_ratio}",
        f"--progress={str(progress).lower()}",
    ]
    if recipe.ema_decay:
        flags.append(f"--ema_decay={recipe.ema_decay}")
    if recipe.augmentation is not None:
        flags.append(f"--policy.augmentation={json.dumps(recipe.augmentation)}")
    return flags


def model_overrides(recipe: DemoRecipe) -> dict:
    """The demo's fixed model settings (the env's two cameras, packing, dynamic padding), written by the
    preset's family as its config's keys, under the recipe's `preset_model()`; a nested config's
    settings (vision's image size) merge with the recipe's entry for it, and come last (as the flags
    always had them: pi0-tiny's are unchanged byte for byte)."""
    from kilovla.models.family import ModelSettings, family_of
    from kilovla.models.presets import preset

    config = preset(recipe.preset)
    settings = ModelSettings(
        chunk_length=recipe.chunk_size, max_state_dim=48, image_size=recipe.resolution, cameras=len(DEFAULT_CAMERAS),
        packing=True, language_padding="longest",
        # ~4 bytes per state dimension: 43 dimensions need ~200 prompt tokens
        language_tokens=256 if recipe.state_in_prompt else None)
    fixed, mine = family_of(config).overrides(config, settings), recipe.preset_model()
    model = {k: v for k, v in fixed.items() if not isinstance(v, dict)} | mine
    for key, value in fixed.items():
        if isinstance(value, dict):
            model[key] = {**value, **model.get(key, {})}
    return model


def check_recipe(recipe: DemoRecipe, out: Path) -> None:
    """Refuse a recipe the run would refuse later, before anything is collected or written: its tasks,
    the seeds collection and evaluation would use, and the training config as `kilovla train` checks it
    (preset, every model override's key and type; no weights are built)."""
    from kilovla.envs.base import env_type
    from kilovla.envs.seeds import collect_seed, eval_seeds
    from kilovla.train.config import TrainConfig, validate_config

    env_type("metaworld").check_tasks(list(recipe.tasks))  # what collect() runs
    last = len(recipe.tasks) - 1
    collect_seed(recipe.collect_seed, last, 3 * recipe.episodes_per_task - 1)  # collect's last possible try
    eval_seeds(recipe.eval_seed, last, recipe.eval_episodes)
    validate_config(load_config(TrainConfig, None, train_overrides(recipe, out / "dataset", out / "run", False)))


def collect_demonstrations(recipe: DemoRecipe, data: Path):
    from kilovla.eval.closed_loop import task_progress

    progress, update = task_progress("collect")
    with progress:
        return collect(data, tasks=list(recipe.tasks), episodes_per_task=recipe.episodes_per_task,
                       resolution=recipe.resolution, noise_std=recipe.collect_noise, seed=recipe.collect_seed,
                       labels=recipe.collect_labels, batch_size=5, num_workers=recipe.workers, overwrite=True,
                       success_hold=recipe.collect_hold, progress=update)


def build_demo_cache(data: Path):
    """The demonstrations' frame cache, at the place training looks for it (`frame_cache="auto"`); a
    re-run over a re-collected dataset re-decodes what changed. None, with one warning line, where the
    cache cannot be built (an unwritable cache folder, a folder of other files): training then
    decodes the videos, as it would without a cache."""
    from kilovla.data.frame_cache import build_frame_cache

    try:
        return build_frame_cache(data, engine="local")  # 32-64 px decodes in seconds: Ray's start-up would not pay
    except (OSError, KilovlaError) as e:
        log.warning("frame cache not built (%s); training decodes the videos", e)
        return None


def train_policy(recipe: DemoRecipe, data: Path, run: Path, progress: bool = True) -> dict:
    from kilovla.train.trainer import TrainConfig, train

    clear(run, RUN)  # the demo's own run: replaced on every demo, checked to hold nothing else
    return train(load_config(TrainConfig, None, train_overrides(recipe, data, run, progress)))


def evaluate_both(recipe: DemoRecipe, checkpoint: str, out: Path, train_seeds: dict[str, list[int]]) -> tuple[dict, dict]:
    """The learned policy (with videos) and, beside it in a process of its own, the scripted expert (state only: it
    renders nothing) on the same seeds, which must not be seeds the demonstrations were recorded on."""
    from kilovla.eval.closed_loop import Beside, episode_seeds, evaluate, load_policy, task_progress

    tasks = list(recipe.tasks)
    for t, task in enumerate(tasks):
        shared = set(episode_seeds(recipe.eval_seed, t, recipe.eval_episodes)) & set(train_seeds.get(task, ()))
        if shared:
            raise KilovlaError(f"{task}: evaluation seeds {sorted(shared)[:5]} were also demonstration seeds; "
                               "choose another eval_seed")
    settings = recipe.evaluation()
    # the expert in a process of its own with its envs (no workers), beside the policy's evaluation: ~10 s of one
    # core, which the policy's one-thread inference leaves idle while the env workers wait for it
    with Beside("scripted", dataclasses.replace(settings, videos=0, workers=0), out / "eval-expert",
                "eval expert") as scripted:
        progress, update = task_progress("eval policy")
        with progress:
            learned = evaluate(load_policy(checkpoint, ema=bool(recipe.ema_decay)), settings,
                               out_dir=out / "eval-policy", progress=update, label="eval policy")
        expert = scripted.result()
    return learned, expert


def run_demo(out_dir: str | Path = "demo-output", quick: bool = False, recipe: DemoRecipe | None = None) -> dict:
    """Run the demo; returns the report (also DIR/report.json). Its timings and rates, each one figure:
    `wall_s` the whole command (up to writing the report), `phase_wall_s` each phase's (collect,
    frame_cache, train, evaluate, report); `train.samples_per_s` every training sample over the
    trainer's wall time (set-up and checkpoint included, as `kilovla train`'s summary.json), beside
    `train.step_samples_per_s`, the median step's rate (the progress bar shows the latest step's);
    `train.padding_fraction` the computed token positions that are padding, `train.budget_unused_fraction`
    the packed rows' token budget left empty."""
    from kilovla.machine import machine_info

    t0 = time.perf_counter()
    recipe = recipe or (QUICK if quick else FULL)
    out = Path(out_dir)
    check_recipe(recipe, out)
    # The demo owns its output folder: it replaces an earlier demo's, never a folder of other files.
    check_replaceable(out, DEMO)
    check_replaceable(out / "dataset", DATASET)
    check_replaceable(out / "run", RUN)
    made = not out.exists()
    out.mkdir(parents=True, exist_ok=True)
    (out / DEMO_MARKER).write_text("written by `kilovla demo`: it replaces this folder's contents on every run\n")
    console = Console(width=max(Console().width, 100))
    phase_s = {}

    console.rule("1/4 collect scripted demonstrations")
    data = out / "dataset"
    try:
        collected = collect_demonstrations(recipe, data)  # a refusal removes its staging folder (DatasetWriter.abort)
    except BaseException:
        if made:  # and then the folder this run made, holding nothing but the marker
            (out / DEMO_MARKER).unlink(missing_ok=True)
            with contextlib.suppress(OSError):
                out.rmdir()
        raise
    info = DatasetMeta(data).summary()
    phase_s["collect"] = time.perf_counter() - t0
    cache = None
    if recipe.frame_cache:
        t = time.perf_counter()
        cache = build_demo_cache(data)
        phase_s["frame_cache"] = time.perf_counter() - t
    if cache is not None:
        console.print(f"frame cache: {cache.path}, {cache.frames} frames ({cache.decoded} of {cache.parts} parts "
                      f"decoded now, the rest unchanged; {cache.cache_bytes / 2**20:.0f} MiB, "
                      f"{phase_s['frame_cache']:.0f} s); training reads it")

    console.rule(f"2/4 train {recipe.preset} with packing")
    t = time.perf_counter()
    summary = train_policy(recipe, data, out / "run")
    phase_s["train"] = time.perf_counter() - t

    console.rule("3/4 closed-loop evaluation (the policy, and beside it the scripted expert on the same seeds)")
    t = time.perf_counter()
    learned, expert = evaluate_both(recipe, summary["checkpoint"], out, collected.seeds)
    phase_s["evaluate"] = time.perf_counter() - t

    console.rule("4/4 report")
    t = time.perf_counter()
    report = build_report(recipe, out, collected, info, summary, learned, expert, quick=quick)
    report["frame_cache"] = None if cache is None else {"path": str(cache.path), "bytes": cache.cache_bytes,
                                                        "video_bytes": cache.video_bytes}
    report["machine"] = machine_info()
    phase_s["report"] = time.perf_counter() - t
    report["phase_wall_s"] = phase_s
    report["wall_s"] = time.perf_counter() - t0
    write_report(out, report)
    print_table(console, report)
    return report


def build_report(recipe: DemoRecipe, out: Path, collected, info: dict, summary: dict, learned: dict, expert: dict,
                 quick: bool) -> dict:
    tasks = list(recipe.tasks)
    per_task = {}
    for task in tasks:
        p, e = learned["per_task"][task], expert["per_task"][task]
        per_task[task] = {"policy": p["success_rate"], "expert": e["success_rate"],
                          "policy_ci95": p["success_ci95"], "expert_ci95": e["success_ci95"],
                          "episodes": p["episodes"]}
    policy_rate, expert_rate = learned["overall_success_rate"], expert["overall_success_rate"]
    videos = {task: str(v.relative_to(out)) for task in tasks
              for v in sorted((out / "eval-policy" / "videos" / task).glob("*.mp4"))[:1]}
    if Path(summary.get("plot") or "").is_file():
        shutil.copy(summary["plot"], out / "learning_curve.png")
    return {
        "tasks": tasks,
        "policy_success_rate": policy_rate,
        "expert_success_rate": expert_rate,
        "policy_success_ci95": learned["overall_success_ci95"],
        "expert_success_ci95": expert["overall_success_ci95"],
        "relative_success": policy_rate / expert_rate if expert_rate else None,
        "per_task": per_task,
        "dataset": {"root": str(out / "dataset"), "episodes": info["episodes"], "frames": info["frames"],
                    "size_bytes": info["size_bytes"], "dropped_episodes": sum(collected.dropped.values())},
        "train": {"steps": summary["steps"], "samples_per_s": summary["samples_per_s"],
                  "step_samples_per_s": summary["step_samples_per_s"],
                  "padding_fraction": summary["padding_fraction"],
                  "budget_unused_fraction": summary["budget_unused_fraction"], "final_loss": summary["final_loss"],
                  "data_wait_fraction": summary["data_wait_fraction"], "wall_s": summary["wall_s"],
                  "frames_from_cache": summary["frames_from_cache"],
                  "checkpoint": summary["checkpoint"]},
        "evaluation": {"episodes_per_task": recipe.eval_episodes, "seed": recipe.eval_seed,
                       "seeds": {t: learned["per_task"][t]["seeds"] for t in tasks},
                       "demonstration_seeds": collected.seeds, "disjoint": True},
        "files": {"learning_curve": "learning_curve.png" if (out / "learning_curve.png").is_file() else None,
                  "success_chart": plot_success(out / "success_per_task.png", per_task, policy_rate, expert_rate,
                                                learned["overall_success_ci95"], expert["overall_success_ci95"]),
                  "videos": videos},
        "recipe": {**{k: getattr(recipe, k) for k in (f.name for f in dataclasses.fields(recipe))},
                   "model": recipe.preset_model()},
        "env_backend": learned["env_backend"],
        "quick": quick,
    }


def plot_success(path: Path, per_task: dict, policy: float, expert: float, policy_ci, expert_ci) -> str:
    """Grouped bars, learned policy vs scripted expert per task and overall, with 95 % Wilson intervals."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    names = [*per_task, "overall"]
    rows = [*per_task.values(), {"policy": policy, "expert": expert, "policy_ci95": policy_ci, "expert_ci95": expert_ci}]
    x = np.arange(len(names))
    fig, ax = plt.subplots(figsize=(8, 4))
    for offset, who, colour in ((-0.2, "policy", "tab:blue"), (0.2, "expert", "tab:gray")):
        rates = np.array([r[who] for r in rows])
        ci = np.array([r[f"{who}_ci95"] for r in rows])
        ax.bar(x + offset, rates, 0.4, color=colour, label="learned policy" if who == "policy" else "scripted expert",
               yerr=[rates - ci[:, 0], ci[:, 1] - rates], capsize=3)
    ax.axhline(0.9 * expert, ls="--", lw=1, color="tab:red", label="90 % of the expert")
    ax.set_xticks(x, [n.removesuffix("-v3") for n in names], rotation=20)
    ax.set_ylim(0, 1.05)
    ax.set_ylabel("success rate (95 % Wilson)")
    ax.legend(loc="lower center", bbox_to_anchor=(0.5, 1.0), ncol=3, fontsize=8, frameon=False)
    fig.tight_layout()
    tmp = path.with_name(f".{path.stem}.{uuid.uuid4().hex[:6]}.png")
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    os.replace(tmp, path)
    return path.name


def _rate(rate, ci) -> str:
    return "-" if rate is None else f"{rate:.0%} [{ci[0]:.0%}, {ci[1]:.0%}]"


def _seconds(s: float) -> str:
    return f"{s:.0f} s" if s < 120 else f"{s / 60:.1f} min"


SUCCESS_COLUMNS = ("task", "learned policy", "scripted expert")


def success_rows(report: dict) -> list[tuple[str, str, str]]:
    """The results, one row per task then "overall", in SUCCESS_COLUMNS: success rate [95 % Wilson interval]
    of the learned policy and of the scripted expert on the same seeds. Nothing else goes in these columns.

    e.g. ("reach-v3 (20 episodes)", "95% [76%, 99%]", "100% [84%, 100%]") for 19 and 20 successes of 20.
    """
    n = report["evaluation"]["episodes_per_task"]
    rows = [(f"{task} ({n} episodes)", _rate(r["policy"], r["policy_ci95"]), _rate(r["expert"], r["expert_ci95"]))
            for task, r in report["per_task"].items()]
    rows.append(("overall", _rate(report["policy_success_rate"], report["policy_success_ci95"]),
                 _rate(report["expert_success_rate"], report["expert_success_ci95"])))
    return rows


def run_facts(report: dict) -> list[tuple[str, str]]:
    """How the run went, as (name, value): the dataset, training (one throughput figure: every sample over
    the trainer's wall time, set-up included, i.e. report["train"]["samples_per_s"]; the progress bar
    shows the latest step's rate instead), padding, data wait, the wall time of each phase and in all, the machine.

    e.g. ("wall time", "collect 12 s, frame cache 2 s, train 5 s, evaluate 31 s, report 1 s; total 51 s").
    """
    d, tr = report["dataset"], report["train"]
    facts = [("dataset", f"{d['episodes']} episodes, {d['frames']} frames, {d['size_bytes'] / 2**20:.1f} MiB"),
             ("training", f"{tr['steps']} steps, final loss {tr['final_loss']:.3f}, frames read from "
                          + ("a decoded-frame cache" if tr.get("frames_from_cache") else "the videos")),
             ("training samples/s (all samples / training wall time, set-up included)", f"{tr['samples_per_s']:.0f}"),
             ("padding (of the token positions computed)", f"{tr['padding_fraction']:.1%}")]
    if "budget_unused_fraction" in tr:
        facts.append(("packed rows' unused token budget", f"{tr['budget_unused_fraction']:.1%}"))
    facts.append(("data wait (of step time)", f"{tr['data_wait_fraction']:.1%}"))
    phases = report.get("phase_wall_s", {})
    facts.append(("wall time", ", ".join(f"{k.replace('_', ' ')} {_seconds(v)}" for k, v in phases.items())
                  + ("; " if phases else "") + f"total {_seconds(report['wall_s'])}"))
    machine = report.get("machine")
    if machine:
        facts.append(("machine", f"{machine['cpu']}, {machine['cores']} cores"))
    return facts


def print_table(console: Console, report: dict) -> None:
    """Two tables: the success rates (learned policy vs scripted expert), then the run's facts (name, value)."""
    results = Table(title="kilovla demo: collect -> train -> evaluate (Meta-World)",
                    caption="95 % Wilson intervals in brackets; evaluation seeds are disjoint from the "
                            "demonstrations'.")
    for i, name in enumerate(("what", *SUCCESS_COLUMNS[1:])):
        results.add_column(name, justify="right" if i else "left")
    rows = [(f"success {what}", policy, expert) for what, policy, expert in success_rows(report)]
    for row in rows[:-1]:
        results.add_row(*row)
    results.add_section()
    results.add_row(*rows[-1])
    console.print(results)
    if report["relative_success"] is not None:
        console.print(f"The learned policy reaches {report['relative_success']:.0%} of the scripted expert's success.")
    facts = Table(title="the run")
    facts.add_column("what")
    facts.add_column("value")
    for name, value in run_facts(report):
        facts.add_row(name, value)
    console.print(facts)


def report_markdown(report: dict) -> str:
    ev = report["evaluation"]
    lines = ["# kilovla demo", "",
             f"{report['env_backend']}. {ev['episodes_per_task']} evaluation episodes per task on seeds disjoint "
             "from the demonstrations' (success rate [95 % Wilson interval]).", "",
             f"| {' | '.join(SUCCESS_COLUMNS)} | video |", "|---|---|---|---|"]
    videos = report["files"]["videos"]
    for task, (name, policy, expert) in zip(report["per_task"], success_rows(report)):
        video = videos.get(task)
        lines.append(f"| {name} | {policy} | {expert} | " + (f"[mp4]({video})" if video else "-") + " |")
    name, policy, expert = success_rows(report)[-1]
    lines.append(f"| **{name}** | **{policy}** | **{expert}** | |")
    if report["relative_success"] is not None:
        lines += ["", f"The learned policy reaches **{report['relative_success']:.0%}** of the expert's success."]
    lines += ["", "| the run | |", "|---|---|", *(f"| {name} | {value} |" for name, value in run_facts(report)), ""]
    if report["files"]["success_chart"]:
        lines += [f"![success per task]({report['files']['success_chart']})", ""]
    if report["files"]["learning_curve"]:
        lines += [f"![learning curve]({report['files']['learning_curve']})", ""]
    return "\n".join(lines)


def write_report(out: Path, report: dict) -> None:
    for name, text in (("report.json", json.dumps(report, indent=2)), ("report.md", report_markdown(report))):
        tmp = out / f".{name}.{uuid.uuid4().hex[:8]}"
        tmp.write_text(text)
        os.replace(tmp, out / name)
