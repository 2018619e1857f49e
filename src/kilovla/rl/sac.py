"""Residual SAC: off-policy RL of a bounded correction on top of a frozen VLA (`learner.algo.name=residual_sac`).

Why this and not PPO (docs/rl_finetune.md): on 2 cores a PPO update sees ~5 episodes, each sample once,
with a critic learned from scratch; every run drifted or stood still. Here the flow policy stays
frozen and acts as it was trained (its chunk from fresh noise, deterministic Euler steps); a small
tanh-Gaussian actor adds a correction of at most `res_scale` (normalised units) to the chunk's executed
part (models/residual.py; it starts at exactly zero, the base's behaviour). Twin critics
Q(features, state, privileged state, executed chunk) learn from a replay buffer of every chunk
transition the envs have played, so each sample is reused `utd` x batch / buffer times and rollout
staleness stops mattering (Policy Decorator, ResFiT, IBRL; ../shared/research/rl_gains.md Recipe 2).

- Transitions are chunk steps: the base's pooled prefix features, normalised state and executed
  chunk come from the inference server with the rollout (computed once per step, never again), the
  reward is the chunk's summed `step_reward`; an episode that succeeds terminates (no bootstrap), one
  cut by the time limit is not used as a transition (the env resets before the cut state is seen;
  its earlier steps still bootstrap through), segments of one env are stitched end to start (checked
  on the state, so a round dropped after a worker failure breaks the chain instead of faking it).
- The critics may read privileged simulator state (Meta-World's 39-d object and goal vector): only
  the actor must run on the robot (asymmetric actor-critic).
- Updates: once `warmup_transitions` are stored, `utd` gradient steps of `batch_size` per new
  transition, as segments arrive (async: while the envs keep playing); critics only for the first
  `critic_warmup_updates`, then the actor every `actor_every` critic steps; the entropy coefficient
  tuned to `target_entropy` but kept out of the critics' target (`backup_entropy`); a penalty on the
  squared mean correction; one correction per chunk (`shared`); Polyak targets. Each of these
  guards answers a failure measured here (docs/rl_finetune.md, trials g1-g5). A policy version (what
  the inference server acts with) is every `batch_segments` segments.
- Health per version (metrics.jsonl `learner/*`): Q against the Monte Carlo return of finished
  episodes, the entropy coefficient and entropy, the fraction of corrections at their bound, TD loss.
- Checkpoints save the actor, critics, target critics, optimizers, entropy coefficient and the whole
  replay buffer (replay.safetensors): a resumed run continues exactly where the checkpoint was.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import nn

from kilovla.errors import KilovlaError
from kilovla.models.family import chunk_length
from kilovla.models.processor import PolicyMeta, Processor
from kilovla.models.residual import ResidualActor, ResidualSpec, mlp, pooled_width
from kilovla.rl.algorithm import Algorithm, LearnerRun, Run, RunConfig
from kilovla.rl.core import trajectory
from kilovla.rl.core.losses import sac_actor_loss, sac_critic_loss, sac_td_target, sac_temperature_loss
from kilovla.rl.offpolicy import (OffPolicySchedule, check_one_learner, check_replay_capacity, check_saved_replay,
                                 forget_replaced, state_key)

if TYPE_CHECKING:
    from kilovla.policy_folder import PolicyFolder

log = logging.getLogger(__name__)

@dataclass
class SACConfig:
    res_scale: float = 0.2  # bound of the correction, normalised action units
    init_std: float = 0.3  # std of the actor's pre-tanh Gaussian at the start
    shared: bool = True  # one correction per chunk (action_dim dims) rather than one per executed step
    # actor loss + penalty x mean squared correction (in units of res_scale): a bias of a few hundredths
    # integrates over a 200-step episode, and early critics' action gradients are mostly noise; the
    # penalty keeps the base's behaviour unless Q's gain is consistent (TD3+BC-style anchor, to 0)
    penalty: float = 0.2  # 1.0 held the correction at zero, 0.05 let it drift (docs/rl_finetune.md, g4-g6)
    hidden: int = 128  # actor and critic MLPs (DSRL's and RLinf's small configs: 128 wide)
    depth: int = 2
    utd: float = 1.0  # gradient steps per new transition (update-to-data ratio); a transition is a chunk
    batch_size: int = 128
    replay_size: int = 100_000
    warmup_transitions: int = 1_000  # no update before this many transitions are stored
    actor_lr: float = 1e-4
    critic_lr: float = 3e-4
    alpha_lr: float = 3e-3  # fast: a run is ~10^4-10^5 updates, not SAC's usual 10^6
    init_alpha: float = 1e-3
    target_entropy: float | None = None  # None: -(corrected dims) / 2
    # the entropy bonus in the critics' target (SAC's soft Q) or not (RLPD's backup_entropy=False): with a
    # sparse success of 1.0 the bonus, summed over ~100 discounted chunks, outweighs the reward the
    # critics should see (docs/rl_finetune.md)
    backup_entropy: bool = False
    tau: float = 0.005
    actor_every: int = 2
    # critic-only updates first (DPPO / ReinFlow warm their critics up): an actor that follows a critic
    # still learning from the first thousand transitions learns a large, wrong correction
    critic_warmup_updates: int = 2_000
    privileged: bool = True  # critics read the env's privileged state (asymmetric actor-critic)


class Critic(nn.Module):
    def __init__(self, width_in: int, hidden: int, depth: int):
        super().__init__()
        self.net = nn.Sequential(mlp(width_in, hidden, depth), nn.Linear(hidden, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)[:, 0]


class ResidualAgent(nn.Module):
    """The frozen VLA, the residual actor, twin critics and their targets; what the server acts with and
    the learner trains. `privileged`: (key, width) of observation entries only the critics read."""

    def __init__(self, vla: nn.Module, meta: PolicyMeta, spec: ResidualSpec, privileged: tuple = (),
                 hidden: int = 256, depth: int = 2, actor: ResidualActor | None = None):
        super().__init__()
        self.vla = vla.eval().requires_grad_(False)
        self.meta, self.spec, self.privileged = meta, spec, tuple(privileged)
        self.processor = Processor(vla.config, meta)
        self.actor = actor if actor is not None else ResidualActor(spec)
        width = spec.features + spec.state_dim + sum(w for _, w in self.privileged) + spec.executed
        self.critics = nn.ModuleList([Critic(width, hidden, depth) for _ in range(2)])
        self.targets = copy.deepcopy(self.critics).requires_grad_(False)

    def privileged_state(self, obs: dict) -> np.ndarray:
        b = len(obs["observation.state"])
        parts = [np.asarray(obs[k], np.float32).reshape(b, w) for k, w in self.privileged]
        return np.concatenate(parts, 1) if parts else np.zeros((b, 0), np.float32)

    @torch.no_grad()
    def act(self, obs: dict, generator: torch.Generator | None = None) -> dict[str, np.ndarray]:
        """Stacked observations -> executed actions (B, steps, action_dim) in env units, with what the learner
        stores: features, normalised state, privileged state, the base's chunk and the executed one (normalised)."""
        batch = self.processor.observation_batch(obs)
        field, features = self.vla.velocity_field(batch)
        cfg, spec = self.vla.config, self.spec
        noise = torch.randn(batch.state.shape[0], chunk_length(cfg), cfg.max_action_dim, generator=generator)
        chunk = self.vla.integrate(field, noise)
        base = chunk[:, : spec.steps, : spec.action_dim].float()
        delta, _ = self.actor.sample(features, batch.state, base, generator)  # exploring: the actor's Gaussian
        executed = base + delta
        return {"actions": self.processor.unnormalize_actions(executed.numpy()), "features": features.float().numpy(),
                "state": batch.state.float().numpy(), "privileged": self.privileged_state(obs),
                "base": base.numpy(), "executed": executed.numpy()}

    def critic_input(self, features, state, privileged, executed) -> torch.Tensor:
        return torch.cat([features, state, privileged, executed.flatten(1)], dim=-1)

    def acting_module(self) -> nn.Module:
        """What a weight sync sends the inference server: the actor (the VLA never changes)."""
        return self.actor


