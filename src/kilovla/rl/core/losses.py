"""RL losses and advantage estimators as pure functions of tensors (per-sample values; the caller
sums them, so a streamed global batch can be normalised once).

- `ppo_loss`: clipped surrogate, -min(r A, clip(r, 1-e, 1+e) A) with r = exp(logp - old_logp).
- `decoupled_ppo_loss` (AReaL): three policies. The behaviour policy acted (its log-probs came with
  the rollout), the proximal policy is the learner's policy when the sample is consumed (before this
  update), the current one is being trained:
      w = exp(prox - behav)  (detached; samples with w > behav_cap are masked out)
      r = exp(logp - prox)
      loss = -w * min(r A, clip(r, 1-e, 1+e) A)
  When nothing is stale, prox = behav, w = 1 and it equals `ppo_loss`.
- `awr_loss`: advantage-weighted regression (Peters & Schaal's reward-weighted regression, AWR):
  min(exp(A / temperature), max_weight) x the policy's regression error on the action taken, the
  weight detached. The supervised loss, tilted toward what did better than expected; no ratio, so a
  stale sample needs no correction.
- `value_loss`: clipped squared error of a value head, as in PPO2.
- `gae`: generalised advantage estimation over a segment, bootstrapped from the value after it and,
  at an episode truncated by the time limit, from a value given for the truncated state.
- `group_advantages` (GRPO): (R - mean of the group) / (std of the group + eps) per rollout.
- SAC (residual SAC, rl/sac.py), batch means rather than per-sample values (its updates are whole
  mini-batches from a replay, never streamed):
      `sac_td_target`:        y = r + gamma (1 - terminal) (min(Q1', Q2') - alpha logp')
      `sac_critic_loss`:      0.5 mean((Q1 - y)^2 + (Q2 - y)^2)
      `sac_actor_loss`:       mean(alpha logp - min(Q1, Q2)) + penalty mean(mu^2)
      `sac_temperature_loss`: -mean(log_alpha (logp + target_entropy)), logp detached

>>> ppo_loss(torch.tensor([0.0]), torch.tensor([0.0]), torch.tensor([2.0]))[0]
tensor([-2.])
"""

from __future__ import annotations

import torch


def ppo_loss(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor,
             clip: float = 0.2) -> tuple[torch.Tensor, dict]:
    """Per-sample clipped PPO loss (B,) and stats (clip fraction, approximate KL)."""
    log_ratio = logp - old_logp
    ratio = log_ratio.exp()
    surrogate = torch.minimum(ratio * advantages, ratio.clamp(1 - clip, 1 + clip) * advantages)
    with torch.no_grad():
        stats = {"clip_fraction": ((ratio - 1).abs() > clip).float().mean().item(),
                 "approx_kl": ((ratio - 1) - log_ratio).mean().item()}
    return -surrogate, stats


def decoupled_ppo_loss(logp: torch.Tensor, prox_logp: torch.Tensor, behav_logp: torch.Tensor,
                       advantages: torch.Tensor, clip: float = 0.2, behav_cap: float = 2.0) -> tuple[torch.Tensor, dict]:
    """Per-sample decoupled PPO loss (B,): PPO against the proximal policy, weighted by how far the
    behaviour policy was from it. Samples with weight above `behav_cap` contribute nothing."""
    weight = (prox_logp - behav_logp).detach().exp()
    keep = (weight <= behav_cap).to(logp.dtype)
    per_sample, stats = ppo_loss(logp, prox_logp.detach(), advantages, clip)
    stats["behav_weight_mean"] = weight.mean().item()
    stats["behav_masked_fraction"] = 1.0 - keep.mean().item()
    return per_sample * weight * keep, stats


def awr_loss(regression_error: torch.Tensor, advantages: torch.Tensor, temperature: float = 1.0,
             max_weight: float = 20.0) -> tuple[torch.Tensor, dict]:
    """Per-sample advantage-weighted regression loss (B,) and stats (mean and max weight)."""
    weight = (advantages.detach() / temperature).exp().clamp(max=max_weight)
    stats = {"awr_weight_mean": weight.mean().item(), "awr_weight_max": weight.max().item()}
    return weight * regression_error, stats


def value_loss(values: torch.Tensor, returns: torch.Tensor, old_values: torch.Tensor, clip: float = 0.2) -> torch.Tensor:
    """Per-sample 0.5 * max((V - R)^2, (clip(V, V_old +- clip) - R)^2)."""
    clipped = old_values + (values - old_values).clamp(-clip, clip)
    return 0.5 * torch.maximum((values - returns) ** 2, (clipped - returns) ** 2)


