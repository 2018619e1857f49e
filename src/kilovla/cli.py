"""`kilovla <command>`: one entry point; each command parses its flags and calls one function.

Bad input (a KilovlaError) prints one line and exits 2; anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import sys
from pathlib import Path

# Before torch loads (it reads this once): CPU tensors of 2 MB and more go on transparent huge pages. A
# step's fresh gradient of a wide layer is otherwise page-faulted in 4 KB at a time: at E=8 experts of
# width 1024 that was a fifth of a CPU training step (`kilovla bench moe`). Linux only; elsewhere ignored.
os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")

from kilovla.bench.common import SUITES
from kilovla.errors import KilovlaError


def _console():
    from rich.console import Console

    return Console(width=max(Console().width, 120))


# -- kilovla data ... ------------------------------------------------------------------------------
def cmd_data_info(args) -> int:
    from rich.table import Table

    from kilovla.data.meta import DatasetMeta

    cfg = args.cfg  # cli_config.DataInfoCommand
    info = DatasetMeta(cfg.dataset.root).summary()
    if cfg.json:
        print(json.dumps(info, indent=2))
        return 0
    table = Table(title=f"{info['root']} (LeRobot {info['codebase_version']})", show_header=False)
    for key in ("episodes", "frames", "fps", "robot_type"):
        table.add_row(key, str(info[key]))
    table.add_row("video_codec", ", ".join(info["video_codec"]) or "-")  # one per camera kind; JSON keeps the list
    table.add_row("size on disk", f"{info['size_bytes'] / 2**20:.1f} MiB")
    table.add_row("cameras", ", ".join(info["cameras"]) or "-")
    table.add_row("tasks", f"{len(info['tasks'])}: " + "; ".join(info["tasks"][:5]) + (" ..." if len(info["tasks"]) > 5 else ""))
    for name, f in info["features"].items():
        table.add_row(f"  {name}", f"{f['dtype']} {f['shape']}")
    _console().print(table)
    return 0


def cmd_data_validate(args) -> int:
    from kilovla.data.validate import validate_dataset

    root = args.cfg.dataset.root  # cli_config.DataValidateCommand
    if args.cfg.deep:  # decoding every frame takes a while on a real dataset
        from kilovla.progress import CountProgress

        with CountProgress("data validate: episodes decoded", stream=sys.stderr) as progress:
            problems = validate_dataset(root, deep=True, progress=progress.callback)
    else:
        problems = validate_dataset(root)
    for p in problems:
        _say_error(p)
    if problems:
        return 2
    print(f"{root}: valid")
    return 0


def cmd_data_stats(args) -> int:
    from rich.table import Table

    from kilovla.data.lerobot import LeRobotDataset
    from kilovla.data.stats import compute_dataset_stats, stats_to_json
    from kilovla.data.validate import check_dataset
    from kilovla.data.writer import _atomic_write_text

    root = args.cfg.dataset.root  # cli_config.DataStatsCommand
    check_dataset(root, stats=False)  # the stats it is about to rewrite may be what is wrong
    ds = LeRobotDataset(root)
    stats = compute_dataset_stats(ds)
    table = Table(title=f"normalisation stats of {root}")
    for col in ("feature", "count", "mean", "std", "q01", "q99"):
        table.add_column(col)
    for key, st in stats.items():
        fmt = lambda v: " ".join(f"{x:.3g}" for x in v.ravel()[:4]) + (" ..." if v.size > 4 else "")  # noqa: E731
        table.add_row(key, str(int(st["count"][0])), fmt(st["mean"]), fmt(st["std"]), fmt(st["q01"]), fmt(st["q99"]))
    _console().print(table)
    if not args.cfg.dry_run:
        text = json.dumps(stats_to_json(stats), indent=4, allow_nan=False)  # strict JSON: no NaN reaches here
        _atomic_write_text(Path(root) / "meta" / "stats.json", text)
        print(f"wrote {root}/meta/stats.json")
    return 0


def cmd_data_convert(args) -> int:
    from kilovla.data.writer import convert_v21_to_v30

    cfg = args.cfg  # cli_config.DataConvertCommand
    out = convert_v21_to_v30(cfg.dataset.root, cfg.output_dir, overwrite=cfg.overwrite)
    print(f"converted {cfg.dataset.root} (v2.1) -> {out} (v3.0)")
    return 0


def cmd_data_synth(args) -> int:
    from kilovla.data.synthetic import check_synthetic_args, make_synthetic_dataset
    from kilovla.data.writer import check_dataset_destination
    from kilovla.progress import CountProgress

    from kilovla.cli_config import typed

    cfg = args.cfg  # cli_config.DataSynthCommand
    shape = dict(episodes=cfg.episodes, frames=(cfg.min_frames, cfg.max_frames), fps=cfg.fps,
                 cameras=tuple(cfg.cameras.split(",")), resolution=(cfg.resolution, cfg.resolution), codec=cfg.codec)
    spelt = getattr(args, "_spelt", {})
    # before the progress lines start: bad flags are one line, naming each flag as typed
    check_synthetic_args(**shape, shown=lambda key, value: typed(spelt, key, f"--{key}={value}"))
    check_dataset_destination(cfg.output_dir, cfg.overwrite)
    with CountProgress("data synth: episodes written", total=cfg.episodes) as progress:
        out = make_synthetic_dataset(cfg.output_dir, **shape, seed=cfg.seed, overwrite=cfg.overwrite,
                                     progress=progress.callback)
    print(f"wrote {out}")
    return 0


def cmd_data_cache(args) -> int:
    from rich.table import Table

    from kilovla.data.frame_cache import build_frame_cache
    from kilovla.progress import CountProgress

    cfg = args.cfg  # cli_config.DataCacheCommand
    with CountProgress("data cache: episodes decoded", stream=sys.stderr if cfg.json else None) as progress:
        result = build_frame_cache(cfg.dataset.root, cfg.output_dir,
                                   cameras=cfg.cameras.split(",") if cfg.cameras else None, backend=cfg.backend,
                                   engine="local" if cfg.local else "auto", ray_address=cfg.ray_address,
                                   progress=progress.callback)
    summary = {"cache": str(result.path), "parts": result.parts, "decoded_now": result.decoded,
               "frames": result.frames, "cache_bytes": result.cache_bytes, "video_bytes": result.video_bytes,
               "engine": result.engine}
    if cfg.json:
        print(json.dumps(summary, indent=2))
        return 0
    table = Table(title=f"frame cache of {cfg.dataset.root}", show_header=False)
    table.add_row("cache", summary["cache"])
    table.add_row("parts (camera x episode)", f"{result.parts} ({result.decoded} decoded now, "
                  f"{result.parts - result.decoded} still valid)")
    table.add_row("frames", str(result.frames))
    table.add_row("size on disk", f"{result.cache_bytes / 2**20:.1f} MiB = "
                  f"{result.cache_bytes / max(result.video_bytes, 1):.1f}x the videos ({result.video_bytes / 2**20:.1f} MiB)")
    table.add_row("engine", result.engine)
    _console().print(table)
    return 0


def cmd_data_bench(args) -> int:
    from kilovla.bench import data as data_bench
    from kilovla.bench.common import suite_started
    from kilovla.folders import check_output_folder
    from kilovla.progress import Heartbeat

    cfg = args.cfg  # cli_config.DataBenchCommand
    check_output_folder(cfg.output_dir, "--output_dir")
    suite_started("data")
    with Heartbeat("data bench"):
        path = data_bench.run(quick=cfg.quick, out_dir=cfg.output_dir, dataset=cfg.dataset.root,
                              world_size=cfg.world_size, frame_cache=cfg.frame_cache)
    print(f"wrote {path}")
    return 0


# -- kilovla bench ... -----------------------------------------------------------------------------


def cmd_bench(args) -> int:
    from kilovla.bench import data as data_bench
    from kilovla.bench import elastic as elastic_bench
    from kilovla.bench import envs as envs_bench
    from kilovla.bench import fp8 as fp8_bench
    from kilovla.bench import lake as lake_bench
    from kilovla.bench import load as load_bench
    from kilovla.bench import memory as memory_bench
    from kilovla.bench import models as models_bench
    from kilovla.bench import rl as rl_bench
    from kilovla.bench import scaling as scaling_bench
    from kilovla.bench import serve as serve_bench
    from kilovla.cli_config import check_bench_keys
    from kilovla.folders import check_output_folder

    cfg = args.cfg  # cli_config.BenchCommand
    check_bench_keys(args)
    if args.suite == "table":
        return cmd_bench_table(cfg)
    check_output_folder(cfg.output_dir, "--output_dir")
    common = dict(quick=cfg.quick, out_dir=cfg.output_dir)
    runners = {
        "data": lambda: data_bench.run(**common, world_size=cfg.world_size),
        "lake": lambda: lake_bench.run(**common),
        "envs": lambda: envs_bench.run(**common),
        "packing": lambda: models_bench.run_packing(**common),
        "pruning": lambda: models_bench.run_pruning(**common),
        "moe": lambda: models_bench.run_moe(**common),
        "scaling": lambda: scaling_bench.run(**common),
        "elastic": lambda: elastic_bench.run(**common),
        "load": lambda: load_bench.run(**common),
        "memory": lambda: memory_bench.run(**common),
        "rl": lambda: rl_bench.run(**common, policy=cfg.policy.path, minutes=cfg.rl.minutes,
                                   env_steps=cfg.rl.env_steps, only=cfg.rl.only),
        "fp8": lambda: fp8_bench.run(**common, policy=cfg.policy.path, dataset=cfg.fp8.dataset,
                                     episodes=cfg.fp8.episodes, resolution=cfg.fp8.resolution),
        "serve": lambda: serve_bench.run(**common, policy=cfg.policy.path),
    }
    suites = list(SUITES) if args.suite == "all" else [args.suite]
    from kilovla.bench.common import suite_started
    from kilovla.progress import Heartbeat

    for suite in suites:
        suite_started(suite)
        with Heartbeat(f"bench {suite}"):  # off a terminal: a line at least every 10 s, one per row measured
            path = runners[suite]()
        print(f"wrote {path}")
    if args.suite == "all":
        from kilovla.bench.common import write_results

        print("wrote {} and {}".format(*write_results(cfg.output_dir, suites)))
    return 0


def cmd_bench_table(cfg) -> int:
    """`kilovla bench table DIR_OR_JSON [--readme=README.md]`: the suites' JSON as markdown tables."""
    from kilovla.bench.common import render_tables, update_readme

    if not cfg.results:
        raise KilovlaError("bench table: give a <suite>.json or a folder of them (the positional path or "
                           "--results), e.g. bench-results")
    tables = render_tables(cfg.results)
    if cfg.readme:
        changed = update_readme(cfg.readme, tables)
        print(f"{cfg.readme}: {'tables updated' if changed else 'tables already current'}")
    else:
        print(tables)
    return 0


