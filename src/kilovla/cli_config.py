"""The dotted dialect of the CLI: a command's flags are the fields of one small dataclass.

    kilovla eval --policy.path=DIR --env.type=metaworld --env.task=reach-v3,push-v3 \\
        --eval.n_episodes=20 --eval.batch_size=10 --output_dir=DIR

`add_config_flags` declares `--section.key` for every field (`--help` lists them per section with their
defaults; a command's `HELP` rewords a shared field for it) and today's dashed flags as aliases that print the new spelling once on stderr (a terminal's:
off one, bad input stays one error line). `config_from`
reads the values with config.py's machinery (each checked against its field's type); a key that does not
exist stops with config.py's did-you-mean. The sections (`PolicySection`, `EnvSection`, `EvalSection`)
are defined once, here, and shared by the commands that take them.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import sys
import typing
from dataclasses import dataclass, field

import yaml

from kilovla.bench.common import SUITES
from kilovla.config import _all_keys, _unknown, from_dict, parse_override, set_dotted, to_dict
from kilovla.envs.seeds import MAX_SEED
from kilovla.errors import KilovlaError

PREFIX = "cfg:"  # namespace attributes holding config keys


def _f(default, help: str, choices: tuple[str, ...] | None = None, least: float | None = None,
       below: float | None = None, path: bool = False, required: bool = False):
    """A field with its `--help` line (and the values it takes: `choices`, checked by argparse; `least`, the
    smallest number it takes, `below`, the bound it stays under, `path`, a file or folder (never ""), and
    `required`, given by every run, checked by `config_from` before the command runs)."""
    meta = {"help": help, "choices": choices, "least": least, "below": below, "path": path, "required": required}
    if dataclasses.is_dataclass(default):
        return field(default_factory=lambda: dataclasses.replace(default), metadata=meta)
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata=meta)
    return field(default=default, metadata=meta)


@dataclass
class PolicySection:
    path: str | None = _f("scripted", "a policy folder, a run folder or its checkpoints/latest (the newest complete "
                          "checkpoint), scripted, random, or ws://HOST:PORT of `kilovla serve` ($KILOVLA_API_KEY)",
                          path=True)
    ema: bool = _f(False, "the folder's EMA weights (ema.safetensors, what `kilovla demo` evaluates)")


@dataclass
class EnvSection:
    type: str = _f("metaworld", "a registered env (metaworld, libero, ...)")
    task: str = _f("default", "comma-separated tasks, or a task set: default, MT10, MT50; LIBERO: suite names "
                   "or suite/index")
    cameras: str | None = _f(None, "comma-separated env cameras (default: the env's own)")
    resolution: int | None = _f(None, "camera pixels (default: the policy's training resolution, policy.json "
                                "image_size; 96 for scripted/random policies and folders that lack it)", least=1)
    max_steps: int | None = _f(None, "episode length limit (default: the env's)", least=1)

    def camera_tuple(self) -> tuple[str, ...] | None:
        return tuple(self.cameras.split(",")) if self.cameras else None

    def tasks(self) -> list[str]:
        from kilovla.envs.base import env_type

        return env_type(self.type).tasks(self.task)


@dataclass
class EvalSection:
    n_episodes: int = _f(10, "episodes per task", least=1)
    batch_size: int = _f(8, "envs per task stepped together, one policy batch", least=1)
    seed: int = _f(0, "the eval stream's seed: the same env seeds for every policy", least=0, below=MAX_SEED)
    n_action_steps: int | None = _f(None, "actions executed per predicted chunk (default: the policy's)", least=1)
    workers: int = _f(0, "env processes (0: in this process)", least=0)
    videos: int = _f(2, "record the first K episodes per task", least=0)
    allow_seen_seeds: bool = _f(False, "evaluate even on seeds the policy's demonstrations started from "
                                "(policy.json's demonstration_seeds; refused otherwise)")

    def settings(self, env: EnvSection, tasks, **fields):
        """The `EvalSettings` these sections describe; `fields` override (quantize: no videos)."""
        from kilovla.eval.settings import EvalSettings

        values = dict(env=env.type, tasks=tasks, episodes=self.n_episodes, seed=self.seed,
                      batch_size=self.batch_size, workers=self.workers, cameras=env.camera_tuple(),
                      resolution=env.resolution, max_steps=env.max_steps, n_action_steps=self.n_action_steps,
                      videos=self.videos, allow_seen_seeds=self.allow_seen_seeds)
        return EvalSettings(**{**values, **fields})


@dataclass
class EvalCommand:
    """`kilovla eval`."""

    policy: PolicySection = _f(PolicySection(), "")
    env: EnvSection = _f(EnvSection(), "")
    eval: EvalSection = _f(EvalSection(), "")
    output_dir: str | None = _f(None, "a new folder for report.json, report.md and videos/ (one that holds an "
                                "evaluation is refused); default: a fresh eval-output/<UTC date>_<time>_<env>_<policy>/",
                                path=True)


@dataclass
class QuantSection:
    block: int = _f(128, "weight block size (block x block tiles)")
    include: str | None = _f(None, "regex over module names (default: the family's language model and action "
                             "expert / DiT)")
    exclude: str | None = _f(None, "regex over module names to keep unquantized")
    scope: str = _f("default", "without quant.include: 'default' quantizes the language model and action expert; "
                    "'all' every Linear, token table and per-embodiment Linear outside the vision tower",
                    ("default", "all"))
    activations: str = _f("1x128", "1x128: W8A8 with per-token 1x128 activation scales; none: weight-only",
                          ("none", "1x128"))
    dtype: str = _f("bfloat16", "on-disk dtype of the layers that stay unquantized", ("bfloat16", "float16", "float32"))
    device: str = _f("cpu", "where both policies run for the measurements: cpu, cuda, cuda:N, or auto")
    kernel: str = _f("auto", "FP8 GEMM for the measurements: scaled_mm (Hopper, CUDA >= 12.9) and torchao "
                     "(SM >= 8.9) need a cuda device; auto: the fastest that runs there; the CPU emulates",
                     ("auto", "scaled_mm", "torchao", "emulate"))
    dataset: str | None = _f(None, "held-out LeRobot dataset: action MSE and layer output SQNR")
    samples: int = _f(64, "held-out frames used from quant.dataset", least=1)
    latency_repeats: int = _f(5, "timed repeats of each latency measurement", least=1)


@dataclass
class QuantEvalSection(EvalSection):
    n_episodes: int = _f(0, "episodes per task (0: skip the comparison)", least=0)
    videos: int = _f(0, "record the first K episodes per task", least=0)


@dataclass
class QuantizeCommand:
    """`kilovla quantize`: block-wise FP8 of a policy folder, with a report."""

    policy: PolicySection = _f(PolicySection(path=None), "")
    quant: QuantSection = _f(QuantSection(), "")
    env: EnvSection = _f(EnvSection(), "")
    eval: QuantEvalSection = _f(QuantEvalSection(), "the closed-loop comparison of both policies "
                                "(eval.n_episodes=0 skips it)")
    output_dir: str | None = _f(None, "the new folder for the quantized policy (must not exist)", path=True)

    HELP: typing.ClassVar[dict[str, str]] = {
        "policy.path": "the policy folder to quantize: a policy folder, a run folder or its checkpoints/latest (the "
                       "newest complete checkpoint)",
        "env.resolution": "camera pixels (default: the policy's training resolution, policy.json image_size; 96 for "
                          "folders that lack it)"}


@dataclass
class CollectSection:
    n_episodes: int = _f(10, "successful episodes kept per task", least=1)
    noise: float = _f(0.0, "std of Gaussian noise added to expert actions", least=0)
    labels: str = _f("executed", "with collect.noise, the action recorded: the noisy one executed, or the expert's "
                     "noise-free one for the state reached (DART)", ("executed", "expert"))
    seed: int = _f(0, "the collection stream's seed (disjoint from evaluation's)", least=0, below=MAX_SEED)
    batch_size: int = _f(4, "envs stepped together per task", least=1)
    workers: int = _f(0, "env processes (0: in this process)", least=0)
    overwrite: bool = _f(False, "replace output_dir if it holds a dataset")


@dataclass
class CollectCommand:
    """`kilovla collect`: scripted demonstrations -> a LeRobot v3.0 dataset."""

    env: EnvSection = _f(EnvSection(cameras="scene,wrist", resolution=96), "")
    collect: CollectSection = _f(CollectSection(), "")
    output_dir: str | None = _f(None, "the dataset folder to write", path=True)

    HELP: typing.ClassVar[dict[str, str]] = {"env.cameras": "comma-separated env cameras",
                                             "env.resolution": "camera pixels"}  # no policy: collect's own defaults


@dataclass
class ServeSection:
    host: str = _f("127.0.0.1", "address to listen on (beyond localhost, set serve.api_key)")
    port: int = _f(8000, "0: any free port (printed)")
    max_batch: int = _f(16, "most requests in one forward (1: no batching)", least=1)
    max_wait_ms: float = _f(5.0, "how long the oldest queued request waits for others before its batch runs",
                            least=0)
    api_key: str | None = _f(None, "require `Authorization: Api-Key KEY` (default: $KILOVLA_API_KEY)")
    max_message_mb: float | None = _f(None, "refuse larger frames (default: no cap)")
    layout: str = _f("auto", "observation keys clients send (auto: detected per request)",
                     ("auto", "lerobot", "libero", "droid"))
    map: list[str] = _f([], "REQUEST_KEY=POLICY_KEY maps a request key onto a policy key (repeatable), "
                        "e.g. observation/image=observation.images.scene")
    device: str = _f("auto", "cpu, cuda, cuda:N or auto")
    precision: str = _f("auto", "auto: bf16 on CUDA", ("auto", "fp32", "bf16"))
    cuda_graphs: bool = _f(True, "on CUDA, capture the denoising loop (false: run it eagerly)")


@dataclass
class ServeCommand:
    """`kilovla serve`: a policy folder over openpi's websocket protocol."""

    policy: PolicySection = _f(PolicySection(path=None), "")
    serve: ServeSection = _f(ServeSection(), "")

    HELP: typing.ClassVar[dict[str, str]] = {"policy.path": "the policy folder to serve: a policy folder, a run "
                                             "folder or its checkpoints/latest (the newest complete checkpoint)"}


