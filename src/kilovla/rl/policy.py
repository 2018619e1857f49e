"""A VLA policy (pi0, pi0.5, GR00T N1.5) as an RL actor-critic.

`ActorCritic` holds the VLA and a small value head. Acting samples a Flow-SDE chain (exact
log-probabilities, `core/flow.py`); the value head reads the model's pooled prefix features,
detached, so the critic never moves the VLA, and the normalised state: pi0 and GR00T put the state
in the action stream, not the prefix, so without it the critic would judge a reach from images alone
(RLinf's GR00T head concatenates the state the same way; its pi0 head reads the expert's output).
`forward` recomputes the log-probability of stored chains (or, for advantage-weighted regression,
the flow-matching error of their executed chunks) and the values, differentiably (and the KL to a
frozen reference policy, `frozen_policy`, when given one), which is all the learner needs.

Observations are what the envs return (LeRobot keys, stacked); the `Processor` the supervised
trainer used turns them into model batches, so RL sees exactly what the policy was trained on.
Only the actions the env executes count in the log-probability: the first `n_action_steps` chunk
positions and the env's action dims.
"""

from __future__ import annotations

import logging

import numpy as np
import torch
from torch import nn

from kilovla.models.family import chunk_length
from kilovla.policy_folder import load_policy_folder
from kilovla.models.processor import PolicyMeta, Processor
from kilovla.models.residual import pooled_width
from kilovla.errors import KilovlaError
from kilovla.rl.core.flow import FlowSDE, chain_log_prob, flow_draws, flow_matching_error, sample_chain

log = logging.getLogger(__name__)


