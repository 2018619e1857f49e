"""`kilovla quantize`: a policy folder in, a block-wise FP8 policy folder and its report out.

The output is a policy folder like any other (``kilovla eval --policy DIR`` runs it)::

    model.safetensors    FP8 layers as `weight` (float8_e4m3fn) + `weight_scale_inv` (float32);
                         every other tensor in `--dtype` (bf16 by default)
    policy.json          the source's policy description + `quantization_config`
    quant_report.json    sizes, per-layer SQNR, action MSE, closed-loop success, latency (quant/report.py)
    quant_report.md

Everything is built in a hidden temporary folder next to DIR and renamed at the end: bad input or a
failure midway leaves nothing behind, and an existing DIR is never touched.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import uuid
from collections.abc import Callable
from pathlib import Path

import torch

from kilovla.errors import KilovlaError
from kilovla.quant.fp8 import Fp8BlockLinear, Fp8Config, checkpoint_bytes, quantization_config, quantize_model, set_kernel
from kilovla.quant import report as qreport

_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def _check_source(source: Path) -> None:
    meta = source / "policy.json"
    if not meta.is_file() or not (source / "model.safetensors").is_file():
        raise KilovlaError(f"{source}: not a policy folder (needs policy.json and model.safetensors)")
    try:
        fields = json.loads(meta.read_text())
    except json.JSONDecodeError as e:
        raise KilovlaError(f"{meta}: not JSON: {e}") from None
    if isinstance(fields, dict) and "quantization_config" in fields:
        raise KilovlaError(f"{source}: already quantized (policy.json has a quantization_config); "
                           "quantize the unquantized policy it came from")


def quantize_policy_folder(source: str | Path, out: str | Path, config: Fp8Config = Fp8Config(), *,
                           dataset: str | Path | None = None, samples: int = 64,
                           evaluation: Callable[[object], dict] | None = None, seed: int = 0,
                           latency_repeats: int = 5, kernel: str = "auto", device: str = "cpu") -> dict:
    """Quantize `source` into the new folder `out`; returns the report (also written there).

    `dataset` (held-out LeRobot data) adds the action MSE and the layers' output SQNR; `evaluation`
    (policy -> `evaluate` report) adds the closed-loop comparison.
    """
    from kilovla.models.policy import VLAPolicy, load_checkpoint_policy

    source, out = Path(source), Path(out)
    if out.exists():
        raise KilovlaError(f"--out {out}: already exists; nothing was written (choose a new folder)")
    _check_source(source)
    baseline = load_checkpoint_policy(source, device=device)
    model = copy.deepcopy(baseline.model).cpu()
    weight_sqnr = quantize_model(model, config)  # bad regexes stop here, before anything is written

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.tmp-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        _write_folder(tmp, VLAPolicy(model, baseline.meta, root=source), config, list(weight_sqnr))
        quantized = load_checkpoint_policy(tmp, device=device)  # what is on disk is what gets measured
        set_kernel(quantized.model, kernel)
        report = _report(source, out, tmp, baseline, quantized, config, weight_sqnr, dataset=dataset, samples=samples,
                         evaluation=evaluation, seed=seed, latency_repeats=latency_repeats)
        qreport.write_report(tmp, report)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return report


def _write_folder(folder: Path, policy, config: Fp8Config, layers: list[str]) -> None:
    """A policy folder as `VLAPolicy.save` writes it (tokenizer files included), then the kept layers
    re-stored in `config.dtype` and the `quantization_config` added to policy.json."""
    from kilovla.models.checkpoints import save_safetensors

    policy.save(folder)
    kept = _DTYPES[config.dtype]
    fp8_keys = {f"{n}.{b}" for n, m in policy.model.named_modules() if isinstance(m, Fp8BlockLinear)
                for b in ("weight", "weight_scale_inv")}
    state = {k: v if k in fp8_keys or not v.is_floating_point() else v.to(kept)
             for k, v in policy.model.state_dict().items()}
    save_safetensors(state, folder / "model.safetensors", metadata={"format": "pt", "quant_method": "fp8"})
    fields = json.loads((folder / "policy.json").read_text())
    fields["quantization_config"] = quantization_config(config, layers)
    (folder / "policy.json").write_text(json.dumps(fields, indent=2))


def _latency_batch(policy, rows: list[dict] | None):
    """One observation: the first held-out sample, or a synthetic one (black frames, zero state)."""
    import numpy as np

    if rows:
        first = {k: v[:1] for k, v in rows[0].items()}
        return policy.processor.observation_batch(first)
    obs = {"task": ["quantization latency probe"]}
    for key in policy.meta.camera_map:
        obs[key] = np.zeros((1, 64, 64, 3), np.uint8)
    for key in policy.meta.state_keys:
        width = len(policy.meta.stats[key]["q01"] if "q01" in policy.meta.stats[key] else policy.meta.stats[key]["mean"])
        obs[key] = np.zeros((1, width), np.float32)
    return policy.processor.observation_batch(obs)


def _report(source, out, folder, baseline, quantized, config, weight_sqnr, *, dataset, samples, evaluation, seed,
            latency_repeats) -> dict:
    sizes = qreport.folder_bytes(source, folder, folder)
    counts = checkpoint_bytes(baseline.model, list(weight_sqnr), config.block)
    sizes.update(fp8_params=counts["fp8_params"], total_params=counts["total_params"])
    report = {"source": str(source), "out": str(out), "quantization_config": quantization_config(config, list(weight_sqnr)),
              "size": sizes, "layers": {n: {"weight_sqnr_db": s} for n, s in weight_sqnr.items()}}
    rows = None
    if dataset is not None:
        try:
            rows = qreport.heldout_rows(dataset, baseline, samples)
            actions = qreport.compare_actions(baseline, quantized, rows, seed=seed)
        except KilovlaError as e:
            raise KilovlaError(f"--dataset {dataset} does not fit the policy: {e}") from None
        for name, value in actions.pop("output_sqnr_db").items():
            report["layers"][name]["output_sqnr_db"] = value
        report["actions"] = {"dataset": str(dataset), **actions}
    if evaluation is not None:
        report["closed_loop"] = qreport.closed_loop_summary(evaluation, baseline, quantized, seed)
    batch = _latency_batch(baseline, rows)
    latency = qreport.chunk_latency({"baseline": baseline, "quantized": quantized}, batch, repeats=latency_repeats)
    kernels = sorted({k for m in quantized.model.modules() if isinstance(m, Fp8BlockLinear) for k in m.kernel_used.values()})
    report["latency"] = {"device": str(quantized.device), "kernel": ", ".join(kernels) or "-", "batch_size": 1,
                         "baseline_s": latency["baseline"], "quantized_s": latency["quantized"],
                         "repeats": latency_repeats}
    return report
