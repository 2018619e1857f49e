"""Write the legacy-folder fixtures of tests/test_legacy_folders.py: small folders written by one commit's
code, and the actions that code gives for them, so that later code can be checked to load, evaluate and
serve them with the same actions.

    PYTHONPATH=<checkout of the commit>/src python benchmarks/make_legacy_fixtures.py OUT

OUT (which must not exist) gets:

    demo_checkpoint/   the policy folder of a `kilovla demo` run (its own functions: scripted Meta-World
                       collection, then `train` with the demo's flags), shrunk: 2 tasks x 2 episodes at 32 px,
                       a narrower pi0-tiny, 4 steps; EMA on (ema.safetensors)
    rl_residual_sac/   the policy folder of one residual-SAC `kilovla rl` run (Ray in-process, sync mode, 2
                       versions) from demo_checkpoint; the residual's mean layer is then set to seeded non-zero
                       values (a 2-version run leaves the actor near its zero init: its folder acts almost like
                       its base)
    fp8/               `kilovla quantize demo_checkpoint --eval-episodes 0`
    expected_actions.npz  a seeded observation batch, explicit flow noise, and per folder the actions of
                       the loader eval uses (`closed_loop.load_policy` + `model.sample_actions(batch, noise)`)
                       and of serve's engine (`PolicyEngine.infer`, one batched call, the same noise)
    README.md          what each folder is, which commit wrote it, the command

Only the files a policy folder is loaded from are kept (no optimizer state, replay buffer or learner.pt),
so the fixtures stay ~1 MB. Every action is computed twice in one run and must agree bit for bit.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

TASKS = ("reach-v3", "push-v3")
BATCH = 3
OBS_SEED, NOISE_SEED, RESIDUAL_SEED = 20240, 7, 11
# the loadable part of each folder; the rest (optimizer state, replay, learner.pt, rl_state.json, ...) resumes
# a run, which these fixtures do not test
DEMO_FILES = ("policy.json", "model.safetensors", "ema.safetensors")
RL_FILES = ("policy.json", "model.safetensors", "residual.safetensors", "critic.safetensors")
# name -> (folder, ema)
CASES = {"demo_checkpoint": ("demo_checkpoint", False), "demo_checkpoint_ema": ("demo_checkpoint", True),
         "rl_residual_sac": ("rl_residual_sac", False), "fp8": ("fp8", False)}


def demo_recipe():
    """The demo's recipe shrunk to seconds and ~100 KB of weights."""
    from kilovla.demo import DemoRecipe

    small = {"expert": {"width": 32, "mlp_dim": 48}, "lm": {"mlp_dim": 48}, "vision": {"width": 16, "mlp_dim": 32}}
    # ema_decay 0.5: 4 steps at the demo's 0.995 would leave the EMA at the initial weights
    return DemoRecipe(tasks=TASKS, episodes_per_task=2, resolution=32, frame_cache=False, model=small, chunk_size=4,
                      n_action_steps=4, train_steps=4, batch_tokens=2000, warmup_steps=1, ema_decay=0.5,
                      eval_episodes=0, workers=0)


def make_demo_checkpoint(work: Path, out: Path) -> Path:
    """`kilovla demo`'s collect and train stages with the shrunk recipe; its checkpoint's loadable files."""
    from kilovla import demo

    recipe = demo_recipe()
    demo.collect_demonstrations(recipe, work / "dataset")
    result = demo.train_policy(recipe, work / "dataset", work / "run", progress=False)
    return _keep(Path(result["checkpoint"]), out / "demo_checkpoint", DEMO_FILES)


def make_rl_folder(policy: Path, work: Path, out: Path) -> tuple[Path, tuple[float, float]]:
    """One residual-SAC run (the tiny settings of tests/test_rl.py), then a seeded non-zero residual; also the
    largest |weight| and |bias| of the mean layer as the run left it."""
    import ray

    from kilovla.models.checkpoints import read_safetensors, save_safetensors
    from kilovla.policy_folder import load_policy_folder
    from kilovla.rl import runner

    cfg = runner.load(None, [
        f"--run_dir={work / 'rl'}", f"--policy={policy}", "--mode=sync", "--steps=2", "--checkpoint.every=2",
        "--env.tasks=[reach-v3]", "--env.workers=1", "--env.envs_per_worker=2", "--env.resolution=32",
        "--env.max_steps=30", "--rollout.segment_steps=3", "--learner.batch_segments=2", "--eval.episodes=0",
        "--progress=false", "--learner.algo.name=residual_sac", "--learner.algo.sac.warmup_transitions=8",
        "--learner.algo.sac.batch_size=8", "--learner.algo.sac.critic_warmup_updates=2", "--learner.algo.sac.utd=1",
        "--learner.algo.sac.hidden=16", "--learner.algo.sac.res_scale=0.3"])
    ray.init(num_cpus=2, include_dashboard=False, logging_level="ERROR")
    try:
        summary = runner.run(cfg)
    finally:
        ray.shutdown()
    folder = _keep(Path(summary["checkpoint"]), out / "rl_residual_sac", RL_FILES)
    # A 2-version run barely moves the actor's zero-initialised mean layer (~2e-4: a correction too small
    # for a test to tell a loader that drops the residual from one that applies it). Seeded non-zero
    # values, written back with the library's save_safetensors in the runner's layout (the actor's state
    # dict, "actor." stripped), make the residual's part of the actions visible.
    actor = load_policy_folder(folder).model.actor
    trained = float(actor.mean.weight.abs().max()), float(actor.mean.bias.abs().max())
    g = torch.Generator().manual_seed(RESIDUAL_SEED)
    with torch.no_grad():
        actor.mean.weight.copy_(torch.randn(actor.mean.weight.shape, generator=g) * 0.2)
        actor.mean.bias.copy_(torch.randn(actor.mean.bias.shape, generator=g) * 0.5)
    written = read_safetensors(folder / "residual.safetensors")
    state = actor.state_dict()
    assert set(written) == set(state), (sorted(written), sorted(state))
    save_safetensors({k: v.detach().clone().contiguous() for k, v in state.items()}, folder / "residual.safetensors")
    return folder, trained


