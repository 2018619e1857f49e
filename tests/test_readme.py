"""README's commands are real: every `kilovla ...` line in its shell blocks parses against the CLI, its
`--config` files load, its dotted overrides are keys of the config classes, and its results tables are
what `kilovla bench table docs/bench` renders. A renamed flag or key fails here, naming the README line."""

from __future__ import annotations

import argparse
import contextlib
import io
import re
import shlex
from pathlib import Path

import pytest

from kilovla import cli
from kilovla.bench.common import README_END, README_START, render_tables
from kilovla.errors import KilovlaError

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
SHELL_BLOCK = re.compile(r"^```(bash|sh|shell|console)?\s*$")


def shell_commands(text: str) -> list[tuple[int, str]]:
    """(line number, command) of every `kilovla ...` command in the text's shell code blocks: plain,
    after `$ `, or as torchrun's `-m kilovla`; continuation lines (a trailing backslash) joined."""
    out, in_block, pending, start = [], False, "", 0
    for number, line in enumerate(text.splitlines(), 1):
        if line.startswith("```"):
            in_block = not in_block and bool(SHELL_BLOCK.match(line))
            pending = ""
            continue
        if not in_block:
            continue
        if not pending:
            start = number
        stripped = line.strip()
        if stripped.endswith("\\"):
            pending += stripped[:-1].rstrip() + " "
            continue
        command, pending = (pending + stripped).removeprefix("$ "), ""
        if command.startswith("kilovla ") or " -m kilovla " in command:
            out.append((start, command))
    return out


def kilovla_argv(command: str) -> tuple[list[str], int]:
    """The arguments after `kilovla` (comments and `...` placeholders dropped) and the world size a
    torchrun prefix asks for (1 without one)."""
    words = [w for w in shlex.split(command, comments=True) if w != "..."]
    world = 1
    if "torchrun" in words:  # perhaps after a launcher (`srun ...`, `env VAR=1`)
        words = words[words.index("torchrun"):]
        at = words.index("-m")
        flags, i = {}, 1
        while i < at:  # --flag value or --flag=value
            key, eq, value = words[i].partition("=")
            if not eq and i + 1 < at and not words[i + 1].startswith("--"):
                value, i = words[i + 1], i + 1
            flags[key], i = value, i + 1
        # --nnodes=MIN:MAX (elastic): the smallest world the run must fit
        world = int(flags.get("--nnodes", "1").split(":")[0]) * int(flags.get("--nproc-per-node", 1))
        words = words[at + 1:]
    if words[0] != "kilovla":
        raise AssertionError(f"not a kilovla command: {command!r}")
    return words[1:], world


def check_command(command: str, root: Path = ROOT) -> None:
    """Raise AssertionError naming what is wrong with one README command."""
    argv, world = kilovla_argv(command)
    parser = cli.build_parser()
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            args, extra = parser.parse_known_args(argv)
    except SystemExit as e:
        if e.code == 0:  # `kilovla --version` / `--help`: argparse answers and exits 0
            return
        raise AssertionError(err.getvalue().strip().splitlines()[-1]) from None
    if getattr(args, "config_cls", None) is not None:  # the dotted dialect: every key exists, every value fits
        from kilovla.cli_config import _dict_key, config_from

        bad = [a for a in extra if not (a.startswith("--") and _dict_key(args.config_cls, a[2:].split("=")[0]))]
        if bad:
            raise AssertionError(f"unrecognized arguments: {' '.join(bad)}")
        try:
            config_from(args, extra)
        except KilovlaError as e:
            raise AssertionError(str(e)) from None
        return
    if extra and args.func not in (cli.cmd_train, cli.cmd_rl):
        raise AssertionError(f"unrecognized arguments: {' '.join(extra)}")
    if args.func in (cli.cmd_train, cli.cmd_rl):
        bad = [a for a in extra if not (a.startswith("--") and "=" in a)]
        if bad:
            raise AssertionError(f"{bad}: overrides look like --section.key=value")
        config = None if args.config is None else root / args.config
        if config is not None and not config.is_file():
            raise AssertionError(f"--config {args.config}: no such file in the repository")
        try:
            if args.func is cli.cmd_train:
                from kilovla.config import load_config
                from kilovla.train.config import TrainConfig, validate_config

                from kilovla.cli_config import train_overrides

                validate_config(load_config(TrainConfig, config, train_overrides(extra)), world_size=world)
            else:
                from kilovla.rl import checks, runner

                more = [f"--mode={args.mode}"] * bool(args.mode) + [f"--policy={args.policy}"] * bool(args.policy)
                checks.check_config(runner.load(config, [*extra, *more]))
        except KilovlaError as e:
            raise AssertionError(str(e)) from None


