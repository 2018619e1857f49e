"""benchmarks/gpu_probe.py at tiny shapes on the CPU, so the prepared GPU run cannot rot: every section writes
its rows, the JSON and the markdown; a section that raises leaves the others; a rerun of some sections keeps
the others' rows; GPU-only parts say on the CPU what they skipped; the script imports nothing a bare GPU
machine lacks (a torch, numpy, safetensors and the checkout)."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kilovla.bench.models import _backends_to_compare
from kilovla.models.attention import resolve_backend

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_probe.py"
# kilovla's dependencies other than torch, numpy and safetensors: absent on the GPU machine.
ABSENT_THERE = ("pyarrow", "av", "rich", "yaml", "psutil", "fsspec", "matplotlib", "sentencepiece", "tokenizers",
                "torchcodec", "torchao", "ray", "websockets", "msgpack", "gymnasium", "metaworld", "PIL")
# Runs the script with those imports refused, as they would be on the GPU machine.
BOOT = """
import runpy, sys
absent = set(sys.argv[2].split(","))
class Absent:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in absent:
            raise ImportError(f"{name} is not installed on the GPU machine")
sys.meta_path.insert(0, Absent())
script = sys.argv[1]
sys.argv = [script] + sys.argv[3:]
runpy.run_path(script, run_name="__main__")
"""
TRAIN = ("gpu_train_samples_per_s_{}", "gpu_mfu_{}", "gpu_peak_memory_gb_{}")
SERVE = [f"gpu_chunk_ms_pi05_tiny_b{b}" for b in (1, 4, 16, 64)] + \
        [f"gpu_chunk_per_s_fp8_pi05_tiny_b{b}" for b in (1, 4, 16, 64)]


def probe(out: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}  # the CPU path, even on a machine with a GPU
    return subprocess.run([sys.executable, "-c", BOOT, str(SCRIPT), ",".join(ABSENT_THERE), "--tiny", "--out", str(out),
                           *args], capture_output=True, text=True, timeout=240, env=env)


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu-probe")
    result = probe(out)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return out, result, json.loads((out / "gpu_probe.json").read_text())


@pytest.fixture(scope="module")
def failing_rerun(tiny_run, tmp_path_factory):
    """The tiny run's folder, rerun with train_pi05 and a serve that raises."""
    out = tmp_path_factory.mktemp("gpu-probe-rerun") / "probe"
    shutil.copytree(tiny_run[0], out)
    result = probe(out, "--sections", "train_pi05,serve", "--fail-section", "serve")
    return out, result, json.loads((out / "gpu_probe.json").read_text())


def rows_of(doc: dict) -> dict[str, dict]:
    return {r["name"]: r for r in doc["rows"]}


def test_every_section_writes_its_rows_named_after_the_tiny_shapes(tiny_run):
    _, _, doc = tiny_run
    rows = rows_of(doc)
    expected = [n.format(tag) for tag in ("pi05_tiny", "groot_tiny") for n in TRAIN] + SERVE
    assert set(expected) <= set(rows)
    assert doc["errors"] == [] and set(doc["sections"]) == {"train_pi05", "train_groot", "serve"}
    for tag in ("pi05_tiny", "groot_tiny"):
        r = rows[f"gpu_train_samples_per_s_{tag}"]
        assert r["baseline"] > 0 and r["ours"] > 0 and r["limit"] > 1  # padded tokens exceed real ones
        assert r["ratio"] == pytest.approx(r["ours"] / r["baseline"], rel=0.01)  # ours / baseline: higher is better
    for name in SERVE:
        assert rows[name]["baseline"] > 0 and rows[name]["ours"] > 0, rows[name]


def test_packing_is_measured_with_every_varlen_backend_that_trains_here(tiny_run):
    rows = rows_of(tiny_run[2])
    auto = resolve_backend("auto", "cpu")
    for tag in ("pi05_tiny", "groot_tiny"):
        assert auto in rows[f"gpu_train_samples_per_s_{tag}"]["note"]
        for backend in _backends_to_compare("cpu"):
            if backend != auto:
                assert rows[f"gpu_train_samples_per_s_{tag}_{backend}"]["ours"] > 0


def test_rows_are_kilovla_bench_rows_and_the_markdown_lists_them(tiny_run):
    out, _, doc = tiny_run
    assert doc["suite"] == "gpu_probe" and doc["tiny"] is True
    assert {"gpu", "torch", "cuda", "python", "cpu"} <= set(doc["machine"])
    for r in doc["rows"]:
        assert set(r) == {"name", "unit", "baseline", "ours", "ratio", "limit", "note"}
    md = (out / "gpu_probe.md").read_text()
    assert md.startswith("# kilovla GPU probe") and "| row | unit | baseline | ours | ratio | limit | note |" in md
    assert all(f"| {r['name']} |" in md for r in doc["rows"])


