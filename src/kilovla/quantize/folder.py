"""`kilovla quantize`: a policy folder in, a block-wise FP8 policy folder and its report out.

The output is a policy folder like any other (``kilovla eval --policy.path=DIR`` runs it)::

    model.safetensors    FP8 layers as `weight` (float8_e4m3fn) + `weight_scale_inv` (float32);
                         every other tensor in `--quant.dtype` (bf16 by default)
    policy.json          the source's policy description + `quantization_config`
    quant_report.json    sizes, per-layer SQNR, action MSE, closed-loop success, latency (quantize/report.py)
    quant_report.md

The source is a policy folder with model.safetensors, or an FSDP run's intermediate checkpoint
(`state/` shards, read as `kilovla eval` reads them; its on-disk size is then not reported, since the
shards hold the optimizer too).

What can be checked without the weights is checked first (the output path, quant.samples, the layer
selection on a meta-device model, the dataset's features, the device), then the weights are
quantized in memory (non-finite weights are refused here), and only then is anything written:
everything is built in a hidden temporary folder next to DIR and renamed at the end. Bad input or a
failure midway leaves nothing behind (parent folders this call created are removed again), and an
existing DIR is never touched.
"""

from __future__ import annotations

import copy
import math
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import torch

from kilovla.errors import KilovlaError
from kilovla.machine import resolve_device
from kilovla.policy_folder import Interface, PolicyFolder, save_policy, state_width
from kilovla.quantize import report as qreport
from kilovla.staging import remove_stale_staging, staging_path
from kilovla.quant.fp8 import (KERNELS, Fp8BlockLinear, Fp8Config, Fp8Weights, checkpoint_bytes, quantization_config,
                               quantize_model, select_layers, set_kernel)

_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def read_source(source: str | Path) -> PolicyFolder:
    """The source folder, checked: a policy folder with float weights (model.safetensors, an FSDP run's
    `state/` shards, or a LoRA run's adapters)."""
    folder = PolicyFolder.open(source)
    folder.refuse_quantized("quantize the unquantized policy it came from", said="already quantized")
    folder.check_weights()
    return folder


def describe_source(source: str | Path) -> Interface:
    """The source policy's declared interface (dims, cameras), read from policy.json alone (no weights), so
    a policy that cannot run in the env is refused before any quantization work."""
    return read_source(source).interface()


def check_dataset(dataset: str | Path, meta, flag: str = "--quant.dataset") -> None:
    """`dataset` (given as `flag`) exists, is LeRobot data and has the cameras, state inputs and actions the
    policy reads."""
    from kilovla.data.meta import DatasetMeta

    path = Path(dataset)
    if not path.is_dir():
        raise KilovlaError(f"{flag} {dataset}: no such folder")
    features = DatasetMeta(path).features
    problems = [f"it lacks {k}" for k in (*meta.camera_map, *meta.state_keys, "action") if k not in features]
    if not problems:
        width = lambda k: math.prod(features[k].shape)  # noqa: E731
        if width("action") != meta.action_dim:
            problems.append(f"action has {width('action')} dims, the policy {meta.action_dim}")
        state = sum(width(k) for k in meta.state_keys)
        if state != meta.state_dim:
            problems.append(f"state inputs {list(meta.state_keys)} have {state} dims, the policy {meta.state_dim}")
    if problems:
        raise KilovlaError(f"{flag} {dataset} does not fit the policy: " + "; ".join(problems))


def _check_out(out: Path) -> None:
    if out.exists():
        raise KilovlaError(f"--output_dir {out}: already exists; nothing was written (choose a new folder)")
    for parent in out.parents:
        if parent.exists():
            if not parent.is_dir():
                raise KilovlaError(f"--output_dir {out}: {parent} is a file, not a folder")
            break


