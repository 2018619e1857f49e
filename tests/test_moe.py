"""The mixture-of-experts action expert (models/moe.py): routing, losses, equivalences, folders."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from test_pi05 import _batch

from kilovla.errors import KilovlaError
from kilovla.models.moe import MoEConfig, MoEMLP, Routing, dispatch, route, router_losses, training_loss
from kilovla.models.presets import build_model, preset

EXPERT_MLP = "paligemma_with_expert.gemma_expert.model.layers.{}.mlp."
MOE = {"num_experts": 4, "top_k": 2}


def _inputs(batch, seed=5):
    g = torch.Generator().manual_seed(seed)
    return {"noise": torch.randn(batch.actions.shape, generator=g), "time": torch.rand(batch.batch_size, generator=g)}


def _loss_and_grads(model, batch, packing: bool, objective=training_loss):
    model.config = dataclasses.replace(model.config, packing=packing)
    model.zero_grad(set_to_none=True)
    out = model(batch, **_inputs(batch))
    objective(out).backward()
    return out, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


# -- routing, hand-computed ---------------------------------------------------------------------------------
def test_route_picks_the_top_k_and_renormalises_their_weights():
    logits = torch.tensor([[2.0, 0.0, 1.0], [0.0, 0.0, 3.0]])
    probs, experts, weights = route(logits, 2)
    assert experts.tolist() == [[0, 2], [2, 0]]
    p = logits.softmax(-1)
    torch.testing.assert_close(weights[0], p[0, [0, 2]] / p[0, [0, 2]].sum())
    torch.testing.assert_close(weights.sum(-1), torch.ones(2))


def test_dispatch_groups_by_expert_and_drops_past_capacity_in_token_order():
    experts = torch.tensor([[1, 0], [1, 2], [1, 0]])  # assignments 0..5, token = a // 2
    d = dispatch(experts, 3)
    assert d.assignment.tolist() == [1, 5, 0, 2, 4, 3] and d.counts.tolist() == [2, 3, 1]
    capped = dispatch(experts, 3, capacity=2)
    assert capped.assignment.tolist() == [1, 5, 0, 2, 3]  # expert 1's third token (assignment 4) dropped
    assert capped.counts.tolist() == [2, 2, 1] and capped.load.tolist() == [2, 3, 1]


def test_router_losses_follow_switch_and_st_moe():
    logits = torch.tensor([[1.0, 0.0], [0.0, 2.0], [0.5, 0.5]])
    probs = logits.softmax(-1)
    load = torch.tensor([1, 2])
    aux, z = router_losses(logits, probs, load)
    torch.testing.assert_close(aux, 2 * (1 / 3 * probs[:, 0].mean() + 2 / 3 * probs[:, 1].mean()))
    torch.testing.assert_close(z, (torch.logsumexp(logits, -1) ** 2).mean())
    balanced, _ = router_losses(torch.zeros(4, 2), torch.full((4, 2), 0.5), torch.tensor([2, 2]))
    assert float(balanced) == pytest.approx(1.0)


def test_dropless_moe_equals_a_per_token_reference():
    torch.manual_seed(0)
    mlp = MoEMLP(8, 16, MoEConfig(num_experts=3, top_k=2, shared_experts=1))
    x = torch.randn(2, 5, 8)
    with torch.no_grad():
        out = mlp(x)
        flat = x.reshape(-1, 8)
        _, experts, weights = route(mlp.router(flat), 2)
        ref = torch.stack([sum(w * mlp.experts.expert(int(e), t[None])[0] for e, w in zip(es, ws))
                           + mlp.shared.expert(0, t[None])[0] for t, es, ws in zip(flat, experts, weights)])
    torch.testing.assert_close(out.reshape(-1, 8), ref, atol=1e-6, rtol=1e-5)


def test_tokens_left_out_of_the_routing_are_neither_computed_nor_counted():
    torch.manual_seed(0)
    mlp = MoEMLP(8, 16, MoEConfig(num_experts=2, top_k=1))
    x, valid = torch.randn(2, 4, 8), torch.tensor([[True, True, False, False], [True, False, False, False]])
    routing = Routing(valid=valid)
    out = mlp(x, routing)
    assert float(out[~valid].detach().abs().sum()) == 0.0
    assert int(routing.stats[0].load.sum()) == 3
    torch.testing.assert_close(out[valid], mlp(x[valid]))


def test_the_training_objective_adds_the_regularizer_once_per_sample():
    out = {"per_sample": torch.tensor([1.0, 2.0, 3.0]), "moe_regularizer": torch.tensor(0.5)}
    assert float(training_loss(out)) == pytest.approx(6.0 + 3 * 0.5)
    assert float(training_loss({"per_sample": torch.tensor([1.0, 2.0])})) == 3.0


# -- the model ------------------------------------------------------------------------------------------------
def test_an_e1_k1_moe_is_the_dense_model_weight_for_weight_and_loss_for_loss():
    dense = build_model("pi05-tiny", seed=3)
    moe = build_model("pi05-tiny", seed=3, moe={"num_experts": 1, "top_k": 1, "z_loss_coef": 0.0})
    d, m = dense.state_dict(), moe.state_dict()
    for key, value in d.items():
        if ".mlp." in key and "gemma_expert" in key:
            prefix, proj = key.rsplit(".mlp.", 1)
            torch.testing.assert_close(m[f"{prefix}.mlp.experts.{proj.removesuffix('.weight')}"][0], value,
                                       rtol=0, atol=0)
        else:
            assert torch.equal(m[key], value), key
    batch = _batch(dense.config, horizons=[8, 3, 5])
    for packing in (False, True):
        out_d, grads_d = _loss_and_grads(dense, batch, packing)
        out_m, grads_m = _loss_and_grads(moe, batch, packing)
        torch.testing.assert_close(out_m["loss"], out_d["loss"], atol=1e-6, rtol=1e-6)
        assert float(out_m["moe_aux_loss"]) == 1.0 and float(out_m["moe_dropped"]) == 0
        for name, g in grads_d.items():
            mine = grads_m.get(name) if name in grads_m else \
                grads_m[name.replace(".mlp.", ".mlp.experts.").removesuffix(".weight")][0]
            torch.testing.assert_close(mine, g, atol=1e-6, rtol=1e-5, msg=name)


@pytest.mark.parametrize("capacity_factor", [0.0, 1.0], ids=["dropless", "capacity"])
def test_packed_and_padded_paths_give_the_same_moe_losses_and_gradients(capacity_factor):
    torch.manual_seed(0)
    model = build_model("pi05-tiny", seed=1, moe={**MOE, "capacity_factor": capacity_factor, "shared_experts": 1})
    batch = _batch(model.config, horizons=[8, 3, 5])
    padded, grads_padded = _loss_and_grads(model, batch, packing=False)
    packed, grads_packed = _loss_and_grads(model, batch, packing=True)
    for key in ("loss", "moe_aux_loss", "moe_z_loss", "moe_load", "moe_dropped", "moe_assignments"):
        torch.testing.assert_close(packed[key], padded[key], atol=1e-6, rtol=1e-5, msg=key)
    # padding is never routed: 16 real suffix tokens x top 2 x 2 layers
    assert int(padded["moe_assignments"]) == 16 * 2 * 2
    assert (int(padded["moe_dropped"]) > 0) == (capacity_factor > 0)
    assert grads_padded.keys() == grads_packed.keys()
    for name in grads_padded:
        torch.testing.assert_close(grads_packed[name], grads_padded[name], atol=1e-5, rtol=1e-4, msg=name)


def test_gradient_checkpointing_keeps_the_routing_losses_and_their_gradients():
    model = build_model("pi05-tiny", seed=1, moe=MOE)
    batch = _batch(model.config, horizons=[8, 3, 5])
    runs = []
    for recompute in (False, True):
        model.gradient_checkpointing = recompute
        runs.append(_loss_and_grads(model, batch, packing=True, objective=lambda o: o["moe_regularizer"]))
    (a, ga), (b, gb) = runs
    torch.testing.assert_close(a["moe_regularizer"], b["moe_regularizer"])
    router = EXPERT_MLP.format(0) + "router.weight"
    assert float(ga[router].abs().sum()) > 0
    for name in ga:
        torch.testing.assert_close(gb[name], ga[name], atol=1e-6, rtol=1e-5, msg=name)


def test_moe_outputs_average_the_losses_and_sum_the_counts_over_layers():
    model = build_model("pi05-tiny", seed=1, moe=MOE)
    out = model(_batch(model.config), **_inputs(_batch(model.config)))
    assert out["moe_load"].shape == (4,) and int(out["moe_load"].sum()) == int(out["moe_assignments"])
    cfg = model.config.moe
    torch.testing.assert_close(out["moe_regularizer"],
                               cfg.aux_loss_coef * out["moe_aux_loss"] + cfg.z_loss_coef * out["moe_z_loss"])
    dense = build_model("pi05-tiny")(_batch(model.config), **_inputs(_batch(model.config)))
    assert not any(k.startswith("moe") for k in dense)


def test_bad_moe_settings_are_refused_in_one_line():
    with pytest.raises(KilovlaError, match=r"policy.moe.top_k must be in \[1, num_experts=2\], not 3"):
        preset("pi05-tiny", moe={"num_experts": 2, "top_k": 3})
    with pytest.raises(KilovlaError, match="policy.moe.capacity_factor must be >= 0"):
        preset("pi05-tiny", moe={"num_experts": 2, "capacity_factor": -1})


def test_tp_and_pp_with_moe_are_refused_in_one_line():
    from kilovla.train.pipeline import pp_problems
    from kilovla.train.tensor_parallel import tp_problems

    cfg = preset("pi05-tiny", moe=MOE)
    assert tp_problems(cfg, 2) == ["parallel.tp=2 with policy.moe is not supported yet: the routed experts are not "
                                   "split over tp ranks (expert parallelism is the mesh dimension meant for them); "
                                   "drop one of them"]
    assert pp_problems(cfg, 2) == ["parallel.pp=2 with policy.moe is not supported yet: drop one of them"]
    assert tp_problems(preset("pi05-tiny"), 2) == [] and pp_problems(preset("pi05-tiny"), 2) == []


# -- training, policy folders -------------------------------------------------------------------------------
def _train_moe(dataset, run, *extra, steps=2):
    from kilovla.config import load_config
    from kilovla.train.metrics import read_metrics
    from kilovla.train.trainer import TrainConfig, train

    cfg = load_config(TrainConfig, None, [
        f"--run_dir={run}", f"--steps={steps}", f"--dataset.roots=[{dataset}]", "--batch.global_batch_size=8",
        "--batch.token_budget=150", "--progress=false", "--policy.overrides={chunk_size: 4, packing: true}",
        "--policy.moe.num_experts=4", "--policy.moe.top_k=2", "--optim.warmup_steps=0", *extra])
    summary = train(cfg)
    return summary["checkpoint"], read_metrics(run / "metrics.jsonl")


@pytest.fixture(scope="module")
def moe_run(train_dataset, tmp_path_factory):
    return _train_moe(train_dataset, tmp_path_factory.mktemp("moe") / "run")


def test_metrics_log_the_flow_loss_with_the_routing_figures_beside_it(moe_run):
    _, records = moe_run
    train = [r for r in records if r["kind"] == "train"]
    assert [r["step"] for r in train] == [1, 2]
    for r in train:
        assert r["moe/aux_loss"] >= 1.0 - 1e-6 and r["moe/z_loss"] > 0 and r["moe/dropped_fraction"] == 0.0
        assert len(r["moe/load"]) == 4 and sum(r["moe/load"]) == pytest.approx(1.0)


def test_the_routing_losses_train_but_are_not_in_the_logged_loss(moe_run, train_dataset, tmp_path):
    """A huge aux coefficient leaves step 1's logged loss as it was (the flow-matching loss alone) and
    changes step 2's (it was in the gradient)."""
    _, plain = moe_run
    _, heavy = _train_moe(train_dataset, tmp_path / "run", "--policy.moe.aux_loss_coef=1000")
    assert heavy[0]["loss"] == pytest.approx(plain[0]["loss"], rel=1e-6)
    assert heavy[0]["moe/aux_loss"] == pytest.approx(plain[0]["moe/aux_loss"], rel=1e-6)
    assert heavy[1]["loss"] != pytest.approx(plain[1]["loss"], rel=1e-6)


