"""Golden outputs for issue 40's behaviour-keeping redesign: record what the checkout's commands produce,
then check a later checkout produces the same, bit for bit where the record says it is deterministic.

    PYTHONPATH=src python benchmarks/golden_outputs.py record golden/      # on main, before the redesign
    PYTHONPATH=src python benchmarks/golden_outputs.py compare golden/     # after it: a table, exit 1 on a difference

(the script puts its own checkout's src/ first on the path and runs every command with it, so PYTHONPATH
is optional.) The items, each from one `kilovla demo --quick` run's checkpoint:

- demo.metrics: `kilovla demo --quick`'s per-step training rows (loss, grad norm, lr, token counts);
- demo.report: its report.json less wall times, rates, paths and the machine;
- demo.files: sha256 of the recorded dataset's files and of the checkpoint's weights and policy.json;
- eval: `evaluate` of the demo checkpoint (its EMA weights where it has them), 2 tasks x 2 episodes (torch
  seeded first, since a policy draws its flow noise from torch's global generator): every action chunk the
  policy returned, the states it was given, each episode's seed, success, steps and return, and the report's
  figures;
- serve.engine: the serve engine's chunks for fixed observations (a seeded request alone, the same in a
  batch of two, one with given noise), in this process;
- serve.server: the same seeded and given-noise requests through a real `kilovla serve` on a free port,
  answered to openpi's client, and the server's metadata less its folder and device;
- rl: a tiny sync residual-SAC run on reach-v3 (1 env worker x 2 envs, 4 versions, Ray local): its
  metrics.jsonl rows less wall times and rates, summary.json's counts, and sha256 of the final
  checkpoint's residual, critic and replay files;
- quantize: `kilovla quantize` of the checkpoint (--eval-episodes 0): sha256 of the quantized
  folder's model.safetensors and policy.json, and quant_report.json less its latency and paths.

Every command runs with one torch/OMP thread and a private frame cache: the demo's losses moved in the
8th digit between 1 and 2 threads, so the thread count is part of the record; so are the CPU and the
library versions (torch, MuJoCo, FFmpeg): record and compare on one machine and environment (`compare`
warns when golden.json's versions differ from the running ones). Exact items compare with ==; an item measured to vary
between two runs of the same code is recorded as "tolerance" with its measured spread (see TOLERANCE).
Writes OUT_DIR/golden.json (values and hashes) and OUT_DIR/golden.npz (arrays); `--keep` keeps the work
folder (the demo, the runs) under OUT_DIR/work for a look at what differed. About 3 minutes on 2 busy cores.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import math
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src"
sys.path.insert(0, str(SRC))
# before torch is imported: one intra-op thread here and in every command run below
THREADS = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
os.environ.update(THREADS)

import numpy as np  # noqa: E402

EVAL_TASKS = ("reach-v3", "drawer-close-v3")
EVAL_EPISODES, EVAL_SEED, TORCH_SEED = 2, 1, 0
SERVE_SEED = 7
RL_FLAGS = ("--mode", "sync", "--steps=4", "--env.tasks=[reach-v3]", "--env.workers=1", "--env.envs_per_worker=2",
            "--env.resolution=32", "--env.max_steps=30", "--rollout.segment_steps=3", "--learner.batch_segments=2",
            "--checkpoint.every=4", "--eval.episodes=0", "--progress=false", "--learner.algo.name=residual_sac",
            "--learner.algo.sac.warmup_transitions=8", "--learner.algo.sac.batch_size=16",
            "--learner.algo.sac.critic_warmup_updates=4", "--learner.algo.sac.utd=2", "--seed=0")
# Keys whose values measure time or the machine, never what was computed: left out of every record.
TIMED = re.compile(r"(wall|_s$|_ms$|per_s|time|wait|latency|memory|mfu|busy|machine|elapsed|timing)")
# Items measured to differ between two runs of the same code: allowed absolute difference.
TOLERANCE: dict[str, float] = {}


# -- running commands ------------------------------------------------------------------------------------
def command_env(work: Path) -> dict:
    return {**os.environ, **THREADS, "PYTHONPATH": os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")]),
            "KILOVLA_CACHE_DIR": str(work / "cache")}


def kilovla(work: Path, log: str, *args: str) -> None:
    """`python -m kilovla ARGS` with this checkout's code; its output goes to WORK/LOG."""
    with open(work / log, "w") as out:
        proc = subprocess.run([sys.executable, "-m", "kilovla", *args], stdout=out, stderr=subprocess.STDOUT,
                              env=command_env(work), cwd=work)
    if proc.returncode:
        tail = (work / log).read_text()[-3000:]
        raise SystemExit(f"kilovla {' '.join(args[:2])} exited {proc.returncode}; the end of {work / log}:\n{tail}")