# -- kilovla collect / eval ------------------------------------------------------------------------
def cmd_collect(args) -> int:
    from kilovla.envs.collect import check_collect, collect
    from kilovla.eval.closed_loop import task_progress

    cfg = args.cfg  # cli_config.CollectCommand
    if cfg.output_dir is None:
        raise KilovlaError("collect: give --output_dir=DIR, the dataset folder to write")
    tasks, c = cfg.env.tasks(), cfg.collect
    cameras = cfg.env.camera_tuple() or ("scene", "wrist")
    check_collect(cfg.output_dir, env=cfg.env.type, tasks=tasks, episodes_per_task=c.n_episodes, cameras=cameras,
                  seed=c.seed, max_steps=cfg.env.max_steps, labels=c.labels, overwrite=c.overwrite)  # then announce
    progress, update = task_progress("collect")
    with progress:
        report = collect(cfg.output_dir, env=cfg.env.type, tasks=tasks, episodes_per_task=c.n_episodes,
                         cameras=cameras, resolution=cfg.env.resolution or 96,
                         noise_std=c.noise, seed=c.seed, max_steps=cfg.env.max_steps, batch_size=c.batch_size,
                         num_workers=c.workers, labels=c.labels, overwrite=c.overwrite, progress=update)
    for task in tasks:
        print(f"{task}: kept {report.kept[task]}, dropped {report.dropped[task]} failed episodes")
    print(f"wrote {report.root} ({report.frames} frames)")
    return 0


