"""Policy folders written by older code still load, evaluate and serve with the same actions.

tests/fixtures/legacy_a039621/ holds folders written by commit a039621's code
(benchmarks/make_legacy_fixtures.py; its README.md says how): a `kilovla demo` checkpoint (weights and
EMA), a residual-SAC `kilovla rl` folder and a `kilovla quantize` FP8 folder, with the actions that code
gave for a stored observation batch and flow noise. Here the code of this checkout loads each folder as
eval does (`closed_loop.load_policy`) and as serve does (`PolicyEngine`) and must give those actions.

Bit for bit where the numbers can repeat exactly: the same torch version on the same CPU kernels
(`torch.backends.cpu.get_cpu_capability()`), one thread, as recorded in expected_actions.npz. Elsewhere
another kernel or reduction order moves float32 results by ~1e-7 relative, so they must agree to
atol 1e-5 (actions ~1 in size; the perturbation test below moves them by > 1e-3).
"""

import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

FIXTURES = Path(__file__).parent / "fixtures" / "legacy_a039621"
# name in expected_actions.npz -> (folder, EMA weights)
CASES = {"demo_checkpoint": ("demo_checkpoint", False), "demo_checkpoint_ema": ("demo_checkpoint", True),
         "rl_residual_sac": ("rl_residual_sac", False), "fp8": ("fp8", False)}
ATOL = 1e-5


@pytest.fixture(scope="module")
def expected():
    return dict(np.load(FIXTURES / "expected_actions.npz"))


@pytest.fixture(autouse=True)
def one_thread():
    """The recorded numbers were computed on one thread: one reduction order."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _observation(expected) -> dict:
    obs = {k.removeprefix("obs/"): v for k, v in expected.items() if k.startswith("obs/")}
    return obs | {"task": [str(t) for t in expected["task"]]}


def _direct(folder: Path, ema: bool, obs: dict, noise: np.ndarray) -> np.ndarray:
    from kilovla.eval.closed_loop import load_policy

    policy = load_policy(str(folder), ema=ema)
    batch = policy.processor.observation_batch(obs)
    with torch.no_grad():
        actions = policy.model.sample_actions(batch, torch.from_numpy(noise))
    return policy.processor.unnormalize_actions(actions.float().numpy())


def _served(folder: Path, ema: bool, obs: dict, noise: np.ndarray) -> np.ndarray:
    from kilovla.serve.engine import PolicyEngine, Request

    engine = PolicyEngine.load(folder, device="cpu", ema=ema, precision="fp32")
    requests = [Request({k: v[i] for k, v in obs.items()}, noise=noise[i]) for i in range(len(obs["task"]))]
    chunks, _ = engine.infer(requests)
    return np.stack(chunks)


def _assert_same_actions(got: np.ndarray, want: np.ndarray, expected: dict, what: str) -> None:
    same_kernels = (str(expected["meta/torch"]) == torch.__version__
                    and str(expected["meta/cpu_capability"]) == torch.backends.cpu.get_cpu_capability())
    assert got.shape == want.shape, (what, got.shape, want.shape)
    diff = float(np.abs(got.astype(np.float64) - want).max())
    if same_kernels:
        assert np.array_equal(got, want), f"{what}: differs from the recorded actions by up to {diff:.3g}"
    else:
        np.testing.assert_allclose(got, want, rtol=0, atol=ATOL, err_msg=what)


@pytest.mark.parametrize("name", list(CASES))
def test_a_legacy_folder_evaluates_with_the_actions_it_was_written_with(name, expected):
    folder, ema = CASES[name]
    got = _direct(FIXTURES / folder, ema, _observation(expected), expected["noise"])
    _assert_same_actions(got, expected[f"{name}/direct"], expected, f"{name} (eval's loader)")


@pytest.mark.parametrize("name", list(CASES))
def test_a_legacy_folder_is_served_with_the_actions_it_was_written_with(name, expected):
    folder, ema = CASES[name]
    got = _served(FIXTURES / folder, ema, _observation(expected), expected["noise"])
    _assert_same_actions(got, expected[f"{name}/served"], expected, f"{name} (serve's engine)")


def test_the_recorded_folders_act_differently_from_each_other(expected):
    # the EMA, the residual and FP8 each change the actions: a loader that ignored one of them would fail above
    plain = expected["demo_checkpoint/direct"]
    for name in ("demo_checkpoint_ema", "rl_residual_sac", "fp8"):
        assert np.abs(expected[f"{name}/direct"] - plain).max() > 1e-3, name


def test_one_perturbed_weight_changes_the_actions_past_the_tolerance(expected, tmp_path):
    # the comparison is not vacuous: 1e-3 on one output bias moves that action past ATOL
    from safetensors.torch import load_file, save_file

    folder = tmp_path / "demo_checkpoint"
    shutil.copytree(FIXTURES / "demo_checkpoint", folder)
    weights = load_file(folder / "model.safetensors")
    weights["action_out_proj.bias"][0] += 1e-3
    save_file(weights, folder / "model.safetensors")
    got = _direct(folder, False, _observation(expected), expected["noise"])
    assert np.abs(got - expected["demo_checkpoint/direct"]).max() > 10 * ATOL


@pytest.mark.parametrize("folder, label", [("demo_checkpoint", "pi0-tiny"), ("fp8", "pi0-tiny FP8 W8A8"),
                                           ("rl_residual_sac", "pi0-tiny + residual_sac residual")])
def test_reports_and_the_serve_banner_name_what_a_folder_holds(folder, label):
    """Not only its preset: an FP8 or RL folder said "pi0-tiny" in eval reports and serve's banner."""
    from kilovla.policy_folder import PolicyFolder
    from kilovla.serve.engine import PolicyEngine

    assert PolicyFolder.open(FIXTURES / folder).label == label
    engine = PolicyEngine.load(FIXTURES / folder, device="cpu")
    assert (engine.policy.name, engine.metadata()["policy"], engine.metadata()["model"]) == (label, label, "pi0-tiny")