def sha256(path: Path) -> str:
    """The file's sha256; a .safetensors file's with its header's keys sorted first: safetensors writes the
    header's __metadata__ map in hash order, which changes from run to run (two quantizations of one folder
    differed in nothing else), while the tensors' names, dtypes, shapes, offsets and bytes do not."""
    data = path.read_bytes()
    if path.suffix == ".safetensors":
        n = int.from_bytes(data[:8], "little")
        header = json.loads(data[8:8 + n])
        data = json.dumps(header, sort_keys=True).encode() + data[8 + n:]
    return hashlib.sha256(data).hexdigest()


def untimed(obj, work: Path):
    """`obj` less the keys TIMED names, with WORK's path written <work> (a record does not depend on where it ran)."""
    if isinstance(obj, dict):
        return {k: untimed(v, work) for k, v in obj.items() if not TIMED.search(str(k))}
    if isinstance(obj, list | tuple):
        return [untimed(v, work) for v in obj]
    if isinstance(obj, str):
        return obj.replace(str(work.resolve()), "<work>").replace(str(work), "<work>")
    return obj


def jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


# -- the items -------------------------------------------------------------------------------------------
def record_demo(work: Path) -> tuple[dict, Path]:
    demo = work / "demo"
    kilovla(work, "demo.log", "demo", "--quick", "--out", str(demo))
    report = json.loads((demo / "report.json").read_text())
    ckpt = Path(report["train"]["checkpoint"])
    rows = jsonl(demo / "run" / "metrics.jsonl")
    items = {
        "demo.metrics": {"values": {"rows": untimed(rows, work)}},
        "demo.report": {"values": untimed({k: v for k, v in report.items() if k != "frame_cache"}, work)
                        | {"frame_cache_bytes": (report.get("frame_cache") or {}).get("bytes")}},
        "demo.files": {"values": {
            **{f"dataset/{p.relative_to(demo / 'dataset')}": sha256(p)
               for p in sorted((demo / "dataset").rglob("*")) if p.is_file()},
            **{f"checkpoint/{name}": sha256(ckpt / name)
               for name in ("model.safetensors", "ema.safetensors", "policy.json") if (ckpt / name).is_file()}}},
    }
    return items, ckpt


def record_eval(ckpt: Path) -> dict:
    """The policy's actions in `evaluate`, captured by wrapping its select_action; the episodes, by wrapping
    run_episodes where evaluate looks it up."""
    import torch

    from kilovla.envs import rollout
    from kilovla.eval import closed_loop
    from kilovla.eval.settings import EvalSettings

    # the demo writes EMA weights only with its recipe's ema_decay
    policy = closed_loop.load_policy(str(ckpt), ema=(ckpt / "ema.safetensors").is_file())
    calls: list[tuple[np.ndarray, np.ndarray]] = []
    select = policy.select_action

    def recording_select(obs):
        chunk = select(obs)
        calls.append((np.asarray(obs["observation.state"], np.float32).copy(), np.asarray(chunk).copy()))
        return chunk

    policy.select_action = recording_select
    episodes = []
    run_episodes = rollout.run_episodes

    def recording_run(*args, **kwargs):
        done = run_episodes(*args, **kwargs)
        episodes.extend(done)
        return done

    patched = [m for m in (closed_loop.evaluate.__globals__, vars(rollout)) if m.get("run_episodes") is run_episodes]
    for namespace in patched:
        namespace["run_episodes"] = recording_run
    torch.manual_seed(TORCH_SEED)
    try:
        settings = EvalSettings(tasks=EVAL_TASKS, episodes=EVAL_EPISODES, seed=EVAL_SEED, batch_size=EVAL_EPISODES)
        report = closed_loop.evaluate(policy, settings, progress=lambda *a: None)
    finally:
        for namespace in patched:
            namespace["run_episodes"] = run_episodes
    values = {"per_task": {t: {k: r[k] for k in ("success_rate", "successes", "episodes", "mean_steps", "seeds")}
                           for t, r in report["per_task"].items()},
              "overall_success_rate": report["overall_success_rate"], "n_action_steps": report["n_action_steps"],
              "resolution": report["resolution"], "calls": len(calls), "call_batch": [len(a) for _, a in calls],
              "episodes": [{"task": e.task, "seed": e.seed, "success": bool(e.success), "steps": e.steps,
                            "reward": float(e.reward)} for e in episodes]}
    arrays = {"actions": np.concatenate([a for _, a in calls]), "states": np.concatenate([s for s, _ in calls])}
    return {"eval": {"values": values, "arrays": arrays}}