def cmd_eval(args) -> int:
    from kilovla.eval.closed_loop import check_evaluation, evaluate, load_policy, new_output_dir, task_progress
    from kilovla.folders import check_new_evaluation

    cfg = args.cfg  # cli_config.EvalCommand
    tasks = cfg.env.tasks()
    if cfg.output_dir is not None:  # a folder the user named: never overwrite an evaluation in it
        check_new_evaluation(cfg.output_dir, flag=_spelling(args, "--out", "--output_dir"))
    policy = load_policy(cfg.policy.path, env=cfg.env.type, seed=cfg.eval.seed, ema=cfg.policy.ema)
    settings = cfg.eval.settings(cfg.env, tasks)
    check_evaluation(policy, settings)  # tasks, cameras, fit: refused before a folder is announced
    root = Path("eval-output")
    root_made = cfg.output_dir is None and not root.exists()  # this run makes it: a refusal removes it again
    out = cfg.output_dir if cfg.output_dir is not None else new_output_dir(
        root, cfg.env.type, getattr(policy, "source", None) or cfg.policy.path)
    print(f"eval: report and videos go to {out}", flush=True)
    progress, update = task_progress("eval")
    try:
        with progress:
            report = evaluate(policy, settings, out_dir=out, replace=False, progress=update)
    except BaseException:
        if cfg.output_dir is None and not any(out.iterdir()):  # refused before writing: no empty folder left behind
            out.rmdir()
            if root_made:
                with contextlib.suppress(OSError):  # not empty: another evaluation's folder is in it now
                    root.rmdir()
        raise
    _print_eval_report(report)
    print(f"wrote {out}/report.json, {out}/report.md")
    return 1 if report["crashed_episodes"] else 0


