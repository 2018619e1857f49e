"""`kilovla bench packing`, `pruning` and `moe`: training-step throughput of pi0.5 (and SmolVLA, GR00T N1.7).

The batch follows pi0.5 on LIBERO as openpi feeds it: 3 camera slots x 256 tokens (224 px, patch
14) with the third camera blank, language padded to 200 tokens (real prompts 8-48 tokens), action
chunks of 10-50 steps padded to 50. The model is pi0.5's architecture at a width that trains on
2 CPU cores (`bench-cpu`); on a CUDA machine the same suite runs in bf16 and reports MFU. The
packed path uses the `auto` attention backend.

- packing: baseline = the padded path (fixed shapes); ours = packing + varlen attention (no padding,
  no blank camera). limit = padded tokens / real tokens, the most packing can save. Rows
  `attention_backend_<name>` compare the exact varlen backends that train on this device against the
  per-segment loop; the fastest on CPU is `models.attention.CPU_AUTO`. Row `train_samples_per_s_smolvla`:
  the same comparison for SmolVLA at its LIBERO layout as LeRobot feeds it (2 cameras x 64 tokens after
  the pixel shuffle, language padded to 48, one state token, chunk 50), at a CPU width (`BENCH_SMOLVLA`).
  Row `train_samples_per_s_groot_n17`: the same for GR00T N1.7 at its LIBERO layout as NVIDIA's N1.7 LIBERO
  fine-tunes feed it (cameras image and wrist_image, 256 px cropped to 230, which the Qwen3-VL processor
  rounds to 224 px: 49 merged tokens each, as groot-n17-3b's config; language padded to the config's 200;
  one state token; every sample the full 40-step horizon, since the DiT runs it all), at a CPU width
  (`BENCH_GROOT_N17`: the release's image size, language limit and horizon, narrow layers).
- pruning: baseline = blank camera masked + 200-token language (openpi); ours = blank camera pruned
  before the ViT + per-batch (dynamic) language padding, both in the padded path.
- moe: baseline = the dense action expert (MLP 2048) at pi05-base's expert width (1024); ours = an
  E = 8, K = 2 MoE expert (expert MLP 1024: the same active FLOPs per token), both packed, on batches of
  8 LIBERO-layout samples (`--quick`: width 256, 2 samples). The issue's bar: ours >= 1 / 1.3 of the
  baseline's samples/s on CPU.

Forward + backward + optimizer step, interleaved repeats, median samples/s.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

import numpy as np
import torch

from kilovla.bench.common import DEFAULT_OUT, Row, write_suite
from kilovla.models.attention import resolve_backend
from kilovla.models.batch import PaddedBatch
from kilovla.models.family import chunk_length, family_of
from kilovla.models.groot.dit import DiTConfig
from kilovla.models.groot_n17 import GrootN17Config, GrootN17Model
from kilovla.models.language import DecoderConfig
from kilovla.models.moe import MoEConfig
from kilovla.models.pi05 import Pi05Config, Pi05Model
from kilovla.models.smolvla import SmolVLAConfig, SmolVLAModel
from kilovla.models.tokenize import BYTE_VOCAB_SIZE, ByteTokenizer, tokenize_batch
from kilovla.models.vision import ViTConfig
from kilovla.train.metrics import peak_flops
from kilovla.train.optim import fused_adamw

BENCH_CPU = Pi05Config(
    vision=ViTConfig(image_size=224, patch_size=14, width=64, depth=2, heads=2, mlp_dim=128),
    lm=DecoderConfig(width=128, depth=3, heads=2, kv_heads=1, head_dim=32, mlp_dim=256, vocab_size=BYTE_VOCAB_SIZE),
    expert=DecoderConfig(width=64, depth=3, heads=2, kv_heads=1, head_dim=32, mlp_dim=128, vocab_size=0),
    chunk_size=50, max_action_dim=8, max_state_dim=8, max_language_tokens=200,
)
BENCH_SMOLVLA = SmolVLAConfig(
    vision=ViTConfig(image_size=128, patch_size=4, width=64, depth=2, heads=2, mlp_dim=128), scale_factor=4,
    text=DecoderConfig(width=128, depth=4, heads=4, kv_heads=2, head_dim=32, mlp_dim=256, vocab_size=BYTE_VOCAB_SIZE),
    num_vlm_layers=4, chunk_size=50, max_action_dim=8, max_state_dim=8, max_language_tokens=48,
    cameras=("image", "wrist_image"),
)
_N17 = GrootN17Config()  # nvidia/GR00T-N1.7-3B's shapes: camera size, language limit and horizon kept below
BENCH_GROOT_N17 = GrootN17Config(
    vision=dataclasses.replace(_N17.vision, width=32, depth=2, heads=2, mlp_dim=64, deepstack_layers=(0, 1)),
    llm=DecoderConfig(width=64, depth=3, heads=2, kv_heads=1, head_dim=32, mlp_dim=128, vocab_size=BYTE_VOCAB_SIZE),
    mrope_section=(6, 5, 5), vl_self_attention_depth=1, vl_self_attention_heads=2, vl_self_attention_head_dim=32,
    dit=DiTConfig(depth=4, heads=2, head_dim=32, output_dim=64), hidden_size=64, max_action_dim=8, max_state_dim=8,
    num_embodiments=2, cameras=("image", "wrist_image"),
)
WORDS = "pick up the black bowl on the cookie box and place it on the plate near the stove drawer".split()


def libero_batch(cfg, batch_size: int, seed: int, min_horizon: int = 10) -> PaddedBatch:
    """Prompts of 8-48 byte tokens padded to the model's limit, horizons `min_horizon` to the chunk (the
    family's `chunk_length`), the first two camera slots present (a third, as pi0.5 has, blank and masked)."""
    rng = np.random.default_rng(seed)
    prompts = []
    for _ in range(batch_size):
        target = int(rng.integers(8, 49))  # byte tokens incl. BOS
        words = " ".join(rng.choice(WORDS, 12))
        prompts.append(words[: target - 1])
    tokens, mask = tokenize_batch(ByteTokenizer(), prompts, cfg.max_language_tokens)
    pad = cfg.max_language_tokens - tokens.shape[1]
    tokens, mask = torch.nn.functional.pad(tokens, (0, pad)), torch.nn.functional.pad(mask, (0, pad))
    chunk = chunk_length(cfg)
    horizons = torch.as_tensor(rng.integers(min_horizon, chunk + 1, batch_size))
    g = torch.Generator().manual_seed(seed)
    image_masks = torch.ones(batch_size, len(cfg.cameras), dtype=torch.bool)
    image_masks[:, 2:] = False  # LIBERO has no right wrist camera: openpi feeds a blank one, masked
    s = cfg.vision.image_size
    return PaddedBatch(
        images=torch.rand(batch_size, len(cfg.cameras), 3, s, s, generator=g), image_masks=image_masks,
        camera_names=cfg.cameras, tokens=tokens, token_mask=mask,
        state=torch.randn(batch_size, cfg.max_state_dim, generator=g),
        actions=torch.randn(batch_size, chunk, cfg.max_action_dim, generator=g),
        horizon_mask=torch.arange(chunk)[None] < horizons[:, None])


