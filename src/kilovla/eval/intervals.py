"""Confidence intervals for success rates.

`wilson_interval(successes, n)` is the Wilson score interval: unlike the normal approximation
p +- z sqrt(p(1-p)/n) it stays inside [0, 1] and does not collapse to a point at 0 or n successes,
which is where closed-loop success rates over 10-50 episodes usually sit.

>>> wilson_interval(20, 20)
(0.8388..., 1.0)
>>> wilson_interval(10, 20)
(0.2992..., 0.7007...)
"""

from __future__ import annotations

import math

from kilovla.errors import KilovlaError

Z_95 = 1.959963984540054  # the 97.5 % quantile of the standard normal


def wilson_interval(successes: int, n: int, z: float = Z_95) -> tuple[float, float]:
    """The Wilson score interval (low, high) of a binomial rate; z = 1.96 gives 95 %."""
    if n < 1 or not 0 <= successes <= n:
        raise KilovlaError(f"a success interval needs 0 <= successes <= n and n >= 1, got {successes} of {n}")
    p = successes / n
    z2 = z * z
    centre = (p + z2 / (2 * n)) / (1 + z2 / n)
    half = z / (1 + z2 / n) * math.sqrt(p * (1 - p) / n + z2 / (4 * n * n))
    # At 0 or n successes one bound is exactly 0 or 1; say so instead of leaving rounding residue.
    low = 0.0 if successes == 0 else max(0.0, centre - half)
    high = 1.0 if successes == n else min(1.0, centre + half)
    return low, high
