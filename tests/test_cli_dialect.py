"""The dotted dialect of eval (and the commands that share its sections): LeRobot's spellings, did-you-mean
for a misspelt key, the old dashed flags as aliases that say their new spelling once, `--help` listing
every field with its default."""

from __future__ import annotations

import json

import pytest

from conftest import unless_given

from kilovla import cli
from kilovla.cli import main
from kilovla.cli_config import EvalCommand
from kilovla.models.family import families, family_of


def _config(argv: list[str]):
    args, extra = cli.build_parser().parse_known_args(argv)
    from kilovla.cli_config import config_from

    return config_from(args, extra)


def test_lerobot_spellings_fill_the_eval_config():
    cfg = _config(["eval", "--policy.path=runs/x", "--env.type=metaworld", "--env.task=reach-v3,push-v3",
                   "--eval.n_episodes=20", "--eval.batch_size=10", "--output_dir=out/e", "--env.cameras=scene",
                   "--env.resolution", "64", "--eval.allow_seen_seeds"])
    assert isinstance(cfg, EvalCommand)
    assert (cfg.policy.path, cfg.env.type, cfg.env.task) == ("runs/x", "metaworld", "reach-v3,push-v3")
    assert (cfg.eval.n_episodes, cfg.eval.batch_size, cfg.output_dir) == (20, 10, "out/e")
    assert (cfg.env.resolution, cfg.eval.allow_seen_seeds, cfg.env.camera_tuple()) == (64, True, ("scene",))
    settings = cfg.eval.settings(cfg.env, ["reach-v3"])
    assert (settings.episodes, settings.batch_size, settings.resolution, settings.videos) == (20, 10, 64, 2)


def test_the_old_flags_map_onto_the_same_config_and_say_the_new_spelling_once(capsys):
    old = _config(["eval", "--policy", "random", "--tasks", "MT10", "--episodes", "3", "--n-action-steps", "2",
                   "--episodes", "4", "--ema", "--allow-seen-seeds", "--out", "o", "--max-steps", "7"])
    new = _config(["eval", "--policy.path=random", "--env.task=MT10", "--eval.n_episodes=4",
                   "--eval.n_action_steps=2", "--policy.ema=true", "--eval.allow_seen_seeds=true",
                   "--output_dir=o", "--env.max_steps=7"])
    assert old == new
    err = capsys.readouterr().err.splitlines()
    assert "--n-action-steps is now --eval.n_action_steps" in err
    assert err.count("--episodes is now --eval.n_episodes") == 1  # given twice, said once
    assert "--policy is now --policy.path" in err and "--out is now --output_dir" in err