def readme_failures(text: str) -> list[str]:
    failures = []
    for number, command in shell_commands(text):
        try:
            check_command(command)
        except AssertionError as e:
            failures.append(f"README.md:{number}: {command!r}: {e}")
    return failures


def test_every_kilovla_command_in_readme_parses_against_the_cli():
    text = README.read_text()
    assert len(shell_commands(text)) >= 20  # the extraction found README's commands
    failures = readme_failures(text)
    assert not failures, "\n".join(failures)


def test_a_dead_flag_in_readme_is_reported_with_its_line():
    text = README.read_text().replace("kilovla demo --quick", "kilovla demo --quick --fast", 1)
    line, command = next((n, c) for n, c in shell_commands(text) if c.startswith("kilovla demo --quick --fast"))
    assert readme_failures(text) == [f"README.md:{line}: {command!r}: unrecognized arguments: --fast"]


def test_a_renamed_config_key_in_a_readme_override_is_reported():
    text = "```bash\nkilovla train --config configs/train_pi0_demo.yaml --optim.lrr=1e-4\n```\n"
    (failure,) = readme_failures(text)
    assert failure.startswith("README.md:2: ")
    assert "unknown config key 'optim.lrr' (did you mean 'optim.lr'?)" in failure


def test_continuation_lines_torchrun_and_comments_are_read_as_one_command():
    text = ("```bash\n$ kilovla eval --policy scripted \\\n    --episodes 2   # two per task\n"
            "torchrun --nnodes 2 --nproc-per-node 4 -m kilovla train --steps=3\n```\n"
            "kilovla not-in-a-block\n```python\nkilovla = 1\n```\n")
    commands = shell_commands(text)
    assert commands == [(2, "kilovla eval --policy scripted --episodes 2   # two per task"),
                        (4, "torchrun --nnodes 2 --nproc-per-node 4 -m kilovla train --steps=3")]
    assert kilovla_argv(commands[0][1]) == (["eval", "--policy", "scripted", "--episodes", "2"], 1)
    assert kilovla_argv(commands[1][1]) == (["train", "--steps=3"], 8)


def test_a_missing_config_file_in_readme_is_reported():
    (failure,) = readme_failures("```bash\nkilovla rl --config configs/nope.yaml --policy DIR\n```\n")
    assert failure.endswith("--config configs/nope.yaml: no such file in the repository")


def test_readme_results_tables_are_rendered_from_docs_bench():
    text = README.read_text()
    block = text[text.index(README_START) + len(README_START):text.index(README_END)]
    assert block.strip() == render_tables(ROOT / "docs" / "bench").strip(), \
        "README's tables differ from docs/bench: run `kilovla bench table docs/bench --readme README.md`"


def test_the_bench_parser_accepts_table_with_a_path():
    from kilovla.cli_config import config_from

    args = cli.build_parser().parse_args(["bench", "table", "docs/bench", "--readme=README.md"])
    cfg = config_from(args)
    assert (args.suite, cfg.results, cfg.readme) == ("table", "docs/bench", "README.md")
    assert isinstance(cli.build_parser(), argparse.ArgumentParser)