def token_counts(cfg, batch: PaddedBatch) -> tuple[int, int]:
    """(tokens the padded path processes, real tokens) in the LM + expert streams, counted as the
    family's token plan counts them (a state token with the action tokens)."""
    fam = family_of(cfg)
    chunk = fam.chunk_length(cfg)
    p, rest = fam.camera_tokens(cfg), fam.action_tokens(cfg) - chunk
    padded = batch.batch_size * (len(cfg.cameras) * p + cfg.max_language_tokens + chunk + rest)
    real = (int(batch.image_masks.sum()) * p + int(batch.token_mask.sum()) + int(batch.horizon_mask.sum())
            + batch.batch_size * rest)
    return padded, real


def _model_flops(model: Pi05Model, batch: PaddedBatch) -> float:
    """Forward + backward FLOPs of the real tokens: 6 * params * tokens per stream (attention left out)."""
    cfg = model.config
    count = lambda m: sum(p.numel() for p in m.parameters())  # noqa: E731
    vit = count(model.vlm.vision_tower)
    lm = count(model.vlm.language_model) - model.vlm.language_model.embed_tokens.weight.numel()
    p = cfg.vision.tokens
    images = int(batch.image_masks.sum())
    prefix = images * p + int(batch.token_mask.sum())
    return 6.0 * (vit * images * p + lm * prefix + count(model.expert) * int(batch.horizon_mask.sum()))


