"""A learned residual on top of a frozen flow policy: bounded corrections of each executed action chunk.

The base policy (pi0, pi0.5, GR00T N1.5) samples its chunk as usual; a small actor reads what the base
saw and proposed, the pooled prefix features, the normalised state and the chunk's executed part, and
adds a correction bounded by `scale` (normalised action units):

    delta = scale * tanh(u),   u ~ N(mean(f, q, a_base), std(f, q, a_base))      (acting, RL)
    delta = scale * tanh(mean(f, q, a_base))                                     (evaluation, serving)

Both output layers start at zero, so a fresh residual returns the base's chunk exactly (Policy
Decorator / ResFiT style residual RL; `rl/sac.py` trains it). `ResidualPolicyModel` wraps a base model
with its residual behind the base's own `sample_actions`: eval, serve and the policy API load an RL
folder (policy.json `residual`, residual.safetensors) like any other.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch
from torch import nn

from kilovla.errors import KilovlaError
from kilovla.models.family import chunk_length, family_of

RESIDUAL_FILE = "residual.safetensors"
LOG_STD_RANGE = (-5.0, 1.0)


@dataclass(frozen=True)
class ResidualSpec:
    """The residual's shape and bound; stored in policy.json as `residual`."""

    steps: int  # executed chunk positions it corrects
    action_dim: int  # the env's action dims it corrects
    features: int  # pooled prefix feature width of the base
    state_dim: int  # the base's padded state width
    scale: float = 0.3  # bound of the correction, normalised action units
    hidden: int = 256
    depth: int = 2
    init_std: float = 0.5  # std of u at the start (exploration while acting)
    shared: bool = True  # one correction for every executed step of the chunk (action_dim outputs), or one per step

    @property
    def out(self) -> int:
        """Outputs of the actor: the correction's free dims."""
        return self.action_dim if self.shared else self.steps * self.action_dim

    @property
    def executed(self) -> int:
        """Dims of the executed chunk (steps x action_dim): what the actor reads of the base, the critics of the action."""
        return self.steps * self.action_dim

    def check_steps(self, n_action_steps: int, who: str, training: bool) -> None:
        """The actions run per chunk against the `steps` this residual corrects: training it on needs the same
        count (its replay and critics are of chunks of that many actions); running it, at most that many
        (later actions would go uncorrected)."""
        if training and n_action_steps != self.steps:
            raise KilovlaError(f"{who}: its residual corrects {self.steps} actions per chunk; rollout.n_action_steps "
                               f"asks for {n_action_steps}")
        if not training and n_action_steps > self.steps:
            raise KilovlaError(f"{who}: the policy's residual corrects only the first {self.steps} actions of a chunk; "
                               f"evaluate with {self.steps} or fewer")

    def to_json(self) -> dict:
        return {"algorithm": "residual_sac", **asdict(self)}

    @classmethod
    def from_json(cls, fields: dict, where: str) -> ResidualSpec:
        fields = {k: v for k, v in fields.items() if k != "algorithm"} if isinstance(fields, dict) else fields
        try:
            spec = cls(**fields)
        except TypeError as e:
            raise KilovlaError(f"{where}: residual entry is not a residual description: {e}") from None
        kinds = {"steps": int, "action_dim": int, "features": int, "state_dim": int, "hidden": int, "depth": int,
                 "scale": (int, float), "init_std": (int, float), "shared": bool}
        bad = [k for k, kind in kinds.items() if not isinstance(getattr(spec, k), kind)
               or (kind is not bool and isinstance(getattr(spec, k), bool))
               or (kind is not bool and not 0 < getattr(spec, k) < math.inf)]
        if bad:
            raise KilovlaError(f"{where}: residual entry has bad {', '.join(bad)} (positive finite numbers; shared true/false)")
        return spec


def mlp(width_in: int, hidden: int, depth: int) -> nn.Sequential:
    """Linear + LayerNorm + ReLU blocks (LayerNorm: the off-policy critics' stabiliser, ResFiT / RLPD)."""
    layers, width = [], width_in
    for _ in range(depth):
        layers += [nn.Linear(width, hidden), nn.LayerNorm(hidden), nn.ReLU()]
        width = hidden
    return nn.Sequential(*layers)


