"""The RL algorithms `learner.algo.name` picks from; each module owns one, as a subclass of `Algorithm`:

    name          module             trains                                 checkpoint weights (+ replay)
    ppo           rl/ppo.py          the VLA and a value head (PPO or AWR)  model, value_head
    residual_sac  rl/sac.py          a residual actor and twin critics      residual, critic, replay
                                     over the frozen VLA
    filtered_bc   rl/filtered_bc.py  the VLA, on its own successes          model, value_head, replay

The runner asks the algorithm of a run (`algorithm(cfg.learner.algo.name)`) to check its settings and the
folder it starts or resumes from, for its warm-up, its agent (what the inference server acts with) and its
learner; env workers, the batcher, the buffer, weight sync and checkpoints are the same for all. A fourth
algorithm: a module with its config dataclass (nested in rl/config.py's `AlgoConfig`), its learner and an
`Algorithm` subclass, and one line in `registry` below.
"""

from __future__ import annotations

import functools

from kilovla.errors import KilovlaError
from kilovla.rl.algorithm import Algorithm
from kilovla.rl.filtered_bc import FilteredBC
from kilovla.rl.ppo import PPO
from kilovla.rl.sac import ResidualSAC


@functools.cache
def registry() -> dict[str, Algorithm]:
    return {a.name: a for a in (PPO(), ResidualSAC(), FilteredBC())}


def algorithm(name: str) -> Algorithm:
    """The algorithm of `learner.algo.name`; an unknown name in one line."""
    known = registry()
    if name not in known:
        raise KilovlaError(f"learner.algo.name must be one of {', '.join(known)}, not {name!r}")
    return known[name]