def fixed_observation(cameras, widths, size: int, seed: int) -> dict:
    rng = np.random.default_rng(seed)
    obs = {k: rng.integers(0, 256, (size, size, 3), dtype=np.uint8) for k in cameras}
    obs |= {f"state{i}": rng.standard_normal(w).astype(np.float32) for i, w in enumerate(widths)}
    return obs


def record_serve(work: Path, ckpt: Path) -> dict:
    from kilovla.serve.engine import PolicyEngine, Request

    engine = PolicyEngine.load(ckpt, device="cpu")
    inputs = engine.inputs()
    size = (engine.meta.image_size or [32])[0]

    def policy_obs(seed):
        obs = fixed_observation(inputs.cameras, inputs.state_widths, size, seed)
        obs |= {k: obs.pop(f"state{i}") for i, k in enumerate(inputs.state_keys)}
        return obs | {"task": "reach the red goal"}

    a, b = policy_obs(0), policy_obs(1)
    noise = np.random.default_rng(2).standard_normal((engine.horizon, engine.width)).astype(np.float32)
    [alone], _ = engine.infer([Request(a, seed=SERVE_SEED)])
    batched, _ = engine.infer([Request(a, seed=SERVE_SEED), Request(b, seed=SERVE_SEED + 1)])
    [given], _ = engine.infer([Request(a, noise=noise)])
    items = {"serve.engine": {"values": {"horizon": int(engine.horizon), "width": int(engine.width)},
                              "arrays": {"seeded": alone, "batched": np.stack(batched), "given_noise": given}}}
    items["serve.server"] = served(work, ckpt, a, noise)
    return items


def served(work: Path, ckpt: Path, obs: dict, noise: np.ndarray) -> dict:
    """The seeded and the given-noise request through a real `kilovla serve` and openpi's client."""
    from openpi_client import websocket_client_policy

    with open(work / "serve.log", "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "kilovla", "serve", "--policy", str(ckpt), "--port", "0"],
                                stdout=subprocess.PIPE, stderr=log, text=True, env=command_env(work), cwd=work)
    try:
        line = proc.stdout.readline()
        match = re.search(r"ws://127\.0\.0\.1:(\d+)", line)
        if not match:
            raise SystemExit(f"kilovla serve did not start: {line!r}; see {work / 'serve.log'}")
        import warnings

        with warnings.catch_warnings():  # openpi-client 0.1.2 calls websockets' connect() outside a context
            warnings.simplefilter("ignore", DeprecationWarning)
            client = websocket_client_policy.WebsocketClientPolicy(host="127.0.0.1", port=int(match.group(1)))
        meta = {k: v for k, v in client.get_server_metadata().items() if k not in ("policy_folder", "device")}
        seeded = client.infer({**obs, "seed": SERVE_SEED})["actions"]
        given = client.infer({**obs, "noise": noise})["actions"]
    finally:
        proc.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(60)
        if proc.poll() is None:
            proc.kill()
    return {"values": {"metadata": untimed(meta, work)}, "arrays": {"seeded": seeded, "given_noise": given}}


def record_rl(work: Path, ckpt: Path) -> dict:
    run = work / "rl"
    kilovla(work, "rl.log", "rl", "--policy", str(ckpt), f"--run_dir={run}", *RL_FLAGS)
    summary = json.loads((run / "summary.json").read_text())
    final = Path(summary["checkpoint"])
    files = {name: sha256(final / name)
             for name in ("residual.safetensors", "critic.safetensors", "replay.safetensors", "model.safetensors")
             if (final / name).is_file()}
    return {"rl": {"values": {"rows": untimed(jsonl(run / "metrics.jsonl"), work),
                              "summary": untimed({k: v for k, v in summary.items() if k != "checkpoint"}, work),
                              "files": files}}}


