"""Exact log-probabilities for flow-matching policies: a stochastic denoising chain (Flow-SDE, piRL).

A flow policy samples an action chunk by integrating a velocity field from noise (t = 1) to actions
(t = 0) in K Euler steps; deterministic, it has no density. For RL some steps are made stochastic
with Gaussian transitions whose mean keeps the marginals of the flow (Flow-SDE, as Flow-GRPO and
piRL derive it): at time t with step delta,

    sigma_t = a * sqrt(t / (1 - t))            (at t = 1, the next step's 1 - t is used)
    mean    = x - delta * v - sigma_t^2 * delta / (2 t) * (x + (1 - t) v)
    std     = sigma_t * sqrt(delta)

`stochastic="one"` (piRL's default) makes one step per chunk, drawn at random, stochastic and the
others plain Euler; "all" makes every step stochastic. The whole chain (every x_k) and the index
are stored with the rollout, so the learner re-evaluates the velocity at the stored x_k and scores
the stored x_{k+1}: the policy ratio is exact, never an approximation of a sampled action.
log-prob = the Gaussian log-density of the stochastic transition(s), summed over the executed
elements of the chunk (`mask`: the actions run in the env, the env's action dims) and averaged over
stochastic steps (piRL's convention). Outside RL, sampling stays deterministic (`sample_actions`).

`flow_matching_error` is the other handle on the same field: the supervised flow-matching error of
an action chunk (the executed `chain[:, -1]`), for advantage-weighted regression, which needs no
density at all.

`field(x, t) -> v` is a model's velocity field in this (openpi's) convention; both families provide
one (`Pi05Model.velocity_field`, `GrootModel.velocity_field`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from kilovla.errors import KilovlaError
from kilovla.models.batch import flow_loss


@dataclass(frozen=True)
class FlowSDE:
    steps: int = 4  # K denoising steps
    noise_level: float = 0.5  # a
    stochastic: str = "one"  # or "all"

    def __post_init__(self):
        if self.steps < 1 or self.noise_level <= 0 or self.stochastic not in ("one", "all"):
            raise KilovlaError(f"FlowSDE needs steps >= 1, noise_level > 0 and stochastic one|all, got {self}")

    def time(self, k: torch.Tensor | int) -> torch.Tensor | float:
        return 1.0 - k / self.steps

    def transition(self, x: torch.Tensor, v: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Mean and std (per sample, broadcastable) of x_{k+1} given x_k (B, H, A) and v at step k (B,)."""
        delta = 1.0 / self.steps
        t = self.time(k.to(x.dtype))[:, None, None]
        sigma = self.noise_level * torch.sqrt(t / torch.where(t >= 1.0, torch.full_like(t, delta), 1.0 - t))
        mean = x - delta * v - sigma**2 * delta / (2 * t) * (x + (1 - t) * v)
        return mean, sigma * math.sqrt(delta)

    def stochastic_steps(self, batch_size: int, generator: torch.Generator | None, device) -> torch.Tensor:
        """(B, K) bool: which transitions of each sample's chain are stochastic."""
        if self.stochastic == "all":
            return torch.ones(batch_size, self.steps, dtype=torch.bool, device=device)
        index = torch.randint(0, self.steps, (batch_size,), generator=generator, device="cpu").to(device)
        return torch.nn.functional.one_hot(index, self.steps).bool()