def make_fp8(policy: Path, out: Path) -> Path:
    from kilovla.cli import main

    rc = main(["quantize", str(policy), "--out", str(out / "fp8"), "--eval-episodes", "0", "--latency-repeats", "1"])
    assert rc == 0, rc
    return out / "fp8"


def observation(policy, batch: int = BATCH, seed: int = OBS_SEED) -> dict:
    """A seeded observation batch in the policy's own keys: uint8 HWC images at its image size, states of its
    stats' widths, one prompt per row."""
    rng = np.random.default_rng(seed)
    size = policy.model.config.vision.image_size
    obs = {cam: rng.integers(0, 256, (batch, size, size, 3), dtype=np.uint8) for cam in policy.meta.camera_map}
    for key in policy.meta.state_keys:
        stats = policy.meta.stats[key]
        width = len(stats["q01"] if "q01" in stats else stats["mean"])
        obs[key] = rng.normal(size=(batch, width)).astype(np.float32)
    obs["task"] = ["reach the goal", "push the puck to the goal", "reach the goal"][:batch]
    return obs


def horizon_width(policy) -> tuple[int, int]:
    cfg = policy.model.config
    return int(getattr(cfg, "chunk_size", None) or cfg.action_horizon), int(cfg.max_action_dim)


def direct_actions(folder: Path, ema: bool, obs: dict, noise: np.ndarray) -> np.ndarray:
    """What eval runs: the loader of `kilovla eval --policy FOLDER`, then the policy's sampler with given noise."""
    from kilovla.eval.closed_loop import load_policy

    policy = load_policy(str(folder), ema=ema)
    batch = policy.processor.observation_batch(obs)
    with torch.no_grad():
        actions = policy.model.sample_actions(batch, torch.from_numpy(noise))
    return policy.processor.unnormalize_actions(actions.float().numpy())


def served_actions(folder: Path, ema: bool, obs: dict, noise: np.ndarray) -> np.ndarray:
    """What `kilovla serve` answers: its engine, fp32 on the CPU, the batch as one call, each request's noise given."""
    from kilovla.serve.engine import PolicyEngine, Request

    engine = PolicyEngine.load(folder, device="cpu", ema=ema, precision="fp32")
    requests = [Request({k: v[i] for k, v in obs.items()}, noise=noise[i])
                for i in range(len(obs["task"]))]
    chunks, _ = engine.infer(requests)
    return np.stack(chunks)


def _keep(src: Path, dst: Path, names) -> Path:
    dst.mkdir(parents=True)
    for name in names:
        shutil.copy2(src / name, dst / name)
    return dst


