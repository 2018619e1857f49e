"""Success-filtered self-imitation (`learner.algo.name=filtered_bc`): the VLA trains on its own successes.

The policy acts as PPO's does (the inference server samples chunks with the Flow-SDE: the ODE from
fresh noise plus the rollout's small SDE noise), so its rollouts spread around its deterministic
behaviour. The learner holds each env's running episode until it ends; an episode that succeeded
goes into a replay ring of chunk steps (observation + the normalised chunk it executed), a failed or
time-limited one is dropped. From that ring the learner trains the VLA's own flow-matching loss on
the executed part of each chunk, `utd` training rows per chunk step the envs deliver (any outcome),
in mini-batches of `batch_size`, while rollouts continue (async): each success is reused many times
and staleness does not matter (a success is a success whichever version played it).

This is reward-weighted regression with binary weights, iterated (Peters and Schaal's RWR; "Filtered
BC" in ResFiT, RL-100's second stage): the policy moves toward the behaviour that earns the reward,
with no critic whose noise could tilt it (the AWR attempt of docs/rl_finetune.md), and its supervised
loss keeps it a flow policy; the demonstrations it started from are not needed.

- Episodes are stitched across segments of one env only where the next segment starts at the state the
  previous one ended in (checked as residual SAC does); a gap (a crashed worker, a dropped sync round)
  drops that env's partial episode, never splices two.
- A policy version (what the inference server acts with) is every `segments_per_step` segments.
- Health per version (metrics.jsonl `learner/*`): successful episodes and chunk steps stored, replay
  size, updates, the flow-matching loss, how many times an average stored row has been trained on.
- Checkpoints: the VLA as model.safetensors (eval, serve, quantize load it as any policy), the replay
  ring as replay.safetensors, optimizer and RNG state in learner.pt: a resumed run continues exactly.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from kilovla.errors import KilovlaError
from kilovla.rl.algorithm import Algorithm, LearnerRun, RunConfig
from kilovla.rl.core import trajectory
from kilovla.rl.core.flow import flow_draws, flow_matching_error
from kilovla.rl.policy import ActorCritic, load_actor_critic
from kilovla.rl.offpolicy import (OffPolicySchedule, check_one_learner, check_replay_capacity, check_saved_replay,
                                 forget_replaced, state_key)
from kilovla.train.build import apply_freeze
from kilovla.train.optim import OptimConfig, build_optimizer

log = logging.getLogger(__name__)


@dataclass
class FilteredBCConfig:
    # successful chunk steps kept (oldest out first): raw frames, ~6.3 KB a step at 32 px with two cameras
    # (~130 MB, in memory and in every kept checkpoint), 49x that at 224 px
    replay_size: int = 20_000
    batch_size: int = 32  # rows per gradient step
    utd: float = 2.0  # training rows per chunk step delivered by the envs (update-to-data ratio)
    warmup: int = 256  # successful chunk steps stored before the first update


class SuccessReplay:
    """A ring of chunk steps from successful episodes: observation arrays (the task text as an index into
    `tasks`) and the normalised executed chunk. Running episodes wait per env slot in `pending`."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.arrays: dict[str, np.ndarray] = {}  # allocated from the first row's shapes
        self.tasks: list[str] = []
        self.added = 0
        self.pending: dict[tuple, dict] = {}  # env slot -> {"rows": [(obs row, chunk)], "expects": state key}
        self.episodes = {"succeeded": 0, "failed": 0}

    def __len__(self) -> int:
        return min(self.added, self.capacity)

    def add_segment(self, segment: trajectory.Segment, chunks: np.ndarray) -> int:
        """Hold a segment's steps with its env's running episode; returns the chunk steps that went into the
        ring (the episodes that succeeded in it). `chunks` (T, H, A): the normalised chunk of each step."""
        slot = tuple(segment.segment_id[:3])
        forget_replaced(self.pending, slot)
        waiting = self.pending.pop(slot, None)
        first = state_key(trajectory.index(segment.obs, [0]))
        rows = waiting["rows"] if waiting is not None and np.array_equal(waiting["expects"], first) else []
        outcomes = iter(segment.episodes)
        stored = 0
        for t in range(len(segment)):
            rows.append((trajectory.index(segment.obs, [t]), chunks[t]))
            if segment.done[t]:
                episode = next(outcomes, None)
                if episode is not None and episode.success:
                    for obs, chunk in rows:
                        self._put(obs, chunk)
                    stored += len(rows)
                    self.episodes["succeeded"] += 1
                else:
                    self.episodes["failed"] += 1
                rows = []
        if rows:
            self.pending[slot] = {"rows": rows, "expects": state_key(segment.next_obs, single=True)}
        return stored

    def _put(self, obs: dict, chunk: np.ndarray) -> None:
        if not self.arrays:
            for k, v in obs.items():
                if not isinstance(v, list):
                    self.arrays[k] = np.zeros((self.capacity, *np.shape(v)[1:]), np.asarray(v).dtype)
            self.arrays["task"] = np.zeros(self.capacity, np.int32)
            self.arrays["chunk"] = np.zeros((self.capacity, *chunk.shape), np.float32)
        i = self.added % self.capacity
        self.added += 1
        for k, v in obs.items():
            if isinstance(v, list):
                if v[0] not in self.tasks:
                    self.tasks.append(v[0])
                self.arrays["task"][i] = self.tasks.index(v[0])
            else:
                self.arrays[k][i] = v[0]
        self.arrays["chunk"][i] = chunk

    def batch(self, idx: np.ndarray) -> tuple[dict, torch.Tensor]:
        """(stacked observations as the envs send them, normalised chunks (B, H, A))."""
        obs = {k: v[idx] for k, v in self.arrays.items() if k not in ("task", "chunk")}
        obs["task"] = [self.tasks[j] for j in self.arrays["task"][idx]]
        return obs, torch.from_numpy(self.arrays["chunk"][idx])  # fancy indexing: copies

    def state_dict(self) -> tuple[dict[str, torch.Tensor], dict]:
        """(arrays for replay.safetensors, the small rest for learner.pt)."""
        n = len(self)
        arrays = {k: torch.from_numpy(v[:n].copy()) for k, v in self.arrays.items()}
        pending = [[list(slot), [[{k: v if isinstance(v, list) else torch.from_numpy(np.array(v)) for k, v in obs.items()},
                                  torch.from_numpy(chunk.copy())] for obs, chunk in p["rows"]], torch.from_numpy(p["expects"].copy())]
                   for slot, p in self.pending.items()]
        return arrays, {"added": self.added, "capacity": self.capacity, "tasks": list(self.tasks), "episodes": dict(self.episodes), "pending": pending}

    def load_state_dict(self, arrays: dict[str, torch.Tensor], rest: dict) -> None:
        n = len(arrays["chunk"]) if arrays else 0
        if n > self.capacity:
            raise KilovlaError(f"the saved replay holds {n} chunk steps, more than learner.algo.filtered_bc.replay_size "
                               f"{self.capacity}: resume with the run's own setting")
        self.arrays = {}
        for k, v in arrays.items():
            self.arrays[k] = np.zeros((self.capacity, *v.shape[1:]), v.numpy().dtype)
            self.arrays[k][:n] = v.numpy()
        self.added, self.tasks, self.episodes = int(rest["added"]), list(rest["tasks"]), dict(rest["episodes"])
        self.pending = {tuple(slot): {"rows": [({k: v if isinstance(v, list) else v.numpy() for k, v in obs.items()},
                                                chunk.numpy()) for obs, chunk in rows], "expects": expects.numpy()}
                        for slot, rows, expects in rest["pending"]}


