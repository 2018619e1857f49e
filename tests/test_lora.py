"""LoRA through peft: B = 0 is the base model, only adapters train, merged = unmerged, DDP = one process,
checkpoints hold adapters and resume exactly on the base they name."""

import json

import pytest
import torch

from kilovla.errors import KilovlaError
from kilovla.models.lora import LoraSettings, apply_lora, build_base, load_adapters, merge_state
from kilovla.policy_folder import load_policy_folder
from kilovla.models.presets import build_model
from tests.test_train import _args, _gradients, _max_diff, _metrics, _run, _trained, dataset  # noqa: F401

LORA = ["--policy.lora.rank=4", "--policy.lora.alpha=8"]


def _refused(args, capsys) -> str:
    """`kilovla train *args` in this process (no interpreter to start): it must end with exit code 2; its stderr."""
    from kilovla.cli import main

    capsys.readouterr()
    assert main(["train", *args]) == 2
    return capsys.readouterr().err


def _batch(model, n=3, seed=0):
    """A padded batch of the model's layout (2 camera slots, one present) and its fixed noise and time."""
    from kilovla.models.batch import PaddedBatch
    from kilovla.models.tokenize import ByteTokenizer, tokenize_batch

    cfg, g = model.config, torch.Generator().manual_seed(seed)
    tokens, mask = tokenize_batch(ByteTokenizer(), ["pick the cube", "open the drawer please", "stack"][:n],
                                  cfg.max_language_tokens)
    horizon, s = getattr(cfg, "chunk_size", None) or cfg.action_horizon, cfg.vision.image_size
    batch = PaddedBatch(images=torch.rand(n, len(cfg.cameras), 3, s, s, generator=g),
                        image_masks=torch.arange(len(cfg.cameras)).expand(n, -1) == 0, camera_names=cfg.cameras,
                        tokens=tokens, token_mask=mask, state=torch.randn(n, cfg.max_state_dim, generator=g),
                        actions=torch.randn(n, horizon, cfg.max_action_dim, generator=g),
                        action_is_pad=torch.zeros(n, horizon, dtype=torch.bool))
    return batch, torch.randn(batch.actions.shape, generator=g), torch.rand(n, generator=g)


def _loss(model, batch):
    batch, noise, t = batch
    return model(batch, noise=noise, time=t)["per_sample"]


@pytest.mark.parametrize("family", ["pi05-tiny", "groot-tiny", "smolvla-tiny", "groot-n17-tiny"])
def test_b_zero_gives_the_base_loss_exactly_and_only_adapters_get_gradients(family):
    model = build_model(family, seed=1)
    batch = _batch(model)
    base = _loss(model, batch).detach()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    apply_lora(model, LoraSettings(rank=4, alpha=8, vision=True))
    assert torch.equal(_loss(model, batch).detach(), base)  # lora_B starts at zero
    lora = [n for n, p in model.named_parameters() if p.requires_grad]
    assert lora and all(".lora_" in n for n in lora)
    with torch.no_grad():  # a non-zero B, so that A gets a gradient too
        for n, p in model.named_parameters():
            if ".lora_B" in n:
                p.normal_(0, 0.05)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    _loss(model, batch).sum().backward()
    grads = {n: p.grad for n, p in model.named_parameters()}
    assert all(grads[n] is None for n in grads if ".lora_" not in n)
    assert all(grads[n] is not None and grads[n].abs().sum() > 0 for n in lora)
    opt.step()
    after = merge_state({k: v for k, v in model.state_dict().items()}, LoraSettings(rank=4, alpha=8))
    unwrapped = {k.replace(".base_layer.", "."): v for k, v in model.state_dict().items() if ".lora_" not in k}
    assert all(torch.equal(before[k], unwrapped[k]) for k in before)  # the base did not move
    assert any(not torch.equal(before[k], after[k]) for k in before)  # the merged weights did


@pytest.mark.parametrize("family", ["pi05-tiny", "groot-tiny", "smolvla-tiny", "groot-n17-tiny"])
def test_merged_weights_compute_what_the_adapters_compute(family):
    settings = LoraSettings(rank=4, alpha=8)
    model = apply_lora(build_model(family, seed=2), settings)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if ".lora_B" in n:
                p.normal_(0, 0.1)
    plain = build_model(family, seed=99)
    plain.load_state_dict(merge_state(model.state_dict(), settings))
    batch = _batch(model)
    a, b = _loss(model.eval(), batch), _loss(plain.eval(), batch)
    assert (a - b).abs().max() < 1e-5 and (a - _loss(build_model(family, seed=2).eval(), batch)).abs().max() > 1e-4