SERVE_ALIASES = {
    "--policy": "policy.path", "--ema": "policy.ema", "--no-cuda-graphs": ("serve.cuda_graphs", False),
    **{f"--{k.replace('_', '-')}": f"serve.{k}" for k in ("host", "port", "max_batch", "max_wait_ms", "api_key",
                                                           "max_message_mb", "layout", "map", "device",
                                                           "precision")},
}
@dataclass
class ConvertPolicySection:
    path: str | None = _f(None, "the published folder: LeRobot SmolVLA's (config.json, model.safetensors, "
                          "policy_preprocessor.json / policy_postprocessor.json and their normalizer stats) or "
                          "Isaac-GR00T N1.7's (config.json, sharded model*.safetensors, processor_config.json, "
                          "statistics.json, embodiment_id.json)", path=True, required=True)
    tokenizer: str | None = _f(None, "the VLM's tokenizer.json or its folder: SmolVLM2's, or Cosmos-Reason2-2B's "
                               "for N1.7 (default: looked for in policy.path)", path=True)
    preset: str | None = _f(None, "the kilovla preset with the VLM's shapes (default: from config.json's "
                            "vlm_model_name: smolvla-base for HuggingFaceTB/SmolVLM2-500M-Video-Instruct; "
                            "model_name: groot-n17-3b for nvidia/Cosmos-Reason2-2B)")
    robot: str | None = _f(None, "the robot whose stats to take where the stats file keeps them per robot "
                           "(so100 of so100.buffer.action.mean; N1.7: the embodiment tag, libero_sim; default: "
                           "the only one)")


