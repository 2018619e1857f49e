"""A scaling model: the estimated training step of pi05-3b and of a 30B-class pi0 on 8-1024 GPUs, for
DDP, FSDP and a 3D layout (TP within a node x PP x FSDP on the rest), from the models' shapes.

    python -m kilovla.bench.scaling_model        # the table docs/benchmarks.md shows

What is counted, not assumed: each part's parameters (the models are built on the meta device),
the FLOPs of a sample per layer (8 x parameters x tokens with gradient checkpointing's recomputed
forward, plus attention's 16 x tokens x keys x width, over the LIBERO layout: 2 cameras of 256
tokens, 48 language tokens, a 50-action chunk) and the bytes of every message (gradients in fp32,
parameters gathered in bf16, TP's activations in bf16, pipeline sends in fp32 as train/pipeline.py
sends them).

What is assumed, and can be changed below: an H200's dense bf16 rate at 40 % MFU; 8 GPUs a node on
NVLink (450 GB/s a GPU each way), 50 GB/s a GPU between nodes (400 Gb/s InfiniBand); ring
collectives (2(n-1)/n of the bytes for an all-reduce, (n-1)/n for a gather or a scatter) at the
slowest link they cross; DDP's and FSDP's traffic overlapped with the backward pass up to 80 % of its
length, tensor parallelism's all-reduces on the critical path (6 per layer: forward, recomputed
forward, backward), pipeline bubbles of (stages - 1) / (micro-batches + stages - 1); 32 samples a GPU
per step (weak scaling), micro-batches of 8 samples. Memory: weights, gradients and two AdamW moments
in fp32 (16 bytes a parameter) divided by the degree they are sharded over; under FSDP one layer
gathered whole in bf16 beside them; the layer-boundary activations (bf16, checkpointed, not split by
tp: no sequence parallelism) of every micro-batch in flight (1F1B keeps up to `stages` on the first
stage); a layout over 80 % of 141 GB does not fit. The layouts are ones `kilovla train` runs (PP
with DDP on the data dimension, its stages dividing the layers).

No GPU was measured for these figures: they estimate, for planning, what the rows of `kilovla bench
scaling` measure on the ranks at hand.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from kilovla.models.language import DecoderConfig

GPU_FLOPS = 989e12 * 0.40  # H200 dense bf16 at 40 % MFU
GPU_MEMORY = 141e9 * 0.80
NODE = 8
NVLINK, NETWORK = 450e9, 50e9  # bytes/s a GPU, one way
OVERLAP = 0.8  # of the backward pass that DDP / FSDP traffic can hide behind
SAMPLES_PER_GPU, MICRO_BATCH = 32, 8
CAMERAS, IMAGE_TOKENS, LANGUAGE_TOKENS, CHUNK = 2, 256, 48, 50

# A pi0 whose language model is Gemma-2-27B-shaped and whose action expert is scaled with it.
LARGE = {"lm": DecoderConfig(width=4608, depth=46, heads=32, kv_heads=16, head_dim=128, mlp_dim=36864),
         "expert": DecoderConfig(width=2048, depth=46, heads=32, kv_heads=16, head_dim=128, mlp_dim=8192,
                                 vocab_size=0)}


@dataclass(frozen=True)
class Shape:
    name: str
    params: float  # all of them
    layers: int  # decoder layers (LM + expert pairs): what TP splits and PP stages
    layer_params: float  # one LM + expert layer pair
    flops: float  # one sample, forward + backward
    activation_bytes: float  # one sample's hidden states at a layer boundary (bf16)
    expert_width: int = 0  # the action expert's hidden width: the bytes an expert-parallel token carries


def shape(name: str, **overrides) -> Shape:
    from kilovla.models.presets import build_model

    model = build_model("pi05-3b", device="meta", **overrides)
    cfg = model.config
    count = lambda m: sum(p.numel() for p in m.parameters())  # noqa: E731
    lm, expert, vit = model.vlm.language_model, model.expert, model.vlm.vision_tower
    prefix = CAMERAS * IMAGE_TOKENS + LANGUAGE_TOKENS
    lm_layer, expert_layer = count(lm.layers[0]), count(expert.layers[0])
    attn_width = cfg.lm.heads * cfg.lm.head_dim
    flops = 8 * (count(vit) * CAMERAS * IMAGE_TOKENS + cfg.lm.depth * (lm_layer * prefix + expert_layer * CHUNK))
    flops += 16 * cfg.lm.depth * attn_width * (prefix * prefix + CHUNK * (prefix + CHUNK))
    return Shape(name, count(model), cfg.lm.depth, lm_layer + expert_layer, flops,
                 2 * (prefix * cfg.lm.width + CHUNK * cfg.expert.width), cfg.expert.width)


def _ring(n: int, bytes_: float, factor: float, link: float) -> float:
    """Seconds for a ring collective over n GPUs moving `factor` x (n-1)/n of `bytes_` each over `link`."""
    return 0.0 if n <= 1 else factor * (n - 1) / n * bytes_ / link


def estimate(s: Shape, gpus: int, tp: int = 1, pp: int = 1, fsdp: bool = False) -> dict:
    """One step's seconds and per-GPU memory for `s` on `gpus` GPUs as tp x pp x data parallel."""
    dp = gpus // (tp * pp)
    samples = SAMPLES_PER_GPU * gpus
    per_replica = samples / dp
    compute = s.flops * per_replica / (tp * pp) / GPU_FLOPS  # a GPU's share of its replica's work
    micro = max(1, int(per_replica // MICRO_BATCH))
    bubble = (pp - 1) / (micro + pp - 1)
    step = compute / (1 - bubble)
    # tensor parallelism: 6 all-reduces of a micro-batch's activations per layer of the stage, on NVLink
    tp_comm = 6 * (s.layers / pp) * micro * _ring(tp, s.activation_bytes * MICRO_BATCH, 2, NVLINK)
    # pipeline: a micro-batch's activations forward and their gradients back, at each stage boundary (fp32)
    pp_link = NETWORK if tp * pp > NODE else NVLINK
    pp_comm = 2 * micro * 2 * s.activation_bytes * MICRO_BATCH / pp_link if pp > 1 else 0.0
    # data parallel: its groups cross nodes once there is more than one node
    dp_link = NETWORK if gpus > NODE else NVLINK
    stage_params = s.params / pp
    if fsdp:  # gather bf16 weights for forward and backward, scatter fp32 gradients
        dp_comm = _ring(dp, 2 * stage_params / tp, 2, dp_link) + _ring(dp, 4 * stage_params / tp, 1, dp_link)
    else:  # all-reduce fp32 gradients
        dp_comm = _ring(dp, 4 * stage_params / tp, 2, dp_link)
    exposed_dp = max(0.0, dp_comm - OVERLAP * compute * 2 / 3)
    step += tp_comm + pp_comm + exposed_dp
    in_flight = min(pp, micro)  # 1F1B: micro-batches whose backward is still to come, on the first stage
    memory = (16 * stage_params / tp / (dp if fsdp else 1) + (2 * s.layer_params / tp if fsdp else 0)
              + s.activation_bytes * MICRO_BATCH * in_flight * (s.layers / pp))
    return {"step_s": step, "samples_per_s": samples / step, "memory_gb": memory / 1e9,
            "fits": memory <= GPU_MEMORY, "comm_s": tp_comm + pp_comm + exposed_dp, "bubble": bubble}


def ep_all_to_all_s(s: Shape, ep: int, top_k: int = 2) -> float:
    """A GPU's seconds a step in expert parallelism's all-to-alls, were every action-expert MLP routed experts
    split over `ep` GPUs (`--parallel.ep`): each of its action tokens (CHUNK a sample) travels to its top_k
    experts and back (2 directions) in bf16 at the expert's width, in the forward, the recomputed forward and
    the backward (3 passes), at every layer; (ep-1)/ep of it leaves the GPU, over NVLink while ep fits a
    node. On the critical path (a layer waits for its tokens), so nothing is overlapped."""
    if ep <= 1:
        return 0.0
    link = NVLINK if ep <= NODE else NETWORK
    per_gpu = SAMPLES_PER_GPU * CHUNK * top_k * 2 * (2 * s.expert_width) * 3 * s.layers
    return per_gpu * (ep - 1) / ep / link


def ep_table(gpus: int = 1024, top_k: int = 2) -> list[dict]:
    """The all-to-all term at `gpus` GPUs beside the DDP step it would add to, for pi05-3b with an MoE expert."""
    s = shape("pi05-3b")
    ddp = estimate(s, gpus)["step_s"]
    return [{"model": "pi05-3b", "gpus": gpus, "ep": ep, "top_k": top_k, "all_to_all_s": ep_all_to_all_s(s, ep, top_k),
             "ddp_step_s": ddp, "fraction_of_step": ep_all_to_all_s(s, ep, top_k) / ddp} for ep in (2, 8, 16)]


LAYOUTS = {  # (name, tp, pp, fsdp) per model: 3D puts TP in a node and as few stages as fit (46 layers: 2)
    "pi05-3b": [("DDP", 1, 1, False), ("FSDP", 1, 1, True), ("3D: TP=2 x FSDP", 2, 1, True)],
    "pi0-30b": [("DDP", 1, 1, False), ("FSDP", 1, 1, True), ("3D: TP=8 x PP=2 x DDP", 8, 2, False)],
}
GPUS = (8, 64, 256, 1024)


def table() -> list[dict]:
    # preset() takes overrides as mappings (it checks each key and type), not DecoderConfigs
    large = {k: dataclasses.asdict(v) for k, v in LARGE.items()}
    shapes = {"pi05-3b": shape("pi05-3b"), "pi0-30b": shape("pi0-30b", pi05=False, **large)}
    rows = []
    for name, s in shapes.items():
        for layout, tp, pp, fsdp in LAYOUTS[name]:
            for gpus in GPUS:
                if gpus < tp * pp:
                    continue
                rows.append({"model": name, "params_b": s.params / 1e9, "layout": layout, "gpus": gpus,
                             **estimate(s, gpus, tp, pp, fsdp)})
    return rows


def markdown(rows: list[dict]) -> str:
    lines = ["| model | layout | GPUs | step s | samples/s | GB a GPU | exposed comm s |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        fits = "" if r["fits"] else " (does not fit)"
        lines.append(f"| {r['model']} ({r['params_b']:.1f} B) | {r['layout']} | {r['gpus']} | {r['step_s']:.2f} | "
                     f"{r['samples_per_s']:.0f} | {r['memory_gb']:.1f}{fits} | {r['comm_s']:.2f} |")
    return "\n".join(lines)


if __name__ == "__main__":
    print(markdown(table()))
    for r in ep_table():
        print(f"EP={r['ep']} (top {r['top_k']}) at {r['gpus']} GPUs: all-to-all {r['all_to_all_s'] * 1e3:.1f} ms a step, "
              f"{100 * r['fraction_of_step']:.1f} % of the {r['ddp_step_s']:.2f} s DDP step")