def test_a_lora_run_checkpoints_adapters_ends_merged_and_resumes_exactly(dataset, tmp_path, capsys):
    straight = _trained(dataset, tmp_path / "straight", extra=[*LORA, "--ema_decay=0.9"])
    step2 = straight / "checkpoints" / "step_000002"
    files = {p.name for p in step2.iterdir()}
    assert {"adapter.safetensors", "adapter_ema.safetensors", "optimizer.pt"} <= files
    assert "model.safetensors" not in files  # intermediate: the adapters alone
    section = json.loads((step2 / "policy.json").read_text())["lora"]
    assert section["rank"] == 4 and section["base"]["seed"] == 0 and not section["merged"]
    final = straight / "checkpoints" / "step_000004"
    assert json.loads((final / "policy.json").read_text())["lora"]["merged"]
    # merged (model.safetensors) and unmerged (the adapters on their rebuilt base) sample the same actions
    merged = load_policy_folder(final).model
    unmerged = load_adapters(build_base(section, "test"), section, final / "adapter.safetensors", "test")
    batch = _batch(merged)
    assert (_loss(merged.eval(), batch) - _loss(unmerged.eval(), batch)).abs().max() < 1e-5
    obs, noise, _ = batch
    with torch.no_grad():
        assert (merged.sample_actions(obs, noise=noise) - unmerged.sample_actions(obs, noise=noise)).abs().max() < 1e-5
    # an adapters-only folder loads merged (eval, serve, rl, quantize get a plain model)
    intermediate = load_policy_folder(step2).model
    assert not any(".lora_" in n for n, _ in intermediate.named_parameters())
    on_base = load_adapters(build_base(section, "test"), section, step2 / "adapter.safetensors", "test")
    assert (_loss(intermediate.eval(), batch) - _loss(on_base.eval(), batch)).abs().max() < 1e-5

    # killed after step 3 (checkpoint at 2), resumed: the same losses and adapters as the straight run
    crashed = tmp_path / "crashed"
    killed = _run([*_args(dataset, crashed), *LORA, "--ema_decay=0.9"], env={"KILOVLA_FAULT_AFTER_STEP": "3"})
    assert killed.returncode == -9
    resumed = _run([*_args(dataset, crashed), *LORA, "--ema_decay=0.9", "--resume", "auto"])
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert [r["loss"] for r in _metrics(crashed)] == [r["loss"] for r in _metrics(straight)]
    from safetensors.torch import load_file

    for name in ("adapter.safetensors", "adapter_ema.safetensors", "model.safetensors"):
        a = load_file(str(final / name))
        b = load_file(str(crashed / "checkpoints" / "step_000004" / name))
        assert all(torch.equal(a[k], b[k]) for k in a), name

    # another rank, or another base (seed), is refused in one line
    assert "rank" in _refused([*_args(dataset, crashed, steps=6), "--policy.lora.rank=8", "--resume", "auto"], capsys)
    assert "dropout" in _refused([*_args(dataset, crashed, steps=6), *LORA, "--policy.lora.dropout=0.3", "--resume",
                                  "auto"], capsys)
    assert "base weights differ" in _refused([*_args(dataset, crashed, steps=6), *LORA, "--seed=3", "--resume", "auto"],
                                             capsys)


def test_adapters_are_refused_on_another_base(dataset, references, tmp_path, capsys):
    run = references("pi05-tiny", LORA)
    folder = run / "checkpoints" / "step_000002"
    section = json.loads((folder / "policy.json").read_text())["lora"]
    with pytest.raises(KilovlaError, match="base weights differ"):
        load_adapters(build_model("pi05-tiny", seed=5, chunk_size=4), section, folder / "adapter.safetensors", "x")
    base = lambda: build_base(section, "x")  # noqa: E731
    # one tensor of the base re-set: the fingerprint samples every tensor
    reset = base()
    reset.action_out_proj.weight.data.fill_(1.0)
    with pytest.raises(KilovlaError, match="base weights differ"):
        load_adapters(reset, section, folder / "adapter.safetensors", "x")
    # adapters of the wrong shape, or not finite, or a section that is not one: one line each
    from kilovla.models.checkpoints import read_safetensors, save_safetensors

    weights = read_safetensors(folder / "adapter.safetensors")
    key = next(k for k in weights if ".lora_A." in k)
    for name, bad in (("shape", {**weights, key: weights[key].reshape(-1, 1)}),
                      ("finite", {**weights, key: torch.full_like(weights[key], float("nan"))})):
        save_safetensors(bad, tmp_path / f"{name}.safetensors")
        with pytest.raises(KilovlaError, match="does not fit|non-finite"):
            load_adapters(base(), section, tmp_path / f"{name}.safetensors", "x")
    with pytest.raises(KilovlaError, match="rank must be a positive integer"):
        load_adapters(base(), {**section, "rank": "x"}, folder / "adapter.safetensors", "x")
    with pytest.raises(KilovlaError, match="must name the adapters' base"):
        build_base({**section, "base": {}}, "x")
    # an adapters folder is not weights to start a run from
    err = _refused([*_args(dataset, tmp_path / "again"), f"--policy.init_from={folder}"], capsys)
    assert "a LoRA run's adapters on their base" in err, err[-2000:]


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_two_ranks_of_a_lora_run_give_the_one_process_gradients(dataset, references, tmp_path, strategy):
    one = references("pi05-tiny", LORA)
    two = _trained(dataset, tmp_path / "two", nproc=2, extra=[*LORA, f"--parallel.strategy={strategy}"])
    assert min(r["rows_per_rank"] for r in _metrics(two)) >= 3
    for step in range(1, 5):
        g1, g2 = _gradients(one, step), _gradients(two, step)
        assert g1 and all(".lora_" in k for k in g1)
        assert _max_diff(g1, g2) < 1e-5, f"step {step}"
    assert any(g.abs().sum() > 0 for g in _gradients(one, 2).values())


def test_bad_lora_settings_are_one_line(dataset, tmp_path, capsys):
    for flags, message in ((["--policy.lora.rank=4", "--policy.lora.targets=nothing_here"], "matches no linear"),
                           (["--policy.lora.rank=4", "--expert_only=true"], "pick one"),
                           (["--policy.lora.rank=4", "--policy.lora.llm=true"], "GR00T's switch"),
                           (["--policy.lora.rank=4", "--freeze_vision=true"], "drop freeze_vision")):
        err = _refused([*_args(dataset, tmp_path / "bad"), *flags], capsys)
        assert message in err, err[-2000:]