class ResidualActor(nn.Module):
    """Tanh-Gaussian actor over the executed chunk's correction; zero output layers: the identity at start."""

    def __init__(self, spec: ResidualSpec):
        super().__init__()
        self.spec = spec
        self.trunk = mlp(spec.features + spec.state_dim + spec.executed, spec.hidden, spec.depth)
        self.mean = nn.Linear(spec.hidden, spec.out)
        self.log_std = nn.Linear(spec.hidden, spec.out)
        for layer in (self.mean, self.log_std):
            nn.init.zeros_(layer.weight)
            nn.init.zeros_(layer.bias)
        nn.init.constant_(self.log_std.bias, math.log(spec.init_std))

    def forward(self, features: torch.Tensor, state: torch.Tensor, base: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """u's mean and log-std (B, steps * action_dim) from features (B, F), state (B, S), base (B, steps, A)."""
        h = self.trunk(torch.cat([features.float(), state.float(), base.flatten(1).float()], dim=-1))
        return self.mean(h), self.log_std(h).clamp(*LOG_STD_RANGE)

    def _chunk(self, squashed: torch.Tensor, base: torch.Tensor) -> torch.Tensor:
        """(B, out) -> the correction of each executed step (B, steps, A)."""
        shape = (len(base), 1 if self.spec.shared else base.shape[1], base.shape[2])
        return (self.spec.scale * squashed).view(shape).expand(base.shape)

    def deterministic(self, features, state, base) -> torch.Tensor:
        """The correction of evaluation: scale * tanh(mean), (B, steps, A)."""
        mean, _ = self(features, state, base)
        return self._chunk(torch.tanh(mean), base)

    def sample(self, features, state, base, generator: torch.Generator | None = None
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """A correction (B, steps, A), reparameterised, and its log-prob (B,) in tanh units (the bound's
        constant log(scale) left out, so the entropy target reads as for actions in [-1, 1])."""
        mean, log_std = self(features, state, base)
        std = log_std.exp()
        eps = torch.randn(mean.shape, generator=generator, device="cpu").to(mean.device, mean.dtype)
        u = mean + std * eps
        squashed = torch.tanh(u)
        logp = (-0.5 * eps**2 - log_std - 0.5 * math.log(2 * math.pi)).sum(-1)
        logp = logp - (2 * (math.log(2) - u - nn.functional.softplus(-2 * u))).sum(-1)  # log(1 - tanh(u)^2)
        return self._chunk(squashed, base), logp


class ResidualPolicyModel(nn.Module):
    """A base model plus its residual, with the base's interface: `sample_actions` returns the base's chunk
    with the deterministic correction added to its executed part (the rest as the base samples it)."""

    def __init__(self, base: nn.Module, actor: ResidualActor):
        super().__init__()
        self.base, self.actor = base, actor

    @property
    def config(self):
        return self.base.config

    def velocity_field(self, batch):
        return self.base.velocity_field(batch)

    @torch.no_grad()
    def sample_actions(self, batch, noise: torch.Tensor | None = None, **_) -> torch.Tensor:
        cfg, spec = self.config, self.actor.spec
        field, features = self.base.velocity_field(batch)
        b = batch.state.shape[0]
        if noise is None:
            noise = torch.randn(b, chunk_length(cfg), cfg.max_action_dim, device=batch.state.device)
        chunk = self.base.integrate(field, noise)
        base = chunk[:, : spec.steps, : spec.action_dim]
        delta = self.actor.deterministic(features, batch.state, base).to(chunk.dtype)
        out = chunk.clone()
        out[:, : spec.steps, : spec.action_dim] = base + delta
        return out


def base_of(model: nn.Module) -> nn.Module:
    """The base model under a residual (the model itself when it has none)."""
    return model.base if isinstance(model, ResidualPolicyModel) else model


def pooled_width(config) -> int:
    """Width of the pooled prefix features `velocity_field` returns: GR00T's LLM width; pi0 / pi0.5 the last
    layer's keys and values."""
    return family_of(config).pooled_width(config)


def check_fits(spec: ResidualSpec, config, action_dim: int, where: str) -> None:
    """The residual was made for a base of this shape (features, state width, chunk, action dims)."""
    want = (pooled_width(config), config.max_state_dim, action_dim)
    got = (spec.features, spec.state_dim, spec.action_dim)
    if got != want or spec.steps > chunk_length(config):
        raise KilovlaError(f"{where}: the residual reads {got[0]} features and {got[1]} state dims and corrects "
                           f"{spec.steps} x {got[2]} actions; this base gives {want[0]}, {want[1]} and "
                           f"{chunk_length(config)} x {want[2]}")