class FilteredBCLearner(OffPolicySchedule):
    """Segments in, flow-matching steps on the success replay, a policy version every `segments_per_step` segments."""

    def __init__(self, model: ActorCritic, cfg: FilteredBCConfig, optim: OptimConfig, segments_per_step: int,
                 total_steps: int, freeze_vision: bool, freeze_vlm: bool, seed: int = 0):
        self.model, self.cfg, self.segments_per_step = model, cfg, segments_per_step
        apply_freeze(model.vla, freeze_vision=freeze_vision, freeze_vlm=freeze_vlm)
        model.value_head.requires_grad_(False)  # kept (a PPO run can start from this folder) but not trained
        self.trainable, self.optimizer, self.scheduler = build_optimizer(model, optim, total_steps)
        self.clip = optim.clip_grad_norm
        self.replay = SuccessReplay(cfg.replay_size)
        self.version = self.updates = self.in_step = 0
        self.owed, self.trained_rows = 0.0, 0
        self.rng = np.random.default_rng(seed)
        self._stats: list[dict] = []
        self._stored = 0

    def consume(self, segments: list[trajectory.Segment]) -> dict | None:
        for s in segments:
            self._stored += self.replay.add_segment(s, s.chain[:, -1])
        self._pay(self.cfg.utd * sum(len(s) for s in segments) / self.cfg.batch_size,
                  len(self.replay) >= max(self.cfg.warmup, 1), self._update)
        if not self._version_due(len(segments)):
            return None
        if self.updates:  # the learning-rate schedule counts policy versions that trained, as PPO's steps
            self.scheduler.step()
        return {"version": self.version, **self._summary()}

    def _update(self) -> dict:
        idx = self.rng.integers(0, len(self.replay), self.cfg.batch_size)
        obs, chunks = self.replay.batch(idx)
        model = self.model
        field, _ = model.vla.velocity_field(model.batch(obs))
        actions = chunks.to(model.executed.device) * (model.executed[0] > 0)  # the dims past the env's are zero, as in supervised batches
        seeds = torch.from_numpy(self.rng.integers(0, 2 ** 31, len(idx)))
        t, noise = flow_draws(seeds, actions.shape[1:], actions.device, actions.dtype)
        loss = flow_matching_error(field, actions, model.executed, t, noise).mean()
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = float(torch.nn.utils.clip_grad_norm_(self.trainable, self.clip if self.clip > 0 else float("inf")))
        self.optimizer.step()
        self.updates += 1
        self.trained_rows += len(idx)
        return {"flow_loss": loss.item(), "grad_norm": grad_norm}

    def _summary(self) -> dict:
        out = {"updates": self.updates, "replay": len(self.replay), "stored_this_version": self._stored,
               "updates_this_version": len(self._stats), "lr": self.scheduler.get_last_lr()[0],
               "episodes_succeeded": self.replay.episodes["succeeded"], "episodes_failed": self.replay.episodes["failed"],
               "reuse": self.trained_rows / max(1, self.replay.added)}
        keys = {k for s in self._stats for k in s}
        out.update({k: float(np.mean([s[k] for s in self._stats])) for k in sorted(keys)})
        self._stats, self._stored = [], 0
        return out

    # checkpoints -----------------------------------------------------------------------------------
    def weights(self) -> dict[str, torch.Tensor]:
        """CPU copies of the acting weights (the VLA and the untrained value head) for the inference servers."""
        return {k: v.detach().cpu().clone() for k, v in self.model.state_dict().items()}

    def state_dict(self) -> dict:
        arrays, rest = self.replay.state_dict()
        return {"model": self.weights(), "optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict(),
                "version": self.version, "updates": self.updates, "in_step": self.in_step, "owed": self.owed,
                "trained_rows": self.trained_rows, "replay": arrays, "replay_rest": rest,
                "rng": self.rng.bit_generator.state, "algorithm": "filtered_bc"}

    def load_state_dict(self, state: dict) -> None:
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.version, self.updates, self.in_step, self.owed, self.trained_rows = (
            state[k] for k in ("version", "updates", "in_step", "owed", "trained_rows"))
        self.replay.load_state_dict(state["replay"], state["replay_rest"])
        self.rng.bit_generator.state = state["rng"]