def record_quantize(work: Path, ckpt: Path) -> dict:
    out = work / "quantized"
    kilovla(work, "quantize.log", "quantize", str(ckpt), "--out", str(out), "--eval-episodes", "0")
    report = json.loads((out / "quant_report.json").read_text())
    files = {p.name: sha256(p) for p in sorted(out.iterdir()) if p.is_file() and not p.name.startswith("quant_report")}
    return {"quantize": {"values": {"files": files, "report": untimed(
        {k: v for k, v in report.items() if k not in ("source", "out", "latency")}, work)}}}


def record_all(work: Path) -> tuple[dict, dict]:
    """Every item: ({item: {"values": json-able}}, {"item/array": ndarray}), and each item's seconds."""
    items, seconds = {}, {}
    t = time.perf_counter()
    demo, ckpt = record_demo(work)
    items |= demo
    seconds["demo"] = time.perf_counter() - t
    for name, step in (("eval", lambda: record_eval(ckpt)), ("serve", lambda: record_serve(work, ckpt)),
                       ("rl", lambda: record_rl(work, ckpt)), ("quantize", lambda: record_quantize(work, ckpt))):
        t = time.perf_counter()
        items |= step()
        seconds[name] = time.perf_counter() - t
        print(f"{name}: {seconds[name]:.0f} s", flush=True)
    return items, seconds


# -- files and comparison --------------------------------------------------------------------------------
def save(out: Path, items: dict, seconds: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    arrays = {f"{name}/{k}": np.asarray(v) for name, item in items.items() for k, v in item.get("arrays", {}).items()}
    golden = {"meta": {"commit": git_commit(), **versions(), "seconds": seconds},
              "items": {name: {"mode": "tolerance" if name in TOLERANCE else "exact",
                               "tolerance": TOLERANCE.get(name, 0.0), "values": item.get("values", {}),
                               "arrays": sorted(item.get("arrays", {}))} for name, item in items.items()}}
    np.savez(out / "golden.npz", **arrays)
    (out / "golden.json").write_text(json.dumps(golden, indent=1))


def versions() -> dict[str, str]:
    import importlib.metadata

    found = {"python": sys.version.split()[0]}
    for name in ("torch", "numpy", "mujoco", "metaworld", "av"):
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            found[name] = None
    return found


def load(out: Path) -> tuple[dict, dict]:
    golden = json.loads((out / "golden.json").read_text())
    with np.load(out / "golden.npz") as npz:
        arrays = {k: npz[k] for k in npz.files}
    return golden, arrays


def git_commit() -> str | None:
    """HEAD, with "+changes" where the checkout's src/ differs from it (what ran is then not that commit)."""
    try:
        head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True,
                              check=True).stdout.strip()
        changed = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "--", "src"], capture_output=True,
                                 text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None
    return head + ("+changes" if changed else "")


def leaves(obj, prefix: str = "") -> dict:
    """A nested value as {dotted path: leaf}; a list of numbers stays one leaf (compared as an array)."""
    if isinstance(obj, dict):
        return {k: v for key, value in obj.items()
                for k, v in leaves(value, f"{prefix}.{key}" if prefix else str(key)).items()}
    if isinstance(obj, list) and not all(isinstance(v, int | float) and not isinstance(v, bool) for v in obj):
        return {k: v for i, value in enumerate(obj) for k, v in leaves(value, f"{prefix}[{i}]").items()}
    return {prefix: obj}


MISSING = object()


def difference(a, b) -> tuple[bool, float]:
    """(equal, max abs difference): equality is exact (ints as ints, NaN equal to NaN); the difference is
    nan where the two are not numbers of one shape."""
    if a is MISSING or b is MISSING:
        return a is b, math.nan
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        x, y = np.asarray(a), np.asarray(b)
        equal = x.shape == y.shape and x.dtype == y.dtype and bool(
            np.array_equal(x, y, equal_nan=x.dtype.kind in "fc"))
    else:
        equal = a == b or _both_nan(a, b)
    numbers = all(isinstance(v, np.ndarray) or (isinstance(v, int | float | list) and not isinstance(v, bool))
                  for v in (a, b))
    if not numbers:
        return equal, math.nan
    try:
        x, y = np.asarray(a), np.asarray(b)
        # seeds near 1e18 are ints that float64 would round together: integers subtract exactly
        wide = object if x.dtype.kind in "iu" and y.dtype.kind in "iu" else np.float64
        x, y = x.astype(wide), y.astype(wide)
    except (TypeError, ValueError):
        return equal, math.nan
    if x.shape != y.shape:
        return False, math.nan
    diff = np.abs(x - y).astype(np.float64)
    return equal, float(np.nanmax(diff)) if diff.size and not np.isnan(diff).all() else 0.0


