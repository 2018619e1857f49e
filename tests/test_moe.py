"""The mixture-of-experts action expert (models/moe.py): routing, losses, equivalences, folders."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pytest
import torch
from test_groot import _batch as _groot_batch
from test_groot_n17 import _batch as _groot_n17_batch
from test_pi05 import _batch
from test_smolvla import _batch as _smolvla_batch

from kilovla.errors import KilovlaError
from kilovla.models.family import family_of
from kilovla.models.moe import MoEConfig, MoEMLP, Routing, dispatch, route, router_losses, training_loss
from kilovla.models.presets import build_model, preset

EXPERT_MLP = "paligemma_with_expert.gemma_expert.model.layers.{}.mlp."
MOE = {"num_experts": 4, "top_k": 2}
# each tiny preset's MoE layers: its action expert's MLPs, nothing else
MOE_LAYERS = {"pi05-tiny": [f"paligemma_with_expert.gemma_expert.model.layers.{i}.mlp" for i in range(2)],
              "groot-tiny": [f"action_head.model.transformer_blocks.{i}.ff" for i in range(2)],
              "smolvla-tiny": [f"vlm_with_expert.lm_expert.layers.{i}.mlp" for i in range(4)],
              "groot-n17-tiny": [f"action_head.model.transformer_blocks.{i}.ff" for i in range(4)]}
OTHERS = ["groot-tiny", "smolvla-tiny", "groot-n17-tiny"]  # the families beside pi0/pi0.5
# real action tokens of `_family_batch`; GR00T N1.7's: 1 state + 8 actions a sample
ROUTED = {"pi05-tiny": 16, "groot-tiny": 3 * 13, "smolvla-tiny": 16, "groot-n17-tiny": 3 * 9}


def _inputs(batch, seed=5):
    g = torch.Generator().manual_seed(seed)
    return {"noise": torch.randn(batch.actions.shape, generator=g), "time": torch.rand(batch.batch_size, generator=g)}


def _family_batch(cfg):
    """Three samples with padding (language, a blank camera) and, where the family reads them, horizons 8, 3, 5;
    GR00T's action-head tokens (1 state + 4 future + 8 actions each) are never padding."""
    name = family_of(cfg).name
    if name.startswith("groot"):
        return (_groot_batch if name == "groot" else _groot_n17_batch)(cfg)
    return (_smolvla_batch if name == "smolvla" else _batch)(cfg, horizons=[8, 3, 5])


def _dense_twins(moe, group: str = "experts") -> dict[str, str]:
    """Each expert stack of an MoE model -> the dense model's parameter its experts start as (its kind's dense_keys)."""
    return {f"{name}.{group}.{stack}": f"{name}.{key}" for name, m in moe.named_modules() if isinstance(m, MoEMLP)
            for stack, key in m.experts.dense_keys.items()}


def _same_loss_and_gradients(dense, moe, batch, stack_of):
    """An E=1, K=1 MoE's loss and gradients, padded and packed, equal the dense model's; `stack_of(name)`: the
    expert stack whose slice 0 a dense parameter is (None or a missing name: the parameter itself)."""
    for packing in (False, True):
        out_d, grads_d = _loss_and_grads(dense, batch, packing)
        out_m, grads_m = _loss_and_grads(moe, batch, packing)
        torch.testing.assert_close(out_m["loss"], out_d["loss"], atol=1e-6, rtol=1e-6)
        assert float(out_m["moe_aux_loss"]) == 1.0 and float(out_m["moe_dropped"]) == 0
        for name, g in grads_d.items():
            mine = grads_m[name] if name in grads_m else grads_m[stack_of(name)][0]
            torch.testing.assert_close(mine, g, atol=1e-6, rtol=1e-5, msg=name)


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


def _dense_expert(stacks, e: int) -> torch.nn.Module:
    """Expert e of `stacks` as its dense MLP (its kind's `dense`, loaded with the slices)."""
    width, hidden = stacks.down_proj.shape[1:]
    dense = stacks.dense(width, hidden)
    dense.load_state_dict({key: getattr(stacks, name)[e] for name, key in stacks.dense_keys.items()})
    return dense