class FilteredBC(Algorithm):
    """Success-filtered self-imitation of the VLA (`FilteredBCLearner` above, `learner.algo.filtered_bc`); it acts
    as PPO does, with Flow-SDE chains, and trains with `learner.algo.optim` and its freeze flags."""

    name = "filtered_bc"
    checkpoint_files = ("model.safetensors", "value_head.safetensors")

    def check_config(self, cfg: RunConfig) -> None:
        check_one_learner(cfg)
        algo, bc = cfg.learner.algo, cfg.learner.algo.filtered_bc
        o = algo.optim
        for name, value, ok in (("lr", o.lr, o.lr >= 0), ("weight_decay", o.weight_decay, o.weight_decay >= 0),
                                ("clip_grad_norm", o.clip_grad_norm, True),
                                ("warmup_steps", o.warmup_steps, o.warmup_steps >= 0),
                                ("min_lr_ratio", o.min_lr_ratio, 0 <= o.min_lr_ratio <= 1),
                                *((f"betas[{i}]", b, 0 <= b < 1) for i, b in enumerate(o.betas))):
            if not ok or not math.isfinite(value):
                raise KilovlaError(f"learner.algo.optim.{name} = {value} is out of range")
        if algo.kl_coef > 0 or algo.policy_loss != "ppo":
            log.warning("learner.algo.kl_coef and policy_loss belong to ppo: filtered_bc ignores them")
        for name, value, ok in (("batch_size", bc.batch_size, bc.batch_size >= 1), ("utd", bc.utd, bc.utd > 0),
                                ("warmup", bc.warmup, bc.warmup >= 0),
                                ("replay_size", bc.replay_size, bc.replay_size >= max(bc.batch_size, bc.warmup, 1))):
            if not ok or not math.isfinite(value):
                hint = " (at least batch_size and warmup)" if name == "replay_size" else ""
                raise KilovlaError(f"learner.algo.filtered_bc.{name} = {value} is out of range{hint}")

    def check_resume(self, cfg: RunConfig, folder: Path, learner_state: dict) -> None:
        check_saved_replay(folder, learner_state, self.name)
        check_replay_capacity(folder, learner_state, "learner.algo.filtered_bc.replay_size",
                              cfg.learner.algo.filtered_bc.replay_size)

    def warmup(self, algo) -> tuple[str, int]:
        """Its replay keeps only the steps of successful episodes."""
        return "learner.algo.filtered_bc.warmup", algo.filtered_bc.warmup

    def load_agent(self, policy_dir: str, algo, sde, n_action_steps: int, privileged: tuple) -> ActorCritic:
        return load_actor_critic(policy_dir, sde, n_action_steps)

    def learner(self, model: ActorCritic, run: LearnerRun, world) -> FilteredBCLearner:
        a = run.algo
        return FilteredBCLearner(model, a.filtered_bc, a.optim, run.segments_per_step, run.total_steps,
                                 a.freeze_vision, a.freeze_vlm, run.seed)