@dataclass
class ConvertPolicyCommand:
    """`kilovla convert-policy`: a LeRobot SmolVLA or Isaac-GR00T N1.7 folder -> a kilovla policy folder
    (lerobot_policy.py, nvidia_policy.py)."""

    policy: ConvertPolicySection = _f(ConvertPolicySection(), "")
    output_dir: str | None = _f(None, "the new kilovla policy folder (must not exist)", path=True, required=True)


CONVERT_POLICY_POSITIONAL = (("src", "policy.path"), ("dst", "output_dir"))


@dataclass
class DemoPolicySection:
    preset: str | None = _f(None, "the model preset (default: the recipe's, pi0-tiny)")
    overrides: dict = _f({}, "model config overrides merged into the recipe's for the preset (pi0-tiny's: a wide "
                         "action expert; other presets': none), as --policy.overrides.KEY=VALUE "
                         "(e.g. --policy.overrides.expert.width=128) or one JSON/YAML mapping")
    moe: dict = _f({}, "the action expert as a mixture of experts, train's --policy.moe.* (e.g. "
                   "--policy.moe.num_experts=4 --policy.moe.top_k=2): the same as --policy.overrides.moe.*")


@dataclass
class DemoCommand:
    """`kilovla demo`: its recipe (demo.py `DemoRecipe`), with these changes."""

    quick: bool = _f(False, "the minute-scale recipe (QUICK) instead of the full one")
    output_dir: str = _f("demo-output", "the demo's folder (an earlier demo's is replaced, nothing else)", path=True)
    seed: int | None = _f(None, "collection and training seed S, evaluation seed S+1 (default: the recipe's, 0)",
                          least=0, below=MAX_SEED - 1)
    policy: DemoPolicySection = _f(DemoPolicySection(), "")

    def recipe(self):
        from kilovla.demo import FULL, QUICK
        from kilovla.train.config import _merged

        recipe = QUICK if self.quick else FULL
        if self.policy.preset is not None:
            from kilovla.models.presets import check_preset

            check_preset(self.policy.preset, "--policy.preset")
            recipe = recipe.replace(preset=self.policy.preset)
        overrides = dict(self.policy.overrides)
        if self.policy.moe:  # train's dialect, written into the model overrides as train does
            overrides = _merged(overrides, {"moe": self.policy.moe})
        if overrides:  # over the recipe's model for its preset (the wide expert for pi0-tiny only)
            recipe = recipe.replace(model=_merged(recipe.preset_model(), overrides))
        if self.seed is not None:
            recipe = recipe.replace(collect_seed=self.seed, train_seed=self.seed, eval_seed=self.seed + 1)
        return recipe


# -- kilovla data ... ------------------------------------------------------------------------------------
@dataclass
class DatasetSection:
    root: str | None = _f(None, "the LeRobot dataset folder (with meta/info.json)", path=True, required=True)