def residual_spec(vla: nn.Module, meta: PolicyMeta, n_action_steps: int, cfg: SACConfig) -> ResidualSpec:
    config = vla.config
    return ResidualSpec(steps=min(n_action_steps, chunk_length(config)), action_dim=meta.action_dim,
                        features=pooled_width(config), state_dim=config.max_state_dim, scale=cfg.res_scale,
                        hidden=cfg.hidden, depth=cfg.depth, init_std=cfg.init_std, shared=cfg.shared)


def load_residual_agent(policy_dir: str, n_action_steps: int, cfg: SACConfig, privileged: tuple = ()) -> ResidualAgent:
    """A policy folder as a residual agent: a plain supervised folder gets a fresh (zero) residual and fresh
    critics; an RL folder keeps its residual (and critics, critic.safetensors) and trains on."""
    from kilovla.models.checkpoints import read_safetensors
    from kilovla.policy_folder import load_policy_folder
    from kilovla.models.residual import ResidualPolicyModel

    policy = load_policy_folder(policy_dir)
    model, actor = policy.model, None
    if isinstance(model, ResidualPolicyModel):
        model, actor = model.base, model.actor
        actor.spec.check_steps(min(n_action_steps, chunk_length(model.config)), policy_dir, training=True)
    spec = actor.spec if actor is not None else residual_spec(model, policy.meta, n_action_steps, cfg)
    agent = ResidualAgent(model, policy.meta, spec, privileged if cfg.privileged else (), cfg.hidden, cfg.depth, actor)
    critics = Path(policy_dir) / "critic.safetensors"
    if actor is not None and not critics.is_file():
        log.warning("%s: missing; the residual trains on with fresh critics", critics)
    if actor is not None and critics.is_file():
        weights = read_safetensors(critics)
        try:
            agent.load_state_dict({**agent.state_dict(), **weights})
        except RuntimeError:  # e.g. critics made without the privileged state, or of another width
            log.warning("%s: its critics do not fit this run's (learner.algo.sac); starting fresh critics", critics)
    return agent