def _both_nan(a, b) -> bool:
    return isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b)


def compare(golden: dict, arrays: dict, items: dict) -> list[tuple[str, str, str]]:
    """One row per recorded item: (item, identical / within tolerance / differs, what differs)."""
    rows = []
    for name, rec in golden["items"].items():
        new = items.get(name)
        if new is None:
            rows.append((name, "differs", "not produced"))
            continue
        old_values, new_values = leaves(rec["values"]), leaves(new.get("values", {}))
        old_arrays = {k: arrays.get(f"{name}/{k}", MISSING) for k in rec["arrays"]}
        new_arrays = {k: np.asarray(v) for k, v in new.get("arrays", {}).items()}
        pairs = {f"values.{k}": (old_values.get(k, MISSING), new_values.get(k, MISSING))
                 for k in old_values | new_values}
        pairs |= {f"arrays.{k}": (old_arrays.get(k, MISSING), new_arrays.get(k, MISSING))
                  for k in old_arrays | new_arrays}
        bad, worst = [], 0.0
        for key, (old, now) in pairs.items():
            equal, diff = difference(old, now)
            if not equal and not (rec["mode"] == "tolerance" and diff <= rec["tolerance"]):
                bad.append((key, diff))
            if not math.isnan(diff):
                worst = max(worst, diff)
        if not bad:
            rows.append((name, "identical" if worst == 0 else f"within tolerance {rec['tolerance']:g}",
                         f"{len(pairs)} fields" + (f", max abs diff {worst:.3g}" if worst else "")))
        else:
            shown = "; ".join(k + (" (missing on one side)" if any(v is MISSING for v in pairs[k]) else "" if math.isnan(d)
                                   else f" (max abs diff {d:.3g})") for k, d in bad[:4])
            more = " ..." if len(bad) > 4 else ""
            rows.append((name, "differs", f"{len(bad)} of {len(pairs)} fields: {shown}{more}"))
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("mode", choices=("record", "compare"))
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--keep", action="store_true", help="keep the work folder (demo, runs) under OUT_DIR/work")
    args = parser.parse_args(argv)
    if args.mode == "compare" and not (args.out_dir / "golden.json").is_file():
        print(f"error: {args.out_dir}/golden.json: no record there; run `record {args.out_dir}` first", file=sys.stderr)
        return 2
    args.out_dir.mkdir(parents=True, exist_ok=True)
    work = args.out_dir / "work" if args.keep else Path(tempfile.mkdtemp(prefix="golden-", dir=args.out_dir))
    if work.exists():
        shutil.rmtree(work)
    work.mkdir(parents=True)
    work = work.resolve()
    try:
        t0 = time.perf_counter()
        items, seconds = record_all(work)
        seconds["total"] = time.perf_counter() - t0
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    if args.mode == "record":
        save(args.out_dir, items, seconds)
        for name, item in items.items():
            print(f"{name:14s} {len(leaves(item.get('values', {})))} values, {len(item.get('arrays', {}))} arrays")
        print(f"recorded {len(items)} items in {seconds['total']:.0f} s: {args.out_dir}/golden.json, golden.npz")
        return 0
    golden, arrays = load(args.out_dir)
    for key, now in versions().items():
        if golden["meta"].get(key) != now:
            print(f"warning: recorded with {key} {golden['meta'].get(key)}, running {now}: bit-for-bit "
                  "equality is not expected across versions")
    rows = compare(golden, arrays, items)
    width = max(len(r[0]) for r in rows)
    print(f"{'item':{width}s}  result     detail   (recorded at {golden['meta']['commit']}, now {git_commit()})")
    for name, result, detail in rows:
        print(f"{name:{width}s}  {result:9s}  {detail}")
    print(f"ran in {seconds['total']:.0f} s")
    return 1 if any(r[1] == "differs" for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