class ActorCritic(nn.Module):
    def __init__(self, vla: nn.Module, meta: PolicyMeta, sde: FlowSDE, n_action_steps: int, value_hidden: int = 256):
        super().__init__()
        self.vla, self.meta, self.sde = vla, meta, sde
        self.processor = Processor(vla.config, meta)
        cfg = vla.config
        self.horizon = chunk_length(cfg)
        self.n_action_steps = min(n_action_steps, self.horizon)
        mask = torch.zeros(self.horizon, cfg.max_action_dim)
        mask[: self.n_action_steps, : meta.action_dim] = 1.0
        self.register_buffer("executed", mask, persistent=False)
        features = critic_width(cfg)
        self.value_head = nn.Sequential(nn.Linear(features, value_hidden), nn.Tanh(), nn.Linear(value_hidden, 1))

    def batch(self, obs: dict):
        return self.processor.observation_batch(obs).to(self.executed.device)

    @torch.no_grad()
    def act(self, obs: dict, generator: torch.Generator | None = None) -> dict[str, np.ndarray]:
        """Stacked observations -> executed actions (B, n_action_steps, action_dim) in env units, the
        chain, which steps were stochastic, its log-prob and the value."""
        batch = self.batch(obs)
        field, features = self.vla.velocity_field(batch)
        cfg = self.vla.config
        noise = torch.randn(batch.state.shape[0], self.horizon, cfg.max_action_dim, generator=generator)
        chain, stochastic, logp = sample_chain(field, noise.to(self.executed.device), self.sde, self.executed, generator)
        value = self._value(features, batch)
        actions = self.processor.unnormalize_actions(chain[:, -1, : self.n_action_steps].float().cpu().numpy())
        return {"actions": actions, "chain": chain.cpu().numpy(), "stochastic": stochastic.cpu().numpy(),
                "logp": logp.cpu().numpy(), "value": value.cpu().numpy()}

    @torch.no_grad()
    def value(self, obs: dict) -> np.ndarray:
        batch = self.batch(obs)
        _, features = self.vla.velocity_field(batch)
        return self._value(features, batch).cpu().numpy()

    def forward(self, obs: dict, chain: torch.Tensor, stochastic: torch.Tensor, reference: nn.Module | None = None,
                objective: str = "logp", seeds: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Per sample (B,): the score of each stored chain, the value and, given a frozen `reference` VLA,
        the KL of the chain's stochastic transitions from the reference's: what the learner trains. The
        score is the chain's log-prob (`objective` "logp", PPO) or the flow-matching error of its
        executed chunk (`objective` "flow", advantage-weighted regression), at the flow time and noise
        drawn from each sample's `seeds`."""
        if objective not in ("logp", "flow") or (objective == "flow" and seeds is None):
            raise KilovlaError(f"ActorCritic scores chains by 'logp' or by 'flow' (with seeds), not {objective!r}")
        batch = self.batch(obs)
        field, features = self.vla.velocity_field(batch)
        chain, stochastic = chain.to(self.executed.device), stochastic.to(self.executed.device)
        ref_field = None
        if reference is not None:
            with torch.no_grad():
                ref_field, _ = reference.velocity_field(batch)
        kl = None
        if objective == "flow":
            # the dims past the env's are zero in supervised batches (the processor pads them); the chain's are
            # whatever the model sampled there
            actions = chain[:, -1] * (self.executed[0] > 0)
            t, noise = flow_draws(seeds, actions.shape[1:], actions.device, actions.dtype)
            score = flow_matching_error(field, actions, self.executed, t, noise)
            if ref_field is not None:
                _, kl = chain_log_prob(field, chain, stochastic, self.sde, self.executed, reference=ref_field)
        elif ref_field is None:
            score = chain_log_prob(field, chain, stochastic, self.sde, self.executed)
        else:
            score, kl = chain_log_prob(field, chain, stochastic, self.sde, self.executed, reference=ref_field)
        return score, self._value(features, batch), kl

    def acting_module(self) -> nn.Module:
        """What a weight sync sends the inference server: all of it (the VLA trains)."""
        return self

    def _value(self, features: torch.Tensor, batch) -> torch.Tensor:
        """V (B,) from the pooled prefix features and the normalised state, both detached from the VLA."""
        return self.value_head(torch.cat([features.detach().float(), batch.state.float()], dim=-1))[:, 0]


def load_actor_critic(policy_dir: str, sde: FlowSDE, n_action_steps: int | None = None, device: str = "cpu") -> ActorCritic:
    """A policy folder (a supervised checkpoint, or an RL one with its value head) as an actor-critic."""
    from pathlib import Path

    from kilovla.models.checkpoints import read_safetensors

    policy = load_policy_folder(policy_dir, device=device)
    steps = n_action_steps or policy.meta.n_action_steps or 1
    model = ActorCritic(policy.model.train(), policy.meta, sde, steps).to(device)
    head = Path(policy_dir) / "value_head.safetensors"
    if head.is_file():
        note = stale_value_head(policy_dir, model.value_head[0].in_features)
        if note:
            log.warning("%s: starting a fresh critic", note)
        else:
            model.value_head.load_state_dict(read_safetensors(head))
    return model


def frozen_policy(policy_dir: str) -> nn.Module:
    """A policy folder's VLA with no gradients, in eval mode: the reference of a KL penalty."""
    return load_policy_folder(policy_dir).model.eval().requires_grad_(False)


def critic_width(config) -> int:
    """The value head's inputs: the pooled prefix features (GR00T: its LLM's width; pi0 / pi0.5: the last
    layer's keys and values) and the padded state."""
    return pooled_width(config) + config.max_state_dim


def stale_value_head(policy_dir: str, width: int) -> str | None:
    """Why the folder's value head cannot be loaded into a critic of `width` inputs (None: it can): one
    written before the critic read the state. The policy is fine; its critic has to be relearned."""
    from pathlib import Path

    from kilovla.models.checkpoints import read_header

    head = Path(policy_dir) / "value_head.safetensors"
    stored = read_header(head)["0.weight"].shape[1]
    if stored == width:
        return None
    return f"{head} reads {stored} features, this critic {width} (pooled prefix and state)"