def test_dropless_moe_equals_a_per_token_reference():
    torch.manual_seed(0)
    mlp = MoEMLP(8, 16, MoEConfig(num_experts=3, top_k=2, shared_experts=1))
    x = torch.randn(2, 5, 8)
    with torch.no_grad():
        out = mlp(x)
        flat = x.reshape(-1, 8)
        _, experts, weights = route(mlp.router(flat), 2)
        routed = [_dense_expert(mlp.experts, e) for e in range(3)]
        shared = _dense_expert(mlp.shared, 0)
        ref = torch.stack([sum(w * routed[e](t) for e, w in zip(es, ws)) + shared(t)
                           for t, es, ws in zip(flat, experts, weights)])
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
    _same_loss_and_gradients(dense, moe, batch, lambda name: name.replace(".mlp.", ".mlp.experts.").removesuffix(".weight"))


@pytest.mark.parametrize("name", list(MOE_LAYERS))
def test_only_the_action_experts_mlps_get_experts(name):
    model = build_model(name, moe=MOE)
    assert [n for n, m in model.named_modules() if isinstance(m, MoEMLP)] == MOE_LAYERS[name]


@pytest.mark.parametrize("name", OTHERS)
def test_an_e1_k1_moe_of_groot_and_smolvla_is_their_dense_model(name):
    dense = build_model(name, seed=3)
    moe = build_model(name, seed=3, moe={"num_experts": 1, "top_k": 1, "z_loss_coef": 0.0})
    twins = _dense_twins(moe)
    d, m = dense.state_dict(), moe.state_dict()
    routers = {f"{layer}.router.weight" for layer in MOE_LAYERS[name]}
    assert m.keys() - twins.keys() - routers == d.keys() - set(twins.values())
    for key, dense_key in twins.items():
        assert torch.equal(m[key][0], d[dense_key]), key
    for key in d.keys() - set(twins.values()):
        assert torch.equal(m[key], d[key]), key
    batch, of_dense = _family_batch(dense.config), {v: k for k, v in twins.items()}
    _same_loss_and_gradients(dense, moe, batch, of_dense.get)


@pytest.mark.parametrize("name", list(MOE_LAYERS))
@pytest.mark.parametrize("capacity_factor", [0.0, 1.0], ids=["dropless", "capacity"])
def test_packed_and_padded_paths_give_the_same_moe_losses_and_gradients(capacity_factor, name):
    torch.manual_seed(0)
    model = build_model(name, seed=1, moe={**MOE, "capacity_factor": capacity_factor, "shared_experts": 1})
    batch = _family_batch(model.config)
    padded, grads_padded = _loss_and_grads(model, batch, packing=False)
    packed, grads_packed = _loss_and_grads(model, batch, packing=True)
    for key in ("loss", "moe_aux_loss", "moe_z_loss", "moe_load", "moe_dropped", "moe_assignments"):
        torch.testing.assert_close(packed[key], padded[key], atol=1e-6, rtol=1e-5, msg=key)
    # padding is never routed: the real action tokens x top 2 x the MoE layers (pi05-tiny: 16 x 2 x 2)
    assert int(padded["moe_assignments"]) == ROUTED[name] * 2 * len(MOE_LAYERS[name])
    assert (int(padded["moe_dropped"]) > 0) == (capacity_factor > 0)
    assert grads_padded.keys() == grads_packed.keys()
    for name in grads_padded:
        torch.testing.assert_close(grads_packed[name], grads_padded[name], atol=1e-5, rtol=1e-4, msg=name)


@pytest.mark.parametrize("name", ["pi05-tiny", "smolvla-tiny"])  # GR00T has no gradient checkpointing
def test_gradient_checkpointing_keeps_the_routing_losses_and_their_gradients(name):
    model = build_model(name, seed=1, moe=MOE)
    batch = _family_batch(model.config)
    runs = []
    for recompute in (False, True):
        model.gradient_checkpointing = recompute
        runs.append(_loss_and_grads(model, batch, packing=True, objective=lambda o: o["moe_regularizer"]))
    (a, ga), (b, gb) = runs
    torch.testing.assert_close(a["moe_regularizer"], b["moe_regularizer"])
    router = MOE_LAYERS[name][0] + ".router.weight"
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
    with pytest.raises(KilovlaError, match="policy.moe.capacity_factor must be finite and >= 0"):
        preset("pi05-tiny", moe={"num_experts": 2, "capacity_factor": -1})
    with pytest.raises(KilovlaError, match="policy.moe.aux_loss_coef must be finite and >= 0, not inf"):
        preset("pi05-tiny", moe={"num_experts": 2, "aux_loss_coef": float("inf")})