def _spelling(args, alias: str, flag: str) -> str:
    """The flag as the user typed it, for error messages: the old alias or the dotted key."""
    return alias if alias in getattr(args, "_aliases_said", ()) else flag


def _print_eval_report(report: dict) -> None:
    from rich.table import Table

    table = Table(title=f"{report['policy']} on {report['env']} ({report['env_backend']})")
    for col in ("task", "success", "episodes", "mean steps"):
        table.add_column(col)
    for task, r in report["per_task"].items():
        crash = f" ({r['crashed_episodes']} crashed: {r['error'].splitlines()[0]})" if r["crashed_episodes"] else ""
        table.add_row(task, f"{r['success_rate']:.1%}{crash}", str(r["episodes"]),
                      "-" if r["mean_steps"] is None else f"{r['mean_steps']:.1f}")
    crashed = report["crashed_episodes"]
    table.add_row("overall", f"{report['overall_success_rate']:.1%}"
                  + (f" ({crashed} crashed episodes counted as failures)" if crashed else ""), "", "")
    _console().print(table)


def cmd_train(args) -> int:
    from kilovla.config import load_config
    from kilovla.train.trainer import TrainConfig, train

    unknown = [a for a in args.overrides if not (a.startswith("--") and "=" in a)]
    if unknown:
        raise KilovlaError(f"unexpected arguments {unknown}; overrides look like --section.key=value")
    from kilovla.cli_config import TRAIN_KEYS, train_overrides
    from kilovla.train.config import typed_flags

    cfg = load_config(TrainConfig, args.config, train_overrides(args.overrides))
    typed = (a[2:].split("=", 1)[0] for a in args.overrides)
    with typed_flags({TRAIN_KEYS.get(key, key): f"--{key}" for key in typed}):  # messages name the flags typed
        summary = train(cfg, resume=args.resume)
    if summary:
        print(json.dumps(summary, indent=2))
    return 0


def cmd_rl(args) -> int:
    from kilovla.rl import runner

    if any(a.split("=")[0] == "--policy.ema" for a in args.overrides):  # alone, =true or =false
        raise KilovlaError("--policy.ema: rl starts from a policy folder's trained weights (model.safetensors), "
                           "not its EMA weights")
    unknown = [a for a in args.overrides if not (a.startswith("--") and "=" in a)]
    if unknown:
        raise KilovlaError(f"unexpected arguments {unknown}; overrides look like --section.key=value")
    misspelt = [a for a in args.overrides if a.startswith("--policy.")]  # RLConfig.policy is the folder itself
    if misspelt:
        from kilovla.config import _unknown
        from kilovla.rl.config import RLConfig

        raise _unknown(RLConfig, misspelt[0][2:].split("=")[0], also=("policy.path",))
    from kilovla.cli_config import given_once

    given_once(args.overrides)
    overrides = list(args.overrides)
    if args.mode:
        overrides.append(f"--mode={args.mode}")
    if args.policy:
        overrides.append(f"--policy={args.policy}")
    cfg = runner.load(args.config, overrides)
    summary = runner.run(cfg, resume=args.resume, ray_address=args.ray_address)
    print(json.dumps(summary, indent=2))
    return 0