# -- the replay buffer ---------------------------------------------------------------------------------
class Replay:
    """A ring of chunk transitions. A transition's successor is the next stored step of the same env (its
    index in `nxt`), so next-state inputs are never stored twice; a transition is sampled once its
    successor is known (or it terminated). Monte Carlo returns of finished episodes go in `mc`."""

    FIELDS = ("features", "state", "privileged", "base", "executed")

    def __init__(self, capacity: int, widths: dict[str, int], gamma: float):
        self.capacity, self.gamma = capacity, gamma
        self.data = {k: np.zeros((capacity, widths[k]), np.float32) for k in self.FIELDS}
        self.reward = np.zeros(capacity, np.float32)
        self.terminal = np.zeros(capacity, bool)
        self.nxt = np.full(capacity, -1, np.int64)
        self.valid = np.zeros(capacity, bool)
        self.mc = np.full(capacity, np.nan, np.float32)
        self.added = 0  # transitions ever stored (the ring position is added % capacity)
        self.pending: dict[tuple, list] = {}  # env slot -> [index of its last step, the state it expects next]
        self.episode: dict[tuple, list[int]] = {}  # env slot -> indices of its running episode

    def __len__(self) -> int:
        return min(self.added, self.capacity)

    def _put(self, row: dict, reward: float, terminal: bool) -> int:
        i = self.added % self.capacity
        self.added += 1
        for k in self.FIELDS:
            self.data[k][i] = row[k]
        self.reward[i], self.terminal[i] = reward, terminal
        self.nxt[i], self.valid[i], self.mc[i] = -1, terminal, np.nan
        return i

    def add_segment(self, segment: trajectory.Segment) -> int:
        """Store a segment's steps, linking each to its successor; returns the transitions stored."""
        slot = tuple(segment.segment_id[:3])
        forget_replaced(self.pending, slot, self.episode)
        extras = segment.extras
        key0 = state_key(trajectory.index(segment.obs, [0]))
        pending = self.pending.pop(slot, None)
        if pending is not None and not np.array_equal(pending[1], key0):
            pending = None  # not the state that followed: the chain is broken (a dropped sync round)
            self.episode.pop(slot, None)
        previous = pending[0] if pending is not None else None
        truncated = segment.truncated if segment.truncated is not None else np.zeros(len(segment), bool)
        for t in range(len(segment)):
            row = {k: np.asarray(extras[k][t]).ravel() for k in self.FIELDS}
            terminal = bool(segment.done[t] and not truncated[t])
            i = self._put(row, float(segment.reward[t]), terminal)
            if previous is not None:
                self.nxt[previous], self.valid[previous] = i, True
            self.episode.setdefault(slot, []).append(i)
            previous = None if segment.done[t] else i
            if segment.done[t]:
                self._finish_episode(slot)
        if previous is not None:
            self.pending[slot] = [previous, state_key(segment.next_obs, single=True)]
        return len(segment)

    def _finish_episode(self, slot: tuple) -> None:
        ret = 0.0
        for i in reversed(self.episode.pop(slot, [])):
            ret = float(self.reward[i]) + self.gamma * ret
            self.mc[i] = ret

    def sample(self, n: int, rng: np.random.Generator) -> np.ndarray:
        ok = np.flatnonzero(self.valid[: len(self)])
        return ok[rng.integers(0, len(ok), n)]

    def usable(self) -> int:
        return int(self.valid[: len(self)].sum())

    def batch(self, idx: np.ndarray) -> dict[str, torch.Tensor]:
        nxt = np.where(self.terminal[idx], idx, self.nxt[idx])  # a terminal's successor is never read
        out = {k: torch.from_numpy(v[idx]) for k, v in self.data.items()}
        out.update({f"next_{k}": torch.from_numpy(self.data[k][nxt]) for k in ("features", "state", "privileged", "base")})
        out["reward"], out["terminal"] = torch.from_numpy(self.reward[idx]), torch.from_numpy(self.terminal[idx].astype(np.float32))
        return out

    def state_dict(self) -> tuple[dict[str, torch.Tensor], dict]:
        """(arrays for replay.safetensors, the small rest for learner.pt)."""
        n = len(self)
        arrays = {k: torch.from_numpy(v[:n].copy()) for k, v in self.data.items()}
        arrays.update(reward=torch.from_numpy(self.reward[:n].copy()), terminal=torch.from_numpy(self.terminal[:n].copy()),
                      nxt=torch.from_numpy(self.nxt[:n].copy()), valid=torch.from_numpy(self.valid[:n].copy()),
                      mc=torch.from_numpy(self.mc[:n].copy()))
        rest = {"added": self.added, "capacity": self.capacity, "pending": [[list(k), v[0], torch.from_numpy(np.asarray(v[1]))] for k, v in self.pending.items()],
                "episode": [[list(k), v] for k, v in self.episode.items()]}
        return arrays, rest

    def load_state_dict(self, arrays: dict[str, torch.Tensor], rest: dict) -> None:
        n = len(arrays["reward"])
        if n > self.capacity:
            raise KilovlaError(f"the saved replay buffer holds {n} transitions, more than learner.algo.sac.replay_size "
                               f"{self.capacity}")
        for k in self.FIELDS:
            self.data[k][:n] = arrays[k].numpy()
        self.reward[:n], self.terminal[:n] = arrays["reward"].numpy(), arrays["terminal"].numpy()
        self.nxt[:n], self.valid[:n], self.mc[:n] = arrays["nxt"].numpy(), arrays["valid"].numpy(), arrays["mc"].numpy()
        self.added = int(rest["added"])
        self.pending = {tuple(k): [int(i), v.numpy()] for k, i, v in rest["pending"]}
        self.episode = {tuple(k): list(v) for k, v in rest["episode"]}