def _commit() -> str:
    """The last commit that changed the src/ the fixtures were written with (not HEAD: the commit that adds
    the fixtures changes no code), '+modified' where src/ differs from it."""
    import kilovla

    root = Path(kilovla.__file__).resolve().parents[2]
    try:
        git = ["git", "-C", str(root)]
        commit = subprocess.run([*git, "log", "-1", "--format=%H", "--", "src"], capture_output=True, text=True,
                                check=True).stdout.strip()
        modified = subprocess.run([*git, "status", "--porcelain", "--", "src"], capture_output=True, text=True,
                                  check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return commit + ("+modified" if modified else "")


def record(out: Path) -> dict:
    from kilovla.eval.closed_loop import load_policy

    policy = load_policy(str(out / "demo_checkpoint"))
    obs = observation(policy)
    h, w = horizon_width(policy)
    noise = torch.randn(BATCH, h, w, generator=torch.Generator().manual_seed(NOISE_SEED)).numpy()
    # where the numbers were made: the same torch on the same CPU kernels (one thread) repeats them bit for bit
    arrays = {"noise": noise, "task": np.array(obs["task"]), "meta/torch": np.array(torch.__version__),
              "meta/cpu_capability": np.array(torch.backends.cpu.get_cpu_capability())}
    arrays |= {f"obs/{k}": v for k, v in obs.items() if k != "task"}
    for name, (folder, ema) in CASES.items():
        for path, fn in (("direct", direct_actions), ("served", served_actions)):
            a, b = fn(out / folder, ema, obs, noise), fn(out / folder, ema, obs, noise)
            assert np.array_equal(a, b), f"{name} {path}: two runs differ by {np.abs(a - b).max()}"
            arrays[f"{name}/{path}"] = a
    base = arrays["demo_checkpoint/direct"]
    for name in ("demo_checkpoint_ema", "fp8"):
        assert np.abs(arrays[f"{name}/direct"] - base).max() > 1e-4, f"{name} acts like the plain checkpoint"
    np.savez(out / "expected_actions.npz", **arrays)
    return {k: float(np.abs(v).mean()) for k, v in arrays.items() if k.endswith(("direct", "served"))}


def rl_base_difference(out: Path, obs_noise) -> float:
    """How far the RL folder's actions are from its base's alone (the residual acts)."""
    from kilovla.eval.closed_loop import load_policy

    obs, noise = obs_noise
    policy = load_policy(str(out / "rl_residual_sac"))
    batch = policy.processor.observation_batch(obs)
    with torch.no_grad():
        full = policy.model.sample_actions(batch, torch.from_numpy(noise))
        base = policy.model.base.sample_actions(batch, torch.from_numpy(noise))
    return float((full - base).abs().max())


README = """# Legacy policy folders written by {commit_short}

Written by `benchmarks/make_legacy_fixtures.py` with the code (src/) of commit
{commit} (kilovla main before issue 40's refactor),
so tests/test_legacy_folders.py can check that later code still loads, evaluates and serves folders
written then, with the same actions. From a checkout that has the script:

    git worktree add /tmp/legacy {commit_short}
    PYTHONPATH=/tmp/legacy/src python benchmarks/make_legacy_fixtures.py OUT

(torch {torch}, CPU, one thread.) Of the training and RL checkpoints only the files a policy folder is
loaded from were kept (no optimizer state, replay buffer, learner.pt).

- `demo_checkpoint/`: the checkpoint folder of a `kilovla demo` run shrunk to seconds (the demo's own
  collect and train functions: scripted Meta-World {tasks}, 2 episodes each at 32 px; pi0-tiny with a
  narrower vision tower, MLPs and action expert; chunks of 4; 4 steps; EMA decay 0.5): policy.json
  (preset, overrides, cameras, state keys, normalisation stats), model.safetensors, ema.safetensors.
- `rl_residual_sac/`: the final policy folder of one residual-SAC `kilovla rl` run (sync mode, 2 versions,
  reach-v3, Ray in-process) from demo_checkpoint: policy.json with its `residual` entry,
  model.safetensors (the base), residual.safetensors, critic.safetensors. Its residual's mean layer was
  then set to seeded non-zero values, written with the library's save_safetensors: the run left it
  near its zero init (largest |weight|, |bias| {trained[0]:.2g}, {trained[1]:.2g}), acting almost like its base;
  now its actions differ from the base's by up to {rl_moves:.3f} (normalised units).
- `fp8/`: `kilovla quantize demo_checkpoint --out fp8 --eval-episodes 0 --latency-repeats 1` (block-wise
  FP8 of the language model and action expert, W8A8 1x128, the rest bfloat16): quantize's whole output,
  its report (quant_report.json, .md) included.
- `expected_actions.npz`: `obs/<key>` (a seeded batch of {batch} observations in the policy's keys), `task`,
  `noise` (the flow noise, batch x horizon x max_action_dim), and for each of demo_checkpoint,
  demo_checkpoint_ema (its EMA weights), rl_residual_sac and fp8: `<name>/direct` (eval's loader,
  `closed_loop.load_policy`, then `model.sample_actions(batch, noise)`, unnormalised) and `<name>/served`
  (`serve.engine.PolicyEngine.load(..., precision="fp32").infer`, the batch in one call, the same noise);
  `meta/torch` and `meta/cpu_capability`: where they were computed (the same pair repeats them bit for bit).
"""


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    args = parser.parse_args(argv)
    out: Path = args.out
    if out.exists():
        sys.exit(f"error: {out} exists; give a new folder")
    torch.set_num_threads(1)  # one reduction order, and little CPU
    out.mkdir(parents=True)
    with tempfile.TemporaryDirectory(prefix="legacy-fixtures-") as tmp:
        work = Path(tmp)
        demo_dir = make_demo_checkpoint(work, out)
        _, trained = make_rl_folder(demo_dir, work, out)
        make_fp8(demo_dir, out)
    means = record(out)
    data = np.load(out / "expected_actions.npz")
    obs = {k.removeprefix("obs/"): data[k] for k in data.files if k.startswith("obs/")} | {"task": list(data["task"])}
    moves = rl_base_difference(out, (obs, data["noise"]))
    assert moves > 1e-3, f"the residual does not act ({moves})"
    commit = _commit()
    (out / "README.md").write_text(README.format(commit=commit, commit_short=commit[:7], torch=torch.__version__,
                                                 tasks=", ".join(TASKS), rl_moves=moves, trained=trained, batch=BATCH))
    print(json.dumps({"commit": commit, "rl_residual_moves": moves, "rl_mean_layer_after_run_max_abs": trained,
                      "mean_abs_actions": means}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
