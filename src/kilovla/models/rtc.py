"""Real-time chunking (Black, Galliker, Levine 2025), guided mode, as LeRobot implements it for pi0 / pi0.5,
for every family: each answers `velocity_field` in openpi's time convention (GR00T's flow, whose time runs
the other way, converts in its own; its Euler steps land on the same times as its `sample_actions`).

While a robot executes the rest of its last chunk, the next chunk is sampled so that it continues it:
each Euler step of the flow pulls the predicted clean chunk x0 = x_t - t v(x_t) towards the given
prefix (the previous chunk's unexecuted actions, normalised) with a vector-Jacobian product,

    err = (prefix - x0) * W                     # W: 1 on the first `inference_delay` positions (they
    v  <- v - min(beta, c / r^2) * (dx0/dx_t)^T err   # execute before the new chunk arrives), decaying
                                                # to 0 at `execution_horizon`, 0 where there is no prefix

with tau = 1 - t, c = (1 - tau) / tau, 1/r^2 = ((1 - tau)^2 + tau^2) / (1 - tau)^2 and beta the maximum
guidance weight. Rows whose W is all zero are sampled exactly as `sample_actions` samples them, so
requests with and without RTC can share a batch. The prefix keys and values are computed once
(`velocity_field`); only the action expert is differentiated, and only when some row asks for RTC.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from kilovla.errors import KilovlaError

SCHEDULES = ("zeros", "ones", "linear", "exp")


def prefix_weights(horizon: int, inference_delay: int, execution_horizon: int, prefix_len: int,
                   schedule: str = "linear") -> np.ndarray:
    """(horizon,) guidance weights: 1 up to `inference_delay`, then `schedule` down to 0 at
    `execution_horizon`, and 0 past the prefix.

    prefix_weights(6, 1, 4, 5) -> [1, 2/3, 1/3, 0, 0, 0]
    """
    if schedule not in SCHEDULES:
        raise KilovlaError(f"rtc schedule must be one of {', '.join(SCHEDULES)}, not {schedule!r}")
    d = max(0, min(int(inference_delay), horizon))
    s = max(d, min(int(execution_horizon), horizon))
    w = np.zeros(horizon, np.float32)
    w[:d] = 1.0
    if schedule == "ones":
        w[:s] = 1.0
    elif schedule in ("linear", "exp") and s > d:
        ramp = np.linspace(1.0, 0.0, s - d + 1, dtype=np.float32)[1:]  # the positions after the delay
        if schedule == "exp":
            ramp = ramp * np.expm1(ramp) / (math.e - 1)
        w[d:s] = ramp
    w[min(prefix_len, horizon):] = 0.0
    return w


def guidance_weight(tau: float, max_weight: torch.Tensor) -> torch.Tensor:
    """min(c / r^2, beta) per row (`max_weight` (B,)); beta at tau = 0, 0 at tau = 1."""
    if tau <= 0.0:
        return max_weight
    if tau >= 1.0:
        return torch.zeros_like(max_weight)
    c = (1.0 - tau) / tau
    inv_r2 = ((1.0 - tau) ** 2 + tau ** 2) / (1.0 - tau) ** 2
    return torch.clamp(max_weight, max=c * inv_r2)


def sample_actions_rtc(model, batch, noise: torch.Tensor, prefix: torch.Tensor, weights: torch.Tensor,
                       max_guidance_weight: float | torch.Tensor = 10.0) -> torch.Tensor:
    """Euler sampling of a model's `velocity_field` (openpi's convention: noise at t = 1, actions at t = 0)
    with RTC guidance. noise, prefix (B, H, A) normalised and zero-padded; weights (B, H, A);
    max_guidance_weight: one beta, or one per row (B,), so rows of a batch do not share theirs."""
    n = model.config.num_inference_steps
    with torch.no_grad():
        field, _ = model.velocity_field(batch)
    guided = bool(weights.any())
    beta = torch.as_tensor(max_guidance_weight, dtype=noise.dtype, device=noise.device).expand(noise.shape[0])
    x, dt = noise, -1.0 / n
    for step in range(n):
        t = 1.0 + step * dt
        tt = torch.full((x.shape[0],), t, device=x.device)
        if not guided:
            with torch.no_grad():
                v = field(x, tt)
        else:
            with torch.enable_grad():
                xg = x.detach().requires_grad_(True)
                v = field(xg, tt)
                x0 = xg - t * v
                err = (prefix - x0) * weights
                (correction,) = torch.autograd.grad(x0, xg, err.detach())
            v = v.detach() - guidance_weight(1.0 - t, beta)[:, None, None] * correction
        x = (x + dt * v).detach()
    return x
