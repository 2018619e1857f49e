"""Run under torchrun (2 ranks): FSDP2 sharding of each model family, measured with hooks.

Prints one JSON line per family from rank 0: the model's parameter bytes, this rank's resident
(sharded) bytes, the largest number of parameter bytes unsharded at once during a training
forward + backward, and the sizes of the root and of the largest layer unit.
"""

import json
import sys

import torch
from torch.distributed.tensor import DTensor

from kilovla.models.batch import PaddedBatch
from kilovla.models.presets import build_model
from kilovla.models.tokenize import ByteTokenizer, tokenize_batch
from kilovla.train import distributed


def nbytes(params) -> int:
    return sum(p.numel() * p.element_size() for p in params)


def batch_for(cfg) -> PaddedBatch:
    g = torch.Generator().manual_seed(0)
    tokens, mask = tokenize_batch(ByteTokenizer(), ["pick the cube", "open the drawer"], cfg.max_language_tokens)
    horizon = getattr(cfg, "chunk_size", None) or cfg.action_horizon
    s = cfg.vision.image_size
    return PaddedBatch(images=torch.rand(2, len(cfg.cameras), 3, s, s, generator=g),
                       image_masks=torch.ones(2, len(cfg.cameras), dtype=torch.bool), camera_names=cfg.cameras,
                       tokens=tokens, token_mask=mask, state=torch.randn(2, cfg.max_state_dim, generator=g),
                       actions=torch.randn(2, horizon, cfg.max_action_dim, generator=g))


def measure(name: str, world, **overrides) -> dict:
    model = build_model(name, **overrides)
    total = nbytes(model.parameters())
    unit_bytes = [nbytes(p for m in unit for p in m.parameters()) for unit in distributed.layer_units(model)]
    root = total - sum(unit_bytes)
    distributed.parallelize(model, "fsdp", world)
    resident = sum(p.to_local().numel() * p.element_size() for p in model.parameters())
    peak = [0]

    def unsharded(*_):  # parameters that are plain tensors right now are gathered (FSDP2 swaps them in)
        peak[0] = max(peak[0], nbytes(p for p in model.parameters() if not isinstance(p, DTensor)))

    for m in model.modules():
        m.register_forward_pre_hook(unsharded)
        m.register_forward_hook(unsharded)
        m.register_full_backward_pre_hook(unsharded)
        m.register_full_backward_hook(unsharded)
    batch = batch_for(model.config)
    model(batch)["loss"].backward()
    return {"family": name, "total": total, "resident": resident, "peak_unsharded": peak[0], "root": root,
            "largest_unit": max(unit_bytes), "units": len(unit_bytes)}


def main() -> None:
    world = distributed.init()
    deep = {"pi05-tiny": dict(lm={"depth": 6}, expert={"depth": 6}, vision={"depth": 4}),
            "groot-tiny": dict(llm={"depth": 4}, dit={"depth": 6, "heads": 2, "head_dim": 16, "output_dim": 32}),
            "smolvla-tiny": dict(text={"depth": 6}, num_vlm_layers=6, vision={"depth": 4}),
            "groot-n17-tiny": dict(llm={"depth": 6}, vision={"depth": 4}, dit={"depth": 8})}
    results = [measure(name, world, **deep[name]) for name in sys.argv[1:]]
    if world.is_main:
        for r in results:
            print(json.dumps(r), flush=True)
    distributed.shutdown()


if __name__ == "__main__":
    main()