def _step_time(model, opt, batch, switches: dict) -> float:
    model.config = dataclasses.replace(model.config, **switches)
    t0 = time.perf_counter()
    out = model(batch)
    loss = out["loss"] + out["moe_regularizer"] if "moe_regularizer" in out else out["loss"]
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()
    if batch.images.is_cuda:
        torch.cuda.synchronize()
    return time.perf_counter() - t0


def _throughputs(model, opt, batches, variants: dict[str, dict], repeats: int, autocast) -> dict[str, float]:
    """Median samples/s of each variant (config switches), all interleaved in one process."""
    times: dict[str, list[float]] = {name: [] for name in variants}
    with autocast:
        for switches in variants.values():  # warm-up: allocator, kernels
            _step_time(model, opt, batches[0], switches)
        for _ in range(repeats):
            for b in batches:
                for name, switches in variants.items():
                    times[name].append(_step_time(model, opt, b, switches))
    n = batches[0].batch_size
    return {name: n / float(np.median(t)) for name, t in times.items()}


def _compare(model, opt, batches, base: dict, ours: dict, repeats: int, autocast) -> tuple[float, float]:
    result = _throughputs(model, opt, batches, {"base": base, "ours": ours}, repeats, autocast)
    return result["base"], result["ours"]


def _setup(quick: bool, device: str, model_class=Pi05Model, config=BENCH_CPU, min_horizon: int = 10):
    torch.manual_seed(0)
    cuda = device == "cuda"
    model = model_class(dataclasses.replace(config, attention_backend="auto")).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    batch_size = 4 if quick else 8
    batches = [libero_batch(model.config, batch_size, seed, min_horizon).to(device)
               for seed in range(2 if quick else 3)]
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if cuda else torch.autocast("cpu", enabled=False)
    return model, opt, batches, autocast


def _mfu(model, batch, samples_per_s: float) -> float | None:
    peak = peak_flops(batch.images.device)
    return None if peak is None else _model_flops(model, batch) / batch.batch_size * samples_per_s / peak


def _family_packing(quick: bool, device: str, name: str, model_class, config, note: str,
                    min_horizon: int = 10) -> tuple[Row, dict]:
    """Another family padded vs packed at its LIBERO layout, in the same process as the pi0.5 rows; `note`
    names the device as {device}."""
    model, opt, batches, autocast = _setup(quick, device, model_class, config, min_horizon)
    padded, real = map(sum, zip(*(token_counts(model.config, b) for b in batches)))
    base, ours = _compare(model, opt, batches, {"packing": False}, {"packing": True}, 1 if quick else 3, autocast)
    row = Row.compare(name, "samples/s", base, ours, higher_is_better=True, limit=round(padded / real, 3),
                      note=note.format(device=device))
    return row, {"padded_tokens": padded, "real_tokens": real, "fraction_of_ideal": (ours / base) / (padded / real)}


def _smolvla_packing(quick: bool, device: str) -> tuple[Row, dict]:
    cfg = BENCH_SMOLVLA
    return _family_packing(quick, device, "train_samples_per_s_smolvla", SmolVLAModel, cfg,
                           f"SmolVLA LIBERO layout (2x{family_of(cfg).camera_tokens(cfg)} img tokens; lang<=48; "
                           f"1 state token; horizon 10-50 of 50), {{device}}; fixed padding vs packing + varlen; "
                           f"limit = padded/real tokens of the LM + expert; the ViT's {cfg.vision.tokens} patches a "
                           f"camera run the same either way")