def test_a_trained_moe_folder_records_its_experts_and_loads_back_to_the_same_actions(moe_run):
    from kilovla.models.checkpoints import read_safetensors
    from kilovla.models.family import moe_of
    from kilovla.policy_folder import PolicyFolder

    checkpoint, _ = moe_run
    folder = PolicyFolder.open(checkpoint)
    assert folder.meta.overrides["moe"] == dataclasses.asdict(MoEConfig(num_experts=4, top_k=2))
    policy = folder.load("cpu")
    assert moe_of(policy.model) == MoEConfig(num_experts=4, top_k=2)
    rebuilt = build_model(folder.meta.preset, **folder.meta.overrides)
    rebuilt.load_state_dict(read_safetensors(checkpoint))
    batch = _batch(policy.model.config)
    noise = torch.randn(batch.batch_size, policy.model.config.chunk_size, policy.model.config.max_action_dim)
    torch.testing.assert_close(policy.model.sample_actions(batch, noise=noise),
                               rebuilt.eval().sample_actions(batch, noise=noise), rtol=0, atol=0)
    again = PolicyFolder.open(checkpoint).load("cpu")
    torch.testing.assert_close(again.model.sample_actions(batch, noise=noise),
                               policy.model.sample_actions(batch, noise=noise), rtol=0, atol=0)


