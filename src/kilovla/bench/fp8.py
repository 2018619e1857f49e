"""`kilovla bench fp8`: what block-wise FP8 PTQ saves and what it costs.

Rows (DESIGN.md, Benchmarks):

- checkpoint_bytes_3b / checkpoint_bytes_3b_groot: tensor bytes of the `pi05-3b` / `groot-n15-3b`
  shapes, counted on the meta device from shapes and dtypes: bf16 vs the family's default FP8
  selection (vision tower, norms, projectors, embeddings kept in bf16); the ``_all`` rows: bf16 vs
  `--scope all` (everything that can be blocked outside the vision tower, token tables included);
- checkpoint_bytes_tiny: model.safetensors bytes on disk of the demo's trained policy, a bf16 copy
  vs the `kilovla quantize` folder; ``_all``: vs the `--scope all` folder, whose quality rows are
  ``min_layer_sqnr_db_all``, ``action_mse_rel_all`` and ``success_rate_all`` (same seeds as
  ``success_rate``'s baseline);
- min_layer_sqnr_db: the lowest output SQNR of an FP8 layer on held-out samples (ours only);
- action_mse_rel: action MSE of the FP8 policy against the unquantized one / action variance (ours only);
- success_rate: closed-loop success on the demo's tasks, unquantized (baseline) vs FP8 (ours), same seeds
  (``--fp8.episodes=0`` leaves it out: the timing and size rows then run in a few minutes);
- chunk_latency_ms: batch-1 action chunk of the demo policy, fp32 vs FP8 (emulated on CPU);
  chunk_latency_ms_3b (CUDA only): the `pi05-3b` shape with random weights, bf16 vs FP8 kernels.

The policy is the demo's: ``--policy.path=DIR``, else the checkpoint `kilovla demo` left in demo-output/,
else one trained here with the demo's recipe. The held-out samples are fresh scripted episodes on
another seed (``--fp8.dataset=DIR`` to bring your own).
"""

from __future__ import annotations

import contextlib
import copy
import shutil
from pathlib import Path

import torch

from kilovla.bench.common import DEFAULT_OUT, Row, write_suite
from kilovla.errors import KilovlaError
from kilovla.quantize.folder import quantize_policy_folder
from kilovla.quant.fp8 import Fp8Config, checkpoint_bytes, quantize_model, select_layers
from kilovla.quantize.report import min_output_sqnr

HELDOUT_SEED = 7  # the demo collects on seed 0: other object and goal positions
FULL = {"episodes": 50, "heldout_episodes": 2, "samples": 128, "latency_repeats": 10}
QUICK = {"episodes": 2, "heldout_episodes": 1, "samples": 16, "latency_repeats": 3}


def sizes_3b(preset: str, scope: str = "default") -> dict:
    from kilovla.models.presets import build_model

    model = build_model(preset, device="meta")
    layers = select_layers(model, scope=scope)
    counts = checkpoint_bytes(model, layers)
    vision = [n for n in layers if "vision" in n]
    return {**counts, "layers": len(layers), "vision_layers_quantized": len(vision),
            "reduction": 1 - counts["quantized_bytes"] / counts["baseline_bytes"]}


def _demo_policy(out: Path, quick: bool) -> tuple[Path, list[str], int]:
    """Train the demo's policy (its recipe, its tasks) into out/fp8-demo; returns (checkpoint, tasks, resolution)."""
    from kilovla.demo import FULL as DEMO_FULL, QUICK as DEMO_QUICK, run_demo

    size = DEMO_QUICK if quick else DEMO_FULL
    report = run_demo(out_dir=out / "fp8-demo", quick=quick)
    return Path(report["train"]["checkpoint"]), list(size.tasks), size.resolution


