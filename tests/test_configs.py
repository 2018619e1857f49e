"""The example configs under configs/ load into their config classes and pass the checks made before a
run starts, so a renamed key or a refused value breaks here, not in a user's first run."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from kilovla.config import load_config

CONFIGS = Path(__file__).resolve().parents[1] / "configs"


def test_every_config_is_a_train_or_rl_config():
    names = sorted(p.name for p in CONFIGS.glob("*.yaml"))
    assert names and all(n.startswith(("train_", "rl_")) for n in names), names


@pytest.mark.parametrize("path", sorted(CONFIGS.glob("train_*.yaml")), ids=lambda p: p.name)
def test_train_configs_load_validate_and_build_their_model_config(path):
    from kilovla.models.presets import preset
    from kilovla.train.config import TrainConfig, validate_config

    cfg = load_config(TrainConfig, path)
    validate_config(cfg)
    model = preset(cfg.policy.preset, **cfg.policy.overrides)  # the model overrides are real fields
    assert cfg.dataset.roots and model is not None


def test_the_demo_config_is_the_demo_recipe():
    from kilovla.demo import FULL, train_overrides
    from kilovla.train.config import TrainConfig

    recipe = load_config(TrainConfig, None, train_overrides(FULL, Path("data/mw"), Path("runs/mw"), progress=True))
    cfg = load_config(TrainConfig, CONFIGS / "train_pi0_demo.yaml")
    assert cfg == recipe


@pytest.mark.parametrize("path", sorted(CONFIGS.glob("rl_*.yaml")), ids=lambda p: p.name)
def test_rl_configs_load_and_pass_the_checks_made_before_ray(path):
    from kilovla.rl import checks, runner

    cfg = runner.load(str(path), [])
    checks.check_config(cfg)
    assert cfg.env.tasks


def test_the_rl_config_is_the_gain_rows_recipe():
    from kilovla.bench.rl import GAIN
    from kilovla.rl import runner

    assert runner.load(str(CONFIGS / "rl_residual_sac.yaml"), ["--env.tasks=[reach-v3,push-v3]"]) == \
        runner.load(str(CONFIGS / "rl_residual_sac.yaml"), list(GAIN))


def test_a_type_error_names_the_type_with_its_article():
    from dataclasses import dataclass

    from kilovla.config import from_dict
    from kilovla.errors import KilovlaError

    @dataclass
    class C:
        n: int = 0
        x: float = 0.0
        b: bool = False
        s: str = ""
        o: int | None = None

    for key, value, kind in [("n", "abc", "an int"), ("x", "abc", "a float"), ("b", 3, "a bool"), ("s", 3, "a str"),
                             ("o", "abc", "an int or None")]:
        with pytest.raises(KilovlaError) as e:
            from_dict(C, {key: value})
        assert str(e.value) == f"config key {key!r}: {value!r} is not {kind}"


@pytest.mark.parametrize("name", ["pi0-tiny", "groot-tiny", "smolvla-tiny"])
@pytest.mark.parametrize("override, message", [
    ({"language_padding": "shortest"}, "language_padding must be max_length or longest, not 'shortest'"),
    ({"disabled_cameras": ["nope"]}, "disabled cameras ['nope'] are not among the model's cameras"),
    ({"attention_backend": "fast"}, "attention_backend must be one of"),
])
def test_every_familys_config_checks_its_shared_fields(name, override, message):
    """family.CameraSlots.check_shared: one rule for the three configs (GR00T's took any language_padding)."""
    from kilovla.errors import KilovlaError
    from kilovla.models.presets import preset

    with pytest.raises(KilovlaError, match=re.escape(message)):
        preset(name, **override)


def _optim(*flags):
    from kilovla.train.config import TrainConfig, with_init_model

    return with_init_model(load_config(TrainConfig, None, list(flags))).optim


def test_smolvla_base_trains_with_lerobots_optimizer_by_default():
    """LeRobot v0.4.4 SmolVLAConfig: AdamW 1e-4, betas (0.9, 0.95), weight decay 1e-10, clip 10, 1000 warmup
    steps, cosine to 2.5e-6."""
    optim = _optim("--policy.preset=smolvla-base")
    assert (optim.lr, tuple(optim.betas), optim.weight_decay, optim.clip_grad_norm) == (1e-4, (0.9, 0.95), 1e-10, 10.0)
    assert optim.warmup_steps == 1000 and optim.lr * optim.min_lr_ratio == pytest.approx(2.5e-6)


def test_a_runs_own_optimizer_settings_win_over_the_presets_recipe():
    optim = _optim("--policy.preset=smolvla-base", "--optim.lr=3e-4", "--optim.warmup_steps=10")
    assert (optim.lr, optim.warmup_steps, optim.weight_decay) == (3e-4, 10, 1e-10)  # the rest: the recipe's


@pytest.mark.parametrize("name", ["pi05-tiny", "groot-tiny", "smolvla-tiny"])
def test_a_preset_without_an_optimizer_recipe_takes_optimconfigs_defaults(name):
    import dataclasses

    from kilovla.train.optim import OptimConfig

    assert dataclasses.asdict(_optim(f"--policy.preset={name}")) == dataclasses.asdict(OptimConfig())


def test_filled_optimizer_settings_survive_config_yaml_and_a_second_fill():
    """config.yaml holds the filled settings; a resumed run compares them with its own (checkpoint.py)."""
    import yaml

    from kilovla.config import dump_yaml, from_dict
    from kilovla.train.config import TrainConfig, with_init_model

    cfg = with_init_model(load_config(TrainConfig, None, ["--policy.preset=smolvla-base", "--optim.lr=2e-4"]))
    again = from_dict(TrainConfig, yaml.safe_load(dump_yaml(cfg)))
    assert with_init_model(again).optim == cfg.optim == with_init_model(cfg).optim


def test_optim_settings_leave_every_optimconfig_field_unset():
    import dataclasses

    from kilovla.train.optim import OptimConfig, OptimSettings

    assert [f.name for f in dataclasses.fields(OptimSettings)] == [f.name for f in dataclasses.fields(OptimConfig)]
    assert all(v is None for v in dataclasses.asdict(OptimSettings()).values())


def test_every_recipes_optimizer_settings_are_optimconfig_fields():
    from kilovla.models.presets import POLICY_DEFAULTS
    from kilovla.train.optim import OptimConfig

    for name, recipe in POLICY_DEFAULTS.items():
        OptimConfig(**recipe.optim)  # a misspelt key: TypeError naming it