# -- the learner ---------------------------------------------------------------------------------------
def _step(optimizer: torch.optim.Optimizer, loss: torch.Tensor) -> None:
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()


class SACLearner(OffPolicySchedule):
    """Segments in, gradient steps on the replay buffer, a policy version every `segments_per_step` segments."""

    def __init__(self, agent: ResidualAgent, gamma: float, cfg: SACConfig, segments_per_step: int, seed: int = 0):
        self.agent, self.cfg, self.gamma = agent, cfg, gamma
        self.segments_per_step = segments_per_step
        spec = agent.spec
        widths = {"features": spec.features, "state": spec.state_dim, "base": spec.executed, "executed": spec.executed,
                  "privileged": sum(w for _, w in agent.privileged)}
        self.replay = Replay(cfg.replay_size, widths, gamma)
        self.actor_opt = torch.optim.Adam(agent.actor.parameters(), lr=cfg.actor_lr, foreach=True)
        self.critic_opt = torch.optim.Adam(agent.critics.parameters(), lr=cfg.critic_lr, foreach=True)
        self.log_alpha = torch.tensor(math.log(cfg.init_alpha), requires_grad=True)
        self.alpha_opt = torch.optim.Adam([self.log_alpha], lr=cfg.alpha_lr)
        self.target_entropy = -spec.out / 2 if cfg.target_entropy is None else cfg.target_entropy
        self.version = self.updates = self.in_step = 0
        self.owed = 0.0
        self.rng = np.random.default_rng(seed)
        self.generator = torch.Generator().manual_seed(seed)
        self._stats: list[dict] = []
        self._new_episodes: list[trajectory.Episode] = []

    def consume(self, segments: list[trajectory.Segment]) -> dict | None:
        new = sum(self.replay.add_segment(s) for s in segments)
        self._pay(self.cfg.utd * new, self.replay.usable() >= max(self.cfg.warmup_transitions, 1), self._update)
        if not self._version_due(len(segments)):
            return None
        return {"version": self.version, **self._summary()}

    def _update(self) -> dict:
        """One gradient step of the critics (and, past their warm-up, every `actor_every`-th step, of the actor
        and the entropy coefficient) on a replay mini-batch; the losses are core/losses.py's `sac_*`."""
        agent, cfg = self.agent, self.cfg
        b = self.replay.batch(self.replay.sample(cfg.batch_size, self.rng))
        alpha = self.log_alpha.exp().detach()
        shape = (len(b["reward"]), agent.spec.steps, agent.spec.action_dim)
        with torch.no_grad():
            next_base = b["next_base"].view(shape)
            delta, logp = agent.actor.sample(b["next_features"], b["next_state"], next_base, self.generator)
            x = agent.critic_input(b["next_features"], b["next_state"], b["next_privileged"], next_base + delta)
            y = sac_td_target(b["reward"], b["terminal"], *(q(x) for q in agent.targets), self.gamma,
                              logp if cfg.backup_entropy else None, alpha)
        x = agent.critic_input(b["features"], b["state"], b["privileged"], b["executed"])
        critic_loss, stats = sac_critic_loss(*(q(x) for q in agent.critics), y)
        _step(self.critic_opt, critic_loss)
        self.updates += 1
        if self.updates % cfg.actor_every == 0 and self.updates > cfg.critic_warmup_updates:
            base = b["base"].view(shape)
            delta, logp = agent.actor.sample(b["features"], b["state"], base, self.generator)
            x = agent.critic_input(b["features"], b["state"], b["privileged"], base + delta)
            mean = agent.actor.deterministic(b["features"], b["state"], base) / agent.spec.scale
            actor_loss, actor_stats = sac_actor_loss(logp, *(c(x) for c in agent.critics), alpha, mean, cfg.penalty)
            _step(self.actor_opt, actor_loss)
            _step(self.alpha_opt, sac_temperature_loss(self.log_alpha, logp, self.target_entropy))
            stats.update(actor_stats, residual_at_bound=(delta.abs() >= 0.95 * agent.spec.scale).float().mean().item(),
                         residual_abs=(delta.abs().mean() / agent.spec.scale).item())
        with torch.no_grad():
            for target, critic in zip(agent.targets.parameters(), agent.critics.parameters()):
                target.lerp_(critic, cfg.tau)
        return stats

    def _summary(self) -> dict:
        """This version's health: means of the updates' statistics, Q vs Monte Carlo return, buffer size."""
        # replay_usable: the transitions that can be sampled (successor known, or terminal): what the warm-up counts
        out = {"alpha": self.log_alpha.exp().item(), "updates": self.updates, "replay": len(self.replay),
               "replay_usable": self.replay.usable(), "updates_this_version": len(self._stats)}
        keys = {k for s in self._stats for k in s}
        out.update({k: float(np.mean([s[k] for s in self._stats if k in s])) for k in sorted(keys)})
        self._stats = []
        n = len(self.replay)
        recent = np.arange(max(0, n - 2000), n) if self.replay.added <= self.replay.capacity else \
            (self.replay.added - 1 - np.arange(min(n, 2000))) % self.replay.capacity
        recent = recent[np.isfinite(self.replay.mc[recent])]
        if len(recent):
            r = self.replay.data
            with torch.no_grad():
                x = self.agent.critic_input(*(torch.from_numpy(r[k][recent]) for k in
                                              ("features", "state", "privileged", "executed")))
                out["q_on_finished"] = self.agent.critics[0](x).mean().item()
            out["mc_return"] = float(self.replay.mc[recent].mean())
        return out

    # checkpoints -----------------------------------------------------------------------------------
    def weights(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().clone() for k, v in self.agent.actor.state_dict().items()}

    def state_dict(self) -> dict:
        arrays, rest = self.replay.state_dict()
        return {"model": {k: v.detach().clone() for k, v in self.agent.state_dict().items()},
                "optimizer": {"actor": self.actor_opt.state_dict(), "critic": self.critic_opt.state_dict(),
                              "alpha": self.alpha_opt.state_dict()},
                "log_alpha": self.log_alpha.detach().clone(), "version": self.version, "updates": self.updates,
                "in_step": self.in_step, "owed": self.owed, "replay": arrays, "replay_rest": rest,
                "rng": self.rng.bit_generator.state, "generator": self.generator.get_state(),
                "residual": self.agent.spec.to_json(), "algorithm": "residual_sac"}

    def load_state_dict(self, state: dict) -> None:
        if "model" in state:  # a checkpoint's weights came in with the folder (residual / critic.safetensors)
            self.agent.load_state_dict(state["model"])
        for opt, saved in ((self.actor_opt, state["optimizer"]["actor"]), (self.critic_opt, state["optimizer"]["critic"])):
            params = [p for g in opt.param_groups for p in g["params"]]
            moments = [saved["state"].get(i, {}).get("exp_avg") for i in range(len(params))]
            if len(saved["param_groups"][0]["params"]) != len(params) or any(
                    m is not None and m.shape != p.shape for m, p in zip(moments, params)):
                raise KilovlaError("the checkpoint's actor or critics have other shapes than learner.algo.sac makes now "
                                   "(hidden, depth, privileged): resume with the run's own settings")
            opt.load_state_dict(saved)
        self.alpha_opt.load_state_dict(state["optimizer"]["alpha"])
        with torch.no_grad():
            self.log_alpha.copy_(state["log_alpha"])
        self.version, self.updates, self.in_step, self.owed = (state[k] for k in ("version", "updates", "in_step", "owed"))
        self.replay.load_state_dict(state["replay"], state["replay_rest"])
        self.rng.bit_generator.state = state["rng"]
        self.generator.set_state(state["generator"])


