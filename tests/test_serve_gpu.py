"""`kilovla serve` on a GPU: the CUDA-graphed denoising loop equals the eager one; bf16 runs; graphs are
kept per batch shape. Random weights of a tiny preset; no dataset needed."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kilovla.models.processor import PolicyMeta

pytestmark = pytest.mark.gpu
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _engine(precision="fp32", cuda_graphs=True, preset="pi05-tiny"):
    from kilovla.models.policy import VLAPolicy
    from kilovla.models.presets import build_model
    from kilovla.serve.engine import PolicyEngine

    model = build_model(preset, seed=0)
    stats = {k: {"mean": [0.0] * 4, "std": [1.0] * 4, "q01": [-1.0] * 4, "q99": [1.0] * 4, "min": [-1.0] * 4,
                 "max": [1.0] * 4} for k in ("observation.state", "action")}
    cams = list(model.config.enabled_cameras)[:2]
    meta = PolicyMeta(preset=preset, camera_map={f"observation.images.{c}": c for c in cams}, state_dim=4,
                      action_dim=4, stats=stats, image_size=[32, 32])
    return PolicyEngine(VLAPolicy(model, meta, "cuda"), "random", "cuda", precision=precision, cuda_graphs=cuda_graphs)


def _requests(engine, n, seed=0):
    from kilovla.serve.engine import Request

    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        obs = {k: rng.integers(0, 255, (32, 32, 3), dtype=np.uint8) for k in engine.meta.camera_map}
        out.append(Request({**obs, "observation.state": rng.standard_normal(4).astype(np.float32), "task": "go"},
                           seed=i))
    return out


@cuda
@pytest.mark.parametrize("batch", [1, 4])
def test_graphed_sampling_equals_eager(batch):
    graphed, eager = _engine(cuda_graphs=True), _engine(cuda_graphs=False)
    assert graphed.sampler.enabled and not eager.sampler.enabled
    requests = _requests(graphed, batch)
    first, _ = graphed.infer(requests)  # captured
    again, _ = graphed.infer(requests)  # replayed
    reference, _ = eager.infer(requests)
    for a, b, c in zip(first, again, reference):
        np.testing.assert_allclose(a, c, atol=1e-4)
        np.testing.assert_array_equal(a, b)
    assert len(graphed.sampler._graphs) == 1


@cuda
def test_bf16_serving_runs_and_stays_near_fp32():
    bf16, fp32 = _engine("bf16"), _engine("fp32")
    requests = _requests(bf16, 2)
    a, _ = bf16.infer(requests)
    b, _ = fp32.infer(requests)
    assert all(np.isfinite(x).all() for x in a)
    assert max(np.abs(x - y).max() for x, y in zip(a, b)) < 0.1


@cuda
def test_gr00t_serves_on_cuda_with_graphs():
    engine = _engine(preset="groot-tiny")
    chunks, _ = engine.infer(_requests(engine, 2))
    assert chunks[0].shape == (engine.horizon, 4)