def _groot_n17_packing(quick: bool, device: str) -> tuple[Row, dict]:
    """Every sample has the whole chunk: the DiT runs all 1 + horizon tokens in both paths (a horizon mask
    would only weight the loss), so they count as real."""
    cfg = BENCH_GROOT_N17
    v, horizon = cfg.vision, chunk_length(cfg)
    return _family_packing(quick, device, "train_samples_per_s_groot_n17", GrootN17Model, cfg,
                           f"GR00T N1.7 LIBERO layout (2x{family_of(cfg).camera_tokens(cfg)} img tokens: 256 px "
                           f"cropped to 230, which the Qwen3-VL processor rounds to a multiple of "
                           f"{v.patch_size * v.merge_size}, {v.image_size} px; lang<={cfg.max_language_tokens}; "
                           f"1 state token; every sample the full horizon {horizon}: the DiT runs it all), "
                           f"{{device}}; fixed padding vs packing + varlen; limit = padded/real tokens of the "
                           f"LLM + DiT", min_horizon=horizon)


def _backends_to_compare(device: str) -> list[str]:
    """Exact varlen backends that can train on `device` (flex has no backward on CPU)."""
    names = ["sdpa_segments", "sdpa_masked", "sdpa_batched"]
    if device == "cuda":
        names += [b for b in ("flex", "flash_attn", "torch_varlen") if resolve_backend(b, device) == b]
    return names


def run_packing(*, quick: bool = False, out_dir: str | Path = DEFAULT_OUT, device: str | None = None, console=None) -> Path:
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    model, opt, batches, autocast = _setup(quick, device)
    backend = resolve_backend("auto", device)
    padded, real = map(sum, zip(*(token_counts(model.config, b) for b in batches)))
    repeats = 1 if quick else 3
    base, ours = _compare(model, opt, batches, {"packing": False}, {"packing": True}, repeats, autocast)
    rows = [Row.compare("train_samples_per_s", "samples/s", base, ours, higher_is_better=True,
                        limit=round(padded / real, 3),
                        note=f"pi0.5 LIBERO layout (3x256 img tokens, 1 blank; lang<=200; horizon 10-50), "
                             f"{device}; fixed padding vs packing + varlen ({backend}, the auto choice); "
                             f"limit = padded/real tokens")]
    mfu = _mfu(model, batches[0], ours)
    if mfu is not None:
        rows.append(Row.compare("mfu", "fraction", _mfu(model, batches[0], base), mfu, higher_is_better=True,
                                note="model FLOPs of real tokens / peak bf16"))
    # Which exact varlen kernel the packed path should use here: the per-segment loop is the baseline.
    names = _backends_to_compare(device)
    speeds = _throughputs(model, opt, batches, {b: {"packing": True, "attention_backend": b} for b in names},
                          repeats, autocast)
    for name in names:
        rows.append(Row.compare(f"attention_backend_{name}", "samples/s", speeds["sdpa_segments"], speeds[name],
                                higher_is_better=True,
                                note=f"packed training step, {device}: one SDPA call per sample vs {name}"
                                     + (" (the auto choice)" if name == backend else "")))
    if device != "cuda":
        rows.append(Row.compare("attention_backend_flex", "samples/s", speeds["sdpa_segments"], None,
                                higher_is_better=True, note="flex_attention has no backward on CPU: cannot train"))
    smolvla_row, smolvla = _smolvla_packing(quick, device)
    groot_n17_row, groot_n17 = _groot_n17_packing(quick, device)
    rows += [smolvla_row, groot_n17_row]
    extra = {"padded_tokens": padded, "real_tokens": real, "ideal_ratio": padded / real,
             "fraction_of_ideal": (ours / base) / (padded / real), "device": device, "attention_backend": backend,
             "backend_samples_per_s": speeds, "smolvla": smolvla,
             "groot_n17": groot_n17}
    return write_suite("packing", rows, quick=quick, out_dir=out_dir, extra=extra, console=console)