def test_policy_moe_goes_into_the_model_overrides_and_a_family_without_moe_refuses_it():
    from kilovla.config import load_config
    from kilovla.train.config import TrainConfig, with_init_model

    cfg = with_init_model(load_config(TrainConfig, None, ["--policy.moe.num_experts=4", "--policy.moe.top_k=1"]))
    assert cfg.policy.overrides["moe"] == dataclasses.asdict(MoEConfig(num_experts=4, top_k=1))
    assert cfg.policy.moe == MoEConfig() and with_init_model(cfg) == cfg
    groot = load_config(TrainConfig, None, ["--policy.preset=groot-tiny", "--policy.moe.num_experts=4"])
    with pytest.raises(KilovlaError, match=r"^policy.moe: GR00T \(groot-tiny\) has no mixture-of-experts option; "
                                           r"the families with one: pi0/pi0.5$"):
        with_init_model(groot)


# -- upcycling ------------------------------------------------------------------------------------------------
def test_upcycling_starts_every_expert_as_the_dense_mlp_and_keeps_the_dense_output(tmp_path):
    from kilovla.models.checkpoints import CheckpointError, load_weights, save_safetensors

    dense = build_model("pi05-tiny", seed=2)
    save_safetensors(dense.state_dict(), tmp_path / "model.safetensors")
    cfg = {"num_experts": 3, "top_k": 2, "shared_experts": 1}
    with pytest.raises(CheckpointError, match="missing keys: .*mlp.experts"):  # loading stays strict elsewhere
        load_weights(build_model("pi05-tiny", device="meta", moe=cfg), tmp_path / "model.safetensors")
    moe = build_model("pi05-tiny", device="meta", seed=2, moe=cfg)  # the router draws from the seed
    ckpt = load_weights(moe, tmp_path / "model.safetensors", upcycle=True)
    assert len(ckpt.fresh_routers) == 2
    state, own = dense.state_dict(), build_model("pi05-tiny", seed=2, moe=cfg).state_dict()
    for layer in range(2):
        prefix = EXPERT_MLP.format(layer)
        for group, n in (("experts", 3), ("shared", 1)):
            for proj in ("gate_proj", "up_proj", "down_proj"):
                stack = moe.state_dict()[f"{prefix}{group}.{proj}"]
                assert stack.shape[0] == n and all(torch.equal(e, state[f"{prefix}{proj}.weight"]) for e in stack)
        assert torch.equal(moe.state_dict()[prefix + "router.weight"], own[prefix + "router.weight"])
    # identical routed experts with weights summing to 1 compute the dense MLP (shared ones add theirs)
    routed_only = build_model("pi05-tiny", device="meta", moe={"num_experts": 3, "top_k": 2})
    load_weights(routed_only, tmp_path / "model.safetensors", upcycle=True)
    batch = _batch(dense.config, horizons=[8, 3, 5])
    with torch.no_grad():
        torch.testing.assert_close(routed_only(batch, **_inputs(batch))["loss"], dense(batch, **_inputs(batch))["loss"],
                                   atol=1e-6, rtol=1e-6)