@dataclass
class DataInfoCommand:
    """`kilovla data info`."""

    dataset: DatasetSection = _f(DatasetSection(), "")
    json: bool = _f(False, "print JSON instead of a table")


@dataclass
class DataValidateCommand:
    """`kilovla data validate`."""

    dataset: DatasetSection = _f(DatasetSection(), "")
    deep: bool = _f(False, "also decode every frame of every episode (at its timestamp), every camera")


@dataclass
class DataStatsCommand:
    """`kilovla data stats`."""

    dataset: DatasetSection = _f(DatasetSection(), "")
    dry_run: bool = _f(False, "print, do not write")


@dataclass
class DataConvertCommand:
    """`kilovla data convert`: v2.1 -> v3.0."""

    dataset: DatasetSection = _f(DatasetSection(), "")
    output_dir: str | None = _f(None, "the v3.0 dataset folder to write", path=True, required=True)
    overwrite: bool = _f(False, "replace output_dir if it holds a dataset")

    HELP: typing.ClassVar[dict[str, str]] = {"dataset.root": "the LeRobot v2.1 dataset folder to convert"}


@dataclass
class DataSynthCommand:
    """`kilovla data synth`: a synthetic v3.0 dataset (data/synthetic.py checks the values, naming the flag)."""

    output_dir: str | None = _f(None, "the dataset folder to write", path=True, required=True)
    episodes: int = _f(10, "episodes written")
    min_frames: int = _f(40, "the shortest episode's frames")
    max_frames: int = _f(80, "the longest episode's frames")
    fps: int = _f(10, "frames per second")
    cameras: str = _f("front,wrist", "comma-separated camera names")
    resolution: int = _f(96, "camera pixels (square)")
    codec: str = _f("libsvtav1", "video codec", ("libsvtav1", "libx264"))
    seed: int = _f(0, "the random stream's seed", least=0, below=MAX_SEED)
    overwrite: bool = _f(False, "replace output_dir if it holds a dataset")


@dataclass
class DataCacheCommand:
    """`kilovla data cache`: every video decoded once into a frame cache."""

    dataset: DatasetSection = _f(DatasetSection(), "")
    output_dir: str | None = _f(None, "cache folder (default: where loaders look by themselves, $KILOVLA_CACHE_DIR "
                                "or ~/.cache/kilovla, frames/<name>-<hash>)", path=True)
    ray_address: str | None = _f(None, "Ray cluster to decode on ('auto': the running one); default: RAY_ADDRESS, "
                                 "else a local Ray")
    local: bool = _f(False, "decode in this process, without Ray")
    cameras: str | None = _f(None, "comma-separated camera keys (default: all)")
    backend: str = _f("auto", "decoder; frames are bit-identical to what a loader with this backend decodes",
                      ("auto", "pyav", "torchcodec"))
    json: bool = _f(False, "print JSON instead of a table")


@dataclass
class DataBenchCommand:
    """`kilovla data bench`: the data suite on the user's dataset."""

    dataset: DatasetSection = _f(DatasetSection(), "")
    frame_cache: str | None = _f(None, "the dataset's frame cache for the cache rows (default: build one under "
                                 "output_dir/cache)", path=True)
    quick: bool = _f(False, "small sizes, for a smoke run")
    output_dir: str = _f("bench-results", "folder for data.json", path=True)
    world_size: int = _f(1024, "simulated ranks for the imbalance rows", least=1)

    HELP: typing.ClassVar[dict[str, str]] = {"dataset.root": "a LeRobot v3 dataset folder (with meta/info.json) to "
                                             "benchmark loading on"}


DATA_POSITIONAL = {"info": (("path", "dataset.root"),), "validate": (("path", "dataset.root"),),
                   "stats": (("path", "dataset.root"),), "convert": (("src", "dataset.root"), ("dst", "output_dir")),
                   "synth": (("dst", "output_dir"),), "cache": (("src", "dataset.root"),),
                   "bench": (("path", "dataset.root"),)}
DATA_ALIASES = {"stats": {"--dry-run": "dry_run"},
                "synth": {"--min-frames": "min_frames", "--max-frames": "max_frames"},
                "cache": {"--out": "output_dir", "--ray-address": "ray_address"},
                "bench": {"--cache": "frame_cache", "--out": "output_dir", "--world-size": "world_size"}}


# -- kilovla bench ------------------------------------------------------------------------------------
@dataclass
class BenchPolicySection:
    path: str | None = _f(None, "rl, fp8, serve: the policy folder to fine-tune / quantize / serve (default: the "
                          "demo's checkpoint; fp8 trains one with the demo's recipe when there is none)", path=True)


@dataclass
class BenchRLSection:
    minutes: float = _f(60.0, "wall-time cap of each RL run of the gain rows", least=0)
    env_steps: int = _f(120_000, "env-step budget of each RL run of the gain rows (bench.rl.GAIN_ENV_STEPS)",
                        least=1)
    only: str | None = _f(None, "just the closed-loop gain rows, or just the throughput rows",
                          ("gain", "throughput"))