def run_pruning(*, quick: bool = False, out_dir: str | Path = DEFAULT_OUT, device: str | None = None, console=None) -> Path:
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    model, opt, batches, autocast = _setup(quick, device)
    repeats = 1 if quick else 3
    blank = (model.config.cameras[-1],)
    plain = {"packing": False, "disabled_cameras": (), "language_padding": "max_length"}
    variants = {
        "train_samples_per_s": {"disabled_cameras": blank, "language_padding": "longest"},
        "train_samples_per_s_pruning_only": {"disabled_cameras": blank},
        "train_samples_per_s_dynamic_padding_only": {"language_padding": "longest"},
    }
    rows = []
    for name, switches in variants.items():
        base, ours = _compare(model, opt, batches, plain, {**plain, **switches}, repeats, autocast)
        rows.append(Row.compare(name, "samples/s", base, ours, higher_is_better=True,
                                note=f"pi0.5 LIBERO layout, {device}; blank camera masked + 200-token language "
                                     f"vs {', '.join(f'{k}={v}' for k, v in switches.items())}"))
    return write_suite("pruning", rows, quick=quick, out_dir=out_dir, extra={"device": device}, console=console)


def _moe_models(quick: bool, device: str) -> dict[str, tuple]:
    """The dense and the E = 8, K = 2 expert at equal active FLOPs (one expert MLP is half the dense one),
    each with its optimizer; the rest is BENCH_CPU's, packed."""
    width = 256 if quick else 1024  # pi05-base's expert width
    expert = dataclasses.replace(BENCH_CPU.expert, width=width, mlp_dim=2 * width)
    dense = dataclasses.replace(BENCH_CPU, expert=expert, packing=True, attention_backend="auto")
    models = {}
    for name, cfg in (("dense", dense), ("moe", dataclasses.replace(dense, moe=MoEConfig(num_experts=8, top_k=2,
                                                                                       expert_dim=width)))):
        torch.manual_seed(0)
        model = Pi05Model(cfg).to(device)
        params = list(model.parameters())  # AdamW as the trainer builds it (fused where torch has it)
        models[name] = (model, torch.optim.AdamW(params, lr=1e-4, fused=fused_adamw(params)))
    return models


def run_moe(*, quick: bool = False, out_dir: str | Path = DEFAULT_OUT, device: str | None = None, console=None) -> Path:
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    models = _moe_models(quick, device)
    cfg = models["dense"][0].config
    batches = [libero_batch(cfg, 2 if quick else 8, seed).to(device) for seed in range(1 if quick else 3)]
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if device == "cuda" else torch.autocast("cpu", enabled=False)
    times: dict[str, list[float]] = {name: [] for name in models}
    with autocast:
        for model, opt in models.values():  # warm-up
            _step_time(model, opt, batches[0], {})
        for _ in range(1 if quick else 3):  # interleaved, so both see the same machine load
            for b in batches:
                for name, (model, opt) in models.items():
                    times[name].append(_step_time(model, opt, b, {}))
    speed = {name: batches[0].batch_size / float(np.median(t)) for name, t in times.items()}
    width = cfg.expert.width
    rows = [Row.compare("train_samples_per_s_moe", "samples/s", speed["dense"], speed["moe"], higher_is_better=True,
                        limit=1.0, note=f"pi0.5 LIBERO layout packed, {device}; action expert width {width}: dense MLP "
                                        f"{2 * width} vs E=8, K=2 experts of MLP {width} (equal active FLOPs); "
                                        "limit = dense speed; the issue's bar: ratio >= 1/1.3")]
    extra = {"device": device, "expert_width": width, "dense_mlp": 2 * width, "expert_mlp": width,
             "num_experts": 8, "top_k": 2, "samples": batches[0].batch_size,
             "step_s": {name: float(np.median(t)) for name, t in times.items()}}
    return write_suite("moe", rows, quick=quick, out_dir=out_dir, extra=extra, console=console)