def _gaussian_logp(x: torch.Tensor, mean: torch.Tensor, std: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """log N(x; mean, std^2) summed over the masked elements: (B,)."""
    per = -0.5 * ((x - mean) / std) ** 2 - torch.log(std) - 0.5 * math.log(2 * math.pi)
    return (per * mask).flatten(1).sum(1)


@torch.no_grad()
def sample_chain(field, noise: torch.Tensor, sde: FlowSDE, mask: torch.Tensor,
                 generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Run the chain from `noise` (B, H, A): returns the chain (B, K+1, H, A) (chain[:, -1] is the
    action chunk), which steps were stochastic (B, K), and the log-prob of the chunk (B,)."""
    b = noise.shape[0]
    stochastic = sde.stochastic_steps(b, generator, noise.device)
    x, chain = noise, [noise]
    logp = torch.zeros(b, dtype=torch.float32, device=noise.device)
    for k in range(sde.steps):
        kk = torch.full((b,), k, device=noise.device)
        v = field(x, sde.time(kk.to(noise.dtype)))
        mean, std = sde.transition(x, v, kk)
        eps = torch.randn(x.shape, generator=generator, device="cpu").to(x.device, x.dtype)
        sde_x = mean + std * eps
        ode_x = x - v / sde.steps
        s = stochastic[:, k][:, None, None]
        new = torch.where(s, sde_x, ode_x)
        logp = logp + torch.where(stochastic[:, k], _gaussian_logp(new.float(), mean.float(), std.float().expand_as(mean),
                                                                   mask.float()), torch.zeros_like(logp))
        x = new
        chain.append(x)
    return torch.stack(chain, 1), stochastic, logp / stochastic.sum(1).clamp(min=1)


def chain_log_prob(field, chain: torch.Tensor, stochastic: torch.Tensor, sde: FlowSDE, mask: torch.Tensor,
                   reference=None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """The log-prob (B,) of a stored chain under `field` (differentiable): the velocity is evaluated
    only where a transition was stochastic, one batched call per step that has any.

    With `reference` (a frozen policy's field) also the KL (B,) of this policy's stochastic transitions
    from the reference's at the same x_k: both are Gaussians with the same std, so per transition
    KL = ||mean - mean_ref||^2 / (2 std^2) over the executed elements (Flow-GRPO's penalty), averaged
    over stochastic steps like the log-prob. Returns (logp, kl) then."""
    b = chain.shape[0]
    rows = torch.arange(b, device=chain.device)
    if sde.stochastic == "one":  # one call: each sample's own stochastic step
        k = stochastic.float().argmax(1)
        steps = [(k, chain[rows, k], chain[rows, k + 1], 1.0)]
    else:
        steps = [(torch.full((b,), k, device=chain.device), chain[:, k], chain[:, k + 1], 1.0 / sde.steps)
                 for k in range(sde.steps)]
    logp = torch.zeros(b, dtype=torch.float32, device=chain.device)
    kl = torch.zeros_like(logp)
    for k, x_k, x_next, weight in steps:
        t = sde.time(k.to(chain.dtype))
        mean, std = sde.transition(x_k, field(x_k, t), k)
        std = std.float().expand_as(mean)
        logp = logp + weight * _gaussian_logp(x_next.float(), mean.float(), std, mask.float())
        if reference is not None:
            with torch.no_grad():
                ref_mean, _ = sde.transition(x_k, reference(x_k, t), k)
            kl = kl + weight * (0.5 * ((mean.float() - ref_mean.float()) / std) ** 2 * mask.float()).flatten(1).sum(1)
    return logp if reference is None else (logp, kl)


def flow_draws(seeds: torch.Tensor, shape: tuple, device=None, dtype=torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """Each sample's flow time t (B,) and noise (B, *shape), from its own seed: a sample gets the same draw
    whatever micro-batch, rank or resumed run trains it, so the gradient of a global batch does not
    depend on how it is split. t ~ Beta(1.5, 1) * 0.999 + 0.001 (openpi's; drawn as u^(2/3), the
    inverse of the CDF t^1.5)."""
    ts, noises = [], []
    for seed in seeds.tolist():
        g = torch.Generator().manual_seed(int(seed))
        ts.append(torch.rand(1, generator=g) ** (2.0 / 3.0) * 0.999 + 0.001)
        noises.append(torch.randn(shape, generator=g))
    return torch.cat(ts).to(device, dtype), torch.stack(noises).to(device, dtype)


def flow_matching_error(field, actions: torch.Tensor, mask: torch.Tensor, t: torch.Tensor,
                        noise: torch.Tensor) -> torch.Tensor:
    """The supervised flow-matching error (B,) of `field` on action chunks (B, H, A) at times t (B,) with
    `noise` (B, H, A), differentiable: x_t = t * noise + (1 - t) * actions, target noise - actions,
    the trainer's masked squared error (`flow_loss`) per sample. A field that knows the chunk scores 0."""
    t, noise = t.to(actions.dtype), noise.to(actions.dtype)
    x_t = t[:, None, None] * noise + (1 - t[:, None, None]) * actions
    target = (noise - actions).float()
    return flow_loss(field(x_t, t).float(), target, mask.float().expand_as(target))["per_sample"]