def cmd_quantize(args) -> int:
    from kilovla.folders import policy_folder
    from kilovla.quant.fp8 import Fp8Config
    from kilovla.quantize.folder import quantize_policy_folder
    from kilovla.quantize.report import print_report

    cfg, q = args.cfg, args.cfg.quant  # cli_config.QuantizeCommand
    if cfg.policy.path is None:
        raise KilovlaError("quantize: give --policy.path=DIR, the policy folder to quantize")
    if cfg.output_dir is None:
        raise KilovlaError("quantize: give --output_dir=DIR, the new folder for the quantized policy")
    _check_folder_spec(args, "quantize")
    from kilovla.cli_config import check_quantize_keys

    check_quantize_keys(args)
    source = str(policy_folder(cfg.policy.path))  # a run folder or checkpoints/latest: its newest
    config = Fp8Config(block=q.block, include=q.include, exclude=q.exclude, scope=q.scope,
                       activations=q.activations, dtype=q.dtype)
    evaluation = _quant_evaluation(cfg, source) if cfg.eval.n_episodes else None
    report = quantize_policy_folder(source, cfg.output_dir, config, dataset=q.dataset, samples=q.samples,
                                    evaluation=evaluation, seed=cfg.eval.seed, latency_repeats=q.latency_repeats,
                                    kernel=q.kernel, device=q.device, ema=cfg.policy.ema)
    print_report(report, console=_console())
    print(f"wrote {cfg.output_dir} (policy folder) and {cfg.output_dir}/quant_report.json")
    return 0


def _check_folder_spec(args, command: str) -> None:
    """quantize and serve take a policy folder: scripted, random and a ws:// URL (which a path would
    shorten to ws:/) are refused by name."""
    path = args.cfg.policy.path
    if path in ("scripted", "random") or path.startswith(("ws://", "wss://")):
        raise KilovlaError(f"{_spelling(args, '--policy', '--policy.path')} {path}: {command} takes a policy folder "
                           "(a run folder or a checkpoint); scripted, random and ws:// URLs are for `kilovla eval`")


def _quant_evaluation(cfg, source: str):
    """quantize's closed-loop comparison: `evaluation(policy) -> report`, checked against the folder first."""
    from kilovla.eval.closed_loop import evaluate, task_progress
    from kilovla.quantize.folder import describe_source

    settings = cfg.eval.settings(cfg.env, cfg.env.tasks(), videos=0)
    # Before the weights are even loaded: a policy that cannot run in the env fails in a second.
    settings.check_fits(describe_source(source))

    def evaluation(policy):
        progress, update = task_progress(f"eval {policy.name}")
        with progress:
            return evaluate(policy, settings, label=f"eval {policy.name}", progress=update)

    return evaluation


def cmd_serve(args) -> int:
    import os

    from kilovla.serve.server import ServeConfig, run

    cfg, sv = args.cfg, args.cfg.serve  # cli_config.ServeCommand
    if cfg.policy.path is None:
        raise KilovlaError("serve: give --policy.path=DIR, the policy folder to serve")
    _check_folder_spec(args, "serve")
    mapping = {}
    for item in sv.map:
        key, sep, value = item.partition("=")
        if not sep or not key or not value:
            raise KilovlaError(f"{_spelling(args, '--map', '--serve.map')} {item!r}: give REQUEST_KEY=POLICY_KEY, "
                               "e.g. observation/image=observation.images.scene")
        mapping[key] = value
    if sv.max_message_mb is not None and sv.max_message_mb <= 0:
        raise KilovlaError(f"{_spelling(args, '--max-message-mb', '--serve.max_message_mb')} {sv.max_message_mb}: "
                           "must be > 0 (leave it out for no cap)")
    config = ServeConfig(host=sv.host, port=sv.port, max_batch=sv.max_batch, max_wait_ms=sv.max_wait_ms,
                         api_key=sv.api_key or os.environ.get("KILOVLA_API_KEY"), max_message_mb=sv.max_message_mb,
                         layout=None if sv.layout == "auto" else sv.layout, mapping=mapping)
    return run(cfg.policy.path, config, device=sv.device, ema=cfg.policy.ema, precision=sv.precision,
               cuda_graphs=sv.cuda_graphs)