@dataclass
class BenchFp8Section:
    dataset: str | None = _f(None, "held-out LeRobot data (default: fresh scripted episodes)", path=True)
    resolution: int | None = _f(None, "camera pixels of the held-out episodes and the closed loop (default: the "
                                "demo's)", least=1)
    episodes: int | None = _f(None, "closed-loop episodes per task (default: 50; 0 skips the comparison)", least=0)


@dataclass
class BenchCommand:
    """`kilovla bench SUITE`: measure, print a table, write output_dir/<suite>.json."""

    quick: bool = _f(False, "small sizes, for a smoke run")
    output_dir: str = _f("bench-results", "folder for <suite>.json", path=True)
    world_size: int = _f(1024, "data: simulated ranks for the imbalance rows", least=1)
    policy: BenchPolicySection = _f(BenchPolicySection(), "")
    rl: BenchRLSection = _f(BenchRLSection(), "")
    fp8: BenchFp8Section = _f(BenchFp8Section(), "")
    results: str | None = _f(None, "table: a <suite>.json or a folder of them", path=True)
    readme: str | None = _f(None, "table: write the tables into this README between its markers", path=True)


# The suites each key acts in ("all": every suite but table); a key given to another suite is refused.
BENCH_KEY_SUITES = {"quick": SUITES, "output_dir": SUITES, "world_size": ("data",),
                    "policy.": ("rl", "fp8", "serve"), "rl.": ("rl",), "fp8.": ("fp8",), "results": ("table",),
                    "readme": ("table",)}
BENCH_ALIASES = {"--out": "output_dir", "--world-size": "world_size", "--policy": "policy.path",
                 "--minutes": "rl.minutes", "--env-steps": "rl.env_steps", "--only": "rl.only",
                 "--dataset": "fp8.dataset", "--resolution": "fp8.resolution", "--episodes": "fp8.episodes"}


_ENV_ALIASES = {"--env": "env.type", "--tasks": "env.task", "--cameras": "env.cameras",
                "--resolution": "env.resolution", "--max-steps": "env.max_steps"}
QUANTIZE_ALIASES = {
    **_ENV_ALIASES, "--ema": "policy.ema", "--out": "output_dir", "--eval-episodes": "eval.n_episodes",
    "--batch-size": "eval.batch_size", "--workers": "eval.workers", "--seed": "eval.seed",
    **{f"--{k.replace('_', '-')}": f"quant.{k}" for k in ("block", "include", "exclude", "scope", "activations",
                                                           "dtype", "device", "kernel", "dataset", "samples",
                                                           "latency_repeats")},
}
COLLECT_ALIASES = {
    **_ENV_ALIASES, "--out": "output_dir", "--episodes-per-task": "collect.n_episodes", "--noise": "collect.noise",
    "--labels": "collect.labels", "--seed": "collect.seed", "--batch-size": "collect.batch_size",
    "--workers": "collect.workers", "--overwrite": "collect.overwrite",
}
EVAL_ALIASES = {
    "--policy": "policy.path", "--ema": "policy.ema", "--env": "env.type", "--tasks": "env.task",
    "--cameras": "env.cameras", "--resolution": "env.resolution", "--max-steps": "env.max_steps",
    "--episodes": "eval.n_episodes", "--batch-size": "eval.batch_size", "--seed": "eval.seed",
    "--n-action-steps": "eval.n_action_steps", "--workers": "eval.workers", "--videos": "eval.videos",
    "--allow-seen-seeds": "eval.allow_seen_seeds", "--out": "output_dir",
}


def take_positionals(args: argparse.Namespace, extra: list[str]) -> list[str]:
    """The command's positional paths, wherever they stand (`convert SRC --overwrite DST`: argparse gives
    DST back unparsed), in order into the positional keys not given by a flag (`convert --dataset.root=SRC
    DST`: DST is the output); returns `extra` less them."""
    pairs = getattr(args, "config_positional", ())
    values = [getattr(args, name) for name, _ in pairs if getattr(args, name) is not None]
    values += [item for item in extra if not item.startswith("-")]
    free = [name for name, key in pairs if PREFIX + key not in vars(args)]
    if not pairs or len(values) > len(free):  # more paths than places: left as they are, refused later
        return list(extra)
    for name, _ in pairs:
        setattr(args, name, None)
    for name, value in zip(free, values):
        setattr(args, name, value)
    return [item for item in extra if item.startswith("-")]


def given_keys(args: argparse.Namespace) -> dict[str, str]:
    """The keys given on the command line (dotted, by an alias or positionally) -> how each was typed."""
    spelt = getattr(args, "_spelt", {})
    keys = [name[len(PREFIX):] for name in vars(args) if name.startswith(PREFIX)]
    given = {key: typed(spelt, key, f"--{key}") for key in keys}
    given.update({key: f"{getattr(args, name)} (the positional {name})"
                  for name, key in args.config_positional if getattr(args, name) is not None})
    return given