def test_capacity_drops_in_training_only():
    """Outside training every assignment is kept: a served action never depends on its batch companions."""
    torch.manual_seed(0)
    mlp = MoEMLP(8, 16, MoEConfig(num_experts=2, top_k=1, capacity_factor=0.5))
    x = torch.randn(1, 12, 8)
    trained = Routing()
    mlp(x, trained)
    assert int(trained.stats[0].dropped) > 0
    mlp.eval()
    served = Routing()
    with torch.no_grad():
        together = mlp(x, served)
        alone = torch.cat([mlp(x[:, i : i + 1]) for i in range(12)], dim=1)
    assert int(served.stats[0].dropped) == 0
    torch.testing.assert_close(together, alone)


# -- training, policy folders -------------------------------------------------------------------------------
# each tiny preset's training flags here (pi0.5: a 4-step chunk; GR00T and SmolVLA keep theirs)
TRAINED = {"pi05-tiny": ["--policy.overrides={chunk_size: 4, packing: true}"],
           "groot-tiny": ["--policy.preset=groot-tiny", "--policy.overrides={packing: true}"],
           "smolvla-tiny": ["--policy.preset=smolvla-tiny", "--policy.overrides={packing: true}"],
           "groot-n17-tiny": ["--policy.preset=groot-n17-tiny", "--policy.overrides={packing: true}"]}


def _train_moe(dataset, run, *extra, steps=2, name="pi05-tiny"):
    from kilovla.config import load_config
    from kilovla.train.metrics import read_metrics
    from kilovla.train.trainer import TrainConfig, train

    cfg = load_config(TrainConfig, None, [
        f"--run_dir={run}", f"--steps={steps}", f"--dataset.roots=[{dataset}]", "--batch.global_batch_size=8",
        "--batch.token_budget=150", "--progress=false", *TRAINED[name],
        "--policy.moe.num_experts=4", "--policy.moe.top_k=2", "--optim.warmup_steps=0", *extra])
    summary = train(cfg)
    return summary["checkpoint"], read_metrics(run / "metrics.jsonl")


@pytest.fixture(scope="module")
def moe_run(train_dataset, tmp_path_factory):
    return _train_moe(train_dataset, tmp_path_factory.mktemp("moe") / "run")


def test_resuming_an_moe_run_without_its_moe_settings_is_refused_in_one_line(moe_run, train_dataset, tmp_path, capsys):
    """Its experts would not fit the dense model (or another E): one line naming each setting, not the key list."""
    import shutil

    from kilovla.config import load_config
    from kilovla.train.trainer import TrainConfig, train

    run = tmp_path / "run"
    shutil.copytree(Path(moe_run[0]).parents[1], run)
    base = [f"--run_dir={run}", "--steps=3", f"--dataset.roots=[{train_dataset}]", "--batch.global_batch_size=8",
            "--batch.token_budget=150", "--progress=false", *TRAINED["pi05-tiny"], "--optim.warmup_steps=0"]
    for extra, said in (([], "moe.num_experts=None (the checkpoint's: 4)"),
                        (["--policy.moe.num_experts=8"], "moe.num_experts=8 (the checkpoint's: 4)")):
        with pytest.raises(KilovlaError, match=rf"cannot resume with .*{re.escape(said)}.*--policy.moe settings again"):
            train(load_config(TrainConfig, None, [*base, *extra]), resume="auto")
    summary = train(load_config(TrainConfig, None, [*base, "--policy.moe.num_experts=4", "--policy.moe.top_k=2"]),
                    resume="auto")
    assert summary["checkpoint"].endswith("step_000003")
    assert "kilovla train: pi05-tiny with an MoE action expert (E=4, K=2), 1 rank(s)" in capsys.readouterr().out


@pytest.fixture(scope="module", params=OTHERS)
def family_moe_run(request, train_dataset, tmp_path_factory):
    """(preset, checkpoint, metrics) of a 2-step packed MoE run of GR00T's or SmolVLA's tiny preset."""
    return request.param, *_train_moe(train_dataset, tmp_path_factory.mktemp("moe") / "run", name=request.param)


def _check_routing_metrics(records):
    train = [r for r in records if r["kind"] == "train"]
    assert [r["step"] for r in train] == [1, 2]
    for r in train:
        assert r["moe/aux_loss"] >= 1.0 - 1e-6 and r["moe/z_loss"] > 0 and r["moe/dropped_fraction"] == 0.0
        assert len(r["moe/load"]) == 4 and sum(r["moe/load"]) == pytest.approx(1.0)