def cmd_convert_policy(args) -> int:
    from kilovla.lerobot_policy import convert_lerobot_policy
    from kilovla.nvidia_policy import convert_groot_n17_policy, is_groot_n17

    cfg = args.cfg  # cli_config.ConvertPolicyCommand
    p = cfg.policy
    convert, what = ((convert_groot_n17_policy, "Isaac-GR00T N1.7") if is_groot_n17(p.path)
                     else (convert_lerobot_policy, "LeRobot SmolVLA"))
    out = convert(p.path, cfg.output_dir, tokenizer=p.tokenizer, preset_name=p.preset, robot=p.robot)
    print(f"converted {p.path} ({what}) -> {out} (policy folder: kilovla eval / serve --policy.path={out})")
    return 0


def cmd_demo(args) -> int:
    from kilovla.demo import run_demo

    cfg = args.cfg  # cli_config.DemoCommand
    run_demo(out_dir=cfg.output_dir, quick=cfg.quick, recipe=cfg.recipe())
    return 0


def _version() -> str:
    """The installed distribution's version; the source tree's when run from a checkout (PYTHONPATH)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("kilovla")
    except PackageNotFoundError:
        import kilovla

        return kilovla.__version__


def _data_parsers(sub) -> None:
    from kilovla import cli_config as c

    data = sub.add_parser("data", help="inspect, check, convert and benchmark LeRobot datasets")
    dsub = data.add_subparsers(dest="data_command", required=True)
    commands = {
        "info": (c.DataInfoCommand, cmd_data_info, "episodes, frames, fps, features, tasks, cameras, codec, size"),
        "validate": (c.DataValidateCommand, cmd_data_validate,
                     "check a dataset; exit 0 if valid, 2 with one line per problem"),
        "stats": (c.DataStatsCommand, cmd_data_stats, "recompute normalisation stats (exact) into meta/stats.json"),
        "convert": (c.DataConvertCommand, cmd_data_convert, "convert a LeRobot v2.1 dataset to v3.0"),
        "synth": (c.DataSynthCommand, cmd_data_synth, "write a synthetic v3.0 dataset (for trying things out)"),
        "cache": (c.DataCacheCommand, cmd_data_cache,
                  "decode every video once into a frame cache that loaders read instead"),
        "bench": (c.DataBenchCommand, cmd_data_bench, "the data benchmark suite on your dataset"),
    }
    for name, (cls, func, help) in commands.items():
        positional = c.DATA_POSITIONAL[name]
        p = dsub.add_parser(name, allow_abbrev=False, help=help, description=f"kilovla data {name} " + " ".join(
            f"{arg.upper()}" for arg, _ in positional) + " [options]")
        c.add_config_flags(p, cls, c.DATA_ALIASES.get(name), positional=positional)
        p.set_defaults(func=func)


def _bench_parser(sub) -> None:
    from kilovla.cli_config import BENCH_ALIASES, BenchCommand, add_config_flags

    p = sub.add_parser("bench", allow_abbrev=False, help="benchmark suites: print a table, write DIR/<suite>.json",
                       description="kilovla bench SUITE [--quick] [--output_dir=bench-results]; "
                       "kilovla bench table DIR_OR_JSON [--readme=README.md]")
    p.add_argument("suite", choices=[*SUITES, "all", "table"],
                   help="table: render PATH's <suite>.json as markdown (README's tables) instead of measuring")
    add_config_flags(p, BenchCommand, BENCH_ALIASES, positional=(("path", "results"),))
    p.set_defaults(func=cmd_bench)


def _quantize_parser(sub) -> None:
    from kilovla.cli_config import QUANTIZE_ALIASES, QuantizeCommand, add_config_flags

    p = sub.add_parser("quantize", allow_abbrev=False, help="block-wise FP8 post-training quantization of a policy folder, with a report",
                       description="kilovla quantize --policy.path=DIR --output_dir=NEW [--eval.n_episodes=50]")
    add_config_flags(p, QuantizeCommand, QUANTIZE_ALIASES, positional=(("policy_dir", "policy.path"),))
    p.set_defaults(func=cmd_quantize)


def _train_rl_parsers(sub) -> None:
    from kilovla.cli_config import _Alias, _Key

    p = sub.add_parser("train", allow_abbrev=False, help="train a VLA policy (single process, or under torchrun)",
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.settings = _train_settings
    p.add_argument("--config", default=None, help="YAML file; dotted overrides follow, e.g. --optim.lr=1e-4; "
                   "--policy.path=DIR: the starting weights (the config's policy.init_from)")
    p.add_argument("--resume", default=None, help="a checkpoint folder, or 'auto' for the run's latest")
    p.set_defaults(func=cmd_train, overrides=[])

    p = sub.add_parser("rl", allow_abbrev=False, help="RL fine-tuning of a policy folder on Ray: sync baseline or async (RL-VLA3)",
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.settings = _rl_settings
    p.add_argument("--config", default=None, help="YAML file (kilovla.rl.config.RLConfig); dotted overrides follow")
    p.add_argument("--mode", choices=["sync", "async"], default=None)
    p.add_argument("--policy.path", dest="policy", action=_Key, default=None,
                   help="the policy folder to start from (e.g. the demo's checkpoint); the config's `policy`")
    p.add_argument("--policy", dest="policy", action=_Alias, key="policy.path", flag=False, default=None,
                   help=argparse.SUPPRESS)  # the old spelling
    p.add_argument("--resume", default=None, help="an RL checkpoint folder, or 'auto' for the run's latest")
    p.add_argument("--ray_address", dest="ray_address", action=_Key, default=None,
                   help="join a Ray cluster ('auto' after `ray start`); default: local")
    p.add_argument("--ray-address", dest="ray_address", action=_Alias, key="ray_address", flag=False, default=None,
                   help=argparse.SUPPRESS)  # the old spelling
    p.set_defaults(func=cmd_rl, overrides=[])


def _train_settings() -> str:
    from kilovla.cli_config import TRAIN_KEYS, fields_help
    from kilovla.train.config import TrainConfig
    from kilovla.train.optim import OptimSettings

    shown = TrainConfig(optim=OptimSettings().filled({}))  # unset optim fields as OptimConfig's defaults
    return fields_help(TrainConfig, shown=TRAIN_KEYS, defaults=shown)


def _rl_settings() -> str:
    from kilovla.cli_config import fields_help
    from kilovla.rl.config import RLConfig

    return fields_help(RLConfig, skip=("policy", "mode"))  # its own flags: --policy.path, --mode


def _collect_parser(sub) -> None:
    from kilovla.cli_config import COLLECT_ALIASES, CollectCommand, add_config_flags

    p = sub.add_parser("collect", allow_abbrev=False, help="scripted demonstrations -> a LeRobot v3.0 dataset",
                       description="kilovla collect --env.task=reach-v3,push-v3 --collect.n_episodes=20 "
                       "--output_dir=data/mw")
    add_config_flags(p, CollectCommand, COLLECT_ALIASES)
    p.set_defaults(func=cmd_collect)


def _serve_parser(sub) -> None:
    from kilovla.cli_config import SERVE_ALIASES, ServeCommand, add_config_flags

    p = sub.add_parser("serve", allow_abbrev=False, help="serve a policy folder over openpi's websocket protocol, batched across robots",
                       description="kilovla serve --policy.path=DIR [--serve.host=0.0.0.0 --serve.api_key=KEY]")
    add_config_flags(p, ServeCommand, SERVE_ALIASES)
    p.set_defaults(func=cmd_serve)


def _convert_policy_parser(sub) -> None:
    from kilovla.cli_config import CONVERT_POLICY_POSITIONAL, ConvertPolicyCommand, add_config_flags

    p = sub.add_parser("convert-policy", allow_abbrev=False, help="a LeRobot SmolVLA or Isaac-GR00T N1.7 "
                       "folder -> a kilovla policy folder (for eval, serve, train)",
                       description="kilovla convert-policy SRC DST [--policy.tokenizer=PATH] [--policy.preset=NAME] "
                       "[--policy.robot=NAME]")
    add_config_flags(p, ConvertPolicyCommand, positional=CONVERT_POLICY_POSITIONAL)
    p.set_defaults(func=cmd_convert_policy)


def _demo_parser(sub) -> None:
    from kilovla.cli_config import DEMO_ALIASES, DemoCommand, add_config_flags

    p = sub.add_parser("demo", allow_abbrev=False, help="the main job on an embedded default",
                       description="kilovla demo [--quick] [--policy.preset=pi0-tiny] "
                       "[--policy.overrides.expert.width=128] [--seed=S] [--output_dir=demo-output]")
    add_config_flags(p, DemoCommand, DEMO_ALIASES)
    p.set_defaults(func=cmd_demo)


_BOOL_WORDS = {"true", "false", "yes", "no", "on", "off"}  # what YAML reads as a bool


class _CommandParser(argparse.ArgumentParser):
    """A command's parser: one flag's error (a value outside its choices, its value missing) is one error
    line, not the usage (8-15 lines)."""

    def _check_value(self, action, value):
        if action.choices is not None and value not in action.choices:
            raise argparse.ArgumentError(
                action, f"invalid choice: {value!r} is not one of {', '.join(map(str, action.choices))}")

    def parse_known_args(self, args=None, namespace=None):
        """A bool key alone (`--dry_run DIR`) is true: the word after it is its value only when it reads
        as one (`--serve.cuda_graphs false`), else it stays a positional argument."""
        bools = {s for a in self._actions if a.nargs == "?" and a.const == "true" for s in a.option_strings}
        if args is not None:
            args = [f"{a}=true" if a in bools and (i + 1 == len(args) or args[i + 1].lower() not in _BOOL_WORDS)
                    else a for i, a in enumerate(args)]
        return super().parse_known_args(args, namespace)

    def format_help(self):
        if getattr(self, "settings", None) is not None:  # train, rl: their config's fields, imported for --help only
            self.epilog = "settings (YAML keys, or dotted flags that override them):\n\n" + self.settings()
        return super().format_help()

    def error(self, message):
        if not message.startswith("argument ") or not any(
                said in message for said in ("invalid choice: ", "expected one argument", "ignored explicit argument")):
            super().error(message)
        _say_error(message.removeprefix("argument "))
        sys.exit(2)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kilovla", description=__doc__.splitlines()[0])
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    parser.add_argument("--version", action="version", version=f"kilovla {_version()}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_CommandParser)

    _data_parsers(sub)
    _bench_parser(sub)
    _quantize_parser(sub)
    _train_rl_parsers(sub)
    _collect_parser(sub)
    _eval_parser(sub)
    _serve_parser(sub)
    _convert_policy_parser(sub)
    _demo_parser(sub)
    return parser


def _eval_parser(sub) -> None:
    from kilovla.cli_config import EVAL_ALIASES, EvalCommand, add_config_flags

    p = sub.add_parser("eval", allow_abbrev=False, help="closed-loop evaluation: success rate per task, videos, report",
                       description="kilovla eval --policy.path=DIR --env.type=metaworld --env.task=reach-v3,push-v3 "
                       "--eval.n_episodes=20 --output_dir=DIR")
    add_config_flags(p, EvalCommand, EVAL_ALIASES)
    p.set_defaults(func=cmd_eval)


def _say_error(problem) -> None:
    """One write per line: under torchrun stderr is unbuffered and every rank shares it, and print's
    separate newline let two ranks' errors run together on one line."""
    sys.stderr.write(f"error: {problem}\n")
    sys.stderr.flush()


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    dotted = getattr(args, "config_cls", None) is not None
    if extra and not dotted and args.func not in (cmd_train, cmd_rl):
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    if extra and not dotted:
        args.overrides = extra
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        if dotted or "_spelt" in vars(args):
            from kilovla.cli_config import check_spellings, config_from, take_positionals

            if dotted:
                extra = take_positionals(args, extra)
            check_spellings(args)
        if dotted:
            args.cfg = config_from(args, extra)
        return args.func(args)
    except KilovlaError as e:
        _say_error(e)
        return e.exit_code
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130

if __name__ == "__main__":
    sys.exit(main())