def gae(rewards: torch.Tensor, values: torch.Tensor, dones: torch.Tensor, last_value: torch.Tensor,
        gamma: float = 0.99, lam: float = 0.95, truncated: torch.Tensor | None = None,
        truncation_values: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Advantages and returns (T,) of one segment of T steps.

    rewards, values, dones (T,): dones[t] = the episode ended at step t (no bootstrap into the next
    episode); last_value: V of the state after the segment (ignored when it ended an episode).
    truncated (T,), a subset of dones: the episode was cut by the time limit at t, not terminated, so
    its return goes on past the cut: bootstrap with truncation_values[t] (the caller's estimate of V
    of the state the cut left it in).
        delta_t = r_t + gamma * (V_{t+1} * (1 - done_t) + Vcut_t * truncated_t) - V_t
        A_t = delta_t + gamma * lam * (1 - done_t) * A_{t+1}
    """
    t_len = len(rewards)
    if truncated is None:
        truncated, truncation_values = torch.zeros(t_len, dtype=torch.bool), torch.zeros_like(rewards)
    advantages = torch.zeros_like(rewards)
    next_value, next_adv = last_value, torch.zeros((), dtype=rewards.dtype)
    for t in reversed(range(t_len)):
        live = 1.0 - dones[t].to(rewards.dtype)
        cut = truncated[t].to(rewards.dtype)
        delta = rewards[t] + gamma * (next_value * live + truncation_values[t] * cut) - values[t]
        next_adv = delta + gamma * lam * live * next_adv
        advantages[t] = next_adv
        next_value = values[t]
    return advantages, advantages + values


def group_advantages(returns: torch.Tensor, groups: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """GRPO: each rollout's return against the others of its group (rollouts from the same start)."""
    out = torch.zeros_like(returns)
    for g in groups.unique():
        members = groups == g
        r = returns[members]
        std = r.std(unbiased=False) if len(r) > 1 else torch.zeros((), dtype=r.dtype)
        out[members] = (r - r.mean()) / (std + eps)
    return out


def sac_td_target(reward: torch.Tensor, terminal: torch.Tensor, next_q1: torch.Tensor, next_q2: torch.Tensor,
                  gamma: float, next_logp: torch.Tensor | None = None, alpha: torch.Tensor | float = 0.0) -> torch.Tensor:
    """The critics' target y (B,) = r + gamma (1 - terminal) (min(Q1', Q2') - alpha logp'): the target critics'
    smaller value of the next state and the actor's next action; `next_logp` None leaves the entropy out of
    the backup (RLPD's backup_entropy=False). Call it without gradients.

    >>> sac_td_target(torch.tensor([1.0]), torch.tensor([0.0]), torch.tensor([2.0]), torch.tensor([3.0]), 0.5)
    tensor([2.])
    """
    next_q = torch.minimum(next_q1, next_q2)
    if next_logp is not None:
        next_q = next_q - alpha * next_logp
    return reward + gamma * (1.0 - terminal) * next_q


def sac_critic_loss(q1: torch.Tensor, q2: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, dict]:
    """Twin critics' TD loss 0.5 mean((Q1 - y)^2 + (Q2 - y)^2) and stats (the loss, mean Q1, mean target)."""
    loss = 0.5 * ((q1 - target) ** 2 + (q2 - target) ** 2).mean()
    return loss, {"critic_loss": loss.item(), "q": q1.mean().item(), "target": target.mean().item()}


def sac_actor_loss(logp: torch.Tensor, q1: torch.Tensor, q2: torch.Tensor, alpha: torch.Tensor | float,
                   mean: torch.Tensor, penalty: float) -> tuple[torch.Tensor, dict]:
    """The actor's loss mean(alpha logp - min(Q1, Q2)) + penalty mean(mean^2) and stats (the loss, the
    entropy estimate -mean(logp)). `mean`: the actor's deterministic correction in units of its bound (the
    penalty anchors it to the base's behaviour); `alpha` is detached by the caller."""
    loss = (alpha * logp - torch.minimum(q1, q2)).mean() + penalty * (mean ** 2).mean()
    return loss, {"actor_loss": loss.item(), "entropy": -logp.mean().item()}


def sac_temperature_loss(log_alpha: torch.Tensor, logp: torch.Tensor, target_entropy: float) -> torch.Tensor:
    """The entropy coefficient's loss -mean(log_alpha (logp + target_entropy)), logp detached: alpha grows while
    the entropy -logp is below its target and shrinks above it (the actor's stats carry the entropy)."""
    return -(log_alpha * (logp.detach() + target_entropy)).mean()