def _check_folder_loads_back(checkpoint, make_batch):
    """policy.json records the MoE; the folder loads (twice) and rebuilds to the same actions on `make_batch(cfg)`."""
    from kilovla.models.checkpoints import read_safetensors
    from kilovla.models.family import chunk_length, moe_of
    from kilovla.policy_folder import PolicyFolder

    folder = PolicyFolder.open(checkpoint)
    assert folder.meta.overrides["moe"] == dataclasses.asdict(MoEConfig(num_experts=4, top_k=2))
    policy = folder.load("cpu")
    assert moe_of(policy.model) == MoEConfig(num_experts=4, top_k=2)
    rebuilt = build_model(folder.meta.preset, **folder.meta.overrides)
    rebuilt.load_state_dict(read_safetensors(checkpoint))
    batch = make_batch(policy.model.config)
    noise = torch.randn(batch.batch_size, chunk_length(policy.model.config), policy.model.config.max_action_dim)
    torch.testing.assert_close(policy.model.sample_actions(batch, noise=noise),
                               rebuilt.eval().sample_actions(batch, noise=noise), rtol=0, atol=0)
    again = PolicyFolder.open(checkpoint).load("cpu")
    torch.testing.assert_close(again.model.sample_actions(batch, noise=noise),
                               policy.model.sample_actions(batch, noise=noise), rtol=0, atol=0)


def test_metrics_log_the_flow_loss_with_the_routing_figures_beside_it(moe_run):
    _check_routing_metrics(moe_run[1])


def test_the_routing_losses_train_but_are_not_in_the_logged_loss(moe_run, train_dataset, tmp_path):
    """A huge aux coefficient leaves step 1's logged loss as it was (the flow-matching loss alone) and
    changes step 2's (it was in the gradient)."""
    _, plain = moe_run
    _, heavy = _train_moe(train_dataset, tmp_path / "run", "--policy.moe.aux_loss_coef=1000")
    assert heavy[0]["loss"] == pytest.approx(plain[0]["loss"], rel=1e-6)
    assert heavy[0]["moe/aux_loss"] == pytest.approx(plain[0]["moe/aux_loss"], rel=1e-6)
    assert heavy[1]["loss"] != pytest.approx(plain[1]["loss"], rel=1e-6)


def test_a_trained_moe_folder_records_its_experts_and_loads_back_to_the_same_actions(moe_run):
    _check_folder_loads_back(moe_run[0], _batch)


def test_groot_and_smolvla_moe_runs_log_the_routing_and_their_folders_load_back(family_moe_run):
    _, checkpoint, records = family_moe_run
    _check_routing_metrics(records)
    _check_folder_loads_back(checkpoint, _family_batch)


def test_policy_moe_goes_into_the_model_overrides_and_a_family_without_moe_refuses_it(monkeypatch):
    from kilovla.config import load_config
    from kilovla.models import family
    from kilovla.train.config import TrainConfig, with_init_model

    cfg = with_init_model(load_config(TrainConfig, None, ["--policy.moe.num_experts=4", "--policy.moe.top_k=1"]))
    assert cfg.policy.overrides["moe"] == dataclasses.asdict(MoEConfig(num_experts=4, top_k=1))
    assert cfg.policy.moe == MoEConfig() and with_init_model(cfg) == cfg
    for name in OTHERS:
        other = with_init_model(load_config(TrainConfig, None, [f"--policy.preset={name}", "--policy.moe.num_experts=4"]))
        assert other.policy.overrides["moe"] == dataclasses.asdict(MoEConfig(num_experts=4))
    # every family has the option now: one without it is GR00T's spec less its `moe`
    monkeypatch.setitem(family._FAMILIES, "groot", dataclasses.replace(family.family("groot"), moe=None))
    groot = load_config(TrainConfig, None, ["--policy.preset=groot-tiny", "--policy.moe.num_experts=4"])
    with pytest.raises(KilovlaError, match=r"^policy.moe: GR00T \(groot-tiny\) has no mixture-of-experts option; "
                                           r"the families with one: pi0/pi0.5, SmolVLA, GR00T N1.7$"):
        with_init_model(groot)