def test_a_misspelt_key_gets_did_you_mean_and_exit_2(capsys):
    assert main(["eval", "--eval.n_episods=3"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["error: unknown config key 'eval.n_episods' (did you mean 'eval.n_episodes'?)"]


def test_a_bad_value_is_one_line_and_exit_2(capsys):
    assert main(["eval", "--eval.n_episodes=many"]) == 2
    assert capsys.readouterr().err.strip() == "error: config key 'eval.n_episodes': 'many' is not an int"
    assert main(["eval", "--policy.path=scripted", "stray"]) == 2
    assert "unexpected arguments ['stray']" in capsys.readouterr().err


def test_help_lists_every_field_per_section_with_its_default(capsys):
    with pytest.raises(SystemExit) as e:
        main(["eval", "--help"])
    assert e.value.code == 0
    out = " ".join(capsys.readouterr().out.split())
    for section in ("--policy.*:", "--env.*:", "--eval.*:"):
        assert section in out
    for key in ("--policy.path", "--policy.ema", "--env.type", "--env.task", "--env.cameras", "--env.resolution",
                "--env.max_steps", "--eval.n_episodes", "--eval.batch_size", "--eval.seed", "--eval.n_action_steps",
                "--eval.workers", "--eval.videos", "--eval.allow_seen_seeds", "--output_dir"):
        assert key in out
    assert "episodes per task (default: 10)" in out and "(default: metaworld)" in out
    assert "--n-action-steps = --eval.n_action_steps" in out  # the aliases, in the epilog


def _help(command: str, capsys) -> str:
    with pytest.raises(SystemExit) as e:
        main([command, "--help"])
    assert e.value.code == 0
    return " ".join(capsys.readouterr().out.split())


def test_each_commands_help_states_its_own_defaults_and_policies(capsys):
    out = _help("collect", capsys)  # collect has no policy: its own resolution and cameras
    assert "--env.resolution INT camera pixels (default: 96)" in out
    assert "--env.cameras STR comma-separated env cameras (default: scene,wrist)" in out
    assert "training resolution" not in out and "the env's own" not in out
    for command in ("quantize", "serve"):  # a policy folder only
        out = _help(command, capsys)
        assert f"--policy.path STR the policy folder to {command}:" in out and "scripted" not in out
    assert "scripted, random, or ws://HOST:PORT" in _help("eval", capsys)


@pytest.mark.parametrize("argv", [["serve", "--policy.path=ws://127.0.0.1:8000"],
                                  ["quantize", "--policy.path=scripted", "--output_dir=q"]])
def test_quantize_and_serve_refuse_what_is_not_a_policy_folder_by_name(tmp_path, monkeypatch, capsys, argv):
    monkeypatch.chdir(tmp_path)
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"error: {argv[1].replace('=', ' ')}: {argv[0]} takes a policy folder (a run folder or a " \
                  "checkpoint); scripted, random and ws:// URLs are for `kilovla eval`"
    assert list(tmp_path.iterdir()) == []


def test_eval_runs_in_the_dotted_dialect(tmp_path, capsys):
    out = tmp_path / "ev"
    assert main(["eval", "--policy.path=scripted", "--env.type=metaworld", "--env.task=reach-v3",
                 "--eval.n_episodes=1", "--eval.batch_size=1", "--env.resolution=32", "--env.max_steps=5",
                 "--eval.videos=0", f"--output_dir={out}"]) == 0
    report = json.loads((out / "report.json").read_text())
    assert report["per_task"]["reach-v3"]["episodes"] == 1
    assert capsys.readouterr().err == ""  # no alias used, no notice


def test_a_bad_value_of_an_old_flag_names_the_flag_as_typed(capsys):
    assert main(["eval", "--episodes", "abc"]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == "error: --episodes abc: 'abc' is not an int"


def test_old_flags_with_bad_input_say_their_new_spelling_then_one_error_line(capsys):
    assert main(["eval", "--tasks", "push-v9", "--episodes", "1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[:2] == ["--tasks is now --env.task", "--episodes is now --eval.n_episodes"]
    assert len(err) == 3 and err[2].startswith("error: ")


def test_quantize_and_collect_share_the_env_and_eval_sections_and_keep_their_old_flags():
    from kilovla.cli_config import CollectCommand, EnvSection, EvalSection, QuantizeCommand

    new = _config(["quantize", "--policy.path=runs/x", "--output_dir=q", "--eval.n_episodes=50",
                   "--env.type=libero", "--env.task=libero_spatial/0", "--quant.block=64", "--quant.scope=all"])
    old = _config(["quantize", "runs/x", "--out", "q", "--eval-episodes", "50", "--env", "libero", "--tasks",
                   "libero_spatial/0", "--block", "64", "--scope", "all"])
    assert isinstance(new, QuantizeCommand) and new == old
    assert isinstance(new.env, EnvSection) and isinstance(new.eval, EvalSection)
    assert (QuantizeCommand().eval.n_episodes, QuantizeCommand().quant.samples) == (0, 64)  # quantize's defaults
    new = _config(["collect", "--env.task=reach-v3", "--collect.n_episodes=2", "--output_dir=d",
                   "--collect.noise=0.1", "--collect.labels=expert", "--collect.overwrite"])
    old = _config(["collect", "--tasks", "reach-v3", "--episodes-per-task", "2", "--out", "d", "--noise", "0.1",
                   "--labels", "expert", "--overwrite"])
    assert isinstance(new, CollectCommand) and new == old
    assert (new.env.cameras, new.env.resolution, new.collect.noise) == ("scene,wrist", 96, 0.1)  # collect's defaults


def test_quantize_and_collect_name_what_is_missing_or_misspelt(capsys):
    assert main(["quantize", "--output_dir=q"]) == 2
    assert capsys.readouterr().err.strip() == "error: quantize: give --policy.path=DIR, the policy folder to quantize"
    assert main(["collect", "--collect.n_epsiodes=2", "--output_dir=d"]) == 2
    assert "(did you mean 'collect.n_episodes'?)" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        main(["quantize", "--policy.path=x", "--output_dir=q", "--quant.scope=most"])
    assert e.value.code == 2 and "invalid choice: 'most'" in capsys.readouterr().err


def test_serve_takes_policy_path_and_its_serve_section_and_keeps_its_old_flags(capsys):
    from kilovla.cli_config import ServeCommand

    new = _config(["serve", "--policy.path=runs/mw", "--serve.host=0.0.0.0", "--serve.port=0", "--serve.map=a=b",
                   "--serve.map=[c=d]", "--serve.cuda_graphs=false", "--serve.max_batch=4"])
    old = _config(["serve", "--policy", "runs/mw", "--host", "0.0.0.0", "--port", "0", "--map", "a=b", "--map",
                   "c=d", "--no-cuda-graphs", "--max-batch", "4"])
    assert isinstance(new, ServeCommand) and new == old
    assert new.serve.map == ["a=b", "c=d"] and new.serve.cuda_graphs is False
    err = capsys.readouterr().err.splitlines()
    assert "--no-cuda-graphs is now --serve.cuda_graphs=false" in err and err.count("--map is now --serve.map") == 1
    assert main(["serve", "--serve.port=0"]) == 2
    assert capsys.readouterr().err.strip() == "error: serve: give --policy.path=DIR, the policy folder to serve"
    assert main(["serve", "--policy.path=x", "--serve.map=nokey"]) == 2
    assert "error: --serve.map 'nokey': give REQUEST_KEY=POLICY_KEY" in capsys.readouterr().err


def _bench_config(argv):
    from kilovla.cli_config import config_from

    args, extra = cli.build_parser().parse_known_args(argv)
    return config_from(args, extra)


def test_bench_takes_policy_path_and_the_old_policy_flag():
    assert _bench_config(["bench", "rl", "--policy.path=runs/x"]).policy.path == "runs/x"
    assert _bench_config(["bench", "fp8", "--policy", "runs/y"]).policy.path == "runs/y"
    assert _bench_config(["bench", "serve"]).policy.path is None


def test_bench_and_data_take_dotted_keys_and_their_old_flags(capsys):
    cfg = _bench_config(["bench", "rl", "--rl.minutes=2", "--env-steps", "300", "--only=throughput", "--out", "o"])
    assert (cfg.rl.minutes, cfg.rl.env_steps, cfg.rl.only, cfg.output_dir) == (2.0, 300, "throughput", "o")
    cfg = _bench_config(["bench", "fp8", "--fp8.episodes=0", "--resolution", "48", "--fp8.dataset=d"])
    assert (cfg.fp8.episodes, cfg.fp8.resolution, cfg.fp8.dataset) == (0, 48, "d")
    cfg = _bench_config(["data", "bench", "DS", "--cache", "c", "--world_size=8"])
    assert (cfg.dataset.root, cfg.frame_cache, cfg.world_size, cfg.output_dir) == ("DS", "c", 8, "bench-results")
    cfg = _bench_config(["data", "convert", "A", "--output_dir=B", "--overwrite"])
    assert (cfg.dataset.root, cfg.output_dir, cfg.overwrite) == ("A", "B", True)
    for argv in (["data", "convert", "A", "--overwrite", "B"], ["data", "convert", "--dataset.root=A", "B"]):
        args, extra = cli.build_parser().parse_known_args(argv)  # a flag between the paths; the source by name
        from kilovla.cli_config import config_from, take_positionals

        cfg = config_from(args, take_positionals(args, extra))
        assert (cfg.dataset.root, cfg.output_dir) == ("A", "B")
    err = capsys.readouterr().err.splitlines()
    assert err == ["--env-steps is now --rl.env_steps", "--only is now --rl.only", "--out is now --output_dir",
                   "--resolution is now --fp8.resolution", "--cache is now --frame_cache"]


@pytest.mark.parametrize("argv, said", [
    (["bench", "data", "--rl.minutes=3"], "--rl.minutes=3: a setting of bench rl, not of bench data"),
    (["bench", "all", "--only", "gain"], "--only gain: a setting of bench rl, not of bench all"),
    (["bench", "serve", "--world_size=4"], "--world_size=4: a setting of bench data, not of bench serve"),
    (["bench", "rl", "results/"], "results/ (the positional path): a setting of bench table, not of bench rl"),
    (["data", "info"], "give --dataset.root (or the positional path): the LeRobot dataset folder"),
    (["data", "convert", "v21"], "give --output_dir (or the positional dst): the v3.0 dataset folder to write"),
])
def test_a_bench_or_data_key_the_command_does_not_read_is_one_line(capsys, argv, said):
    assert cli.main(argv) == 2
    assert capsys.readouterr().err.splitlines()[-1].startswith(f"error: {said}")


def test_demo_takes_dotted_overrides_of_its_recipe(capsys):
    from kilovla.demo import FULL, QUICK

    cfg = _config(["demo", "--quick", "--policy.preset=pi0-tiny", "--policy.overrides.expert.width=128",
                   "--seed=3", "--output_dir=d"])
    recipe = cfg.recipe()
    assert (recipe.preset, recipe.train_steps, cfg.output_dir) == ("pi0-tiny", QUICK.train_steps, "d")
    moe = {"num_experts": 4, "top_k": 2, "expert_dim": 128}  # the demo's MoE action expert
    assert recipe.model == {"expert": {"width": 128, "mlp_dim": 256}, "moe": moe}  # merged into the recipe's
    assert (recipe.collect_seed, recipe.train_seed, recipe.eval_seed) == (3, 3, 4)
    # the wide expert is pi0-tiny's: another preset's overrides merge into its own model's (none)
    other = _config(["demo", "--quick", "--policy.preset=pi05-tiny", "--policy.overrides.expert.width=128"]).recipe()
    assert (other.preset, other.model) == ("pi05-tiny", {"expert": {"width": 128}})
    assert _config(["demo", "--policy.preset=groot-tiny"]).recipe().preset_model() == {}
    # train's --policy.moe.* merges into the recipe's MoE settings, beside its wide expert
    dense = _config(["demo", "--quick", "--policy.moe.num_experts=0"]).recipe()
    assert dense.model == {"expert": {"width": 64, "mlp_dim": 256}, "moe": {**moe, "num_experts": 0}}
    assert _config(["demo"]).recipe() == FULL and _config(["demo", "--quick", "--out", "x"]).recipe() == QUICK
    assert main(["demo", "--policy.overides.x=1"]) == 2
    assert "unknown config key 'policy.overides.x' (did you mean 'policy.overrides'?)" in capsys.readouterr().err
    assert main(["demo", "--policy.overrides.expert.width"]) == 2  # a key below a mapping needs its value


@pytest.mark.parametrize("override, message", [
    ("--policy.overrides.expert.widht=128",
     "error: unknown config key 'policy.overrides.expert.widht' (did you mean 'policy.overrides.expert.width'?)"),
    ("--policy.overrides.expert.width=wide", "error: config key 'policy.overrides.expert.width': 'wide' is not an int"),
    ("--policy.preset=pi0-huge", "error: --policy.preset=pi0-huge: unknown model preset 'pi0-huge'"),
    ("--policy.moe.num_expert=4",
     "error: unknown config key 'policy.overrides.moe.num_expert' (did you mean 'policy.overrides.moe.num_experts'?)"),
    ("--policy.preset=pi0-tny", "error: --policy.preset=pi0-tny: unknown model preset 'pi0-tny' (did you mean "
     "'pi0-tiny'?); available: pi05-tiny, pi0-tiny, "),
])
def test_demo_refuses_a_bad_override_in_a_second_before_collecting_or_writing(override, message, tmp_path, capsys,
                                                                               monkeypatch):
    """The quick recipe's collection alone takes ~20 s on 2 cores; the refusal comes before it, and before
    the demo's folder (or a dataset staging folder beside it) is made."""
    import time

    import kilovla.demo

    monkeypatch.chdir(tmp_path)  # the default output_dir, demo-output, would be made here
    monkeypatch.setattr(kilovla.demo, "collect_demonstrations", lambda *a: pytest.fail("collection started"))
    t = time.perf_counter()
    assert main(["demo", "--quick", override]) == 2
    assert time.perf_counter() - t < 5
    err = capsys.readouterr().err
    assert err.startswith(message) and err.count("\n") == 1
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("name", [name for fam in families() for name in fam.presets if name.endswith("-tiny")])
def test_the_demo_recipe_trains_every_familys_tiny_preset(name, tmp_path):
    """Each family writes the demo's fixed settings (chunk, state width, image size, the env's two cameras,
    packing) as its own config's keys: the training config passes `kilovla train`'s checks and builds."""
    from kilovla.demo import QUICK, check_recipe, model_overrides
    from kilovla.models.presets import preset

    recipe = QUICK.replace(preset=name)
    check_recipe(recipe, tmp_path)
    config = preset(name, **model_overrides(recipe))
    fam = family_of(config)
    assert fam.chunk_length(config) == recipe.chunk_size and config.vision.image_size == recipe.resolution
    assert len(config.enabled_cameras) == 2 and config.packing


def test_the_demo_writes_pi0_tinys_model_settings_as_before():
    from kilovla.demo import FULL, model_overrides

    assert model_overrides(FULL) == {
        "chunk_size": 10, "max_state_dim": 48, "packing": True, "language_padding": "longest",
        "disabled_cameras": ["right_wrist_0_rgb"], "expert": {"width": 64, "mlp_dim": 256},
        "moe": {"num_experts": 4, "top_k": 2, "expert_dim": 128}, "vision": {"image_size": 32}}
    assert list(model_overrides(FULL)) == ["chunk_size", "max_state_dim", "packing", "language_padding",
                                           "disabled_cameras", "expert", "moe", "vision"]


def test_a_demo_whose_collection_is_refused_leaves_no_folder_and_no_staging_behind(tmp_path, monkeypatch):
    import kilovla.envs.collect
    from kilovla.demo import QUICK, run_demo
    from kilovla.errors import KilovlaError

    def refuse(*args, **kwargs):  # after the dataset writer made its staging folder beside out/dataset
        assert sorted(p.name[:13] for p in (tmp_path / "out").iterdir()) == [".dataset.tmp-", ".kilovla-demo"]
        raise KilovlaError("reach-v3: refused")

    monkeypatch.setattr(kilovla.envs.collect, "run_episodes", refuse)
    with pytest.raises(KilovlaError, match="reach-v3: refused"):
        run_demo(tmp_path / "out", recipe=QUICK)
    assert list(tmp_path.iterdir()) == []


def test_train_takes_policy_path_as_its_starting_weights_and_keeps_init_from(capsys):
    from kilovla.cli_config import train_overrides
    from kilovla.config import load_config
    from kilovla.train.config import TrainConfig

    new = load_config(TrainConfig, None, train_overrides(["--policy.path=ckpt/a", "--steps=3"]))
    assert new.policy.init_from == "ckpt/a" and new.steps == 3
    old = load_config(TrainConfig, None, train_overrides(["--policy.init_from=ckpt/a", "--steps=3"]))
    assert old == new
    assert capsys.readouterr().err == ""  # init_from is the config's own key (YAML files), not an old flag


def test_a_prefix_of_a_key_is_not_taken_for_the_key(capsys):
    """argparse's abbreviation ran `--eval.n_episode=2` as --eval.n_episodes: a typo must not run."""
    assert main(["eval", "--eval.n_episode=2"]) == 2
    assert capsys.readouterr().err.strip() == ("error: unknown config key 'eval.n_episode' "
                                               "(did you mean 'eval.n_episodes'?)")
    assert main(["collect", "--collect.n_episode=1", "--output_dir=d"]) == 2
    assert "(did you mean 'collect.n_episodes'?)" in capsys.readouterr().err
    assert main(["bench", "rl", "--env-step", "5"]) == 2
    assert "error: unknown config key 'env-step' (did you mean 'rl.env_steps'?)" in capsys.readouterr().err


@pytest.mark.parametrize("argv, spellings", [
    (["eval", "--eval.n_episodes=0", "--episodes", "3"], "--eval.n_episodes=0 and --episodes 3"),
    (["collect", "--output_dir=c4", "--out", "c5"], "--output_dir=c4 and --out c5"),
    (["quantize", "RUN_A", "--policy.path=RUN_B"], "--policy.path=RUN_B and RUN_A (the positional policy_dir)"),
    (["serve", "--policy.path=x", "--no-cuda-graphs", "--serve.cuda_graphs=true"],
     "--no-cuda-graphs and --serve.cuda_graphs=true"),
    (["bench", "rl", "--policy.path=a", "--policy", "b"], "--policy.path=a and --policy b"),
    (["rl", "--policy.path=a", "--policy", "b"], "--policy.path=a and --policy b"),
    (["train", "--policy.path=a", "--policy.init_from=b"], "--policy.path=a and --policy.init_from=b"),
    # one spelling typed twice: the last no longer wins silently
    (["eval", "--eval.n_episodes=2", "--eval.n_episodes=3"], "--eval.n_episodes=2 and --eval.n_episodes=3"),
    (["train", "--steps=3", "--optim.lr=1e-4", "--steps=4"], "--steps=3 and --steps=4"),
    (["rl", "--rl.sac.batch_size=8", "--rl.sac.batch_size=16"], "--rl.sac.batch_size=8 and --rl.sac.batch_size=16"),
])
def test_two_spellings_of_one_key_with_two_values_are_refused(capsys, argv, spellings):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == f"error: {spellings} are one setting with two values; give one"


def test_two_spellings_of_one_key_with_one_value_agree():
    from kilovla.cli_config import check_spellings

    for argv in (["eval", "--eval.n_episodes=3", "--episodes", "3", "--ema", "--policy.ema=true"],
                 ["quantize", "runs/x", "--policy.path=runs/x"]):
        check_spellings(cli.build_parser().parse_known_args(argv)[0])  # no error
    cfg = _config(["eval", "--eval.n_episodes=3", "--episodes", "3", "--ema", "--policy.ema=true"])
    assert (cfg.eval.n_episodes, cfg.policy.ema) == (3, True)


@pytest.mark.parametrize("argv, line", [
    (["quantize", "--policy.path=x", "--quant.scope=every"],
     "error: --quant.scope: invalid choice: 'every' is not one of default, all"),
    (["collect", "--collect.labels=foo"], "error: --collect.labels: invalid choice: 'foo' is not one of executed, expert"),
    (["collect", "--labels", "foo"], "error: --labels: invalid choice: 'foo' is not one of executed, expert"),
    (["eval", "--eval.n_episodes"], "error: --eval.n_episodes: expected one argument"),
    (["eval", "--episodes"], "error: --episodes: expected one argument"),
])
def test_a_value_outside_the_choices_is_one_line_and_exit_2(capsys, argv, line):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2 and capsys.readouterr().err.strip() == line


@pytest.mark.parametrize("flag, said", [
    ("--eval.n_episodes=0", "--eval.n_episodes=0: must be >= 1"),
    ("--env.task=reach-v9", "unknown metaworld task(s) ['reach-v9']"),
    ("--env.task=", "no metaworld tasks given"),
    ("--env.cameras=foo", "unknown Meta-World cameras ['foo']"),
])
def test_eval_refuses_before_it_announces_a_folder(tmp_path, monkeypatch, capsys, flag, said):
    monkeypatch.chdir(tmp_path)
    assert main(["eval", "--policy.path=scripted", *unless_given(["--env.task=reach-v3", "--eval.n_episodes=1"],
                                                                  [flag]), flag]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.startswith(f"error: {said}") and len(err.splitlines()) == 1
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("argv, said", [
    (["--env.task=reach-v9"], "error: unknown metaworld task(s) ['reach-v9']"),
    (["--env.cameras=foo"], "error: unknown Meta-World cameras ['foo']"),
    (["--collect.seed=-1"], "error: --collect.seed=-1: must be an integer in [0, 1000000000)"),
    (["--seed", "-1"], "error: --seed -1: must be an integer in [0, 1000000000)"),
])
def test_collect_refuses_before_it_announces(tmp_path, monkeypatch, capsys, argv, said):
    monkeypatch.chdir(tmp_path)
    assert main(["collect", *unless_given(["--env.task=reach-v3", "--collect.n_episodes=1"], argv),
                 "--output_dir=d", *argv]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.splitlines()[-1].startswith(said) and "starting" not in err
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("argv, line", [
    (["demo", "--seed=-1"], "error: --seed=-1: must be an integer in [0, 999999999)"),
    (["eval", "--eval.seed=1000000000"], "error: --eval.seed=1000000000: must be an integer in [0, 1000000000)"),
])
def test_a_seed_outside_the_seed_rule_names_the_flag(tmp_path, monkeypatch, capsys, argv, line):
    monkeypatch.chdir(tmp_path)
    assert main(argv) == 2
    assert capsys.readouterr().err.strip() == line
    assert list(tmp_path.iterdir()) == []


def test_a_refused_eval_writes_nothing(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["eval", "--policy.path=scripted", "--env.task=MT10", "--eval.n_episodes=0"]) == 2
    assert capsys.readouterr().err.startswith("error: ")
    assert list(tmp_path.iterdir()) == []  # not even the eval-output/ it made for its folder
    (tmp_path / "eval-output" / "earlier").mkdir(parents=True)  # one that was there stays
    assert main(["eval", "--policy.path=scripted", "--env.task=MT10", "--eval.n_episodes=0"]) == 2
    assert [p.name for p in (tmp_path / "eval-output").iterdir()] == ["earlier"]


def test_train_did_you_mean_knows_policy_path(capsys):
    assert main(["train", "--policy.pth=runs/x"]) == 2
    assert capsys.readouterr().err.strip() == "error: unknown config key 'policy.pth' (did you mean 'policy.path'?)"
    assert main(["train", "--optim.lrr=1"]) == 2
    assert "(did you mean 'optim.lr'?)" in capsys.readouterr().err


def test_rl_takes_policy_path_and_its_old_policy_flag(tmp_path, capsys):
    """Refused before Ray starts: the folder is not a policy folder."""
    nope = tmp_path / "nope"
    assert main(["rl", f"--run_dir={tmp_path / 'rl'}", f"--policy.path={nope}"]) == 2
    assert capsys.readouterr().err.splitlines() == [f"error: --policy.path {nope}: not a policy folder (no policy.json; "
                                                     "a policy folder holds policy.json and model.safetensors)"]
    assert main(["rl", f"--run_dir={tmp_path / 'rl'}", "--policy", str(nope)]) == 2
    assert capsys.readouterr().err.splitlines() == ["--policy is now --policy.path",
                                                     f"error: --policy.path {nope}: not a policy folder (no policy.json; "
                                                     "a policy folder holds policy.json and model.safetensors)"]
    assert main(["rl", "--policy.pth=x"]) == 2
    assert capsys.readouterr().err.strip() == "error: unknown config key 'policy.pth' (did you mean 'policy.path'?)"
    assert not (tmp_path / "rl").exists()


def test_an_rl_yaml_config_keeps_its_policy_key(tmp_path, capsys):
    from kilovla.rl import runner

    (tmp_path / "rl.yaml").write_text(f"policy: {tmp_path / 'nope'}\nmode: sync\n")
    assert runner.load(str(tmp_path / "rl.yaml"), []).policy == str(tmp_path / "nope")
    assert main(["rl", f"--config={tmp_path / 'rl.yaml'}", f"--run_dir={tmp_path / 'rl'}"]) == 2
    assert capsys.readouterr().err.strip() == (f"error: --policy.path {tmp_path / 'nope'}: not a policy folder "
                                               "(no policy.json; a policy folder holds policy.json and model.safetensors)")


def test_rl_help_shows_policy_path(capsys):
    with pytest.raises(SystemExit) as e:
        main(["rl", "--help"])
    out = capsys.readouterr().out
    assert e.value.code == 0 and "--policy.path" in out and "--policy " not in out


@pytest.mark.parametrize("argv, line", [
    (["eval", "--eval.videos=-1"], "error: --eval.videos=-1: must be >= 0"),
    (["eval", "--videos", "-1"], "error: --videos -1: must be >= 0"),
    (["eval", "--eval.n_episodes=-2"], "error: --eval.n_episodes=-2: must be >= 1"),
    (["eval", "--eval.n_episodes=0"], "error: --eval.n_episodes=0: must be >= 1"),  # quantize's least is 0
    (["eval", "--eval.batch_size=0"], "error: --eval.batch_size=0: must be >= 1"),
    (["eval", "--workers", "-1"], "error: --workers -1: must be >= 0"),
    (["collect", "--collect.noise=-1", "--output_dir=c"], "error: --collect.noise=-1: must be >= 0"),
    (["collect", "--collect.n_episodes=-1", "--output_dir=c"], "error: --collect.n_episodes=-1: must be >= 1"),
    (["collect", "--batch-size", "0", "--output_dir=c"], "error: --batch-size 0: must be >= 1"),
    (["collect", "--collect.workers=-3", "--output_dir=c"], "error: --collect.workers=-3: must be >= 0"),
    (["quantize", "--policy.path=p", "--output_dir=q", "--quant.samples=-1"], "error: --quant.samples=-1: must be >= 1"),
    (["quantize", "--policy.path=p", "--output_dir=q", "--eval.n_episodes=-1"],
     "error: --eval.n_episodes=-1: must be >= 0"),
    (["serve", "--policy.path=p", "--serve.max_batch=0"], "error: --serve.max_batch=0: must be >= 1"),
])
def test_a_number_below_its_fields_least_is_one_line_and_writes_nothing(tmp_path, monkeypatch, capsys, argv, line):
    monkeypatch.chdir(tmp_path)
    small = {"eval": ["--env.task=reach-v3", "--eval.n_episodes=1", "--env.max_steps=2", "--env.resolution=16"],
             "collect": ["--env.task=reach-v3", "--collect.n_episodes=1", "--env.max_steps=2", "--env.resolution=16"]}
    # (small runs: without the check, the command would run and write)
    assert main([*argv[:1], *unless_given(small.get(argv[0], []), argv[1:]), *argv[1:]]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == line
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("argv, line", [
    (["eval", "--policy.path=nope", "--env.task=reach-v3"],
     "error: --policy.path 'nope': not 'scripted', 'random', a ws:// URL or an existing checkpoint path"),
    (["quantize", "--policy.path=nope", "--output_dir=q", "--quant.block=24"],
     "error: --quant.block 24: a block must be a positive multiple of 16 (FP8 GEMMs work on 16-wide tiles; the GPU "
     "kernels need 128)"),
    (["quantize", "--policy.path=nope", "--output_dir=."], "error: --output_dir .: already exists; nothing was written "
     "(choose a new folder)"),
    (["serve", "--policy.path=nope", "--serve.port=70000"], "error: --serve.port 70000: must be in 0..65535 "
     "(0: any free port)"),
])
def test_errors_of_the_library_name_the_dotted_flags(tmp_path, monkeypatch, capsys, argv, line):
    monkeypatch.chdir(tmp_path)
    assert main(argv) == 2
    assert capsys.readouterr().err.strip() == line


def test_library_notes_name_the_dotted_flags(tmp_path, monkeypatch):
    from kilovla.bench.rl import default_policy
    from kilovla.envs.collect import collect
    from kilovla.errors import KilovlaError
    from kilovla.quantize.report import report_rows

    with pytest.raises(KilovlaError, match="^--collect.n_episodes must be at least 1, got 0$"):
        collect(tmp_path / "c", tasks=["reach-v3"], episodes_per_task=0)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(KilovlaError, match="pass --policy.path=PATH"):
        default_policy()
    size = {"source_bytes": 4096, "bf16_bytes": 2048, "quantized_bytes": 1024, "reduction_percent": 50.0,
            "fp8_params": 1, "total_params": 2}
    report = {"size": size, "layers": {"x": {"weight_sqnr_db": 30.0}},
              "latency": {"baseline_s": 1.0, "quantized_s": 1.0, "device": "cpu", "kernel": "emulate"}}
    notes = {row[0]: row[3] for row in report_rows(report)}  # quantize without quant.dataset, no closed loop
    assert (notes["action MSE"], notes["closed-loop success"]) == ("pass --quant.dataset=DIR", "pass --eval.n_episodes=N")


def test_train_takes_no_abbreviation_of_its_flags(capsys):
    """argparse's abbreviation ran `--conf` as --config; like the other commands, train takes whole flags."""
    assert main(["train", "--conf=run.yaml"]) == 2
    assert capsys.readouterr().err.startswith("error: unknown config key 'conf'")


@pytest.mark.parametrize("command, lines", [
    ("train", ["--optim.lr=FLOAT (default: 0.0003)", "--batch.token_budget=INT (default: 4096)  most tokens in one "
               "packed row", "--policy.path, --policy.init_from=STR (default: None)", "--dataset.roots=LIST"]),
    ("rl", ["--learner.algo.name=STR (default: 'residual_sac')", "--env.workers=INT (default: 2)",
            "--run_dir=STR (default: 'runs/rl')"]),
])
def test_train_and_rl_help_list_every_section_field_from_their_config(capsys, command, lines):
    with pytest.raises(SystemExit) as e:
        main([command, "--help"])
    out = capsys.readouterr().out
    assert e.value.code == 0 and all(line in out for line in lines), out
    assert "--policy=" not in out and "--mode=" not in out  # rl takes those as its own flags


@pytest.mark.parametrize("argv", [["eval", "--policy.path="], ["eval", "--output_dir="], ["serve", "--policy.path="],
                                  ["quantize", "--policy.path=x", "--output_dir="], ["collect", "--output_dir="],
                                  ["demo", "--output_dir="]])
def test_an_empty_path_is_refused_in_one_line(tmp_path, monkeypatch, capsys, argv):
    monkeypatch.chdir(tmp_path)  # were it taken, "" would be the current folder
    assert main(argv) == 2
    assert capsys.readouterr().err.splitlines() == [f"error: {argv[-1]}: an empty path; give a file or folder"]
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize("argv, line", [
    (["quantize", "--output_dir=q", "--env.task=reach-v3"],
     "error: --env.task=reach-v3: a setting of the closed-loop comparison, which runs only with --eval.n_episodes=N"),
    (["quantize", "--output_dir=q", "--workers", "2"],
     "error: --workers 2: a setting of the closed-loop comparison, which runs only with --eval.n_episodes=N"),
    (["eval", "--policy.path=random", "--policy.ema"],
     "error: --policy.ema: the random policy has no weights; EMA weights are a policy folder's"),
])
def test_a_setting_that_would_do_nothing_is_refused_in_one_line(tmp_path, monkeypatch, capsys, argv, line):
    """quantize's env/eval keys without its comparison, EMA weights of a policy that has none."""
    from tests.test_legacy_folders import FIXTURES

    monkeypatch.chdir(tmp_path)
    if argv[0] == "quantize":
        argv = [*argv, f"--policy.path={FIXTURES / 'demo_checkpoint'}"]
    assert main(argv) == 2
    assert capsys.readouterr().err.splitlines()[-1].startswith(line)
    assert list(tmp_path.iterdir()) == []