def test_a_dense_policy_folder_fine_tunes_into_an_moe_expert(train_dataset, tmp_path):
    import json

    from kilovla.config import load_config
    from kilovla.train.trainer import TrainConfig, train

    dense = train(load_config(TrainConfig, None, [
        f"--run_dir={tmp_path / 'dense'}", "--steps=1", f"--dataset.roots=[{train_dataset}]",
        "--batch.global_batch_size=4", "--progress=false", "--policy.overrides={chunk_size: 4}"]))["checkpoint"]
    checkpoint, records = _train_moe(train_dataset, tmp_path / "moe", f"--policy.init_from={dense}", steps=1)
    meta = json.loads((tmp_path / "moe" / "checkpoints" / "step_000001" / "policy.json").read_text())
    assert meta["init_from"]["path"].endswith("step_000001") and meta["overrides"]["moe"]["num_experts"] == 4
    assert meta["overrides"]["chunk_size"] == 4 and records[0]["moe/aux_loss"] > 0


# -- adapters, FP8 --------------------------------------------------------------------------------------------
def test_fp8_ptq_keeps_the_experts_in_bf16_and_says_so_in_the_report(moe_run, tmp_path):
    from kilovla.models.moe import MoEMLP
    from kilovla.policy_folder import load_policy_folder
    from kilovla.quant.fp8 import Fp8BlockLinear, Fp8Config
    from kilovla.quantize.folder import quantize_policy_folder
    from kilovla.quantize.report import report_rows

    checkpoint, _ = moe_run
    report = quantize_policy_folder(checkpoint, tmp_path / "fp8", Fp8Config(), latency_repeats=1)
    original, quantized = load_policy_folder(checkpoint), load_policy_folder(tmp_path / "fp8")
    n = sum(p.numel() for m in original.model.modules() if isinstance(m, MoEMLP) for p in m.parameters())
    assert report["moe_experts"] == {"quantized": False, "stored_as": "bfloat16", "params": n}
    assert ("MoE experts", "", "bfloat16, not FP8",
            f"{n} params of routed / shared experts and routers kept unquantized") in report_rows(report)
    expert = [name for name in report["layers"] if "gemma_expert" in name]
    assert expert and not any(".mlp" in name for name in expert)  # the action expert's attention only
    assert any(isinstance(m, Fp8BlockLinear) for m in quantized.model.modules())
    for key, value in original.model.state_dict().items():
        if ".mlp.experts." in key or ".mlp.router." in key:
            assert torch.equal(quantized.model.state_dict()[key], value.to(torch.bfloat16).float()), key