def test_gpu_only_parts_say_on_the_cpu_what_they_skipped(tiny_run):
    _, result, doc = tiny_run
    rows = rows_of(doc)
    said = {
        "CUDA graphs skipped": "gpu_chunk_ms_pi05_tiny_b1",
        "FP8 GEMM kernels skipped": "gpu_chunk_per_s_fp8_pi05_tiny_b1",
        "peak memory skipped": "gpu_peak_memory_gb_pi05_tiny",
        "MFU skipped": "gpu_mfu_groot_tiny",
        "fp32, not bf16": "gpu_train_samples_per_s_pi05_tiny",
    }
    for words, row in said.items():
        assert result.stdout.count(f"gpu_probe: cpu: {words}") == 1, words  # one line, not one per row
        assert words in rows[row]["note"], (words, rows[row]["note"])
        assert any(words in f for f in doc["fallbacks"])
    assert rows["gpu_mfu_pi05_tiny"]["ours"] is None and rows["gpu_peak_memory_gb_groot_tiny"]["ours"] is None
    assert doc["sections"]["train_pi05"]["extra"]["model_tflops_per_sample"] > 0  # MFU's numerator is computed


def test_a_section_that_raises_leaves_the_other_sections_rows(failing_rerun):
    out, result, doc = failing_rerun
    assert result.returncode == 1
    assert doc["errors"] == [{"section": "serve", "error": "RuntimeError: injected failure (--fail-section serve)"}]
    rows = rows_of(doc)
    assert rows["gpu_train_samples_per_s_pi05_tiny"]["ours"] > 0
    assert not any(n.startswith("gpu_chunk") for n in rows)  # the failed rerun's rows are not the earlier run's
    assert "serve: RuntimeError: injected failure" in (out / "gpu_probe.md").read_text()


def test_rerunning_some_sections_keeps_the_others_rows(tiny_run, failing_rerun):
    _, _, doc = failing_rerun
    sections = doc["sections"]
    assert sections["train_groot"]["kept_from"] == tiny_run[2]["date"] and "kept_from" not in sections["train_pi05"]
    assert rows_of(doc)["gpu_train_samples_per_s_groot_tiny"] == rows_of(tiny_run[2])["gpu_train_samples_per_s_groot_tiny"]


# -- the parts that only a GPU exercises, with stand-ins --------------------------------------------
@pytest.fixture(scope="module")
def gpu_probe():
    spec = importlib.util.spec_from_file_location("gpu_probe", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_probe"] = module  # its dataclasses look their module up while they are made
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.modules.pop("gpu_probe", None)


def test_micro_batches_cut_the_per_sample_tensors(gpu_probe):
    from kilovla.bench.models import libero_batch
    from kilovla.models.presets import preset

    batch = libero_batch(preset("pi05-tiny", chunk_size=16), 5, seed=0)
    parts = list(gpu_probe.micro_batches(batch, 2))
    assert [p.batch_size for p in parts] == [2, 2, 1]
    assert torch.equal(torch.cat([p.tokens for p in parts]), batch.tokens)
    assert parts[2].camera_names == batch.camera_names


@dataclasses.dataclass(frozen=True)
class _NoSwitches:
    """A config with nothing to switch: `timed_step` replaces fields of the model's config."""


def test_out_of_memory_halves_the_micro_batch_and_says_so(gpu_probe):
    from kilovla.bench.models import libero_batch
    from kilovla.models.presets import preset

    class Tight(torch.nn.Module):  # out of memory above 2 samples per forward
        def __init__(self):
            super().__init__()
            self.config = _NoSwitches()
            self.w = torch.nn.Parameter(torch.ones(()))

        def forward(self, batch):
            if batch.batch_size > 2:
                raise torch.cuda.OutOfMemoryError("CUDA out of memory (stand-in)")
            return {"per_sample": self.w * batch.state.sum(1)}

    probe = gpu_probe.Probe(gpu_probe.TINY, torch.device("cpu"))
    model = Tight()
    batch = libero_batch(preset("pi05-tiny", chunk_size=16), 8, seed=0)
    timing = gpu_probe.TrainTiming(micro_batch=8, global_batch=8)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    assert gpu_probe.timed_step(probe, model, opt, list(model.parameters()), batch, {}, timing) > 0
    assert timing.micro_batch == 2
    assert timing.notes == ["out of memory: micro-batch 4", "out of memory: micro-batch 2"]


def test_serving_skips_a_batch_the_time_budget_cannot_fit_and_says_why(gpu_probe):
    probe = gpu_probe.Probe(gpu_probe.TINY, torch.device("cpu"))
    assert gpu_probe.serve_skip(probe, 1, None, gpu_probe.Budget(60), 0) == ""
    assert "spent" in gpu_probe.serve_skip(probe, 4, None, gpu_probe.Budget(-1), 0)
    # batch 16 took 20 s: batch 64 is estimated at 0.75 x 4 x 20 = 60 s, more than the 30 s left
    assert gpu_probe.serve_skip(probe, 64, (16, 20.0, 0), gpu_probe.Budget(30), 0).startswith("skipped: ~60 s estimated")