def quantize_policy_folder(source: str | Path, out: str | Path, config: Fp8Config = Fp8Config(), *,
                           dataset: str | Path | None = None, samples: int = 64,
                           evaluation: Callable[[object], dict] | None = None, seed: int = 0,
                           latency_repeats: int = 5, kernel: str = "auto", device: str = "cpu", ema: bool = False) -> dict:
    """Quantize `source` into the new folder `out`; returns the report (also written there).

    `dataset` (held-out LeRobot data) adds the action MSE and the layers' output SQNR; `evaluation`
    (policy -> `evaluate` report) adds the closed-loop comparison (check the env against
    `describe_source(source)` before calling). `ema` quantizes (and compares against) the folder's EMA
    weights instead of its last ones. `device` ("cpu", "cuda", "auto") is where both policies
    run for the measurements, so it decides which FP8 kernels `kernel` can get. Everything that can be
    checked without the weights is checked first; nothing is written on any refusal.
    """
    from kilovla.models.policy import VLAPolicy
    from kilovla.models.presets import build_model
    from kilovla.models.residual import RESIDUAL_FILE, base_of

    source, out = Path(source), Path(out)
    if samples < 1:
        raise KilovlaError(f"--quant.samples {samples}: must be >= 1")
    if latency_repeats < 1:
        raise KilovlaError(f"--quant.latency_repeats {latency_repeats}: must be >= 1")
    if kernel not in KERNELS:
        raise KilovlaError(f"--quant.kernel must be one of {KERNELS}, not {kernel!r}")
    _check_out(out)
    folder = read_source(source)
    meta = folder.meta
    select_layers(build_model(meta.preset, device="meta", **meta.overrides), config.include, config.exclude, config.scope)
    if dataset is not None:
        check_dataset(dataset, meta)
    if ema and not folder.has_ema:
        raise KilovlaError(f"--policy.ema: {source / 'ema.safetensors'} is missing; only runs with ema_decay write EMA weights")
    device = resolve_device(device, "--quant.device")

    baseline = folder.load(device, ema=ema)
    # an RL folder's base is quantized; its residual actor (a few small layers) is carried over as it is
    model = copy.deepcopy(base_of(baseline.model)).cpu()
    weight_sqnr = quantize_model(model, config)  # non-finite weights stop here, before anything is written

    created = [p for p in reversed(out.parents) if not p.exists()]
    out.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_staging(out)  # what a killed quantization of this folder left
    tmp = staging_path(out)
    try:
        tmp.mkdir()
        qconfig = _write_folder(tmp, VLAPolicy(model, baseline.meta, root=source), config, list(weight_sqnr))
        if baseline.meta.residual is not None:
            shutil.copy2(source / RESIDUAL_FILE, tmp / RESIDUAL_FILE)
        quantized = PolicyFolder.open(tmp).load(device)  # what is on disk is what gets measured
        set_kernel(quantized.model, kernel)
        report = _report(source, out, tmp, qconfig, baseline, quantized, config, weight_sqnr, dataset=dataset, samples=samples,
                         evaluation=evaluation, seed=seed, latency_repeats=latency_repeats)
        report["weights"] = "ema" if ema else "last"
        qreport.write_report(tmp, report)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        for folder in reversed(created):  # the parents this call made, deepest first, if still empty
            try:
                folder.rmdir()
            except OSError:
                break
        raise
    return report


def _write_folder(folder: Path, policy, config: Fp8Config, layers: list[str]) -> dict:
    """A policy folder as `save_policy` writes it (tokenizer files included), the kept layers stored in
    `config.dtype` and policy.json with the `quantization_config`, which is returned as written."""
    kept = _DTYPES[config.dtype]
    fp8_keys = {f"{n}.{b}" for n, m in policy.model.named_modules() if isinstance(m, Fp8Weights)
                for p in m.payload_names(m) for b in (p, p + "_scale_inv")}
    state = {k: v if k in fp8_keys or not v.is_floating_point() else v.to(kept)
             for k, v in policy.model.state_dict().items()}
    qconfig = quantization_config(config, layers, policy.model)
    save_policy(policy, folder, state=state, quantization=qconfig,
                metadata={"format": "pt", "quant_method": "fp8", "weight_block_size": str(config.block)})
    return PolicyFolder.open(folder).quantization  # as it reads back (JSON lists, not tuples)


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
        obs[key] = np.zeros((1, state_width(policy.meta, key)), np.float32)  # a loaded policy has its stats
    return policy.processor.observation_batch(obs)


def _report(source, out, folder, qconfig, baseline, quantized, config, weight_sqnr, *, dataset, samples, evaluation, seed,
            latency_repeats) -> dict:
    from kilovla.models.residual import base_of

    sizes = qreport.folder_bytes(source, baseline.model.state_dict(), folder, folder)
    counts = checkpoint_bytes(base_of(baseline.model), list(weight_sqnr), config.block)
    sizes.update(fp8_params=counts["fp8_params"], total_params=counts["total_params"])
    report = {"source": str(source), "out": str(out), "quantization_config": qconfig,
              "size": sizes, "layers": {n: {"weight_sqnr_db": s} for n, s in weight_sqnr.items()}}
    rows = None
    if dataset is not None:
        try:
            rows = qreport.heldout_rows(dataset, baseline, samples)
            actions = qreport.compare_actions(baseline, quantized, rows, seed=seed)
        except KilovlaError as e:  # what check_dataset cannot see from info.json (the action window, ...)
            raise KilovlaError(f"--quant.dataset {dataset} does not fit the policy: {e}") from None
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