# -- upcycling ------------------------------------------------------------------------------------------------
def test_upcycling_starts_every_expert_as_the_dense_mlp_and_keeps_the_dense_output(tmp_path):
    from kilovla.models.checkpoints import CheckpointError, load_weights, save_safetensors

    dense = build_model("pi05-tiny", seed=2)
    save_safetensors(dense.state_dict(), tmp_path / "model.safetensors")
    cfg = {"num_experts": 3, "top_k": 2, "shared_experts": 1}
    with pytest.raises(CheckpointError, match="missing keys: .*mlp.experts"):  # loading stays strict elsewhere
        load_weights(build_model("pi05-tiny", device="meta", moe=cfg), tmp_path / "model.safetensors")
    narrow = build_model("pi05-tiny", device="meta", moe={**cfg, "expert_dim": 8})  # not the dense MLP's width
    with pytest.raises(KilovlaError, match=r"upcycling copies its dense MLP .*mlp.gate_proj.weight \(\d+, \d+\) into "
                                           r"every expert, but .*\(3, 8, \d+\): leave policy.moe.expert_dim unset"):
        load_weights(narrow, tmp_path / "model.safetensors", upcycle=True)
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


@pytest.mark.parametrize("name", OTHERS)
def test_upcycling_groot_and_smolvla_starts_every_expert_as_their_dense_mlp(name, tmp_path):
    from kilovla.models.checkpoints import load_weights, save_safetensors

    dense = build_model(name, seed=2)
    save_safetensors(dense.state_dict(), tmp_path / "model.safetensors")
    cfg = {"num_experts": 3, "top_k": 2, "shared_experts": 1}
    moe = build_model(name, device="meta", seed=2, moe=cfg)
    assert load_weights(moe, tmp_path / "model.safetensors", upcycle=True).fresh_routers == MOE_LAYERS[name]
    state, own, loaded = dense.state_dict(), build_model(name, seed=2, moe=cfg).state_dict(), moe.state_dict()
    for group, n in (("experts", 3), ("shared", 1)):
        twins = _dense_twins(moe, group)
        assert len(twins) == len(MOE_LAYERS[name]) * len(moe.get_submodule(MOE_LAYERS[name][0]).experts.dense_keys)
        for stack, dense_key in twins.items():
            assert loaded[stack].shape[0] == n and all(torch.equal(e, state[dense_key]) for e in loaded[stack]), stack
    for layer in MOE_LAYERS[name]:
        assert torch.equal(loaded[f"{layer}.router.weight"], own[f"{layer}.router.weight"])
    routed_only = build_model(name, device="meta", moe={"num_experts": 3, "top_k": 2})
    load_weights(routed_only, tmp_path / "model.safetensors", upcycle=True)
    batch = _family_batch(dense.config)
    with torch.no_grad():
        torch.testing.assert_close(routed_only(batch, **_inputs(batch))["loss"], dense(batch, **_inputs(batch))["loss"],
                                   atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("name", list(MOE_LAYERS))
def test_a_dense_policy_folder_fine_tunes_into_an_moe_expert(name, train_dataset, tmp_path):
    import json

    from kilovla.config import load_config
    from kilovla.train.trainer import TrainConfig, train

    dense_flags = ["--policy.overrides={chunk_size: 4}"] if name == "pi05-tiny" else [f"--policy.preset={name}"]
    dense = train(load_config(TrainConfig, None, [
        f"--run_dir={tmp_path / 'dense'}", "--steps=1", f"--dataset.roots=[{train_dataset}]",
        "--batch.global_batch_size=4", "--progress=false", *dense_flags]))["checkpoint"]
    checkpoint, records = _train_moe(train_dataset, tmp_path / "moe", f"--policy.init_from={dense}", steps=1, name=name)
    meta = json.loads((tmp_path / "moe" / "checkpoints" / "step_000001" / "policy.json").read_text())
    assert meta["init_from"]["path"].endswith("step_000001") and meta["overrides"]["moe"]["num_experts"] == 4
    assert meta["overrides"].get("chunk_size") == (4 if name == "pi05-tiny" else None)
    assert records[0]["moe/aux_loss"] > 0


# -- adapters, FP8 --------------------------------------------------------------------------------------------
def _check_fp8_experts(checkpoint, out, dataset, stacks):
    """FP8 PTQ of an MoE policy folder: each expert stack in `stacks` is FP8 in its own experts' blocks (a
    slice quantized alone gives the same payload and scales), bias stacks and routers keep their values at
    bf16, the report has each stack's SQNRs, and the folder reloads to what was quantized."""
    from kilovla.policy_folder import load_policy_folder
    from kilovla.quant.fp8 import FP8, Fp8BlockLinear, Fp8Config, Fp8GroupedExperts, quantize_fp8_blockwise
    from kilovla.quantize.folder import quantize_policy_folder

    report = quantize_policy_folder(checkpoint, out, Fp8Config(), dataset=dataset, samples=8, latency_repeats=1)
    original, quantized = load_policy_folder(checkpoint), load_policy_folder(out)
    before, after = original.model.state_dict(), quantized.model.state_dict()
    for stack in stacks:
        layer = quantized.model.get_submodule(stack)
        assert isinstance(layer, Fp8GroupedExperts) and layer.payloads, stack
        for name in layer.payloads:
            w, q, scales = before[f"{stack}.{name}"], after[f"{stack}.{name}"], after[f"{stack}.{name}_scale_inv"]
            assert q.dtype == FP8 and scales.shape[0] == len(w)
            for e in range(len(w)):
                q_e, s_e = quantize_fp8_blockwise(w[e])
                assert torch.equal(scales[e], s_e) and torch.equal(q[e].view(torch.uint8), q_e.view(torch.uint8))
        fp8_keys = {f"{stack}.{name}" for name in layer.payloads}
        for key, value in before.items():  # the MoE layer's other weights: bias stacks, the router
            if key.startswith(stack.rpartition(".")[0] + ".") and key not in fp8_keys:
                assert torch.equal(after[key], value.to(torch.bfloat16).float()), key
        entry = report["layers"][stack]
        assert entry["weight_sqnr_db"] > 25 and entry["output_sqnr_db"] > 20, entry
    assert report["actions"]["relative"] < 0.05, report["actions"]
    qconfig = json.loads((Path(out) / "policy.json").read_text())["quantization_config"]
    assert qconfig["activations"] == "1x128" and set(stacks) <= set(qconfig["weight_only_modules"])
    assert not any(isinstance(quantized.model.get_submodule(n), Fp8BlockLinear) for n in qconfig["weight_only_modules"])
    return report


def test_fp8_ptq_quantizes_each_expert_in_its_own_blocks(moe_run, train_dataset, tmp_path):
    checkpoint, _ = moe_run
    report = _check_fp8_experts(checkpoint, tmp_path / "fp8", train_dataset,
                                [f"{m}.experts" for m in MOE_LAYERS["pi05-tiny"]])
    assert not any(".mlp.router" in name for name in report["layers"])


def test_fp8_ptq_quantizes_groot_and_smolvla_experts(family_moe_run, train_dataset, tmp_path):
    name, checkpoint, _ = family_moe_run
    _check_fp8_experts(checkpoint, tmp_path / "fp8", train_dataset, [f"{m}.experts" for m in MOE_LAYERS[name]])


def test_fp8_shared_experts_and_an_excluded_stack():
    """Shared experts are quantized like routed ones, and the layer computes exactly what it does with the
    dequantized weights as plain stacks; `--quant.exclude` keeps one stack, the default takes the rest."""
    import re

    from kilovla.quant.fp8 import Fp8Config, Fp8GroupedExperts, quantize_model

    moe, layers = {**MOE, "shared_experts": 1}, MOE_LAYERS["groot-tiny"]
    torch.manual_seed(0)
    model = build_model("groot-tiny", moe=moe).eval()
    torch.manual_seed(0)
    reference = build_model("groot-tiny", moe=moe).eval()
    sqnr = quantize_model(model, Fp8Config(exclude=rf"^{re.escape(layers[1])}\.experts$"))
    assert {f"{layers[0]}.experts", f"{layers[0]}.shared", f"{layers[1]}.shared"} <= set(sqnr)
    assert not isinstance(model.get_submodule(f"{layers[1]}.experts"), Fp8GroupedExperts)
    with torch.no_grad():
        for group in ("experts", "shared"):
            fp8, plain = model.get_submodule(f"{layers[0]}.{group}"), reference.get_submodule(f"{layers[0]}.{group}")
            for name in fp8.payloads:
                getattr(plain, name).copy_(fp8.dequantized_weight(name=name))
        x = torch.randn(7, model.get_submodule(layers[0]).router.weight.shape[1])
        got, want = model.get_submodule(layers[0])(x), reference.get_submodule(layers[0])(x)
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_upcycling_under_lora_is_refused_unless_the_moe_layers_train_in_full(train_dataset, tmp_path):
    """LoRA freezes experts and routers: an upcycled MoE would stay the dense model with random routers."""
    from kilovla.config import load_config
    from kilovla.train.trainer import TrainConfig, train

    common = [f"--dataset.roots=[{train_dataset}]", "--steps=1", "--batch.global_batch_size=4", "--progress=false",
              "--policy.overrides={chunk_size: 4}"]
    dense = train(load_config(TrainConfig, None, [f"--run_dir={tmp_path / 'dense'}", *common]))["checkpoint"]
    upcycle = [*common, f"--policy.init_from={dense}", "--policy.moe.num_experts=4", "--policy.lora.rank=2"]
    with pytest.raises(KilovlaError, match=r"policy.lora.rank=2 on an MoE model upcycled .* every router at its "
                                           rf"random start; .*policy.lora.full=\[{re.escape(EXPERT_MLP.format(0).rstrip('.'))}"):
        train(load_config(TrainConfig, None, [f"--run_dir={tmp_path / 'lora'}", *upcycle]))
    assert not (tmp_path / "lora").exists()
    layers = ", ".join(EXPERT_MLP.format(i).rstrip(".") for i in range(2))
    summary = train(load_config(TrainConfig, None, [f"--run_dir={tmp_path / 'full'}", *upcycle,
                                                    f"--policy.lora.full=[{layers}]"]))
    assert summary["checkpoint"].endswith("step_000001")


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


@pytest.mark.parametrize("name", OTHERS)
def test_lora_leaves_groot_and_smolvla_experts_frozen_and_trains_them_in_full_when_named(name):
    from kilovla.models.lora import LoraSettings, apply_lora, merge_state

    mlp = MOE_LAYERS[name][1]
    model = apply_lora(build_model(name, moe=MOE), LoraSettings(rank=2))
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert any(".lora_A" in n for n in trainable)
    assert not any(n.startswith(f"{m}.") for n in trainable for m in MOE_LAYERS[name])
    full = apply_lora(build_model(name, moe=MOE), LoraSettings(rank=2, full=[mlp]))
    assert {f"{mlp}.router.weight", f"{mlp}.experts.down_proj"} <= {n for n, p in full.named_parameters() if p.requires_grad}
    assert merge_state(model.state_dict(), LoraSettings(rank=2)).keys() == build_model(name, moe=MOE).state_dict().keys()


def test_bench_moe_quick_writes_the_dense_vs_moe_row(tmp_path):
    import json

    from kilovla.bench.models import run_moe

    result = json.loads(run_moe(quick=True, out_dir=tmp_path, device="cpu").read_text())
    (row,) = result["rows"]
    assert row["name"] == "train_samples_per_s_moe" and row["baseline"] > 0 and row["ours"] > 0
    assert row["ratio"] == pytest.approx(row["ours"] / row["baseline"], rel=1e-2)
    assert (result["expert_mlp"], result["dense_mlp"], result["top_k"]) == (256, 512, 2)


def test_an_fsdp_runs_dense_shards_cannot_start_an_moe_model(tmp_path):
    """Upcycling reads the dense MLPs from model.safetensors; an FSDP run's intermediate checkpoint holds only
    DCP shards, which load as saved: starting an MoE model from dense ones is refused in one line."""
    import torch.distributed.checkpoint as dcp

    from kilovla.train.build import _refuse_sharded_upcycling

    dense, moe = tmp_path / "dense", tmp_path / "moe"
    dcp.save({"model.expert.layers.0.mlp.gate_proj.weight": torch.zeros(2, 2)}, checkpoint_id=dense / "state",
             no_dist=True)
    dcp.save({"model.expert.layers.0.mlp.router.weight": torch.zeros(2, 2)}, checkpoint_id=moe / "state", no_dist=True)
    with pytest.raises(KilovlaError, match=r"dense: an FSDP run's intermediate checkpoint of a dense model .* upcycle "
                                           r"from the run's final checkpoint \(model.safetensors\)$"):
        _refuse_sharded_upcycling(dense, preset("pi05-tiny", moe=MOE))
    _refuse_sharded_upcycling(moe, preset("pi05-tiny", moe=MOE))  # MoE shards onto the MoE model: loads as saved
    _refuse_sharded_upcycling(dense, preset("pi05-tiny"))