def check_quantize_keys(args: argparse.Namespace) -> None:
    """quantize's env.* and eval.* keys (but eval.seed, the held-out comparison's too) set the closed-loop
    comparison: given while eval.n_episodes=0 skips it, they would do nothing."""
    if args.cfg.eval.n_episodes:
        return
    for key, shown in given_keys(args).items():
        if key.startswith(("env.", "eval.")) and key not in ("eval.n_episodes", "eval.seed"):
            raise KilovlaError(f"{shown}: a setting of the closed-loop comparison, which runs only with "
                               "--eval.n_episodes=N (N > 0)")


def check_bench_keys(args: argparse.Namespace) -> None:
    """A key given to a suite that does not read it (`--rl.minutes=5` to `bench data`): one line, as argparse
    would refuse an unknown flag, rather than a setting silently dropped. `rl.only` picks rows of rl alone."""
    for key, shown in given_keys(args).items():
        suites = next((s for k, s in BENCH_KEY_SUITES.items() if key == k or k.endswith(".") and key.startswith(k)),
                      None)
        if suites is None or args.suite in suites:
            continue
        if args.suite == "all" and "table" not in suites and key != "rl.only":
            continue
        raise KilovlaError(f"{shown}: a setting of bench {' / '.join(suites)}, not of bench {args.suite}")


# -- argparse ------------------------------------------------------------------------------------------
def _fields(cls, default, prefix: str = ""):
    """(dotted key, type hint, default value, field metadata) of every leaf field, in declaration order."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        value = getattr(default, f.name)
        if dataclasses.is_dataclass(hints[f.name]):
            yield from _fields(hints[f.name], value, f"{prefix}{f.name}.")
        else:
            yield f"{prefix}{f.name}", hints[f.name], value, f.metadata


def _hint_name(hint) -> str:
    args = [a for a in typing.get_args(hint) if a is not type(None)] or [hint]
    return "|".join(getattr(a, "__name__", str(a)) for a in args).upper()


def _note(namespace, dest: str, option_string: str, shown: str, value) -> None:
    """Remember what each spelling of `dest` gave, each time it was given (`check_spellings` refuses two
    values of one key, also the same flag typed twice)."""
    given = namespace.__dict__.setdefault("_spelt", {}).setdefault(dest, {})
    name, n = option_string, 1
    while name in given:
        n += 1
        name = f"{option_string}#{n}"
    given[name] = (shown, value)


def _plain(value):
    """A flag's value as YAML reads it, so that `--episodes 3` and `--eval.n_episodes=3` agree."""
    try:
        return yaml.safe_load(value) if isinstance(value, str) else value
    except yaml.YAMLError:
        return value


def check_spellings(args: argparse.Namespace) -> None:
    """Two spellings of one key (old and new, or the old positional) with different values: an error, not
    the last one silently winning."""
    spelt = {dest: dict(given) for dest, given in getattr(args, "_spelt", {}).items()}
    for name, key in getattr(args, "config_positional", ()):
        value = getattr(args, name, None)
        if value is not None:
            spelt.setdefault(PREFIX + key, {})[name] = (f"{value} (the positional {name})", value)
    for given in spelt.values():
        one_value(list(given.values()))


def one_value(given: list[tuple[str, object]]) -> None:
    """`given`: (as typed, value) of each spelling of one key; two values are refused in one line."""
    (shown, value), *rest = given
    for other, other_value in rest:
        if _plain(value) != _plain(other_value):
            raise KilovlaError(f"{shown} and {other} are one setting with two values; give one")


class _Key(argparse._StoreAction):
    """A dotted flag (`--eval.n_episodes=3`): stores its value and notes its spelling."""

    def __call__(self, parser, namespace, values, option_string=None):
        super().__call__(parser, namespace, values, option_string)
        _note(namespace, self.dest, option_string, f"{option_string}={values}", values)


class _Alias(argparse.Action):
    """A flag of the old dialect: sets its dotted key (a flag: to `const`; a list key: appends) and says
    the new spelling, once."""

    def __init__(self, option_strings, dest, key: str, flag: bool, append: bool = False, **kw):
        self.key, self.flag, self.append = key, flag, append
        super().__init__(option_strings, dest, nargs=0 if flag else None, **kw)

    def __call__(self, parser, namespace, values, option_string=None):
        if self.flag:
            values = self.const
        if self.append:  # a list key: every spelling's items add up
            values = [*getattr(namespace, self.dest, []), values]
        else:
            _note(namespace, self.dest, option_string, option_string if self.flag else f"{option_string} {values}",
                  values)
        setattr(namespace, self.dest, values)
        said = namespace.__dict__.setdefault("_aliases_said", set())
        if option_string not in said:
            said.add(option_string)
            new = f"--{self.key}" + ("" if self.const in (None, True) else f"={str(self.const).lower()}")
            sys.stderr.write(f"{option_string} is now {new}\n")


