"""Simulators behind the gymnasium API, with LeRobot feature names.

Observations are dicts: ``observation.images.<camera>`` (uint8 HWC), ``observation.state``
(proprioception), ``observation.environment_state`` (object and goal positions, where the task needs
them) and ``task`` (the instruction). ``info["is_success"]`` says whether the task is solved.

MuJoCo picks its GL backend at import: headless EGL unless MUJOCO_GL says otherwise
(``MUJOCO_GL=osmesa`` also works on CPU-only machines).
"""

from __future__ import annotations

import os

os.environ.setdefault("MUJOCO_GL", "egl")
os.environ.setdefault("PYOPENGL_PLATFORM", os.environ["MUJOCO_GL"])

from kilovla.envs.base import ENV_NAMES, EnvSpec, EnvType, env_spec, env_type, make_env  # noqa: E402

__all__ = ["ENV_NAMES", "EnvSpec", "EnvType", "env_spec", "env_type", "make_env"]
