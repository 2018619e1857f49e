"""Where batch-1 FP8 latency goes on a GPU: per-GEMM and whole-chunk timings, eager and CUDA-graphed.

Run on a CUDA machine: `python benchmarks/gpu_fp8_probe.py [--no-gemms] [--kernel K] [OUT.json]`. Every
section is independent (one failing prints its error and the rest still run). Prints each section's
numbers and writes JSON. `--kernel scaled_mm` skips auto's timing of the candidates (torchao's Triton
kernel compiles per shape, which takes minutes for a whole model).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import traceback

import torch
import torch.nn.functional as F

from gpu_probe import serving_pair  # benchmarks/gpu_probe.py: the bf16 / FP8 pair its serve section measures
from kilovla.bench.models import libero_batch
from kilovla.models.presets import preset
from kilovla.quant import fp8
from kilovla.quant.fp8 import Fp8BlockLinear

parser = argparse.ArgumentParser()
parser.add_argument("out", nargs="?")
parser.add_argument("--no-gemms", action="store_true", help="skip the per-GEMM section")
parser.add_argument("--kernel", default="auto", help="the FP8 kernel of the whole-model sections")
args = parser.parse_args()
results: dict = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "cuda": torch.version.cuda}


def section(name):
    def wrap(fn):
        t0 = time.time()
        try:
            results[name] = fn()
        except Exception as e:  # noqa: BLE001 - a probe: report and go on
            results[name] = {"error": f"{type(e).__name__}: {e}"}
            traceback.print_exc()
        print(f"== {name} ({time.time() - t0:.1f} s): {json.dumps(results[name], default=str)[:2000]}", flush=True)
        return fn
    return wrap


def capture(fn, warmups=3):
    """fn() captured as a CUDA graph after warm-up calls on a side stream; -> (graph, fn's output)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(warmups):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = fn()
    return g, out


def graph_time(fn, repeats=50):
    """Microseconds per call of fn() replayed from a CUDA graph (launch overhead gone)."""
    g, _ = capture(fn)
    for _ in range(3):
        g.replay()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(repeats):
        g.replay()
    torch.cuda.synchronize()
    return 1e6 * (time.perf_counter() - t0) / repeats


def eager_time(fn, repeats=20):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return 1e6 * statistics.median(times)


compiled_quant = None
eager_quant = fp8.quantize_activations_1x128


@section("compile_quantizer")
def _():
    global compiled_quant
    t0 = time.time()
    compiled_quant = torch.compile(fp8.quantize_activations_1x128, dynamic=True)
    x = torch.randn(50, 1024, device="cuda", dtype=torch.bfloat16)
    q, s = compiled_quant(x)
    q2, s2 = fp8.quantize_activations_1x128(x)
    return {"compile_s": time.time() - t0, "equal_q": bool(torch.equal(q.float(), q2.float())),
            "equal_s": bool(torch.equal(s, s2))}


def gemms():
    rows = {}
    shapes = {"lm_qkv": (816, 2048, 2560), "lm_gate_up": (816, 2048, 32768), "lm_down": (816, 16384, 2048),
              "ex_qkv": (50, 1024, 2560), "ex_gate_up": (50, 1024, 8192), "ex_down": (50, 4096, 1024)}
    for name, (m, k, n) in shapes.items():
        lin = torch.nn.Linear(k, n, bias=False, device="cuda")
        layer = Fp8BlockLinear.from_module(lin)
        w = lin.weight.to(torch.bfloat16)
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        r = {"bf16_graph_us": graph_time(lambda: F.linear(x, w)), "bf16_eager_us": eager_time(lambda: F.linear(x, w)),
             "quant_eager_graph_us": graph_time(lambda: fp8.quantize_activations_1x128(x))}
        for kern in ("scaled_mm", "torchao"):
            why = fp8.kernel_unavailable(kern, layer, x.device)
            if why:
                r[kern] = why
                continue
            r[f"{kern}_graph_us"] = graph_time(lambda: fp8._GEMMS[kern](layer, x))
            r[f"{kern}_eager_us"] = eager_time(lambda: fp8._GEMMS[kern](layer, x))
        if compiled_quant is not None:
            r["quant_compiled_graph_us"] = graph_time(lambda: compiled_quant(x))
            orig = fp8.quantize_activations_1x128
            fp8.quantize_activations_1x128 = compiled_quant
            try:
                r["scaled_mm_cq_graph_us"] = graph_time(lambda: fp8._GEMMS["scaled_mm"](layer, x))
                r["scaled_mm_cq_eager_us"] = eager_time(lambda: fp8._GEMMS["scaled_mm"](layer, x))
            finally:
                fp8.quantize_activations_1x128 = orig
        rows[name] = {k: round(v, 1) if isinstance(v, float) else v for k, v in r.items()}
    return rows


if not args.no_gemms:
    section("gemms")(gemms)


cfg = preset("pi05-3b")
base, ours = serving_pair("pi05-3b", "cuda", args.kernel)
batch = libero_batch(cfg, 1, seed=0).to("cuda")
noise = torch.randn(1, cfg.chunk_size, cfg.max_action_dim, device="cuda")


def graphed_loop(model):
    """Prefix eager once, then the whole Euler loop captured as one CUDA graph; returns a callable
    that runs one chunk (prefix + replay)."""
    steps = cfg.num_inference_steps
    dt = -1.0 / steps
    x_static = noise.clone()
    ts = [torch.full((1,), 1.0 + s * dt, device="cuda") for s in range(steps)]
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
        field, _ = model.velocity_field(batch)

        def loop():
            x = x_static
            for t in ts:
                x = x + dt * field(x, t)
            return x

        g, out = capture(loop, warmups=2)

    def chunk():
        with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
            model.velocity_field(batch)  # the prefix cost (its cache is not the graph's: timing only)
        g.replay()
        return out

    def loop_only():
        g.replay()

    return chunk, loop_only


def prefix_only(model):
    def run():
        with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
            model.velocity_field(batch)
    return run


def sample(model):
    def run():
        with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
            model.sample_actions(batch, noise=noise.clone())
    return run


for name, model in (("bf16", base), ("fp8", ours)):
    section(f"chunk_eager_{name}")(lambda model=model: {"ms": eager_time(sample(model), 10) / 1e3})
    section(f"prefix_eager_{name}")(lambda model=model: {"ms": eager_time(prefix_only(model), 10) / 1e3})

    def _graphed(model=model):
        chunk, loop_only = graphed_loop(model)
        return {"chunk_ms": eager_time(chunk, 10) / 1e3, "loop_replay_ms": eager_time(loop_only, 10) / 1e3}
    section(f"chunk_graphed_loop_{name}")(_graphed)

if compiled_quant is not None:
    fp8.quantize_activations_1x128 = compiled_quant
    section("chunk_eager_fp8_compiled_quant")(lambda: {"ms": eager_time(sample(ours), 10) / 1e3})

    def _graphed_cq():
        chunk, loop_only = graphed_loop(ours)
        return {"chunk_ms": eager_time(chunk, 10) / 1e3, "loop_replay_ms": eager_time(loop_only, 10) / 1e3}
    section("chunk_graphed_loop_fp8_compiled_quant")(_graphed_cq)
    fp8.quantize_activations_1x128 = eager_quant  # the bench row below measures the shipped code

results["kernels_used"] = sorted({k for m in ours.modules() for k in getattr(m, "kernel_used", {}).values()})
del base, ours  # room for the bench's own pair of models
torch.cuda.empty_cache()


@section("bench_row_chunk_latency_ms_3b")
def _():
    import dataclasses

    from kilovla.bench.fp8 import _latency_3b_cuda

    return dataclasses.asdict(_latency_3b_cuda(10))


print(json.dumps(results, indent=1, default=str))
if args.out:
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1, default=str)