def add_config_flags(parser: argparse.ArgumentParser, cls, aliases: dict[str, str] | None = None,
                     positional: tuple[tuple[str, str], ...] = ()) -> None:
    """`--key` for every field of `cls`, grouped per section in `--help`; `aliases`: old flag -> key;
    `positional`: (name, key) of each positional argument, in order, that fills `key`."""
    groups: dict[str, argparse._ArgumentGroup] = {}
    meta = {}
    for key, hint, default, m in _fields(cls, cls()):
        meta[key] = (hint, m.get("choices"))
        section = key.split(".")[0] if "." in key else "options"
        if section not in groups:
            groups[section] = parser.add_argument_group(f"--{section}.*" if "." in key else "other options")
        help = getattr(cls, "HELP", {}).get(key, m.get("help", ""))  # a command's own wording of a shared field
        shown = "" if "default:" in help else f" (default: {default})"
        bare = dict(action=_Key, nargs="?", const="true") if hint is bool else dict(action=_Key)
        # (a bool flag alone, `--eval.allow_seen_seeds`: true)
        if typing.get_origin(hint) is list:
            bare = dict(action="append")  # repeatable; each value a YAML item or list
        groups[section].add_argument(f"--{key}", dest=PREFIX + key, default=argparse.SUPPRESS, **bare,
                                     choices=m.get("choices"), metavar=_hint_name(hint), help=help + shown)
    for flag, target in (aliases or {}).items():
        key, const = target if isinstance(target, tuple) else (target, True)
        hint, choices = meta[key]
        parser.add_argument(flag, dest=PREFIX + key, action=_Alias, key=key, flag=hint is bool, const=const,
                            append=typing.get_origin(hint) is list, choices=None if hint is bool else choices,
                            default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    for name, key in positional:
        parser.add_argument(name, nargs="?", default=None, help=f"the same as --{key}")
    if aliases:
        parser.epilog = "old flags still work: " + ", ".join(
            f"{a} = --{k[0]}={str(k[1]).lower()}" if isinstance(k, tuple) else f"{a} = --{k}" for a, k in aliases.items())
    parser.set_defaults(config_cls=cls, config_positional=positional)


def _value(raw, hint):
    """A flag's text as the field's value: strings stay strings where the field takes one, else YAML;
    a repeated list flag: its items, each a YAML item or list."""
    if isinstance(raw, list):
        items = [yaml.safe_load(r) if isinstance(r, str) and r.startswith("[") else r for r in raw]
        return [x for item in items for x in (item if isinstance(item, list) else [item])]
    if not isinstance(raw, str):
        return raw
    if hint is str or str in typing.get_args(hint):
        return raw
    try:
        return yaml.safe_load(raw) if raw else ""
    except yaml.YAMLError:
        return raw


def _dict_key(cls, key: str) -> bool:
    """`key` lies below a field that is a mapping (`policy.overrides.expert.width`)."""
    fields = {k: h for k, h, _, _ in _fields(cls, cls())}
    parts = key.split(".")
    return any(fields.get(".".join(parts[:i])) is dict for i in range(1, len(parts)))


def config_from(args: argparse.Namespace, extra: list[str] = ()):
    """The command's config: its defaults, then every key given (dotted or by an alias), type-checked.
    `extra` (what argparse did not know): keys below a mapping field; any other gets did-you-mean."""
    cls = args.config_cls
    hints = {key: hint for key, hint, _, _ in _fields(cls, cls())}
    data = to_dict(cls())
    for name, key in getattr(args, "config_positional", ()):
        if getattr(args, name) is not None:
            set_dotted(data, key, getattr(args, name))
    for name, raw in vars(args).items():
        if name.startswith(PREFIX):
            key = name[len(PREFIX):]
            set_dotted(data, key, _value(raw, hints[key]))
    for item in extra:
        if not item.startswith("--"):
            raise KilovlaError(f"unexpected arguments {list(extra)}; flags look like --section.key=value")
        key = item[2:].split("=", 1)[0]
        if not _dict_key(cls, key) or "=" not in item:
            raise _unknown(cls, key)
        set_dotted(data, *parse_override(item))
    try:
        cfg = from_dict(cls, data)
    except KilovlaError as e:
        raise _as_typed(e, args) from None
    _check_values(cls, cfg, getattr(args, "_spelt", {}), dict(getattr(args, "config_positional", ())))
    return cfg


def _as_typed(error: KilovlaError, args: argparse.Namespace) -> KilovlaError:
    """A bad value given by an old flag (`--episodes abc`): its error names the flag as typed, not the key."""
    said = getattr(args, "_aliases_said", ())
    for dest, given in getattr(args, "_spelt", {}).items():
        head = f"config key {dest[len(PREFIX):]!r}: "
        typed = [shown for flag, (shown, _) in given.items() if flag in said]
        if typed and str(error).startswith(head):
            return KilovlaError(f"{typed[0]}: {str(error)[len(head):]}")
    return error


def _check_values(cls, cfg, spelt: dict, positional: dict[str, str]) -> None:
    """A number below its field's `least` (`--eval.videos=-1`) or not under its `below` (a seed of 10 digits),
    an empty path (`--output_dir=`) or a required key not given: one line naming the flag as it was typed."""
    by_key = {key: name for name, key in positional.items()}
    for key, _, value, meta in _fields(cls, cfg):
        least, below = meta.get("least"), meta.get("below")
        if meta.get("required") and value is None:
            also = f" (or the positional {by_key[key]})" if key in by_key else ""
            raise KilovlaError(f"give --{key}{also}: {getattr(cls, 'HELP', {}).get(key, meta['help'])}")
        shown = typed(spelt, key, f"--{key}={value}")
        if meta.get("path") and value == "":
            raise KilovlaError(f"{shown}: an empty path; give a file or folder")
        if value is None or (least is None or value >= least) and (below is None or value < below):
            continue
        raise KilovlaError(f"{shown}: must be >= {least}" if below is None else
                           f"{shown}: must be an integer in [{least}, {below})")


def typed(spelt: dict, key: str, default: str) -> str:
    """How the user typed `key` (`--episodes 3`, `--eval.n_episodes=3`): for messages."""
    return next(iter(spelt.get(PREFIX + key, {}).values()), (default,))[0]


DEMO_ALIASES = {"--out": "output_dir"}


# `kilovla train`'s dotted keys that are spelt differently in TrainConfig (the YAML keeps the config's).
TRAIN_KEYS = {"policy.path": "policy.init_from"}


def train_overrides(overrides: list[str]) -> list[str]:
    """`kilovla train` overrides as TrainConfig keys: `--policy.path=DIR` (LeRobot's spelling of the
    starting weights) is `--policy.init_from=DIR`; `--policy.init_from` itself stays, the config's own key
    (YAML files spell it so), without a notice."""
    from kilovla.train.config import TrainConfig

    keys = _all_keys(TrainConfig)
    out = []
    for item in overrides:
        key, sep, value = item.removeprefix("--").partition("=")
        known = key in keys or key in TRAIN_KEYS or any(k.startswith(key + ".") for k in keys)
        if not known and not _dict_key(TrainConfig, key):  # did-you-mean that knows policy.path too
            raise _unknown(TrainConfig, key, also=tuple(TRAIN_KEYS))
        out.append(f"--{TRAIN_KEYS[key]}{sep}{value}" if key in TRAIN_KEYS else item)
    given_once(overrides, TRAIN_KEYS)
    return out


def given_once(overrides: list[str], renamed: dict[str, str] | None = None) -> None:
    """`--key=value` overrides: one key given twice (or by two spellings, `renamed`: spelling -> key) with
    two values is refused in one line, not the last silently winning."""
    spelt: dict[str, list] = {}
    for item in overrides:
        key, _, value = item.removeprefix("--").partition("=")
        spelt.setdefault((renamed or {}).get(key, key), []).append((item, value))
    for given in spelt.values():
        one_value(given)


@functools.cache  # fields_help asks once per field; the source is read once per class
def _comments(cls) -> dict[str, str]:
    """`name: type = default  # comment`: the comment of each field declared in `cls` or a base, from source."""
    import inspect
    import re

    found: dict[str, str] = {}
    for owner in reversed(cls.__mro__[:-1]):
        try:
            lines = inspect.getsource(owner).splitlines()
        except (OSError, TypeError):
            continue
        for line in lines:
            m = re.match(r"\s+(\w+):[^#]*?#\s*(.+)$", line)
            if m:
                found[m.group(1)] = m.group(2)
    return found


def fields_help(cls, shown: dict[str, str] | None = None, skip: tuple[str, ...] = (), defaults=None) -> str:
    """`--help`'s listing of a config dataclass's dotted keys per section, with type, default and the field's
    comment; `shown`: key -> how the command spells it, `skip`: keys the command takes as its own flags,
    `defaults`: the instance whose values are shown (default `cls()`)."""
    spelling = {key: flag for flag, key in (shown or {}).items()}
    groups: dict[str, list[str]] = {}
    for key, hint, default, meta in _fields(cls, cls() if defaults is None else defaults):
        if key in skip:
            continue
        *path, name = key.split(".")
        owner = cls
        for part in path:
            owner = typing.get_type_hints(owner)[part]
        note = meta.get("help") or _comments(owner).get(name, "")
        flag = f"--{spelling[key]}, --{key}" if key in spelling else f"--{key}"
        kind = "LIST" if typing.get_origin(hint) is list else _hint_name(hint)
        line = f"  {flag}={kind} (default: {default!r})" + (f"  {note}" if note else "")
        groups.setdefault(f"--{path[0]}.*" if path else "other options", []).append(line)
    return "\n\n".join(f"{title}:\n" + "\n".join(lines) for title, lines in groups.items())