def _latency_3b_cuda(repeats: int) -> Row:
    """pi05-3b with random weights on the GPU: bf16 baseline vs FP8 layers, batch-1 action chunk."""
    from kilovla.bench.models import libero_batch
    from kilovla.models.presets import build_model, preset
    from kilovla.quantize.report import chunk_latency

    class _Runner:  # the shape `chunk_latency` times: a model and its device
        def __init__(self, model):
            self.model, self.device = model, torch.device("cuda")

    cfg = preset("pi05-3b")
    base = build_model("pi05-3b", device="cuda").to(torch.bfloat16).eval()
    ours = copy.deepcopy(base)
    quantize_model(ours, Fp8Config())
    batch = libero_batch(cfg, 1, seed=0).to("cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        t = chunk_latency({"baseline": _Runner(base), "quantized": _Runner(ours)}, batch, repeats=repeats)
    kernels = sorted({k for m in ours.modules() for k in getattr(m, "kernel_used", {}).values()})
    return Row.compare("chunk_latency_ms_3b", "ms", 1e3 * t["baseline"], 1e3 * t["quantized"], higher_is_better=False,
                       note=f"pi05-3b random weights, {torch.cuda.get_device_name(0)}, batch 1, "
                            f"{cfg.num_inference_steps} flow steps; bf16 vs FP8 ({', '.join(kernels)})")


def _scope_all(policy, out: Path, dataset, size: dict, report: dict, evaluation, ema: bool) -> tuple[dict, list[Row]]:
    """The demo policy quantized with `--scope all`: its size on disk and the same quality rows, its
    closed-loop success on the seeds the default folder's comparison used (torch seeded alike)."""
    from kilovla.policy_folder import load_policy_folder

    folder = out / "fp8-policy-all"
    shutil.rmtree(folder, ignore_errors=True)
    wide = quantize_policy_folder(policy, folder, Fp8Config(scope="all"), dataset=dataset, samples=size["samples"],
                                  latency_repeats=1, ema=ema)
    s, a = wide["size"], wide["actions"]
    worst, worst_db = min_output_sqnr(wide)
    rows = [
        Row.compare("checkpoint_bytes_tiny_all", "bytes", s["bf16_bytes"], s["quantized_bytes"], higher_is_better=False,
                    note=f"demo policy on disk: bf16 copy vs the --scope all FP8 folder ({s['fp8_params']} of "
                         f"{s['total_params']} params in FP8; the rest, kept in bf16, is the vision tower, norms and "
                         "biases)"),
        Row.compare("min_layer_sqnr_db_all", "dB", None, worst_db, higher_is_better=True,
                    note=f"--scope all: lowest FP8 layer output SQNR over {len(wide['layers'])} layers ({worst})"),
        Row.compare("action_mse_rel_all", "% of variance", None, 100 * a["relative"], higher_is_better=False,
                    note=f"--scope all: MSE vs the unquantized actions / action variance, {a['samples']} action steps"),
    ]
    c = report.get("closed_loop")
    if evaluation is not None and c is not None:
        torch.manual_seed(0)  # as closed_loop_summary seeds each policy's evaluation
        result = evaluation(load_policy_folder(folder))
        quantized = {"overall": result["overall_success_rate"],
                     "per_task": {t: r["success_rate"] for t, r in result["per_task"].items()},
                     "episodes_per_task": result["episodes_per_task"]}
        wide["closed_loop"] = {"baseline": c["baseline"], "quantized": quantized,  # the shape of report["closed_loop"]
                               "difference_points": 100 * (quantized["overall"] - c["baseline"]["overall"])}
        rows.append(Row.compare("success_rate_all", "fraction", c["baseline"]["overall"], result["overall_success_rate"],
                                higher_is_better=True,
                                note=f"same tasks, episodes and seeds as success_rate; unquantized vs --scope all FP8 "
                                     f"({100 * (result['overall_success_rate'] - c['baseline']['overall']):+.1f} points)"))
    return wide, rows


def _sizes_3b_rows() -> tuple[list[Row], dict]:
    """Checkpoint bytes of the 3B shapes, default and `--scope all`; the sizes by preset (and suffix)."""
    rows, sizes = [], {}
    for name, preset_name in (("checkpoint_bytes_3b", "pi05-3b"), ("checkpoint_bytes_3b_groot", "groot-n15-3b")):
        for scope, suffix in (("default", ""), ("all", "_all")):
            s = sizes_3b(preset_name, scope)
            sizes[f"{preset_name}{suffix}"] = s
            rows.append(Row.compare(f"{name}{suffix}", "bytes", s["baseline_bytes"], s["quantized_bytes"],
                                    higher_is_better=False,
                                    note=f"{preset_name} shapes (meta device), --scope {scope}: bf16 vs FP8 128x128 on "
                                         f"{s['layers']} layers ({s['fp8_params'] / 1e9:.2f} of "
                                         f"{s['total_params'] / 1e9:.2f} B params), {100 * s['reduction']:.1f} % smaller; "
                                         "vision tower kept"))
    return rows, sizes


def _demo_setting(policy, out: Path, quick: bool, tasks: list[str] | None,
                  resolution: int | None) -> tuple[str | Path, list[str], int]:
    """(policy, tasks, resolution): the ones given, else the demo's checkpoint (trained here if there is
    none) with the demo's tasks and resolution."""
    from kilovla.bench.rl import default_policy

    if policy is None:
        try:
            policy = default_policy()  # the demo's checkpoint under demo-output/, as `bench rl` takes it
        except KilovlaError:
            policy, demo_tasks, demo_resolution = _demo_policy(out, quick)
            tasks, resolution = tasks or demo_tasks, resolution or demo_resolution
    from kilovla.demo import FULL as DEMO_FULL
    from kilovla.envs.metaworld import DEFAULT_TASKS

    tasks = tasks or list(DEFAULT_TASKS)
    resolution = resolution or DEMO_FULL.resolution  # the policy is the demo's unless --policy.path says otherwise
    return policy, tasks, resolution


def _policy_rows(report: dict, tasks: list[str], n: int) -> list[Row]:
    """The default FP8 folder's rows from its quantize report: size, quality, success (when evaluated), latency."""
    s, a, lat = report["size"], report["actions"], report["latency"]
    worst, worst_db = min_output_sqnr(report)
    rows = [
        Row.compare("checkpoint_bytes_tiny", "bytes", s["bf16_bytes"], s["quantized_bytes"], higher_is_better=False,
                    note=f"demo policy model.safetensors on disk: bf16 copy vs FP8 folder "
                         f"({s['fp8_params']} of {s['total_params']} params in FP8; fp32 source {s['source_bytes']} B)"),
        Row.compare("min_layer_sqnr_db", "dB", None, worst_db, higher_is_better=True,
                    note=f"lowest FP8 layer output SQNR over {len(report['layers'])} layers on held-out samples "
                         f"(W8A8 1x128; {worst}); min weight SQNR "
                         f"{min(v['weight_sqnr_db'] for v in report['layers'].values()):.1f} dB"),
        Row.compare("action_mse_rel", "% of variance", None, 100 * a["relative"], higher_is_better=False,
                    note=f"MSE of FP8 vs unquantized action chunks / variance of the actions, {a['samples']} held-out "
                         "action steps (same observations, same flow noise)"),
    ]
    c = report.get("closed_loop")
    if c is not None:
        rows.append(Row.compare("success_rate", "fraction", c["baseline"]["overall"], c["quantized"]["overall"],
                                higher_is_better=True,
                                note=f"{len(tasks)} Meta-World tasks x {n} episodes, same seeds, {report['weights']} weights; "
                                     "unquantized vs FP8 "
                                     f"({c['difference_points']:+.1f} points)"))
    rows += [
        Row.compare("chunk_latency_ms", "ms", 1e3 * lat["baseline_s"], 1e3 * lat["quantized_s"], higher_is_better=False,
                    note=f"demo policy, batch 1, {lat['device']}: fp32 vs FP8 ({lat['kernel']}; emulation "
                         "dequantizes every call, so it is slower on CPU)"),
    ]
    return rows


def _check_inputs(policy, dataset, settings, n: int) -> None:
    """What can be refused before anything is written: the policy folder, the data it is measured on, the env
    it runs in (the held-out episodes and the closed loop), `--fp8.episodes`."""
    from kilovla.quantize.folder import check_dataset, read_source

    if n < 0:
        raise KilovlaError(f"--fp8.episodes={n}: must be >= 0 (0 skips the closed-loop comparison)")
    folder = read_source(policy)
    if dataset is not None:
        check_dataset(dataset, folder.meta, flag="--fp8.dataset")
    if n or dataset is None:  # the env collects the held-out episodes or runs the closed loop
        settings.check_fits(folder.interface())


def run(*, quick: bool = False, out_dir: str | Path = DEFAULT_OUT, policy: str | Path | None = None,
        dataset: str | Path | None = None, tasks: list[str] | None = None, resolution: int | None = None,
        episodes: int | None = None, console=None) -> Path:
    from kilovla.demo import FULL as DEMO_FULL
    from kilovla.envs.collect import collect
    from kilovla.eval.settings import EvalSettings

    size = QUICK if quick else FULL
    out = Path(out_dir)
    out_made = not out.exists()
    policy, tasks, resolution = _demo_setting(policy, out, quick, tasks, resolution)
    n = size["episodes"] if episodes is None else episodes
    # on the demo's evaluation seeds, disjoint from the demonstrations'
    settings = EvalSettings(tasks=tasks, episodes=n, seed=DEMO_FULL.eval_seed, batch_size=10, resolution=resolution,
                            workers=2)
    _check_inputs(policy, dataset, settings, n)
    out.mkdir(parents=True, exist_ok=True)
    rows, extra = _sizes_3b_rows()
    heldout = out / "fp8-heldout" if dataset is None else None
    try:
        if heldout is not None:
            collect(heldout, tasks=tasks, episodes_per_task=size["heldout_episodes"], resolution=resolution,
                    noise_std=0.1, seed=HELDOUT_SEED, batch_size=5, overwrite=True)
        rows += _measure(policy, out, heldout or dataset, size, settings, tasks, n, extra)
    except KilovlaError:  # refused midway: what this run collected goes again (quantize writes nothing then)
        if heldout is not None:
            shutil.rmtree(heldout, ignore_errors=True)
        if out_made:
            with contextlib.suppress(OSError):  # not empty: a demo policy trained for this run stays
                out.rmdir()
        raise
    return write_suite("fp8", rows, quick=quick, out_dir=out, extra=extra, console=console)


def _measure(policy, out: Path, dataset, size: dict, settings, tasks: list[str], n: int, extra: dict) -> list[Row]:
    """The demo policy's rows: quantized by default and with `--scope all`, compared on `dataset` and in
    the closed loop (`settings`, when `n` episodes); the reports go into `extra`."""
    from kilovla.eval.closed_loop import evaluate, task_progress

    quantized_dir = out / "fp8-policy"
    shutil.rmtree(quantized_dir, ignore_errors=True)
    ema = (Path(policy) / "ema.safetensors").is_file()  # the demo evaluates its EMA weights: quantize those

    def evaluation(p):
        progress, update = task_progress(f"eval {p.name}")
        with progress:
            return evaluate(p, settings, progress=update)

    report = quantize_policy_folder(policy, quantized_dir, Fp8Config(), dataset=dataset, samples=size["samples"],
                                    evaluation=evaluation if n else None, latency_repeats=size["latency_repeats"],
                                    ema=ema)
    rows = _policy_rows(report, tasks, n)
    wide, wide_rows = _scope_all(policy, out, dataset, size, report, evaluation if n else None, ema)
    rows += wide_rows
    if torch.cuda.is_available():
        rows.append(_latency_3b_cuda(size["latency_repeats"]))
    extra.update(policy=str(policy), quantized=str(quantized_dir), report=report, report_all=wide)
    return rows