# -- the algorithm -------------------------------------------------------------------------------------
class ResidualSAC(Algorithm):
    """Off-policy SAC of a bounded residual over the frozen VLA (`SACLearner` above, `learner.algo.sac`)."""

    name = "residual_sac"
    trains_residual = True
    checkpoint_files = ("residual.safetensors", "critic.safetensors")

    def check_config(self, cfg: RunConfig) -> None:
        sac = cfg.learner.algo.sac
        check_one_learner(cfg)
        # a buffer that could overwrite a step before its successor arrives (one round of every env) or never
        # reach the warm-up would link wrong transitions or never update
        least = max(sac.batch_size, sac.warmup_transitions,
                    4 * cfg.env.workers * cfg.env.envs_per_worker * cfg.rollout.segment_steps)
        gamma = cfg.learner.algo.gamma
        for name, value, ok in (("res_scale", sac.res_scale, sac.res_scale > 0), ("init_std", sac.init_std, sac.init_std > 0),
                                ("utd", sac.utd, sac.utd >= 0), ("batch_size", sac.batch_size, sac.batch_size >= 1),
                                ("replay_size", sac.replay_size, sac.replay_size >= least),
                                ("actor_lr", sac.actor_lr, sac.actor_lr >= 0), ("critic_lr", sac.critic_lr, sac.critic_lr >= 0),
                                ("alpha_lr", sac.alpha_lr, sac.alpha_lr >= 0), ("hidden", sac.hidden, sac.hidden >= 1),
                                ("depth", sac.depth, sac.depth >= 1), ("gamma", gamma, 0 < gamma <= 1),
                                ("target_entropy", sac.target_entropy if sac.target_entropy is not None else 0.0, True),
                                ("tau", sac.tau, 0 < sac.tau <= 1), ("penalty", sac.penalty, sac.penalty >= 0),
                                ("init_alpha", sac.init_alpha, sac.init_alpha > 0),
                                ("actor_every", sac.actor_every, sac.actor_every >= 1),
                                ("critic_warmup_updates", sac.critic_warmup_updates, sac.critic_warmup_updates >= 0)):
            if not ok or not math.isfinite(value):
                where = "learner.algo.gamma" if name == "gamma" else f"learner.algo.sac.{name}"
                hint = f" (at least {least}: batch, warm-up and 4 rounds of every env)" if name == "replay_size" else ""
                raise KilovlaError(f"{where} = {value} is out of range{hint}")

    def fit_start(self, cfg: Run, source: PolicyFolder, n_action_steps: int, folder: Path | None,
                  state: dict) -> Run:
        """A residual folder's actor (not the VLA) is loaded here, before Ray, so a missing or mismatched file is
        one line; the run then trains that residual as it was made (`with_saved_residual`)."""
        if not source.meta.residual:
            return cfg
        spec = source.residual_actor().spec
        spec.check_steps(n_action_steps, str(source.path), training=True)
        if folder is None and not (source.path / "critic.safetensors").is_file():
            log.warning("%s/critic.safetensors: missing; the residual trains on with fresh critics", source.path)
        return with_saved_residual(cfg, spec, str(source.path))

    def check_resume(self, cfg: RunConfig, folder: Path, learner_state: dict) -> None:
        """Nothing is rebuilt on resume: the actor, its critics and their targets come from the checkpoint files."""
        from kilovla.models.checkpoints import read_safetensors

        check_saved_replay(folder, learner_state, self.name)
        for name in self.checkpoint_files:
            if not (folder / name).is_file():
                raise KilovlaError(f"{folder / name}: missing; a residual_sac run resumes with its actor, critics and "
                                   f"targets (start a new run_dir with --policy.path={folder} for fresh critics)")
            read_safetensors(folder / name)  # a damaged file is named here, before Ray starts
        check_replay_capacity(folder, learner_state, "learner.algo.sac.replay_size", cfg.learner.algo.sac.replay_size)

    def warmup(self, algo) -> tuple[str, int]:
        return "learner.algo.sac.warmup_transitions", algo.sac.warmup_transitions

    def load_agent(self, policy_dir: str, algo, sde, n_action_steps: int, privileged: tuple) -> ResidualAgent:
        return load_residual_agent(policy_dir, n_action_steps or 1, algo.sac, privileged)

    def learner(self, model: ResidualAgent, run: LearnerRun, world) -> SACLearner:
        return SACLearner(model, run.algo.gamma, run.algo.sac, run.segments_per_step, run.seed)


def with_saved_residual(cfg: Run, saved: ResidualSpec, policy_dir: str) -> Run:
    """A run from an RL folder (or resuming one) trains the folder's residual (`saved`, as loaded) as it was
    made: its bound, widths and std replace the config's (one warning where they differ), so config.yaml
    records what the run uses."""
    sac = cfg.learner.algo.sac
    kept = {"res_scale": saved.scale, "init_std": saved.init_std, "hidden": saved.hidden, "depth": saved.depth,
            "shared": saved.shared}
    changed = {k: v for k, v in kept.items() if getattr(sac, k) != v}
    if not changed:
        return cfg
    log.warning("%s: its residual was made with %s; those replace the config's (%s)", policy_dir,
                ", ".join(f"{k}={v}" for k, v in changed.items()),
                ", ".join(f"{k}={getattr(sac, k)}" for k in changed))
    algo = dataclasses.replace(cfg.learner.algo, sac=dataclasses.replace(sac, **changed))
    return dataclasses.replace(cfg, learner=dataclasses.replace(cfg.learner, algo=algo))