def test_lora_leaves_the_experts_frozen_trains_them_in_full_when_named_and_refuses_them_as_targets():
    from kilovla.models.lora import LoraSettings, apply_lora, merge_state

    mlp = EXPERT_MLP.format(1).rstrip(".")
    model = apply_lora(build_model("pi05-tiny", moe=MOE), LoraSettings(rank=2))
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert any("gemma_expert" in n and "self_attn.q_proj.lora_A" in n for n in trainable)
    assert not any(".mlp.experts." in n or ".mlp.router." in n for n in trainable)
    full = apply_lora(build_model("pi05-tiny", moe=MOE), LoraSettings(rank=2, full=[mlp]))
    assert {f"{mlp}.router.weight", f"{mlp}.experts.gate_proj"} <= {n for n, p in full.named_parameters() if p.requires_grad}
    plain = build_model("pi05-tiny", moe=MOE).state_dict()
    assert merge_state(model.state_dict(), LoraSettings(rank=2)).keys() == plain.keys()
    with pytest.raises(KilovlaError, match=rf"names MoE experts or routers \({mlp}.experts\).*policy.lora.full=\[{mlp}\]"):
        apply_lora(build_model("pi05-tiny", moe=MOE), LoraSettings(rank=2, targets=r".*layers\.1\.mlp\.experts"))


def test_bench_moe_quick_writes_the_dense_vs_moe_row(tmp_path):
    import json

    from kilovla.bench.models import run_moe

    result = json.loads(run_moe(quick=True, out_dir=tmp_path, device="cpu").read_text())
    (row,) = result["rows"]
    assert row["name"] == "train_samples_per_s_moe" and row["baseline"] > 0 and row["ours"] > 0
    assert row["ratio"] == pytest.approx(row["ours"] / row["baseline"], rel=1e-2)
    assert (result["expert_mlp"], result["dense_mlp"], result["top_k"]) == (256, 512, 2)
